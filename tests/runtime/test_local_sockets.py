"""Workers on one host connect through Unix domain sockets; anything else uses TCP.

Every worker also listens on an abstract Unix socket and advertises it with its host's
identity. These tests look at the socket under each peer connection and check that
calls still carry the same values whichever transport is chosen.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

import actorgrad as ag
from actorgrad.runtime import _local
from actorgrad.testing import InProcessGroup, free_port

pytestmark = pytest.mark.skipif(_local.host_identity() is None, reason="no abstract Unix sockets here")


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


async def start_pair(spawn: Callable[..., Awaitable[list[Any]]], options: ag.RpcOptions | None = None) -> list[Any]:
    """Two workers on this loop (``spawn`` shuts them down after the test)."""
    method = f"tcp://127.0.0.1:{free_port()}"
    workers = await spawn([
        {"name": f"w{rank}", "rank": rank, "world_size": 2, "init_method": method, "options": options}
        for rank in range(2)
    ])
    assert all(isinstance(w, ag.runtime.Worker) for w in workers), workers
    return workers


def _families(workers: list[Any]) -> set[int]:
    return {
        peer.transport.get_extra_info("socket").family
        for worker in workers for peer in worker.peers.values()
    }


async def _round_trip(workers: list[Any]) -> None:
    """A small and a large tensor each way; the values must come back exact."""
    group = InProcessGroup(workers)
    for size in (3, 256 * 256):
        x = torch.randn(size)
        for caller, callee in ((0, "w1"), (1, "w0")):
            got = await group.run_as(caller, lambda x=x, callee=callee: ag.rpc_async(callee, add_one, args=(x,)))
            assert torch.equal(got, x + 1)


async def test_same_host_peers_use_unix_sockets(spawn):
    workers = await start_pair(spawn)
    assert _families(workers) == {socket.AF_UNIX}
    await _round_trip(workers)


async def test_local_sockets_off_uses_tcp(spawn):
    workers = await start_pair(spawn, ag.RpcOptions(local_sockets=False))
    assert _families(workers) == {socket.AF_INET}
    await _round_trip(workers)


async def test_unreachable_local_socket_falls_back_to_tcp(spawn, monkeypatch):
    listen = _local.listen

    async def listen_but_advertise_nothing_there(loop: Any, factory: Any) -> Any:
        served = await listen(loop, factory)
        assert served is not None
        return served[0], "actorgrad-no-such-socket"  # peers cannot connect there

    monkeypatch.setattr(_local, "listen", listen_but_advertise_nothing_there)
    workers = await start_pair(spawn)
    assert _families(workers) == {socket.AF_INET}
    await _round_trip(workers)


class _Keeps(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport


async def test_connects_only_to_a_peer_on_the_same_host():
    loop = asyncio.get_running_loop()
    served = await _local.listen(loop, _Keeps)
    assert served is not None
    server, name = served
    try:
        here = _local.host_identity()
        proto = await _local.connect(loop, _Keeps, name, here)
        assert proto is not None  # the same host: reachable
        proto.transport.close()
        assert await _local.connect(loop, _Keeps, name, "another-boot-id/1") is None
        assert await _local.connect(loop, _Keeps, name, None) is None
        assert await _local.connect(loop, _Keeps, "actorgrad-no-such-socket", here) is None
    finally:
        server.close()
