"""DistributedOptimizer: every owner's update equals a local optimizer on the same math."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import actorgrad as ag


def make_param(seed: int, shape: tuple[int, ...] = (3, 3)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g).requires_grad_()


def clone_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def scaled_sum(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (p * x).tanh().sum()


async def one_step(opt: ag.optim.DistributedOptimizer, rref: ag.RRef, x: torch.Tensor) -> None:
    """One distributed step of ``opt`` on ``scaled_sum`` of the remote parameter."""
    async with ag.autograd.context() as context_id:
        p = await rref.to_here()
        await ag.autograd.backward(context_id, [scaled_sum(p, x)])
        await opt.step(context_id)


async def owner_num_optimizers(name: str) -> int:
    return await ag.rpc_async(name, _num_optimizers)


def _num_optimizers() -> int:
    from actorgrad.runtime import get_worker

    return len(get_worker().extensions["optim"].optimizers)


async def test_sgd_remote_params(group2):
    x = torch.rand(3, 3, requires_grad=True)
    rref1 = ag.remote("worker1", make_param, args=(1,))
    rref2 = ag.remote("worker1", make_param, args=(2,))
    before1, before2 = await rref1.to_here(), await rref2.to_here()
    async with ag.autograd.context() as context_id:
        p1, p2 = await rref1.to_here(), await rref2.to_here()
        loss = (p1 * x + p2 * p1).pow(2).sum()
        await ag.autograd.backward(context_id, [loss])
        opt = ag.optim.DistributedOptimizer(torch.optim.SGD, [rref1, rref2], lr=0.05)
        await opt.zero_grad()
        await opt.step(context_id)
        x_grad = ag.autograd.get_gradients(context_id)[x]

    l1, l2, lx = clone_leaf(before1), clone_leaf(before2), clone_leaf(x)
    local = torch.optim.SGD([l1, l2], lr=0.05)
    (l1 * lx + l2 * l1).pow(2).sum().backward()
    torch.testing.assert_close(x_grad, lx.grad)
    local.step()
    torch.testing.assert_close(await rref1.to_here(), l1.detach())
    torch.testing.assert_close(await rref2.to_here(), l2.detach())
    # on the owner, .grad is cleared again after the step
    assert await ag.rpc_async("worker1", _owner_grad_is_none, args=(rref1,))


def _owner_grad_is_none(rref: ag.RRef) -> bool:
    return rref.local_value().grad is None


async def test_adam_two_steps_in_two_contexts(group2):
    rref = ag.remote("worker1", make_param, args=(3,))
    before = await rref.to_here()
    opt = ag.optim.DistributedOptimizer(torch.optim.Adam, [rref], lr=0.1, betas=(0.8, 0.9))
    xs = [torch.rand(3, 3), torch.rand(3, 3) * 2]
    for x in xs:
        async with ag.autograd.context() as context_id:
            p = await rref.to_here()
            loss = (await ag.rpc_async("worker1", scaled_sum, args=(p, x))) * 3
            await ag.autograd.backward(context_id, [loss])
            await opt.step(context_id)

    lp = clone_leaf(before)
    local = torch.optim.Adam([lp], lr=0.1, betas=(0.8, 0.9))
    for x in xs:
        local.zero_grad()
        (scaled_sum(lp, x) * 3).backward()
        local.step()
    torch.testing.assert_close(await rref.to_here(), lp.detach())


async def test_params_on_two_owners_and_a_local_param(group3):
    r1 = ag.remote("worker1", make_param, args=(4,))
    r2 = ag.remote("worker2", make_param, args=(5, (3,)))
    mine = torch.rand(3, 3, requires_grad=True)
    r0 = ag.RRef(mine)
    b1, b2, b0 = await r1.to_here(), await r2.to_here(), mine.detach().clone()
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, [r1, r2, r0], lr=0.2, momentum=0.9)
    data = [torch.rand(3, 3) for _ in range(2)]
    for x in data:
        async with ag.autograd.context() as context_id:
            p1 = await r1.to_here()
            p2 = await r2.to_here()
            h = await ag.rpc_async("worker2", torch.mul, args=(p1 @ x, r0.local_value()))
            loss = ((h + p2) * p1).sum() + r0.local_value().pow(2).sum()
            await ag.autograd.backward(context_id, [loss])
            await opt.step(context_id)

    l1, l2, l0 = clone_leaf(b1), clone_leaf(b2), clone_leaf(b0)
    local = torch.optim.SGD([l1, l2, l0], lr=0.2, momentum=0.9)
    for x in data:
        local.zero_grad()
        (((l1 @ x) * l0 + l2) * l1).sum().add(l0.pow(2).sum()).backward()
        local.step()
    torch.testing.assert_close(await r1.to_here(), l1.detach())
    torch.testing.assert_close(await r2.to_here(), l2.detach())
    torch.testing.assert_close(mine.detach(), l0.detach())  # updated in place, on worker0
    assert mine.grad is None
    assert await owner_num_optimizers("worker1") == 1
    assert await owner_num_optimizers("worker2") == 1


async def _step_in_own_context(opt, rref, x, barrier: asyncio.Barrier) -> None:
    async with ag.autograd.context() as context_id:
        p = await rref.to_here()
        await ag.autograd.backward(context_id, [scaled_sum(p, x)])
        await barrier.wait()  # every context has its gradients: step them all at once
        await opt.step(context_id)


async def test_concurrent_steps_of_one_optimizer(group2):
    """Four contexts stepped at once: plain SGD updates add up (steps are serialized)."""
    rref = ag.remote("worker1", make_param, args=(6, (256, 256)))
    before = await rref.to_here()
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, [rref], lr=0.01)
    xs = [torch.rand(256, 256) for _ in range(4)]
    barrier = asyncio.Barrier(len(xs))
    await asyncio.gather(*(_step_in_own_context(opt, rref, x, barrier) for x in xs))
    lp = clone_leaf(before)
    sum(scaled_sum(lp, x) for x in xs).backward()
    torch.testing.assert_close(await rref.to_here(), (lp - 0.01 * lp.grad).detach())


async def test_step_with_unknown_context_raises(group2):
    rref = ag.remote("worker1", make_param, args=(7,))
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, [rref], lr=0.1)
    before = await rref.to_here()
    async with ag.autograd.context() as context_id:
        p = await rref.to_here()
        await ag.autograd.backward(context_id, [p.sum()])
    with pytest.raises((ag.ContextError, ag.RemoteError)):
        await opt.step(context_id)  # released: its gradients are gone
    torch.testing.assert_close(await rref.to_here(), before)


async def test_an_optimizer_of_a_group_shut_down_says_so(make_group):
    # (its step in a later group read 'autograd context 1 does not exist on worker0'
    # while that context was live: the optimizer looked in its own, closed worker)
    first = await make_group(2)
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, [ag.remote("worker1", make_param, args=(7,))], lr=0.1)
    await first.shutdown()
    await make_group(2)
    async with ag.autograd.context() as context_id:
        with pytest.raises(RuntimeError, match="belongs to worker0 of a group that was shut down"):
            await opt.step(context_id)


async def test_owner_that_took_no_part_in_the_context_keeps_its_params(group3):
    # an unused branch (or expert) on worker2: torch's step leaves it alone
    used = ag.remote("worker1", make_param, args=(21,))
    unused = ag.remote("worker2", make_param, args=(22,))
    before_used, before_unused = await used.to_here(), await unused.to_here()
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, [used, unused], lr=0.1, momentum=0.9)
    async with ag.autograd.context() as context_id:
        p = await used.to_here()
        await ag.autograd.backward(context_id, [p.square().sum()])
        await opt.step(context_id)
    lp = clone_leaf(before_used)
    lp.square().sum().backward()
    torch.testing.assert_close(await used.to_here(), (lp - 0.1 * lp.grad).detach())
    assert torch.equal(await unused.to_here(), before_unused)


async def test_step_of_a_context_this_worker_does_not_have_raises_before_anything_moves(group3):
    rrefs = [ag.remote(w, make_param, args=(23,)) for w in ("worker1", "worker2")]
    before = [await r.to_here() for r in rrefs]
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1)
    with pytest.raises(ag.ContextError, match="does not exist"):
        await opt.step(123456789)
    for r, b in zip(rrefs, before, strict=True):
        assert torch.equal(await r.to_here(), b)


class CountingSlowSGD(torch.optim.SGD):
    """SGD whose step takes 0.3 s and records how many steps ran at once."""

    running = 0
    most = 0

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        cls = CountingSlowSGD
        cls.running += 1
        cls.most = max(cls.most, cls.running)
        try:
            time.sleep(0.3)
            return super().step(closure)
        finally:
            cls.running -= 1


def _most_at_once() -> int:
    return CountingSlowSGD.most


async def test_steps_stay_serialized_when_a_caller_gives_up(group2):
    # the first step is abandoned (cancelled) while it runs on the owner's pool; the
    # second must wait for it, not run beside it (one update would be lost)
    rref = ag.remote("worker1", make_param, args=(24,))
    before = await rref.to_here()
    opt = ag.optim.DistributedOptimizer(CountingSlowSGD, [rref], lr=1.0)
    xs = [torch.rand(3, 3) for _ in range(2)]
    async with ag.autograd.context() as first:
        await ag.autograd.backward(first, [scaled_sum(await rref.to_here(), xs[0])])
        async with ag.autograd.context() as second:
            await ag.autograd.backward(second, [scaled_sum(await rref.to_here(), xs[1])])
            abandoned = asyncio.ensure_future(opt.step(first))
            await asyncio.sleep(0.15)  # running on the owner now
            abandoned.cancel()
            await opt.step(second)
        await asyncio.sleep(0.3)  # the abandoned one ends
    assert await ag.rpc_async("worker1", _most_at_once) == 1
    lp = clone_leaf(before)
    grads = [torch.autograd.grad(scaled_sum(lp, x), lp)[0] for x in xs]
    torch.testing.assert_close(await rref.to_here(), lp.detach() - grads[0] - grads[1])


async def test_optimizer_dropped_while_being_created_is_not_kept(group2):
    rref = ag.remote("worker1", make_param, args=(25,))
    await rref.to_here()
    base = await owner_num_optimizers("worker1")
    for _ in range(10):
        opt = ag.optim.DistributedOptimizer(SlowInitSGD, [rref], lr=0.1)
        del opt  # before its creation on the owner is done
    await asyncio.sleep(0.5)
    assert await owner_num_optimizers("worker1") == base


class SlowInitSGD(torch.optim.SGD):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        super().__init__(*args, **kwargs)


def test_needs_rrefs():
    with pytest.raises((ValueError, RuntimeError)):
        ag.optim.DistributedOptimizer(torch.optim.SGD, [], lr=0.1)


async def test_arguments_every_owner_would_refuse_are_refused_at_once(group2):
    """As torch's constructor: a bad learning rate or keyword raises here, not as a
    RemoteError at the first step."""
    w = ag.remote("worker1", torch.zeros, args=(3,), kwargs={"requires_grad": True})
    with pytest.raises(ValueError, match="SGD: Invalid learning rate: -1"):
        ag.optim.DistributedOptimizer(torch.optim.SGD, [w], lr=-1)
    with pytest.raises(TypeError, match="Adam: .*unexpected keyword argument 'moment'"):
        ag.optim.DistributedOptimizer(torch.optim.Adam, [w], lr=0.1, moment=0.9)
    with pytest.raises(TypeError, match="optimizer class"):
        ag.optim.DistributedOptimizer("SGD", [w], lr=0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer class .* got <class 'list'>"):
        ag.optim.DistributedOptimizer(list, [w])  # type: ignore[arg-type]
    made = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(TypeError, match=r"got a SGD already made: pass its class and arguments$"):
        ag.optim.DistributedOptimizer(made, [w])  # type: ignore[arg-type]


def _not_an_optimizer(params: object, lr: float) -> dict[str, float]:
    return {"lr": lr}


async def test_a_factory_that_makes_no_optimizer_is_named_at_the_first_step(group2):
    w = ag.remote("worker1", torch.zeros, args=(3,), kwargs={"requires_grad": True})
    opt = ag.optim.DistributedOptimizer(_not_an_optimizer, [w], lr=0.1)  # type: ignore[arg-type]
    async with ag.autograd.context() as context_id:
        with pytest.raises(ag.RemoteError, match="optimizer_class made a dict, which has no step"):
            await opt.step(context_id)


async def test_optimizer_that_checks_its_parameters_is_judged_by_its_owners(group2):
    """Muon takes 2-D parameters only: the argument check must not build it over a
    stand-in parameter of its own (it refused every Muon), yet still refuses its bad
    arguments at once. The step equals a local Muon step."""
    rref = ag.remote("worker1", make_param, args=(13, (4, 3)))
    before = await rref.to_here()
    with pytest.raises(ValueError, match="Muon: Learning rate should be >= 0"):
        ag.optim.DistributedOptimizer(torch.optim.Muon, [rref], lr=-1)
    opt = ag.optim.DistributedOptimizer(torch.optim.Muon, [rref], lr=0.02)
    x = torch.rand(4, 3)
    await one_step(opt, rref, x)
    lp = clone_leaf(before)
    local = torch.optim.Muon([lp], lr=0.02)
    scaled_sum(lp, x).backward()
    local.step()
    torch.testing.assert_close(await rref.to_here(), lp.detach())


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes a while (as with big parameters): widens any race window."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        time.sleep(0.2)
        return super().step(closure)


async def _step_in_own_context_with(opt, rref, x, barrier: asyncio.Barrier) -> None:
    async with ag.autograd.context() as context_id:
        p = await rref.to_here()
        await ag.autograd.backward(context_id, [scaled_sum(p, x)])
        await barrier.wait()
        await opt.step(context_id)


async def test_concurrent_slow_steps_of_one_optimizer(group2):
    rref = ag.remote("worker1", make_param, args=(11,))
    before = await rref.to_here()
    opt = ag.optim.DistributedOptimizer(SlowSGD, [rref], lr=0.1)
    xs = [torch.rand(3, 3) for _ in range(2)]
    barrier = asyncio.Barrier(len(xs))
    await asyncio.gather(*(_step_in_own_context_with(opt, rref, x, barrier) for x in xs))
    lp = clone_leaf(before)
    sum(scaled_sum(lp, x) for x in xs).backward()
    torch.testing.assert_close(await rref.to_here(), (lp - 0.1 * lp.grad).detach())


async def test_two_optimizers_on_the_same_params_are_serialized(group2):
    """API: concurrent steps on the same parameters are serialized, also when they come
    from two DistributedOptimizers (PyTorch's _LocalOptimizer shares one global lock)."""
    rref = ag.remote("worker1", make_param, args=(12,))
    before = await rref.to_here()
    lrs = (0.1, 0.2)
    opts = [ag.optim.DistributedOptimizer(SlowSGD, [rref], lr=lr) for lr in lrs]
    xs = [torch.rand(3, 3) for _ in lrs]
    barrier = asyncio.Barrier(len(opts))
    await asyncio.gather(
        *(_step_in_own_context_with(opt, rref, x, barrier) for opt, x in zip(opts, xs, strict=True))
    )
    lp = clone_leaf(before)
    grads = [torch.autograd.grad(scaled_sum(lp, x), lp)[0] for x in xs]
    expected = lp.detach() - lrs[0] * grads[0] - lrs[1] * grads[1]
    torch.testing.assert_close(await rref.to_here(), expected)


def _param_rrefs(module_rref: ag.RRef) -> list[ag.RRef]:
    return [ag.RRef(p) for p in module_rref.local_value().parameters()]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


async def test_model_parallel_remote_module(group3):
    """The PyTorch tutorial pattern: modules on two workers, parameter RRefs from their
    owners, forward through rref.rpc_async() proxies, one DistributedOptimizer."""
    first = ag.remote("worker1", make_model, args=(1,))
    head = ag.remote("worker2", torch.nn.Linear, args=(2, 1))
    params = await ag.rpc_async("worker1", _param_rrefs, args=(first,)) + await ag.rpc_async(
        "worker2", _param_rrefs, args=(head,)
    )
    local_first, local_head = await first.to_here(), await head.to_here()
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.5)
    local_opt = torch.optim.SGD(
        [*local_first.parameters(), *local_head.parameters()], lr=0.1, momentum=0.5
    )
    batches = [(torch.randn(5, 4), torch.randn(5, 1)) for _ in range(3)]
    for x, target in batches:
        async with ag.autograd.context() as context_id:
            h = await first.rpc_async().forward(x)
            out = await head.rpc_async().forward(h)
            loss = torch.nn.functional.mse_loss(out, target)
            await ag.autograd.backward(context_id, [loss])
            await opt.step(context_id)
        local_opt.zero_grad()
        torch.nn.functional.mse_loss(local_head(local_first(x)), target).backward()
        local_opt.step()
    for remote_module, local_module in ((first, local_first), (head, local_head)):
        got = (await remote_module.to_here()).state_dict()
        for name, value in local_module.state_dict().items():
            torch.testing.assert_close(got[name], value, msg=name)


