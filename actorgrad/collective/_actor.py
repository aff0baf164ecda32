"""CollectiveActor: groups, the mailbox of collective messages, point-to-point.

One per worker (``worker.extensions["collective"]``). Every message handler runs on the
loop as the message arrives; operations are the state machines of ``_ops``.

# Mailbox
Collective messages are keyed by ``(group id, sequence number)``. A message for an
operation that is running here goes straight to it; one for an operation this rank has
not entered yet is kept in ``_early`` until it does; one for an operation that already
ended here (it failed) is dropped.

Point-to-point messages are keyed by ``(group id, tag)`` and matched in arrival order
against posted receives (a receive from a given source takes the first message of
that source; a receive from any source takes the first message). Large sends complete
when the receiver acknowledges them, so the sender may reuse its tensor afterwards.

# Failures
A lost peer fails every running operation whose group contains it, every receive
that waits on it (or on any source of a group containing it) and every send waiting for
its acknowledgement; later operations on such a group fail at once. Every wait has a
deadline (``RpcOptions.rpc_timeout`` unless ``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .._errors import CollectiveError, CollectiveRankLost
from ..runtime import Worker, _cma, get_worker
from ..wire import Payload
from . import _arena, _ops
from ._arena_channel import ArenaChannel
from ._ops import (
    Barrier,
    ChainBroadcast,
    DirectBroadcast,
    DirectReduce,
    Gather,
    Op,
    RingReduce,
    Scatter,
    Sig,
    TinyAllReduce,
    byte_view,
    send_tiny,
    sig_bytes,
    sig_of,
)
from ._staging import staged as _staged
from ._staging import staged_apart
from ._types import Group, ReduceOp

log = logging.getLogger("actorgrad.collective")

P2P_TARGET = "collective.p2p"
P2P_ACK_TARGET = "collective.p2p_ack"

RING_MIN_BYTES = 256 << 10  # all_reduce / reduce of at least this size use the ring
CHAIN_MIN_BYTES = 1 << 20  # broadcasts of at least this size use the chain
CHUNK_BYTES = 1 << 20  # pipeline granule of the ring and the chain
SPIN_US = 500  # see CollectiveActor.spin_s; only when the group fits the machine's CPUs
_CPUS = os.cpu_count() or 1


class _Recv:
    __slots__ = ("future", "gid", "src", "t", "tag", "timer")

    def __init__(self, future: asyncio.Future[int], gid: int, tag: int, src: int | None,
                 t: torch.Tensor) -> None:
        self.future = future
        self.gid = gid
        self.tag = tag
        self.src = src
        self.t = t
        self.timer: asyncio.TimerHandle | None = None


class CollectiveActor:
    """This worker's groups, running collectives and point-to-point traffic."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.loop = worker.loop
        self.default_backend = "actorgrad"
        self.world = Group(0, tuple(range(worker.world_size)), "actorgrad")
        self.groups: dict[int, Group] = {0: self.world}
        self.timeout: float | None = None  # None: worker.options.rpc_timeout
        self.ring_min_bytes = RING_MIN_BYTES
        self.chain_min_bytes = CHAIN_MIN_BYTES
        self.chunk_bytes = CHUNK_BYTES
        self.tiny_max_bytes = _ops.INLINE_MAX_BYTES  # all-reduces this small take TinyAllReduce
        # a tiny all-reduce keeps the loop polling this long before it lets the process
        # sleep: waking a sleeping process costs more than the whole exchange on a VM
        self.spin_s = float(os.environ.get("ACTORGRAD_COLLECTIVE_SPIN_US", SPIN_US)) * 1e-6
        self.torch: Any = None  # the torch.distributed backend, once initialized
        self.deferred: set[tuple[int, int]] = set()  # operations waiting to start (arena)
        self._next_gid = 1
        self._seq: dict[int, int] = {}
        self._ops: dict[tuple[int, int], Op] = {}
        self._early: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
        self._p2p_queue: dict[tuple[int, int], deque[tuple[Any, ...]]] = {}
        self._p2p_wait: dict[tuple[int, int], list[_Recv]] = {}
        # (group, tag) of receives a message reached, while their future lives: one
        # cancelled in that moment hands its message on (see withdraw_recv)
        self._p2p_taken: weakref.WeakKeyDictionary[asyncio.Future[int], tuple[int, int]] = (
            weakref.WeakKeyDictionary())
        self._p2p_acks: dict[int, tuple[int, asyncio.Future[None], asyncio.TimerHandle | None]] = {}
        self._ack_ids = itertools.count(1)
        self._lost: dict[int, str] = {}
        # ranks that number groups otherwise: from which group id on, and why
        self._apart: dict[int, tuple[int, str]] = {}
        # groups whose members may pair their calls apart: after which sequence number, why
        self._out_of_step: dict[int, tuple[int, str]] = {}
        # for groups not made yet: after which sequence number, why, who said so
        self._early_out_of_step: dict[int, tuple[int, str, int | None]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._sigs: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.closed = False
        self._cma = _cma.cma_peers(worker)
        self.use_cma = self._cma.enabled  # (tests turn it off to take the other path)
        worker.register(_ops.MSG_TARGET, self._on_msg, tell_only=True)
        worker.register(P2P_TARGET, self._on_p2p, tell_only=True)
        worker.register(P2P_ACK_TARGET, self._on_p2p_ack, tell_only=True)
        worker.add_lost_listener(self._on_lost)
        self.arenas = ArenaChannel(self)

    # -- groups ---------------------------------------------------------------------
    def new_group(self, ranks: tuple[int, ...], backend: str) -> Group:
        gid = self._next_gid
        self._next_gid += 1
        group = Group(gid, ranks, backend)
        self.groups[gid] = group
        for (early_gid, seq), messages in list(self._early.items()):
            if early_gid != gid:
                continue
            strangers = [m for m in messages if m[0] not in ranks]
            if strangers:
                # (kept, they would be fed to this group's operation of that number)
                self._early[(gid, seq)] = [m for m in messages if m[0] in ranks]
                for message in strangers:
                    self._numbered_apart(message[0], gid, seq, group, first_of_op=message[4] is not None)
        if gid in self._early_out_of_step:
            seq, text, sender = self._early_out_of_step.pop(gid)
            # (from a rank that is no member here: it numbers groups apart, and its
            # group of this number is another one, said so above)
            if sender is None or sender in ranks:
                self._set_out_of_step(gid, seq, text)
        return group

    def _numbered_apart(self, src: int, gid: int, seq: int, group: Group, first_of_op: bool = True) -> None:
        """``src`` sent a message for group ``gid``, of which it is no member here: the
        ranks number their groups apart (one skipped a new_group call). Every operation
        that waits for ``src`` would wait for its timeout, then blame a member that did
        call it: they fail now, naming the cause, and ``src`` learns it too."""
        text = (f"rank {src} sent a collective message for group {gid}, whose members on rank "
                f"{self.worker.rank} are {list(group.ranks)}: the ranks number their groups apart. "
                "new_group numbers groups in the order it is called: every rank must call it for "
                "every group, in the same order, members or not (as torch.distributed.new_group)")
        # (groups made before the skipped call, the world among them, are numbered alike)
        if src not in self._apart:
            log.error("%s", text)
        if first_of_op:  # (its first message, with its signature: answered once an operation)
            _ops.send_fail(self.worker, src, gid, seq, text.encode())
        if src not in self._apart or gid < self._apart[src][0]:
            self._apart[src] = (gid, text)
        for op in list(self._ops.values()):
            if self._numbered_apart_from(op) is not None:
                error = CollectiveError(f"{op.what()}: {text}")
                op.fail(error)
                self._tell_failed(op, str(error))  # (what it sent must not complete theirs)

    def _numbered_apart_from(self, op: Op) -> str | None:
        """Why a member of ``op``'s group numbers groups otherwise, if one does."""
        for r in op.members:
            apart = self._apart.get(r)
            if apart is not None and op.gid >= apart[0]:
                return apart[1]
        return None

    def destroy_group(self, group: Group) -> None:
        """Free ``group``'s state here (torch's ``destroy_process_group(group)``): its
        arena and memory file, its sequence, what waits for it. An operation still
        running on it fails; what peers send for it later is dropped (refused, for a
        send that waits for its receipt)."""
        gid = group.id
        error = f"{group!r} was destroyed on rank {self.worker.rank}"
        for key, op in list(self._ops.items()):
            if key[0] == gid:
                op.fail(CollectiveError(error))
        for key in [k for k in self._early if k[0] == gid]:
            del self._early[key]
        self.deferred = {k for k in self.deferred if k[0] != gid}
        for key in [k for k in self._p2p_queue if k[0] == gid]:
            for message in self._p2p_queue.pop(key):
                self._acknowledge(message[0], message[4], error)
        for key in [k for k in self._p2p_wait if k[0] == gid]:
            for recv in self._p2p_wait.pop(key):
                if recv.timer is not None:
                    recv.timer.cancel()
                if not recv.future.done():
                    recv.future.set_exception(CollectiveError(error))
        self._seq.pop(gid, None)
        self._out_of_step.pop(gid, None)
        self.groups.pop(gid, None)
        self.arenas.forget(gid)
        if self.torch is not None:
            self.torch.destroy_pg(gid)

    def destroyed(self, gid: int) -> bool:
        """Whether ``gid`` named a group destroyed here (groups are numbered alike on
        every worker, in creation order: a higher id is one not created here yet)."""
        return gid < self._next_gid and gid not in self.groups

    def deadline(self) -> float:
        return self.worker.options.rpc_timeout if self.timeout is None else self.timeout

    # -- running operations -----------------------------------------------------------
    def next_seq(self, group: Group) -> int:
        seq = self._seq.get(group.id, 0)
        self._seq[group.id] = seq + 1
        return seq

    def refuse(self, group: Group, reason: str) -> None:
        """This rank refused its part of the group's next collective (a bad argument):
        the others' part of it fails with ``reason`` as soon as they call it."""
        seq = self.next_seq(group)
        self.arenas.skip(group.id, seq)
        text = f"{reason} (the arguments were refused there)".encode()
        for r in group.ranks:
            if r != self.worker.rank:
                _ops.send_fail(self.worker, r, group.id, seq, text)

    def run(self, op: Op) -> asyncio.Future[Any]:
        """Register ``op``, arm its deadline, send its first messages, feed it the
        messages that arrived before this rank entered it."""
        key = (op.gid, op.seq)
        self._ops[key] = op
        early = self._early.pop(key, None) if self._early else None
        refusal = self._refusal(op)
        if refusal is not None:
            error, tell = refusal
            op.fail(error)
            if tell:
                self._tell_failed(op, str(error))
        else:
            limit = self.deadline()
            if limit > 0:
                op.deadline = self.loop.time() + limit
                if self._sweeper is None:
                    self._sweeper = self.loop.call_later(min(1.0, limit / 4), self._sweep)
            try:
                op.start()
                if early:
                    early.sort(key=lambda message: message[1] != _ops.K_FAIL)  # a failure wins
                    for message in early:
                        if op.done:
                            break
                        op.receive(*message)
                op.check()
            except Exception as exc:
                op.fail(CollectiveError(f"{op.what()}: {exc}"), exc)
                # this rank will not do its part: the others learn it now instead of
                # waiting for it until their deadline
                self._tell_failed(op, f"{type(exc).__name__}: {exc}")
        return op.future

    def _refusal(self, op: Op) -> tuple[CollectiveError, bool] | None:
        """Why ``op`` must not start here, if it must not, and whether its members need
        to be told (they are told of a lost member and of a group out of step already)."""
        if self.closed:
            return CollectiveError(f"{op.what()}: {self.worker.name} is shut down"), False
        gone = [r for r in op.members if r in self._lost] if self._lost else None
        if gone:
            return CollectiveRankLost(
                f"{op.what()}: rank {gone[0]} of the group is gone ({self._lost[gone[0]]})"), False
        apart = self._numbered_apart_from(op) if self._apart else None
        if apart:
            return CollectiveError(f"{op.what()}: {apart}"), True
        out_of_step = self._out_of_step_at(op.gid, op.seq)
        if out_of_step is not None:
            return CollectiveError(f"{op.what()}: {out_of_step}"), False
        return None

    def _out_of_step_from(self, op: Op, absent: list[int]) -> None:
        """``op`` timed out before ``absent`` entered it. Whether they come to it late or
        never called it (then their next call would take its place, and every later one
        would pair with the call before it on this rank, with matching signatures: wrong
        values) nobody can tell. The group's later collectives fail, on every member."""
        text = (f"group {op.gid} is out of step since {op.what()} timed out on rank "
                f"{self.worker.rank} before ranks {absent} called it: its members may no longer "
                "pair their calls alike (a rank that called a collective the others did not "
                "call runs one ahead of them). Destroy the group and make a new one"
                + ("; the world group cannot be made again: start over" if op.gid == 0 else ""))
        self._set_out_of_step(op.gid, op.seq, text)
        for r in op.members:
            if r != self.worker.rank:
                _ops.send_note(self.worker, r, op.gid, op.seq, _ops.K_OUT_OF_STEP, text.encode())

    def _set_out_of_step(self, gid: int, seq: int, text: str, sender: int | None = None) -> None:
        if gid in self._out_of_step or self.destroyed(gid):
            return
        if gid not in self.groups:  # not made here yet: it will be born out of step
            self._early_out_of_step.setdefault(gid, (seq, text, sender))
            return
        self._out_of_step[gid] = (seq, text)
        for op in list(self._ops.values()):
            if op.gid == gid and op.seq > seq:
                op.fail(CollectiveError(f"{op.what()}: {text}"))

    def _out_of_step_at(self, gid: int, seq: int) -> str | None:
        """Why operation ``seq`` of group ``gid`` must not run, if the group is out of step."""
        mark = self._out_of_step.get(gid) if self._out_of_step else None
        return mark[1] if mark is not None and seq > mark[0] else None

    def _tell_failed(self, op: Op, text: str) -> None:
        """Tell the other members that ``op`` failed here (they fail it at once)."""
        for r in op.members:
            if r != self.worker.rank:
                _ops.send_fail(self.worker, r, op.gid, op.seq, text.encode())

    def _spin(self, op: Op, until: float) -> None:
        """Keep the loop polling (a ready callback makes it poll without sleeping) while a
        tiny all-reduce waits, for at most ``spin_s``: MPI-style busy polling."""
        if not op.done and self.loop.time() < until:
            os.sched_yield()  # a peer sharing this CPU gets to run (and answer) first
            self.loop.call_soon(self._spin, op, until)

    def forget(self, op: Op) -> None:
        self._ops.pop((op.gid, op.seq), None)

    def _sweep(self) -> None:
        """Fail the operations past their deadline (one timer for all of them)."""
        self._sweeper = None
        # (a shared-memory operation whose last contribution came since the last poll is
        # complete, not late: the others may already have finished it with ours)
        self.arenas.poll_now()
        now = self.loop.time()
        for op in list(self._ops.values()):
            if op.deadline is not None and now >= op.deadline:
                error = CollectiveError(
                    f"{op.what()} timed out after {self.deadline()}s on rank {self.worker.rank} "
                    f"waiting for {op.waiting_for()} (did every member of the group call it?)"
                )
                op.fail(error)
                # a member that comes late must not complete it with what this rank sent
                # before it gave up: one rank would take a step the others did not
                self._tell_failed(op, str(error))
                if absent := op.absent():
                    self._out_of_step_from(op, absent)
        if self._ops and not self.closed:
            limit = self.deadline() or 1.0
            self._sweeper = self.loop.call_later(min(1.0, max(0.02, limit / 4)), self._sweep)

    def _on_msg(self, peer: Any, payload: Payload) -> None:
        gid, seq, kind, a, b, sig, ack, ref = pickle.loads(payload.body)
        if ref is None:
            data: Any = payload.raw[0] if payload.raw else None
        elif type(ref) is bytes:
            data = ref  # small data travels inside the header
        else:
            data = self._remote(peer.rank, ref)
        group = self.groups.get(gid)
        if group is not None and peer.rank not in group.ranks:
            self._numbered_apart(peer.rank, gid, seq, group, first_of_op=sig is not None)
            return
        if kind == _ops.K_OUT_OF_STEP:
            self._set_out_of_step(gid, seq, bytes(data).decode(errors="replace"), peer.rank)
            return
        op = self._ops.get((gid, seq))
        if op is not None:
            op.receive(peer.rank, kind, a, b, sig, ack, data)
        elif self.destroyed(gid):
            pass  # a peer still working on a group destroyed here: nobody will take it
        elif seq >= self._seq.get(gid, 0) or (gid, seq) in self.deferred:
            self._early.setdefault((gid, seq), []).append((peer.rank, kind, a, b, sig, ack, data))
        # else: a straggler of an operation that already ended here

    # -- cross-memory attach ---------------------------------------------------------
    def cma_ok(self, rank: int) -> bool:
        """Whether ``rank`` reads our large data from our memory (see ``CmaPeers.ok``)."""
        return self.use_cma and self._cma.ok(rank)

    def _remote(self, rank: int, ref: tuple[int, int]) -> _cma.RemoteRef:
        pid = self._cma.pid(rank)
        if pid is None:
            raise CollectiveError(f"rank {rank} sent a memory reference without a CMA probe")
        return _cma.RemoteRef(pid, ref[0], ref[1])

    # -- collectives (arguments validated by the API layer) ---------------------------
    def all_reduce(self, group: Group, t: torch.Tensor, op: ReduceOp) -> asyncio.Future[Any]:
        return self._reduce(group, t, op, None)

    def reduce(self, group: Group, t: torch.Tensor, dst: int, op: ReduceOp) -> asyncio.Future[Any]:
        return self._reduce(group, t, op, dst)

    def _reduce(self, group: Group, t: torch.Tensor, op: ReduceOp, root: int | None) -> asyncio.Future[Any]:
        seq = self.next_seq(group)
        key = (t.shape, t.dtype, op, root)
        sig = self._sigs.get(key)
        if sig is None:
            name = "all_reduce" if root is None else "reduce"
            params: dict[str, Any] = {"op": op.name}
            if root is not None:
                params["dst"] = root
            sig = sig_of(name, t, **params)
            if len(self._sigs) < 1024:
                self._sigs[key] = sig
        nbytes = t.numel() * t.element_size()
        if root is None and nbytes <= self.tiny_max_bytes and t.dtype in _ops._NP:
            work, writeback = _staged(t)
            if nbytes <= _arena.DATA_MAX and group.size() > 1:
                return self.arenas.all_reduce(group, seq, sig, work.view(-1), op, writeback)
            return self.tiny_tcp(group, seq, sig, work.view(-1), op, writeback).future
        work, writeback = _staged(t, copy=root is not None and root != self.worker.rank)
        o: Op
        if nbytes >= self.ring_min_bytes and t.numel() >= group.size() and group.size() > 1:
            flat = work.view(-1)
            o = RingReduce(self, group, seq, sig, flat, op, root, self.chunk_bytes)
        else:
            o = DirectReduce(self, group, seq, sig, work, op, root)
        if root is not None and root != self.worker.rank:
            writeback = None  # non-root tensors are left as they were
        o.after = writeback
        return self.run(o)

    def tiny_tcp(self, group: Group, seq: int, sig: Sig, flat: torch.Tensor, op: ReduceOp,
                 after: Callable[[], None] | None = None, extra: Any = 0) -> TinyAllReduce:
        """Start a tiny all-reduce of ``flat`` (contiguous, CPU) over the connections;
        ``after`` runs on success, ``extra`` rides in its header."""
        if flat.requires_grad:
            flat = flat.detach()
        o = TinyAllReduce(self, group, seq, sig, flat, op)  # (its start sends nothing)
        o.after = after
        failed = None
        # (else run() refuses it: nothing of an operation that may not start leaves, or
        # a member that has not heard why yet could complete it with our data)
        if self._refusal(o) is None:
            failed = send_tiny(self.worker, group.ranks, group.id, seq, sig_bytes(sig), flat, extra)
        if failed is not None:
            dst, exc = failed
            o.fail(_ops.send_error(o.what(), dst, exc))
            return o
        fut = self.run(o)
        if self.spin_s > 0 and not fut.done() and group.size() <= _CPUS:
            self.loop.call_soon(self._spin, o, self.loop.time() + self.spin_s)
        return o

    def broadcast(self, group: Group, t: torch.Tensor, src: int) -> asyncio.Future[Any]:
        seq = self.next_seq(group)
        sig = sig_of("broadcast", t, src=src)
        work, writeback = _staged(t)
        if t.numel() * t.element_size() >= self.chain_min_bytes and group.size() > 1:
            o: Op = ChainBroadcast(self, group, seq, sig, work.view(-1), src, self.chunk_bytes)
        else:
            o = DirectBroadcast(self, group, seq, sig, work, src)
        # (the source's tensor is only read: an expand() of one value, which cannot be
        # written through, is a fine source)
        o.after = writeback if src != self.worker.rank else None
        return self.run(o)

    def scatter(self, group: Group, t: torch.Tensor, parts: list[torch.Tensor] | None,
                src: int) -> asyncio.Future[Any]:
        seq = self.next_seq(group)
        sig = sig_of("scatter", t, src=src)
        work, writeback = staged_apart(t, parts, group.ranks.index(self.worker.rank))
        staged = None if parts is None else [_staged(p)[0] for p in parts]
        o = Scatter(self, group, seq, sig, work, staged, src)
        o.after = writeback
        return self.run(o)

    def gather(self, group: Group, t: torch.Tensor, out: list[torch.Tensor] | None,
               dst: int | None) -> asyncio.Future[Any]:
        seq = self.next_seq(group)
        sig = sig_of("gather" if dst is not None else "all_gather", t,
                     **({"dst": dst} if dst is not None else {}))
        work, _ = staged_apart(t, out, group.ranks.index(self.worker.rank))
        writebacks: list[Callable[[], None]] = []
        staged_out = None
        if out is not None:
            staged_out = []
            for o_t in out:
                w, wb = _staged(o_t)
                staged_out.append(w)
                if wb is not None:
                    writebacks.append(wb)
        o = Gather(self, group, seq, sig, work, staged_out, dst)
        if writebacks:
            def after() -> None:
                for wb in writebacks:
                    wb()

            o.after = after
        return self.run(o)

    def barrier(self, group: Group) -> asyncio.Future[Any]:
        seq = self.next_seq(group)
        sig = ("barrier", (), "", ())
        return self.run(Barrier(self, group, seq, sig))

    # -- point-to-point ---------------------------------------------------------------
    def send(self, group: Group, t: torch.Tensor, dst: int, tag: int) -> asyncio.Future[None]:
        """Send ``t`` to global rank ``dst``; resolves when ``t`` may be reused."""
        future: asyncio.Future[None] = self.loop.create_future()
        work, _ = _staged(t)
        nbytes = work.numel() * work.element_size()
        ack_id = 0
        if nbytes > _ops.COPY_FREE_BYTES:
            ack_id = next(self._ack_ids)
        header: tuple[Any, ...] = (group.id, tag, tuple(work.shape), str(work.dtype).removeprefix("torch."), ack_id)
        inline = nbytes <= _ops.INLINE_MAX_BYTES
        if inline and nbytes:  # inside the header: a frame of one part, which decodes in a
            header += (_ops.to_bytes(work),)  # fraction of the time of one with a buffer
        payload = Payload(pickle.dumps(header, protocol=5))
        if not inline:
            payload.buffers = [byte_view(work)]
        if dst in self._lost:
            future.set_exception(CollectiveRankLost(f"send to rank {dst}: the worker is gone ({self._lost[dst]})"))
            return future
        try:
            self.worker.tell(dst, P2P_TARGET, payload)
        except Exception as exc:
            future.set_exception(_ops.send_error(f"send (tag {tag})", dst, exc))
            return future
        if not ack_id:
            future.set_result(None)
            return future
        limit = self.deadline()
        timer = self.loop.call_later(limit, self._ack_expired, ack_id, dst, limit) if limit > 0 else None
        self._p2p_acks[ack_id] = (dst, future, timer)
        return future

    def _ack_expired(self, ack_id: int, dst: int, limit: float) -> None:
        entry = self._p2p_acks.pop(ack_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_exception(CollectiveError(
                f"send to rank {dst} timed out after {limit}s: the receiver did not post a "
                "matching recv (same group and tag)"
            ))

    def _on_p2p_ack(self, peer: Any, payload: Payload) -> None:
        ack_id, error = pickle.loads(payload.body)
        entry = self._p2p_acks.pop(ack_id, None)
        if entry is None:
            return
        _, future, timer = entry
        if timer is not None:
            timer.cancel()
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(CollectiveError(f"send to rank {peer.rank} failed on the receiver: {error}"))

    def recv(self, group: Group, t: torch.Tensor, src: int | None, tag: int) -> asyncio.Future[int]:
        """Receive into ``t`` from global rank ``src`` (None: any member); resolves with
        the sender's global rank."""
        future: asyncio.Future[int] = self.loop.create_future()
        key = (group.id, tag)
        recv = _Recv(future, group.id, tag, src, t)
        queue = self._p2p_queue.get(key)
        if queue:
            for i, message in enumerate(queue):
                if src is None or message[0] == src:
                    del queue[i]
                    if not queue:  # a tag used once must not leave its queue behind
                        del self._p2p_queue[key]
                    self._deliver(recv, *message)
                    return future
        if src is not None and src in self._lost:
            future.set_exception(CollectiveRankLost(f"recv from rank {src}: the worker is gone ({self._lost[src]})"))
            return future
        if src is None:
            gone = [r for r in group.ranks if r in self._lost]
            if gone:
                future.set_exception(CollectiveError(
                    f"recv from any source: rank {gone[0]} of the group is gone ({self._lost[gone[0]]})"
                ))
                return future
        self._p2p_wait.setdefault(key, []).append(recv)
        limit = self.deadline()
        if limit > 0:
            recv.timer = self.loop.call_later(limit, self._recv_expired, recv, limit)
        return future

    def withdraw_recv(self, future: asyncio.Future[int], t: torch.Tensor) -> None:
        """The caller of the receive of ``future`` (into ``t``) stopped waiting: withdraw
        the receive if no message matched it yet, so that the next message goes to the
        next receive. If one did (its caller was cancelled in that very step), hand the
        message, now in ``t``, on to the next receive, as ``asyncio.Queue.get`` hands
        an item back. (Another backend's receive: nothing to do.)"""
        for waiters in self._p2p_wait.values():
            for recv in waiters:
                if recv.future is future:
                    self._drop_waiter(recv)
                    if recv.timer is not None:
                        recv.timer.cancel()
                    future.cancel()
                    return
        key = self._p2p_taken.pop(future, None)
        if key is None or future.cancelled() or future.exception() is not None or self.destroyed(key[0]):
            return
        data = t.detach().clone(memory_format=torch.contiguous_format)
        # (acknowledged already: the sender learnt that this rank took it)
        self._route(key, (future.result(), tuple(t.shape), str(t.dtype).removeprefix("torch."), data, 0),
                    first=True)

    def _recv_expired(self, recv: _Recv, limit: float) -> None:
        self._drop_waiter(recv)
        if not recv.future.done():
            who = "any source" if recv.src is None else f"rank {recv.src}"
            recv.future.set_exception(CollectiveError(
                f"recv from {who} (group {recv.gid}, tag {recv.tag}) timed out after {limit}s"
            ))

    def _drop_waiter(self, recv: _Recv) -> None:
        waiters = self._p2p_wait.get((recv.gid, recv.tag))
        if waiters and recv in waiters:
            waiters.remove(recv)
            if not waiters:
                del self._p2p_wait[(recv.gid, recv.tag)]

    def _on_p2p(self, peer: Any, payload: Payload) -> None:
        gid, tag, shape, dtype, ack_id, *inline = pickle.loads(payload.body)
        if inline:
            data: torch.Tensor | None = torch.frombuffer(bytearray(inline[0]), dtype=torch.uint8)
        else:
            data = payload.raw[0] if payload.raw else None
        message = (peer.rank, shape, dtype, data, ack_id)
        if self.destroyed(gid):
            self._acknowledge(peer.rank, ack_id, f"group {gid} was destroyed on rank {self.worker.rank}")
            return
        self._route((gid, tag), message)

    def _route(self, key: tuple[int, int], message: tuple[Any, ...], first: bool = False) -> None:
        """Deliver ``message`` to the first receive waiting for it, or queue it (at the
        front: ``first``, a message handed back, which came before those queued)."""
        waiters = self._p2p_wait.get(key)
        if waiters:
            for i, recv in enumerate(waiters):
                if recv.src is None or recv.src == message[0]:
                    del waiters[i]
                    if not waiters:
                        del self._p2p_wait[key]
                    self._deliver(recv, *message)
                    return
        queue = self._p2p_queue.setdefault(key, deque())
        if first:
            queue.appendleft(message)
        else:
            queue.append(message)

    def _deliver(self, recv: _Recv, src: int, shape: tuple[int, ...], dtype: str,
                 data: torch.Tensor | None, ack_id: int) -> None:
        if recv.timer is not None:
            recv.timer.cancel()
        t = recv.t
        mine = str(t.dtype).removeprefix("torch.")
        numel = 1
        for s in shape:
            numel *= s
        error = None
        if dtype != mine or numel != t.numel():
            error = (
                f"rank {src} sent a tensor of shape {tuple(shape)} and dtype {dtype} but rank "
                f"{self.worker.rank} posted a recv of shape {tuple(t.shape)} and dtype {mine}"
            )
        if error is None:
            try:
                if numel:
                    assert data is not None
                    t.detach().copy_(data.view(t.dtype).view(t.shape))
            except Exception as exc:
                error = f"cannot receive into the tensor: {exc}"
        self._acknowledge(src, ack_id, error)
        if recv.future.done():
            return
        if error is None:
            recv.future.set_result(src)
            self._p2p_taken[recv.future] = (recv.gid, recv.tag)
        else:
            recv.future.set_exception(CollectiveError(f"recv (tag {recv.tag}): {error}"))

    def _acknowledge(self, src: int, ack_id: int, error: str | None) -> None:
        """Tell the sender its message was taken (or why not), when it waits for that."""
        if ack_id:
            try:
                self.worker.tell(src, P2P_ACK_TARGET, Payload(pickle.dumps((ack_id, error), protocol=5)))
            except Exception:
                log.debug("cannot acknowledge a send from rank %s", src, exc_info=True)

    # -- failures -------------------------------------------------------------------
    def _on_lost(self, name: str, rank: int, reason: str) -> None:
        self._lost[rank] = f"{name}: {reason}"
        for op in list(self._ops.values()):
            if rank in op.members:
                op.fail(CollectiveRankLost(
                    f"{op.what()}: rank {rank} ({name}) was lost: {reason}", name, reason
                ))
        for key, waiters in list(self._p2p_wait.items()):
            for recv in list(waiters):
                group = self.groups.get(recv.gid)
                if recv.src == rank or (recv.src is None and (group is None or rank in group.ranks)):
                    self._drop_waiter(recv)
                    if recv.timer is not None:
                        recv.timer.cancel()
                    if not recv.future.done():
                        who = "any source" if recv.src is None else f"rank {recv.src}"
                        recv.future.set_exception(CollectiveRankLost(
                            f"recv from {who} (tag {key[1]}): rank {rank} ({name}) was lost: {reason}",
                            name, reason,
                        ))
        for ack_id, (dst, future, timer) in list(self._p2p_acks.items()):
            if dst == rank:
                del self._p2p_acks[ack_id]
                if timer is not None:
                    timer.cancel()
                if not future.done():
                    future.set_exception(CollectiveRankLost(
                        f"send to rank {rank} ({name}): the worker was lost before receiving: {reason}",
                        name, reason,
                    ))

    def close(self) -> None:
        """Fail everything still waiting (the worker shuts down)."""
        self.closed = True
        for op in list(self._ops.values()):
            op.fail(CollectiveError(f"{op.what()}: {self.worker.name} shut down"))
        for waiters in list(self._p2p_wait.values()):
            for recv in waiters:
                if recv.timer is not None:
                    recv.timer.cancel()
                if not recv.future.done():
                    recv.future.set_exception(CollectiveError(f"recv: {self.worker.name} shut down"))
        self._p2p_wait.clear()
        for _, future, timer in self._p2p_acks.values():
            if timer is not None:
                timer.cancel()
            if not future.done():
                future.set_exception(CollectiveError(f"send: {self.worker.name} shut down"))
        self._p2p_acks.clear()
        self._early.clear()
        self._p2p_queue.clear()
        self.arenas.close()
        if self.torch is not None:
            self.torch.close()
        if self._sweeper is not None:
            self._sweeper.cancel()


def setup(worker: Worker) -> None:
    """Plug a CollectiveActor into a new worker (``actorgrad._api.worker_setup``)."""
    if "collective" not in worker.extensions:
        worker.extensions["collective"] = CollectiveActor(worker)


def actor(worker: Worker | None = None) -> CollectiveActor:
    """The CollectiveActor of ``worker`` (default: the current worker)."""
    worker = worker or get_worker()
    ext = worker.extensions.get("collective")
    if ext is None:
        setup(worker)
        ext = worker.extensions["collective"]
    assert isinstance(ext, CollectiveActor)
    return ext


__all__ = ["CollectiveActor", "actor", "setup"]
