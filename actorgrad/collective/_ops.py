"""The collective algorithms of our own backend, as message-driven state machines.

# Theory of operation
Every collective call on a group takes the group's next sequence number; every rank
calls the collectives of a group in the same order (as torch requires), so the pair
``(group id, seq)`` names one operation on every rank and keys all of its messages.
A message for an operation this rank has not entered yet waits in the actor's mailbox
(``_early``) until it does.

An operation object lives on the loop; ``receive`` is called synchronously from the
message handler, so no task is created per message. The phases of every operation:

1. **Validation.** Every rank learns the *signature* (op name, shape, dtype, root,
   reduce op) of every other rank, either from a small header message or from the
   first data message, which carries it. Data that arrives before all signatures are
   in is queued. Every rank sees every signature, so a mismatch makes *every* rank
   raise ``CollectiveError`` and nobody waits for data that will never come.
2. **Data.** Algorithm specific (``on_data``); ``data_complete`` says when this rank
   has everything, then ``complete`` writes the results.
3. **Acknowledgement.** When a large tensor is sent straight from the caller's memory
   (a frame buffer the transport may still be writing out, or an address the peer
   reads through CMA), the message is flagged ``ack``: the receiver answers once its
   own data is complete, and the sender finishes only then, so the caller may
   overwrite its tensor as soon as the call returns. Small data is copied into the
   header (``INLINE_MAX_BYTES``) or cloned, and needs no acknowledgement. In the ring,
   every send from the caller's tensor but the first all-gather step is covered by
   causality (the data that completes the operation cannot arrive before the peer
   consumed it), so only that step is flagged.

Data moves in one of three ways, chosen per message: inside the pickled header (up to
8 KiB), as an out-of-band frame buffer (received straight into fresh memory), or,
between workers on one machine that passed the probe, as an address the receiver reads
with ``process_vm_readv`` (``_cma``): one copy instead of two, and none by the sender.

Failures: a mismatch, a lost member (the actor fails every operation whose group
contains it), a send to a dead peer, or the deadline fail the operation on this rank.

Reductions are computed in an order that does not depend on the rank doing them (rank
order for the direct algorithm; each ring segment is reduced once and then copied), so
every rank ends with bitwise identical results.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._errors import CollectiveError, CollectiveRankLost, WorkerLost
from ..runtime._cma import RemoteRef
from ..wire import Payload, Tell
from ._arena import Arena
from ._types import Group, ReduceOp

if TYPE_CHECKING:
    from ._actor import CollectiveActor

MSG_TARGET = "collective.msg"

# message kinds: header tuple is (gid, seq, kind, a, b, pickled sig or None, ack, ref);
# ref: None (data in the frame's buffer), bytes (small data inline) or (addr, nbytes) (CMA)
K_HEADER = 0  # signature only
K_DATA = 1  # direct data (a, b unused)
K_RS = 2  # ring reduce-scatter: a = step, b = chunk
K_AG = 3  # ring all-gather: a = step, b = chunk
K_ROOT = 4  # ring reduce: a = segment, b = chunk, sent to the root
K_CHAIN = 5  # chain broadcast: b = chunk
K_ACK = 6  # "I have all my data" answer to a flagged message
K_FAIL = 7  # the operation failed on the sender: ref is the error text (utf-8)
K_OUT_OF_STEP = 8  # the group is out of step from this operation on: ref is why (utf-8)

INLINE_MAX_BYTES = 8 << 10  # smaller data travels inside the pickled header
CMA_MIN_BYTES = 64 << 10  # larger data goes through CMA where the peer can use it
COPY_FREE_BYTES = 8 << 10  # smaller frames are joined (copied) by the encoder
CLONE_MAX_BYTES = 1 << 20  # up to this size a send is cloned instead of acknowledged

Sig = tuple[Any, ...]
Data = torch.Tensor | RemoteRef | bytes | None


_NP = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}


_TORCH_OPS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}
# the same elementwise operations on numpy arrays (cheaper for a few elements; every
# binary step rounds like torch's: float16 is computed in float32 and rounded per step)
_NUMPY_OPS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor,
}


def to_bytes(t: torch.Tensor) -> bytes:
    """A copy of the bytes of a contiguous CPU tensor."""
    if t.dtype in _NP:
        return t.numpy().tobytes()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def sig_of(name: str, t: torch.Tensor, **params: Any) -> Sig:
    """The signature every rank must agree on for one operation."""
    return (name, tuple(t.shape), str(t.dtype).removeprefix("torch."), tuple(sorted(params.items())))


_SIG_BYTES: dict[Sig, bytes] = {}


def sig_bytes(sig: Sig) -> bytes:
    """The pickled signature (what travels; compared as bytes), cached."""
    b = _SIG_BYTES.get(sig)
    if b is None:
        b = pickle.dumps(sig, protocol=5)
        if len(_SIG_BYTES) < 4096:
            _SIG_BYTES[sig] = b
    return b


def describe(sig: Sig) -> str:
    name, shape, dtype, params = sig
    extra = "".join(f", {k}={v}" for k, v in params)
    return f"{name}(shape={shape}, dtype={dtype}{extra})"


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(total)``, sizes differing by <= 1."""
    q, r = divmod(total, parts)
    out = []
    lo = 0
    for k in range(parts):
        hi = lo + q + (1 if k < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


def reduce_into(acc: torch.Tensor, x: torch.Tensor, op: ReduceOp) -> None:
    """``acc = acc (op) x`` in place."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        acc.add_(x)
    elif op is ReduceOp.PRODUCT:
        acc.mul_(x)
    else:
        _TORCH_OPS[op](acc, x, out=acc)


def finish_avg(t: torch.Tensor, op: ReduceOp, n: int) -> None:
    if op is ReduceOp.AVG and n > 1:
        t.div_(n)


def send_error(what: str, dst: int, exc: Exception) -> CollectiveError:
    """What ``what`` fails with when a message to global rank ``dst`` cannot go out: a
    lost rank when its connection is gone (or closing: the peer's goodbye may come
    before the worker learns that it is lost), as the loss itself would say."""
    if isinstance(exc, WorkerLost):
        error: CollectiveError = CollectiveRankLost(
            f"{what}: rank {dst} ({exc.worker}) was lost: {exc.reason}", exc.worker, exc.reason)
    else:
        error = CollectiveError(f"{what}: cannot send to rank {dst}: {exc}")
    error.__cause__ = exc
    return error


class Op:
    """One collective operation on this rank (base class: validation, acks, ending)."""

    name = "collective"

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig) -> None:
        self.actor = actor
        self.worker = actor.worker
        self.gid = group.id
        self.seq = seq
        self.members = group.ranks
        self.n = len(group.ranks)
        self.rank = actor.worker.rank
        self.me = group.ranks.index(self.rank)
        self.sig = sig
        self.sig_bytes = sig_bytes(sig)
        self.future: asyncio.Future[Any] = actor.worker.loop.create_future()
        self.result: Any = None
        self.missing: set[int] = {r for r in group.ranks if r != self.rank}
        self.queued: list[tuple[int, int, int, int, Data]] = []
        self.acks_needed: set[int] = set()
        self.acks_owed: set[int] = set()
        self.data_done = False
        self.done = False
        self.deadline: float | None = None
        self.keep: list[torch.Tensor] = []  # data peers read through CMA
        self.scratch: torch.Tensor | None = None
        self.after: Callable[[], None] | None = None  # run on success before resolving

    # -- to be provided by the algorithms -------------------------------------------
    def send_to_root(self, data: Any) -> None:
        """Send ``data`` to the root (to everyone when there is none); the other members
        get only the header, so every rank still checks every other's signature."""
        root = getattr(self, "root", None)
        for r in self.members:
            if r == self.rank:
                continue
            if root is None or r == root:
                self.send(r, K_DATA, sig=True, data=data, protect="clone")
            else:
                self.send(r, K_HEADER, sig=True)

    def start(self) -> None:
        """Send the first messages."""

    def on_data(self, src: int, kind: int, a: int, b: int, data: Data) -> None:
        """A validated data message."""

    def data_complete(self) -> bool:
        """Whether every message this rank needs has arrived."""
        return True

    def complete(self) -> None:
        """Write the results (called once, when validated and data_complete)."""

    # -- sending --------------------------------------------------------------------
    def send(self, dst: int, kind: int, a: int = 0, b: int = 0, *, sig: bool = False,
             data: torch.Tensor | None = None, ack: bool = False, protect: str | None = None) -> None:
        """Send one message of this operation to global rank ``dst``.

        ``protect`` says what to do when ``data`` may change once the operation ended
        on this rank (the caller's tensor): ``"clone"`` copies a medium-sized tensor
        and asks for an acknowledgement beyond that, ``"ack"`` always asks for one.
        Data the peer reads through CMA is always acknowledged (and kept alive).
        """
        if self.done:
            return
        ref: bytes | tuple[int, int] | None = None
        buffers: list[memoryview] = []
        if data is not None and data.numel():
            nbytes = data.numel() * data.element_size()
            if nbytes <= INLINE_MAX_BYTES:
                ref = to_bytes(data)  # copied into the header now: nothing to protect
            elif nbytes >= CMA_MIN_BYTES and self.actor.cma_ok(dst):
                ref = (data.data_ptr(), nbytes)
                self.keep.append(data)
                ack = True
            else:
                if protect is not None and nbytes > COPY_FREE_BYTES:
                    if protect == "clone" and nbytes <= CLONE_MAX_BYTES:
                        data = data.clone()
                    else:
                        ack = True
                buffers = [byte_view(data)]
        header = (self.gid, self.seq, kind, a, b, self.sig_bytes if sig else None, ack, ref)
        payload = Payload(pickle.dumps(header, protocol=5))
        payload.buffers = buffers
        if ack:
            self.acks_needed.add(dst)
        peer = self.worker.peers.get(dst)
        try:
            if peer is not None and peer.can_send:
                peer.send(Tell(target=MSG_TARGET, payload=payload))
            else:
                self.worker.tell(dst, MSG_TARGET, payload)  # raises WorkerLost
        except Exception as exc:
            self.fail(send_error(self.what(), dst, exc))

    def send_headers(self, ranks: Any) -> None:
        for r in ranks:
            if r != self.rank:
                self.send(r, K_HEADER, sig=True)

    def view(self, data: Data, like: torch.Tensor) -> torch.Tensor:
        """Received data as a tensor shaped like ``like`` (read into scratch if remote)."""
        if isinstance(data, RemoteRef):
            nbytes = like.numel() * like.element_size()
            if self.scratch is None or self.scratch.numel() < nbytes:
                self.scratch = torch.empty(nbytes, dtype=torch.uint8)
            buf = self.scratch[:nbytes]
            data.read_into(buf)
            return buf.view(like.dtype).view(like.shape)
        return _as(data, like)

    def own(self, data: Data, like: torch.Tensor) -> torch.Tensor:
        """Received data as a tensor of its own (not the shared scratch)."""
        if isinstance(data, RemoteRef):
            out = torch.empty_like(like, memory_format=torch.contiguous_format)
            data.read_into(out)
            return out
        return _as(data, like)

    def forward(self, dst: int, kind: int, a: int, b: int, data: Data, local: torch.Tensor) -> None:
        """Pass on data just received and written into ``local``: the received buffer
        itself when it came over the connection, else ``local`` (acknowledged)."""
        if isinstance(data, torch.Tensor):
            self.send(dst, kind, a, b, data=data)
        else:
            self.send(dst, kind, a, b, data=local, protect="ack")

    def copy_into(self, dst: torch.Tensor, data: Data) -> None:
        """Write received data into ``dst``."""
        if isinstance(data, RemoteRef) and dst.is_contiguous() and dst.device.type == "cpu":
            data.read_into(dst)
        else:
            dst.copy_(self.view(data, dst))

    # -- receiving ------------------------------------------------------------------
    def receive(self, src: int, kind: int, a: int, b: int, sig: bytes | None, ack: bool,
                data: Data) -> None:
        """Handle one message of this operation from global rank ``src``."""
        try:
            self._receive(src, kind, a, b, sig, ack, data)
        except Exception as exc:
            self.fail(CollectiveError(f"{self.what()}: {exc}"), exc)

    def _receive(self, src: int, kind: int, a: int, b: int, sig: bytes | None, ack: bool,
                 data: Data) -> None:
        if self.done:
            return
        if kind == K_ACK:
            self.acks_needed.discard(src)
            self._maybe_finish()
            return
        if kind == K_FAIL:
            self.fail(CollectiveError(f"{self.what()}: failed on rank {src}: {bytes(data).decode()}"))  # type: ignore[arg-type]
            return
        if sig is not None:
            if sig != self.sig_bytes:
                self.fail(self.mismatch(src, describe(pickle.loads(sig))))
                return
            self.missing.discard(src)
        if ack:
            self.acks_owed.add(src)
        if kind != K_HEADER:
            if self.missing or self.queued:
                self.queued.append((src, kind, a, b, data))
            else:
                self.on_data(src, kind, a, b, data)
        if not self.missing:
            if self.queued:
                queued, self.queued = self.queued, []
                for m in queued:
                    if self.done:
                        return
                    self.on_data(*m)
            self.check()

    def check(self) -> None:
        """Finish the data phase once validated and complete."""
        if self.done or self.data_done or self.missing or not self.data_complete():
            return
        self.data_done = True
        try:
            self.complete()
        except Exception as exc:
            self.fail(CollectiveError(f"{self.what()}: {exc}"), exc)
            return
        for r in sorted(self.acks_owed):
            self.send(r, K_ACK)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.done or not self.data_done or self.acks_needed:
            return
        self.done = True
        self.actor.forget(self)
        try:
            self.write_late()
            if self.after is not None:
                self.after()
        except Exception as exc:
            self.future.set_exception(exc)
            return
        if not self.future.done():
            self.future.set_result(self.result)

    def write_late(self) -> None:
        """Write results that had to wait for every acknowledgement (see DirectReduce)."""

    def fail(self, exc: BaseException, cause: BaseException | None = None) -> None:
        """End the operation on this rank with ``exc``."""
        if self.done:
            return
        self.done = True
        if cause is not None:
            exc.__cause__ = cause
        self.actor.forget(self)
        self.actor.arenas.skip(self.gid, self.seq)
        if not self.future.done():
            self.future.set_exception(exc)

    def mismatch(self, src: int, called: str) -> CollectiveError:
        """The error for global rank ``src`` having called ``called`` instead."""
        return CollectiveError(
            f"{self.what()}: rank {src} called {called} but rank {self.rank} called "
            f"{describe(self.sig)}; every member of the group must call the same "
            "collectives in the same order with matching tensors"
        )

    def absent(self) -> list[int]:
        """The members that have not entered this operation (as far as this rank knows)."""
        return sorted(self.missing)

    def waiting_for(self) -> str:
        if self.missing:
            return f"the signatures of ranks {self.absent()}"
        if not self.data_done:
            return "data"
        return f"acknowledgements from ranks {sorted(self.acks_needed)}"

    def what(self) -> str:
        return f"{self.sig[0]} on group {self.gid} (collective #{self.seq})"


# ---------------------------------------------------------------------------------------
# all_reduce / reduce
# ---------------------------------------------------------------------------------------
class DirectReduce(Op):
    """Small all-reduce (``root=None``) or reduce: everybody sends to everybody (or to
    the root), every receiver reduces in rank order."""

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig,
                 t: torch.Tensor, op: ReduceOp, root: int | None) -> None:
        super().__init__(actor, group, seq, sig)
        self.t = t
        self.op = op
        self.root = root
        self.parts: list[Data] = [None] * self.n
        self.got = 0
        self.receiving = root is None or root == self.rank
        self.late: torch.Tensor | None = None  # the result, while peers still read ``t``

    def start(self) -> None:
        self.send_to_root(self.t)

    def on_data(self, src: int, kind: int, a: int, b: int, data: Data) -> None:
        idx = self.members.index(src)
        self.parts[idx] = data if type(data) is bytes else self.own(data, self.t)
        self.got += 1

    def data_complete(self) -> bool:
        return not self.receiving or self.got == self.n - 1

    def complete(self) -> None:
        if not self.receiving:
            return
        t, op, me, parts = self.t, self.op, self.me, self.parts
        views = [t if i == me else self.view(p, t) if type(p) is bytes else p
                 for i, p in enumerate(parts)]
        result = views[0].clone()  # type: ignore[union-attr]
        for p in views[1:]:
            reduce_into(result, p, op)  # type: ignore[arg-type]
        finish_avg(result, op, self.n)
        if self.acks_needed:
            # Peers read ``t`` itself through CMA and may not have yet (their data can
            # complete later than ours): overwriting it now would hand them the
            # result instead of our contribution. It is written once they all acked.
            self.late = result
        else:
            t.copy_(result)

    def write_late(self) -> None:
        if self.late is not None:
            self.t.copy_(self.late)
            self.late = None


