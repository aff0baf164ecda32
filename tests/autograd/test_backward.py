"""Distributed backward: every gradient equals plain local autograd on detached clones.

Functions sent by RPC live at module level (the callee imports this module by name).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from _ag_helpers import assert_grads, local_copies, wait_released

import actorgrad as ag
from actorgrad.runtime import get_worker

# -- remote functions ---------------------------------------------------------------------


def my_add(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return torch.add(t1, t2)


def hop_a(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * 1.5


def hop_b(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * x


def other_worker() -> str:
    return "worker0" if ag.get_worker_info().name == "worker1" else "worker1"


async def ping_pong(x: torch.Tensor, depth: int) -> torch.Tensor:
    """worker0 -> worker1 -> worker0 -> worker1 ...: each hop calls the other worker back."""
    y = torch.sin(x) * 2
    if depth == 0:
        return y * x
    z = await ag.rpc_async(other_worker(), ping_pong, args=(y, depth - 1))
    return z + y * x


def ping_pong_local(x: torch.Tensor, depth: int) -> torch.Tensor:
    y = torch.sin(x) * 2
    if depth == 0:
        return y * x
    return ping_pong_local(y, depth - 1) + y * x


async def nested_async(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """On worker1: calls worker2 with an async RPC and mixes its result with local math."""
    h = x * w
    z = await ag.rpc_async("worker2", torch.mul, args=(h, x))
    return z.cos() + h


def nested_sync(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """On worker1 (a thread of its pool): a blocking RPC to worker2."""
    h = x * w
    z = ag.rpc_sync("worker2", hop_b, args=(h,))
    return z * 3 + x


def nested_local(x: torch.Tensor, w: torch.Tensor, sync: bool) -> torch.Tensor:
    h = x * w
    if sync:
        return hop_b(h) * 3 + x
    return (h * x).cos() + h


def make_leaf(seed: int, shape: tuple[int, ...] = (3, 3)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g).requires_grad_()


def square_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum()


def two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x * 3


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def mixed_args(x: torch.Tensor, n: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Tensors that do not require grad between ones that do."""
    return x * n.float() + y * k


def rand3(*shape: int) -> torch.Tensor:
    return torch.rand(shape or (3, 3), requires_grad=True)


# -- the seed example ---------------------------------------------------------------------


async def test_seed_example(group2):
    t1, t2, t4 = rand3(), rand3(), rand3()
    async with ag.autograd.context() as context_id:
        t3 = await ag.rpc_async("worker1", my_add, args=(t1, t2))
        loss = (t3 * t4).sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
        remote_grads = await ag.rpc_async("worker1", ag.autograd.get_gradients, args=(context_id,))

    l1, l2, l4 = local_copies(t1, t2, t4)
    ((l1 + l2) * l4).sum().backward()
    assert_grads(grads, [(t1, l1.grad), (t2, l2.grad), (t4, l4.grad), (t3, None)])
    assert remote_grads == {}  # worker1 has no leaves of its own
    assert not t3.is_leaf  # a received tensor comes out of RecvRpcBackward, as in torch
    assert type(t3.grad_fn).__name__.startswith("RecvRpcBackward")  # directly, no view nodes
    for t in (t1, t2, t4):
        assert t.grad is None  # gradients live in the context, never in .grad
    await wait_released(["worker0", "worker1"])


async def test_dist_backward_alias(group2):
    assert ag.dist_backward is ag.autograd.backward
    t1, t2, t4 = rand3(), rand3(), rand3()
    async with ag.autograd.context() as context_id:
        t3 = await ag.rpc_async("worker1", my_add, args=(t1, t2))
        await ag.dist_backward(context_id, [(t3 * t4).sum()])
        grads = ag.autograd.get_gradients(context_id)
    l1, l2, l4 = local_copies(t1, t2, t4)
    ((l1 + l2) * l4).sum().backward()
    assert_grads(grads, [(t1, l1.grad), (t2, l2.grad), (t4, l4.grad)])


async def test_builtin_rpc_and_remote_to_here(group2):
    """A C builtin (runs inline on the callee's loop), remote() + to_here inside the context."""
    a, b = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        rref = ag.remote("worker1", torch.mul, args=(a, b))
        c = await ag.rpc_async("worker1", torch.add, args=(a, b))
        m = await rref.to_here()
        loss = (m * c).sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    la, lb = local_copies(a, b)
    ((la * lb) * (la + lb)).sum().backward()
    assert_grads(grads, [(a, la.grad), (b, lb.grad)])


async def test_remote_leaves_gradients_live_on_owner(group2):
    """Leaves created on worker1 by remote(): their gradients accumulate on worker1."""
    x = rand3()
    rref = ag.remote("worker1", make_leaf, args=(7,))
    before = await rref.to_here()
    async with ag.autograd.context() as context_id:
        p = await rref.to_here()
        loss = (p * x).pow(2).sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
        owner_grads = await ag.rpc_async("worker1", _owner_grads, args=(rref, context_id))
    lp, lx = local_copies(before, x)
    (lp * lx).pow(2).sum().backward()
    assert_grads(grads, [(x, lx.grad), (p, None)])
    torch.testing.assert_close(owner_grads, lp.grad)


def _owner_grads(rref: ag.RRef, context_id: int) -> torch.Tensor:
    return ag.autograd.get_gradients(context_id)[rref.local_value()].clone()


