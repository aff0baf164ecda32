"""A process that has imported torch and actorgrad once and forks local_group's workers.

# Why
Importing torch takes seconds (2.3 s on a slow 2-core machine), and a new worker
process spends most of its start doing it. ``local_group`` starts a fork server the
first time it runs: ``python -m actorgrad.testing._serve --fork-server`` imports every
layer a worker loads (as ``init_rpc`` would), then forks a worker per request, so every
later group starts in a fraction of a second. A notebook that starts groups again and
again, or a test suite with a process group per test, waits for the import once.

# What a forked worker sees
What a worker started by ``subprocess`` would: the environment and working directory
that ``local_group`` gives it (replaced in full in the child), its own session
(``killpg`` ends it and what it started), stdin from /dev/null, stdout and stderr into
its log, random states of its own (Python reseeds its generator at a fork, torch's is
reseeded here; the server imports no numpy.random, whose global state a fork would
copy). One thing it shares with the server: the seed of str hashes, fixed when an
interpreter starts (set iteration orders are the same in every forked worker).
What the server imported at its start was imported under its environment and working
directory; a group asked for under another environment or directory (an environment
variable read at import time, another ``PYTHONPATH``) gets a server of its own, and the
old one ends once its workers have.

# Protocol (text lines; the server's stdin and stdout)
request  ``{"id": N, "argv": [...] (after the program's name), "env": {...}, "cwd": "...", "log": "..."}``
replies  ``started N PID``, ``failed N MESSAGE``,
         ``exited N RETURNCODE`` (as ``Popen.returncode``: -signal for a signal).
(Exits are told by request, not by pid: pids wrap around, and a later worker may get
the pid of one that ended.)
The server reaps its children and reports each exit; at the end of its stdin (its
parent closed it or died) it takes no more requests and exits when its children have.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, NoReturn

#: Setting this to "0" makes local_group start each worker as a new interpreter.
DISABLE_ENV = "ACTORGRAD_FORK_SERVER"


def supported(env: dict[str, str]) -> bool:
    """Whether workers started with environment ``env`` come from a fork server."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and env.get(DISABLE_ENV, "1") != "0"


# --------------------------------------------------------------------- the server side


