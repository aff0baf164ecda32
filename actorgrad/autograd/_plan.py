"""Exact dependency planning of one worker's share of a distributed backward.

# Theory of operation
A worker's graph receives gradients at *starts*: the roots (on the worker that called
``backward``) and the send entries that take part (every send in FAST mode, the ones
discovery reached in SMART mode). Walking the autograd graph from all starts in
topological order, each node gets the set of starts whose gradients flow into it. A
node fed by a single start runs inside that start's ``torch.autograd.grad`` call. A node
fed by several is a *stop*: every feeding job captures its share at the node's input
(a ``GradientEdge``) without running it, and once the last share is in, the node runs
as a start of its own, exactly once, with the summed gradient. Recv leaves fed by
several starts wait the same way, so each recv sends its gradients exactly once.

Within one job torch would run a stop node (and everything between it and the target)
if another of the job's targets lay beyond it: a leaf that the job reaches directly and
also through the stop, say. Such a target is *shadowed*. The plan avoids it: the job's
own parents of a shadowed target become stops with a single feeder (the job captures
their inputs and they run as starts of their own, right after it), and planning is
repeated until no job has a shadowed target. A start with a direct edge to a shadowed
target (a send whose tensors include the leaf, a stop that feeds it directly) has no
parent to split at: there a node pre-hook blanks the stop's gradient inside the job
that merely feeds it (captures happen before pre-hooks), so its share is counted once,
when it runs, although torch still calls the nodes behind it with zero gradients
(a known gap, covered by a strict xfail test).

Most graphs have no node (other than a leaf's AccumulateGrad) that two starts reach:
then there is no stop and nothing to split, and a single walk gives the plan. The
passes above run only when that walk meets a node a second start reaches.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._errors import ContextError

_suppressed = threading.local()


def _blank_if_suppressed(node: Any) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[None, ...] | None:
        if node in getattr(_suppressed, "nodes", ()):
            return tuple(None for _ in grad_outputs)
        return None

    return hook


class suppressing:  # noqa: N801 - used as a context manager
    """Within the block, on this thread, the given stop nodes propagate nothing."""

    def __init__(self, nodes: frozenset[Any]) -> None:
        self.nodes = nodes

    def __enter__(self) -> None:
        self._saved: frozenset[Any] = getattr(_suppressed, "nodes", frozenset())
        _suppressed.nodes = self.nodes

    def __exit__(self, *exc: object) -> None:
        _suppressed.nodes = self._saved


@dataclass(slots=True, eq=False)
class Stop:
    """A node (or recv entry) that waits for the shares of several starts."""

    pending: int
    slots: tuple[int, ...] = ()
    grads: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Feeds:
    """What one start's job delivers gradients to."""

    leaves: list[torch.Tensor] = field(default_factory=list)
    recv_leaves: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # leaf, msg, i
    stops: list[Any] = field(default_factory=list)  # nodes

    def inputs(self, plan: Plan) -> list[torch.Tensor | GradientEdge]:
        targets: list[torch.Tensor | GradientEdge] = [*self.leaves]
        targets.extend(leaf for leaf, _, _ in self.recv_leaves)
        for node in self.stops:
            targets.extend(GradientEdge(node, slot) for slot in plan.stops[node].slots)
        return targets


@dataclass(slots=True, eq=False)
class Plan:
    feeds: dict[Hashable, Feeds]
    stops: dict[Any, Stop]
    regions: dict[Hashable, list[Any]]  # start -> the nodes its torch call runs (for traces)
    indegree: dict[Any, int]  # node -> number of gradient edges into it (for pictures)
    recvs: dict[int, Stop]  # message id -> pending shares and summed grads (by leaf index)
    targeted_by: dict[Any, set[Hashable]] = field(default_factory=dict)  # leaf/stop node -> jobs


_is_grad_enabled = torch.is_grad_enabled


def _edge(tensor: torch.Tensor | GradientEdge) -> tuple[Any, int]:
    if isinstance(tensor, GradientEdge):  # a send's tensor changed in place since it was sent
        return tensor.node, tensor.output_nr
    node = tensor.grad_fn
    if node is not None:  # computed: its own node (get_gradient_edge adds only checks)
        return node, tensor.output_nr
    if _is_grad_enabled():  # a leaf: its AccumulateGrad, found as get_gradient_edge does
        return tensor.view_as(tensor).grad_fn.next_functions[0]  # type: ignore[union-attr]
    edge = get_gradient_edge(tensor)  # (which turns grad mode on for the view)
    return edge.node, edge.output_nr


_MAX_REPLANS = 8  # planning passes at most; shadowed targets left after them: pre-hook


