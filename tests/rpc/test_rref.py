"""RRef: creation, identity, values, proxies, forks and the lifetime protocol."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from typing import Any

import pytest
import torch

import actorgrad as ag
from actorgrad.runtime import get_worker
from actorgrad.wire import Payload


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def inc(self, k: int = 1) -> int:
        self.n += k
        return self.n

    def get(self) -> int:
        return self.n

    def snapshot(self) -> Counter:
        return Counter(self.n)

    async def slow_get(self, delay: float) -> int:
        await asyncio.sleep(delay)
        return self.n


def make_tensor(n: int) -> torch.Tensor:
    return torch.arange(float(n))


def slow_make(seconds: float, n: int) -> torch.Tensor:
    time.sleep(seconds)
    return torch.arange(float(n))


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def inspect_on_owner(rref: ag.RRef) -> tuple[str, bool, str, Any]:
    """Runs on the owner: the RRef it receives is the owner's own."""
    return ag.get_worker_info().name, rref.is_owner(), rref.owner_name(), rref.local_value()


def local_value_identity(rref_a: ag.RRef, rref_b: ag.RRef) -> bool:
    return rref_a.local_value() is rref_b.local_value()


def try_local_value(rref: ag.RRef) -> str:
    try:
        rref.local_value()
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return "no error"


async def fetch_and_sum(rref: ag.RRef) -> tuple[str, bool, float]:
    value = await rref.to_here()
    return ag.get_worker_info().name, rref.is_owner(), float(value.sum())


def sync_proxy_inc(rref: ag.RRef, k: int) -> tuple[str, int]:
    # runs in a thread-pool thread of the caller worker
    return ag.get_worker_info().name, rref.rpc_sync().inc(k)


def make_local_rref(n: int) -> ag.RRef:
    return ag.RRef(torch.full((3,), float(n)))


KEPT: dict[str, Any] = {}


def keep(key: str, rref: ag.RRef) -> str:
    KEPT[key] = rref
    return ag.get_worker_info().name


async def debug_info(worker: str) -> dict[str, int]:
    return await ag.rpc_async(worker, ag.rref_debug_info)


