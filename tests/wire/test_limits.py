"""Malformed and oversized input: always ProtocolError (never another exception), with a
message that names the problem; truncated input is simply incomplete."""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch
from wire_helpers import connected_pair, flatten, frame, raw_header, transfer

from actorgrad import ProtocolError
from actorgrad.wire import (
    DEFAULT_MAX_BUFFERS,
    Call,
    Connection,
    FrameDecoder,
    Kind,
    Payload,
    Result,
    State,
    decode_frame,
)
from actorgrad.wire._codec import _DTYPE_ORDER, _tensor
from actorgrad.wire._frames import HEADER, Frame

HELLO_BODY = b"\x01" * 32 + (3).to_bytes(4, "little")

BAD_HEADERS = {
    "magic": (raw_header(magic=b"HTTP"), "bad frame magic"),
    "version": (raw_header(version=2), "protocol version 2"),
    "version0": (raw_header(version=0), "protocol version 0"),
    "flags": (raw_header(flags=0x8000), "unsupported frame flags 0x8000"),
    "flags1": (raw_header(flags=1), "unsupported frame flags 0x1"),
    "too_many_buffers": (raw_header(nbuf=DEFAULT_MAX_BUFFERS + 1), "4097 buffers, the limit is 4096"),
    "body_too_big": (raw_header(body_len=(4 << 30) + 1), "exceeds max_frame_size"),
    "body_huge": (raw_header(body_len=2**64 - 1), "exceeds max_frame_size"),
    "buffers_too_big": (raw_header(nbuf=2, lengths=(2 << 30, (2 << 30) + 1)), "frame of 4294967297 bytes exceeds max_frame_size"),
    "buffer_huge": (raw_header(body_len=1, nbuf=3, lengths=(0, 2**64 - 1, 0)), "exceeds max_frame_size"),
}


def _decoder_error(data: bytes, **kwargs) -> ProtocolError:
    decoder = FrameDecoder(**kwargs)
    decoder.receive_data(data)  # never raises
    with pytest.raises(ProtocolError) as info:
        decoder.next_frame()
    with pytest.raises(ProtocolError) as again:  # sticky
        decoder.next_frame()
    assert again.value is info.value
    return info.value


def _refused(message: str, err: ProtocolError) -> bool:
    """Before the handshake a connection may refuse a frame earlier, for its kind or size."""
    text = str(err)
    return message in text or "before the handshake completed" in text or "before authentication" in text


def _connection_error(data: bytes, *, established: bool = False, **kwargs) -> ProtocolError:
    if established:
        _, conn = connected_pair(**kwargs)
    else:
        conn = Connection(name="me", rank=0, **kwargs)
    conn.receive_data(data)
    with pytest.raises(ProtocolError) as info:
        conn.next_event()
    assert conn.state is State.ERROR
    assert conn.next_event() is None
    return info.value


@pytest.mark.parametrize("name", sorted(BAD_HEADERS))
def test_bad_header(name):
    data, message = BAD_HEADERS[name]
    assert message in str(_decoder_error(data))
    assert _refused(message, _connection_error(data))
    assert message in str(_connection_error(data, established=True))
    # Also when the header arrives byte by byte, and after a good frame.
    decoder = FrameDecoder()
    for i in range(len(data)):
        decoder.receive_data(data[i : i + 1])
    with pytest.raises(ProtocolError, match=message.split(",")[0]):
        decoder.next_frame()
    decoder = FrameDecoder()
    decoder.receive_data(frame(Kind.HEARTBEAT) + data)
    assert decoder.next_frame().kind == Kind.HEARTBEAT
    with pytest.raises(ProtocolError, match=message.split(",")[0]):
        decoder.next_frame()


def test_header_errors_need_only_the_header():
    """The decoder rejects a bad header at once, without waiting for its body."""
    data = raw_header(flags=2, body_len=1000)
    assert "flags" in str(_decoder_error(data))


