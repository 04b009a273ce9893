"""The master-worker protocol in one place: every replay message, which way it goes, what its
payload holds, and why it exists.

A message is a Locust custom message (replay.locust.link.RunnerLink, msgpack over ZeroMQ) or,
in one process, a call through transport.LocalLink. Its payload is a plain dict; the
TypedDicts below name its keys for the code that builds and reads it, and cost nothing at run
time (a TypedDict builds a plain dict). A key marked NotRequired may be absent: read it with
`.get`; every other key is always sent.

A run, in order:

    worker -> master  HELLO                 it can hear replay messages now
    master -> worker  PLAN                  its part of the run, sent only after its HELLO and
                                            resent until acked by PLAN_ACK
    master -> worker  ROWS ...              its rows, once the plan is acked; each acked by ROWS_ACK
    worker -> master  PING  <-> PONG        its clock's offset to the master's
    worker -> master  READY                 set up (or failed to)
    master -> worker  GO                    the shared start, resent until acked by GO_ACK
    worker -> master  RECORDS ...           outcomes; each chunk acked by RECORDS_ACK
    worker -> master  LIVE                  once a second, for the Replay view
    worker -> master  FAULT                 its own records file cannot be written: the master stops the run
    master -> worker  ROUND                 a capacity search's next round of rows, a probe cut short,
                                            or its end; resent until acked by ROUND_ACK
    master -> worker  ABORT                 the run ends before the worker did: record what is left
                                            (resent while its records are awaited)
    master -> worker  IDLE                  to a worker that joined after the start
    worker -> master  STOPPED               it got a stop signal: its own (its unrecorded rows fail), or,
                                            `shared` with the master's process group, maybe the
                                            master's too: the master decides, and says so by ABORT

PLAN, ROWS, GO and RECORDS go through transport.Window (numbered chunks, at most a few unacknowledged,
resent until acked), which sets each chunk's `seq`: their payloads extend `Chunk`, and their
builders leave `seq` to the window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

if TYPE_CHECKING:
    from replay.results.records import Record

# -- master -> worker -------------------------------------------------------------------------------

PLAN = "replay_plan"
ROWS = "replay_rows"
PONG = "replay_pong"
GO = "replay_go"
RECORDS_ACK = "replay_records_ack"
ABORT = "replay_abort"
IDLE = "replay_idle"
ROUND = "replay_round"

# -- worker -> master -------------------------------------------------------------------------------

HELLO = "replay_hello"
PLAN_ACK = "replay_plan_ack"
GO_ACK = "replay_go_ack"
ROWS_ACK = "replay_rows_ack"
PING = "replay_ping"
READY = "replay_ready"
RECORDS = "replay_records"
LIVE = "replay_live"
STOPPED = "replay_stopped"
FAULT = "replay_fault"
ROUND_ACK = "replay_round_ack"


class Chunk(TypedDict):
    """What transport.Window adds to each payload it carries."""

    seq: int  # the chunk's number: acked by it, resent until acked, applied once and in order


class Plan(Chunk):
    """PLAN: a worker's part of the run. All of it comes from the master, which alone has seen
    the options, the trace and the target host (a worker's own --host is not asked).
    Sent after the worker's HELLO (Locust acks a worker's connection before the worker has
    registered its replay messages: a plan sent then is dropped) and resent until PLAN_ACK."""

    worker: int  # its index: in its records and its file's name
    rows: int  # how many rows its part has (the ROWS still to come)
    origin: float  # trace time of the window's first row: every send is timed from it
    block_size: int | None  # tokens per hash id block, as the master read the trace
    output: str  # the merged file; the worker writes OUTPUT.worker-N.jsonl beside it
    run_id: str  # X-Request-Id: <run id>-<request_id>
    endpoints: list[str]  # the servers, resolved on the master
    options: dict[str, Any]  # ReplayOptions.to_dict()
    tokenizer_fingerprint: str | None  # the master's tokenizer: a worker with other files refuses to run; None: no check
    master_node: str  # the master's host name and process group: a worker in the same group got
    master_pgid: int  # a signal the master got too (a terminal's Ctrl-C, --processes), so it is not a stop of its own
    more: NotRequired[bool]  # a capacity search: more rounds of rows may follow `rows` (ROUND); absent: no


class Rows(Chunk):
    """ROWS: up to CHUNK_ROWS of a worker's rows, in send order, shipped only as far ahead as
    the worker asks (RowsAck.want), so its memory does not grow with its part."""

    rows: list[list]  # replay.engine.plan.encode_row's form


class Pong(TypedDict):
    """PONG: the master's clock, stamped as it answers a PING."""

    t0: float  # the worker's PING stamp, returned: the round trip is measured on one clock
    tm: float  # the master's time.time() when it answered


