"""Distributed backward when things go wrong: remote errors, lost workers, unused RPCs,
and a loop that must keep serving while a big backward runs."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch
from _ag_helpers import assert_grads, debug_infos, local_copies, slow_backward_fn, wait_released

import actorgrad as ag
from actorgrad.autograd._engine import _all_or_first_error
from actorgrad.runtime import get_worker


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise ValueError("backward exploded on purpose 4711")


def failing_fn(x: torch.Tensor) -> torch.Tensor:
    return FailingBackward.apply(x) + x


async def nested_failing(x: torch.Tensor) -> torch.Tensor:
    y = await ag.rpc_async("worker2", failing_fn, args=(x * 3,))
    return y * x


def rand3() -> torch.Tensor:
    return torch.rand(3, 3, requires_grad=True)


# -- remote errors ----------------------------------------------------------------------------


async def test_remote_error_during_backward(group2):
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", failing_fn, args=(x,))
        with pytest.raises(ag.RemoteError) as info:
            await asyncio.wait_for(ag.autograd.backward(context_id, [(y * x).sum()]), 10)
        assert "backward exploded on purpose 4711" in str(info.value)
        assert "ValueError" in str(info.value)
    await wait_released(["worker0", "worker1"])


async def test_remote_error_two_hops_away(group3):
    x = rand3()
    with pytest.raises(ag.RemoteError) as info:
        async with ag.autograd.context() as context_id:
            y = await ag.rpc_async("worker1", nested_failing, args=(x,))
            await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)
    assert "backward exploded on purpose 4711" in str(info.value)
    await wait_released(["worker0", "worker1", "worker2"])


async def test_every_failure_of_propagations_that_failed_together_is_read():
    """Where several propagations a job waits for failed by the time it looks, the
    first (in order) is raised and every other is read too: asyncio logs a failure
    never read ("exception was never retrieved", a remote traceback each)."""
    loop = asyncio.get_running_loop()
    logged: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: logged.append(context))
    try:
        futures = [loop.create_future() for _ in range(3)]
        futures[0].set_result(None)
        futures[1].set_exception(ValueError("first"))
        futures[2].set_exception(ValueError("second"))
        with pytest.raises(ValueError, match="first"):
            await _all_or_first_error(futures)
        del futures
        gc.collect()
        await asyncio.sleep(0)
        assert logged == []
    finally:
        loop.set_exception_handler(None)


# -- a worker dies in the middle of the backward ------------------------------------------------


@pytest.mark.slow
async def test_worker_killed_during_backward(make_process_group):
    group = await make_process_group(2)

    slow_fn = slow_backward_fn(3)

    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", slow_fn, args=(x,))
        task = asyncio.ensure_future(ag.autograd.backward(context_id, [(y * y).sum()]))
        await asyncio.sleep(0.5)
        assert not task.done()
        assert ag.autograd.debug_info()["num_current_backward_passes"] >= 1
        started = time.monotonic()
        group.kill(1)
        with pytest.raises((ag.WorkerLost, ag.RemoteError)) as info:
            await asyncio.wait_for(task, 10)
        assert time.monotonic() - started < 10
        if isinstance(info.value, ag.RemoteError):
            assert "WorkerLost" in str(info.value) or isinstance(
                info.value.__cause__, ag.WorkerLost
            )
        assert ag.autograd.debug_info()["num_current_backward_passes"] == 0
    info_after = ag.autograd.debug_info()
    assert info_after["num_current_backward_passes"] == 0
    assert info_after["num_autograd_contexts"] == 0


def _optimizers_here() -> int:
    from actorgrad.runtime import get_worker

    return len(get_worker().extensions["optim"].optimizers)


async def test_what_a_killed_worker_created_here_is_freed(make_process_group):
    # a trainer that dies can never release its context or drop its optimizer: the
    # parameter server (worker0 here) must not keep them, and their graphs, for good
    async def trainer_holding_a_context_and_an_optimizer(param: ag.RRef) -> None:
        # defined here: it travels to the worker process by value
        opt = ag.optim.DistributedOptimizer(torch.optim.SGD, [param], lr=0.1)
        async with ag.autograd.context():
            await ag.rpc_async("worker0", torch.mul, args=(torch.ones(2, requires_grad=True), 2.0))
            await asyncio.sleep(60)  # killed in here: it never leaves the context
        del opt

    group = await make_process_group(2)
    param = ag.RRef(torch.ones(2, requires_grad=True))
    trainer = ag.rpc_async("worker1", trainer_holding_a_context_and_an_optimizer, args=(param,), timeout=0)
    deadline = time.monotonic() + 10
    while ag.autograd.debug_info()["num_autograd_contexts"] == 0 or _optimizers_here() == 0:
        assert time.monotonic() < deadline and not trainer.done()
        await asyncio.sleep(0.02)
    group.kill(1)
    with pytest.raises(ag.WorkerLost):
        await asyncio.wait_for(trainer, 10)
    deadline = time.monotonic() + 5
    while ag.autograd.debug_info()["num_autograd_contexts"] or _optimizers_here():
        assert time.monotonic() < deadline, (ag.autograd.debug_info(), _optimizers_here())
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_worker_killed_two_hops_away(make_process_group):
    """worker0 -> worker1 -> worker2; worker2 dies while it backpropagates."""
    group = await make_process_group(3)

    slow_fn = slow_backward_fn(3)

    async def via_worker1(x):  # type: ignore[no-untyped-def]
        return (await ag.rpc_async("worker2", slow_fn, args=(x * 3,))) * x

    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", via_worker1, args=(x,))
        task = asyncio.ensure_future(ag.autograd.backward(context_id, [y.sum()]))
        await asyncio.sleep(0.5)
        assert not task.done()
        group.kill(2)
        with pytest.raises((ag.WorkerLost, ag.RemoteError)) as info:
            await asyncio.wait_for(task, 10)
        if isinstance(info.value, ag.RemoteError):
            assert "WorkerLost" in str(info.value) or "lost" in str(info.value)
    await wait_released(["worker0", "worker1"], timeout=5)


def _lost_here(rank: int) -> bool:
    return rank not in get_worker().peers


@pytest.mark.parametrize("leave", ["after the loss was seen", "at once"])
async def test_a_share_reached_only_through_a_lost_worker_is_released(make_process_group, leave):
    """worker0 -> worker2 -> worker1, then worker2 dies: worker0's release can no longer
    travel the way worker1 heard of the context. worker1 tells the creator it holds a
    share, which is released with the rest, or at once when the context is gone."""
    group = await make_process_group(3)

    async def via_worker2(x):  # type: ignore[no-untyped-def]
        return (await ag.rpc_async("worker1", torch.mul, args=(x, 2.0))) + 1

    x = rand3()
    async with ag.autograd.context():
        await ag.rpc_async("worker2", via_worker2, args=(x,))
        with torch.no_grad():  # calls that the context does not record: worker1 stays unknown here
            assert (await debug_infos(["worker1"]))["worker1"]["num_autograd_contexts"] == 1
            group.kill(2)
            if leave == "after the loss was seen":
                deadline = time.monotonic() + 10
                while not (_lost_here(2) and await ag.rpc_async("worker1", _lost_here, args=(2,))):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
    await wait_released(["worker0", "worker1"], timeout=5)


class SleepyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        time.sleep(1.0)
        return grad * 2


def sleepy_fn(x: torch.Tensor) -> torch.Tensor:
    return SleepyBackward.apply(x)


async def test_backward_times_out_with_rpc_timeout(make_group):
    await make_group(2, ag.RpcOptions(rpc_timeout=0.3))
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", sleepy_fn, args=(x,))
        started = time.monotonic()
        with pytest.raises(ag.RpcTimeout):
            await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)
        assert time.monotonic() - started < 5  # raised, not waited out
    await wait_released(["worker0", "worker1"])


@pytest.mark.parametrize("peers", [1, 2])
async def test_a_cancelled_backward_calls_off_what_it_waits_for(make_group, peers):
    """The caller gives up (a timeout) while the pass waits on one peer or on several:
    every call of the pass is cancelled with it (with several, they ran on and wrote
    gradients into the context after backward had raised)."""
    await make_group(peers + 1)
    slow_fn = slow_backward_fn(1.0)
    x = rand3()
    async with ag.autograd.context() as context_id:
        ys = [await ag.rpc_async(f"worker{r}", slow_fn, args=(x,)) for r in range(1, peers + 1)]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await ag.autograd.backward(context_id, [sum(y.sum() for y in ys)])
        await asyncio.sleep(0)  # (the cancellations go out)
        assert not get_worker()._pending, "calls of the cancelled pass still pending"
        await asyncio.sleep(1.5)  # the peers' backward nodes ended meanwhile
        assert ag.autograd.get_gradients(context_id) == {}
    await wait_released([f"worker{r}" for r in range(peers + 1)])


# -- unused RPCs: FAST mode refuses, SMART mode skips -----------------------------------------------


async def _unused_rpc_forward():
    a, b, c = rand3(), rand3(), rand3()
    d = await ag.rpc_async("worker1", torch.add, args=(a, b))
    e = await ag.rpc_async("worker1", torch.mul, args=(b, c))
    return (a, b, c), d, e


async def test_unused_rpc_fast_mode_raises(group2):
    async with ag.autograd.context() as context_id:
        _, d, _e = await _unused_rpc_forward()
        with pytest.raises(ag.ContextError, match="smart"):
            await asyncio.wait_for(ag.autograd.backward(context_id, [d.sum()], mode="fast"), 10)
    await wait_released(["worker0", "worker1"])


async def test_no_backward_after_a_failed_one_in_the_same_context(group2):
    """A failed pass has already added some gradients (FAST mode: those of the used RPCs):
    another backward there would add to those partial ones, so it is refused, naming
    why; the forward run again in a new context in SMART mode gives local autograd's."""
    async with ag.autograd.context() as context_id:
        (a, b, c), d, _e = await _unused_rpc_forward()
        with pytest.raises(ag.ContextError, match="new context"):
            await asyncio.wait_for(
                ag.autograd.backward(context_id, [d.sum()], retain_graph=True, mode="fast"), 10
            )
        with pytest.raises(ag.ContextError, match="failed.*partial"):
            await asyncio.wait_for(
                ag.autograd.backward(context_id, [d.sum()], mode="smart"), 10
            )
    x = rand3()
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", failing_fn, args=(x,))
        with pytest.raises(ag.RemoteError):
            await asyncio.wait_for(
                ag.autograd.backward(context_id, [(y * x).sum()], retain_graph=True), 10
            )
        with pytest.raises(ag.ContextError, match="RemoteError"):
            await asyncio.wait_for(ag.autograd.backward(context_id, [x.sum()]), 10)
    async with ag.autograd.context() as context_id:
        (a, b, c), d, _e = await _unused_rpc_forward()
        await asyncio.wait_for(ag.autograd.backward(context_id, [d.sum()], mode="smart"), 10)
        grads = ag.autograd.get_gradients(context_id)
    la, lb, lc = local_copies(a, b, c)
    (la + lb).sum().backward()
    assert_grads(grads, [(a, la.grad), (b, lb.grad), (c, None)])
    await wait_released(["worker0", "worker1"])


