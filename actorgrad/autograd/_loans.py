"""Large gradients of a backward pass read from the sender's memory.

A PROPAGATE_GRADS message between workers on one machine that can read each other's
memory (``runtime._cma``) carries a large gradient as a :class:`Lent` reference: its
address, size, dtype and shape. The receiver copies it with ``process_vm_readv``
straight into a tensor of its own as it takes the message, and returns the loan in a
tell a moment later (the returns of one loop iteration travel together); until then
the sender holds the tensor.

That is one copy instead of two, and no kernel socket buffers. Sending a tensor
through a socket makes the kernel allocate pages for it; in a backward pass the
gradients flow one way (towards the leaves), so one worker's kernel keeps allocating
pages another's keeps freeing, and on a virtual machine that hands free memory back to
its host such a send may cost ten times its usual time (see the README).

Only gradients the engine made travel this way: nothing but the engine holds them
while they are lent, so they cannot change before they are read. RPC arguments and
results are the caller's and the callee's tensors (a function may return a parameter
an optimizer changes next) and keep going through the connection, copied as sent.
"""

from __future__ import annotations

import array
import contextlib
import itertools
from typing import TYPE_CHECKING, Any

import torch

from .._errors import ProtocolError
from ..runtime import _cma
from ..wire import Payload

if TYPE_CHECKING:
    from ..runtime import Worker

RETURN_TARGET = "autograd.loans_returned"
LEND_MIN_BYTES = 64 << 10  # smaller ones cost less through the socket than a return
# larger ones go through the socket, read a piece at a time: one read of the whole
# would hold the loop (and every other peer's messages) for milliseconds
LEND_MAX_BYTES = 16 << 20
# Loans go back a moment after they were read, together: not while the pass that
# brought them is still finishing on this worker (its caller waits for that), but
# while the loop next waits for something (the next step's answers). uvloop's timers
# count whole milliseconds and round a shorter delay down to the next loop iteration.
RETURN_DELAY_S = 0.001

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 64


class Lent:
    """A gradient left in the sender's memory: where it is and what it looks like."""

    __slots__ = ("addr", "code", "loan_id", "nbytes", "shape")

    def __init__(self, loan_id: int, addr: int, nbytes: int, code: int, shape: tuple[int, ...]) -> None:
        self.loan_id = loan_id
        self.addr = addr
        self.nbytes = nbytes
        self.code = code
        self.shape = shape

    def __reduce__(self) -> tuple[Any, tuple[int, int, int, int, tuple[int, ...]]]:
        return Lent, (self.loan_id, self.addr, self.nbytes, self.code, self.shape)


class Loans:
    """A worker's loans, both ways: gradients it lent (held until returned) and the
    returns it owes peers whose gradients it read. Serves ``RETURN_TARGET`` with
    :meth:`on_returned` and forgets a lost peer's loans in :meth:`on_worker_lost`."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.lent: dict[int, dict[int, torch.Tensor]] = {}  # peer -> loan id -> tensor
        self.lent_total = 0  # how many gradients went this way (for tests and tuning)
        self._ids = itertools.count(1)
        self._owed: dict[int, list[int]] = {}  # peer -> loan ids read, not returned yet

    # -- lending ---------------------------------------------------------------------
    def lend(self, to: int, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        """``grads`` as they travel to ``to``: the large ones lent where it can read them."""
        lent: list[Any] | None = None
        if to == self.worker.rank:
            return grads
        for i, grad in enumerate(grads):
            if (type(grad) is not torch.Tensor or grad.layout is not torch.strided
                    or grad.device.type != "cpu" or (code := _CODES.get(grad.dtype)) is None
                    or not LEND_MIN_BYTES <= grad.nbytes <= LEND_MAX_BYTES
                    or grad.requires_grad or not grad.is_contiguous()
                    # (a lazy conjugate or negation is a flag, not in the bytes)
                    or grad.is_conj() or grad.is_neg() or not _cma.cma_peers(self.worker).ok(to)):
                continue
            loan_id = next(self._ids)
            self.lent.setdefault(to, {})[loan_id] = grad
            self.lent_total += 1
            if lent is None:
                lent = list(grads)
            lent[i] = Lent(loan_id, grad.data_ptr(), grad.nbytes, code, tuple(grad.shape))
        return grads if lent is None else tuple(lent)

    def on_returned(self, peer: Any, payload: Payload) -> None:
        ids = array.array("Q")
        ids.frombytes(payload.body)
        held = self.lent.get(peer.rank)
        if held is not None:
            for loan_id in ids:
                held.pop(loan_id, None)
            if not held:
                del self.lent[peer.rank]

    # -- borrowing -------------------------------------------------------------------
    def borrow(self, src: int, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        """``grads`` as they came from ``src``, with every lent one read into a tensor
        of ours, and returned (also when reading failed: nothing else will).

        Raises:
            ProtocolError: a malformed reference, one from a peer we cannot read, or
                one whose memory could not be read (the sender is gone, a bad address).
        """
        if not any(type(grad) is Lent for grad in grads):
            return grads
        lent = [grad for grad in grads if type(grad) is Lent]
        owed = self._owed.setdefault(src, [])
        if not owed:
            self.worker.loop.call_later(RETURN_DELAY_S, self._return, src)
        owed.extend(int(grad.loan_id) for grad in lent if type(grad.loan_id) is int)
        pid = _cma.cma_peers(self.worker).pid(src)
        if pid is None:
            raise ProtocolError(f"rank {src} lent a gradient without a memory probe")
        try:
            return tuple(_read(pid, grad) if type(grad) is Lent else grad for grad in grads)
        except OSError as exc:
            raise ProtocolError(f"the gradient rank {src} lent cannot be read: {exc}") from exc

    def _return(self, src: int) -> None:
        owed = self._owed.pop(src, [])
        if owed and src in self.worker.peers:
            with contextlib.suppress(Exception):  # a peer on its way out needs them no more
                self.worker.tell(src, RETURN_TARGET, Payload(array.array("Q", owed).tobytes()))

    def on_worker_lost(self, name: str, rank: int, reason: str) -> None:
        self.lent.pop(rank, None)
        self._owed.pop(rank, None)


def _read(pid: int, lent: Lent) -> torch.Tensor:
    """A tensor of ours holding the gradient ``lent`` describes, read from ``pid``."""
    code, shape, nbytes, addr = lent.code, lent.shape, lent.nbytes, lent.addr
    if (type(code) is not int or not 0 <= code < len(_DTYPES) or type(shape) is not tuple
            or len(shape) > _MAX_DIMS or any(type(n) is not int or n < 0 for n in shape)
            or type(nbytes) is not int or type(addr) is not int or addr <= 0):
        raise ProtocolError(f"malformed lent gradient ({code!r}, {shape!r}, {nbytes!r})")
    dtype = _DTYPES[code]
    numel = 1
    for n in shape:
        numel *= n
    if not LEND_MIN_BYTES <= nbytes <= LEND_MAX_BYTES or numel * dtype.itemsize != nbytes:
        raise ProtocolError(f"lent gradient of shape {shape} and {dtype} cannot hold {nbytes} bytes")
    grad = torch.empty(shape, dtype=dtype)
    _cma.read(pid, addr, grad.data_ptr(), nbytes)
    return grad


__all__ = ["LEND_MAX_BYTES", "LEND_MIN_BYTES", "RETURN_TARGET", "Lent", "Loans"]
