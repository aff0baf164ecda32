"""rpc_async / rpc_sync against real in-process workers (loopback sockets).

Every expected value is computed locally with torch; the callee reports where it ran
(worker name, thread) so that a call that silently ran on the wrong worker fails.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback

import pytest
import torch

import actorgrad as ag

# --------------------------------------------------------------------------------------
# functions called remotely (module level: pickled by reference, importable in-process)


def where_am_i() -> str:
    return ag.get_worker_info().name


def add_scaled(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return (a + b) * scale


def thread_and_worker() -> tuple[str, str]:
    return threading.current_thread().name, ag.get_worker_info().name


async def async_double(x: torch.Tensor, delay: float) -> tuple[str, bool, torch.Tensor]:
    await asyncio.sleep(delay)
    on_loop = threading.current_thread() is threading.main_thread()
    return ag.get_worker_info().name, on_loop, x * 2


def identity(x: object) -> object:
    return x


def mutate_in_place(t: torch.Tensor) -> float:
    t.add_(100)
    t[0] = -5
    return float(t.sum())


def sleep_then(seconds: float, value: object = None) -> object:
    time.sleep(seconds)
    return value


def square(i: int) -> int:
    return i * i


def raise_value_error(message: str) -> None:
    raise ValueError(message)


class CustomError(Exception):
    pass


def raise_custom(message: str) -> None:
    raise CustomError(message)


class NeedsTwoArgs(Exception):
    """Pickles fine but cannot be rebuilt: ``Exception.__reduce__`` passes only ``args``."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(a)
        self.b = b


def raise_unrebuildable() -> None:
    raise NeedsTwoArgs("first", "second")


