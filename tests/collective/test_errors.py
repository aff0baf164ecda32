"""Argument checks like torch.distributed; mismatches raise on every rank; dead ranks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from collective_helpers import run_all, run_all_settled, tune

import actorgrad as ag
import actorgrad.collective as C
from actorgrad import CollectiveError
from actorgrad.collective import ReduceOp
from actorgrad.testing import InProcessGroup
from actorgrad.wire import Goodbye
from actorgrad.wire._connection import _encode

cloudpickle.register_pickle_by_value(sys.modules[__name__])


async def test_argument_checks(make_group: object) -> None:
    group: InProcessGroup = await make_group(2)  # type: ignore[operator]
    t = torch.zeros(2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        await C.all_reduce([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReduceOp"):
        await C.all_reduce(t, op="sum")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AVG"):
        await C.all_reduce(torch.zeros(2, dtype=torch.int64), op=ReduceOp.AVG)
    with pytest.raises(TypeError, match="BXOR needs an integer or bool"):
        await C.all_reduce(t, op=ReduceOp.BXOR)
    with pytest.raises(ValueError, match="out of range"):
        await C.broadcast(t, src=5)
    with pytest.raises(TypeError, match="int"):
        await C.broadcast(t, src=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="own rank"):
        await C.send(t, dst=0)
    with pytest.raises(ValueError, match="tag"):
        await C.send(t, dst=1, tag=-1)
    with pytest.raises(ValueError, match=r"tag must be >= 0 and < 2\*\*31"):  # gloo's limit, on every backend
        C.isend(t, dst=1, tag=1 << 40)
    with pytest.raises(ValueError, match="one tensor per group member"):
        await C.all_gather([torch.zeros(2)], t)
    with pytest.raises(ValueError, match="must match"):
        await C.all_gather([torch.zeros(2), torch.zeros(3)], t)
    with pytest.raises(ValueError, match="must be None"):
        await C.gather(t, [t, t], dst=1)
    with pytest.raises(TypeError, match="scatter_list"):
        await C.scatter(t, None, src=0)
    with pytest.raises(ValueError, match="duplicate"):
        C.new_group([0, 0])
    with pytest.raises(ValueError, match="out of range"):
        C.new_group([0, 9])
    with pytest.raises(TypeError, match="new_group: ranks must be a list of global ranks, got 2"):
        C.new_group(2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown backend"):
        await C.init_process_group(backend="mpi")
    sub = C.new_group([0])
    with pytest.raises(ValueError, match="not a member"):
        await C.broadcast(t, src=1, group=sub)
    with pytest.raises(TypeError, match="Group"):
        await C.barrier(group=[0, 1])  # type: ignore[arg-type]
    assert len(group.workers) == 2


@pytest.mark.parametrize("kind", ["shape", "dtype", "op", "collective"])
@pytest.mark.parametrize("size", [3, 200_000], ids=["small", "large"])
async def test_mismatch_raises_on_every_rank(make_group: object, kind: str, size: int) -> None:
    group: InProcessGroup = await make_group(4)  # type: ignore[operator]

    async def body(rank: int) -> None:
        odd = rank == 2
        n = size + 1 if kind == "shape" and odd else size
        dtype = torch.float64 if kind == "dtype" and odd else torch.float32
        t = torch.ones(n, dtype=dtype)
        if kind == "op" and odd:
            await C.all_reduce(t, op=ReduceOp.MAX)
        elif kind == "collective" and odd:
            await C.broadcast(t, src=0)
        else:
            await C.all_reduce(t)

    start = time.monotonic()
    results = await run_all_settled(group, body, timeout=20)
    assert time.monotonic() - start < 10
    for r in results:
        assert isinstance(r, CollectiveError), r
        assert "rank 2" in str(r) or "rank 0" in str(r)


async def test_mismatched_broadcast_raises_on_every_rank(make_group: object) -> None:
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]

    async def body(rank: int) -> None:
        await C.broadcast(torch.zeros(5 if rank != 1 else 6), src=0)

    for r in await run_all_settled(group, body, timeout=20):
        assert isinstance(r, CollectiveError) and "shape=(6,)" in str(r)


async def test_recv_of_the_wrong_shape_raises_on_both_sides(make_group: object) -> None:
    group: InProcessGroup = await make_group(2)  # type: ignore[operator]

    async def body(rank: int) -> None:
        if rank == 0:
            await C.send(torch.zeros(100_000), dst=1)  # large: waits for the receiver
        else:
            await C.recv(torch.zeros(99_999), src=0)

    results = await run_all_settled(group, body)
    assert all(isinstance(r, CollectiveError) and "shape" in str(r) for r in results), results


async def test_a_rank_that_skipped_new_group_is_named_at_once(make_group: object) -> None:
    # (rank 2 made only the group it is in, so its ids ran one behind: the members of
    # [1, 2] waited their whole timeout and then asked 'did every member call it?')
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]

    async def body(rank: int) -> Any:
        if rank != 2:
            C.new_group([0, 1])
        pair = C.new_group([1, 2])
        if rank == 0:
            return None
        t = torch.ones(2)
        try:
            await C.all_reduce(t, group=pair)
        except CollectiveError as exc:
            return str(exc)
        return t.tolist()

    start = time.monotonic()
    results = await run_all(group, body, timeout=30)
    assert time.monotonic() - start < 10
    for rank in (1, 2):
        assert "the ranks number their groups apart" in results[rank], results[rank]
        assert "rank 2 sent a collective message for group 1" in results[rank], results[rank]

    async def world(rank: int) -> list[float]:  # numbered alike: it goes on working
        t = torch.full((2,), float(rank))
        await C.all_reduce(t)
        return t.tolist()

    assert await run_all(group, world) == [[3.0, 3.0]] * 3


async def test_a_rank_numbering_apart_heard_before_the_group_is_made_here(make_group: object) -> None:
    # rank 2 skipped new_group([0, 1]) and its message for its group 1 ([1, 2]) reaches
    # rank 1 before rank 1 made its group 1 ([0, 1]): that message was then fed to the
    # [0, 1] all-reduce, which ranks 0 and 1 number alike ('x not in tuple' on one, a
    # value on the other); and rank 2's second call waited for its timeout
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]

    async def body(rank: int) -> dict[str, Any]:
        if rank == 1:
            await asyncio.sleep(0.3)
        first = C.new_group([0, 1]) if rank != 2 else None
        pair = C.new_group([1, 2])
        out: dict[str, Any] = {}
        if rank in (0, 1):
            t = torch.full((2,), float(rank + 1))
            await C.all_reduce(t, group=first)
            out["first"] = t.tolist()
        if rank in (1, 2):
            for attempt in range(2):
                with pytest.raises(CollectiveError, match="number their groups apart"):
                    await C.all_reduce(torch.ones(2), group=pair)
                out[f"pair {attempt}"] = "refused"
        return out

    start = time.monotonic()
    results = await run_all(group, body, timeout=30)
    assert time.monotonic() - start < 10
    assert results[0]["first"] == results[1]["first"] == [3.0, 3.0]
    assert results[2] == {"pair 0": "refused", "pair 1": "refused"}


async def test_deadline(make_group: object) -> None:
    group: InProcessGroup = await make_group(2)  # type: ignore[operator]
    await run_all(group, _set_timeout)
    with pytest.raises(CollectiveError, match="timed out.*contributions of ranks \\[1\\]"):
        await C.all_reduce(torch.zeros(1))  # worker1 never joins
    with pytest.raises(CollectiveError, match="timed out"):
        await C.recv(torch.zeros(1), src=1)


async def _set_timeout(rank: int) -> None:
    await C.init_process_group(timeout=0.3)


@pytest.mark.parametrize("numel", [1, 3000, 300_000], ids=["arena", "direct", "ring"])
async def test_a_rank_that_timed_out_fails_the_late_rank_too(make_group: object, numel: int) -> None:
    """Rank 1 gives up on an all-reduce rank 0 comes to late: rank 0's call must fail too
    (it used to complete with rank 1's contribution, so one rank took a step the other
    did not). Nobody can tell a late rank from one that never called it, so the group's
    later collectives fail on both (see the next test); a group made anew works."""
    group: InProcessGroup = await make_group(2)  # type: ignore[operator]
    await run_all(group, _set_timeout)

    async def body(rank: int) -> tuple[str, str, float, float]:
        pair = C.new_group([0, 1])
        if rank == 0:
            await asyncio.sleep(0.8)  # past rank 1's deadline
        try:
            await C.all_reduce(torch.ones(numel), group=pair)
            outcome = "ok"
        except CollectiveError as exc:
            outcome = f"CollectiveError: {exc}"
        await asyncio.sleep(0.6 if rank == 1 else 0.0)  # both come to the next one in time
        try:
            await C.all_reduce(torch.ones(numel), group=pair)
            next_one = "ok"
        except CollectiveError as exc:
            next_one = str(exc)
        C.destroy_process_group(pair)
        again = C.new_group([0, 1])
        after = torch.full((numel,), float(rank + 1))
        await C.all_reduce(after, group=again)
        world = torch.full((numel,), float(rank + 1))
        await C.all_reduce(world)  # another group: unaffected
        return outcome, next_one, after[0].item(), world[0].item()

    results = await run_all(group, body, timeout=30)
    for outcome, next_one, after, world in results:
        assert outcome.startswith("CollectiveError") and "timed out" in outcome, results
        assert "is out of step since" in next_one, results
        assert after == 3.0 and world == 3.0, results


@pytest.mark.parametrize("numel", [1, 3000, 300_000], ids=["arena", "direct", "ring"])
async def test_a_collective_one_rank_called_alone_never_pairs_the_others_calls_apart(
        make_group: object, numel: int) -> None:
    # (rank 0 called one all-reduce the others did not; it timed out, the others' next
    # one failed with its error, and from then on rank 0's step k was reduced with the
    # others' step k + 1: wrong values on every rank, with matching signatures)
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]
    await run_all(group, _set_timeout)

    async def body(rank: int) -> list[str]:
        if rank == 0:
            with pytest.raises(CollectiveError, match="timed out"):
                await C.all_reduce(torch.ones(numel))
        else:
            await asyncio.sleep(0.6)
        return await _three_steps(rank, numel)

    results = await run_all(group, body, timeout=30)
    for rank, outcomes in enumerate(results):
        assert not any(o.startswith("value") for o in outcomes), (rank, outcomes)
        assert all("out of step" in o for o in outcomes[1:]), (rank, outcomes)


async def _three_steps(rank: int, numel: int, group: Any = None) -> list[str]:
    """Three all-reduces of values that tell the steps apart: each one's value or error."""
    outcomes = []
    for step in range(3):
        t = torch.full((numel,), float(10 * (step + 1) + rank))
        try:
            await C.all_reduce(t, group=group)
            outcomes.append(f"value {t[0].item()}")
        except CollectiveError as exc:
            outcomes.append(str(exc))
    return outcomes


