"""Per-peer protocol state: handshake, authentication, message encode/decode (sans-IO).

# Rules / theory of operation
    state        frame received            action
    HANDSHAKE    Hello                     remember peer; queue our Auth proof
    HANDSHAKE    Auth (after Hello)        verify proof of the key over *our* nonce;
                                           both Hello and Auth seen -> ESTABLISHED
    HANDSHAKE    anything else             ProtocolError (data before handshake)
    ESTABLISHED  data / heartbeat / cancel event for the layer above
    ESTABLISHED  Goodbye                   CLOSED
    any          malformed bytes           ERROR, ProtocolError raised; never reused

Both sides send Hello first, so authentication is mutual: each side proves it holds
the key over the other side's fresh nonce (HMAC-SHA256, as multiprocessing.connection
does). The proof also binds the prover's role (the side that opened the connection or
the side that accepted it), its own nonce, both names and the accepting side's endpoint
as each side knows it (the address the opener dialed; the one the acceptor published
and accepted it on), and each side only accepts a proof made in the opposite role: a
proof obtained from one connection cannot be relayed into another, nor reflected back,
and a go-between that passes a whole handshake through from an address of its own
(say, after rewriting a rendezvous entry) fails it on both sides. No data frame is decoded before the handshake completes, so an unauthenticated
peer can never make us unpickle anything.
"""

from __future__ import annotations

import enum
import hmac
import os
import struct

from .._errors import AuthenticationError, ProtocolError
from ._codec import Payload
from ._frames import (
    DEFAULT_MAX_BUFFERS,
    DEFAULT_MAX_FRAME_SIZE,
    HANDSHAKE_STAGING_BYTES,
    Frame,
    FrameDecoder,
    encode_frame,
)
from ._messages import (
    CONTROL_KINDS,
    MAX_NAME_BYTES,
    NONCE_BYTES,
    Auth,
    Call,
    Cancel,
    Failure,
    Goodbye,
    Heartbeat,
    Hello,
    Kind,
    Message,
    Result,
    Tell,
)

_HELLO = struct.Struct(f"<{NONCE_BYTES}sI")
_TARGET_LEN = struct.Struct("<H")
_MAX_HEAD = _TARGET_LEN.size + MAX_NAME_BYTES  # what a CALL or TELL adds to its payload
_AUTH_DOMAIN = b"actorgrad-auth-v1:"
_HANDSHAKE_MAX_BODY = 4096


class State(enum.Enum):
    HANDSHAKE = "handshake"
    ESTABLISHED = "established"
    CLOSED = "closed"
    ERROR = "error"


class Established:
    """Event: the handshake completed; ``peer_name``/``peer_rank`` are authenticated."""

    __slots__ = ("peer_name", "peer_rank")

    def __init__(self, peer_name: str, peer_rank: int) -> None:
        self.peer_name = peer_name
        self.peer_rank = peer_rank


def tcp_endpoint(host: str, port: int) -> str:
    """The endpoint of a worker's TCP listener, as the handshake binds it."""
    return f"tcp {host} {port}"


def unix_endpoint(name: str) -> str:
    """The endpoint of a worker's (abstract) Unix socket listener."""
    return f"unix {name}"


def _proof(key: bytes, prover_is_initiator: bool, verifier_nonce: bytes, prover_nonce: bytes,
           prover: str, verifier: str, endpoint: str) -> bytes:
    role = b"I" if prover_is_initiator else b"A"
    message = b"".join([_AUTH_DOMAIN, role, verifier_nonce, prover_nonce,
                        prover.encode(), b"\0", verifier.encode(), b"\0", endpoint.encode()])
    return hmac.new(key, message, "sha256").digest()


def _encode(msg: Message) -> list[bytes | bytearray | memoryview]:
    match msg:
        case Hello(name=name, rank=rank, nonce=nonce):
            return encode_frame(Kind.HELLO, 0, _HELLO.pack(nonce, rank) + name.encode())
        case Auth(digest=digest):
            return encode_frame(Kind.AUTH, 0, digest)
        case Heartbeat(ping=ping):
            return encode_frame(Kind.HEARTBEAT, 0, b"\x01" if ping else b"")
        case Goodbye(reason=reason):
            return encode_frame(Kind.GOODBYE, 0, reason.encode(errors="backslashreplace")[:1024])
        case Cancel(request_id=rid):
            return encode_frame(Kind.CANCEL, rid, b"")
        case Call(request_id=rid, target=target, payload=p):
            head = _TARGET_LEN.pack(len(t := target.encode())) + t
            return encode_frame(Kind.CALL, rid, head + p.body, p.buffers)
        case Tell(target=target, payload=p):
            head = _TARGET_LEN.pack(len(t := target.encode())) + t
            return encode_frame(Kind.TELL, 0, head + p.body, p.buffers)
        case Result(request_id=rid, payload=p):
            return encode_frame(Kind.RESULT, rid, p.body, p.buffers)
        case Failure(request_id=rid, payload=p):
            return encode_frame(Kind.FAILURE, rid, p.body, p.buffers)
    raise TypeError(f"not a wire message: {msg!r}")


