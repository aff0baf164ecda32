"""Groups of workers for tests and notebooks.

``start_in_process(n)`` runs ``n`` workers on the current event loop, talking over real
loopback sockets: fast to start, and every message still crosses the wire format.
``local_group(n)`` starts ``n - 1`` worker processes and joins the current loop as
``worker0`` (notebooks, and tests that kill a worker).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import contextvars
import dataclasses
import json
import numbers
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._api import init_rpc
from .._errors import RendezvousTimeout
from .._ports import pick_rendezvous_port
from ..runtime import RpcOptions, Worker, _current
from . import _forkserver
from ._echo import OutputEcho
from ._module_files import find_module_files, modules_off_the_path

#: a worker process of local_group: forked by the fork server, or started anew
WorkerProcess = subprocess.Popen[bytes] | _forkserver.ForkedProcess

T = TypeVar("T")
# how long a worker that worker0 declared lost (stopped, cut off) gets to exit at
# shutdown before it is killed: it cannot hear that worker0 left
_LOST_GRACE = 2.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, outside the range the kernel hands to
    the workers' own listeners (so a rendezvous on it does not race them)."""
    return pick_rendezvous_port(host)


async def follow_leader(worker: Worker, leader_alive: Callable[[], bool] = lambda: True) -> None:
    """Serve until worker0 starts its shutdown (or is gone), then shut ``worker`` down
    with the group: ``await ag.shutdown()`` on worker0 ends the whole group, as it does
    in torch when every worker calls it. ``leader_alive`` is polled every second."""
    while 0 in worker.peers and 0 not in worker._done_from and not worker.shutting_down:
        worker._done_changed.clear()
        try:
            async with asyncio.timeout(1.0):  # (not wait_for: see Worker._wait_done)
                await worker._done_changed.wait()
        except TimeoutError:
            if not leader_alive():
                break
    if not worker.shutting_down and not worker.closed:
        await worker.shutdown(graceful=0 in worker.peers)
    # a shutdown the worker started itself (ag.shutdown() in a remote function) runs
    # on: the process must not end before it does
    while not worker.closed and leader_alive():  # noqa: ASYNC110 - bounded by that shutdown
        await asyncio.sleep(0.05)


