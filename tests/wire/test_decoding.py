"""h11-style ``tr`` checks: however the bytes are split, the same frames come out.

Every stream is decoded fed whole, byte by byte (small streams), in random chunk sizes
and through ``get_buffer()``/``buffer_updated()`` with varying write sizes; a trailing
partial frame never produces an event.
"""

from __future__ import annotations

import random

import pytest
import torch
from wire_helpers import (
    connected_pair,
    data_stream,
    decode_with,
    describe_event,
    feed_bytewise,
    feed_get_buffer,
    feed_random_chunks,
    feed_whole,
    flatten,
    frame,
    handshake_stream,
)

from actorgrad.wire import Call, Connection, Established, FrameDecoder, Kind, Payload, Result, State
from actorgrad.wire._frames import _DIRECT_MIN_BYTES, _DIRECT_READ_MAX, _STAGING_BYTES, HEADER

SMALL_FRAMES = [
    frame(Kind.HEARTBEAT),
    frame(Kind.CALL, 1, b"\x04\x00echo" + b"pickle"),
    frame(Kind.RESULT, 2**64 - 1, b"body", (b"", b"\x01", b"\x02\x03\x04")),
    frame(Kind.CANCEL, 12),
    frame(99, 3, b"", (b"xyz",)),  # unknown kinds pass a decoder without known_kinds
    frame(Kind.TELL, 0, b"\x01\x00t" + bytes(range(256))),
    frame(Kind.FAILURE, 5, b"", (b"", b"")),
]
SMALL = b"".join(SMALL_FRAMES)


def _big_frames() -> list[bytes]:
    rng = random.Random(1)
    return [
        # a body bigger than the staging area
        frame(Kind.RESULT, 1, rng.randbytes(_STAGING_BYTES + 12345)),
        # buffers around the direct-read threshold, and one on the huge-page (mmap) path
        frame(Kind.CALL, 2, b"\x01\x00x" + rng.randbytes(100),
              (rng.randbytes(_DIRECT_MIN_BYTES - 1), rng.randbytes(_DIRECT_MIN_BYTES),
               rng.randbytes(_DIRECT_MIN_BYTES + 1), rng.randbytes(5 << 20))),
        frame(Kind.HEARTBEAT),
        # a header whose buffer-length table spans many bytes
        frame(Kind.TELL, 0, b"\x01\x00y", tuple(rng.randbytes(i % 7) for i in range(300))),
        frame(Kind.FAILURE, 3, rng.randbytes(70000), (rng.randbytes(300000),)),
    ]


BIG_FRAMES = _big_frames()
BIG = b"".join(BIG_FRAMES)

CHUNKED_FEEDERS = [
    feed_random_chunks(0),
    feed_random_chunks(1, max_chunk=97),
    feed_random_chunks(2),
    feed_get_buffer(0),
    feed_get_buffer(1),
    feed_get_buffer(amounts=(1,)),
    feed_get_buffer(amounts=(7, 4096, 1 << 20)),
    feed_get_buffer(amounts=(HEADER.size, 1, 65536, 3)),
]


# Feeders cheap enough for megabytes (no 1-byte-per-call ones).
BULK_FEEDERS = [f for f in CHUNKED_FEEDERS if f.__name__ not in (
    "random_chunks_1", "get_buffer_None_(1,)")]
assert len(BULK_FEEDERS) == len(CHUNKED_FEEDERS) - 2


def _medium_frames() -> list[bytes]:
    rng = random.Random(2)
    return [
        frame(Kind.CALL, 4, b"\x01\x00m" + rng.randbytes(30),
              (rng.randbytes(_DIRECT_MIN_BYTES + 3), b"", rng.randbytes(10))),
        frame(Kind.HEARTBEAT),
        frame(Kind.RESULT, 5, rng.randbytes(_DIRECT_MIN_BYTES + 1)),
    ]


MEDIUM_FRAMES = _medium_frames()


def _expected(frames: list[bytes]) -> list[tuple]:
    """Decode each frame on its own, in one piece: the reference result."""
    out = []
    for f in frames:
        (described,) = decode_with(feed_whole, f)
        out.append(described)
    return out


