"""Soak: mix RPC, distributed backward, optimizer steps (and collectives, when built)
on a local group of three for a while; report throughput, errors, RSS and live
contexts. Also: N sequential contexts with backward, RSS and live contexts per 1000.

    python scripts/soak.py --seconds 120
    python scripts/soak.py --contexts 10000 --seconds 0
Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter

import torch

import actorgrad as ag
from actorgrad.testing import local_group


def rss_mib(pid: int | None = None) -> float:
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_weight() -> torch.Tensor:
    return torch.randn(32, 32).requires_grad_()


def layer(w: ag.RRef, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w.local_value())


async def sequential_contexts(n: int) -> None:
    w = torch.rand(256, requires_grad=True)
    print(f"{'contexts':>9} {'RSS w0 MiB':>11} {'live ctx w0':>12} {'live ctx w1':>12}")
    start = time.perf_counter()
    for i in range(1, n + 1):
        async with ag.autograd.context() as cid:
            y = await ag.rpc_async("worker1", torch.mul, args=(w, 2.0))
            await ag.autograd.backward(cid, [y.sum()])
        if i % 1000 == 0 or i == n:
            remote = await ag.rpc_async("worker1", ag.autograd.debug_info)
            print(f"{i:>9} {rss_mib():>11.1f} {ag.autograd.debug_info()['num_autograd_contexts']:>12} "
                  f"{remote['num_autograd_contexts']:>12}")
    print(f"{n / (time.perf_counter() - start):.0f} contexts/s")


async def mixed(seconds: float) -> None:
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    w1, w2 = ag.remote("worker1", make_weight), ag.remote("worker2", make_weight)
    optimizer = ag.optim.DistributedOptimizer(torch.optim.SGD, [w1, w2], lr=1e-3)
    try:
        from actorgrad import collective  # type: ignore[attr-defined]
    except ImportError:
        collective = None
    deadline = time.monotonic() + seconds

    async def rpc_loop() -> None:
        while time.monotonic() < deadline:
            await asyncio.gather(*(ag.rpc_async(f"worker{1 + i % 2}", torch.add, args=(torch.ones(8), i))
                                   for i in range(64)))
            counts["rpc"] += 64

    async def train_loop() -> None:
        x = torch.randn(16, 32)
        while time.monotonic() < deadline:
            async with ag.autograd.context() as cid:
                h = await ag.rpc_async("worker1", layer, args=(w1, x))
                y = await ag.rpc_async("worker2", layer, args=(w2, h))
                await ag.autograd.backward(cid, [y.square().mean()])
                await optimizer.step(cid)
            counts["train step"] += 1

    async def guarded(name: str, loop: object) -> None:
        while time.monotonic() < deadline:
            try:
                await loop()  # type: ignore[operator]
            except Exception as exc:  # noqa: BLE001 - the soak reports every error
                errors[f"{name}: {type(exc).__name__}: {exc}"[:160]] += 1

    loops = [guarded("rpc", rpc_loop), guarded("train", train_loop)]
    if collective is not None and hasattr(collective, "all_reduce"):
        async def collective_loop() -> None:
            while time.monotonic() < deadline:
                t = torch.ones(1024)
                await asyncio.gather(collective.all_reduce(t), *(
                    ag.rpc_async(f"worker{r}", _remote_all_reduce) for r in (1, 2)))
                counts["all_reduce"] += 1
        loops.append(guarded("collective", collective_loop))
    start = time.perf_counter()
    rss0 = rss_mib()
    await asyncio.gather(*loops)
    elapsed = time.perf_counter() - start
    for name, n in counts.items():
        print(f"{name:>12}: {n:>8} ({n / elapsed:.0f}/s)")
    print(f"RSS worker0: {rss0:.0f} -> {rss_mib():.0f} MiB; live contexts: "
          f"{ag.autograd.debug_info()['num_autograd_contexts']}")
    if errors:
        print("ERRORS:")
        for text, n in errors.most_common():
            print(f"  {n} x {text}")
    else:
        print("errors: none")


async def _remote_all_reduce() -> None:
    from actorgrad import collective  # type: ignore[attr-defined]

    await collective.all_reduce(torch.ones(1024))


async def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    group = await local_group(3)
    try:
        if args.contexts:
            await sequential_contexts(args.contexts)
        if args.seconds:
            await mixed(args.seconds)
    finally:
        await group.shutdown()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--contexts", type=int, default=0)
    sys.exit(ag.run(main(parser.parse_args())))
