"""Payload codec: Python objects to a pickle body plus raw tensor buffers, and back.

# Theory of operation
A payload is pickled with protocol 5 by cloudpickle, so lambdas, closures and anything
defined in ``__main__`` travel by value (except the functions of ``__main__`` sent to a
worker that runs the same program: by name, see ``_main_objects``; so do its classes). Two hot spots of
cloudpickle are shortcut without changing its output: the "is this function/class
importable by reference on the other side?" test is remembered per object (and
forgotten whenever a module is registered for pickling by value), and its reducer table
is a dict instead of a ``ChainMap``.

Every ``torch.Tensor`` (or ``nn.Parameter``) inside a payload is pickled as a call of
``_tensor`` on a small descriptor (``reducer_override``; the pickler consults it only
for objects that are not plain data, where a persistent-id hook would be called for
every int and string of the payload). The descriptor is one ``bytes`` object::

    flags (1 byte: 1 requires_grad, 2 nn.Parameter, 4 out of band, 8 strided)
    dtype code (1 byte, the index of its name in _DTYPE_ORDER)
    ndim (1 byte), then ndim sizes (little-endian int64)
    strided only: ndim strides (little-endian int64)
    then either a buffer index (little-endian uint32; out of band) or the tensor's
    bytes themselves (in band: the rest of the descriptor)

The bytes are the tensor's C-order bytes, except for a *strided* tensor: one whose
elements fill the memory they span without gaps, broadcast (stride 0) dimensions aside
(a transposed or channels_last tensor, an ``expand``), which travels as that memory
and its strides, as torch's own RPC sends a storage: an expanded tensor stays as small
as its storage and keeps stride 0, a permuted one keeps its memory format, and the
sender copies nothing. A view with gaps (a column of a matrix, also expanded) is
compacted to its C-order bytes instead, so no byte travels that the tensor does not
show.

Out of band: the index of a buffer of the frame. The tensor's bytes are written
straight from its memory and received straight into a freshly allocated tensor; no
byte goes through the pickler. Used above ``INBAND_MAX_BYTES``. In band: small tensors
travel inside the pickle, since a separate buffer costs far more per tensor
(allocation, views, one more write piece) than copying a few KiB.

``Payload.tensors`` lists every tensor object met while pickling, once each, in pickling
order: the originals on the sending side; on the receiving side the rebuilt tensors,
each a fresh leaf with ``requires_grad`` preserved. A tensor met twice is described
once and arrives as one tensor met twice, as pickle keeps any object's identity (and
torch's own RPC does). The autograd layer pairs the ones that require grad into
send/recv entries.
"""

from __future__ import annotations

import contextvars
import copyreg
import io
import pickle
import reprlib
import struct
import threading
import types
from typing import Any

import cloudpickle
import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from .._errors import ProtocolError
from ._main_objects import (
    class_fingerprint,
    fingerprint,
    is_main_object,
    main_class,
    main_function,
    origin_function,
    origin_token,
)

INBAND_MAX_BYTES = 8 << 10  # tensors up to this size travel inside the pickle body

# The dtypes a descriptor can name, by code: a fixed order, so that both ends agree
# whatever their torch has (a code whose dtype this torch lacks is refused).
_DTYPE_ORDER = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "uint8", "int8",
    "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_ORDER if isinstance(getattr(torch, name, None), torch.dtype)
}
_GRAD_DTYPES = frozenset(d for d in _DTYPES.values() if d.is_floating_point or d.is_complex)
_DTYPE_CODES: dict[torch.dtype, int] = {_DTYPES[n]: i for i, n in enumerate(_DTYPE_ORDER) if n in _DTYPES}
_CODE_NAMES: tuple[str | None, ...] = tuple(n if n in _DTYPES else None for n in _DTYPE_ORDER)
_REQUIRES_GRAD, _PARAMETER, _OUT_OF_BAND, _STRIDED = 1, 2, 4, 8
_MAX_DIMS = 64  # torch's own limit
_HEAD = struct.Struct("<BBB")
_SIZES = [struct.Struct(f"<{n}q") for n in range(_MAX_DIMS + 1)]
_INDEX = struct.Struct("<I")
_MAX_ELEMENTS = 1 << 62  # beyond this torch overflows sizes and strides
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in _DTYPES.values()}