class TooBig(Exception):
    """The graph has more nodes than the caller wanted to plan on its own thread."""


def make_plan(
    starts: dict[Hashable, Sequence[torch.Tensor | GradientEdge]],
    recv_of_leaf: dict[int, tuple[int, int]],
    hooked: dict[Any, Any],
    max_nodes: int | None = None,
) -> Plan:
    """Plan the jobs for ``starts`` (key -> tensors receiving the start's gradients, or
    the edges of tensors changed since; see ``SendEntry.starts``).

    ``hooked`` maps nodes that already carry the suppression pre-hook to its handle; new
    stop nodes get the hook and are added. Raises TooBig, before changing anything, when
    the graph has more than ``max_nodes`` nodes.
    """
    start_edges = {key: [_edge(t) for t in tensors if isinstance(t, GradientEdge) or t.requires_grad]
                   for key, tensors in starts.items()}
    disjoint = _disjoint_plan(start_edges, recv_of_leaf, max_nodes)
    if disjoint is not None:
        return disjoint
    # 1. the reached subgraph and the in-degree of every node in it
    indegree: dict[Any, int] = {}
    stack = []
    for edges in start_edges.values():
        for node, _ in edges:
            if node not in indegree:
                indegree[node] = 0
                stack.append(node)
            indegree[node] += 1
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in indegree:
                indegree[child] = 0
                stack.append(child)
            indegree[child] += 1
        if max_nodes is not None and len(indegree) > max_nodes:
            raise TooBig
    forced: set[Any] = set()
    for _ in range(_MAX_REPLANS):
        plan = _assign(start_edges, dict(indegree), recv_of_leaf, hooked, forced)
        more = _split_points(plan) - forced
        if not more:
            break
        forced |= more
    return plan


# Every recv leaf ("anchor") ever made, weakly: one that a context does not know came
# from another context (or a released one), and its gradient cannot go back from here.
recv_anchors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # by id


def _deliver_to_leaf(
    variable: torch.Tensor, keys: Iterable[Hashable], feeds: dict[Hashable, Feeds],
    recv_of_leaf: dict[int, tuple[int, int]], recv_sources: dict[int, set[Hashable]],
) -> None:
    """The jobs of ``keys`` deliver to the leaf ``variable``: a user leaf, or a recv
    leaf whose entry then waits for those jobs' shares."""
    where = recv_of_leaf.get(id(variable))
    if where is None and recv_anchors.get(id(variable)) is variable:
        raise ContextError(
            "the graph being differentiated reaches a tensor received by an RPC of another "
            "distributed autograd context (or of one already left): its gradient cannot "
            "travel back through this one; compute the roots from this context's RPCs. "
            "(In this context, it may be the argument of a call that failed or was given "
            "up on here, which made RPCs of its own before it ended: they stay in the "
            "context, and mode=\"smart\" leaves them out.)"
        )
    for key in keys:
        if where is None:
            feeds[key].leaves.append(variable)
        else:
            feeds[key].recv_leaves.append((variable, where[0], where[1]))
    if where is not None:
        recv_sources.setdefault(where[0], set()).update(keys)


def _disjoint_plan(
    start_edges: dict[Hashable, list[tuple[Any, int]]],
    recv_of_leaf: dict[int, tuple[int, int]],
    max_nodes: int | None,
) -> Plan | None:
    """The plan in a single walk when no node other than a leaf's AccumulateGrad is
    reached from two starts (the common case: then there are no stops, and nothing to
    split); None as soon as one is.

    Raises TooBig like ``make_plan``. The result equals what the general passes make
    (leaves and regions may be listed in another order, which nothing depends on).
    """
    owner: dict[Any, Hashable] = {}
    indegree: dict[Any, int] = {}
    feeds: dict[Hashable, Feeds] = {}
    regions: dict[Hashable, list[Any]] = {}
    targeted_by: dict[Any, set[Hashable]] = {}
    recv_sources: dict[int, set[Hashable]] = {}
    for key, edges in start_edges.items():
        region = list[Any]()
        feeds[key], regions[key] = Feeds(), region
        stack = [None]  # the start's own edges first, then the nodes they lead to
        while stack:
            node = stack.pop()
            if node is None:
                children: Any = edges
            else:
                region.append(node)
                children = node.next_functions
            for child, _ in children:
                if child is None:
                    continue
                indegree[child] = indegree.get(child, 0) + 1
                variable = getattr(child, "variable", None)
                if variable is not None:  # AccumulateGrad: a user leaf or a recv leaf
                    targets = targeted_by.setdefault(child, set())
                    if key in targets:
                        continue
                    targets.add(key)  # several starts may deliver to one leaf
                    _deliver_to_leaf(variable, (key,), feeds, recv_of_leaf, recv_sources)
                elif child not in owner:
                    owner[child] = key
                    stack.append(child)
                elif owner[child] != key:
                    return None  # fed by two starts: a stop, the general passes
            if max_nodes is not None and len(owner) + len(targeted_by) > max_nodes:
                raise TooBig
    return Plan(
        feeds=feeds,
        stops={},
        regions=regions,
        indegree=indegree,
        recvs={msg: Stop(pending=len(keys)) for msg, keys in recv_sources.items()},
        targeted_by=targeted_by,
    )


