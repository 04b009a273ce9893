"""The recorder: a child process of `replay record` that turns exchanges into trace rows.

The proxy hands each finished exchange down a pipe and goes on forwarding; counting tokens
(the server's POST /tokenize, or the tokenizer), hashing and finding sessions happen here, in
another process, so no request waits for them. Rows are made and written in arrival order (a
request waits for those that arrived before it to end), each a whole line (replay/results/files.py:
a full disk cuts the trace at a whole line).

The pipe carries: one line, the recording's settings (JSON, the salt in hex); then per
exchange one JSON line (Exchange's fields, `request` and `response` as byte counts) followed
by those bytes. End of input: the proxy is done; the rows still held are written, the meta
says the trace is complete, and the process exits (1 if the trace was cut).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import BinaryIO

import orjson

from replay.errors import OutputError
from replay.output_claim import Output, open_regular
from replay.record.hashing import BlockHasher
from replay.record.rows import CHAT, Answer, Exchange, PromptTokens, RowMaker, api_of, read_answer
from replay.results.files import AppendFile, write_atomically
from replay.rules.run_files import meta_path, tmp_path

CUT_EXIT = 3  # the trace was cut (a write failed) and the settings say forwarding stops


def _tokenizer(settings: dict):
    if not settings.get("tokenizer"):
        return None
    from replay.synth.tokenizer import ServerTokenizer

    return ServerTokenizer.load(settings["tokenizer"], settings.get("chat_template"))


def _fingerprint(settings: dict, method: str | None) -> str | None:
    if method == "tokenizer" and settings.get("tokenizer"):
        from replay.synth.tokenizer import tokenizer_fingerprint

        return tokenizer_fingerprint(settings["tokenizer"], settings.get("chat_template"))
    return None


class Recorder:
    def __init__(self, settings: dict):
        self.settings = settings
        self.path = Path(settings["output"])
        self.meta = dict(settings["meta"])
        self.hasher = BlockHasher(bytes.fromhex(settings["salt"]), settings["block_size"])
        self.tokens = PromptTokens(settings["upstream"], _tokenizer(settings), ask_server=settings["ask_server"])
        self.rows = RowMaker(self.tokens, self.hasher, settings.get("session_from"), settings["keep_text"],
                             session_user=settings.get("session_user", False))
        self.file = AppendFile(self.path, fd=new_file(self.path))
        self.raw = AppendFile(settings["raw_log"], fd=new_file(settings["raw_log"], private=True)) \
            if settings.get("raw_log") else None
        self.held: dict[int, Exchange] = {}
        self.next_seq = 0
        self.written = 0
        self.failed = 0
        self.cut: str | None = None
        self.write_meta(complete=False)

    def add(self, exchange: Exchange) -> None:
        """Exchanges come as they end; each is made a row in arrival order, so that hash ids are
        numbered, and sessions found, as anonymize does from a log (a continuation always arrives
        after the turn it continues has ended, so that turn is always made first)."""
        self.held[exchange.seq] = exchange
        while self.next_seq in self.held:
            self._make(self.held.pop(self.next_seq))
            self.next_seq += 1

    def _make(self, exchange: Exchange) -> None:
        body, answer = read_exchange(exchange)
        row = self.rows.row_of(exchange, body, answer)
        if "error" in row:
            self.failed += 1
        raw = None if self.raw is None else raw_line(exchange, body, answer)
        self._write(orjson.dumps(row) + b"\n", raw)

    def _write(self, line: bytes, raw: bytes | None) -> None:
        if self.cut is not None:
            return
        try:
            if self.raw is not None and raw is not None:
                self.raw.append(raw)
            self.file.append(line)
            self.written += 1
        except OutputError as e:
            self.cut = str(e)
            print(f"replay record: the trace is cut after line {self.written}: {e}; "
                  f"{'forwarding stops' if self.settings['on_write_error'] == 'stop' else 'forwarding goes on, unrecorded'}",
                  file=sys.stderr, flush=True)
            if self.settings["on_write_error"] == "stop":
                self.meta["ended"] = "the trace could not be written: the proxy stops (--on-write-error stop)"
                self.close(None)
                sys.exit(CUT_EXIT)

    def close(self, numbered: int | None) -> None:
        """After the proxy's last exchange. `numbered`: the requests the proxy numbered, as it
        said goodbye; None: it died (SIGKILL) without, and what it had not handed over yet is
        lost. The meta says how many were lost, or that it cannot know."""
        lost = 0
        for seq in sorted(self.held):  # behind a gap: one the proxy never handed over
            lost += seq - self.next_seq
            self._make(self.held.pop(seq))
            self.next_seq = seq + 1
        if numbered is not None:
            lost += max(0, numbered - self.next_seq)
        self.meta["lost"] = lost if numbered is not None else None
        if numbered is None and "ended" not in self.meta:
            self.meta["ended"] = "the proxy ended without closing the recording (killed?): requests it had not " \
                                 "handed over are missing, how many is not known"
        self.file.close()
        if self.raw is not None:
            self.raw.close()
        self.write_meta(complete=self.cut is None and lost == 0 and numbered is not None)

    def write_meta(self, complete: bool) -> None:
        self.meta.update(rows=self.written, rows_marked_failed=self.failed, complete=complete, cut=self.cut,
                         tokens=self.tokens.method, tokenizer_fingerprint=_fingerprint(self.settings, self.tokens.method),
                         written_at=time.time())
        try:
            write_atomically(meta_path(self.path), orjson.dumps(self.meta, option=orjson.OPT_INDENT_2) + b"\n")
        except OutputError as e:
            print(f"replay record: {e}", file=sys.stderr, flush=True)


def new_file(path: str | Path, private: bool = False) -> int:
    """`path` opened empty for writing, only if it is a regular file or nothing (the claim's own
    check, against a node swapped in since: replay.output_claim.open_regular). `private`: the
    raw log, which holds prompts and answers, readable by its owner only."""
    try:
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        if private:
            os.fchmod(fd, 0o600)
    except OSError as e:
        raise OutputError(path, e) from None
    return fd


def read_exchange(x: Exchange) -> tuple[dict | None, Answer | None]:
    """The request's body (None: not a JSON object) and its answer read."""
    try:
        body = orjson.loads(x.request)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(body, dict):
        return None, None
    return body, read_answer(api_of(x.path) or CHAT, x.response, body.get("stream") is True)


