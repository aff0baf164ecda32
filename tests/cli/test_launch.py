"""End-to-end tests for ``actorgrad launch`` (run as ``python -m actorgrad``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPTS = Path(__file__).parent / "scripts"

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    """Environment for the launcher: repo root on PYTHONPATH, no inherited auth key."""
    env = dict(os.environ)
    env.pop("ACTORGRAD_AUTH_KEY", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (PID 1 may not reap orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _read_pids(pid_dir: Path) -> list[int]:
    """All PIDs recorded by ``sleeper.py`` in ``pid_dir``."""
    return [int(p.read_text()) for p in pid_dir.glob("*.pid")]


def _wait_for_pid_files(pid_dir: Path, names: list[str], timeout: float = 10.0) -> None:
    """Wait until every ``name`` exists in ``pid_dir``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((pid_dir / n).exists() for n in names):
            return
        time.sleep(0.02)
    pytest.fail(f"PID files {names} not all written within {timeout}s")


def _assert_all_dead(pids: list[int], timeout: float = 2.0) -> None:
    """Assert that none of ``pids`` is alive, allowing ``timeout`` s for reaping."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not alive, f"processes still alive after launcher exit: {alive}"


@contextlib.contextmanager
def _launcher(
    args: list[str], pid_dir: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """Start ``python -m actorgrad <args>``; always kill it and recorded PIDs afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "actorgrad", *args],
        cwd=ROOT,
        env=env if env is not None else _env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(Exception):
            proc.communicate(timeout=10)
        if pid_dir is not None:
            for pid in _read_pids(pid_dir):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _run(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 20.0
) -> tuple[int, str, str]:
    """Run the launcher to completion; return (returncode, stdout, stderr)."""
    with _launcher(args, env=env) as proc:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err


def _env_reports(stdout: str) -> dict[int, dict[str, object]]:
    """Parse the ``[rank N] ENV {...}`` lines printed by ``report_env.py``."""
    reports: dict[int, dict[str, object]] = {}
    for line in stdout.splitlines():
        if line.startswith("[rank ") and "] ENV " in line:
            prefix, payload = line.split("] ENV ", 1)
            reports[int(prefix[len("[rank ") :])] = json.loads(payload)
    return reports


def test_three_ranks_get_distinct_ranks_and_shared_port_and_key() -> None:
    code, out, err = _run(["launch", "--nproc", "3", str(SCRIPTS / "report_env.py")])
    assert code == 0, err
    for r in range(3):
        assert f"[rank {r}] ENV " in out
    reports = _env_reports(out)
    assert sorted(reports) == [0, 1, 2]
    for r, rep in reports.items():
        assert rep["rank"] == str(r)
        assert rep["local_rank"] == str(r)
        assert rep["world_size"] == "3"
        assert rep["local_world_size"] == "3"
        assert rep["master_addr"] == "127.0.0.1"
        assert rep["unbuffered"] == "1"
        assert rep["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS", "1")  # as torchrun
        assert rep["auth_key_set"] is True
        assert rep["auth_key_len"] == 64  # secrets.token_hex(32)
    ports = {(rep["master_port"], rep["store_port"]) for rep in reports.values()}
    assert len(ports) == 1
    port, store_port = ports.pop()
    assert isinstance(port, str) and 1 <= int(port) <= 65535
    assert isinstance(store_port, str) and 1 <= int(store_port) <= 65535 and store_port != port
    assert len({rep["auth_key_sha256"] for rep in reports.values()}) == 1


def test_existing_auth_key_and_explicit_port_pass_through() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = _run(
        ["launch", "--nproc", "2", "--master-port", str(port), str(SCRIPTS / "report_env.py")],
        env=_env(ACTORGRAD_AUTH_KEY="not-so-secret"),
    )
    assert code == 0, err
    reports = _env_reports(out)
    assert sorted(reports) == [0, 1]
    expected = hashlib.sha256(b"not-so-secret").hexdigest()
    for rep in reports.values():
        assert rep["auth_key_sha256"] == expected
        assert rep["master_port"] == str(port)


