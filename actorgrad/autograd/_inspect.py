"""The distributed autograd graph of a context, as data and as a Graphviz picture.

Each worker describes its share: the autograd nodes reachable from its send entries
(and from given roots), its recv leaves, and how many gradient edges enter each node
(the dependency counts of the FAST-mode plan). Send and recv entries with the same
message id are joined across workers: the edge that gradients travel over RPC.
"""

from __future__ import annotations

import asyncio
import collections.abc
import shutil
import subprocess
from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..runtime import Worker, get_worker, run_sync
from ..wire import Payload
from ._context import RecvRpcBackward, context_actor, root_tensors
from ._plan import make_plan

_TARGET = "autograd.describe"


@dataclass
class DistGraph:
    """Nodes (per worker) and edges of a context's distributed autograd graph.

    ``nodes``: id -> {"worker", "label", "kind" ("op", "leaf", "recv", "send", "root"),
    "deps"}; ``edges``: (from, to, kind) in the direction gradients flow; kind "rpc" for
    the send/recv joins between workers.
    """

    context_id: int
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    edges: list[tuple[str, str, str]] = field(default_factory=list)

    def to_dot(self) -> str:
        """Graphviz DOT: one cluster per worker, RPC edges dashed."""
        lines = [f'digraph "context {self.context_id}" {{', "  rankdir=TB;",
                 '  node [fontname="Helvetica", fontsize=10];']
        shapes = {"op": "box", "leaf": "ellipse", "recv": "invhouse", "send": "house", "root": "doubleoctagon"}
        colors = {"op": "white", "leaf": "lightblue", "recv": "khaki", "send": "palegreen", "root": "salmon"}
        workers = sorted({n["worker"] for n in self.nodes.values()})
        for i, worker in enumerate(workers):
            lines.append(f'  subgraph "cluster_{i}" {{')
            lines.append(f'    label="{_dot_text(worker)}"; style=rounded; color=gray;')
            for node_id, node in self.nodes.items():
                if node["worker"] != worker:
                    continue
                deps = f"\\n({node['deps']})" if node.get("deps") is not None else ""
                lines.append(
                    f'    "{_dot_text(node_id)}" [label="{_dot_text(node["label"])}{deps}", '
                    f'shape={shapes[node["kind"]]}, style=filled, fillcolor={colors[node["kind"]]}];'
                )
            lines.append("  }")
        for src, dst, kind in self.edges:
            style = ' [style=dashed, color=blue, label="rpc"]' if kind == "rpc" else ""
            lines.append(f'  "{_dot_text(src)}" -> "{_dot_text(dst)}"{style};')
        lines.append("}")
        return "\n".join(lines)

    def render(self, path: str, format: str = "png") -> str:
        """Write the picture with Graphviz's ``dot`` (when installed); returns ``path``."""
        dot = shutil.which("dot")
        if dot is None:
            raise RuntimeError("Graphviz `dot` is not installed; use to_dot() and render elsewhere")
        subprocess.run([dot, f"-T{format}", "-o", path], input=self.to_dot().encode(), check=True)
        return path


def _dot_text(text: str) -> str:
    """``text`` for the inside of a DOT quoted string (worker names may hold quotes
    and backslashes)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _message_label(message_id: int) -> str:
    """``rank.counter``: the worker that minted the id and its sequence number."""
    return f"{message_id >> 48}.{message_id & ((1 << 48) - 1)}"


_RECV_FUNCTION = f"{RecvRpcBackward.__name__}Backward"


def _past_recv_function(node: Any) -> Any:
    """A received tensor's own function (an identity that hands its gradient to the
    recv leaf) drawn as that recv, as torch's graph has one recv node."""
    if node.name() == _RECV_FUNCTION:
        for child, _ in node.next_functions:
            if child is not None:
                return child
    return node


def describe_local(worker: Worker, context_id: int, roots: Sequence[torch.Tensor] = ()) -> dict[str, Any]:
    """This worker's share of the graph as plain data (sent to the collecting worker)."""
    ctx = context_actor(worker).get(context_id)
    me = worker.name
    starts: dict[Hashable, Sequence[Any]] = {("send", m): e.starts() for m, e in ctx.sends.items()}
    if roots:
        starts[("roots",)] = list(roots)
    plan = make_plan(starts, ctx.recv_of_leaf, ctx.hooked)
    ids: dict[Any, str] = {}
    nodes: dict[str, dict[str, Any]] = {}
    edges: list[tuple[str, str, str]] = []
    drawn_for: dict[Any, Any] = {}  # recv leaf node -> the identity function it stands for

    def drawn(node: Any) -> Any:
        shown = _past_recv_function(node)
        if shown is not node:
            drawn_for[shown] = node
        return shown

    def deps(node: Any) -> int | None:
        count = plan.indegree.get(node)
        identity = drawn_for.get(node)
        if identity is None or count is None:
            return count
        # the edges into the identity, plus any straight into the leaf besides its own
        return plan.indegree.get(identity, 0) + count - 1

    def node_id(node: Any) -> str:
        if node not in ids:
            ids[node] = f"{me}:{len(ids)}"
            variable = getattr(node, "variable", None)
            where = ctx.recv_of_leaf.get(id(variable)) if variable is not None else None
            if where is not None:
                label, kind = f"recv {_message_label(where[0])}", "recv"
            elif variable is not None:
                label, kind = f"leaf {tuple(variable.shape)}", "leaf"
            else:
                label, kind = node.name(), "op"
            nodes[ids[node]] = {"worker": me, "label": label, "kind": kind,
                                "deps": deps(node), "message": where[0] if where else None}
        return ids[node]

    seen: set[Any] = set()
    stack: list[Any] = []
    for key, tensors in starts.items():
        assert isinstance(key, tuple)
        if key[0] == "send":
            start_id = f"{me}:send{key[1]}"
            nodes[start_id] = {"worker": me, "label": f"send {_message_label(key[1])}", "kind": "send",
                               "deps": None, "message": key[1]}
        else:
            start_id = f"{me}:roots"
            nodes[start_id] = {"worker": me, "label": "roots", "kind": "root", "deps": None, "message": None}
        for tensor in tensors:
            if type(tensor) is torch.autograd.graph.GradientEdge:  # changed since sent
                node = tensor.node
            elif not tensor.requires_grad:
                continue
            else:
                node = tensor.grad_fn or torch.autograd.graph.get_gradient_edge(tensor).node
            node = drawn(node)
            edges.append((start_id, node_id(node), "local"))
            if node not in seen:
                seen.add(node)
                stack.append(node)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            child = drawn(child)
            edges.append((node_id(node), node_id(child), "local"))
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return {"nodes": nodes, "edges": edges, "peers": sorted(ctx.peers)}