async def wait_owner_count(worker: str, expected: int, timeout: float = 3.0) -> dict[str, int]:
    """Poll (with gc) until ``worker`` owns ``expected`` values; return the last info."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        info = await debug_info(worker)
        if info["num_owner_rrefs"] == expected or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------------------
# identity and values


async def test_remote_and_to_here(group2):
    rref = ag.remote("worker1", torch.add, args=(torch.ones(3), torch.arange(3.0)))
    assert isinstance(rref, ag.RRef)
    assert rref.owner() == ag.WorkerInfo("worker1", 1)
    assert rref.owner_name() == "worker1"
    assert not rref.is_owner()
    value = await rref.to_here()
    assert torch.equal(value, torch.ones(3) + torch.arange(3.0))
    # to_here can be called again and gives an equal copy
    assert torch.equal(await rref.to_here(), value)


async def test_remote_with_rank_and_workerinfo_destination(group3):
    by_rank = ag.remote(2, make_tensor, args=(4,))
    by_info = ag.remote(ag.get_worker_info("worker1"), make_tensor, args=(5,))
    assert by_rank.owner_name() == "worker2"
    assert by_info.owner_name() == "worker1"
    assert torch.equal(await by_rank.to_here(), torch.arange(4.0))
    assert torch.equal(await by_info.to_here(), torch.arange(5.0))


async def test_remote_returns_at_once(group2):
    start = time.monotonic()
    rref = ag.remote("worker1", slow_make, args=(0.5, 3))
    assert time.monotonic() - start < 0.2
    assert torch.equal(await rref.to_here(), torch.arange(3.0))


async def test_local_value_on_owner(group2):
    rref = ag.remote("worker1", make_tensor, args=(6,))
    name, is_owner, owner_name, value = await ag.rpc_async(
        "worker1", inspect_on_owner, args=(rref,)
    )
    assert (name, is_owner, owner_name) == ("worker1", True, "worker1")
    assert torch.equal(value, torch.arange(6.0))
    # two copies of the RRef resolve to the very same object on the owner
    assert await ag.rpc_async("worker1", local_value_identity, args=(rref, rref)) is True


async def test_local_value_on_owner_waits_for_creation(group2):
    rref = ag.remote("worker1", slow_make, args=(0.3, 4))
    _, _, _, value = await ag.rpc_async("worker1", inspect_on_owner, args=(rref,))
    assert torch.equal(value, torch.arange(4.0))


async def test_local_value_on_non_owner_raises(group3):
    rref = ag.remote("worker1", make_tensor, args=(2,))
    await rref.to_here()
    with pytest.raises(RuntimeError):
        rref.local_value()
    # also on a third worker that received a fork
    message = await ag.rpc_async("worker2", try_local_value, args=(rref,))
    assert message.startswith("RuntimeError")


async def test_local_rref(group2):
    value = {"weights": torch.randn(3)}
    rref = ag.RRef(value)
    assert rref.is_owner()
    assert rref.owner() == ag.WorkerInfo("worker0", 0)
    assert rref.owner_name() == "worker0"
    assert rref.local_value() is value
    assert await rref.to_here() is value
    # a non-owner fetches a copy
    name, is_owner, total = await ag.rpc_async("worker1", _fetch_weights_sum, args=(rref,))
    assert (name, is_owner) == ("worker1", False)
    assert total == pytest.approx(float(value["weights"].sum()))


async def _fetch_weights_sum(rref: ag.RRef) -> tuple[str, bool, float]:
    value = await rref.to_here()
    return ag.get_worker_info().name, rref.is_owner(), float(value["weights"].sum())


async def test_to_here_timeout(group2):
    rref = ag.remote("worker1", slow_make, args=(0.8, 2))
    with pytest.raises(ag.RpcTimeout):
        await rref.to_here(timeout=0.2)
    assert torch.equal(await rref.to_here(timeout=5), torch.arange(2.0))


# --------------------------------------------------------------------------------------
# proxies


async def test_rpc_async_proxy(group2):
    rref = ag.remote("worker1", Counter, args=(10,))
    assert await rref.rpc_async().inc(5) == 15
    assert await rref.rpc_async().inc(k=2) == 17
    assert await rref.rpc_async().slow_get(0.05) == 17  # async method awaited on the owner
    assert await rref.rpc_async().get() == 17


async def test_rpc_async_proxy_timeout(group2):
    rref = ag.remote("worker1", Counter)
    with pytest.raises(ag.RpcTimeout):
        await rref.rpc_async(timeout=0.1).slow_get(2.0)


async def test_rpc_sync_proxy_from_a_thread(group2):
    rref = ag.remote("worker1", Counter, args=(1,))
    result = await asyncio.wait_for(asyncio.to_thread(lambda: rref.rpc_sync().inc(4)), 10)
    assert result == 5
    assert await rref.rpc_async().get() == 5


async def test_rpc_sync_proxy_from_a_remote_function(group3):
    rref = ag.remote("worker1", Counter, args=(100,))
    name, result = await asyncio.wait_for(
        ag.rpc_async("worker2", sync_proxy_inc, args=(rref, 3)), 10
    )
    assert (name, result) == ("worker2", 103)
    assert await rref.rpc_async().get() == 103


async def test_remote_proxy_returns_rref(group2):
    rref = ag.remote("worker1", Counter, args=(7,))
    snap = rref.remote().snapshot()
    assert isinstance(snap, ag.RRef)
    assert snap.owner_name() == "worker1"
    copy = await snap.to_here()
    assert isinstance(copy, Counter) and copy.n == 7
    # the snapshot is independent of the original
    assert await rref.rpc_async().inc(1) == 8
    assert await snap.rpc_async().get() == 7
    inc_rref = rref.remote().inc(2)
    assert await inc_rref.to_here() == 10


async def test_proxies_on_local_rref(group2):
    rref = ag.RRef(Counter(3))
    assert await rref.rpc_async().inc(1) == 4
    assert rref.local_value().n == 4


# --------------------------------------------------------------------------------------
# failures


async def test_remote_creation_failure_surfaces_at_to_here(group2):
    rref = ag.remote("worker1", raise_value_error, args=("cannot create",))
    with pytest.raises(ag.RemoteError) as info:
        await rref.to_here()
    assert "ValueError" in info.value.remote_type
    assert isinstance(info.value.__cause__, ValueError)
    assert "cannot create" in str(info.value)
    # and on the proxies
    with pytest.raises(ag.RemoteError) as info:
        await rref.rpc_async().anything()
    assert "ValueError" in info.value.remote_type


async def test_remote_to_unknown_worker(group2):
    with pytest.raises(ValueError):
        ag.remote("nobody", make_tensor, args=(1,))
    with pytest.raises(TypeError):
        ag.remote("worker1", 3)


# --------------------------------------------------------------------------------------
# forks


async def test_pass_rref_to_third_worker(group3):
    rref = ag.remote("worker1", make_tensor, args=(5,))
    name, is_owner, total = await ag.rpc_async("worker2", fetch_and_sum, args=(rref,))
    assert (name, is_owner) == ("worker2", False)
    assert total == float(torch.arange(5.0).sum())


async def send_back_to_owner(rref: ag.RRef) -> tuple[str, bool, float]:
    return await ag.rpc_async("worker1", fetch_and_sum, args=(rref,))


@pytest.mark.parametrize("route", ["fetched", "sent to its owner"])
async def test_a_third_worker_overtaking_the_creation_waits_for_it(group3, route):
    """worker2 gets the RRef and reaches the owner before worker0's remote() does
    (another connection): the owner waits for the creation, as torch's does, instead of
    saying the value is not (or no longer) owned there; then everything is freed."""
    w1 = group3.workers[1]
    w1.peers[0].transport.pause_reading()  # worker0's messages to worker1 wait
    rref = ag.remote("worker1", make_tensor, args=(4,))
    fetch = fetch_and_sum if route == "fetched" else send_back_to_owner
    answer = ag.rpc_async("worker2", fetch, args=(rref,))
    await asyncio.sleep(0.2)  # worker2 asked worker1, which waits
    assert not answer.done()
    w1.peers[0].transport.resume_reading()
    name, _, total = await asyncio.wait_for(answer, 10)
    assert total == float(torch.arange(4.0).sum())
    assert name == ("worker2" if route == "fetched" else "worker1")
    del rref, answer
    assert (await wait_owner_count("worker1", 0))["num_owner_rrefs"] == 0


async def test_a_fetch_for_a_freed_value_still_fails_at_once(group3):
    rref = ag.remote("worker1", make_tensor, args=(2,))
    await rref.to_here()
    rref_id = rref._id
    del rref
    await wait_owner_count("worker1", 0)
    worker = group3.workers[0]
    reply = worker.call(1, "rref.fetch", Payload.dump((rref_id, None)), 10)
    with pytest.raises(ag.RemoteError, match="not \\(or no longer\\) owned"):
        await asyncio.wait_for(reply, 5)


async def test_pass_rref_back_to_owner_and_to_self(group2):
    rref = ag.remote("worker1", make_tensor, args=(3,))
    name, is_owner, total = await ag.rpc_async("worker1", fetch_and_sum, args=(rref,))
    assert (name, is_owner, total) == ("worker1", True, 3.0)
    name, is_owner, total = await ag.rpc_async("worker0", fetch_and_sum, args=(rref,))
    assert (name, is_owner, total) == ("worker0", False, 3.0)


async def test_rref_returned_in_result(group3):
    rref = await ag.rpc_async("worker1", make_local_rref, args=(4,))
    assert isinstance(rref, ag.RRef)
    assert rref.owner_name() == "worker1"
    assert not rref.is_owner()
    assert torch.equal(await rref.to_here(), torch.full((3,), 4.0))
    name, _, total = await ag.rpc_async("worker2", fetch_and_sum, args=(rref,))
    assert (name, total) == ("worker2", 12.0)


# --------------------------------------------------------------------------------------
# lifetime


async def test_dropped_rref_is_freed_on_owner(group2):
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    rref = ag.remote("worker1", make_tensor, args=(3,))
    await rref.to_here()
    assert (await debug_info("worker1"))["num_owner_rrefs"] == base + 1
    del rref
    info = await wait_owner_count("worker1", base)
    assert info["num_owner_rrefs"] == base
    assert info["num_forks"] == 0


async def test_many_dropped_rrefs_are_freed(group2):
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    rrefs = [ag.remote("worker1", make_tensor, args=(i,)) for i in range(50)]
    values = await asyncio.gather(*(r.to_here() for r in rrefs))
    assert [v.numel() for v in values] == list(range(50))
    assert (await debug_info("worker1"))["num_owner_rrefs"] == base + 50
    rrefs.clear()
    assert (await wait_owner_count("worker1", base))["num_owner_rrefs"] == base


async def rref_after(seconds: float) -> ag.RRef:
    with contextlib.suppress(asyncio.CancelledError):  # ignores the caller's CANCEL, as
        await asyncio.sleep(seconds)  # a reply already on its way would: the reply comes
    return ag.RRef(torch.zeros(100))


async def test_rrefs_in_replies_that_come_after_the_caller_gave_up_are_freed(group2):
    # the reply was pickled (a fork registered at the owner) after we stopped waiting;
    # the owner must still hear that nobody holds it
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    late = 0
    for _ in range(20):
        try:
            await ag.rpc_async("worker1", rref_after, args=(0.05,), timeout=0.01)
        except ag.RpcTimeout:
            late += 1
    call = ag.rpc_async("worker1", rref_after, args=(0.05,), timeout=0)
    await asyncio.sleep(0.01)
    call.cancel()
    await asyncio.sleep(0.2)  # the late replies arrive
    assert late == 20
    info = await wait_owner_count("worker1", base)
    assert info["num_owner_rrefs"] == base and info["num_forks"] == 0, info


async def test_failed_creation_is_freed(group2):
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    rref = ag.remote("worker1", raise_value_error, args=("x",))
    with pytest.raises(ag.RemoteError):
        await rref.to_here()
    del rref
    assert (await wait_owner_count("worker1", base))["num_owner_rrefs"] == base


async def test_a_failed_fetch_leaves_no_cycle_through_its_error(group2):
    """The failed fetch's error must not keep the RRef in a reference cycle (its
    traceback holds to_here's frame; a future in that frame holding the error closed
    the loop): dropped, the RRef is freed at once, as torch's C++ RRef, not at the next
    gc, and the owner's entry with it (a loop of failing remote() calls grew the
    owner's table meanwhile)."""
    rref = ag.remote("worker1", raise_value_error, args=("x",))
    try:
        await rref.to_here()
    except ag.RemoteError as exc:
        error = exc
    tb, held = error.__traceback__, []
    while tb is not None:
        held += [v for v in tb.tb_frame.f_locals.values()
                 if isinstance(v, asyncio.Future) and v.done() and not v.cancelled() and v.exception() is error]
        tb = tb.tb_next
    assert not held


