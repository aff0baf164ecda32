"""Cross-memory attach: read a peer process's tensor straight into ours.

For large tensors between workers on one machine, a message (of a collective, or a
backward pass's gradients) carries only
the address and length of the data; the receiver copies it with Linux
``process_vm_readv`` directly from the sender's memory into its own destination (the
way TensorPipe's ``cma`` channel works). That is one memory copy instead of the two a
loopback TCP transfer costs (sender into the kernel, kernel into the receiver), and
the sender spends no CPU at all. The kernel checks permissions (same user, ptrace
access); the system call releases the GIL.

Whether a pair of workers can use it is found out by a probe, never assumed: the
sender offers the address of a random token, the receiver reads it and answers
whether it got the right bytes (a worker on another machine, in another PID
namespace, or without ptrace permission cannot). Until the answer is in, and whenever
it is no, messages carry their bytes over the connection as usual. One probe per pair
of workers serves every layer (:class:`CmaPeers`).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
from typing import TYPE_CHECKING, Any

import torch

from ..wire import Payload

if TYPE_CHECKING:
    from ._worker import Worker

PROBE_TARGET = "cma.probe"
REPLY_TARGET = "cma.reply"

_libc: ctypes.CDLL | None = None


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.process_vm_readv
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
        _libc = libc
    return _libc


def available() -> bool:
    """True when this platform has ``process_vm_readv`` and it is not disabled with
    ``ACTORGRAD_CMA=0``."""
    return os.environ.get("ACTORGRAD_CMA", "1") != "0" and _load() is not None


def read(pid: int, remote_addr: int, local_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``remote_addr`` in process ``pid`` to ``local_addr`` here.

    Raises:
        OSError: the read failed (the process is gone, no permission, bad address).
    """
    libc = _load()
    if libc is None:
        raise OSError("process_vm_readv is not available")
    done = 0
    while done < nbytes:
        local = _IoVec(local_addr + done, nbytes - done)
        remote = _IoVec(remote_addr + done, nbytes - done)
        n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err) if err else 'no progress'}")
        done += n


class RemoteRef:
    """Data of a message that stays in the sender's memory until read."""

    __slots__ = ("addr", "nbytes", "pid")

    def __init__(self, pid: int, addr: int, nbytes: int) -> None:
        self.pid = pid
        self.addr = addr
        self.nbytes = nbytes

    def read_into(self, dst: torch.Tensor) -> None:
        """Copy the data into the contiguous CPU tensor ``dst`` (same byte size)."""
        size = dst.numel() * dst.element_size()
        if size != self.nbytes:
            raise ValueError(f"expected {size} bytes of data, the sender offers {self.nbytes}")
        if size:
            read(self.pid, self.addr, dst.data_ptr(), size)


class Token:
    """Random bytes at a fixed address, offered to peers to probe CMA."""

    def __init__(self) -> None:
        self.value = os.urandom(16)
        self._buf = ctypes.create_string_buffer(self.value, 16)
        self.addr = ctypes.addressof(self._buf)


def probe(pid: int, addr: int, expected: bytes) -> bool:
    """Whether reading ``expected`` from ``addr`` in ``pid`` works."""
    buf = ctypes.create_string_buffer(len(expected))
    try:
        read(pid, addr, ctypes.addressof(buf), len(expected))
    except OSError:
        return False
    return buf.raw == expected


class CmaPeers:
    """Which peers of a worker read its memory, and whose memory it reads.

    ``ok(rank)`` starts the probe the first time it is asked and says no until the
    answer arrives; a lost peer is forgotten (a worker started again under its rank
    is probed again)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.enabled = available()
        self._readers: dict[int, bool | None] = {}  # can it read our memory (None: probing)
        self._pids: dict[int, int] = {}  # peers whose memory we read, by the pid they offered
        self._token = Token() if self.enabled else None
        worker.register(PROBE_TARGET, self._on_probe, tell_only=True)
        worker.register(REPLY_TARGET, self._on_reply, tell_only=True)
        worker.add_lost_listener(self._on_lost)

    def ok(self, rank: int) -> bool:
        """Whether ``rank`` reads our large data from our memory."""
        state = self._readers.get(rank, ... if self.enabled else False)
        if state is ...:
            self._readers[rank] = None
            assert self._token is not None
            body = (os.getpid(), self._token.addr, self._token.value)
            try:
                self.worker.tell(rank, PROBE_TARGET, Payload(pickle.dumps(body, protocol=5)))
            except Exception:
                self._readers[rank] = False
            return False
        return bool(state)

    def pid(self, rank: int) -> int | None:
        """The process of ``rank``, when we can read its memory."""
        return self._pids.get(rank)

    def _on_probe(self, peer: Any, payload: Payload) -> None:
        pid, addr, value = pickle.loads(payload.body)
        ok = self.enabled and probe(pid, addr, value)
        if ok:
            self._pids[peer.rank] = pid
        self.worker.tell(peer.rank, REPLY_TARGET, Payload(pickle.dumps(ok, protocol=5)))

    def _on_reply(self, peer: Any, payload: Payload) -> None:
        self._readers[peer.rank] = bool(pickle.loads(payload.body))

    def _on_lost(self, name: str, rank: int, reason: str) -> None:
        self._readers.pop(rank, None)
        self._pids.pop(rank, None)


def setup(worker: Worker) -> None:
    """Serve the probes of a new worker's peers from the start
    (``actorgrad._api.worker_setup``)."""
    cma_peers(worker)


def cma_peers(worker: Worker) -> CmaPeers:
    """The :class:`CmaPeers` of ``worker`` (made on first use)."""
    peers = worker.extensions.get("cma")
    if not isinstance(peers, CmaPeers):
        peers = worker.extensions["cma"] = CmaPeers(worker)
    return peers


__all__ = ["CmaPeers", "RemoteRef", "Token", "available", "cma_peers", "probe", "read"]
