"""`python -m support.zygote SOCKET` (tests/ on PYTHONPATH): `replay run` processes for the tests,
forked from one that has already imported Locust and the replay.

A `replay run` spends most of a test's short run importing Locust, gevent and the replay (about
0.45 s of CPU), and the suite starts hundreds, on two cores. This process imports them once; each
request (support.processes.spawn_locust) forks it into a process that becomes what
`python -m replay run ARGS` would have been: the requester's stdin, stdout, stderr, cwd,
environment, umask, CPU affinity, scheduling and resource limits, a fresh gevent loop, the
interpreter's own signal handlers, and the command's exit. The tests signal it by its own pid;
what only a process of its own shows (a new session, another environment, another command) is
started as one (support.processes).

Per request: the zygote forks a keeper, which forks the run and reports its pid, then its wait
status, on the request's connection. The keeper kills the run when the requester goes (its
connection closes); the run dies with its keeper (PR_SET_PDEATHSIG). The zygote ends with the
process that started it.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import socket
import struct
import sys
import tempfile

PR_SET_PDEATHSIG = 1
MAX_FDS = 3  # stdin, stdout, stderr
HEADER = struct.Struct("!I")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # on the zygote's path, not a run's
_ORIGINAL: dict = {}  # the standard library's functions as they were before Locust patched them


def _die_with_parent(sig: int) -> None:
    """`sig` to this process when its parent ends; ends now when the parent is already gone."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def send_request(sock: socket.socket, request: dict, fds: list[int]) -> None:
    """One request: its length, the JSON, and the three standard streams' fds beside it."""
    body = json.dumps(request).encode()
    socket.send_fds(sock, [HEADER.pack(len(body)) + body], fds)


def _receive_request(conn) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, MAX_FDS)
    (size,) = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise EOFError("the request ended early")
        body += more
    return json.loads(body), fds


def _requester_pid(conn) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _as_requester(pid: int) -> None:
    """The requesting process's CPU affinity, scheduling and resource limits, which a process it
    started itself would have inherited (the zygote has those it had when it started)."""
    os.sched_setaffinity(0, os.sched_getaffinity(pid))
    policy, param = os.sched_getscheduler(pid), os.sched_getparam(pid)
    if policy != os.sched_getscheduler(0):
        os.sched_setscheduler(0, policy, param)
    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, pid))
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                resource.setrlimit(getattr(resource, name), resource.prlimit(pid, getattr(resource, name)))
            except (OSError, ValueError):
                pass


def _become_the_run(request: dict, fds: list[int], requester: int) -> None:
    """In the forked run: the process `python -m replay run ARGS` would have been, then its exit."""
    import gevent

    _die_with_parent(signal.SIGKILL)
    gevent.reinit()  # the zygote's loop is shared with it: a loop of its own
    set_handler = _ORIGINAL["signal"]
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            set_handler(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    set_handler(signal.SIGINT, signal.default_int_handler)  # as the interpreter sets them at start
    set_handler(signal.SIGPIPE, signal.SIG_IGN)
    set_handler(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    _as_requester(requester)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read from the environment again (TMPDIR), as a new process would
    sys.path[:] = [request["cwd"], *(p for p in sys.path[1:] if p != TESTS)]  # as `-m` sets it
    import replay
    from replay.cli import main

    sys.argv = [os.path.join(os.path.dirname(replay.__file__), "__main__.py"), "run", *request["args"]]
    sys.exit(main(sys.argv[1:]))


def _keep(conn, request: dict, fds: list[int], requester: int) -> None:
    """The keeper: fork the run, report its pid and its wait status; kill it if the requester goes.
    It uses the standard library as it was before Locust patched it (gevent's versions would use
    the loop it shares with the zygote)."""
    set_handler, waitpid, wait_for = (_ORIGINAL[name] for name in ("signal", "waitpid", "select"))
    set_handler(signal.SIGCHLD, signal.SIG_DFL)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    pid = _ORIGINAL["fork"]()
    if pid == 0:
        conn.close()
        os.close(wake_r)
        os.close(wake_w)
        _become_the_run(request, fds, requester)
        return  # not reached: _become_the_run exits
    for fd in fds:
        os.close(fd)
    set_handler(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    while True:
        done, status = waitpid(pid, os.WNOHANG)
        if done:
            break
        readable, _, _ = wait_for([conn, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 512)
        if conn in readable and not conn.recv(64):  # the requester is gone: so is its run
            os.kill(pid, signal.SIGKILL)
            waitpid(pid, 0)
            os._exit(0)
    try:
        conn.sendall(json.dumps({"status": status}).encode() + b"\n")
    except OSError:
        pass
    os._exit(0)


def serve(path: str) -> None:
    import locust.main  # noqa: F401  first: importing Locust monkey-patches the standard library
    from gevent import monkey

    import replay.cli  # noqa: F401
    import replay.locust.cli  # noqa: F401
    import replay.locust.plugin  # noqa: F401
    import replay.run.finish  # noqa: F401

    _ORIGINAL.update(fork=monkey.get_original("os", "fork"), waitpid=monkey.get_original("os", "waitpid"),
                     select=monkey.get_original("select", "select"), signal=monkey.get_original("signal", "signal"))
    original_socket = monkey.get_original("socket", "socket")
    listener = original_socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    _ORIGINAL["signal"](signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    _die_with_parent(signal.SIGTERM)
    print("ready", flush=True)
    while True:
        fd, _ = listener._accept()  # not accept(): it wraps the connection in gevent's socket
        conn = original_socket(fileno=fd)
        try:
            request, fds = _receive_request(conn)
            requester = _requester_pid(conn)
        except (OSError, EOFError, ValueError) as e:
            print(f"zygote: a bad request ({e})", file=sys.stderr, flush=True)
            conn.close()
            continue
        if _ORIGINAL["fork"]() == 0:
            listener.close()
            _keep(conn, request, fds, requester)
            os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1])