async def test_unused_rpc_smart_mode_skips(group2):
    async with ag.autograd.context() as context_id:
        (a, b, c), d, _e = await _unused_rpc_forward()
        await asyncio.wait_for(ag.autograd.backward(context_id, [d.sum()], mode="smart"), 10)
        grads = ag.autograd.get_gradients(context_id)
    la, lb, lc = local_copies(a, b, c)
    _le = lb * lc
    (la + lb).sum().backward()
    assert lc.grad is None
    assert_grads(grads, [(a, la.grad), (b, lb.grad), (c, None)])
    await wait_released(["worker0", "worker1"])


async def test_smart_mode_as_default_option(make_group):
    await make_group(2, ag.RpcOptions(autograd_mode="smart"))
    async with ag.autograd.context() as context_id:
        (a, b, c), d, _e = await _unused_rpc_forward()
        await asyncio.wait_for(
            ag.autograd.backward(context_id, [(d * d).sum()], retain_graph=True), 10
        )
        grads = {t: g.clone() for t, g in ag.autograd.get_gradients(context_id).items()}
        # an explicit mode still wins over the default
        with pytest.raises(ag.ContextError, match="smart"):
            await asyncio.wait_for(
                ag.autograd.backward(context_id, [(d * 2).sum()], mode="fast"), 10
            )
    la, lb, lc = local_copies(a, b, c)
    ((la + lb) * (la + lb)).sum().backward()
    assert_grads(grads, [(a, la.grad), (b, lb.grad), (c, None)])


