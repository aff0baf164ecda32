"""Grad mode decides what an RPC records, and it is torch's per-thread state: the thread
that makes a call must decide for it, never the loop thread that happens to send it.
Gradients are compared with the same computation in plain local autograd."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from _ag_helpers import assert_grads, local_copies

import actorgrad as ag

MODES = ["fast", "smart"]


@pytest.mark.parametrize("mode", MODES)
async def test_reply_is_recorded_while_another_callee_waits_under_no_grad(make_process_group, mode):
    # worker1 serves a coroutine that waits inside torch.no_grad(), which leaves its
    # loop thread in no_grad meanwhile; its reply to a graded call made in a context
    # must still be recorded (it was lost: no gradient in SMART, an "unused RPC" in FAST)
    await make_process_group(2)

    async def evaluate(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            await asyncio.sleep(0.5)
            return x * 2

    def times3(w: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)  # runs on worker1's thread pool
        return w * 3

    for fn in (times3, torch.mul):  # a pool function, and a builtin run on the loop
        args = (3.0,) if fn is torch.mul else ()
        w = torch.rand(3, requires_grad=True)
        async with ag.autograd.context() as cid:
            waiting = asyncio.ensure_future(ag.rpc_async("worker1", evaluate, args=(torch.ones(3),)))
            await asyncio.sleep(0.1)
            y = await ag.rpc_async("worker1", fn, args=(w, *args))
            await ag.autograd.backward(cid, [(y * y).sum()], mode=mode)
            grads = ag.autograd.get_gradients(cid)
            await waiting
        (lw,) = local_copies(w)
        ((lw * 3) ** 2).sum().backward()
        assert_grads(grads, [(w, lw.grad)])


@pytest.mark.parametrize("mode", MODES)
async def test_rpc_sync_in_a_remote_function_follows_its_threads_no_grad(group3, mode):
    # worker1's function runs on a pool thread; its rpc_sync under no_grad must not be
    # recorded (it was: the call was sent from the loop thread, whose grad mode is on)
    def on_worker1(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            m = ag.rpc_sync("worker2", torch.mul, args=(x, 2.0))
        assert torch.is_grad_enabled() and m.grad_fn is None  # arrived as a leaf
        with torch.enable_grad():
            n = ag.rpc_sync("worker2", torch.mul, args=(x, 5.0))
        return x * 3 + m + n

    x = torch.rand(4, requires_grad=True)
    async with ag.autograd.context() as cid:
        y = await ag.rpc_async("worker1", on_worker1, args=(x,))
        await ag.autograd.backward(cid, [y.sum()], mode=mode)
        grads = ag.autograd.get_gradients(cid)
    (lx,) = local_copies(x)
    (lx * 3 + (lx * 2).detach() + lx * 5).sum().backward()
    assert_grads(grads, [(x, lx.grad)])


@pytest.mark.parametrize("mode", MODES)
async def test_work_on_the_loop_is_untouched_by_a_coroutine_waiting_in_autocast(make_process_group, mode):
    # worker1 serves a coroutine that waits inside torch.autocast and inference_mode,
    # which leaves both set on its loop thread meanwhile; a builtin run inline there and
    # the small backward job of its graph must still compute as a pool thread does (in
    # float32: the builtin's result came back as bfloat16, and its gradient with it)
    await make_process_group(2)

    async def holder() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
            await asyncio.sleep(0.6)

    x = torch.rand(4, 4, requires_grad=True)
    w = torch.rand(4, 4, requires_grad=True)
    async with ag.autograd.context() as cid:
        waiting = asyncio.ensure_future(ag.rpc_async("worker1", holder))
        await asyncio.sleep(0.2)
        y = await ag.rpc_async("worker1", torch.mm, args=(x, w))
        assert y.dtype == torch.float32 and y.requires_grad
        await ag.autograd.backward(cid, [(y * y).sum()], mode=mode)
        grads = ag.autograd.get_gradients(cid)
        assert not waiting.done()  # all of it happened while the coroutine waited
        await waiting
    lx, lw = local_copies(x, w)
    ly = torch.mm(lx, lw)
    (ly * ly).sum().backward()
    assert torch.equal(y, ly.detach())
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert_grads(grads, [(x, lx.grad), (w, lw.grad)])


async def holding_modes(seconds: float) -> None:
    """Waits inside modes that stay set on the loop thread while it waits."""
    with torch.no_grad(), torch.device("meta"), torch.autocast("cpu", dtype=torch.bfloat16):
        await asyncio.sleep(seconds)


async def triple_after_a_step(x: torch.Tensor) -> torch.Tensor:
    await asyncio.sleep(0.01)
    return torch.mm(x, torch.eye(x.shape[1])) * 3


async def keeping_its_own_modes(x: torch.Tensor) -> list[object]:
    seen = []
    with torch.no_grad():
        await asyncio.sleep(0.4)  # holding_modes starts meanwhile and holds its modes on
        seen += [torch.is_grad_enabled(), (x * 2).requires_grad]
    seen += [torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.zeros(1).device.type]
    return seen


@pytest.mark.parametrize("mode", MODES)
async def test_a_remote_coroutine_runs_in_its_own_modes(make_process_group, mode):
    # worker1 serves a coroutine that waits inside no_grad, a meta device and autocast;
    # a remote async def served meanwhile ran in them: its result was not recorded (a
    # wrong gradient in SMART mode, an "unused RPC" in FAST) and came back in bfloat16,
    # and an empty tensor received meanwhile landed on the meta device. A remote
    # coroutine keeps the modes it sets itself across its awaits, whoever runs between.
    await make_process_group(2)
    x = torch.rand(3, 3, requires_grad=True)
    own = asyncio.ensure_future(ag.rpc_async("worker1", keeping_its_own_modes, args=(torch.ones(2),)))
    await asyncio.sleep(0.1)
    holder = asyncio.ensure_future(ag.rpc_async("worker1", holding_modes, args=(2.0,)))
    await asyncio.sleep(0.2)
    async with ag.autograd.context() as cid:
        y = await ag.rpc_async("worker1", triple_after_a_step, args=(x,))
        assert y.dtype == torch.float32
        await ag.autograd.backward(cid, [y.sum() + (x * x).sum()], mode=mode)
        grads = ag.autograd.get_gradients(cid)
    empty = await ag.rpc_async("worker1", torch.Tensor.__repr__, args=(torch.zeros(0, 3),))
    assert not holder.done()
    await holder
    (lx,) = local_copies(x)
    (torch.mm(lx, torch.eye(3)) * 3 + lx * lx).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    assert "meta" not in empty
    assert await own == [False, False, True, False, "cpu"]


async def waiting_in_modes_here(seconds: float) -> list[object]:
    with torch.no_grad(), torch.inference_mode(), torch.device("meta"), torch.autocast("cpu", dtype=torch.bfloat16):
        await asyncio.sleep(seconds)
        return [torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.empty(1).device.type,
                torch.is_autocast_enabled("cpu")]


def call_worker0_back(seconds: float) -> list[object]:
    return ag.rpc_sync("worker0", waiting_in_modes_here, args=(seconds,), timeout=30)


async def test_a_remote_coroutine_leaves_its_modes_to_itself(make_process_group):
    # worker1 calls back into this worker's async def, which waits inside no_grad,
    # inference_mode, a meta device and autocast: this program's own coroutine ran in
    # them meanwhile (its w * 2 was not recorded, torch.empty landed on meta)
    await make_process_group(2)
    back = asyncio.ensure_future(ag.rpc_async("worker1", call_worker0_back, args=(0.6,), timeout=30))
    await asyncio.sleep(0.3)
    w = torch.ones(2, requires_grad=True)
    seen = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.empty(1).device.type,
            torch.is_autocast_enabled("cpu"), (w * 2).requires_grad]
    assert not back.done()
    assert seen == [True, False, "cpu", False, True]
    assert await back == [False, True, "meta", True]  # and it kept its own across its await
    assert [torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.empty(1).device.type] == [True, False, "cpu"]