def _split_target(body: bytearray | memoryview) -> tuple[str, memoryview]:
    if len(body) < _TARGET_LEN.size:
        raise ProtocolError("data frame too short for its target name")
    (n,) = _TARGET_LEN.unpack_from(body)
    end = _TARGET_LEN.size + n
    if n == 0 or n > MAX_NAME_BYTES or len(body) < end:
        raise ProtocolError(f"bad target name length {n}")
    try:
        target = bytes(body[_TARGET_LEN.size : end]).decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("target name is not UTF-8") from exc
    return target, memoryview(body)[end:]


def decode_frame(frame: Frame) -> Message:
    """Turn a frame into a message; pickled payloads stay undecoded."""
    kind = frame.kind
    if kind in CONTROL_KINDS and (frame.buffers or len(frame.body) > _HANDSHAKE_MAX_BODY):
        raise ProtocolError(f"control frame {Kind(kind).name} too large")
    if kind == Kind.HELLO:
        if len(frame.body) <= _HELLO.size:
            raise ProtocolError("truncated HELLO")
        nonce, rank = _HELLO.unpack_from(frame.body)
        try:
            return Hello(name=bytes(frame.body[_HELLO.size :]).decode(), rank=rank, nonce=nonce)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"bad HELLO: {exc}") from exc
    if kind == Kind.AUTH:
        return Auth(digest=bytes(frame.body))
    if kind == Kind.HEARTBEAT:
        return Heartbeat(ping=bytes(frame.body[:1]) == b"\x01")
    if kind == Kind.GOODBYE:
        return Goodbye(reason=bytes(frame.body).decode(errors="replace"))
    if kind == Kind.CANCEL:
        return Cancel(request_id=frame.request_id)
    if kind == Kind.CALL:
        target, body = _split_target(frame.body)
        return Call(request_id=frame.request_id, target=target, payload=Payload(body, frame.buffers))
    if kind == Kind.TELL:
        target, body = _split_target(frame.body)
        return Tell(target=target, payload=Payload(body, frame.buffers))
    if kind == Kind.RESULT:
        return Result(request_id=frame.request_id, payload=Payload(frame.body, frame.buffers))
    if kind == Kind.FAILURE:
        return Failure(request_id=frame.request_id, payload=Payload(frame.body, frame.buffers))
    raise ProtocolError(f"unknown message kind {kind}")