async def nested_with_unused(x: torch.Tensor) -> torch.Tensor:
    """On worker1: one nested RPC to worker2 is used, one is not."""
    used = await ag.rpc_async("worker2", torch.sin, args=(x,))
    _unused = await ag.rpc_async("worker2", torch.cos, args=(x * 5,))
    return used * x


async def nested_with_unused_leaf(x: torch.Tensor) -> torch.Tensor:
    """On worker1: a nested RPC to worker2 with a fresh leaf of its own, never used."""
    _unused = await ag.rpc_async("worker2", torch.cos, args=(torch.ones(7, requires_grad=True),))
    return x * 2


async def test_unused_rpc_is_described_by_the_worker_that_made_it(group3):
    """Only worker1's call to worker2 (and its answer) stay silent: the error names it
    as worker1, which recorded it, describes it."""
    x = rand3()
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", nested_with_unused_leaf, args=(x,))
        unused = r"2 RPC send/recv pair\(s\).*\(rank 1: tensors of shape \(7,\) sent to rank 2\).*smart"
        with pytest.raises(ag.ContextError, match=unused):
            await asyncio.wait_for(ag.autograd.backward(context_id, [r.sum()]), 10)
    await wait_released(["worker0", "worker1", "worker2"])


async def test_unused_rpc_named_rather_than_a_used_one_it_holds_up(group3):
    """The unused call takes a used call's output as its argument: the used call's
    pair waits for the unused one's share and stays silent too, and has the lower id.
    The error names the call whose output nothing used."""
    x = torch.rand(4, requires_grad=True)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 2.0))  # used
        _unused = await ag.rpc_async("worker2", torch.sin, args=(y[:2].clone(),))
        with pytest.raises(ag.ContextError, match=r"shape \(2,\) (sent to|received from)") as info:
            await asyncio.wait_for(ag.autograd.backward(context_id, [(y * y).sum()]), 10)
        assert "shape (4,)" not in str(info.value)


