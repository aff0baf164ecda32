"""Relays: a worker that would only hand gradients on (an RPC result passed on as it
came) lets the worker holding the other end send them where they are needed directly:
to its own send (a chain of calls to one worker) or to the worker the result came from
(a driver handing one stage's output to the next).

A chain of K round trips whose results are passed on then needs one propagation each
way instead of 2K; gradients, hooks, FAST mode's check, retain_graph and failures must
come out as without relays, and wherever the caller has something to do with the
gradient (the result is also used here, a hook) it still gets it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

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
from actorgrad._errors import ContextError, ProtocolError
from actorgrad.autograd._context import DistContext, RecvEntry, SendEntry
from actorgrad.autograd._engine import EngineActor, GraphTask
from actorgrad.autograd._messages import pack_relays, unpack_relays


def sin3(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 3


def pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a * b, a - 2 * b


def rand3() -> torch.Tensor:
    return torch.rand(3, 3, requires_grad=True)


def count_served(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rank of every worker that serves a PROPAGATE_GRADS (called or passed on)."""
    served: list[int] = []
    original = EngineActor._serve

    def counting(self, *args):  # type: ignore[no-untyped-def]
        served.append(self.worker.rank)
        return original(self, *args)

    monkeypatch.setattr(EngineActor, "_serve", counting)
    return served


async def chain(x: torch.Tensor, hops: int, to: str = "worker1", fn=sin3) -> torch.Tensor:  # type: ignore[no-untyped-def]
    y = x
    for _ in range(hops):
        y = await ag.rpc_async(to, fn, args=(y,))
    return y


def local_chain(x: torch.Tensor, hops: int) -> torch.Tensor:
    for _ in range(hops):
        x = sin3(x)
    return x


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_results_passed_on_need_one_propagation_each_way(group2, monkeypatch, mode):
    served = count_served(monkeypatch)
    hops = 6
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await chain(x, hops)
        await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()], mode=mode), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    local_chain(lx, hops).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    # worker1 runs all six hops on one propagation; the last one brings x's gradient
    assert served == [1, 0], served
    await wait_released(["worker0", "worker1"])


async def test_a_result_also_used_here_is_not_relayed(group2, monkeypatch):
    served = count_served(monkeypatch)
    x = rand3()
    async with ag.autograd.context() as context_id:
        a = await ag.rpc_async("worker1", sin3, args=(x,))
        b = await ag.rpc_async("worker1", sin3, args=(a,))
        loss = b.sum() + (a * a).sum()  # a's gradient is summed here, from two sources
        await asyncio.wait_for(ag.autograd.backward(context_id, [loss]), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    la = sin3(lx)
    (sin3(la).sum() + (la * la).sum()).backward()
    assert_grads(grads, [(x, lx.grad)])
    assert len(served) == 4, served  # every pair carries its gradients itself


async def test_a_hook_on_a_passed_on_result_still_runs(group2):
    x = rand3()
    seen: list[torch.Tensor] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(grad)
        return grad * 5

    async with ag.autograd.context() as context_id:
        a = await ag.rpc_async("worker1", sin3, args=(x,))
        a.register_hook(hook)
        b = await ag.rpc_async("worker1", sin3, args=(a,))
        await asyncio.wait_for(ag.autograd.backward(context_id, [b.sum()]), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    la = sin3(lx)
    la.register_hook(lambda g: g * 5)
    sin3(la).sum().backward()
    assert len(seen) == 1
    assert_grads(grads, [(x, lx.grad)])


async def test_results_passed_on_in_another_order(group2, monkeypatch):
    served = count_served(monkeypatch)
    a0, b0 = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        a, b = await ag.rpc_async("worker1", pair, args=(a0, b0))
        for _ in range(3):
            a, b = await ag.rpc_async("worker1", pair, args=(b, a))  # swapped each time
        await asyncio.wait_for(ag.autograd.backward(context_id, [(a * 3 + b).sum()]), 10)
        grads = ag.autograd.get_gradients(context_id)
    la0, lb0 = local_copies(a0, b0)
    la, lb = pair(la0, lb0)
    for _ in range(3):
        la, lb = pair(lb, la)
    (la * 3 + lb).sum().backward()
    assert_grads(grads, [(a0, la0.grad), (b0, lb0.grad)])
    assert served == [1, 0], served


async def test_one_of_two_results_passed_on(group2):
    a0, b0 = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        a, b = await ag.rpc_async("worker1", pair, args=(a0, b0))
        c = await ag.rpc_async("worker1", sin3, args=(b,))  # a is dropped
        d = await ag.rpc_async("worker1", sin3, args=(c,))
        await asyncio.wait_for(ag.autograd.backward(context_id, [d.sum()]), 10)
        grads = ag.autograd.get_gradients(context_id)
    la0, lb0 = local_copies(a0, b0)
    _, lb = pair(la0, lb0)
    sin3(sin3(lb)).sum().backward()
    assert_grads(grads, [(a0, la0.grad), (b0, lb0.grad)])


@pytest.mark.parametrize("mode", ["fast", "smart"])
@pytest.mark.parametrize("to", ["worker1", "worker2"])
async def test_one_result_passed_on_and_the_other_used_here(group3, mode, to):
    """The recv of (a, b) is fed by two jobs: a's by the call it went on to, b's by the
    roots. The roots' job has delivered b's share before the first message of the pass
    is built, so a relay judged by the recv's live count would drop it."""
    a0, b0 = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        a, b = await ag.rpc_async("worker1", pair, args=(a0, b0))
        c = await ag.rpc_async(to, sin3, args=(a,))  # a passed on as it came
        await asyncio.wait_for(ag.autograd.backward(context_id, [c.sum() + (b * b).sum()], mode=mode), 10)
        grads = ag.autograd.get_gradients(context_id)
    la0, lb0 = local_copies(a0, b0)
    la, lb = pair(la0, lb0)
    (sin3(la).sum() + (lb * lb).sum()).backward()
    assert_grads(grads, [(a0, la0.grad), (b0, lb0.grad)])


async def test_retain_graph_relays_again(group2):
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await chain(x, 4)
        await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()], retain_graph=True), 10)
        await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    local_chain(lx, 4).sum().backward()
    assert_grads(grads, [(x, 2 * lx.grad)])


