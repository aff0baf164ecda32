"""Module-level API: starting, identifying and stopping the current worker."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import numbers
import os
import signal
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .runtime import RpcOptions, Worker, WorkerInfo, _current, _sync, get_worker

T = TypeVar("T")

# Layers above the runtime plug their actors into every new worker through these.
worker_setup: list[Callable[[Worker], None]] = []


def load_layers() -> None:
    """Import the layers above the runtime: each adds its setup to ``worker_setup`` on
    import, and every worker must serve all of them whatever its program imported."""
    from . import autograd, collective, optim, parallel, rpc  # noqa: F401
    from .runtime._cma import setup as cma_setup

    if cma_setup not in worker_setup:  # (before the layers that read peers' memory)
        worker_setup.insert(0, cma_setup)
    if rpc.install_handlers not in worker_setup:
        worker_setup.append(rpc.install_handlers)


async def init_rpc(
    name: str,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    options: RpcOptions | None = None,
) -> WorkerInfo:
    """Start this worker and join the group.

    Args:
        name: unique worker name, e.g. ``"worker0"``.
        rank, world_size: default to ``RANK``/``WORLD_SIZE`` from the environment.
        init_method: ``"env://"`` (default: ``MASTER_ADDR``/``MASTER_PORT``),
            ``"tcp://HOST:PORT"`` (rank 0 hosts the rendezvous) or ``"file:///path"``.
        options: :class:`RpcOptions`.

    Returns:
        This worker's WorkerInfo, once every worker has joined and can reach every other.
    """
    from ._errors import ActorgradError
    from .runtime._rendezvous import parse_init_method

    _check_init_args(name, rank, world_size, init_method, options)
    rank = None if rank is None else int(rank)  # numpy ints too
    world_size = None if world_size is None else int(world_size)
    options = options or RpcOptions()
    _, _, _, rank, world_size = parse_init_method(init_method, rank, world_size)
    current = _current.current_worker.get()
    if current is not None and not current.closed:
        raise ActorgradError(
            f"RPC is already initialized here (as {current.name!r}): `await actorgrad.shutdown()` "
            "before init_rpc again"
        )
    if _current.running_here(name):
        raise ActorgradError(f"a worker named {name!r} is already running on this loop")
    load_layers()
    worker = Worker(name, rank, world_size, options)
    for setup in worker_setup:
        setup(worker)
    await worker.start(init_method)
    _current.current_worker.set(worker)
    _freeze_long_lived()
    return worker.info


_REFREEZE_GROWTH = 50_000  # objects frozen since the last full collection that call for one
_frozen_base: int | None = None  # gc.get_freeze_count() after the last full collection


def _freeze_long_lived() -> None:
    """torch and friends leave ~170k long-lived objects; full collections scanning them
    cost ~80 us per call under load: move them out of the collector's way. A process
    that starts groups again (a test suite, a notebook) freezes what lives at each
    start, garbage-to-be of the earlier groups included; once that has grown by
    ``_REFREEZE_GROWTH`` objects, one full collection (~65 ms) frees what was dropped
    since, so it is not kept for good, while most starts stay cheap."""
    global _frozen_base
    full = _frozen_base is not None and gc.get_freeze_count() > _frozen_base + _REFREEZE_GROWTH
    if full:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    if _frozen_base is None or full:
        _frozen_base = gc.get_freeze_count()


def _check_init_args(name: object, rank: object, world_size: object, init_method: object,
                     options: object) -> None:
    """Name the argument of the wrong type, as torch's init_rpc does."""
    if isinstance(options, RpcOptions):
        options.validate()  # (fields may have been set since it was made)
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    for arg, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{arg} must be an int or None, got {type(value).__name__} {value!r}")
    if init_method is not None and not isinstance(init_method, str):
        raise TypeError(f"init_method must be a str such as 'tcp://HOST:PORT', got {type(init_method).__name__}")
    if options is not None and not isinstance(options, RpcOptions):
        raise TypeError(f"options must be an actorgrad.RpcOptions, got {type(options).__name__}")


