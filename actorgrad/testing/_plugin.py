"""The actorgrad pytest plugin (registered through the ``pytest11`` entry point).

Fixtures:
    actorgrad_group: a fresh group of in-process workers talking over real loopback
        sockets; the test body runs as ``worker0``, so ``await ag.rpc_async("worker1",
        ...)`` just works. Its size comes from ``@pytest.mark.world_size(n)`` (default
        2). The group is shut down after the test, also when the test fails.
    actorgrad_process_group: the same with workers 1..n-1 in their own processes (for
        tests that kill a worker, or need separate interpreters).

The plugin never runs coroutines itself: pytest-asyncio does, in strict or auto mode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from ._group import InProcessGroup, LocalGroup, local_group, start_in_process


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "world_size(n): number of workers of the actorgrad_group fixture (default 2)"
    )


def _world_size(request: pytest.FixtureRequest) -> int:
    marker = request.node.get_closest_marker("world_size")
    if marker is None:
        return 2
    size = marker.args[0] if marker.args else marker.kwargs.get("n", 2)
    if not isinstance(size, int) or size < 1:
        raise pytest.UsageError(f"@pytest.mark.world_size needs a positive int, got {size!r}")
    return size


@pytest_asyncio.fixture
async def actorgrad_group(request: pytest.FixtureRequest) -> AsyncIterator[InProcessGroup]:
    """In-process workers ``worker0``..; the test body acts as ``worker0``."""
    group = await start_in_process(_world_size(request))
    try:
        yield group
    finally:
        await group.shutdown(graceful=False)


@pytest_asyncio.fixture
async def actorgrad_process_group(request: pytest.FixtureRequest) -> AsyncIterator[LocalGroup]:
    """``worker0`` in this process, the other workers in their own processes."""
    group = await local_group(_world_size(request))
    try:
        yield group
    finally:
        try:
            await group.shutdown(graceful=False, timeout=5.0)
        finally:
            for rank in range(1, len(group.processes) + 1):
                group.kill(rank)
