"""The shared-memory arena of tiny all-reduces: the memory layout on its own, then the
negotiation, the results (against values computed locally), failures and wake-ups."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import warnings
from typing import Any

import cloudpickle
import pytest
import torch
from collective_helpers import expected, run_all, run_all_settled

import actorgrad as ag
import actorgrad.collective as C
from actorgrad import CollectiveError
from actorgrad.collective import ReduceOp, _arena
from actorgrad.collective._actor import actor
from actorgrad.collective._api import start_all_reduce
from actorgrad.collective._arena import SLOTS, Arena
from actorgrad.testing import InProcessGroup

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # functions run on subprocess workers
pytestmark = pytest.mark.skipif(not _arena.supported(), reason="no shared-memory arena on this machine")

WARM_UP = 2  # the tiny all-reduces that negotiate the arena


# -- the memory layout ------------------------------------------------------------------
def test_arena_layout_write_read_and_reuse() -> None:
    creator, path, token = Arena.create(3, 0)
    others = [Arena.attach(path, token, 3, me) for me in (1, 2)]
    assert all(a is not None for a in others)
    arenas = [creator, *others]  # type: ignore[list-item]
    assert Arena.attach(path, b"x" * len(token), 3, 1) is None  # not that arena
    assert Arena.attach(path, token, 4, 1) is None  # another size: another group
    assert Arena.attach("/proc/self/fd/999999", token, 3, 1) is None
    sig = b"the signature"
    for i in range(2 * SLOTS + 1):
        for me, a in enumerate(arenas):
            assert a.can_write(i)
            assert not a.ready(i) if me == 0 else True
            a.write(i, sig, torch.tensor([float(me + i)]))
        assert all(a.ready(i) and a.same_sigs(i, sig) for a in arenas)
        for a in arenas:
            views = a.views(i, torch.tensor([0.0]).numpy().dtype, 1)
            assert [float(v[0]) for v in views] == [float(r + i) for r in range(3)]
        # nobody read operation i yet: its slot is taken for operation i + SLOTS
        assert not creator.can_write(i + SLOTS)
        for a in arenas:
            a.mark_done(i)
        assert creator.can_write(i + SLOTS)
    arenas[2].write(2 * SLOTS + 1, b"another", torch.tensor([0.0]))
    assert arenas[0].missing(2 * SLOTS + 1) == [0, 1]
    assert not arenas[2].same_sig(0, 2 * SLOTS, b"another")
    assert arenas[2].sig(1, 2 * SLOTS) == sig
    arenas[1].set_sleeping(True)
    assert arenas[0].sleepers() == [1] and arenas[1].sleepers() == []
    for a in arenas:
        a.close()


# -- on a group of workers --------------------------------------------------------------
async def _warm_up(group: InProcessGroup, g: Any = None) -> None:
    async def body(rank: int) -> None:
        for _ in range(WARM_UP):
            await C.all_reduce(torch.ones(1), group=g)

    await run_all(group, body)


def _value(rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 4).to(dtype)
    return torch.randint(-50, 50, shape, generator=gen).to(dtype)


async def test_arena_takes_over_and_matches_local_values(make_group: Any) -> None:
    group: InProcessGroup = await make_group(4)
    await _warm_up(group)
    assert all(actor(w).arenas.active(0) for w in group.workers)
    bitwise = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    cases = [(dtype, op) for dtype in (torch.float32, torch.float64, torch.float16)
             for op in ReduceOp if op not in bitwise]
    cases += [(torch.int64, op) for op in ReduceOp if op is not ReduceOp.AVG]
    cases += [(torch.bool, ReduceOp.MAX), (torch.bool, ReduceOp.MIN), (torch.int8, ReduceOp.SUM)]
    cases += [(torch.bool, op) for op in bitwise] + [(torch.uint8, ReduceOp.BXOR)]

    async def body(rank: int) -> list[torch.Tensor]:
        out = []
        for dtype, op in cases:
            t = _value(rank, dtype, (3, 5))
            await C.all_reduce(t, op=op)
            out.append(t)
        # a non-contiguous tensor is staged and written back; the rest is untouched
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank
        view = base[:, 1]
        await C.all_reduce(view)
        out.append(base)
        return out

    results = await run_all(group, body)
    for k, (dtype, op) in enumerate(cases):
        want = expected(op, [_value(r, dtype, (3, 5)) for r in range(4)])
        for r in range(4):
            assert results[r][k].dtype == dtype
            assert torch.equal(results[r][k], results[0][k]), (dtype, op)  # bitwise identical
            torch.testing.assert_close(results[r][k], want, msg=f"{dtype} {op}")
    bases = [torch.arange(12, dtype=torch.float32).reshape(3, 4) + r for r in range(4)]
    for r in range(4):
        want = bases[r].clone()
        want[:, 1] = sum(b[:, 1] for b in bases)
        assert torch.equal(results[r][-1], want)


async def test_overflow_in_the_arena_gives_inf_without_numpy_warnings(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)
    await _warm_up(group)
    assert all(actor(w).arenas.active(0) for w in group.workers)

    async def body(rank: int) -> list[torch.Tensor]:
        product = torch.full((4,), 300.0, dtype=torch.float16)
        await C.all_reduce(product, op=ReduceOp.PRODUCT)  # 90000 overflows float16
        total = torch.tensor([3e38, 0.0]) * (rank + 1)
        await C.all_reduce(total)
        return [product, total]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as torch (and gloo): no warning for inf or nan
        results = await run_all(group, body)
    local_product = torch.full((4,), 300.0, dtype=torch.float16) * 300.0
    local_total = torch.tensor([3e38, 0.0]) + torch.tensor([3e38, 0.0]) * 2
    for product, total in results:
        assert torch.equal(product, local_product) and torch.isinf(product).all()
        assert torch.equal(total, local_total) and torch.isinf(total[0])


async def test_more_operations_in_flight_than_slots_and_two_groups(make_group: Any) -> None:
    group: InProcessGroup = await make_group(4)

    async def body(rank: int) -> tuple[list[float], list[float], bool]:
        pair = C.new_group([0, 1]) if rank < 2 else C.new_group([2, 3])
        C.new_group([2, 3]) if rank < 2 else C.new_group([0, 1])  # every worker creates both
        world_ts = [torch.tensor([float(rank * 10 + k)]) for k in range(3 * SLOTS)]
        pair_ts = [torch.tensor([float(rank + k)]) for k in range(3 * SLOTS)]
        # launched before any of them is awaited: the negotiation's answers are not
        # known when the later ones start, so they wait for them
        works = []
        for w, p in zip(world_ts, pair_ts, strict=True):
            works.append(await C.all_reduce(w, async_op=True))
            works.append(await C.all_reduce(p, group=pair, async_op=True))
        for work in works:
            await work.wait()  # type: ignore[union-attr]
        return [t.item() for t in world_ts], [t.item() for t in pair_ts], actor().arenas.active(pair.id)

    results = await run_all(group, body)
    for rank, (world_vals, pair_vals, pair_active) in enumerate(results):
        assert world_vals == [float(sum(r * 10 + k for r in range(4))) for k in range(3 * SLOTS)]
        mates = (0, 1) if rank < 2 else (2, 3)
        assert pair_vals == [float(sum(r + k for r in mates)) for k in range(3 * SLOTS)]
        assert pair_active
    assert all(actor(w).arenas.active(0) for w in group.workers)


async def test_an_operation_started_as_the_negotiation_ends_waits_behind_older_ones(make_group: Any) -> None:
    # Operations started during the negotiation wait for its answer; an operation
    # started right when the answer comes (here: from a callback that runs first, as
    # DDP's last all-reduce can) must not overtake them: one that did took the arena
    # slot of an older one (seq % SLOTS) and both ranks waited for each other forever.
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> list[float]:
        ts = [torch.tensor([float(rank + 10 * k)]) for k in range(SLOTS + 3)]
        futures = [start_all_reduce(ts[0]), start_all_reduce(ts[1])]  # the negotiation
        state = actor().arenas._groups[0]
        last: list[asyncio.Future[Any]] = []
        if rank == 1:  # only here: the ranks' queues then differ
            state.decided.add_done_callback(lambda _: last.append(start_all_reduce(ts[-1])))
        futures += [start_all_reduce(t) for t in ts[2:-1]]  # deferred until it ends
        await asyncio.wait_for(asyncio.gather(*futures), 10)
        if rank == 0:
            last.append(start_all_reduce(ts[-1]))
        await asyncio.wait_for(last[0], 10)
        return [t.item() for t in ts]

    for values in await run_all(group, body):
        assert values == [float(1 + 20 * k) for k in range(SLOTS + 3)]


@pytest.mark.parametrize("which", [0, 1])
async def test_a_rank_that_stops_waiting_during_the_negotiation_decides_alike(make_group: Any, which: int) -> None:
    """Rank 0 gives up waiting (a timeout) on one of the two negotiating all-reduces;
    the operation goes on, and rank 0 must come to the same arena decision as the
    others (it took the cancelled wait for a failure: the group's small all-reduces
    went over the connections on rank 0 and into the arena elsewhere, for good)."""
    group: InProcessGroup = await make_group(3)

    async def body(rank: int) -> list[float]:
        for k in range(WARM_UP):
            t = torch.tensor([float(rank)])
            if k == which and rank == 0:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(C.all_reduce(t), 0.1)
            else:
                if k == which:
                    await asyncio.sleep(0.4)
                await C.all_reduce(t)
        await asyncio.sleep(0.2)
        out = []
        for k in range(3):
            t = torch.tensor([float(rank + k)])
            await asyncio.wait_for(C.all_reduce(t), 5)
            out.append(t.item())
        return out

    assert await run_all(group, body) == [[3.0, 6.0, 9.0]] * 3
    assert len({actor(w).arenas.active(0) for w in group.workers}) == 1


@pytest.mark.parametrize("which", [0, 1])
async def test_an_all_reduce_refused_during_the_negotiation_fails_the_others_at_once(make_group: Any,
                                                                                      which: int) -> None:
    """A bad argument on one rank in one of a group's first two small all-reduces: the
    others' call failed only at its timeout, and the group's calls were paired off by
    one from then on (silently wrong sums). Now they fail at once, and every member
    goes on alike (without the arena)."""
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[str, list[float]]:
        for _ in range(which):
            await C.all_reduce(torch.ones(1))
        start = time.monotonic()
        try:
            await C.all_reduce(None if rank == 0 else torch.ones(4))  # type: ignore[arg-type]
            failure = "none"
        except (TypeError, CollectiveError) as exc:
            failure = type(exc).__name__
        assert time.monotonic() - start < 2
        out = []
        for k in range(3):
            t = torch.tensor([float(rank + k)])
            await asyncio.wait_for(C.all_reduce(t), 5)
            out.append(t.item())
        return failure, out

    results = await run_all(group, body)
    assert results == [("TypeError", [1.0, 3.0, 5.0]), ("CollectiveError", [1.0, 3.0, 5.0])]


async def test_a_member_without_the_arena_keeps_everyone_on_the_connections(make_group: Any) -> None:
    group: InProcessGroup = await make_group(3)
    actor(group.workers[1]).arenas.enabled = False

    async def body(rank: int) -> list[float]:
        out = []
        for k in range(WARM_UP + 3):
            t = torch.tensor([float(rank + k)])
            await C.all_reduce(t)
            out.append(t.item())
        return out

    results = await run_all(group, body)
    assert results == [[float(3 * k + 3) for k in range(WARM_UP + 3)]] * 3
    assert not any(actor(w).arenas.active(0) for w in group.workers)


@pytest.mark.parametrize("kind", ["shape", "op", "large"])
async def test_mismatch_in_the_arena_raises_on_every_rank(make_group: Any, kind: str) -> None:
    group: InProcessGroup = await make_group(4)
    await _warm_up(group)

    async def body(rank: int) -> None:
        odd = rank == 2
        if kind == "shape" and odd:
            await C.all_reduce(torch.ones(3))
        elif kind == "op" and odd:
            await C.all_reduce(torch.ones(2), op=ReduceOp.MAX)
        elif kind == "large" and odd:
            await C.all_reduce(torch.ones(200_000))
        else:
            await C.all_reduce(torch.ones(2))

    start = time.monotonic()
    results = await run_all_settled(group, body, timeout=20)
    assert time.monotonic() - start < 10
    for r in results:
        assert isinstance(r, CollectiveError), r
        assert "rank 2" in str(r) or "shape=(200000,)" in str(r), r

    async def again(rank: int) -> float:  # the group goes on working
        t = torch.tensor([float(rank)])
        await C.all_reduce(t)
        return t.item()

    assert await run_all(group, again) == [6.0] * 4


async def test_a_late_member_wakes_the_sleepers(make_group: Any) -> None:
    group: InProcessGroup = await make_group(3)
    await _warm_up(group)

    async def body(rank: int) -> list[float]:
        out = []
        for k in range(3):
            if rank == 2:
                await asyncio.sleep(0.03)  # far beyond the others' polling: they sleep
            t = torch.tensor([float(rank * k)])
            await C.all_reduce(t)
            out.append(t.item())
        return out

    assert await run_all(group, body) == [[0.0, 3.0, 6.0]] * 3


# -- a member that dies ------------------------------------------------------------------
async def _install() -> None:
    actor()


async def _tiny_all_reduces(count: int, delay: float) -> str:
    """On a subprocess worker: ``count`` tiny all-reduces, the last after ``delay``."""
    try:
        for k in range(count):
            if k == count - 1:
                await asyncio.sleep(delay)
            await C.all_reduce(torch.ones(2))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"ok {actor().arenas.active(0)}"


@pytest.mark.slow
async def test_a_dead_member_fails_the_others_waiting_in_the_arena(make_process_group: Any) -> None:
    group = await make_process_group(3)
    await asyncio.gather(*(ag.rpc_async(f"worker{r}", _install) for r in (1, 2)))
    warm = [ag.rpc_async(f"worker{r}", _tiny_all_reduces, args=(WARM_UP + 1, 0.0)) for r in (1, 2)]
    for _ in range(WARM_UP + 1):
        await C.all_reduce(torch.ones(2))
    assert await asyncio.gather(*warm) == ["ok True"] * 2
    survivor = ag.rpc_async("worker1", _tiny_all_reduces, args=(1, 0.0))
    late = ag.rpc_async("worker2", _tiny_all_reduces, args=(1, 30.0))
    mine = asyncio.ensure_future(C.all_reduce(torch.ones(2)))
    await asyncio.sleep(0.3)
    start = time.monotonic()
    group.kill(2)
    with pytest.raises(CollectiveError, match="rank 2"):
        await asyncio.wait_for(mine, 10)
    other = await asyncio.wait_for(survivor, 10)
    assert time.monotonic() - start < 10
    assert "rank 2" in other and other.startswith(("CollectiveError", "CollectiveRankLost")), other
    with pytest.raises(ag.ActorgradError):
        await late


async def test_destroyed_groups_free_their_arenas_and_state(make_group: Any) -> None:
    """A job that makes a group per step and destroys it (torch's
    destroy_process_group(group)) holds no more files or state after many of them;
    the group cannot be used any more, and a recv waiting on it fails."""
    group: InProcessGroup = await make_group(4)

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def warm(rank: int) -> None:
        for _ in range(3):  # files opened once for good (the first arena's) come first
            g = C.new_group([0, 1, 2, 3])
            for _ in range(WARM_UP):
                await C.all_reduce(torch.ones(1), group=g)
            C.destroy_process_group(g)

    await run_all(group, warm)
    before = open_files()

    async def many(rank: int) -> int:
        for _ in range(20):
            g = C.new_group([0, 1, 2, 3])
            t = torch.ones(1)
            for _ in range(WARM_UP):
                await C.all_reduce(t, group=g)
            assert actor().arenas.active(g.id)  # it went through an arena
            C.destroy_process_group(g)
            with pytest.raises(ValueError, match="destroyed"):
                await C.all_reduce(t, group=g)
        return len(actor().groups)

    assert await run_all(group, many) == [1, 1, 1, 1]  # only the group of all workers is left
    assert open_files() <= before + 2  # 80 arenas were made: none is held

    async def waiting(rank: int) -> str:
        g = C.new_group([0, 1])
        if rank != 0:
            return ""
        pending = asyncio.ensure_future(C.recv(torch.empty(1), src=1, group=g))
        await asyncio.sleep(0.05)
        C.destroy_process_group(g)
        with pytest.raises(CollectiveError, match="destroyed"):
            await pending
        return "failed as expected"

    assert (await run_all(group, waiting))[0] == "failed as expected"


async def test_a_member_waiting_long_in_the_arena_backs_off(make_group: Any) -> None:
    """A member waiting in a tiny all-reduce while another takes its time (evaluating,
    checkpointing) sleeps: its timer only covers a lost nudge, so it backs off instead
    of waking the process a thousand times a second for as long as the wait lasts."""
    group: InProcessGroup = await make_group(2)
    await _warm_up(group)
    channel = actor(group.workers[1]).arenas
    wakeups = 0  # by the sleeping timer (spinning first is another matter)
    poll = channel._poll

    def counted() -> None:
        nonlocal wakeups
        wakeups += channel._timer
        poll()

    channel._poll = counted  # type: ignore[method-assign]

    async def body(rank: int) -> torch.Tensor:
        t = torch.tensor([float(rank + 1)])
        if rank == 0:
            await asyncio.sleep(1.0)
        await C.all_reduce(t)
        return t

    results = await run_all(group, body)
    assert all(r.item() == 3.0 for r in results)
    assert wakeups < 60, wakeups  # (a thousand a second before)