async def test_proxy_results_are_freed(group2):
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    counter = ag.remote("worker1", Counter)
    assert await counter.rpc_async().inc(2) == 2
    snap = counter.remote().snapshot()
    assert (await snap.to_here()).n == 2
    assert (await debug_info("worker1"))["num_owner_rrefs"] == base + 2
    del counter, snap
    assert (await wait_owner_count("worker1", base))["num_owner_rrefs"] == base


async def test_forked_rref_freed_after_every_holder_drops(group3):
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    rref = ag.remote("worker1", make_tensor, args=(4,))
    name, _, total = await ag.rpc_async("worker2", fetch_and_sum, args=(rref,))
    assert (name, total) == ("worker2", 6.0)
    # worker2 dropped its copy; worker0 still holds one: the value must stay alive
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        gc.collect()
        info = await debug_info("worker1")
        if info["num_forks"] == 1:
            break
        await asyncio.sleep(0.02)
    assert info == {"num_owner_rrefs": base + 1, "num_forks": 1}
    assert torch.equal(await rref.to_here(), torch.arange(4.0))
    del rref
    info = await wait_owner_count("worker1", base)
    assert info["num_owner_rrefs"] == base and info["num_forks"] == 0


async def test_value_survives_while_third_worker_holds_it(group3):
    key = f"kept-{time.monotonic()}"
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    rref = ag.remote("worker1", make_tensor, args=(5,))
    assert await ag.rpc_async("worker2", keep, args=(key, rref)) == "worker2"
    del rref
    gc.collect()
    await asyncio.sleep(0.2)
    gc.collect()
    assert (await debug_info("worker1"))["num_owner_rrefs"] == base + 1

    async def fetch_kept() -> torch.Tensor:
        return await KEPT[key].to_here()

    assert torch.equal(await group3.run_as(2, fetch_kept), torch.arange(5.0))
    del KEPT[key]
    assert (await wait_owner_count("worker1", base))["num_owner_rrefs"] == base


