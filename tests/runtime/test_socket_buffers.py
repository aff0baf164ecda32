"""Peer connections get the kernel buffer size RpcOptions asks for."""

from __future__ import annotations

import socket

import pytest

import actorgrad as ag


def _system_max(name: str) -> int:
    with open(f"/proc/sys/net/core/{name}") as f:
        return int(f.read())


def _peer_socket(worker: object) -> socket.socket:
    (peer,) = worker.peers.values()  # type: ignore[attr-defined]
    return peer.transport.get_extra_info("socket")


@pytest.mark.parametrize("size", [1 << 20, 3 << 20])
async def test_connections_use_the_requested_buffers(make_group, size):
    group = await make_group(2, ag.RpcOptions(socket_buffer_bytes=size))
    for worker in group.workers:
        sock = _peer_socket(worker)
        # Linux doubles the value (bookkeeping) and caps it at the system maximum
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(size, _system_max("wmem_max"))
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= min(size, _system_max("rmem_max"))


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="socket_buffer_bytes"):
        ag.RpcOptions(socket_buffer_bytes=-1)
