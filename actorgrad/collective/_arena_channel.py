"""The event-loop side of the shared-memory arena (``_arena``): negotiation per group,
the poller and the nudges.

# Negotiation
Whether the members of a group share a host is found out by the group's first two
tiny all-reduces, which run over the connections as usual and carry the negotiation
in their headers (every member sees every header of a tiny all-reduce):

1. In the first, the group's rank 0 offers an arena it just created (its path and
   token). When that operation ended here, the others try to map it.
2. The second carries each member's answer: mapped or not. When it ended, every
   member has the same answers, so all decide alike: the arena is used from the third
   tiny all-reduce on if everybody mapped it, and never otherwise.

A tiny all-reduce started while its answer is not known here yet (the caller did not
await the previous one) waits for it before it sends anything; its messages are kept
in the mailbox meanwhile. Tiny means: no root, at most ``DATA_MAX`` bytes, a numpy
dtype; that depends only on the signature, so every member counts the same
operations.

# Polling
Waiting members poll the arena from the loop (a ready callback makes the loop poll
its sockets without sleeping, so other messages are still served), yielding the CPU
each turn. After ``spin_s`` without progress, or while the thread pool runs a job, a
member announces in the arena that it sleeps and polls from a timer; the member whose
write completes an operation sends each sleeper a nudge message. A nudge missed in a
race only costs the timer's period.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..wire import Payload
from . import _arena
from ._arena import Arena
from ._ops import ArenaAllReduce, Sig, TinyAllReduce
from ._types import Group, ReduceOp

if TYPE_CHECKING:
    from ._actor import CollectiveActor

NUDGE_TARGET = "collective.arena_nudge"
SLEEP_POLL_S = 1e-3  # a sleeping member's timer, at first; a nudge wakes it anyway, so
SLEEP_POLL_MAX_S = 0.05  # it only covers a lost one: it doubles up to this while waiting
SPIN_US = 2000  # polling without progress this long makes a member sleep


class _GroupArena:
    """The negotiation state and the running arena operations of one group."""

    def __init__(self, group: Group, rank: int, loop: asyncio.AbstractEventLoop) -> None:
        self.group = group
        self.me = group.ranks.index(rank)  # this worker's rank in the group
        self.count = 0  # tiny all-reduces started on the group
        self.arena: Arena | None = None
        self.active = False
        self.offered: asyncio.Future[None] = loop.create_future()  # first one ended here
        self.decided: asyncio.Future[None] = loop.create_future()  # second one ended here
        self.queue: deque[ArenaAllReduce] = deque()  # running, in order
        self.sleeping = False
        # Operations waiting for a gate (``_after``) whose start has not run yet. While
        # there are any, a new operation waits behind them even if its gate is open:
        # the gate's callbacks run a loop turn after it opens, and an operation started
        # in between would take its place in the queue ahead of older ones; a later
        # operation that shares their slot (seq % SLOTS) then waits for them forever.
        self.starting = 0


class ArenaChannel:
    """The tiny all-reduces of this worker's groups: over shared memory where possible."""

    def __init__(self, actor: CollectiveActor) -> None:
        self.actor = actor
        self.worker = actor.worker
        self.loop = actor.loop
        self.enabled = _arena.supported() and os.environ.get("ACTORGRAD_COLLECTIVE_ARENA", "1") != "0"
        # polling the arena costs a few microseconds a turn and yields the CPU, so it
        # may go on longer than the socket polling before a member sleeps
        self.spin_s = float(os.environ.get("ACTORGRAD_COLLECTIVE_ARENA_SPIN_US", SPIN_US)) * 1e-6
        self._groups: dict[int, _GroupArena] = {}
        self._busy: dict[int, _GroupArena] = {}  # groups with running arena operations
        self._handle: asyncio.Handle | None = None
        self._timer = False  # _handle is the sleeping timer
        self._sleep_s = SLEEP_POLL_S  # its next delay
        self._spin_until = 0.0
        self.worker.register(NUDGE_TARGET, self._on_nudge, tell_only=True)

    def active(self, gid: int) -> bool:
        """Whether the tiny all-reduces of group ``gid`` go through shared memory now."""
        st = self._groups.get(gid)
        return st is not None and st.active

    # -- starting an operation --------------------------------------------------------
    def all_reduce(self, group: Group, seq: int, sig: Sig, work: torch.Tensor, op: ReduceOp,
                   after: Callable[[], None] | None) -> asyncio.Future[Any]:
        """A tiny all-reduce of the contiguous CPU tensor ``work``; ``after`` runs on
        success before the future resolves (the write-back of a staged tensor)."""
        st = self._groups.get(group.id)
        if st is None:
            st = self._groups[group.id] = _GroupArena(group, self.worker.rank, self.loop)
            if not self.enabled:  # we answer "no" in the second: decided already
                st.offered.set_result(None)
                st.decided.set_result(None)
        k = st.count
        st.count += 1
        if k == 0:
            return self._offer(st, seq, sig, work, op, after)
        if k == 1:
            if st.offered.done() and not st.starting:
                return self._confirm(st, seq, sig, work, op, after)
            return self._after(st, st.offered, seq, lambda: self._confirm(st, seq, sig, work, op, after))
        if st.decided.done() and not st.starting:
            return self._start(st, seq, sig, work, op, after)
        return self._after(st, st.decided, seq, lambda: self._start(st, seq, sig, work, op, after))

    def _start(self, st: _GroupArena, seq: int, sig: Sig, work: torch.Tensor, op: ReduceOp,
               after: Callable[[], None] | None) -> asyncio.Future[Any]:
        if not st.active:
            return self.actor.tiny_tcp(st.group, seq, sig, work, op, after).future
        assert st.arena is not None
        o = ArenaAllReduce(self.actor, st.group, seq, sig, work, op, st.arena)
        o.after = after
        fut = self.actor.run(o)
        st.queue.append(o)
        self._busy[st.group.id] = st
        if self._advance(st):  # write now; done now if everybody else was first
            self._spin_until = self.loop.time() + self.spin_s
        if st.queue:
            self._kick()
        else:
            self._idle(st)
        return fut

    def _offer(self, st: _GroupArena, seq: int, sig: Sig, work: torch.Tensor, op: ReduceOp,
               after: Callable[[], None] | None) -> asyncio.Future[Any]:
        extra: Any = 0
        if self.enabled and st.me == 0:
            try:
                st.arena, path, token = Arena.create(st.group.size(), 0)
                extra = (path, token)
            except OSError:
                st.arena = None
        o = self.actor.tiny_tcp(st.group, seq, sig, work, op, after, extra)
        o.future.add_done_callback(lambda f: self._attach(st, o))
        return self._detached(o.future)

    def _attach(self, st: _GroupArena, o: TinyAllReduce) -> None:
        if not st.offered.done():
            leader = st.group.ranks[0]
            offer = o.extras.get(leader) if _succeeded(o.future) else None
            if leader != self.worker.rank and isinstance(offer, tuple) and len(offer) == 2:
                path, token = offer
                st.arena = Arena.attach(path, token, st.group.size(), st.me)
            st.offered.set_result(None)

    def _confirm(self, st: _GroupArena, seq: int, sig: Sig, work: torch.Tensor, op: ReduceOp,
                 after: Callable[[], None] | None) -> asyncio.Future[Any]:
        flag = 1 if st.arena is not None else 0
        o = self.actor.tiny_tcp(st.group, seq, sig, work, op, after, flag)
        o.future.add_done_callback(lambda f: self._decide(st, o, flag))
        return self._detached(o.future)

    def _detached(self, fut: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """What the caller of a negotiating all-reduce awaits: a caller that gives up
        (a timeout cancels what it awaits) must not cancel the operation's own future,
        which the decision reads: the operation goes on, as every collective does, and
        this rank decides on its outcome alike with the others."""
        outer: asyncio.Future[Any] = self.loop.create_future()
        fut.add_done_callback(lambda f: _copy(f, outer))
        return outer

    def _decide(self, st: _GroupArena, o: TinyAllReduce, flag: int) -> None:
        if st.decided.done():
            return
        me = self.worker.rank
        st.active = bool(flag) and _succeeded(o.future) and all(
            o.extras.get(r) == 1 for r in st.group.ranks if r != me
        )
        if st.arena is not None:
            st.arena.release()  # every member mapped it, or it will not be used
            if not st.active:
                st.arena.close()
                st.arena = None
        st.decided.set_result(None)

    def _after(self, st: _GroupArena, gate: asyncio.Future[None], seq: int,
               start: Any) -> asyncio.Future[Any]:
        """Start the operation ``seq`` of the group when ``gate`` is resolved, after the
        ones deferred before it (callbacks run in the order they were added); its
        messages wait in the mailbox until then."""
        outer: asyncio.Future[Any] = self.loop.create_future()
        key = (st.group.id, seq)
        self.actor.deferred.add(key)
        st.starting += 1

        def go(_: asyncio.Future[None]) -> None:
            self.actor.deferred.discard(key)
            st.starting -= 1
            inner: asyncio.Future[Any] = start()
            if inner.done():
                _copy(inner, outer)
            else:
                inner.add_done_callback(lambda f: _copy(f, outer))

        gate.add_done_callback(go)
        return outer

    # -- polling ----------------------------------------------------------------------
    def _advance(self, st: _GroupArena) -> bool:
        """Write what may be written, finish what is complete (in order)."""
        arena = st.arena
        assert arena is not None
        progressed = False
        for o in st.queue:
            if o.written or o.done:
                continue
            if not arena.can_write(o.seq):
                break
            o.write()
            progressed = True
            if arena.ready(o.seq):
                self._nudge(st, arena)
        queue = st.queue
        while queue:
            o = queue[0]
            if not o.done:
                if not o.written or not arena.ready(o.seq):
                    break
                o.finish()
            arena.mark_done(o.seq)
            queue.popleft()
            progressed = True
        return progressed

    def settled(self, gid: int) -> bool:
        """Whether the negotiation of group ``gid`` is over here (its first two tiny
        all-reduces started): from then on, how many came no longer matters."""
        st = self._groups.get(gid)
        return st is not None and st.count >= 2

    def refused(self, group: Group) -> None:
        """This member refused a small all-reduce of ``group`` (a bad argument) while
        the group's arena was being negotiated. The others count that operation (it
        fails there with our refusal), this member cannot: it gives the arena up, and
        its next operations (plain ones, with no offer and no yes) make the others
        decide against it too, so every member goes on over the connections alike."""
        st = self._groups.get(group.id)
        if st is None:
            st = self._groups[group.id] = _GroupArena(group, self.worker.rank, self.loop)
        if st.count >= 2:
            return
        st.count = 2
        if not st.offered.done():
            st.offered.set_result(None)
        if not st.decided.done():
            st.active = False
            if st.arena is not None:
                st.arena.release()
                st.arena.close()
                st.arena = None
            st.decided.set_result(None)

    def skip(self, gid: int, seq: int) -> None:
        """Operation ``seq`` of group ``gid`` failed here on another path: this member
        will never read the arena for it (so nobody waits for that to reuse a slot)."""
        st = self._groups.get(gid)
        if st is not None and st.arena is not None and (not st.queue or st.queue[0].seq > seq):
            st.arena.mark_done(seq)

    def _nudge(self, st: _GroupArena, arena: Arena) -> None:
        sleepers = arena.sleepers()
        if sleepers:
            payload = Payload(pickle.dumps(st.group.id, protocol=5))
            for r in sleepers:
                try:
                    self.worker.tell(st.group.ranks[r], NUDGE_TARGET, payload)
                except Exception:  # noqa: S112 - a lost member fails the operation anyway
                    continue

    def _on_nudge(self, peer: Any, payload: Payload) -> None:
        if self._busy:
            self._spin_until = self.loop.time() + self.spin_s
            self._sleep_s = SLEEP_POLL_S
            self._kick()

    def _kick(self) -> None:
        if self._handle is None:
            self._handle = self.loop.call_soon(self._poll)
        elif self._timer:
            self._handle.cancel()
            self._timer = False
            self._handle = self.loop.call_soon(self._poll)

    def _idle(self, st: _GroupArena) -> None:
        self._busy.pop(st.group.id, None)
        if st.sleeping and st.arena is not None:
            st.arena.set_sleeping(False)
        st.sleeping = False

    def poll_now(self) -> None:
        """Write and finish what the arenas allow now (before judging a deadline)."""
        if self._busy:
            self._advance_all()

    def _advance_all(self) -> bool:
        progressed = False
        for st in list(self._busy.values()):
            if st.arena is None:  # closed
                self._busy.pop(st.group.id, None)
                continue
            progressed = self._advance(st) or progressed
            if not st.queue:
                self._idle(st)
        return progressed

    def _poll(self) -> None:
        self._handle = None
        self._timer = False
        if len(self._busy) == 1:
            # the common case, kept cheap: one group, its oldest operation still waiting
            st = next(iter(self._busy.values()))
            head = st.queue[0] if st.queue else None
            if (head is not None and head.written and not head.done and st.arena is not None
                    and not st.arena.ready(head.seq) and not st.sleeping
                    and self.loop.time() < self._spin_until and not self.worker.pool_busy):
                os.sched_yield()
                self._handle = self.loop.call_soon(self._poll)
                return
        now = self.loop.time()
        if self._advance_all():
            self._spin_until = now + self.spin_s
            self._sleep_s = SLEEP_POLL_S
        if not self._busy or self.actor.closed:
            return
        if now < self._spin_until and not self.worker.pool_busy:
            for st in self._busy.values():
                if st.sleeping:
                    st.sleeping = False
                    st.arena.set_sleeping(False)  # type: ignore[union-attr]
            os.sched_yield()  # a member sharing this CPU gets to run (and write) first
            self._handle = self.loop.call_soon(self._poll)
            return
        for st in self._busy.values():
            if not st.sleeping:
                st.sleeping = True
                st.arena.set_sleeping(True)  # type: ignore[union-attr]
        if self._advance_all():  # a write that came before our flag sent no nudge
            self._spin_until = now + self.spin_s
            self._handle = self.loop.call_soon(self._poll)
            return
        if self._busy:
            # a member that sleeps until the others come (rank 0 evaluating for minutes)
            # must not wake a thousand times a second meanwhile
            self._handle = self.loop.call_later(self._sleep_s, self._poll)
            self._timer = True
            self._sleep_s = min(2 * self._sleep_s, SLEEP_POLL_MAX_S)

    def forget(self, gid: int) -> None:
        """A group destroyed here: unmap its arena (and its memory file)."""
        st = self._groups.pop(gid, None)
        self._busy.pop(gid, None)
        if st is not None:
            self._close_group(st)

    def _close_group(self, st: _GroupArena) -> None:
        if st.arena is not None:
            st.arena.close()
            st.arena = None
        for fut in (st.offered, st.decided):
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._busy.clear()
        for st in self._groups.values():
            self._close_group(st)


def _succeeded(fut: asyncio.Future[Any]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None


def _copy(src: asyncio.Future[Any], dst: asyncio.Future[Any]) -> None:
    if src.cancelled():
        if not dst.done():
            dst.cancel()
        return
    exc = src.exception()  # also marks it retrieved
    if dst.done():
        return
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