async def test_local_rref_forks_are_released(group2):
    base = (await debug_info("worker0"))["num_owner_rrefs"]
    rref = ag.RRef(torch.arange(3.0))
    name, _, total = await ag.rpc_async("worker1", fetch_and_sum, args=(rref,))
    assert (name, total) == ("worker1", 3.0)
    assert (await wait_owner_count("worker0", base))["num_owner_rrefs"] == base
    # the owner's own RRef still holds the value
    assert torch.equal(rref.local_value(), torch.arange(3.0))
    assert torch.equal(
        await ag.rpc_async("worker1", _to_here_sync_free, args=(rref,)), torch.arange(3.0)
    )


async def _to_here_sync_free(rref: ag.RRef) -> torch.Tensor:
    return await rref.to_here()


# --------------------------------------------------------------------------------------
# remote() to oneself


async def test_remote_to_self_local_value(group2):
    rref = ag.remote("worker0", make_tensor, args=(3,))
    assert rref.is_owner()
    assert torch.equal(await rref.to_here(), torch.arange(3.0))
    assert torch.equal(rref.local_value(), torch.arange(3.0))


async def test_remote_to_self_can_be_passed_on(group2):
    rref = ag.remote("worker0", make_tensor, args=(3,))
    await rref.to_here()
    name, _, total = await ag.rpc_async("worker1", fetch_and_sum, args=(rref,))
    assert (name, total) == ("worker1", 3.0)


async def test_remote_to_self_is_freed(group2):
    base = (await debug_info("worker0"))["num_owner_rrefs"]
    rref = ag.remote("worker0", make_tensor, args=(3,))
    await rref.to_here()
    del rref
    assert (await wait_owner_count("worker0", base, timeout=1.0))["num_owner_rrefs"] == base


async def test_rref_sent_to_its_owner_needs_no_fork_message(group3, monkeypatch):
    """A call to the owner with the RRef as argument (the usual way to use one, and every
    proxy call) sends no add_fork: the owner rebuilds an owner RRef. Sent anywhere else
    an RRef is still a new fork, and the value is freed once every holder is done."""
    told: list[str] = []
    tell = ag.runtime.Worker.tell

    def counting(self, to, target, payload):  # type: ignore[no-untyped-def]
        if target == "rref.add_fork":
            told.append(self.name)
        return tell(self, to, target, payload)

    monkeypatch.setattr(ag.runtime.Worker, "tell", counting)
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    rref = ag.remote("worker1", Counter, args=(5,))
    assert await rref.rpc_async().inc(2) == 7
    name, is_owner, _, _ = await ag.rpc_async("worker1", inspect_on_owner, args=(rref,))
    assert (name, is_owner) == ("worker1", True)
    assert told == []
    assert await ag.rpc_async("worker2", sync_proxy_inc, args=(rref, 1)) == ("worker2", 8)
    assert told == ["worker0"]  # the copy for worker2 is a fork; its own call to the owner is not
    del rref
    gc.collect()
    info = await wait_owner_count("worker1", base)
    assert (info["num_owner_rrefs"], info["num_forks"]) == (base, 0)