@pytest.mark.parametrize("kind", [0, 6, 15, 20, 99, 255])
def test_unknown_kind(kind):
    data = raw_header(kind=kind)
    assert f"unknown message kind {kind}" in str(_decoder_error(data, known_kinds=frozenset(Kind)))
    assert f"unknown message kind {kind}" in str(_connection_error(data))
    assert f"unknown message kind {kind}" in str(_connection_error(data, established=True))
    # A bare decoder knows no kinds and passes the frame up; decode_frame refuses it.
    decoder = FrameDecoder()
    decoder.receive_data(data)
    f = decoder.next_frame()
    assert f.kind == kind
    with pytest.raises(ProtocolError, match=f"unknown message kind {kind}"):
        decode_frame(f)


def test_small_max_frame_size():
    limit = 100
    ok = frame(Kind.RESULT, 1, b"x" * 40, (b"y" * 60,))  # exactly at the limit
    decoder = FrameDecoder(max_frame_size=limit)
    decoder.receive_data(ok)
    assert decoder.next_frame() is not None
    body = raw_header(body_len=limit + 1)
    assert "frame body of 101 bytes exceeds max_frame_size" in str(_decoder_error(body, max_frame_size=limit))
    bufs = raw_header(body_len=10, nbuf=2, lengths=(50, 41))
    assert "frame of 101 bytes exceeds max_frame_size=100" in str(_decoder_error(bufs, max_frame_size=limit))
    one = raw_header(nbuf=1, lengths=(limit + 1,))
    assert "exceeds max_frame_size=100" in str(_decoder_error(one, max_frame_size=limit))
    # and through a Connection configured with the same limit
    assert _refused("exceeds max_frame_size", _connection_error(bufs, max_frame_size=limit))
    assert "exceeds max_frame_size" in str(_connection_error(bufs, max_frame_size=limit, established=True))


def test_small_max_buffers():
    decoder = FrameDecoder(max_buffers=2)
    decoder.receive_data(frame(Kind.RESULT, 1, b"", (b"a", b"b")))
    assert len(decoder.next_frame().buffers) == 2
    err = _decoder_error(raw_header(nbuf=3, lengths=(1, 1, 1)), max_buffers=2)
    assert "3 buffers, the limit is 2" in str(err)
    err = _connection_error(frame(Kind.RESULT, 1, b"", (b"a", b"b", b"c")), max_buffers=2, established=True)
    assert "the limit is 2" in str(err)


def test_length_table_larger_than_staging():
    err = _decoder_error(raw_header(nbuf=100_000), max_buffers=1 << 20)
    assert "frame header too large" in str(err)


def test_truncated_frame_is_not_an_error():
    data = frame(Kind.RESULT, 3, b"body", (b"buffer",))
    for cut in range(len(data)):
        decoder = FrameDecoder()
        decoder.receive_data(data[:cut])
        assert decoder.next_frame() is None
        assert decoder.in_frame == (cut > 0)
        _, conn = connected_pair()  # a data frame only makes sense after the handshake
        conn.receive_data(data[:cut])
        assert conn.next_event() is None
        assert conn.state is State.ESTABLISHED


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
def test_a_large_body_takes_memory_as_its_bytes_arrive():
    """A header may claim a body the bytes never back: the decoder must not fill that
    much memory before they come (zero-filling it stalled the loop for seconds)."""
    claimed = 768 << 20
    decoder = FrameDecoder()
    before = _resident_bytes()
    decoder.receive_data(raw_header(kind=Kind.RESULT, request_id=9, body_len=claimed))
    assert decoder.next_frame() is None and decoder.in_frame
    assert _resident_bytes() - before < 64 << 20
    # a body of that kind, in full, still comes out as it was sent
    body = pickle.dumps(list(range(400_000)))
    assert len(body) > 1 << 20
    decoder = FrameDecoder()
    decoder.receive_data(frame(Kind.RESULT, 3, body))
    got = decoder.next_frame()
    assert got is not None and bytes(got.body) == body and pickle.loads(got.body) == list(range(400_000))


