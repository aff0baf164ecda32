"""Typed messages of the wire protocol.

Control messages (handshake, heartbeats, cancel, goodbye) have fixed binary bodies and are
never unpickled. Data messages carry a :class:`~actorgrad.wire._codec.Payload` whose
pickled body is only decoded on request (``payload.load()``), by the layer above, and only
on a connection that completed the handshake.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ._codec import Payload


class Kind(enum.IntEnum):
    """The message kind byte of the frame header."""

    HELLO = 1
    AUTH = 2
    HEARTBEAT = 3
    GOODBYE = 4
    CANCEL = 5
    CALL = 16
    TELL = 17
    RESULT = 18
    FAILURE = 19


CONTROL_KINDS = frozenset({Kind.HELLO, Kind.AUTH, Kind.HEARTBEAT, Kind.GOODBYE, Kind.CANCEL})
MAX_NAME_BYTES = 256
NONCE_BYTES = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """First frame on every connection, sent by both sides: who I am and my nonce."""

    name: str
    rank: int
    nonce: bytes

    def __post_init__(self) -> None:
        if not self.name or len(self.name.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"worker name must be 1..{MAX_NAME_BYTES} bytes, got {self.name!r}")
        if not 0 <= self.rank < 2**31:
            raise ValueError(f"rank out of range: {self.rank}")
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class Auth:
    """Proof of the shared key over the peer's nonce (empty when no key is configured)."""

    digest: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Liveness probe. A ``ping`` is answered with a pong by the peer's protocol state,
    so a peer whose loop runs answers whatever its own settings."""

    ping: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye:
    """The sender closes the connection on purpose (shutdown or protocol error)."""

    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """The caller gave up on ``request_id`` (timeout): the callee may drop the work."""

    request_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """A request for handler ``target``; answered by :class:`Result` or :class:`Failure`."""

    request_id: int
    target: str
    payload: Payload = field(compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tell:
    """A one-way message for handler ``target``; never answered."""

    target: str
    payload: Payload = field(compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """The successful answer to the :class:`Call` with the same ``request_id``."""

    request_id: int
    payload: Payload = field(compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """The failed answer to a :class:`Call`; the payload describes the exception."""

    request_id: int
    payload: Payload = field(compare=False)


Message = Hello | Auth | Heartbeat | Goodbye | Cancel | Call | Tell | Result | Failure