class CountingSGD(torch.optim.SGD):
    """A user's optimizer that looks at its parameter list before iterating it."""

    def __init__(self, params, lr=0.1):  # type: ignore[no-untyped-def]
        if len(params) == 0:
            raise ValueError("CountingSGD needs parameters")
        super().__init__(params, lr=lr)


async def test_an_optimizer_that_takes_the_length_of_its_parameters_is_accepted(group2):
    rref = ag.remote("worker1", make_param, args=(14,))
    before = await rref.to_here()
    opt = ag.optim.DistributedOptimizer(CountingSGD, [rref], lr=0.1)
    x = torch.rand(3, 3)
    await one_step(opt, rref, x)
    lp = clone_leaf(before)
    scaled_sum(lp, x).backward()
    torch.testing.assert_close(await rref.to_here(), (lp - 0.1 * lp.grad).detach())


async def test_params_rref_must_be_a_list_of_rrefs_and_step_a_context_id(group2):
    rref = ag.remote("worker1", make_param, args=(15,))
    with pytest.raises(TypeError, match="params_rref must be a list of RRefs, got RRef"):
        ag.optim.DistributedOptimizer(torch.optim.SGD, rref, lr=0.1)  # type: ignore[arg-type]
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, (r for r in [rref]), lr=0.1)  # any iterable
    with pytest.raises(TypeError, match="context_id must be the int"):
        await opt.step("x")  # type: ignore[arg-type]