def install(worker: Worker) -> None:
    def describe(peer: Any, payload: Payload) -> Payload:
        return Payload.dump(describe_local(worker, payload.load()))

    worker.register(_TARGET, describe)


def graph(context_id: int, roots: Sequence[torch.Tensor] = ()) -> GraphQuery:
    """The context's graph, collected from every worker that took part (transitively):
    ``await ag.autograd.graph(cid)`` gives the :class:`DistGraph`.

    Pass ``roots`` (e.g. ``[loss]``) to include the part of this worker's graph that
    only the loss reaches.
    """
    return GraphQuery(get_worker(), context_id, tuple(root_tensors(roots, "graph")))


class GraphQuery(collections.abc.Coroutine[Any, Any, DistGraph]):
    """What :func:`graph` returns: a coroutine of the graph (await it, or make it a
    task), or, used as the graph (``graph(cid).to_dot()``), collected where blocking
    calls work (a script, a thread, Jupyter and other asyncio loops, like
    ``rpc_sync``); collected once."""

    def __init__(self, worker: Worker, context_id: int, roots: tuple[torch.Tensor, ...]) -> None:
        self._worker, self._context_id, self._roots = worker, context_id, roots
        self._graph: DistGraph | None = None
        self._running: Any = None  # the coroutine a task (or an await) drives

    def _coroutine(self) -> Any:
        if self._running is None:
            self._running = self._collected()
        return self._running

    def __await__(self) -> Generator[Any, None, DistGraph]:
        return self._coroutine().__await__()

    def send(self, value: Any) -> Any:
        return self._coroutine().send(value)

    def throw(self, *exc: Any) -> Any:
        return self._coroutine().throw(*exc)

    def close(self) -> None:
        if self._running is not None:
            self._running.close()

    async def _collected(self) -> DistGraph:
        if self._graph is None:
            self._graph = await _collect(self._worker, self._context_id, self._roots)
        return self._graph

    if TYPE_CHECKING:  # used as the graph: DistGraph's names (served by __getattr__)
        context_id: int
        nodes: dict[str, dict[str, Any]]
        edges: list[tuple[str, str, str]]

        def to_dot(self) -> str: ...

        def render(self, path: str, format: str = "png") -> str: ...

    def __getattr__(self, name: str) -> Any:
        if name not in _GRAPH_NAMES:  # e.g. asyncio asking a coroutine for cr_frame
            raise AttributeError(name)
        if self._graph is None:
            worker = self._worker
            try:
                self._graph = run_sync(worker, lambda: worker.loop.create_task(self._collected()))
            except RuntimeError as exc:
                if "cannot be re-entered" not in str(exc):
                    raise
                raise RuntimeError(
                    f"graph(context_id).{name} collects the graph from every worker, which "
                    "a coroutine on the worker's uvloop loop cannot wait for in a blocking "
                    f"call: write `(await ag.autograd.graph(context_id)).{name}`"
                ) from None
        return getattr(self._graph, name)


_GRAPH_NAMES = frozenset(
    {name for name in dir(DistGraph) if not name.startswith("_")} | {"nodes", "edges", "context_id"}
)


async def _collect(worker: Worker, context_id: int, roots: Sequence[torch.Tensor]) -> DistGraph:
    result = DistGraph(context_id)
    parts = {worker.rank: describe_local(worker, context_id, roots)}
    frontier = set(parts[worker.rank]["peers"]) - set(parts)
    while frontier:
        ranks = sorted(frontier)
        replies = await asyncio.gather(
            *(worker.call(r, _TARGET, Payload.dump(context_id)) for r in ranks), return_exceptions=True
        )
        for rank, reply in zip(ranks, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply  # a graph missing a worker's share would look whole
            parts[rank] = reply.load()
        frontier = {p for part in parts.values() for p in part["peers"]} - set(parts)
    by_message: dict[int, dict[str, list[str]]] = {}
    for part in parts.values():
        result.nodes.update(part["nodes"])
        result.edges.extend(tuple(e) for e in part["edges"])
        for node_id, node in part["nodes"].items():
            if node["message"] is not None and node["kind"] in ("recv", "send"):
                by_message.setdefault(node["message"], {}).setdefault(node["kind"], []).append(node_id)
    for ends in by_message.values():
        for recv in ends.get("recv", []):
            for send in ends.get("send", []):
                result.edges.append((recv, send, "rpc"))
    return result
