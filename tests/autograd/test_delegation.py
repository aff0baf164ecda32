"""A propagation that ends in exactly one further propagation passes its duty to answer
along, so a chain of round trips is answered once, by the worker where it ends.

Gradients, errors, lost workers and FAST mode's unused-RPC check must come out exactly
as when every worker answers its caller itself.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from _ag_helpers import (
    assert_grads,
    assert_kill_fails_backward,
    local_copies,
    slow_backward_fn,
    wait_released,
)

import actorgrad as ag


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 3

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise ValueError("backward on the caller exploded 8152")


def rand3() -> torch.Tensor:
    return torch.rand(3, 3, requires_grad=True)


def count_calls(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(cls, name)

    def counting(self, *args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(cls, name, counting)
    return calls


async def test_round_trips_are_answered_once(group2, monkeypatch):
    """worker0 -> worker1 -> worker0 -> ...: one call from the caller, the rest passed on."""
    called = count_calls(monkeypatch, ag.autograd.EngineActor, "_fire_recv")
    served = count_calls(monkeypatch, ag.autograd.EngineActor, "_serve")
    answers = count_calls(monkeypatch, ag.runtime.Worker, "answer")
    settled = count_calls(monkeypatch, ag.runtime.Worker, "settle_own_call")
    hops = 4
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = x
        for i in range(hops):
            y = await ag.rpc_async("worker1", double, args=(torch.sin(y) + i,))
        await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    ly = lx
    for i in range(hops):
        ly = double(torch.sin(ly) + i)
    ly.sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    # 2 * hops propagations: the caller's own call, and 2 * hops - 1 passed along with
    # the duty to answer, which the last one discharges; it runs on the caller, which
    # settles its own call without a message
    assert (len(served), len(called), len(answers), len(settled)) == (2 * hops, 1, 0, 1)
    await wait_released(["worker0", "worker1"])


async def test_error_after_the_duty_moved_reaches_the_caller(group2):
    """The failing node runs on worker0 while it holds worker1's duty to answer."""
    x = rand3()
    async with ag.autograd.context() as context_id:
        a = await ag.rpc_async("worker1", double, args=(x,))
        b = FailingBackward.apply(a)
        c = await ag.rpc_async("worker1", double, args=(b,))
        with pytest.raises(ag.RemoteError) as info:
            await asyncio.wait_for(ag.autograd.backward(context_id, [c.sum()]), 10)
        assert "backward on the caller exploded 8152" in str(info.value)
    await wait_released(["worker0", "worker1"])


async def test_unused_rpc_is_reported_through_passed_on_answers(group2):
    x = rand3()
    async with ag.autograd.context() as context_id:
        a = await ag.rpc_async("worker1", double, args=(x,))
        await ag.rpc_async("worker1", double, args=(x * 5,))  # its output is never used
        c = await ag.rpc_async("worker1", double, args=(a * 2,))
        with pytest.raises(ag.ContextError, match="2 RPC send/recv pair"):
            await asyncio.wait_for(ag.autograd.backward(context_id, [c.sum()], mode="fast"), 10)
    await wait_released(["worker0", "worker1"])


async def test_concurrent_backwards_answer_their_own_callers(group2):
    async def one(seed: int) -> tuple[dict[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        x = rand3()
        async with ag.autograd.context() as context_id:
            y = await ag.rpc_async("worker1", double, args=(x,))
            z = await ag.rpc_async("worker1", double, args=(y.cos(),))
            await ag.autograd.backward(context_id, [z.sum()])
            grads = ag.autograd.get_gradients(context_id)
        (lx,) = local_copies(x)
        double(double(lx).cos()).sum().backward()
        return grads, x, lx.grad  # type: ignore[return-value]

    for grads, x, expected in await asyncio.wait_for(asyncio.gather(*(one(s) for s in range(6))), 20):
        assert_grads(grads, [(x, expected)])
    await wait_released(["worker0", "worker1"])


@pytest.mark.slow
async def test_worker_killed_while_it_holds_the_duty(make_process_group):
    """worker1 dies in a propagation passed to it by worker0 (which held the duty)."""
    group = await make_process_group(2)

    slow_fn = slow_backward_fn(3)

    def quick(x):  # type: ignore[no-untyped-def]
        return x * 2

    x = rand3()
    async with ag.autograd.context() as context_id:
        a = await ag.rpc_async("worker1", slow_fn, args=(x,))
        c = await ag.rpc_async("worker1", quick, args=(a * 2,))
        await assert_kill_fails_backward(group, 1, context_id, c.sum())
    info = ag.autograd.debug_info()
    assert info["num_current_backward_passes"] == 0
    assert info["num_autograd_contexts"] == 0
