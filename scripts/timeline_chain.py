#!/usr/bin/env python3
"""Where one iteration of the K-hop chain (or the seed example) spends its time, on
both workers.

Instruments a few points of each worker (socket writes, message dispatch, planning,
torch's engine; with ``--detail`` also pickling and the engine actor's steps between
them) with timestamps of the machine's monotonic clock, which both processes share,
runs the chain of ``bench_autograd.py`` (context; K round trips ``x*2+1`` on 256x256
float32 to worker1; sum; distributed backward; get_gradients) or, with ``--seed``, its
seed example (context; ``torch.add`` of two 3x3 tensors on worker1; mul; sum;
distributed backward; get_gradients), and prints the iteration as one timeline: for every event its median offset from the
start and the p10 / p50 / p90 of the gap since the event before. Iterations whose
events differ in order (a garbage collection, a heartbeat) are left out; how many is
printed. Then the writes by size, with how many took over 300 µs.

Wrapping costs ~1 µs per event, so the whole iteration reads ~10% slower than in
``bench_autograd.py``; the gaps between events are what this is for.

    python scripts/timeline_chain.py                # K = 1, 600 iterations
    python scripts/timeline_chain.py --k 4 --iters 300
    python scripts/timeline_chain.py --seed --detail
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_ns = time.monotonic_ns
EVENTS: list[tuple[int, str]] = []
WRITES: list[tuple[int, int]] = []  # (nanoseconds, bytes) of each socket write


def _mark(name: str) -> None:
    EVENTS.append((_ns(), name))


def _wrap(owner, attr: str, name: str, label=None) -> None:
    original = getattr(owner, attr)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        event = name if label is None else f"{name} {label(*args, **kwargs)}"
        EVENTS.append((_ns(), event + " >"))
        try:
            return original(*args, **kwargs)
        finally:
            EVENTS.append((_ns(), event + " <"))

    setattr(owner, attr, timed)


def _nbytes(pieces) -> int:
    return sum(memoryview(p).nbytes for p in pieces)


def install(detail: bool = False) -> None:
    """Instrument this process (the remote functions below do it on worker1)."""
    import actorgrad.autograd._engine as engine
    from actorgrad.runtime._transport import PeerProtocol
    from actorgrad.runtime._worker import Worker

    write = PeerProtocol._write

    def timed_write(self, pieces):
        nbytes = _nbytes(pieces)
        start = _ns()
        EVENTS.append((start, f"write {nbytes} >"))
        try:
            return write(self, pieces)
        finally:
            end = _ns()
            EVENTS.append((end, f"write {nbytes} <"))
            WRITES.append((end - start, nbytes))

    PeerProtocol._write = timed_write
    _wrap(Worker, "on_message", "handle", lambda self, peer, msg: f"{type(msg).__name__}({getattr(msg, 'target', '')})")
    _wrap(engine, "make_plan", "plan")
    _wrap(engine, "_run_backward", "torch engine")
    if detail:
        from actorgrad.wire import Payload

        for step in ("_serve", "plan_now", "_job", "_deliver", "_conclude", "_own_relays", "_message"):
            _wrap(engine.EngineActor, step, step)
        _wrap(Payload, "dump", "Payload.dump")
        _wrap(Payload, "load", "Payload.load")


async def remote_install(detail: bool) -> None:
    install(detail)


async def remote_take() -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    events, writes = EVENTS[:], WRITES[:]
    EVENTS.clear()
    WRITES.clear()
    return events, writes


def _mul2add1(x):
    return x * 2 + 1


def report(events: list[tuple[int, int, str]], writes: dict[int, list[tuple[int, int]]]) -> None:
    iterations: list[list[tuple[int, int, str]]] = []
    for event in events:
        if event[1] == 0 and event[2] == "iteration >":
            iterations.append([event])
        elif iterations:
            iterations[-1].append(event)
    shapes = collections.Counter(tuple((w, n) for _, w, n in it) for it in iterations)
    shape, count = shapes.most_common(1)[0]
    rows = [it for it in iterations if tuple((w, n) for _, w, n in it) == shape]
    print(f"{len(iterations)} iterations, {count} of the most common shape (the others left out)")
    print(f"{'at us':>8}  {'gap p10':>7} {'p50':>6} {'p90':>6}  event")
    for i, (worker, name) in enumerate(shape):
        at = statistics.median(r[i][0] - r[0][0] for r in rows) / 1e3
        gaps = sorted((r[i][0] - r[i - 1][0]) / 1e3 for r in rows) if i else [0.0]
        q = [gaps[int(p * (len(gaps) - 1))] for p in (0.1, 0.5, 0.9)]
        indent = "" if worker == 0 else " " * 30
        print(f"{at:8.1f}  {q[0]:7.1f} {q[1]:6.1f} {q[2]:6.1f}  {indent}worker{worker}: {name}")
    print("\nsocket writes: worker, bytes, count, p50 / p90 us, over 300 us")
    for worker, ws in writes.items():
        for nbytes in sorted({n for _, n in ws}):
            t = sorted(d / 1e3 for d, n in ws if n == nbytes)
            if len(t) >= 10:
                slow = sum(1 for d in t if d > 300)
                print(f"  worker{worker} {nbytes:>8} {len(t):>5} {t[len(t) // 2]:8.1f} / "
                      f"{t[len(t) * 9 // 10]:8.1f}  {slow}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=1, help="round trips per iteration")
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--seed", action="store_true", help="the seed example instead of the chain")
    parser.add_argument("--detail", action="store_true", help="also pickling and the engine's steps")
    args = parser.parse_args()

    import torch

    import actorgrad as ag
    from actorgrad.testing import local_group

    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    import timeline_chain as mod  # by reference, so worker1 instruments its own copy

    async def run() -> None:
        env = {"OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        group = await local_group(2, env=env)
        try:
            await ag.rpc_async("worker1", torch.set_num_threads, args=(1,))

            async def iteration() -> None:
                mod._mark("iteration >")
                async with ag.autograd.context() as cid:
                    if args.seed:
                        t1 = torch.rand((3, 3), requires_grad=True)
                        t2 = torch.rand((3, 3), requires_grad=True)
                        mod._mark("forward >")
                        t3 = await ag.rpc_async("worker1", torch.add, args=(t1, t2))
                        loss = torch.mul(t3, torch.rand((3, 3), requires_grad=True)).sum()
                    else:
                        x = torch.rand((256, 256), requires_grad=True)
                        y = x
                        mod._mark("forward >")
                        for _ in range(args.k):
                            y = await ag.rpc_async("worker1", mod._mul2add1, args=(y,))
                        loss = y.sum()
                    mod._mark("backward >")
                    await ag.autograd.backward(cid, [loss])
                    mod._mark("backward <")
                    ag.autograd.get_gradients(cid)
                mod._mark("iteration <")

            for _ in range(100):  # warm-up, and worker1 learns to run _mul2add1 inline
                await iteration()
            await ag.rpc_async("worker1", mod.remote_install, args=(args.detail,))
            mod.install(args.detail)
            mod.EVENTS.clear()
            for _ in range(args.iters):
                await iteration()
            mine, my_writes = mod.EVENTS[:], mod.WRITES[:]
            theirs, their_writes = await ag.rpc_async("worker1", mod.remote_take)
        finally:
            await group.shutdown()
        events = sorted([(t, 0, n) for t, n in mine] + [(t, 1, n) for t, n in theirs])
        report(events, {0: my_writes, 1: their_writes})

    ag.run(run())


if __name__ == "__main__":
    main()
