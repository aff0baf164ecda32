"""Where remote Python functions run (pool or loop thread) and the loop's brief polling.

A function is observed running by recording the thread it ran on: pool threads are
named ``actorgrad-<worker>-<n>``; the event loop runs on this test's thread.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import actorgrad as ag
from actorgrad.rpc import _inline
from actorgrad.rpc._inline import (
    BLOCKING_SECONDS,
    FAST_SECONDS,
    FORGIVE_AFTER_RUNS,
    PROMOTE_AFTER,
    SLOW_AGAIN_WITHIN_RUNS,
    SLOW_SECONDS,
    InlinePolicy,
    size_class,
)


@pytest.fixture(autouse=True)
def any_function_may_be_learned(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the timing rules: their functions read the thread's name
    or sleep, which the bytecode check (tests/rpc/test_inline_purity.py) would keep on
    the pool for good, so here every function passes it."""
    monkeypatch.setattr(_inline, "cannot_block", lambda func: True)


def thread_name(x: object = None) -> str:
    return threading.current_thread().name


def fast_then_slow(sleep: float) -> str:
    if sleep:
        time.sleep(sleep)
    return threading.current_thread().name


def calls_worker_blocking() -> str:
    ag.rpc_sync("worker0", torch.add, args=(torch.ones(1), 1))
    return threading.current_thread().name


def sleeps_a_little() -> str:
    time.sleep(0.002)
    return threading.current_thread().name


def on_pool(name: str) -> bool:
    return name.startswith("actorgrad-")


async def call_n(fn: object, n: int, *args: object) -> list[str]:
    return [await ag.rpc_async("worker1", fn, args=args) for _ in range(n)]  # type: ignore[arg-type]


async def test_fast_function_moves_to_the_loop_after_learning(group2):
    names = await call_n(thread_name, PROMOTE_AFTER + 4)
    assert all(on_pool(n) for n in names[:PROMOTE_AFTER])
    assert names[-1] == threading.current_thread().name  # the loop's thread


async def test_inline_run_keeps_big_arguments_on_the_pool(group2):
    await call_n(thread_name, PROMOTE_AFTER + 1)
    big = torch.zeros(1 << 20)  # 4 MiB of arguments: not a quick call
    assert on_pool(await ag.rpc_async("worker1", thread_name, args=(big,)))


async def test_each_size_of_arguments_is_learned_on_its_own(group2):
    mid = torch.zeros(1 << 16)  # 256 KiB: its own size class
    names = await call_n(thread_name, PROMOTE_AFTER + 2, mid)
    assert all(on_pool(n) for n in names[:PROMOTE_AFTER])
    assert names[-1] == threading.current_thread().name
    # learned at 256 KiB says nothing about small arguments, nor about 1 MiB
    assert on_pool(await ag.rpc_async("worker1", thread_name, args=(torch.zeros(4),)))
    assert on_pool(await ag.rpc_async("worker1", thread_name, args=(torch.zeros(1 << 18),)))


def test_size_classes_double_above_64_kib():
    assert [size_class(n) for n in (0, 1, 1 << 16)] == [0, 0, 0]
    assert [size_class(n) for n in ((1 << 16) + 1, 1 << 17, (1 << 17) + 1, 1 << 18)] == [1, 1, 2, 2]
    assert size_class(1 << 30) == 14


async def test_lambda_sent_by_value_is_learned_by_its_code(group2):
    names = await call_n(lambda: threading.current_thread().name, PROMOTE_AFTER + 5)
    assert on_pool(names[0]) and not on_pool(names[-1])


async def test_function_that_blocks_on_a_worker_is_never_inlined(group2):
    names = await call_n(calls_worker_blocking, PROMOTE_AFTER + 4)
    assert all(on_pool(n) for n in names)


async def test_slow_function_is_never_inlined(group2):
    names = await call_n(sleeps_a_little, PROMOTE_AFTER + 4)
    assert all(on_pool(n) for n in names)


async def test_two_slow_pool_runs_double_the_fast_runs_needed(group2):
    names = await call_n(fast_then_slow, 2, SLOW_SECONDS * 3)
    names += await call_n(fast_then_slow, 2 * PROMOTE_AFTER + 5, 0.0)
    assert all(on_pool(n) for n in names[: 2 * PROMOTE_AFTER + 2])
    assert not on_pool(names[-1])


