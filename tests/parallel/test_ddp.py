"""DistributedDataParallel against single-process training."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import actorgrad.collective as C
from actorgrad.parallel import DistributedDataParallel as DDP
from actorgrad.parallel._ddp import _wrappers
from actorgrad.testing import InProcessGroup

ROOT = Path(__file__).parents[2]
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

torch.manual_seed(0)
X = torch.randn(8, 6)
Y = torch.randn(8, 3)


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


async def run_all(group: InProcessGroup, body: Callable[..., Awaitable[Any]]) -> list[Any]:
    tasks = [group.run_as(r, body, r) for r in range(len(group.workers))]
    return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))


async def run_settled(group: InProcessGroup, body: Callable[..., Awaitable[Any]]) -> list[Any]:
    tasks = [group.run_as(r, body, r) for r in range(len(group.workers))]
    return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60))


@pytest.mark.parametrize("backend", ["actorgrad", "gloo"])
async def test_five_steps_match_single_process_training(make_group: Any, backend: str) -> None:
    group: InProcessGroup = await make_group(2)
    reference = mlp(0)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(5):
        opt.zero_grad()
        nn.functional.mse_loss(reference(X), Y).backward()  # the full batch, mean loss
        opt.step()

    async def body(rank: int) -> tuple[list[torch.Tensor], list[int]]:
        await C.init_process_group(backend=backend)
        model = mlp(rank)  # different on purpose: create() copies rank 0's
        ddp = await DDP.create(model, bucket_cap_mb=0.0008)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        shard = slice(4 * rank, 4 * rank + 4)
        for _ in range(5):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(X[shard]), Y[shard])
            await ddp.backward(loss)
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()], ddp.bucket_sizes

    (params0, buckets), (params1, _) = await run_all(group, body)
    assert len(buckets) >= 3 and sum(buckets) == 6
    for a, b, want in zip(params0, params1, reference.parameters(), strict=True):
        assert torch.equal(a, b)  # the replicas stay bitwise equal
        assert_close(a, want.detach(), rtol=1e-5, atol=1e-6)


async def test_buckets_in_reverse_registration_order(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> list[list[int]]:
        ddp = await DDP.create(mlp(0), bucket_cap_mb=(16 * 16 * 4 + 16 * 4) / 2**20)
        return [b.params for b in ddp._buckets]

    layout = (await run_all(group, body))[0]
    # cap = W2 + b1: filled from the last parameter backwards, never over the cap
    assert layout == [[5, 4, 3], [2, 1], [0]]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.b(h) if use_b else self.a(h)


def assert_averaged(results: list[dict[str, torch.Tensor | None]],
                    local: list[dict[str, torch.Tensor | None]]) -> None:
    """Each rank's gradients are the average of the ranks' local ones (a rank without
    one counts as zero); None where no rank has one, as torch leaves it."""
    for name in results[0]:
        parts = [g[name] for g in local]
        if all(p is None for p in parts):
            assert all(r[name] is None for r in results), name
            continue
        want = sum(p for p in parts if p is not None) / len(local)
        for r, got in enumerate(results):
            assert_close(got[name], want, msg=f"rank {r} {name}")


async def two_backwards(ddp: DDP, loss_at: Any, first_unsynced: bool) -> None:
    """Two steps' backwards into the same .grad, the first inside no_sync() if asked."""
    for step in range(2):
        loss = loss_at(step)
        if step == 0 and first_unsynced:
            with ddp.no_sync():
                await ddp.backward(loss)
        else:
            await ddp.backward(loss)


@pytest.mark.parametrize("b_users", [(), (0,)], ids=["nobody", "rank0"])
async def test_find_unused_parameters(make_group: Any, b_users: tuple[int, ...]) -> None:
    group: InProcessGroup = await make_group(2)

    def local_grads(rank: int) -> dict[str, torch.Tensor | None]:
        torch.manual_seed(0)
        m = Branchy()
        shard = slice(4 * rank, 4 * rank + 4)
        nn.functional.mse_loss(m(X[shard], rank in b_users), Y[shard]).backward()
        return {n: p.grad for n, p in m.named_parameters()}

    async def body(rank: int) -> dict[str, torch.Tensor | None]:
        torch.manual_seed(0)
        model = Branchy()
        ddp = await DDP.create(model, bucket_cap_mb=1e-4, find_unused_parameters=True)
        for _ in range(2):  # twice: the second backward reuses the buckets
            model.zero_grad(set_to_none=True)
            shard = slice(4 * rank, 4 * rank + 4)
            await ddp.backward(nn.functional.mse_loss(ddp(X[shard], rank in b_users), Y[shard]))
        return {n: p.grad for n, p in model.named_parameters()}

    assert_averaged(await run_all(group, body), [local_grads(r) for r in range(2)])


# (use_b per rank in step 0, in step 1, whether step 0 runs inside no_sync())
ACCUMULATION = {
    "swapped_branches": (((True, False), (False, True)), False),
    "no_sync_then_sync": (((True, False), (False, False)), True),
}


@pytest.mark.parametrize("scenario", list(ACCUMULATION))
async def test_find_unused_accumulates_like_torch(make_group: Any, scenario: str) -> None:
    # Two backwards into the same .grad (no zero_grad between, or gradient accumulation
    # with no_sync): a parameter this rank did not use in the last forward still holds
    # the gradient of an earlier one, which counts (torch reduces the .grad it has, and
    # a parameter used in a no_sync pass is used). The oracle: every rank's local
    # accumulated gradients, averaged.
    group: InProcessGroup = await make_group(2)
    uses, first_unsynced = ACCUMULATION[scenario]

    def shard(rank: int, step: int) -> slice:
        return slice(4 * rank + 2 * step, 4 * rank + 2 * step + 2)

    def local_grads(rank: int) -> dict[str, torch.Tensor | None]:
        torch.manual_seed(0)
        m = Branchy()
        for step in range(2):
            nn.functional.mse_loss(m(X[shard(rank, step)], uses[step][rank]), Y[shard(rank, step)]).backward()
        return {n: p.grad for n, p in m.named_parameters()}

    async def body(rank: int) -> dict[str, torch.Tensor | None]:
        torch.manual_seed(0)
        model = Branchy()
        ddp = await DDP.create(model, bucket_cap_mb=1e-4, find_unused_parameters=True)
        await two_backwards(ddp, lambda step: nn.functional.mse_loss(
            ddp(X[shard(rank, step)], uses[step][rank]), Y[shard(rank, step)]), first_unsynced)
        return {n: p.grad for n, p in model.named_parameters()}

    local = [local_grads(r) for r in range(2)]
    assert all(any(g[name] is not None for g in local) for name in local[0])  # each used somewhere
    assert_averaged(await run_all(group, body), local)