# -- control frames ----------------------------------------------------------------------
@pytest.mark.parametrize(("body", "buffers", "message"), [
    (HELLO_BODY + b"n" * 4061, (), "control frame HELLO too large"),  # 4097 bytes
    (HELLO_BODY + b"name", (b"",), "control frame HELLO too large"),  # any buffer
    (HELLO_BODY, (), "truncated HELLO"),  # no name
    (b"\x01" * 35, (), "truncated HELLO"),
    (b"", (), "truncated HELLO"),
    (HELLO_BODY + b"\xff\xfe", (), "bad HELLO"),  # name not UTF-8
    (HELLO_BODY + b"n" * 257, (), "bad HELLO"),  # name too long
    (b"\x01" * 32 + (2**31).to_bytes(4, "little") + b"n", (), "bad HELLO"),  # rank too big
])
def test_bad_hello(body, buffers, message):
    err = _connection_error(frame(Kind.HELLO, 0, body, buffers))
    assert _refused(message, err)


def test_hello_at_the_size_limits_is_fine():
    conn = Connection(name="me", rank=0)
    conn.receive_data(frame(Kind.HELLO, 0, b"\x01" * 32 + (2**31 - 1).to_bytes(4, "little") + "é".encode() * 128))
    assert conn.next_event() is None
    assert conn.peer_name == "é" * 128 and conn.peer_rank == 2**31 - 1


@pytest.mark.parametrize("kind", [Kind.AUTH, Kind.HEARTBEAT, Kind.GOODBYE, Kind.CANCEL])
def test_oversize_control_frames(kind):
    err = _connection_error(frame(kind, 0, b"z" * 4097), established=True)
    assert f"control frame {kind.name} too large" in str(err)
    err = _connection_error(frame(kind, 0, b"", (b"q",)), established=True)
    assert f"control frame {kind.name} too large" in str(err)


# -- data frames ---------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "message"), [
    (b"", "too short for its target name"),
    (b"\x05", "too short for its target name"),
    (b"\x00\x00pickle", "bad target name length 0"),
    ((257).to_bytes(2, "little") + b"t" * 257, "bad target name length 257"),
    (b"\x09\x00short", "bad target name length 9"),
    (b"\x02\x00\xc3\x28", "target name is not UTF-8"),
])
@pytest.mark.parametrize("kind", [Kind.CALL, Kind.TELL])
def test_bad_target(kind, body, message):
    err = _connection_error(frame(kind, 1, body), established=True)
    assert message in str(err)


def test_target_too_long_to_send_is_refused_by_the_receiver():
    a, b = connected_pair()
    call = Call(request_id=1, target="x" * 257, payload=Payload.dump(None))
    for chunk in a.send(call):
        b.receive_data(chunk)
    with pytest.raises(ProtocolError, match="bad target name length 257"):
        b.next_event()


# -- tensor descriptors ----------------------------------------------------------------------
class _Marker:
    """Pickles as the codec pickles a tensor, with ``pid`` as its descriptor."""

    def __init__(self, pid: object) -> None:
        self.pid = pid

    def __reduce__(self) -> tuple[object, tuple[object]]:
        return _tensor, (self.pid,)


def _descriptor_body(*pids: object) -> bytes:
    return pickle.dumps([_Marker(p) for p in pids], protocol=5)


def _pid(where: int | bytes, dtype: str, shape: tuple[int, ...], requires_grad: bool = False,
         parameter: bool = False, flags: int = 0, ndim: int | None = None,
         strides: tuple[int, ...] | None = None) -> bytes:
    """A descriptor as the codec writes it (see actorgrad.wire._codec): ``where`` is a
    buffer index (out of band) or the in-band bytes; ``flags``/``ndim`` override;
    ``strides`` makes it a strided one."""
    flags |= (1 if requires_grad else 0) | (2 if parameter else 0) | (4 if isinstance(where, int) else 0)
    flags |= 8 if strides is not None else 0
    head = struct.pack("<BBB", flags, _DTYPE_ORDER.index(dtype), len(shape) if ndim is None else ndim)
    head += struct.pack(f"<{len(shape)}q", *shape)
    if strides is not None:
        head += struct.pack(f"<{len(strides)}q", *strides)
    tail = struct.pack("<I", where) if isinstance(where, int) else where
    return head + tail


