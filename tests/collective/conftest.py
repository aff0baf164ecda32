"""Fixtures of the collective tests: 4 in-process workers, on either backend."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import pytest
from collective_helpers import run_all

import actorgrad.collective as C
from actorgrad.testing import InProcessGroup

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(params=["actorgrad", "gloo"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def world4(make_group: Callable[..., Awaitable[InProcessGroup]], backend: str) -> InProcessGroup:
    """4 in-process workers whose default backend is ``backend``."""
    group = await make_group(4)

    async def init(rank: int) -> None:
        await C.init_process_group(backend=backend)

    await run_all(group, init)
    return group