class HoldsLock(Exception):
    """Cannot even be pickled on the callee (a lock is not picklable)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def raise_unpicklable() -> None:
    raise HoldsLock("with a lock")


def nested_sync_via_worker2(x: torch.Tensor) -> tuple[str, str, torch.Tensor]:
    # runs in worker1's thread pool and blocks on a call to worker2
    here = ag.get_worker_info().name
    there = ag.rpc_sync("worker2", where_am_i)
    y = ag.rpc_sync("worker2", torch.mul, args=(x, 3))
    return here, there, y + 1


async def nested_async_via_worker2(x: torch.Tensor) -> tuple[str, str, torch.Tensor]:
    here = ag.get_worker_info().name
    there, y = await asyncio.gather(
        ag.rpc_async("worker2", where_am_i), ag.rpc_async("worker2", add_scaled, args=(x, x))
    )
    return here, there, y - 1


CANCELLED: list[str] = []


async def wait_to_be_cancelled(tag: str) -> None:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        CANCELLED.append(tag)
        raise


# --------------------------------------------------------------------------------------
# calling conventions


async def test_torch_builtin(group2):
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    result = await ag.rpc_async("worker1", torch.add, args=(a, b))
    assert torch.equal(result, a + b)
    result = await ag.rpc_async("worker1", torch.matmul, args=(a, b.t()))
    assert torch.allclose(result, a @ b.t())


async def test_module_level_function_runs_on_callee_thread_pool(group2):
    thread, name = await ag.rpc_async("worker1", thread_and_worker)
    assert name == "worker1"
    assert thread != threading.main_thread().name
    assert thread.startswith("actorgrad-worker1")


async def test_lambda(group2):
    x = torch.arange(6.0)
    result = await ag.rpc_async("worker1", lambda t: (t**2, ag.get_worker_info().name), args=(x,))
    assert torch.equal(result[0], x**2)
    assert result[1] == "worker1"


async def test_closure_capturing_a_tensor(group2):
    weight = torch.randn(4, 2)
    bias = torch.randn(2)

    def affine(x: torch.Tensor) -> torch.Tensor:
        return x @ weight + bias

    x = torch.randn(3, 4)
    result = await ag.rpc_async("worker1", affine, args=(x,))
    assert torch.allclose(result, x @ weight + bias)


async def test_kwargs(group2):
    a, b = torch.randn(5), torch.randn(5)
    result = await ag.rpc_async("worker1", torch.add, args=(a,), kwargs={"other": b, "alpha": 2})
    assert torch.allclose(result, a + 2 * b)
    result = await ag.rpc_async("worker1", add_scaled, args=(a,), kwargs={"b": b, "scale": -3.0})
    assert torch.allclose(result, (a + b) * -3.0)


async def test_async_def_is_awaited_on_callee_loop(group2):
    x = torch.randn(3)
    start = time.monotonic()
    name, on_loop, y = await ag.rpc_async("worker1", async_double, args=(x, 0.1))
    assert time.monotonic() - start >= 0.09  # the coroutine really ran to completion
    assert name == "worker1"
    assert on_loop  # awaited on the loop, not run in the thread pool
    assert torch.equal(y, x * 2)


async def test_function_defined_inside_the_test(group2):
    offset = 7

    def local_fn(values: list[int]) -> tuple[str, list[int]]:
        return ag.get_worker_info().name, [v + offset for v in values]

    assert await ag.rpc_async("worker1", local_fn, args=([1, 2, 3],)) == ("worker1", [8, 9, 10])


async def test_destination_as_name_rank_and_workerinfo(group3):
    info = ag.get_worker_info("worker2")
    assert info == ag.WorkerInfo("worker2", 2)
    assert await ag.rpc_async("worker2", where_am_i) == "worker2"
    assert await ag.rpc_async(2, where_am_i) == "worker2"
    assert await ag.rpc_async(info, where_am_i) == "worker2"
    assert await ag.rpc_async(1, where_am_i) == "worker1"


async def test_call_to_self(group2):
    assert await ag.rpc_async("worker0", where_am_i) == "worker0"
    assert await ag.rpc_async(0, where_am_i) == "worker0"
    x = torch.randn(4)
    assert torch.equal(await ag.rpc_async("worker0", torch.neg, args=(x,)), -x)


async def test_rpc_sync_from_a_plain_thread(group2):
    x = torch.randn(3)

    def blocking() -> torch.Tensor:
        return ag.rpc_sync("worker1", add_scaled, args=(x, x), kwargs={"scale": 0.5})

    result = await asyncio.wait_for(asyncio.to_thread(blocking), 10)
    assert torch.allclose(result, x)


async def test_rpc_sync_from_a_plain_thread_times_out_on_time(group2):
    # the call's RpcTimeout is a TimeoutError, as is a blocking wait's: it was taken for
    # the wait's own and the thread waited for ever
    def blocking() -> None:
        ag.rpc_sync("worker1", time.sleep, args=(2,), timeout=0.3)

    start = time.monotonic()
    with pytest.raises(ag.RpcTimeout):
        await asyncio.wait_for(asyncio.to_thread(blocking), 10)
    assert time.monotonic() - start < 1.5


# --------------------------------------------------------------------------------------
# argument copying


@pytest.mark.parametrize("to", ["worker1", "worker0"])
async def test_callee_mutation_does_not_reach_caller(group2, to):
    x = torch.arange(4.0)
    original = x.clone()
    returned = await ag.rpc_async(to, mutate_in_place, args=(x,))
    expected = original + 100
    expected[0] = -5
    assert returned == float(expected.sum())
    assert torch.equal(x, original)


@pytest.mark.parametrize("to", ["worker1", "worker0"])
async def test_callee_gets_the_value_at_call_time(group2, to):
    # the caller changes its tensor right after issuing the call; the call carries the
    # value it had when it was made (also for a large tensor whose write is buffered)
    x = torch.ones(4 << 20)
    fut = ag.rpc_async(to, torch.sum, args=(x,))
    x.zero_()
    assert float(await fut) == float(4 << 20)


async def test_caller_mutating_result_does_not_reach_callee_state(group2):
    x = torch.arange(3.0)
    rref = ag.remote("worker1", identity, args=(x,))
    fetched = await rref.to_here()
    fetched.mul_(0)
    again = await rref.to_here()
    assert torch.equal(again, torch.arange(3.0))


# --------------------------------------------------------------------------------------
# nested calls


async def test_rpc_sync_nested_in_thread_pool_function(group3):
    x = torch.randn(4)
    here, there, y = await asyncio.wait_for(
        ag.rpc_async("worker1", nested_sync_via_worker2, args=(x,)), 10
    )
    assert (here, there) == ("worker1", "worker2")
    assert torch.allclose(y, x * 3 + 1)


async def test_rpc_async_nested_in_async_function(group3):
    x = torch.randn(4)
    here, there, y = await asyncio.wait_for(
        ag.rpc_async("worker1", nested_async_via_worker2, args=(x,)), 10
    )
    assert (here, there) == ("worker1", "worker2")
    assert torch.allclose(y, 2 * x - 1)


async def call_worker2(func: object, *args: object) -> object:
    return await ag.rpc_async("worker2", func, args=args)


def raise_unpicklable_saying(message: str) -> None:
    raise HoldsLock(message)


@pytest.mark.parametrize(("func", "kind"), [(raise_value_error, ValueError), (raise_unpicklable_saying, None)])
async def test_a_nested_remote_error_reaches_the_caller_as_the_original(group3, func, kind):
    """worker1 passes on the RemoteError of its call to worker2: the caller gets the
    error worker2 raised (type, worker, cause), as if it had called worker2 itself, and
    a note naming worker1; an exception that cannot be pickled keeps its name and text."""
    with pytest.raises(ag.RemoteError) as info:
        await asyncio.wait_for(ag.rpc_async("worker1", call_worker2, args=(func, "deep 31")), 10)
    error = info.value
    assert error.worker == "worker2"
    if kind is None:
        assert error.remote_type.endswith("HoldsLock") and error.__cause__ is None
        assert "deep 31" in str(error)
    else:
        assert error.remote_type == "ValueError" and "deep 31" in str(error)
        assert isinstance(error.__cause__, kind) and str(error.__cause__) == "deep 31"
    assert any("reported by worker1" in note for note in error.__notes__)


def raise_at_the_end_of(chain: list[str]) -> None:
    if chain:
        ag.rpc_sync(chain[0], raise_at_the_end_of, args=(chain[1:],))
    else:
        raise ValueError("the end of the chain")


async def test_an_error_passed_along_a_chain_grows_a_hop_at_a_time(make_process_group):
    """Each worker that passes the error on adds where it did, once: the text doubled at
    each hop (every worker repeated the whole traceback it had got, notes included)."""
    await make_process_group(4)
    with pytest.raises(ag.RemoteError) as info:
        await ag.rpc_async("worker1", raise_at_the_end_of, args=(["worker2", "worker3"],), timeout=30)
    text = "".join(traceback.format_exception(info.value))
    assert info.value.worker == "worker3" and str(info.value.__cause__) == "the end of the chain"
    assert text.count('raise ValueError("the end of the chain")') == 1, text
    assert [note.split("\n")[0] for note in info.value.__notes__] == [
        "reported by worker2, passed on at:", "reported by worker1, passed on at:"]
    assert all(note.count("in raise_at_the_end_of") == 1 for note in info.value.__notes__)


# --------------------------------------------------------------------------------------
# tensors on the wire


async def test_64mib_tensor_round_trip(group2):
    x = torch.randn(16 << 20)  # 64 MiB of float32
    assert x.numel() * x.element_size() == 64 << 20
    y = await ag.rpc_async("worker1", identity, args=(x,))
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, x)
    assert y.data_ptr() != x.data_ptr()


def _special_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    storage_owner = torch.arange(100.0)
    return {
        "transposed": base.t(),
        "strided_slice": base[:, ::3],
        "offset_view": storage_owner[10:20],
        "expanded": torch.randn(1, 5, generator=g).expand(4, 5),
        "bfloat16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "float16": torch.randn(9, generator=g).half(),
        "float64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "complex64": torch.randn(5, generator=g, dtype=torch.complex64),
        "complex128_conj_view": torch.randn(4, generator=g, dtype=torch.complex128).conj(),
        "neg_view": torch.randn(3, generator=g, dtype=torch.complex64)._neg_view(),
        "bool": torch.tensor([True, False, True, True]),
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "int64": torch.tensor([2**62, -(2**62)], dtype=torch.int64),
        "zero_dim": torch.tensor(3.25),
        "zero_dim_int": torch.tensor(-7),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 3),
        "empty_int": torch.empty(2, 0, dtype=torch.int32),
    }


@pytest.mark.parametrize("kind", list(_special_tensors()))
async def test_special_tensor_round_trip(group2, kind):
    x = _special_tensors()[kind]
    y = await ag.rpc_async("worker1", identity, args=(x,))
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    assert torch.equal(y.resolve_conj().resolve_neg(), x.resolve_conj().resolve_neg())


async def test_sparse_tensor_round_trip(group2):
    x = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse()
    y = await ag.rpc_async("worker1", identity, args=(x,))
    assert y.is_sparse
    assert torch.equal(y.to_dense(), x.to_dense())


@pytest.mark.parametrize("dtype", ["uint16", "float8_e4m3fn"])
async def test_less_common_dtype_round_trip(group2, dtype):
    x = torch.tensor([1.0, 2.0, 3.0]).to(getattr(torch, dtype))
    y = await ag.rpc_async("worker1", identity, args=(x,))
    assert y.dtype == x.dtype
    assert torch.equal(y.float(), x.float())


async def test_nested_containers_of_tensors(group2):
    a, b, c = torch.randn(2), torch.randn(3, dtype=torch.float64), torch.tensor(True)
    value = {"a": [a, (b, {"c": c})], "n": 5}
    y = await ag.rpc_async("worker1", identity, args=(value,))
    assert y["n"] == 5
    assert torch.equal(y["a"][0], a)
    assert torch.equal(y["a"][1][0], b)
    assert torch.equal(y["a"][1][1]["c"], c)


# --------------------------------------------------------------------------------------
# remote exceptions


async def test_remote_exception_becomes_remote_error(group2):
    with pytest.raises(ag.RemoteError) as info:
        await ag.rpc_async("worker1", raise_value_error, args=("the message 42",))
    err = info.value
    assert isinstance(err, ag.ActorgradError)
    assert "ValueError" in err.remote_type
    assert "raise_value_error" in err.remote_traceback
    assert "the message 42" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)
    assert str(err.__cause__) == "the message 42"
    assert "the message 42" in str(err)


async def test_remote_exception_from_async_function_and_self_call(group2):
    async def fail_async() -> None:
        await asyncio.sleep(0)
        raise KeyError("missing-key")

    for to in ("worker1", "worker0"):
        with pytest.raises(ag.RemoteError) as info:
            await ag.rpc_async(to, fail_async)
        assert "KeyError" in info.value.remote_type
        assert "fail_async" in info.value.remote_traceback
        assert isinstance(info.value.__cause__, KeyError)


async def test_remote_custom_exception_type(group2):
    with pytest.raises(ag.RemoteError) as info:
        await ag.rpc_async("worker1", raise_custom, args=("custom!",))
    assert "CustomError" in info.value.remote_type
    assert isinstance(info.value.__cause__, CustomError)
    assert str(info.value.__cause__) == "custom!"


async def test_unrebuildable_exception_still_gives_remote_error(group2):
    with pytest.raises(ag.RemoteError):
        await ag.rpc_async("worker1", raise_unrebuildable)
    # and the worker keeps serving
    assert await ag.rpc_async("worker1", square, args=(9,)) == 81


async def test_unrebuildable_exception_keeps_type_and_traceback(group2):
    with pytest.raises(ag.RemoteError) as info:
        await ag.rpc_async("worker1", raise_unrebuildable)
    assert "NeedsTwoArgs" in info.value.remote_type
    assert "raise_unrebuildable" in info.value.remote_traceback
    assert info.value.__cause__ is None


async def test_unpicklable_exception_gives_remote_error_with_type(group2):
    with pytest.raises(ag.RemoteError) as info:
        await ag.rpc_async("worker1", raise_unpicklable)
    assert "HoldsLock" in info.value.remote_type
    assert "raise_unpicklable" in info.value.remote_traceback
    assert "with a lock" in str(info.value)
    assert info.value.__cause__ is None


def returns_a_lock() -> object:
    return threading.Lock()


async def test_a_result_that_cannot_be_sent_says_so(group2):
    # (it read "TypeError on worker1: cannot pickle '_thread.lock' object", as if the
    # function had raised it)
    with pytest.raises(ag.RemoteError, match=r"the result \(lock\) could not be sent back: TypeError: cannot pickle"):
        await ag.rpc_async("worker1", returns_a_lock)
    assert await ag.rpc_async("worker1", len, args=([1, 2],)) == 2


# --------------------------------------------------------------------------------------
# timeouts


async def test_per_call_timeout(group2):
    start = time.monotonic()
    with pytest.raises(ag.RpcTimeout) as info:
        await ag.rpc_async("worker1", sleep_then, args=(2.0,), timeout=0.2)
    elapsed = time.monotonic() - start
    assert isinstance(info.value, TimeoutError)
    assert 0.15 <= elapsed < 1.0
    # the worker still serves calls (its pool thread is still sleeping)
    assert await asyncio.wait_for(ag.rpc_async("worker1", square, args=(12,)), 5) == 144


async def test_default_timeout_from_options(make_group):
    await make_group(2, ag.RpcOptions(rpc_timeout=0.3))
    start = time.monotonic()
    with pytest.raises(ag.RpcTimeout):
        await ag.rpc_async("worker1", sleep_then, args=(2.0,))
    assert 0.25 <= time.monotonic() - start < 1.2
    # a faster call within the default still succeeds
    assert await ag.rpc_async("worker1", sleep_then, args=(0.05, "ok")) == "ok"


async def test_timeout_zero_means_no_limit(make_group):
    await make_group(2, ag.RpcOptions(rpc_timeout=0.2))
    start = time.monotonic()
    assert await ag.rpc_async("worker1", sleep_then, args=(0.5, "done"), timeout=0) == "done"
    assert time.monotonic() - start >= 0.45


async def test_timeout_on_call_to_self(group2):
    with pytest.raises(ag.RpcTimeout):
        await ag.rpc_async("worker0", sleep_then, args=(1.0,), timeout=0.1)
    assert await ag.rpc_async("worker0", where_am_i) == "worker0"


async def test_timeout_cancels_async_callee(group2):
    tag = f"cancel-{time.monotonic()}"
    with pytest.raises(ag.RpcTimeout):
        await ag.rpc_async("worker1", wait_to_be_cancelled, args=(tag,), timeout=0.1)
    for _ in range(150):  # up to 3 s
        if tag in CANCELLED:
            break
        await asyncio.sleep(0.02)
    assert tag in CANCELLED


async def test_cancelling_the_future_cancels_the_callee(group2):
    tag = f"user-cancel-{time.monotonic()}"
    fut = ag.rpc_async("worker1", wait_to_be_cancelled, args=(tag,))
    await asyncio.sleep(0.05)  # running on worker1
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(fut, 0.05)  # wait_for cancels the call's future
    assert fut.cancelled()
    for _ in range(150):  # up to 3 s
        if tag in CANCELLED:
            break
        await asyncio.sleep(0.02)
    assert tag in CANCELLED
    assert await ag.rpc_async("worker1", square, args=(3,)) == 9


async def test_mixed_timeouts_expire_in_deadline_order(group2):
    started = time.monotonic()
    limits = [0.6, 0.2, 0.0, 0.4, 60.0]  # 0: no limit
    futures = [ag.rpc_async("worker1", sleep_then, args=(0.8, "done"), timeout=t) for t in limits]
    when: dict[float, float] = {}

    async def watch(limit: float, fut: asyncio.Future) -> object:
        try:
            return await fut
        except ag.RpcTimeout:
            when[limit] = time.monotonic() - started
            return "timeout"

    outcome = await asyncio.gather(*(watch(t, f) for t, f in zip(limits, futures, strict=True)))
    assert outcome == ["timeout", "timeout", "done", "timeout", "done"]
    assert when[0.2] < when[0.4] < when[0.6]
    for limit, elapsed in when.items():
        assert limit - 0.05 <= elapsed < limit + 0.5


async def test_blocking_builtin_respects_timeout(group2):
    start = time.monotonic()
    with pytest.raises(ag.RpcTimeout):
        await ag.rpc_async("worker1", time.sleep, args=(0.6,), timeout=0.1)
    assert time.monotonic() - start < 0.4


# --------------------------------------------------------------------------------------
# a blocking remote function does not block the callee


async def test_sleeping_function_does_not_block_other_callers(group3):
    slow = ag.rpc_async("worker1", sleep_then, args=(1.0, "slept"))
    await asyncio.sleep(0.05)  # the slow call is running on worker1

    async def twenty_small_calls() -> tuple[list[int], float]:
        start = time.monotonic()
        results = [await ag.rpc_async("worker1", square, args=(i,)) for i in range(20)]
        return results, time.monotonic() - start

    results, elapsed = await asyncio.wait_for(group3.run_as(2, twenty_small_calls), 5)
    assert results == [i * i for i in range(20)]
    assert elapsed < 0.6
    assert not slow.done()
    assert await slow == "slept"


# --------------------------------------------------------------------------------------
# bad arguments


async def test_unknown_worker_name(group2):
    with pytest.raises(ValueError, match="no-such-worker"):
        await ag.rpc_async("no-such-worker", where_am_i)
    with pytest.raises(ValueError, match="no-such-worker"):
        ag.rpc_sync("no-such-worker", where_am_i)


async def test_non_callable_func(group2):
    with pytest.raises(TypeError):
        await ag.rpc_async("worker1", 42)
    with pytest.raises(TypeError):
        await ag.rpc_async("worker1", "torch.add", args=(1, 2))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")  # (torch.func.jvp's own)
async def test_a_tensor_inside_a_torch_func_transform_is_refused(group2):
    """torch.func.grad over an RPC gave zeros (the transform cannot follow the tensor
    to another worker): the call is refused instead, and the worker serves on. A tensor
    detached inside grad is a constant to it, and its value travels."""
    x = torch.rand(4)

    def through_rpc(a: torch.Tensor) -> torch.Tensor:
        return ag.rpc_sync("worker1", torch.sin, args=(a,)).sum()

    def jvp(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.func.jvp(through_rpc, (a,), (torch.ones_like(a),))  # type: ignore[no-any-return]

    def mutated_through_rpc(a: torch.Tensor) -> torch.Tensor:  # (sent its value before the add_)
        a.view(-1).add_(10)
        return ag.rpc_sync("worker1", torch.sin, args=(a,))

    for transformed, arg in ((torch.func.grad(through_rpc), x), (torch.func.vmap(through_rpc), x[None]),
                             (jvp, x), (torch.func.grad(torch.func.grad(lambda a: through_rpc(a * a))), x[0]),
                             (torch.func.functionalize(mutated_through_rpc), x.clone())):
        with pytest.raises(TypeError, match=r"inside a torch.func transform .* cannot be sent"):
            await asyncio.to_thread(transformed, arg)
    assert torch.equal(await ag.rpc_async("worker1", torch.sin, args=(x,)), torch.sin(x))
    assert torch.allclose(torch.func.grad(lambda a: torch.sin(a).sum())(x), torch.cos(x))

    def detached_through_rpc(a: torch.Tensor) -> torch.Tensor:  # a constant to the transform
        return (a * ag.rpc_sync("worker1", torch.sin, args=(a.detach(),))).sum()

    for transform in (torch.func.grad, lambda f: torch.func.grad(torch.func.grad(lambda a: f(a) * a))):
        got = await asyncio.to_thread(transform(detached_through_rpc), x[0] if transform is not torch.func.grad else x)
        want = transform(lambda a: (a * torch.sin(a.detach())).sum())(x[0] if transform is not torch.func.grad else x)
        assert torch.allclose(got, want)


@pytest.mark.parametrize("rank", [2, 99, -1])
async def test_rank_out_of_range(group2, rank):
    with pytest.raises(ValueError):
        await ag.rpc_async(rank, where_am_i)


async def test_bad_destination_type(group2):
    with pytest.raises(TypeError):
        await ag.rpc_async(1.0, where_am_i)


# --------------------------------------------------------------------------------------
# load


async def test_2000_calls_in_flight(group2):
    n = 2000
    tensors = [torch.full((2,), float(i)) for i in range(n // 2)]
    futures = [ag.rpc_async("worker1", torch.mul, args=(t, 3)) for t in tensors]
    futures += [ag.rpc_async("worker1", square, args=(i,)) for i in range(n // 2)]
    assert len(futures) == n
    results = await asyncio.wait_for(asyncio.gather(*futures), 60)
    for i, r in enumerate(results[: n // 2]):
        assert torch.equal(r, torch.full((2,), 3.0 * i))
    assert results[n // 2 :] == [i * i for i in range(n // 2)]


async def test_args_none_means_no_arguments_as_in_torch(group2):
    assert await ag.rpc_async("worker1", where_am_i, args=None) == "worker1"
    assert await ag.remote("worker1", where_am_i, args=None, kwargs=None).to_here() == "worker1"


class BatchUpdater:
    """torch's batch-processing parameter server (its async_execution tutorial): each
    call returns a torch.futures.Future that is completed once ``size`` calls came in."""

    def __init__(self, size: int) -> None:
        self.size, self.lock = size, threading.Lock()
        self.pending: list[torch.Tensor] = []
        self.future: torch.futures.Future = torch.futures.Future()

    @staticmethod
    @torch.distributed.rpc.functions.async_execution
    def add(rref: ag.RRef, value: torch.Tensor) -> torch.futures.Future:
        self = rref.local_value()
        with self.lock:
            self.pending.append(value)
            future = self.future
            if len(self.pending) == self.size:
                total = torch.stack(self.pending).sum(0)
                self.pending, self.future = [], torch.futures.Future()
                if total.isnan().any():
                    future.set_exception(ValueError("a NaN in the batch"))
                else:
                    future.set_result(total)
        return future


async def add_soon(x: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    asyncio.get_running_loop().call_later(0.05, future.set_result, x + 1)
    return future


async def test_a_returned_torch_future_is_waited_for_as_in_torch(group2):
    """A function returning a torch.futures.Future (torch's @async_execution idiom)
    answers with the future's value once it completes, or with its error."""
    updater = ag.remote("worker1", BatchUpdater, args=(3,))
    values = [torch.full((2,), float(i)) for i in range(3)]
    calls = [ag.rpc_async("worker1", BatchUpdater.add, args=(updater, v)) for v in values]
    for result in await asyncio.wait_for(asyncio.gather(*calls), 10):
        assert torch.equal(result, sum(values))
    bad = [torch.zeros(2), torch.zeros(2), torch.full((2,), float("nan"))]
    calls = [ag.rpc_async("worker1", BatchUpdater.add, args=(updater, v)) for v in bad]
    for outcome in await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10):
        assert isinstance(outcome, ag.RemoteError) and "a NaN in the batch" in str(outcome)
    x = torch.rand(3)
    assert torch.equal(await ag.rpc_async("worker1", add_soon, args=(x,)), x + 1)
    # then() and collect_all() make torch._C.Future objects, not torch.futures.Future
    then, collected = await asyncio.wait_for(asyncio.gather(
        ag.rpc_async("worker1", chained_soon, args=(x,)),
        ag.rpc_async("worker1", collected_soon, args=(x,))), 10)
    assert torch.equal(then, x + 2)
    assert torch.equal(collected, 2 * x + 2)


