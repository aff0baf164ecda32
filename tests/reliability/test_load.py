"""Load: many sequential contexts leave nothing behind; thousands of calls in flight
all complete."""

from __future__ import annotations

import asyncio
import gc
import resource

import pytest
import torch

import actorgrad as ag


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def scale(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


async def contexts_with_backward(n: int, w: torch.Tensor) -> None:
    for _ in range(n):
        async with ag.autograd.context() as cid:
            y = await ag.rpc_async("worker1", scale, args=(w, 2.0))
            await ag.autograd.backward(cid, [y.sum()])
            assert torch.equal(ag.autograd.get_gradients(cid)[w], torch.full_like(w, 2.0))


async def all_released(ranks: range) -> bool:
    for _ in range(100):
        infos = [await ag.rpc_async(f"worker{r}", ag.autograd.debug_info) for r in ranks]
        if all(i["num_autograd_contexts"] == 0 and i["num_current_backward_passes"] == 0 for i in infos):
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.mark.slow
async def test_sequential_contexts_leave_nothing_behind(group2) -> None:  # type: ignore[no-untyped-def]
    w = torch.rand(64, requires_grad=True)
    await contexts_with_backward(300, w)  # warm up allocators and caches
    gc.collect()
    assert await all_released(range(2))
    before = rss_mib()
    await contexts_with_backward(2000, w)
    gc.collect()
    assert await all_released(range(2))
    grown = rss_mib() - before
    # both workers live in this process: 2000 contexts may not leave more than a few MiB
    assert grown < 20, f"RSS grew by {grown:.1f} MiB over 2000 contexts"
    assert ag.rref_debug_info()["num_owner_rrefs"] == 0


@pytest.mark.slow
async def test_5000_calls_in_flight_across_four_workers(make_group) -> None:  # type: ignore[no-untyped-def]
    group = await make_group(4)
    xs = [torch.full((4,), float(i)) for i in range(5000)]

    async def burst(rank: int) -> list[torch.Tensor]:
        calls = [ag.rpc_async(f"worker{(rank + 1 + i % 3) % 4}", torch.add, args=(x, rank))
                 for i, x in enumerate(xs[rank::4])]
        return list(await asyncio.gather(*calls))

    results = await asyncio.gather(*(group.run_as(r, burst, r) for r in range(4)))
    for rank, got in enumerate(results):
        want = [x + rank for x in xs[rank::4]]
        assert len(got) == len(want) == 1250
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