def send_tiny(worker: Any, members: tuple[int, ...], gid: int, seq: int, sig: bytes,
              flat: torch.Tensor, extra: Any = 0) -> tuple[int, Exception] | None:
    """Send a tiny all-reduce contribution to every other member at once (the first
    thing an all-reduce does, so the peers can start on it while we set up).
    ``extra`` rides along in the header (the shared-memory arena's negotiation).
    Returns the first member it could not send to, and why."""
    header = (gid, seq, K_DATA, extra, 0, sig, False, flat.numpy().tobytes())
    tell = Tell(target=MSG_TARGET, payload=Payload(pickle.dumps(header, protocol=5)))
    peers = worker.peers
    me = worker.rank
    for r in members:
        if r == me:
            continue
        peer = peers.get(r)
        try:
            if peer is not None and peer.can_send:
                peer.send(tell)
            else:
                worker.tell(r, MSG_TARGET, tell.payload)  # raises WorkerLost
        except Exception as exc:
            return r, exc
    return None


class TinyAllReduce(Op):
    """The latency path: an all-reduce of a few bytes (numpy dtype, CPU, contiguous).

    One pickled header carrying the data goes to every other member (the same bytes
    for all; ``send_tiny``, called before this object is built, so its ``start`` has
    nothing to send); the contributions are reduced in rank order straight into the
    tensor. Validation is the signature inside every message, as in DirectReduce.
    """

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig,
                 t: torch.Tensor, op: ReduceOp) -> None:
        super().__init__(actor, group, seq, sig)
        self.flat = t.view(-1)
        self.op = op
        self.parts: list[Any] = [None] * self.n
        self.got = 0
        self.extras: dict[int, Any] = {}  # the other members' ``extra`` (send_tiny)

    def receive(self, src: int, kind: int, a: int, b: int, sig: bytes | None, ack: bool,
                data: Data) -> None:
        if self.done:
            return
        if sig != self.sig_bytes or type(data) is not bytes:
            Op.receive(self, src, kind, a, b, sig, ack, data)  # reports the mismatch
            return
        self.parts[self.members.index(src)] = data
        if a:
            self.extras[src] = a
        self.got += 1
        if self.got == self.n - 1:
            self.missing.clear()
            self.check()

    def data_complete(self) -> bool:
        return self.got == self.n - 1

    def absent(self) -> list[int]:
        # (``missing`` is cleared only once every contribution is in)
        return [r for i, r in enumerate(self.members) if i != self.me and self.parts[i] is None]

    def waiting_for(self) -> str:
        return f"the contributions of ranks {self.absent()}"

    def complete(self) -> None:
        flat, dtype, me = self.flat, self.flat.dtype, self.me
        if not flat.numel():
            return  # nothing to reduce (the signatures matched: every rank's is empty)
        parts = [flat if i == me else torch.frombuffer(bytearray(p), dtype=dtype)
                 for i, p in enumerate(self.parts)]
        fn = _TORCH_OPS[self.op]
        out = flat if me <= 1 else parts[0].clone()  # ``flat`` is free once consumed
        fn(parts[0], parts[1], out=out)
        for part in parts[2:]:
            fn(out, part, out=out)
        if self.op is ReduceOp.AVG:
            out.div_(self.n)
        if out is not flat:
            flat.copy_(out)


