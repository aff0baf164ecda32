"""The single-walk plan for starts that share no node must equal the general passes.

``make_plan`` first tries one walk that gives up as soon as a node (other than a
leaf's AccumulateGrad) is reached from two starts; the general passes handle the rest.
Both are run here on the same local graphs and compared field by field.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest
import torch

from actorgrad.autograd import _plan
from actorgrad.autograd._context import _as_recv_output


def _general(starts: dict[Hashable, Sequence[torch.Tensor]], recv_of_leaf: dict[int, tuple[int, int]]) -> _plan.Plan:
    original = _plan._disjoint_plan
    try:
        _plan._disjoint_plan = lambda *args: None  # type: ignore[assignment]
        return _plan.make_plan(starts, recv_of_leaf, {})
    finally:
        _plan._disjoint_plan = original


def _summary(plan: _plan.Plan) -> dict[str, Any]:
    return {
        "leaves": {k: sorted(id(t) for t in f.leaves) for k, f in plan.feeds.items()},
        "recv_leaves": {k: sorted((id(t), m, i) for t, m, i in f.recv_leaves) for k, f in plan.feeds.items()},
        "stops": set(plan.stops),
        "regions": {k: {id(n) for n in nodes} for k, nodes in plan.regions.items()},
        "indegree": {id(n): d for n, d in plan.indegree.items()},
        "recvs": {m: s.pending for m, s in plan.recvs.items()},
        "targeted_by": {id(n): keys for n, keys in plan.targeted_by.items()},
    }


def _received(shape: tuple[int, ...] = (3,)) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor as a worker receives it: (the tensor with its recv function, its leaf)."""
    received = torch.rand(shape).requires_grad_()
    leaf = _as_recv_output(received)
    return received, leaf


def chain_caller() -> tuple[dict[Hashable, Sequence[torch.Tensor]], dict[int, tuple[int, int]]]:
    x = torch.rand(3, requires_grad=True)  # sent away
    y, leaf = _received()
    return {("send", 1): [x], ("roots",): [(y.sin() * 2).sum()]}, {id(leaf): (7, 0)}


def two_sends_one_leaf() -> tuple[dict[Hashable, Sequence[torch.Tensor]], dict[int, tuple[int, int]]]:
    """Two sends of values computed from the same leaf: disjoint nodes, one shared leaf."""
    w = torch.rand(3, requires_grad=True)
    return {("send", 1): [w * 2], ("send", 2): [w.exp()], ("send", 3): [w]}, {}


def one_message_two_starts() -> tuple[dict[Hashable, Sequence[torch.Tensor]], dict[int, tuple[int, int]]]:
    """Two leaves of one received message, each reached from another start."""
    (r1, l1), (r2, l2) = _received(), _received()
    return {("send", 1): [r1 * 3], ("roots",): [(r2 + 1).sum()]}, {id(l1): (9, 0), id(l2): (9, 1)}


def diamond_within_a_start() -> tuple[dict[Hashable, Sequence[torch.Tensor]], dict[int, tuple[int, int]]]:
    w = torch.rand(3, requires_grad=True)
    h = w * 2
    return {("roots",): [(h.sin() + h.cos()).sum()], ("send", 4): [w]}, {}


def shared_node() -> tuple[dict[Hashable, Sequence[torch.Tensor]], dict[int, tuple[int, int]]]:
    """A node both the roots and a send reach: only the general passes plan it."""
    w = torch.rand(3, requires_grad=True)
    h = w.exp()
    return {("roots",): [h.sum()], ("send", 2): [h * 3]}, {}


@pytest.mark.parametrize("build", [chain_caller, two_sends_one_leaf, one_message_two_starts, diamond_within_a_start])
def test_single_walk_equals_the_general_passes(build: Callable[..., Any]) -> None:
    starts, recv_of_leaf = build()
    start_edges = {k: [_plan._edge(t) for t in ts if t.requires_grad] for k, ts in starts.items()}
    fast = _plan._disjoint_plan(start_edges, recv_of_leaf, None)
    assert fast is not None
    assert _summary(fast) == _summary(_general(starts, recv_of_leaf))


def test_a_node_shared_by_two_starts_takes_the_general_passes() -> None:
    starts, recv_of_leaf = shared_node()
    start_edges = {k: [_plan._edge(t) for t in ts if t.requires_grad] for k, ts in starts.items()}
    assert _plan._disjoint_plan(start_edges, recv_of_leaf, None) is None
    plan = _plan.make_plan(starts, recv_of_leaf, {})
    assert len(plan.stops) == 1  # exp's node waits for both shares


def test_single_walk_respects_the_node_limit() -> None:
    x = torch.rand(3, requires_grad=True)
    y = x
    for _ in range(20):
        y = y * 1.5
    starts: dict[Hashable, Sequence[torch.Tensor]] = {("roots",): [y.sum()]}
    with pytest.raises(_plan.TooBig):
        _plan.make_plan(starts, {}, {}, max_nodes=10)
    assert len(_plan.make_plan(starts, {}, {}, max_nodes=30).regions[("roots",)]) == 21  # sum and 20 muls
