"""local_group's fork server: workers forked from a process that imported torch once
behave as workers started as new interpreters would."""

from __future__ import annotations

import os
import random
import signal
import sys

import numpy as np
import pytest

import actorgrad as ag
from actorgrad.testing import _forkserver, local_group

pytestmark = pytest.mark.skipif(not _forkserver.supported(), reason="the fork server needs Linux")


def describe_process() -> dict[str, object]:
    return {
        "env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv[1:], "pid": os.getpid(),
        "ppid": os.getppid(), "session": os.getsid(0), "random": random.random(),
        "numpy": np.random.random(), "stdin": os.read(0, 1),
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
    # the random states the server had are not shared
    assert seen[0]["random"] != seen[1]["random"]
    assert seen[0]["numpy"] != seen[1]["numpy"]


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