class SlowCreateSGD(torch.optim.SGD):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        super().__init__(*args, **kwargs)


async def test_a_step_given_up_while_the_optimizers_are_created_leaves_it_usable(group2):
    """The first step waits for the owners' optimizers; giving it up (a timeout) must
    not cancel their creation: every later step needs them (they stayed cancelled)."""
    rref = ag.remote("worker1", make_param, args=(31,))
    before = await rref.to_here()
    x = torch.rand(3, 3)
    async with ag.autograd.context() as context_id:
        await ag.autograd.backward(context_id, [scaled_sum(await rref.to_here(), x)])
        opt = ag.optim.DistributedOptimizer(SlowCreateSGD, [rref], lr=0.5)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(opt.step(context_id), 0.1)
        await asyncio.wait_for(opt.step(context_id), 10)
    lp = clone_leaf(before)
    (grad,) = torch.autograd.grad(scaled_sum(lp, x), lp)
    torch.testing.assert_close(await rref.to_here(), lp.detach() - 0.5 * grad)


def _steps_running() -> int:
    return CountingSlowSGD.running


async def test_a_step_given_up_ends_once_the_owners_step_did(group2):
    """A step on an owner's thread pool cannot be stopped midway: a step given up at
    the caller (timeout, cancel) returns only once it ended, so that the caller's next
    iteration never runs beside it on the same parameters."""
    rref = ag.remote("worker1", make_param, args=(32,))
    before = await rref.to_here()
    opt = ag.optim.DistributedOptimizer(CountingSlowSGD, [rref], lr=1.0)
    x = torch.rand(3, 3)
    async with ag.autograd.context() as context_id:
        await ag.autograd.backward(context_id, [scaled_sum(await rref.to_here(), x)])
        await asyncio.wait_for(opt.step(context_id), 10)  # (the optimizer is created)
    async with ag.autograd.context() as context_id:
        await ag.autograd.backward(context_id, [scaled_sum(await rref.to_here(), x)])
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(opt.step(context_id), 0.1)
        assert time.monotonic() - start >= 0.25  # the owner's 0.3 s step ended first
        assert await ag.rpc_async("worker1", _steps_running) == 0
    lp = clone_leaf(before)
    for _ in range(2):
        (grad,) = torch.autograd.grad(scaled_sum(lp, x), lp)
        lp = clone_leaf(lp.detach() - grad)
    torch.testing.assert_close(await rref.to_here(), lp.detach())


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        return grad