@pytest.mark.parametrize("numel", [1, 3000], ids=["tiny", "direct"])
async def test_a_member_that_makes_the_group_after_it_went_out_of_step_hears_so(
        make_group: object, numel: int) -> None:
    # (the note came before rank 2 had made the group and was dropped: rank 2's small
    # all-reduces then completed with the data of calls that failed on the others, and
    # its larger ones waited their whole timeout, blaming ranks that had called; the
    # timeout named every member as absent where one was)
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]
    await run_all(group, _set_timeout)

    async def body(rank: int) -> list[str]:
        if rank == 2:
            await asyncio.sleep(0.8)  # past the others' deadline
        return await _three_steps(rank, numel, C.new_group([0, 1, 2]))

    start = time.monotonic()
    results = await run_all(group, body, timeout=30)
    assert time.monotonic() - start < 3, results
    for rank, outcomes in enumerate(results):
        assert not any(o.startswith("value") for o in outcomes), (rank, outcomes)
        assert all("is out of step since" in o for o in outcomes[1:]), (rank, outcomes)
        assert "before ranks [2] called it" in outcomes[1], (rank, outcomes)


async def test_a_group_out_of_step_whose_member_is_gone_says_it_is_gone(make_group: object) -> None:
    # (it said 'out of step: destroy the group and make a new one', which cannot work
    # without the member, instead of CollectiveRankLost)
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]
    await run_all(group, _set_timeout)

    async def body(rank: int) -> Any:
        trio = C.new_group([0, 1, 2])
        if rank == 2:
            await asyncio.sleep(0.6)  # the others time out without it
            await group.workers[2].shutdown(graceful=False)
            return None
        with pytest.raises(CollectiveError, match="timed out"):
            await C.all_reduce(torch.ones(3000), group=trio)
        await asyncio.sleep(0.6)
        with pytest.raises(ag.CollectiveRankLost, match="rank 2 of the group is gone"):
            await C.all_reduce(torch.ones(3000), group=trio)
        return "ok"

    assert (await run_all(group, body, timeout=30))[:2] == ["ok", "ok"]