@pytest.mark.parametrize("order", ["torch-first", "actorgrad-first"])
def test_a_script_using_torch_distributed_too_finds_both_rendezvous(order: str) -> None:
    """As under torchrun: torch.distributed's env:// store binds MASTER_PORT, so
    actorgrad's rendezvous has a port of its own (both bound MASTER_PORT: whichever
    came second failed with 'Address already in use')."""
    code, out, err = _run(["launch", "--nproc", "2", str(SCRIPTS / "with_torch_distributed.py"), order],
                          timeout=90)
    assert code == 0, out + err
    assert "[rank 0] sum 3 squared 1" in out and "[rank 1] sum 3 squared 0" in out, out + err


def test_failing_rank_stops_all_ranks(tmp_path: Path) -> None:
    args = [
        "launch",
        "--nproc",
        "3",
        str(SCRIPTS / "sleeper.py"),
        str(tmp_path),
        "--fail-rank",
        "1",
        "--fail-code",
        "3",
        "--spawn-child-rank",
        "0",
    ]
    start = time.monotonic()
    with _launcher(args, pid_dir=tmp_path) as proc:
        out, err = proc.communicate(timeout=10)
        elapsed = time.monotonic() - start
        assert proc.returncode == 3, (out, err)
        assert elapsed < 10
        assert "rank 1 exited with code 3" in err
        assert "[rank 1] rank 1 failing with code 3" in err
        pids = _read_pids(tmp_path)
        assert len(pids) == 4  # 3 ranks + rank 0's grandchild
        _assert_all_dead(pids)


def test_script_args_pass_through() -> None:
    extra = ["--foo", "bar", "--nproc", "7", "-h", "--", "baz"]
    code, out, err = _run(["launch", "--nproc", "2", str(SCRIPTS / "echo_argv.py"), *extra])
    assert code == 0, err
    for r in range(2):
        assert f"[rank {r}] ARGV {json.dumps(extra)}" in out.splitlines()
        assert f"[rank {r}] to-stderr" in err.splitlines()


def test_missing_script_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "does_not_exist.py"
    code, out, err = _run(["launch", "--nproc", "2", str(missing)])
    assert code == 2
    assert f"actorgrad launch: script not found: {missing}" in err
    assert "[rank" not in out + err


def test_nproc_must_be_positive() -> None:
    code, _out, err = _run(["launch", "--nproc", "0", str(SCRIPTS / "echo_argv.py")])
    assert code == 2
    assert "--nproc" in err


def test_torchrun_spellings_of_the_options_are_taken() -> None:
    code, out, err = _run(["launch", "--nnodes", "1", "--node_rank", "0", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", str(SCRIPTS / "echo_argv.py"), "x"])
    assert code == 0, err
    assert {f"[rank {r}] ARGV {json.dumps(['x'])}" for r in range(2)} <= set(out.splitlines())
    code, _out, err = _run(["launch", "--node-rank", "1", "--nproc-per-node", "2", str(SCRIPTS / "echo_argv.py")])
    assert code == 2 and "this machine only" in err  # (SCRIPT was taken for "1": a missing --nproc)


def test_version() -> None:
    code, out, _err = _run(["--version"])
    assert code == 0
    assert out.startswith("actorgrad ")


def test_sigint_stops_all_ranks(tmp_path: Path) -> None:
    # Rank 1 ignores SIGINT/SIGTERM, so it must be SIGKILLed after the grace period;
    # rank 0 spawns a grandchild that must die with its process group.
    args = [
        "launch",
        "--nproc",
        "3",
        "--grace-period",
        "1",
        str(SCRIPTS / "sleeper.py"),
        str(tmp_path),
        "--spawn-child-rank",
        "0",
        "--ignore-signals-rank",
        "1",
    ]
    with _launcher(args, pid_dir=tmp_path) as proc:
        _wait_for_pid_files(tmp_path, ["rank0.pid", "rank1.pid", "rank2.pid", "grandchild.pid"])
        pids = _read_pids(tmp_path)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
        assert time.monotonic() - start < 10
        assert proc.returncode == 130, (out, err)
        assert "received SIGINT" in err
        assert "actorgrad launch: killing rank(s) 1: still running after 1s\n" in err
        _assert_all_dead(pids)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT], ids=lambda s: signal.Signals(s).name)
