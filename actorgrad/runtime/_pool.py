"""A lean thread pool for blocking remote functions.

``loop.run_in_executor`` costs two future wrappers and a ``concurrent.futures`` hop per
call; on a 2-core machine that showed up as ~200 µs per RPC. Here a job is one queue
put, and its result one ``call_soon_threadsafe``.

Threads start on demand, but not merely because jobs are queued: with the GIL, extra
threads racing through a burst of short jobs only add contention and context switches.
So the first thread starts with the first job, and more only when jobs have waited
``_GRACE`` seconds while no thread was free to take them and no running job finished,
i.e. when every thread is stuck in a long or blocking function. Nested calls stay
deadlock-free: a function blocked on a call back into this worker gets a new thread
within ``_GRACE`` (up to ``max_threads``, as before).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import logging
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from ._torch_modes import as_a_fresh_thread, fresh_modes

_get_num_threads = torch.get_num_threads

_STOP = object()
_JOIN_SECONDS = 2.0  # how long close() waits for threads to finish their last job
_GRACE = 0.002  # seconds queued jobs may wait on busy threads before another starts
# jobs waiting this long behind every thread, none of which finished anything
# meanwhile: the pool is full of blocked functions, and their callers will time out
_SATURATED_SECONDS = 5.0

log = logging.getLogger("actorgrad")


class ThreadPool:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_threads: int, name: str) -> None:
        self._loop = loop
        self._pid = os.getpid()  # (a function that forks goes on in the child: see _run)
        self._max = max_threads
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._finished = 0  # jobs completed (progress marker, written by pool threads)
        self._free: list[bool] = []  # per thread: blocked waiting for a job (or about to)
        self._check: asyncio.TimerHandle | None = None
        self._closed = False
        self._closed_at: float | None = None  # when close() began waiting for the threads
        self._said_full = False  # warned since the pool last had a free thread
        self.in_flight = 0  # jobs submitted whose result the loop has not received yet

    def submit(self, fn: Callable[[], Any], ctx: contextvars.Context) -> asyncio.Future[Any]:
        """Run ``ctx.run(fn)`` on a pool thread; the future resolves on the loop.

        Must be called on the loop's thread.
        """
        if self._closed:
            raise RuntimeError("the worker's thread pool is shut down")
        future: asyncio.Future[Any] = self._loop.create_future()
        self.in_flight += 1
        self._jobs.put((fn, ctx, future))
        if not self._threads:
            self._start_thread()
        elif self._check is None:
            self._schedule_check()
        return future

    def _schedule_check(self) -> None:
        delay = _GRACE if len(self._threads) < self._max else _SATURATED_SECONDS
        self._check = self._loop.call_later(delay, self._check_backlog, self._finished)

    def _check_backlog(self, finished_before: int) -> None:
        """Start a thread if jobs are still queued and nothing finished meanwhile; say
        so when they wait behind every thread for long."""
        self._check = None
        if self._closed or self._jobs.empty():
            self._said_full = False
            return
        if self._finished == finished_before and True not in self._free:
            # every thread is stuck in a job (a free one may merely not have run yet:
            # GIL, busy CPU); one more thread per waiting job, up to the limit
            if len(self._threads) < self._max:
                for _ in range(min(self._jobs.qsize(), self._max - len(self._threads))):
                    self._start_thread()
            elif not self._said_full:
                self._said_full = True
                log.warning(
                    "%s: all %d threads have been busy for %.0fs with %d function(s) waiting "
                    "behind them, whose callers may time out: each long or blocking function "
                    "holds a thread; if they wait for each other (a barrier, a lock, an event) "
                    "or simply take long, raise RpcOptions(num_worker_threads=...) or make the "
                    "waiting ones `async def`",
                    self._name, self._max, _SATURATED_SECONDS, self._jobs.qsize())
        elif True in self._free:
            self._said_full = False
        self._schedule_check()

    def busy(self) -> bool:
        """Whether a thread of this pool is inside a job."""
        return any(not free and thread.is_alive() for thread, free in zip(self._threads, self._free, strict=False))

    def _start_thread(self) -> None:
        if not self._threads:
            _watch_at_exit(self)
        index = len(self._threads)
        self._free.append(True)
        thread = threading.Thread(
            target=self._run, args=(index,), name=f"{self._name}-{index}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _run(self, index: int) -> None:
        get = self._jobs.get
        free = self._free
        call_soon_threadsafe = self._loop.call_soon_threadsafe
        # OpenMP keeps its thread count per thread, and torch sets it in a new thread
        # (to the program's torch.set_num_threads) only when asked for it: until then
        # ops that go to OpenMP directly ran on every core (two ranks on two cores: a
        # small model's DDP backward on the pool took 5-10x as long as on the loop
        # thread, until OMP_NUM_THREADS=1). Asked at the start; a job that sets a count
        # of its own has it for itself only, as each job starts as a fresh thread.
        threads = _get_num_threads()
        while True:
            free[index] = True  # one store: atomic under the GIL, no lock needed
            job = get()
            free[index] = False
            if job is _STOP:
                return
            fn, ctx, future = job
            deliver: Callable[[asyncio.Future[Any], Any], None]
            try:
                if fresh_modes():
                    value = ctx.run(fn)
                else:  # an earlier job left a mode set (torch.set_grad_enabled(False)):
                    with as_a_fresh_thread():  # each job starts as a fresh thread, as inline work
                        value = ctx.run(fn)
                deliver = _set_result
            except BaseException as exc:  # delivered to the awaiting coroutine
                if os.getpid() != self._pid:
                    _end_forked_child(exc)
                if isinstance(exc, KeyboardInterrupt):
                    exc.raised_in_pool = True  # type: ignore[attr-defined]  # no Ctrl-C: see raised_in_pool
                value, deliver = exc, _set_exception
            if _get_num_threads() != threads:  # (see above)
                torch.set_num_threads(threads)
            del job, fn, ctx
            if os.getpid() != self._pid:
                _end_forked_child(None)
            self._finished += 1  # a lost update only delays a thread start by _GRACE
            try:
                call_soon_threadsafe(self._deliver, deliver, future, value)
            except RuntimeError:
                return  # the loop is closed: nobody waits any more
            del future, value

    def _deliver(
        self, deliver: Callable[[asyncio.Future[Any], Any], None], future: asyncio.Future[Any], value: Any
    ) -> None:
        self.in_flight -= 1
        deliver(future, value)

    def close(self) -> None:
        self._closed = True
        self._closed_at = time.monotonic()
        if self._check is not None:
            self._check.cancel()
            self._check = None
        for _ in self._threads:
            self._jobs.put(_STOP)
        # Join (bounded): a daemon thread still holding tensors when the interpreter
        # exits can abort the process inside torch's destructors.
        deadline = time.monotonic() + _JOIN_SECONDS
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


_pools: weakref.WeakSet[ThreadPool] = weakref.WeakSet()  # pools with threads, for _let_jobs_finish
_watching = [False]


def _watch_at_exit(pool: ThreadPool) -> None:
    if not _watching[0]:
        _watching[0] = True
        atexit.register(_let_jobs_finish)  # (once: a handler runs as often as it is registered)
    _pools.add(pool)


def _let_jobs_finish() -> None:
    """At interpreter exit: a pool thread still inside a job (a remote call running
    torch code) is stopped, once exit handlers have run, where it next takes the GIL,
    in the middle of torch's C++; that aborts the process ("terminate called without an
    active exception", status 134) in place of the status it was ending with (a Ctrl-C,
    a failed ``main``). The jobs get as long to finish first as closing the pool gives