async def chained_soon(x: torch.Tensor) -> torch.futures.Future:
    return (await add_soon(x)).then(lambda done: done.wait() + 1)


async def collected_soon(x: torch.Tensor) -> torch.futures.Future:
    both = torch.futures.collect_all([await add_soon(x), await add_soon(x)])
    return both.then(lambda done: sum(f.wait() for f in done.wait()))


async def test_rpc_sync_from_a_thread_while_the_loops_thread_is_blocked(group2):
    """A notebook cell that waits for threads calling rpc_sync blocks the loop those
    calls need: they give up a little after their timeout, saying so, instead of
    waiting for good (and the cell with them); the worker works on afterwards."""
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(ag.rpc_sync("worker1", max, args=(1, 2), timeout=1))
        except BaseException as exc:  # noqa: BLE001 - the outcome is what is checked
            outcome.append(exc)

    thread = threading.Thread(target=call)
    start = time.monotonic()
    thread.start()
    thread.join(20)  # blocks this loop's thread, as the cell does
    assert not thread.is_alive() and time.monotonic() - start < 10
    assert isinstance(outcome[0], ag.RpcTimeout), outcome
    assert "has not run" in str(outcome[0]) and "never sent" in str(outcome[0])
    await asyncio.sleep(0.1)
    assert await ag.rpc_async("worker1", max, args=(1, 2)) == 2


