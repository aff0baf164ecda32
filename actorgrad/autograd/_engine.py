"""EngineActor: executes this worker's part of a distributed backward pass.

# Theory of operation
A *job* starts from some tensors and their incoming gradients: the roots (with ones) on
the worker that called ``backward``, or a send entry's tensors when a peer's
PROPAGATE_GRADS arrives. The job finds the leaves its tensors reach (``_graph``), has
torch compute all their gradients in one ``torch.autograd.grad`` call on a pool thread
(the event loop keeps serving meanwhile), accumulates user-leaf gradients in the context
and ships recv-leaf gradients to the workers that sent those tensors. A job finishes
when every propagation it caused has been answered, and a worker answers a
PROPAGATE_GRADS only when its own job has finished, so the ``backward`` call returns
exactly when all gradient propagation everywhere is done — or raises the first failure.

Gradient propagation is linear, so jobs that reach shared parts of a worker's graph may
run independently and their contributions add up; no job waits for a gradient that may
never come, and several round trips between two workers cannot deadlock. Each job runs
with ``retain_graph=True`` because a later job may traverse the same nodes; the graph is
freed when the context is released.

FAST mode follows PyTorch's contract that every send of the context receives a gradient:
each answer carries the send/recv pairs the answering worker knows and the ones that
fired, and the caller raises ContextError naming any pair that stayed silent instead of
waiting for it forever. SMART mode accepts such unused RPCs and skips them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import ContextError
from ..runtime import Worker, get_worker
from ..wire import Payload
from ._context import ContextActor, DistContext, SendEntry, context_actor
from ._graph import reachable_leaves
from ._messages import BackwardReport, PropagateGrads

_EMPTY_REPORT = BackwardReport(pairs={}, fired=frozenset())


class EngineActor:
    """Runs backward jobs and answers PROPAGATE_GRADS for this worker."""

    def __init__(self, worker: Worker, contexts: ContextActor) -> None:
        self.worker = worker
        self.contexts = contexts

    def on_propagate(self, peer: Any, payload: Payload) -> Any:
        msg: PropagateGrads = payload.load()
        ctx = self.contexts.get(msg.context_id)
        entry = ctx.sends.get(msg.message_id)
        if entry is None:
            raise ContextError(
                f"context {msg.context_id} on {self.worker.name} has no send entry "
                f"{msg.message_id} (gradients arrived for tensors this worker never sent)"
            )
        entry.fired = True

        async def run() -> Payload:
            report = await self.run_job(
                ctx, entry.tensors, list(msg.grads), msg.check_unused, entry=entry
            )
            return Payload.dump(report.merge(BackwardReport(pairs={}, fired=frozenset({msg.message_id}))))

        return run()

    async def run_job(
        self,
        ctx: DistContext,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        check_unused: bool,
        entry: SendEntry | None = None,
    ) -> BackwardReport:
        """Backpropagate ``grads`` from ``outputs`` here and everywhere it leads."""
        ctx.running_backwards += 1
        try:
            pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]

            def compute() -> tuple[list[torch.Tensor], Sequence[torch.Tensor | None]]:
                if entry is not None:
                    if entry.leaves is None:
                        entry.leaves = reachable_leaves(entry.tensors)
                    leaves = entry.leaves
                else:
                    leaves = reachable_leaves([o for o, _ in pairs])
                if not leaves or not pairs:
                    return leaves, []
                return leaves, torch.autograd.grad(
                    [o for o, _ in pairs], leaves, [g for _, g in pairs],
                    retain_graph=True, allow_unused=True,
                )

            leaves, leaf_grads = await self.worker.run_blocking(compute) if pairs else ([], [])
            outgoing: dict[int, list[torch.Tensor | None]] = {}
            for leaf, grad in zip(leaves, leaf_grads, strict=False):
                if grad is None:
                    continue
                where = ctx.recv_of_leaf.get(id(leaf))
                if where is None:
                    ctx.accumulate(leaf, grad)
                else:
                    message_id, index = where
                    slots = outgoing.setdefault(message_id, [None] * len(ctx.recvs[message_id].leaves))
                    slots[index] = grad if slots[index] is None else slots[index] + grad
            fired = frozenset(outgoing)
            report = BackwardReport(
                pairs={m: ctx.describe(m) for m in (*ctx.sends, *ctx.recvs)} if check_unused else {},
                fired=fired,
            )
            replies = []
            for message_id, slots in outgoing.items():
                recv = ctx.recvs[message_id]
                recv.fired = True
                message = PropagateGrads(
                    context_id=ctx.context_id, message_id=message_id,
                    grads=tuple(slots), check_unused=check_unused,
                )
                replies.append(self.worker.call(recv.peer, PropagateGrads.TARGET, Payload.dump(message)))
            for reply in await _all_or_first_error(replies):
                report = report.merge(reply.load())
            return report
        finally:
            ctx.running_backwards -= 1


async def _all_or_first_error(futures: list[asyncio.Future[Payload]]) -> list[Payload]:
    """Wait for all; on the first failure cancel the rest and raise it (never hang)."""
    if not futures:
        return []
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    for fut in done:
        if not fut.cancelled() and fut.exception() is not None:
            for other in pending:
                other.cancel()
            raise fut.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


def engine_actor(worker: Worker | None = None) -> EngineActor:
    worker = worker or get_worker()
    actor = worker.extensions.get("autograd.engine")
    if not isinstance(actor, EngineActor):
        raise RuntimeError("distributed autograd is not set up on this worker")
    return actor


async def backward(
    context_id: int,
    roots: Sequence[torch.Tensor],
    retain_graph: bool = False,
    mode: str | None = None,
) -> None:
    """Run the distributed backward pass of ``roots`` in context ``context_id``.

    Args:
        context_id: the id yielded by ``autograd.context()``.
        roots: local scalar tensors (losses).
        retain_graph: allow another ``backward`` in the same context; its gradients add.
        mode: ``"fast"`` (PyTorch's FAST mode: every RPC of the context must receive a
            gradient, otherwise ContextError names the unused one) or ``"smart"``
            (RPCs the roots do not use are skipped). Default: ``RpcOptions.autograd_mode``.

    Returns when every gradient propagation on every worker has finished. Gradients
    accumulate in the context (``get_gradients``), never in ``.grad``.

    Raises:
        ContextError: unknown context, bad roots, a second backward after one without
            ``retain_graph``, or (FAST mode) an RPC whose output the roots do not use.
        RemoteError / WorkerLost / RpcTimeout: a peer failed during the backward.
    """
    worker = get_worker()
    mode = mode or worker.options.autograd_mode
    if mode not in ("fast", "smart"):
        raise ValueError(f"mode must be 'fast' or 'smart', got {mode!r}")
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    roots = list(roots)
    if not roots:
        raise ContextError("backward needs at least one root tensor")
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward roots must be tensors, got {type(root).__name__}")
        if not root.requires_grad:
            raise ContextError("a backward root does not require grad and has no grad_fn")
        if root.numel() != 1:
            raise ContextError(
                f"backward roots must be scalars (got shape {tuple(root.shape)}); reduce the "
                "loss, e.g. with .sum()"
            )
    ctx = context_actor(worker).get(context_id)
    if ctx.graph_freed:
        raise ContextError(
            f"backward already ran in context {context_id} without retain_graph=True; "
            "pass retain_graph=True to the earlier call to backpropagate again"
        )
    report = await engine_actor(worker).run_job(
        ctx, roots, [torch.ones_like(r) for r in roots], check_unused=(mode == "fast")
    )
    if not retain_graph:
        ctx.graph_freed = True
    if mode == "fast":
        unused = sorted(set(report.pairs) - report.fired)
        if unused:
            first = unused[0]
            raise ContextError(
                f"FAST mode backward in context {context_id}: {len(unused)} RPC send/recv "
                f"pair(s) received no gradient, first autograd message {first} "
                f"({report.pairs[first]}). FAST mode assumes every RPC's output takes part "
                "in the loss (PyTorch would wait forever here); use "
                "backward(..., mode=\"smart\") to skip unused RPCs."
            )
