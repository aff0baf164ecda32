"""Random programs over three workers: every leaf gradient as local autograd gives it.

The programs (``_random_programs``) mix what the engine treats specially: lent
gradients, relays, stops, delegated answers, nested and concurrent calls, ``remote``,
``retain_graph``, two roots, FAST and SMART mode. After each one no worker holds a
context, a running backward or an unreturned loan. ``scripts/fuzz_autograd.py`` runs
the same programs by the thousand.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

import torch
from _random_programs import (
    WORKERS,
    NoGradient,
    check,
    compare,
    fault_of,
    loans_made,
    make_program,
    mode_of,
    run_distributed,
    run_local,
    run_with_fault,
    usable,
    wait_clean,
)

import actorgrad as ag

CLEAN = dict.fromkeys(WORKERS, (0, 0, 0))


async def test_random_programs_match_local_autograd(group3):
    checked, shapes = 0, collections.Counter[str]()
    for seed in range(300):
        program = make_program(seed, mode_of(seed))
        try:
            problems = await asyncio.wait_for(check(program), 30)
        except NoGradient:  # (a few: no gradient to compare, or one too large for a fair oracle)
            continue
        assert not problems, f"seed {seed} ({program.mode}): {problems}"
        assert await wait_clean() == CLEAN, f"left over after seed {seed}"
        checked += 1
        shapes.update(program.shapes)
    assert checked >= 250
    # the programs took the paths they are for
    assert min(shapes[k] for k in (
        "relay", "stop", "nested", "remote", "parallel", "unused", "returned_args", "packed", "custom")) > 0
    assert all([await ag.rpc_async(w, loans_made) for w in WORKERS])


async def test_concurrent_random_programs_stay_apart(group3):
    """Two programs at once, one FAST and one SMART, in contexts of their own."""
    pairs = 0
    for seed in range(1000, 1100):
        programs = [make_program(seed, "fast"), make_program(seed + 1, "smart")]
        try:
            oracles = [await run_local(p) for p in programs]
        except NoGradient:
            continue
        if not all(usable(want) for want, _ in oracles):
            continue
        got = await asyncio.wait_for(asyncio.gather(*(run_distributed(p) for p in programs)), 30)
        problems = [compare(p, g, want, largest) for p, g, (want, largest) in zip(programs, got, oracles, strict=True)]
        assert problems == [[], []], f"seeds {seed}, {seed + 1}: {problems}"
        assert await wait_clean() == CLEAN
        pairs += 1
    assert pairs >= 70


async def test_the_comparison_sees_a_changed_input(group3):
    """The oracle is not blind: leaves nudged by 1e-3 between the two runs."""
    compared = caught = 0
    for seed in range(200, 216):
        program = make_program(seed, mode_of(seed))
        try:
            want, largest = await run_local(program)
        except NoGradient:
            continue
        if not usable(want):
            continue
        with torch.no_grad():
            for leaf in program.leaves:
                leaf.add_(1e-3)
        compared += 1
        caught += bool(compare(program, await run_distributed(program), want, largest))
    assert compared >= 8 and caught >= compared - 2


async def test_random_programs_that_fail_leave_nothing_behind(group3):
    """A call fails in its forward or in its backward, anywhere in the program: the
    caller gets the error, every worker lets go of the context, and the next program
    runs as if nothing happened."""
    failed = 0
    for seed in range(2000, 2080):
        outcome, wrong = await asyncio.wait_for(run_with_fault(make_program(seed, mode_of(seed)), fault_of(seed)), 30)
        if outcome in ("no call", "skipped"):
            continue
        assert not wrong, f"seed {seed} ({fault_of(seed)}): {wrong}"
        failed += outcome == "failed"
        assert await wait_clean() == CLEAN, f"left over after seed {seed} ({fault_of(seed)})"
        with contextlib.suppress(NoGradient):
            assert await check(make_program(seed, mode_of(seed))) == [], f"seed {seed} after the failure"
    assert failed >= 40