async def test_unused_parameter_without_the_flag_raises_instead_of_hanging(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        torch.manual_seed(0)
        ddp = await DDP.create(Branchy(), bucket_cap_mb=1e-4)
        await ddp.backward(ddp(X[:4], False).sum())  # self.b gets no gradient

    results = await run_settled(group, body)
    assert all(isinstance(r, RuntimeError) and "find_unused_parameters" in str(r) for r in results)


class Optional(Branchy):
    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


async def test_unused_parameter_on_one_rank_raises_on_every_rank(make_group: Any) -> None:
    # rank 0 leaves `b` without a gradient; rank 1 has all of its own, but the average it
    # got holds rank 0's zeros for `b`: it must not step on it either
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        torch.manual_seed(0)
        ddp = await DDP.create(Optional(), bucket_cap_mb=1e-4)
        await ddp.backward(ddp(X[:4], rank == 1).sum())

    results = await run_settled(group, body)
    for r in results:
        assert isinstance(r, RuntimeError), r
        assert "b.weight (on 1 rank(s))" in str(r) and "find_unused_parameters" in str(r), r


class WithAux(nn.Module):
    """Returns (logits, aux): a loss that leaves aux out reaches no aux parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.head(h), self.aux(h)


# whether each rank's loss uses the aux output, per step (no zero_grad between them)
AUX_USES = {"first_step_only": ((True, True), (False, False)), "never": ((False, False), (False, False)),
            "one_rank_each_step": ((True, False), (False, True))}


@pytest.mark.parametrize("no_sync_first", [False, True])
@pytest.mark.parametrize("scenario", list(AUX_USES))
async def test_find_unused_leaves_an_output_the_loss_did_not_use_alone(
        make_group: Any, scenario: str, no_sync_first: bool) -> None:
    # The forward reaches the aux head, the loss does not: no gradient comes for it. It
    # counts as unused on that rank, like a parameter the forward did not reach: what its
    # .grad holds already is reduced, and a .grad no rank added to stays as it was (it
    # was overwritten with an average of zeros: an accumulated gradient lost, a None made
    # zero, which weight decay then moved). Oracle: the local accumulated gradients,
    # averaged over the ranks that have one.
    group: InProcessGroup = await make_group(2)
    uses = AUX_USES[scenario]

    def loss_of(out: tuple[torch.Tensor, torch.Tensor], rank: int, step: int) -> torch.Tensor:
        rows = slice(4 * rank + 2 * step, 4 * rank + 2 * step + 2)
        logits, aux = out
        loss = nn.functional.mse_loss(logits, Y[rows])
        return loss + aux.pow(2).mean() if uses[step][rank] else loss

    def local_grads(rank: int) -> dict[str, torch.Tensor | None]:
        torch.manual_seed(0)
        m = WithAux()
        for step in range(2):
            loss_of(m(X[4 * rank + 2 * step: 4 * rank + 2 * step + 2]), rank, step).backward()
        return {n: p.grad for n, p in m.named_parameters()}

    async def body(rank: int) -> dict[str, torch.Tensor | None]:
        torch.manual_seed(0)
        model = WithAux()
        ddp = await DDP.create(model, bucket_cap_mb=1e-4, find_unused_parameters=True)
        await two_backwards(ddp, lambda step: loss_of(ddp(X[4 * rank + 2 * step: 4 * rank + 2 * step + 2]), rank, step),
                            no_sync_first)
        return {n: p.grad for n, p in model.named_parameters()}

    assert_averaged(await run_all(group, body), [local_grads(r) for r in range(2)])


@pytest.mark.parametrize("find_unused", [False, True])
async def test_local_backward_error_on_one_rank_fails_every_rank_and_keeps_them_in_step(
        make_group: Any, find_unused: bool) -> None:
    group: InProcessGroup = await make_group(2)

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("a hook of rank 1 failed")

    async def body(rank: int) -> tuple[str, list[torch.Tensor]]:
        model = mlp(0)
        ddp = await DDP.create(model, bucket_cap_mb=0.0008, find_unused_parameters=find_unused)
        shard = slice(4 * rank, 4 * rank + 4)
        out = ddp(X[shard])
        if rank == 1:
            out.register_hook(boom)
        try:
            await ddp.backward(nn.functional.mse_loss(out, Y[shard]))
            failure = "none"
        except (ValueError, RuntimeError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        # the ranks are still in step: the next backward averages correctly
        model.zero_grad()
        await ddp.backward(nn.functional.mse_loss(ddp(X[shard]), Y[shard]))
        return failure, [p.grad.clone() for p in model.parameters()]

    (fail0, grads0), (fail1, grads1) = await run_all(group, body)
    assert fail1 == "ValueError: a hook of rank 1 failed"
    assert fail0.startswith("RuntimeError: the local backward raised on 1 other rank"), fail0
    reference = mlp(0)
    nn.functional.mse_loss(reference(X), Y).backward()  # the mean over both shards
    for g0, g1, p in zip(grads0, grads1, reference.parameters(), strict=True):
        assert torch.equal(g0, g1)
        assert_close(g0, p.grad)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor([1.5]))  # not used by forward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("scale_users", [(0, 1), (0,)], ids=["both", "rank0"])
async def test_parameter_used_outside_forward_raises_on_every_rank(
        make_group: Any, scale_users: tuple[int, ...]) -> None:
    # find_unused_parameters sees `scale` unused after forward and reduces a zero for it;
    # its gradient from the loss comes too late, so (as torch) this is an error, and not
    # only on the rank where it happens: the other one would diverge or wait for it
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        torch.manual_seed(0)
        model = Scaled()
        ddp = await DDP.create(model, find_unused_parameters=True)
        shard = slice(4 * rank, 4 * rank + 4)
        loss = nn.functional.mse_loss(ddp(X[shard]), Y[shard])
        await ddp.backward(loss * model.scale if rank in scale_users else loss)

    results = await run_settled(group, body)
    for r in results:
        assert isinstance(r, RuntimeError), r
        assert "'scale'" in str(r) and "outside" in str(r) and "only once" in str(r)


async def test_parameter_reused_in_reentrant_backward_raises(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(6, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.inner, x, use_reentrant=True)
            return self.head(self.inner(h))  # `inner` accumulates twice: two hook calls

    async def body(rank: int) -> None:
        torch.manual_seed(0)
        ddp = await DDP.create(Twice())
        x = X[:4].clone().requires_grad_(True)
        await ddp.backward(nn.functional.mse_loss(ddp(x), Y[:4]))

    results = await run_settled(group, body)
    for r in results:
        assert isinstance(r, RuntimeError), r
        assert "'inner.weight'" in str(r) and "reentrant" in str(r)


async def test_buffers_follow_rank0(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> list[torch.Tensor]:
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
        ddp = await DDP.create(model)
        shard = slice(4 * rank, 4 * rank + 4)
        await ddp.backward(ddp(X[shard]).square().mean())  # updates running stats locally
        return [b.clone() for b in model.buffers()]

    b0, b1 = await run_all(group, body)
    for x, y in zip(b0, b1, strict=True):
        assert torch.equal(x, y)
    assert b0[0].abs().sum() > 0  # the running mean moved


class _Scaled(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(4, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.p * x).sum()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
async def test_half_precision_gradients_near_their_range_average_as_torch(make_group: Any, dtype: torch.dtype) -> None:
    """torch's DDP divides each bucket by the world size before summing it: their sum of
    two float16 gradients of 40000 overflows (the range ends at 65504), their average
    does not."""
    group: InProcessGroup = await make_group(2)
    inputs = [torch.full((4,), 40000.0, dtype=dtype), torch.full((4,), 30000.0, dtype=dtype)]

    async def body(rank: int) -> torch.Tensor:
        model = _Scaled(dtype)
        ddp = await DDP.create(model)
        await ddp.backward(ddp(inputs[rank]))
        return model.p.grad  # type: ignore[return-value]

    grads = await run_all(group, body)
    want = sum(x.float() for x in inputs) / 2
    for grad in grads:
        assert grad.dtype == dtype and torch.isfinite(grad).all()
        assert_close(grad.float(), want, rtol=1e-2, atol=0)
    assert torch.equal(grads[0], grads[1])


async def test_an_eval_forward_after_a_training_forward_warns_and_sync_buffers_fixes_it(
        make_group: Any) -> None:
    """torch broadcasts rank 0's buffers before every forward; here it happens at the end
    of backward, so an eval forward right after a training one reads this rank's own
    running statistics: that warns, and sync_buffers gives it rank 0's."""
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
        ddp = await DDP.create(model)
        shard = slice(4 * rank, 4 * rank + 4)
        await ddp.backward(ddp(X[shard]).square().mean())
        model.eval()
        ddp(X[:2])  # after a synced backward: nothing to say
        model.train()
        ddp(X[shard])  # moves this rank's running statistics
        model.eval()
        own = ddp(X[:2]).detach()
        ddp(X[:2])  # (said once)
        await ddp.sync_buffers()
        return own, ddp(X[:2]).detach()

    with warnings.catch_warnings(record=True) as caught:  # (the ranks share this process)
        warnings.simplefilter("always")
        (own0, synced0), (own1, synced1) = await run_all(group, body)
    said = [str(w.message) for w in caught if "buffers" in str(w.message)]
    assert len(said) == 1 and "sync_buffers" in said[0], said  # rank 1 (rank 0's are its own)
    assert not torch.equal(own0, own1)  # each rank's own statistics
    assert torch.equal(synced0, synced1) and torch.equal(synced0, own0)  # rank 0's


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 4)
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 1.0]))  # never changes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.mask