class InProcessGroup:
    """``n`` workers on this event loop; the calling code acts as ``workers[0]``."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.followers: list[asyncio.Task[None]] = []  # workers 1.. leave when worker0 does

    def run_as(self, rank: int, fn: Callable[..., Awaitable[T]], *args: Any) -> asyncio.Task[T]:
        """Run ``fn(*args)`` as worker ``rank`` (in that worker's context)."""
        worker = self.workers[rank]
        ctx = worker._context.copy()
        return worker.loop.create_task(_call(fn, args), context=ctx)

    async def shutdown(self, graceful: bool = True) -> None:
        await asyncio.gather(
            # (not w.shutting_down: a shutdown that was cancelled or failed left a worker
            # that says so and is still open)
            *(self.run_as(w.rank, _shutdown_one, w, graceful) for w in self.workers if not w.closed),
            *self.followers,
            return_exceptions=True,
        )
        _forget(self.workers)


def _forget(workers: list[Worker]) -> None:
    """After a group's shutdown: this context and the process default no longer point
    at its workers (a group started next would keep them alive through its context)."""
    if _current.default() in (None, *workers):
        _current.set_default(None)
    if _current.current_worker.get() in workers:
        _current.current_worker.set(None)


async def _call(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    return await fn(*args)


async def _shutdown_one(worker: Worker, graceful: bool) -> None:
    await worker.shutdown(graceful=graceful, timeout=10.0)


async def start_in_process(world_size: int = 2, options: RpcOptions | None = None) -> InProcessGroup:
    """Start ``world_size`` workers named ``worker0``.. on the running loop."""
    port = free_port()
    loop = asyncio.get_running_loop()
    options = options or RpcOptions()
    if options.auth_key is None and not os.environ.get("ACTORGRAD_AUTH_KEY"):
        # a key of the group's own: no other process on the host can join it
        options = dataclasses.replace(options, auth_key=os.urandom(16).hex())
    contexts = [contextvars.copy_context() for _ in range(world_size)]
    for ctx in contexts:  # a worker of an earlier group must not live on in these
        ctx.run(_current.current_worker.set, None)
    tasks = [
        loop.create_task(
            init_rpc(f"worker{r}", rank=r, world_size=world_size,
                     init_method=f"tcp://127.0.0.1:{port}", options=options),
            context=contexts[r],
        )
        for r in range(world_size)
    ]
    await asyncio.gather(*tasks)
    workers = [ctx.get(_current.current_worker) for ctx in contexts]
    assert all(w is not None for w in workers)
    group = InProcessGroup(workers)  # type: ignore[arg-type]
    group.followers = [group.run_as(r, follow_leader, group.workers[r]) for r in range(1, world_size)]
    _current.set_default(group.workers[0])
    _current.current_worker.set(group.workers[0])
    return group


class LocalGroup:
    """This process as ``worker0`` plus ``n - 1`` worker processes on this machine."""

    def __init__(self, processes: list[WorkerProcess], logdir: str, echo: OutputEcho | None = None) -> None:
        self.processes = processes
        self.logdir = logdir
        self.echo = echo  # shows what the workers print (see _echo)
        self.killed: set[int] = set()  # ranks ended on purpose by kill()
        self.worker: Worker | None = None  # this process's worker0, once the group formed

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def kill(self, rank: int) -> None:
        """SIGKILL worker ``rank`` (>= 1), as a crash would."""
        proc = self.processes[rank - 1]
        self.killed.add(rank)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def logs(self, rank: int) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.logdir, f"worker{rank}.log")) as f:
            return f.read()
        return ""

    async def shutdown(self, graceful: bool = True, timeout: float = 20.0) -> None:
        """Shut worker0 down (the others follow), then make sure every process ended.
        A group shut down already is left as it is (a notebook cell run twice must not
        end a group started since)."""
        worker = self.worker
        ranks = range(1, len(self.processes) + 1)
        lost: set[int] = set()
        deadline = time.monotonic() + timeout  # for the whole shutdown
        if worker is not None and not worker.closed:
            # (a worker declared lost, stopped or cut off, will not follow worker0 out)
            lost = {rank for rank in ranks if rank not in worker.peers}
            await worker.shutdown(graceful=graceful, timeout=timeout)
            if graceful:  # nor will one that worker0's shutdown gave up on
                lost |= {rank for rank in ranks if rank not in worker.peers_done}
        if worker is not None:
            _forget([worker])
        # (those that said they are done may still be on their way out)
        deadline = max(deadline, time.monotonic() + _LOST_GRACE)
        soon = time.monotonic() + _LOST_GRACE
        for rank, proc in enumerate(self.processes, start=1):
            until = soon if rank in lost else deadline
            while proc.poll() is None and time.monotonic() < until:  # noqa: ASYNC110 - polling a child
                await asyncio.sleep(0.05)
            if rank in lost and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self.end_processes(deadline)

    def end_processes(self, deadline: float) -> None:
        """Wait until ``deadline`` for the processes to exit, kill those still there,
        and remove the logs unless a worker failed on its own."""
        _unfinished.discard(self)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.echo is not None:  # the workers have ended: the last of their output
            self.echo.stop()
        # keep the logs of failures: a worker that exited with an error we did not cause
        if all(proc.returncode == 0 or rank in self.killed
               for rank, proc in enumerate(self.processes, start=1)):
            shutil.rmtree(self.logdir, ignore_errors=True)