def test_every_error_is_a_runtime_error_as_torchs_are():
    """torch.distributed's errors and torch RPC's failures are RuntimeErrors: code ported
    from torch that catches RuntimeError catches ours; the finer types stay."""
    for cls in (ag.ActorgradError, ag.RemoteError, ag.RpcTimeout, ag.WorkerLost,
                ag.ProtocolError, ag.AuthenticationError, ag.ContextError, ag.RendezvousTimeout,
                ag.CollectiveError, ag.CollectiveRankLost):
        assert issubclass(cls, RuntimeError), cls
        assert cls.__module__ == "actorgrad" and getattr(ag, cls.__name__) is cls, cls
    assert issubclass(ag.RpcTimeout, TimeoutError) and issubclass(ag.WorkerLost, ConnectionError)


def _interrupt() -> None:
    raise KeyboardInterrupt  # as Ctrl-C lands in a notebook cell


async def test_an_interrupted_blocking_call_is_cancelled(group2):
    """Ctrl-C on rpc_sync (Jupyter's loop, re-entered) stops waiting and cancels the
    call on the callee too: nothing is left for shutdown to wait for."""
    tag = "interrupted-rpc-sync"
    asyncio.get_running_loop().call_later(0.3, _interrupt)
    with pytest.raises(KeyboardInterrupt):
        ag.rpc_sync("worker1", wait_to_be_cancelled, args=(tag,))
    for _ in range(100):
        if tag in CANCELLED:
            break
        await asyncio.sleep(0.02)
    assert tag in CANCELLED
    assert not group2.workers[1].peers[0].serving


