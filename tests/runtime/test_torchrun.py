"""env:// under torchrun, whose agent already hosts a store on MASTER_PORT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actorgrad.testing import free_port

ROOT = Path(__file__).parents[2]

SCRIPT = textwrap.dedent('''
    import os

    import torch

    import actorgrad as ag


    async def main():
        await ag.init_rpc(f"worker{os.environ['RANK']}")  # env://, as torch's rpc examples
        other = (ag.get_rank() + 1) % ag.get_world_size()
        total = await ag.rpc_async(other, torch.add, args=(torch.ones(2), ag.get_rank()))
        print(f"rank {ag.get_rank()} of {ag.get_world_size()} got {total.tolist()}", flush=True)
        await ag.shutdown()


    ag.run(main())
''')


@pytest.mark.slow
def test_env_init_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "under_torchrun.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("ACTORGRAD_AUTH_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out
    assert "rank 0 of 2 got [1.0, 1.0]" in out and "rank 1 of 2 got [2.0, 2.0]" in out, out
