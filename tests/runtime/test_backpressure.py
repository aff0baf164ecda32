"""A peer that does not read what a worker sends it: its calls wait instead of piling
up replies, in order, and a peer that stopped reading for good is dropped."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from typing import Any

import torch

import actorgrad as ag
from actorgrad.wire import Payload

MiB = 1 << 20
served_order: list[int] = []


def big(i: int) -> torch.Tensor:
    return torch.full((4 * MiB,), float(i))  # 16 MiB


def record(i: int) -> int:
    served_order.append(i)
    return i


async def test_a_peer_that_stops_reading_gets_no_more_work_and_is_dropped(make_group, caplog):
    group = await make_group(3, ag.RpcOptions(heartbeat_interval=0.2, heartbeat_timeout=1.0))
    w1, w2 = group.workers[1], group.workers[2]
    # worker2 plays the peer that stops reading (and never gives up on worker1 itself)
    w2.options = dataclasses.replace(w2.options, heartbeat_timeout=60.0)
    w2.peers[1].transport.pause_reading()
    to_w2 = w1.peers[2]

    async def ask_and_never_read() -> int:
        # asks for a 16 MiB result every 20 ms, reads none
        futures = []
        while 2 in w1.peers and len(futures) < 60:
            futures.append(ag.rpc_async("worker1", big, args=(len(futures),), timeout=30))
            await asyncio.sleep(0.02)
        for future in futures:
            future.cancel()
        return len(futures)

    asking = group.run_as(2, ask_and_never_read)
    peak = 0
    deadline = time.monotonic() + 10
    with caplog.at_level(logging.WARNING, logger="actorgrad"):
        while 2 in w1.peers and time.monotonic() < deadline:  # noqa: ASYNC110 - sampling
            peak = max(peak, to_w2.transport.get_write_buffer_size())
            await asyncio.sleep(0.01)
    assert 2 not in w1.peers, "worker1 kept a peer that read nothing for 10 s"
    assert any("worker2 stopped reading" in r.getMessage() for r in caplog.records)
    assert await asyncio.wait_for(asking, 10) > 20
    # no more than the high-water mark (64 MiB) plus what was being produced when it
    # was crossed waited for the peer; the rest of what it asked for was never run
    assert peak < 64 * MiB + 3 * 17 * MiB, f"{peak / MiB:.0f} MiB waited for a peer that did not read"
    # worker1 still serves the others
    x = torch.randn(5)
    assert torch.equal(await asyncio.wait_for(ag.rpc_async("worker1", torch.neg, args=(x,)), 10), -x)


async def _fill_worker1s_buffer(make_group) -> tuple[Any, asyncio.Transport, list[Any]]:
    """worker0 stops reading and asks worker1 for 128 MiB: worker1's buffer to it fills
    (past the 64 MiB high-water mark), so the calls worker0 makes from now on wait."""
    group = await make_group(2)
    served_order.clear()
    transport = group.workers[0].peers[1].transport
    transport.pause_reading()
    bigs = [ag.rpc_async("worker1", big, args=(i,), timeout=30) for i in range(8)]
    await asyncio.sleep(0.5)
    return group, transport, bigs


async def test_calls_of_a_slow_reader_wait_and_run_in_order(make_group):
    group, transport, bigs = await _fill_worker1s_buffer(make_group)
    smalls = [ag.rpc_async("worker1", record, args=(i,), timeout=30) for i in range(20)]
    await asyncio.sleep(0.2)
    to_w0 = group.workers[1].peers[0]
    assert to_w0.write_paused and len(to_w0.deferred) == 20 and not served_order
    transport.resume_reading()
    results = await asyncio.wait_for(asyncio.gather(*bigs), 30)
    assert [int(r[0]) for r in results] == list(range(8))
    assert all(torch.equal(r, big(i)) for i, r in enumerate(results))
    assert await asyncio.wait_for(asyncio.gather(*smalls), 30) == list(range(20))
    assert served_order == list(range(20))


async def test_cancelled_call_that_waits_for_a_slow_reader_never_runs(make_group):
    _, transport, bigs = await _fill_worker1s_buffer(make_group)
    waiting = ag.rpc_async("worker1", record, args=(1,), timeout=30)
    await asyncio.sleep(0.1)
    waiting.cancel()
    after = ag.rpc_async("worker1", record, args=(2,), timeout=30)
    await asyncio.sleep(0.1)
    transport.resume_reading()
    await asyncio.wait_for(asyncio.gather(*bigs), 30)
    assert await asyncio.wait_for(after, 30) == 2
    assert served_order == [2]


async def test_messages_behind_a_waiting_call_wait_behind_it(make_group):
    # a tell that came after a waiting call must not overtake it (an RRef's add_fork
    # overtook its create call: the fork was lost and the value freed too early)
    group, transport, bigs = await _fill_worker1s_buffer(make_group)
    w0, w1 = group.workers[0], group.workers[1]
    w1.register("test.note", lambda peer, payload: served_order.append(payload.load()))

    def note_and_answer(peer: Any, payload: Payload) -> Payload:
        served_order.append(payload.load())  # when the call is served, as rref.create does
        return Payload.dump(None)

    w1.register("test.call", note_and_answer)
    first = w0.call(1, "test.call", Payload.dump(1), 30)
    w0.tell(1, "test.note", Payload.dump(2))
    await asyncio.sleep(0.1)
    assert not served_order
    transport.resume_reading()
    await asyncio.wait_for(asyncio.gather(*bigs, first), 30)
    await asyncio.sleep(0.05)
    assert served_order == [1, 2]


def ident(x: Any) -> Any:
    return x


def drop(rref: Any) -> bool:
    return True  # the RRef copy dies here: its release goes from worker2 to the owner


async def test_an_rref_released_elsewhere_before_its_waiting_creation_is_freed(make_group):
    # worker1 (the owner) gets worker2's release of a fork before worker0's remote()
    # that creates the value, which waits behind worker0's unread replies: the release
    # must still count (it was dropped, and the value kept for good)
    from actorgrad.rpc import owner_table

    group = await make_group(3)
    transport = group.workers[0].peers[1].transport
    transport.pause_reading()
    bigs = [ag.rpc_async("worker1", big, args=(i,), timeout=30) for i in range(8)]
    await asyncio.sleep(0.5)
    rref = ag.remote("worker1", ident, args=(5,))
    assert await ag.rpc_async("worker2", drop, args=(rref,), timeout=30)
    gc.collect()
    await asyncio.sleep(0.3)
    transport.resume_reading()
    await asyncio.wait_for(asyncio.gather(*bigs), 30)
    assert await rref.to_here() == 5
    rref_id = rref._id
    del rref
    gc.collect()
    table = owner_table(group.workers[1])
    deadline = time.monotonic() + 5
    while rref_id in table.entries and time.monotonic() < deadline:  # noqa: ASYNC110 - polling
        await asyncio.sleep(0.05)
    assert rref_id not in table.entries
