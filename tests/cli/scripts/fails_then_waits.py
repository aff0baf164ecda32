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
    (Path(sys.argv[1]) / "rank1.pid").write_text(str(os.getpid()))
    time.sleep(60)