async def test_buffers_that_did_not_change_give_no_warning(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        model = _Masked()
        ddp = await DDP.create(model)
        ddp(X[:4])
        model.eval()
        ddp(X[:2])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await run_all(group, body)


async def test_no_sync_accumulates_locally(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> list[Any]:
        model = mlp(0)
        ddp = await DDP.create(model)
        with ddp.no_sync():
            await ddp.backward(ddp(X[rank : rank + 1]).sum())
        local = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        await ddp.backward(ddp(X[rank + 2 : rank + 3]).sum())  # now averages the total
        return [*local, *(p.grad for p in model.parameters())]

    r0, r1 = await run_all(group, body)
    n = len(r0) // 2
    assert not torch.equal(r0[0], r1[0])
    ref = mlp(0)
    for rank in range(2):
        ref(X[rank : rank + 1]).sum().backward()
        ref(X[rank + 2 : rank + 3]).sum().backward()
    for got0, got1, want in zip(r0[n:], r1[n:], ref.parameters(), strict=True):
        assert torch.equal(got0, got1)
        assert_close(got0, want.grad / 2)  # type: ignore[operator]


async def test_plain_loss_backward_is_reported(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        ddp = await DDP.create(mlp(0))
        with pytest.raises(RuntimeError, match="await ddp.backward"):
            ddp(X).sum().backward()  # not averaged: refused before an optimizer steps on it
        with ddp.no_sync():
            ddp(X).sum().backward()  # meant to stay local: allowed
        await ddp.backward(ddp(X).sum())  # and the wrapper works on

    await run_all(group, body)


async def test_sparse_gradients_are_refused_clearly(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        with pytest.raises(ValueError, match="sparse=False"):
            await DDP.create(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
        # (SyncBatchNorm trained silently as a per-rank BatchNorm: torch.distributed has
        # no default group here for it to share statistics through)
        with pytest.raises(ValueError, match="1 is a SyncBatchNorm.*normalise each rank's batch alone"):
            await DDP.create(nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))))
        # a sparse gradient from elsewhere (here: a hook) fails the step on every rank
        model = nn.Linear(4, 2)
        ddp = await DDP.create(model)
        model.weight.register_hook(lambda g: g.to_sparse())
        await ddp.backward(ddp(torch.ones(3, 4)).sum())

    results = await run_settled(group, body)
    for r in results:
        assert isinstance(r, RuntimeError) and "sparse" in str(r), r


@pytest.mark.parametrize("differs", ["frozen", "shape", "extra"])
async def test_a_module_that_differs_between_ranks_is_refused_by_name(make_group: Any, differs: str) -> None:
    # as torch checks at construction (another shape failed in the broadcast without
    # naming the model; another frozen set in the first backward's all-reduce)
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        model = nn.Sequential(nn.Linear(4, 3 + (differs == "shape" and rank == 1)), nn.Linear(3, 2))
        if differs == "frozen" and rank == 1:
            model[0].bias.requires_grad_(False)
        if differs == "extra" and rank == 0:
            model.register_buffer("steps", torch.zeros(1))
        await DDP.create(model)

    said = {"frozen": "parameter '0.bias': (3,) torch.float32, requires grad on rank 0, (3,) torch.float32, frozen on rank 1",
            "shape": "parameter '0.weight': (3, 4) torch.float32, requires grad on rank 0, (4, 4) torch.float32, requires grad on rank 1",
            "extra": "buffer 'steps': (1,) torch.float32 on rank 0, none on rank 1"}[differs]
    for r in await run_settled(group, body):
        assert isinstance(r, ValueError) and "the module differs between ranks" in str(r), r
        assert said in str(r), r


@pytest.mark.parametrize("setting", ["bucket_cap_mb", "find_unused_parameters", "broadcast_buffers"])
async def test_settings_that_differ_between_ranks_are_refused_by_name(make_group: Any, setting: str) -> None:
    # (other buckets or other checks for unused parameters make the ranks' collectives
    # differ: the group went out of step for good at the first backward)
    group: InProcessGroup = await make_group(2)
    said = {"bucket_cap_mb": "the same buckets, and bucket_cap_mb=25.0 on rank 0 and bucket_cap_mb=0.0001 on rank 1",
            "find_unused_parameters": "the same find_unused_parameters, got False on rank 0 and True on rank 1",
            "broadcast_buffers": "the same broadcast_buffers, got False on rank 0 and True on rank 1"}[setting]

    async def body(rank: int) -> float:
        kwargs: dict[str, Any] = {setting: (0.0001 if rank else 25.0) if setting == "bucket_cap_mb" else bool(rank)}
        with pytest.raises(ValueError, match=re.escape(said)):
            await DDP.create(mlp(0), **kwargs)
        # the same buckets from another cap are no difference
        await DDP.create(mlp(0), bucket_cap_mb=25.0 + rank)
        t = torch.ones(2)
        await C.all_reduce(t)  # the group is still in step
        return t.sum().item()

    assert await run_settled(group, body) == [4.0, 4.0]


@pytest.mark.parametrize("cap", [float("inf"), float("nan"), 0, -1])
async def test_a_bucket_cap_that_is_no_size_is_refused(make_group: Any, cap: float) -> None:
    await make_group(1)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB > 0"):
        await DDP.create(mlp(0), bucket_cap_mb=cap)


async def test_constructor_needs_create() -> None:
    with pytest.raises(TypeError, match="create"):
        DDP(mlp(0))


async def test_torchs_keyword_arguments_are_taken(make_group: Any) -> None:
    """A torch DDP construction ported as is: its keywords work, with their meaning."""
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        pair = C.new_group([0, 1])
        ddp = await DDP.create(mlp(rank), device_ids=["cpu"], output_device="cpu",
                               process_group=pair, gradient_as_bucket_view=True,
                               static_graph=True, bucket_cap_mb=None)
        assert ddp.group is pair
        await ddp.backward(ddp(X).sum())
        with pytest.raises(ValueError, match="cuda:0"):
            await DDP.create(mlp(0), device_ids=[0])
        with pytest.raises(ValueError, match="not both"):
            await DDP.create(mlp(0), group=pair, process_group=pair)
        frozen = mlp(0).requires_grad_(False)
        with pytest.raises(RuntimeError, match="not needed"):
            await DDP.create(frozen)

    await run_all(group, body)


@pytest.mark.slow
def test_example_trains_over_two_processes() -> None:
    env = dict(os.environ)
    env.pop("ACTORGRAD_AUTH_KEY", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "actorgrad", "launch", "--nproc", "2", str(ROOT / "examples" / "ddp_train.py"),
           "--steps", "80", "--train-size", "2000", "--test-size", "500", "--min-accuracy", "0.5"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=ROOT, start_new_session=True) as popen:
        try:
            out, err = popen.communicate(timeout=120)
        finally:
            if popen.poll() is None:  # kill the launcher and its ranks
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
    proc = subprocess.CompletedProcess(cmd, popen.returncode, out, err)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test accuracy" in proc.stdout


Z = torch.randn(8, 4)


async def test_one_loss_through_two_wrappers_averages_both_as_torch(make_group: Any) -> None:
    """A GAN step: the discriminator's loss uses the generator's output detached (only D
    is averaged), the generator's loss goes through D (both are, as one loss.backward()
    does in torch). Against the same steps on the full batch in one process."""
    group: InProcessGroup = await make_group(2)

    def models() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(3)
        return nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))

    def step_d(g: nn.Module, d: nn.Module, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        real, fake = d(x), d(g(z).detach())
        return (nn.functional.mse_loss(real, torch.ones_like(real))
                + nn.functional.mse_loss(fake, torch.zeros_like(fake)))

    def step_g(g: nn.Module, d: nn.Module, z: torch.Tensor) -> torch.Tensor:
        out = d(g(z))
        return nn.functional.mse_loss(out, torch.ones_like(out))

    g_ref, d_ref = models()
    opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (g_ref, d_ref))
    for _ in range(3):
        opt_d.zero_grad()
        step_d(g_ref, d_ref, Z, X).backward()
        opt_d.step()
        opt_g.zero_grad()
        step_g(g_ref, d_ref, Z).backward()
        opt_g.step()

    async def body(rank: int) -> list[torch.Tensor]:
        g, d = models()
        dg, dd = await DDP.create(g), await DDP.create(d)
        og, od = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (g, d))
        shard = slice(4 * rank, 4 * rank + 4)
        for _ in range(3):
            od.zero_grad()
            await dd.backward(step_d(dg, dd, Z[shard], X[shard]))
            od.step()
            og.zero_grad()
            await dg.backward(step_g(dg, dd, Z[shard]))  # reaches d's parameters too
            og.step()
        return [p.detach().clone() for p in [*g.parameters(), *d.parameters()]]

    r0, r1 = await run_all(group, body)
    for a, b, want in zip(r0, r1, [*g_ref.parameters(), *d_ref.parameters()], strict=True):
        assert torch.equal(a, b)
        assert_close(a, want.detach(), rtol=1e-5, atol=1e-6)