async def test_remote_loss_and_several_roots(group2):
    """A root computed remotely (a recv leaf) and two roots at once."""
    x, y = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        remote_loss = await ag.rpc_async("worker1", square_sum, args=(x,))
        local_loss = (x * y).sum()
        await ag.autograd.backward(context_id, [remote_loss, local_loss])
        grads = ag.autograd.get_gradients(context_id)
    lx, ly = local_copies(x, y)
    ((lx * lx).sum() + (lx * ly).sum()).backward()
    assert_grads(grads, [(x, lx.grad), (y, ly.grad)])


async def test_tuple_result_partly_used_identity_and_repeated_arg(group2):
    a, b = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        p, _unused = await ag.rpc_async("worker1", two_outputs, args=(a,))
        same = await ag.rpc_async("worker1", identity, args=(b,))
        twice = await ag.rpc_async("worker1", torch.mul, args=(a, a))
        loss = (p * same).sum() + twice.sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    la, lb = local_copies(a, b)
    ((la * 2) * lb).sum().add((la * la).sum()).backward()
    assert_grads(grads, [(a, la.grad), (b, lb.grad)])


async def test_tensors_without_grad_between_grad_tensors(group2):
    x, y = rand3(), rand3()
    n = torch.arange(9).reshape(3, 3)  # int tensor
    c = torch.rand(3, 3)  # float, no grad
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", mixed_args, args=(x, n, y, 4))
        r2 = await ag.rpc_async("worker1", torch.mul, args=(c, y))
        await ag.autograd.backward(context_id, [(r * r2).sum()])
        grads = ag.autograd.get_gradients(context_id)
    lx, ly = local_copies(x, y)
    (mixed_args(lx, n, ly, 4) * (c * ly)).sum().backward()
    assert_grads(grads, [(x, lx.grad), (y, ly.grad)])


# -- graphs with several hops ---------------------------------------------------------------


async def test_sequential_round_trips_share_local_graph(group2):
    """worker0 -> worker1 -> worker0 -> worker1 -> worker0, each hop feeding on the last,
    local math in between, and an early tensor reused late (shared local regions)."""
    a, b, w = rand3(), rand3(), rand3()
    async with ag.autograd.context() as context_id:
        x1 = a * 2 + b
        y1 = await ag.rpc_async("worker1", hop_a, args=(x1, w))
        z1 = y1 * b + a
        y2 = await ag.rpc_async("worker1", hop_b, args=(z1,))
        z2 = y2 * x1  # x1 from the first hop, used again
        y3 = await ag.rpc_async("worker1", hop_a, args=(z2, w))
        loss = (y3 * a).sum() + z1.sum() + (x1 * y2).mean()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    la, lb, lw = local_copies(a, b, w)
    lx1 = la * 2 + lb
    lz1 = hop_a(lx1, lw) * lb + la
    ly2 = hop_b(lz1)
    lz2 = ly2 * lx1
    ((hop_a(lz2, lw) * la).sum() + lz1.sum() + (lx1 * ly2).mean()).backward()
    assert_grads(grads, [(a, la.grad), (b, lb.grad), (w, lw.grad)])
    await wait_released(["worker0", "worker1"])


@pytest.mark.parametrize("depth", [1, 4])
async def test_ping_pong_callbacks_between_two_workers(group2, depth):
    """worker1's function calls worker0 back, which calls worker1 again, ..."""
    x = rand3()
    async with ag.autograd.context() as context_id:
        out = await ag.rpc_async("worker1", ping_pong, args=(x * 1.0, depth))
        loss = (out * x).sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    (ping_pong_local(lx * 1.0, depth) * lx).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    await wait_released(["worker0", "worker1"])


@pytest.mark.parametrize("sync", [False, True], ids=["async_def", "rpc_sync"])
async def test_nested_rpc_over_three_workers(group3, sync):
    x, w = rand3(), rand3()
    fn = nested_sync if sync else nested_async
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", fn, args=(x, w))
        loss = (r * x).sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    lx, lw = local_copies(x, w)
    (nested_local(lx, lw, sync) * lx).sum().backward()
    assert_grads(grads, [(x, lx.grad), (w, lw.grad)])
    # worker2 was only reached through worker1; it must be released all the same.
    await wait_released(["worker0", "worker1", "worker2"])


async def test_tensor_sent_to_two_workers(group3):
    a, b = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        x = a * b
        r1, r2 = await asyncio.gather(
            ag.rpc_async("worker1", torch.sin, args=(x,)),
            ag.rpc_async("worker2", hop_b, args=(x,)),
        )
        loss = (r1 * r2).sum() + x.sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    la, lb = local_copies(a, b)
    lx = la * lb
    ((torch.sin(lx) * hop_b(lx)).sum() + lx.sum()).backward()
    assert_grads(grads, [(a, la.grad), (b, lb.grad)])


async def test_diamond_across_three_workers(group3):
    """x on worker0 -> f on worker1 and g on worker2 -> merged on worker1 -> loss with x."""
    x, w = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        y1 = await ag.rpc_async("worker1", hop_a, args=(x, w))
        y2 = await ag.rpc_async("worker2", hop_b, args=(x,))
        z = await ag.rpc_async("worker1", torch.mul, args=(y1, y2))
        top = await ag.rpc_async("worker2", my_add, args=(z, y1))
        loss = (top * x).sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    lx, lw = local_copies(x, w)
    ly1, ly2 = hop_a(lx, lw), hop_b(lx)
    (((ly1 * ly2) + ly1) * lx).sum().backward()
    assert_grads(grads, [(x, lx.grad), (w, lw.grad)])
    await wait_released(["worker0", "worker1", "worker2"])


