#!/usr/bin/env python
"""Long random + mutation fuzz campaign on the sans-IO wire layer.

Feeds ``actorgrad.wire.Connection`` and ``FrameDecoder`` with random bytes, frames built
from almost-valid header fields, and mutations (byte flips, header-field overwrites,
truncation, duplication, deletion, insertion, frame swaps) of valid streams: a HELLO +
AUTH handshake (with and without a key) followed by data frames. Inputs that get deep
(past the handshake) are kept in a pool and mutated further.

Checked on every input:
  * only ProtocolError (decoder, Connection) or AuthenticationError (Connection) escape;
  * after an error the Connection is in State.ERROR and yields no more events;
  * decoding terminates (at most one event per 28-byte frame header);
  * no event precedes Established, which comes at most once; nothing follows Goodbye;
  * the outcome (frames/events and the error message) does not depend on whether the
    bytes arrive whole, in random chunks or through get_buffer()/buffer_updated().

Payloads are never unpickled. Prints one summary line; exits 1 on any unexpected result.

    python scripts/fuzz_wire.py --examples 100000 --seed 1
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from collections import Counter
from typing import Any

import torch

from actorgrad import AuthenticationError, ProtocolError
from actorgrad.wire import (
    Auth,
    Call,
    Cancel,
    Connection,
    Established,
    Failure,
    FrameDecoder,
    Goodbye,
    Heartbeat,
    Hello,
    Kind,
    Payload,
    Result,
    State,
    Tell,
)
from actorgrad.wire._connection import _encode
from actorgrad.wire._frames import HEADER, MAGIC, PROTOCOL_VERSION

KEY = b"fuzz key"
KINDS = [int(k) for k in Kind]


class Unexpected(Exception):
    """An invariant broke (as opposed to the expected protocol errors)."""


def flatten(chunks: Any) -> bytes:
    return b"".join(bytes(c) for c in chunks)


# -- seeds --------------------------------------------------------------------------------
def data_messages() -> bytes:
    msgs = [
        Call(request_id=1, target="echo", payload=Payload.dump((1, "two", [3.0]))),
        Tell(target="notify", payload=Payload.dump({"k": torch.arange(5)})),
        Result(request_id=1, payload=Payload.dump(torch.ones(2, 3))),
        Failure(request_id=2, payload=Payload.dump("error")),
        Cancel(request_id=3),
        Heartbeat(),
        Call(request_id=2**64 - 1, target="tä", payload=Payload.dump([torch.zeros(0), b"x" * 300])),
        Result(request_id=4, payload=Payload.dump({"a": torch.arange(6).reshape(2, 3).t()})),
    ]
    out = b"".join(flatten(_encode(m)) for m in msgs)
    return out + flatten(_encode(Goodbye(reason="done")))


DATA = data_messages()
PLAIN_HANDSHAKE = flatten(_encode(Hello(name="peer", rank=7, nonce=b"\x07" * 32))) + flatten(
    _encode(Auth(digest=b""))
)


def keyed_handshake(receiver: Connection) -> bytes:
    """A valid keyed HELLO+AUTH stream from a fresh peer, proving the key over
    ``receiver``'s nonce."""
    peer = Connection(name="peer", rank=7, auth_key=KEY)
    peer.receive_data(flatten(receiver.data_to_send()))
    if peer.next_event() is not None:
        raise Unexpected("peer produced an event from a bare HELLO")
    return flatten(peer.data_to_send())


def frame_starts(data: bytes) -> list[int]:
    """Frame offsets of a stream, as far as its headers parse (for targeted mutations)."""
    starts, pos = [], 0
    while pos + HEADER.size <= len(data) and len(starts) < 64:
        starts.append(pos)
        _, _, _, _, _, body, nbuf = HEADER.unpack_from(data, pos)
        if nbuf > 64 or pos + HEADER.size + 8 * nbuf > len(data):
            break
        lengths = sum(
            int.from_bytes(data[pos + HEADER.size + 8 * i : pos + HEADER.size + 8 * i + 8], "little")
            for i in range(nbuf)
        )
        pos += HEADER.size + 8 * nbuf + body + lengths
    return starts or [0]