def _summed(rref: ag.RRef, slowly: bool) -> torch.Tensor:
    p = rref.local_value()
    return (_SlowBackward.apply(p) if slowly else p).sum()


async def test_a_step_on_the_gradients_of_a_backward_that_failed_midway_is_refused(group3):
    """A backward given up on (here: cancelled by a timeout) left gradients with some
    owners and not others: a step on them would update part of the model."""
    rrefs = [ag.remote(f"worker{r}", make_param, args=(r,)) for r in (1, 2)]
    before = [await r.to_here() for r in rrefs]
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    async with ag.autograd.context() as context_id:
        parts = [await ag.rpc_async(f"worker{r}", _summed, args=(rref, r == 2)) for r, rref in zip((1, 2), rrefs, strict=True)]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ag.autograd.backward(context_id, [parts[0] + parts[1]]), 0.2)
        with pytest.raises(ag.ContextError, match="failed .*gradients are partial"):
            await opt.step(context_id)
    for rref, old in zip(rrefs, before, strict=True):
        assert torch.equal(await rref.to_here(), old)


async def test_a_step_while_the_backward_still_runs_is_refused(group3):
    """The gradients are partial until the backward ends (one owner has its own, the
    other not yet): a step then updated one owner and not the other, silently."""
    rrefs = [ag.remote(f"worker{r}", make_param, args=(r,)) for r in (1, 2)]
    before = [await r.to_here() for r in rrefs]
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    async with ag.autograd.context() as context_id:
        parts = [await ag.rpc_async(f"worker{r}", _summed, args=(rref, r == 2))
                 for r, rref in zip((1, 2), rrefs, strict=True)]
        running = asyncio.ensure_future(ag.autograd.backward(context_id, [parts[0] + parts[1]]))
        await asyncio.sleep(0.2)  # worker2's slow backward node runs
        with pytest.raises(ag.ContextError, match="still running"):
            await opt.step(context_id)
        await running
        await opt.step(context_id)  # once it ended, the whole step
    for rref, old in zip(rrefs, before, strict=True):
        torch.testing.assert_close(await rref.to_here(), old - 1.0)


