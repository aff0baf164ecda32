"""Typed messages between the autograd actors of different workers."""

from __future__ import annotations

import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ProtocolError
from ..wire import Payload, TupleMessage

_strided = torch.strided


@dataclass(frozen=True, slots=True, kw_only=True)
class PropagateGrads(TupleMessage):
    """PROPAGATE_GRADS: gradients for the send entry ``message_id`` of a context.

    Sent by the worker that executed the matching recv; answered (with a
    :class:`BackwardReport`) once every propagation this one caused has finished.

    A worker whose part of a propagation ends in exactly one further propagation may
    hand its duty to answer along: it sends that one as a tell to ``DELEGATED``
    with ``reply`` = (caller rank, request id, rank of the worker called) and the
    report so far (``pairs``, ``fired``), and whoever finishes the work answers the
    caller directly (see ``Worker.answer``).

    ``relays`` (see :func:`pack_relays`) names sends whose gradients the worker that
    declared them would only hand on, unchanged, to the worker their tensors came
    from: the worker holding the paired recv sends them there itself (feeds its own
    matching send, when they came from it). Each worker passes on the relays it
    learned, once per peer, so they reach every worker of the pass.
    """

    TARGET = "autograd.propagate"
    DELEGATED = "autograd.propagate.delegated"
    context_id: int
    backward_id: int
    message_id: int
    grads: tuple[Any, ...]  # tensors or None; built with ``travelling``
    mode: str
    retain_graph: bool
    reply: tuple[int, int, int] | None = None
    pairs: bytes = b""  # message ids, packed (see pack_ids)
    fired: bytes = b""
    relays: bytes = b""  # see pack_relays


def pack_ids(ids: Iterable[int]) -> bytes:
    """Autograd message ids as one bytes object: pickling visits every object of a
    message, and a chain's report holds up to two ids per hop."""
    return array.array("Q", ids).tobytes()


def unpack_ids(packed: bytes) -> frozenset[int]:
    if type(packed) is not bytes or len(packed) % 8:
        raise ProtocolError("malformed autograd message ids")
    ids = array.array("Q")
    ids.frombytes(packed)
    return frozenset(ids)


# (rank that declared it, rank holding the recv paired with its send, send id, recv id,
#  rank the recv's tensors came from, recv leaves, recv leaf index per send tensor)
Relay = tuple[int, int, int, int, int, int, tuple[int, ...]]
_RELAY_FIELDS = 6


def pack_relays(relays: Iterable[Relay]) -> bytes:
    """Relays as one bytes object: per relay its six numbers, the number of the send's
    tensors and, for each, the index of the recv leaf it passes its gradient to."""
    packed = array.array("Q")
    for *fields, order in relays:
        packed.extend((*fields, len(order), *order))
    return packed.tobytes()


def unpack_relays(packed: bytes) -> list[Relay]:
    if type(packed) is not bytes or len(packed) % 8:
        raise ProtocolError("malformed autograd relays")
    values = array.array("Q")
    values.frombytes(packed)
    relays: list[Relay] = []
    at, fixed = 0, _RELAY_FIELDS
    while at < len(values):
        if at + fixed + 1 > len(values) or at + fixed + 1 + values[at + fixed] > len(values):
            raise ProtocolError("malformed autograd relays")
        count = values[at + fixed]
        origin, holder, send_id, recv_id, source, width = values[at:at + fixed]
        relays.append((origin, holder, send_id, recv_id, source, width,
                       tuple(values[at + fixed + 1:at + fixed + 1 + count])))
        at += fixed + 1 + count
    return relays


def travelling(grad: torch.Tensor | None) -> Any:
    """``grad`` as PROPAGATE_GRADS carries it: a gradient with broadcast dimensions
    (stride 0, as ``d(y.sum())/dy`` is one value expanded to y's shape) travels as its
    distinct values and is expanded again on arrival, instead of being copied out and
    sent element by element."""
    if grad is None or not is_broadcast(grad):
        return grad
    return _Broadcast(grad)


def is_broadcast(tensor: torch.Tensor) -> bool:
    """Whether elements of ``tensor`` share memory (a dimension of stride 0, expanded)."""
    if tensor.layout is not _strided:
        return False  # sparse and other layouts have no strides of their own (sparse: zeros)
    strides = tensor.stride()
    return 0 in strides and any(
        stride == 0 and size > 1 for size, stride in zip(tensor.shape, strides, strict=True))


class _Broadcast:
    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def __reduce__(self) -> tuple[Any, tuple[torch.Tensor, tuple[int, ...]]]:
        grad = self.grad
        strides = grad.stride()
        # the distinct values: size 1 along each broadcast dimension (one call; indexing
        # with a tuple of slices costs twice as much)
        distinct = grad.as_strided([1 if st == 0 else n for n, st in zip(grad.shape, strides, strict=True)], strides)
        return _expand, (distinct.contiguous(), tuple(grad.shape))


def _expand(values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return values.expand(shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class Traverse(TupleMessage):
    """TRAVERSE (SMART mode discovery): the recv of ``message_id`` is reachable from the
    roots; the worker holding the send continues the traversal from it. Answered once
    that whole sub-traversal is done, so the initiator knows when discovery ended."""

    TARGET = "autograd.traverse"
    context_id: int
    backward_id: int
    message_id: int
    retain_graph: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class BackwardReport(TupleMessage):
    """What the workers reached by a propagation know about their send/recv pairs.

    ``pairs`` holds every autograd message id recorded on those workers in this context,
    ``fired`` those that carried gradients. Ids are global, so merging is a union and
    the order in which reports arrive does not matter. Only ids travel: describing a
    pair (its tensors' shapes, where they went) is left to the rare report that finds
    one unused (see ``DESCRIBE``).
    """

    pairs: frozenset[int]
    fired: frozenset[int]

    def merge(self, other: BackwardReport) -> BackwardReport:
        return BackwardReport(pairs=self.pairs | other.pairs, fired=self.fired | other.fired)

    def dump(self, main_by_name: bool = False) -> Payload:  # (ids only: nothing goes by name)
        return Payload.dump((pack_ids(self.pairs), pack_ids(self.fired)))

    @classmethod
    def load(cls, payload: Payload) -> BackwardReport:
        values = payload.load()
        if type(values) is not tuple or len(values) != 2:
            raise ProtocolError("malformed BackwardReport message")
        return cls(pairs=unpack_ids(values[0]), fired=unpack_ids(values[1]))


DESCRIBE = "autograd.describe_pair"  # (context id, message id) -> that pair's description


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseContext(TupleMessage):
    """RELEASE_CONTEXT: drop the context here and forward to the workers it touched."""

    TARGET = "autograd.release"
    context_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareHeld(TupleMessage):
    """To a context's creator, from a worker whose only route to it was a worker that
    was lost: it holds a share, to be released with the rest (at once if it is gone)."""

    TARGET = "autograd.share_held"
    context_id: int
