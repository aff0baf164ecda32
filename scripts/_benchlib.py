"""Helpers shared by the benchmark scripts (``bench_rpc.py``, ``bench_autograd.py``).

Percentiles, JSON-line output, per-process CPU time from /proc and a wall-clock
watchdog, kept in one place so the scripts measure and report the same way. The
scripts import this module by its bare name: ``scripts/`` is ``sys.path[0]`` when they
run, and their child and worker processes get it on ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

TCK = os.sysconf("SC_CLK_TCK")


def pct(vals, q):
    v = sorted(vals)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def emit(impl, metric, value, unit, **extra):
    d = {"metric": metric, "value": None if value is None else round(float(value), 4),
         "unit": unit, "impl": impl}
    d.update(extra)
    print(json.dumps(d), flush=True)


def proc_cpu_s(pid: int) -> float:
    """utime+stime of a process (all threads), seconds, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TCK


def start_watchdog(tag: str, seconds: float, children=()):
    """Kill our own children (by PID) and exit if this process runs too long.

    ``tag`` prefixes the message on stderr (the script's name, e.g. ``"bench_rpc"``).
    """
    import threading

    def fire():
        print(f"[{tag}] watchdog: {seconds:.0f}s passed, exiting", file=sys.stderr, flush=True)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer
