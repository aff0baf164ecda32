"""Shared helpers for the sans-IO wire tests (no asyncio, no sockets)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

import torch

from actorgrad import AuthenticationError, ProtocolError
from actorgrad.wire import (
    Call,
    Cancel,
    Connection,
    Established,
    Failure,
    FrameDecoder,
    Goodbye,
    Heartbeat,
    Kind,
    Payload,
    Result,
    State,
    Tell,
    encode_frame,
)
from actorgrad.wire._frames import HEADER, MAGIC, PROTOCOL_VERSION

Chunks = Iterable[bytes | bytearray | memoryview]


def flatten(chunks: Chunks) -> bytes:
    """The bytes of ``data_to_send()`` / ``send()`` / ``encode_frame()`` output."""
    return b"".join(bytes(c) for c in chunks)


def raw_header(
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    kind: int = Kind.CALL,
    flags: int = 0,
    request_id: int = 0,
    body_len: int = 0,
    nbuf: int = 0,
    lengths: tuple[int, ...] = (),
) -> bytes:
    """A frame header with every field under the test's control (for malformed frames)."""
    head = HEADER.pack(magic, version, kind, flags, request_id, body_len, nbuf)
    return head + b"".join(n.to_bytes(8, "little") for n in lengths)


def frame(kind: int, request_id: int = 0, body: bytes = b"", buffers: tuple[bytes, ...] = ()) -> bytes:
    return flatten(encode_frame(kind, request_id, body, [memoryview(b) for b in buffers]))


def target_body(target: str, pickled: bytes) -> bytes:
    """The body of a CALL/TELL frame: u16 target length, target, pickle."""
    name = target.encode()
    return len(name).to_bytes(2, "little") + name + pickled


# -- connections -------------------------------------------------------------------
def drain(conn: Connection) -> list[Any]:
    """Every event ``conn`` has ready (exceptions propagate)."""
    events = []
    while (event := conn.next_event()) is not None:
        events.append(event)
    return events


def exchange(a: Connection, b: Connection, rounds: int = 8) -> dict[str, list[Any]]:
    """Move handshake bytes both ways until quiet.

    Returns each side's events; an exception raised by ``next_event`` is recorded in
    that side's list (and the side is then in State.ERROR), pumping goes on.
    """
    events: dict[str, list[Any]] = {"a": [], "b": []}
    for _ in range(rounds):
        moved = False
        for src, dst, side in ((a, b, "b"), (b, a, "a")):
            for chunk in src.data_to_send():
                moved = True
                dst.receive_data(chunk)
            try:
                events[side].extend(drain(dst))
            except (ProtocolError, AuthenticationError) as exc:
                events[side].append(exc)
        if not moved:
            break
    return events


def connected_pair(
    key_a: bytes | None = None,
    key_b: bytes | None = None,
    *,
    name_a: str = "alice",
    rank_a: int = 0,
    name_b: str = "bob",
    rank_b: int = 1,
    **kwargs: Any,
) -> tuple[Connection, Connection]:
    """Two Connections that completed the handshake with each other."""
    a = Connection(name=name_a, rank=rank_a, auth_key=key_a, initiator=True, **kwargs)
    b = Connection(name=name_b, rank=rank_b, auth_key=key_b, **kwargs)
    assert a.state is State.HANDSHAKE and b.state is State.HANDSHAKE
    events = exchange(a, b)
    assert len(events["a"]) == 1 and isinstance(events["a"][0], Established), events
    assert len(events["b"]) == 1 and isinstance(events["b"][0], Established), events
    assert (events["a"][0].peer_name, events["a"][0].peer_rank) == (name_b, rank_b)
    assert (events["b"][0].peer_name, events["b"][0].peer_rank) == (name_a, rank_a)
    assert a.state is State.ESTABLISHED and b.state is State.ESTABLISHED
    assert (a.peer_name, a.peer_rank, b.peer_name, b.peer_rank) == (name_b, rank_b, name_a, rank_a)
    assert a.data_to_send() == [] and b.data_to_send() == []
    return a, b


def transfer(src: Connection, dst: Connection, msg: Any) -> Any:
    """Send ``msg`` from ``src`` and return the single event ``dst`` makes of it."""
    for chunk in src.send(msg):
        dst.receive_data(chunk)
    event = dst.next_event()
    assert event is not None
    assert dst.next_event() is None
    assert not dst.in_frame
    return event