async def test_encoder_and_head_wrapped_apart_one_backward(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)
    torch.manual_seed(4)
    enc_ref, head_ref = nn.Linear(6, 8), nn.Linear(8, 3)
    nn.functional.mse_loss(head_ref(torch.tanh(enc_ref(X))), Y).backward()

    async def body(rank: int) -> list[torch.Tensor]:
        torch.manual_seed(4)
        enc, head = nn.Linear(6, 8), nn.Linear(8, 3)
        denc, dhead = await DDP.create(enc), await DDP.create(head)
        shard = slice(4 * rank, 4 * rank + 4)
        await dhead.backward(nn.functional.mse_loss(dhead(torch.tanh(denc(X[shard]))), Y[shard]))
        denc(X[shard])  # no "computed with loss.backward()": they were averaged
        return [p.grad.clone() for p in [*enc.parameters(), *head.parameters()]]  # type: ignore[union-attr]

    r0, r1 = await run_all(group, body)
    for a, b, want in zip(r0, r1, [*enc_ref.parameters(), *head_ref.parameters()], strict=True):
        assert torch.equal(a, b)
        assert_close(a, want.grad)


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    aux: torch.Tensor | None = None


class _DataclassOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.unused = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> _Out:
        return _Out(self.a(x))


async def test_find_unused_sees_tensors_in_a_dataclass_output(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)
    torch.manual_seed(5)
    ref = _DataclassOutput()
    ref(X).logits.pow(2).mean().backward()

    async def body(rank: int) -> list[Any]:
        torch.manual_seed(5)
        model = _DataclassOutput()
        ddp = await DDP.create(model, find_unused_parameters=True)
        await ddp.backward(ddp(X[4 * rank : 4 * rank + 4]).logits.pow(2).mean())
        return [p.grad for p in model.parameters()]

    for grads in await run_all(group, body):
        for got, want in zip(grads, ref.parameters(), strict=True):
            if want.grad is None:
                assert got is None  # the unused layer keeps no gradient, as in torch
            else:
                assert_close(got, want.grad)


