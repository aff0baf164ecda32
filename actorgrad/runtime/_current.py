"""Which worker the module-level API talks to.

A contextvar holds the current worker, so several workers can live in one process (each
handler runs in its worker's context). Code outside any worker's context (a notebook
cell, a thread) falls back to the only worker of the process, if there is exactly one.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._worker import Worker

current_worker: contextvars.ContextVar[Worker | None] = contextvars.ContextVar(
    "actorgrad_worker", default=None
)
_live_workers: list[Worker] = []
# workers whose start() still runs: not yet what the module-level API talks to, but
# serving peers' calls already (a forked child forsakes them too)
_starting: list[Worker] = []
_default: list[Worker] = []  # the worker that code outside any worker context acts as


def set_default(worker: Worker | None) -> None:
    """Make ``worker`` the one that code outside every worker's context talks to."""
    _default.clear()
    if worker is not None:
        _default.append(worker)


def default() -> Worker | None:
    """The worker set by :func:`set_default`, if any."""
    return _default[0] if _default else None


def starting(worker: Worker) -> None:
    """``worker`` may serve calls from now on (see :func:`register`)."""
    _starting.append(worker)


def register(worker: Worker) -> None:
    """``worker`` joined its group: the module-level API may talk to it."""
    if worker in _starting:
        _starting.remove(worker)
    _live_workers.append(worker)


def _forsake_after_fork() -> None:
    """In a forked child: the workers are the parent's (see Worker.forsake_in_child),
    also one whose start still ran (a remote function it served forked)."""
    for worker in (*_starting, *_live_workers):
        worker.forsake_in_child()
    _starting.clear()
    _live_workers.clear()
    _default.clear()


os.register_at_fork(after_in_child=_forsake_after_fork)


def unregister(worker: Worker) -> None:
    if worker in _starting:
        _starting.remove(worker)
    if worker in _live_workers:
        _live_workers.remove(worker)


def on_loop(worker: Worker) -> bool:
    """Whether the calling code runs on ``worker``'s event loop (not a thread, not
    another loop)."""
    try:
        return asyncio.get_running_loop() is worker.loop
    except RuntimeError:
        return False


# why code may run on another loop than its worker's, and what to do
OTHER_LOOP_HINT = (
    "a worker calls and serves on the event loop it was started on; under pytest-asyncio, "
    "a fixture whose loop_scope differs from its test's runs on another loop: give it the "
    "test's loop_scope"
)


def off_loop_error(worker: Worker, what: str, from_a_thread: str = (
        "use the blocking *_sync form (rpc_sync, rref.to_here_sync...)")) -> RuntimeError:
    """What ``what``, which must run on ``worker``'s loop, raises anywhere else;
    ``from_a_thread``: what to do instead in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return RuntimeError(
            f"{what} must be called on the event loop of {worker.name}; from a thread, {from_a_thread}"
        )
    return RuntimeError(
        f"{what} was called on an event loop other than the one {worker.name} runs on: {OTHER_LOOP_HINT}"
    )


def live_on(loop: asyncio.AbstractEventLoop) -> list[Worker]:
    """The workers running on ``loop``."""
    return [w for w in _live_workers if not w.closed and w.loop is loop]


def running_here(name: str) -> bool:
    """Whether a worker named ``name`` runs on the calling code's event loop."""
    return any(w.name == name for w in live_on(asyncio.get_running_loop()))


def get_worker() -> Worker:
    """The worker of the calling code; raises if RPC is not initialized."""
    worker = current_worker.get()
    if worker is not None and not worker.closed:
        return worker
    if _default and not _default[0].closed:
        return _default[0]
    live = [w for w in _live_workers if not w.closed]
    if len(live) == 1:
        return live[0]
    if not live:
        raise RuntimeError("RPC is not initialized: call `await actorgrad.init_rpc(name)` first")
    raise RuntimeError(
        "several actorgrad workers live in this process and none is current here; "
        "call from inside a worker's context"
    )


def maybe_worker() -> Worker | None:
    try:
        return get_worker()
    except RuntimeError:
        return None
