"""A typed user program: ``test_public_types`` type-checks it with mypy (never run).

Each ``assert_type`` states what the API gives its caller at run time, so a signature
that types a call's result wrong (or as Any) fails the check.
"""

from __future__ import annotations

import asyncio
from typing import Any, assert_type

import torch
from torch import nn

import actorgrad as ag
from actorgrad import collective as C


async def double(x: torch.Tensor) -> torch.Tensor:  # awaited on the callee
    return x * 2


def plus_one_later(x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:  # async_execution idiom
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(x + 1)
    return fut


def count(x: torch.Tensor) -> int:
    return x.numel()


class Counter:
    def __init__(self) -> None:
        self.n = 0


async def rpc(x: torch.Tensor) -> None:
    assert_type(ag.rpc_async("worker1", count, args=(x,)), asyncio.Future[int])
    assert_type(await ag.rpc_async("worker1", double, args=(x,)), torch.Tensor)
    assert_type(await ag.rpc_async("worker1", plus_one_later, args=(x,)), torch.Tensor)
    assert_type(ag.rpc_sync("worker1", double, args=(x,)), torch.Tensor)
    assert_type(ag.rpc_sync(1, count, args=(x,)), int)
    rref = ag.remote("worker1", double, args=(x,))
    assert_type(rref, ag.RRef[torch.Tensor])
    assert_type(await rref.to_here(), torch.Tensor)
    assert_type(ag.remote("worker1", Counter), ag.RRef[Counter])
    assert_type(ag.RRef(Counter()).local_value(), Counter)


async def autograd(w: torch.Tensor) -> None:
    async with ag.autograd.context() as context_id:
        assert_type(context_id, int)
        y = await ag.rpc_async("worker1", torch.mul, args=(w, 2.0))
        await ag.autograd.backward(context_id, [y.sum()])
        assert_type(ag.autograd.get_gradients(context_id), dict[torch.Tensor, torch.Tensor])
        graph = await ag.autograd.graph(context_id)
        assert_type(graph.to_dot(), str)
        assert_type(ag.autograd.graph(context_id).to_dot(), str)
        params = [ag.remote("worker1", nn.Parameter, args=(torch.ones(2),))]
        opt = ag.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
        await opt.step(context_id)


async def collectives(t: torch.Tensor, group: C.Group) -> None:
    work = C.isend(t, 1)
    assert_type(work, C.Work)
    await work
    assert_type(C.irecv(t, 0), C.Work)
    assert_type(C.irecv(t, 0, group=group), C.Work | None)
    await C.all_reduce(t, op=C.ReduceOp.SUM)
    assert_type(await C.recv(t), int)


async def notebook() -> None:
    group = await ag.local_group(2)
    await group.shutdown()


async def main() -> None:
    info = await ag.init_rpc("worker0", rank=0, world_size=2)
    assert_type(info, ag.WorkerInfo)
    ddp = await ag.parallel.DistributedDataParallel.create(nn.Linear(2, 2))
    out: Any = ddp(torch.ones(2))
    await ddp.backward(out.sum())
    await ag.shutdown()
