"""Frame layout and the streaming frame decoder (sans-IO).

# Frame layout (little endian)
    magic    4s   b"AGRD"
    version  u8   PROTOCOL_VERSION
    kind     u8   Kind
    flags    u16  reserved, must be 0
    request  u64  request id (0 when unused)
    body     u64  body length in bytes
    nbuf     u32  number of out-of-band buffers
    lengths  nbuf x u64
    body bytes, then each buffer's bytes

# Theory of operation
The decoder is fed either by ``receive_data(bytes)`` (tests, fuzzers) or, zero-copy, by
``get_buffer()`` / ``buffer_updated(n)`` in the manner of ``asyncio.BufferedProtocol``.
Small frames are parsed out of a reusable staging area; a buffer-less frame that is
wholly staged is sliced out in one step (the common small call/reply). A large
out-of-band buffer is allocated as a uint8 tensor when its frame header arrives (from
huge pages above 2 MiB, see ``allocate_buffer``), and once the staging area is drained
``get_buffer`` hands out that tensor's memory itself, so the kernel copies the bytes
straight into the tensor that the receiver will use.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections import deque
from dataclasses import dataclass

import torch

from .._errors import ProtocolError

MAGIC = b"AGRD"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBHQQI")
LENGTH = struct.Struct("<Q")
RESTRICTED_MAX_BODY = 4096
RESTRICTED_MAX_SPILL = 64 << 20
_HEADER_SIZE = HEADER.size
_HEADER_PACK = HEADER.pack
_HEADER_UNPACK = HEADER.unpack_from
DEFAULT_MAX_FRAME_SIZE = 4 << 30
DEFAULT_MAX_BUFFERS = 4096
_STAGING_BYTES = 256 << 10
# Until the handshake completes a connection needs room for a few small frames only: a
# smaller staging area keeps unauthenticated connections cheap (a full one is 256 KiB).
HANDSHAKE_STAGING_BYTES = 16 << 10
_DIRECT_MIN_BYTES = 64 << 10  # read larger remainders straight into tensor memory
# At most this much memory is offered to one read: a read into a large tensor while its
# sender keeps the socket full went on copying for the whole transfer (seconds for a
# GiB), and the loop served nothing else meanwhile (heartbeats, other peers' calls).
_DIRECT_READ_MAX = 2 << 20
_HUGE_PAGE_MIN_BYTES = 2 << 20
_HUGE_PAGE = 2 << 20
_MAP_PRIVATE_ANON = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) or None
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_JOIN_MAX_BYTES = 16 << 10


def allocate_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor for ``nbytes`` received bytes.

    Large buffers come from a *private* anonymous mmap advised to use transparent huge
    pages: first-touch page faults otherwise cap receive bandwidth near
    memcpy-into-fresh-memory speed (about 1 GB/s on small VMs), while one 2 MiB huge
    page costs one fault instead of 512. ``mmap.mmap(-1, n)`` alone would be MAP_SHARED,
    i.e. shmem, which THP ignores (``shmem_enabled``) and which faults even slower.
    The length is rounded up to whole huge pages, so the kernel aligns the mapping.
    """
    if nbytes >= _HUGE_PAGE_MIN_BYTES and _MAP_PRIVATE_ANON is not None:
        length = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        try:
            region = mmap.mmap(-1, length, flags=_MAP_PRIVATE_ANON)
        except (OSError, ValueError):
            return torch.empty(nbytes, dtype=torch.uint8)
        if _MADV_HUGEPAGE is not None:
            with contextlib.suppress(OSError):  # THP off or unsupported: plain pages
                region.madvise(_MADV_HUGEPAGE)
        tensor = torch.frombuffer(region, dtype=torch.uint8)
        return tensor[:nbytes] if length != nbytes else tensor
    return torch.empty(nbytes, dtype=torch.uint8)


def encode_frame(
    kind: int,
    request_id: int,
    body: bytes | bytearray | memoryview,
    buffers: list[memoryview] | tuple[()] = (),
) -> list[bytes | bytearray | memoryview]:
    """The pieces of one frame, ready for ``transport.writelines``.

    Small frames come as one ``bytes`` (one write, one segment); large pieces are
    passed through as they are (zero-copy: the transport writes from their memory).
    """
    size = len(body)
    if not buffers:
        header = _HEADER_PACK(MAGIC, PROTOCOL_VERSION, kind, 0, request_id, size, 0)
        return [header + body] if size < _JOIN_MAX_BYTES else [header, body]
    lengths = [b.nbytes for b in buffers]
    header = _HEADER_PACK(MAGIC, PROTOCOL_VERSION, kind, 0, request_id, size, len(buffers))
    header += struct.pack(f"<{len(lengths)}Q", *lengths)
    if size + sum(lengths) < _JOIN_MAX_BYTES:
        return [b"".join([header, body, *buffers])]  # one write for small frames
    return [header, body, *buffers]