def test_hangup_and_termination_stop_all_ranks(tmp_path: Path, signum: int) -> None:
    # SIGHUP is what a closed terminal or a dropped ssh session sends: the ranks run in
    # their own sessions, so only the launcher gets it and must pass the stop on
    args = ["launch", "--nproc", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path), "--spawn-child-rank", "1"]
    with _launcher(args, pid_dir=tmp_path) as proc:
        _wait_for_pid_files(tmp_path, ["rank0.pid", "rank1.pid", "grandchild.pid"])
        pids = _read_pids(tmp_path)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 128 + signum, (out, err)
        assert f"received {signal.Signals(signum).name}" in err
        _assert_all_dead(pids)


@pytest.mark.parametrize("ending", ["ok", "fail", "no-shutdown", "other-fails"])
def test_trace_is_written_whole_however_the_run_ends(tmp_path: Path, ending: str) -> None:
    # (a run that failed, or whose script never shut down, wrote no trace: only a
    # graceful shutdown exported it, and the run one wants to look at is the failed one;
    # nor one whose rank 0 the launcher stopped with SIGTERM after another rank failed)
    target = tmp_path / "trace.json"
    code, _out, err = _run(["launch", "--nproc", "2", "--trace", str(target), str(SCRIPTS / "traced.py"), ending],
                           timeout=60)
    assert code == (1 if ending in ("fail", "other-fails") else 0), err
    events = json.loads(target.read_text())["traceEvents"]
    calls = [e for e in events if e["pid"] == 0 and e["name"] == "call rpc.call"]
    served = [e for e in events if e["pid"] == 1 and e["name"] == "serve rpc.call"]
    assert len(calls) >= 3, len(calls)
    if ending != "other-fails":  # (there rank 1 is gone when rank 0 collects the trace)
        assert len(served) >= 3, len(served)
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # nothing half-written beside it


