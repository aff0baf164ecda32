"""Train a digit classifier with DistributedDataParallel over actorgrad.

    actorgrad launch --nproc 2 examples/ddp_train.py            # 2 or 4 ranks (--global-batch divides by them)
    actorgrad launch --nproc 4 examples/ddp_train.py --steps 300

The data is generated, so nothing is downloaded: 8x8 grey images of the digits 0-9,
drawn from a 5x7 bitmap font, each randomly shifted, thickened, dimmed and noised
(a harder cousin of scikit-learn's 8x8 digits). Every rank generates the same data
set from the same seed and trains on its own shard (every ``world_size``-th example);
the global batch is split evenly, and DDP averages the gradients, so the run computes
the same updates as one process on the whole batch. Rank 0 prints the progress and,
at the end, the accuracy on a held-out test set that the ranks evaluate together.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import actorgrad as ag
import actorgrad.collective as C
from actorgrad.parallel import DistributedDataParallel

FONT = {  # 5x7 bitmaps, one string per row
    0: ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    1: ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    2: ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    3: ["11110", "00001", "00001", "01110", "00001", "00001", "11110"],
    4: ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    5: ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    6: ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    7: ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    8: ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    9: ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
}


def make_digits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy 8x8 digit images (flattened to 64 features) and their labels."""
    g = torch.Generator().manual_seed(seed)
    glyphs = torch.tensor([[[float(c) for c in row] for row in FONT[d]] for d in range(10)])
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.zeros(n, 8, 8)
    dx = torch.randint(0, 4, (n,), generator=g)  # the glyph is 5 wide, 7 high: room to move
    dy = torch.randint(0, 2, (n,), generator=g)
    bold = torch.rand(n, generator=g) < 0.3
    for i in range(n):
        glyph = glyphs[labels[i]]
        if bold[i]:  # thicken strokes to the right
            glyph = torch.clamp(glyph + torch.nn.functional.pad(glyph[:, :-1], (1, 0)), max=1)
        images[i, dy[i] : dy[i] + 7, dx[i] : dx[i] + 5] = glyph
    intensity = 0.5 + 0.5 * torch.rand(n, 1, 1, generator=g)
    images = images * intensity + 0.25 * torch.randn(n, 8, 8, generator=g)
    flip = torch.rand(n, 8, 8, generator=g) < 0.02  # salt and pepper
    images = torch.where(flip, 1 - images, images)
    return images.reshape(n, 64), labels


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(),
        nn.Linear(256, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )


def progress(step: int, total: int, loss: float, acc: float, width: int = 30) -> str:
    done = int(width * step / total)
    return f"\r[{'#' * done}{'.' * (width - done)}] step {step:4d}/{total}  loss {loss:.3f}  batch acc {acc:5.1%}"


async def main(args: argparse.Namespace) -> float:
    await ag.init_rpc(_name())
    rank, world = ag.get_rank(), ag.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by {world} ranks")
    torch.manual_seed(args.seed + rank)  # replicas start different: DDP copies rank 0's
    x_train, y_train = make_digits(args.train_size, seed=args.seed)
    x_test, y_test = make_digits(args.test_size, seed=args.seed + 1)
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    shard_x, shard_y = x_train[rank::world], y_train[rank::world]  # this rank's shard

    model = await DistributedDataParallel.create(make_model(), bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    local_batch = args.global_batch // world
    g = torch.Generator().manual_seed(args.seed + 100 + rank)
    if rank == 0:
        print(f"training on {world} rank(s): {len(x_train)} examples, shard of {len(shard_x)} per "
              f"rank, global batch {args.global_batch}, {len(model.bucket_sizes)} gradient bucket(s)")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(shard_x), (local_batch,), generator=g)
        xb, yb = shard_x[idx], shard_y[idx]
        optimizer.zero_grad()
        logits = model(xb)
        loss = nn.functional.cross_entropy(logits, yb)
        await model.backward(loss)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            stats = torch.tensor([loss.item(), (logits.argmax(1) == yb).float().mean().item()])
            await C.all_reduce(stats, op=C.ReduceOp.AVG)
            if rank == 0:
                print(progress(step, args.steps, stats[0].item(), stats[1].item()),
                      end="" if sys.stdout.isatty() else "\n", flush=True)
    elapsed = time.perf_counter() - start

    model.eval()  # every rank scores its share of the test set; the counts are summed
    with torch.no_grad():
        mine = slice(rank, None, world)
        correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum()
    counts = torch.tensor([float(correct), float(len(y_test[mine]))])
    await C.all_reduce(counts)
    accuracy = counts[0].item() / counts[1].item()
    if rank == 0:
        print(("\n" if sys.stdout.isatty() else "") + f"done in {elapsed:.1f}s ({1e3 * elapsed / args.steps:.1f} ms/step); "
              f"test accuracy {accuracy:.1%} on {int(counts[1].item())} held-out images")
    await ag.shutdown()
    return accuracy


def _name() -> str:
    import os

    return f"worker{os.environ.get('RANK', '0')}"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--train-size", type=int, default=8000)
    p.add_argument("--test-size", type=int, default=2000)
    p.add_argument("--bucket-cap-mb", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit non-zero when the test accuracy ends below this")
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    torch.set_num_threads(1)
    acc = ag.run(main(arguments))
    if acc < arguments.min_accuracy:
        raise SystemExit(f"test accuracy {acc:.1%} is below --min-accuracy {arguments.min_accuracy:.1%}")
