"""Every message kind and every kind of payload survives send -> receive_data -> next_event."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from wire_helpers import connected_pair, same_bits, transfer

from actorgrad import ProtocolError
from actorgrad.wire import (
    Call,
    Cancel,
    Established,
    Failure,
    Goodbye,
    Heartbeat,
    Payload,
    Result,
    State,
    Tell,
)
from actorgrad.wire._codec import _DTYPES, INBAND_MAX_BYTES

NESTED = {
    "ints": [1, -2, 2**70, 0],
    "tuple": (1.5, math.inf, -0.0, None, True),
    "nested": {"a": [{"b": ("c", b"\x00\xff", bytearray(b"ba"))}], 3: frozenset({1, 2})},
    "text": "grüße ✓",
    "empty": ([], {}, (), ""),
}

__all__ = ["connected_pair"]  # the pair helper lives in wire_helpers, shared by every file


def _closure(k: int):
    offset = [k * 10]

    def add(x: int) -> int:
        return x + k + offset[0]

    return add


def _roundtrip_payload(obj: object, key: bytes | None = None) -> tuple[object, Payload, Payload]:
    """Send ``obj`` as a Result over a fresh pair; returns (loaded, sent, received)."""
    a, b = connected_pair(key, key)
    sent = Payload.dump(obj)
    event = transfer(a, b, Result(request_id=5, payload=sent))
    assert isinstance(event, Result) and event.request_id == 5
    return event.payload.load(), sent, event.payload


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8: no sampling kernels
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, generator=g, dtype=dtype)
        if t.numel() >= 4 and dtype.is_floating_point:
            flat = t.view(-1)
            flat[:4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=dtype)
        return t
    if dtype in (torch.uint32, torch.uint64):  # randint cannot span them: draw the bytes
        raw = torch.randint(0, 256, (*shape, dtype.itemsize), generator=g, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


# -- the pair itself ----------------------------------------------------------------
@pytest.mark.parametrize("key", [None, b"shared secret", bytes(range(256))])
def test_connected_pair_establishes(key):
    a, b = connected_pair(key, key, name_a="w0", rank_a=0, name_b="wörker-1", rank_b=2**31 - 1)
    assert (a.peer_name, a.peer_rank) == ("wörker-1", 2**31 - 1)
    assert (b.peer_name, b.peer_rank) == ("w0", 0)


# -- every message kind, both directions ----------------------------------------------
_T = torch.arange(6.0).reshape(2, 3)


def _messages():
    """(message, the object its payload holds) for every kind."""
    return [
        (Call(request_id=1, target="echo", payload=Payload.dump(NESTED)), NESTED),
        # non-ASCII target of 120 characters, 200 UTF-8 bytes
        (Call(request_id=2**64 - 1, target="ä/ü" * 40, payload=Payload.dump([_T])), [_T]),
        (Tell(target="log", payload=Payload.dump(("tell", 1))), ("tell", 1)),
        (Tell(target="✓", payload=Payload.dump({"t": _T})), {"t": _T}),
        (Result(request_id=0, payload=Payload.dump(NESTED)), NESTED),
        (Failure(request_id=77, payload=Payload.dump(RuntimeError("boom"))), RuntimeError("boom")),
        (Cancel(request_id=2**63), None),
        (Heartbeat(), None),
    ]


def _equal(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and same_bits(x, y)
    if isinstance(x, BaseException):
        return type(x) is type(y) and x.args == y.args
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple):
        return type(x) is type(y) and len(x) == len(y) and all(map(_equal, x, y))
    return x == y


@pytest.mark.parametrize("direction", ["a->b", "b->a"])
@pytest.mark.parametrize("index", range(len(_messages())))
def test_message_roundtrip(direction, index):
    a, b = connected_pair(b"k", b"k")
    src, dst = (a, b) if direction == "a->b" else (b, a)
    msg, obj = _messages()[index]
    got = transfer(src, dst, msg)
    assert type(got) is type(msg)
    assert got == msg  # dataclass equality: every field except the payload
    if hasattr(msg, "payload"):
        assert _equal(obj, got.payload.load())
        assert len(got.payload.tensors) == len(msg.payload.tensors)
    assert dst.state is State.ESTABLISHED and src.state is State.ESTABLISHED


def test_non_ascii_target_roundtrip():
    # Regression: the target length prefix used to count characters, not UTF-8 bytes.
    a, b = connected_pair()
    for target in ["é", "数据/処理", "🙂" * 64]:  # the last one is exactly 256 bytes
        got = transfer(a, b, Call(request_id=1, target=target, payload=Payload.dump(1)))
        assert got.target == target
        got = transfer(b, a, Tell(target=target, payload=Payload.dump(2)))
        assert got.target == target


def test_goodbye_closes():
    a, b = connected_pair()
    got = transfer(a, b, Goodbye(reason="shutting down ✓"))
    assert got == Goodbye(reason="shutting down ✓")
    assert b.state is State.CLOSED
    # Later frames are ignored once closed, and nothing raises.
    for chunk in a.send(Heartbeat()):
        b.receive_data(chunk)
    assert b.next_event() is None
    # Goodbye may be sent in any state, even during the handshake.
    from actorgrad.wire import Connection

    c = Connection(name="c", rank=0)
    assert c.send(Goodbye(reason="bye"))


def test_goodbye_reason_is_truncated_not_broken():
    a, b = connected_pair()
    got = transfer(a, b, Goodbye(reason="x" * 5000))
    assert got.reason == "x" * 1024


def test_events_keep_their_order():
    a, b = connected_pair()
    msgs = [Call(request_id=i, target=f"t{i}", payload=Payload.dump(i)) for i in range(50)]
    for m in msgs:
        for chunk in a.send(m):
            b.receive_data(chunk)
    got = []
    while (e := b.next_event()) is not None:
        got.append(e)
    assert got == msgs
    assert [e.payload.load() for e in got] == list(range(50))


# -- payload contents -------------------------------------------------------------------
def test_nested_containers():
    loaded, _, _ = _roundtrip_payload(NESTED)
    assert loaded == NESTED
    assert isinstance(loaded["tuple"], tuple) and isinstance(loaded["nested"]["a"][0]["b"][2], bytearray)
    assert math.copysign(1.0, loaded["tuple"][2]) == -1.0


def test_lambda_and_closure():
    square = lambda x: x * x  # noqa: E731
    loaded, _, _ = _roundtrip_payload({"square": square, "add": _closure(3), "both": [square]})
    assert loaded["square"](7) == 49
    assert loaded["add"](1) == 1 + 3 + 30
    assert loaded["both"][0] is loaded["square"]  # pickle memo kept the identity
    assert loaded["square"] is not square


def _dtype_zoo(dtype: torch.dtype, big: bool) -> dict[str, torch.Tensor]:
    """Contiguous, 0-dim, empty and non-contiguous tensors; ``big`` ones exceed
    INBAND_MAX_BYTES (out-of-band buffers), the others travel inside the pickle."""
    n = 1 if not big else 100  # scale factor for the dimensions
    zoo = {
        "matrix": _sample(dtype, (5 * n, 7 * n)),
        "scalar": _sample(dtype, (), seed=1),
        "empty": _sample(dtype, (0, 3)),
        "transposed": _sample(dtype, (4 * n, 6 * n), seed=2).t(),
        "stepped": _sample(dtype, (9 * n, 10 * n), seed=3)[::2, 1::3],
        "expanded": _sample(dtype, (1, 3 * n * n), seed=4).expand(4, 3 * n * n),
        "sliced_1d": _sample(dtype, (17 * n * n,), seed=5)[3::5],
    }
    assert not any(zoo[k].is_contiguous() for k in ("transposed", "stepped", "expanded", "sliced_1d"))
    return zoo


# the zoo's tensors whose elements cover no more memory than they number: they travel
# as that memory and their strides; the views with gaps are compacted
_KEEP_STRIDES = ("transposed", "expanded")


def _memory_bytes(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to its last in memory."""
    offsets = torch.as_strided(torch.arange(t.untyped_storage().nbytes() // t.element_size()),
                               t.shape, t.stride(), t.storage_offset())
    return (int(offsets.max()) - int(offsets.min()) + 1) * t.element_size()


@pytest.mark.parametrize("big", [False, True], ids=["inband", "out_of_band"])
@pytest.mark.parametrize("name", sorted(_DTYPES))
def test_every_dtype(name, big):
    dtype = _DTYPES[name]
    tensors = _dtype_zoo(dtype, big)
    loaded, sent, received = _roundtrip_payload(tensors)
    assert loaded.keys() == tensors.keys()
    for key, original in tensors.items():
        got = loaded[key]
        assert type(got) is torch.Tensor
        assert got.dtype == dtype and got.shape == original.shape, key
        assert same_bits(got, original), key
        assert not got.requires_grad
        if key in _KEEP_STRIDES:
            assert got.stride() == original.stride(), key
        else:
            assert got.is_contiguous(), key
    # Exactly the tensors above the in-band limit travel as buffers, in order, each
    # holding exactly the tensor's bytes (its memory, for those that keep strides).
    travelling = [_memory_bytes(t) if key in _KEEP_STRIDES else t.numel() * t.element_size()
                  for key, t in tensors.items()]
    expected = [n for n in travelling if n > INBAND_MAX_BYTES]
    assert [b.nbytes for b in sent.buffers] == expected
    assert [r.numel() for r in received.raw] == expected
    if big:
        assert len(expected) >= 4
    else:
        assert expected == []
    assert len(sent.tensors) == len(received.tensors) == len(tensors)


def test_requires_grad_leaf():
    x = torch.randn(3, 4, requires_grad=True)
    nonleaf = x * 2  # a non-leaf: travels as data, arrives as a leaf requiring grad
    frozen = torch.randn(2)
    loaded, _, _ = _roundtrip_payload([x, nonleaf, frozen])
    gx, gn, gf = loaded
    assert gx.requires_grad and gx.is_leaf and gx.grad_fn is None and type(gx) is torch.Tensor
    assert gn.requires_grad and gn.is_leaf and gn.grad_fn is None
    assert not gf.requires_grad
    # not views of the frame buffer: autograd would record in-place ops on a view of a
    # buffer as CopySlices on the base instead of on the tensor itself
    assert not gx._is_view() and not gn._is_view()
    assert torch.equal(gx.detach(), x.detach()) and torch.equal(gn.detach(), nonleaf.detach())
    gx.sum().backward()  # a usable leaf
    assert torch.equal(gx.grad, torch.ones(3, 4))
    assert x.grad is None


def test_parameter():
    p = torch.nn.Parameter(torch.randn(2, 3))
    frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    loaded, _, received = _roundtrip_payload({"p": p, "frozen": frozen})
    gp, gf = loaded["p"], loaded["frozen"]
    assert type(gp) is torch.nn.Parameter and gp.requires_grad and gp.is_leaf
    assert type(gf) is torch.nn.Parameter and not gf.requires_grad
    assert torch.equal(gp.detach(), p.detach()) and torch.equal(gf, frozen)
    assert received.tensors[0] is gp and received.tensors[1] is gf


def test_attributes_set_on_tensors_travel_with_them():
    t = torch.randn(3)
    t.tag = "activations"
    p = torch.nn.Parameter(torch.randn(2))
    p.shard = {"rank": 1, "peer": t}  # a tensor among the attributes travels as one too
    p.me = p
    big = torch.randn(INBAND_MAX_BYTES)
    big.tag = ("out of band", 2)
    loaded, sent, _ = _roundtrip_payload([t, p, big, torch.ones(1)])
    lt, lp, lbig, plain = loaded
    assert lt.tag == "activations" and lbig.tag == ("out of band", 2)
    assert lp.shard["rank"] == 1 and lp.shard["peer"] is lt and lp.me is lp
    assert type(lp) is torch.nn.Parameter and torch.equal(lp.detach(), p.detach())
    assert torch.equal(lbig, big) and plain.__dict__ == {}
    assert len(sent.tensors) == 4


def test_module_state():
    module = torch.nn.Linear(4, 3)
    loaded, sent, _ = _roundtrip_payload(module)
    assert isinstance(loaded, torch.nn.Linear)
    assert len(sent.tensors) == 2  # weight and bias went out of band
    assert torch.equal(loaded.weight, module.weight) and torch.equal(loaded.bias, module.bias)
    x = torch.randn(5, 4)
    assert torch.equal(loaded(x), module(x))


def test_large_tensor():
    big = torch.randn(16 << 20)  # 64 MiB of float32
    loaded, sent, received = _roundtrip_payload({"big": big})
    assert sent.buffers[0].nbytes == 64 << 20
    assert torch.equal(loaded["big"], big)
    assert loaded["big"].data_ptr() != big.data_ptr()


@pytest.mark.parametrize("size", [6, 4096], ids=["inband", "out_of_band"])
def test_conj_and_neg_views(size):
    z = torch.randn(size, dtype=torch.complex64)
    conj = z.conj()
    neg = z.conj().imag  # a view with the negative bit set
    assert conj.is_conj() and neg.is_neg()
    loaded, sent, _ = _roundtrip_payload([conj, neg, z.conj()[::2]])
    assert len(sent.buffers) == (0 if size == 6 else 3)
    assert not loaded[0].is_conj() and not loaded[1].is_neg()
    assert torch.equal(loaded[0], conj.resolve_conj())
    assert torch.equal(loaded[0], torch.conj_physical(z))
    assert torch.equal(loaded[1], -z.imag)
    assert torch.equal(loaded[2], torch.conj_physical(z)[::2])
    assert torch.equal(z.conj(), conj)  # the original views are untouched


@pytest.mark.parametrize("big", [False, True], ids=["inband", "out_of_band"])
def test_strided_tensors_keep_their_strides(big):
    """As torch's RPC sends a storage: a tensor whose elements cover no more memory than
    they number travels as that memory and its strides (an expand stays small, a
    channels_last batch stays channels_last); a view with gaps is compacted."""
    n = 4096 if big else 8
    row = _sample(torch.float32, (1, n))
    expanded = row.expand((1 << 20) // n, n)  # 4 MiB shown, one row stored
    channels_last = _sample(torch.bfloat16, (2, 3, n, 4), seed=1).to(memory_format=torch.channels_last)
    transposed = _sample(torch.float64, (n, 3), seed=2).t()
    leaf = _sample(torch.float32, (n, 2), seed=3).t().requires_grad_()
    column = _sample(torch.int64, (n, 5), seed=4)[:, 2]  # stride 5: gaps
    secret = _sample(torch.float32, (n, 3), seed=5)
    secret[:, 2] = 31337.0  # never shown by the expanded view of the first two columns
    gapped = secret[:, :2].expand(4, n, 2)
    shown = [expanded, channels_last, transposed, leaf, column, gapped]
    loaded, sent, _ = _roundtrip_payload(shown)
    stored = row.nbytes + channels_last.nbytes + transposed.nbytes + leaf.nbytes + column.nbytes + gapped.nbytes
    assert sent.nbytes < stored + 1024
    assert b"".join([sent.body, *map(bytes, sent.buffers)]).count(struct.pack("<f", 31337.0)) == 0
    for original, got in zip(shown, loaded, strict=True):
        assert got.shape == original.shape and got.dtype == original.dtype
        assert same_bits(got.detach(), original.detach())
    assert [t.stride() for t in loaded[:4]] == [t.stride() for t in shown[:4]]
    assert loaded[1].is_contiguous(memory_format=torch.channels_last)
    assert loaded[4].is_contiguous() and loaded[5].is_contiguous()
    assert loaded[3].requires_grad and loaded[3].is_leaf and not loaded[3]._is_view()
    assert loaded[0].untyped_storage().nbytes() == row.nbytes


def test_sparse_tensor_travels():
    s = torch.sparse_coo_tensor([[0, 1, 1], [2, 0, 2]], [3.0, 4.0, 5.0], (2, 3),
                                check_invariants=True)
    loaded, _, _ = _roundtrip_payload({"sparse": s})
    assert loaded["sparse"].layout is torch.sparse_coo
    assert torch.equal(loaded["sparse"].to_dense(), s.to_dense())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensor_travels():
    # torch pickles it in band (our descriptors are for strided tensors: a nested one
    # reports layout strided too, and failed asking for its sizes)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    loaded, _, _ = _roundtrip_payload({"nested": nested})
    assert loaded["nested"].is_nested
    assert [t.tolist() for t in loaded["nested"].unbind()] == [[1.0, 1.0], [0.0, 1.0, 2.0]]


@pytest.mark.parametrize("numel", [12, 12 << 10], ids=["inband", "out_of_band"])
def test_received_tensors_are_copies(numel):
    original = torch.arange(numel, dtype=torch.float32).reshape(3, -1)
    keep = original.clone()
    other = torch.ones(5)
    loaded, _, _ = _roundtrip_payload([original, other, original])
    loaded[0].add_(100)
    loaded[0][0, 0] = -1
    assert torch.equal(original, keep)
    assert loaded[0].data_ptr() != original.data_ptr()
    original.mul_(0)  # and the other way around
    assert loaded[1].sum().item() == 5
    # a tensor met twice travels once and arrives as one tensor, as pickle keeps identity
    assert loaded[2] is loaded[0]


def test_a_tensor_met_twice_travels_once():
    shared = torch.arange(4000, dtype=torch.float32)  # out of band
    small = torch.ones(3, requires_grad=True)
    loaded, sent, received = _roundtrip_payload({"a": [shared, small], "b": (small, shared)})
    assert [t is s for t, s in zip(sent.tensors, (shared, small), strict=True)] == [True, True]
    assert len(sent.buffers) == 1
    assert loaded["a"][0] is loaded["b"][1] and loaded["a"][1] is loaded["b"][0]
    assert [t is x for t, x in zip(received.tensors, loaded["a"], strict=True)] == [True, True]
    assert torch.equal(loaded["a"][0], shared) and loaded["a"][1].requires_grad


def test_tensor_order_is_kept():
    # odd ones above the in-band limit: buffers and in-pickle bytes interleave
    sizes = [i + 1 + (3000 if i % 2 else 0) for i in range(6)]
    ts = [torch.full((n,), float(i)) for i, n in enumerate(sizes)]
    obj = {"z": ts[0], "a": [ts[1], (ts[2], {"deep": ts[3]})], "m": "text", "last": [ts[4]], "p": ts[5]}
    loaded, sent, received = _roundtrip_payload(obj)
    assert len(sent.tensors) == len(ts)
    assert all(s is t for s, t in zip(sent.tensors, ts, strict=True))
    rebuilt = [loaded["z"], loaded["a"][0], loaded["a"][1][0], loaded["a"][1][1]["deep"],
               loaded["last"][0], loaded["p"]]
    assert len(received.tensors) == len(ts)
    assert all(r is x for r, x in zip(received.tensors, rebuilt, strict=True))
    assert len(sent.buffers) == 3 and [r.numel() for r in received.raw] == [4 * n for n in sizes[1::2]]
    for i, r in enumerate(received.tensors):
        assert r.shape == (sizes[i],) and torch.all(r == i)


def test_payload_load_twice_rebuilds():
    loaded, _, received = _roundtrip_payload([torch.ones(2), 3])
    again = received.load()
    assert torch.equal(again[0], loaded[0]) and again[1] == 3


def test_send_in_wrong_state_raises():
    a, b = connected_pair()
    transfer(a, b, Goodbye())
    with pytest.raises(ProtocolError, match="closed"):
        b.send(Heartbeat())
    with pytest.raises(TypeError):
        a.send(Established("x", 1))  # type: ignore[arg-type]


def test_consecutive_dumps_are_independent():
    """Payload.dump may reuse picklers: no state may leak from one dump to the next."""
    import threading

    big, small = torch.randn(3000), torch.randn(5)
    first = Payload.dump({"big": big, "f": lambda: 1, "nested": NESTED})
    second = Payload.dump([small, NESTED])
    with pytest.raises(TypeError):
        Payload.dump({"lock": threading.Lock(), "t": big})  # fails half-way
    third = Payload.dump((big, small, NESTED))
    assert Payload.dump(NESTED).body == Payload.dump(NESTED).body  # memo is cleared
    assert [t is big for t in first.tensors] == [True] and len(first.buffers) == 1
    assert len(second.tensors) == 1 and second.tensors[0] is small and second.buffers == []
    assert [t is x for t, x in zip(third.tensors, (big, small), strict=True)] == [True, True]
    a, b = connected_pair()
    got = [transfer(a, b, Result(request_id=i, payload=p)).payload.load()
           for i, p in enumerate((first, second, third))]
    assert torch.equal(got[0]["big"], big) and got[0]["f"]() == 1 and got[0]["nested"] == NESTED
    assert torch.equal(got[1][0], small) and got[1][1] == NESTED
    assert torch.equal(got[2][0], big) and torch.equal(got[2][1], small) and got[2][2] == NESTED


def test_a_pickler_that_pickled_a_large_structure_is_not_reused(monkeypatch):
    """A pickler's memo table never shrinks and clearing it walks all of it: reusing
    one that memoized a large structure would slow every later dump down."""
    from actorgrad.wire import _codec

    monkeypatch.setattr(_codec, "_free_picklers", [])
    Payload.dump((1, "small"))
    (reused,) = _codec._free_picklers
    large = [(i, str(i)) for i in range(20_000)]
    payload = Payload.dump(large)
    assert _codec._free_picklers == []  # the one that took the large dump was dropped
    assert len(payload.body) > _codec._REUSE_MAX_BODY
    assert payload.load() == large
    Payload.dump((2, "small again"))
    assert len(_codec._free_picklers) == 1 and _codec._free_picklers[0] is not reused