async def test_broadcast_buffers_false_keeps_each_ranks_buffers_from_the_start(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[float, float]:
        model = nn.Linear(2, 2)
        model.register_buffer("rank_id", torch.tensor(float(rank)))
        kept = await DDP.create(model, broadcast_buffers=False)
        synced_model = nn.Linear(2, 2)
        synced_model.register_buffer("rank_id", torch.tensor(float(rank)))
        await DDP.create(synced_model)
        del kept
        return float(model.rank_id), float(synced_model.rank_id)

    assert await run_all(group, body) == [(0.0, 0.0), (1.0, 0.0)]


async def test_a_wrapper_in_no_sync_still_averages_the_others_its_loss_reaches(make_group: Any) -> None:
    """As torch: the encoder's no_sync() keeps its own gradients local; the head's,
    reached by the same loss, are averaged."""
    group: InProcessGroup = await make_group(2)

    def local_grads(rank: int) -> list[torch.Tensor]:
        torch.manual_seed(4)
        enc, head = nn.Linear(6, 8), nn.Linear(8, 3)
        head(torch.tanh(enc(X[4 * rank : 4 * rank + 4]))).sum().backward()
        return [p.grad for p in [*enc.parameters(), *head.parameters()]]  # type: ignore[misc]

    async def body(rank: int) -> list[torch.Tensor]:
        torch.manual_seed(4)
        enc, head = nn.Linear(6, 8), nn.Linear(8, 3)
        denc, dhead = await DDP.create(enc), await DDP.create(head)
        with denc.no_sync():
            await denc.backward(dhead(torch.tanh(denc(X[4 * rank : 4 * rank + 4]))).sum())
        return [p.grad.clone() for p in [*enc.parameters(), *head.parameters()]]  # type: ignore[union-attr]

    results = await run_all(group, body)
    mine = [local_grads(0), local_grads(1)]
    for rank in range(2):
        for k, got in enumerate(results[rank]):
            want = mine[rank][k] if k < 2 else (mine[0][k] + mine[1][k]) / 2
            assert_close(got, want)


async def test_a_wrapper_whose_forward_did_not_run_takes_no_part(make_group: Any) -> None:
    """An earlier wrapper of the same module (rewrapped on another group, the first one
    destroyed) plays no part in the new one's backward, as torch's reducer does not
    unless its forward ran; gradients through the bare module stay local, as in torch."""
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        model = mlp(0)
        pair = C.new_group([0, 1])
        old = await DDP.create(model, group=pair)
        await old.backward(old(X[rank : rank + 1]).sum())
        C.destroy_process_group(pair)
        new = await DDP.create(model)
        model.zero_grad()
        await new.backward(new(X[rank : rank + 1]).sum())  # old is not taken along
        model(X).sum().backward()  # through the bare module: local, no error

    await run_all(group, body)


async def test_a_backward_given_up_leaves_no_wrapper_taken(make_group: Any) -> None:
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[bool, bool]:
        torch.manual_seed(4)
        enc, head = nn.Linear(6, 8), nn.Linear(8, 3)
        denc, dhead = await DDP.create(enc), await DDP.create(head)
        if rank == 0:  # rank 1 never joins this backward: rank 0 gives up on it
            loss = dhead(torch.tanh(denc(X[:4]))).sum()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(dhead.backward(loss), 0.5)
        return denc._active, dhead._active

    assert await run_all(group, body) == [(False, False), (False, False)]


async def test_create_refused_on_one_rank_fails_the_others_at_once(make_group: Any) -> None:
    """The others waited in the broadcast of rank 0's state until their timeout, and
    their next collective then paired with the refusing rank's next one."""
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[str, float]:
        start = time.monotonic()
        try:
            await DDP.create(mlp(0), bucket_cap_mb="x" if rank == 1 else 25)  # type: ignore[arg-type]
            failure = "none"
        except (TypeError, C.CollectiveError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        assert time.monotonic() - start < 5
        t = torch.tensor([float(rank + 1)])
        await C.all_reduce(t)  # the group is still in step
        return failure, t.item()

    (fail0, sum0), (fail1, sum1) = await run_all(group, body)
    assert fail1 == "TypeError: bucket_cap_mb must be a number of MiB, got str"
    assert fail0.startswith("CollectiveError") and "bucket_cap_mb must be a number of MiB" in fail0
    assert sum0 == sum1 == 3.0


async def test_two_wrappers_backward_at_once_average_each_their_own(make_group: Any) -> None:
    """asyncio.gather of two wrappers' backward (same shapes, same group): their
    all-reduces used to pair in the order hooks fired, mixing the two models."""
    group: InProcessGroup = await make_group(2)

    def local_grads(seed: int) -> list[torch.Tensor]:
        shards = []
        for rank in range(2):
            model = mlp(seed)
            nn.functional.mse_loss(model(X[4 * rank : 4 * rank + 4]), Y[4 * rank : 4 * rank + 4]).backward()
            shards.append([p.grad for p in model.parameters()])
        return [(a + b) / 2 for a, b in zip(*shards, strict=True)]

    async def body(rank: int) -> list[list[torch.Tensor]]:
        a, b = mlp(1), mlp(2)
        da, db = await DDP.create(a, bucket_cap_mb=1e-4), await DDP.create(b, bucket_cap_mb=1e-4)
        shard = slice(4 * rank, 4 * rank + 4)
        steps = []
        for _ in range(6):  # (how the hooks of the two interleave varies)
            a.zero_grad(set_to_none=True)
            b.zero_grad(set_to_none=True)
            la = nn.functional.mse_loss(da(X[shard]), Y[shard])
            lb = nn.functional.mse_loss(db(X[shard]), Y[shard])
            await asyncio.gather(da.backward(la), db.backward(lb))
            steps.append([p.grad for p in a.parameters()] + [p.grad for p in b.parameters()])
        return steps

    want = local_grads(1) + local_grads(2)
    for steps in await run_all(group, body):
        for got in steps:
            for g, w in zip(got, want, strict=True):
                assert_close(g, w)


async def test_find_unused_second_backward_of_one_forward_leaves_unused_grads_none(make_group: Any) -> None:
    """Two losses of one forward (retain_graph): the unused branch stays without a
    gradient in the second backward too, as in torch (it used to get zeros)."""
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> list[bool]:
        torch.manual_seed(0)
        model = Branchy()
        ddp = await DDP.create(model, find_unused_parameters=True)
        out = ddp(X[:4], False)
        await ddp.backward(out.sum(), retain_graph=True)
        await ddp.backward((out * out).sum())
        return [p.grad is None for p in model.parameters()]

    results = await run_all(group, body)
    torch.manual_seed(0)
    reference = Branchy()
    reference(X[:4], False).sum().backward()
    assert results[0] == results[1] == [p.grad is None for p in reference.parameters()]
    assert any(results[0])


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class _SlowBackward(_Identity):
    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)
        return grad


async def test_a_backward_cancelled_on_one_rank_keeps_the_ranks_in_step(make_group: Any) -> None:
    """Rank 0 gives up its step-1 backward at once (wait_for): it issues the rest of
    that step's collectives anyway, the other rank's step fails saying so, and the next
    steps pair up and average as before (they used to fail with mismatches for good)."""
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[list[str], list[torch.Tensor]]:
        torch.manual_seed(3)
        model = WithNorm()
        ddp = await DDP.create(model, bucket_cap_mb=1e-4)
        outcomes = []
        for step in range(4):
            model.zero_grad(set_to_none=True)
            loss = ddp(X[4 * rank : 4 * rank + 4]).square().mean()
            try:
                if step == 1 and rank == 0:  # given up while its local backward runs
                    await asyncio.wait_for(ddp.backward(_SlowBackward.apply(loss)), 0.05)
                else:
                    await ddp.backward(loss)
                outcomes.append("ok")
            except (TimeoutError, RuntimeError) as exc:
                outcomes.append(type(exc).__name__)
        return outcomes, [p.grad.clone() for p in model.parameters()]

    (out0, grads0), (out1, grads1) = await run_all(group, body)
    assert out0 == ["ok", "TimeoutError", "ok", "ok"] and out1 == ["ok", "RuntimeError", "ok", "ok"]
    for g0, g1 in zip(grads0, grads1, strict=True):
        assert_close(g0, g1)


async def test_a_backward_cancelled_while_its_buckets_wait_leaves_the_next_step_exact(make_group: Any) -> None:
    """Rank 0 gives up its step-1 backward while its buckets wait for the slow rank 1:
    their all-reduces go on, and land in its buckets later. The next step averages its
    own gradients (it used to send rank 0's late step-1 averages instead, on every rank
    the same wrong result, and raised nothing)."""
    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[str, list[torch.Tensor]]:
        model = mlp(0)
        ddp = await DDP.create(model, bucket_cap_mb=1e-4)
        outcome = "ok"
        loss = ddp(X[4 * rank : 4 * rank + 4]).square().mean()
        try:
            if rank == 0:
                await asyncio.wait_for(ddp.backward(loss), 0.1)
            else:
                await ddp.backward(_SlowBackward.apply(loss))
        except TimeoutError:
            outcome = "TimeoutError"
        model.zero_grad(set_to_none=True)
        await ddp.backward(ddp(X[4 * rank : 4 * rank + 4]).square().mean())
        return outcome, [p.grad.clone() for p in model.parameters()]

    results = await run_all(group, body)
    assert [outcome for outcome, _ in results] == ["TimeoutError", "ok"]
    local = mlp(0)
    per_rank = []
    for rank in range(2):
        local.zero_grad(set_to_none=True)
        local(X[4 * rank : 4 * rank + 4]).square().mean().backward()
        per_rank.append([p.grad.clone() for p in local.parameters()])
    expected = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
    for _, grads in results:
        for got, want in zip(grads, expected, strict=True):
            assert_close(got, want)


class _SlowerBackward(_Identity):
    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.8)
        return grad


