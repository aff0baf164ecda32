"""Run by ``actorgrad launch --nproc 4``: every collective across real processes,
checked against values computed locally; on both backends. Exits non-zero on error."""

from __future__ import annotations

import os
import sys

import torch

import actorgrad as ag
import actorgrad.collective as C
from actorgrad.collective import ReduceOp

BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def inp(rank: int, numel: int, op: ReduceOp | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if op in BITWISE:  # integers only
        return torch.randint(0, 1 << 30, (numel,), generator=g, dtype=torch.int32)
    t = torch.randn(numel, generator=g, dtype=torch.float64)
    return (1 + 0.01 * t if op is ReduceOp.PRODUCT else t).float()


def expected(op: ReduceOp, ts: list[torch.Tensor]) -> torch.Tensor:
    out = ts[0].clone()
    for t in ts[1:]:
        out = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
               ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
               ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
               ReduceOp.BXOR: torch.bitwise_xor}[op](out, t)
    return out / len(ts) if op is ReduceOp.AVG else out


def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


async def run_all(backend: str) -> None:
    rank, n = ag.get_rank(), ag.get_world_size()
    for numel in (5, 300_003):  # the direct path and the ring / chain path
        for op in ReduceOp:
            t = inp(rank, numel, op)
            await C.all_reduce(t, op=op)
            check(f"{backend} all_reduce {op} {numel}", t, expected(op, [inp(r, numel, op) for r in range(n)]))
        t = inp(rank, numel)
        await C.reduce(t, dst=1, op=ReduceOp.MAX)
        want = expected(ReduceOp.MAX, [inp(r, numel) for r in range(n)]) if rank == 1 else inp(rank, numel)
        check(f"{backend} reduce {numel}", t, want)
        t = inp(rank, numel)
        await C.broadcast(t, src=2)
        check(f"{backend} broadcast {numel}", t, inp(2, numel))
        out = [torch.empty(numel) for _ in range(n)]
        await C.all_gather(out, inp(rank, numel))
        for r in range(n):
            check(f"{backend} all_gather {numel}", out[r], inp(r, numel))
        got = [torch.empty(numel) for _ in range(n)] if rank == 3 else None
        await C.gather(inp(rank, numel), got, dst=3)
        if got is not None:
            for r in range(n):
                check(f"{backend} gather {numel}", got[r], inp(r, numel))
        t = torch.empty(numel)
        await C.scatter(t, [inp(10 + r, numel) for r in range(n)] if rank == 0 else None, src=0)
        check(f"{backend} scatter {numel}", t, inp(10 + rank, numel))
        # point-to-point around the ring, non-blocking, and a receive from any source
        into = torch.empty(numel)
        recv = C.irecv(into, src=(rank - 1) % n)
        await C.isend(inp(rank, numel), dst=(rank + 1) % n)  # type: ignore[misc]
        await recv  # type: ignore[misc]
        check(f"{backend} isend/irecv {numel}", into, inp((rank - 1) % n, numel))
        if rank == 0:
            seen = set()
            for _ in range(n - 1):
                src = await C.recv(into, tag=7)
                check(f"{backend} recv any {numel}", into, inp(src, numel))
                seen.add(src)
            assert seen == {1, 2, 3}, seen
        else:
            await C.send(inp(rank, numel), dst=0, tag=7)
    pair = C.new_group([1, 3])  # every rank creates it; only the members use it
    if rank in (1, 3):
        t = torch.full((3,), float(rank))
        await C.all_reduce(t, group=pair)
        assert t.tolist() == [4.0] * 3, t
    await C.barrier()


async def main() -> None:
    await ag.init_rpc(f"worker{os.environ['RANK']}")
    await run_all("actorgrad")
    await C.init_process_group(backend="gloo")
    await run_all("gloo")
    if ag.get_rank() == 0:
        print("every collective OK on both backends", flush=True)
    await ag.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ag.run(main())
    sys.exit(0)