async def _backward_of_a_used_call(context_id: int, x: torch.Tensor, mode: str) -> dict[torch.Tensor, torch.Tensor]:
    """A call whose output the loss uses, after the failed ones; its backward's gradients."""
    y = await ag.rpc_async("worker1", torch.mul, args=(x, 3.0))
    await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()], mode=mode), 10)
    return ag.autograd.get_gradients(context_id)


def _assert_three_times(grads: dict[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
    (lx,) = local_copies(x)
    (lx * 3.0).sum().backward()
    assert_grads(grads, [(x, lx.grad)])


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_a_remote_whose_creation_failed_is_no_pair_of_the_context(group2, mode):
    """remote() calls whose function raised or that timed out: the owner forgets its
    recv as the callee of a failed rpc_async does (FAST mode waited for it)."""
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as context_id:
        for rref in (ag.remote("worker1", _raise_on, args=(x,)),
                     ag.remote("worker1", _sleepy, args=(x, 0.6), timeout=0.2)):
            with pytest.raises((ag.RemoteError, ag.RpcTimeout)):
                await rref.to_here()
        await asyncio.sleep(0.7)  # the slow one has returned by now
        grads = await _backward_of_a_used_call(context_id, x, mode)
    _assert_three_times(grads, x)


async def _nested_then_raise(x: torch.Tensor) -> torch.Tensor:
    await ag.rpc_async("worker2", torch.mul, args=(x, 2.0))
    raise ValueError("failed after its nested call")


async def test_a_failed_call_that_made_rpcs_of_its_own_says_so(group3):
    """The RPCs a failed call made before it ended stay in the context: FAST mode
    cannot finish there, and says why and what to do rather than blaming another
    context; SMART mode leaves them out."""
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as context_id:
        with pytest.raises(ag.RemoteError, match="failed after its nested call"):
            await ag.rpc_async("worker1", _nested_then_raise, args=(x,))
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 3.0))
        with pytest.raises(ag.RemoteError, match="a call that failed or was given up on"):
            await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()], retain_graph=True), 10)
    async with ag.autograd.context() as context_id:
        with pytest.raises(ag.RemoteError, match="failed after its nested call"):
            await ag.rpc_async("worker1", _nested_then_raise, args=(x,))
        grads = await _backward_of_a_used_call(context_id, x, "smart")
    _assert_three_times(grads, x)


