"""Same-host peer connections over Unix domain sockets.

Loopback TCP runs every byte through the whole TCP stack: segmentation, the softirq
that delivers it to the receiving socket, acknowledgements, and socket locks both
sides contend for. A Unix domain stream socket hands the data straight to the peer's
receive queue; on a small VM a round trip of 256 KiB takes about half as long, and one
of a few bytes too. Every worker therefore also listens on an *abstract* Unix socket
(Linux: a name in the kernel, never a file, so nothing is left behind), advertises it
in the rendezvous with the identity of its host, and a peer that finds the same
identity connects there first. The handshake and everything after it are the same as
over TCP, so any failure to connect (another network namespace, a name taken) simply
falls back to TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

_identity: list[str | None] = []


def host_identity() -> str | None:
    """What two processes share when they can reach each other's abstract Unix
    sockets: the running kernel (its boot id) and the network namespace. None where
    abstract sockets do not exist."""
    if not _identity:
        value = None
        if sys.platform.startswith("linux"):
            try:
                with open("/proc/sys/kernel/random/boot_id") as f:
                    boot = f.read().strip()
                value = f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
            except OSError:
                value = None
        _identity.append(value)
    return _identity[0]


async def listen(loop: asyncio.AbstractEventLoop, factory: Callable[[], Any]) -> tuple[asyncio.Server, str] | None:
    """Serve ``factory`` protocols on a fresh abstract Unix socket: (server, its name
    without the leading NUL), or None where that is not possible."""
    if host_identity() is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        name = f"actorgrad-{os.getpid()}-{os.urandom(8).hex()}"
        sock.bind("\0" + name)
        sock.listen(1024)
        sock.setblocking(False)
        server = await loop.create_unix_server(factory, sock=sock)
    except OSError:
        sock.close()
        return None
    return server, name


async def connect(
    loop: asyncio.AbstractEventLoop, factory: Callable[[], Any], name: str, identity: str | None
) -> Any | None:
    """Connect to the abstract Unix socket ``name`` of a peer on host ``identity``; the
    protocol, or None when the peer is elsewhere or cannot be reached this way."""
    if identity is None or identity != host_identity() or not isinstance(name, str):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, "\0" + name)
        _, proto = await loop.create_unix_connection(factory, sock=sock)
    except OSError:
        with contextlib.suppress(OSError):
            sock.close()
        return None
    return proto


__all__ = ["connect", "host_identity", "listen"]