# -- generators ---------------------------------------------------------------------------
def random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((0, 1, 27, 28, 29, rng.randint(0, 64), rng.randint(0, 2000))))


def header(rng: random.Random, body_len: int, lengths: list[int]) -> bytes:
    def often(good: Any, bad: Any) -> Any:
        return good if rng.random() < 0.9 else bad

    head = HEADER.pack(
        often(MAGIC, rng.randbytes(4)),
        often(PROTOCOL_VERSION, rng.randint(0, 255)),
        often(rng.choice(KINDS), rng.randint(0, 255)),
        often(0, rng.randint(1, 0xFFFF)),
        rng.choice((0, 1, rng.randint(0, 2**64 - 1))),
        often(body_len, rng.choice((body_len + 1, max(body_len - 1, 0), rng.randint(0, 2**64 - 1)))),
        often(len(lengths), rng.choice((len(lengths) + 1, rng.randint(0, 2**32 - 1)))),
    )
    return head + b"".join(n.to_bytes(8, "little") for n in lengths)


def structured_frames(rng: random.Random) -> bytes:
    out = []
    for _ in range(rng.randint(1, 6)):
        body = rng.choice((
            b"",
            rng.randbytes(rng.randint(0, 64)),
            rng.randint(0, 300).to_bytes(2, "little") + rng.randbytes(rng.randint(0, 20)),
            b"\x01" * 32 + rng.randbytes(4) + rng.randbytes(rng.randint(0, 8)),
        ))
        buffers = [rng.randbytes(rng.randint(0, 24)) for _ in range(rng.choice((0, 0, 1, 3)))]
        out.append(header(rng, len(body), [len(b) for b in buffers]) + body + b"".join(buffers))
    return b"".join(out)


def mutate(rng: random.Random, data: bytes, rounds: int) -> bytes:
    buf = bytearray(data)
    starts = frame_starts(data)
    for _ in range(rounds):
        if not buf:
            buf += rng.randbytes(rng.randint(1, 40))
            continue
        op = rng.randrange(9)
        if op == 0:  # flip bits of one byte
            buf[rng.randrange(len(buf))] ^= rng.randint(1, 255)
        elif op in (1, 2):  # overwrite a header field byte (magic, version, kind, flags, ids, lengths)
            pos = rng.choice(starts) + rng.randrange(HEADER.size + 16)
            if pos < len(buf):
                buf[pos] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randint(0, 255)))
        elif op == 3:  # truncate
            del buf[rng.randrange(len(buf)) :]
        elif op == 4:  # duplicate a slice somewhere
            start = rng.randrange(len(buf))
            piece = buf[start : start + rng.randint(1, 300)]
            at = rng.randint(0, len(buf))
            buf[at:at] = piece
        elif op == 5:  # delete a slice
            start = rng.randrange(len(buf))
            del buf[start : start + rng.randint(1, 64)]
        elif op == 6:  # insert random bytes
            at = rng.randint(0, len(buf))
            buf[at:at] = rng.randbytes(rng.randint(1, 40))
        elif op == 7:  # splice in a whole other frame / stream piece
            at = rng.choice([*starts, len(buf)])
            at = min(at, len(buf))
            donor = rng.choice((DATA, PLAIN_HANDSHAKE, structured_frames(rng)))
            ds = frame_starts(donor)
            i = rng.randrange(len(ds))
            end = ds[i + 1] if i + 1 < len(ds) else len(donor)
            buf[at:at] = donor[ds[i] : end]
        else:  # set a 64-bit length field to an interesting value
            pos = rng.choice(starts) + rng.choice((16, HEADER.size, HEADER.size + 8))
            value = rng.choice((0, 1, 2**31, 2**32, 2**63, 2**64 - 1, rng.randint(0, 1 << 21)))
            if pos + 8 <= len(buf):
                buf[pos : pos + 8] = value.to_bytes(8, "little")
    return bytes(buf)


