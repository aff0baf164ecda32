"""Cross-memory attach: read a peer process's tensor straight into ours.

For large tensors between workers on one machine, a collective message carries only
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
it is no, messages carry their bytes over the connection as usual.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

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


__all__ = ["RemoteRef", "Token", "available", "probe", "read"]
