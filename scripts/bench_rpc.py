#!/usr/bin/env python3
"""actorgrad vs torch.distributed.rpc (TensorPipe) vs raw sockets, on this machine.

One run measures, for each implementation, with the same loops:

* small-RPC round trip p50/p99: ``noop(torch.ones(1))`` (a Python function that returns
  None), 2000 sequential calls after warm-up (actorgrad: ``await rpc_async``, torch:
  ``rpc_sync``), plus the CPU both processes burn per call;
* rpc_async throughput: 1000 calls in flight, then wait for all; median of rounds;
* tensor echo bandwidth (the callee returns its argument): 1, 16, 64 MiB float32,
  GB/s = 2 * size / median round trip (GB = 1e9 bytes);
* CPU burnt by an idle 2-worker group (cores, /proc/<pid>/stat of both processes);
* raw blocking-socket echo between two processes as the ceiling: 64 MiB echo and a
  16-byte round trip (TCP_NODELAY).

Every process uses ``torch.set_num_threads(1)``. The torch side is a copy of the
driver in ``/work/shared/bench/torch_rpc_bench.py`` (TensorPipe defaults: shm
transport + cma channel, ``num_worker_threads=16``); ``--tcp`` variants (uv + basic,
plain TCP like actorgrad) are reported with ``impl=torch_tpuv``.

Output (stdout): one JSON object per line ``{"metric", "value", "unit", "impl", ...}``,
ratio lines with ``impl="actorgrad/torch"``, then a table. Diagnostics go to stderr.

    python scripts/bench_rpc.py              # ~1.5 min
    python scripts/bench_rpc.py --quick      # short loops, < 40 s
    python scripts/bench_rpc.py --skip-torch # actorgrad and raw sockets only
    python scripts/bench_rpc.py --only actorgrad,raw --no-table
    python scripts/bench_rpc.py --repeat 3   # medians of 3 interleaved runs (noisy machine)

This machine may be shared: each phase also reports ``_foreign_cores``, the CPU other
processes used meanwhile; above ~0.25 cores the numbers are contaminated.

Each phase runs in its own child process (own session) under a wall-clock limit; on
timeout the phase's whole process group and the worker processes it reported are
killed by PID. Nothing outlives the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from _benchlib import emit, pct, proc_cpu_s, start_watchdog

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
ECHO_SIZES = [("1MiB", 1 * MiB, 100), ("16MiB", 16 * MiB, 20), ("64MiB", 64 * MiB, 10)]


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def free_port() -> int:
    """A free port for a rendezvous, outside the kernel's ephemeral range (a port
    found by binding 0 may go to a worker's own listener first; see actorgrad._ports)."""
    from actorgrad._ports import pick_rendezvous_port

    return pick_rendezvous_port()


def cpu_of(pids):
    return [proc_cpu_s(p) for p in pids]


