"""The worker: one per process (or several in one process for tests), on one event loop.

It owns the listener, the peer connections, the table of outstanding requests, the
handler registry that actors plug into, and the thread pool that runs blocking remote
functions so the loop keeps serving heartbeats and other peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import functools
import gc
import hashlib
import inspect
import ipaddress
import json
import logging
import math
import numbers
import os
import pickle
import socket
import ssl
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import cloudpickle

from .._errors import (
    AuthenticationError,
    ProtocolError,
    RemoteError,
    RendezvousTimeout,
    RpcTimeout,
    WorkerLost,
    error_line,
    error_message,
    error_name,
)
from ..wire import (
    Call,
    Cancel,
    Connection,
    Established,
    Failure,
    Goodbye,
    Heartbeat,
    Message,
    Payload,
    Result,
    Tell,
    dumps,
    tcp_endpoint,
    unix_endpoint,
)
from . import _current, _local, _tcp
from ._calls import CallFuture, PendingCalls, check_timeout
from ._options import RpcOptions, WorkerInfo
from ._pool import ThreadPool, raised_in_pool
from ._rendezvous import (
    POLL_S,
    FileStore,
    Store,
    StoreServer,
    TcpStore,
    TorchAgentStore,
    parse_init_method,
    socket_fd,
)
from ._torch_modes import as_a_fresh_thread, fresh_modes
from ._trace import Tracer, in_lanes, now_us
from ._transport import LoopbackPeer, PeerProtocol

log = logging.getLogger("actorgrad")
_perf_counter = time.perf_counter
_sched_yield = getattr(os, "sched_yield", lambda: None)  # not on every platform
# While an answer is awaited, poll up to this many times RpcOptions.spin_us (keep_hot).
_WAIT_SPIN_FACTOR = 10

_TRACE_EXPORT_UNGRACEFUL = 10.0  # most a worker stopping at once spends writing the trace
_STORE_LINGER = 2.0  # most a rendezvous host waits at shutdown for workers still in it
_STORE_DONE_LINGER = 10.0  # once the group formed: the most a client of the store keeps it
_STORE_SETTLE = 2.0  # how long the store's host waits in init_rpc for the others to hang up
# A rank listens before it publishes its address, so one that refuses connections there
# has stopped listening (it gave up forming the group, or exited); a short grace covers
# a connection reset mid-accept.
_REFUSED_GRACE_S = 1.0
# A network that does not reach a published address (no route, host down) may be one
# still coming up: tried again for this long, then the rank is reported unreachable.
_UNREACHABLE_GRACE_S = 5.0
_UNREACHABLE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN,
                          errno.ETIMEDOUT})


def _dial_failure(rank: int, address: tuple[str, int], exc: OSError) -> tuple[float, str]:
    """How long a failure to reach ``rank`` at its published ``address`` is tried again,
    and what is said once it is not."""
    where = f"{address[0]}:{address[1]}"
    if isinstance(exc, (ConnectionRefusedError, ConnectionResetError)):
        return _REFUSED_GRACE_S, (
            f"rank {rank} refuses connections at {where}, the address it published: it stopped "
            "listening (it gave up forming the group, or exited), or that address does not "
            f"reach it (RpcOptions.advertise_host): {exc}")
    unreachable = f"rank {rank} cannot be reached at {where}, the address it published ({exc})"
    if exc.errno in _UNREACHABLE or isinstance(exc, socket.gaierror):
        return _UNREACHABLE_GRACE_S, (
            f"{unreachable}: is it an address this host reaches (RpcOptions.advertise_host on that rank)?")
    return 0.0, unreachable
# A Goodbye that starts so tells the peers the error the program stopped on; the reason
# travels in a control frame, which must stay small.
_STOPPED_ON_ERROR = "it stopped on an error: "
_STOP_REASON_BYTES = 1000

Handler = Callable[[PeerProtocol, Payload], "Payload | Awaitable[Payload] | None"]
PeerRef = str | int | WorkerInfo


# Whatever a remote function raises, SystemExit and KeyboardInterrupt included, its
# caller gets as RemoteError, and the worker goes on serving (as torch's RPC does: a
# remote sys.exit() is the function's failure, not the worker's end). Only a
# KeyboardInterrupt raised on the loop thread is raised on once answered: it may be a
# Ctrl-C that landed in the served function, which must still stop the program.


def _close_unstarted(coro: Any, _: object = None) -> None:
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()


def describe_error(exc: BaseException) -> tuple[str, str, str]:
    """``exc``'s type name, message and formatted traceback; never raises.

    A user's exception may break ``str()``: the caller must still get an answer.
    """
    tb = "".join(traceback.format_exception(exc))  # tolerates a failing str() itself
    return error_name(exc), error_message(exc), tb


# errors a worker passes on to its caller as they are (see Worker._remote_error)
_PASSED_ON = (WorkerLost, RpcTimeout, RemoteError)


def error_payload(exc: BaseException, main_by_name: bool = False) -> Payload:
    """Describe ``exc`` for the caller: type, message, traceback, and the exception.

    The exception itself travels as separate bytes: if it cannot be pickled here, or
    rebuilt there, the caller still gets its type name, message and traceback.
    ``main_by_name``: the caller runs the same program (see ``Payload.dump``), so an
    exception of a class of its ``__main__`` arrives as an instance of its own class
    (``RemoteError.__cause__``: ``except AppError`` catches it raised again).
    """
    try:
        pickled: bytes | None = dumps(exc, main_by_name)
    except Exception:
        pickled = None
        if isinstance(exc, RemoteError) and exc.__cause__ is not None:
            # its cause (another worker's exception) cannot travel on: the rest can
            bare = RemoteError(exc.worker, exc.remote_type, exc.remote_message, exc.remote_traceback)
            with contextlib.suppress(Exception):
                pickled = cloudpickle.dumps(bare)
    name, message, tb = describe_error(exc)
    if isinstance(exc, _PASSED_ON) and pickled is not None:
        # it travels whole (its cause, notes and remote traceback in it): the traceback
        # that goes with it is only where this worker passed it on, or every worker of a
        # chain would repeat all it got (the text doubled at each hop)
        tb = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
    return Payload.dump((name, message, tb, pickled))


def _runs_in(task: asyncio.Task[Any] | None) -> bool:
    """Whether the code calling this runs as a step of ``task``."""
    try:
        return task is not None and asyncio.current_task() is task
    except RuntimeError:  # no running loop
        return False


class Worker:
    """State of one worker of a group. Reach the current one with ``get_worker()``."""

    def __init__(self, name: str, rank: int, world_size: int, options: RpcOptions) -> None:
        if not name or len(name.encode()) > 256:
            raise ValueError(f"worker name must be 1..256 bytes, got {name!r}")
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.options = options
        key = options.auth_key
        if key is None:
            key = os.environ.get("ACTORGRAD_AUTH_KEY") or None
        self.auth_key: bytes | None = key.encode() if isinstance(key, str) else (key or None)
        self.loop = asyncio.get_running_loop()
        self.infos: dict[int, WorkerInfo] = {}
        self.program = program_identity()
        self._programs: dict[int, str | None] = {}  # what each peer runs (see same_program)
        self._known: dict[str | int, WorkerInfo] = {}  # names and ranks looked up so far
        self.peers: dict[int, PeerProtocol] = {}
        self._lost_reasons: dict[int, str] = {}  # rank -> why it was lost (for later calls)
        self.closed = False
        self.shutting_down = False
        self._handlers: dict[str, Handler] = {}
        self._tell_only: set[str] = set()
        self.serving_request = 0  # request id of the call whose handler runs right now
        # what the Goodbye to every peer says (set_stopped_on when the program failed)
        self.stop_reason = "shutdown"
        # what a traced call's handler runs (a remote function's name), for its spans
        self.serving_label: str | None = None
        self._pending = PendingCalls(self.loop, self._call_cancelled, self._call_expired)
        self._server: _tcp.Listening | None = None
        self._local_server: asyncio.Server | None = None
        self._tcp_endpoint = ""  # what peers dial to reach us (bound by the handshake)
        self._unix_endpoint = ""
        self._store: Store | None = None
        self._store_server: StoreServer | None = None
        self._store_closing: asyncio.Task[None] | None = None
        self._connections: set[PeerProtocol] = set()
        self._peer_waiters: dict[int, asyncio.Future[PeerProtocol]] = {}
        self._done_from: set[int] = set()
        self._done_changed = asyncio.Event()
        self._lost_listeners: list[Callable[[str, int, str], None]] = []
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._pool = ThreadPool(self.loop, options.num_worker_threads, f"actorgrad-{name}")
        self._peer_waits = 0  # pool jobs that only wait for other workers (run_blocking)
        self._context = contextvars.copy_context()
        self._context.run(_current.current_worker.set, self)
        self.tracer = Tracer(rank, name, options.trace)
        self._loopback = LoopbackPeer(self)
        self.extensions: dict[str, Any] = {}  # actors of the layers above, by name
        # > 0 while handling received frames: small frames are corked meanwhile
        self.corking = 0
        self.corked_peers: list[PeerProtocol] = []
        self._spin_seconds = options.spin_us / 1e6 if (os.cpu_count() or 1) > 1 else 0.0
        self._wait_spin_seconds = (_WAIT_SPIN_FACTOR - 1) * self._spin_seconds  # beyond _hot_until
        self._hot_until = 0.0
        self._expect_until = 0.0  # see expect_message
        self._spinning = False
        self.register("runtime.done", self._on_peer_done, tell_only=True)
        self.register("runtime.ping", lambda peer, payload: Payload.dump(None))
        self.register("trace.set", self._on_trace_set, tell_only=True)
        self.register("trace.collect", lambda peer, payload: Payload.dump(self.tracer.snapshot()))

    # -- identity -------------------------------------------------------------------
    def same_program(self, rank: int) -> bool:
        """Whether worker ``rank`` runs this process's ``__main__`` (the same script, or
        this very process): its functions and classes then travel by name (see
        wire._main_objects)."""
        return rank == self.rank or self._programs.get(rank) == self.program

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.name, self.rank)

    @property
    def pool_busy(self) -> bool:
        """Whether the thread pool runs a job (a polling loop would take its GIL)."""
        return bool(self._pool.in_flight)

    def resolve(self, to: PeerRef) -> WorkerInfo:
        """The :class:`WorkerInfo` for a name, rank or WorkerInfo of this group."""
        cls = type(to)
        if cls is str or cls is int:  # the common cases, without the checks below
            info = self._known.get(to)  # type: ignore[arg-type]  # str or int here
            if info is not None:
                return info
        if isinstance(to, WorkerInfo):
            to = to.id
        if isinstance(to, bool) or not isinstance(to, (int, str)):
            raise TypeError(f"expected a worker name, rank or WorkerInfo, got {to!r}")
        if isinstance(to, int):
            info = self.infos.get(to)
            if info is None:
                raise ValueError(f"no worker with rank {to} (world size {self.world_size})")
            self._known[to] = info
            return info
        for info in self.infos.values():
            if info.name == to:
                self._known[to] = info
                return info
        known = ", ".join(sorted(i.name for i in self.infos.values()))
        raise ValueError(f"unknown worker name {to!r}; the group has: {known}")

    # -- start-up -------------------------------------------------------------------
    async def start(self, init_method: str | None) -> None:
        """Listen, rendezvous with every rank, connect to every peer, wait for all."""
        opts = self.options
        deadline = time.monotonic() + opts.init_timeout
        scheme, host, port, _, _ = parse_init_method(init_method, self.rank, self.world_size)
        if not self.auth_key:
            if not _is_loopback(opts.listen_host):
                raise ValueError(
                    f"listening on {opts.listen_host!r} without an auth_key would let anyone who "
                    "reaches it run code here: set RpcOptions(auth_key=...) or ACTORGRAD_AUTH_KEY "
                    "(actorgrad launch sets a fresh one)"
                )
            log.warning(
                "%s: no auth_key: any process on this host can join the group and run code "
                "here; set ACTORGRAD_AUTH_KEY (actorgrad launch, local_group and in-process "
                "groups make one)", self.name)
        self._server = await _tcp.listen(
            opts.listen_host, opts.listen_port,
            lambda sock: self.loop.create_server(
                lambda: self._accept(endpoint=self._tcp_endpoint), sock=sock, ssl=opts.ssl_context, backlog=1024,
                ssl_handshake_timeout=_tls_handshake_limit(opts.ssl_context, opts.init_timeout)),
        )
        listen_port = self._server.sockets[0].getsockname()[1]
        local = None
        if opts.local_sockets and opts.ssl_context is None:
            local = await _local.listen(self.loop, lambda: self._accept(endpoint=self._unix_endpoint))
            if local is not None:
                self._local_server = local[0]
                self._unix_endpoint = unix_endpoint(local[1])
        advertise = opts.advertise_host or opts.listen_host
        if advertise in ("0.0.0.0", "::", ""):
            advertise = host if scheme in ("tcp", "torch") else socket.gethostname()
        # what we publish is what peers dial: the handshake binds it (see _connection)
        self._tcp_endpoint = tcp_endpoint(advertise, listen_port)
        try:
            _current.starting(self)  # (peers learn our address from here on, and may call)
            if scheme == "tcp":
                if self.rank == 0:
                    self._store_server = StoreServer()
                    try:
                        await self._store_server.start(host, port)
                    except OSError as exc:
                        raise RuntimeError(
                            f"rank 0 cannot host the rendezvous on {host}:{port}: {exc}"
                        ) from exc
                self._store = TcpStore(host, port)
            elif scheme == "torch":
                self._store = TorchAgentStore(host, port, self.world_size)
            else:
                self._store = FileStore(host)
            await self._store.connect(deadline)
            # Be ready for every peer before anyone can learn our address: a peer that
            # reads the roster before we do connects right away.
            for rank in range(self.world_size):
                if rank != self.rank:
                    self._peer_waiters[rank] = self.loop.create_future()
            me: dict[str, Any] = {"name": self.name, "host": advertise, "port": listen_port,
                                  "program": self.program, "world_size": self.world_size}
            if local is not None:
                me["local"] = [local[1], _local.host_identity()]
            if isinstance(self._store, FileStore) and await self._store.wait_prefix("ready/", 0):
                raise ValueError(
                    f"the rendezvous file {host} holds a group that formed already (one still "
                    "running, or one that ended without removing it): delete it, or use another path"
                )
            held = await self._until(deadline, self._store.claim(f"worker/{self.rank}", json.dumps(me)),
                                     "the rendezvous store to answer")
            if held is not None:
                raise ValueError(
                    f"rank {self.rank} is already taken in this group (by worker "
                    f"{_entry_name(held)!r}); every worker needs a rank of its own"
                )
            entries = await self._wait_entries(deadline, "worker/", "all workers to join the rendezvous")
            addresses: dict[int, tuple[str, int]] = {}
            local_addresses: dict[int, Any] = {}
            for key, value in entries.items():
                entry = json.loads(value)
                rank = int(key.split("/", 1)[1])
                self.infos[rank] = WorkerInfo(entry["name"], rank)
                self._programs[rank] = entry.get("program")
                addresses[rank] = (entry["host"], int(entry["port"]))
                local_addresses[rank] = entry.get("local")
            names = [i.name for i in self.infos.values()]
            if len(set(names)) != len(names):
                raise ValueError(f"worker names must be unique, got {sorted(names)}")
            for rank, proto in list(self.peers.items()):  # connected before we read the roster
                if proto.name != self.infos[rank].name:
                    proto.abort(ProtocolError(f"peer {proto.name!r} is not rank {rank}'s worker"))
            # Lower ranks accept, higher ranks connect: exactly one connection per pair.
            connects = [self._connect(r, addresses[r], local_addresses[r]) for r in self.infos if r < self.rank]
            await self._until(deadline, asyncio.gather(*connects), "connections to lower ranks",
                              self._not_connected)
            await self._until(deadline, asyncio.gather(*self._peer_waiters.values()), "every peer to connect",
                              self._not_connected)
            await self._until(deadline, self._store.set(f"ready/{self.rank}", "1"), "the rendezvous store to answer")
            await self._wait_entries(deadline, "ready/", "every worker to be ready")
        except BaseException as exc:
            # a wrong set-up (duplicate names, ...) is seen by every worker once it read
            # the roster: the rendezvous host waits a moment for them to read it
            await self._close_everything(store_linger=2.0 if isinstance(exc, ValueError) else 0.0)
            raise
        if self._store_server is not None:
            # every worker has the roster: nobody needs the store any more, and a store
            # without a key left open is one anyone on the host can load (memory held
            # for clients that never read, CPU); those still reading their last answer
            # hang up at once
            self._store_closing = self.loop.create_task(self._store_server.close(linger=_STORE_DONE_LINGER))
        if isinstance(self._store, FileStore):
            await self._store.set(f"left/{self.rank}", "1")
            if self.rank == 0:  # the path is free for the next group as soon as all read it
                self._store_closing = self.loop.create_task(self._remove_rendezvous_file(self._store))
        else:
            # done with the rendezvous: hanging up tells its host (rank 0), which waits at
            # its shutdown for every worker still reading its last answer
            await self._store.close()
            if self._store_server is not None and self._store_closing is not None:
                # the others read their last answers from this worker's loop: a program
                # that blocks it right after init_rpc returns (a blocking
                # torch.distributed call) must not leave them waiting for it
                try:
                    await asyncio.wait({self._store_closing}, timeout=_STORE_SETTLE)
                except BaseException:  # cancelled (a timeout around init_rpc): not started
                    await self._close_everything()
                    raise
        self._heartbeat_task = self.loop.create_task(self._heartbeats(), context=self._context.copy())
        _current.register(self)

    async def _remove_rendezvous_file(self, store: FileStore) -> None:
        """Once every worker has read the roster (or after a while), remove the file."""
        deadline = time.monotonic() + _STORE_DONE_LINGER
        while time.monotonic() < deadline:
            if len(await store.wait_prefix("left/", self.world_size)) >= self.world_size:
                break
        store.remove()

    async def _until(self, deadline: float, aw: Awaitable[Any], what: str,
                     missing: Callable[[], list[int] | None] | None = None) -> Any:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await aw
        except TimeoutError:
            raise self._rendezvous_timeout(what, missing() if missing is not None else []) from None

    def _rendezvous_timeout(self, what: str, missing: list[int] | None) -> RendezvousTimeout:
        """``missing``: the ranks not there (None: unknown, the store never answered)."""
        text = f"{self.name}: timed out after {self.options.init_timeout}s waiting for {what}"
        if missing is None:
            text += "; the rendezvous store did not answer before then (was this process stopped?)"
        elif missing:
            names = [f"rank {r} ({self.infos[r].name})" if r in self.infos else f"rank {r}" for r in missing]
            text += f"; still missing: {', '.join(names)}"
        return RendezvousTimeout(text)

    def _not_connected(self) -> list[int]:
        # (asked after a timeout, which cancelled the waiters still waiting)
        return sorted(r for r, waiter in self._peer_waiters.items() if not waiter.done() or waiter.cancelled())

    def on_key_check_failed(self, rank: int | None, exc: AuthenticationError) -> None:
        """A connection claiming to be ``rank`` failed the key check. While the group
        forms, its waiter fails with that: the group cannot form without the rank, and
        the worker that tried to join already knows why, so this one need not wait for
        its timeout. (The rendezvous store takes anyone's entries anyway: nobody who
        can reach it is denied a way to stop a group forming that they did not have.)"""
        waiter = self._peer_waiters.get(rank) if rank is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_exception(AuthenticationError(f"{self.name}: rank {rank} cannot join: {exc}"))
            waiter.exception()  # retrieved: the rendezvous may fail elsewhere first

    async def _wait_entries(self, deadline: float, prefix: str, what: str) -> dict[str, str]:
        """The store's entries under ``prefix`` once every rank wrote one. The store
        answers every little while with those there so far: a roster entry of another
        group (another world size) fails at once, and a timeout names who is missing."""
        items: dict[str, str] = {}
        answered = False

        def missing() -> list[int] | None:
            if not answered:  # (stopped or starved until past the deadline: nothing known)
                return None
            there = {key[len(prefix):] for key in items}
            return [r for r in range(self.world_size) if str(r) not in there]

        while True:
            # (the store answers within POLL_S: a wait begun just before the deadline
            # may end just after it, with who is there)
            # (merged: entries are never taken back while a group forms, but a worker
            # that gave up removes a rendezvous file, and its last read finds nobody)
            items = {**items, **await self._until(
                deadline + 2 * POLL_S, self._store.wait_prefix(prefix, self.world_size),  # type: ignore[union-attr]
                what, missing)}
            answered = True
            if prefix == "worker/":
                self._check_roster(items)
            if len(items) >= self.world_size:
                return items
            if time.monotonic() >= deadline:
                raise self._rendezvous_timeout(what, missing())

    def _check_roster(self, entries: dict[str, str]) -> None:
        """Refuse a roster with a worker started for another world size or rank range."""
        for key, value in entries.items():
            try:
                entry, rank = json.loads(value), int(key.split("/", 1)[1])
                size = entry.get("world_size", self.world_size)
            except (ValueError, TypeError, AttributeError):
                continue  # (a malformed entry fails where the roster is read)
            if size != self.world_size or not 0 <= rank < self.world_size:
                raise ValueError(
                    f"world_size mismatch: worker {entry.get('name')!r} (rank {rank}) was started "
                    f"with world_size {size}, {self.name} with {self.world_size}; every worker "
                    "of a group needs the same world_size"
                )

    async def _connect(self, rank: int, address: tuple[str, int], local: Any) -> None:
        """Connect to a lower rank: through its Unix socket when it runs on this host
        (see ``_local``), else (or when that fails) over TCP.

        Gives up once another rank's wait failed (the group cannot form: no use dialing
        on) or once ``rank`` keeps refusing connections at the address it published."""
        proto: PeerProtocol | None = None
        if self._local_server is not None and isinstance(local, list) and len(local) == 2:
            unix = unix_endpoint(str(local[0]))
            proto = await _local.connect(self.loop, lambda: self._accept(True, unix), *local)
        delay = 0.01
        failing_since: dict[float, float] = {}
        tcp = tcp_endpoint(address[0], address[1])
        client_tls = self.options.ssl_client_context

        async def dial_one(host: str, port: int) -> PeerProtocol:
            _, dialed = await self.loop.create_connection(
                lambda: self._accept(True, tcp), host, port, ssl=client_tls,
                server_hostname=address[0] if client_tls else None,
                ssl_handshake_timeout=_tls_handshake_limit(client_tls, self.options.init_timeout),
            )
            return dialed

        while proto is None:
            try:
                proto = await _tcp.dial(address[0], address[1], dial_one)
                break
            except ssl.SSLError:
                raise
            except OSError as exc:  # refused, reset, no route, a name that does not resolve
                if (failed := self._failed_wait()) is not None:
                    raise failed from None
                grace, why = _dial_failure(rank, address, exc)
                now = time.monotonic()
                if now - failing_since.setdefault(grace, now) >= grace:  # (one clock per kind)
                    raise WorkerLost(self.infos[rank].name, why) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)
        await proto.established

    def _failed_wait(self) -> BaseException | None:
        """The error of a rank's wait that failed while the group forms (a key check)."""
        for waiter in self._peer_waiters.values():
            if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
                return waiter.exception()
        return None

    def _accept(self, initiator: bool = False, endpoint: str = "") -> PeerProtocol:
        """A protocol for a new connection; ``endpoint``: the accepting side's (the one
        dialed, or ours), which the handshake binds."""
        return PeerProtocol(self, initiator, endpoint)

    def on_connected(self, proto: PeerProtocol) -> None:
        """A connection is up (past TLS, if any: one whose TLS handshake fails never
        gets here, nor to ``on_connection_lost``, so it must not be kept before)."""
        self._connections.add(proto)
        # An unauthenticated connection gets a bounded time to finish the handshake.
        proto.handshake_timer = self.loop.call_later(self.options.init_timeout, self._handshake_deadline, proto)

    def _handshake_deadline(self, proto: PeerProtocol) -> None:
        if not proto.established.done():
            proto.abort(ProtocolError("handshake not completed in time"))

    def new_connection(self, initiator: bool = False, endpoint: str = "") -> Connection:
        return Connection(
            name=self.name, rank=self.rank, auth_key=self.auth_key,
            max_frame_size=self.options.max_frame_size, initiator=initiator, endpoint=endpoint,
        )

    def on_established(self, proto: PeerProtocol, event: Established) -> None:
        if proto.handshake_timer is not None:
            proto.handshake_timer.cancel()
            proto.handshake_timer = None
        rank, name = event.peer_rank, event.peer_name
        expected = self.infos.get(rank)
        waiter = self._peer_waiters.get(rank)
        if (expected is not None and expected.name != name) or waiter is None or rank in self.peers:
            proto.abort(ProtocolError(f"unexpected peer {name!r} (rank {rank})"))
            return
        if waiter.done():
            # that rank joined once and was lost since: without a key, anyone on the host
            # could otherwise take its place and be served
            proto.abort(ProtocolError(
                f"peer {name!r} (rank {rank}) connected after that rank left the group: "
                "a worker that left cannot rejoin"))
            return
        proto.name, proto.rank = name, rank
        self.peers[rank] = proto
        proto.established.set_result(proto)
        if not waiter.done():
            waiter.set_result(proto)

    def forsake_in_child(self) -> None:
        """In a process forked from this worker's (``os.fork``, multiprocessing's fork
        start method): the worker is the parent's. Its sockets, and the event loop's
        epoll instance, are shared with the parent: a child that ran the loop (the
        cleanup of ``sys.exit``) read the parent's messages and unregistered its
        sockets from that epoll, so the parent's peers went silent. Each socket's
        descriptor now refers to /dev/null here: the child reads nothing of the
        parent's, and the parent's registrations stay. The worker is closed here."""
        self.closed = True
        fds = [socket_fd(proto.transport) for proto in (*self._connections, *self.peers.values())]
        for server in (self._server, self._local_server):
            fds += [sock.fileno() for sock in (server.sockets if server is not None else ())]
        if self._store_server is not None:
            fds += self._store_server.filenos()
        fds += self._store.filenos() if self._store is not None else []
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd in fds:
                if fd is not None and fd >= 0:
                    with contextlib.suppress(OSError):
                        os.dup2(null, fd)
        finally:
            os.close(null)

    def keep_hot(self) -> None:
        """Something was sent or received: keep the loop polling for a short while.

        Waking a process that sleeps in ``epoll_wait`` costs tens of microseconds on a
        virtual machine, more than a small call itself (a blocking loopback ping-pong
        takes ~7x as long as a polling one). After activity the loop keeps itself
        busy with a callback that reschedules itself for ``RpcOptions.spin_us``, so
        the answer or the next request is picked up without a wake-up; it yields the
        CPU on each turn, and a quiet worker still sleeps. It does not poll while the
        thread pool runs a job: the polling loop would win the GIL back every time and
        the job would wait for a forced switch (milliseconds).

        While this worker waits for the answer to a call of its own, it polls up to
        ``_WAIT_SPIN_FACTOR`` times as long: a remote step of a few milliseconds (a
        layer's forward, an optimizer step) is then picked up without a wake-up too.
        """
        self._hot_until = _perf_counter() + self._spin_seconds
        if not self._spinning and self._spin_seconds:
            self._spinning = True
            self.loop.call_soon(self._spin)

    def expect_message(self) -> None:
        """A message is bound to arrive soon (after a forward that recorded autograd
        sends, its backward): keep polling as long as while awaiting an answer, so it
        is picked up without a wake-up."""
        self._expect_until = _perf_counter() + self._spin_seconds + self._wait_spin_seconds
        self.keep_hot()

    def _spin(self) -> None:
        now = _perf_counter()
        if (
            (now < self._hot_until or now < self._expect_until
             or (self._pending.futures and now < self._hot_until + self._wait_spin_seconds))
            and not self.closed and not self._pool.in_flight
        ):
            _sched_yield()  # let other runnable processes (more ranks than cores) run
            self.loop.call_soon(self._spin)
        else:
            self._spinning = False

    def flush_corked(self) -> None:
        """Send every peer's corked frames."""
        peers, self.corked_peers = self.corked_peers, []
        for peer in peers:
            peer.flush()

    # -- messages -------------------------------------------------------------------
    def register(self, target: str, handler: Handler, *, tell_only: bool = False) -> None:
        """Route messages for ``target`` to ``handler(peer, payload)``.

        The handler runs synchronously on the loop when the message arrives (so its
        effects are ordered like the messages); it may return a Payload (the reply), an
        awaitable of one (run as a task), or None (for tells; for a call: the handler
        passed the duty to answer on, see :meth:`answer`; the awaitable may end in None
        too). While a call's handler runs, ``serving_request`` is its request id.
        A ``tell_only`` target answers nobody, so a call to it is refused at once
        (its caller would otherwise wait for its timeout).
        """
        self._handlers[target] = handler
        if tell_only:
            self._tell_only.add(target)
        else:
            self._tell_only.discard(target)

    def answer(self, to: int, request_id: int, result: Payload | BaseException) -> None:
        """Answer the call ``request_id`` that worker ``to`` made, to whichever worker.

        A call handler may hand the duty to answer to another worker (the last one
        the work travels to), which answers the caller directly instead of a chain of
        replies back through every worker on the way. The caller's future stays tied
        to the worker it called: losing that one still fails the call.
        """
        peer = self.peer(to)
        if isinstance(result, BaseException):
            self._fail_call(peer, request_id, result)
        else:
            self._reply(peer, request_id, result)

    def _answered_by_callee(self, peer: PeerProtocol, request_id: int) -> bool:
        """Whether ``peer`` may answer our call ``request_id``: only the worker it was
        made to does, or this one (a duty to answer moves only to those, see
        :meth:`answer`). Another peer's answer would stand in for the real one, which
        would then be dropped: that peer breaks the protocol and is dropped instead."""
        future = self._pending.futures.get(request_id)
        if future is None or future.peer is peer or peer is self._loopback:
            return True
        peer.abort(ProtocolError(
            f"{peer.name} answered request {request_id}, which {self.name} made to {future.peer.name}"))
        return False

    def _reply(self, peer: PeerProtocol, request_id: int, payload: Payload) -> Message:
        """Send the result of a call; one the connection refuses (larger than
        max_frame_size) fails the call instead, and the connection stays up."""
        response: Message = Result(request_id=request_id, payload=payload)
        if not peer.can_send:
            return response  # it said goodbye: nobody there waits for the answer
        try:
            peer.send(response)
        except ProtocolError as exc:
            response = self._failure(peer, request_id, exc)
            peer.send(response)
        return response

    def _failure(self, peer: PeerProtocol, request_id: int, exc: BaseException) -> Failure:
        """The answer to ``peer``'s call ``request_id`` that raised ``exc``."""
        same_program = peer.rank is not None and self.same_program(peer.rank)
        return Failure(request_id=request_id, payload=error_payload(exc, same_program))

    def _fail_call(self, peer: PeerProtocol, request_id: int, exc: BaseException) -> None:
        """Answer the call ``request_id`` with its error (see :meth:`_reply`)."""
        if peer.can_send:
            peer.send(self._failure(peer, request_id, exc))

    def settle_own_call(self, request_id: int, value: Any) -> bool:
        """Resolve this worker's own outstanding call ``request_id`` with ``value``
        as it is, when the duty to answer it came back here (see :meth:`answer`):
        nothing is encoded, sent to ourselves and decoded again. The value stands in
        for the reply payload, so only code that made the call and knows to expect it
        may settle it. False when no such call is waiting.

        It is settled from the loop's queue, where a reply sent to ourselves used to
        arrive, so a deadline that is already due still expires first."""
        if request_id not in self._pending.futures:
            return False
        self.loop.call_soon(self._settle, request_id, value)
        return True

    def _settle(self, request_id: int, value: Any) -> None:
        future = self._pending.pop(request_id)
        if future is not None and not future.done():
            future.set_result(value)

    def on_message(self, peer: PeerProtocol, msg: Message) -> None:
        if peer.rank is None or (self.peers.get(peer.rank) is not peer and peer is not self._loopback):
            return  # a connection we rejected or replaced: nothing it sent is acted on
        if not fresh_modes():  # a coroutine waits inside torch.no_grad() or autocast...
            with as_a_fresh_thread():  # ...: tensors received now must not be marked by it
                return self.on_message(peer, msg)
        token = _current.current_worker.set(self)
        try:
            if isinstance(msg, Call):
                if peer.write_paused or peer.deferred:
                    peer.deferred.append(msg)  # served when the peer reads again
                else:
                    self._serve_call(peer, msg)
            elif isinstance(msg, Tell):
                if peer.deferred:
                    peer.deferred.append(msg)  # behind the calls it sent before: in order
                else:
                    self._serve_tell(peer, msg)
            elif isinstance(msg, Result):
                if self._answered_by_callee(peer, msg.request_id):
                    self._pending.resolve(msg.request_id, msg.payload)
            elif isinstance(msg, Failure):
                if msg.request_id in self._pending.futures and self._answered_by_callee(peer, msg.request_id):
                    self._pending.fail(msg.request_id, self._remote_error(peer, msg.payload))
            elif isinstance(msg, Cancel):
                task = peer.serving.pop(msg.request_id, None)
                if task is not None:
                    task.cancel()
                elif peer.deferred:
                    for waiting in peer.deferred:
                        if isinstance(waiting, Call) and waiting.request_id == msg.request_id:
                            peer.deferred.remove(waiting)
                            break
            elif isinstance(msg, Goodbye):
                peer.leaving = True
                if msg.reason.startswith(_STOPPED_ON_ERROR):
                    peer.left_on_error = msg.reason[:_STOP_REASON_BYTES]
        finally:
            _current.current_worker.reset(token)

    def serve_deferred(self, peer: PeerProtocol) -> None:
        """Serve, in order, the calls ``peer`` sent while it did not read our replies
        (see PeerProtocol.write_paused), and the messages it sent behind them, until it
        falls behind again."""
        if peer.rank is None or self.peers.get(peer.rank) is not peer:
            peer.deferred.clear()
            return
        if not fresh_modes():  # see on_message
            with as_a_fresh_thread():
                return self.serve_deferred(peer)
        token = _current.current_worker.set(self)
        self.corking += 1  # the replies leave together
        try:
            while peer.deferred and not peer.write_paused:
                msg = peer.deferred.popleft()
                if isinstance(msg, Call):
                    self._serve_call(peer, msg)
                else:
                    self._serve_tell(peer, msg)
        finally:
            self.corking -= 1
            _current.current_worker.reset(token)
            if not self.corking:
                self.flush_corked()

    def _on_trace_set(self, peer: PeerProtocol, payload: Payload) -> None:
        if peer.rank is not None:
            self.tracer.set_blocks(peer.rank, int(payload.load()))

    def _serve_call(self, peer: PeerProtocol, msg: Call) -> None:
        if self.tracer.enabled:
            start = now_us()
            self.serving_label = None
            answered = self._serve_call_untraced(peer, msg)
            args: dict[str, Any] = {"from": peer.name, "request": msg.request_id}
            if self.serving_label is not None:
                args["function"] = self.serving_label
            if answered is not None:  # (else "run remote function" says, when it ends)
                args["ok"] = answered
            self.tracer.complete(f"serve {msg.target}", "rpc", start, args)
            return
        self._serve_call_untraced(peer, msg)

    def _serve_call_untraced(self, peer: PeerProtocol, msg: Call) -> bool | None:
        """Whether the call was answered with a result or a failure right here (None:
        a task answers it later)."""
        handler = self._handlers.get(msg.target)
        try:
            if handler is None:
                raise ProtocolError(f"{self.name} has no handler for {msg.target!r}")
            if msg.target in self._tell_only:
                raise ProtocolError(f"{msg.target!r} is only told, never called (it answers nobody)")
            self.serving_request = msg.request_id
            reply = handler(peer, msg.payload)
        except BaseException as exc:  # no task here: a CancelledError is the function's own
            self._fail_call(peer, msg.request_id, exc)
            if isinstance(exc, KeyboardInterrupt):
                raise  # answered, and a Ctrl-C still stops this program (see _finish_call)
            return False
        if isinstance(reply, Payload):
            self._reply(peer, msg.request_id, reply)
            return True
        if reply is not None:
            task = self.loop.create_task(
                self._finish_call(peer, msg.request_id, reply, self.tracer.enabled, self.serving_label),
                context=self._context.copy(),
            )
            if inspect.iscoroutine(reply):  # cancelled before it started: close it quietly
                task.add_done_callback(functools.partial(_close_unstarted, reply))
            peer.serving[msg.request_id] = task
        return None

    async def _finish_call(self, peer: PeerProtocol, request_id: int, reply: Awaitable[Payload | None],
                           traced: bool, label: str | None = None) -> None:
        # traced: recording was on when the call arrived (a trace block may end
        # before this task starts); label: the function it runs (serving_label)
        start = now_us() if traced else 0.0
        task = asyncio.current_task()
        interrupted: KeyboardInterrupt | None = None
        try:
            result = await reply
            if result is None:  # the handler passed the duty to answer on
                peer.serving.pop(request_id, None)
                return
            response: Message = Result(request_id=request_id, payload=result)
        except asyncio.CancelledError as exc:
            # Our Cancel handler, a lost peer and shutdown end this task with cancel(),
            # which cancelling() counts; a CancelledError the function raised itself
            # (or an inner task of it that was cancelled) is its error, to be answered.
            if task is None or task.cancelling():
                if peer.serving.pop(request_id, None) is not None and not self.closed:
                    raise  # cancelled by us (shutdown): nothing to answer
                return  # cancelled by the caller: it no longer waits
            response = self._failure(peer, request_id, exc)
        except GeneratorExit as exc:
            if not _runs_in(task):
                raise  # thrown in by close() (the loop is gone): nobody to answer
            response = self._failure(peer, request_id, exc)
        except BaseException as exc:  # SystemExit too (see the note above describe_error)
            response = self._failure(peer, request_id, exc)
            if isinstance(exc, KeyboardInterrupt) and not raised_in_pool(exc):
                interrupted = exc  # maybe a Ctrl-C on the loop: raised on once answered
        peer.serving.pop(request_id, None)
        if isinstance(response, Result):
            response = self._reply(peer, request_id, response.payload)
        elif peer.can_send:  # (see _reply)
            peer.send(response)
        if interrupted is not None:
            raise interrupted
        if start:
            args = {"from": peer.name, "request": request_id, "ok": isinstance(response, Result)}
            if label is not None:
                args["function"] = label
            self.tracer.complete("run remote function", "rpc", start, args)

    def _serve_tell(self, peer: PeerProtocol, msg: Tell) -> None:
        handler = self._handlers.get(msg.target)
        if handler is None:
            log.warning("%s: no handler for message %r from %s", self.name, msg.target, peer.name)
            return
        try:
            result = handler(peer, msg.payload)
        except Exception:
            log.exception("%s: handler %r failed", self.name, msg.target)
            return
        if inspect.isawaitable(result):
            self.spawn(result)

    def spawn(self, aw: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``aw`` as a task in this worker's context; log its failure."""
        async def runner() -> Any:
            try:
                return await aw
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: background task failed", self.name)
        return self.loop.create_task(runner(), context=self._context.copy())

    def _remote_error(self, peer: PeerProtocol, payload: Payload) -> BaseException:
        try:
            type_name, message, tb, pickled = payload.load()
        except Exception as load_exc:
            return RemoteError(peer.name or "?", "UndecodableError", f"could not decode the error: {load_exc}")
        error = RemoteError(peer.name or "?", type_name, message, tb)
        if pickled is not None:
            try:
                exc = pickle.loads(pickled)
            except Exception:
                exc = None  # e.g. an exception class whose __init__ needs other arguments
            if isinstance(exc, _PASSED_ON):
                # a peer of the callee died or timed out, or a function it called raised:
                # the caller sees the same error it would have seen calling that peer
                # itself (the original type, worker and cause), and learns who passed it on
                exc.add_note(f"reported by {peer.name}, passed on at:\n{tb.rstrip()}")
                return exc
            if isinstance(exc, BaseException):
                error.__cause__ = exc
        return error

    def peer(self, to: PeerRef) -> PeerProtocol:
        """The open connection to ``to``; raises WorkerLost when it is gone."""
        info = self.resolve(to)
        if info.id == self.rank:
            return self._loopback  # type: ignore[return-value]
        proto = self.peers.get(info.id)
        if proto is None or not proto.can_send:
            if proto is None or not proto.is_open:
                raise WorkerLost(info.name, self._lost_reasons.get(
                    info.id, "no open connection (the worker is gone)"))
            # its goodbye came (or it broke the protocol): its connection closes next
            raise WorkerLost(info.name, proto.left_on_error or (
                "it shut down" if proto.leaving else "its connection broke"))
        return proto

    def call(
        self, to: PeerRef, target: str, payload: Payload, timeout: float | None = None,
        decode: Callable[[Payload], Any] | None = None, label: str | None = None,
    ) -> asyncio.Future[Any]:
        """Send a request now; the future resolves with the reply payload, or with
        ``decode(payload)`` when ``decode`` is given (its exception, if it raises).
        ``label``: what the call runs, for a trace (a remote function's name).

        Fails with RpcTimeout after ``timeout`` (default ``rpc_timeout``; 0: none), with
        WorkerLost when the peer goes away (or is gone already: the future fails, as
        every other failure of a call does, so that callers collecting futures see it
        where they wait), with RemoteError when the handler raised. Cancelling the
        future tells the callee to drop the work.
        """
        if self.closed:
            raise RuntimeError(f"{self.name} is shut down")
        check_timeout(timeout)
        try:
            peer = self.peer(to)
        except WorkerLost as lost:
            gone: asyncio.Future[Any] = self.loop.create_future()
            gone.set_exception(lost)
            return gone
        limit = self.options.rpc_timeout if timeout is None else timeout
        future = self._pending.add(peer, decode, limit)
        if self.tracer.enabled:
            self._trace_call(future, target, payload, label)
        try:
            peer.send(Call(request_id=future.request_id, target=target, payload=payload))
        except BaseException:
            self._pending.pop(future.request_id)  # never sent: nothing to wait for
            future.cancel()
            raise
        return future

    def _trace_call(self, future: CallFuture, target: str, payload: Payload, label: str | None) -> None:
        start = now_us()
        peer, request_id = future.peer, future.request_id

        def done(_: asyncio.Future[Any]) -> None:
            args: dict[str, Any] = {"to": peer.name, "request": request_id, "bytes": payload.nbytes}
            if label is not None:
                args["function"] = label
            args["ok"] = not future.cancelled() and future.exception() is None
            self.tracer.complete(f"call {target}", "rpc", start, args)

        future.add_done_callback(done)

    def _call_cancelled(self, future: CallFuture) -> None:
        with contextlib.suppress(Exception):
            future.peer.send(Cancel(request_id=future.request_id))

    def _call_expired(self, future: CallFuture, limit: float) -> None:
        runs = future.runs
        what = "call" if runs is None else (
            f"call of {getattr(runs, '__qualname__', None) or type(runs).__qualname__}")
        future.expired = True
        future.set_exception(RpcTimeout(
            f"{what} to {future.peer.name} timed out after {limit}s (the limit is the call's "
            "timeout=, else RpcOptions.rpc_timeout; 0 waits as long as it takes)"))
        self._call_cancelled(future)

    def tell(self, to: PeerRef, target: str, payload: Payload) -> None:
        """Send a one-way message; raises WorkerLost when the peer is gone."""
        self.peer(to).send(Tell(target=target, payload=payload))

    # -- execution of user code -----------------------------------------------------
    def run_blocking(self, fn: Callable[[], Any], waits_on_peers: bool = False) -> asyncio.Future[Any]:
        """Run ``fn()`` in the worker's thread pool, in the caller's contextvars.

        ``waits_on_peers``: ``fn`` only waits for other workers (the rendezvous of a
        gloo process group), so a graceful shutdown does not wait for it as for work
        served here: closing the backend ends it."""
        future = self._pool.submit(fn, contextvars.copy_context())
        if waits_on_peers:
            self._peer_waits += 1
            future.add_done_callback(self._peer_wait_done)
        return future

    def _peer_wait_done(self, _: asyncio.Future[Any]) -> None:
        self._peer_waits -= 1

    # -- failures -------------------------------------------------------------------
    def add_lost_listener(self, listener: Callable[[str, int, str], None]) -> None:
        """Call ``listener(name, rank, reason)`` when a peer is lost."""
        self._lost_listeners.append(listener)

    def on_connection_lost(self, proto: PeerProtocol, reason: str) -> None:
        self._connections.discard(proto)
        if proto.rank is None or self.peers.get(proto.rank) is not proto:
            return
        del self.peers[proto.rank]
        self.tracer.set_blocks(proto.rank, 0)  # its trace blocks will never end
        name = proto.name or f"rank {proto.rank}"
        # A peer that said goodbye, or that told us it is done while we shut down, or
        # that we are closing on: an orderly end. One that vanished without either while
        # we were shutting down crashed, and is reported like any other loss; so is one
        # we dropped (gone silent with our calls outstanding, broke the protocol).
        orderly = proto.leaving or self.closed or (
            self.shutting_down and proto.rank in self._done_from and proto.lost_reason is None)
        if proto.left_on_error:  # its program failed: no orderly end, and the peer says why
            orderly = False
            reason = f"{reason} ({proto.left_on_error})"
        elif orderly:
            reason = f"{reason} (worker shut down)"
        self._lost_reasons[proto.rank] = reason
        error = WorkerLost(name, reason)
        for request_id in list(proto.outstanding):
            self._pending.fail(request_id, error)
        proto.outstanding.clear()
        for task in proto.serving.values():
            task.cancel()
        proto.serving.clear()
        proto.deferred.clear()
        self._done_changed.set()
        if not orderly:
            log.warning("%s: lost worker %s: %s", self.name, name, reason)
        for listener in list(self._lost_listeners):
            try:
                listener(name, proto.rank, reason)
            except Exception:
                log.exception("%s: lost-worker listener failed", self.name)

    async def _heartbeats(self) -> None:
        interval = self.options.heartbeat_interval
        last = time.monotonic()
        while not self.closed:
            await asyncio.sleep(interval)
            # a peer is pinged once silent for an interval: judged no sooner than an
            # interval after that (a timeout under the interval declared a peer that
            # was busy serving a call lost in the very tick that first pinged it)
            limit = max(self.options.heartbeat_timeout, 2 * interval)
            now = time.monotonic()
            stalled_here = now - last > 2 * interval  # our own loop was blocked
            last = now
            for peer in list(self.peers.values()):
                peer.took_bytes(now)  # (looked at every tick: progress between two looks counts)
                silent = now - peer.last_received
                if silent >= interval:  # the peer answers pings while its loop runs
                    with contextlib.suppress(Exception):
                        peer.send(Heartbeat(ping=True))
                if stalled_here:
                    peer.last_received = peer.stall_since = now
                elif peer.write_paused:
                    self._check_write_stall(peer, now)
                elif peer.outstanding and silent > limit and now - peer.last_taken > limit:
                    # (a peer that took bytes of ours lately is reading: see took_bytes)
                    peer.abort(f"no message for {silent:.1f}s (heartbeat timeout)")

    def _check_write_stall(self, peer: PeerProtocol, now: float) -> None:
        """Drop a peer that took none of our bytes for heartbeat_timeout: it stopped
        reading (its calls already wait, see serve_deferred), and what we hold for it
        would otherwise stay for good."""
        taken = peer.taken_since_pause()
        if taken > peer.stall_taken:
            peer.stall_since, peer.stall_taken = now, taken
        elif now - peer.stall_since > self.options.heartbeat_timeout:
            peer.abort(f"{peer.name} stopped reading: {peer.unsent_bytes() / (1 << 20):.1f} MiB "
                       f"unsent, none taken for {now - peer.stall_since:.1f}s")

    # -- observability --------------------------------------------------------------
    async def export_trace(self, path: str) -> int:
        """Merge every reachable worker's events into one Chrome-trace JSON at ``path``.

        Written beside it and renamed when complete: an export cut short leaves no
        half-written file. Workers that did not answer are named in a warning and in
        the file's ``otherData``."""
        target = os.path.abspath(path)  # noqa: ASYNC240 - no I/O: a string operation
        try:  # a name of its own (two exports to one path at once), made first: a bad path fails at once
            fd, partial = tempfile.mkstemp(dir=os.path.dirname(target),
                                           prefix=os.path.basename(target) + ".", suffix=".partial")
        except FileNotFoundError:
            raise FileNotFoundError(f"cannot write the trace to {path}: no folder {os.path.dirname(target)}") \
                from None
        os.fchmod(fd, 0o666 & ~_umask())  # (mkstemp makes it private; open() would not)
        f = open(fd, "w")  # noqa: ASYNC230, SIM115 - closed by write() or below
        writing = done = False
        try:
            events = self.tracer.snapshot()
            ranks = list(self.peers)
            replies = [self.call(rank, "trace.collect", Payload.dump(None)) for rank in ranks]
            answered = {self.rank}
            for rank, reply in zip(ranks, await asyncio.gather(*replies, return_exceptions=True), strict=True):
                if not isinstance(reply, BaseException):
                    events.extend(reply.load())
                    answered.add(rank)
            missing = [info.name for rank, info in sorted(self.infos.items()) if rank not in answered]
            if missing:
                log.warning("%s: the trace at %s has no events of %s (gone, or did not answer)",
                            self.name, path, ", ".join(missing))

            def write() -> int:  # on the pool: a million events take seconds to arrange
                arranged = in_lanes(events)
                document: dict[str, Any] = {"traceEvents": arranged, "displayTimeUnit": "ms"}
                if missing:
                    document["otherData"] = {"workers_missing": missing}
                with f:
                    json.dump(document, f)
                return len(arranged)

            writing = True
            count = await self.run_blocking(write)
            os.replace(partial, target)
            done = True
            return count
        finally:
            if not done:
                if not writing:
                    f.close()  # (else the job closes it: it may still be writing)
                with contextlib.suppress(OSError):
                    os.unlink(partial)

    # -- shutdown -------------------------------------------------------------------
    @property
    def peers_done(self) -> frozenset[int]:
        """Ranks of the peers that said they are done during a graceful shutdown."""
        return frozenset(self._done_from)

    def _on_peer_done(self, peer: PeerProtocol, payload: Payload) -> None:
        if peer.rank is not None:
            self._done_from.add(peer.rank)
        self._done_changed.set()

    def set_stopped_on(self, exc: BaseException) -> None:
        """The program stops this worker because it raised ``exc``: tell the peers so
        when the connections close (their WorkerLost names it; the program's own
        traceback may never be seen, its process killed by a launcher meanwhile)."""
        # (whole characters within the bytes a control frame carries; a lone surrogate,
        # from an undecodable path, escaped: it cannot be encoded, and the Goodbye
        # would not go out at all)
        raw = (_STOPPED_ON_ERROR + error_line(exc)).encode("utf-8", "backslashreplace")[:_STOP_REASON_BYTES]
        self.stop_reason = raw.decode("utf-8", "ignore")

    async def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop this worker. Graceful: wait until no worker has outstanding work first.

        As torch's ``rpc.shutdown()``, a graceful shutdown waits for every other worker
        to finish and shut down too, however long it runs: workers that only serve call
        it at once. A peer that is gone is not waited on, and neither is one silent
        (no message, no answer to heartbeats) for ``RpcOptions.shutdown_timeout``: it is
        reported and the connections close anyway. ``timeout`` (> 0) bounds the whole
        wait; ``None`` and 0 leave it to the peers, as torch's default does.
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or not timeout >= 0):
            raise ValueError(f"shutdown timeout must be a number of seconds >= 0, got {timeout!r}")
        if not isinstance(graceful, bool):
            raise TypeError(f"shutdown graceful must be True or False, got {graceful!r}")
        if self.closed:
            return
        self.shutting_down = True
        deadline = time.monotonic() + timeout if timeout else math.inf
        quiet = self.options.shutdown_timeout or math.inf  # silence that ends the wait
        trace_path = os.environ.get("ACTORGRAD_TRACE")
        if trace_path and self.rank == 0:
            # (actorgrad launch --trace). Also when the program failed or did not shut
            # down (ag.run ends its worker that way): that is the run one wants to see.
            # Gracefully the others wait for our "done", so they can still be asked for
            # events; writing takes what it takes, within half of a timeout if given.
            budget = timeout / 2 if timeout else (None if graceful else _TRACE_EXPORT_UNGRACEFUL)
            try:
                async with asyncio.timeout(budget):
                    await self.export_trace(trace_path)
            except Exception as exc:
                why = f"it took longer than {budget:g}s" if isinstance(exc, TimeoutError) and budget else str(exc)
                log.warning("%s: could not write the trace to %s: %s", self.name, trace_path,
                            why or type(exc).__name__)
        if graceful:
            gc.collect()  # dropped RRefs announce themselves before we leave
            await asyncio.sleep(0)
            # our own calls: each ends by its rpc timeout, or when its peer is lost
            while self._pending and time.monotonic() < deadline:
                futures = list(self._pending.futures.values())
                await asyncio.wait(futures, timeout=_wait_s(deadline))
            for peer in list(self.peers.values()):
                with contextlib.suppress(Exception):
                    peer.send(Tell(target="runtime.done", payload=Payload.dump(None)))
            await self._wait_done(deadline, quiet)
            # work this worker accepted and still runs, also for callers that stopped
            # waiting (their timeout cancels our task, not a function already running
            # on the pool) or that left: it finishes first, as torch drains its pool
            until = min(deadline, time.monotonic() + quiet)
            while self._still_serving() and time.monotonic() < until:  # noqa: ASYNC110 - bounded
                await asyncio.sleep(0.01)
        await self._close_everything()

    async def _wait_done(self, deadline: float, quiet: float) -> None:
        """Until every peer said it is done (or is gone), the ``deadline`` passes, or
        every peer still awaited has been silent for ``quiet`` seconds. The heartbeat
        task keeps pinging them meanwhile: a peer that answers is still running."""
        while True:
            waiting = [p for r, p in self.peers.items() if r not in self._done_from]
            if not waiting:
                return
            now = time.monotonic()
            heard = max(p.last_received for p in waiting)
            if now >= deadline or now - heard >= quiet:
                why = "before the shutdown timeout" if now >= deadline else f"for {quiet:.1f}s"
                log.warning("%s: shutdown did not hear from %s %s; closing anyway", self.name,
                            ", ".join(p.name or f"rank {p.rank}" for p in waiting), why)
                return
            self._done_changed.clear()
            wake = min(deadline, heard + quiet, now + self.options.heartbeat_interval)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the wake-up
            # when a cancellation comes in the same step, and this loop would go on
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_wait_s(wake)):
                    await self._done_changed.wait()

    def _still_serving(self) -> bool:
        """Whether calls of peers are still being served here, or functions of calls
        given up on still run on the pool (``shutdown`` itself may be one of them)."""
        me = asyncio.current_task()
        serving = any(task is not me for proto in self.peers.values() for task in proto.serving.values())
        return serving or self._pool.in_flight > self._peer_waits

    async def _close_everything(self, store_linger: float = 0.0) -> None:
        if self.closed:
            return  # (two shutdowns at once: the first closes)
        self.closed = True
        _current.unregister(self)
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        for request_id, future in list(self._pending.futures.items()):
            self._pending.fail(request_id, WorkerLost(future.peer.name or "?", f"{self.name} shut down"))
        self._pending.close()
        me = asyncio.current_task()
        for proto in list(self._connections) + list(self.peers.values()):
            for request_id, task in list(proto.serving.items()):
                if task is me:  # a remote function that called shutdown: it finishes it
                    del proto.serving[request_id]  # (closing its connection cancels the rest)
                else:
                    task.cancel()
            if proto.is_open:
                with contextlib.suppress(Exception):
                    proto.send(Goodbye(reason=self.stop_reason))
                proto.close()
        for server in (self._server, self._local_server):
            if server is not None:
                server.close()
        if self._store is not None:
            await self._store.close()
        if self._store_closing is not None:
            self._store_closing.cancel()  # the close below does what it was waiting to
        if self._store_server is not None:
            # workers still in the rendezvous (a group shut down right after it formed)
            # get their last answers first; the others have hung up already
            await self._store_server.close(linger=max(store_linger, _STORE_LINGER))
        if isinstance(self._store, FileStore) and self.rank == 0:
            self._store.remove()
        await asyncio.sleep(0)
        self._pool.close()
        for name, ext in list(self.extensions.items()):
            closer = getattr(ext, "close", None)
            if closer is not None:
                try:
                    closer()
                except Exception:
                    log.exception("%s: closing %s failed", self.name, name)


def _umask() -> int:
    mask = os.umask(0o022)  # (read by setting it: there is no getter)
    os.umask(mask)
    return mask


def _tls_handshake_limit(context: Any, init_timeout: float) -> float | None:
    """The TLS handshake gets the time the worker's own handshake gets (asyncio refuses
    a limit without TLS)."""
    return init_timeout if context is not None else None


def _wait_s(until: float) -> float | None:
    """Seconds from now to the monotonic time ``until``; None for no limit."""
    return None if until == math.inf else max(0.0, until - time.monotonic())


def program_identity() -> str:
    """What this process runs, to tell whether another runs the same ``__main__``: the
    contents of its file, or this process for one without a file (a notebook, -c)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path:
        try:
            with open(path, "rb") as f:
                return "file:" + hashlib.sha256(f.read()).hexdigest()[:32]
        except OSError:
            pass
    return f"process:{socket.gethostname()}:{os.getpid()}"


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _entry_name(entry: str) -> str:
    """The worker name in a roster entry, for messages."""
    try:
        return str(json.loads(entry)["name"])
    except (ValueError, KeyError, TypeError):
        return "?"


__all__ = ["AuthenticationError", "Worker", "describe_error", "error_payload"]