async def _block_the_loop_then_double(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.8)  # noqa: ASYNC251 - on purpose: the cancel is read after the reply left
    return x * 2


async def test_a_call_given_up_on_whose_reply_came_anyway_is_described(make_process_group):
    """The callee answered before it read the caller's cancel, so its side of the pair
    stays; FAST mode names the pair, described by the caller as one it gave up on."""
    await make_process_group(2)  # (the callee blocks its own loop, not ours)
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as context_id:
        with pytest.raises(ag.RpcTimeout):
            await ag.rpc_async("worker1", _block_the_loop_then_double, args=(x,), timeout=0.3)
        await asyncio.sleep(0.8)  # the late answer came and was dropped
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 3.0))
        with pytest.raises(ag.ContextError, match=r"shape \(3,\) sent to rank 1, by a call that failed or was given up on"):
            await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)


async def test_a_remote_given_up_on_is_not_fetched_when_its_value_came_anyway(make_process_group):
    """remote(timeout=...) gave up while the owner, its loop busy, still made the value:
    to_here raises that the creation timed out, as documented, rather than hand over a
    value tied to a call the caller forgot (its backward failed with 'no send entry')."""
    await make_process_group(2)  # (the owner blocks its own loop, not ours)
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as context_id:
        rref = ag.remote("worker1", _block_the_loop_then_double, args=(x,), timeout=0.3)
        await asyncio.sleep(1.0)  # the value is there by now
        with pytest.raises(ag.RpcTimeout, match="remote.. call creating RRef"):
            await rref.to_here()
        with pytest.raises(ag.RpcTimeout, match="remote.. call creating RRef"):
            await rref.rpc_async().sum()  # the proxies alike
        with pytest.raises(ag.RpcTimeout, match="remote.. call creating RRef"):
            await ag.rpc_async("worker1", _fetch, args=(rref,))  # nor is it sent on
        grads = await _backward_of_a_used_call(context_id, x, "smart")
    _assert_three_times(grads, x)


async def _fetch(rref: ag.RRef) -> torch.Tensor:
    return await rref.to_here()


async def _nested_call_timing_out(x: torch.Tensor) -> torch.Tensor:
    return await ag.rpc_async("worker0", _sleepy, args=(x, 0.5), timeout=0.1)


async def test_a_remote_whose_function_timed_out_is_not_said_to_be_given_up(group2):
    """The remote() call had no limit; its function's own call timed out: to_here
    raises that error, not that this worker gave up on the creation."""
    rref = ag.remote("worker1", _nested_call_timing_out, args=(torch.ones(2),), timeout=0)
    await asyncio.sleep(0.3)  # its creation has failed by now
    with pytest.raises(ag.RpcTimeout) as info:
        await rref.to_here()
    assert "gave up" not in str(info.value) and "_sleepy" in str(info.value)


def _function_class_of_this_call() -> type[torch.autograd.Function]:
    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x * 2

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return grad * 2

    return Doubled