async def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Stop the current worker.

    Graceful (default): wait until no worker of the group has outstanding work and
    every other one shuts down too, then close every connection. As torch's
    ``rpc.shutdown()``, a peer still running is waited for however long it runs (a
    worker that only serves calls this at once); peers that are gone are skipped, and
    so are peers silent (no message, no answer to heartbeats) for
    ``RpcOptions.shutdown_timeout``. ``timeout`` (seconds, > 0) bounds the whole wait.
    """
    worker = get_worker()
    await worker.shutdown(graceful=graceful, timeout=timeout)
    if _current.current_worker.get() is worker:
        _current.current_worker.set(None)


def get_worker_info(
    name_or_rank: str | int | WorkerInfo | None = None, *, worker_name: str | int | None = None
) -> WorkerInfo:
    """The WorkerInfo of a worker by name or rank; ``None`` means this worker.
    ``worker_name`` is torch's name for the argument."""
    if worker_name is not None:
        if name_or_rank is not None:
            raise TypeError("get_worker_info() takes name_or_rank or worker_name, not both")
        name_or_rank = worker_name
    worker = get_worker()
    if name_or_rank is None:
        return worker.info
    return worker.resolve(name_or_rank)


def get_rank() -> int:
    """This worker's rank in the group (raises RuntimeError before init_rpc)."""
    return get_worker().rank


def get_world_size() -> int:
    """The number of workers in the group (raises RuntimeError before init_rpc)."""
    return get_worker().world_size


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a fresh event loop (uvloop when installed) and return its result.

    A worker that ``main`` started and did not shut down is stopped (not gracefully)
    when it ends: its connections, threads and listeners go with the loop."""
    if not inspect.isawaitable(main):
        called = " (call it: ag.run(main()))" if callable(main) else ""
        raise TypeError(f"ag.run needs a coroutine, got {type(main).__name__} {main!r:.60}{called}")
    term = _Termination()
    try:
        try:
            import uvloop
        except ImportError:
            result = asyncio.run(_closing_workers(main, term))
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                result = runner.run(_closing_workers(main, term))
    except BaseException as exc:
        if term.signalled:
            if not isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
                traceback.print_exception(exc)  # the program's own failure, as Python prints it
            _end_by_sigterm()
        raise
    if term.signalled:
        _end_by_sigterm()
    return result


class _Termination:
    """A SIGTERM that ``run`` took (see ``_closing_workers``)."""

    __slots__ = ("main_running", "signalled")

    def __init__(self) -> None:
        self.signalled = self.main_running = False


def _end_by_sigterm() -> None:
    """End the process as the SIGTERM that ``run`` held back would have."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


async def _closing_workers(main: Coroutine[Any, Any, T], term: _Termination | None = None) -> T:
    loop = asyncio.get_running_loop()
    before = _current.live_on(loop)  # (on a loop run again: not those of earlier code)
    if term is not None and os.environ.get("ACTORGRAD_TRACE") and _on_main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # actorgrad launch --trace: the launcher stops the ranks with SIGTERM once one
        # failed (or it was told to stop), and rank 0 writes the trace as its worker
        # shuts down: SIGTERM cancels the program as Ctrl-C does, instead of ending it
        # (once the program is over, the shutdown that writes the trace goes on), and
        # the process ends by SIGTERM afterwards
        task = asyncio.current_task()

        def stop() -> None:
            term.signalled = True
            if term.main_running and task is not None:
                task.cancel()

        # a loop that cannot take signals (not on Unix) refuses: SIGTERM ends the process
        # at once there, as it did before
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGTERM, stop)
    failure: BaseException | None = None
    try:
        if term is not None:
            term.main_running = True
        return await main
    except BaseException as exc:
        failure = exc
        raise
    finally:
        if term is not None:
            term.main_running = False
        for worker in _current.live_on(loop):
            if worker not in before:
                if failure is not None and not isinstance(failure, asyncio.CancelledError) and not (
                        isinstance(failure, SystemExit) and failure.code in (None, 0)):
                    worker.set_stopped_on(failure)
                await worker.shutdown(graceful=False)


