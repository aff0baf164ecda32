"""The examples run end to end under ``actorgrad launch`` and do what they promise.

Each example is started as ``python -m actorgrad launch --nproc N examples/X.py`` with a
small ``--steps``; the test checks the exit status (the examples exit non-zero when the
loss did not fall) and the summary lines worker0 prints at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _launch(nproc: int, script: str, *args: str) -> str:
    env = dict(os.environ)
    env.pop("ACTORGRAD_AUTH_KEY", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    proc = subprocess.run(
        [sys.executable, "-m", "actorgrad", "launch", "--nproc", str(nproc), str(EXAMPLES / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{output[-6000:]}"
    return output


def _loss_drop(output: str, pattern: str) -> tuple[float, float]:
    match = re.search(pattern, output, re.MULTILINE)
    assert match, f"summary line {pattern!r} not found in:\n{output[-6000:]}"
    initial, final = float(match["initial"]), float(match["final"])
    assert final < 0.7 * initial, output[-6000:]
    return initial, final


def test_dist_autograd_simple() -> None:
    output = _launch(2, "dist_autograd_simple.py")
    assert re.search(
        r"^\[rank 0\] loss [\d.]+; gradients and SGD step on worker1 match local autograd$",
        output, re.MULTILINE,
    ), output[-6000:]


@pytest.mark.parametrize("nproc", [2, 3], ids=["1-trainer", "2-trainers"])
def test_parameter_server(nproc: int) -> None:
    output = _launch(nproc, "parameter_server.py", "--steps", "60")
    trainers = nproc - 1
    assert f"{trainers} trainer(s), 60 steps each" in output, output[-6000:]
    for t in range(1, trainers + 1):  # every trainer reported its progress to the end
        assert re.search(rf"^\[rank {t}\] trainer {t}/{trainers} \[#+\]\s+60/60  loss [\d.]+$",
                         output, re.MULTILINE), output[-6000:]
    _loss_drop(output, r"^\[rank 0\] loss (?P<initial>[\d.]+) -> (?P<final>[\d.]+); "
                       r"final accuracy (?P<acc>[\d.]+)$")
    acc = float(re.search(r"final accuracy ([\d.]+)", output)[1])  # type: ignore[index]
    assert acc > 0.5, output[-6000:]  # 4 classes: chance is 0.25


def test_pipeline_parallel() -> None:
    output = _launch(3, "pipeline_parallel.py", "--steps", "60")
    assert "stage 1 on worker1, stage 2 on worker2" in output, output[-6000:]
    assert re.search(r"^\[rank 0\] \[#+\]\s+60/60  loss [\d.]+$", output, re.MULTILINE), output[-6000:]
    _loss_drop(output, r"^\[rank 0\] loss (?P<initial>[\d.]+) -> (?P<final>[\d.]+)$")


def test_example_refuses_too_few_ranks() -> None:
    """A clear message instead of a hang when the example is started with too few ranks."""
    env = dict(os.environ)
    env.pop("ACTORGRAD_AUTH_KEY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "actorgrad", "launch", "--nproc", "2", str(EXAMPLES / "pipeline_parallel.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "needs 3 ranks" in proc.stdout + proc.stderr
