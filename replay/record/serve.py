"""`replay record`'s process: checks the options, starts the recorder child and the proxy, and
stops both in order on SIGTERM/SIGINT (no new requests; those in flight finish, up to
--drain-timeout; the recorder writes what it holds and closes the trace and its meta)."""

from __future__ import annotations

import argparse
import importlib.metadata
import signal
import socket
import sys
import time

import gevent
import orjson
from gevent import subprocess
from gevent.event import Event
from gevent.pool import Pool
from gevent.pywsgi import WSGIServer

from replay.errors import OptionError
from replay.protocol.ask import check_url
from replay.protocol.server_cache import ask_cache_config
from replay.protocol.urls import shown
from replay.record.hashing import read_salt
from replay.record.proxy import RECORDER_STOPPED, Forwarder, pump
from replay.record.recorder import CUT_EXIT
from replay.trace.fields import block_size_problem

DEFAULT_BLOCK_SIZE = 16  # when neither --block-size nor the upstream's /metrics says

READY_PREFIX = "replay record listening on "


class _Server(WSGIServer):
    """Each answer's chunk goes out when it is written: without TCP_NODELAY a streamed token
    written right after another waits for the client's (delayed) acknowledgement of the first,
    up to 40 ms on Linux, which the proxy would add to the TTFT it is there to leave alone."""

    def handle(self, sock, address):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return super().handle(sock, address)


class RecordError(ValueError):
    """Options or inputs refused before anything is forwarded (exit 2)."""


def _block_size(args: argparse.Namespace) -> tuple[int, str]:
    if args.block_size is not None:
        if problem := block_size_problem(args.block_size):
            raise RecordError(f"--block-size {args.block_size}: {problem}")
        return args.block_size, "--block-size"
    said = ask_cache_config(args.upstream) or {}
    if said.get("block_size"):
        return said["block_size"], "the upstream's /metrics"
    return DEFAULT_BLOCK_SIZE, "default (the upstream's /metrics did not say)"


def settings_of(args: argparse.Namespace) -> dict:
    try:
        check_url("--upstream", args.upstream)
        salt = read_salt(args.salt_file)
    except (OptionError, ValueError) as e:
        raise RecordError(str(e)) from None
    if args.tokenizer is not None:  # its files and template checked here; the recorder loads it
        from replay.synth.tokenizer import ServerTokenizer

        try:
            ServerTokenizer.load(args.tokenizer, args.chat_template, lazy=True)
        except (OSError, ValueError) as e:
            raise RecordError(f"--tokenizer {args.tokenizer}: {e}") from None
    block_size, block_source = _block_size(args)
    kept = ["arrival times", "input and output lengths", "salted hash ids", "sessions and turns", "model",
            "max_tokens", "ignore_eos", "status"]
    if args.keep_text:
        kept.append("prompt text (--keep-text)")
    if args.id_header:
        kept.append(f"the {args.id_header} header (--id-header)")
    meta = {"recorded_by": "replay record", "version": _version(), "upstream": shown(args.upstream),
            "started_at": time.time(), "format": "jsonl", "block_size": block_size, "block_size_source": block_source,
            "hash_ids": "salted (blake2b keyed), renumbered in order of first use",
            "salt": "from --salt-file" if args.salt_file else "random, never written", "kept": kept,
            "sessions": (f"header {args.session_header}, " if args.session_header else "")
            + ("the body's user field, " if args.session_user else "") + "message continuation"}
    return {"output": args.output, "upstream": args.upstream, "salt": salt.hex(), "block_size": block_size,
            "tokenizer": args.tokenizer, "chat_template": args.chat_template, "ask_server": True,
            "session_from": "name" if (args.session_header or args.session_user) else None,
            "session_user": args.session_user,
            "keep_text": args.keep_text, "raw_log": args.raw_log, "on_write_error": args.on_write_error, "meta": meta}


def _version() -> str:
    try:
        return importlib.metadata.version("tracereplay")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def serve(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    recorder = subprocess.Popen([sys.executable, "-m", "replay.record.recorder"], stdin=subprocess.PIPE)
    recorder.stdin.write(orjson.dumps(settings) + b"\n")
    recorder.stdin.flush()
    forwarder = Forwarder(args.upstream, session_header=args.session_header,
                          timeout_s=args.upstream_timeout, max_record_bytes=args.max_record_bytes,
                          id_header=args.id_header)
    try:
        server = _Server((args.host, args.port), forwarder, log=None, spawn=Pool())  # a pool: stop() waits for it
        server.start()
    except OSError as e:
        recorder.stdin.close()
        recorder.wait()
        raise RecordError(f"--host {args.host} --port {args.port}: {e.strerror or e}") from None
    stop = Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(sig, stop.set)
    pumping = gevent.spawn(pump, forwarder.exchanges, recorder.stdin, forwarder)
    recorder_ended = gevent.spawn(recorder.wait)
    recorder_ended.link(lambda _: stop.set())
    host, port = server.address[:2]
    print(f"{READY_PREFIX}http://{host}:{port} (forwarding to {shown(args.upstream)}, trace to {args.output})",
          flush=True)
    stop.wait()
    server.close()  # no new connections; the requests in flight go on to their answers' end
    deadline = time.monotonic() + args.drain_timeout
    while forwarder.active and time.monotonic() < deadline:
        gevent.sleep(0.02)
    server.stop(timeout=0)  # idle keep-alive connections, and what is left past --drain-timeout
    forwarder.exchanges.put(RECORDER_STOPPED)
    pumping.join()
    try:
        recorder.stdin.close()
    except OSError:
        pass
    code = recorder.wait()
    if code == CUT_EXIT:
        print("replay record: stopped: the trace could not be written (--on-write-error stop)", file=sys.stderr)
    elif code != 0:
        print(f"replay record: the recorder ended with exit code {code}: the trace may be incomplete "
              f"({args.output}.meta.json says)", file=sys.stderr)
    print(f"replay record: stopped; {forwarder.seq} requests recorded to {args.output}", file=sys.stderr, flush=True)
    return 0 if code == 0 else 1