@pytest.mark.parametrize("synced", [True, False], ids=["averaged", "no_sync"])
async def test_a_cancelled_backward_has_written_its_gradients_when_it_raises(
    make_group: Any, synced: bool
) -> None:
    """Given up while the local backward runs on the pool (which cannot stop it), the
    call raises once that backward has ended: it used to go on adding into .grad after
    the call raised, beside the caller's next step."""
    await make_group(1)
    torch.manual_seed(0)
    model = mlp(0)
    ddp = await DDP.create(model)
    loss = _SlowerBackward.apply(ddp(X[:4])).square().mean()
    with contextlib.nullcontext() if synced else ddp.no_sync(), pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await ddp.backward(loss)
    at_raise = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    await asyncio.sleep(1.0)
    for then, now in zip(at_raise, model.parameters(), strict=True):
        assert then is not None, "the call raised before its backward ended"
        assert_close(now.grad, then)


async def test_a_wrapper_dropped_for_a_new_one_goes_with_its_hooks(make_group: Any) -> None:
    """Re-wrapping (after freezing a layer, say) used to keep every old wrapper alive
    through its hooks on the parameters, with its gradient-sized buckets."""
    import gc

    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[list[int], int]:
        model = mlp(5)
        for _ in range(4):
            ddp = await DDP.create(model, bucket_cap_mb=1e-4)
        await ddp.backward(nn.functional.mse_loss(ddp(X[4 * rank : 4 * rank + 4]), Y[4 * rank : 4 * rank + 4]))
        del ddp
        gc.collect()
        from actorgrad.runtime import get_worker

        alive = sum(ref() is not None for ref in _wrappers.get(get_worker(), []))
        return [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()], alive

    for hooks, alive in await run_all(group, body):
        assert hooks == [0] * len(hooks) and alive == 0


async def test_wrappers_and_groups_made_again_and_again_leave_bounded_tables(make_group: Any) -> None:
    """A job that wraps a model in a fresh subgroup time after time (a sweep, a
    re-wrap each epoch): the dead wrappers and the destroyed groups' locks used to
    stay listed, one more each time, and every backward scanned them all."""
    from actorgrad.parallel._ddp import _backward_turns
    from actorgrad.runtime import get_worker

    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> tuple[int, int]:
        model = mlp(5)
        for _ in range(12):
            sub = C.new_group([0, 1])
            ddp = await DDP.create(model, group=sub)
            await ddp.backward(nn.functional.mse_loss(ddp(X[4 * rank : 4 * rank + 4]), Y[4 * rank : 4 * rank + 4]))
            del ddp
            C.destroy_process_group(sub)
        worker = get_worker()
        return len(_wrappers.get(worker, [])), len(_backward_turns.get(worker, []))

    for wrappers, locks in await run_all(group, body):
        assert wrappers <= 2 and locks <= 2, (wrappers, locks)


async def test_a_loss_reaching_a_wrapper_of_another_group_waits_for_that_groups_backward(
        make_group: Any) -> None:
    """W1 (world) and W2 (a subgroup) under one loss, beside a backward of W3 in that
    subgroup: W1's backward averages W2 too, so it must hold the subgroup's lock as
    well; with only its own, W2's all-reduces paired up with W3's across ranks
    (silently wrong gradients on every rank)."""
    group: InProcessGroup = await make_group(2)

    def data(rank: int, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * rank + which)
        n = 200_000 if (rank == 0 and which == 3) else 4  # rank 0's W3 backward is slow
        return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)

    def expected() -> dict[str, list[torch.Tensor]]:
        per: dict[str, list[list[torch.Tensor]]] = {"W1W2": [], "W3": []}
        for r in range(2):
            m1, m2, m3 = mlp(1), mlp(2), mlp(3)
            x, y = data(r, 1)
            (nn.functional.mse_loss(m1(x), y) + nn.functional.mse_loss(m2(x), y)).backward()
            per["W1W2"].append([p.grad for m in (m1, m2) for p in m.parameters()])
            x, y = data(r, 3)
            nn.functional.mse_loss(m3(x), y).backward()
            per["W3"].append([p.grad for p in m3.parameters()])
        return {k: [sum(t) / 2 for t in zip(*v, strict=True)] for k, v in per.items()}

    async def body(rank: int) -> dict[str, list[torch.Tensor]]:
        sub = C.new_group([0, 1])
        m1, m2, m3 = mlp(1), mlp(2), mlp(3)
        d1 = await DDP.create(m1, bucket_cap_mb=1e-4)
        d2 = await DDP.create(m2, bucket_cap_mb=1e-4, group=sub)
        d3 = await DDP.create(m3, bucket_cap_mb=1e-4, group=sub)
        x1, y1 = data(rank, 1)
        x3, y3 = data(rank, 3)
        l1 = nn.functional.mse_loss(d1(x1), y1) + nn.functional.mse_loss(d2(x1), y1)
        l3 = nn.functional.mse_loss(d3(x3), y3)
        await asyncio.gather(d1.backward(l1), d3.backward(l3))
        return {"W1W2": [p.grad for m in (m1, m2) for p in m.parameters()], "W3": [p.grad for p in m3.parameters()]}

    want = expected()
    for got in await run_all(group, body):
        for key in want:
            for g, w in zip(got[key], want[key], strict=True):
                assert_close(g, w, atol=1e-5, rtol=1e-4)


