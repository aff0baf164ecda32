"""Make a few calls under `actorgrad launch --trace`, then end as argv[1] says:
``ok`` (shut down), ``fail`` (rank 0 raises), ``no-shutdown`` (return without it),
``other-fails`` (rank 1 raises while rank 0 works on: the launcher stops rank 0 with
SIGTERM)."""

from __future__ import annotations

import asyncio
import os
import sys

import torch

import actorgrad as ag


async def main() -> None:
    rank = int(os.environ["RANK"])
    await ag.init_rpc(f"worker{rank}")
    if rank == 0:
        for i in range(3):
            await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), i))
        if sys.argv[1] == "fail":
            raise RuntimeError("rank 0 fails on purpose")
        if sys.argv[1] == "no-shutdown":
            return
        if sys.argv[1] == "other-fails":
            await asyncio.sleep(60)
    elif sys.argv[1] == "other-fails":
        await asyncio.sleep(1)
        raise RuntimeError("rank 1 fails on purpose")
    await ag.shutdown()


if __name__ == "__main__":
    ag.run(main())
