"""The table of outstanding calls: one future per call, shared deadlines."""

from __future__ import annotations

import asyncio

import pytest

from actorgrad.runtime._calls import PendingCalls
from actorgrad.wire import Payload


class FakePeer:
    name = "peer"

    def __init__(self) -> None:
        self.outstanding: set[int] = set()


def table(expired: list[tuple[int, float]], cancelled: list[int]) -> PendingCalls:
    loop = asyncio.get_running_loop()
    return PendingCalls(
        loop,
        on_cancel=lambda f: cancelled.append(f.request_id),
        on_expire=lambda f, limit: (expired.append((f.request_id, limit)),
                                    f.set_exception(TimeoutError(limit))),
    )


async def test_reply_decoded_into_the_same_future():
    calls = table([], [])
    peer = FakePeer()
    future = calls.add(peer, lambda p: p.load() * 2, 0)
    assert peer.outstanding == {future.request_id}
    calls.resolve(future.request_id, Payload.dump(21))
    assert await future == 42 and peer.outstanding == set() and len(calls) == 0


async def test_decoding_error_fails_the_call():
    calls = table([], [])
    future = calls.add(FakePeer(), lambda p: 1 / 0, 0)
    calls.resolve(future.request_id, Payload.dump(None))
    with pytest.raises(ZeroDivisionError):
        await future


async def test_deadlines_fire_in_order_and_only_for_pending_calls():
    expired: list[tuple[int, float]] = []
    calls = table(expired, [])
    peer = FakePeer()
    slow, fast, answered = (calls.add(peer, None, t) for t in (0.15, 0.05, 0.1))
    calls.resolve(answered.request_id, Payload.dump(None))
    await asyncio.sleep(0.3)
    assert expired == [(fast.request_id, 0.05), (slow.request_id, 0.15)]
    assert fast.done() and slow.done() and len(calls) == 0


async def test_cancelling_tells_the_callee_once():
    cancelled: list[int] = []
    calls = table([], cancelled)
    future = calls.add(FakePeer(), None, 10)
    assert future.cancel()
    assert not future.cancel()
    assert cancelled == [future.request_id] and len(calls) == 0
    calls.resolve(future.request_id, Payload.dump(None))  # a late reply is ignored


async def test_deadlines_of_answered_calls_do_not_pile_up():
    calls = table([], [])
    peer = FakePeer()
    for _ in range(5000):
        future = calls.add(peer, None, 60)
        calls.resolve(future.request_id, Payload.dump(None))
    assert len(calls._deadlines) < 2 * len(calls) + 1100
    calls.close()
