"""The worker's thread pool: threads on demand, and a pool that is full is said so."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from actorgrad.runtime import _pool
from actorgrad.runtime._pool import ThreadPool


async def test_a_pool_whose_threads_all_stay_busy_says_so(monkeypatch, caplog):
    """Functions that block (waiting for each other, for a lock) fill every thread;
    the ones queued behind them wait, and their callers only see timeouts: the worker
    that knows why says it, naming the option to raise."""
    monkeypatch.setattr(_pool, "_SATURATED_SECONDS", 0.2)
    pool = ThreadPool(asyncio.get_running_loop(), 2, "test-pool")
    release = threading.Event()
    try:
        with caplog.at_level("WARNING", logger="actorgrad"):
            jobs = [pool.submit(lambda: release.wait(10), contextvars.copy_context()) for _ in range(3)]
            await asyncio.sleep(0.6)
            assert not any(j.done() for j in jobs)
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1, warnings  # once while it stays full
        assert "all 2 threads" in warnings[0] and "num_worker_threads" in warnings[0]
        assert "1 function(s) waiting" in warnings[0]
    finally:
        release.set()
    assert await asyncio.wait_for(asyncio.gather(*jobs), 10) == [True] * 3
    pool.close()


async def test_a_pool_busy_with_quick_jobs_stays_quiet(monkeypatch, caplog):
    monkeypatch.setattr(_pool, "_SATURATED_SECONDS", 0.2)
    pool = ThreadPool(asyncio.get_running_loop(), 1, "test-pool")
    with caplog.at_level("WARNING", logger="actorgrad"):
        for _ in range(30):  # always a few queued, but every one ends within ms
            await asyncio.gather(*(pool.submit(lambda: sum(range(1000)), contextvars.copy_context())
                                   for _ in range(5)))
            await asyncio.sleep(0.01)
    assert not caplog.records
    pool.close()


@pytest.mark.parametrize("threads", [16])
def test_the_default_pool_is_torchs_size(threads):
    import actorgrad as ag

    assert ag.RpcOptions().num_worker_threads == threads  # TensorPipe's default


async def test_jobs_run_torch_with_the_intra_op_threads_the_program_set():
    """A pool thread takes the program's torch.set_num_threads at its start (OpenMP
    keeps the count per thread: ops that went to OpenMP directly ran on every core), and
    a job that sets a count of its own has it for itself only, as each job starts as a
    fresh thread: it stayed for every later job on that thread."""
    import torch

    before = torch.get_num_threads()
    wanted = 3 if before != 3 else 2  # (not what a new thread starts with)
    other = 1

    def sets_its_own() -> int:
        torch.set_num_threads(other)
        return torch.get_num_threads()

    pool = ThreadPool(asyncio.get_running_loop(), 1, "test-pool")
    try:
        torch.set_num_threads(wanted)
        assert await pool.submit(torch.get_num_threads, contextvars.copy_context()) == wanted
        assert await pool.submit(sets_its_own, contextvars.copy_context()) == other
        assert await pool.submit(torch.get_num_threads, contextvars.copy_context()) == wanted
    finally:
        torch.set_num_threads(before)
        pool.close()
