"""Fault matrix: SIGKILL a worker at each stage and report what the survivors saw.

    python scripts/reliability_report.py [--stages "forward RPC,all-reduce"]

For every stage a fresh group of three starts (worker0 here, worker1 the victim,
worker2 a survivor). The table gives the error the survivor got, the seconds from the
kill to that error, whether the survivors were left with no contexts or running
backward passes, and how long their graceful shutdown took. Exit status 1 if any stage
misses (error other than WorkerLost/RpcTimeout/RemoteError/CollectiveError, more than
10 s, leftovers, or a shutdown over 15 s).
"""

from __future__ import annotations

import argparse
import sys

import torch

import actorgrad as ag
from actorgrad.testing._faults import STAGES, Outcome, run_stage


async def main(stages: list[str]) -> int:
    torch.set_num_threads(1)
    outcomes: list[Outcome] = []
    for stage in stages:
        outcomes.append(await run_stage(stage))
        o = outcomes[-1]
        print(f"  {stage}: {o.error} after {o.seconds:.2f}s", file=sys.stderr, flush=True)
    print()
    print("| stage | survivor saw | s to error | survivors clean | shutdown s | ok |")
    print("|---|---|---:|---|---:|---|")
    for o in outcomes:
        print(f"| {o.stage} | {o.error} | {o.seconds:.2f} | {'yes' if o.survivors_clean else 'NO'} "
              f"| {o.shutdown_seconds:.2f} | {'yes' if o.ok else 'NO'} |")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {list(STAGES)}")
    sys.exit(ag.run(main(chosen)))
