"""Point-to-point: blocking and non-blocking, any source, tags, large tensors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from collective_helpers import run_all, tune

import actorgrad.collective as C
from actorgrad.collective._actor import actor
from actorgrad.testing import InProcessGroup


async def test_send_recv_blocking(world4: InProcessGroup) -> None:
    async def body(rank: int) -> tuple[torch.Tensor, int]:
        t = torch.zeros(3)
        src = -1
        if rank == 0:
            t += 1
            await C.send(t, dst=1)
        elif rank == 1:
            src = await C.recv(t, src=0)
        return t, src

    results = await run_all(world4, body)
    assert results[1] == (results[1][0], 0)
    assert results[1][0].tolist() == [1.0, 1.0, 1.0]
    assert results[2][0].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("numel", [0, 1, 5, 2048, 2049, 20000], ids=lambda n: f"{n}el")
async def test_sent_tensors_of_every_kind_arrive_as_they_left(world4: InProcessGroup, numel: int) -> None:
    """Small ones travel inside the message header, larger ones as buffers of their
    own (8 KiB of float32 is 2048 elements): every dtype, a 0-dim tensor, a view."""
    g = torch.Generator().manual_seed(numel)
    sent = [
        torch.randn(numel, generator=g),
        (torch.randn(numel, generator=g) * 50).to(torch.int8),
        torch.randn(numel, generator=g) > 0,
        torch.randn(numel, generator=g).to(torch.bfloat16),
        torch.randn(numel, dtype=torch.complex64, generator=g),
        torch.randn(2 * numel, generator=g)[::2],  # a view with a stride
    ]
    if numel == 1:
        sent.append(torch.tensor(3.5))  # 0-dim

    async def body(rank: int) -> list[torch.Tensor]:
        got = [torch.zeros_like(t) for t in sent]
        if rank == 0:
            for t in sent:
                await C.send(t, dst=1)
        elif rank == 1:
            for t in got:
                assert await C.recv(t, src=0) == 0
        return got

    results = await run_all(world4, body)
    for want, got in zip(sent, results[1], strict=True):
        assert torch.equal(got, want) and got.shape == want.shape


async def test_isend_irecv_ring(world4: InProcessGroup) -> None:
    """Every rank sends to its right and receives from its left, non-blocking."""

    async def body(rank: int) -> tuple[torch.Tensor, int]:
        n = C.get_world_size()
        out = torch.full((2, 2), float(rank))
        into = torch.empty(2, 2)
        recv = C.irecv(into, src=(rank - 1) % n)
        send = C.isend(out, dst=(rank + 1) % n)
        assert recv is not None and send is not None
        await send
        assert await recv.wait() is True
        assert recv.is_completed()
        return into, recv.source_rank()

    for rank, (into, src) in enumerate(await run_all(world4, body)):
        assert src == (rank - 1) % 4
        assert into.tolist() == [[float(src)] * 2] * 2


async def test_recv_from_any_source(world4: InProcessGroup) -> None:
    async def body(rank: int) -> list[int]:
        if rank == 0:
            seen = []
            for _ in range(3):
                t = torch.zeros(1)
                src = await C.recv(t)  # any source
                assert t.item() == src * 10
                seen.append(src)
            return sorted(seen)
        await asyncio.sleep(0.01 * rank)
        await C.send(torch.tensor([rank * 10.0]), dst=0)
        return []

    assert (await run_all(world4, body))[0] == [1, 2, 3]


async def test_tags_select_messages(world4: InProcessGroup) -> None:
    """Messages of different tags never match each other, whatever the order."""

    async def body(rank: int) -> tuple[float, float]:
        if rank == 2:  # non-blocking: gloo's send waits for the matching recv
            w1 = C.isend(torch.tensor([1.0]), dst=3, tag=1)
            w2 = C.isend(torch.tensor([2.0]), dst=3, tag=2)
            await asyncio.gather(w1, w2)  # type: ignore[arg-type]
        if rank == 3:
            a, b = torch.zeros(1), torch.zeros(1)
            await C.recv(b, src=2, tag=2)  # posted in the other order
            await C.recv(a, src=2, tag=1)
            return a.item(), b.item()
        return 0.0, 0.0

    assert (await run_all(world4, body))[3] == (1.0, 2.0)


async def test_p2p_in_a_subgroup_uses_global_ranks(world4: InProcessGroup) -> None:
    async def body(rank: int) -> float:
        g = C.new_group([1, 3])
        t = torch.zeros(1)
        if rank == 1:
            await C.send(torch.tensor([7.0]), dst=3, group=g)
        elif rank == 3:
            assert await C.recv(t, src=None, group=g) == 1
        return t.item()

    assert (await run_all(world4, body))[3] == 7.0


@pytest.mark.parametrize("cma", [True, False], ids=["cma", "tcp"])
async def test_large_send_completes_after_the_receiver_has_it(make_group: object, cma: bool) -> None:
    group: InProcessGroup = await make_group(2)  # type: ignore[operator]
    tune(group, use_cma=cma)
    numel = 2_000_000

    async def body(rank: int) -> torch.Tensor:
        t = torch.arange(numel, dtype=torch.float32)
        for _ in range(2):  # the second round reads through CMA once probed
            if rank == 0:
                await C.send(t, dst=1)
                t.zero_()  # allowed as soon as send returned
                t += torch.arange(numel, dtype=torch.float32)
            else:
                t = torch.empty(numel)
                assert await C.recv(t, src=0) == 0
        return t

    got = (await run_all(group, body))[1]
    assert torch.equal(got, torch.arange(numel, dtype=torch.float32))


async def test_a_tag_used_once_leaves_nothing_behind(world4: InProcessGroup) -> None:
    """Messages that arrive before their recv wait in a queue per tag; once taken, a tag
    used only once must not keep an empty queue (a job using a fresh tag per step)."""
    from actorgrad.collective._api import actor

    async def body(rank: int) -> list[float]:
        if rank == 0:
            for tag in range(50):
                await C.send(torch.full((1,), float(tag)), dst=1, tag=tag)
            return []
        if rank == 1:
            await asyncio.sleep(0.2)  # let them all arrive first
            got = []
            for tag in range(50):
                t = torch.empty(1)
                await C.recv(t, src=0, tag=tag)
                got.append(t.item())
            assert not actor()._p2p_queue
            return got
        return []

    assert (await run_all(world4, body))[1] == [float(tag) for tag in range(50)]


async def test_a_recv_given_up_on_takes_no_message(world4: InProcessGroup, backend: str) -> None:
    """recv with a timeout, then again: the first, abandoned receive must not take the
    message the retry waits for (gloo cannot withdraw a posted receive)."""
    if backend == "gloo":
        pytest.skip("gloo has no way to withdraw a posted receive")

    async def body(rank: int) -> tuple[float, float] | None:
        if rank == 0:
            await asyncio.sleep(0.3)
            await C.send(torch.tensor([42.0]), dst=1)
        if rank != 1:
            return None
        abandoned, fresh = torch.zeros(1), torch.zeros(1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(C.recv(abandoned, src=0), 0.1)
        assert await asyncio.wait_for(C.recv(fresh, src=0), 5) == 0
        return abandoned.item(), fresh.item()

    assert (await run_all(world4, body))[1] == (0.0, 42.0)


async def test_a_recv_cancelled_as_its_message_arrives_hands_the_message_on(
    world4: InProcessGroup, backend: str
) -> None:
    """The receive is cancelled (its timeout fires) in the step its message reached it:
    the message goes to the next receive, as asyncio.Queue.get hands an item back,
    instead of being lost with the cancelled receive (a retry loop dropped messages)."""
    if backend == "gloo":
        pytest.skip("gloo has no way to withdraw a posted receive")

    async def body(rank: int) -> float | None:
        if rank == 0:
            await C.send(torch.tensor([42.0]), dst=1)
        if rank != 1:
            return None
        act = actor()
        first = asyncio.ensure_future(C.recv(torch.zeros(1), src=0))
        deliver = act._deliver

        def deliver_and_cancel(*args: Any) -> None:
            deliver(*args)
            first.cancel()  # what the caller's timeout does when it fires in this step

        act._deliver = deliver_and_cancel  # type: ignore[method-assign]
        try:
            with pytest.raises(asyncio.CancelledError):
                await first
        finally:
            del act._deliver
        fresh = torch.zeros(1)
        assert await asyncio.wait_for(C.recv(fresh, src=0), 5) == 0
        return fresh.item()

    assert (await run_all(world4, body))[1] == 42.0


def _plus_one(x: int) -> int:
    return x + 1


async def test_receives_posted_ahead_leave_the_pool_free(world4: InProcessGroup) -> None:
    # (on gloo each pending receive held one of the worker's 16 pool threads: a server
    # waiting on its clients could run no remote function, which timed out)
    import actorgrad as ag

    async def body(rank: int) -> Any:
        if rank == 0:
            bufs = [torch.zeros(2) for _ in range(20)]
            works = [C.irecv(b, src=1, tag=i) for i, b in enumerate(bufs)]
            for w in works:
                await w
            return [b.tolist() for b in bufs]
        if rank == 1:
            await asyncio.sleep(0.3)  # the receives are posted
            answer = await ag.rpc_async("worker0", _plus_one, args=(1,), timeout=5)
            for i in range(20):
                await C.send(torch.full((2,), float(i)), dst=0, tag=i)
            return answer
        return None

    results = await run_all(world4, body, timeout=30)
    assert results[1] == 2
    assert results[0] == [[float(i)] * 2 for i in range(20)]


async def test_a_wait_takes_a_timedelta_and_says_what_timed_out(world4: InProcessGroup) -> None:
    # (torch's Work.wait takes a timedelta: ours raised TypeError; an expired wait
    # raised a TimeoutError with no message)
    import datetime

    async def body(rank: int) -> str:
        if rank == 1:
            work = C.irecv(torch.zeros(1), src=0)
            with pytest.raises(TimeoutError) as expired:
                await work.wait(timeout=datetime.timedelta(milliseconds=50))
            await C.send(torch.ones(1), dst=0, tag=1)  # now rank 0 sends
            assert await work.wait(timeout=datetime.timedelta(seconds=10))
            return str(expired.value)
        if rank == 0:
            await C.recv(torch.zeros(1), src=1, tag=1)
            await C.send(torch.ones(1), dst=1)
        return ""

    results = await run_all(world4, body)
    assert "did not finish within 0.05s" in results[1], results[1]


async def test_a_wait_of_timedelta_zero_has_no_limit_and_any_number_will_do(world4: InProcessGroup) -> None:
    # (timedelta(0), torch's default for Work.wait, means no limit: it expired at once;
    # a Fraction's expiry raised a TypeError from the message's format)
    import datetime
    import fractions

    async def body(rank: int) -> str:
        if rank == 0:
            await asyncio.sleep(0.2)
            await C.send(torch.ones(1), dst=1)
        elif rank == 1:
            assert await C.irecv(torch.zeros(1), src=0).wait(timeout=datetime.timedelta(0))
            with pytest.raises(TimeoutError, match="within 0.05s"):
                await C.irecv(torch.zeros(1), src=0, tag=5).wait(timeout=fractions.Fraction(1, 20))
            await C.send(torch.ones(1), dst=0, tag=6)  # (the receive above stays posted)
        if rank == 0:
            await C.recv(torch.zeros(1), src=1, tag=6)
            await C.send(torch.ones(1), dst=1, tag=5)
        return "done"

    await run_all(world4, body)


async def test_wait_and_init_timeouts_must_be_numbers(world4: InProcessGroup) -> None:
    async def body(rank: int) -> None:
        if rank > 1:
            return
        if rank == 0:
            await C.send(torch.ones(1), dst=1)
            return
        work = C.irecv(torch.zeros(1), src=0)
        assert work is not None
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            await work.wait(timeout="x")  # type: ignore[arg-type]
        assert await work.wait(timeout=5)
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            await C.init_process_group(timeout="x")  # type: ignore[arg-type]

    await run_all(world4, body)


async def test_a_gloo_receive_given_up_on_does_not_hold_a_graceful_shutdown(make_group: Any) -> None:
    """A posted gloo receive waits on a pool thread until the backend closes (gloo
    cannot withdraw it): a graceful shutdown, which waits for work still served, must
    not wait for it too (both ranks waited for their whole shutdown timeout)."""
    group: InProcessGroup = await make_group(2)
    await run_all(group, lambda rank: C.init_process_group(backend="gloo"))

    async def post(rank: int) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(C.recv(torch.zeros(3), src=1 - rank, tag=7), 0.2)

    await run_all(group, post)
    start = time.monotonic()
    await group.shutdown()
    assert time.monotonic() - start < 8  # (the in-process groups' shutdown timeout is 10 s)