class ArenaAllReduce(Op):
    """The tiny all-reduce through the group's shared-memory arena (``_arena``).

    The collective actor writes this rank's contribution when the slot is free, polls
    until every member's is there, and calls ``finish``: signatures are compared (every
    member sees every signature, so all fail together on a mismatch) and the
    contributions are reduced in rank order, in place in the arena, into the tensor.
    A message over the connection for this operation means its sender took another
    path (a different call): it gets our signature and the others a failure notice.
    """

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig,
                 t: torch.Tensor, op: ReduceOp, arena: Arena) -> None:
        super().__init__(actor, group, seq, sig)
        self.flat = t.view(-1)
        self.op = op
        self.arena = arena
        self.written = False
        self.ready = False  # every contribution is in the arena
        self.missing.clear()  # validation happens in the arena

    def write(self) -> None:
        self.arena.write(self.seq, self.sig_bytes, self.flat)
        self.written = True

    def finish(self) -> None:
        """Every contribution is there: validate, reduce, complete."""
        arena, sig = self.arena, self.sig_bytes
        if not arena.same_sigs(self.seq, sig):
            for r in range(self.n):
                if r != self.me and not arena.same_sig(r, self.seq, sig):
                    theirs = arena.sig(r, self.seq)
                    called = describe(pickle.loads(theirs)) if not theirs.startswith(b"#") else "another operation"
                    self.fail(self.mismatch(self.members[r], called))
                    return
        self.ready = True
        self.check()

    def data_complete(self) -> bool:
        return self.ready

    def complete(self) -> None:
        flat = self.flat
        out = flat.numpy()  # the contributions are read from the arena, so ``flat`` is free
        parts = self.arena.views(self.seq, out.dtype, out.size)
        fn = _NUMPY_OPS[self.op]
        with np.errstate(all="ignore"):  # inf and nan as torch gives them, without numpy's warnings
            fn(parts[0], parts[1], out=out)
            for part in parts[2:]:
                fn(out, part, out=out)
        if self.op is ReduceOp.AVG:
            flat.div_(self.n)

    def receive(self, src: int, kind: int, a: int, b: int, sig: bytes | None, ack: bool,
                data: Data) -> None:
        if self.done:
            return
        if kind != K_FAIL:
            # the sender runs another algorithm: a different call. Make sure it learns
            # the mismatch, and that the members waiting in the arena learn it too.
            self.send(src, K_HEADER, sig=True)
            Op.receive(self, src, kind, a, b, sig, ack, data)
            if self.done:
                text = str(self.future.exception()).encode() if not self.future.cancelled() else b"cancelled"
                for r in self.members:
                    if r not in (self.rank, src):
                        send_fail(self.worker, r, self.gid, self.seq, text)
            return
        Op.receive(self, src, kind, a, b, sig, ack, data)

    def absent(self) -> list[int]:
        if not self.written:  # a member is behind on an earlier one
            return [r for r in self.members if r != self.rank]
        return [self.members[r] for r in self.arena.missing(self.seq)]

    def waiting_for(self) -> str:
        if not self.written:
            return "a free slot in the shared-memory arena (a member is behind)"
        return f"the contributions of ranks {self.absent()} (shared memory)"


