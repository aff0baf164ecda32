"""Command-line interface for actorgrad.

Currently provides one subcommand, ``launch``, a small single-node process
launcher in the spirit of ``torchrun``::

    actorgrad launch --nproc 4 train.py --lr 0.1

It starts ``nproc`` copies of ``sys.executable train.py --lr 0.1``, each with
the environment variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``ACTORGRAD_AUTH_KEY``
and ``PYTHONUNBUFFERED=1`` (and ``OMP_NUM_THREADS=1`` unless set, as torchrun
does), and ``ACTORGRAD_MASTER_PORT``, the port of actorgrad's own rendezvous, so that
``MASTER_PORT`` stays free for ``torch.distributed.init_process_group`` in the same
script.  Every output line of rank ``r`` is echoed with a ``[rank r] `` prefix (see
``_rank_output``).  If any rank fails, or the launcher receives SIGINT, SIGTERM, SIGHUP
or SIGQUIT, every rank's process group is signalled, given a grace period, and then
killed (after a failure, the other ranks first get a few seconds to exit by themselves,
so each one's own error is printed); the launcher always waits for all of its children
before it returns.

This module uses the standard library only, and the package loads its public names
on first use, so the launcher starts without importing torch.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from . import _rank_output
from ._ports import pick_rendezvous_port

__all__ = ["main", "launch"]

_PROG = "actorgrad"
_LAUNCH = "actorgrad launch"

#: Seconds between the polite signal (SIGTERM/SIGINT) and SIGKILL (torchrun's: time
#: for a rank's handler to save a checkpoint; a second Ctrl-C kills at once).
GRACE_PERIOD_S = 30.0
#: Seconds the other ranks have to exit by themselves once one failed, before they are
#: signalled: a rank that failed while serving a peer is often seen to go (WorkerLost)
#: by a peer that exits first, and its own traceback is printed only as it exits (after
#: up to 2 s joining its thread pool); a signal then would cut it off.
SETTLE_S = 3.0
#: How often the supervisor loop polls the children.
_POLL_INTERVAL_S = 0.05

_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _version() -> str:
    """Return the installed actorgrad version, or ``"0.1.0"`` if not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - always available on 3.11+
        return "0.1.0"
    try:
        return version("actorgrad")
    except PackageNotFoundError:
        return "0.1.0"


# --------------------------------------------------------------------------- #
# Argument parsing
# --------------------------------------------------------------------------- #


