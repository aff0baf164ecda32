"""Blocking calls into a worker's loop: from threads, scripts and Jupyter."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import RpcTimeout
from ._current import OTHER_LOOP_HINT

if TYPE_CHECKING:
    from ._worker import Worker

T = TypeVar("T")

_blocking = threading.local()  # .calls: blocking waits on a worker made by this thread


def note_blocking_call() -> None:
    """Count a blocking wait of this thread on a worker (``rpc_sync`` and friends)."""
    _blocking.calls = getattr(_blocking, "calls", 0) + 1


def blocking_calls() -> int:
    """How many blocking waits on a worker this thread has made so far."""
    return getattr(_blocking, "calls", 0)


def run_sync(worker: Worker, start: Callable[[], asyncio.Future[T]], answer_within: float | None = None) -> T:
    """Run ``start()`` (which returns a future) on the worker's loop and block for it.

    - From a thread while another thread runs the loop (a remote function in the
      thread pool, a script thread beside a loop thread): the work is scheduled on
      the loop in the caller's contextvars (autograd context too).
    - From a plain script, whose loop runs only while somebody drives it: the caller
      runs the loop until its own work is done; threads that call meanwhile wait,
      and take over driving when the driver is done before them.
    - From the loop's own thread while it runs (Jupyter, an ``async def`` that calls a
      blocking helper): re-enters the loop with ``nest_asyncio``, applied on demand.

    ``answer_within`` (seconds, None: no limit) is the call's own timeout, which the
    loop enforces; should the loop's thread be blocked (a notebook cell waiting for
    threads that call ``rpc_sync``), the waiting thread gives up a little after it with
    an RpcTimeout that says so, instead of waiting for a loop that cannot run.
    """
    loop = worker.loop
    if running_loop() is loop:
        return _reenter(loop, start)
    return _block_on(loop, start, answer_within)


def start_threadsafe(loop: asyncio.AbstractEventLoop, start: Callable[[], asyncio.Future[T]]) -> Any:
    """From a thread while ``loop`` runs elsewhere: ``start()`` on the loop, in this
    thread's contextvars, at once; a ``torch.futures.Future`` of its outcome, as torch's
    ``rpc_async`` returns in a remote function (``.wait()``, ``.then()``; returned by
    the function, the call answers with its value). None when ``loop`` is not running
    (nobody would start it; a blocking call drives it instead)."""
    import torch

    if not loop.is_running() or running_loop() is not None:
        return None
    result: Any = torch.futures.Future()
    ctx = contextvars.copy_context()

    def begin() -> None:
        try:
            fut = ctx.run(start)
        except BaseException as exc:  # noqa: BLE001 - the future carries it
            result.set_exception(exc)
            return

        def done(f: asyncio.Future[T]) -> None:
            if f.cancelled():
                result.set_exception(asyncio.CancelledError())
            elif (exc := f.exception()) is not None:
                result.set_exception(exc)
            else:
                result.set_result(f.result())

        fut.add_done_callback(done)

    loop.call_soon_threadsafe(begin)
    return result


def await_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any],
                     answer_within: float | None) -> Any:
    """Block a thread that is not running ``loop`` until a future of it is done."""
    return _block_on(loop, lambda: fut, answer_within)


def _block_on(loop: asyncio.AbstractEventLoop, start: Callable[[], asyncio.Future[T]],
              answer_within: float | None) -> T:
    """Schedule ``start()`` on ``loop`` in this thread's contextvars and wait for its
    outcome, driving the loop meanwhile whenever nobody else does (see run_sync)."""
    if loop.is_closed():
        raise RuntimeError("the worker's event loop is closed")
    can_drive = running_loop() is None  # a thread that runs another loop cannot
    if not can_drive and not loop.is_running():
        # nobody runs the worker's loop, and this thread cannot while it runs another:
        # refused before anything is sent
        raise RuntimeError(
            "a blocking call (a *_sync call, or remote() away from the worker's loop) made "
            "inside an event loop other than the worker's, while the worker's loop is not "
            f"running: use the async form on the worker's loop ({OTHER_LOOP_HINT})"
        )
    note_blocking_call()
    ctx = contextvars.copy_context()
    result: concurrent.futures.Future[T] = concurrent.futures.Future()
    began: list[asyncio.Future[T]] = []

    def begin() -> None:
        if result.done():  # given up on while the loop could not run: never started
            return
        try:
            fut = ctx.run(start)
        except BaseException as exc:
            result.set_exception(exc)
            return
        began.append(fut)

        def done(f: asyncio.Future[T]) -> None:
            if result.done():
                return
            if f.cancelled():
                result.cancel()
            elif (exc := f.exception()) is not None:
                result.set_exception(exc)
            else:
                result.set_result(f.result())

        fut.add_done_callback(done)

    def cancel() -> None:
        result.cancel()  # a begin() still queued starts nothing
        with contextlib.suppress(RuntimeError):  # a closed loop: nothing runs any more
            loop.call_soon_threadsafe(lambda: [fut.cancel() for fut in began])

    def give_up() -> BaseException:
        cancel()
        return RpcTimeout(
            f"no answer within {answer_within}s, and the worker's event loop, which runs "
            f"on another thread, has not run for {_STALL_GRACE}s since: a blocking call "
            "needs that loop free (is its thread blocked, e.g. a notebook cell or a "
            "coroutine waiting for threads that call *_sync?). "
            + ("The call was sent and is cancelled." if began else "The call was never sent.")
        )

    loop.call_soon_threadsafe(begin)
    stall = None if answer_within is None else (answer_within, give_up)
    try:
        return _wait_driving(loop, result, can_drive, stall, cancel)
    except BaseException:
        if not result.done():  # interrupted (Ctrl-C): the call is not waited for any more
            cancel()
        raise


_drivers: dict[int, threading.Lock] = {}  # per loop: held by the thread that runs it for run_sync
_DRIVER_POLL = 0.005  # how often a waiting thread checks whether the loop still runs
_STALL_GRACE = 2.0  # past the call's timeout, how long a loop may not run before we give up


def _wait_driving(loop: asyncio.AbstractEventLoop, result: concurrent.futures.Future[T],
                  can_drive: bool, stall: tuple[float, Callable[[], BaseException]] | None,
                  cancel: Callable[[], None]) -> T:
    """Wait for ``result``; run the loop meanwhile whenever nobody else does (and this
    thread can: not while it runs another loop). ``stall``: (the call's timeout, what
    to raise when the loop, run by another thread, stopped running past it);
    ``cancel``: gives the call up (Ctrl-C while this thread runs the loop)."""
    driver = _drivers.setdefault(id(loop), threading.Lock())
    check_at = None if stall is None else time.monotonic() + stall[0]
    probe: threading.Event | None = None  # set by the loop when it runs again
    while True:
        if not loop.is_running() and not can_drive and not result.done():
            raise RuntimeError(
                "the worker's event loop stopped before the call was answered, and this "
                "thread cannot run it while it runs another event loop: the call was sent "
                "and may still run when the worker's loop runs again"
            )
        if not loop.is_running() and driver.acquire(blocking=False):
            try:
                if not loop.is_running() and not loop.is_closed():
                    # the call's own outcome is read from ``result`` below
                    with _interrupts_cancel(cancel), contextlib.suppress(Exception, asyncio.CancelledError):
                        loop.run_until_complete(_until_done(result))
            finally:
                driver.release()
        if check_at is not None and stall is not None and time.monotonic() >= check_at \
                and loop.is_running() and not result.done():
            # the loop should have answered by now (its own timer fails the call): ask
            # whether it runs at all; one that did not within the grace is blocked
            if probe is not None and not probe.is_set():
                raise stall[1]()
            probe = threading.Event()
            loop.call_soon_threadsafe(probe.set)
            check_at = time.monotonic() + _STALL_GRACE
        try:
            return result.result(_DRIVER_POLL)
        except concurrent.futures.TimeoutError:
            if result.done():
                raise  # the call's own RpcTimeout (a TimeoutError too), not the poll's
            if loop.is_closed():
                raise RuntimeError("the worker's event loop was closed") from None


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _until_done(result: concurrent.futures.Future[Any]) -> None:
    await asyncio.wrap_future(result)


async def _await(start: Callable[[], asyncio.Future[T]]) -> T:
    return await start()


def _reenter(loop: asyncio.AbstractEventLoop, start: Callable[[], asyncio.Future[T]]) -> T:
    if type(loop).__module__.startswith("uvloop"):
        raise RuntimeError(
            "a blocking *_sync call was made inside a coroutine on the worker's uvloop event "
            "loop, which cannot be re-entered: use the async form (`await "
            "actorgrad.rpc_async(...)`, `await rref.rpc_async().method()`); on an asyncio "
            "loop (asyncio.run, Jupyter) blocking calls re-enter it through nest_asyncio. "
            "(A hook on an intermediate tensor or an autograd node runs on the loop too when "
            "a small distributed backward job runs it: make the blocking call in a custom "
            "autograd.Function, whose backward runs on the thread pool)"
        )
    import nest_asyncio

    if not getattr(loop, "_nest_patched", False):
        nest_asyncio.apply(loop)
    task = loop.create_task(_await(start))

    def cancel() -> None:
        task.cancel()
        loop.call_soon_threadsafe(lambda: None)  # wake the loop to act on it

    try:
        with _interrupts_cancel(cancel):
            return loop.run_until_complete(task)
    except BaseException:
        task.cancel()  # interrupted (Ctrl-C in a notebook): nobody waits for the call now
        raise


@contextlib.contextmanager
def _interrupts_cancel(cancel: Callable[[], None]) -> Iterator[None]:
    """While this (main) thread runs the loop: Ctrl-C cancels the call, and is raised
    once the loop returned, as asyncio.Runner does. Raised where it lands, inside a
    transport's callback, it lost bytes already read off a socket, and the connection
    (and the group with it) broke."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    interrupted: list[Any] = []

    def on_interrupt(signum: int, frame: Any) -> None:
        if not interrupted:
            interrupted.append(frame)
            cancel()

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    except BaseException:
        if not interrupted:
            raise  # (interrupted: the call's cancellation, which the interrupt replaces)
    finally:
        signal.signal(signal.SIGINT, handler)
    if interrupted:
        handler(signal.SIGINT, interrupted[0])  # the default raises KeyboardInterrupt