def _received_payload(body: bytes, buffers: tuple[bytes, ...]) -> Payload:
    a, b = connected_pair()
    event = None
    for chunk in [frame(Kind.RESULT, 1, body, buffers)]:
        b.receive_data(chunk)
        event = b.next_event()
    assert isinstance(event, Result)
    return event.payload


def test_descriptor_crafting_works():
    """Guard: well-formed crafted descriptors do load (so the failures below are real)."""
    payload = _received_payload(_descriptor_body(_pid(0, "int16", (2, 2)), _pid(b"\x02\x00", "int16", ()),
                                                 _pid(b"\x03\x00\x04\x00", "int16", (3, 2), strides=(0, 1))),
                                (b"\x01\x00" * 4,))
    out_of_band, in_band, strided = payload.load()
    assert torch.equal(out_of_band, torch.ones(2, 2, dtype=torch.int16))
    assert torch.equal(in_band, torch.tensor(2, dtype=torch.int16))
    assert torch.equal(strided, torch.tensor([[3, 4]] * 3, dtype=torch.int16)) and strided.stride() == (0, 1)


@pytest.mark.parametrize(("pid", "buffers", "message"), [
    (_pid(0, "float32", (4,)), (b"\x00" * 8,), "needs 16 bytes, the frame carries 8"),
    (_pid(0, "float32", (4,)), (b"\x00" * 17,), "needs 16 bytes, the frame carries 17"),
    (_pid(0, "int64", ()), (b"",), "needs 8 bytes, the frame carries 0"),
    (_pid(0, "float64", (0, 3)), (b"\x00",), "needs 0 bytes, the frame carries 1"),
    (_pid(0, "float32", (2**62, 2**62)), (b"",), "is too large"),
    (_pid(1, "float32", (1,)), (b"\x00" * 4,), "no buffer 1"),
    (_pid(2**32 - 1, "float32", (1,)), (b"\x00" * 4,), "no buffer 4294967295"),
    (_pid(0, "float32", (1,))[:1] + b"\xc8" + _pid(0, "float32", (1,))[2:], (b"\x00" * 4,),
     "malformed tensor descriptor"),  # an unknown dtype code
    (_pid(0, "float32", (1,), ndim=2), (b"\x00" * 4,), "malformed tensor descriptor"),  # sizes cut short
    (_pid(0, "float32", (1,), ndim=65), (b"\x00" * 4,), "malformed tensor descriptor"),  # too many dims
    (_pid(0, "float32", (1,))[:2], (b"\x00" * 4,), "malformed tensor descriptor"),  # header cut short
    (_pid(0, "float32", (1,), flags=16), (b"\x00" * 4,), "malformed tensor descriptor"),  # unknown flag
    (_pid(0, "float32", (2, 2), flags=8), (b"\x00" * 16,), "malformed tensor descriptor"),  # strides cut short
    (_pid(0, "float32", (2, 2), strides=(1, -1)), (b"\x00" * 16,), "strides (1, -1) out of range"),
    (_pid(0, "float32", (2, 2), strides=(2**62 + 1, 0)), (b"\x00" * 16,), "out of range"),
    (_pid(0, "float32", (2, 2), strides=(3, 1)), (b"\x00" * 20,), "cannot have strides (3, 1)"),  # gaps
    (_pid(0, "float32", (0, 2), strides=(0, 1)), (b"",), "cannot have strides"),
    (_pid(0, "float32", (3, 2), strides=(0, 1)), (b"\x00" * 24,), "needs 8 bytes, the frame carries 24"),
    (_pid(b"\x00" * 4, "float32", (3, 2), strides=(0, 1)), (), "needs 8 bytes, the descriptor carries 4"),
    (_pid(0, "float32", (1,)) + b"\x00", (b"\x00" * 4,), "malformed tensor descriptor"),  # index too long
    ((0, "float32", (1,), False, False), (b"\x00" * 4,), "malformed tensor descriptor"),  # not bytes
    ("tensor", (b"\x00" * 4,), "malformed tensor descriptor"),
    (5, (b"\x00" * 4,), "malformed tensor descriptor"),
    ((), (), "malformed tensor descriptor"),
    (bytearray(_pid(0, "float32", (1,))), (b"\x00" * 4,), "malformed tensor descriptor"),
    (_pid(0, "float32", (-1, -4)), (b"\x00" * 16,), "negative tensor dimension"),
    # in-band descriptors: the bytes travel inside the pickle
    (_pid(b"\x00" * 8, "float32", (4,)), (), "needs 16 bytes, the descriptor carries 8"),
    (_pid(b"\x00" * 3, "float32", ()), (), "needs 4 bytes, the descriptor carries 3"),
    (_pid(b"\x00", "int64", (0,)), (), "needs 0 bytes, the descriptor carries 1"),
    (_pid(b"\x00" * 4, "float32", (-1,)), (), "negative tensor dimension"),
])
def test_descriptor_mismatch(pid, buffers, message):
    payload = _received_payload(_descriptor_body(pid), buffers)
    with pytest.raises(ProtocolError) as info:
        payload.load()
    assert message in str(info.value)