def test_trace_into_a_missing_directory_exits_2_before_any_rank_runs(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "trace.json"
    code, out, err = _run(["launch", "--nproc", "2", "--trace", str(target), str(SCRIPTS / "echo_argv.py")])
    assert code == 2
    assert "--trace" in err and "does not exist" in err
    assert "[rank" not in out + err


def test_master_port_in_use_exits_2() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out, err = _run(
            ["launch", "--nproc", "2", "--master-port", str(port), str(SCRIPTS / "echo_argv.py")]
        )
    assert code == 2
    assert str(port) in err
    assert "in use" in err
    assert "[rank" not in out + err


def test_the_launcher_starts_without_importing_torch() -> None:
    # the ranks import torch themselves; the launcher before them only waited for it
    probe = ("import sys, actorgrad, actorgrad.cli; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    out = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
    # and the names of the package are there on first use
    use = ("import actorgrad as ag; print(ag.WorkerLost.__module__, ag.autograd.backward is ag.dist_backward, "
           "all(hasattr(ag, m) for m in ('rpc', 'runtime', 'wire', 'optim', 'parallel', 'collective')))")
    out = subprocess.run([sys.executable, "-c", use], env=_env(), capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["actorgrad", "True", "True"]


CASES = SCRIPTS / "output_cases.py"


def test_a_failure_is_acted_on_while_nobody_reads_the_output(tmp_path: Path) -> None:
    """A reader of the launcher's stdout that pauses (a pager, a paused terminal) must
    neither keep the launcher from stopping the ranks when one fails nor lose lines."""
    with _launcher(["launch", "--nproc", "2", str(CASES), "flood", str(tmp_path)]) as proc:
        _wait_for_pid_files(tmp_path, ["rank0.pid"], timeout=20)
        rank0 = int((tmp_path / "rank0.pid").read_text())
        _assert_all_dead([rank0], timeout=10)  # stopped although stdout is not read yet
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 3, err
    assert "rank 1 exited with code 3" in err
    lines = [line for line in out.splitlines() if line.startswith("[rank 0] line ")]
    assert lines == [f"[rank 0] line {i:05d} " + "x" * 20 for i in range(20000)]


def test_the_rank_that_failed_first_is_reported(tmp_path: Path) -> None:
    """Rank 0 exits a few milliseconds after rank 1, because rank 1 went: rank 1 is
    the cause, and its exit code is the launcher's."""
    code, _out, err = _run(["launch", "--nproc", "2", str(CASES), "race", str(tmp_path)])
    assert code == 3, err
    assert "rank 1 exited with code 3" in err


def test_a_rank_that_fails_while_serving_is_heard_from() -> None:
    """Rank 1 fails while rank 0 waits on it: rank 0 exits first (WorkerLost). Rank 1
    used to be terminated before its own traceback was printed, and rank 0's error
    read like an orderly shutdown ('connection closed (worker shut down)')."""
    code, out, err = _run(["launch", "--nproc", "2", str(SCRIPTS / "fails_while_serving.py")], timeout=60)
    assert code == 1, err
    assert "[rank 1] ValueError: rank 1 fails on purpose" in out + err
    assert ("is lost: connection closed (it stopped on an error: ValueError: rank 1 fails on purpose)"
            in out + err)
    assert "rank 0 exited with code 1" in err
    assert "rank 1 also exited with code 1 (after rank 0)" in err
    assert "terminating" not in err


def test_ctrl_c_while_the_others_are_given_time_to_exit(tmp_path: Path) -> None:
    """A Ctrl-C after a rank failed, while the others have a few seconds to exit, stops
    them as a Ctrl-C does (it only ended that wait, unreported, and the ranks got
    SIGTERM; a second Ctrl-C then did not count as one)."""
    with _launcher(["launch", "--nproc", "2", str(SCRIPTS / "fails_then_waits.py"), str(tmp_path)]) as proc:
        _wait_for_pid_files(tmp_path, ["rank1.pid"], timeout=20)
        time.sleep(0.5)  # rank 0 has failed: the launcher waits for rank 1
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
    assert "rank 0 exited with code 3; the other rank(s) have 3s to exit" in err, err
    assert "received SIGINT; stopping all 2 ranks" in err, err
    assert proc.returncode == 128 + signal.SIGINT


def test_an_unfinished_line_is_shown_while_its_rank_waits(tmp_path: Path) -> None:
    """A prompt or a progress bar without a newline reaches the screen before the
    rest of its line (it was held back until the rank ended)."""
    with _launcher(["launch", "--nproc", "2", str(CASES), "prompt", str(tmp_path)]) as proc:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        seen = b""
        deadline = time.monotonic() + 20
        while b"[rank 0] prompt> " not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                seen += chunk
        assert b"[rank 0] prompt> " in seen
        (tmp_path / "answer").touch()
        rest, _err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert (seen.decode() + rest).endswith("[rank 0] prompt> answered\n")


def test_ranks_share_stdin_and_bytes_pass_unchanged(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "actorgrad", "launch", "--nproc", "2", str(CASES), "stdin", str(tmp_path)],
        cwd=ROOT, env=_env(), input=b"hello\n", capture_output=True, timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert b"[rank 0] got 'hello'\n" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "actorgrad", "launch", "--nproc", "1", str(CASES), "bytes", str(tmp_path)],
        cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"[rank 0] bytes \xff\xfe end\n[rank 0] dos line\r\n"


def test_modules_and_directories_run_as_with_python(tmp_path: Path) -> None:
    code, out, err = _run(["launch", "--nproc", "2", "-m", "echo_argv", "a", "-m"],
                          env=_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(SCRIPTS)])))
    assert code == 0, err
    for r in range(2):
        assert f"[rank {r}] ARGV {json.dumps(['a', '-m'])}" in out.splitlines()
    (tmp_path / "__main__.py").write_text("import os\nprint('main of', os.environ['RANK'])\n")
    code, out, err = _run(["launch", "--nproc", "2", str(tmp_path)])
    assert code == 0, err
    assert {"[rank 0] main of 0", "[rank 1] main of 1"} <= set(out.splitlines())
    code, _out, err = _run(["launch", "--nproc", "2", "--nnodes", "2", str(tmp_path)])
    assert code == 2 and "this machine only" in err
    code, _out, err = _run(["launch", "--nproc", "2"])  # (said "required: SCRIPT, ARGS")
    assert code == 2 and "required: SCRIPT (" in err and "ARGS" not in err


