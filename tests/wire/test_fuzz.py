"""Property tests: whatever bytes arrive, only ProtocolError/AuthenticationError escape,
decoding terminates, no data event precedes authentication, and the outcome does not
depend on how the bytes were split.

``scripts/fuzz_wire.py`` runs the same kind of campaign for much longer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from wire_helpers import (
    data_stream,
    describe_event,
    describe_frame,
    flatten,
    handshake_stream,
    raw_header,
)

from actorgrad import AuthenticationError, ProtocolError
from actorgrad.wire import (
    Auth,
    Call,
    Connection,
    Established,
    Failure,
    FrameDecoder,
    Goodbye,
    Hello,
    Kind,
    Payload,
    Result,
    State,
    Tell,
)
from actorgrad.wire._connection import _encode
from actorgrad.wire._frames import HEADER

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,  # keep the checkout clean; failures print their reproducer
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LIMIT = 1 << 20  # max_frame_size while fuzzing: mutated lengths must not allocate GiBs
KEY = b"fuzz key"
DATA_KINDS = (Call, Tell, Result, Failure)

BASE_MESSAGES = data_stream(goodbye=None)
# Without a key the handshake does not depend on the receiver's nonce.
PLAIN_HANDSHAKE = flatten(_encode(Hello(name="peer", rank=7, nonce=b"\x07" * 32))) + flatten(
    _encode(Auth(digest=b""))
)


def _frame_starts(data: bytes) -> list[int]:
    """Offsets of the frames in a valid stream."""
    starts, pos = [], 0
    while pos < len(data):
        starts.append(pos)
        _, _, _, _, _, body, nbuf = HEADER.unpack_from(data, pos)
        lengths = [int.from_bytes(data[pos + HEADER.size + 8 * i : pos + HEADER.size + 8 * i + 8], "little")
                   for i in range(nbuf)]
        pos += HEADER.size + 8 * nbuf + body + sum(lengths)
    assert pos == len(data)
    return starts


# -- feeding ------------------------------------------------------------------------------
chunk_sizes = st.lists(st.integers(1, 300), min_size=1, max_size=20)
feed_modes = st.sampled_from(["whole", "chunks", "get_buffer"])


def _feed(sink: Any, data: bytes, mode: str, sizes: list[int]) -> None:
    if mode == "whole":
        sink.receive_data(data)
        return
    pos = i = 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        i += 1
        if mode == "chunks":
            sink.receive_data(data[pos : pos + n])
            pos += n
        else:
            buf = sink.get_buffer(-1)
            n = min(n, len(buf), len(data) - pos)
            assert n > 0
            buf[:n] = data[pos : pos + n]
            sink.buffer_updated(n)
            pos += n


def _run_connection(conn: Connection, data: bytes, mode: str, sizes: list[int]):
    """Feed and drain; check the invariants; return (described events, error or None)."""
    _feed(conn, data, mode, sizes)
    events: list[Any] = []
    error: Exception | None = None
    bound = len(data) // HEADER.size + 1  # every event needs at least one frame header
    try:
        while (event := conn.next_event()) is not None:
            events.append(event)
            assert len(events) <= bound, "decoding does not terminate"
    except (ProtocolError, AuthenticationError) as exc:
        error = exc
        assert conn.state is State.ERROR
        assert conn.next_event() is None
    # Authentication comes first, and once; nothing but Established before it.
    established = [i for i, e in enumerate(events) if isinstance(e, Established)]
    assert established in ([], [0])
    if not established:
        assert events == []
    else:
        assert conn.state in (State.ESTABLISHED, State.CLOSED, State.ERROR)
        assert conn.peer_name == events[0].peer_name
    # Nothing after a Goodbye.
    goodbyes = [i for i, e in enumerate(events) if isinstance(e, Goodbye)]
    assert goodbyes in ([], [len(events) - 1])
    if goodbyes and error is None:
        assert conn.state is State.CLOSED
    return [describe_event(e) for e in events], error


def _note(events: list[Any], error: Exception | None) -> None:
    """Coverage labels for ``pytest --hypothesis-show-statistics``."""
    event(f"events: {len(events)}" if len(events) < 3 else "events: 3+")
    event("ok" if error is None else f"{type(error).__name__}: {str(error).split()[0:3]}")


def _outcome(error: Exception | None) -> tuple[str, str] | None:
    return None if error is None else (type(error).__name__, str(error))


# -- (a) arbitrary bytes ----------------------------------------------------------------
@FUZZ
@given(data=st.binary(max_size=2000), mode=feed_modes, sizes=chunk_sizes, keyed=st.booleans())
def test_arbitrary_bytes(data, mode, sizes, keyed):
    conn = Connection(name="fuzz", rank=0, auth_key=KEY if keyed else None, max_frame_size=LIMIT)
    events, error = _run_connection(conn, data, mode, sizes)
    _note(events, error)
    assert not any(e[0] in ("Call", "Tell", "Result", "Failure") for e in events[:1])


# Frames whose header fields are drawn from "almost valid" values, after a valid keyless
# handshake: this reaches decode_frame and the established state, which random bytes never do.
@st.composite
def structured_frame(draw) -> bytes:
    kind = draw(st.sampled_from([int(k) for k in Kind] * 3 + [0, 6, 20, 255]))
    body = draw(st.one_of(
        st.binary(max_size=64),
        st.builds(lambda n, t, rest: n.to_bytes(2, "little") + t + rest,
                  st.integers(0, 300), st.binary(max_size=8), st.binary(max_size=16)),
        st.just(b"\x01" * 32 + b"\x00\x00\x00\x00" + b"name"),
    ))
    buffers = draw(st.lists(st.binary(max_size=16), max_size=3))
    head = raw_header(
        magic=draw(st.sampled_from([b"AGRD"] * 9 + [b"AGRE"])),
        version=draw(st.sampled_from([1] * 9 + [0, 2])),
        kind=kind,
        flags=draw(st.sampled_from([0] * 9 + [1, 0x100])),
        request_id=draw(st.sampled_from([0, 1, 2**64 - 1])),
        body_len=len(body) + draw(st.sampled_from([0] * 9 + [-1, 1, LIMIT])) if body else 0,
        nbuf=len(buffers),
        lengths=tuple(len(b) for b in buffers),
    )
    return head + body + b"".join(buffers)


@FUZZ
@given(frames=st.lists(structured_frame(), max_size=6), mode=feed_modes, sizes=chunk_sizes,
       handshake=st.booleans())
def test_structured_frames(frames, mode, sizes, handshake):
    conn = Connection(name="fuzz", rank=0, max_frame_size=LIMIT)
    data = (PLAIN_HANDSHAKE if handshake else b"") + b"".join(frames)
    events, error = _run_connection(conn, data, mode, sizes)
    _note(events, error)
    if not handshake:
        assert events == []
    else:
        assert events and events[0] == ("Established", "peer", 7)
    # The same bytes in one piece give the same events and the same error.
    whole = Connection(name="fuzz", rank=0, max_frame_size=LIMIT)
    whole_events, whole_error = _run_connection(whole, data, "whole", [1])
    assert (whole_events, _outcome(whole_error)) == (events, _outcome(error))


# -- (b) mutated valid streams ------------------------------------------------------------
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 2**32), st.integers(1, 255)),
        st.tuples(st.just("field"), st.integers(0, 2**32), st.integers(0, HEADER.size + 15),
                  st.integers(0, 255)),
        st.tuples(st.just("truncate"), st.integers(0, 2**32)),
        st.tuples(st.just("duplicate"), st.integers(0, 2**32), st.integers(1, 200), st.integers(0, 2**32)),
        st.tuples(st.just("delete"), st.integers(0, 2**32), st.integers(1, 64)),
        st.tuples(st.just("insert"), st.integers(0, 2**32), st.binary(min_size=1, max_size=40)),
        st.tuples(st.just("swap_frames"), st.integers(0, 2**32), st.integers(0, 2**32)),
    ),
    max_size=4,
)


def _mutate(data: bytes, ops: list[tuple]) -> bytes:
    buf = bytearray(data)
    starts = _frame_starts(data)
    for op in ops:
        if not buf:
            break
        name, a = op[0], op[1]
        if name == "flip":
            buf[a % len(buf)] ^= op[2]
        elif name == "field":  # hit a header field of a frame of the original stream
            pos = starts[a % len(starts)] + op[2]
            if pos < len(buf):
                buf[pos] = op[3]
        elif name == "truncate":
            del buf[a % len(buf) :]
        elif name == "duplicate":
            start = a % len(buf)
            piece = buf[start : start + op[2]]
            at = op[3] % (len(buf) + 1)
            buf[at:at] = piece
        elif name == "delete":
            start = a % len(buf)
            del buf[start : start + op[2]]
        elif name == "insert":
            at = a % (len(buf) + 1)
            buf[at:at] = op[2]
        elif name == "swap_frames":  # splice: frames of the original stream, out of order
            ends = [*starts[1:], len(data)]
            i, j = sorted((a % len(starts), op[2] % len(starts)))
            fi, fj = data[starts[i] : ends[i]], data[starts[j] : ends[j]]
            buf = bytearray(data[: starts[i]] + fj + data[ends[i] : starts[j]] + fi + data[ends[j] :])
    return bytes(buf)


@FUZZ
@given(ops=OPS, mode=feed_modes, sizes=chunk_sizes, keyed=st.booleans())
def test_mutated_streams(ops, mode, sizes, keyed):
    conn = Connection(name="fuzz", rank=0, auth_key=KEY if keyed else None, max_frame_size=LIMIT)
    valid = handshake_stream(conn, key=KEY if keyed else None) + BASE_MESSAGES
    data = _mutate(valid, ops)
    events, error = _run_connection(conn, data, mode, sizes)
    _note(events, error)
    if data == valid:
        assert error is None
        assert [e[0] for e in events] == [
            "Established", "Call", "Tell", "Result", "Failure", "Cancel", "Heartbeat", "Call", "Result"]


def test_mutation_helper_is_identity_without_ops():
    conn = Connection(name="fuzz", rank=0, max_frame_size=LIMIT)
    valid = handshake_stream(conn) + BASE_MESSAGES
    assert _mutate(valid, []) == valid
    assert len(_frame_starts(valid)) == 2 + 8
    swapped = _mutate(valid, [("swap_frames", 0, 2)])
    assert swapped != valid and sorted(swapped) == sorted(valid)


# -- (c) the bare frame decoder ----------------------------------------------------------
def _run_decoder(data: bytes, mode: str, sizes: list[int]):
    decoder = FrameDecoder(max_frame_size=LIMIT, max_buffers=64)
    _feed(decoder, data, mode, sizes)
    frames = []
    bound = len(data) // HEADER.size + 1
    try:
        while (f := decoder.next_frame()) is not None:
            frames.append(describe_frame(f))
            assert len(frames) <= bound
    except ProtocolError as exc:
        with pytest.raises(ProtocolError):
            decoder.next_frame()
        return frames, str(exc)
    return frames, None


VALID_FRAMES = b"".join(flatten(_encode(m)) for m in [
    Call(request_id=1, target="f", payload=Payload.dump([1, 2])),
    Result(request_id=1, payload=Payload.dump({"t": torch.arange(10)})),
]) + BASE_MESSAGES


@FUZZ
@given(data=st.one_of(
    st.binary(max_size=3000),
    OPS.map(lambda ops: _mutate(VALID_FRAMES, ops)),
    st.lists(structured_frame(), max_size=6).map(b"".join),
), mode=st.sampled_from(["chunks", "get_buffer"]), sizes=chunk_sizes)
def test_frame_decoder(data, mode, sizes):
    reference = _run_decoder(data, "whole", [1])
    event(f"frames: {min(len(reference[0]), 3)}")
    event("ok" if reference[1] is None else f"ProtocolError: {reference[1].split()[:3]}")
    assert _run_decoder(data, mode, sizes) == reference
    if data == VALID_FRAMES:
        assert reference[1] is None and len(reference[0]) == len(_frame_starts(VALID_FRAMES))
