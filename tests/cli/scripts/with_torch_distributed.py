"""A torchrun-style script that uses torch.distributed (env://) next to actorgrad, in
the order given by its argument: both find their rendezvous."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import actorgrad as ag


def rank_squared() -> int:
    return ag.get_rank() ** 2


async def main(torch_first: bool) -> None:
    if torch_first:
        dist.init_process_group("gloo")
    await ag.init_rpc(f"worker{os.environ['RANK']}")
    if not torch_first:
        dist.init_process_group("gloo")
    total = torch.tensor([float(ag.get_rank() + 1)])
    dist.all_reduce(total)
    other = (ag.get_rank() + 1) % ag.get_world_size()
    squared = await ag.rpc_async(other, rank_squared)
    print(f"sum {total.item():g} squared {squared}", flush=True)
    dist.destroy_process_group()
    await ag.shutdown()


if __name__ == "__main__":
    ag.run(main(sys.argv[1] == "torch-first"))