def _check(data: bytes, frames: list[bytes], feeders) -> None:
    expected = _expected(frames)
    assert len(expected) == len(frames)
    for feeder in feeders:
        assert decode_with(feeder, data) == expected, feeder.__name__


def test_reference_decoding_is_sane():
    # The reference itself must reproduce the encoded fields.
    kind, rid, body, buffers = _expected([SMALL_FRAMES[2]])[0]
    assert (kind, rid, body, buffers) == (Kind.RESULT, 2**64 - 1, b"body", (b"", b"\x01", b"\x02\x03\x04"))
    assert _expected([SMALL_FRAMES[4]])[0] == (99, 3, b"", (b"xyz",))


def test_small_frames_every_split():
    _check(SMALL, SMALL_FRAMES, [feed_whole, feed_bytewise, *CHUNKED_FEEDERS])


def test_small_frames_every_two_piece_split():
    expected = _expected(SMALL_FRAMES)
    for cut in range(len(SMALL) + 1):
        decoder = FrameDecoder()
        decoder.receive_data(SMALL[:cut])
        decoder.receive_data(SMALL[cut:])
        got = []
        while (f := decoder.next_frame()) is not None:
            got.append((f.kind, f.request_id, bytes(f.body), tuple(b.numpy().tobytes() for b in f.buffers)))
        assert got == expected, cut


def test_medium_frames_one_byte_writes():
    """Direct (zero-copy) reads into a large buffer, filled one byte at a time."""
    _check(b"".join(MEDIUM_FRAMES), MEDIUM_FRAMES, [feed_whole, *CHUNKED_FEEDERS])


def test_big_frames_chunked():
    _check(BIG, BIG_FRAMES, [feed_whole, *BULK_FEEDERS])


def test_big_buffers_are_received_directly():
    """A large buffer is handed out by get_buffer() as the tensor's own memory, a few
    MiB at a time: one read into all of it went on for as long as the sender kept the
    socket full (seconds for a GiB), and the event loop served nothing meanwhile."""
    payload = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB
    data = frame(Kind.RESULT, 1, b"b", (payload.numpy().tobytes(),))
    decoder = FrameDecoder()
    decoder.receive_data(data[: HEADER.size + 8 + 1])  # header, length table, body
    rest = memoryview(data)[HEADER.size + 9 :]
    offered = []
    first = None
    while rest:
        buf = decoder.get_buffer(-1)
        first = buf if first is None else first
        offered.append(len(buf))
        n = min(len(buf), len(rest))
        buf[:n] = rest[:n]
        decoder.buffer_updated(n)
        rest = rest[n:]
    assert sum(offered) == payload.numel() * 4 and max(offered) == _DIRECT_READ_MAX, offered
    f = decoder.next_frame()
    assert f is not None and torch.equal(f.buffers[0].view(torch.int32), payload)
    # the memory read into was the buffer's own, not the staging area
    import numpy as np

    assert first is not None and f.buffers[0].data_ptr() == np.frombuffer(first, np.uint8).ctypes.data
    assert decoder.next_frame() is None and not decoder.in_frame


@pytest.mark.parametrize("frames", [SMALL_FRAMES, BIG_FRAMES], ids=["small", "big"])
def test_trailing_partial_frame_yields_nothing(frames):
    data = b"".join(frames)
    expected = _expected(frames)
    tail = frames[-1] if len(frames[-1]) < 1000 else frames[1]
    rng = random.Random(5)
    cuts = sorted({1, HEADER.size - 1, HEADER.size, HEADER.size + 1, len(tail) - 1,
                   *(rng.randrange(1, len(tail)) for _ in range(5))})
    for cut in cuts:
        if not 0 < cut < len(tail):
            continue
        for feeder in (feed_whole, feed_random_chunks(cut), feed_get_buffer(cut)):
            decoder = FrameDecoder()
            feeder(decoder, data + tail[:cut])
            got = []
            while (f := decoder.next_frame()) is not None:
                got.append((f.kind, f.request_id, bytes(f.body), tuple(b.numpy().tobytes() for b in f.buffers)))
            assert got == expected, (cut, feeder.__name__)
            assert decoder.next_frame() is None  # NEED_DATA, not an error, repeatedly
            assert decoder.in_frame
            # The rest of the frame completes it.
            decoder.receive_data(tail[cut:])
            f = decoder.next_frame()
            assert f is not None
            assert (f.kind, f.request_id, bytes(f.body)) == expected[frames.index(tail)][:3]
            assert decoder.next_frame() is None and not decoder.in_frame
            assert decoder.buffered_bytes == 0


