"""Only remote functions whose code cannot block are ever run on the event loop.

A function learned as quick used to move to the loop whatever it did; one that later
waited on a queue for an item a later call brings (that call then never served: the
worker lost its heartbeats) or called ``rpc_sync`` (refused on the loop) failed. Now
its bytecode must show it only computes (``actorgrad.rpc._purity``).
"""

from __future__ import annotations

import math
import queue
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import actorgrad as ag
from actorgrad.rpc import _api, _inline
from actorgrad.rpc._inline import PROMOTE_AFTER
from actorgrad.rpc._purity import cannot_block, plain

WEIGHT = torch.ones(3)
ITEMS: queue.Queue[object] = queue.Queue()


# -- functions to judge ---------------------------------------------------------------------
def mul2add1(x):  # type: ignore[no-untyped-def]
    return x * 2 + 1


def uses_torch_math_and_globals(x):  # type: ignore[no-untyped-def]
    for i in range(3):
        x = x + i
    return F.relu(x) * math.sqrt(2) + WEIGHT.sum(), torch.float32, max(1, 2)


def calls_a_worker(x, nested):  # type: ignore[no-untyped-def]
    if nested:
        return ag.rpc_sync("worker2", torch.add, args=(x, 1))
    return x + 1


def take():  # type: ignore[no-untyped-def]
    return ITEMS.get(timeout=10)


def put(item):  # type: ignore[no-untyped-def]
    ITEMS.put(item)


def sleeps(x):  # type: ignore[no-untyped-def]
    time.sleep(0.001)
    return x


def saves(x):  # type: ignore[no-untyped-def]
    torch.save(x, "/dev/null")
    return x


def prints(x):  # type: ignore[no-untyped-def]
    print(x)
    return x


def comprehension(xs):  # type: ignore[no-untyped-def]
    return [x * 2 for x in xs]


def imports(x):  # type: ignore[no-untyped-def]
    import os  # noqa: F401

    return x


def make_closure():  # type: ignore[no-untyped-def]
    factor = 3

    def scaled(x):  # type: ignore[no-untyped-def]
        return x * factor

    return scaled


def generator(x):  # type: ignore[no-untyped-def]
    yield x


def distributed_call(x):  # type: ignore[no-untyped-def]
    return torch.distributed.is_initialized()


def thread_name():  # type: ignore[no-untyped-def]
    return threading.current_thread().name


@pytest.mark.parametrize("func", [mul2add1, uses_torch_math_and_globals, lambda x: x * 3])
def test_functions_that_only_compute_may_run_inline(func):  # type: ignore[no-untyped-def]
    assert cannot_block(func)


@pytest.mark.parametrize(
    "func",
    [calls_a_worker, take, put, sleeps, saves, prints, comprehension, imports, make_closure(), generator,
     distributed_call, thread_name],
)
def test_functions_that_might_block_never_do(func):  # type: ignore[no-untyped-def]
    assert not cannot_block(func)


def test_plain_arguments():
    assert plain((torch.ones(2), 3, 2.5, None, "s", [torch.nn.Parameter(torch.ones(1))], {"k": (1, 2)}))
    assert not plain((ITEMS,))
    assert not plain(([mul2add1],))
    assert not plain({1: 2})  # dict keys other than strings: a user object could hide there

    class Text(str):
        def upper(self) -> str:  # any code at all
            return "called"

    assert not plain((Text("subclasses may override methods"),))


# -- on workers -------------------------------------------------------------------------------
def on_loop(name: str) -> bool:
    return not name.startswith("actorgrad-")


async def test_a_quick_function_that_later_calls_a_worker_keeps_working(make_group):
    await make_group(3)
    for _ in range(3 * PROMOTE_AFTER):
        await ag.rpc_async("worker1", calls_a_worker, args=(torch.ones(2), False))
    got = await ag.rpc_async("worker1", calls_a_worker, args=(torch.ones(2), True), timeout=20)
    assert torch.equal(got, torch.full((2,), 2.0))


async def test_a_quick_function_that_later_waits_for_a_later_call_keeps_working(group2):
    for i in range(3 * PROMOTE_AFTER):
        await ag.rpc_async("worker1", put, args=(i,))
        assert await ag.rpc_async("worker1", take) == i
    waiting = ag.rpc_async("worker1", take, timeout=20)  # waits for an item ...
    await ag.rpc_async("worker1", put, args=("item",), timeout=20)  # ... this call brings
    assert await waiting == "item"


async def test_pure_functions_still_move_to_the_loop(group2, monkeypatch):
    inline_runs: list[object] = []
    call_inline = _api._call_inline

    def counted(policy, func, *rest):  # type: ignore[no-untyped-def]
        inline_runs.append(func)
        return call_inline(policy, func, *rest)

    monkeypatch.setattr(_api, "_call_inline", counted)
    # every run counts as quick: this is about which functions may move, not timing
    monkeypatch.setattr(_inline, "FAST_SECONDS", 1.0)
    monkeypatch.setattr(_inline, "SLOW_SECONDS", 2.0)
    for _ in range(PROMOTE_AFTER + 4):
        assert torch.equal(await ag.rpc_async("worker1", mul2add1, args=(torch.ones(2),)), torch.full((2,), 3.0))
    assert mul2add1 in inline_runs
    for _ in range(PROMOTE_AFTER + 4):
        await ag.rpc_async("worker1", sleeps, args=(1,))
    assert sleeps not in inline_runs