async def test_backwards_take_their_turns_in_the_order_they_were_called(make_group: Any) -> None:
    """Every rank calls C (world), A (world, and a subgroup its loss reaches too), B
    (subgroup) in this order; rank 0 calls B a little later. B must not overtake A
    on rank 1 while A waits for C: the ranks would pair A's and B's collectives in
    different orders (each rank waiting on the other until the collective timeout)."""
    group: InProcessGroup = await make_group(2)

    def data(rank: int, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * rank + which)
        return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)

    def expected() -> list[list[torch.Tensor]]:
        per: list[list[list[torch.Tensor]]] = [[], [], []]
        for r in range(2):
            m0, m1, m2, m3 = mlp(0), mlp(1), mlp(2), mlp(3)
            x, y = data(r, 0)
            nn.functional.mse_loss(m0(x), y).backward()
            x, y = data(r, 1)
            (nn.functional.mse_loss(m1(x), y) + nn.functional.mse_loss(m2(x), y)).backward()
            x, y = data(r, 3)
            nn.functional.mse_loss(m3(x), y).backward()
            for i, models in enumerate(((m0,), (m1, m2), (m3,))):
                per[i].append([p.grad for m in models for p in m.parameters()])
        return [[sum(t) / 2 for t in zip(*v, strict=True)] for v in per]

    async def body(rank: int) -> list[list[torch.Tensor]]:
        sub = C.new_group([0, 1])
        m0, m1, m2, m3 = mlp(0), mlp(1), mlp(2), mlp(3)
        d0 = await DDP.create(m0, bucket_cap_mb=1e-4)
        d1 = await DDP.create(m1, bucket_cap_mb=1e-4)
        d2 = await DDP.create(m2, bucket_cap_mb=1e-4, group=sub)
        d3 = await DDP.create(m3, bucket_cap_mb=1e-4, group=sub)
        (x0, y0), (x1, y1), (x3, y3) = data(rank, 0), data(rank, 1), data(rank, 3)
        lc = nn.functional.mse_loss(d0(x0), y0)
        la = nn.functional.mse_loss(d1(x1), y1) + nn.functional.mse_loss(d2(x1), y1)
        lb = nn.functional.mse_loss(d3(x3), y3)
        c = asyncio.ensure_future(d0.backward(lc))
        await asyncio.sleep(0)
        a = asyncio.ensure_future(d1.backward(la))
        await asyncio.sleep(0.5 if rank == 0 else 0)
        b = asyncio.ensure_future(d3.backward(lb))
        await asyncio.wait_for(asyncio.gather(c, a, b), 20)
        return [[p.grad for m in models for p in m.parameters()] for models in ((m0,), (m1, m2), (m3,))]

    want = expected()
    for got in await run_all(group, body):
        for g_part, w_part in zip(got, want, strict=True):
            for g, w in zip(g_part, w_part, strict=True):
                assert_close(g, w, atol=1e-5, rtol=1e-4)


async def test_a_cancelled_waiter_gives_up_its_own_turn_not_the_running_ones() -> None:
    """Two backwards of one group: the second, waiting, is cancelled and leaves the
    queue (else the third would wait for good); the third still waits for the first."""
    from actorgrad.parallel._ddp import _turns

    class Worker:  # (the queues are kept per worker object)
        pass

    worker = Worker()
    running: list[str] = []
    overlaps: list[list[str]] = []

    async def backward(name: str, hold: float) -> None:
        async with _turns(worker).turn({1}):
            if running:
                overlaps.append([*running, name])
            running.append(name)
            await asyncio.sleep(hold)
            running.remove(name)

    first = asyncio.ensure_future(backward("first", 0.2))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(backward("second", 0.01))
    await asyncio.sleep(0.01)
    second.cancel()
    await asyncio.sleep(0.01)
    third = asyncio.ensure_future(backward("third", 0.01))
    await asyncio.gather(first, third)
    assert second.cancelled() and overlaps == []


async def test_a_groups_backward_lock_is_not_dropped_while_handed_to_a_waiter() -> None:
    """Idle backward locks go when another group's is needed; one just released to a
    waiter that has not run yet is not idle (a lock made anew for that group let a
    third backward run beside the waiter's: their all-reduces paired up wrongly)."""
    import types

    from actorgrad.parallel._ddp import _turns

    def _backward_lock(worker: Any, group: Any) -> Any:
        return _turns(worker).turn({group.id})

    class Worker:  # (the locks are kept per worker object)
        pass

    worker = Worker()
    g1, g2 = types.SimpleNamespace(id=1), types.SimpleNamespace(id=2)
    inside: list[str] = []
    overlaps: list[tuple[str, list[str]]] = []

    async def backward(name: str, group: Any, hold: float) -> None:
        async with _backward_lock(worker, group):
            if group is g1 and inside:
                overlaps.append((name, list(inside)))
            if group is g1:
                inside.append(name)
            await asyncio.sleep(hold)
            if group is g1:
                inside.remove(name)

    async def first_then_another_group() -> None:
        await backward("A", g1, 0.05)
        await backward("C", g2, 0.01)  # in the step that released g1's lock to B

    a = asyncio.ensure_future(first_then_another_group())
    await asyncio.sleep(0.01)
    b = asyncio.ensure_future(backward("B", g1, 0.2))  # waits for A
    await asyncio.sleep(0.1)
    d = asyncio.ensure_future(backward("D", g1, 0.05))  # must wait for B
    await asyncio.gather(a, b, d)
    assert overlaps == []


async def test_copying_or_saving_a_wrapper_says_what_to_do_instead(make_group: Any) -> None:
    import copy
    import io

    group: InProcessGroup = await make_group(2)

    async def body(rank: int) -> None:
        ddp = await DDP.create(mlp(0))
        for attempt in (lambda: copy.deepcopy(ddp), lambda: copy.copy(ddp), lambda: torch.save(ddp, io.BytesIO())):
            with pytest.raises(TypeError, match="copy or save its .module"):
                attempt()
        copy.deepcopy(ddp.module)  # what to do instead works
        torch.save(ddp.state_dict(), io.BytesIO())

    await run_all(group, body)


