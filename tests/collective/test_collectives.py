"""Every collective on 4 workers, against values computed locally; both backends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from collective_helpers import expected, run_all, tune
from torch.testing import assert_close

import actorgrad.collective as C
from actorgrad.collective import ReduceOp
from actorgrad.collective._actor import actor
from actorgrad.runtime import _cma
from actorgrad.testing import InProcessGroup

N = 4


def inp(rank: int, shape: tuple[int, ...] = (3, 5), dtype: torch.dtype = torch.float32,
        op: ReduceOp | None = None) -> torch.Tensor:
    """The input of ``rank``: seeded by the rank, so every test can recompute it."""
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        if op is ReduceOp.PRODUCT:
            t = 1 + 0.1 * t
        return t.to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


@pytest.mark.parametrize("op", list(ReduceOp))
async def test_all_reduce_every_op(world4: InProcessGroup, op: ReduceOp) -> None:
    dtype = torch.int32 if op in BITWISE else torch.float32  # bitwise: integers only

    async def body(rank: int) -> torch.Tensor:
        t = inp(rank, dtype=dtype, op=op)
        assert await C.all_reduce(t, op=op) is None
        return t

    results = await run_all(world4, body)
    want = expected(op, [inp(r, dtype=dtype, op=op) for r in range(N)])
    for got in results:
        assert_close(got, want)
    for got in results[1:]:  # every rank holds the same bits
        assert torch.equal(got, results[0])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64, torch.bfloat16])
async def test_all_reduce_dtypes(world4: InProcessGroup, dtype: torch.dtype) -> None:
    async def body(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, m = inp(rank, (7,), dtype), inp(rank, (7,), dtype)
        await C.all_reduce(s)
        await C.all_reduce(m, op=ReduceOp.MAX)
        return s, m

    results = await run_all(world4, body)
    ins = [inp(r, (7,), dtype) for r in range(N)]
    for s, m in results:
        assert_close(s, expected(ReduceOp.SUM, ins), rtol=1e-2 if dtype == torch.bfloat16 else None,
                     atol=1e-1 if dtype == torch.bfloat16 else None)
        assert_close(m, expected(ReduceOp.MAX, ins))


async def test_all_reduce_non_contiguous_and_scalar(world4: InProcessGroup) -> None:
    async def body(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        base = inp(rank, (4, 6))
        view = base.t()  # non-contiguous: written back in place
        await C.all_reduce(view)
        scalar = torch.tensor(float(rank))
        await C.all_reduce(scalar)
        return base, scalar

    results = await run_all(world4, body)
    want = expected(ReduceOp.SUM, [inp(r, (4, 6)) for r in range(N)])
    for base, scalar in results:
        assert_close(base, want)
        assert scalar.item() == 6.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
async def test_one_element_views_with_odd_strides(world4: InProcessGroup, dtype: torch.dtype) -> None:
    # x[1::2] of a 3-long x: one element, stride 2; torch calls it contiguous. Only that
    # element may change, on every path (bfloat16 has no numpy type: byte views).
    def view(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        base = torch.full((3,), -7.0, dtype=dtype)
        v = base[1::2]
        v.fill_(rank + 10 * k)
        return base, v

    async def body(rank: int) -> list[torch.Tensor]:
        bases = []
        base, v = view(rank, 1)
        await C.all_reduce(v)
        bases.append(base)
        base, v = view(rank, 2)
        await C.broadcast(v, src=3)
        bases.append(base)
        base, v = view(rank, 3)
        await C.reduce(v, dst=2)
        bases.append(base)
        base, v = view(rank, 4)
        if rank == 0:
            await C.send(v, dst=1)
        elif rank == 1:
            await C.recv(v, src=0)
        bases.append(base)
        return bases

    results = await run_all(world4, body)
    for rank, bases in enumerate(results):
        middle = [b[1].item() for b in bases]
        assert middle[0] == sum(r + 10 for r in range(N))
        assert middle[1] == 3 + 20
        assert middle[2] == (sum(r + 30 for r in range(N)) if rank == 2 else rank + 30)
        assert middle[3] == (0 + 40 if rank in (0, 1) else rank + 40)
        for b in bases:
            assert b[0].item() == b[2].item() == -7.0  # nothing written outside the view


async def test_zero_element_all_reduce_first_and_later(world4: InProcessGroup) -> None:
    """A no-op, as in torch: first on the group (before the shared-memory arena is
    negotiated: the plain message path) and again later, then a real one."""

    async def body(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        empty = torch.empty(0)
        await C.all_reduce(empty)
        rows = torch.zeros(3, 0)
        await C.all_reduce(rows, op=ReduceOp.MAX)
        for _ in range(3):
            await C.all_reduce(torch.empty(0))
        t = inp(rank)
        await C.all_reduce(t)
        return empty, rows, t

    want = expected(ReduceOp.SUM, [inp(r) for r in range(N)])
    for empty, rows, t in await run_all(world4, body):
        assert empty.shape == (0,) and rows.shape == (3, 0)
        assert_close(t, want)


@pytest.mark.parametrize("src", [0, 3])
async def test_broadcast(world4: InProcessGroup, src: int) -> None:
    async def body(rank: int) -> torch.Tensor:
        t = inp(rank, (2, 3, 4))
        await C.broadcast(t, src)
        return t

    for got in await run_all(world4, body):
        assert torch.equal(got, inp(src, (2, 3, 4)))


async def test_reduce_leaves_other_ranks_alone(world4: InProcessGroup) -> None:
    async def body(rank: int) -> torch.Tensor:
        t = inp(rank)
        await C.reduce(t, dst=2, op=ReduceOp.MAX)
        return t

    results = await run_all(world4, body)
    assert_close(results[2], expected(ReduceOp.MAX, [inp(r) for r in range(N)]))
    for r in (0, 1, 3):
        assert torch.equal(results[r], inp(r))


async def test_scatter_gather_all_gather(world4: InProcessGroup) -> None:
    async def body(rank: int) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[torch.Tensor]]:
        out = torch.zeros(3, 5)
        parts = [inp(10 + i) for i in range(N)] if rank == 1 else None
        await C.scatter(out, parts, src=1)
        gathered = [torch.zeros(3, 5) for _ in range(N)] if rank == 3 else None
        await C.gather(inp(rank), gathered, dst=3)
        everyone = [torch.zeros(3, 5) for _ in range(N)]
        await C.all_gather(everyone, inp(rank))
        return out, gathered, everyone

    results = await run_all(world4, body)
    for rank, (out, gathered, everyone) in enumerate(results):
        assert torch.equal(out, inp(10 + rank))
        assert (gathered is None) == (rank != 3)
        for i in range(N):
            assert torch.equal(everyone[i], inp(i))
            if gathered is not None:
                assert torch.equal(gathered[i], inp(i))


@pytest.mark.parametrize("numel", [5, 20_000, 300_001])  # in the header, through CMA, over the ring's size
async def test_an_input_that_is_another_ranks_output_entry(make_group: object, numel: int, backend: str) -> None:
    # (all_gather wrote a peer's data into the input while it was still being sent,
    # through CMA too: every rank got wrong values; a scatter root whose own output was
    # another rank's part sent it the root's part)
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]

    async def init(rank: int) -> None:
        await C.init_process_group(backend=backend)

    await run_all(group, init)
    ins = [inp(r, (numel,)) for r in range(3)]
    parts = [inp(10 + r, (numel,)) for r in range(3)]

    async def body(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, torch.Tensor]:
        mine = ins[rank].clone()
        everyone = [torch.zeros(numel) for _ in range(3)]
        everyone[(rank + 1) % 3] = mine  # a peer's slot is the input itself
        await C.all_gather(everyone, mine)
        gathered = None
        if rank == 2:
            mine = ins[rank].clone()
            gathered = [mine, torch.zeros(numel), torch.zeros(numel)]  # rank 0's slot
        await C.gather(ins[rank].clone() if rank != 2 else mine, gathered, dst=2)
        if rank == 2:
            own = [p.clone() for p in parts]
            await C.scatter(own[0], own, src=2)  # its output is rank 0's part
            got = own[0]
        else:
            got = torch.zeros(numel)
            await C.scatter(got, None, src=2)
        return everyone, gathered, got

    results = await run_all(group, body, timeout=60)
    for rank, (everyone, gathered, got) in enumerate(results):
        for i in range(3):
            assert torch.equal(everyone[i], ins[i]), (rank, i)
        if gathered is not None:
            for i in range(3):
                assert torch.equal(gathered[i], ins[i]), i
        assert torch.equal(got, parts[rank]), rank


async def test_broadcast_from_a_tensor_that_cannot_be_written(world4: InProcessGroup) -> None:
    # (the source wrote its own tensor back through the expand() and raised, while the
    # others had the value)
    async def body(rank: int) -> torch.Tensor:
        t = torch.tensor([5.0]).expand(4) if rank == 1 else torch.zeros(4)
        await C.broadcast(t, src=1)
        return t

    for got in await run_all(world4, body):
        assert torch.equal(got, torch.full((4,), 5.0))


async def test_complex_tensors(world4: InProcessGroup, backend: str) -> None:
    # (the gloo backend handed complex tensors to gloo, which has no complex type:
    # all_gather, gather, scatter, broadcast, send and recv failed; torch views them as
    # real; a complex PRODUCT failed with a garbled message)
    def cin(rank: int) -> torch.Tensor:
        return torch.complex(inp(rank, (3,)), inp(rank + 20, (3,)))

    async def body(rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        s = cin(rank)
        await C.all_reduce(s)
        out["sum"] = s
        everyone = [torch.zeros(3, dtype=torch.complex64) for _ in range(N)]
        await C.all_gather(everyone, cin(rank))
        out["all_gather"] = everyone
        got = torch.zeros(3, dtype=torch.complex64)
        await C.scatter(got, [cin(10 + i) for i in range(N)] if rank == 0 else None, src=0)
        out["scatter"] = got
        b = cin(rank)
        await C.broadcast(b, src=2)
        out["broadcast"] = b
        if rank == 0:
            await C.send(cin(30), dst=1)
        elif rank == 1:
            r = torch.zeros(3, dtype=torch.complex64)
            await C.recv(r, src=0)
            out["recv"] = r
        p = cin(rank)
        try:
            await C.all_reduce(p, op=ReduceOp.PRODUCT)
            out["product"] = p
        except ValueError as exc:
            out["product"] = str(exc)
        return out

    results = await run_all(world4, body)
    ins = [cin(r) for r in range(N)]
    for rank, out in enumerate(results):
        assert_close(out["sum"], sum(ins[1:], ins[0].clone()))
        for i in range(N):
            assert torch.equal(out["all_gather"][i], ins[i])
        assert torch.equal(out["scatter"], cin(10 + rank))
        assert torch.equal(out["broadcast"], ins[2])
        if backend == "gloo":
            assert "PRODUCT on complex tensors is not supported by the gloo backend" in out["product"]
        else:
            want = ins[0].clone()
            for t in ins[1:]:
                want = want * t
            assert_close(out["product"], want)
    assert torch.equal(results[1]["recv"], cin(30))


async def test_barrier_waits_for_the_last_rank(world4: InProcessGroup) -> None:
    loop = asyncio.get_running_loop()

    async def body(rank: int) -> float:
        if rank == 2:
            await asyncio.sleep(0.3)
        start = loop.time()
        await C.barrier()
        return loop.time() - start

    waited = await run_all(world4, body)
    assert all(w >= 0.2 for r, w in enumerate(waited) if r != 2)


async def test_many_overlapping_groups_made_in_a_row(world4: InProcessGroup) -> None:
    """Groups made one after another, then used: on gloo their process groups were made
    at once over one store client per rank, and could wait on each other for good."""
    specs = [[0, 1, 2, 3], [0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2], [1, 2, 3]]

    async def body(rank: int) -> list[float]:
        sums = []
        for _ in range(3):
            groups = [(C.new_group(members), members) for members in specs]
            for group, members in groups:
                if rank in members:
                    t = torch.tensor([float(rank)])
                    await C.all_reduce(t, group=group)
                    sums.append(t.item())
        return sums

    results = await run_all(world4, body, timeout=60.0)
    for rank, sums in enumerate(results):
        mine = [float(sum(members)) for members in specs if rank in members]
        assert sums == mine * 3


async def test_subgroups_and_non_members(world4: InProcessGroup) -> None:
    async def body(rank: int) -> tuple[int, int, int, torch.Tensor]:
        odd = C.new_group([3, 1])  # every worker creates both groups, in the same order
        even = C.new_group([0, 2])
        mine = odd if rank % 2 else even
        other = even if rank % 2 else odd
        t = inp(rank)
        await C.all_reduce(t, group=mine)
        with pytest.warns(UserWarning, match="not a member"):
            assert await C.all_reduce(torch.zeros(1), group=other) is None
        src = mine.ranks[-1]  # a global rank
        b = torch.full((2,), float(rank))
        await C.broadcast(b, src, group=mine)
        assert b.tolist() == [float(src)] * 2
        return C.get_rank(mine), C.get_rank(other), C.get_world_size(mine), t

    results = await run_all(world4, body)
    for rank, (grank, other_rank, size, t) in enumerate(results):
        members = [1, 3] if rank % 2 else [0, 2]
        assert grank == members.index(rank) and other_rank == -1 and size == 2
        assert_close(t, expected(ReduceOp.SUM, [inp(r) for r in members]))


async def test_roots_named_by_their_rank_in_the_group(world4: InProcessGroup) -> None:
    """torch's group_src / group_dst: the root as a rank inside the group (its members
    in rank order, as torch sorts them: in new_group([3, 1]) group rank 0 is global 1)."""
    async def body(rank: int) -> list[torch.Tensor] | None:
        odd = C.new_group([3, 1])
        if rank % 2 == 0:
            return None
        b = torch.full((2,), float(rank))
        await C.broadcast(b, group=odd, group_src=0)
        r = torch.full((2,), float(rank))
        await C.reduce(r, group=odd, group_dst=1)
        s = torch.empty(2)
        await C.scatter(s, [torch.full((2,), 10.0 + i) for i in range(2)] if rank == 3 else None,
                        group=odd, group_src=1)
        got = [torch.empty(2) for _ in range(2)] if rank == 1 else None
        await C.gather(torch.full((2,), float(rank)), got, group=odd, group_dst=0)
        p = torch.full((2,), float(rank))
        if rank == 3:
            await C.send(p, group=odd, group_dst=0, tag=5)
        else:
            assert await C.recv(p, group=odd, group_src=1, tag=5) == 3
        with pytest.raises(ValueError, match="not both"):
            await C.broadcast(b, src=3, group=odd, group_src=0)
        with pytest.raises(ValueError, match="group_src=2 is out of range"):
            await C.broadcast(b, group=odd, group_src=2)
        return [b, r, s, *(got or []), p]

    results = await run_all(world4, body)
    b1, r1, s1, g0, g1, p1 = results[1]  # type: ignore[misc]
    b3, r3, s3, p3 = results[3]  # type: ignore[misc]
    assert b3.tolist() == b1.tolist() == [1.0, 1.0]  # from group rank 0: global 1
    assert r3.tolist() == [4.0, 4.0] and r1.tolist() == [1.0, 1.0]  # into global 3 only
    assert s1.tolist() == [10.0, 10.0] and s3.tolist() == [11.0, 11.0]  # scattered by 3
    assert g0.tolist() == [1.0, 1.0] and g1.tolist() == [3.0, 3.0]  # in group rank order
    assert p1.tolist() == [3.0, 3.0]


async def test_concurrent_ops_on_two_groups_never_mix(world4: InProcessGroup) -> None:
    async def body(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g1 = C.new_group([0, 1, 2, 3])
        g2 = C.new_group([0, 1, 2, 3])
        a, b, c = inp(rank), inp(rank) * 10, inp(rank) * 100
        # the order across groups differs per rank; within a group it is the same
        if rank % 2:
            w2 = await C.all_reduce(b, group=g2, async_op=True)
            w1 = await C.all_reduce(a, group=g1, async_op=True)
            w3 = await C.all_reduce(c, op=ReduceOp.MAX, group=g2, async_op=True)
        else:
            w1 = await C.all_reduce(a, group=g1, async_op=True)
            w2 = await C.all_reduce(b, group=g2, async_op=True)
            w3 = await C.all_reduce(c, op=ReduceOp.MAX, group=g2, async_op=True)
        assert w1 is not None and w2 is not None and w3 is not None
        await asyncio.gather(w3.wait(), w1, w2.wait())
        assert w1.is_completed() and w1.is_success()
        return a, b, c

    results = await run_all(world4, body)
    ins = [inp(r) for r in range(N)]
    for a, b, c in results:
        assert_close(a, expected(ReduceOp.SUM, ins))
        assert_close(b, expected(ReduceOp.SUM, [t * 10 for t in ins]))
        assert_close(c, expected(ReduceOp.MAX, [t * 100 for t in ins]))


async def test_objects(world4: InProcessGroup) -> None:
    async def body(rank: int) -> tuple[list[object], list[object]]:
        objs: list[object] = [{"from": rank, "fn": len}, None] if rank == 2 else [None, None]
        await C.broadcast_object_list(objs, src=2)
        everyone: list[object] = [None] * N
        await C.all_gather_object(everyone, ("rank", rank, "x" * rank))
        return objs, everyone

    for objs, everyone in await run_all(world4, body):
        assert objs == [{"from": 2, "fn": len}, None]
        assert everyone == [("rank", r, "x" * r) for r in range(N)]


async def test_objects_on_a_rank_outside_the_group_stay_as_they_are(world4: InProcessGroup) -> None:
    """As torch: a non-member warns and leaves its lists alone (it crashed unpickling
    the empty buffer it never received)."""

    async def body(rank: int) -> tuple[list[object], list[object]]:
        g = C.new_group([1, 2])
        objs: list[object] = [f"from{rank}", {"r": rank}]
        everyone: list[object] = [None, None]
        if rank in (1, 2):
            await C.broadcast_object_list(objs, src=1, group=g)
            await C.all_gather_object(everyone, rank, group=g)
        else:
            with pytest.warns(UserWarning, match="not a member"):
                await C.broadcast_object_list(objs, src=1, group=g)
            with pytest.warns(UserWarning, match="not a member"):
                await C.all_gather_object(everyone, rank, group=g)
        return objs, everyone

    results = await run_all(world4, body)
    for rank in (0, 3):
        assert results[rank] == ([f"from{rank}", {"r": rank}], [None, None])
    for rank in (1, 2):
        assert results[rank] == (["from1", {"r": 1}], [1, 2])


# -- large tensors: ring all-reduce, chain broadcast ----------------------------------------
@pytest.mark.parametrize("cma", [True, False], ids=["cma", "tcp"])
@pytest.mark.parametrize("numel", [300_003, 1_000_000])  # 1.2 MB not divisible by 4; 4 MB
async def test_ring_all_reduce_and_chain_broadcast(make_group: object, numel: int, cma: bool) -> None:
    group: InProcessGroup = await make_group(N)  # type: ignore[operator]
    tune(group, use_cma=cma, chunk_bytes=256 << 10)

    async def body(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = []
        for _ in range(2):  # the second round uses CMA once the probes are answered
            t = inp(rank, (numel,))
            await C.all_reduce(t)
            avg = inp(rank, (numel,))
            await C.all_reduce(avg, op=ReduceOp.AVG)
            b = inp(rank, (numel,))
            await C.broadcast(b, src=1)
            out = [t, avg, b]
        return out[0], out[1], out[2]

    results = await run_all(group, body, timeout=60)
    ins = [inp(r, (numel,)) for r in range(N)]
    want = expected(ReduceOp.SUM, ins)
    for t, avg, b in results:
        assert_close(t, want, rtol=1e-5, atol=1e-5)
        assert_close(avg, want / N, rtol=1e-5, atol=1e-5)
        assert torch.equal(b, ins[1])
        assert torch.equal(t, results[0][0])  # identical on every rank


async def test_direct_all_reduce_read_through_cma_while_the_result_is_written(
    make_group: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Medium tensors (CMA size, below the ring) go to every peer as an address in the
    caller's tensor; a rank whose data completes first must not write its result there
    before the slower peers have read their copy."""
    if not _cma.available():
        pytest.skip("process_vm_readv is not available here")
    reads: list[int] = []
    read_into = _cma.RemoteRef.read_into

    def counted(ref: _cma.RemoteRef, dst: torch.Tensor) -> None:
        reads.append(dst.numel())
        read_into(ref, dst)

    monkeypatch.setattr(_cma.RemoteRef, "read_into", counted)
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]
    numel = 20_000  # 80 KB: over CMA_MIN_BYTES, under the ring
    ins = [inp(r, (numel,)) for r in range(3)]
    want = expected(ReduceOp.SUM, ins)

    async def body(rank: int) -> list[torch.Tensor]:
        out = []
        for _ in range(12):
            t = ins[rank].clone()
            await C.all_reduce(t)
            out.append(t)
        return out

    for rank_results in await run_all(group, body, timeout=60):
        for t in rank_results:
            assert_close(t, want, rtol=1e-5, atol=1e-5)
    assert reads, "no data went through CMA: the case is not exercised"