_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_batched = torch._C._functorch.is_batchedtensor
_functional = torch._C._functorch.is_functionaltensor  # (functionalize: its value may lag its mutations)
_unwrapped = torch._C._functorch.get_unwrapped
_transforms_active = torch._C._are_functorch_transforms_active
_JVP = torch._C._functorch.TransformType.Jvp
_EMPTY = memoryview(b"")
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
_uint8 = torch.uint8
_FunctionType = types.FunctionType


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte view of a CPU, contiguous copy-free version of ``tensor``'s data."""
    data = tensor.detach() if tensor.requires_grad else tensor
    if data.is_contiguous():
        try:  # fast path: a contiguous CPU tensor without conj/neg bit, of a numpy dtype
            return data.numpy().data.cast("B")
        except (RuntimeError, TypeError, ValueError):
            pass
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.resolve_conj().resolve_neg().contiguous()
    if data.numel() == 0:
        return _EMPTY
    # numpy keeps a reference to the tensor, so the memory outlives the send.
    return data.reshape(-1).view(_uint8).numpy().data


def _memory_span(tensor: torch.Tensor) -> torch.Tensor | None:
    """The memory a non-contiguous CPU tensor's elements cover, as a 1-D tensor, when
    they fill it without gaps, broadcast dimensions aside (see the module docstring);
    else None."""
    if not tensor.is_cpu or tensor.is_conj() or tensor.is_neg():
        return None
    if tensor.numel() == 0:
        return None
    span = shown = 1  # over the dimensions that are not broadcast (stride 0)
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride:
            span += (size - 1) * stride
            shown *= size
    if span != shown:
        return None  # gaps (or overlaps): compacted instead
    return tensor.detach().as_strided((span,), (1,))


def _inband_bytes(tensor: torch.Tensor) -> bytes:
    """The C-order bytes of a small tensor as one bytes object."""
    data = tensor.detach() if tensor.requires_grad else tensor
    try:  # numpy copes with any strides; it refuses conj/neg bits, bfloat16, non-CPU
        return data.numpy().tobytes()
    except (RuntimeError, TypeError):
        return bytes(_tensor_bytes(data))


# -- pickling ----------------------------------------------------------------------
try:
    from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES as _BY_VALUE_MODULES
except ImportError:  # pragma: no cover - other cloudpickle versions: no memo
    _BY_VALUE_MODULES = None

_BY_REFERENCE: dict[Any, None] = {}  # functions/classes cloudpickle pickles by reference
_BY_REFERENCE_MAX = 4096
_by_value_seen = [-1]  # len(_BY_VALUE_MODULES) when the memo was last valid


class _ReducerTable(dict[type, Any]):
    """cloudpickle's reducers, then ``copyreg``'s (live): a ChainMap the C pickler reads
    without a Python call per lookup that hits."""

    def __missing__(self, key: Any) -> Any:
        return copyreg.dispatch_table[key]


_REDUCERS = _ReducerTable(getattr(cloudpickle.Pickler, "_dispatch_table", {}))


class _ByValue:
    """A function to be pickled by value, past the codec's own choices for it."""

    __slots__ = ("func",)

    def __init__(self, func: types.FunctionType) -> None:
        self.func = func


