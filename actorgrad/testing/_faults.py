"""Fault scenarios: SIGKILL a worker at a given stage and see what the survivors get.

Used by the reliability tests and by ``scripts/reliability_report.py``. Each scenario
runs on a fresh ``local_group(3)``: this process is worker0, worker1 is killed,
worker2 survives alongside worker0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ActorgradError
from ..autograd import backward, context, debug_info
from ..optim import DistributedOptimizer
from ..rpc import remote, rpc_async
from ..runtime import RpcOptions
from ._group import LocalGroup, local_group

# What a survivor must see: the peer is gone (also when another worker reports it, and
# as CollectiveRankLost in a collective), or the call timed out.
SURVIVOR_ERRORS = frozenset({"WorkerLost", "RpcTimeout", "CollectiveRankLost"})
KILL_AFTER = 0.5


class SlowBackward(torch.autograd.Function):
    """Identity forward; sleeps in backward (a long local backward on the victim)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


def slow_backward_op(x: torch.Tensor, seconds: float) -> torch.Tensor:
    return SlowBackward.apply(x, seconds) * 2


def make_parameter() -> torch.Tensor:
    return torch.ones(4, requires_grad=True)


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes long (the victim dies in the middle of it)."""

    def step(self, closure: Any = None) -> Any:
        time.sleep(30)
        return super().step(closure)


@dataclass
class Outcome:
    stage: str
    error: str  # exception type the survivor saw, or "none"
    seconds: float  # from the kill to the error
    survivors_clean: bool  # no contexts or backward passes left on worker0 and worker2
    shutdown_seconds: float

    @property
    def ok(self) -> bool:
        return self.error in SURVIVOR_ERRORS and self.seconds < 10 \
            and self.survivors_clean and self.shutdown_seconds < 15


async def _kill_while(group: LocalGroup, work: Awaitable[Any]) -> tuple[str, float]:
    task = asyncio.ensure_future(work)
    await asyncio.sleep(KILL_AFTER)
    group.kill(1)
    killed = time.monotonic()
    try:
        async with asyncio.timeout(20):
            await task
    except ActorgradError as exc:  # recorded; only SURVIVOR_ERRORS count as ok
        return type(exc).__name__, time.monotonic() - killed
    except TimeoutError:
        return "hang", time.monotonic() - killed
    return "none", time.monotonic() - killed


async def _forward(group: LocalGroup) -> tuple[str, float]:
    return await _kill_while(group, rpc_async("worker1", time.sleep, args=(30,)))


async def _backward(group: LocalGroup, mode: str) -> tuple[str, float]:
    x = torch.rand(4, requires_grad=True)
    async with context() as cid:
        y = await rpc_async("worker1", slow_backward_op, args=(x, 30.0))
        z = await rpc_async("worker2", torch.sin, args=(y,))
        return await _kill_while(group, backward(cid, [z.sum()], mode=mode))


async def _optimizer_step(group: LocalGroup) -> tuple[str, float]:
    param = remote("worker1", make_parameter)
    optimizer = DistributedOptimizer(SlowSGD, [param], lr=0.1)
    async with context() as cid:
        value = await param.to_here()
        await backward(cid, [(value * 3).sum()])
        return await _kill_while(group, optimizer.step(cid))


async def _shutdown(group: LocalGroup) -> tuple[str, float]:
    busy = rpc_async("worker1", time.sleep, args=(30,))  # keeps graceful shutdown waiting
    outcome = await _kill_while(group, busy)
    return outcome


async def _all_reduce(group: LocalGroup) -> tuple[str, float]:
    from .. import collective

    async def here() -> None:
        await collective.all_reduce(torch.ones(1 << 20))

    async def on_worker2() -> None:
        _ = await rpc_async("worker2", _all_reduce_remote)  # an async function: awaited there

    return await _kill_while(group, asyncio.gather(here(), on_worker2()))


async def _all_reduce_remote() -> None:
    from .. import collective

    await collective.all_reduce(torch.ones(1 << 20))


STAGES: dict[str, Callable[[LocalGroup], Awaitable[tuple[str, float]]]] = {
    "forward RPC": _forward,
    "backward (FAST)": lambda g: _backward(g, "fast"),
    "backward (SMART)": lambda g: _backward(g, "smart"),
    "DistributedOptimizer.step": _optimizer_step,
    "all-reduce": _all_reduce,
    "graceful shutdown": _shutdown,
}


async def _clean(rank: int) -> bool:
    for _ in range(30):
        info = debug_info() if rank == 0 else await rpc_async(f"worker{rank}", debug_info, timeout=5)
        if info["num_autograd_contexts"] == 0 and info["num_current_backward_passes"] == 0:
            return True
        await asyncio.sleep(0.1)
    return False


async def run_stage(stage: str) -> Outcome:
    """Run one scenario on a fresh group of three and shut the survivors down."""
    group = await local_group(3, RpcOptions(rpc_timeout=30, shutdown_timeout=10))
    try:
        if stage == "graceful shutdown":
            # the kill lands while worker0 is already inside its graceful shutdown
            busy = asyncio.ensure_future(rpc_async("worker1", time.sleep, args=(30,)))
            start = time.monotonic()
            stopping = asyncio.ensure_future(group.shutdown(graceful=True, timeout=10))
            await asyncio.sleep(KILL_AFTER)
            group.kill(1)
            killed = time.monotonic()
            try:
                await busy
                error = "none"
            except ActorgradError as exc:  # recorded; only SURVIVOR_ERRORS count as ok
                error = type(exc).__name__
            seconds = time.monotonic() - killed
            await stopping
            return Outcome(stage, error, seconds, True, time.monotonic() - start)
        error, seconds = await STAGES[stage](group)
        clean = await _clean(0) and await _clean(2)
        start = time.monotonic()
        await group.shutdown(graceful=True, timeout=10)
        return Outcome(stage, error, seconds, clean, time.monotonic() - start)
    finally:
        for rank in (1, 2):
            group.kill(rank)
        await group.shutdown(graceful=False, timeout=2)