def raw_line(x: Exchange, body: dict | None, answer: Answer | None) -> bytes:
    """One line of the raw log (`replay record --raw-log`, read by `replay trace anonymize`): the
    request as it came, what was read of the answer, and when; never a header but the session's
    and the request id's the recording was told to take."""
    return orjson.dumps({"arrival": x.arrival, "end": x.end, "path": x.path, "status": x.status, "error": x.error,
                         "session_name": x.session_name, "client_id": x.client_id, "request": body,
                         "answer": None if answer is None else dataclasses.asdict(answer)}) + b"\n"


def read_exchanges(pipe: BinaryIO, closed: dict | None = None):
    """The exchanges on the pipe; `closed` gets the proxy's goodbye ({"closed": the requests it
    numbered}) when it says one (none: it died)."""
    while True:
        head = pipe.readline()
        if not head:
            return
        fields = orjson.loads(head)
        if "closed" in fields:
            if closed is not None:
                closed.update(fields)
            continue
        request = pipe.read(fields.pop("request"))
        response = pipe.read(fields.pop("response"))
        yield Exchange(**fields, request=request, response=response)


def drain(pipe: BinaryIO) -> int:
    """Read the exchanges and keep none (the trace could not be opened; forwarding goes on)."""
    for _ in read_exchanges(pipe):
        pass
    return 1


def main() -> int:
    # The proxy ends this process by closing the pipe, after the last exchange; a Ctrl-C or a
    # SIGTERM sent to the whole process group must not cut the trace before that.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipe = sys.stdin.buffer
    settings = orjson.loads(pipe.readline())
    try:
        recorder = Recorder(settings)
    except OutputError as e:
        print(f"replay record: {e}: nothing is recorded", file=sys.stderr, flush=True)
        return CUT_EXIT if settings["on_write_error"] == "stop" else drain(pipe)
    closed: dict = {}
    for exchange in read_exchanges(pipe, closed):
        recorder.add(exchange)
    recorder.close(closed.get("closed"))
    return 1 if recorder.cut else 0


if __name__ == "__main__":
    sys.exit(main())


def trace_files(path: Path) -> list[Path]:
    """What `--output TRACE` writes: the trace (appended to, line by line) and TRACE.meta.json
    (written and renamed); TRACE.tmp too, which every output claims (replay.output_claim), so
    that no node in its place is left for a later writer to follow."""
    return [path, tmp_path(path), meta_path(path), tmp_path(meta_path(path))]


TRACE = Output("trace", files=trace_files)