async def test_an_interrupted_blocking_call_from_a_thread_is_cancelled(group2):
    tag = "interrupted-thread-call"
    outcome: list[BaseException] = []

    def call() -> None:
        from actorgrad.runtime import _sync

        original = _sync._wait_driving

        def interrupted(*args: object, **kwargs: object) -> object:
            time.sleep(0.3)
            raise KeyboardInterrupt  # arrives while the thread waits

        _sync._wait_driving = interrupted  # type: ignore[assignment]
        try:
            ag.rpc_sync("worker1", wait_to_be_cancelled, args=(tag,))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)
        finally:
            _sync._wait_driving = original

    thread = threading.Thread(target=call)
    thread.start()
    while thread.is_alive():  # noqa: ASYNC110 - the loop must run meanwhile
        await asyncio.sleep(0.02)
    assert isinstance(outcome[0], KeyboardInterrupt)
    for _ in range(100):
        if tag in CANCELLED:
            break
        await asyncio.sleep(0.02)
    assert tag in CANCELLED


async def test_call_arguments_that_cannot_be_meant_are_refused_at_the_call(group2):
    """args=(t) is t, whose rows were sent as arguments; a string was split into its
    characters; a timeout that is no number failed deep inside with a comparison."""
    t = torch.ones(2)
    for call in (ag.rpc_async, ag.remote):
        with pytest.raises(TypeError, match=r"args must be a tuple of arguments, got Tensor \(one argument: args=\(x,\)\)"):
            call("worker1", torch.neg, args=t)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="args must be a tuple"):
            call("worker1", len, args="ab")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="kwargs must be a dict"):
            call("worker1", torch.neg, args=(t,), kwargs=[1, 2])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            call("worker1", torch.neg, args=(t,), timeout="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        await ag.remote("worker1", torch.neg, args=(t,)).to_here(timeout=True)
    # the blocking form names the bad argument too, also where it could not block
    with pytest.raises(ValueError, match="timeout"):
        ag.rpc_sync("worker1", torch.neg, args=(t,), timeout=-1)
    with pytest.raises(TypeError, match="args must be a tuple"):
        ag.rpc_sync("worker1", torch.neg, args=t)  # type: ignore[arg-type]
    assert ag.rpc_sync("worker1", max, args=(i for i in range(3))) == 2  # read once, sent    assert torch.equal(await ag.rpc_async("worker1", torch.neg, args=[t]), -t)  # a list is fine
    # any other iterable and mapping as before, numpy numbers as timeouts
    import types

    import numpy as np

    assert await ag.rpc_async("worker1", max, args=range(3), kwargs=types.MappingProxyType({}),
                              timeout=np.float32(5)) == 2


def _forward_with_rpc_async(x: torch.Tensor) -> torch.Tensor:
    """torch's idiom in a plain (not async) remote function: rpc_async, then wait."""
    fut = ag.rpc_async("worker2", torch.mul, args=(x, 3.0))
    return fut.wait() * 2


def _chained_with_then(x: torch.Tensor) -> object:
    """torch's @async_execution idiom: return the future of a chain of callbacks."""
    return ag.rpc_async("worker2", torch.add, args=(x, 1.0)).then(lambda f: f.wait() * 10)


async def test_rpc_async_in_a_plain_remote_function_gives_a_torch_future(group3):
    x = torch.ones(2)
    assert torch.equal(await ag.rpc_async("worker1", _forward_with_rpc_async, args=(x,)), torch.full((2,), 6.0))
    assert torch.equal(await ag.rpc_async("worker1", _chained_with_then, args=(x,)), torch.full((2,), 20.0))
    # recorded in the caller's autograd context, as from the loop: the gradient is exact
    x = torch.ones(2, requires_grad=True)
    async with ag.autograd.context() as context_id:
        y = await ag.rpc_async("worker1", _forward_with_rpc_async, args=(x,))
        await ag.autograd.backward(context_id, [y.sum()])
        assert torch.equal(ag.autograd.get_gradients(context_id)[x], torch.full((2,), 6.0))
    # its errors: in the torch future, raised by wait()
    with pytest.raises(ag.RemoteError, match="TypeError on worker2: mul"):
        await ag.rpc_async("worker1", _forward_with_rpc_async, args=("not a tensor",))
