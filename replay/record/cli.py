"""`replay record --upstream URL --output TRACE`: the recording proxy (docs/record.md)."""

from __future__ import annotations

import argparse
import sys

from replay.bounds import BLOCK_SIZE, DAY_S, WEEK_S, Bound
from replay.output_claim import INPUT, Output
from replay.record.recorder import TRACE

ON_WRITE_ERROR = ("continue", "stop")
PORT = Bound(0, 65535, integer=True)
UPSTREAM_TIMEOUT_S = Bound(0.001, WEEK_S, unit="seconds")
DRAIN_TIMEOUT_S = Bound(0.0, DAY_S, unit="seconds")
RECORD_BYTES = Bound(1, 1 << 40, integer=True, unit="bytes")




def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "record",
        help="a proxy in front of an OpenAI-compatible server that records its traffic as a hash-id trace",
        description="Forward every request to --upstream unchanged and write a salted hash-id trace of the "
        "chat/completions requests that passed (docs/record.md). No prompt or answer text is written "
        "unless --keep-text.",
    )
    parser.add_argument("--upstream", required=True, metavar="URL",
                        help="the server (or router) to forward to: http://HOST:PORT (credentials in it: never shown)")
    parser.add_argument("--output", required=True, type=TRACE, help="the trace to write (JSONL); OUTPUT.meta.json beside it")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=PORT, default=8080, help="port to listen on (0: any free one; default 8080)")
    parser.add_argument("--block-size", type=BLOCK_SIZE, default=None,
                        help="tokens per hash id (default: the upstream's KV block size from its /metrics, else 16)")
    parser.add_argument("--salt-file", default=None, type=INPUT,
                        help="key the hash ids with this file's bytes (16-64), so that two recordings share ids; "
                        "default: a random salt, kept nowhere")
    parser.add_argument("--tokenizer", default=None, type=INPUT,
                        help="the served model's tokenizer, for an upstream without POST /tokenize")
    parser.add_argument("--chat-template", default=None, type=INPUT, help="the served chat template, with --tokenizer")
    parser.add_argument("--session-header", default=None, metavar="NAME",
                        help="a request header naming its session (it wins over message continuation)")
    parser.add_argument("--session-user", action="store_true",
                        help="the body's OpenAI `user` field names the session (it wins over message continuation)")
    parser.add_argument("--id-header", default=None, metavar="NAME",
                        help="keep this request header's value (a client's request id, e.g. X-Request-Id) in each "
                        "row, as client_request_id, to pair rows with the client's own records")
    parser.add_argument("--raw-log", default=None, metavar="FILE", type=Output("raw log"),
                        help="also write each request body and what was read of its answer (text included, mode "
                        "0600), for `replay trace anonymize` to make traces from later")
    parser.add_argument("--keep-text", action="store_true",
                        help="write each prompt (messages or text) into its row: for internal replays only")
    parser.add_argument("--on-write-error", choices=ON_WRITE_ERROR, default="continue",
                        help="when a line of the trace fails (a full disk): go on forwarding, unrecorded "
                        "(default), or stop the proxy")
    parser.add_argument("--upstream-timeout", type=UPSTREAM_TIMEOUT_S, default=3600.0,
                        help="seconds without a byte from the upstream before the request fails (default 3600)")
    parser.add_argument("--max-record-bytes", type=RECORD_BYTES, default=64 << 20,
                        help="a request or answer longer than this is forwarded but not read (its row marked)")
    parser.add_argument("--drain-timeout", type=DRAIN_TIMEOUT_S, default=30.0,
                        help="on SIGTERM/SIGINT, seconds to let requests in flight finish (default 30)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from replay.record.serve import RecordError, serve

    try:
        return serve(args)
    except RecordError as exc:
        print(f"replay record: {exc}", file=sys.stderr)
        return 2
