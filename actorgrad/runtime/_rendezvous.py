"""Rendezvous: how the workers of a group find each other.

A tiny key-value store that speaks JSON lines, never pickle (it runs before any
authentication). ``env://`` and ``tcp://HOST:PORT`` use a TCP store hosted by rank 0;
``file:///path`` uses a shared file guarded by ``flock``; under torchrun, ``env://`` uses
the store its agent already hosts on ``MASTER_PORT`` (as torch's own env:// does).
Workers publish their listening address under ``worker/<rank>`` and wait until every
rank has published.

Waits are answered at least every ``POLL_S`` with what is there so far, so a worker
that waits knows which ranks are missing (and sees a wrong world size) at any time.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import time
import urllib.parse
from typing import Any

from .._errors import RendezvousTimeout
from . import _tcp

_MAX_LINE = 1 << 16
POLL_S = 0.5  # a wait is answered at least this often with the entries so far
_MAX_BYTES = 16 << 20  # what the store keeps in all: a few short entries per worker


def socket_fd(transport: Any) -> int | None:
    """The descriptor of a transport's (or stream writer's) socket, if it has one open."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock.fileno() if sock is not None else None


class StoreServer:
    """The TCP store hosted by rank 0."""

    def __init__(self) -> None:
        self._data: dict[str, str] = {}
        self._bytes = 0  # received by set/claim so far (bounds what the store keeps)
        self._changed = asyncio.Event()
        self._server: _tcp.Listening | None = None
        self._clients: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> None:
        self._server = await _tcp.listen(host, port, lambda sock: asyncio.start_server(self._serve, sock=sock, limit=_MAX_LINE))

    def filenos(self) -> list[int]:
        """The descriptors of its sockets (see Worker.forsake_in_child)."""
        listening = [sock.fileno() for sock in (self._server.sockets if self._server is not None else ())]
        return listening + [fd for w in self._clients if (fd := socket_fd(w)) is not None]

    async def close(self, linger: float = 0.0) -> None:
        """Stop serving. ``linger``: first wait up to that long for the clients to hang
        up (after a start-up error every worker can see, so that they read their last
        answers and fail with the same error instead of a closed connection)."""
        if self._server is not None:
            self._server.close()  # no new clients; those connected keep their connection
        deadline = time.monotonic() + linger
        while self._clients and time.monotonic() < deadline:  # noqa: ASYNC110 - bounded
            await asyncio.sleep(0.02)
        if self._server is not None:
            for writer in list(self._clients):
                writer.close()  # their handlers see EOF and end, instead of being cancelled
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            while line := await reader.readline():
                request = json.loads(line)
                op, key = request["op"], str(request["key"])
                if op in ("set", "claim") and self._bytes + len(line) > _MAX_BYTES:
                    return  # no group needs this much: this client is not one of it
                if op == "set" or (op == "claim" and key not in self._data):
                    self._data[key] = str(request["value"])
                    self._bytes += len(line)
                    self._changed.set()
                    self._changed = asyncio.Event()
                    reply: dict[str, Any] = {"ok": True}
                elif op == "claim":  # taken: say by what
                    reply = {"ok": False, "value": self._data[key]}
                elif op == "wait_prefix":
                    count = int(request["count"])
                    until = time.monotonic() + min(float(request.get("timeout", POLL_S)), POLL_S)
                    while len(items := self._items(key)) < count and (left := until - time.monotonic()) > 0:
                        if not await self._changed_or_gone(reader, left):
                            return  # the client hung up while it waited: free its socket
                    reply = {"items": items}
                else:
                    reply = {"error": f"unknown op {op!r}"}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ValueError, KeyError, TypeError, RecursionError, ConnectionError, asyncio.LimitOverrunError):
            pass  # a malformed or vanished client: drop it, keep serving the others
        except asyncio.CancelledError:
            # The loop is going away (asyncio.run cancels what is left when the program
            # raised before shutdown). Nothing awaits this task, and Python 3.11's stream
            # callback asks a cancelled task for its exception, which logs a traceback of
            # ours on top of the user's: end quietly instead.
            pass
        finally:
            self._clients.discard(writer)
            writer.close()

    async def _changed_or_gone(self, reader: asyncio.StreamReader, timeout: float) -> bool:
        """Wait up to ``timeout`` for a change of the data; False if the client hung up
        (or, against the protocol, sent more while it waits) first."""
        changed = asyncio.ensure_future(self._changed.wait())
        gone = asyncio.ensure_future(reader.read(1))
        try:
            done, _ = await asyncio.wait({changed, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            gone.cancel()
            # let the read end before anyone reads the stream again
            await asyncio.gather(changed, gone, return_exceptions=True)
        return gone not in done

    def _items(self, prefix: str) -> dict[str, str]:
        return {k: v for k, v in self._data.items() if k.startswith(prefix)}


class TcpStore:
    """Client of :class:`StoreServer`."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def connect(self, deadline: float) -> None:
        delay = 0.01
        while True:
            try:
                self._reader, self._writer = await _tcp.dial(
                    self.host, self.port, lambda host, port: asyncio.open_connection(host, port, limit=_MAX_LINE))
                return
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise RendezvousTimeout(  # (a TimeoutError, as it was, and an actorgrad error)
                        f"could not reach the rendezvous at {self.host}:{self.port}, which rank 0 "
                        f"hosts (is it running, and past init_rpc's start?): {exc}"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._reader is not None and self._writer is not None
        async with self._lock:
            self._writer.write(json.dumps(request).encode() + b"\n")
            await self._writer.drain()
            line = await self._reader.readline()
        if not line:
            raise ConnectionError("the rendezvous store closed the connection")
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def set(self, key: str, value: str) -> None:
        await self._request({"op": "set", "key": key, "value": value})

    async def claim(self, key: str, value: str) -> str | None:
        """Set ``key`` unless it is set already; then return the value it holds."""
        reply = await self._request({"op": "claim", "key": key, "value": value})
        return None if reply.get("ok") else str(reply.get("value"))

    async def wait_prefix(self, prefix: str, count: int) -> dict[str, str]:
        """The entries under ``prefix`` once there are ``count``, or those there are
        after a while (``POLL_S``)."""
        reply = await self._request({"op": "wait_prefix", "key": prefix, "count": count, "timeout": POLL_S})
        items: dict[str, str] = reply["items"]
        return items

    def filenos(self) -> list[int]:
        fd = socket_fd(self._writer)
        return [fd] if fd is not None else []

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class FileStore:
    """A store in a shared file: one JSON object per line, appended under ``flock``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: tuple[int, int] | None = None  # (device, inode) of the file we wrote to

    def filenos(self) -> list[int]:
        return []  # (a file opened per request: none held)

    async def connect(self, deadline: float) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)  # noqa: ASYNC240 - one tiny call at start-up

    def _read(self) -> dict[str, str]:
        data: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError), open(self.path) as f:
            for line in f:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    entry = json.loads(line)
                    data[str(entry["key"])] = str(entry["value"])
        return data

    async def set(self, key: str, value: str) -> None:
        self._append(key, value, once=False)

    async def claim(self, key: str, value: str) -> str | None:
        """Set ``key`` unless it is set already; then return the value it holds."""
        return self._append(key, value, once=True)

    def _append(self, key: str, value: str, once: bool) -> str | None:
        with open(self.path, "a") as f:  # noqa: ASYNC230 - a line appended under flock
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                if once and (held := self._read().get(key)) is not None:
                    return held
                f.write(json.dumps({"key": key, "value": value}) + "\n")
                f.flush()
                stat = os.fstat(f.fileno())
                self._file = (stat.st_dev, stat.st_ino)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return None

    async def wait_prefix(self, prefix: str, count: int) -> dict[str, str]:
        """As :meth:`TcpStore.wait_prefix`."""
        until = time.monotonic() + POLL_S
        while True:
            items = {k: v for k, v in self._read().items() if k.startswith(prefix)}
            if len(items) >= count or time.monotonic() >= until:
                return items
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        pass

    def remove(self) -> None:
        """Remove the file, unless it is not the one we wrote to any more (a group after
        ours uses the path already)."""
        with contextlib.suppress(OSError):
            stat = os.stat(self.path)
            if self._file == (stat.st_dev, stat.st_ino):
                os.unlink(self.path)