def _embedding() -> nn.Module:
    torch.manual_seed(5)
    return nn.EmbeddingBag(10, 4, mode="sum")


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)  # each trainer its own data
    offsets = torch.tensor([0, 2, 4, 6])
    return [(torch.randint(0, 10, (8,), generator=g), offsets, torch.randint(0, 3, (4,), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("mode", ["fast", "smart"])
async def test_dist_autograd_backward_averages_ddp_gradients_as_torch(make_group: Any, mode: str) -> None:
    """torch's "Combining DDP with distributed RPC": a remote embedding (worker0) feeds a
    DDP-wrapped layer on each trainer; the trainers run a distributed backward and a
    DistributedOptimizer step. The DDP gradients are averaged in the context, as torch's
    DDP does inside dist_autograd.backward: the replicas stay equal, and equal to
    single-process training on both trainers' batches."""
    import actorgrad as ag

    group: InProcessGroup = await make_group(3)
    steps, lr = 3, 0.5
    # the oracle: one process, the layer stepped on the mean of both trainers' gradients
    emb = _embedding()
    torch.manual_seed(1)  # the first trainer's layer: create() copies it to the other
    fc = nn.Linear(4, 3)
    data = {rank: _batches(rank, steps) for rank in (1, 2)}
    for step in range(steps):
        grads = [torch.autograd.grad(
            nn.functional.cross_entropy(fc(emb(data[r][step][0], data[r][step][1])), data[r][step][2]),
            list(fc.parameters())) for r in (1, 2)]
        with torch.no_grad():
            for p, g1, g2 in zip(fc.parameters(), *grads, strict=True):
                p -= lr * (g1 + g2) / 2

    async def body(rank: int) -> list[torch.Tensor] | None:
        trainers = C.new_group([1, 2])
        if rank == 0:
            return None
        emb_rref = ag.remote("worker0", _embedding)
        torch.manual_seed(rank)  # different on purpose: create() copies the first one's
        layer = nn.Linear(4, 3)
        ddp = await DDP.create(layer, group=trainers)
        opt = ag.optim.DistributedOptimizer(torch.optim.SGD, [ag.RRef(p) for p in layer.parameters()], lr=lr)
        for indices, offsets, target in _batches(rank, steps):
            async with ag.autograd.context() as cid:
                out = ddp(await emb_rref.rpc_async().forward(indices, offsets))
                await ag.autograd.backward(cid, [nn.functional.cross_entropy(out, target)], mode=mode)
                await opt.step(cid)
            assert layer.weight.grad is None  # the context holds the gradients
        return [p.detach().clone() for p in layer.parameters()]

    _, params1, params2 = await run_all(group, body)
    for a, b, want in zip(params1, params2, fc.parameters(), strict=True):
        assert torch.equal(a, b)
        assert_close(a, want.detach(), rtol=1e-5, atol=1e-6)


class _RaisesInBackward(_Identity):
    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward failed on purpose")


def _through_failing_backward(x: torch.Tensor) -> torch.Tensor:
    return _RaisesInBackward.apply(x)


async def test_dist_autograd_backward_failing_on_one_trainer_fails_both_in_step(make_group: Any) -> None:
    """A distributed backward that fails on one trainer still issues its DDP collectives
    (saying it failed): the other trainer raises at once instead of waiting, and the
    next iteration pairs up again."""
    import actorgrad as ag

    group: InProcessGroup = await make_group(3)

    async def body(rank: int) -> tuple[list[str], list[torch.Tensor]] | None:
        trainers = C.new_group([1, 2])
        if rank == 0:
            return None
        layer = nn.Linear(4, 3)
        ddp = await DDP.create(layer, group=trainers)
        errors = []
        for step in range(2):
            x = torch.randn(2, 4)
            async with ag.autograd.context() as cid:
                loss = ddp(x).sum()
                if rank == 2 and step == 0:  # fails before any gradient reaches the layer
                    loss = (await ag.rpc_async("worker0", _through_failing_backward, args=(loss,))).sum()
                try:
                    await asyncio.wait_for(ag.autograd.backward(cid, [loss]), 20)
                except (ag.RemoteError, RuntimeError) as exc:
                    errors.append(f"{step}: {exc}")
                    continue
                grads = ag.autograd.get_gradients(cid)
                with torch.no_grad():
                    for p in layer.parameters():
                        p -= 0.1 * grads[p]
        return errors, [p.detach().clone() for p in layer.parameters()]

    _, (errors1, params1), (errors2, params2) = await run_all(group, body)
    assert len(errors2) == 1 and errors2[0].startswith("0:") and "on purpose" in errors2[0]
    assert len(errors1) == 1 and errors1[0].startswith("0:") and "raised on 1 other rank" in errors1[0]
    for a, b in zip(params1, params2, strict=True):
        assert torch.equal(a, b)


async def test_a_failed_dist_backward_that_did_not_reach_a_wrapper_leaves_it_alone(make_group: Any) -> None:
    """A wrapper waiting for its own ddp.backward is not this distributed pass's: when
    the pass fails on one rank before reaching it, that rank issues none of its
    collectives, and the ddp.backward of every rank still pairs up and averages."""
    import actorgrad as ag

    group: InProcessGroup = await make_group(2)
    reference = mlp(0)
    nn.functional.mse_loss(reference(X), Y).backward()

    async def body(rank: int) -> list[torch.Tensor]:
        model = mlp(0)
        ddp = await DDP.create(model)
        shard = slice(4 * rank, 4 * rank + 4)
        loss = nn.functional.mse_loss(ddp(X[shard]), Y[shard])  # armed, for ddp.backward
        if rank == 1:
            async with ag.autograd.context() as cid:
                x = await ag.rpc_async("worker0", _through_failing_backward, args=(torch.ones(2, requires_grad=True),))
                with pytest.raises(ag.RemoteError, match="on purpose"):
                    await ag.autograd.backward(cid, [x.sum()])
        await asyncio.wait_for(ddp.backward(loss), 20)
        return [p.grad.clone() for p in model.parameters()]

    grads0, grads1 = await run_all(group, body)
    for a, b, want in zip(grads0, grads1, reference.parameters(), strict=True):
        assert torch.equal(a, b)
        assert_close(a, want.grad, rtol=1e-5, atol=1e-6)


_REPLICAS: dict[str, DDP] = {}


async def _make_replica(group_ranks: list[int]) -> None:
    import actorgrad as ag

    trainers = C.new_group(group_ranks)
    torch.manual_seed(0)
    _REPLICAS[ag.get_worker_info().name] = await DDP.create(nn.Linear(4, 3), group=trainers)


def _replica_forward(x: torch.Tensor) -> torch.Tensor:
    import actorgrad as ag

    return _REPLICAS[ag.get_worker_info().name](x)


async def test_dist_backward_started_elsewhere_refuses_to_leave_ddp_unaveraged(make_group: Any) -> None:
    """Replicas on worker1 and worker2 whose forwards worker0 ran by RPC: a backward
    started on worker0 would leave their gradients unaveraged (torch averages them
    wherever they are); it fails naming the problem instead of letting them drift."""
    import actorgrad as ag

    group: InProcessGroup = await make_group(3)
    C.new_group([1, 2])  # (every worker creates the group, worker0 too)
    await asyncio.gather(*(group.run_as(r, _make_replica, [1, 2]) for r in (1, 2)))
    async with ag.autograd.context() as cid:
        outs = [await ag.rpc_async(f"worker{r}", _replica_forward, args=(torch.randn(2, 4),)) for r in (1, 2)]
        with pytest.raises(ag.RemoteError, match="started on another worker"):
            await ag.autograd.backward(cid, [sum(o.sum() for o in outs)])


class _TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


async def test_dist_backward_unused_parameters_average_zeros_not_a_stale_grad(make_group: Any) -> None:
    """find_unused_parameters in a distributed backward: a parameter one rank did not
    use counts as zero there, as in ddp.backward, not as the .grad an earlier
    ddp.backward left on it (the context's gradients have nothing to do with .grad)."""
    import actorgrad as ag

    group: InProcessGroup = await make_group(2)
    reference = _TwoBranches()
    want = [torch.autograd.grad(reference(X[4 * r : 4 * r + 4], r == 0).sum(), list(reference.parameters()),
                                allow_unused=True) for r in (0, 1)]

    async def body(rank: int) -> dict[str, torch.Tensor]:
        model = _TwoBranches()
        ddp = await DDP.create(model, find_unused_parameters=True)
        await ddp.backward(ddp(X[:4], True).sum())  # leaves .grad on every parameter
        async with ag.autograd.context() as cid:
            loss = ddp(X[4 * rank : 4 * rank + 4], rank == 0).sum()
            await ag.autograd.backward(cid, [loss])
            grads = ag.autograd.get_gradients(cid)
            return {n: grads[p].clone() for n, p in model.named_parameters()}

    got0, got1 = await run_all(group, body)
    for i, (name, _) in enumerate(reference.named_parameters()):
        expected = sum(g[i] if g[i] is not None else 0 for g in want) / 2
        assert torch.equal(got0[name], got1[name])
        assert_close(got0[name], expected, rtol=1e-5, atol=1e-6)
