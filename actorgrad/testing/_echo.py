"""What the worker processes of a local group print, shown where worker0 prints.

A local group's workers write to log files (kept when a worker fails; a pipe nobody
reads while worker0's loop is busy, a long notebook cell, would block a worker that
prints). A thread of worker0's process follows the files and copies each complete line
to this process's ``sys.stdout`` as it is at that moment (a notebook's cell, pytest's
capture), prefixed with the worker's name, as ``actorgrad launch`` prefixes its ranks.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import BinaryIO

_INTERVAL_S = 0.1  # how often the files are read: output shows this much after it was written
_READ_MAX = 1 << 20  # per file and turn (turns follow each other while there is more)
_LINE_MAX = 1 << 16  # a line without its end that grows past this is shown in pieces


class OutputEcho:
    """Follows ``paths`` (rank -> log file) on a daemon thread until :meth:`stop`."""

    def __init__(self, paths: dict[int, str]) -> None:
        self._paths = paths
        self._files: dict[int, BinaryIO] = {}
        self._partial: dict[int, bytes] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # one reader of the files at a time (the thread, or stop)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="actorgrad-output-echo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(_INTERVAL_S):
            while self._copy() and not self._stopping.is_set():
                pass

    def _copy(self, final: bool = False) -> bool:
        """Show what the files gained; whether there may be more (a full read)."""
        more = False
        with self._lock:
            if self._closed:
                return False
            lines: list[str] = []
            for rank, path in self._paths.items():
                file = self._files.get(rank)
                if file is None:
                    try:
                        file = self._files[rank] = open(path, "rb")  # noqa: SIM115 - kept open
                    except OSError:
                        continue  # not there yet (or removed: the group has ended)
                try:
                    read = file.read(_READ_MAX)
                except (OSError, ValueError):
                    continue
                more = more or len(read) == _READ_MAX
                *complete, rest = (self._partial.pop(rank, b"") + read).split(b"\n")
                if rest and ((final and len(read) < _READ_MAX) or len(rest) > _LINE_MAX):
                    complete.append(rest)  # the worker's last line, or a piece of a long one
                elif rest:
                    self._partial[rank] = rest
                prefix = f"[worker{rank}] "
                lines.extend(prefix + line.decode(errors="replace") + "\n" for line in complete)
            if lines:
                stream = sys.stdout
                with contextlib.suppress(Exception):  # a closed or replaced stream: nobody to show
                    stream.write("".join(lines))
                    stream.flush()
        return more

    def flush(self) -> None:
        """Show now what the workers wrote until now (complete lines)."""
        while self._copy():
            pass

    def stop(self, copy_rest: bool = True) -> None:
        """Stop following; with ``copy_rest``, show what the workers wrote until now
        (call it once they have ended)."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if copy_rest:
            while self._copy(final=True):  # to the end of every file
                pass
        with self._lock:
            self._closed = True
            for file in self._files.values():
                file.close()
            self._files.clear()
