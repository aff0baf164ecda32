"""TCP listening and dialing done by actorgrad itself (runtime/_tcp.py), so that uvloop
never starts libuv's thread pool for a lookup: a forked child of a worker that exits
the normal way must not crash in libuv's exit handler."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from actorgrad.runtime import _tcp


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def _echo_server(host: str | None, port: int = 0) -> _tcp.Listening:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    return await _tcp.listen(host, port, lambda sock: asyncio.start_server(serve, sock=sock))


async def _echo(host: str, port: int, line: bytes) -> bytes:
    reader, writer = await _tcp.dial(host, port, lambda h, p: asyncio.open_connection(h, p))
    writer.write(line)
    answer = await reader.readline()
    writer.close()
    return answer


async def test_numeric_addresses_and_the_wildcard_resolve_as_given() -> None:
    assert await _tcp.resolve("127.0.0.1", 80) == [(socket.AF_INET, ("127.0.0.1", 80))]
    wildcard = await _tcp.resolve("", 0, passive=True)
    assert (socket.AF_INET, ("0.0.0.0", 0)) in wildcard
    assert await _tcp.resolve("0.0.0.0", 5, passive=True) == [(socket.AF_INET, ("0.0.0.0", 5))]


async def test_a_name_is_looked_up_and_its_addresses_tried_in_turn() -> None:
    expected = {sockaddr[0] for family, _, _, _, sockaddr in socket.getaddrinfo(
        "localhost", 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        if family in (socket.AF_INET, socket.AF_INET6)}
    found = {sockaddr[0] for _, sockaddr in await _tcp.resolve("localhost", 0, passive=True)}
    assert found == expected  # (whatever this host's resolver says localhost is)
    listening = await _echo_server("127.0.0.1")
    try:
        port = listening.sockets[0].getsockname()[1]
        assert await _echo("localhost", port, b"by name\n") == b"by name\n"  # tries ::1 first where it comes first
        assert await _echo("127.0.0.1", port, b"by number\n") == b"by number\n"
    finally:
        listening.close()
        await listening.wait_closed()


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_both_loopbacks_of_a_name_are_bound() -> None:
    port = socket.socket()  # a port free on IPv4; bound on both below as asyncio would
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    hosts = {sockaddr[0] for _, sockaddr in await _tcp.resolve("localhost", number, passive=True)}
    listening = await _echo_server("localhost", number)
    try:
        bound = {sock.getsockname()[0] for sock in listening.sockets}
        assert bound == hosts
        for host in hosts:
            assert await _echo(host, number, b"x\n") == b"x\n"
    finally:
        listening.close()
        await listening.wait_closed()


def _link_local_address() -> str | None:
    """An IPv6 link-local address of this host with its interface ("fe80::...%eth0")."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    for row in rows:
        if len(row) == 6 and row[0].startswith("fe80"):
            groups = ":".join(row[0][i:i + 4] for i in range(0, 32, 4))
            return f"{socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, groups))}%{row[5]}"
    return None


@pytest.mark.skipif(_link_local_address() is None, reason="no IPv6 link-local address here")
async def test_a_link_local_address_keeps_its_interface() -> None:
    host = _link_local_address()
    assert host is not None
    listening = await _echo_server(host)
    try:
        sockaddr = listening.sockets[0].getsockname()
        assert sockaddr[3] == socket.if_nametoindex(host.split("%")[1])  # bound on that interface
        assert await _echo(host, sockaddr[1], b"link\n") == b"link\n"
    finally:
        listening.close()
        await listening.wait_closed()


async def test_an_address_in_use_is_named_and_nothing_stays_bound() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError) as info:
            await _echo_server("127.0.0.1", port)
        assert info.value.errno == errno.EADDRINUSE
        assert f"('127.0.0.1', {port})" in str(info.value)
    finally:
        taken.close()


async def test_dialing_a_closed_port_is_refused_and_an_unknown_name_fails() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(ConnectionRefusedError):
        await _echo("127.0.0.1", port, b"x\n")
    with pytest.raises(socket.gaierror):
        await _echo("no-such-host.invalid", port, b"x\n")


def test_a_child_forked_from_a_tcp_worker_exits_with_its_own_status(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A group formed through a tcp:// rendezvous by name (so: a lookup, a TCP store
    # server and client, TCP listeners); a child forked from its loop thread that
    # exits the normal way must end with its own status, not SIGSEGV.
    script = textwrap.dedent('''
        import os, sys, socket, actorgrad as ag

        async def main():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            await ag.init_rpc("worker0", rank=0, world_size=1, init_method=f"tcp://localhost:{port}")
            pid = os.fork()
            if pid == 0:
                sys.exit(7)
            print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
            await ag.shutdown()

        ag.run(main())
    ''')
    path = tmp_path / "fork_tcp.py"
    path.write_text(script)
    env = {**os.environ, "ACTORGRAD_AUTH_KEY": "k" * 32}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["child exit 7"], proc.stdout + proc.stderr[-3000:]
