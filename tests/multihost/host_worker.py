"""One worker on one "host" (network namespace) of the multi-host test.

Rank 0 trains parameters owned by the two other hosts with distributed autograd and
DistributedOptimizer, and checks every step against the same math in local autograd.
"""

from __future__ import annotations

import os

import torch

import actorgrad as ag


def make_weight(seed: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def host_address() -> str:
    """Runs on the callee: the address of the namespace it lives in."""
    return os.environ["HOST_ADDR"]


def layer(w_rref: ag.RRef, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w_rref.local_value())


async def driver() -> None:
    w1 = ag.remote("worker1", make_weight, args=(1,))
    w2 = ag.remote("worker2", make_weight, args=(2,))
    optimizer = ag.optim.DistributedOptimizer(torch.optim.SGD, [w1, w2], lr=0.1)
    local1, local2 = make_weight(1), make_weight(2)
    local_opt = torch.optim.SGD([local1, local2], lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        async with ag.autograd.context() as cid:
            h = await ag.rpc_async("worker1", layer, args=(w1, x))
            y = await ag.rpc_async("worker2", layer, args=(w2, h))
            loss = y.square().mean()
            await ag.autograd.backward(cid, [loss])
            await optimizer.step(cid)
        local_opt.zero_grad()
        torch.tanh(torch.tanh(x @ local1) @ local2).square().mean().backward()
        local_opt.step()
    torch.testing.assert_close(await w1.to_here(), local1.detach())
    torch.testing.assert_close(await w2.to_here(), local2.detach())
    hosts = [await ag.rpc_async(f"worker{r}", host_address) for r in (1, 2)]
    print(f"MULTIHOST OK loss={loss.item():.5f} hosts={hosts}", flush=True)


async def main() -> None:
    rank = int(os.environ["RANK"])
    options = ag.RpcOptions(listen_host=os.environ["HOST_ADDR"], auth_key=os.environ["KEY"],
                            init_timeout=30)
    await ag.init_rpc(f"worker{rank}", rank=rank, world_size=3,
                      init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                      options=options)
    if rank == 0:
        await driver()
    await ag.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    ag.run(main())