async def test_small_all_reduces_of_a_group_go_on_when_a_worker_outside_it_is_lost(
        make_group: object) -> None:
    # (a lost worker anywhere stopped every small all-reduce over the connections from
    # sending: they timed out, blamed a live member, and left the group out of step)
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]
    await run_all(group, _set_timeout)

    async def body(rank: int) -> Any:
        pair = C.new_group([0, 1])
        if rank == 2:
            await group.workers[2].shutdown(graceful=False)
            return None
        await asyncio.sleep(0.5)  # rank 2 is known lost
        values = []
        for _ in range(3):  # the first two go over the connections (arena negotiation)
            t = torch.full((1,), float(rank + 1))
            await C.all_reduce(t, group=pair)
            values.append(t.item())
        return values

    assert (await run_all(group, body, timeout=30))[:2] == [[3.0] * 3] * 2


async def test_a_note_from_a_rank_numbering_apart_does_not_mark_a_group_it_is_not_in(
        make_group: object) -> None:
    # rank 0 skipped new_group([1, 2]): its group 1 is [0, 1]. Its all-reduce there timed
    # out before rank 1 made its group 1 ([1, 2]); the out-of-step note, kept for that
    # group number, then broke [1, 2], which ranks 1 and 2 number alike
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]
    await run_all(group, _set_timeout)

    async def body(rank: int) -> Any:
        if rank == 0:
            mine = C.new_group([0, 1])  # (rank 0's group 1; ranks 1 and 2 make [1, 2] first)
            with pytest.raises(CollectiveError):
                await C.all_reduce(torch.ones(1), group=mine)
            return None
        await asyncio.sleep(0.8)  # rank 0 timed out
        pair = C.new_group([1, 2])
        C.new_group([0, 1])
        values = []
        for _ in range(3):
            t = torch.full((1,), float(rank + 1))
            await C.all_reduce(t, group=pair)
            values.append(t.item())
        return values

    assert (await run_all(group, body, timeout=30))[1:] == [[5.0] * 3] * 2