async def local_group(
    world_size: int = 2, options: RpcOptions | None = None, env: dict[str, str] | None = None,
    *, echo: bool = True,
) -> LocalGroup:
    """Start ``world_size - 1`` worker processes and join the current loop as worker0.

    The processes serve until worker0 shuts down (``await group.shutdown()``), and die
    with it if it disappears. With ``echo``, what they print shows in this process's
    stdout (a notebook's cell), each line prefixed ``[workerN]``; it is also in their
    logs (``group.logs(rank)``, kept in ``group.logdir`` when a worker failed).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise TypeError(f"local_group: world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"local_group: world_size must be >= 1, got {world_size}")
    world_size = int(world_size)
    if options is not None and not isinstance(options, RpcOptions):
        raise TypeError(f"local_group: options must be an RpcOptions, got {type(options).__name__}")
    if _current.running_here("worker0"):  # before any process starts (a cell run twice)
        raise RuntimeError(
            "local_group: worker0 is already running on this loop (an earlier group); "
            "`await group.shutdown()` it first"
        )
    port = free_port()
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env.setdefault("ACTORGRAD_AUTH_KEY", os.urandom(16).hex())
    os.environ.setdefault("ACTORGRAD_AUTH_KEY", child_env["ACTORGRAD_AUTH_KEY"])
    child_env["PYTHONUNBUFFERED"] = "1"
    # what the workers need to run this process's functions as it would: its import
    # path (a test module, a sys.path.insert in a notebook; as multiprocessing passes
    # sys.path on), the modules it loaded from files that the path does not lead to,
    # and the options of the group
    child_env[CHILD_SYS_PATH_ENV] = json.dumps([p or os.getcwd() for p in sys.path])
    if options is not None:
        child_env[CHILD_OPTIONS_ENV] = _encode_options(options)
    logdir = tempfile.mkdtemp(prefix="actorgrad-group-")
    off_the_path = modules_off_the_path()
    if off_the_path:  # (in a file: a suite's test modules may list more than an
        # environment variable holds, 128 KiB)
        listing = os.path.join(logdir, "modules.json")
        with open(listing, "w") as f:  # noqa: ASYNC230 - a small file, once per group
            json.dump(off_the_path, f)
        child_env[CHILD_MODULES_ENV] = listing
    args = {rank: [str(rank), str(world_size), f"tcp://127.0.0.1:{port}", str(os.getpid())]
            for rank in range(1, world_size)}
    if _forkserver.supported(child_env):
        timeout = (options or RpcOptions()).init_timeout
        try:
            processes = await _fork_workers(args, child_env, logdir, timeout)
        except BaseException:
            shutil.rmtree(logdir, ignore_errors=True)
            raise
    else:
        processes = []
        for rank, rank_args in args.items():
            log = open(os.path.join(logdir, f"worker{rank}.log"), "wb")  # noqa: SIM115, ASYNC230
            processes.append(subprocess.Popen(  # noqa: ASYNC220 - starting, not waiting
                [sys.executable, "-m", "actorgrad.testing._serve", *rank_args],
                stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
            ))
            log.close()
    paths = {rank: os.path.join(logdir, f"worker{rank}.log") for rank in args}
    group = LocalGroup(processes, logdir, OutputEcho(paths) if echo else None)
    # init_rpc runs in this task (it sets this context's worker); a watcher cancels it
    # when a worker process exits before the group formed, instead of letting it wait
    # for the whole init_timeout for a worker that will never join.
    this_task = asyncio.current_task()
    dead: list[int] = []
    watcher = asyncio.ensure_future(_watch_start(processes, this_task, dead))
    try:
        await init_rpc("worker0", rank=0, world_size=world_size,
                       init_method=f"tcp://127.0.0.1:{port}", options=options)
    except BaseException as exc:
        for proc in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if group.echo is not None:  # (a worker that died at start: its log's end is raised below)
            group.echo.stop(copy_rest=not dead)
        if dead and isinstance(exc, asyncio.CancelledError) and this_task is not None:
            this_task.uncancel()
            rank = dead[0]
            tail = "\n".join(group.logs(rank).splitlines()[-15:])
            raise RuntimeError(
                f"local_group: worker{rank}'s process exited with code "
                f"{processes[rank - 1].returncode} before the group formed; the end of its "
                f"log ({os.path.join(logdir, f'worker{rank}.log')}):\n{tail}"
            ) from None
        shutil.rmtree(logdir, ignore_errors=True)  # we ended them: nothing to keep
        raise
    finally:
        watcher.cancel()
    group.worker = _current.current_worker.get()
    _current.set_default(group.worker)
    _unfinished.add(group)
    return group


async def _fork_workers(args: dict[int, list[str]], env: dict[str, str], logdir: str,
                        timeout: float) -> list[WorkerProcess]:
    """Have the fork server start a worker for each rank (see ``_forkserver``)."""
    deadline = time.monotonic() + timeout
    while True:
        server = _forkserver.server_for(env)
        served_before = bool(server.started)
        try:
            started = await _started_by(server, args, env, logdir, deadline, timeout)
        except _forkserver.ServerGone:
            if served_before:  # it died since the last group (killed): a new one
                _forkserver.replace(server)
                continue
            raise RuntimeError(f"local_group: {server.failure()}") from None
        failures = [why for _, why in started if isinstance(why, str)]
        if failures:
            raise RuntimeError(f"local_group: the fork server could not fork a worker: {failures[0]}")
        return [_forkserver.ForkedProcess(server, ident, pid) for ident, pid in started]  # type: ignore[arg-type]


async def _started_by(server: _forkserver.ForkServer, args: dict[int, list[str]], env: dict[str, str],
                      logdir: str, deadline: float, timeout: float) -> list[tuple[int, int | str]]:
    """Ask ``server`` for the workers; per worker, the request and the pid (or why it
    could not be forked). Raises ServerGone when it ended before it answered them all."""
    requests = [server.request(rank_args, env, os.path.join(logdir, f"worker{rank}.log"))
                for rank, rank_args in args.items()]
    try:
        while True:
            with server.changed:
                started = [server.started.get(ident) for ident in requests]
                ended = server.ended
            if all(pid is not None for pid in started):
                return list(zip(requests, started, strict=True))  # type: ignore[arg-type]
            if ended:
                raise _forkserver.ServerGone
            if time.monotonic() > deadline:  # (what init_rpc raises for workers slow to start)
                raise RendezvousTimeout(
                    f"local_group: no worker started within init_timeout ({timeout}s): the fork "
                    f"server that forks them was still starting; {server.log_tail()}")
            await asyncio.sleep(0.01)
    finally:
        forked = [pid for pid in (server.started.get(ident) for ident in requests) if isinstance(pid, int)]
        if len(forked) < len(requests):  # given up or failed: end the ones forked
            for pid in forked:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


_unfinished: set[LocalGroup] = set()  # started, not shut down
# (a process forked from this one does not own them: its exit must not end them)
os.register_at_fork(after_in_child=_unfinished.clear)


@atexit.register
def _end_unfinished_groups() -> None:
    """A program (a notebook kernel, a script that raised) that ends without
    ``group.shutdown()``: end its workers (they would wait for worker0, whose sockets
    are still open) and remove the logs, as shutdown would."""
    for group in list(_unfinished):
        for rank, proc in enumerate(group.processes, start=1):
            if proc.poll() is None:
                group.killed.add(rank)  # ended by us: no failure of theirs
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        group.end_processes(time.monotonic() + 3.0)


CHILD_SYS_PATH_ENV = "ACTORGRAD_LOCAL_GROUP_SYS_PATH"
CHILD_MODULES_ENV = "ACTORGRAD_LOCAL_GROUP_MODULES"
CHILD_OPTIONS_ENV = "ACTORGRAD_LOCAL_GROUP_OPTIONS"


def _encode_options(options: RpcOptions) -> str:
    if options.ssl_context is not None or options.ssl_client_context is not None:
        raise ValueError(
            "local_group cannot hand SSL contexts to its worker processes; start TLS "
            "groups with `actorgrad launch` and init_rpc in each process"
        )
    # each worker listens where the kernel puts it: a fixed listen_port is worker0's
    return base64.b64encode(pickle.dumps(dataclasses.replace(options, listen_port=0))).decode()


def child_setup() -> RpcOptions | None:
    """In a worker process of local_group: take its parent's import path (and its
    modules off that path), and return the group's options (None: the defaults)."""
    parent_path = json.loads(os.environ.pop(CHILD_SYS_PATH_ENV, "[]"))
    if parent_path:
        sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
    listing = os.environ.pop(CHILD_MODULES_ENV, None)
    if listing is not None:
        with open(listing) as f:
            find_module_files(json.load(f))
    encoded = os.environ.pop(CHILD_OPTIONS_ENV, None)
    return None if encoded is None else pickle.loads(base64.b64decode(encoded))


async def _watch_start(processes: list[WorkerProcess], starter: asyncio.Task[Any] | None,
                       dead: list[int]) -> None:
    while starter is not None:
        for rank, proc in enumerate(processes, start=1):
            if proc.poll() is not None:
                dead.append(rank)
                starter.cancel()
                return
        await asyncio.sleep(0.1)
