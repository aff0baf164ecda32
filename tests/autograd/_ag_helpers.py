"""Shared helpers of the distributed autograd and optimizer tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping

import pytest
import torch

import actorgrad as ag


def local_copies(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Detached clones that require grad: the same math runs on them in plain autograd."""
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def assert_grads(
    grads: Mapping[torch.Tensor, torch.Tensor],
    expected: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
) -> None:
    """``grads`` holds exactly the tensors of ``expected`` with a gradient, matching it."""
    expected = list(expected)
    for tensor, want in expected:
        if want is None:
            assert tensor not in grads, "a tensor the roots do not reach got a gradient"
        else:
            assert tensor in grads, f"no gradient for a tensor of shape {tuple(tensor.shape)}"
            torch.testing.assert_close(grads[tensor], want)
    wanted = {id(t) for t, g in expected if g is not None}
    assert {id(t) for t in grads} == wanted, "gradients for tensors that should have none"


def slow_backward_fn(seconds: float = 3.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> 2x`` whose backward sleeps ``seconds``: a worker busy in a backward, to
    kill or to wait on. Defined afresh on each call, so that it travels to worker
    processes by value (cloudpickle), which cannot import this test helper."""

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x * 2

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            time.sleep(seconds)
            return grad * 2

    def slow_fn(x: torch.Tensor) -> torch.Tensor:
        return SlowBackward.apply(x)

    return slow_fn


async def debug_infos(names: Iterable[str]) -> dict[str, dict[str, int]]:
    return {n: await ag.rpc_async(n, ag.autograd.debug_info) for n in names}


async def wait_released(names: Iterable[str], timeout: float = 2.0) -> None:
    """Poll debug_info until no worker of ``names`` holds a context or runs a backward."""
    names = list(names)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        infos = await debug_infos(names)
        if all(
            i["num_autograd_contexts"] == 0 and i["num_current_backward_passes"] == 0
            for i in infos.values()
        ):
            return
        if loop.time() > deadline:
            pytest.fail(f"autograd contexts not released within {timeout}s: {infos}")
        await asyncio.sleep(0.02)


async def assert_kill_fails_backward(group: object, rank: int, context_id: int, root: torch.Tensor) -> None:
    """Start the backward of ``root``, kill worker ``rank`` while it runs (a slow
    backward there keeps it busy), and check that it fails with WorkerLost in time."""
    task = asyncio.ensure_future(ag.autograd.backward(context_id, [root]))
    await asyncio.sleep(0.7)
    assert not task.done()
    started = time.monotonic()
    group.kill(rank)  # type: ignore[attr-defined]
    with pytest.raises(ag.WorkerLost):
        await asyncio.wait_for(task, 10)
    assert time.monotonic() - started < 5