# -- retain_graph, concurrency ----------------------------------------------------------------


async def test_retain_graph_accumulates(group2):
    a, b = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", hop_a, args=(a, b))
        loss = (r * a).sum()
        await ag.autograd.backward(context_id, [loss], retain_graph=True)
        once = {t: g.clone() for t, g in ag.autograd.get_gradients(context_id).items()}
        await ag.autograd.backward(context_id, [loss], retain_graph=True)
        twice = ag.autograd.get_gradients(context_id)
        await ag.autograd.backward(context_id, [loss])  # the last one may free the graph
        thrice = ag.autograd.get_gradients(context_id)
    la, lb = local_copies(a, b)
    (hop_a(la, lb) * la).sum().backward()
    assert_grads(once, [(a, la.grad), (b, lb.grad)])
    assert_grads(twice, [(a, 2 * la.grad), (b, 2 * lb.grad)])
    assert_grads(thrice, [(a, 3 * la.grad), (b, 3 * lb.grad)])


async def test_second_backward_without_retain_graph_raises(group2):
    a, b = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        loss = (await ag.rpc_async("worker1", torch.mul, args=(a, b))).sum()
        await ag.autograd.backward(context_id, [loss])
        first = {t: g.clone() for t, g in ag.autograd.get_gradients(context_id).items()}
        with pytest.raises(ag.ContextError):
            await ag.autograd.backward(context_id, [loss])
        # the failed call added nothing
        assert_grads(ag.autograd.get_gradients(context_id), [(a, first[a]), (b, first[b])])
    await wait_released(["worker0", "worker1"])


async def _one_context(a: torch.Tensor, b: torch.Tensor, kind: int):
    async with ag.autograd.context() as context_id:
        if kind == 0:
            r = await ag.rpc_async("worker1", hop_a, args=(a, b))
            await asyncio.sleep(0.01)  # let the other context interleave
            loss = (r * a).sum()
        else:
            r = await ag.rpc_async("worker1", hop_b, args=(a * b,))
            await asyncio.sleep(0.01)
            r = await ag.rpc_async("worker1", torch.mul, args=(r, b))
            loss = r.sum() * 3
        await ag.autograd.backward(context_id, [loss])
        return context_id, ag.autograd.get_gradients(context_id)


async def test_concurrent_contexts_keep_separate_gradients(group2):
    a, b = rand3(), rand3()  # the same leaves in both contexts
    (id0, g0), (id1, g1), (id2, g2) = await asyncio.gather(
        _one_context(a, b, 0), _one_context(a, b, 1), _one_context(a, b, 0)
    )
    assert len({id0, id1, id2}) == 3
    la, lb = local_copies(a, b)
    (hop_a(la, lb) * la).sum().backward()
    assert_grads(g0, [(a, la.grad), (b, lb.grad)])
    assert_grads(g2, [(a, la.grad), (b, lb.grad)])
    la, lb = local_copies(a, b)
    (hop_b(la * lb) * lb).sum().mul(3).backward()
    assert_grads(g1, [(a, la.grad), (b, lb.grad)])
    await wait_released(["worker0", "worker1"])


# -- context lifetime and ids ------------------------------------------------------------------


async def test_context_released_everywhere_after_exit(group3):
    x = rand3()
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", nested_async, args=(x, x * 2))
        await ag.autograd.backward(context_id, [r.sum()])
        infos = {n: await ag.rpc_async(n, ag.autograd.debug_info) for n in ("worker1", "worker2")}
        assert all(i["num_autograd_contexts"] == 1 for i in infos.values()), infos
    with pytest.raises(ag.ContextError):
        ag.autograd.get_gradients(context_id)
    await wait_released(["worker0", "worker1", "worker2"])


def deliver_late_message(context_id: int) -> int:
    """On the worker running it: record a received tensor under ``context_id`` as a
    message arriving after the context was released there would; returns the number
    of live contexts afterwards."""
    from actorgrad.autograd._context import context_actor
    from actorgrad.runtime import get_worker
    from actorgrad.wire import Payload

    worker = get_worker()
    payload = Payload(Payload.dump(torch.ones(2, requires_grad=True)).body)
    payload.load()
    context_actor(worker).on_receive(worker, (context_id, 12345), payload, 0)
    return ag.autograd.debug_info()["num_autograd_contexts"]


async def own_context_then_late_message() -> int:
    async with ag.autograd.context() as context_id:
        pass
    return deliver_late_message(context_id)


def _note_tell_threads() -> None:
    """On this worker, note for each tell whether it was sent from the loop's thread."""
    worker = get_worker()
    loop_thread = threading.get_ident()
    worker.tell_threads = []
    tell = worker.tell

    def noting(to, target, payload):  # type: ignore[no-untyped-def]
        worker.tell_threads.append((target, threading.get_ident() == loop_thread))
        return tell(to, target, payload)

    worker.tell = noting


async def _start_noting_tells() -> None:
    _note_tell_threads()  # (a coroutine function: runs on the loop's thread)


def _context_in_a_pool_thread(x: torch.Tensor) -> float:
    """A remote function (run on the pool) with a context of its own."""
    with ag.autograd.context():
        y = ag.rpc_sync("worker2", torch.mul, args=(x, 2.0))
    return float(y.sum())


