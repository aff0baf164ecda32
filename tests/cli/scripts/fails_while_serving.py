"""Rank 1 raises while it serves rank 0's slow call (rank 0 loses it at once and exits
first); each rank prints its own error and the launcher waits for rank 1's exit."""

from __future__ import annotations

import asyncio
import os
import time

import actorgrad as ag


def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


async def main() -> None:
    rank = int(os.environ["RANK"])
    await ag.init_rpc(f"worker{rank}")
    if rank == 1:
        await asyncio.sleep(0.5)
        raise ValueError("rank 1 fails on purpose")
    await ag.rpc_async("worker1", slow, args=(5,))
    await ag.shutdown()


if __name__ == "__main__":
    ag.run(main())
