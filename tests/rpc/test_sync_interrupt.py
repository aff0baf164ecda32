"""Ctrl-C during a blocking call of a plain script whose main thread drives the loop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

SCRIPT = textwrap.dedent('''
    import asyncio, os, random, signal, sys, threading, time

    import torch

    import actorgrad as ag

    random.seed(int(sys.argv[1]))
    loop = asyncio.new_event_loop()
    group = loop.run_until_complete(ag.local_group(2))
    x = torch.ones(1_000_000)  # 4 MB each way: a read of it spans several callbacks


    def interrupt_soon(delay):
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGINT)


    for attempt in range(12):
        threading.Thread(target=interrupt_soon, args=(0.1 + random.random() * 0.3,), daemon=True).start()
        try:
            while True:
                ag.rpc_sync("worker1", torch.add, args=(x, 1))
        except KeyboardInterrupt:
            pass
        assert ag.rpc_sync("worker1", max, args=(attempt, -1), timeout=10) == attempt
        print("ok", attempt, flush=True)
    loop.run_until_complete(group.shutdown(timeout=15))
''')


@pytest.mark.parametrize("seed", [1, 2])
def test_interrupts_during_rpc_sync_leave_the_group_working(tmp_path: Path, seed: int) -> None:
    """A KeyboardInterrupt raised where it lands, inside a transport's callback, lost
    bytes already read off the socket: the connection broke and the group with it."""
    script = tmp_path / "interrupted.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 12, proc.stdout + proc.stderr