def _tells_from_other_threads() -> list[str]:
    return [target for target, on_loop in get_worker().tell_threads if not on_loop]


async def test_context_left_in_another_thread_is_released_from_the_loop(group3):
    """A context left in a thread beside the running loop (a remote function on the
    pool) sends its release through the loop: a transport is not for other threads."""
    await ag.rpc_async("worker1", _start_noting_tells)
    x = torch.rand(3)
    assert await ag.rpc_async("worker1", _context_in_a_pool_thread, args=(x,)) == pytest.approx(float(x.sum() * 2))
    await wait_released(["worker1", "worker2"])
    assert await ag.rpc_async("worker1", _tells_from_other_threads) == []


def _gradient_bytes_kept_by_backward_passes(context_id: int) -> int:
    """Bytes of the gradients this worker's backward passes of the context still hold."""
    ctx = ag.autograd._context.context_actor().contexts[context_id]
    return sum(g.numel() * g.element_size() for task in ctx.graph_tasks.values() if task.plan is not None
               for share in task.plan.recvs.values() for g in share.grads.values())


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_backward_passes_let_go_of_the_gradients_they_sent(group2, mode):
    """Each pass (retain_graph=True, in one context) left the gradients worker1 sent
    back in its state for the pass until the context ended: memory grew by the
    gradients' size with every pass."""
    x = torch.rand(64, 64, requires_grad=True)
    w = torch.rand(64, 64)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", torch.matmul, args=(x, w))
        for _ in range(3):
            await ag.autograd.backward(context_id, [y.sum()], retain_graph=True, mode=mode)
        assert await ag.rpc_async("worker1", _gradient_bytes_kept_by_backward_passes, args=(context_id,)) == 0
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    for _ in range(3):
        (lx @ w).sum().backward()
    assert_grads(grads, [(x, lx.grad)])


async def test_late_message_does_not_recreate_a_released_context(group3):
    x = rand3()
    async with ag.autograd.context() as context_id:
        await ag.rpc_async("worker1", torch.mul, args=(x, x))
    await wait_released(["worker0", "worker1"])
    # a context created elsewhere (remembered as released) and one created here
    # (known by the rank in its id) stay released
    assert await ag.rpc_async("worker1", deliver_late_message, args=(context_id,)) == 0
    assert await ag.rpc_async("worker1", own_context_then_late_message) == 0
    # a context never seen here is created by its first message, as it should
    async with ag.autograd.context() as fresh:
        assert await ag.rpc_async("worker2", deliver_late_message, args=(fresh,)) == 1


async def test_context_released_when_body_raises(group3):
    x = rand3()
    with pytest.raises(ZeroDivisionError):
        async with ag.autograd.context():
            await ag.rpc_async("worker1", nested_sync, args=(x, x))
            await ag.rpc_async("worker2", torch.mul, args=(x, x))
            raise ZeroDivisionError
    await wait_released(["worker0", "worker1", "worker2"])
    with pytest.raises(ag.RemoteError):
        async with ag.autograd.context() as context_id:
            r = await ag.rpc_async("worker1", nested_async, args=(x, x))
            await ag.autograd.backward(context_id, [r.sum()])
            await ag.rpc_async("worker2", torch.mul, args=(x,))  # wrong arity: raises remotely
    await wait_released(["worker0", "worker1", "worker2"])


async def _new_context_ids(n: int) -> list[int]:
    ids = []
    for _ in range(n):
        async with ag.autograd.context() as context_id:
            ids.append(context_id)
    return ids


def _context_id_seen_by_callee() -> int | None:
    return ag.autograd.current_context_id()


async def test_context_ids_unique_across_workers(group3):
    ids = await _new_context_ids(3)
    ids += await group3.run_as(1, _new_context_ids, 3)
    ids += await group3.run_as(2, _new_context_ids, 3)
    assert len(set(ids)) == 9
    nested = await asyncio.gather(_new_context_ids(2), group3.run_as(1, _new_context_ids, 2))
    assert len(set(ids) | set(nested[0]) | set(nested[1])) == 13
    async with ag.autograd.context() as context_id:
        assert ag.autograd.current_context_id() == context_id
        assert await ag.rpc_async("worker2", _context_id_seen_by_callee) == context_id
    assert ag.autograd.current_context_id() is None
    assert await ag.rpc_async("worker2", _context_id_seen_by_callee) is None


async def test_unknown_context_and_bad_roots(group2):
    x = rand3()
    bogus = 123456789
    with pytest.raises(ag.ContextError):
        ag.autograd.get_gradients(bogus)
    with pytest.raises(ag.ContextError):
        await ag.autograd.backward(bogus, [(x * 2).sum()])
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", torch.mul, args=(x, x))
        with pytest.raises(ag.ContextError):
            await ag.autograd.backward(context_id, [r])  # not a scalar
        with pytest.raises(ag.ContextError):
            await ag.autograd.backward(context_id, [torch.ones(())])  # no grad
        with pytest.raises(ag.ContextError):
            await ag.autograd.backward(context_id, [r.sum().detach()])
        with pytest.raises(ag.ContextError):
            await ag.autograd.backward(context_id, [])
        # the context is still usable after the failed calls
        await ag.autograd.backward(context_id, [r.sum()])
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    (lx * lx).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    with pytest.raises(ag.ContextError):
        await ag.autograd.backward(context_id, [(x * 2).sum()])
    with pytest.raises(ag.RemoteError) as info:
        await ag.rpc_async("worker1", ag.autograd.get_gradients, args=(bogus,))
    assert info.value.remote_type.endswith("ContextError")