@dataclass(slots=True)
class Frame:
    """One decoded frame: header fields, body bytes and received buffers."""

    kind: int
    request_id: int
    body: bytearray | memoryview  # a memoryview for a large body (see FrameDecoder._begin_frame)
    buffers: list[torch.Tensor]


class FrameDecoder:
    """Incremental frame parser; yields :class:`Frame` objects or raises ProtocolError."""

    def __init__(
        self,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_buffers: int = DEFAULT_MAX_BUFFERS,
        known_kinds: frozenset[int] = frozenset(),
        staging_bytes: int = _STAGING_BYTES,
    ) -> None:
        self.max_frame_size = max_frame_size
        self.max_buffers = max_buffers
        self.known_kinds = known_kinds
        self._staging = bytearray(staging_bytes)
        self._view = memoryview(self._staging)
        self._start = 0  # first unconsumed byte in staging
        self._end = 0  # end of received bytes in staging
        self._frames: deque[Frame] = deque()
        # Before the handshake completes only these kinds are accepted, small and without
        # buffers, one frame at a time: an unauthenticated peer cannot make us allocate.
        self.restricted_kinds: frozenset[int] | None = None
        self._spill = bytearray()  # bytes beyond the staging area while restricted
        self._spilling: memoryview | None = None
        # the frame being assembled (the slow path: frames larger than what is staged)
        self._header: tuple[int, int] | None = None  # kind, request id
        self._body: bytearray | memoryview = bytearray()
        self._buffers: list[torch.Tensor] = []
        self._targets: list[memoryview] = []  # memory of each part still to fill, in order
        self._part = 0  # index into _targets
        self._filled = 0  # bytes filled in the current part
        self._direct = False  # the last get_buffer handed out part memory
        self._error: ProtocolError | None = None

    # -- feeding -------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Memory the next received bytes should be written into."""
        if self._error is not None or not self._staging:  # (or released: see release)
            return self._view[self._end :] if self._end < len(self._staging) else memoryview(bytearray(1))
        if self._header is not None and self._start == self._end:
            target = self._targets[self._part]
            if len(target) - self._filled >= _DIRECT_MIN_BYTES:
                self._direct = True
                return target[self._filled : self._filled + _DIRECT_READ_MAX]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._staging) - self._end < 4096:
            # compact: move the unconsumed tail to the front
            pending = self._end - self._start
            self._staging[:pending] = self._staging[self._start : self._end]
            self._start, self._end = 0, pending
        if self._spill or (self.restricted_kinds is not None and self._end == len(self._staging)):
            # waiting for the handshake with a full staging area: park the bytes
            self._spilling = memoryview(bytearray(1 << 16))
            return self._spilling
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the memory returned by the last ``get_buffer``."""
        if self._error is not None:
            return
        if self._spilling is not None:
            self._spill += self._spilling[:nbytes]
            self._spilling = None
            if len(self._spill) > RESTRICTED_MAX_SPILL:
                self._error = ProtocolError(
                    f"peer sent over {RESTRICTED_MAX_SPILL} bytes before the handshake completed"
                )
            return
        try:
            if self._direct:
                self._direct = False
                self._filled += nbytes
                self._advance_part()
            else:
                self._end += nbytes
            self._parse()
        except ProtocolError as exc:
            self._error = exc

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes (copying them). Never raises: errors surface in ``next_frame``."""
        view = memoryview(data)
        while view.nbytes and self._error is None:
            target = self.get_buffer(view.nbytes)
            n = min(len(target), view.nbytes)
            target[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None when more data is needed."""
        if not self._frames and self.restricted_kinds is not None and self._error is None:
            self._parse_safely()  # restricted mode parses one frame per request
        if self._frames:
            return self._frames.popleft()
        if self._error is not None:
            raise self._error
        return None

    def lift_restriction(self) -> None:
        """The handshake completed: accept every kind and size again."""
        self.restricted_kinds = None
        if len(self._staging) < _STAGING_BYTES:  # the full staging area, for data frames
            staging = bytearray(_STAGING_BYTES)
            pending = self._end - self._start
            staging[:pending] = self._staging[self._start : self._end]
            self._staging, self._view = staging, memoryview(staging)
            self._start, self._end = 0, pending
        self._parse_safely()
        if self._spill:
            spill, self._spill = self._spill, bytearray()
            self.receive_data(spill)

    def _parse_safely(self) -> None:
        try:
            self._parse()
        except ProtocolError as exc:
            self._error = exc

    @property
    def memory_bytes(self) -> int:
        """Bytes of receive memory held: the staging area and a partial frame's parts."""
        return len(self._staging) + len(self._spill) + sum(len(t) for t in self._targets)

    def release(self) -> None:
        """The connection is closed: let go of the receive memory (nothing more comes;
        frames decoded already stay)."""
        self._staging = bytearray()
        self._view = memoryview(self._staging)
        self._start = self._end = 0
        self._spill, self._spilling = bytearray(), None
        self._header, self._body, self._buffers, self._targets = None, bytearray(), [], []
        self._part = self._filled = 0
        self._direct = False

    @property
    def buffered_bytes(self) -> int:
        """Bytes of an incomplete frame held by the decoder."""
        return self._end - self._start

    @property
    def in_frame(self) -> bool:
        """True while a frame is partially received."""
        return self._header is not None or self._end > self._start

    # -- parsing -------------------------------------------------------------------
    def _parse(self) -> None:
        staging = self._staging
        while True:
            if self.restricted_kinds is not None and self._frames:
                return  # the handshake decides what comes next
            start, end = self._start, self._end
            if self._header is None:
                if end - start < _HEADER_SIZE:
                    return
                kind, request_id, body_len, nbuf = self._check_header(start)
                body_start = start + _HEADER_SIZE
                if nbuf == 0 and body_start + body_len <= end:
                    # fast path: a whole buffer-less frame is staged
                    self._start = body_start + body_len
                    self._frames.append(Frame(kind, request_id, staging[body_start : self._start], []))
                    continue
                if not self._begin_frame(start, kind, request_id, body_len, nbuf):
                    return  # the buffer lengths are not all here yet
            else:
                available = end - start
                if available == 0:
                    return
                target = self._targets[self._part]
                n = min(available, len(target) - self._filled)
                target[self._filled : self._filled + n] = self._view[start : start + n]
                self._start = start + n
                self._filled += n
                self._advance_part()

    def _check_header(self, start: int) -> tuple[int, int, int, int]:
        magic, version, kind, flags, request_id, body_len, nbuf = _HEADER_UNPACK(self._staging, start)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r} (not an actorgrad peer?)")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"peer speaks protocol version {version}, this worker speaks {PROTOCOL_VERSION}"
            )
        if self.known_kinds and kind not in self.known_kinds:
            raise ProtocolError(f"unknown message kind {kind}")
        restricted = self.restricted_kinds
        if restricted is not None:
            if kind not in restricted:
                raise ProtocolError(f"message kind {kind} before the handshake completed")
            if body_len > RESTRICTED_MAX_BODY or nbuf:
                raise ProtocolError(
                    f"handshake frame of {body_len} bytes with {nbuf} buffers refused before "
                    f"authentication (limit {RESTRICTED_MAX_BODY} bytes, no buffers)"
                )
        if flags:
            raise ProtocolError(f"unsupported frame flags {flags:#x}")
        if nbuf > self.max_buffers:
            raise ProtocolError(f"frame has {nbuf} buffers, the limit is {self.max_buffers}")
        if body_len > self.max_frame_size:
            raise ProtocolError(f"frame body of {body_len} bytes exceeds max_frame_size")
        return kind, request_id, body_len, nbuf

    def _begin_frame(self, start: int, kind: int, request_id: int, body_len: int, nbuf: int) -> bool:
        need = _HEADER_SIZE + LENGTH.size * nbuf
        if self._end - start < need:
            if need > len(self._staging):
                raise ProtocolError("frame header too large")
            return False
        lengths = struct.unpack_from(f"<{nbuf}Q", self._staging, start + _HEADER_SIZE) if nbuf else ()
        total = body_len + sum(lengths)
        if total > self.max_frame_size:
            raise ProtocolError(
                f"frame of {total} bytes exceeds max_frame_size={self.max_frame_size}"
            )
        self._start = start + need
        self._header = (kind, request_id)
        # A large body's memory is taken as its bytes arrive (zero-filling a bytearray
        # would stall the loop, for a length the bytes may never back)
        self._body = bytearray(body_len) if body_len < _DIRECT_MIN_BYTES \
            else allocate_buffer(body_len).numpy().data
        self._buffers = [allocate_buffer(n) for n in lengths]
        self._targets = [memoryview(self._body)]
        self._targets += [b.numpy().data for b in self._buffers]
        self._part, self._filled = 0, 0
        self._advance_part()
        return True

    def _advance_part(self) -> None:
        """Move past completed parts; emit the frame when all parts are complete."""
        targets = self._targets
        while self._filled >= len(targets[self._part]):
            self._part += 1
            self._filled = 0
            if self._part == len(targets):
                assert self._header is not None
                kind, request_id = self._header
                self._frames.append(Frame(kind, request_id, self._body, self._buffers))
                self._header = None
                self._body = bytearray()
                self._buffers = []
                self._targets = []
                self._part = 0
                return