# -- running ------------------------------------------------------------------------------
def feed(sink: Any, data: bytes, mode: str, rng: random.Random) -> None:
    if mode == "whole":
        sink.receive_data(data)
        return
    sizes = [rng.choice((1, 2, 3, rng.randint(1, 64), rng.randint(1, 4096))) for _ in range(8)]
    pos = i = 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        i += 1
        if mode == "chunks":
            sink.receive_data(data[pos : pos + n])
        else:
            buf = sink.get_buffer(-1)
            n = min(n, len(buf), len(data) - pos)
            if n <= 0:
                raise Unexpected(f"get_buffer() returned {len(buf)} bytes")
            buf[:n] = data[pos : pos + n]
            sink.buffer_updated(n)
        pos += n


def describe(event: Any) -> tuple[Any, ...]:
    if isinstance(event, Established):
        return ("Established", event.peer_name, event.peer_rank)
    payload = getattr(event, "payload", None)
    if payload is None:
        return (type(event).__name__, repr(event))
    fields = tuple(getattr(event, f) for f in ("request_id", "target") if hasattr(event, f))
    return (type(event).__name__, fields, bytes(payload.body),
            tuple(r.numpy().tobytes() for r in payload.raw))


def run_connection(conn: Connection, data: bytes, mode: str, rng: random.Random):
    feed(conn, data, mode, rng)
    events: list[Any] = []
    error: Exception | None = None
    bound = len(data) // HEADER.size + 1
    try:
        while (event := conn.next_event()) is not None:
            events.append(event)
            if len(events) > bound:
                raise Unexpected("more events than frame headers: decoding does not terminate")
    except (ProtocolError, AuthenticationError) as exc:
        error = exc
        if conn.state is not State.ERROR:
            raise Unexpected(f"{type(exc).__name__} left the connection in {conn.state}") from exc
        if conn.next_event() is not None:
            raise Unexpected("an event after the error") from exc
    established = [i for i, e in enumerate(events) if isinstance(e, Established)]
    if established not in ([], [0]) or (not established and events):
        raise Unexpected(f"events before/without authentication: {[type(e).__name__ for e in events]}")
    goodbyes = [i for i, e in enumerate(events) if isinstance(e, Goodbye)]
    if goodbyes not in ([], [len(events) - 1]):
        raise Unexpected("events after Goodbye")
    return [describe(e) for e in events], error


def run_decoder(data: bytes, mode: str, rng: random.Random, limit: int):
    decoder = FrameDecoder(max_frame_size=limit, max_buffers=256)
    feed(decoder, data, mode, rng)
    frames = []
    bound = len(data) // HEADER.size + 1
    try:
        while (f := decoder.next_frame()) is not None:
            frames.append((f.kind, f.request_id, bytes(f.body), tuple(b.numpy().tobytes() for b in f.buffers)))
            if len(frames) > bound:
                raise Unexpected("more frames than headers")
    except ProtocolError as exc:
        try:
            decoder.next_frame()
        except ProtocolError:
            pass
        else:
            raise Unexpected("decoder error is not sticky") from exc
        return frames, str(exc)
    return frames, None


def outcome(error: Exception | None) -> Any:
    return None if error is None else (type(error).__name__, str(error))


def generate(rng: random.Random, pool: list[bytes], limit: int, stats: Counter):
    """One input: (bytes, the keyed Connection they were made for, or None)."""
    choice = rng.random()
    if choice < 0.10:
        stats["gen_random"] += 1
        return random_bytes(rng), None
    if choice < 0.25:
        stats["gen_structured"] += 1
        return (PLAIN_HANDSHAKE if rng.random() < 0.7 else b"") + structured_frames(rng), None
    if choice < 0.45 and pool:
        stats["gen_pool"] += 1
        return mutate(rng, rng.choice(pool), rng.randint(1, 3)), None
    if choice < 0.70:
        stats["gen_keyed"] += 1
        conn = Connection(name="fuzz", rank=0, auth_key=KEY, max_frame_size=limit)
        return mutate(rng, keyed_handshake(conn) + DATA, rng.choice((1, 1, 2, 3, 6))), conn
    stats["gen_plain"] += 1
    return mutate(rng, PLAIN_HANDSHAKE + DATA, rng.choice((1, 1, 2, 3, 6))), None


