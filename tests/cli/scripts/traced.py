"""Make a few calls under `actorgrad launch --trace`, then end as argv[1] says:
``ok`` (shut down), ``fail`` (rank 0 raises), ``no-shutdown`` (return without it)."""

from __future__ import annotations

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
    await ag.shutdown()


if __name__ == "__main__":
    ag.run(main())
