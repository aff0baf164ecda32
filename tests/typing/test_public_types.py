"""The public API as a type checker sees it: mypy on a typed user program."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
USER_CODE = Path(__file__).with_name("typed_user_code.py")


@pytest.mark.timeout(600)
def test_a_typed_user_program_checks_clean(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy type-checks the user program")
    # MYPYPATH: an editable install is found by an import hook mypy does not follow
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-warn-unused-ignores",
         "--config-file", os.devnull, "--cache-dir", str(tmp_path / "cache"), str(USER_CODE)],
        capture_output=True, text=True, timeout=540, cwd=tmp_path, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