async def test_function_classes_made_per_call_are_not_kept(group2):
    """autograd.Function classes made on the fly (in a factory, in a function sent by
    value) go when nothing uses them, as with plain torch: the engine used to keep
    every one it had run, and all its class captured."""
    import gc
    import weakref

    classes = []
    for _ in range(3):
        fn = _function_class_of_this_call()
        classes.append(weakref.ref(fn))
        x = torch.rand(3, requires_grad=True)
        async with ag.autograd.context() as context_id:
            y = await ag.rpc_async("worker1", torch.add, args=(fn.apply(x), 1.0))
            await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 10)
            assert torch.equal(ag.autograd.get_gradients(context_id)[x], torch.full((3,), 2.0))
        del fn, x, y
    gc.collect()
    assert [ref() for ref in classes] == [None, None, None]


async def test_unused_nested_rpc(group3):
    x = rand3()
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", nested_with_unused, args=(x,))
        with pytest.raises(ag.ContextError, match="smart"):
            await asyncio.wait_for(
                ag.autograd.backward(context_id, [r.sum()], retain_graph=True), 10
            )
    async with ag.autograd.context() as context_id:
        r = await ag.rpc_async("worker1", nested_with_unused, args=(x,))
        await asyncio.wait_for(ag.autograd.backward(context_id, [r.sum()], mode="smart"), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    (torch.sin(lx) * lx).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
    await wait_released(["worker0", "worker1", "worker2"])


# -- the event loop keeps serving during a big backward ------------------------------------------


def long_chain(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x @ w)
    return x


def small_python_fn(x: torch.Tensor) -> torch.Tensor:
    return x + 1


async def test_loop_responsive_during_big_backward(group2):
    torch.manual_seed(0)
    size, depth = 256, 200
    x = torch.randn(size, size, requires_grad=True)
    w = (torch.randn(size, size) / size**0.5).requires_grad_()
    small = torch.ones(4)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", long_chain, args=(x, w, depth))
        loss = y.sum()
        start = time.monotonic()
        backward = asyncio.ensure_future(ag.autograd.backward(context_id, [loss]))
        # wait until worker1 is busy with its part of the graph
        while (await ag.rpc_async("worker1", ag.autograd.debug_info))[
            "num_current_backward_passes"
        ] == 0:
            assert not backward.done() and time.monotonic() - start < 10
            await asyncio.sleep(0.005)
        latencies, overlapped = [], 0
        for i in range(20):
            t0 = time.monotonic()
            if i % 2:
                out = await ag.rpc_async("worker1", torch.add, args=(small, small))
            else:
                out = await ag.rpc_async("worker1", small_python_fn, args=(small,))
            latencies.append(time.monotonic() - t0)
            overlapped += not backward.done()
            assert out.shape == (4,)
        await asyncio.wait_for(backward, 60)
        grads = ag.autograd.get_gradients(context_id)
    assert max(latencies) < 0.5, latencies
    assert overlapped >= 5, f"the backward ended before most small RPCs ran ({overlapped})"
    lx, lw = local_copies(x, w)
    long_chain(lx, lw, depth).sum().backward()
    assert_grads(grads, [(x, lx.grad), (w, lw.grad)])


def wide_graph(x: torch.Tensor, depth: int) -> torch.Tensor:
    """About 100 * len(x) autograd nodes, but only ``2 * depth + 3`` deep."""
    rows = []
    for row in x.unbind():
        for _ in range(depth):
            row = row * 1.0001 + 0.001
        rows.append(row)
    return torch.stack(rows)


async def _max_loop_stall(stop: asyncio.Event) -> float:
    worst, period = 0.0, 0.01
    while not stop.is_set():
        t0 = time.monotonic()
        await asyncio.sleep(period)
        worst = max(worst, time.monotonic() - t0 - period)
    return worst


async def _backward_watching_the_loop(fn, x):  # type: ignore[no-untyped-def]
    """Gradients of ``sum(worker1: fn(x))`` and the worst stall of this (shared) event
    loop while the backward ran."""
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", fn, args=(x,))
        stop = asyncio.Event()
        monitor = asyncio.ensure_future(_max_loop_stall(stop))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 60)
        stop.set()
        stall = await monitor
        return ag.autograd.get_gradients(context_id), stall


