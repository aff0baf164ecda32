"""Shared fixtures: groups of real workers talking over loopback sockets."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import torch

from actorgrad.testing import InProcessGroup, LocalGroup, local_group, start_in_process

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
async def make_group() -> AsyncIterator[Callable[..., Awaitable[InProcessGroup]]]:
    """``group = await make_group(n, options=None)``: n in-process workers; the test
    body acts as worker0. Every group is shut down after the test, also on failure."""
    groups: list[InProcessGroup] = []

    async def make(world_size: int = 2, options: object = None) -> InProcessGroup:
        group = await start_in_process(world_size, options)  # type: ignore[arg-type]
        groups.append(group)
        return group

    yield make
    for group in groups:
        await group.shutdown(graceful=False)


@pytest.fixture
async def group2(make_group: Callable[..., Awaitable[InProcessGroup]]) -> InProcessGroup:
    return await make_group(2)


@pytest.fixture
async def group3(make_group: Callable[..., Awaitable[InProcessGroup]]) -> InProcessGroup:
    return await make_group(3)


@pytest.fixture
async def make_process_group() -> AsyncIterator[Callable[..., Awaitable[LocalGroup]]]:
    """``group = await make_process_group(n)``: worker0 here, workers 1..n-1 in their own
    processes (so a test can kill one). Processes are always killed afterwards."""
    groups: list[LocalGroup] = []

    async def make(world_size: int = 2, options: object = None) -> LocalGroup:
        group = await local_group(world_size, options)  # type: ignore[arg-type]
        groups.append(group)
        return group

    yield make
    for group in groups:
        try:
            await group.shutdown(graceful=False, timeout=5.0)
        finally:
            for rank in range(1, len(group.processes) + 1):
                group.kill(rank)