them (counted from when it began closing, if it did). (Ending the process
    here instead would skip the exit handlers registered before this one: the program's
    own, its temporary folders'.)"""
    busy = [p for p in list(_pools) if p.busy()]
    if not busy:
        return
    # as long as closing the pool waits (which ag.run and shutdown did already): a
    # launcher gives a rank that outlives a failed one only a few seconds
    now = time.monotonic()
    deadline = min((p._closed_at or now) + _JOIN_SECONDS for p in busy)
    if deadline <= now:
        return
    names = ", ".join(sorted({p._name for p in busy}))
    with contextlib.suppress(Exception):
        sys.stderr.write(f"actorgrad: waiting up to {deadline - now:.1f}s for the calls still running "
                         f"on the threads of {names} before the process exits\n")
        sys.stderr.flush()
    while any(p.busy() for p in busy) and time.monotonic() < deadline:
        time.sleep(0.01)


def raised_in_pool(exc: BaseException) -> bool:
    """Whether a job of a pool raised ``exc`` itself: a KeyboardInterrupt that did can
    never be a Ctrl-C, which Python raises in the main thread only."""
    return getattr(exc, "raised_in_pool", False) is True


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        if isinstance(exc, StopIteration):
            # Python 3.11's futures refuse StopIteration (it would end the awaiting
            # coroutine as if it returned), so this future would never resolve; wrap
            # it in a RuntimeError as 3.12's set_exception does itself.
            wrapped = RuntimeError(f"the function raised StopIteration: {exc!r}")
            wrapped.__cause__ = exc
            exc = wrapped
        future.set_exception(exc)


def _end_forked_child(exc: BaseException | None) -> NoReturn:
    """A remote function forked, and the child's copy of it ended, on this thread (the
    child's only one): end the child with the function's exit status. It has no event
    loop to deliver anything to, and its exit must not run the parent's exit handlers
    (its copies of the worker's state); waiting for the next job would keep it for good."""
    code = 0
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    elif exc is not None:
        traceback.print_exception(exc)
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