def many_nodes(x: torch.Tensor) -> torch.Tensor:
    return wide_graph(x, 50)  # ~120k nodes for 1200 rows


async def test_loop_responsive_while_planning_a_graph_of_many_nodes(group2):
    x = torch.rand(1200, 4, requires_grad=True)
    grads, stall = await _backward_watching_the_loop(many_nodes, x)
    torch.testing.assert_close(grads[x], torch.full_like(x, 1.0001**50))
    assert stall < 0.5, f"the event loop stalled for {stall:.2f}s during the backward"


async def test_loop_responsive_while_a_small_custom_backward_runs(group2):
    # a tiny job, but a custom Function's backward is user Python of any length (here
    # 1 s): on the event loop it would stall the worker (heartbeats, other peers)
    x = torch.rand(3, requires_grad=True)
    grads, stall = await _backward_watching_the_loop(slow_backward_fn(1.0), x)
    assert_grads(grads, [(x, torch.full_like(x, 2.0))])
    assert stall < 0.5, f"the event loop stalled for {stall:.2f}s during the backward"


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_roots_reaching_a_tensor_of_another_context_raise(group2, mode):
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as outer:
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 2.0))
        async with ag.autograd.context() as inner:
            with pytest.raises(ag.ContextError, match="another distributed autograd context"):
                await ag.autograd.backward(inner, [y.sum()], mode=mode)
            assert ag.autograd.get_gradients(inner) == {}  # nothing leaked into it
        await ag.autograd.backward(outer, [y.sum()], mode=mode)  # its own context is fine
        assert_grads(ag.autograd.get_gradients(outer), [(x, torch.full_like(x, 2.0))])
    await wait_released(["worker0", "worker1"])


@pytest.mark.slow
async def test_deep_graph_released_without_crashing_the_worker(make_process_group):
    group = await make_process_group(2)

    def deep_chain(x, n):  # type: ignore[no-untyped-def]  (sent by value)
        for _ in range(n):
            x = x * 1.0 + 0.001
        return x

    x = torch.rand(4, requires_grad=True)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", deep_chain, args=(x, 30_000))  # 60k nodes there
        await asyncio.wait_for(ag.autograd.backward(context_id, [y.sum()]), 60)
        grads = ag.autograd.get_gradients(context_id)
    torch.testing.assert_close(grads[x], torch.ones_like(x))
    # worker1 releases the context (and frees its graph) now; it must still be alive
    await asyncio.sleep(0.5)
    try:
        info = await asyncio.wait_for(ag.rpc_async("worker1", ag.autograd.debug_info), 10)
    except ag.WorkerLost:
        await asyncio.sleep(0.5)
        pytest.fail(f"worker1 died after the release (exit status {group.processes[0].poll()})")
    assert info["num_autograd_contexts"] == 0


# -- a reply that arrives after the context was released --------------------------------------


@pytest.mark.slow
async def test_late_reply_after_exit_does_not_resurrect_context(make_process_group):
    await make_process_group(2)
    x = rand3()
    async with ag.autograd.context():
        fut = ag.rpc_async("worker1", torch.mul, args=(x, x))
        time.sleep(0.5)  # noqa: ASYNC251 - block this loop: worker1 (a process) answers meanwhile
    # the context is released here, before this loop has read worker1's answer
    result = await fut
    assert result.requires_grad
    await asyncio.sleep(0.1)
    infos = await debug_infos(["worker0", "worker1"])
    assert all(i["num_autograd_contexts"] == 0 for i in infos.values()), infos