def send_fail(worker: Any, dst: int, gid: int, seq: int, text: bytes) -> None:
    """Tell ``dst`` that operation (gid, seq) failed here (best effort)."""
    send_note(worker, dst, gid, seq, K_FAIL, text)


def send_note(worker: Any, dst: int, gid: int, seq: int, kind: int, text: bytes) -> None:
    """Tell ``dst`` something about operation (gid, seq) in a text (best effort)."""
    header = (gid, seq, kind, 0, 0, None, False, text)
    with contextlib.suppress(Exception):  # a peer that is gone has nothing to learn
        worker.tell(dst, MSG_TARGET, Payload(pickle.dumps(header, protocol=5)))


class RingReduce(Op):
    """Large all-reduce: chunked, pipelined ring (reduce-scatter then all-gather).

    The flat tensor is cut into ``n`` segments, each into ``chunks`` chunks. In
    reduce-scatter step ``s`` rank ``i`` sends segment ``i - s`` to its right neighbour
    and reduces segment ``i - s - 1`` received from its left; every chunk moves on as
    soon as it is reduced, so all links stay busy. After ``n - 1`` steps rank ``i`` owns
    the total of segment ``i + 1``; the all-gather passes the totals around the ring.
    With ``root`` set (``reduce``), the owners send their segments to the root instead.
    """

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig,
                 flat: torch.Tensor, op: ReduceOp, root: int | None, chunk_bytes: int) -> None:
        super().__init__(actor, group, seq, sig)
        self.acc = flat
        self.op = op
        self.root = root
        n = self.n
        numel = flat.numel()
        itemsize = flat.element_size()
        segs = split(numel, n)
        longest = max(hi - lo for lo, hi in segs)
        self.chunks = max(1, -(-longest * itemsize // chunk_bytes))
        self.bounds = [
            [(lo + clo, lo + chi) for clo, chi in split(hi - lo, self.chunks)] for lo, hi in segs
        ]
        self.left = self.members[(self.me - 1) % n]
        self.right = self.members[(self.me + 1) % n]
        self.rs_got = 0
        self.ag_got = 0
        self.root_got = 0
        total = (n - 1) * self.chunks
        if root is None:
            self.expect = (total, total, 0)
        elif root == self.rank:
            self.expect = (total, 0, total)
        else:
            self.expect = (total, 0, 0)

    def _chunk(self, seg: int, j: int) -> torch.Tensor:
        lo, hi = self.bounds[seg][j]
        return self.acc[lo:hi]

    def start(self) -> None:
        self.send_headers(self.members)
        seg = self.me
        for j in range(self.chunks):
            self.send(self.right, K_RS, 0, j, data=self._chunk(seg, j))

    def on_data(self, src: int, kind: int, a: int, b: int, data: Data) -> None:
        n, me = self.n, self.me
        if kind == K_RS:
            seg = (me - a - 1) % n
            dst = self._chunk(seg, b)
            reduce_into(dst, self.view(data, dst), self.op)
            self.rs_got += 1
            if a < n - 2:
                self.send(self.right, K_RS, a + 1, b, data=dst)
                return
            # this rank now owns the total of segment ``seg``
            if self.root is None:
                finish_avg(dst, self.op, n)
                if n > 1:
                    self.send(self.right, K_AG, 0, b, data=dst, ack=True)
            elif self.root != self.rank:
                finish_avg(dst, self.op, n)
                self.send(self.root, K_ROOT, seg, b, data=dst)
            else:
                finish_avg(dst, self.op, n)
        elif kind == K_AG:
            seg = (me - a) % n
            dst = self._chunk(seg, b)
            self.copy_into(dst, data)
            self.ag_got += 1
            if a < n - 2:
                self.forward(self.right, K_AG, a + 1, b, data, dst)
        elif kind == K_ROOT:
            self.copy_into(self._chunk(a, b), data)
            self.root_got += 1

    def data_complete(self) -> bool:
        return (self.rs_got, self.ag_got, self.root_got) == self.expect


# ---------------------------------------------------------------------------------------
# broadcast
# ---------------------------------------------------------------------------------------
class DirectBroadcast(Op):
    """Small broadcast: the root sends to every member; the others exchange headers."""

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig,
                 t: torch.Tensor, root: int) -> None:
        super().__init__(actor, group, seq, sig)
        self.t = t
        self.root = root
        self.got = 0

    def part_for(self, index: int) -> torch.Tensor:
        """What the root sends to the member at ``index`` of the group."""
        return self.t

    def start(self) -> None:
        if self.rank == self.root:
            for i, r in enumerate(self.members):
                if r != self.rank:
                    self.send(r, K_DATA, sig=True, data=self.part_for(i), protect="clone")
        else:
            self.send_headers(self.members)

    def on_data(self, src: int, kind: int, a: int, b: int, data: Data) -> None:
        self.copy_into(self.t, data)
        self.got += 1

    def data_complete(self) -> bool:
        return self.rank == self.root or self.got == 1


class ChainBroadcast(Op):
    """Large broadcast: chunks flow root -> next -> next ... along the group, each rank
    forwarding a chunk as soon as it has it, so the root sends the tensor only once."""

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig,
                 flat: torch.Tensor, root: int, chunk_bytes: int) -> None:
        super().__init__(actor, group, seq, sig)
        self.flat = flat
        n = self.n
        ri = group.ranks.index(root)
        pos = (self.me - ri) % n
        self.is_root = pos == 0
        self.next = self.members[(self.me + 1) % n] if pos < n - 1 else None
        numel = flat.numel()
        pieces = max(1, -(-numel * flat.element_size() // chunk_bytes))
        self.bounds = split(numel, pieces)
        self.got = 0

    def start(self) -> None:
        self.send_headers(self.members)
        if self.is_root and self.next is not None:
            for j, (lo, hi) in enumerate(self.bounds):
                self.send(self.next, K_CHAIN, 0, j, data=self.flat[lo:hi], ack=True)

    def on_data(self, src: int, kind: int, a: int, b: int, data: Data) -> None:
        lo, hi = self.bounds[b]
        dst = self.flat[lo:hi]
        self.copy_into(dst, data)
        self.got += 1
        if self.next is not None:
            self.forward(self.next, K_CHAIN, 0, b, data, dst)

    def data_complete(self) -> bool:
        return self.is_root or self.got == len(self.bounds)


# ---------------------------------------------------------------------------------------
# scatter / gather / all_gather / barrier
# ---------------------------------------------------------------------------------------
class Scatter(DirectBroadcast):
    """A direct broadcast that sends each member its own part (``parts``, on the root)."""

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig,
                 t: torch.Tensor, parts: list[torch.Tensor] | None, root: int) -> None:
        super().__init__(actor, group, seq, sig, t, root)
        self.parts = parts

    def part_for(self, index: int) -> torch.Tensor:
        assert self.parts is not None
        return self.parts[index]

    def complete(self) -> None:
        if self.rank == self.root:
            assert self.parts is not None
            self.t.copy_(self.parts[self.me])


class Gather(Op):
    """gather (``root`` set) and all_gather (``root=None``): direct exchange. For
    all_gather every rank receives ``(n - 1) * size`` bytes either way, as in a ring."""

    def __init__(self, actor: CollectiveActor, group: Group, seq: int, sig: Sig,
                 t: torch.Tensor, out: list[torch.Tensor] | None, root: int | None) -> None:
        super().__init__(actor, group, seq, sig)
        self.t = t
        self.out = out
        self.root = root
        self.got = 0
        self.receiving = root is None or root == self.rank

    def start(self) -> None:
        self.send_to_root(self.t)

    def on_data(self, src: int, kind: int, a: int, b: int, data: Data) -> None:
        assert self.out is not None
        self.copy_into(self.out[self.members.index(src)], data)
        self.got += 1

    def data_complete(self) -> bool:
        return not self.receiving or self.got == self.n - 1

    def complete(self) -> None:
        if self.receiving:
            assert self.out is not None
            self.out[self.me].copy_(self.t)


class Barrier(Op):
    def start(self) -> None:
        self.send_headers(self.members)


def _as(data: torch.Tensor | bytes | None, like: torch.Tensor) -> torch.Tensor:
    """View received bytes as a tensor shaped like ``like``."""
    nbytes = like.numel() * like.element_size()
    if isinstance(data, bytes):
        if len(data) != nbytes:
            raise CollectiveError(f"expected {nbytes} bytes of data, got {len(data)}")
        return torch.frombuffer(bytearray(data), dtype=like.dtype).view(like.shape)
    if data is None:
        if nbytes:
            raise CollectiveError(f"expected {nbytes} bytes of data, got none")
        return torch.empty_like(like)
    if data.numel() != nbytes:
        raise CollectiveError(f"expected {nbytes} bytes of data, got {data.numel()}")
    return data.view(like.dtype).view(like.shape)


__all__ = [
    "Barrier",
    "TinyAllReduce",
    "send_tiny",
    "ChainBroadcast",
    "DirectBroadcast",
    "DirectReduce",
    "Gather",
    "Op",
    "RingReduce",
    "Scatter",
]