async def test_one_slow_run_now_and_then_is_forgiven(group2):
    """A quick function the machine happened to preempt once stays where it is."""
    names = await call_n(fast_then_slow, PROMOTE_AFTER + 2, 0.0)
    assert not on_pool(names[-1])
    assert not on_pool(await ag.rpc_async("worker1", fast_then_slow, args=(SLOW_SECONDS * 3,)))
    assert not on_pool(await ag.rpc_async("worker1", fast_then_slow, args=(0.0,)))


async def test_slow_runs_far_apart_in_a_busy_stretch_are_forgiven(group2):
    """Two preempted runs within a few milliseconds, but many runs apart: the machine."""
    names = await call_n(fast_then_slow, PROMOTE_AFTER + 2, 0.0)
    assert not on_pool(names[-1])
    for _ in range(2):
        assert not on_pool(await ag.rpc_async("worker1", fast_then_slow, args=(SLOW_SECONDS * 3,)))
        await call_n(fast_then_slow, SLOW_AGAIN_WITHIN_RUNS, 0.0)
    assert not on_pool(await ag.rpc_async("worker1", fast_then_slow, args=(0.0,)))


async def test_slow_inline_runs_send_the_function_back_to_the_pool(group2):
    names = await call_n(fast_then_slow, PROMOTE_AFTER + 5, 0.0)
    assert not on_pool(names[-1])
    # two slow runs on the loop (the price of learning), then the pool until twice as
    # many fast runs as before vouch for it again
    slow = await call_n(fast_then_slow, 2, SLOW_SECONDS * 3)
    assert not any(on_pool(n) for n in slow)
    after = await call_n(fast_then_slow, 2 * PROMOTE_AFTER + 5, 0.0)
    assert all(on_pool(n) for n in after[: 2 * PROMOTE_AFTER])
    assert not on_pool(after[-1])


async def test_a_run_that_blocks_sends_the_function_back_at_once(group2):
    names = await call_n(fast_then_slow, PROMOTE_AFTER + 2, 0.0)
    assert not on_pool(names[-1])
    assert not on_pool(await ag.rpc_async("worker1", fast_then_slow, args=(BLOCKING_SECONDS * 1.5,)))
    assert on_pool(await ag.rpc_async("worker1", fast_then_slow, args=(0.0,)))


async def test_inlining_can_be_turned_off(make_group):
    await make_group(2, ag.RpcOptions(inline_functions=False))
    names = await call_n(thread_name, PROMOTE_AFTER + 4)
    assert all(on_pool(n) for n in names)


async def test_inlined_function_errors_reach_the_caller(group2):
    await call_n(fast_then_slow, PROMOTE_AFTER + 1, 0.0)
    try:
        await ag.rpc_async("worker1", fast_then_slow, args=("not a number",))
    except ag.RemoteError as exc:
        assert exc.remote_type == "TypeError"
    else:
        raise AssertionError("the remote TypeError did not reach the caller")


async def test_idle_workers_stop_polling(group2):
    for _ in range(200):
        await ag.rpc_async("worker1", torch.add, args=(torch.ones(1), 1))
    await asyncio.sleep(0.05)  # well past the polling window
    cpu_before, wall_before = time.process_time(), time.monotonic()
    await asyncio.sleep(0.5)
    busy = (time.process_time() - cpu_before) / (time.monotonic() - wall_before)
    assert busy < 0.1, f"two idle workers used {busy:.2f} of a core"


async def test_polling_can_be_turned_off(make_group):
    with_polling = ag.RpcOptions(spin_us=0)
    await make_group(2, with_polling)
    result = await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    assert torch.equal(result, torch.full((2,), 2.0))


def test_negative_polling_window_is_refused():
    try:
        ag.RpcOptions(spin_us=-1)
    except ValueError as exc:
        assert "spin_us" in str(exc)
    else:
        raise AssertionError("spin_us=-1 was accepted")


