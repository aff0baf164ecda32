"""TLS between workers, with a self-signed certificate made by the test."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import ssl
import subprocess

import pytest
import torch

import actorgrad as ag

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@pytest.fixture
def tls_options(tmp_path) -> ag.RpcOptions:  # type: ignore[no-untyped-def]
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=actorgrad-test",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cert)
    return ag.RpcOptions(ssl_context=server, ssl_client_context=client, auth_key=b"k" * 16)


async def test_rpc_and_tensors_over_tls(make_group, tls_options) -> None:  # type: ignore[no-untyped-def]
    group = await make_group(3, tls_options)
    big = torch.randn(1 << 20)
    back = await ag.rpc_async("worker2", torch.mul, args=(big, 2.0))
    torch.testing.assert_close(back, big * 2.0)
    assert all(w._server is not None for w in group.workers)


async def test_plaintext_peer_is_rejected_and_group_keeps_working(make_group, tls_options) -> None:  # type: ignore[no-untyped-def]
    group = await make_group(2, tls_options)
    port = group.workers[1]._server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"AGRD" + b"\x01" * 40)  # a plaintext frame where TLS is expected
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10) is not None  # the worker closes on us
    writer.close()
    assert await ag.rpc_async("worker1", max, args=(2, 7)) == 7


async def test_connections_that_fail_or_stall_the_tls_handshake_are_let_go(make_group, tls_options) -> None:  # type: ignore[no-untyped-def]
    group = await make_group(2, dataclasses.replace(tls_options, init_timeout=2.0))
    worker = group.workers[1]
    kept = len(worker._connections)
    port = worker._server.sockets[0].getsockname()[1]
    for _ in range(20):  # a port scan, a plaintext client: the TLS handshake fails
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"AGRD" + b"\x01" * 40)
        await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert len(worker._connections) == kept
    # clients that never start the TLS handshake are cut within init_timeout
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
    for reader, writer in idle:
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    assert len(worker._connections) == kept
    assert await ag.rpc_async("worker1", max, args=(2, 7)) == 7


def test_half_configured_tls_is_refused() -> None:
    with pytest.raises(ValueError, match="ssl_client_context"):
        ag.RpcOptions(ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
