"""Rank 0 fails at once; rank 1 sleeps (it would run for a minute), writing its pid."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    if rank == 0:
        sys.exit(3)
    tmp = Path(sys.argv[1]) / "rank1.tmp"  # then renamed: a reader sees the whole pid
    tmp.write_text(str(os.getpid()))
    tmp.replace(tmp.with_suffix(".pid"))
    time.sleep(60)