def check(rng: random.Random, data: bytes, keyed_conn: Connection | None, pool: list[bytes],
          limit: int, stats: Counter) -> None:
    """Run one input through a Connection and a bare decoder; raise on any finding."""
    mode = rng.choice(("whole", "chunks", "get_buffer"))
    if keyed_conn is not None:
        events, error = run_connection(keyed_conn, data, mode, rng)
    else:
        conn = Connection(name="fuzz", rank=0, max_frame_size=limit)
        events, error = run_connection(conn, data, mode, rng)
        if mode != "whole":  # differential: the split must not matter
            whole = Connection(name="fuzz", rank=0, max_frame_size=limit)
            w_events, w_error = run_connection(whole, data, "whole", rng)
            if (w_events, outcome(w_error)) != (events, outcome(error)):
                raise Unexpected(f"{mode} and whole feeding disagree: {outcome(error)} vs {outcome(w_error)}")
        if len(events) >= 2 and len(pool) < 500:
            pool.append(data)  # got past the handshake: worth mutating further
    if error is None:
        stats["clean"] += 1
    else:
        stats[type(error).__name__] += 1
    if events:
        stats["established"] += 1

    # The bare decoder sees the same bytes: whole versus split.
    ref = run_decoder(data, "whole", rng, limit)
    split = run_decoder(data, rng.choice(("chunks", "get_buffer")), rng, limit)
    if split != ref:
        raise Unexpected(f"decoder: split and whole feeding disagree: {split[1]!r} vs {ref[1]!r}")
    if ref[1] is not None:
        stats["decoder_ProtocolError"] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100_000, help="inputs to try (default 100000)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    parser.add_argument("--max-frame-size", type=int, default=1 << 20,
                        help="decoder limit; keeps mutated lengths from allocating GiBs (default 1 MiB)")
    parser.add_argument("--show", type=int, default=3, help="unexpected failures to print in full")
    parser.add_argument("--save", metavar="DIR", help="write each unexpected input to DIR")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    torch.set_num_threads(1)

    stats: Counter = Counter()
    pool: list[bytes] = []
    failures = 0
    start = time.perf_counter()
    for i in range(args.examples):
        case_seed = rng.getrandbits(64)
        case_rng = random.Random(case_seed)
        data = b""
        try:
            data, keyed_conn = generate(case_rng, pool, args.max_frame_size, stats)
            check(case_rng, data, keyed_conn, pool, args.max_frame_size, stats)
        except Exception as exc:  # anything but the expected errors is a finding
            failures += 1
            if failures <= args.show:
                print(f"--- unexpected #{failures} (input {i}, case seed {case_seed}): "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)
                traceback.print_exception(exc, file=sys.stderr)
                print(f"input ({len(data)} bytes): {data[:256].hex()}", file=sys.stderr)
            if args.save and data:
                os.makedirs(args.save, exist_ok=True)
                with open(os.path.join(args.save, f"case-{case_seed}.bin"), "wb") as f:
                    f.write(data)
    elapsed = time.perf_counter() - start
    print(
        f"fuzz_wire: seed={seed} inputs={args.examples} "
        f"protocol_errors={stats['ProtocolError']} auth_errors={stats['AuthenticationError']} "
        f"clean={stats['clean']} established={stats['established']} "
        f"decoder_protocol_errors={stats['decoder_ProtocolError']} "
        f"unexpected={failures} time={elapsed:.1f}s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