async def test_a_local_backward_through_a_received_tensor_is_refused(group2):
    """loss.backward() cannot send a gradient back to the worker that sent a tensor:
    torch refuses it (an internal assert), and so do we, by name, instead of silently
    stopping at the RPC boundary (the remote parameters would never learn a thing)."""
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 2))
        loss = (y * y).sum()
        with pytest.raises(RuntimeError, match=r"ag\.autograd\.backward"):
            loss.backward(retain_graph=True)
        assert x.grad is None
        # a local backward that stops short of the received tensor is the user's business
        w = torch.ones(3, requires_grad=True)
        (y * w).sum().backward(inputs=[w])
        assert torch.allclose(w.grad, y.detach().sum(0))
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    ((lx * 2) * (lx * 2)).sum().backward()
    assert_grads(grads, [(x, lx.grad)])


async def test_a_local_backward_is_refused_while_the_engine_runs_on_another_thread(group2):
    """The check holds while a distributed backward runs elsewhere in the process
    (another context, another thread): it asks the thread that runs the node."""
    import threading

    from actorgrad.autograd._context import engine_calls

    x = rand3()
    async with ag.autograd.context():
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 2))
        started, release = threading.Event(), threading.Event()

        def engine_call_elsewhere() -> None:
            engine_calls.count += 1  # (as the engine's call on this thread counts itself)
            try:
                started.set()
                release.wait(10)
            finally:
                engine_calls.count -= 1

        elsewhere = threading.Thread(target=engine_call_elsewhere)
        elsewhere.start()
        try:
            assert started.wait(10)
            with pytest.raises(RuntimeError, match=r"ag\.autograd\.backward"):
                (y * y).sum().backward()
        finally:
            release.set()
            elsewhere.join(10)


# -- what travels: views, containers, parameters, modules, RRefs -----------------------------


def from_containers(d: dict, pair: tuple, view: torch.Tensor) -> torch.Tensor:
    return d["x"] * pair[0].sum() + pair[1][0] @ view + d["ys"][1].exp()


def apply_module(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).relu()


async def test_views_containers_parameters_and_modules(group2):
    a, b = rand3(), rand3()
    weight = torch.nn.Parameter(torch.rand(3, 3))
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    big = torch.rand(6, 6, requires_grad=True)
    async with ag.autograd.context() as context_id:
        r1 = await ag.rpc_async(
            "worker1",
            from_containers,
            args=(
                {"x": a.t(), "ys": [b, big[::2, 1:4]]},
                (big[1:4, 2:5], [weight]),
                a[:, 1:2].expand(3, 3),
            ),
        )
        r2 = await ag.rpc_async("worker1", apply_module, args=(module, r1 * weight))
        loss = (r2 * r1).sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    la, lb, lbig, lw = local_copies(a, b, big, weight)
    lmodule = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    lmodule.load_state_dict(module.state_dict())
    lr1 = from_containers(
        {"x": la.t(), "ys": [lb, lbig[::2, 1:4]]}, (lbig[1:4, 2:5], [lw]), la[:, 1:2].expand(3, 3)
    )
    (apply_module(lmodule, lr1 * lw) * lr1).sum().backward()
    expected = [(a, la.grad), (b, lb.grad), (big, lbig.grad), (weight, lw.grad)]
    expected += [
        (p, lp.grad) for p, lp in zip(module.parameters(), lmodule.parameters(), strict=True)
    ]
    assert_grads(grads, expected)
    assert all(p.grad is None for p in module.parameters())


async def fetch_and_mul(rref: ag.RRef, x: torch.Tensor) -> torch.Tensor:
    p = await rref.to_here()
    return p * x + p.sum()


def _rref_grad(rref: ag.RRef, context_id: int) -> torch.Tensor:
    return ag.autograd.get_gradients(context_id)[rref.local_value()]


def fetch_and_mul_blocking(rref: ag.RRef, x: torch.Tensor) -> torch.Tensor:
    """torch's pipeline tutorial style: a plain method on the callee's thread pool
    fetches its input with a blocking to_here."""
    p = rref.to_here_sync()
    return p * x + p.sum()


@pytest.mark.parametrize("fetch", [fetch_and_mul, fetch_and_mul_blocking])
async def test_rref_fetched_by_a_third_worker(group3, fetch):
    """worker0 hands an RRef to worker2's tensor to worker1, which fetches it in the
    context (awaiting to_here, or blocking in to_here_sync on its thread pool)."""
    x = rand3()
    rref = ag.remote("worker2", make_leaf, args=(3,))
    before = await rref.to_here()
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", fetch, args=(rref, x))
        await ag.autograd.backward(context_id, [(r * r).sum()])
        grads = ag.autograd.get_gradients(context_id)
        owner_grad = await ag.rpc_async("worker2", _rref_grad, args=(rref, context_id))
    lp, lx = local_copies(before, x)
    ((lp * lx + lp.sum()) ** 2).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    torch.testing.assert_close(owner_grad, lp.grad)
    await wait_released(["worker0", "worker1", "worker2"])