class _Pickler(cloudpickle.Pickler):
    """cloudpickle with tensors as descriptors (see the module docstring)."""

    if getattr(cloudpickle.Pickler, "_dispatch_table", None) is not None:
        dispatch_table = _REDUCERS

    def __init__(self) -> None:
        self.file = io.BytesIO()
        super().__init__(self.file, protocol=5)
        self.tensors: list[torch.Tensor] = []
        self.buffers: list[memoryview] = []
        self.main_by_name = False  # see Payload.dump
        self.recording = False  # see Payload.dump
        self.describes_tensors = True  # False: torch pickles them itself (see dumps)
        self.wrapping: set[Any] = set()  # functions sent with their origin in this dump

    def _describe(self, obj: torch.Tensor) -> bytes | None:
        """The descriptor of ``obj`` (noting it in ``tensors``/``buffers``), or None for
        a tensor torch's own pickling handles."""
        if _functorch_wrapped(obj):
            obj = _transform_constant(obj)
        code = _DTYPE_CODES.get(obj.dtype)
        if (code is None or obj.layout is not _strided or obj.is_quantized or obj.is_nested
                or obj.dim() > _MAX_DIMS):
            return None  # torch's own (in-band) pickling handles the exotic ones
        self.tensors.append(obj)
        shape = obj.shape
        ndim = len(shape)
        flags = (_REQUIRES_GRAD if obj.requires_grad else 0) | (_PARAMETER if type(obj) is _Parameter else 0)
        head = _SIZES[ndim].pack(*shape)
        data = obj
        if not obj.is_contiguous():
            span = _memory_span(obj)
            if span is not None:
                flags |= _STRIDED
                head += _SIZES[ndim].pack(*obj.stride())
                data = span
        if data.nbytes <= INBAND_MAX_BYTES:
            tail = _inband_bytes(data)
        else:
            flags |= _OUT_OF_BAND
            tail = _INDEX.pack(len(self.buffers))
            self.buffers.append(_tensor_bytes(data))
        return _HEAD.pack(flags, code, ndim) + head + tail

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if (cls is _Tensor or cls is _Parameter) and self.describes_tensors:
            descriptor = self._describe(obj)
            if descriptor is None:
                if self.recording and obj.requires_grad:
                    _refuse_untracked(f"a {obj.layout} tensor".replace("torch.", ""))
                return NotImplemented
            if attributes := obj.__dict__:  # set by the user (t.tag = ...), as pickle keeps them
                return (_tensor, (descriptor,), attributes, None, None, _set_attributes)
            return (_tensor, (descriptor,))
        if cls is _FunctionType or cls is type:
            if self.main_by_name and obj.__module__ == "__main__" and is_main_object(obj):
                return self._by_name(obj)
            if obj in _BY_REFERENCE and _BY_VALUE_MODULES is not None and len(_BY_VALUE_MODULES) == _by_value_seen[0]:
                return NotImplemented
            # by value, with its origin (see _main_objects). A function its own globals
            # name (recursion) is met again while its arguments are pickled: there it
            # goes as a plain copy, which pickle's memo then keeps for it, so such a
            # function travels without its origin (a copy, as before)
            if (cls is _FunctionType and obj.__module__ == "__main__" and obj not in self.wrapping
                    and (token := origin_token(obj)) is not None):
                self.wrapping.add(obj)
                return (origin_function, (token, _ByValue(obj)))
            reduced = super().reducer_override(obj)
            if reduced is NotImplemented and _BY_VALUE_MODULES is not None:
                if len(_BY_VALUE_MODULES) != _by_value_seen[0] or len(_BY_REFERENCE) >= _BY_REFERENCE_MAX:
                    _BY_REFERENCE.clear()
                    _by_value_seen[0] = len(_BY_VALUE_MODULES)
                _BY_REFERENCE[obj] = None
            return reduced
        if issubclass(cls, type):  # a class with a metaclass (an ABC, an Enum)
            if self.main_by_name and obj.__module__ == "__main__" and is_main_object(obj):
                return self._by_name(obj)
            return super().reducer_override(obj)
        if self.recording and issubclass(cls, _Tensor) and obj.requires_grad:
            _refuse_untracked(f"a tensor of the subclass {cls.__qualname__}")
        if cls is _ByValue:
            return super().reducer_override(obj.func)  # (cloudpickle's copy, as before)
        return NotImplemented  # what cloudpickle does for everything else

    @staticmethod
    def _by_name(obj: Any) -> tuple[Any, tuple[str, Any]]:
        """A top-level function or class of ``__main__``, to be found by name."""
        if type(obj) is _FunctionType:
            return (main_function, (obj.__qualname__, fingerprint(obj.__code__)))
        return (main_class, (obj.__qualname__, class_fingerprint(obj)))

    def reset(self) -> None:
        """Ready for the next ``dump`` (same file, empty memo)."""
        self.file.seek(0)
        self.file.truncate()
        self.clear_memo()
        self.globals_ref: dict[int, Any] = {}
        self.tensors = []
        self.buffers = []
        self.wrapping.clear()


def dumps(obj: Any, main_by_name: bool = False) -> bytes:
    """``obj`` as bytes that plain ``pickle.loads`` rebuilds anywhere: as a payload
    pickles it (cloudpickle; with ``main_by_name``, the functions and classes of
    ``__main__`` by name, see ``Payload.dump``), but its tensors pickled by torch itself,
    inside the bytes. For what travels inside another payload as bytes (an exception,
    whose loss must not lose the rest) or outside of one (an object collective)."""
    pickler = _Pickler()
    pickler.main_by_name = main_by_name
    pickler.describes_tensors = False
    pickler.dump(obj)
    return pickler.file.getvalue()


# Set while a call is made for a thread that runs inside a forward-mode torch.func
# transform (see forward_transform_active), when another thread pickles it.
sending_for_forward_transform: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sending_for_forward_transform", default=False)


def forward_transform_active() -> bool:
    """Whether this thread runs inside torch.func.jvp (or jacfwd...), whose tangents a
    tensor carries where only this thread's transform sees them."""
    return _transforms_active() and any(
        i.key() == _JVP for i in retrieve_all_functorch_interpreters())


