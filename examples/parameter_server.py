"""A parameter server trained by one or more trainers, on actorgrad.

Run with:  actorgrad launch --nproc 2 examples/parameter_server.py            # 1 trainer
           actorgrad launch --nproc 3 examples/parameter_server.py --steps 500  # 2 trainers

worker0 is the parameter server: it owns a small MLP classifier (wrapped in an RRef) and
drives the run. Every other rank is a trainer: worker0 starts ``run_trainer`` on it with
``rpc_async``, and the trainer, for ``--steps`` steps,

* opens a distributed autograd context,
* sends a mini-batch of its shard of a generated 2-D spiral data set (4 classes, no
  download) to the server: ``logits = await ps.rpc_async().forward(x)``,
* computes the cross-entropy loss locally and runs ``await ag.autograd.backward(cid,
  [loss])``: the gradients travel back to worker0 and accumulate there, in the context,
* steps its ``DistributedOptimizer(torch.optim.SGD, param_rrefs, ...)``, which applies
  them to the parameters where they live.

With two trainers both update the same parameters concurrently (asynchronous SGD). The
server runs each forward on a snapshot of the parameters (``clone``, through which the
gradients still reach the parameters themselves), so that another trainer's optimizer
step may change the parameters in place between this trainer's forward and its backward.

Each trainer prints its loss every few steps; worker0 prints the final accuracy on the
whole data set and exits non-zero if the loss did not fall clearly.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time

import torch
from torch import nn

import actorgrad as ag

CLASSES = 4
POINTS_PER_CLASS = 500
BATCH = 64


def make_spiral(seed: int = 0, noise: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """``CLASSES`` interleaved spiral arms in the plane: inputs [N, 2], labels [N]."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(CLASSES):
        r = torch.linspace(0.05, 1.0, POINTS_PER_CLASS)
        jitter = noise * torch.randn(POINTS_PER_CLASS, generator=gen)
        theta = c * 2 * math.pi / CLASSES + 3.0 * r + jitter
        xs.append(torch.stack([r * torch.sin(theta), r * torch.cos(theta)], dim=1))
        ys.append(torch.full((POINTS_PER_CLASS,), c))
    return torch.cat(xs), torch.cat(ys)


class ParameterServer:
    """Lives on worker0; trainers reach it through an RRef."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Read each parameter once (clone): the graph saves the snapshot, not the
        # parameter, so a concurrent optimizer step (another trainer's) may update the
        # parameters in place before this trainer's backward; gradients still flow
        # through the clone to the parameter itself. Forwards run concurrently on the
        # server's thread pool, so nothing here may change the module.
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                x = nn.functional.linear(x, layer.weight.clone(), layer.bias.clone())
            else:
                x = layer(x)
        return x

    def parameter_rrefs(self) -> list[ag.RRef[torch.Tensor]]:
        return [ag.RRef(p) for p in self.model.parameters()]

    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return (self.model(x).argmax(dim=1) == y).float().mean().item()


def progress(label: str, step: int, steps: int, loss: float, width: int = 24) -> str:
    done = width * step // steps
    return f"{label} [{'#' * done}{'.' * (width - done)}] {step:4d}/{steps}  loss {loss:.4f}"


async def run_trainer(ps: ag.RRef[ParameterServer], trainer: int, trainers: int, steps: int,
                      lr: float) -> list[float]:
    """Runs on a trainer rank: ``steps`` steps of SGD on the server's parameters."""
    torch.set_num_threads(1)
    x_all, y_all = make_spiral()
    shard = torch.arange(trainer, len(x_all), trainers)  # every trainer its own points
    x_all, y_all = x_all[shard], y_all[shard]
    gen = torch.Generator().manual_seed(100 + trainer)

    param_rrefs = await ps.rpc_async().parameter_rrefs()
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=lr, momentum=0.9)
    label = f"trainer {trainer + 1}/{trainers}"
    tty = sys.stdout.isatty()
    report_every = max(1, steps // 10)
    losses: list[float] = []
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(x_all), (BATCH,), generator=gen)
        x, y = x_all[idx], y_all[idx]
        async with ag.autograd.context() as cid:
            logits = await ps.rpc_async().forward(x)
            loss = nn.functional.cross_entropy(logits, y)
            await ag.autograd.backward(cid, [loss])
            await opt.step(cid)
        losses.append(loss.item())
        if step % report_every == 0 or step == steps:
            recent = sum(losses[-report_every:]) / len(losses[-report_every:])
            line = progress(label, step, steps, recent)
            # Under `actorgrad launch` the output is a pipe: one line per report.
            print("\r" + line if tty else line, end="" if tty and step < steps else "\n", flush=True)
    return losses


async def serve(args: argparse.Namespace) -> bool:
    """worker0: own the model, start the trainers, check the result."""
    world = ag.get_world_size()
    trainers = world - 1
    if trainers < 1:
        raise SystemExit("needs at least 2 ranks: "
                         "actorgrad launch --nproc 2 examples/parameter_server.py")
    ps = ag.RRef(ParameterServer())
    x_all, y_all = make_spiral()
    acc_before = ps.local_value().accuracy(x_all, y_all)
    print(f"parameter server on worker0; {trainers} trainer(s), {args.steps} steps each, "
          f"{len(x_all)} points, accuracy before training {acc_before:.3f}", flush=True)

    t0 = time.perf_counter()
    histories = await asyncio.gather(*(
        ag.rpc_async(f"worker{t + 1}", run_trainer,
                     args=(ps, t, trainers, args.steps, args.lr), timeout=0)  # no time limit
        for t in range(trainers)
    ))
    elapsed = time.perf_counter() - t0

    window = max(1, min(20, args.steps // 5))
    initial = sum(sum(h[:window]) / window for h in histories) / trainers
    final = sum(sum(h[-window:]) / window for h in histories) / trainers
    acc = ps.local_value().accuracy(x_all, y_all)
    total = sum(len(h) for h in histories)
    print(f"{total} steps in {elapsed:.1f}s ({1e3 * elapsed / args.steps:.1f} ms per step per trainer)",
          flush=True)
    print(f"loss {initial:.4f} -> {final:.4f}; final accuracy {acc:.3f}", flush=True)
    ok = final < 0.7 * initial
    if not ok:
        print(f"FAILED: the loss did not fall clearly ({initial:.4f} -> {final:.4f})", flush=True)
    return ok


async def main() -> int:
    parser = argparse.ArgumentParser(description="parameter server + trainers on actorgrad")
    parser.add_argument("--steps", type=int, default=300, help="SGD steps per trainer (default 300)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rank = int(os.environ.get("RANK", "0"))
    await ag.init_rpc(f"worker{rank}")
    ok = True
    try:
        if rank == 0:
            ok = await serve(args)
    finally:
        await ag.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(ag.run(main()))
