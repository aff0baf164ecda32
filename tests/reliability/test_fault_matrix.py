"""SIGKILL a worker at each stage: survivors get an error within 10 s, hold no leftover
contexts or backward passes, and shut down."""

from __future__ import annotations

import pytest

from actorgrad.testing._faults import STAGES, SURVIVOR_ERRORS, run_stage

try:
    import actorgrad.collective  # noqa: F401
    HAVE_COLLECTIVES = True
except ImportError:
    HAVE_COLLECTIVES = False


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
async def test_kill_at_stage(stage: str) -> None:
    if stage == "all-reduce" and not HAVE_COLLECTIVES:
        pytest.skip("collectives are not built yet")
    outcome = await run_stage(stage)
    assert outcome.error in SURVIVOR_ERRORS, outcome
    assert outcome.seconds < 10, outcome
    assert outcome.survivors_clean, outcome
    assert outcome.shutdown_seconds < 15, outcome
