"""A model split into two pipeline stages on two workers, trained with micro-batches.

Run with:  actorgrad launch --nproc 3 examples/pipeline_parallel.py [--steps 300]

worker1 holds stage 1 and worker2 stage 2, each an ``nn.Module`` created there with
``ag.remote`` and used through its RRef. worker0 drives: it splits every batch into
micro-batches and sends each one through both stages (``await
stage.rpc_async().forward(x)``); the micro-batches run concurrently, so stage 1 works on
one micro-batch while stage 2 works on another. The driver computes the loss of the
whole batch, runs one distributed backward in the step's autograd context (the
gradients flow back through worker2 and worker1 to every parameter), and steps a
``DistributedOptimizer`` over both stages' parameter RRefs, which updates each stage's
parameters on the worker that holds them.

The task is regression on generated data (no download): y = sin(1.5 * x @ a) + noise.
worker0 prints the loss every few steps and exits non-zero if it did not fall clearly.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch
from torch import nn

import actorgrad as ag

IN, HIDDEN, OUT = 16, 128, 4


class Stage(nn.Module):
    """One pipeline stage; lives on its worker, reached through an RRef."""

    def __init__(self, seed: int, layers: list[nn.Module]) -> None:
        super().__init__()
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.net = nn.Sequential(*layers)
        for module in self.net:
            if isinstance(module, nn.Linear):
                nn.init.kaiming_uniform_(module.weight, nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def parameter_rrefs(self) -> list[ag.RRef[torch.Tensor]]:
        return [ag.RRef(p) for p in self.parameters()]


def make_stage1() -> Stage:
    return Stage(1, [nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU()])


def make_stage2() -> Stage:
    return Stage(2, [nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)])


def make_data(n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(IN, OUT, generator=gen) / IN**0.5
    x = torch.randn(n, IN, generator=gen)
    y = torch.sin(1.5 * x @ a) + 0.05 * torch.randn(n, OUT, generator=gen)
    return x, y


async def train(args: argparse.Namespace) -> bool:
    stage1 = ag.remote("worker1", make_stage1)
    stage2 = ag.remote("worker2", make_stage2)
    params = [*await stage1.rpc_async().parameter_rrefs(), *await stage2.rpc_async().parameter_rrefs()]
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, params, lr=args.lr, momentum=0.9)
    print(f"stage 1 on worker1, stage 2 on worker2: {len(params)} parameter tensors; "
          f"batch {args.batch} in {args.micro} micro-batches", flush=True)

    x_all, y_all = make_data()
    gen = torch.Generator().manual_seed(1)

    async def through_pipeline(x: torch.Tensor) -> torch.Tensor:
        hidden = await stage1.rpc_async().forward(x)
        return await stage2.rpc_async().forward(hidden)

    losses: list[float] = []
    report_every = max(1, args.steps // 10)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(x_all), (args.batch,), generator=gen)
        x, y = x_all[idx], y_all[idx]
        async with ag.autograd.context() as cid:
            outs = await asyncio.gather(*(through_pipeline(mb) for mb in x.chunk(args.micro)))
            loss = nn.functional.mse_loss(torch.cat(outs), y)
            await ag.autograd.backward(cid, [loss])
            await opt.step(cid)
        losses.append(loss.item())
        if step % report_every == 0 or step == args.steps:
            recent = losses[-report_every:]
            done = 24 * step // args.steps
            print(f"[{'#' * done}{'.' * (24 - done)}] {step:4d}/{args.steps}  "
                  f"loss {sum(recent) / len(recent):.4f}", flush=True)
    elapsed = time.perf_counter() - t0

    window = max(1, min(20, args.steps // 5))
    initial, final = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"{args.steps} steps in {elapsed:.1f}s ({1e3 * elapsed / args.steps:.1f} ms per step)",
          flush=True)
    print(f"loss {initial:.4f} -> {final:.4f}", flush=True)
    ok = final < 0.7 * initial
    if not ok:
        print(f"FAILED: the loss did not fall clearly ({initial:.4f} -> {final:.4f})", flush=True)
    return ok


async def main() -> int:
    parser = argparse.ArgumentParser(description="two-stage pipeline parallel training on actorgrad")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=128, help="batch size (default 128)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per batch (default 4)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 3:
        raise SystemExit("needs 3 ranks: actorgrad launch --nproc 3 examples/pipeline_parallel.py")
    await ag.init_rpc(f"worker{rank}")
    ok = True
    try:
        if rank == 0:
            ok = await train(args)
    finally:
        await ag.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(ag.run(main()))