def serve_forever() -> dict[str, Any]:
    """Run the server until its stdin ends. Returns (in a forked child only) the request
    the child is to carry out; the server itself leaves through SystemExit."""
    from .._api import load_layers

    parent = os.getppid()  # (before the imports: a parent may die during them)
    load_layers()  # every layer a worker loads in init_rpc, and torch with them
    gc.freeze()  # the collector of a child leaves these alone: their pages stay shared
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (its wake-up byte is what counts)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its parent decides when it ends

    def say(line: str) -> None:
        with contextlib.suppress(OSError):  # a parent gone: nobody to tell
            os.write(1, (line + "\n").encode())

    children: dict[int, int] = {}  # pid -> request id
    pending = b""
    open_stdin = True
    while open_stdin or children:
        readable, _, _ = select.select([0, wake_r] if open_stdin else [wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                ident = children.pop(pid, None)
                if ident is not None:
                    say(f"exited {ident} {os.waitstatus_to_exitcode(status)}")
        if 0 in readable:
            data = os.read(0, 65536)
            if not data:
                open_stdin = False
                continue
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                if os.getppid() != parent:  # its parent died: the request's group is gone
                    say(f"failed {request['id']} the program that asked for it has ended")
                    continue
                try:
                    pid = _fork(request)
                except OSError as exc:
                    say(f"failed {request['id']} {exc}")
                    continue
                if pid == 0:  # the child: leave the server's loop and run the worker
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    os.close(wake_r)
                    os.close(wake_w)
                    return request
                children[pid] = request["id"]
                say(f"started {request['id']} {pid}")
    raise SystemExit(0)


def _fork(request: dict[str, Any]) -> int:
    """Fork a child for ``request``; in the server, return once the child has its own
    session (a killpg right after ``started`` must reach it)."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ready_r, ready_w = os.pipe()
    try:
        with warnings.catch_warnings():
            # (Python 3.12+ warns of forking a process with threads: numpy's BLAS pool,
            # which is made to survive a fork, as torch's DataLoader workers rely on)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        for fd in (log, ready_r, ready_w):
            os.close(fd)
        raise
    if pid == 0:
        os.close(ready_r)
        os.setsid()
        os.close(ready_w)  # the server's read returns: the session exists
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        return 0
    os.close(log)
    os.close(ready_w)
    os.read(ready_r, 1)  # end of file once the child has closed its end
    os.close(ready_r)
    return pid


def become(request: dict[str, Any]) -> None:
    """In a forked child: take the environment, directory and arguments the worker
    would have been started with."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv[1:] = request["argv"]  # (argv[0] is _serve's path already, as when started)
    import torch

    torch.seed()  # as a new interpreter's import seeds it, at random


def exit_at_once() -> NoReturn:
    """End a forked worker that finished well as the interpreter would (wait for its
    threads, run the executors' and the exit handlers, flush) but without its teardown:
    freeing the objects it shares with the server would copy their pages first, a
    quarter of a second per worker."""
    threading._shutdown()  # type: ignore[attr-defined]  # (what Py_Finalize calls first)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


# --------------------------------------------------------------------- the parent side


class ServerGone(Exception):
    """The server ended before it answered a request."""


class ForkedProcess:
    """A worker forked by the server: the part of ``subprocess.Popen`` that
    ``LocalGroup`` uses (the server reaps it and reports its exit status)."""

    def __init__(self, server: ForkServer, ident: int, pid: int) -> None:
        self._server = server
        self._ident = ident  # the request it was forked for
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._server.exit_status(self._ident, self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.changed:
            while (code := self.returncode) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(["forked worker", str(self.pid)], timeout or 0.0)
                self._server.changed.wait(0.1 if left is None else min(left, 0.1))
        return code


class ForkServer:
    """The parent's handle on one server process."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.key = _key(env, cwd)
        env = {k: v for k, v in env.items() if k not in _PER_GROUP}  # (each request brings its own)
        # its stderr: a file without a name, so that nothing is left behind however the
        # program ends; written out where the user can read it when the server fails
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "actorgrad.testing._serve", "--fork-server"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env={**env, "PYTHONUNBUFFERED": "1"},
            cwd=cwd, start_new_session=True,
        )
        self.changed = threading.Condition()
        self.ended = False  # its stdout closed: it exited (or died)
        self.started: dict[int, int | str] = {}  # request id -> pid, or why it failed
        self.exits: dict[int, int] = {}  # request id -> return code
        self._next_id = 0
        self._write = threading.Lock()
        threading.Thread(target=self._read, name="actorgrad-forkserver-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            word, _, rest = raw.decode().rstrip("\n").partition(" ")
            with self.changed:
                if word == "started":
                    ident, pid = rest.split()
                    self.started[int(ident)] = int(pid)
                elif word == "failed":
                    ident, _, why = rest.partition(" ")
                    self.started[int(ident)] = why
                elif word == "exited":
                    ident, code = rest.split()
                    self.exits[int(ident)] = int(code)
                self.changed.notify_all()
        self.process.stdout.close()  # (at its end: left to the collector, it warned at exit)
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def exit_status(self, ident: int, pid: int) -> int | None:
        """The return code of the worker forked for request ``ident`` (None: running)."""
        with self.changed:
            code = self.exits.get(ident)
            if code is None and self.ended:
                # the server died before it saw this worker end: ask the kernel
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    code = self.exits[ident] = -signal.SIGKILL  # gone; its status was the server's
                except PermissionError:
                    pass
            return code

    def request(self, argv: list[str], env: dict[str, str], log: str) -> int:
        """Ask for a worker; returns the request's id (see ``started``)."""
        assert self.process.stdin is not None
        with self._write:
            ident = self._next_id
            self._next_id += 1
            line = json.dumps({"id": ident, "argv": argv, "env": env, "cwd": os.getcwd(), "log": log})
            try:
                self.process.stdin.write(line.encode() + b"\n")
                self.process.stdin.flush()
            except OSError:  # it died (its reader may not have seen it yet)
                raise ServerGone from None
        return ident

    def failure(self) -> str:
        """Why the server ended before it started the workers asked for."""
        self.process.wait()
        return (f"the fork server that starts the workers exited with code {self.process.returncode} "
                f"before it started them; {self.log_tail()}")

    def log_tail(self) -> str:
        """The end of the server's log, and a file where the user finds all of it."""
        fd = self.log.fileno()  # (pread: the offset is shared with the server's writes)
        text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        if not text:
            return "its log is empty"
        fd, path = tempfile.mkstemp(prefix="actorgrad-forkserver-", suffix=".log")
        with os.fdopen(fd, "w") as kept:
            kept.write(text)
        tail = "\n".join(text.splitlines()[-15:])
        return f"the end of its log ({path}):\n{tail}"

    def retire(self) -> None:
        """Take no more requests: the server ends once its workers have."""
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()

    def close(self, timeout: float) -> None:
        self.retire()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


# variables that change between groups and that no import reads: those local_group sets
# for each group, pytest's name of the running test, and one torch sets once it used its
# compiler. (Any other change starts a new server: slower, never wrong.)
_PER_GROUP = ("ACTORGRAD_AUTH_KEY", "ACTORGRAD_LOCAL_GROUP_SYS_PATH", "ACTORGRAD_LOCAL_GROUP_OPTIONS",
              "ACTORGRAD_LOCAL_GROUP_MODULES", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST",
              "TORCHINDUCTOR_CACHE_DIR")


def _key(env: dict[str, str], cwd: str) -> tuple[Any, ...]:
    return (sys.executable, cwd, frozenset((k, v) for k, v in env.items() if k not in _PER_GROUP))


_server: ForkServer | None = None  # the one that takes requests
_retired: list[ForkServer] = []  # the ones replaced (they end after their workers)
_server_lock = threading.Lock()


def server_for(env: dict[str, str]) -> ForkServer:
    """The server whose imports were made under ``env`` and this directory (started or
    replaced here)."""
    global _server
    cwd = os.getcwd()
    with _server_lock:
        for ended in [old for old in _retired if old.ended]:
            _retired.remove(ended)
            ended.close(timeout=1.0)
        if _server is not None and (_server.key != _key(env, cwd) or _server.ended
                                    or _server.process.poll() is not None):  # (died since)
            _retire(_server)
        if _server is None:
            _server = ForkServer(env, cwd)
        return _server


def replace(server: ForkServer) -> None:
    """``server`` died (before its reader or ``server_for`` could see it): the next
    group gets a new one."""
    with _server_lock:
        _retire(server)


def _retire(server: ForkServer) -> None:
    """(Under the lock) ``server``, if it is the one taking requests, takes no more."""
    global _server
    if _server is server:
        server.retire()
        _retired.append(server)
        _server = None


def _every_server() -> list[ForkServer]:
    return [*_retired, *([_server] if _server is not None else [])]


def _forget_servers() -> None:
    """In a child forked from this process: the servers are its parent's (their reader
    threads did not come along); a group started there gets a server of its own. The
    ends of their pipes are closed here: a server sees its parent end by its stdin."""
    global _server, _server_lock
    for server in _every_server():
        for pipe in (server.process.stdin, server.process.stdout):
            if pipe is not None and not pipe.closed:  # (closed: retired, or read to its end)
                with contextlib.suppress(OSError):
                    os.close(pipe.fileno())
    _server, _retired[:], _server_lock = None, [], threading.Lock()


os.register_at_fork(after_in_child=_forget_servers)


@atexit.register
def _close_servers() -> None:
    """At exit (after local_group's own handler ended the groups left): the servers end
    once their workers have."""
    for server in _every_server():
        server.close(timeout=5.0)