def many_steps(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x * 1.001 + 0.001 * torch.sin(x)
    return x


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_context_left_while_its_backward_runs(group2, mode):
    """Leaving the context (here: exiting it by hand) while a big backward runs in it
    on another task: backward raises ContextError saying so, not an internal KeyError
    from the entries the release freed, and nothing is left behind."""
    x = rand3()
    scope = ag.autograd.context()
    context_id = await scope.__aenter__()
    h = many_steps(x, 3000)  # a big graph: released through the reaper thread
    a = await ag.rpc_async("worker1", slow_backward_fn(1.0), args=(h,))
    running = asyncio.ensure_future(ag.autograd.backward(context_id, [(a * h).sum()], mode=mode))
    await asyncio.sleep(0.2)
    assert not running.done(), "the backward ended before the context was left"
    await scope.__aexit__(None, None, None)
    with pytest.raises(ag.ContextError, match="released .* while a backward pass ran"):
        await asyncio.wait_for(running, 30)
    await wait_released(["worker0", "worker1"], timeout=10)


class TaggedTensor(torch.Tensor):
    """A tensor subclass (its instances are not plain strided tensors to the codec)."""


def _requires_grad_of(*tensors: torch.Tensor) -> list[bool]:
    return [t.requires_grad for t in tensors]


async def test_a_tensor_autograd_cannot_record_is_refused_inside_a_context(group2):
    """A sparse tensor or a tensor subclass that requires grad would travel without its
    send/recv pair: its gradient silently never came back (or FAST mode blamed the
    call for an unused output). Inside a context it is refused; outside, it travels."""
    sparse = torch.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (2, 2), requires_grad=True, check_invariants=True)
    tagged = torch.rand(3).as_subclass(TaggedTensor).requires_grad_()
    async with ag.autograd.context():
        for tensor, named in ((sparse, "sparse_coo tensor"), (tagged, "subclass TaggedTensor")):
            with pytest.raises(TypeError, match=f"{named} that requires grad cannot take part"):
                ag.rpc_async("worker1", _requires_grad_of, args=(tensor,))
        with pytest.raises(ag.RemoteError, match="sparse_coo tensor that requires grad"):
            await ag.rpc_async("worker1", torch.sparse_coo_tensor,
                               args=([[0], [0]], [1.0], (1, 1)),
                               kwargs={"requires_grad": True, "check_invariants": True})
        x = torch.rand(2, requires_grad=True)  # the context still works
        assert await ag.rpc_async("worker1", _requires_grad_of, args=(x, sparse.detach())) == [True, False]
    assert len(await ag.rpc_async("worker1", _requires_grad_of, args=(sparse, tagged))) == 2


def _raise_on(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("not this one")


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_a_call_that_failed_is_no_pair_of_the_context(group3, mode):
    """A caller that catches a failed call and goes on: that call recorded no pair
    (FAST mode used to wait for a gradient for it and blame it as an unused RPC)."""
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as context_id:
        for worker in ("worker1", "worker2"):
            with pytest.raises(ag.RemoteError, match="not this one"):
                await ag.rpc_async(worker, _raise_on, args=(x,))
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 2.0))
        z = await ag.rpc_async("worker2", torch.add, args=(y, x))  # worker2 takes part too
        await asyncio.wait_for(ag.autograd.backward(context_id, [z.sum()], mode=mode), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    (lx * 2.0 + lx).sum().backward()
    assert_grads(grads, [(x, lx.grad)])


def _sleepy(x: torch.Tensor, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return x * 5


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_a_call_that_timed_out_or_was_cancelled_is_no_pair_of_the_context(group3, mode):
    """A caller that gives up on a call (its timeout, a cancelled task) and goes on: the
    result never came, so no gradient can come for it either (FAST mode used to wait
    for one and blame the call as an unused RPC)."""
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as context_id:
        with pytest.raises(ag.RpcTimeout):
            await ag.rpc_async("worker1", _sleepy, args=(x, 0.6), timeout=0.2)
        call = asyncio.ensure_future(ag.rpc_async("worker2", _sleepy, args=(x, 0.6)))
        await asyncio.sleep(0.1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.7)  # both functions have returned by now
        y = await ag.rpc_async("worker1", torch.mul, args=(x, 2.0))
        z = await ag.rpc_async("worker2", torch.add, args=(y, x))  # both take part
        await asyncio.wait_for(ag.autograd.backward(context_id, [z.sum()], mode=mode), 10)
        grads = ag.autograd.get_gradients(context_id)
    (lx,) = local_copies(x)
    (lx * 2.0 + lx).sum().backward()
    assert_grads(grads, [(x, lx.grad)])