def run_sync(aw: Awaitable[T]) -> T:
    """Block until ``aw`` is done: the blocking form of any awaitable of the API
    (``autograd.backward(...)``, ``opt.step(...)``, a collective, ``shutdown()``) for
    code that is not ``async``: a plain script, a thread, a notebook cell.

    It runs on the worker's event loop in this thread's contextvars (its autograd
    context). In a plain script, whose loop runs only while somebody drives it, this
    thread runs the loop meanwhile and takes turns with other threads blocked in
    ``rpc_sync`` (where ``loop.run_until_complete`` fails while one of them runs it).
    Before ``init_rpc``: ``run_sync(ag.init_rpc(...))`` starts the worker on a new
    event loop (uvloop where installed), made this thread's current one.
    """
    if not inspect.isawaitable(aw):
        raise TypeError(f"run_sync takes an awaitable (a coroutine of the API), got {type(aw).__name__}")
    worker = _current.maybe_worker()
    if worker is None:
        if _sync.running_loop() is not None:
            _close_unawaited(aw)
            raise RuntimeError("run_sync called inside a running event loop before init_rpc: await it instead")
        loop = getattr(_blocking_loops, "loop", None)
        # (one per thread, reused: each holds descriptors; a forked child makes its own)
        if loop is None or loop.is_closed() or getattr(_blocking_loops, "pid", None) != os.getpid():
            loop = _blocking_loops.loop = _new_event_loop()
            _blocking_loops.pid = os.getpid()
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(aw)
    return _sync.run_sync(worker, lambda: asyncio.ensure_future(aw))


_blocking_loops = threading.local()  # .loop: the event loop run_sync made for this thread


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _close_unawaited(aw: Any) -> None:
    if inspect.iscoroutine(aw):
        aw.close()  # (no "never awaited" warning on top of the error)


class trace:  # noqa: N801 - used as `with ag.trace():`
    """Record RPC and backward events on every worker while the block runs.

    ``with ag.trace(): ...`` then ``await ag.export_trace("trace.json")``. Messages to
    peers are ordered, so every call made inside the block is recorded on both sides.
    """

    def __init__(self) -> None:
        self._workers: list[Any] = []  # the worker each open entry of this block counts on

    def __enter__(self) -> trace:
        worker = get_worker()
        self._change(worker, +1)
        self._workers.append(worker)
        return self

    def __exit__(self, *exc: object) -> None:
        worker = self._workers.pop()
        if not worker.closed:  # (a group shut down inside the block took its count along)
            self._change(worker, -1)

    @staticmethod
    def _change(worker: Any, by: int) -> None:
        import contextlib

        from .wire import Payload

        count = worker.tracer.change_blocks(worker.rank, by)

        def tell_peers() -> None:
            message = Payload.dump(count)
            for rank in list(worker.peers):
                with contextlib.suppress(Exception):
                    worker.tell(rank, "trace.set", message)

        if _current.on_loop(worker):
            tell_peers()
        else:  # a thread (a plain script, a remote function on the pool): the loop sends,
            # after what this thread sent before, so calls made in the block are recorded
            worker.loop.call_soon_threadsafe(tell_peers)


async def export_trace(path: str) -> int:
    """Merge every worker's recorded events into one Chrome-trace JSON file at ``path``.

    Open it in Perfetto (ui.perfetto.dev) or chrome://tracing. Returns the number of
    events written. Workers that are gone are left out.
    """
    if not isinstance(path, (str, bytes, os.PathLike)):  # (an int was taken for a file descriptor)
        raise TypeError(f"export_trace: path must be a file path, got {type(path).__name__}")
    return await get_worker().export_trace(os.fsdecode(path))