def takes_anything(*args: Any) -> int:
    return len(args)


@pytest.mark.parametrize("owner", ["worker1", "worker0"])
async def test_fork_taken_back_when_the_call_cannot_be_sent(group3, owner):
    """An RRef pickled beside an argument that cannot be pickled registered its fork at
    the owner, and the message never left: the fork must be taken back, so dropping
    the RRef frees the value (a user RRef, and one this worker owns)."""
    import threading

    base = (await debug_info(owner))["num_owner_rrefs"]
    rref = ag.remote(owner, make_tensor, args=(3,)) if owner != "worker0" else ag.RRef(torch.ones(3))
    await rref.to_here()
    with pytest.raises(TypeError, match="pickle"):
        await ag.rpc_async("worker2", takes_anything, args=(rref, threading.Lock()))
    assert await ag.rpc_async("worker2", takes_anything, args=(rref,)) == 1  # it still travels
    del rref
    info = await wait_owner_count(owner, base)
    assert (info["num_owner_rrefs"], info["num_forks"]) == (base, 0)


async def test_forks_held_by_a_lost_worker_are_dropped(make_process_group):
    """worker0 sends RRefs of values it owns to worker2, which keeps them; worker2 dies.
    Its RRefs are gone with it, so worker0 frees the values (one still held by worker1
    stays)."""
    group = await make_process_group(3)

    def keep(*rrefs: Any) -> int:  # runs in worker processes: defined here, sent by value
        import builtins

        kept = builtins.__dict__.setdefault("_kept_rrefs", [])
        kept.extend(rrefs)
        return len(kept)

    base = ag.rref_debug_info()["num_owner_rrefs"]
    values = [ag.RRef(torch.full((4,), float(i))) for i in range(5)]
    assert await ag.rpc_async("worker2", keep, args=tuple(values)) == 5
    assert await ag.rpc_async("worker1", keep, args=(values[0],)) == 1
    del values
    gc.collect()
    assert ag.rref_debug_info() == {"num_owner_rrefs": base + 5, "num_forks": 6}
    group.kill(2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the loss is noticed when the connection drops
        if ag.rref_debug_info()["num_owner_rrefs"] == base + 1:
            break
        await asyncio.sleep(0.05)
    assert ag.rref_debug_info() == {"num_owner_rrefs": base + 1, "num_forks": 1}


@pytest.mark.parametrize("owner", ["worker1", "worker0"])
async def test_remote_that_cannot_be_sent_leaves_nothing(group2, owner):
    import threading

    base = (await debug_info(owner))["num_owner_rrefs"]
    with pytest.raises(TypeError, match="pickle"):
        ag.remote(owner, takes_anything, args=(threading.Lock(),))
    info = await wait_owner_count(owner, base)
    assert (info["num_owner_rrefs"], info["num_forks"]) == (base, 0)



async def test_own_remote_value_survives_a_fork_taken_back_before_it_is_created(group2):
    """remote() to oneself, then at once a call that pickles its RRef (a fork of the
    entry the creation will fill) and fails: taking the fork back must not free that
    entry, or the value would be made into a new one and never reach this RRef."""
    import threading

    rref = ag.remote("worker0", make_tensor, args=(3,))
    with pytest.raises(TypeError, match="pickle"):
        ag.rpc_async("worker1", takes_anything, args=(rref, threading.Lock()))
    assert torch.equal(await rref.to_here(timeout=10), torch.arange(3.0))


# --------------------------------------------------------------------------------------
# torch's RRef extras: confirmed_by_owner() and backward()


def failing_make() -> None:
    raise ValueError("no value")


def rref_of_loss(w: torch.Tensor) -> ag.RRef:
    return ag.RRef((w * w).sum())


async def test_confirmed_by_owner(group2):
    slow = ag.remote("worker1", slow_make, args=(0.3, 3))
    assert not slow.confirmed_by_owner()  # its creation has not answered yet
    await slow.to_here()
    assert slow.confirmed_by_owner()
    failed = ag.remote("worker1", failing_make)
    with contextlib.suppress(ag.RemoteError):
        await failed.to_here()
    assert not failed.confirmed_by_owner()
    assert ag.RRef(torch.ones(1)).confirmed_by_owner()  # the owner's own
    assert ag.remote("worker0", slow_make, args=(0.3, 3)).confirmed_by_owner()  # its own too


async def test_rref_backward_starts_a_distributed_backward_on_the_owner(group2):
    # the loss lives on worker1 (an RRef), computed from a tensor sent from here
    w = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as cid:
        loss = await ag.rpc_async("worker1", rref_of_loss, args=(w,))
        assert loss.owner_name() == "worker1"
        await loss.backward(cid)
        grads = ag.autograd.get_gradients(cid)
    assert torch.allclose(grads[w], 2 * w.detach())  # d/dw sum(w*w), as local autograd gives
    assert w.grad is None


def slow_loss(seconds: float, w: torch.Tensor) -> torch.Tensor:
    time.sleep(seconds)
    return (w * w).sum()


@pytest.mark.parametrize("owner", ["worker0", "worker1"])
async def test_rref_backward_waits_for_a_value_still_being_created(group2, owner):
    """As torch: backward right after remote() waits for the root to exist."""
    w = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as cid:
        loss = ag.remote(owner, slow_loss, args=(0.3, w))
        await asyncio.wait_for(loss.backward(cid), 10)
        grads = ag.autograd.get_gradients(cid)
    assert torch.allclose(grads[w], 2 * w.detach())


async def test_rref_backward_without_a_context_is_local_and_on_the_owner_only(group2):
    w = torch.rand(3, requires_grad=True)
    here = ag.RRef((w * 3).sum())
    await here.backward()
    assert torch.equal(w.grad, torch.full((3,), 3.0))
    there = ag.remote("worker1", torch.ones, args=(1,))
    with pytest.raises(RuntimeError, match="owner"):
        await there.backward()


async def test_rref_backward_of_a_value_that_is_no_tensor_says_so(group2):
    with pytest.raises(TypeError, match="backward\\(\\) needs a tensor as its value, not a str"):
        await ag.RRef("foo").backward()
    async with ag.autograd.context() as context_id:
        with pytest.raises(ag.RemoteError, match="needs a tensor as its value, not a str"):
            await ag.remote("worker1", str, args=("foo",)).backward(context_id)


# --------------------------------------------------------------------------------------
# the owner's table: fork news that come before the value's creation


class _StubWorker:
    rank = 1

    def add_lost_listener(self, listener: Any) -> None:
        self.on_lost = listener


def _created(table: Any, rref_id: Any, creator_fork: Any) -> None:
    """What the owner does when the remote() call creating the value comes: the entry,
    and the creator's fork."""
    loop = asyncio.get_running_loop()
    table.entry_for(rref_id, loop.create_future())
    table.add_fork(rref_id, creator_fork, 0)


async def test_fork_news_before_creation_count_when_it_comes():
    from actorgrad.rpc._rref import OwnerTable

    table = OwnerTable(_StubWorker())  # type: ignore[arg-type]
    rid, creator, forwarded = (0, 1), (0, 2), (0, 3)
    table.add_fork(rid, forwarded, 2)  # worker2 got a copy ... and released it, both early
    table.del_fork(rid, forwarded)
    _created(table, rid, creator)
    assert table.entries[rid].forks == {creator}
    table.del_fork(rid, creator)
    assert rid not in table.entries and not table._early


async def test_early_forks_of_a_lost_worker_are_dropped():
    from actorgrad.rpc._rref import OwnerTable

    worker = _StubWorker()
    table = OwnerTable(worker)  # type: ignore[arg-type]
    rid, creator, held_by_3 = (0, 1), (0, 2), (0, 3)
    table.add_fork(rid, held_by_3, 3)
    worker.on_lost("worker3", 3, "killed")  # worker3 can never release it now
    _created(table, rid, creator)
    table.del_fork(rid, creator)
    assert rid not in table.entries and not table._early


async def test_early_fork_news_are_bounded():
    from actorgrad.rpc._rref import _EARLY_MAX, OwnerTable

    table = OwnerTable(_StubWorker())  # type: ignore[arg-type]
    for i in range(_EARLY_MAX + 100):  # news of values that never come (their creation failed)
        table.del_fork((0, i % 7), (0, i))
    assert table._early_count == sum(map(len, table._early.values())) <= _EARLY_MAX



async def test_values_asked_for_early_that_will_not_come_fail():
    """A value asked for before its creation came waits; when a later creation of the
    same creator comes first (creations come in id order), or the creator is lost, it
    never will: the askers get an error and the table forgets it."""
    from actorgrad.rpc._rref import OwnerTable

    worker = _StubWorker()
    worker.name, worker.peers = "worker1", {0: object(), 2: object()}  # type: ignore[attr-defined]
    worker.loop = asyncio.get_running_loop()  # type: ignore[attr-defined]
    table = OwnerTable(worker)  # type: ignore[arg-type]
    skipped, waited, later = table.find((0, 5)), table.find((0, 7)), (0, 9)
    from_2 = table.find((2, 4))
    assert skipped is not None and waited is not None and from_2 is not None
    assert table.created((0, 7)) is waited  # 7 came: the creation of 5 never will
    with pytest.raises(RuntimeError, match="never came"):
        skipped.value.result()
    assert (0, 5) not in table.entries
    table.created(later)
    assert table.find((0, 8)) is None  # below what came: freed long ago, not awaited
    worker.on_lost("worker2", 2, "killed")
    with pytest.raises(ag.WorkerLost):
        from_2.value.result()
    assert (2, 4) not in table.entries and not table._awaited


def _refuse_to_unpickle() -> None:
    raise RuntimeError("cannot be rebuilt on the owner")


class Unloadable:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_refuse_to_unpickle, ())