async def test_a_local_failure_inside_a_collective_fails_the_others_at_once(
        make_group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # an unexpected error while rank 0 starts its part (a bug, a memory error, ...):
    # the others must not wait for rank 0 until their deadline
    from actorgrad.collective import _ops

    original = _ops.ChainBroadcast.start

    def start(self: Any) -> None:
        if self.rank == 0:
            raise MemoryError("no room for the chunk")
        original(self)

    monkeypatch.setattr(_ops.ChainBroadcast, "start", start)
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]

    async def body(rank: int) -> str:
        await C.init_process_group(timeout=30)
        with pytest.raises(CollectiveError) as info:
            await C.broadcast(torch.zeros(1 << 18), src=0)
        return str(info.value)

    start_time = asyncio.get_running_loop().time()
    messages = await run_all(group, body)
    assert asyncio.get_running_loop().time() - start_time < 10
    assert "no room for the chunk" in messages[0]
    for text in messages[1:]:
        assert "failed on rank 0" in text and "MemoryError: no room for the chunk" in text


async def test_group_still_works_after_a_failed_collective(make_group: object) -> None:
    group: InProcessGroup = await make_group(2)  # type: ignore[operator]

    async def body(rank: int) -> float:
        with pytest.raises(CollectiveError):
            await C.all_reduce(torch.zeros(2 + rank))
        t = torch.ones(1)
        await C.all_reduce(t)
        return t.item()

    assert await run_all(group, body) == [2.0, 2.0]


@pytest.mark.parametrize("case", ["scatter_list", "gather_list", "src", "tensor_list",
                                  "object_broadcast", "object_gather"])