@pytest.mark.parametrize("pid", [
    _pid(b"", "float32", (0, 2**63 - 1)),
    _pid(b"", "float32", (0, 2**62, 2**62)),
    _pid(b"\x00" * 4, "int32", (1,), requires_grad=True),  # ints cannot require grad
    _pid(b"\x01", "bool", (1,), requires_grad=True, parameter=True),  # same, as an nn.Parameter
], ids=["dim_overflow", "stride_overflow", "int_requires_grad", "bool_parameter_grad"])
def test_descriptor_values_torch_rejects(pid):
    payload = _received_payload(_descriptor_body(pid), ())
    with pytest.raises(ProtocolError):
        payload.load()


def test_descriptor_outside_a_payload_is_refused():
    with pytest.raises(ProtocolError, match="tensor descriptor outside an actorgrad payload"):
        pickle.loads(_descriptor_body(_pid(b"\x00" * 4, "float32", (1,))))


def test_frame_buffers_match_the_sent_tensors():
    """Well-formed traffic never trips the descriptor checks, even for odd shapes."""
    a, b = connected_pair()
    obj = [torch.zeros(0, 5), torch.ones(1, 1, 1), torch.zeros(3, 0, dtype=torch.bool)]
    got = transfer(a, b, Result(request_id=1, payload=Payload.dump(obj)))
    loaded = got.payload.load()
    assert [t.shape for t in loaded] == [t.shape for t in obj]


def test_decode_frame_rejects_buffers_on_control_frames_directly():
    f = Frame(Kind.HEARTBEAT, 0, bytearray(), [torch.empty(0, dtype=torch.uint8)])
    with pytest.raises(ProtocolError, match="control frame HEARTBEAT too large"):
        decode_frame(f)


def test_error_messages_are_flattened_frames():
    """Sanity for the helpers: raw_header() of a valid header decodes."""
    decoder = FrameDecoder()
    decoder.receive_data(raw_header(kind=Kind.CANCEL, request_id=9))
    f = decoder.next_frame()
    assert (f.kind, f.request_id, bytes(f.body), f.buffers) == (Kind.CANCEL, 9, b"", [])
    assert len(flatten([raw_header()])) == HEADER.size


@pytest.mark.parametrize("header", [
    raw_header(kind=Kind.HELLO, body_len=64 << 20),
    raw_header(kind=Kind.CALL, request_id=1, body_len=64 << 20),
], ids=["huge_hello", "huge_call"])
def test_unauthenticated_peer_cannot_announce_huge_frames(header):
    conn = Connection(name="me", rank=0, auth_key=b"k")
    conn.receive_data(header)
    with pytest.raises(ProtocolError):
        conn.next_event()
