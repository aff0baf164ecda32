"""Forwarding of the ranks' output for ``actorgrad launch`` (standard library only).

Every rank's stdout and stderr is a pipe read by a thread of its own; what it reads
is cut at line ends (``\\n``, and ``\\r`` as progress bars use), prefixed with the
rank and queued on a :class:`Sink`, one per launcher stream, whose own thread writes
it out. Nothing the supervisor does waits for a stream: a reader that stopped
reading the launcher's stdout (a pager, a paused terminal) holds up only that
stream's writer, and through the bounded queue the ranks that write to it, exactly
as it would hold up ranks writing straight to it, while failures and signals are
still acted on at once.

Bytes pass through as the ranks wrote them (no decoding), and a line still being
written (a prompt, a progress bar) is shown once its rank has been quiet for
``PARTIAL_AFTER_S``; a line of another rank interleaved with it starts on a line of
its own.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO

#: How long a rank's unfinished line waits for the rest before it is shown.
PARTIAL_AFTER_S = 0.1
#: Bytes a sink holds before the readers feeding it wait (the ranks then block on
#: their pipes, as they would writing to a stream nobody reads).
SINK_BUDGET_BYTES = 1 << 20
_READ_BYTES = 1 << 16


class Sink:
    """One destination (the launcher's stdout or stderr) and the thread writing to it."""

    def __init__(self, stream: IO[str] | None, name: str, budget: int = SINK_BUDGET_BYTES) -> None:
        self._stream = stream
        self._budget = budget
        self._chunks: deque[bytes] = deque()
        self._pending = 0  # bytes queued or being written
        self._open: object | None = None  # the source whose line is unfinished on screen
        self._after_cr: object | None = None  # the source whose last line ended in \r
        self._closed = False
        # the stream refused a write (or there is none: a closed descriptor leaves
        # sys.stdout None): the rest is dropped
        self._broken = stream is None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"actorgrad-launch-{name}", daemon=True)
        self._thread.start()

    def put_line(self, source: object, prefix: bytes, text: bytes, complete: bool, *, wait: bool = True) -> None:
        """Queue ``text`` of ``source`` (``complete`` when it ends its line). With
        ``wait`` the caller waits while the sink is over budget."""
        with self._cond:
            while wait and self._pending > self._budget and not self._broken:
                self._cond.wait()
            if self._broken or (text == b"\r" and self._open is not source):
                return  # (a carriage return at the start of a line moves nothing)
            pieces = []
            if self._open is not None and self._open is not source:
                pieces.append(b"\n")  # another source's unfinished line: end it on screen
                self._open = None
            if self._open is None and not (text == b"\n" and self._after_cr is source):
                pieces.append(prefix)  # (a \n after this source's \r ends that line)
            pieces.append(text)
            self._open = None if complete else source
            self._after_cr = source if complete and text.endswith(b"\r") else None
            data = b"".join(pieces)
            self._chunks.append(data)
            self._pending += len(data)
            self._cond.notify_all()

    def message(self, text: str) -> None:
        """A line of the launcher's own: queued whole, never waiting (the supervisor
        calls it)."""
        encoding = getattr(self._stream, "encoding", None) or "utf-8"
        self.put_line(self, b"", f"{text}\n".encode(encoding, errors="replace"), True, wait=False)

    def drained(self) -> bool:
        """Whether everything queued was written (or the stream refused it)."""
        with self._cond:
            return self._pending == 0 or self._broken

    def close(self) -> None:
        """No more output: the writer ends once the queue is written."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._chunks and not self._closed:
                    self._cond.wait()
                if not self._chunks:
                    return
                data = b"".join(self._chunks)
                self._chunks.clear()
            try:
                self._write(data)
            except Exception:  # noqa: BLE001 - whatever the stream's failure, the same end
                # a closed or broken pipe (`actorgrad launch ... | head`): drop the
                # rest but keep the readers draining the ranks, so they never block
                with self._cond:
                    self._broken = True
                    self._chunks.clear()
                    self._pending = 0
                    self._cond.notify_all()
                continue
            with self._cond:
                self._pending -= len(data)
                self._cond.notify_all()

    def _write(self, data: bytes) -> None:
        stream = self._stream
        assert stream is not None  # (a sink without one is broken from the start)
        binary = getattr(stream, "buffer", None)
        if binary is None:  # a text-only stream (a notebook's, a test's): decode
            stream.write(data.decode("utf-8", errors="replace"))
            stream.flush()
            return
        stream.flush()  # anything written through the text layer goes first
        binary.write(data)
        binary.flush()


def forward(pipe: IO[bytes], prefix: bytes, sink: Sink) -> None:
    """Copy ``pipe`` to ``sink`` until end of file, line by line with ``prefix``."""
    fd = pipe.fileno()
    partial = b""  # the unfinished line, not shown yet
    shown = False  # whether the start of the unfinished line was already shown
    try:
        while True:
            if partial:
                ready, _, _ = select.select([fd], [], [], PARTIAL_AFTER_S)
                if not ready or len(partial) >= _READ_BYTES:
                    # quiet for a while, or long: show what there is of the line (a
                    # lone \r waiting to see whether \n follows ended it after all)
                    ended = partial.endswith(b"\r")
                    sink.put_line(pipe, prefix, partial, ended)
                    partial, shown = b"", not ended
                    continue
            data = os.read(fd, _READ_BYTES)
            if not data:
                break
            data = partial + data
            start = 0
            while (end := _line_end(data, start)) > 0:
                sink.put_line(pipe, prefix, data[start:end], True)
                start, shown = end, False
            partial = data[start:]
        if partial or shown:  # the rank ended mid-line
            sink.put_line(pipe, prefix, partial if partial.endswith(b"\n") else partial + b"\n", True)
    except (OSError, ValueError):
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def _line_end(data: bytes, start: int) -> int:
    """Where the line from ``start`` ends (past \n, \r\n or \r), or 0: not in ``data``
    yet (a \r at the very end may be the first half of \r\n)."""
    newline, carriage = data.find(b"\n", start), data.find(b"\r", start)
    if carriage < 0 or 0 <= newline < carriage:
        return newline + 1
    if carriage + 1 == len(data):
        return 0
    return carriage + (2 if data[carriage + 1] == 0x0A else 1)


def sinks(stdout: IO[str] | None, stderr: IO[str] | None) -> tuple[Sink, Sink]:
    """The sinks for the launcher's stdout and stderr: one shared when both are the
    same file (a terminal, ``2>&1``), so their lines never split each other."""
    out = Sink(stdout, "stdout")
    return out, out if _same_file(stdout, stderr) else Sink(stderr, "stderr")


def _same_file(a: IO[str] | None, b: IO[str] | None) -> bool:
    if a is None or b is None:
        return False
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):  # no file behind it (captured, a notebook)
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def finish(threads: list[threading.Thread], outputs: tuple[Sink, ...], stop: Callable[[], bool],
           idle_s: float = 2.0) -> None:
    """After the ranks exited: wait until their output is all written, then end the
    sinks' threads.

    Waits as long as output is still queued (a slow reader of the launcher's stream
    makes this slow, as it makes the ranks slow under any launcher). Gives up when
    ``stop()`` says so, or after ``idle_s`` with nothing queued while a pipe stays
    open (a process that left the rank's process group still holds it).
    """
    last = time.monotonic()
    while any(t.is_alive() for t in threads) or not all(s.drained() for s in outputs):
        if stop():
            break
        if not all(s.drained() for s in outputs):
            last = time.monotonic()
        elif time.monotonic() - last > idle_s:
            break
        time.sleep(0.02)
    for sink in outputs:
        sink.close()