async def test_arguments_refused_on_one_rank_fail_the_others_at_once(make_group: object, case: str) -> None:
    """Rank 1 alone passes a bad argument: it raises it, and the others raise
    CollectiveError naming it right away (not after the 60 s timeout); then the group's
    next collectives run on every rank, numbered alike."""
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]

    async def body(rank: int) -> tuple[str, list[float]]:
        bad = rank == 1
        t = torch.full((4,), float(rank))
        try:
            if case == "scatter_list":  # rank 1 is the source, with a list one too short
                parts = [torch.zeros(4) for _ in range(2 if bad else 3)]
                await C.scatter(t, parts if rank == 1 else None, src=1)
            elif case == "gather_list":  # a list on a rank other than the destination
                await C.gather(t, [torch.zeros(4) for _ in range(3)] if rank in (0, 1) else None, dst=0)
            elif case == "src":
                await C.broadcast(t, src=7 if bad else 0)
            elif case == "object_broadcast":  # rank 1 is the source, of an unpicklable object
                await C.broadcast_object_list([threading.Lock() if bad else None], src=1)
            elif case == "object_gather":
                await C.all_gather_object([None] * 3, threading.Lock() if bad else rank)
            else:
                await C.all_gather([torch.zeros(4 if not bad else 5) for _ in range(3)], t)
            outcome = "ok"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        after = torch.full((2,), float(rank))
        await C.all_reduce(after)
        everyone = [torch.zeros(1) for _ in range(3)]
        await C.all_gather(everyone, torch.tensor([float(rank)]))
        return outcome, [*after.tolist(), *(e.item() for e in everyone)]

    start = time.monotonic()
    results = await run_all(group, body, timeout=30)
    assert time.monotonic() - start < 10, "the others waited for the refusing rank"
    (bad_outcome, _), others = results[1], [results[0], results[2]]
    assert bad_outcome.startswith(("ValueError", "TypeError")), bad_outcome
    for outcome, _ in others:
        assert outcome.startswith("CollectiveError") and "rank 1" in outcome, outcome
        assert bad_outcome.split(": ", 1)[1] in outcome  # the reason, as rank 1 saw it
    for _, values in results:
        assert values == [3.0, 3.0, 0.0, 1.0, 2.0]


# -- a rank that dies ------------------------------------------------------------------------
async def _install() -> None:
    """Make sure a subprocess worker has its CollectiveActor (until ``actorgrad``
    imports ``actorgrad.collective`` itself, a plain worker process does not)."""
    from actorgrad.collective._actor import actor

    actor()


async def _join_all_reduce(numel: int, delay: float) -> str:
    """Run on a subprocess worker: one all_reduce, after ``delay`` seconds."""
    await asyncio.sleep(delay)
    t = torch.ones(numel)
    try:
        await C.all_reduce(t)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _goodbye_arrives(peer: Any, reason: str) -> None:
    """``peer``'s Goodbye comes in, as read from its connection (which stays open)."""
    frame = b"".join(_encode(Goodbye(reason=reason)))
    peer.get_buffer(len(frame))[:len(frame)] = frame
    peer.buffer_updated(len(frame))


@pytest.mark.parametrize("what", ["tiny all_reduce", "all_reduce", "broadcast", "send"])
async def test_a_rank_whose_goodbye_came_is_lost_to_every_send(make_group: object, what: str) -> None:
    """Between a rank's Goodbye and its connection closing, an operation that cannot
    send to it fails as the loss itself does: CollectiveRankLost (a WorkerLost) naming
    the rank and why it left, whichever path the message takes."""
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]
    peer = group.workers[0].peers[1]
    _goodbye_arrives(peer, "it stopped on an error: RuntimeError: boom")
    calls = {
        "tiny all_reduce": lambda: C.all_reduce(torch.ones(2)),
        "all_reduce": lambda: C.all_reduce(torch.ones(100_000)),
        "broadcast": lambda: C.broadcast(torch.ones(100_000), src=0),
        "send": lambda: C.send(torch.ones(2), dst=1),
    }
    with pytest.raises(ag.CollectiveRankLost, match=r"rank 1 \(worker1\) was lost: it stopped on an error"):
        await asyncio.wait_for(calls[what](), 10)


