"""Helpers shared by the collective tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from actorgrad.collective import ReduceOp
from actorgrad.collective._actor import actor
from actorgrad.testing import InProcessGroup


async def run_all(group: InProcessGroup, body: Callable[..., Awaitable[Any]], *args: Any,
                  timeout: float = 30.0) -> list[Any]:
    """Run ``body(rank, *args)`` as every worker at once; results in rank order."""
    tasks = [group.run_as(r, body, r, *args) for r in range(len(group.workers))]
    return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout))


async def run_all_settled(group: InProcessGroup, body: Callable[..., Awaitable[Any]], *args: Any,
                          timeout: float = 30.0) -> list[Any]:
    """Like :func:`run_all`, but exceptions are returned instead of raised."""
    tasks = [group.run_as(r, body, r, *args) for r in range(len(group.workers))]
    return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout))


def tune(group: InProcessGroup, **attrs: Any) -> None:
    """Set CollectiveActor attributes (thresholds, use_cma) on every worker."""
    for w in group.workers:
        a = actor(w)
        for k, v in attrs.items():
            setattr(a, k, v)


def expected(op: ReduceOp, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The reduction of ``tensors`` computed locally, in rank order (the oracle)."""
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            out = out + t
        elif op is ReduceOp.PRODUCT:
            out = out * t
        elif op is ReduceOp.MIN:
            out = torch.minimum(out, t)
        elif op is ReduceOp.MAX:
            out = torch.maximum(out, t)
        elif op is ReduceOp.BAND:
            out = out & t
        elif op is ReduceOp.BOR:
            out = out | t
        else:
            out = out ^ t
    if op is ReduceOp.AVG:
        out = out / len(tensors)
    return out