def test_a_launcher_without_stdout_or_stderr_still_ends(tmp_path: Path) -> None:
    """With its stdout or stderr closed (``>&-``) Python has no sys.stdout: the
    launcher must drop that output, not wait for good to write it."""
    for closed in ("1", "2"):
        proc = subprocess.run(
            ["bash", "-c", f'exec "$0" -m actorgrad launch --nproc 2 "$1" >&{closed}- ', sys.executable,
             str(SCRIPTS / "echo_argv.py")],
            cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
        )
        assert proc.returncode == 0, proc.stderr


def test_output_lines_of_two_ranks_never_run_together() -> None:
    """Sans processes: what the sink makes of partial lines, carriage returns and
    \\r\\n from two sources."""
    import io

    from actorgrad._rank_output import Sink, finish

    buffer = io.BytesIO()
    sink = Sink(io.TextIOWrapper(buffer, write_through=True), "test")
    a, b = object(), object()
    sink.put_line(a, b"[a] ", b"step 1", False)  # a's progress bar, shown unfinished
    sink.put_line(b, b"[b] ", b"\r", True)  # b's carriage return at its line start
    sink.put_line(b, b"[b] ", b"line\n", True)  # ends a's line on screen first
    sink.put_line(a, b"[a] ", b"crlf\r", True)  # \r\n whose \n came apart
    sink.put_line(a, b"[a] ", b"\n", True)
    sink.message("done")
    finish([], (sink,), lambda: False)
    assert buffer.getvalue() == b"[a] step 1\n[b] line\n[a] crlf\r\ndone\n"


def test_a_tcp_init_method_without_a_port_one_can_meet_at_says_why() -> None:
    from actorgrad.runtime._rendezvous import parse_init_method

    with pytest.raises(ValueError, match="port 0 cannot be agreed on by every rank"):
        parse_init_method("tcp://127.0.0.1:0", 0, 2)
    with pytest.raises(ValueError, match="needs tcp://HOST:PORT"):
        parse_init_method("tcp://127.0.0.1", 0, 2)


def test_env_init_takes_the_launchers_store_port_only_beside_its_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    from actorgrad.runtime._rendezvous import parse_init_method

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("ACTORGRAD_MASTER_PORT", "29501")
    monkeypatch.setenv("ACTORGRAD_MASTER_PORT_BESIDE", "29500")
    assert parse_init_method("env://", 0, 2)[2] == 29501  # as the launcher set them
    monkeypatch.setenv("MASTER_PORT", "31000")  # a group of the program's own, inside a rank
    assert parse_init_method("env://", 0, 2)[2] == 31000
    monkeypatch.delenv("ACTORGRAD_MASTER_PORT")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert parse_init_method("env://", 0, 2)[2] == 29500
