"""The only code that touches sockets: one ``BufferedProtocol`` per peer connection.

Received bytes go straight into the memory the sans-IO ``Connection`` hands out (for a
large tensor, the tensor itself); decoded events are passed to the worker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from .._errors import AuthenticationError, ProtocolError
from ..wire import Call, Connection, Established, Heartbeat, Message, State, Tell

if TYPE_CHECKING:
    from ._worker import Worker

log = logging.getLogger("actorgrad.transport")

# Test-only network latency: every frame leaves this many milliseconds late, in order.
# For multi-host tests on kernels without the netem qdisc. Never set it in production.
_TEST_DELAY = float(os.environ.get("ACTORGRAD_TEST_DELAY_MS", "0") or 0) / 1000.0
# Frames to one peer in one loop iteration that go out one send each before the rest
# of the burst is corked.
_BURST_FRAMES = 4
# Corked frames that leave together at most: a long burst goes out in slices, so the
# peer works on one slice while this side produces the next.
_CORK_MAX_FRAMES = 32


class PeerProtocol(asyncio.BufferedProtocol):
    """A connection to one peer; after the handshake it *is* the peer for the worker."""

    def __init__(self, worker: Worker, initiator: bool = False, endpoint: str = "") -> None:
        self.worker = worker
        self.conn: Connection = worker.new_connection(initiator, endpoint)
        self.transport: asyncio.Transport | None = None
        self.name: str | None = None
        self.rank: int | None = None
        self.established: asyncio.Future[PeerProtocol] = worker.loop.create_future()
        self.outstanding: set[int] = set()  # request ids we wait on from this peer
        self.serving: dict[int, asyncio.Task[None]] = {}  # its requests we are running
        self.last_received = self.last_sent = self.last_taken = time.monotonic()
        # bytes handed to the transport, ever: with what it still holds, the progress of
        # a peer reading a long message of ours (see took_bytes)
        self.handed = 0
        self._taken_mark = self._unsent_mark = 0
        self.leaving = False  # peer announced shutdown: losing it is expected
        self.left_on_error = ""  # the error the peer's program stopped on, as it told us
        self.lost_reason: str | None = None
        # Above the transport's high-water mark the peer is not reading what we send as
        # fast as we produce it: its calls wait in ``deferred`` (in order) until the
        # buffer drains, so a peer that stops reading cannot make us pile up replies;
        # the worker drops it when the buffer makes no progress (see Worker._heartbeats).
        self.write_paused = False
        self.deferred: collections.deque[Call | Tell] = collections.deque()
        self.stall_since = 0.0  # when the peer last took bytes while paused
        self.stall_taken = 0  # bytes it took since the pause, as of then
        self.owed_since_pause = 0  # unsent at the pause + handed to the transport since
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._handshaking = True  # the Connection may queue frames of its own until done
        self.handshake_timer: asyncio.TimerHandle | None = None  # set by the accepting worker
        # Small frames are sometimes corked and leave together (see _write).
        self._corked: list[bytes | bytearray | memoryview] | None = None
        self._sent_this_tick = 0
        # The event loop calls get_buffer for every read: hand it the Connection's.
        self.get_buffer = self.conn.get_buffer  # type: ignore[method-assign]

    # -- asyncio callbacks ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.worker.on_connected(self)
        self.transport.set_write_buffer_limits(high=64 << 20)  # type: ignore[union-attr]
        size = self.worker.options.socket_buffer_bytes
        sock = transport.get_extra_info("socket")
        if size and sock is not None:
            # Big kernel buffers let a large tensor leave in a few sends instead of many
            # rounds of "buffer full, wait until writable" (the kernel caps the size
            # at net.core.wmem_max / rmem_max).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        self._write(self.conn.data_to_send())

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_received = time.monotonic()
        conn = self.conn
        conn.buffer_updated(nbytes)
        worker = self.worker
        if not self._handshaking:  # no polling for a peer not known yet: anyone can connect
            worker.keep_hot()
        worker.corking += 1  # replies to everything this read brought leave together
        try:
            if self._handshaking:
                self._handshake_events()
                return
            next_event = conn.next_event
            on_message = worker.on_message
            while (event := next_event()) is not None:
                if event.__class__ is not Heartbeat:
                    on_message(self, event)  # type: ignore[arg-type]  # no Established any more
                elif event.ping:
                    self.send(Heartbeat(ping=False))  # answer: we are alive
        except (ProtocolError, AuthenticationError) as exc:
            # without its traceback: the decoder keeps this error, and the traceback's
            # frames hold this protocol, a cycle that kept every dropped connection (and
            # its receive buffer) alive until a full garbage collection
            self.abort(exc.with_traceback(None))
        finally:
            worker.corking -= 1
            if not worker.corking:
                worker.flush_corked()

    def _handshake_events(self) -> None:
        conn = self.conn
        while (event := conn.next_event()) is not None:
            if (out := conn.data_to_send()):
                self._write(out)
            if isinstance(event, Established):
                self.worker.on_established(self, event)
            elif not isinstance(event, Heartbeat):
                self.worker.on_message(self, event)
            elif event.ping:
                self.send(Heartbeat(ping=False))
        if (out := conn.data_to_send()):
            self._write(out)
        if conn.state is State.ESTABLISHED:
            self._handshaking = False  # from now on the Connection queues nothing itself

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()  # it holds this protocol for init_timeout
            self.handshake_timer = None
        reason = self.lost_reason or (f"connection lost: {exc}" if exc else "connection closed")
        if not self.established.done():
            self.established.set_exception(ConnectionError(reason))
            self.established.exception()  # mark retrieved
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        # (this protocol may outlive the group for a while: the collector's frozen
        # generation keeps a group's objects until a later start collects them)
        self.conn.release_buffers()
        self.worker.on_connection_lost(self, reason)

    def pause_writing(self) -> None:
        self.write_paused = True
        self.stall_since = time.monotonic()
        self.stall_taken = 0
        self.owed_since_pause = self.unsent_bytes()

    def took_bytes(self, now: float) -> float:
        """When the peer last read bytes of ours (as of ``now``, when it did since the
        last look): a peer that reads is alive, also while it can hear nothing else
        from us (our ping waits behind a large message it is reading) and says nothing
        (it hears from us all the time). Bytes the kernel took while some waited in
        the transport count: the kernel's buffers were full, so the peer made room.
        (A peer that does not run still has room in them for our pings.)"""
        unsent = self.unsent_bytes()
        taken = self.handed - unsent
        if taken != self._taken_mark and self._unsent_mark:
            self.last_taken = now
        self._taken_mark, self._unsent_mark = taken, unsent
        return self.last_taken

    def taken_since_pause(self) -> int:
        """Bytes the kernel took from the transport since writing paused: progress of
        a peer that reads, however much more we write meanwhile."""
        return self.owed_since_pause - self.unsent_bytes()

    def resume_writing(self) -> None:
        self.write_paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self.deferred:
            self.worker.serve_deferred(self)

    def unsent_bytes(self) -> int:
        """Bytes handed to the transport that the kernel has not taken yet."""
        transport = self.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    # -- used by the worker ---------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    @property
    def can_send(self) -> bool:
        """Whether messages may still go out: open, and the peer has not said goodbye
        (nor broken the protocol), after which its connection only waits to close."""
        return self.conn.state is State.ESTABLISHED and self.is_open

    def send(self, msg: Message) -> None:
        self._write(self.conn.send(msg))

    def _write(self, pieces: list[bytes | bytearray | memoryview]) -> None:
        """Send one frame, or cork it to leave with others in one ``send``.

        The kernel's cost per ``send`` on loopback exceeds the Python work of a small
        call, so small frames (one piece) are corked in two cases: while the worker
        handles what one read brought (``worker.corking``; flushed before control goes
        back to the loop), and in a burst, past the first few frames written to this
        peer in one loop iteration (a thousand ``rpc_async`` calls issued at once;
        flushed at the end of the iteration). Any other frame goes out at once, as
        the API promises, after whatever is corked, so frames never reorder.
        """
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.last_sent = time.monotonic()
        if not self._handshaking:  # (our HELLO to whoever connected: no polling either)
            self.worker.keep_hot()
        if _TEST_DELAY:
            self._write_later(pieces)
            return
        if len(pieces) == 1:
            if self._corked is not None:
                self._corked.append(pieces[0])
                if len(self._corked) >= _CORK_MAX_FRAMES:
                    self.flush()  # the peer starts on these while we produce the rest
                return
            if self.worker.corking or self._sent_this_tick >= _BURST_FRAMES:
                self._corked = pieces
                self.worker.corked_peers.append(self)
                if not self.worker.corking:
                    self.worker.loop.call_soon(self.worker.flush_corked)
                return
            if not self._sent_this_tick:
                self.worker.loop.call_soon(self._end_tick)
            self._sent_this_tick += 1
            size = _nbytes(pieces[0])
            self.handed += size
            if self.write_paused:
                self.owed_since_pause += size
            transport.write(pieces[0])
            return
        self.flush()
        size = sum(map(_nbytes, pieces))
        self.handed += size
        if self.write_paused:
            self.owed_since_pause += size
        transport.writelines(pieces)

    def _end_tick(self) -> None:
        self._sent_this_tick = 0

    def flush(self) -> None:
        """Hand the corked frames to the transport now."""
        corked, self._corked = self._corked, None
        if corked is None or self.transport is None or self.transport.is_closing():
            return
        data = corked[0] if len(corked) == 1 else b"".join(corked)
        size = _nbytes(data)
        self.handed += size
        if self.write_paused:
            self.owed_since_pause += size
        self.transport.write(data)

    def _write_later(self, pieces: list[bytes | bytearray | memoryview]) -> None:
        """Test-only delay: queue the frame; one timer releases frames in order."""
        queue: collections.deque[tuple[float, list[bytes | bytearray | memoryview]]] | None
        queue = getattr(self, "_delayed", None)
        if queue is None:
            queue = collections.deque()
            self._delayed = queue
        queue.append((time.monotonic() + _TEST_DELAY, pieces))
        if len(queue) == 1:
            self.worker.loop.call_later(_TEST_DELAY, self._release_delayed)

    def _release_delayed(self) -> None:
        queue = self._delayed
        now = time.monotonic()
        while queue and queue[0][0] <= now + 1e-4:
            _, pieces = queue.popleft()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.writelines(pieces)
        if queue:
            self.worker.loop.call_later(max(0.0, queue[0][0] - now), self._release_delayed)

    async def drain(self) -> None:
        self.flush()
        if self.write_paused and self.is_open:
            waiter: asyncio.Future[None] = self.worker.loop.create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def abort(self, exc: BaseException | str) -> None:
        """Drop the connection because of ``exc`` (protocol violation, failed auth)."""
        self.lost_reason = str(exc)
        if isinstance(exc, AuthenticationError) and not self.established.done():
            self.established.set_exception(exc)
            self.established.exception()
            self.worker.on_key_check_failed(self.conn.peer_rank, exc)
        log.warning("%s: dropping connection to %s: %s", self.worker.name, self.name or "peer", exc)
        if self.transport is not None:
            if isinstance(exc, AuthenticationError):
                # our AUTH goes out first (the peer's HELLO and failed AUTH may arrive in
                # one read, which fails before the reply is written), then a close, not a
                # reset that may discard it: the peer checks it and tells a failed key
                # check from a connection that just broke
                if (out := self.conn.data_to_send()):
                    self._write(out)
                self.close()
            else:
                self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.flush()
            self.transport.close()


def _nbytes(piece: bytes | bytearray | memoryview) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


class LoopbackPeer:
    """Stands in for a connection to the worker itself (``rpc_async`` to oneself).

    Every message is encoded and decoded exactly as on a socket, so arguments are
    copied and every layer above sees the same events as for a remote peer.
    """

    def __init__(self, worker: Worker) -> None:
        from ..wire import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, decode_frame

        self.worker = worker
        self.name: str | None = worker.name
        self.rank: int | None = worker.rank
        self.outstanding: set[int] = set()
        self.serving: dict[int, asyncio.Task[None]] = {}
        self.leaving = False
        self.write_paused = False  # messages to ourselves never wait
        self.deferred: collections.deque[Call | Tell] = collections.deque()
        self.last_received = self.last_sent = time.monotonic()
        self.flush = lambda: None
        self._decoder = FrameDecoder(max_frame_size=DEFAULT_MAX_FRAME_SIZE)
        self._decode = decode_frame

    @property
    def is_open(self) -> bool:
        return not self.worker.closed

    can_send = is_open

    def send(self, msg: Message) -> None:
        from ..wire._connection import _encode

        for piece in _encode(msg):
            self._decoder.receive_data(piece)
        frame = self._decoder.next_frame()
        assert frame is not None
        decoded = self._decode(frame)
        self.worker.loop.call_soon(self.worker.on_message, self, decoded)  # type: ignore[arg-type]  # stands in for a PeerProtocol

    def abort(self, exc: BaseException | str) -> None:
        pass

    def close(self) -> None:
        pass