def grad_mode(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled()


async def test_inline_runs_see_the_grad_mode_of_a_pool_thread(group2):
    # every worker of group2 shares this thread: the caller's no_grad is the callee's
    x = torch.ones(2)
    with torch.no_grad():
        pooled = [await ag.rpc_async("worker1", grad_mode, args=(x,)) for _ in range(PROMOTE_AFTER)]
        inline = await ag.rpc_async("worker1", grad_mode, args=(x,))
        product = await ag.rpc_async("worker1", torch.mul, args=(torch.ones(2, requires_grad=True), 2))
    assert pooled == [True] * PROMOTE_AFTER
    assert inline is True
    assert product.requires_grad  # the inline builtin recorded its graph, as elsewhere


def grad_off_and_left_off(x: torch.Tensor) -> bool:
    torch.set_grad_enabled(False)  # never restored: the pool thread keeps it
    return True


async def test_a_mode_one_pool_job_left_set_is_not_the_next_jobs(make_group):
    """Every job starts as on a fresh thread, as inline work does: whether a call sees
    what an earlier call on the same thread left set must not depend on which thread
    (or the loop) it happens to run on."""
    await make_group(2, ag.RpcOptions(inline_functions=False, num_worker_threads=1))
    x = torch.ones(2)
    assert await ag.rpc_async("worker1", grad_off_and_left_off, args=(x,))
    assert [await ag.rpc_async("worker1", grad_mode, args=(x,)) for _ in range(3)] == [True] * 3
    product = await ag.rpc_async("worker1", torch.mul, args=(torch.ones(2, requires_grad=True), 2))
    assert product.requires_grad


async def _doubled_later(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


def returns_a_coroutine(x: int) -> object:
    return _doubled_later(x)


async def test_inlined_function_returning_an_awaitable_is_awaited(group2):
    results = [await ag.rpc_async("worker1", returns_a_coroutine, args=(i,)) for i in range(PROMOTE_AFTER + 5)]
    assert results == [2 * i for i in range(PROMOTE_AFTER + 5)]


# -- the policy on its own: runs reported with chosen times ------------------------------
FAST, SLOW = FAST_SECONDS / 2, SLOW_SECONDS * 2
CODE = thread_name.__code__


def _learned(policy: InlinePolicy, fast_pool_runs: int) -> bool:
    """Report ``fast_pool_runs`` quick pool runs; whether the function is inline now."""
    for _ in range(fast_pool_runs):
        policy._pool_run((CODE, 0), FAST, False)
    return policy.runs_inline(CODE)


def _struck(policy: InlinePolicy) -> None:
    """Two slow inline runs in a row: one strike, back to the pool."""
    policy.inline_run(CODE, SLOW)
    policy.inline_run(CODE, SLOW)
    assert not policy.runs_inline(CODE)


def test_a_function_slow_on_one_run_in_four_is_struck():
    policy = InlinePolicy()
    assert _learned(policy, PROMOTE_AFTER)
    for run in range(12):
        policy.inline_run(CODE, SLOW if run % 4 == 0 else FAST)
    assert not policy.runs_inline(CODE)


def test_a_function_slow_once_in_many_runs_stays_inline():
    policy = InlinePolicy()
    assert _learned(policy, PROMOTE_AFTER)
    for run in range(20 * (SLOW_AGAIN_WITHIN_RUNS + 1)):
        policy.inline_run(CODE, SLOW if run % (SLOW_AGAIN_WITHIN_RUNS + 1) == 0 else FAST)
    assert policy.runs_inline(CODE)


def test_strikes_close_together_double_the_evidence_each_time():
    policy = InlinePolicy()
    assert _learned(policy, PROMOTE_AFTER)
    _struck(policy)
    assert not _learned(policy, 2 * PROMOTE_AFTER - 1) and _learned(policy, 1)
    _struck(policy)
    assert not _learned(policy, 4 * PROMOTE_AFTER - 1) and _learned(policy, 1)


def test_strikes_far_apart_do_not_add_up():
    policy = InlinePolicy()
    assert _learned(policy, PROMOTE_AFTER)
    _struck(policy)
    assert _learned(policy, 2 * PROMOTE_AFTER)
    for _ in range(FORGIVE_AFTER_RUNS):
        policy.inline_run(CODE, FAST)
    _struck(policy)  # a strike again, but the first one is long past
    assert not _learned(policy, 2 * PROMOTE_AFTER - 1) and _learned(policy, 1)
