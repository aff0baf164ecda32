"""TCP listening and dialing that keep libuv's thread pool unused.

uvloop looks up every host of ``create_server`` (even ``127.0.0.1``), and host names
given to ``create_connection``, with libuv's ``getaddrinfo`` on libuv's own thread
pool. libuv joins that pool's threads in an exit handler of its library, and a process
forked from ours has none of them: a child of a worker (``os.fork``) that exits the
normal way died of SIGSEGV at its very end, whatever exit status it asked for. So
addresses are looked up here, numeric ones at once and names with
``socket.getaddrinfo`` on an executor thread (Python's, which a forked child simply
does not have), and the event loop only ever gets bound sockets and numeric hosts.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Address = tuple[int, tuple[Any, ...]]  # (family, socket address: host, port[, flow, scope])


async def resolve(host: str | None, port: int, passive: bool = False) -> list[_Address]:
    """The addresses ``host`` stands for, in the resolver's order (deduplicated);
    ``passive``: for binding (None or "" is every interface).

    Raises:
        socket.gaierror: the name is unknown.
    """
    if passive and host == "":
        host = None
    flags = socket.AI_PASSIVE if passive else 0
    try:  # a numeric address (or the wildcard) needs no lookup
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags | socket.AI_NUMERICHOST)
    except socket.gaierror:
        loop = asyncio.get_running_loop()
        infos = await loop.run_in_executor(
            None, lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags))
    found: dict[_Address, None] = {}
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            found[(family, tuple(sockaddr))] = None  # (a link-local one keeps its scope)
    return list(found)


async def listen(
    host: str | None, port: int, serve: Callable[[socket.socket], Awaitable[asyncio.Server]],
) -> Listening:
    """Bind every address of ``host`` (as ``loop.create_server`` does) and serve each
    socket with ``serve`` (a ``create_server(..., sock=sock)``); closes what it bound
    when one fails.

    Raises:
        OSError: an address cannot be bound (naming it), or the name is unknown.
    """
    servers: list[asyncio.Server] = []
    addresses = await resolve(host, port, passive=True)
    if not addresses:
        raise OSError(f"{host!r} has no IPv4 or IPv6 address to listen on")
    try:
        for family, sockaddr in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # as asyncio: the IPv4 address is bound apart
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    sock.bind(sockaddr)
                except OSError as exc:
                    raise OSError(exc.errno, f"error while attempting to bind on address "
                                             f"{sockaddr[:2]!r}: {exc.strerror}") from None
                sock.setblocking(False)
                servers.append(await serve(sock))
            except BaseException:
                sock.close()
                raise
    except BaseException:
        for server in servers:
            server.close()
        raise
    return Listening(servers)


async def dial(host: str, port: int, connect: Callable[[str, int], Awaitable[T]]) -> T:
    """``connect(address, port)`` to each numeric address ``host`` stands for, in
    order, until one succeeds (as ``loop.create_connection`` tries them).

    Raises:
        OSError: no address could be reached: the first address's error when all
            failed alike (a refusal stays a ConnectionRefusedError), else one naming
            each; or ``host`` has no address.
    """
    errors: list[OSError] = []
    addresses = await resolve(host, port)
    if not addresses:
        raise OSError(f"{host!r} has no IPv4 or IPv6 address")
    for _, sockaddr in addresses:
        address = sockaddr[0]
        if len(sockaddr) == 4 and sockaddr[3]:  # a link-local IPv6 address: its interface
            address = f"{address}%{sockaddr[3]}"  # (which uvloop looks up, on its pool)
        try:
            return await connect(address, sockaddr[1])
        except OSError as exc:
            errors.append(exc)
    if len(errors) == 1 or all(type(e) is type(errors[0]) for e in errors):
        raise errors[0]
    raise OSError(f"could not connect to {host}:{port}: " + "; ".join(str(e) for e in errors)) from errors[0]


class Listening:
    """The servers of one :func:`listen`, with ``asyncio.Server``'s members in use."""

    def __init__(self, servers: list[asyncio.Server]) -> None:
        self.servers = servers

    @property
    def sockets(self) -> tuple[Any, ...]:
        return tuple(sock for server in self.servers for sock in server.sockets)

    def close(self) -> None:
        for server in self.servers:
            server.close()

    async def wait_closed(self) -> None:
        for server in self.servers:
            await server.wait_closed()


__all__ = ["Listening", "dial", "listen", "resolve"]
