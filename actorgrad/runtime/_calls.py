"""The requests a worker waits on: one future per call, resolved where the reply lands.

# Theory of operation
Each call gets a :class:`CallFuture` keyed by its request id. The reply is decoded
(``decode(payload)``, e.g. unpickling an RPC result) and set on that same future right
in the message handler: no second future, no done-callback and no extra loop turn per
call. Cancelling the future (``asyncio.wait_for``, a cancelled task, ``gather``) is
noticed by its ``cancel`` method, which tells the worker to send the callee a CANCEL.

Timeouts share one timer: deadlines go into a heap and the timer fires at the
earliest one. Most calls use the default timeout, so a new deadline is rarely the
earliest and the timer is rarely moved. Entries of calls that completed stay in the
heap until they surface (or until the heap is rebuilt when it has grown well past the
number of calls still pending).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..wire import Payload
    from ._transport import PeerProtocol

_REBUILD_SLACK = 1024  # stale heap entries tolerated beyond twice the pending calls
_ABANDONED_MAX = 4096  # calls given up on whose late replies are still unpickled


def check_timeout(timeout: float | None, meaning: str = " (0: no limit; None: RpcOptions.rpc_timeout)") -> None:
    """Refuse a per-call ``timeout`` that is neither None (the default), 0 (no limit)
    nor a positive number of seconds; ``meaning`` says what 0 and None mean there.

    Raises:
        TypeError: ``timeout`` is no number.
        ValueError: ``timeout`` is negative or NaN (which ``limit > 0`` would
            silently turn into "no limit").
    """
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 seconds{meaning}, got {timeout!r}")


class CallFuture(asyncio.Future[Any]):
    """The future of one outstanding call; cancelling it cancels the remote work."""

    # set right after construction by PendingCalls.add
    request_id: int
    peer: PeerProtocol
    decode: Callable[[Payload], Any] | None
    table: PendingCalls
    runs: Any = None  # the remote function, when there is one (named when the call expires)
    expired = False  # failed by its own timeout here (not by an error that came back)

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        self.table.cancelled(self)
        return True


class PendingCalls:
    """Outstanding calls of one worker, by request id, with their deadlines."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_cancel: Callable[[CallFuture], None],
        on_expire: Callable[[CallFuture, float], None],
    ) -> None:
        self.loop = loop
        self.futures: dict[int, CallFuture] = {}
        self._on_cancel = on_cancel  # the caller gave up: tell the callee
        self._on_expire = on_expire  # the deadline passed: fail the call, tell the callee
        self._next_id = 1
        self._deadlines: list[tuple[float, int, float]] = []  # (when, request id, limit)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        # Calls that timed out or were cancelled, oldest first. A reply that comes for
        # one anyway is still unpickled and dropped: an RRef in it registered a fork at
        # its owner, which only dropping the unpickled RRef gives back.
        self._abandoned: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self.futures)

    def add(self, peer: PeerProtocol, decode: Callable[[Payload], Any] | None, limit: float) -> CallFuture:
        """A new call to ``peer`` failing after ``limit`` seconds (0: never)."""
        deadline = self.loop.time() + limit if limit > 0 else None  # (a bad limit raises here,
        # before anything is registered that nobody would ever answer)
        request_id = self._next_id
        self._next_id += 1
        future = CallFuture(loop=self.loop)
        future.request_id = request_id
        future.peer = peer
        future.decode = decode
        future.table = self
        self.futures[request_id] = future
        peer.outstanding.add(request_id)
        if deadline is not None:
            self._add_deadline(deadline, request_id, limit)
        return future

    def pop(self, request_id: int) -> CallFuture | None:
        """Forget the call (it is answered, failed or abandoned); None if unknown."""
        future = self.futures.pop(request_id, None)
        if future is not None:
            future.peer.outstanding.discard(request_id)
        return future

    def resolve(self, request_id: int, payload: Payload) -> None:
        """The reply arrived: set the decoded value (or the decoding error)."""
        future = self.pop(request_id)
        if future is None or future.done():
            if future is None and request_id in self._abandoned:
                del self._abandoned[request_id]
                with contextlib.suppress(Exception):  # nobody waits for this value any more
                    payload.load()  # dropped at once: RRefs in it release their forks
            return
        decode = future.decode
        if decode is None:
            future.set_result(payload)
            return
        try:
            value = decode(payload)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(value)

    def fail(self, request_id: int, error: BaseException) -> None:
        future = self.pop(request_id)
        if future is not None and not future.done():
            future.set_exception(error)
        elif future is None:
            self._abandoned.pop(request_id, None)

    def cancelled(self, future: CallFuture) -> None:
        if self.pop(future.request_id) is not None:
            self._abandon(future.request_id)
            self._on_cancel(future)

    def _abandon(self, request_id: int) -> None:
        abandoned = self._abandoned
        abandoned[request_id] = None
        if len(abandoned) > _ABANDONED_MAX:
            del abandoned[next(iter(abandoned))]

    # -- deadlines ----------------------------------------------------------------
    def _add_deadline(self, when: float, request_id: int, limit: float) -> None:
        deadlines = self._deadlines
        if len(deadlines) > 2 * len(self.futures) + _REBUILD_SLACK:
            deadlines[:] = [d for d in deadlines if d[1] in self.futures]
            heapq.heapify(deadlines)
        heapq.heappush(deadlines, (when, request_id, limit))
        if when < self._timer_at:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.loop.call_at(when, self._expire_due)

    def _expire_due(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        deadlines, futures = self._deadlines, self.futures
        now = self.loop.time()
        while deadlines and (deadlines[0][0] <= now or deadlines[0][1] not in futures):
            _, request_id, limit = heapq.heappop(deadlines)
            future = self.pop(request_id)
            if future is not None and not future.done():
                self._abandon(request_id)
                self._on_expire(future, limit)
        if deadlines:
            self._arm(deadlines[0][0])

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deadlines.clear()