class Go(Chunk):
    """GO: the start every worker times its sends from. Sent once the worker is READY, and
    resent until GO_ACK: a worker without it would send nothing, and its rows would wait for
    the drain timeout."""

    epoch: float  # master clock (unix seconds) at which the window's first row is due


class Round(Chunk):
    """ROUND: a capacity search's news for a worker (docs/capacity.md): its part now has `rows`
    rows (the next probe's are shipped as ROWS), whether more may follow (the last ROUND says
    none: the worker ends once it has sent them), and, when a probe failed early, the row number
    below which it sends nothing more (its rows not yet sent are recorded as `skip_reason`)."""

    rows: int
    more: bool
    skip_to: NotRequired[int]
    skip_reason: NotRequired[str]


class RoundAck(TypedDict):
    """ROUND_ACK: the worker holds this ROUND (a resent one is acked again, applied once)."""

    seq: int


class RecordsAck(TypedDict):
    """RECORDS_ACK: the master holds this RECORDS chunk; the worker stops resending it."""

    seq: int


class Abort(TypedDict):
    """ABORT: the run is being stopped; the worker records every row not yet answered and
    ships those records at once."""

    reason: str  # the label those records get (replay.results.records)


class Idle(TypedDict):
    """IDLE: this worker joined after the start and gets no rows (the trace is split only among
    the workers present at the start)."""

    reason: str  # for the worker's log


class Hello(TypedDict):
    """HELLO: the worker's first word, sent once its handlers are registered, so an answer
    (IDLE) is not dropped as it would be at Locust's own connect."""


class PlanAck(TypedDict):
    """PLAN_ACK: the worker holds the plan (a resent one is acked again, applied once); the
    master starts shipping its rows."""

    seq: int


class GoAck(TypedDict):
    """GO_ACK: the worker has its start (a resent GO is acked again, applied once)."""

    seq: int


class Stopped(TypedDict):
    """STOPPED: this worker got a stop signal (SIGTERM, SIGINT, SIGHUP). Not `shared`: its own,
    not the master's stop: the rows it has not recorded are "worker stopped" (a failure), not
    "worker lost". `shared`: the worker is in the master's process group on its host, where a
    terminal's Ctrl-C reaches both at once: only the master knows whether it got the signal too
    (the user's stop: its ABORT says "run stopped"); if not, it is the worker's own stop, and the
    master's ABORT says "worker stopped"."""

    shared: NotRequired[bool]  # absent: False


class RowsAck(TypedDict):
    """ROWS_ACK: the worker holds a ROWS chunk, and takes rows up to `want`: its flow control."""

    seq: int | None  # the ROWS chunk now held; None: only asking for more rows
    want: int  # rows of its part it takes so far: transport.HOLD_ROWS past its sends


class Ping(TypedDict):
    """PING: a clock sample, answered at once by PONG."""

    t0: float  # the worker's time.time() as it sent


class Ready(TypedDict):
    """READY: the worker is set up and waits for GO, or it cannot replay (`error`), and the
    master records its rows as failed instead of waiting for it."""

    worker: int
    error: NotRequired[str]  # one line; absent when the worker is ready
    clock_offset_ms: NotRequired[float]  # master clock - worker clock; absent with an error
    rtt_ms: NotRequired[float]  # the round trip the offset was measured with; absent with an error


class Records(Chunk):
    """RECORDS: a batch of the worker's records (also written to its own file), for the master's
    merged file and live figures."""

    worker: int
    records: list[Record]  # replay.results.records' form


class Live(TypedDict):
    """LIVE: what only the worker knows about itself, once a second from the GO to the end of
    its part, for the master's Replay view (replay.engine.live)."""

    worker: int
    host: str  # its host name, for the view's worker table
    sent: int  # rows sent so far
    in_flight: int  # requests written but not yet answered
    failed: int  # rows failed so far


class Fault(TypedDict):
    """FAULT: the worker cannot write its own file (OUTPUT.worker-N.jsonl: a full disk); its
    records still come as RECORDS. The master stops the run and names the file as incomplete
    in the meta."""

    worker: int
    file: str  # the path, as the worker's host names it
    reason: str  # the system's reason, e.g. "No space left on device (errno 28)"