async def test_a_result_passed_to_another_worker(make_group):
    """Two hops on worker1, two on worker2, two on worker1 again: relays within each
    worker and across to the other."""
    await make_group(3)
    x = rand3()
    async with ag.autograd.context() as context_id:
        a = await chain(x, 2, "worker1")
        b = await chain(a, 2, "worker2")
        c = await chain(b, 2, "worker1")
        await asyncio.wait_for(ag.autograd.backward(context_id, [c.sum()]), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    local_chain(lx, 6).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    await wait_released(["worker0", "worker1", "worker2"])


async def test_unused_rpc_is_still_reported_next_to_relays(group2):
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await chain(x, 3)
        await ag.rpc_async("worker1", sin3, args=(x * 2,))  # its output is never used
        with pytest.raises(ag.ContextError, match="2 RPC send/recv pair"):
            await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()], mode="fast"), 10)
    await wait_released(["worker0", "worker1"])


async def test_relays_between_processes(make_process_group):
    await make_process_group(2)

    def by_value(x):  # type: ignore[no-untyped-def]  # a local function travels by value
        return torch.sin(x) * 3

    hops = 5
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await chain(x, hops, fn=by_value)
        await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    local_chain(lx, hops).sum().backward()
    assert_grads(grads, [(x, lx.grad)])


async def test_a_stage_output_handed_to_the_next_stage_skips_the_driver(make_group, monkeypatch):
    """worker0 drives: worker1's output goes on to worker2 as it came. In the backward
    worker2 sends its gradient straight to worker1, not through worker0."""
    await make_group(3)
    served = count_served(monkeypatch)
    x = rand3()
    async with ag.autograd.context() as context_id:
        hidden = await ag.rpc_async("worker1", sin3, args=(x,))
        out = await ag.rpc_async("worker2", pair, args=(hidden, hidden * 0 + 2))
        loss = (out[0] * 3 + out[1]).sum()
        await asyncio.wait_for(ag.autograd.backward(context_id, [loss]), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    lhidden = sin3(lx)
    lout = pair(lhidden, lhidden * 0 + 2)
    (lout[0] * 3 + lout[1]).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    # worker2 (from worker0), worker1 (from worker2), worker0 (x's gradient, from
    # worker1); ``hidden * 0 + 2`` is computed here, so its pair is not relayed
    assert sorted(served) == [0, 0, 1, 2], served
    await wait_released(["worker0", "worker1", "worker2"])


async def test_stages_driven_in_a_loop(make_group, monkeypatch):
    """Four stages alternating between worker1 and worker2, each output handed on."""
    await make_group(3)
    served = count_served(monkeypatch)
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = x
        for stage in range(4):
            y = await ag.rpc_async(f"worker{1 + stage % 2}", sin3, args=(y,))
        await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    local_chain(lx, 4).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    assert served == [2, 1, 2, 1, 0], served  # never through worker0 but at the ends
    await wait_released(["worker0", "worker1", "worker2"])


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 3

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise ValueError("relayed backward exploded 5521")


def fails_in_backward(x: torch.Tensor) -> torch.Tensor:
    return FailingBackward.apply(x)


async def test_an_error_in_a_relayed_job_reaches_the_caller(group2):
    """The failing hop runs on worker1 as a relayed job, far from the caller's call."""
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await chain(x, 2)
        y = await ag.rpc_async("worker1", fails_in_backward, args=(y,))
        y = await chain(y, 2)
        with pytest.raises(ag.RemoteError) as info:
            await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)
        assert "relayed backward exploded 5521" in str(info.value)
    await wait_released(["worker0", "worker1"])