def handshake_stream(receiver: Connection, *, key: bytes | None = None, name: str = "peer",
                     rank: int = 7) -> bytes:
    """A valid HELLO+AUTH byte stream, from a fresh peer, for ``receiver``.

    Drains ``receiver``'s own outbox (its HELLO) to learn its nonce.
    """
    peer = Connection(name=name, rank=rank, auth_key=key, initiator=True)
    hello = flatten(receiver.data_to_send())
    peer.receive_data(hello)
    assert peer.next_event() is None
    return flatten(peer.data_to_send())


def sample_messages() -> list[Any]:
    """One established-state message of every kind, with small payloads."""
    return [
        Call(request_id=1, target="echo", payload=Payload.dump((1, "two", [3.0]))),
        Tell(target="notify", payload=Payload.dump({"k": torch.arange(5)})),
        Result(request_id=1, payload=Payload.dump(torch.ones(2, 3))),
        Failure(request_id=2, payload=Payload.dump(ValueError("nope"))),
        Cancel(request_id=3),
        Heartbeat(),
        Call(request_id=2**64 - 1, target="t" * 256, payload=Payload.dump(None)),
        Result(request_id=9, payload=Payload.dump([torch.zeros(0), torch.ones(()), b"x" * 300])),
    ]


def data_stream(messages: list[Any] | None = None, *, goodbye: str | None = None) -> bytes:
    """The bytes of ``messages`` as an established connection sends them."""
    a, _ = connected_pair(name_a="src", name_b="sink")
    msgs = sample_messages() if messages is None else messages
    if goodbye is not None:
        msgs = [*msgs, Goodbye(reason=goodbye)]
    return b"".join(flatten(a.send(m)) for m in msgs)


# -- describing what came out, for comparisons -------------------------------------
def describe_frame(f: Any) -> tuple[Any, ...]:
    return (f.kind, f.request_id, bytes(f.body), tuple(b.numpy().tobytes() for b in f.buffers))


def describe_event(event: Any) -> tuple[Any, ...]:
    if isinstance(event, Established):
        return ("Established", event.peer_name, event.peer_rank)
    payload = getattr(event, "payload", None)
    if payload is None:
        return (type(event).__name__, repr(event))
    fields = tuple(
        getattr(event, f) for f in ("request_id", "target") if hasattr(event, f)
    )
    return (type(event).__name__, fields, bytes(payload.body),
            tuple(r.numpy().tobytes() for r in payload.raw))


# -- feeding strategies --------------------------------------------------------------
Feeder = Callable[[Any, bytes], None]


def feed_whole(sink: Any, data: bytes) -> None:
    sink.receive_data(data)


def feed_bytewise(sink: Any, data: bytes) -> None:
    for i in range(len(data)):
        sink.receive_data(data[i : i + 1])


def feed_random_chunks(seed: int, max_chunk: int = 1 << 17) -> Feeder:
    def feed(sink: Any, data: bytes) -> None:
        rng = random.Random(seed)
        view = memoryview(data)
        while view:
            n = rng.choice((1, 2, 3, rng.randint(1, 64), rng.randint(1, max_chunk)))
            sink.receive_data(view[:n])
            view = view[n:]

    feed.__name__ = f"random_chunks_{seed}"
    return feed


def feed_get_buffer(seed: int | None = None, amounts: tuple[int, ...] = ()) -> Feeder:
    """``get_buffer()``/``buffer_updated()`` as asyncio.BufferedProtocol does, writing
    a varying number of bytes each time (never more than the buffer holds)."""

    def feed(sink: Any, data: bytes) -> None:
        rng = random.Random(seed)
        pos = i = 0
        while pos < len(data):
            buf = sink.get_buffer(-1)
            assert len(buf) > 0
            if amounts:
                want = amounts[i % len(amounts)]
            else:
                want = rng.choice((1, 5, rng.randint(1, 4096), rng.randint(1, 1 << 20), len(buf)))
            n = min(len(buf), want, len(data) - pos)
            buf[:n] = data[pos : pos + n]
            sink.buffer_updated(n)
            pos += n
            i += 1

    feed.__name__ = f"get_buffer_{seed}_{amounts}"
    return feed


def decode_with(feeder: Feeder, data: bytes, **kwargs: Any) -> list[tuple[Any, ...]]:
    decoder = FrameDecoder(**kwargs)
    feeder(decoder, data)
    out = []
    while (f := decoder.next_frame()) is not None:
        out.append(describe_frame(f))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, -0.0-sensitive)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)

    return torch.equal(raw(a), raw(b))