async def test_ring_reduce_and_large_gather(make_group: object) -> None:
    group: InProcessGroup = await make_group(N)  # type: ignore[operator]
    tune(group, ring_min_bytes=1 << 10, chunk_bytes=4 << 10)
    numel = 10_001

    async def body(rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        t = inp(rank, (numel,))
        await C.reduce(t, dst=3, op=ReduceOp.MIN)
        everyone = [torch.empty(numel) for _ in range(N)]
        await C.all_gather(everyone, inp(rank, (numel,)) * 2)
        return t, everyone

    results = await run_all(group, body)
    ins = [inp(r, (numel,)) for r in range(N)]
    assert torch.equal(results[3][0], expected(ReduceOp.MIN, ins))
    for rank, (t, everyone) in enumerate(results):
        if rank != 3:
            assert torch.equal(t, ins[rank])
        for i in range(N):
            assert torch.equal(everyone[i], ins[i] * 2)


async def test_ring_with_tiny_chunks_and_more_elements_than_bytes(make_group: object) -> None:
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]
    tune(group, ring_min_bytes=1, chunk_bytes=8)

    async def body(rank: int) -> torch.Tensor:
        t = torch.arange(11, dtype=torch.int64) * (rank + 1)
        await C.all_reduce(t, op=ReduceOp.PRODUCT)
        return t

    for t in await run_all(group, body):
        assert torch.equal(t, torch.arange(11, dtype=torch.int64) ** 3 * 6)


