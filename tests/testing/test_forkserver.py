"""local_group's fork server: workers forked from a process that imported torch once
behave as workers started as new interpreters would."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys

import numpy as np
import pytest
import torch

import actorgrad as ag
from actorgrad.testing import _forkserver, local_group

pytestmark = pytest.mark.skipif(not _forkserver.supported(dict(os.environ)), reason="the fork server is off here")


def describe_process() -> dict[str, object]:
    return {
        "env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv[1:], "pid": os.getpid(),
        "ppid": os.getppid(), "session": os.getsid(0), "random": random.random(),
        "numpy": np.random.random(), "torch": torch.rand(2).tolist(), "stdin": os.read(0, 1),
    }


async def test_forked_workers_get_this_processs_environment_and_their_own_state() -> None:
    group = await local_group(3)
    try:
        server = _forkserver._server
        assert server is not None
        seen = [await ag.rpc_async(f"worker{rank}", describe_process) for rank in (1, 2)]
    finally:
        await group.shutdown()
    assert [p.returncode for p in group.processes] == [0, 0]
    for rank, worker in enumerate(seen, start=1):
        assert worker["ppid"] == server.process.pid  # forked, not started anew
        # the environment local_group gives it (this test's name, say: not the name of
        # the test running when the server started), this directory, the arguments
        assert worker["env"] == {**os.environ, "PYTHONUNBUFFERED": "1"}
        assert worker["cwd"] == os.getcwd()
        assert worker["argv"][:2] == [str(rank), "3"] and worker["argv"][3] == str(os.getpid())
        assert worker["session"] == worker["pid"]  # its own session: killpg reaches it
        assert worker["stdin"] == b""  # /dev/null, not the server's request pipe
    # the random states the server had are not shared (torch seeds itself at random
    # when imported: each new interpreter draws other numbers)
    for generator in ("random", "numpy", "torch"):
        assert seen[0][generator] != seen[1][generator], generator


async def test_the_next_group_comes_from_the_same_server_and_exits_are_reported() -> None:
    first = await local_group(2)
    server = _forkserver._server
    await first.shutdown()
    second = await local_group(2)
    try:
        assert _forkserver._server is server
        assert await ag.rpc_async("worker1", os.getppid) == server.process.pid  # type: ignore[union-attr]
        second.kill(1)
        assert second.processes[0].wait(10) == -signal.SIGKILL
    finally:
        await second.shutdown(graceful=False)
    assert first.processes[0].returncode == 0


async def test_a_worker_with_the_pid_of_an_earlier_one_is_not_taken_for_it() -> None:
    """Pids wrap around (at 32768 here): a new worker may get the pid of one that
    exited, whose exit status must not be taken for the new worker's."""
    first = await local_group(2)
    pid = first.pids[0]
    await first.shutdown()
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # noqa: ASYNC230 - the next pid: this one
            f.write(str(pid - 1))
    except OSError:
        pytest.skip("cannot choose the next pid here (needs root)")
    second = await local_group(2)
    try:
        if second.pids[0] != pid:
            pytest.skip("another process took the pid first")
        assert second.processes[0].returncode is None
        assert await ag.rpc_async("worker1", os.getpid) == pid
    finally:
        await second.shutdown()
    assert first.processes[0].returncode == second.processes[0].returncode == 0


async def test_a_server_killed_between_groups_is_replaced() -> None:
    await (await local_group(2)).shutdown()
    old = _forkserver._server
    assert old is not None
    os.kill(old.process.pid, signal.SIGKILL)  # its reader has not seen it end yet
    group = await local_group(2)
    try:
        assert _forkserver._server is not old
        assert await ag.rpc_async("worker1", max, args=(1, 2)) == 2
    finally:
        await group.shutdown()


async def test_a_fork_after_the_server_died_forgets_it_in_the_child() -> None:
    # (the reader closes the server's stdout once it ended; the child's at-fork handler
    # then stopped at that closed pipe with a ValueError and kept the parent's servers)
    await (await local_group(2)).shutdown()
    server = _forkserver._server
    assert server is not None
    os.killpg(server.process.pid, signal.SIGKILL)
    with server.changed:
        assert server.changed.wait_for(lambda: server.ended, timeout=10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports and leaves at once
        os.close(read)
        os.write(write, b"1" if _forkserver._server is None and not _forkserver._retired else b"0")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)  # noqa: ASYNC222 - the child leaves at once
    with os.fdopen(read, "rb") as answer:
        assert answer.read() == b"1"


async def test_a_group_under_another_environment_gets_a_server_of_its_own() -> None:
    # a variable read at import time would not reach a worker forked from a server
    # that imported under another environment
    await (await local_group(2)).shutdown()
    old = _forkserver._server
    assert old is not None
    group = await local_group(2, env={"ACTORGRAD_FORK_SERVER_TEST": "marked"})
    try:
        new = _forkserver._server
        assert new is not old and new is not None
        env, ppid = await ag.rpc_async("worker1", lambda: (dict(os.environ), os.getppid()))
        assert env["ACTORGRAD_FORK_SERVER_TEST"] == "marked" and ppid == new.process.pid
        assert old.process.wait(10) == 0  # replaced, and no workers left: it ended
    finally:
        await group.shutdown()


def write_later(path: str) -> None:
    """Work a worker leaves running in a thread of its own and in an executor's."""
    import concurrent.futures
    import threading
    import time

    def job(tag: str) -> None:
        time.sleep(0.5)
        with open(path, "a") as f:
            f.write(tag + "\n")

    threading.Thread(target=job, args=("thread",)).start()
    concurrent.futures.ThreadPoolExecutor(1).submit(job, "executor")


async def test_a_worker_ends_its_threads_work_before_it_exits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # as an interpreter's exit joins non-daemon threads and runs the executors' exit
    # hooks (a checkpoint saved in a thread must not be cut off)
    group = await local_group(2)
    try:
        await ag.rpc_async("worker1", write_later, args=(str(tmp_path / "out"),))
    finally:
        await group.shutdown()
    assert group.processes[0].returncode == 0
    assert sorted((tmp_path / "out").read_text().split()) == ["executor", "thread"]


def test_the_server_ends_with_a_program_that_forked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A process forked from the program (multiprocessing's fork) held the server's
    stdin open: the server outlived the program killed."""
    import subprocess
    import textwrap
    import time
    from pathlib import Path

    script = tmp_path / "forks.py"
    script.write_text(textwrap.dedent('''
        import multiprocessing, os, time
        import actorgrad as ag
        from actorgrad.testing import _forkserver, local_group

        async def main():
            await (await local_group(2)).shutdown()
            helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
            helper.start()
            print(_forkserver._server.process.pid, helper.pid, flush=True)
            os.kill(os.getpid(), 9)  # (its exit handlers would end the server)

        ag.run(main())
    '''))
    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "pids"
    with open(out, "w") as stdout:  # (not a pipe: the helper would hold it open)
        subprocess.run([sys.executable, str(script)], env=env, stdout=stdout, timeout=60)
    server, helper = map(int, out.read_text().split())
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(server):
            time.sleep(0.05)
        assert not _alive(server), "the server outlived its program"
    finally:
        for pid in (server, helper):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
