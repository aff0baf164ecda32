"""Record PIDs in a directory, then sleep; optionally fail, spawn or ignore signals.

Usage: sleeper.py PID_DIR [--fail-rank R --fail-code C] [--spawn-child-rank R]
       [--ignore-signals-rank R]

Every rank writes ``rank<RANK>.pid``.  ``--spawn-child-rank R`` makes rank R start a
grandchild sleeper (same process group) and record it as ``grandchild.pid``.
``--ignore-signals-rank R`` makes rank R ignore SIGINT and SIGTERM (so only SIGKILL
stops it).  ``--fail-rank R`` makes rank R wait until every rank's PID file exists,
sleep 0.5 s and exit with ``--fail-code``.  All other ranks sleep 60 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _write(path: Path, pid: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(pid))
    tmp.replace(path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("pid_dir", type=Path)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-code", type=int, default=3)
    p.add_argument("--spawn-child-rank", type=int, default=-1)
    p.add_argument("--ignore-signals-rank", type=int, default=-1)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])

    if rank == args.ignore_signals_rank:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == args.spawn_child_rank:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        _write(args.pid_dir / "grandchild.pid", child.pid)
    _write(args.pid_dir / f"rank{rank}.pid", os.getpid())
    print(f"rank {rank} ready", flush=True)

    if rank == args.fail_rank:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all((args.pid_dir / f"rank{r}.pid").exists() for r in range(world)):
                break
            time.sleep(0.02)
        time.sleep(0.5)
        print(f"rank {rank} failing with code {args.fail_code}", file=sys.stderr, flush=True)
        return args.fail_code
    time.sleep(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
