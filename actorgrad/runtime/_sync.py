"""Blocking calls into a worker's loop: from threads, scripts and Jupyter."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

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


def run_sync(worker: Worker, start: Callable[[], asyncio.Future[T]], timeout: float | None = None) -> T:
    """Run ``start()`` (which returns a future) on the worker's loop and block for it.

    - From another thread (a remote function in the thread pool, a script thread): the
      work is scheduled on the loop in the caller's contextvars (autograd context too).
    - From the loop's own thread while it runs (Jupyter, an ``async def`` that calls a
      blocking helper): re-enters the loop with ``nest_asyncio``, applied on demand.
    """
    loop = worker.loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return _reenter(loop, start)
    if loop.is_running() and threading.current_thread() is not _loop_thread(loop):
        note_blocking_call()
        ctx = contextvars.copy_context()
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def begin() -> None:
            try:
                fut = ctx.run(start)
            except BaseException as exc:
                result.set_exception(exc)
                return

            def done(f: asyncio.Future[T]) -> None:
                if f.cancelled():
                    result.cancel()
                elif (exc := f.exception()) is not None:
                    result.set_exception(exc)
                else:
                    result.set_result(f.result())

            fut.add_done_callback(done)

        loop.call_soon_threadsafe(begin)
        return result.result(timeout)
    if not loop.is_running() and not loop.is_closed():
        return loop.run_until_complete(_await(start))
    raise RuntimeError("the worker's event loop is not running")


async def _await(start: Callable[[], asyncio.Future[T]]) -> T:
    return await start()


_loop_threads: dict[int, threading.Thread] = {}


def remember_loop_thread(loop: asyncio.AbstractEventLoop) -> None:
    _loop_threads[id(loop)] = threading.current_thread()


def _loop_thread(loop: asyncio.AbstractEventLoop) -> threading.Thread | None:
    return _loop_threads.get(id(loop))


def _reenter(loop: asyncio.AbstractEventLoop, start: Callable[[], asyncio.Future[T]]) -> T:
    if type(loop).__module__.startswith("uvloop"):
        raise RuntimeError(
            "a blocking *_sync call was made inside a coroutine on the worker's uvloop event "
            "loop, which cannot be re-entered: use the async form (`await "
            "actorgrad.rpc_async(...)`, `await rref.rpc_async().method()`); on an asyncio "
            "loop (asyncio.run, Jupyter) blocking calls re-enter it through nest_asyncio"
        )
    import nest_asyncio

    if not getattr(loop, "_nest_patched", False):
        nest_asyncio.apply(loop)
    return loop.run_until_complete(_await(start))


def await_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], timeout: float | None) -> Any:
    """Block a non-loop thread until an asyncio future of ``loop`` is done."""
    note_blocking_call()

    async def wait() -> Any:
        return await asyncio.shield(fut)
    return asyncio.run_coroutine_threadsafe(wait(), loop).result(timeout)