class Connection:
    """The protocol state of one connection to one peer, without any I/O.

    Feed received bytes with ``receive_data`` (or ``get_buffer``/``buffer_updated``),
    drain ``next_event()`` until it returns None, and write out ``data_to_send()``
    after every call that may have queued frames (the handshake queues its own).
    """

    def __init__(
        self,
        *,
        name: str,
        rank: int,
        auth_key: bytes | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_buffers: int = DEFAULT_MAX_BUFFERS,
        initiator: bool = False,
        endpoint: str = "",
    ) -> None:
        self.name = name
        self.initiator = initiator  # True on the side that opened the connection
        # the accepting side's endpoint (see tcp_endpoint): dialed by the opener,
        # published by the acceptor; both must be the same for the proofs to match
        self.endpoint = endpoint
        self.rank = rank
        self.auth_key = auth_key
        self.state = State.HANDSHAKE
        self.peer_name: str | None = None
        self.peer_rank: int | None = None
        self._nonce = os.urandom(NONCE_BYTES)
        self._peer_nonce = b""
        self._peer_authenticated = False
        self.max_frame_size = max_frame_size
        self._decoder = FrameDecoder(
            max_frame_size=max_frame_size,
            max_buffers=max_buffers,
            known_kinds=frozenset(int(k) for k in Kind),
            staging_bytes=HANDSHAKE_STAGING_BYTES,
        )
        self._decoder.restricted_kinds = frozenset({Kind.HELLO, Kind.AUTH, Kind.GOODBYE})
        self._outbox: list[bytes | bytearray | memoryview] = _encode(
            Hello(name=name, rank=rank, nonce=self._nonce)
        )

    # -- input -------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._decoder.buffer_updated(nbytes)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._decoder.receive_data(data)

    @property
    def receive_buffer_bytes(self) -> int:
        """Bytes of memory held for receiving."""
        return self._decoder.memory_bytes

    def release_buffers(self) -> None:
        """The transport is closed: let go of the memory held for receiving."""
        self._decoder.release()

    @property
    def in_frame(self) -> bool:
        return self._decoder.in_frame

    def next_event(self) -> Message | Established | None:
        """The next event, or None when more bytes are needed.

        Raises:
            ProtocolError: malformed input; the connection is in ERROR from then on.
            AuthenticationError: the peer failed to prove the shared key.
        """
        if self.state in (State.ERROR, State.CLOSED):
            return None
        try:
            while True:
                frame = self._decoder.next_frame()
                if frame is None:
                    return None
                msg = decode_frame(frame)
                if self.state is State.HANDSHAKE:
                    event = self._handshake(msg)
                    if event is not None:
                        return event
                    continue
                if isinstance(msg, (Hello, Auth)):
                    raise ProtocolError(f"unexpected {type(msg).__name__} after handshake")
                if isinstance(msg, Goodbye):
                    self.state = State.CLOSED
                return msg
        except (ProtocolError, AuthenticationError):
            self.state = State.ERROR
            raise

    def _handshake(self, msg: Message) -> Established | None:
        if isinstance(msg, Hello):
            if self.peer_name is not None:
                raise ProtocolError("second HELLO during handshake")
            if msg.name == self.name:
                raise AuthenticationError(f"peer claims this worker's own name {msg.name!r} (reflected handshake?)")
            self.peer_name, self.peer_rank = msg.name, msg.rank
            self._peer_nonce = msg.nonce
            digest = (
                _proof(self.auth_key, self.initiator, msg.nonce, self._nonce, self.name, msg.name, self.endpoint)
                if self.auth_key else b""
            )
            self._outbox.extend(_encode(Auth(digest=digest)))
            return None
        if isinstance(msg, Auth):
            if self.peer_name is None:
                raise ProtocolError("AUTH before HELLO")
            if self.auth_key is None:
                if msg.digest:
                    raise AuthenticationError(
                        f"peer {self.peer_name!r} uses an auth_key but this worker has none"
                    )
            elif not msg.digest:
                raise AuthenticationError(
                    f"peer {self.peer_name!r} sent no proof of the auth_key this worker requires"
                )
            elif not hmac.compare_digest(msg.digest, _proof(
                self.auth_key, not self.initiator, self._nonce, self._peer_nonce, self.peer_name, self.name,
                self.endpoint,
            )):
                raise AuthenticationError(
                    f"peer {self.peer_name!r} failed the key check (a different auth_key, a "
                    "proof taken from another connection, or a connection passed on from another "
                    f"address than {self.endpoint or 'the one dialed'})"
                )
            self.state = State.ESTABLISHED
            self._decoder.lift_restriction()
            assert self.peer_rank is not None
            return Established(self.peer_name, self.peer_rank)
        if isinstance(msg, Goodbye):  # (a worker leaving a group that failed to form: no key problem)
            raise ProtocolError(f"peer closed the handshake: {msg.reason}")
        raise ProtocolError(f"{type(msg).__name__} before the handshake completed")

    # -- output ------------------------------------------------------------------
    def send(self, msg: Message) -> list[bytes | bytearray | memoryview]:
        """The bytes of ``msg``; data messages only once ESTABLISHED.

        Raises:
            ProtocolError: not established, or the frame is larger than
                ``max_frame_size``: the peer (same limit) would drop the connection
                instead of receiving it, so the sender refuses it first.
        """
        if self.state is not State.ESTABLISHED and not isinstance(msg, Goodbye):
            raise ProtocolError(f"cannot send {type(msg).__name__} in state {self.state.value}")
        payload = getattr(msg, "payload", None)
        if payload is not None:
            size = len(payload.body)
            if payload.buffers:
                size += sum(b.nbytes for b in payload.buffers)
            if size > self.max_frame_size - _MAX_HEAD:
                raise ProtocolError(
                    f"a {type(msg).__name__.upper()} message of {size} bytes is over "
                    f"max_frame_size={self.max_frame_size}: the peer would drop the connection "
                    "rather than receive it (send less per message, or raise "
                    "RpcOptions.max_frame_size on every worker)"
                )
        return _encode(msg)

    def data_to_send(self) -> list[bytes | bytearray | memoryview]:
        """Frames the protocol queued itself (handshake)."""
        out, self._outbox = self._outbox, []
        return out