def _transform_constant(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a tensor of a torch.func transform, when the transform
    treats it as a constant (detached inside grad: its value is all there is to send);
    refused otherwise, since the transform cannot follow it to another worker (grad
    gave zeros, vmap an error, functionalize the value before its in-place changes)."""
    forward = forward_transform_active() or sending_for_forward_transform.get()
    while _functorch_wrapped(tensor):
        if forward or tensor.requires_grad or _batched(tensor) or _functional(tensor):
            raise TypeError(
                "a tensor inside a torch.func transform (grad, vmap, jvp...) cannot be sent: "
                "the transform cannot follow it to another worker, so its result would be "
                "wrong; apply the transform inside the remote function, use distributed "
                "autograd, or send a constant (.detach() it, outside vmap and jvp)"
            )
        tensor = _unwrapped(tensor)
    return tensor


def _refuse_untracked(what: str) -> None:
    raise TypeError(
        f"{what} that requires grad cannot take part in distributed autograd: only plain "
        "strided tensors are recorded, so its gradient would not come back; send a plain "
        "dense tensor (.to_dense(), .as_subclass(torch.Tensor)) or .detach() it"
    )


_free_picklers: list[_Pickler] = []  # reused: building a pickler costs more than a dump
_FREE_PICKLERS_MAX = 4
# A pickler's memo table grows with the objects it memoized and never shrinks, and
# clearing it walks the whole table: one that pickled a large structure would make
# every later small dump slow (~0.5 ms after a 100k-element list). Every memoized
# object takes at least a byte of the body, so the body's length bounds the table.
_REUSE_MAX_BODY = 2048


# -- unpickling --------------------------------------------------------------------
class _Loading(threading.local):
    unpickler: _Unpickler | None = None  # the one loading a payload on this thread


_loading = _Loading()


def _tensor(descriptor: bytes) -> torch.Tensor:
    """What a payload's tensors are rebuilt by (pickled by reference): the unpickler
    loading a payload on this thread rebuilds it from the frame's buffers. Met in a
    pickle loaded any other way it is refused."""
    unpickler = _loading.unpickler
    if unpickler is None:
        raise ProtocolError("a tensor descriptor outside an actorgrad payload")
    return unpickler.rebuild(descriptor)


def _set_attributes(tensor: torch.Tensor, attributes: dict[str, Any]) -> None:
    """The attributes a sent tensor carried, on its copy (a Tensor's ``__setstate__``
    takes torch's legacy state, not a dict)."""
    tensor.__dict__.update(attributes)


class _Unpickler(pickle.Unpickler):
    raw: list[torch.Tensor]  # the received buffers, as uint8 tensors
    tensors: list[torch.Tensor]  # the rebuilt tensors, in order

    def rebuild(self, pid: Any) -> torch.Tensor:
        if type(pid) is not bytes or len(pid) < _HEAD.size:
            raise ProtocolError(f"malformed tensor descriptor {reprlib.repr(pid)}")
        flags, code, ndim = _HEAD.unpack_from(pid)
        dtype_name = _CODE_NAMES[code] if code < len(_CODE_NAMES) else None
        strided = flags & _STRIDED
        end = _HEAD.size + (16 if strided else 8) * ndim
        if flags & ~(_REQUIRES_GRAD | _PARAMETER | _OUT_OF_BAND | _STRIDED) or dtype_name is None \
                or ndim > _MAX_DIMS or len(pid) < end:
            raise ProtocolError(f"malformed tensor descriptor {reprlib.repr(pid)}")
        dtype = _DTYPES[dtype_name]
        shape = _SIZES[ndim].unpack_from(pid, _HEAD.size)
        requires_grad, is_param = bool(flags & _REQUIRES_GRAD), bool(flags & _PARAMETER)
        numel = 1
        span = 1  # product of max(s, 1): bounds the strides torch will compute
        for s in shape:
            if s < 0:
                raise ProtocolError(f"negative tensor dimension in {shape}")
            numel *= s
            span *= max(s, 1)
            if span > _MAX_ELEMENTS:
                raise ProtocolError(f"tensor shape {shape} is too large")
        if requires_grad and dtype not in _GRAD_DTYPES:
            raise ProtocolError(f"a {dtype_name} tensor cannot require grad (descriptor {reprlib.repr(pid)})")
        strides: tuple[int, ...] | None = None
        elements = numel
        if strided:
            strides = _SIZES[ndim].unpack_from(pid, _HEAD.size + 8 * ndim)
            elements = 1
            for s, stride in zip(shape, strides, strict=True):
                if stride < 0 or stride > _MAX_ELEMENTS:
                    raise ProtocolError(f"tensor strides {strides} out of range")
                elements += (s - 1) * stride
            if numel == 0 or elements > numel:
                raise ProtocolError(f"tensor of shape {shape} cannot have strides {strides}")
        nbytes = elements * _ITEMSIZE[dtype]
        if not flags & _OUT_OF_BAND:
            carried = len(pid) - end
            if nbytes != carried:
                raise ProtocolError(
                    f"tensor of shape {shape} and dtype {dtype_name} needs {nbytes} "
                    f"bytes, the descriptor carries {carried}"
                )
            flat = torch.frombuffer(bytearray(pid[end:]), dtype=dtype) if numel else None
        else:
            if len(pid) != end + _INDEX.size:
                raise ProtocolError(f"malformed tensor descriptor {reprlib.repr(pid)}")
            (where,) = _INDEX.unpack_from(pid, end)
            raw = self.raw
            if where >= len(raw):
                raise ProtocolError(f"malformed tensor descriptor {reprlib.repr(pid)}: no buffer {where}")
            buffer = raw[where]
            if nbytes != buffer.numel():
                raise ProtocolError(
                    f"tensor of shape {shape} and dtype {dtype_name} needs {nbytes} "
                    f"bytes, the frame carries {buffer.numel()}"
                )
            flat = buffer.view(dtype) if numel else None
        if flat is None:
            tensor = torch.empty(shape, dtype=dtype)
        elif strides is not None:
            tensor = flat.as_strided(shape, strides)
        elif len(shape) == 1:
            tensor = flat
        elif shape:
            tensor = flat.view(*shape)
        else:
            tensor = flat.reshape(())
        if is_param:
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(requires_grad))
        elif requires_grad:
            if tensor._is_view():
                # same memory, but no view of the buffer: autograd would otherwise
                # record in-place ops on it (a recv function) as CopySlices on the base
                tensor = tensor.detach()
            tensor.requires_grad_(True)
        self.tensors.append(tensor)
        return tensor


class Payload:
    """The pickled body and tensor buffers of one data message.

    On the sending side ``dump`` fills ``body``, ``buffers`` (zero-copy byte views of
    the tensors that travel out of band) and ``tensors`` (every tensor of the object,
    the originals). On the receiving side the decoder fills ``body`` and ``raw`` (uint8
    tensors holding the received buffers); ``load()`` rebuilds the object and fills
    ``tensors`` with the rebuilt tensors, in the same order as the sender's.
    """

    __slots__ = ("body", "buffers", "raw", "tensors")

    def __init__(self, body: bytes | bytearray | memoryview, raw: list[torch.Tensor] | None = None):
        self.body = body
        self.raw: list[torch.Tensor] = raw if raw is not None else []
        self.buffers: list[memoryview] = []
        self.tensors: list[torch.Tensor] = []

    @classmethod
    def dump(cls, obj: Any, main_by_name: bool = False, recording: bool = False) -> Payload:
        """Pickle ``obj``; tensors become descriptors (plus zero-copy byte views).

        ``main_by_name``: the receiver runs the same program as this process: functions
        and classes of ``__main__`` go by name, to be found there (see ``_main_objects``).
        ``recording``: a distributed autograd context records the payload's tensors: a
        tensor requiring grad that it cannot record (sparse, a subclass) is refused."""
        try:
            pickler = _free_picklers.pop()
        except IndexError:
            pickler = _Pickler()
        pickler.main_by_name = main_by_name
        pickler.recording = recording
        pickler.dump(obj)  # on failure the pickler is dropped, not reused
        payload = cls(pickler.file.getvalue())
        payload.tensors = pickler.tensors
        payload.buffers = pickler.buffers
        if len(payload.body) <= _REUSE_MAX_BODY and len(_free_picklers) < _FREE_PICKLERS_MAX:
            pickler.reset()
            _free_picklers.append(pickler)
        return payload

    def load(self) -> Any:
        """Rebuild the object. Raises whatever unpickling raises (the caller reports it)."""
        unpickler = _Unpickler(io.BytesIO(self.body))
        unpickler.raw = self.raw
        unpickler.tensors = []
        outer, _loading.unpickler = _loading.unpickler, unpickler  # a load may nest
        try:
            obj = unpickler.load()
        finally:
            _loading.unpickler = outer
        self.tensors = unpickler.tensors
        return obj

    @property
    def nbytes(self) -> int:
        return len(self.body) + sum(b.nbytes for b in self.buffers)