def test_garbage_after_complete_frames():
    """Frames before a broken one still come out; then the error."""
    from actorgrad import ProtocolError

    for feeder in (feed_whole, feed_bytewise, feed_random_chunks(3), feed_get_buffer(3)):
        decoder = FrameDecoder()
        feeder(decoder, SMALL + b"JUNK" + b"\x00" * 40)
        got = []
        with pytest.raises(ProtocolError, match="magic"):
            while True:
                f = decoder.next_frame()
                assert f is not None
                got.append(f.kind)
        assert got == [int.from_bytes(f[5:6], "little") for f in SMALL_FRAMES]
        with pytest.raises(ProtocolError, match="magic"):  # the error is sticky
            decoder.next_frame()


# -- the same through a Connection -----------------------------------------------------
def _connection_events(feeder, key: bytes | None, data_part: bytes, tail: bytes = b""):
    conn = Connection(name="me", rank=0, auth_key=key)
    stream = handshake_stream(conn, key=key) + data_part + tail
    feeder(conn, stream)
    events = []
    while (e := conn.next_event()) is not None:
        events.append(describe_event(e))
    return conn, events


@pytest.mark.parametrize("key", [None, b"k3y"])
def test_connection_every_split(key):
    data = data_stream()
    _, reference = _connection_events(feed_whole, key, data)
    assert reference[0] == ("Established", "peer", 7)
    assert [e[0] for e in reference[1:]] == [
        "Call", "Tell", "Result", "Failure", "Cancel", "Heartbeat", "Call", "Result"]
    for feeder in [feed_bytewise, *CHUNKED_FEEDERS]:
        conn, events = _connection_events(feeder, key, data)
        assert events == reference, feeder.__name__
        assert conn.state is State.ESTABLISHED


def test_connection_big_payloads_chunked():
    big = torch.randn(3 << 20)  # 12 MiB
    msgs = [
        Call(request_id=1, target="big", payload=Payload.dump({"x": big, "y": torch.arange(100)})),
        Result(request_id=2, payload=Payload.dump(b"z" * (_STAGING_BYTES * 2))),
    ]
    data = data_stream(msgs)
    for feeder in (feed_whole, feed_random_chunks(9), feed_get_buffer(9), feed_get_buffer(amounts=(65536,))):
        conn = Connection(name="me", rank=0)
        feeder(conn, handshake_stream(conn) + data)
        assert isinstance(conn.next_event(), Established)
        call = conn.next_event()
        assert isinstance(call, Call)
        loaded = call.payload.load()
        assert torch.equal(loaded["x"], big) and torch.equal(loaded["y"], torch.arange(100))
        result = conn.next_event()
        assert result.payload.load() == b"z" * (_STAGING_BYTES * 2)
        assert conn.next_event() is None


@pytest.mark.parametrize("key", [None, b"k3y"])
def test_connection_trailing_partial_frame(key):
    data = data_stream()
    _, reference = _connection_events(feed_whole, key, data)
    sender, _ = connected_pair()
    partial = flatten(sender.send(Call(request_id=1, target="x", payload=Payload.dump([1] * 100))))
    for cut in (1, HEADER.size - 1, HEADER.size, len(partial) // 2, len(partial) - 1):
        for feeder in (feed_whole, feed_random_chunks(cut), feed_get_buffer(cut)):
            conn, events = _connection_events(feeder, key, data, partial[:cut])
            assert events == reference, (cut, feeder.__name__)
            assert conn.next_event() is None and conn.in_frame
            assert conn.state is State.ESTABLISHED
            conn.receive_data(partial[cut:])
            call = conn.next_event()
            assert isinstance(call, Call) and call.payload.load() == [1] * 100
            assert conn.next_event() is None and not conn.in_frame