def system_busy_s() -> float:
    """CPU seconds all processes of the machine spent so far (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def note_pids(pidfile: str, pids) -> None:
    """Record worker processes for the orchestrator, which kills them if a phase hangs."""
    with open(pidfile, "a") as f:
        f.write("".join(f"{p}\n" for p in pids))


# remote functions: module level, so both workers import them by reference (the
# actorgrad worker gets this directory on PYTHONPATH; torch's spawn children run this
# file as __mp_main__)
def _noop(x):
    return None


def _echo(x):
    return x


def _getpid():
    return os.getpid()


def _setup_child():
    import torch

    torch.set_num_threads(1)
    return os.getpid()


# ---------------------------------------------------------------------------------------
# actorgrad phase
# ---------------------------------------------------------------------------------------
def role_actorgrad(cfg) -> None:
    import torch

    import actorgrad as ag
    from actorgrad.testing import local_group

    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    import bench_rpc as mod  # the functions must pickle by reference, not by value

    impl = "actorgrad"
    q = cfg["quick"]
    pc = time.perf_counter_ns

    async def main():
        env = {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        group = await local_group(2, env=env)
        note_pids(cfg["pidfile"], group.pids)
        try:
            await body(group)
        finally:
            await group.shutdown()

    async def body(group):
        import asyncio

        dst = "worker1"
        t = torch.ones(1)
        other = await ag.rpc_async(dst, mod._setup_child)
        pids = (os.getpid(), other)

        # idle CPU of the group
        await asyncio.sleep(0.3)
        c0, w0 = cpu_of(pids), time.monotonic()
        await asyncio.sleep(1.0 if q else 3.0)
        c1, wall = cpu_of(pids), time.monotonic() - w0
        emit(impl, "rpc_idle_cpu_cores", sum(b - a for a, b in zip(c0, c1, strict=False)) / wall, "cores",
             per_process=[round((b - a) / wall, 3) for a, b in zip(c0, c1, strict=False)])

        # small RPC latency
        n_lat = 500 if q else 2000
        for _ in range(200):
            await ag.rpc_async(dst, mod._noop, args=(t,))
        lat = []
        c0 = cpu_of(pids)
        for _ in range(n_lat):
            t0 = pc()
            await ag.rpc_async(dst, mod._noop, args=(t,))
            lat.append((pc() - t0) / 1e3)
        c1 = cpu_of(pids)
        emit(impl, "rpc_sync_small_p50_us", pct(lat, 50), "us", n=n_lat)
        emit(impl, "rpc_sync_small_p99_us", pct(lat, 99), "us", n=n_lat)
        emit(impl, "rpc_sync_small_cpu_us_per_call", (sum(c1) - sum(c0)) / n_lat * 1e6, "us", n=n_lat)

        # throughput, 1000 in flight
        n = 1000

        async def burst():
            t0 = pc()
            await asyncio.gather(*[ag.rpc_async(dst, mod._noop, args=(t,)) for _ in range(n)])
            return (pc() - t0) / 1e9

        await burst()
        rounds = 3 if q else 7
        c0 = cpu_of(pids)
        rates = [n / await burst() for _ in range(rounds)]
        c1 = cpu_of(pids)
        emit(impl, "rpc_async_1000_concurrent_calls_per_s", pct(rates, 50), "calls/s", rounds=rounds)
        emit(impl, "rpc_async_cpu_us_per_call", (sum(c1) - sum(c0)) / (n * rounds) * 1e6, "us")

        # tensor echo
        for name, nbytes, reps in ECHO_SIZES:
            reps = max(3, reps // 4) if q else reps
            x = torch.rand(nbytes // 4)
            for _ in range(2):
                y = await ag.rpc_async(dst, mod._echo, args=(x,))
            assert torch.equal(y, x)
            ts = []
            for _ in range(reps):
                t0 = pc()
                y = await ag.rpc_async(dst, mod._echo, args=(x,))
                ts.append((pc() - t0) / 1e9)
            del y
            med = pct(ts, 50)
            emit(impl, f"rpc_echo_{name}_GBps", 2 * nbytes / med / 1e9, "GB/s", n=reps,
                 median_ms=round(med * 1e3, 3))

    ag.run(main())


# ---------------------------------------------------------------------------------------
# torch.distributed.rpc phase (adapted from /work/shared/bench/torch_rpc_bench.py)
# ---------------------------------------------------------------------------------------
def _torch_bench(cfg):
    import torch
    import torch.distributed.rpc as rpc

    impl = cfg["impl"]
    q = cfg["quick"]
    pc = time.perf_counter_ns
    dst = "worker1"
    t = torch.ones(1)

    pids = (os.getpid(), rpc.rpc_sync(dst, _getpid))
    time.sleep(0.3)
    c0, w0 = cpu_of(pids), time.monotonic()
    time.sleep(1.0 if q else 3.0)
    c1, wall = cpu_of(pids), time.monotonic() - w0
    emit(impl, "rpc_idle_cpu_cores", sum(b - a for a, b in zip(c0, c1, strict=False)) / wall, "cores",
         per_process=[round((b - a) / wall, 3) for a, b in zip(c0, c1, strict=False)])

    n_lat = 500 if q else 2000
    for _ in range(200):
        rpc.rpc_sync(dst, _noop, (t,))
    lat = []
    c0 = cpu_of(pids)
    for _ in range(n_lat):
        t0 = pc()
        rpc.rpc_sync(dst, _noop, (t,))
        lat.append((pc() - t0) / 1e3)
    c1 = cpu_of(pids)
    emit(impl, "rpc_sync_small_p50_us", pct(lat, 50), "us", n=n_lat)
    emit(impl, "rpc_sync_small_p99_us", pct(lat, 99), "us", n=n_lat)
    emit(impl, "rpc_sync_small_cpu_us_per_call", (sum(c1) - sum(c0)) / n_lat * 1e6, "us", n=n_lat)

    n = 1000

    def burst():
        t0 = pc()
        futs = [rpc.rpc_async(dst, _noop, (t,)) for _ in range(n)]
        torch.futures.wait_all(futs)
        return (pc() - t0) / 1e9

    burst()
    rounds = 3 if q else 7
    c0 = cpu_of(pids)
    rates = [n / burst() for _ in range(rounds)]
    c1 = cpu_of(pids)
    emit(impl, "rpc_async_1000_concurrent_calls_per_s", pct(rates, 50), "calls/s", rounds=rounds)
    emit(impl, "rpc_async_cpu_us_per_call", (sum(c1) - sum(c0)) / (n * rounds) * 1e6, "us")

    for name, nbytes, reps in ECHO_SIZES:
        reps = max(3, reps // 4) if q else reps
        x = torch.rand(nbytes // 4)
        for _ in range(2):
            y = rpc.rpc_sync(dst, _echo, (x,))
        assert y.numel() == x.numel()
        ts = []
        for _ in range(reps):
            t0 = pc()
            y = rpc.rpc_sync(dst, _echo, (x,))
            ts.append((pc() - t0) / 1e9)
        del y
        med = pct(ts, 50)
        emit(impl, f"rpc_echo_{name}_GBps", 2 * nbytes / med / 1e9, "GB/s", n=reps,
             median_ms=round(med * 1e3, 3))


def _torch_worker(rank, port, cfg):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    transports, channels = (["uv"], ["basic"]) if cfg["tcp"] else (None, None)
    opts = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16, rpc_timeout=60, init_method=f"tcp://127.0.0.1:{port}",
        _transports=transports, _channels=channels,
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank == 0:
            _torch_bench(cfg)
    finally:
        rpc.shutdown()


def role_torch(cfg) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_torch_worker, args=(free_port(), cfg), nprocs=2, join=False,
                             start_method="spawn")
    note_pids(cfg["pidfile"], [p.pid for p in ctx.processes])
    deadline = time.monotonic() + cfg["timeout"] - 5
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError("torch workers timed out")


# ---------------------------------------------------------------------------------------
# raw blocking sockets (the ceiling)
# ---------------------------------------------------------------------------------------
def _recv_exact_into(sock, mv, size):
    got = 0
    while got < size:
        r = sock.recv_into(mv[got:size], size - got)
        if r == 0:
            raise ConnectionError("EOF")
        got += r


def role_raw_server(port_file: str) -> None:
    """Echo server: for each connection, echo messages of the size the client announces."""
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    lsock.settimeout(60)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(lsock.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    for _ in range(2):
        s, _ = lsock.accept()
        s.settimeout(60)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(16)
        _recv_exact_into(s, memoryview(hdr), 16)
        size, count = int.from_bytes(hdr[:8], "little"), int.from_bytes(hdr[8:], "little")
        mv = memoryview(bytearray(size))
        for _ in range(count):
            _recv_exact_into(s, mv, size)
            s.sendall(mv)
        s.close()


def role_raw(cfg) -> None:
    impl = "raw_socket"
    q = cfg["quick"]
    port_file = cfg["pidfile"] + ".port"
    server = subprocess.Popen([sys.executable, __file__, "--role", "raw-server", "--pidfile", port_file])
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(port_file):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("raw echo server did not start")
            time.sleep(0.01)
        with open(port_file) as f:
            port = int(f.read())

        def run(size, count):
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(size.to_bytes(8, "little") + count.to_bytes(8, "little"))
            src = memoryview(bytearray(b"\x5a" * size))
            dst = memoryview(bytearray(size))
            ts = []
            for _ in range(count):
                t0 = time.perf_counter_ns()
                s.sendall(src)
                _recv_exact_into(s, dst, size)
                ts.append((time.perf_counter_ns() - t0) / 1e9)
            s.close()
            return ts

        warm, n = (1, 4) if q else (1, 8)
        ts = run(64 * MiB, warm + n)[warm:]
        med = pct(ts, 50)
        emit(impl, "rpc_echo_64MiB_GBps", 2 * 64 * MiB / med / 1e9, "GB/s", n=n,
             median_ms=round(med * 1e3, 3), how="blocking sockets sendall/recv_into, echoed back")
        warm, n = (200, 2000) if q else (500, 5000)
        us = [x * 1e6 for x in run(16, warm + n)[warm:]]
        emit(impl, "rpc_sync_small_p50_us", pct(us, 50), "us", n=n, how="16-byte request/response")
        emit(impl, "rpc_sync_small_p99_us", pct(us, 99), "us", n=n, how="16-byte request/response")
    finally:
        server.wait(10) if server.poll() is None else None
        if server.poll() is None:
            server.kill()
            server.wait()
        if os.path.exists(port_file):
            os.unlink(port_file)


# ---------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------
def run_phase(role, args, timeout, extra=()):
    """Run one phase in a child process (own session); returns its JSON rows."""
    fd, pidfile = tempfile.mkstemp(prefix="bench_rpc_", suffix=".pids")
    os.close(fd)
    cmd = [sys.executable, __file__, "--role", role, "--pidfile", pidfile, "--timeout", str(timeout)]
    if args.quick:
        cmd.append("--quick")
    cmd += list(extra)
    t0 = time.monotonic()
    busy0, ours0 = system_busy_s(), children_cpu_s()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    rc = out = None
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        # kill whatever is left: the phase's process group, then the workers it reported
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if out is None:
            out, _ = proc.communicate()
        try:
            with open(pidfile) as f:
                for line in f:
                    with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                        os.kill(int(line), signal.SIGKILL)
            os.unlink(pidfile)
        except OSError:
            pass
    rows = []
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    wall = time.monotonic() - t0
    foreign = max(0.0, ((system_busy_s() - busy0) - (children_cpu_s() - ours0)) / wall)
    label = role + (" --tcp" if "--tcp" in extra else "")
    impl = {"actorgrad": "actorgrad", "raw": "raw_socket"}.get(role, "torch_tpuv" if "--tcp" in extra else "torch")
    rows.append({"metric": "_foreign_cores", "value": round(foreign, 3), "unit": "cores", "impl": impl,
                 "how": "CPU used by other processes of the machine during this phase (noise)"})
    print(f"[bench_rpc] {label}: rc={rc} in {wall:.1f}s, other processes used {foreign:.2f} cores"
          + ("  <- NOISY, compare with care" if foreign > 0.25 else ""), file=sys.stderr, flush=True)
    if rc != 0:
        rows.append({"metric": f"bench_{role}_error", "value": None, "unit": "",
                     "impl": role, "error": "timeout" if rc is None else f"exit status {rc}"})
    return rows


METRICS = [
    # metric, label, better ("low"/"high"), target ratio ours/torch (None: no target)
    ("rpc_sync_small_p50_us", "small RPC p50 (us)", "low", 0.25),
    ("rpc_sync_small_p99_us", "small RPC p99 (us)", "low", None),
    ("rpc_sync_small_cpu_us_per_call", "small RPC CPU/call, both procs (us)", "low", None),
    ("rpc_async_1000_concurrent_calls_per_s", "1000 in flight (calls/s)", "high", 5.0),
    ("rpc_async_cpu_us_per_call", "in-flight CPU/call (us)", "low", None),
    ("rpc_echo_1MiB_GBps", "echo 1 MiB (GB/s)", "high", None),
    ("rpc_echo_16MiB_GBps", "echo 16 MiB (GB/s)", "high", None),
    ("rpc_echo_64MiB_GBps", "echo 64 MiB (GB/s)", "high", 1.3),
    ("rpc_idle_cpu_cores", "idle CPU, 2 workers (cores)", "low", None),
    ("_foreign_cores", "noise: other processes' CPU (cores)", "low", None),
]


def report(rows, show_table=True):
    import statistics

    runs: dict = {}
    for r in rows:
        if r.get("value") is not None:
            runs.setdefault((r["impl"], r["metric"]), []).append(r["value"])
    vals = {k: statistics.median(v) for k, v in runs.items()}  # median over --repeat runs
    ratios = []
    for ref in ("torch", "torch_tpuv"):
        for metric, _label, better, target in METRICS:
            a, b = vals.get(("actorgrad", metric)), vals.get((ref, metric))
            if a is None or b is None or b == 0 or metric.startswith("_"):
                continue
            ratio = a / b
            ok = None
            if target is not None:
                ok = ratio <= target if better == "low" else ratio >= target
            row = {"metric": f"ratio_{metric}", "value": round(ratio, 4), "unit": "x",
                   "impl": f"actorgrad/{ref}"}
            if target is not None:
                row["target"] = ("<= " if better == "low" else ">= ") + str(target)
                row["met"] = ok
            ratios.append(row)
    raw = vals.get(("raw_socket", "rpc_echo_64MiB_GBps"))
    ours = vals.get(("actorgrad", "rpc_echo_64MiB_GBps"))
    if raw and ours:
        ratios.append({"metric": "ratio_rpc_echo_64MiB_GBps", "value": round(ours / raw, 4), "unit": "x",
                       "impl": "actorgrad/raw_socket", "target": ">= 0.75", "met": ours / raw >= 0.75})
    idle = vals.get(("actorgrad", "rpc_idle_cpu_cores"))
    if idle is not None:
        ratios.append({"metric": "idle_cpu_near_zero", "value": idle, "unit": "cores", "impl": "actorgrad",
                       "target": "<= 0.02", "met": idle <= 0.02})
    for r in ratios:
        print(json.dumps(r), flush=True)
    if not show_table:
        return
    impls = [i for i in ("actorgrad", "torch", "torch_tpuv", "raw_socket") if any(k[0] == i for k in vals)]
    rat = {(r["impl"], r["metric"]): r for r in ratios}
    head = f"{'metric':38s}" + "".join(f"{i:>12s}" for i in impls)
    refs = [r for r in ("torch", "torch_tpuv") if r in impls]
    head += "".join(f"{'ours/' + r.replace('torch_', ''):>14s}" for r in refs) + "   target"
    print()
    print(head)
    print("-" * len(head))
    for metric, label, better, target in METRICS:
        line = f"{label:38s}"
        for i in impls:
            v = vals.get((i, metric))
            line += f"{'-' if v is None else f'{v:.4g}':>12s}"
        for ref in refs:
            r = rat.get((f"actorgrad/{ref}", f"ratio_{metric}"))
            cell = "-" if r is None else f"{r['value']:.3g}x" + ("" if r.get("met") is None else (" ok" if r["met"] else " NO"))
            line += f"{cell:>14s}"
        if target is not None:
            line += f"   {'<=' if better == 'low' else '>='} {target}x torch"
        print(line)
    r = rat.get(("actorgrad/raw_socket", "ratio_rpc_echo_64MiB_GBps"))
    if r is not None:
        print(f"{'echo 64 MiB, ours / raw socket':38s}{r['value']:>12.3g}x   target >= 0.75 {'ok' if r['met'] else 'NO'}")
    r = rat.get(("actorgrad", "idle_cpu_near_zero"))
    if r is not None:
        print(f"{'idle CPU, ours':38s}{r['value']:>12.3g}    target ~0 {'ok' if r['met'] else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short loops (< 40 s in all)")
    ap.add_argument("--skip-torch", action="store_true", help="do not run torch.distributed.rpc")
    ap.add_argument("--no-torch-tcp", action="store_true", help="skip TensorPipe's --tcp (uv) variant")
    ap.add_argument("--only", default=None, help="comma list of phases: actorgrad,torch,torch_tcp,raw")
    ap.add_argument("--no-table", action="store_true", help="JSON lines only")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per phase")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the phases N times, interleaved; ratios and table use medians")
    # internal
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pidfile", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tcp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role == "raw-server":
        start_watchdog("bench_rpc", 120)
        role_raw_server(args.pidfile)
        return
    if args.role is not None:
        cfg = {"quick": args.quick, "pidfile": args.pidfile, "timeout": args.timeout or 120,
               "tcp": args.tcp, "impl": "torch_tpuv" if args.tcp else "torch"}
        start_watchdog("bench_rpc", cfg["timeout"] - 2)
        {"actorgrad": role_actorgrad, "torch": role_torch, "raw": role_raw}[args.role](cfg)
        return

    # SIGTERM unwinds like Ctrl-C, so run_phase's cleanup kills the phase's processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    phases = ["actorgrad", "torch", "torch_tcp", "raw"]
    if args.only:
        phases = [p for p in args.only.split(",") if p]
    if args.skip_torch:
        phases = [p for p in phases if not p.startswith("torch")]
    if args.no_torch_tcp and "torch_tcp" in phases:
        phases.remove("torch_tcp")
    import platform

    print(f"[bench_rpc] python {platform.python_version()} cpus={os.cpu_count()} phases={phases} "
          f"quick={args.quick}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    rows = []
    try:
        for run in range(args.repeat):
            for phase in phases:
                timeout = args.timeout or (40 if args.quick else 150)
                got = run_phase("torch", args, timeout, ["--tcp"]) if phase == "torch_tcp" else run_phase(phase, args, timeout)
                for r in got:
                    if args.repeat > 1:
                        r["run"] = run
                rows += got
    except KeyboardInterrupt:
        print("[bench_rpc] interrupted; the running phase's processes were killed", file=sys.stderr)
        sys.exit(130)
    for r in rows:
        print(json.dumps(r), flush=True)
    report(rows, show_table=not args.no_table)
    print(f"[bench_rpc] total {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