class _SlowerThanTheTimeout(torch.optim.SGD):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.6)  # as a first optimizer that imports what it needs
        super().__init__(*args, **kwargs)

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        time.sleep(0.6)
        return super().step(closure)


async def test_owners_steps_and_optimizers_are_not_cut_off_by_the_rpc_timeout(make_group):
    """With rpc_timeout shorter than an owner's step, the step raised RpcTimeout and was
    applied on the owner afterwards (a retry applied it twice); a creation that took
    longer failed every later step with that same RpcTimeout."""
    await make_group(2, ag.RpcOptions(rpc_timeout=0.3))
    rref = ag.remote("worker1", make_param, args=(33,))
    before = await rref.to_here()
    opt = ag.optim.DistributedOptimizer(_SlowerThanTheTimeout, [rref], lr=1.0)
    x = torch.rand(3, 3)
    for _ in range(2):
        async with ag.autograd.context() as context_id:
            await ag.autograd.backward(context_id, [scaled_sum(await rref.to_here(), x)])
            await opt.step(context_id)
    lp = clone_leaf(before)
    for _ in range(2):
        (grad,) = torch.autograd.grad(scaled_sum(lp, x), lp)
        lp = clone_leaf(lp.detach() - grad)
    torch.testing.assert_close(await rref.to_here(), lp.detach())
