"""Ranks that exercise the launcher's output forwarding and failure reporting.

Usage: output_cases.py CASE DIR

- ``flood``: rank 0 writes LINES numbered lines, records its pid and waits to be
  stopped; rank 1 waits for that, then exits with code 3.
- ``race``: rank 1 exits with code 3; rank 0 notices it is gone and exits with code 1
  a moment later (as a rank that lost its peer does).
- ``prompt``: rank 0 writes ``prompt> `` without a newline and waits until DIR/answer
  exists, then finishes the line.
- ``stdin``: rank 0 reads a line from stdin and prints it back.
- ``bytes``: rank 0 writes bytes that are not UTF-8, and a line ending in \\r\\n.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

LINES = 20000


def _wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _write_pid(path: Path) -> None:
    """All at once: a reader that sees the file sees the whole pid."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(path)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def main() -> int:
    case, where = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    if case == "flood":
        if rank == 0:
            for i in range(LINES):
                print(f"line {i:05d} " + "x" * 20)
            _write_pid(where / "rank0.pid")
            time.sleep(60)
            return 0
        _wait_for(where / "rank0.pid")
        return 3
    if case == "race":
        _write_pid(where / f"rank{rank}.pid")
        other = where / f"rank{1 - rank}.pid"
        _wait_for(other)
        if rank == 1:
            time.sleep(0.3)
            return 3
        pid = int(other.read_text())
        while _alive(pid):
            time.sleep(0.001)
        time.sleep(0.005)
        return 1
    if rank != 0:
        return 0
    if case == "prompt":
        sys.stdout.write("prompt> ")
        sys.stdout.flush()
        _wait_for(where / "answer")
        print("answered")
    elif case == "stdin":
        print(f"got {input()!r}")
    elif case == "bytes":
        sys.stdout.buffer.write(b"bytes \xff\xfe end\ndos line\r\n")
        sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