def identity(x: Any) -> Any:
    return x


async def test_a_creation_the_owner_could_not_read_is_not_waited_for(group3):
    """The owner fails the remote() call before reading which value it creates: uses of
    the RRef fail at once (from any worker), and the owner keeps nothing for it."""
    rref = ag.remote("worker1", identity, args=(Unloadable(),))
    with pytest.raises(ag.RemoteError, match="cannot be rebuilt"):
        await asyncio.wait_for(rref._creation, 5)
    await asyncio.sleep(0.05)  # the owner hears that it was not created
    started = time.monotonic()
    with pytest.raises(ag.RemoteError):
        await rref.to_here(timeout=5)
    with pytest.raises(ag.RemoteError):
        await ag.rpc_async("worker2", fetch_and_sum, args=(rref,), timeout=5)
    assert time.monotonic() - started < 3

    def awaited_on_owner() -> int:
        from actorgrad.rpc._rref import owner_table
        from actorgrad.runtime import get_worker

        return len(owner_table(get_worker())._awaited)

    assert await ag.rpc_async("worker1", awaited_on_owner) == 0


async def test_the_release_of_an_rref_never_created_is_not_kept(group2):
    """Dropping the RRef of a remote() the owner could not read sends a release that
    finds no value there: it was kept for good, as news of a value still to come."""
    from actorgrad.rpc._rref import owner_table

    table = owner_table(group2.workers[1])
    for _ in range(5):
        rref = ag.remote("worker1", identity, args=(Unloadable(),))
        with pytest.raises(ag.RemoteError):
            await rref.to_here(timeout=5)
        del rref
    gc.collect()
    await ag.rpc_async("worker1", max, args=(1, 2))  # (the releases are there before it)
    assert table._early_count == 0 and not table._early


