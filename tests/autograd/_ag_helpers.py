"""Shared helpers of the distributed autograd and optimizer tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

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
