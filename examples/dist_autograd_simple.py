"""The end-to-end example of PyTorch's distributed autograd design, on actorgrad.

Run with:  actorgrad launch --nproc 2 examples/dist_autograd_simple.py

worker0 creates two tensors on worker1 with ``remote``, fetches them with ``to_here``
inside a distributed autograd context, runs the distributed backward, and steps a
DistributedOptimizer that updates the tensors where they live, on worker1. It checks
every gradient and the update against the same computation in plain local autograd.
"""

from __future__ import annotations

import os

import torch

import actorgrad as ag


def random_tensor() -> torch.Tensor:
    return torch.rand((3, 3), requires_grad=True)


def my_add(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return torch.add(t1, t2)


async def worker0() -> None:
    t1 = torch.rand((3, 3), requires_grad=True)
    t2 = torch.rand((3, 3), requires_grad=True)
    rref1 = ag.remote("worker1", random_tensor)
    rref2 = ag.remote("worker1", random_tensor)
    before1, before2 = await rref1.to_here(), await rref2.to_here()

    async with ag.autograd.context() as context_id:
        # Forward: one RPC with t1/t2, two RRef fetches, local math.
        t3 = await ag.rpc_async("worker1", my_add, args=(t1, t2))
        t4 = await rref1.to_here()
        t5 = await rref2.to_here()
        loss = (t3 * t4 + t5).sum()

        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)

        optimizer = ag.optim.DistributedOptimizer(torch.optim.SGD, [rref1, rref2], lr=0.05)
        await optimizer.step(context_id)

    # The same computation in plain local autograd.
    l1, l2 = t1.detach().requires_grad_(), t2.detach().requires_grad_()
    l4, l5 = before1.detach().requires_grad_(), before2.detach().requires_grad_()
    ((l1 + l2) * l4 + l5).sum().backward()
    torch.testing.assert_close(grads[t1], l1.grad)
    torch.testing.assert_close(grads[t2], l2.grad)
    torch.testing.assert_close(await rref1.to_here(), before1 - 0.05 * l4.grad)
    torch.testing.assert_close(await rref2.to_here(), before2 - 0.05 * l5.grad)
    print(f"loss {loss.item():.4f}; gradients and SGD step on worker1 match local autograd")


async def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    await ag.init_rpc(f"worker{rank}")
    if rank == 0:
        await worker0()
    await ag.shutdown()


if __name__ == "__main__":
    ag.run(main())