def _positive_int(text: str) -> int:
    """argparse ``type=`` for an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    """argparse ``type=`` for a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _port(text: str) -> int:
    """argparse ``type=`` for a TCP port number in 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    """Build the top-level ``actorgrad`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="actorgrad: asyncio actors and distributed autograd for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    launch_p = sub.add_parser(
        "launch",
        help="start N local worker processes running a script",
        description=(
            "Start NPROC copies of `python SCRIPT [ARGS...]` with RANK, WORLD_SIZE, "
            "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (free for "
            "torch.distributed's env://), ACTORGRAD_MASTER_PORT (actorgrad's rendezvous) and "
            "ACTORGRAD_AUTH_KEY set. If any rank fails, all ranks are stopped."
        ),
    )
    launch_p.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=_positive_int,
        required=True,
        metavar="N",
        help="number of worker processes (ranks) to start",
    )
    launch_p.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address of rank 0 (default: %(default)s)",
    )
    launch_p.add_argument(
        "--master-port",
        "--master_port",
        type=_port,
        default=None,
        metavar="PORT",
        help="port of rank 0 (default: pick a free port)",
    )
    launch_p.add_argument(
        "--trace",
        default=None,
        metavar="OUT.json",
        help="record RPC and backward events on every rank; rank 0 writes one merged "
        "Chrome-trace JSON to this path when it shuts down",
    )
    launch_p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module, run as `python -m SCRIPT` (as torchrun's -m)",
    )
    launch_p.add_argument(
        "--grace-period",
        type=_non_negative_float,
        default=GRACE_PERIOD_S,
        metavar="S",
        help="seconds a rank has to exit after SIGTERM/SIGINT before it is killed "
        "(default: %(default)g; a second Ctrl-C kills at once)",
    )
    launch_p.add_argument(
        "--nnodes",
        default="1",
        metavar="N",
        help="accepted for torchrun compatibility: only 1 (this machine)",
    )
    launch_p.add_argument(
        "--node-rank",
        "--node_rank",
        default="0",
        metavar="R",
        help="accepted for torchrun compatibility: only 0 (this machine)",
    )
    launch_p.add_argument(
        "--standalone",
        action="store_true",
        help="accepted for torchrun compatibility (the rendezvous is always local)",
    )
    # (optional to argparse, checked in main: a REMAINDER after a required positional
    # made argparse call ARGS required too when SCRIPT was missing)
    launch_p.add_argument("script", metavar="SCRIPT", nargs="?",
                          help="Python script (or module, with -m) to run in every rank")
    launch_p.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments passed through to SCRIPT",
    )
    return parser


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def _pick_free_port(addr: str, avoid: int | None = None) -> int:
    """Return a port that is currently free for the rendezvous (other than ``avoid``).

    Binds ``addr`` when possible (so the port is free where rank 0 will
    listen), falling back to ``127.0.0.1``; the port lies outside the range the
    kernel hands to the ranks' own listeners (see ``pick_rendezvous_port``).
    """
    last_exc: OSError | None = None
    for host in (addr, "127.0.0.1"):
        for _ in range(16):
            try:
                port = pick_rendezvous_port(host)
            except OSError as exc:
                last_exc = exc
                break
            if port != avoid:
                return port
    raise OSError(f"could not find a free port: {last_exc}")


def _port_in_use(addr: str, port: int) -> bool:
    """Return True if ``addr:port`` cannot be bound because it is in use.

    Other bind failures (e.g. ``addr`` is not a local address, as on a
    multi-node setup) are not treated as "in use".
    """
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, socktype, proto, _canon, sockaddr in infos:
        try:
            with socket.socket(family, socktype, proto) as s:
                # Same option a real server would use: ignores TIME_WAIT leftovers
                # but still fails for a port that somebody is listening on.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
    return False


def _describe_exit(returncode: int) -> tuple[str, int]:
    """Turn a ``Popen.returncode`` into (human text, shell-style exit code)."""
    if returncode < 0:
        signum = -returncode
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"was killed by {name} (exit code {128 + signum})", 128 + signum
    return f"exited with code {returncode}", returncode


@dataclass
class _Rank:
    """One launched worker process and its output-forwarding threads."""

    rank: int
    proc: subprocess.Popen[bytes]
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def pgid(self) -> int:
        """Process-group id of the worker (== its pid, thanks to ``start_new_session``)."""
        return self.proc.pid


def _signal_group(ranks: Sequence[_Rank], sig: int) -> None:
    """Send ``sig`` to the process group of every rank, ignoring vanished groups."""
    for r in ranks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Return True if a live (non-zombie) process is still in process group ``pgid``.

    Zombies are ignored: in containers whose PID 1 does not reap orphans, dead
    grandchildren linger as zombies forever and would otherwise look alive.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs (e.g. macOS): trust kill()
        return True
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # Format: "pid (comm) state ppid pgrp ..."; comm may contain spaces/parens.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


class _SignalState:
    """Records the signals received by the launcher (handlers only set flags)."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def handler(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: remember the signal; the supervisor loop acts on it."""
        self.received.append(signum)


# --------------------------------------------------------------------------- #
# Launcher
# --------------------------------------------------------------------------- #


def _child_env(rank: int, nproc: int, addr: str, port: int, auth_key: str, store_port: int) -> dict[str, str]:
    """Return the environment for ``rank``."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        ACTORGRAD_MASTER_PORT=str(store_port),
        ACTORGRAD_MASTER_PORT_BESIDE=str(port),
        ACTORGRAD_AUTH_KEY=auth_key,
        PYTHONUNBUFFERED="1",
    )
    if nproc > 1:
        # as torchrun: N ranks each using every core would slow one another down
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _start_rank(rank: int, cmd: list[str], env: dict[str, str],
                sinks: tuple[_rank_output.Sink, _rank_output.Sink]) -> _Rank:
    """Start one worker in its own session and its output-forwarding threads.

    It shares the launcher's stdin, as under torchrun (``input()``, ``breakpoint()``)."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    r = _Rank(rank=rank, proc=proc)
    prefix = f"[rank {rank}] ".encode()
    assert proc.stdout is not None and proc.stderr is not None
    for pipe, sink, name in ((proc.stdout, sinks[0], "stdout"), (proc.stderr, sinks[1], "stderr")):
        t = threading.Thread(
            target=_rank_output.forward,
            args=(pipe, prefix, sink),
            name=f"actorgrad-rank{rank}-{name}",
            daemon=True,
        )
        t.start()
        r.threads.append(t)
    return r


class _ExitWatch:
    """Reports the ranks in the order they exit.

    A thread per rank waits for its exit without reaping it (``waitid`` with
    ``WNOWAIT``; the supervisor's ``Popen`` reaps), so two ranks that fail a few
    milliseconds apart are told apart: the first is the one to report (the other
    often only saw it go). Without ``waitid`` the ranks are polled.
    """

    def __init__(self, ranks: Sequence[_Rank]) -> None:
        self._ranks = ranks
        self._seen: set[int] = set()
        self._exits: queue.SimpleQueue[_Rank] | None = None
        if hasattr(os, "waitid") and hasattr(os, "WNOWAIT"):
            self._exits = queue.SimpleQueue()
            for r in ranks:
                threading.Thread(target=self._wait, args=(r,), name=f"actorgrad-rank{r.rank}-exit",
                                 daemon=True).start()

    def _wait(self, r: _Rank) -> None:
        assert self._exits is not None
        with contextlib.suppress(OSError):  # ChildProcessError: already reaped
            os.waitid(os.P_PID, r.proc.pid, os.WEXITED | os.WNOWAIT)
        self._exits.put(r)

    def exited(self, timeout: float) -> list[_Rank]:
        """The ranks that exited since the last call, in order (reaped), waiting at
        most ``timeout`` for the first."""
        if self._exits is None:
            time.sleep(timeout)
            found = [r for r in self._ranks if r.rank not in self._seen and r.proc.poll() is not None]
        else:
            found = []
            with contextlib.suppress(queue.Empty):
                found.append(self._exits.get(timeout=timeout))
                while True:
                    found.append(self._exits.get_nowait())
            for r in found:
                r.proc.wait()  # it exited: this only reaps
        self._seen.update(r.rank for r in found)
        return found


def _shutdown(
    ranks: Sequence[_Rank],
    first_signal: int,
    signals: _SignalState,
    err: _rank_output.Sink,
    grace_s: float = GRACE_PERIOD_S,
) -> None:
    """Stop every rank: ``first_signal`` to each group, then SIGKILL after ``grace_s``.

    Always waits for (reaps) every worker before returning.  A further
    SIGINT/SIGTERM to the launcher during the grace period escalates to
    SIGKILL immediately.
    """
    seen = len(signals.received)
    # Signal every group, including those whose leader already exited: processes
    # the leader spawned may still be running in it.
    _signal_group(ranks, first_signal)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        # poll() also reaps exited leaders, so their groups can disappear.
        leaders_done = all(r.proc.poll() is not None for r in ranks)
        if leaders_done and not any(_group_alive(r.pgid) for r in ranks):
            break
        if len(signals.received) > seen:
            break
        time.sleep(_POLL_INTERVAL_S)
    running = [r.rank for r in ranks if r.proc.poll() is None]
    if running:
        why = "on a second signal" if len(signals.received) > seen else f"after {grace_s:g}s"
        _say(err, f"killing rank(s) {', '.join(map(str, running))}: still running {why}")
    _kill_and_reap(ranks, stragglers=True)


def _kill_and_reap(ranks: Sequence[_Rank], *, stragglers: bool) -> None:
    """SIGKILL the process group of every still-running worker, then reap all workers.

    With ``stragglers=True`` groups whose leader already exited but that still
    have members are SIGKILLed too.
    """
    for r in ranks:
        if r.proc.poll() is None or (stragglers and _group_alive(r.pgid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.pgid, signal.SIGKILL)
    for r in ranks:
        # SIGKILL cannot be ignored, so this returns promptly.
        while True:
            try:
                r.proc.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - handlers are installed
                continue


def _cleanup_stragglers(ranks: Sequence[_Rank], grace_s: float = 1.0) -> None:
    """After all workers exited, stop anything they left behind in their process groups."""
    groups = [r for r in ranks if _group_alive(r.pgid)]
    if not groups:
        return
    _signal_group(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_alive(r.pgid) for r in groups):
        time.sleep(_POLL_INTERVAL_S)
    _signal_group([r for r in groups if _group_alive(r.pgid)], signal.SIGKILL)


def _say(err: _rank_output.Sink, text: str) -> None:
    """A message of the launcher's own, on its stderr."""
    err.message(f"{_LAUNCH}: {text}")


def _script_problem(script: str, module: bool) -> str | None:
    """Why ``script`` cannot run, or None (a module is looked for by the ranks)."""
    if module or os.path.isfile(script):
        return None
    if os.path.isdir(script):
        if os.path.isfile(os.path.join(script, "__main__.py")):
            return None  # python runs a directory with a __main__.py
        return f"script {script} is a directory without a __main__.py"
    return f"script not found: {script}"


def launch(
    script: str,
    script_args: Sequence[str],
    nproc: int,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    *,
    module: bool = False,
    grace_period: float = GRACE_PERIOD_S,
) -> int:
    """Run ``nproc`` copies of ``script`` (a module with ``module``) and supervise
    them; return the exit code.

    Returns 0 if every rank exits 0; the exit code (or ``128 + signal``) of the rank
    that failed first if one fails; ``128 + signal`` if the launcher is interrupted
    by SIGINT/SIGTERM; 2 for usage errors (missing script, port in use).  Never
    returns while a worker it started is still running, nor before the ranks'
    output is written (unless a second signal says to stop waiting).
    """
    out, err = _rank_output.sinks(sys.stdout, sys.stderr)

    problem = _script_problem(script, module)
    if problem is None:
        if master_port is None:
            try:
                master_port = _pick_free_port(master_addr)
            except OSError as exc:
                problem = str(exc)
        elif _port_in_use(master_addr, master_port):
            problem = (f"--master-port {master_port} is already in use on {master_addr}; "
                       "choose another port or omit --master-port to pick a free one")
    if problem is not None or master_port is None:
        _say(err, str(problem))
        _rank_output.finish([], (out, err), lambda: False)
        return 2

    try:  # the rendezvous of actorgrad's own store; MASTER_PORT stays torch.distributed's
        store_port = _pick_free_port(master_addr, avoid=master_port)
    except OSError as exc:
        _say(err, str(exc))
        _rank_output.finish([], (out, err), lambda: False)
        return 2
    auth_key = os.environ.get("ACTORGRAD_AUTH_KEY") or secrets.token_hex(32)
    cmd = [sys.executable, *(["-m"] if module else []), script, *script_args]

    signals = _SignalState()
    previous: dict[int, _SignalHandler] = {}
    if threading.current_thread() is threading.main_thread():
        # SIGHUP: the terminal closed or the ssh session dropped. The ranks run in
        # sessions of their own, so the hangup does not reach them: without a handler
        # the launcher would die and leave them orphaned.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            previous[sig] = signal.signal(sig, signals.handler)

    ranks: list[_Rank] = []
    exit_code = 0
    try:
        try:
            for rank in range(nproc):
                if signals.received:
                    break
                env = _child_env(rank, nproc, master_addr, master_port, auth_key, store_port)
                ranks.append(_start_rank(rank, cmd, env, (out, err)))
        except OSError as exc:
            _say(err, f"failed to start rank {len(ranks)}: {exc}")
            _shutdown(ranks, signal.SIGTERM, signals, err, grace_period)
            return 1

        watch = _ExitWatch(ranks)
        failed: list[_Rank] = []  # in the order they exited
        told = 0  # of them, reported
        done = 0
        settle_until = 0.0  # once one failed: until when the others may exit by themselves
        while True:
            if signals.received:  # (also while the others may exit: as any signal stops them)
                signum = signals.received[0]
                _say(err, f"received {signal.Signals(signum).name}; stopping all {nproc} ranks "
                    "(again to kill them at once)")
                # the ranks see Ctrl-C as KeyboardInterrupt; anything else as SIGTERM
                _shutdown(ranks, signum if signum == signal.SIGINT else signal.SIGTERM, signals, err,
                          grace_period)
                exit_code = 128 + signum
                break
            if failed:
                first = failed[0]
                if not told:
                    text, exit_code = _describe_exit(first.proc.returncode)
                    settle_until = time.monotonic() + SETTLE_S
                    if done < len(ranks):
                        _say(err, f"rank {first.rank} {text}; the other rank(s) have {SETTLE_S:g}s to exit")
                    told = 1
                for r in failed[told:]:
                    _say(err, f"rank {r.rank} also {_describe_exit(r.proc.returncode)[0]} "
                         f"(after rank {first.rank})")
                told = len(failed)
                if done == len(ranks) or time.monotonic() >= settle_until:
                    others = [r for r in ranks if r.proc.poll() is None]
                    if others:
                        _say(err, f"terminating {len(others)} remaining rank(s): "
                             f"{', '.join(str(r.rank) for r in others)}")
                    _shutdown(ranks, signal.SIGTERM, signals, err, grace_period)
                    break
            elif done == len(ranks):
                exit_code = 0
                break
            exited = watch.exited(_POLL_INTERVAL_S)
            done += len(exited)
            failed += [r for r in exited if r.proc.returncode != 0]
    finally:
        # Whatever happened above (including unexpected exceptions), no worker
        # outlives the launcher.
        _kill_and_reap(ranks, stragglers=False)
        _cleanup_stragglers(ranks)
        seen = len(signals.received)
        _rank_output.finish([t for r in ranks for t in r.threads], (out, err),
                            lambda: len(signals.received) > seen)
        for prev_sig, handler in previous.items():
            signal.signal(prev_sig, signal.SIG_DFL if handler is None else handler)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``actorgrad`` command; returns the process exit code."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "launch":
        if args.script is None:
            print(f"{_LAUNCH}: the following argument is required: SCRIPT (the script, or module "
                  "with -m, that every rank runs)", file=sys.stderr)
            return 2
        if args.trace:
            trace_path = os.path.abspath(args.trace)
            if not os.path.isdir(os.path.dirname(trace_path)):  # say so now, not after the run
                print(f"actorgrad launch: --trace {args.trace}: the directory "
                      f"{os.path.dirname(trace_path)} does not exist", file=sys.stderr)
                return 2
            os.environ["ACTORGRAD_TRACE"] = trace_path
        if args.nnodes not in ("1", "1:1") or args.node_rank != "0":
            print(f"{_LAUNCH}: --nnodes {args.nnodes} --node-rank {args.node_rank}: the launcher starts ranks on this "
                  "machine only; on several machines start every rank with RANK, WORLD_SIZE, "
                  "MASTER_ADDR and MASTER_PORT set (README: Running across machines)", file=sys.stderr)
            return 2
        return launch(
            script=args.script,
            script_args=list(args.script_args),
            nproc=args.nproc,
            master_addr=args.master_addr,
            master_port=args.master_port,
            module=args.module,
            grace_period=args.grace_period,
        )
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2  # pragma: no cover