async def test_an_rref_does_not_outlive_its_group() -> None:
    """Ids start over in a new group: an RRef kept from the last one named another
    value there (a worker fetching it got the new group's value)."""
    from actorgrad.testing import start_in_process

    group = await start_in_process(2)
    stale = ag.RRef("from the first group")
    await group.shutdown()
    group = await start_in_process(2)
    try:
        fresh = ag.RRef("from the second group")
        assert fresh._id == stale._id  # the case that mattered
        with pytest.raises(RuntimeError, match="do not outlive their group"):
            await ag.rpc_async("worker1", str, args=(stale,))
        with pytest.raises(RuntimeError, match="do not outlive their group"):
            await stale.to_here()
        assert await ag.rpc_async("worker1", _fetch, args=(fresh,)) == "from the second group"
    finally:
        await group.shutdown()


async def _fetch(rref: ag.RRef[Any]) -> Any:
    return await rref.to_here()


# --------------------------------------------------------------------------------------
# pickling outside an RPC, and remote() arguments the owner cannot load


async def test_an_rref_pickled_outside_an_rpc_is_refused_and_copies_are_itself(group2):
    """The owner counts every copy an RPC sends; bytes from pickle or torch.save would
    copy it without telling it (and hold the value forever): refused, as torch does.
    copy and deepcopy give the same reference."""
    import copy
    import io
    import pickle

    remote_rref = ag.remote("worker1", make_tensor, args=(3,))
    await remote_rref.to_here()
    own = ag.RRef(torch.ones(2))
    base1, base0 = (await debug_info("worker1"))["num_owner_rrefs"], ag.rref_debug_info()["num_owner_rrefs"]
    for rref in (remote_rref, own):
        with pytest.raises(TypeError, match="only be pickled as part of an RPC"):
            pickle.dumps(rref)
        with pytest.raises(TypeError, match="only be pickled as part of an RPC"):
            torch.save({"r": rref}, io.BytesIO())
        assert copy.copy(rref) is rref and copy.deepcopy({"r": [rref]})["r"][0] is rref
    assert (await debug_info("worker1"))["num_forks"] == 1  # remote_rref's own, nothing else
    del remote_rref, own
    assert (await wait_owner_count("worker1", base1 - 1))["num_owner_rrefs"] == base1 - 1
    gc.collect()
    assert ag.rref_debug_info() == {"num_owner_rrefs": base0, "num_forks": 0}  # never shared


class LoadsNowhere:
    """Pickles fine, fails to load (like an object of a module the callee lacks)."""

    def __reduce__(self) -> Any:
        return (_fail_to_load, ())


def _fail_to_load() -> None:
    raise OSError("cannot be rebuilt here")


