"""Command-line interface for actorgrad.

Currently provides one subcommand, ``launch``, a small single-node process
launcher in the spirit of ``torchrun``::

    actorgrad launch --nproc 4 train.py --lr 0.1

It starts ``nproc`` copies of ``sys.executable train.py --lr 0.1``, each with
the environment variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``ACTORGRAD_AUTH_KEY``
and ``PYTHONUNBUFFERED=1``.  Every output line of rank ``r`` is echoed with a
``[rank r] `` prefix.  If any rank fails, or the launcher receives SIGINT,
SIGTERM, SIGHUP or SIGQUIT, every rank's process group is signalled, given a grace period, and
then killed; the launcher always waits for all of its children before it
returns.

This module uses the standard library only, and the package loads its public names
on first use, so the launcher starts without importing torch.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
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
from typing import IO, Any

from ._ports import pick_rendezvous_port

__all__ = ["main", "launch"]

_PROG = "actorgrad"
_LAUNCH = "actorgrad launch"

#: Seconds between the polite signal (SIGTERM/SIGINT) and SIGKILL.
GRACE_PERIOD_S = 3.0
#: How often the supervisor loop polls the children.
_POLL_INTERVAL_S = 0.05
#: How long to wait for output-forwarding threads after all children exited.
_READER_JOIN_TIMEOUT_S = 2.0

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
            "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and "
            "ACTORGRAD_AUTH_KEY set. If any rank fails, all ranks are stopped."
        ),
    )
    launch_p.add_argument(
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        type=_positive_int,
        required=True,
        metavar="N",
        help="number of worker processes (ranks) to start",
    )
    launch_p.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address of rank 0 (default: %(default)s)",
    )
    launch_p.add_argument(
        "--master-port",
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
    launch_p.add_argument("script", metavar="SCRIPT", help="Python script to run in every rank")
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


def _pick_free_port(addr: str) -> int:
    """Return a port that is currently free for the rendezvous.

    Binds ``addr`` when possible (so the port is free where rank 0 will
    listen), falling back to ``127.0.0.1``; the port lies outside the range the
    kernel hands to the ranks' own listeners (see ``pick_rendezvous_port``).
    """
    last_exc: OSError | None = None
    for host in (addr, "127.0.0.1"):
        try:
            return pick_rendezvous_port(host)
        except OSError as exc:
            last_exc = exc
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


class _Output:
    """Thread-safe, failure-tolerant line writer for the launcher's stdout/stderr."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, stream: IO[str], text: str) -> None:
        """Write ``text`` to ``stream`` atomically w.r.t. other writers and flush."""
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                # Closed or broken pipe (e.g. `actorgrad launch ... | head`):
                # keep draining the children anyway so they never block.
                pass

    def message(self, text: str) -> None:
        """Print a launcher message to stderr."""
        self.write(sys.stderr, f"{_LAUNCH}: {text}\n")


def _forward_lines(pipe: IO[bytes], prefix: str, stream: IO[str], out: _Output) -> None:
    """Copy every line from ``pipe`` to ``stream`` prefixed with ``prefix``."""
    try:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            out.write(stream, prefix + line)
    except (OSError, ValueError):
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


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


def _child_env(rank: int, nproc: int, addr: str, port: int, auth_key: str) -> dict[str, str]:
    """Return the environment for ``rank``."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        ACTORGRAD_AUTH_KEY=auth_key,
        PYTHONUNBUFFERED="1",
    )
    return env


def _start_rank(rank: int, cmd: list[str], env: dict[str, str], out: _Output) -> _Rank:
    """Start one worker in its own session and its output-forwarding threads."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    r = _Rank(rank=rank, proc=proc)
    prefix = f"[rank {rank}] "
    assert proc.stdout is not None and proc.stderr is not None
    for pipe, stream, name in (
        (proc.stdout, sys.stdout, "stdout"),
        (proc.stderr, sys.stderr, "stderr"),
    ):
        t = threading.Thread(
            target=_forward_lines,
            args=(pipe, prefix, stream, out),
            name=f"actorgrad-rank{rank}-{name}",
            daemon=True,
        )
        t.start()
        r.threads.append(t)
    return r


def _shutdown(
    ranks: Sequence[_Rank],
    first_signal: int,
    signals: _SignalState,
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


def launch(
    script: str,
    script_args: Sequence[str],
    nproc: int,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> int:
    """Run ``nproc`` copies of ``script`` and supervise them; return the exit code.

    Returns 0 if every rank exits 0; the first failing rank's exit code (or
    ``128 + signal``) if one fails; ``128 + signal`` if the launcher is
    interrupted by SIGINT/SIGTERM; 2 for usage errors (missing script, port
    in use).  Never returns while a worker it started is still running.
    """
    out = _Output()

    if not os.path.isfile(script):
        out.message(f"script not found: {script}")
        return 2

    if master_port is None:
        try:
            master_port = _pick_free_port(master_addr)
        except OSError as exc:
            out.message(str(exc))
            return 2
    elif _port_in_use(master_addr, master_port):
        out.message(
            f"--master-port {master_port} is already in use on {master_addr}; "
            "choose another port or omit --master-port to pick a free one"
        )
        return 2

    auth_key = os.environ.get("ACTORGRAD_AUTH_KEY") or secrets.token_hex(32)
    cmd = [sys.executable, script, *script_args]

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
                env = _child_env(rank, nproc, master_addr, master_port, auth_key)
                ranks.append(_start_rank(rank, cmd, env, out))
        except OSError as exc:
            out.message(f"failed to start rank {len(ranks)}: {exc}")
            _shutdown(ranks, signal.SIGTERM, signals)
            return 1

        while True:
            if signals.received:
                signum = signals.received[0]
                out.message(f"received {signal.Signals(signum).name}; stopping all {nproc} ranks")
                # the ranks see Ctrl-C as KeyboardInterrupt; anything else as SIGTERM
                _shutdown(ranks, signum if signum == signal.SIGINT else signal.SIGTERM, signals)
                exit_code = 128 + signum
                break
            failed = next(
                (r for r in ranks if r.proc.poll() is not None and r.proc.returncode != 0),
                None,
            )
            if failed is not None:
                text, exit_code = _describe_exit(failed.proc.returncode)
                others = [r for r in ranks if r.proc.poll() is None]
                out.message(
                    f"rank {failed.rank} {text}; terminating {len(others)} remaining rank(s)"
                )
                _shutdown(ranks, signal.SIGTERM, signals)
                break
            if all(r.proc.poll() is not None for r in ranks):
                exit_code = 0
                break
            time.sleep(_POLL_INTERVAL_S)
    finally:
        # Whatever happened above (including unexpected exceptions), no worker
        # outlives the launcher.
        _kill_and_reap(ranks, stragglers=False)
        _cleanup_stragglers(ranks)
        deadline = time.monotonic() + _READER_JOIN_TIMEOUT_S
        for r in ranks:
            for t in r.threads:
                t.join(max(0.0, deadline - time.monotonic()))
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
        if args.trace:
            trace_path = os.path.abspath(args.trace)
            if not os.path.isdir(os.path.dirname(trace_path)):  # say so now, not after the run
                print(f"actorgrad launch: --trace {args.trace}: the directory "
                      f"{os.path.dirname(trace_path)} does not exist", file=sys.stderr)
                return 2
            os.environ["ACTORGRAD_TRACE"] = trace_path
        return launch(
            script=args.script,
            script_args=list(args.script_args),
            nproc=args.nproc,
            master_addr=args.master_addr,
            master_port=args.master_port,
        )
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2  # pragma: no cover
