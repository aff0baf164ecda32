"""A remote function's failure reaches its caller at once, as RemoteError (or as the
RpcTimeout / WorkerLost that API.md promises), whatever it raised and whoever owns the
RRef: never a wait until the call's timeout, never a bare CancelledError.

Every call has a generous timeout (``_LIMIT``) and every test asserts that the failure
came well before it, so a lost answer fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from typing import Any

import pytest

import actorgrad as ag
from actorgrad.rpc import _inline

_LIMIT = 10.0  # timeout of the calls that must fail fast
_FAST = 5.0  # they must fail within this many seconds
OWNERS = ["worker1", "worker0"]  # an in-process peer, and the caller itself

# --------------------------------------------------------------------------------------
# functions called remotely (module level: pickled by reference)


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() fails")


def raise_bad_str() -> None:
    raise BadStr()


def raise_cancelled() -> None:
    raise asyncio.CancelledError()


async def raise_cancelled_async() -> None:
    await asyncio.sleep(0)
    raise asyncio.CancelledError()


async def await_cancelled_inner_task() -> None:
    inner = asyncio.ensure_future(asyncio.sleep(10))
    await asyncio.sleep(0)
    inner.cancel()
    await inner


def raise_stop_iteration() -> None:
    raise StopIteration("done early")


def raise_generator_exit() -> None:
    raise GeneratorExit()


async def raise_generator_exit_async() -> None:
    await asyncio.sleep(0)
    raise GeneratorExit()


def raise_system_exit() -> None:
    raise SystemExit(3)


async def raise_system_exit_async() -> None:
    await asyncio.sleep(0)
    raise SystemExit(3)


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def sleep_then(seconds: float, value: object = None) -> object:
    time.sleep(seconds)
    return value


async def sleep_async(seconds: float) -> None:
    await asyncio.sleep(seconds)


def square(i: int) -> int:
    return i * i


async def fails_fast(aw: Awaitable[Any], expected: type[BaseException]) -> Any:
    """Await ``aw``, which must raise ``expected`` well within ``_LIMIT``."""
    start = time.monotonic()
    with pytest.raises(expected) as info:
        await aw
    elapsed = time.monotonic() - start
    assert elapsed < _FAST, f"{expected.__name__} came after {elapsed:.1f}s, not at once"
    return info.value


# --------------------------------------------------------------------------------------
# rpc_async: whatever the function raises is answered


@pytest.mark.parametrize("to", OWNERS)
async def test_exception_whose_str_fails(group2, to):
    err = await fails_fast(ag.rpc_async(to, raise_bad_str, timeout=_LIMIT), ag.RemoteError)
    assert "BadStr" in err.remote_type
    assert "str()" in err.remote_message  # says why there is no message
    assert "raise_bad_str" in err.remote_traceback
    assert await ag.rpc_async(to, square, args=(4,), timeout=_LIMIT) == 16


@pytest.mark.parametrize("to", OWNERS)
@pytest.mark.parametrize(
    "func", [raise_cancelled, raise_cancelled_async, await_cancelled_inner_task]
)
async def test_cancelled_error_raised_by_the_function(group2, to, func):
    err = await fails_fast(ag.rpc_async(to, func, timeout=_LIMIT), ag.RemoteError)
    assert "CancelledError" in err.remote_type
    assert func.__name__ in err.remote_traceback
    assert await ag.rpc_async(to, square, args=(5,), timeout=_LIMIT) == 25


@pytest.mark.parametrize("to", OWNERS)
async def test_stop_iteration_raised_by_the_function(group2, to):
    err = await fails_fast(ag.rpc_async(to, raise_stop_iteration, timeout=_LIMIT), ag.RemoteError)
    assert "StopIteration" in str(err)
    assert "done early" in str(err)
    assert await ag.rpc_async(to, square, args=(6,), timeout=_LIMIT) == 36


@pytest.mark.parametrize("to", OWNERS)
@pytest.mark.parametrize("func", [raise_generator_exit, raise_generator_exit_async])
async def test_generator_exit_raised_by_the_function(group2, to, func):
    err = await fails_fast(ag.rpc_async(to, func, timeout=_LIMIT), ag.RemoteError)
    assert "GeneratorExit" in err.remote_type
    assert await ag.rpc_async(to, square, args=(7,), timeout=_LIMIT) == 49


@pytest.mark.parametrize("to", OWNERS)
@pytest.mark.parametrize("func", [raise_system_exit, raise_system_exit_async])
async def test_system_exit_raised_by_the_function_is_its_failure(group2, to, func):
    # as in torch's RPC: the caller gets the error, the worker goes on serving
    err = await fails_fast(ag.rpc_async(to, func, timeout=_LIMIT), ag.RemoteError)
    assert type(err.__cause__) is SystemExit and err.remote_type == "SystemExit"
    assert func.__name__ in err.remote_traceback
    assert await ag.rpc_async(to, square, args=(3,), timeout=_LIMIT) == 9


def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt()


async def test_keyboard_interrupt_of_a_pool_function_is_only_its_failure(group2):
    # raised in a pool thread, it cannot be a Ctrl-C (Python raises those in the main
    # thread only): the call fails and the worker (here: this process) goes on
    err = await fails_fast(ag.rpc_async("worker1", raise_keyboard_interrupt, timeout=_LIMIT), ag.RemoteError)
    assert type(err.__cause__) is KeyboardInterrupt
    assert await ag.rpc_async("worker1", square, args=(3,), timeout=_LIMIT) == 9


@pytest.mark.slow
async def test_keyboard_interrupt_on_the_loop_is_answered_then_stops_the_worker(make_process_group):
    # answered, so the caller does not wait; then raised on, as a Ctrl-C that lands in a
    # function served on the loop must stop the program
    group = await make_process_group(2)

    async def interrupted() -> None:  # by value: the worker process cannot import this module
        raise KeyboardInterrupt()

    err = await fails_fast(ag.rpc_async("worker1", interrupted, timeout=_LIMIT), ag.RemoteError)
    assert type(err.__cause__) is KeyboardInterrupt
    deadline = time.monotonic() + _FAST
    while group.processes[0].poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - a child
        await asyncio.sleep(0.05)
    assert group.processes[0].poll() is not None, group.logs(1)
    group.killed.add(1)  # its end was the point: no failure log to keep
    with pytest.raises(ag.WorkerLost):
        await ag.rpc_async("worker1", max, args=(3, 4), timeout=_LIMIT)


@pytest.mark.parametrize("to", OWNERS)
@pytest.mark.parametrize("func", [raise_cancelled, raise_generator_exit, raise_system_exit])
async def test_base_exceptions_once_the_function_runs_inline(group2, monkeypatch, to, func):
    # A quick function is learned to run on the loop itself, in the message handler
    # (these read globals the bytecode check does not trust: let them pass it).
    monkeypatch.setattr(_inline, "cannot_block", lambda f: True)
    for _ in range(30):
        err = await fails_fast(ag.rpc_async(to, func, timeout=_LIMIT), ag.RemoteError)
        assert type(err.__cause__).__name__ in err.remote_type
    assert await ag.rpc_async(to, square, args=(8,), timeout=_LIMIT) == 64


async def test_real_cancellation_still_ends_the_callee_without_answer(group2):
    # The caller's timeout cancels the callee; the caller gets RpcTimeout, not a
    # RemoteError naming CancelledError, and the callee keeps serving.
    start = time.monotonic()
    with pytest.raises(ag.RpcTimeout, match=r"call of sleep_async to worker1 timed out after 0.2s "
                       r"\(the limit is the call's timeout=, else RpcOptions.rpc_timeout"):
        await ag.rpc_async("worker1", sleep_async, args=(30.0,), timeout=0.2)
    assert time.monotonic() - start < _FAST
    assert await ag.rpc_async("worker1", square, args=(9,), timeout=_LIMIT) == 81


# --------------------------------------------------------------------------------------
# remote() and to_here(): the owner fails like any other worker


@pytest.mark.parametrize("owner", OWNERS)
@pytest.mark.parametrize("func", [sleep_then, sleep_async])
async def test_timed_out_creation_fails_the_next_use(group2, owner, func):
    rref = ag.remote(owner, func, args=(1.0,), timeout=0.2)
    err = await fails_fast(rref.to_here(timeout=_LIMIT), ag.RpcTimeout)
    assert "remote() call" in str(err)
    assert "timed out" in str(err)
    assert func.__name__ in str(err)
    # and again, now that the creation has ended for good
    await fails_fast(rref.to_here(timeout=_LIMIT), ag.RpcTimeout)
    await fails_fast(rref.to_here(timeout=0), ag.RpcTimeout)


@pytest.mark.parametrize("owner", OWNERS)
async def test_failed_creation_gives_remote_error(group2, owner):
    rref = ag.remote(owner, raise_value_error, args=("cannot create",))
    err = await fails_fast(rref.to_here(timeout=_LIMIT), ag.RemoteError)
    assert "ValueError" in err.remote_type
    assert isinstance(err.__cause__, ValueError)
    assert "cannot create" in str(err)
    assert "raise_value_error" in err.remote_traceback


@pytest.mark.parametrize("owner", OWNERS)
@pytest.mark.parametrize(
    ("func", "remote_type"),
    [
        (raise_cancelled, "CancelledError"),
        (raise_cancelled_async, "CancelledError"),
        (raise_generator_exit, "GeneratorExit"),
        (raise_system_exit, "SystemExit"),
        (raise_bad_str, "BadStr"),
    ],
)
async def test_creation_raising_base_exceptions_gives_remote_error(
    group2, owner, func, remote_type
):
    rref = ag.remote(owner, func, timeout=_LIMIT)
    err = await fails_fast(rref.to_here(timeout=_LIMIT), ag.RemoteError)
    assert remote_type in err.remote_type


@pytest.mark.parametrize("owner", OWNERS)
async def test_to_here_honours_its_timeout(group2, owner):
    rref = ag.remote(owner, sleep_then, args=(3.0, "made"))
    start = time.monotonic()
    with pytest.raises(ag.RpcTimeout):
        await rref.to_here(timeout=0.2)
    assert time.monotonic() - start < 2.0  # not the 3 s the creation takes
    assert await rref.to_here(timeout=_LIMIT) == "made"  # the creation went on


@pytest.mark.parametrize("owner", OWNERS)
async def test_to_here_default_timeout_is_rpc_timeout(make_group, owner):
    await make_group(2, ag.RpcOptions(rpc_timeout=0.2))
    rref = ag.remote(owner, sleep_then, args=(3.0,), timeout=0)
    start = time.monotonic()
    with pytest.raises(ag.RpcTimeout):
        await rref.to_here()
    assert time.monotonic() - start < 2.0  # not the 3 s the creation takes


# --------------------------------------------------------------------------------------
# negative per-call timeouts are refused


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan])
async def test_negative_timeout_is_refused(group2, bad):
    for to in OWNERS:
        with pytest.raises(ValueError, match=r"timeout.*(-1|-0\.5|nan)"):
            ag.rpc_async(to, square, args=(2,), timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            ag.remote(to, square, args=(2,), timeout=bad)
        rref = ag.remote(to, square, args=(3,))
        with pytest.raises(ValueError, match="timeout"):
            await rref.to_here(timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            rref.rpc_async(timeout=bad).bit_length()
        assert await rref.to_here(timeout=_LIMIT) == 9


async def test_negative_timeout_is_refused_by_rpc_sync(group2):
    with pytest.raises(ValueError, match="-1"):
        await asyncio.wait_for(
            asyncio.to_thread(ag.rpc_sync, "worker1", square, (2,), None, -1), _LIMIT
        )


# --------------------------------------------------------------------------------------
# a message larger than max_frame_size fails its call, not the connection


async def square_on_worker0(i: int) -> int:
    return await ag.rpc_async("worker0", square, args=(i,))


def make_zeros(n: int) -> object:
    import torch

    return torch.zeros(n)


async def test_oversized_argument_and_result_fail_the_call_only(make_group):
    import torch

    await make_group(2, ag.RpcOptions(max_frame_size=1 << 20))
    with pytest.raises(ag.ProtocolError, match="CALL message of .* over max_frame_size"):
        ag.rpc_async("worker1", square, args=(torch.zeros(1 << 19),))  # 2 MiB: refused at once
    err = await fails_fast(
        ag.rpc_async("worker1", make_zeros, args=(1 << 19,), timeout=_LIMIT), ag.RemoteError)
    assert "RESULT message" in str(err) and "max_frame_size" in str(err)
    # the connection is still up, both ways
    assert await ag.rpc_async("worker1", square, args=(7,), timeout=_LIMIT) == 49
    assert await ag.rpc_async("worker1", square_on_worker0, args=(3,), timeout=_LIMIT) == 9