async def backward_on_callee(x: torch.Tensor) -> float:
    """A callee that runs the backward itself, in the caller's context (roots are local)."""
    context_id = ag.autograd.current_context_id()
    assert context_id is not None
    loss = (x.sin() * x).sum()
    await ag.autograd.backward(context_id, [loss])
    return loss.item()


async def test_backward_started_by_a_callee(group2):
    x = rand3()
    async with ag.autograd.context() as context_id:
        value = await ag.rpc_async("worker1", backward_on_callee, args=(x * 2,))
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    lloss = ((lx * 2).sin() * (lx * 2)).sum()
    lloss.backward()
    assert value == pytest.approx(lloss.item())
    assert_grads(grads, [(x, lx.grad)])


def inplace_on_input(x: torch.Tensor) -> torch.Tensor:
    x.mul_(2)
    return x.sin()


async def test_inplace_op_on_received_tensor(group2):
    a = rand3()
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", inplace_on_input, args=(a * 1.0,))
        r.add_(1)  # in-place on the result on the caller's side too
        await ag.autograd.backward(context_id, [(r * r).sum()])
        grads = ag.autograd.get_gradients(context_id)
    (la,) = local_copies(a)
    lr = inplace_on_input(la * 1.0)
    lr.add_(1)
    (lr * lr).sum().backward()
    assert_grads(grads, [(a, la.grad)])



