#!/usr/bin/env python3
"""actorgrad's distributed autograd vs torch.distributed.autograd, side by side.

One run measures both implementations with the same loops (torch: the shared baseline
driver ``/work/shared/bench/torch_dist_autograd_bench.py``, run as it is, TensorPipe
default shm+cma and, as ``torch_tpuv``, plain TCP):

a. the seed example per iteration: context + forward RPC ``torch.add`` (3x3) + mul +
   sum + distributed backward + ``get_gradients``; median and p99, the forward /
   backward / get_gradients split, and the same forward without autograd;
b. a chain of K = 1, 4, 16 round trips ``x*2+1`` on 256x256 float32 from worker0 to
   worker1, sum, distributed backward, ``get_gradients``; the same hops without
   autograd (no context, no grad); and the nested chain (worker1 -> worker0 -> ...);
c. a parameter-server step: ``nn.Linear(1024, 1024)`` owned by worker1 through an RRef,
   forward by RPC with x[32, 1024], ``loss = out.square().mean()``, distributed
   backward, ``DistributedOptimizer(SGD, lr=0.01).step``; plus the local compute floor
   (the same math in one process);
d. empty autograd contexts per second.

actorgrad runs through ``actorgrad.testing.local_group(2)``: the measuring process is
worker0, worker1 a subprocess. Every process uses ``torch.set_num_threads(1)``.

Output (stdout): one JSON object per line ``{"metric", "value", "unit", "impl", ...}``
(metric names as in the torch driver), ratio lines ``impl="actorgrad/torch"`` with the
targets, then a table. Diagnostics go to stderr. Times are medians over iterations; the
machine has 2 cores and may be shared, so every phase also reports the CPU other
processes used while it ran (``foreign_cores``): compare runs taken on a quiet machine.

    python scripts/bench_autograd.py              # ~2.5 min
    python scripts/bench_autograd.py --quick      # short loops, < 60 s
    python scripts/bench_autograd.py --skip-torch # actorgrad only
    python scripts/bench_autograd.py --no-torch-tcp --no-table
    python scripts/bench_autograd.py --repeat 3   # medians of 3 interleaved runs (noisy box)

Each phase runs in its own child process (own session) under a wall-clock limit and a
watchdog; on timeout the phase's process group and the worker processes it reported
are killed by PID. Nothing outlives the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from _benchlib import emit, pct, proc_cpu_s, start_watchdog

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_BENCH = "/work/shared/bench/torch_dist_autograd_bench.py"
KS = (1, 4, 16)
TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = v
    return (user + nice + system + irq + softirq) / TCK


# remote functions: module level, so both workers import them by reference (worker1
# gets this directory on PYTHONPATH)
def _setup_child():
    import torch

    torch.set_num_threads(1)
    return os.getpid()


def _mul2add1(x):
    return x * 2 + 1


async def _nested_chain(x, k, me):
    """Runs on ``me``: x*2+1, then forwards to the other worker; k hops in all."""
    import actorgrad as ag

    y = x * 2 + 1
    if k <= 1:
        return y
    other = "worker0" if me == "worker1" else "worker1"
    return await ag.rpc_async(other, _nested_chain, args=(y, k - 1, other))


def _make_linear():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(1024, 1024)


def _param_rrefs(module_rref):
    import actorgrad as ag

    return [ag.RRef(p) for p in module_rref.local_value().parameters()]


def _forward(module_rref, x):
    return module_rref.local_value()(x)


# ---------------------------------------------------------------------------------------
# actorgrad phase
# ---------------------------------------------------------------------------------------
def role_actorgrad(cfg) -> None:
    import torch

    import actorgrad as ag
    from actorgrad.testing import local_group

    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    import bench_autograd as mod  # the functions must pickle by reference, not by value

    async def main():
        env = {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        group = await local_group(2, env=env)
        with open(cfg["pidfile"], "a") as f:  # noqa: ASYNC230 - a few bytes, once
            f.write("".join(f"{p}\n" for p in group.pids))
        try:
            await bench_actorgrad(cfg, ag, mod, torch)
        finally:
            await group.shutdown()

    ag.run(main())


async def atimeit_pair(fn, n, warm):
    """fn("fast") and fn("smart") alternately, warm times each, then n times each;
    the two lists of per-call seconds."""
    pc = time.perf_counter_ns
    for _ in range(warm):
        await fn("fast")
        await fn("smart")
    times = {"fast": [], "smart": []}
    for i in range(2 * n):
        mode = ("fast", "smart")[i % 2]
        t0 = pc()
        await fn(mode)
        times[mode].append((pc() - t0) / 1e9)
    return times["fast"], times["smart"]


async def atimeit(fn, n, warm):
    """Await fn() warm times, then n times; the list of per-call seconds."""
    pc = time.perf_counter_ns
    for _ in range(warm):
        await fn()
    ts = []
    for _ in range(n):
        t0 = pc()
        await fn()
        ts.append((pc() - t0) / 1e9)
    return ts


async def bench_actorgrad(cfg, ag, mod, torch) -> None:
    impl = "actorgrad"
    q = cfg["quick"]
    w1 = "worker1"
    pc = time.perf_counter_ns
    pids = (os.getpid(), await ag.rpc_async(w1, mod._setup_child))
    autograd = ag.autograd

    # ---- a. seed example ----------------------------------------------------------
    n_a = 100 if q else 500
    torch.manual_seed(0)

    async def seed_iter():
        async with autograd.context() as cid:
            t1 = torch.rand((3, 3), requires_grad=True)
            t2 = torch.rand((3, 3), requires_grad=True)
            t3 = await ag.rpc_async(w1, torch.add, args=(t1, t2))
            t4 = torch.rand((3, 3), requires_grad=True)
            loss = torch.mul(t3, t4).sum()
            await autograd.backward(cid, [loss])
            grads = autograd.get_gradients(cid)
            assert len(grads) == 3

    await atimeit(seed_iter, 0, 50)
    c0 = sum(proc_cpu_s(p) for p in pids)
    ts = await atimeit(seed_iter, n_a, 0)
    cpu = sum(proc_cpu_s(p) for p in pids) - c0
    how = "context + rpc_async(torch.add) + mul + sum + dist backward + get_gradients, 3x3"
    emit(impl, "dist_autograd_seed_iter_median_ms", pct(ts, 50) * 1e3, "ms", n=n_a, how=how)
    emit(impl, "dist_autograd_seed_iter_p99_ms", pct(ts, 99) * 1e3, "ms", n=n_a, how=how)
    emit(impl, "dist_autograd_seed_cpu_ms_per_iter", cpu / n_a * 1e3, "ms", n=n_a,
         how="utime+stime of both processes over the loop / iterations")

    fw, bw, gg = [], [], []
    for i in range(n_a + 20):
        async with autograd.context() as cid:
            t1 = torch.rand((3, 3), requires_grad=True)
            t2 = torch.rand((3, 3), requires_grad=True)
            a0 = pc()
            t3 = await ag.rpc_async(w1, torch.add, args=(t1, t2))
            a1 = pc()
            t4 = torch.rand((3, 3), requires_grad=True)
            loss = torch.mul(t3, t4).sum()
            b0 = pc()
            await autograd.backward(cid, [loss])
            b1 = pc()
            autograd.get_gradients(cid)
            b2 = pc()
        if i >= 20:
            fw.append((a1 - a0) / 1e9)
            bw.append((b1 - b0) / 1e9)
            gg.append((b2 - b1) / 1e9)
    emit(impl, "dist_autograd_seed_forward_rpc_median_ms", pct(fw, 50) * 1e3, "ms", n=n_a)
    emit(impl, "dist_autograd_seed_backward_median_ms", pct(bw, 50) * 1e3, "ms", n=n_a)
    emit(impl, "dist_autograd_seed_get_gradients_median_ms", pct(gg, 50) * 1e3, "ms", n=n_a)

    async def seed_noautograd():
        t1 = torch.rand((3, 3))
        t2 = torch.rand((3, 3))
        t3 = await ag.rpc_async(w1, torch.add, args=(t1, t2))
        (t3 * torch.rand((3, 3))).sum()

    ts = await atimeit(seed_noautograd, n_a, 50)
    emit(impl, "seed_noautograd_iter_median_ms", pct(ts, 50) * 1e3, "ms", n=n_a,
         how="same forward without requires_grad / context / backward")

    # ---- b. chain of K hops -------------------------------------------------------
    torch.manual_seed(0)
    for K in KS:
        n_b = {1: 200, 4: 100, 16: 40}[K]
        if q:
            n_b = max(8, n_b // 5)

        async def chain_iter(K=K):
            async with autograd.context() as cid:
                x = torch.rand((256, 256), requires_grad=True)
                y = x
                for _ in range(K):
                    y = await ag.rpc_async(w1, mod._mul2add1, args=(y,))
                await autograd.backward(cid, [y.sum()])
                g = autograd.get_gradients(cid)[x]
                assert g.shape == x.shape

        ts = await atimeit(chain_iter, n_b, 5)
        emit(impl, f"dist_autograd_chain_k{K}_ms", pct(ts, 50) * 1e3, "ms", n=n_b, K=K,
             how=f"ctx; {K} sequential rpc_async(worker1, x*2+1) on 256x256 f32; sum; dist backward; get_gradients")

        async def chain_plain(K=K):
            y = torch.rand((256, 256))
            for _ in range(K):
                y = await ag.rpc_async(w1, mod._mul2add1, args=(y,))
            y.sum()

        ts = await atimeit(chain_plain, n_b, 5)
        emit(impl, f"chain_noautograd_k{K}_ms", pct(ts, 50) * 1e3, "ms", n=n_b, K=K,
             how=f"same {K} hops, no autograd/context/backward")

        async def chain_nested(K=K):
            async with autograd.context() as cid:
                x = torch.rand((256, 256), requires_grad=True)
                y = await ag.rpc_async(w1, mod._nested_chain, args=(x, K, w1))
                await autograd.backward(cid, [y.sum()])
                g = autograd.get_gradients(cid)[x]
                assert g.shape == x.shape

        ts = await atimeit(chain_nested, n_b, 5)
        emit(impl, f"dist_autograd_chain_nested_k{K}_ms", pct(ts, 50) * 1e3, "ms", n=n_b, K=K,
             how=f"ctx; worker0->worker1->worker0->... nested async calls, {K} hops of x*2+1")

    # ---- c. parameter-server step -------------------------------------------------
    n_c = 30 if q else 200
    mod_rref = ag.remote(w1, mod._make_linear)
    param_rrefs = await ag.rpc_async(w1, mod._param_rrefs, args=(mod_rref,))
    opt = ag.optim.DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.01)
    torch.manual_seed(1)
    x = torch.randn(32, 1024)

    async def ps_iter():
        async with autograd.context() as cid:
            out = await ag.rpc_async(w1, mod._forward, args=(mod_rref, x))
            loss = out.square().mean()
            await autograd.backward(cid, [loss])
            await opt.step(cid)

    ts = await atimeit(ps_iter, n_c, 10)
    how = ("ctx; out=rpc_async(worker1, rref.local_value()(x)) Linear(1024,1024) x[32,1024]; "
           "loss=out.square().mean(); dist backward; DistributedOptimizer(SGD).step")
    emit(impl, "dist_ps_linear1024_iter_median_ms", pct(ts, 50) * 1e3, "ms", n=n_c, how=how)
    emit(impl, "dist_ps_linear1024_iter_p99_ms", pct(ts, 99) * 1e3, "ms", n=n_c, how=how)

    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 1024)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.01)

    async def local_iter():
        sgd.zero_grad(set_to_none=True)
        lin(x).square().mean().backward()
        sgd.step()

    ts = await atimeit(local_iter, n_c, 10)
    emit(impl, "local_linear1024_sgd_iter_median_ms", pct(ts, 50) * 1e3, "ms", n=n_c,
         how="same Linear+loss+backward+SGD.step in one process, no RPC (compute floor)")

    # ---- e. SMART mode beside FAST on the same workloads (every RPC is used) -------
    # The two modes alternate iteration by iteration, so the machine's drift between
    # phases does not land on one of them; the ratio compares these paired timings.
    async def seed_mode(mode):
        async with autograd.context() as cid:
            t1 = torch.rand((3, 3), requires_grad=True)
            t2 = torch.rand((3, 3), requires_grad=True)
            t3 = await ag.rpc_async(w1, torch.add, args=(t1, t2))
            loss = torch.mul(t3, torch.rand((3, 3), requires_grad=True)).sum()
            await autograd.backward(cid, [loss], mode=mode)

    def emit_pair(name, fast, smart, n, **extra):
        emit(impl, f"smart_{name}", pct(smart, 50) * 1e3, "ms", n=n, **extra,
             how="backward(mode='smart'), interleaved with FAST")
        emit(impl, f"paired_fast_{name}", pct(fast, 50) * 1e3, "ms", n=n, **extra,
             how="backward(mode='fast'), interleaved with SMART")

    emit_pair("seed_iter_median_ms", *await atimeit_pair(seed_mode, n_a, 50), n=n_a)
    for K in KS:
        n_e = max(8, {1: 200, 4: 100, 16: 40}[K] // (5 if q else 1))

        async def chain_mode(mode, K=K):
            async with autograd.context() as cid:
                y = torch.rand((256, 256), requires_grad=True)
                for _ in range(K):
                    y = await ag.rpc_async(w1, mod._mul2add1, args=(y,))
                await autograd.backward(cid, [y.sum()], mode=mode)

        emit_pair(f"chain_k{K}_ms", *await atimeit_pair(chain_mode, n_e, 5), n=n_e, K=K)

    async def ps_mode(mode):
        async with autograd.context() as cid:
            out = await ag.rpc_async(w1, mod._forward, args=(mod_rref, x))
            await autograd.backward(cid, [out.square().mean()], mode=mode)
            await opt.step(cid)

    emit_pair("ps_linear1024_iter_median_ms", *await atimeit_pair(ps_mode, n_c, 10), n=n_c)

    # ---- d. empty contexts --------------------------------------------------------
    n_d = 2000 if q else 20000
    for _ in range(500):
        async with autograd.context():
            pass
    t0 = pc()
    for _ in range(n_d):
        async with autograd.context():
            pass
    dt = (pc() - t0) / 1e9
    emit(impl, "dist_autograd_empty_context_per_s", n_d / dt, "contexts/s", n=n_d,
         how="`async with ag.autograd.context(): pass` in a loop")
    emit(impl, "dist_autograd_empty_context_us", dt / n_d * 1e6, "us", n=n_d)


# ---------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------
def run_phase(name, cmd, timeout, pidfile=None):
    """Run one phase in a child process (own session); returns its JSON rows."""
    t0 = time.monotonic()
    busy0, ours0 = machine_busy_s(), _children_cpu()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        # kill whatever is left: the phase's process group, then the workers it reported
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if rc is None:
            out, _ = proc.communicate()
        if pidfile is not None:
            try:
                with open(pidfile) as f:
                    for line in f:
                        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                            os.kill(int(line), signal.SIGKILL)
                os.unlink(pidfile)
            except OSError:
                pass
    wall = time.monotonic() - t0
    foreign = max(0.0, (machine_busy_s() - busy0) - (_children_cpu() - ours0)) / wall
    rows = []
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    print(f"[bench_autograd] {name}: rc={rc} in {wall:.1f}s, other processes used "
          f"{foreign:.2f} cores meanwhile", file=sys.stderr, flush=True)
    rows.append({"metric": "phase_foreign_cores", "value": round(foreign, 3), "unit": "cores",
                 "impl": name, "how": "CPU used by other processes of the machine while the phase ran"})
    if rc != 0:
        rows.append({"metric": f"bench_{name}_error", "value": None, "unit": "", "impl": name,
                     "error": "timeout" if rc is None else f"exit status {rc}"})
    return rows


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def merge_runs(runs):
    """One row per (impl, metric): the median value over the runs (all rows if one run)."""
    if len(runs) == 1:
        return runs[0]
    merged, values = {}, {}
    for rows in runs:
        for r in rows:
            key = (r["impl"], r["metric"])
            merged.setdefault(key, dict(r))
            if r.get("value") is not None:
                values.setdefault(key, []).append(r["value"])
    out = []
    for key, row in merged.items():
        vals = values.get(key)
        if vals:
            row["value"] = round(pct(vals, 50), 4)
            row["runs"] = len(vals)
            row["spread"] = [min(vals), max(vals)]
        out.append(row)
    return out


def actorgrad_phase(args, timeout):
    fd, pidfile = tempfile.mkstemp(prefix="bench_autograd_", suffix=".pids")
    os.close(fd)
    cmd = [sys.executable, __file__, "--role", "actorgrad", "--pidfile", pidfile, "--timeout", str(timeout)]
    if args.quick:
        cmd.append("--quick")
    return run_phase("actorgrad", cmd, timeout, pidfile)


def torch_phase(args, timeout, tcp):
    """The shared baseline driver as it is; its rows get ``impl`` torch / torch_tpuv."""
    name = "torch_tpuv" if tcp else "torch"
    if not os.path.exists(args.torch_bench):
        print(f"[bench_autograd] {args.torch_bench} not found: no torch rows", file=sys.stderr)
        return [{"metric": f"bench_{name}_error", "value": None, "unit": "", "impl": name,
                 "error": f"{args.torch_bench} not found"}]
    cmd = [sys.executable, args.torch_bench, "--timeout", str(max(10, timeout - 10))]
    if args.quick:
        cmd.append("--quick")
    if tcp:
        cmd.append("--tcp")
    rows = run_phase(name, cmd, timeout)
    for r in rows:
        r["impl"] = name
        if tcp and r["metric"].endswith("_tpuv"):
            r["metric"] = r["metric"][: -len("_tpuv")]
        r.pop("script", None)
        r.pop("variant", None)
    return rows


# metric, label, better, target ratio ours/torch (None: none)
METRICS = [
    ("dist_autograd_seed_iter_median_ms", "seed iteration median (ms)", "low", 0.35),
    ("dist_autograd_seed_iter_p99_ms", "seed iteration p99 (ms)", "low", None),
    ("dist_autograd_seed_forward_rpc_median_ms", "  seed forward RPC (ms)", "low", None),
    ("dist_autograd_seed_backward_median_ms", "  seed backward (ms)", "low", None),
    ("dist_autograd_seed_get_gradients_median_ms", "  seed get_gradients (ms)", "low", None),
    ("seed_noautograd_iter_median_ms", "seed forward, no autograd (ms)", "low", None),
    *[(f"dist_autograd_chain_k{k}_ms", f"chain K={k} (ms)", "low", 0.7) for k in KS],
    *[(f"chain_noautograd_k{k}_ms", f"chain K={k}, no autograd (ms)", "low", None) for k in KS],
    *[(f"dist_autograd_chain_nested_k{k}_ms", f"nested chain K={k} (ms)", "low", None) for k in KS],
    ("dist_ps_linear1024_iter_median_ms", "PS step Linear(1024) median (ms)", "low", 0.8),
    ("dist_ps_linear1024_iter_p99_ms", "PS step Linear(1024) p99 (ms)", "low", None),
    ("local_linear1024_sgd_iter_median_ms", "local compute floor (ms)", "low", None),
    ("dist_autograd_empty_context_per_s", "empty contexts per second", "high", None),
]
REFS = ("torch", "torch_tpuv")


def derived(vals):
    """Rows computed from one run: ratios to torch, autograd overhead, linearity in K."""
    rows = []
    for ref in REFS:
        for metric, _label, better, target in METRICS:
            a, b = vals.get(("actorgrad", metric)), vals.get((ref, metric))
            if a is None or b is None or b == 0:
                continue
            ratio = a / b
            row = {"metric": f"ratio_{metric}", "value": round(ratio, 4), "unit": "x",
                   "impl": f"actorgrad/{ref}"}
            if target is not None:
                row["target"] = ("<= " if better == "low" else ">= ") + str(target)
                row["met"] = ratio <= target if better == "low" else ratio >= target
            rows.append(row)
    for name, fast in (("seed_iter_median_ms", "dist_autograd_seed_iter_median_ms"),
                       *((f"chain_k{k}_ms", f"dist_autograd_chain_k{k}_ms") for k in KS),
                       ("ps_linear1024_iter_median_ms", "dist_ps_linear1024_iter_median_ms")):
        s, f = vals.get(("actorgrad", f"smart_{name}")), vals.get(("actorgrad", f"paired_fast_{name}"))
        if s is not None and f:
            rows.append({"metric": f"smart_over_fast_{fast}", "value": round(s / f, 4), "unit": "x",
                         "impl": "actorgrad", "how": "SMART / FAST time, every RPC used",
                         "target": "<= 1.2", "met": s / f <= 1.2})
    for impl in ("actorgrad", *REFS):
        chain = [vals.get((impl, f"dist_autograd_chain_k{k}_ms")) for k in KS]
        plain = [vals.get((impl, f"chain_noautograd_k{k}_ms")) for k in KS]
        for k, c, p in zip(KS, chain, plain, strict=True):
            if c is not None and p:
                row = {"metric": f"autograd_overhead_k{k}", "value": round(c / p, 4), "unit": "x",
                       "impl": impl, "how": "chain with autograd / the same hops without"}
                if impl == "actorgrad":
                    row["target"], row["met"] = "<= 1.3", c / p <= 1.3
                rows.append(row)
        if None not in chain:
            k1, k4, k16 = chain
            early, late = (k4 - k1) / 3, (k16 - k4) / 12  # ms per hop
            rows.append({"metric": "chain_ms_per_hop", "value": round((k16 - k1) / 15, 4), "unit": "ms",
                         "impl": impl, "how": "(k16 - k1) / 15"})
            if early > 0 and late > 0:
                spread = max(early, late) / min(early, late)
                row = {"metric": "chain_per_hop_spread", "value": round(spread, 4), "unit": "x",
                       "impl": impl, "how": "max/min of the per-hop cost over K 1->4 and 4->16; 1 = linear"}
                if impl == "actorgrad":
                    row["target"], row["met"] = "<= 1.5 (linear in K)", spread <= 1.5
                rows.append(row)
    return rows


def report(rows, show_table=True):
    vals = {}
    for r in rows:
        if r.get("value") is not None:
            vals[(r["impl"], r["metric"])] = r["value"]
    extra = derived(vals)
    for r in extra:
        print(json.dumps(r), flush=True)
    if not show_table:
        return
    got = {(r["impl"], r["metric"]): r for r in extra}
    impls = [i for i in ("actorgrad", *REFS) if any(k[0] == i for k in vals)]
    refs = [r for r in REFS if r in impls]
    head = f"{'metric':34s}" + "".join(f"{i:>12s}" for i in impls)
    head += "".join(f"{'ours/' + r:>17s}" for r in refs) + "   target"
    print()
    print(head)
    print("-" * len(head))
    for metric, label, better, target in METRICS:
        line = f"{label:34s}"
        for i in impls:
            v = vals.get((i, metric))
            line += f"{'-' if v is None else f'{v:.4g}':>12s}"
        for ref in refs:
            r = got.get((f"actorgrad/{ref}", f"ratio_{metric}"))
            cell = "-" if r is None else f"{r['value']:.3g}x" + ("" if r.get("met") is None else (" ok" if r["met"] else " NO"))
            line += f"{cell:>17s}"
        if target is not None:
            line += f"   {'<=' if better == 'low' else '>='} {target}x torch"
        print(line)
    print()
    for metric, label, target in (
        *[(f"autograd_overhead_k{k}", f"autograd / no autograd, K={k}", "<= 1.3x") for k in KS],
        ("chain_ms_per_hop", "chain cost per hop (ms)", None),
        ("chain_per_hop_spread", "per-hop cost spread (1 = linear)", "<= 1.5x"),
    ):
        line = f"{label:34s}"
        for i in impls:
            r = got.get((i, metric))
            cell = "-" if r is None else f"{r['value']:.3g}"
            line += f"{cell:>12s}"
        ours = got.get(("actorgrad", metric))
        if target is not None and ours is not None and "met" in ours:
            line += f"{'':{17 * len(refs)}s}   ours {target} {'ok' if ours['met'] else 'NO'}"
        print(line)
    smart_rows = [r for r in extra if r["metric"].startswith("smart_over_fast_")]
    if smart_rows:
        print()
        for r in smart_rows:
            name = r["metric"].removeprefix("smart_over_fast_")
            print(f"{'SMART / FAST ' + name:60s}{r['value']:>8.3g}x   <= 1.2x {'ok' if r['met'] else 'NO'}")
    foreign = [f"{i} {vals[(i, 'phase_foreign_cores')]:.2f}" for i in impls if (i, "phase_foreign_cores") in vals]
    if foreign:
        print(f"\nCPU used by other processes during each phase (cores; noise if > ~0.25): {', '.join(foreign)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short loops (< 60 s in all)")
    ap.add_argument("--skip-torch", action="store_true", help="do not run torch.distributed.autograd")
    ap.add_argument("--no-torch-tcp", action="store_true", help="skip TensorPipe's --tcp (uv) variant")
    ap.add_argument("--torch-bench", default=TORCH_BENCH, help=f"the torch driver (default {TORCH_BENCH})")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every phase N times, interleaved; report the median of the runs")
    ap.add_argument("--no-table", action="store_true", help="JSON lines only")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per phase")
    # internal
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pidfile", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role == "actorgrad":
        start_watchdog("bench_autograd", (args.timeout or 120) - 2)
        role_actorgrad({"quick": args.quick, "pidfile": args.pidfile})
        return

    import platform

    phases = ["actorgrad"] + ([] if args.skip_torch else ["torch"] + ([] if args.no_torch_tcp else ["torch_tpuv"]))
    print(f"[bench_autograd] python {platform.python_version()} cpus={os.cpu_count()} phases={phases} "
          f"quick={args.quick} loadavg={os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    runs = []
    for _ in range(max(1, args.repeat)):  # interleaved, so that noise hits every phase alike
        rows = []
        for phase in phases:
            if phase == "actorgrad":
                rows += actorgrad_phase(args, args.timeout or (45 if args.quick else 200))
            else:
                rows += torch_phase(args, args.timeout or (30 if args.quick else 120),
                                    tcp=phase == "torch_tpuv")
        runs.append(rows)
    rows = merge_runs(runs)
    for r in rows:
        print(json.dumps(r), flush=True)
    report(rows, show_table=not args.no_table)
    print(f"[bench_autograd] total {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
