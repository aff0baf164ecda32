"""Worker configuration and identity."""

from __future__ import annotations

import numbers
import ssl
from dataclasses import dataclass, field

from ..wire import DEFAULT_MAX_FRAME_SIZE


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Identity of a worker of the group: its unique ``name`` and its rank ``id``."""

    name: str
    id: int

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


@dataclass(slots=True)
class RpcOptions:
    """Options of :func:`actorgrad.init_rpc`. The defaults are safe for one machine.

    Attributes:
        rpc_timeout: default timeout of every call in seconds; ``0`` means no limit.
        auth_key: shared secret; when set, every connection proves it with an HMAC
            challenge before any data is decoded. ``None`` reads ``ACTORGRAD_AUTH_KEY``
            from the environment (``actorgrad launch`` sets it); empty means no auth.
        listen_host: address the worker listens on. Loopback by default: listening on a
            public address lets anyone who reaches it (and holds the key) run code here.
        advertise_host: address other workers use to reach this one (default: the
            listen address, or the address used to reach the rendezvous when listening
            on all interfaces).
        listen_port: port to listen on (0 picks a free one).
        num_worker_threads: threads that run blocking remote functions off the loop
            (16, as TensorPipe's; started as needed). A function that blocks
            (waits for other calls, a lock) holds one for as long as it waits.
        heartbeat_interval / heartbeat_timeout: an idle connection is pinged every
            interval; a peer silent for longer than the timeout while calls to it are
            outstanding is declared lost (never before two intervals: it has at
            least one to answer a ping).
        init_timeout: bound on the rendezvous.
        shutdown_timeout: how long a graceful shutdown waits for peers that have gone
            silent (no message, no answer to heartbeats) before it closes anyway. A
            peer still running is waited for however long it runs, as torch's
            ``rpc.shutdown()`` waits; ``0``: no limit.
        max_frame_size: largest frame accepted from a peer, in bytes.
        ssl_context: optional TLS for the listening side (an ``ssl.PROTOCOL_TLS_SERVER``
            context with the worker's certificate).
        ssl_client_context: TLS for outgoing connections (``ssl.PROTOCOL_TLS_CLIENT``,
            trusting the peers' certificates); required when ``ssl_context`` is set.
        autograd_mode: default ``mode`` of distributed backward ("fast" or "smart").
        trace: record RPC and backward events for :func:`actorgrad.export_trace`.
        inline_functions: let remote Python functions that proved fast, and whose
            code can only compute (it cannot block: see ``actorgrad.rpc._purity``), run
            on the callee's event loop instead of its thread pool, which saves a thread
            hop per call; a run that turns out slow sends the function back to the
            pool. ``False``: always use the pool.
        spin_us: after sending or receiving, the loop keeps polling instead of
            sleeping for this many microseconds, so a quick answer is picked up
            without the cost of waking the process. ``0`` turns polling off; a quiet
            worker sleeps either way.
        local_sockets: connect to workers on the same host (same kernel and network
            namespace) through a Unix domain socket instead of loopback TCP: the
            same messages, about half the latency. Off when TLS is configured, so
            that every connection is encrypted as asked; ``False`` keeps TCP.
        socket_buffer_bytes: kernel send and receive buffer of each peer connection
            (``SO_SNDBUF``/``SO_RCVBUF``; the kernel caps it at ``net.core.wmem_max``
            / ``rmem_max``); ``0`` keeps the system's default and its autotuning.
    """

    rpc_timeout: float = 60.0
    auth_key: bytes | str | None = field(default=None, repr=False)  # (a secret: not printed)
    listen_host: str = "127.0.0.1"
    advertise_host: str | None = None
    listen_port: int = 0
    num_worker_threads: int = 16
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 6.0
    init_timeout: float = 60.0
    shutdown_timeout: float = 30.0
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False)
    ssl_client_context: ssl.SSLContext | None = field(default=None, repr=False)
    autograd_mode: str = "fast"
    trace: bool = False
    inline_functions: bool = True
    spin_us: int = 500
    local_sockets: bool = True
    socket_buffer_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise TypeError/ValueError naming a field of the wrong type or value; also
        run by ``init_rpc``, for fields set after construction."""
        # (name, least value, whether the least value itself is allowed, whole numbers only)
        for name, least, inclusive, whole in (
            ("rpc_timeout", 0, True, False),  # 0: no limit
            ("heartbeat_interval", 0, False, False),  # 0 would ping in a busy loop
            ("heartbeat_timeout", 0, False, False),
            ("init_timeout", 0, False, False),
            ("shutdown_timeout", 0, True, False),
            ("spin_us", 0, True, False),
            ("listen_port", 0, True, True),
            ("num_worker_threads", 1, True, True),
            ("max_frame_size", 1 << 16, True, True),  # room for the handshake and headers
            ("socket_buffer_bytes", 0, True, True),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral if whole else numbers.Real):
                kind = "an int" if whole else "a number"
                raise TypeError(f"RpcOptions.{name} must be {kind}, got {type(value).__name__} {value!r}")
            if value != value or value < least or (value == least and not inclusive):  # NaN too
                bound = f">= {least}" if inclusive else f"> {least}"
                raise ValueError(f"RpcOptions.{name} must be {bound}, got {value!r}")
        if self.listen_port > 65535:
            raise ValueError(f"RpcOptions.listen_port must be <= 65535, got {self.listen_port}")
        for name, kinds, what in (
            ("auth_key", (bytes, bytearray, str, type(None)), "bytes, a str or None"),
            ("listen_host", (str,), "a str (a host name or address)"),
            ("advertise_host", (str, type(None)), "a str or None"),
            ("ssl_context", (ssl.SSLContext, type(None)), "an ssl.SSLContext or None"),
            ("ssl_client_context", (ssl.SSLContext, type(None)), "an ssl.SSLContext or None"),
        ):
            value = getattr(self, name)
            if not isinstance(value, kinds):
                shown = "" if name == "auth_key" else f" {value!r:.40}"  # (a key is not echoed)
                raise TypeError(f"RpcOptions.{name} must be {what}, got {type(value).__name__}{shown}")
        for name in ("trace", "inline_functions", "local_sockets"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)):  # ("no" is true)
                raise TypeError(f"RpcOptions.{name} must be True or False, got {type(value).__name__} {value!r:.40}")
        if (self.ssl_context is None) != (self.ssl_client_context is None):
            raise ValueError(
                "TLS needs both ssl_context (listening) and ssl_client_context (connecting)"
            )
        if self.autograd_mode not in ("fast", "smart"):
            raise ValueError(f"autograd_mode must be 'fast' or 'smart', got {self.autograd_mode!r}")