def times2(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_rpc_under_no_grad_is_not_recorded(group2, mode):
    """As in torch: under no_grad nothing is recorded on either side; the result is a
    leaf (it requires grad, as the callee computed it with grad) that gets its own
    gradient in the context, and the arguments get none through that call."""
    x, w = rand3(), rand3()
    async with ag.autograd.context() as context_id:
        with torch.no_grad():
            metric = await ag.rpc_async("worker1", times2, args=(x,))
        assert metric.requires_grad and metric.grad_fn is None
        y = await ag.rpc_async("worker1", times2, args=(w,))
        await ag.autograd.backward(context_id, [(y + 3 * metric).sum()], mode=mode)
        grads = ag.autograd.get_gradients(context_id)
    assert_grads(grads, [(w, torch.full_like(w, 2.0)), (metric, torch.full_like(metric, 3.0)), (x, None)])
    await wait_released(["worker0", "worker1"])


async def test_leaves_given_one_gradient_tensor_get_their_own(group2):
    """y = a + b hands both leaves the same tensor; as with torch's AccumulateGrad each
    leaf's context gradient is its own (scaling one in place leaves the other)."""
    a, b, c, d = rand3(), rand3(), rand3(), rand3()
    k = torch.rand(3, 3)  # a dense gradient (the sum's alone is broadcast, stored apart)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", torch.add, args=(a, b))
        await ag.autograd.backward(context_id, [((y + c + d) * k).sum()])
        grads = ag.autograd.get_gradients(context_id)
    for one, other in ((a, b), (c, d)):
        assert grads[one].data_ptr() != grads[other].data_ptr()
        grads[one].mul_(0.5)
        torch.testing.assert_close(grads[other], k)
        torch.testing.assert_close(grads[one], k * 0.5)


KEPT_GRADIENT = torch.tensor([1.0, 2.0, 3.0])


class ReturnsAKeptGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return KEPT_GRADIENT


async def test_gradients_that_user_code_keeps_are_copied_into_the_context(group2):
    """A backward function or a hook may return a tensor it keeps; as torch's
    AccumulateGrad does, the context stores a copy, so changing the context's gradient
    in place (an optimizer, clipping) leaves the kept tensor alone."""
    kept_by_hook = torch.tensor([5.0, 6.0, 7.0])
    w, v, x = torch.rand(3, requires_grad=True), torch.rand(3, requires_grad=True), torch.rand(3, requires_grad=True)
    v.register_hook(lambda grad: kept_by_hook)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 2.0))
        z = await ag.rpc_async("worker1", torch.mul, args=(v, 3.0))
        loss = ReturnsAKeptGradient.apply(w).sum() + y.sum() + z.sum()
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    lw, lv, lx = local_copies(w, v, x)
    lv.register_hook(lambda grad: kept_by_hook)
    (ReturnsAKeptGradient.apply(lw).sum() + (lx * 2.0).sum() + (lv * 3.0).sum()).backward()
    assert_grads(grads, [(w, lw.grad), (v, lv.grad), (x, lx.grad)])
    for grad in grads.values():
        grad.zero_()
    assert torch.equal(KEPT_GRADIENT, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(kept_by_hook, torch.tensor([5.0, 6.0, 7.0]))


def test_only_gradients_held_elsewhere_are_cloned():
    from actorgrad.autograd._engine import _unshared

    fresh, twice, kept = torch.ones(2), torch.ones(2), torch.ones(2)
    pointers = (fresh.data_ptr(), twice.data_ptr())
    results = (fresh, twice, twice, kept, None, torch.ones(1))
    del fresh, twice  # as torch hands them over: the results alone hold them
    out = _unshared(results, 5)
    assert (out[0].data_ptr(), out[1].data_ptr()) == pointers and out[2] is out[1]  # (accumulate clones one)
    assert out[3] is not kept and torch.equal(out[3], kept) and out[4] is None
    assert out[5] is results[5]  # not a leaf's: left alone


def sparse_lookup(idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.embedding(idx, weight, sparse=True).sum(1)


async def test_sparse_gradients_travel_and_accumulate(group2):
    """An embedding with sparse=True on the callee sends its weight's sparse gradient
    back; retain_graph=True twice sums two of them in the context."""
    weight = rand3(10, 4)
    idx = torch.tensor([[1, 2], [2, 7]])
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", sparse_lookup, args=(idx, weight))
        loss = (y * y).sum()
        await ag.autograd.backward(context_id, [loss], retain_graph=True)
        await ag.autograd.backward(context_id, [loss])
        grads = ag.autograd.get_gradients(context_id)
    (lw,) = local_copies(weight)
    (sparse_lookup(idx, lw) ** 2).sum().backward()
    assert grads[weight].is_sparse
    torch.testing.assert_close(grads[weight].to_dense(), 2 * lw.grad.to_dense())


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_tensor_changed_in_place_after_it_was_sent(group3, mode):
    """The gradient from the peer belongs to the history a tensor had when it went
    (torch hangs SendRpcBackward there), not through in-place ops made afterwards: on
    an argument, and on a received result passed on to a third worker."""
    w = rand3()
    async with ag.autograd.context() as context_id:
        h = w * 1
        y = await ag.rpc_async("worker1", times2, args=(h,))
        h.mul_(3)  # after the send
        z = await ag.rpc_async("worker2", times2, args=(y,))
        y.add_(h)  # a received tensor, after it was passed on
        loss = (z * z).sum() + (h * y).sum()
        await ag.autograd.backward(context_id, [loss], mode=mode)
        grads = ag.autograd.get_gradients(context_id)
    (lw,) = local_copies(w)
    lh = lw * 1
    ly = times2(lh)
    lh.mul_(3)
    lz = times2(ly)
    ly.add_(lh)
    ((lz * lz).sum() + (lh * ly).sum()).backward()
    assert_grads(grads, [(w, lw.grad)])

# -- cost: every send/recv pair carries gradients once per backward ---------------------------


def expert(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


async def _moe_forward(
    x: torch.Tensor, ws: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    for w1, w2 in ws:  # every layer: two experts on two workers, combined on worker0
        e1, e2 = await asyncio.gather(
            ag.rpc_async("worker1", expert, args=(x, w1)),
            ag.rpc_async("worker2", expert, args=(x, w2)),
        )
        x = (e1 + e2) / 2
    return x


async def test_fan_out_fan_in_layers_propagate_once_per_pair(make_group, monkeypatch):
    """Mixture-of-experts shape: at every layer x goes to two workers, the results rejoin."""
    calls = []
    original = ag.autograd.EngineActor._serve  # every PROPAGATE_GRADS, called or passed on

    def counting(self, msg, *rest):  # type: ignore[no-untyped-def]
        calls.append(self.worker.rank)
        return original(self, msg, *rest)

    monkeypatch.setattr(ag.autograd.EngineActor, "_serve", counting)
    await make_group(3)
    layers = 8
    x = torch.rand(2, 4, requires_grad=True)
    ws = [(rand3(4, 4), rand3(4, 4)) for _ in range(layers)]
    async with ag.autograd.context() as context_id:
        out = await _moe_forward(x, ws)
        await asyncio.wait_for(ag.autograd.backward(context_id, [out.sum()]), 30)
        grads = ag.autograd.get_gradients(context_id)
    lx, *lws = local_copies(x, *(w for pair in ws for w in pair))
    lout = lx
    for i in range(layers):
        lout = (expert(lout, lws[2 * i]) + expert(lout, lws[2 * i + 1])) / 2
    lout.sum().backward()
    # the gradients are right either way ...
    assert_grads(
        grads,
        [
            (x, lx.grad),
            *((w, lw.grad) for w, lw in zip((w for pair in ws for w in pair), lws, strict=True)),
        ],
    )
    # ... but each of the 4 send/recv pairs per layer should carry gradients exactly once
    # (a job per arriving gradient would double the propagations at every layer)
    assert len(calls) == 4 * layers, f"{len(calls)} PROPAGATE_GRADS for {4 * layers} pairs"


async def test_leaf_arguments_get_their_gradients_with_and_without_hooks(group2):
    """An RPC's leaf arguments end the backward on the caller: without a hook their
    gradients are delivered as they arrive; a hook on a leaf still sees (and may
    change) its gradient, as in local autograd."""
    plain, hooked, twice = rand3(), rand3(), rand3()
    hooked.register_hook(lambda g: g * 3)
    async with ag.autograd.context() as context_id:
        a = await ag.rpc_async("worker1", torch.sin, args=(plain,))
        b = await ag.rpc_async("worker1", torch.mul, args=(hooked, twice))
        c = await ag.rpc_async("worker1", torch.add, args=(twice, twice))
        await ag.autograd.backward(context_id, [(a * b + c).sum()])
        grads = ag.autograd.get_gradients(context_id)
    lp, lh, lt = local_copies(plain, hooked, twice)
    lh.register_hook(lambda g: g * 3)
    (torch.sin(lp) * (lh * lt) + (lt + lt)).sum().backward()
    assert_grads(grads, [(plain, lp.grad), (hooked, lh.grad), (twice, lt.grad)])


def make_leaf_with_a_calling_hook(n: int) -> torch.Tensor:
    """A leaf whose hook asks worker0 for what to add: a blocking call in a hook, which
    torch's distributed autograd runs on its own threads."""
    leaf = torch.arange(float(n)).requires_grad_()
    leaf.register_hook(lambda g: g + ag.rpc_sync("worker0", torch.full, args=((n,), 0.5)))
    return leaf


def times_held(rref: ag.RRef, x: torch.Tensor) -> torch.Tensor:
    return rref.local_value() * x


async def test_a_hook_that_calls_another_worker_runs_off_the_loop(group2):
    """A tensor hook is user Python that may block (here an rpc_sync): the backward job
    that runs it goes to the pool, as a custom Function's does, never the event loop
    (where the blocking call was refused and the backward failed)."""
    rref = ag.remote("worker1", make_leaf_with_a_calling_hook, args=(3,))
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", times_held, args=(rref, x))
        await ag.autograd.backward(context_id, [(y * y).sum()])
        grads = ag.autograd.get_gradients(context_id)
        owner_grad = await ag.rpc_async("worker1", _rref_grad, args=(rref, context_id))
    lw = torch.arange(3.0).requires_grad_()
    lw.register_hook(lambda g: g + 0.5)
    (lx,) = local_copies(x)
    ((lw * lx) ** 2).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    torch.testing.assert_close(owner_grad, lw.grad)


async def test_broadcast_gradient_travels_as_its_values_and_arrives_dense(group2, monkeypatch):
    """d(y.sum())/dy is one value expanded to y's shape: PROPAGATE_GRADS carries that
    value, not 256 KiB of ones; and gradients handed out are dense and writable."""
    sizes: list[int] = []
    dump = ag.autograd._messages.PropagateGrads.dump

    def measured(self):  # type: ignore[no-untyped-def]
        payload = dump(self)
        sizes.append(payload.nbytes)
        return payload

    monkeypatch.setattr(ag.autograd._messages.PropagateGrads, "dump", measured)
    x = torch.rand(256, 256, requires_grad=True)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", torch.sin, args=(x,))
        await ag.autograd.backward(context_id, [y.sum() + x.sum()])
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    (torch.sin(lx).sum() + lx.sum()).backward()
    assert_grads(grads, [(x, lx.grad)])
    assert sorted(sizes)[0] < 2048 < x.numel() * 4 <= sorted(sizes)[-1]  # ones out, cos(x) back
    grads[x].add_(1)  # dense: writable in place

    async with ag.autograd.context() as context_id:
        await ag.autograd.backward(context_id, [x.sum()])  # a local root's gradient
        (g,) = ag.autograd.get_gradients(context_id).values()
    assert g.is_contiguous() and torch.equal(g, torch.ones_like(x))
    g.mul_(2)


def times_two(x: torch.Tensor) -> torch.Tensor:
    return x * 2


async def test_received_tensors_passed_on_as_they_came(group2):
    """Results passed straight into the next call (a chain): each hop's gradient goes
    to the recv leaf unchanged; passed twice, or with a hook, torch still does it."""
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = x
        for _ in range(3):
            y = await ag.rpc_async("worker1", times_two, args=(y,))
        z = await ag.rpc_async("worker1", torch.mul, args=(y, y))  # one received tensor, twice
        w = await ag.rpc_async("worker1", times_two, args=(z,))
        w.register_hook(lambda g: g * 5)
        v = await ag.rpc_async("worker1", torch.sin, args=(w,))
        await ag.autograd.backward(context_id, [v.sum()])
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    ly = lx * 8
    lw = (ly * ly) * 2
    lw.register_hook(lambda g: g * 5)
    torch.sin(lw).sum().backward()
    assert_grads(grads, [(x, lx.grad)])


async def test_bad_arguments_are_refused_before_the_backward_starts(group2):
    """A retain_graph that is no bool failed halfway, leaving the context unusable; the
    others raised internal errors. They are refused at the call, and a correct
    backward in the same context then works."""
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 2.0))
        loss = y.sum()
        with pytest.raises(TypeError, match="retain_graph must be True or False"):
            await ag.autograd.backward(context_id, [loss], retain_graph="no")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="roots must be a tensor or a sequence"):
            await ag.autograd.backward(context_id, None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="context_id must be the int"):
            await ag.autograd.backward("x", [loss])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="context_id must be the int"):
            ag.autograd.get_gradients(None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="graph roots must be tensors"):
            ag.autograd.graph(context_id, [None])  # type: ignore[list-item]
        assert (await ag.autograd.graph(context_id, loss)).nodes  # one tensor, as backward takes
        rref = ag.remote("worker1", torch.ones, args=(1,))
        with pytest.raises(TypeError, match="retain_graph"):
            await rref.backward(context_id, retain_graph="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="dist_autograd_ctx_id must be an int"):
            await rref.backward("x")  # type: ignore[arg-type]
        await ag.autograd.backward(context_id, [loss])
        torch.testing.assert_close(ag.autograd.get_gradients(context_id)[x], torch.full((3,), 2.0))


async def test_a_context_object_is_in_one_context_at_a_time(group2):
    """Entered again while in use, an autograd.context() says so (it left the first
    context behind, never released); once left it may be entered again, as torch's."""
    manager = ag.autograd.context()
    async with manager as first:
        with pytest.raises(RuntimeError, match=f"in use already \\(context {first}\\)"):
            async with manager:
                pass
        assert ag.autograd.debug_info()["num_autograd_contexts"] == 1
    assert ag.autograd.debug_info()["num_autograd_contexts"] == 0
    async with manager as again:
        assert again != first
    assert ag.autograd.debug_info()["num_autograd_contexts"] == 0
    with pytest.raises(RuntimeError, match="left without being entered"):
        await ag.autograd.context().__aexit__(None, None, None)
