"""Entry point of a worker process started by ``local_group``: serve until worker0 leaves.

    python -m actorgrad.testing._serve RANK WORLD_SIZE INIT_METHOD PARENT_PID
"""

from __future__ import annotations

import asyncio
import os
import sys

import actorgrad as ag


async def serve(rank: int, world_size: int, init_method: str, parent: int) -> None:
    await ag.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, init_method=init_method)
    from ..runtime import get_worker

    worker = get_worker()
    # Serve until worker0 starts its shutdown (or vanishes), then leave with the group.
    while 0 in worker.peers and 0 not in worker._done_from:
        worker._done_changed.clear()
        try:
            await asyncio.wait_for(worker._done_changed.wait(), 1.0)
        except TimeoutError:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                break
    await ag.shutdown(graceful=0 in worker.peers)


def main() -> None:
    rank, world_size, init_method, parent = sys.argv[1:5]
    ag.run(serve(int(rank), int(world_size), init_method, int(parent)))


if __name__ == "__main__":
    main()