def _assign(
    start_edges: dict[Hashable, list[tuple[Any, int]]],
    indegree: dict[Any, int],
    recv_of_leaf: dict[int, tuple[int, int]],
    hooked: dict[Any, Any],
    forced: set[Any],
) -> Plan:
    """The topological pass: which starts feed each node; several (or ``forced``) -> a stop."""
    total_indegree = dict(indegree)
    regions: dict[Hashable, list[Any]] = {key: [] for key in start_edges}
    sources: dict[Any, set[Hashable]] = {}
    slots: dict[Any, set[int]] = {}
    ready = []

    def feed(node: Any, slot: int, keys: set[Hashable]) -> None:
        sources.setdefault(node, set()).update(keys)
        slots.setdefault(node, set()).add(slot)
        indegree[node] -= 1
        if indegree[node] == 0:
            ready.append(node)

    for key, edges in start_edges.items():
        for node, slot in edges:
            feed(node, slot, {key})
    feeds: dict[Hashable, Feeds] = {key: Feeds() for key in start_edges}
    stops: dict[Any, Stop] = {}
    recv_sources: dict[int, set[Hashable]] = {}
    targeted_by: dict[Any, set[Hashable]] = {}  # leaf or stop node -> the jobs that target it
    while ready:
        node = ready.pop()
        keys = sources[node]
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a user leaf or a recv leaf
            targeted_by[node] = set(keys)
            _deliver_to_leaf(variable, keys, feeds, recv_of_leaf, recv_sources)
            continue
        if len(keys) > 1 or node in forced:
            targeted_by[node] = set(keys)
            stops[node] = Stop(pending=len(keys), slots=tuple(sorted(slots[node])))
            for key in keys:
                feeds[key].stops.append(node)
            if node not in hooked:
                hooked[node] = node.register_prehook(_blank_if_suppressed(node))
            feeds[node] = Feeds()
            regions[node] = []
            keys = {node}
        for key in keys:
            regions[key].append(node)
        for child, slot in node.next_functions:
            if child is not None:
                feed(child, slot, keys)
    return Plan(
        feeds=feeds,
        stops=stops,
        regions=regions,
        indegree=total_indegree,
        recvs={msg: Stop(pending=len(keys)) for msg, keys in recv_sources.items()},
        targeted_by=targeted_by,
    )


def _split_points(plan: Plan) -> set[Any]:
    """Nodes to turn into stops so that no job has a shadowed target.

    A target of job J is shadowed when a job downstream of one of J's stops targets it
    too: torch would then run that stop inside J. J's own parents of the target (the
    nodes of J's region with an edge to it) are where J should stop instead. A start
    with a direct edge to a shadowed target has no such parent: left to the pre-hook.
    """
    points: set[Any] = set()
    for key, feeds in plan.feeds.items():
        if not feeds.stops:
            continue
        below: set[Hashable] = set()  # the jobs downstream of J's stops
        pending = list(feeds.stops)
        while pending:
            stop = pending.pop()
            if stop not in below:
                below.add(stop)
                pending.extend(plan.feeds[stop].stops)
        shadowed = {node for node, jobs in plan.targeted_by.items() if key in jobs and jobs & below}
        if shadowed:
            for node in plan.regions[key]:
                if any(child in shadowed for child, _ in node.next_functions):
                    points.add(node)
    return points


def reached_recvs(
    tensors: Sequence[torch.Tensor | GradientEdge], recv_of_leaf: dict[int, tuple[int, int]], max_nodes: int | None = None
) -> set[int]:
    """Message ids of the recv entries whose leaves ``tensors`` reach (for discovery).

    Raises TooBig when the graph has more than ``max_nodes`` nodes."""
    from ._graph import TooManyNodes, reachable_leaves

    try:
        leaves = reachable_leaves(tensors, max_nodes)
    except TooManyNodes:
        raise TooBig from None
    found = set()
    for leaf in leaves:
        where = recv_of_leaf.get(id(leaf))
        if where is not None:
            found.add(where[0])
    return found