@pytest.mark.slow
async def test_first_stage_killed_while_the_second_calls_it(make_process_group):
    group = await make_process_group(3)
    slow_fn = slow_backward_fn(3)

    def quick(x):  # type: ignore[no-untyped-def]
        return x * 2

    x = rand3()
    async with ag.autograd.context() as context_id:
        hidden = await ag.rpc_async("worker1", slow_fn, args=(x,))
        out = await ag.rpc_async("worker2", quick, args=(hidden,))
        await assert_kill_fails_backward(group, 1, context_id, out.sum())


@pytest.mark.slow
async def test_worker_killed_in_a_relayed_job(make_process_group):
    group = await make_process_group(2)
    slow_fn = slow_backward_fn(3)

    def quick(x):  # type: ignore[no-untyped-def]
        return x * 2

    x = rand3()
    async with ag.autograd.context() as context_id:
        a = await ag.rpc_async("worker1", quick, args=(x,))
        b = await ag.rpc_async("worker1", slow_fn, args=(a,))  # relayed: runs on worker1
        c = await ag.rpc_async("worker1", quick, args=(b,))
        await assert_kill_fails_backward(group, 1, context_id, c.sum())


# -- the relay table on its own ---------------------------------------------------------
def test_relays_travel_as_packed_ids():
    relays = [(0, 1, 7, 9, 1, 2, (1, 0)), (2, 0, 1 << 50, 3, 2, 0, ()), (0, 2, 4, 5, 0, 3, (2,))]
    assert unpack_relays(pack_relays(relays)) == relays


@pytest.mark.parametrize("packed", [b"\x01", pack_relays([(0, 1, 1, 2, 1, 2, (0, 1))])[:-8], "not bytes"])
def test_malformed_relays_are_refused(packed):
    with pytest.raises(ProtocolError, match="malformed autograd relays"):
        unpack_relays(packed)  # type: ignore[arg-type]


def _engine_with_pair(peer: int) -> tuple[EngineActor, DistContext, GraphTask]:
    """Rank 1 of 3, with a context holding recv 11 (two 3x3 leaves from ``peer``) and
    send 12 (a 3x3 and a 2-vector to ``peer``)."""
    ctx = DistContext(1)
    ctx.recvs[11] = RecvEntry([torch.zeros(3, 3), torch.zeros(3, 3)], peer)
    ctx.sends[12] = SendEntry([torch.zeros(3, 3), torch.zeros(2)], peer)
    worker = SimpleNamespace(name="worker1", rank=1, world_size=3)
    engine = EngineActor(worker, None)  # type: ignore[arg-type]
    return engine, ctx, GraphTask(5, "fast", False)


@pytest.mark.parametrize(
    "relay",
    [
        (0, 1, 11, 12, 1, 2, (0, 0)),  # one tensor twice
        (0, 1, 11, 12, 1, 2, (0, 1)),  # a 3x3 leaf to a 2-vector
        (0, 1, 11, 12, 1, 2, (0,)),  # not one index per leaf
        (0, 1, 11, 12, 1, 2, (0, 5)),  # no such tensor
        (0, 1, 11, 12, 1, 3, (0, 1)),  # not the send's tensor count
        (0, 1, 99, 12, 1, 2, (0, 1)),  # no such recv
        (2, 1, 11, 12, 1, 2, (1, 0)),  # entries paired with another worker
        (0, 1, 11, 12, 0, 2, (1, 0)),  # the declaring worker's own send
        (0, 1, 11, 12, 7, 2, (1, 0)),  # no such rank
        (0, 1, 11, 12, 2, 2, (1, 2)),  # beyond the other worker's send
    ],
)
def test_a_relay_that_does_not_match_the_entries_is_refused(relay):
    engine, ctx, task = _engine_with_pair(peer=0)
    with pytest.raises(ContextError, match="relay from recv"):
        engine._learn_relays(ctx, task, [relay])
    assert not task.relays


def test_a_matching_relay_is_taken():
    engine, ctx, task = _engine_with_pair(peer=0)
    ctx.sends[12].tensors[1] = torch.zeros(3, 3)
    engine._learn_relays(ctx, task, [(0, 1, 11, 12, 1, 2, (1, 0))])
    assert task.relays == {11: (12, 1, 2, (1, 0))}


def test_a_relay_to_a_third_worker_is_taken():
    engine, ctx, task = _engine_with_pair(peer=0)
    engine._learn_relays(ctx, task, [(0, 1, 11, 40, 2, 3, (2, 0))])
    assert task.relays == {11: (40, 2, 3, (2, 0))}


def test_relays_for_other_workers_are_kept_to_pass_on():
    engine, ctx, task = _engine_with_pair(peer=0)
    relay = (0, 2, 77, 78, 1, 1, (0,))  # worker2's recv: not checked here
    engine._learn_relays(ctx, task, [relay])
    assert not task.relays and list(task.relay_table.values()) == [relay]