async def test_remote_whose_arguments_the_owner_cannot_load_says_why_on_every_use(group3):
    rref = ag.remote("worker1", make_tensor, args=(LoadsNowhere(),))
    with pytest.raises(ag.RemoteError, match="cannot be rebuilt here"):
        await rref._creation
    for use in (rref.to_here(), rref.rpc_async().sum(),
                ag.rpc_async("worker2", fetch_and_sum, args=(rref,))):
        with pytest.raises(ag.RemoteError) as info:
            await use
        assert "never created on worker1" in str(info.value) and "cannot be rebuilt here" in str(info.value)


@pytest.mark.parametrize("rref_first", [False, True], ids=["unloadable_first", "rref_first"])
async def test_an_rref_in_a_call_the_callee_cannot_load_is_released(group3, rref_first):
    """The sender registers the fork before the call leaves; a callee that fails to load
    the call before reaching the RRef never released it, and the owner kept the value
    for good. The callee's error names the forks it did rebuild; the sender takes back
    the others."""
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    rref = ag.remote("worker1", make_tensor, args=(3,))
    await rref.to_here()
    args = (rref, LoadsNowhere()) if rref_first else (LoadsNowhere(), rref)
    with pytest.raises(ag.RemoteError, match="cannot be rebuilt here"):
        await ag.rpc_async("worker2", takes_anything, args=args)
    with pytest.raises(ag.RemoteError, match="cannot be rebuilt here"):
        await ag.remote("worker2", takes_anything, args=args)._creation
    assert torch.equal(await rref.to_here(), torch.arange(3.0))  # still held by us
    del rref, args
    info = await wait_owner_count("worker1", base)
    assert (info["num_owner_rrefs"], info["num_forks"]) == (base, 0)


async def _keep_and_fail_further_on(rref: ag.RRef) -> None:
    KEPT["passed on"] = rref
    await ag.rpc_async("worker1", takes_anything, args=(LoadsNowhere(),))  # that one cannot be loaded


async def _fetch_kept() -> torch.Tensor:
    return await KEPT.pop("passed on").to_here()


async def test_a_load_failure_further_on_takes_back_nothing_of_this_call(group3):
    """worker2 loads our call (and keeps the RRef in it); a call of its own fails to
    load and its error comes back to us: our fork is worker2's, not to be taken back."""
    base = (await debug_info("worker1"))["num_owner_rrefs"]
    rref = ag.remote("worker1", make_tensor, args=(3,))
    await rref.to_here()
    with pytest.raises(ag.RemoteError, match="cannot be rebuilt here"):
        await ag.rpc_async("worker2", _keep_and_fail_further_on, args=(rref,))
    del rref
    gc.collect()
    await asyncio.sleep(0.2)
    assert torch.equal(await ag.rpc_async("worker2", _fetch_kept), torch.arange(3.0))
    info = await wait_owner_count("worker1", base)
    assert (info["num_owner_rrefs"], info["num_forks"]) == (base, 0)


async def test_a_proxy_call_that_comes_before_the_value_waits_without_a_thread(group2):
    """Proxy calls that reach the owner before the remote() creating the value (from a
    third worker, under load) each blocked a pool thread until the value existed: once
    they held every thread, the creating function never got one, and the worker's
    pool stayed wedged. Such a call now hands the loop something to await."""
    import inspect

    from actorgrad.rpc._rref import RRef, _call_method

    worker1 = group2.workers[1]
    value = asyncio.get_running_loop().create_future()  # (an in-process group: one loop)
    rref = RRef._make(worker1, 1, (1, 10**9), None, value)  # the owner's, still being created
    outcome = await asyncio.wait_for(worker1.run_blocking(lambda: _call_method(rref, "inc", (2,), {})), 5)
    assert inspect.isawaitable(outcome)
    value.set_result(Counter(1))
    assert await asyncio.wait_for(outcome, 5) == 3


async def test_an_rref_whose_owner_is_lost_fails_the_call_that_sends_it(make_process_group):
    """Sending it registers a fork with its owner, which cannot be done: rpc_async and
    remote() raised WorkerLost out of the call (a loop collecting futures stopped
    halfway); their futures fail instead, and a remote() to oneself fails its value."""
    group = await make_process_group(3)
    rref = ag.remote("worker2", torch.ones, args=(2,))
    assert torch.equal(await rref.to_here(), torch.ones(2))
    group.kill(2)
    deadline = time.monotonic() + 10
    while 2 in get_worker().peers:  # noqa: ASYNC110 - the loss is noticed when the connection drops
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    call = ag.rpc_async("worker1", type, args=(rref,))
    with pytest.raises(ag.WorkerLost, match="worker2"):
        await call
    for to in ("worker1", "worker0"):
        made = ag.remote(to, type, args=(rref,))
        with pytest.raises(ag.WorkerLost, match="worker2"):
            await asyncio.wait_for(made.to_here(), 10)
        del made  # (worker1 never heard of it: nothing to release there)
    gc.collect()

    def news_kept() -> int:  # runs on worker1
        from actorgrad.rpc._rref import owner_table
        from actorgrad.runtime import get_worker

        return owner_table(get_worker())._early_count

    assert await ag.rpc_async("worker1", news_kept) == 0