class TorchAgentStore:
    """The store torchrun's agent hosts on ``MASTER_PORT``, through torch's TCPStore
    client, under a prefix of ours per restart of the job (its keys outlive a restart).

    Its calls block, so they run in a thread; keys are ``<prefix><rank>`` for ranks
    below the world size, which is all a wait has to look for."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        self.host, self.port, self.world_size = host, port, world_size
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store: Any = None

    def _key(self, key: str) -> str:
        return f"actorgrad/attempt_{self._attempt}/{key}"

    def filenos(self) -> list[int]:
        return []  # (torch's client: its socket is torch's to mind)

    async def connect(self, deadline: float) -> None:
        import datetime

        from torch.distributed import TCPStore

        left = max(0.1, deadline - time.monotonic())
        try:
            self._store = await asyncio.to_thread(
                TCPStore, self.host, self.port, is_master=False,
                timeout=datetime.timedelta(seconds=left), wait_for_workers=False,
            )
        except (RuntimeError, ValueError) as exc:
            raise TimeoutError(f"could not reach torchrun's store at {self.host}:{self.port}: {exc}") from exc

    async def set(self, key: str, value: str) -> None:
        await asyncio.to_thread(self._store.set, self._key(key), value)

    async def claim(self, key: str, value: str) -> str | None:
        held = await asyncio.to_thread(self._store.compare_set, self._key(key), "", value)
        held = held.decode() if isinstance(held, bytes) else str(held)
        return None if held == value else held

    async def wait_prefix(self, prefix: str, count: int) -> dict[str, str]:
        until = time.monotonic() + POLL_S
        keys = [f"{prefix}{rank}" for rank in range(self.world_size)]
        while True:
            items = await asyncio.to_thread(self._present, keys)
            if len(items) >= count or time.monotonic() >= until:
                return items
            await asyncio.sleep(0.02)

    def _present(self, keys: list[str]) -> dict[str, str]:
        store = self._store
        return {k: store.get(self._key(k)).decode() for k in keys if store.check([self._key(k)])}

    async def close(self) -> None:
        self._store = None


Store = TcpStore | FileStore | TorchAgentStore


def torchrun_store() -> bool:
    """Whether torchrun's agent hosts a store on ``MASTER_PORT`` for env://."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def parse_init_method(
    init_method: str | None, rank: int | None, world_size: int | None
) -> tuple[str, str, int, int, int]:
    """Resolve ``init_method``/rank/world size into (scheme, host-or-path, port, rank, size)."""
    method = init_method or "env://"
    if rank is None:
        rank = _env_int("RANK")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in range for world_size {world_size}")
    url = urllib.parse.urlparse(method)
    if url.scheme == "env":
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        # actorgrad launch gives our store a port of its own, leaving MASTER_PORT to
        # torch.distributed's env:// store in the same script (torchrun's agent hosts
        # one store that both use)
        # (only beside the MASTER_PORT it came with: a program that sets MASTER_PORT for a
        # group of its own, in a process the launcher started, means that port)
        ours = os.environ.get(OWN_PORT) and os.environ.get(OWN_PORT_BESIDE) == os.environ.get("MASTER_PORT")
        name = OWN_PORT if ours and not torchrun_store() else "MASTER_PORT"
        port = _env_int(name, "set MASTER_ADDR and MASTER_PORT, or pass init_method")
        if not 0 < port < 65536:
            raise ValueError(f"{name}={port} is not a TCP port (1-65535)")
        return "torch" if torchrun_store() else "tcp", host, port, rank, world_size
    if url.scheme == "tcp":
        if not url.hostname or url.port is None:
            raise ValueError(f"init_method {method!r} needs tcp://HOST:PORT")
        if not url.port:
            raise ValueError(
                f"init_method {method!r}: port 0 cannot be agreed on by every rank; "
                "pick a port (actorgrad launch and the pytest plugin pick free ones)")
        return "tcp", url.hostname, url.port, rank, world_size
    if url.scheme == "file":
        if not url.path:
            raise ValueError(f"init_method {method!r} needs file:///path")
        return "file", url.path, 0, rank, world_size
    raise ValueError(f"unsupported init_method {method!r}: use env://, tcp://HOST:PORT or file:///path")


OWN_PORT = "ACTORGRAD_MASTER_PORT"  # env://: the port of our store, where set (actorgrad launch)
OWN_PORT_BESIDE = "ACTORGRAD_MASTER_PORT_BESIDE"  # ... and the MASTER_PORT set with it


def _env_int(name: str, fix: str = "pass rank/world_size to init_rpc") -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"{name} is not set: {fix}, or start the script with `actorgrad launch` or torchrun"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
