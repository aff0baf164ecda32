#!/usr/bin/env python
"""Differential fuzz of the distributed backward: random programs over three worker
processes, every leaf gradient compared with torch's local autograd.

The programs are those of ``tests/autograd/_random_programs.py`` (lent gradients,
relays, stops, delegated answers, nested, concurrent and ``remote`` calls,
``retain_graph``, two roots; even seeds FAST mode, odd SMART; every seventh seed runs
at once with a partner of the other mode). Checked after every program: the gradients
match, nothing hung (``--limit`` seconds a program), and no worker holds a context, a
running backward or an unreturned gradient loan. With ``--faults`` one call of every
program fails, in its forward or in its backward: the error must reach the caller and
nothing may be left behind. A hang or a broken group starts a new group. Prints
progress and one summary line; exits 1 on any failure, naming the seed:

    python scripts/fuzz_autograd.py --seconds 600 --seed 0
    python scripts/fuzz_autograd.py --seconds 600 --faults
    python scripts/fuzz_autograd.py --one 1234          # one program, its problems
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = os.path.join(os.path.dirname(HERE), "tests", "autograd")
sys.path.insert(0, PROGRAMS)

import _random_programs as rp  # noqa: E402  (the workers import it by name too)

import actorgrad as ag  # noqa: E402
from actorgrad.testing import local_group  # noqa: E402

PARTNER = 10_000_000  # a concurrent program's seed: its partner's plus this


async def _group():  # type: ignore[no-untyped-def]
    path = os.pathsep.join(p for p in (PROGRAMS, os.environ.get("PYTHONPATH", "")) if p)
    return await local_group(3, env={"PYTHONPATH": path, "OMP_NUM_THREADS": "1"})


async def _outcome(seed: int, mode: str, faults: bool = False) -> tuple[str, list[str], dict[str, int]]:
    """(what happened, problems, generated shapes) of one program."""
    program = rp.make_program(seed, mode)
    if faults:
        outcome, wrong = await rp.run_with_fault(program, rp.fault_of(seed))
        return f"{outcome} ({rp.fault_of(seed)} fault)", wrong, program.shapes
    try:
        return "checked", await rp.check(program), program.shapes
    except rp.NoGradient:
        return "skipped", [], program.shapes


async def fuzz(seconds: float, first: int, limit: float, faults: bool) -> int:
    counts: collections.Counter[str] = collections.Counter()
    shapes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    group = await _group()
    end = time.monotonic() + seconds
    seed = first
    try:
        while time.monotonic() < end:
            seeds = [(seed, rp.mode_of(seed))]
            if seed % 7 == 0:
                seeds.append((seed + PARTNER, rp.mode_of(seed + 1)))
            try:
                outcomes = await asyncio.wait_for(
                    asyncio.gather(*(_outcome(s, m, faults) for s, m in seeds)), limit)
                for (s, m), (kind, problems, made) in zip(seeds, outcomes, strict=True):
                    counts[f"{kind} {m}"] += 1
                    shapes.update(made)
                    if problems:
                        failures.append(f"seed {s} ({m}): {problems}")
                left = await rp.wait_clean()
                if any(any(v) for v in left.values()):
                    failures.append(f"seed {seed}: left over (loans, contexts, backwards) {left}")
            except Exception as exc:  # a hang (TimeoutError), an error, a broken group
                failures.append(f"seed {seed}: {type(exc).__name__}: {str(exc)[:500]}")
                await asyncio.wait_for(group.shutdown(graceful=False, timeout=5.0), 30)
                group = await _group()
            if failures and failures[-1].startswith(f"seed {seed}"):
                print("FAIL", failures[-1], flush=True)
            seed += 1
            if seed % 100 == 0:
                print(f"seed {seed}: {dict(counts)}, {len(failures)} failures", flush=True)
        lent = [await ag.rpc_async(w, rp.loans_made) for w in rp.WORKERS]
    finally:
        await group.shutdown()
    print(f"seeds {first}..{seed - 1}: {dict(counts)}; generated {dict(shapes)}; gradients lent "
          f"{lent}; {len(failures)} failures")
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


async def one(seed: int) -> int:
    group = await _group()
    try:
        kind, problems, made = await _outcome(seed, rp.mode_of(seed))
        print(f"seed {seed} ({rp.mode_of(seed)}): {kind}, generated {made}, problems {problems}, "
              f"left over {await rp.wait_clean()}")
    finally:
        await group.shutdown()
    return 1 if problems else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--limit", type=float, default=30.0, help="seconds a program may take")
    parser.add_argument("--faults", action="store_true", help="one call of every program fails")
    parser.add_argument("--one", type=int, default=None, help="run this seed alone")
    args = parser.parse_args()
    sys.exit(ag.run(one(args.one) if args.one is not None else fuzz(args.seconds, args.seed, args.limit, args.faults)))


if __name__ == "__main__":
    main()
