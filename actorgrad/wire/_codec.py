"""Payload codec: Python objects to a pickle body plus raw tensor buffers, and back.

# Theory of operation
A payload is pickled with protocol 5 (cloudpickle, so lambdas and closures travel). Every
``torch.Tensor`` inside it is replaced by a small descriptor (buffer index, dtype name,
shape, requires_grad) through the pickle persistent-id mechanism; its bytes travel as a
separate buffer of the frame, written straight from the tensor's memory and received
straight into a freshly allocated tensor. No tensor byte goes through the pickler.

The tensors are kept in order on both sides (``Payload.tensors``): the autograd layer
pairs the ones that require grad into send/recv entries.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle
import torch

from .._errors import ProtocolError

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16,
        torch.complex64, torch.complex128, torch.uint8, torch.int8, torch.int16,
        torch.int32, torch.int64, torch.bool,
    )
}  # fmt: skip

_EMPTY = memoryview(b"")


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte view of a CPU, contiguous copy-free version of ``tensor``'s data."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.resolve_conj().resolve_neg().contiguous()
    if data.numel() == 0:
        return _EMPTY
    # numpy keeps a reference to the tensor, so the memory outlives the send.
    return memoryview(data.reshape(-1).view(torch.uint8).numpy())


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=5)
        self._tensors = tensors

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            if obj.layout is not torch.strided or obj.is_quantized or obj.dtype not in _DTYPES.values():
                return None  # torch's own (in-band) pickling handles the exotic ones
            index = len(self._tensors)
            self._tensors.append(obj)
            return (
                index,
                str(obj.dtype).removeprefix("torch."),
                tuple(obj.shape),
                obj.requires_grad,
                type(obj) is torch.nn.Parameter,
            )
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffers: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._buffers = buffers
        self.tensors: list[torch.Tensor] = []

    def persistent_load(self, pid: Any) -> Any:
        try:
            index, dtype_name, shape, requires_grad, is_param = pid
            dtype = _DTYPES[dtype_name]
            raw = self._buffers[index]
            shape = tuple(int(s) for s in shape)
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise ProtocolError(f"malformed tensor descriptor {pid!r}") from exc
        numel = 1
        for s in shape:
            if s < 0:
                raise ProtocolError(f"negative tensor dimension in {shape}")
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize != raw.numel():
            raise ProtocolError(
                f"tensor of shape {shape} and dtype {dtype_name} needs {numel * itemsize} "
                f"bytes, the frame carries {raw.numel()}"
            )
        tensor = torch.empty(shape, dtype=dtype) if numel == 0 else raw.view(dtype).reshape(shape)
        if is_param:
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(requires_grad))
        elif requires_grad:
            tensor.requires_grad_(True)
        self.tensors.append(tensor)
        return tensor


class Payload:
    """The pickled body and tensor buffers of one data message.

    On the sending side ``dump`` fills ``body``, ``buffers`` and ``tensors`` (the
    originals). On the receiving side the decoder fills ``body`` and ``raw`` (uint8
    tensors holding the received bytes); ``load()`` rebuilds the object and fills
    ``tensors`` with the rebuilt tensors, in the same order as the sender's.
    """

    __slots__ = ("body", "buffers", "raw", "tensors")

    def __init__(self, body: bytes | bytearray | memoryview, raw: list[torch.Tensor] | None = None):
        self.body = body
        self.raw: list[torch.Tensor] = raw if raw is not None else []
        self.buffers: list[memoryview] = []
        self.tensors: list[torch.Tensor] = []

    @classmethod
    def dump(cls, obj: Any) -> Payload:
        """Pickle ``obj``; tensors become descriptors plus zero-copy byte views."""
        tensors: list[torch.Tensor] = []
        file = io.BytesIO()
        _Pickler(file, tensors).dump(obj)
        payload = cls(file.getbuffer())
        payload.tensors = tensors
        payload.buffers = [_tensor_bytes(t) for t in tensors]
        return payload

    def load(self) -> Any:
        """Rebuild the object. Raises whatever unpickling raises (the caller reports it)."""
        unpickler = _Unpickler(io.BytesIO(self.body), self.raw)
        obj = unpickler.load()
        self.tensors = unpickler.tensors
        return obj

    @property
    def nbytes(self) -> int:
        return len(self.body) + sum(b.nbytes for b in self.buffers)