# -- async_op and Work -----------------------------------------------------------------------
async def test_async_op_work(world4: InProcessGroup) -> None:
    async def body(rank: int) -> torch.Tensor:
        t = torch.ones(4) * rank
        work = await C.all_reduce(t, async_op=True)
        assert isinstance(work, C.Work)
        assert await work.wait() is True
        assert work.is_completed() and work.exception() is None
        assert work.result() == [t]
        return t

    for t in await run_all(world4, body):
        assert t.tolist() == [6.0] * 4


async def test_operations_called_while_a_group_is_made_keep_their_order(world4: InProcessGroup, backend: str) -> None:
    """On a fresh group, rank 0 calls its second all-reduce in the very loop turn in
    which the group's backend became ready (the first was called before): it must not
    go first (with gloo's process group it did, and the sums paired the wrong tensors)."""

    async def body(rank: int) -> tuple[list[float], list[float]]:
        g = C.new_group([0, 1])
        if rank > 1:
            return [], []
        a = torch.full((4,), 1.0 + rank)
        b = torch.full((4,), 100.0 * (rank + 1))

        async def second() -> None:
            if rank == 0 and backend == "gloo":
                made = actor().torch.pgs[g.id]
                while not made.done():  # noqa: ASYNC110 - wake in the turn the group became ready
                    await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.3)
            await C.all_reduce(b, group=g)

        await asyncio.gather(C.all_reduce(a, group=g), second())
        return a.tolist(), b.tolist()

    results = await run_all(world4, body)
    assert results[:2] == [([3.0] * 4, [300.0] * 4)] * 2


async def test_conjugate_and_negative_views_are_read_and_written_as_they_read(world4: InProcessGroup) -> None:
    """A conjugate view's memory holds the unconjugated values: gloo sent those, and
    our backend refused the view; both now work with what the view reads."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)

    async def body(rank: int) -> tuple[list[complex], list[complex], list[float]]:
        summed = (x * (rank + 1)).conj()
        await C.all_reduce(summed)
        got = torch.zeros(2, dtype=torch.complex64)
        if rank == 0:
            await C.send(x.conj(), dst=1)
        elif rank == 1:
            await C.recv(got, src=0)
        imag = x.conj().imag if rank == 0 else torch.zeros(2)  # a view with the negative bit
        await C.broadcast(imag, src=0)
        return summed.resolve_conj().tolist(), got.tolist(), imag.tolist()

    results = await run_all(world4, body)
    total = sum((x * (r + 1)).conj().resolve_conj() for r in range(N))
    for summed, _, imag in results:
        assert summed == total.tolist()
        assert imag == x.conj().imag.tolist()
    assert results[1][1] == x.conj().resolve_conj().tolist()