@pytest.mark.slow
@pytest.mark.parametrize("numel", [4, 1_000_000], ids=["direct", "ring"])
async def test_dead_rank_makes_the_others_raise(make_process_group: object, numel: int) -> None:
    group = await make_process_group(4)  # type: ignore[operator]
    await asyncio.gather(*(ag.rpc_async(f"worker{r}", _install) for r in (1, 2, 3)))
    # a warm-up all-reduce on all four, so the ring also uses CMA after the probes
    warm = [ag.rpc_async(f"worker{r}", _join_all_reduce, args=(numel, 0.0)) for r in (1, 2, 3)]
    t = torch.ones(numel)
    await C.all_reduce(t)
    assert await asyncio.gather(*warm) == ["ok"] * 3
    # worker3 joins late; it is killed before it does
    survivors = [ag.rpc_async(f"worker{r}", _join_all_reduce, args=(numel, 0.0)) for r in (1, 2)]
    late = ag.rpc_async("worker3", _join_all_reduce, args=(numel, 30.0))
    mine = asyncio.ensure_future(C.all_reduce(torch.ones(numel)))
    await asyncio.sleep(0.3)
    start = time.monotonic()
    group.kill(3)
    with pytest.raises(CollectiveError, match="rank 3"):
        await asyncio.wait_for(mine, 10)
    others = await asyncio.wait_for(asyncio.gather(*survivors), 10)
    assert time.monotonic() - start < 10
    assert all(o.startswith(("CollectiveError", "CollectiveRankLost")) and "rank 3" in o for o in others), others
    with pytest.raises(ag.ActorgradError):
        await late
    # the group with the dead rank fails fast from now on; a group without it works
    with pytest.raises(CollectiveError, match="gone"):
        await C.all_reduce(torch.ones(2))


@pytest.mark.slow
def test_every_collective_across_four_processes() -> None:
    """A real 4-process run (``actorgrad launch``): CMA between processes, both backends."""
    root = Path(__file__).parents[2]
    env = dict(os.environ)
    env.pop("ACTORGRAD_AUTH_KEY", None)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    script = Path(__file__).parent / "scripts" / "every_collective.py"
    proc = _launch([sys.executable, "-m", "actorgrad", "launch", "--nproc", "4", str(script)], env, root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every collective OK on both backends" in proc.stdout


def _launch(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the launcher in its own session; kill the whole session if it overruns."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=cwd, start_new_session=True) as popen:
        try:
            out, err = popen.communicate(timeout=120)
        finally:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
    return subprocess.CompletedProcess(cmd, popen.returncode, out, err)


async def test_tune_helper_reaches_every_worker(make_group: object) -> None:
    group: InProcessGroup = await make_group(2)  # type: ignore[operator]
    tune(group, ring_min_bytes=123)
    assert all(w.extensions["collective"].ring_min_bytes == 123 for w in group.workers)


@pytest.mark.parametrize("bad", ["tensor", "op"])
async def test_an_all_reduce_refused_on_one_rank_is_not_paired_with_its_next(
    make_group: object, bad: str
) -> None:
    """Once the group's first small all-reduces ran (the shared-memory arena settled),
    an all_reduce refused on rank 1 fails the others at once, and is not paired with
    rank 1's next all_reduce (which silently summed two different calls)."""
    group: InProcessGroup = await make_group(3)  # type: ignore[operator]

    async def body(rank: int) -> tuple[str, list[float]]:
        for _ in range(4):  # the arena's negotiation, and a few through it
            await C.all_reduce(torch.ones(2))
        try:
            if rank == 1:
                if bad == "tensor":
                    await C.all_reduce([1.0, 2.0])  # type: ignore[arg-type]
                else:
                    await C.all_reduce(torch.ones(2, dtype=torch.int64), op=ReduceOp.AVG)
            else:
                await C.all_reduce(torch.ones(2, dtype=torch.int64))
            outcome = "ok"
        except Exception as exc:
            outcome = type(exc).__name__
        after = torch.full((2,), float(rank))
        await C.all_reduce(after)
        return outcome, after.tolist()

    start = time.monotonic()
    results = await run_all(group, body, timeout=30)
    assert time.monotonic() - start < 10
    assert [outcome for outcome, _ in results] == ["CollectiveError", "TypeError", "CollectiveError"]
    assert all(values == [3.0, 3.0] for _, values in results)


async def test_group_rank_lookups_name_a_rank_that_is_no_int(make_group: object) -> None:
    await make_group(2)  # type: ignore[operator]
    group = C.new_group([0, 1])
    assert C.get_global_rank(group, 1) == 1 and C.get_group_rank(group, 1) == 1
    assert C.get_global_rank(group, np.int64(1)) == 1 and C.get_group_rank(group, torch.tensor(1)) == 1
    with pytest.raises(TypeError, match="group_rank must be an int rank, got str"):
        C.get_global_rank(group, "0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="global_rank must be an int rank, got NoneType"):
        C.get_group_rank(group, None)  # type: ignore[arg-type]
