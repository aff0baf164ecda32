"""Large gradients lent across processes (``autograd._loans``): the gradients equal plain
local autograd, every loan comes back, and bad or lost loans fail clearly."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from _ag_helpers import assert_grads, local_copies

import actorgrad as ag
from actorgrad import ProtocolError, RemoteError
from actorgrad.autograd._engine import engine_actor
from actorgrad.autograd._loans import LEND_MAX_BYTES, LEND_MIN_BYTES, Lent, Loans
from actorgrad.runtime import _cma

pytestmark = pytest.mark.skipif(not _cma.available(), reason="no process_vm_readv here")

SIDE = 160  # 160 x 160 float32: 100 KiB, over LEND_MIN_BYTES


def square_then_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).tanh() * 3


def loans_state() -> tuple[int, int]:
    """(gradients lent so far, loans not returned yet) of the worker it runs on."""
    loans = engine_actor().loans
    return loans.lent_total, sum(len(held) for held in loans.lent.values())


async def until_all_returned(names: list[str], timeout: float = 5.0) -> dict[str, tuple[int, int]]:
    deadline = time.monotonic() + timeout
    while True:
        states = {name: await ag.rpc_async(name, loans_state) for name in names}
        if all(outstanding == 0 for _, outstanding in states.values()) or time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.01)


async def test_large_gradients_travel_as_loans_and_come_back(make_process_group):
    """worker0 -> worker1 and back, with full (not broadcast) gradients both ways: each
    worker lends the other the gradient of what it received."""
    await make_process_group(2)
    assert LEND_MIN_BYTES <= SIDE * SIDE * 4 <= LEND_MAX_BYTES
    for _ in range(4):  # (the first pass asks whether worker1 can read us: socket)
        x = torch.randn(SIDE, SIDE, requires_grad=True)
        w = torch.randn(SIDE, SIDE, requires_grad=True)
        async with ag.autograd.context() as cid:
            y = await ag.rpc_async("worker1", square_then_scale, args=(x, w))
            loss = (y * y).sum()  # d loss / dy = 2y: a full tensor back to worker1
            await ag.autograd.backward(cid, [loss])
            grads = ag.autograd.get_gradients(cid)
        lx, lw = local_copies(x, w)
        ly = square_then_scale(lx, lw)
        (ly * ly).sum().backward()
        assert_grads(grads, [(x, lx.grad), (w, lw.grad)])
    states = await until_all_returned(["worker0", "worker1"])
    assert states["worker0"][0] >= 2, f"worker0 lent no gradient: {states}"
    assert states["worker1"][0] >= 2, f"worker1 lent no gradient: {states}"
    assert all(outstanding == 0 for _, outstanding in states.values()), f"loans never returned: {states}"


async def _readable(worker: object, rank: int) -> None:
    cma = _cma.cma_peers(worker)  # type: ignore[arg-type]
    for _ in range(200):
        if cma.ok(rank):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the memory probe never answered")


async def test_only_large_dense_gradients_are_lent(group2):
    w0 = group2.workers[0]
    loans = engine_actor(w0).loans
    await _readable(w0, 1)
    n = LEND_MIN_BYTES // 4
    large = torch.randn(n)
    kept = (
        None,
        torch.randn(n // 2),  # small
        torch.ones(()).expand(n),  # broadcast (travels as one value)
        torch.randn(2 * n)[::2],  # not contiguous
        torch.randn(n, requires_grad=True),
        torch.randn(n, dtype=torch.float64).to(torch.int64),  # not a gradient's dtype
        torch.randn(n // 2, dtype=torch.complex64).conj(),  # lazy: its bytes are not its values
        torch.randn(n // 2, dtype=torch.complex64)._neg_view(),
        torch.sparse_coo_tensor([[0]], [1.0], (n,), check_invariants=True),
        torch.randn(LEND_MAX_BYTES // 4 + 1),  # read a piece at a time through the socket
    )
    assert loans.lend(1, kept) is kept
    assert loans.lend(0, (large,)) == (large,)  # (never to itself)
    sent = loans.lend(1, (None, large))
    assert sent[0] is None and type(sent[1]) is Lent
    assert loans.lent[1][sent[1].loan_id] is large  # held until returned

    # the receiver reads it into a tensor of its own, and returns the loan soon after
    loans1 = engine_actor(group2.workers[1]).loans
    got = loans1.borrow(0, sent)
    assert got[0] is None and torch.equal(got[1], large) and got[1].data_ptr() != large.data_ptr()
    for _ in range(200):
        if not loans.lent:
            break
        await asyncio.sleep(0.005)
    assert not loans.lent


async def test_a_lost_peer_takes_its_loans_along(group2):
    w0 = group2.workers[0]
    loans = engine_actor(w0).loans
    await _readable(w0, 1)
    loans.lend(1, (torch.randn(LEND_MIN_BYTES // 4),))
    assert loans.lent
    loans.on_worker_lost("worker1", 1, "gone")
    assert not loans.lent


@pytest.mark.parametrize(
    "lent",
    [
        Lent(1, 4096, LEND_MIN_BYTES, 99, (LEND_MIN_BYTES // 4,)),  # no such dtype
        Lent(1, 4096, LEND_MIN_BYTES, 0, (LEND_MIN_BYTES // 4 + 1,)),  # shape and size disagree
        Lent(1, 4096, 64, 0, (16,)),  # too small to have been lent
        Lent(1, 4096, LEND_MIN_BYTES, 0, (-1, -LEND_MIN_BYTES // 4)),
        Lent(1, 0, LEND_MIN_BYTES, 0, (LEND_MIN_BYTES // 4,)),
        Lent(1, 4096, LEND_MIN_BYTES, 0, "not a shape"),  # type: ignore[arg-type]
        Lent(1, 4096, LEND_MIN_BYTES, 0, (LEND_MIN_BYTES // 4,)),  # an address not mapped
    ],
)
async def test_a_bad_loan_is_refused_and_still_returned(group2, lent):
    w0, w1 = group2.workers
    await _readable(w0, 1)  # worker1 now reads worker0's memory
    loans1 = engine_actor(w1).loans
    with pytest.raises(ProtocolError, match="lent"):
        loans1.borrow(0, (lent,))
    assert loans1._owed == {0: [1]}  # goes back all the same


async def test_a_loan_from_a_peer_never_probed_is_refused(group2):
    loans1 = engine_actor(group2.workers[1]).loans
    with pytest.raises(ProtocolError, match="without a memory probe"):
        loans1.borrow(0, (Lent(7, 4096, LEND_MIN_BYTES, 0, (LEND_MIN_BYTES // 4,)),))


async def test_a_gradient_that_cannot_be_read_fails_the_backward(group2, monkeypatch):
    """A lent gradient whose memory is gone: the backward raises, naming it; it does
    not hang, and the context is released."""
    lend = Loans.lend

    def bad_address(self, to, grads):
        return tuple(Lent(g.loan_id, 4096, g.nbytes, g.code, g.shape) if type(g) is Lent else g
                     for g in lend(self, to, grads))

    await _readable(group2.workers[0], 1)
    monkeypatch.setattr(Loans, "lend", bad_address)
    x = torch.randn(SIDE, SIDE, requires_grad=True)
    w = torch.randn(SIDE, SIDE, requires_grad=True)
    async with ag.autograd.context() as cid:
        y = await ag.rpc_async("worker1", square_then_scale, args=(x, w))
        with pytest.raises(RemoteError, match="cannot be read"):
            await asyncio.wait_for(ag.autograd.backward(cid, [(y * y).sum()]), 10)


def times_one(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


async def test_a_lazily_conjugated_gradient_arrives_conjugated(group2):
    """``d/dy (y.conj() * a).real.sum()`` is a lazy conjugate view: its bytes are not its
    values, so it must not be lent as they are."""
    await _readable(group2.workers[0], 1)
    a = torch.randn(SIDE, SIDE, dtype=torch.complex64)
    x = torch.randn(SIDE, SIDE, dtype=torch.complex64, requires_grad=True)
    async with ag.autograd.context() as cid:
        y = await ag.rpc_async("worker1", times_one, args=(x,))
        await ag.autograd.backward(cid, [(y.conj() * a).real.sum()])
        grads = ag.autograd.get_gradients(cid)
    (lx,) = local_copies(x)
    (times_one(lx).conj() * a).real.sum().backward()
    assert_grads(grads, [(x, lx.grad)])
