"""The pytest plugin, exercised in fresh pytest runs (pytester)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import sys
import time
import types
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TEST_BODY = '''
import pytest
import torch
import actorgrad as ag

{mark}
@pytest.mark.world_size(3)
async def test_three_workers(actorgrad_group):
    assert ag.get_worker_info().name == "worker0"
    assert ag.get_world_size() == 3
    total = await ag.rpc_async("worker2", torch.add, args=(torch.ones(2), 1))
    assert torch.equal(total, torch.full((2,), 2.0))

{mark}
async def test_default_two(actorgrad_group):
    assert len(actorgrad_group.workers) == 2
    assert await ag.rpc_async("worker1", max, args=(3, 4)) == 4

{mark}
async def test_fails_and_still_tears_down(actorgrad_group):
    await ag.rpc_async("worker1", max, args=(1, 2))
    raise AssertionError("boom")

{mark}
async def test_autograd_in_group(actorgrad_group):
    a = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as cid:
        b = await ag.rpc_async("worker1", torch.mul, args=(a, 2.0))
        await ag.autograd.backward(cid, [b.sum()])
        assert torch.equal(ag.autograd.get_gradients(cid)[a], torch.full((3,), 2.0))

{mark}
@pytest.mark.world_size(3)
async def test_body_ends_with_shutdown(actorgrad_group):
    # as torch RPC tests end with rpc.shutdown(): the other workers leave with worker0
    # (a graceful shutdown waits for them: a minute-long wait means they did not follow)
    import time
    await ag.rpc_async("worker1", max, args=(1, 2))
    start = time.monotonic()
    await ag.shutdown()
    assert time.monotonic() - start < 10
    assert all(w.closed for w in actorgrad_group.workers)
'''


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_plugin_fixture_in_both_asyncio_modes(pytester: pytest.Pytester, mode: str) -> None:
    mark = "@pytest.mark.asyncio" if mode == "strict" else ""
    pytester.makepyfile(test_user=TEST_BODY.format(mark=mark))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-o", f"asyncio_mode={mode}",
        "-o", "asyncio_default_fixture_loop_scope=function", "-q",
    )
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: boom*"])
    # every group was shut down: no worker is left running in the test process
    assert "Task was destroyed" not in result.stdout.str()


USER_SUITE = '''
import pytest
import torch
import actorgrad as ag


def add_one(x):
    return x + 1


async def test_unmarked_in_strict_mode(actorgrad_group):
    assert await ag.rpc_async("worker1", add_one, args=(torch.ones(2),)) is not None


@pytest.mark.asyncio(loop_scope="module")
async def test_on_a_module_loop(actorgrad_group):
    assert await ag.rpc_async("worker1", max, args=(3, 4)) == 4


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.world_size(3)
async def test_on_the_session_loop(actorgrad_group):
    assert await ag.rpc_async("worker2", add_one, args=(1,)) == 2


async def test_a_worker_process_runs_this_modules_function(actorgrad_process_group):
    assert await ag.rpc_async("worker1", add_one, args=(41,)) == 42


@pytest.mark.world_size(True)
async def test_a_bool_is_no_world_size(actorgrad_group):
    pass
'''


@pytest.mark.slow
def test_plugin_in_a_users_own_suite(pytester: pytest.Pytester) -> None:
    """What a user's suite does outside this repository: strict mode with no asyncio
    marks, test loops of other scopes, fixture loops defaulting to the session's, and
    a test directory without __init__.py whose functions worker processes must import."""
    pytester.mkdir("tests")
    pytester.path.joinpath("tests", "test_users.py").write_text(USER_SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-o", "asyncio_mode=strict",
        "-o", "asyncio_default_fixture_loop_scope=session", "-q", "tests",
    )
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*world_size needs a positive int, got True*"])


@pytest.mark.slow
def test_process_group_fixture(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_proc='''
import os
import actorgrad as ag

async def test_separate_process(actorgrad_process_group):
    pid = await ag.rpc_async("worker1", os.getpid)
    assert pid != os.getpid()
    assert pid in actorgrad_process_group.pids
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "asyncio_mode=auto", "-q")
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_what_a_process_groups_workers_print_is_in_the_tests_captured_output(pytester: pytest.Pytester) -> None:
    """The echo follows the workers' logs every 0.1 s: what they printed just before the
    test ended came at teardown, under the wrong heading of a failing test's report."""
    pytester.makepyfile(test_prints='''
import actorgrad as ag

def hello():
    print("hello from", ag.get_worker_info().name, flush=True)
    return 1

async def test_prints_then_fails(actorgrad_process_group):
    assert await ag.rpc_async("worker1", hello) == 2
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "asyncio_mode=auto", "-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*- Captured stdout call -*", "[[]worker1[]] hello from worker1"])


def test_the_plugin_loads_no_torch_until_a_group_starts() -> None:
    """Every pytest run of an environment with actorgrad imports the plugin: it took
    two seconds (torch) also in projects that never use it."""
    import subprocess

    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    code = "import sys, actorgrad.testing._plugin; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("forked", [True, False], ids=["fork-server", "new-interpreters"])
async def test_local_group_reports_a_worker_that_dies_at_start(tmp_path, monkeypatch, forked) -> None:  # type: ignore[no-untyped-def]
    # e.g. a notebook that put actorgrad on sys.path by hand: the worker process (or the
    # fork server that would fork it) cannot import it. The error must come when the
    # process exits, not after init_timeout, and show why.
    import time

    import actorgrad as ag
    from actorgrad.testing import local_group

    monkeypatch.setenv("ACTORGRAD_FORK_SERVER", "1" if forked else "0")
    shadow = tmp_path / "actorgrad"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('this actorgrad cannot be imported')\n")
    monkeypatch.chdir(tmp_path)  # `python -m` puts the working directory first on sys.path
    start = time.monotonic()
    expected = "the fork server .* exited" if forked else "worker1's process exited"
    with pytest.raises(RuntimeError, match=expected) as info:
        await local_group(2, options=ag.RpcOptions(init_timeout=60), env={"PYTHONPATH": str(tmp_path)})
    assert time.monotonic() - start < 30
    assert "this actorgrad cannot be imported" in str(info.value)
    # the log it points to is kept for the user; this test has read it
    logged = re.search(r"\((/\S+\.log)\)", str(info.value))
    assert logged is not None and os.path.isfile(logged.group(1))  # noqa: ASYNC240
    if forked:
        os.unlink(logged.group(1))
    else:
        shutil.rmtree(os.path.dirname(logged.group(1)))


async def test_local_group_keeps_logs_only_of_workers_that_failed_on_their_own() -> None:
    import actorgrad as ag
    from actorgrad.testing import local_group

    killed = await local_group(3)
    killed.kill(2)  # as a fault test does: its end is no failure of the worker
    await killed.shutdown(graceful=False)
    assert not os.path.exists(killed.logdir)  # noqa: ASYNC240

    crashed = await local_group(2)
    try:
        with contextlib.suppress(ag.WorkerLost):
            await ag.rpc_async("worker1", os._exit, args=(3,), timeout=10)
    finally:
        await crashed.shutdown(graceful=False)
    assert crashed.processes[0].returncode == 3
    assert os.path.exists(os.path.join(crashed.logdir, "worker1.log"))  # noqa: ASYNC240
    shutil.rmtree(crashed.logdir)


async def test_shutting_down_a_group_again_leaves_the_group_started_since() -> None:
    """A notebook's shutdown cell run twice, with a new group started in between."""
    import actorgrad as ag
    from actorgrad.testing import local_group

    old = await local_group(2)
    await old.shutdown()
    new = await local_group(2)
    try:
        await old.shutdown()
        assert await ag.rpc_async("worker1", max, args=(1, 2), timeout=10) == 2
    finally:
        await new.shutdown()


def _options_here() -> tuple[float, bool, bool]:
    from actorgrad.runtime import get_worker

    options = get_worker().options
    return options.rpc_timeout, options.trace, options.auth_key == "a key of ours"


async def test_local_group_workers_import_like_this_process_and_share_its_options(
    tmp_path, monkeypatch  # type: ignore[no-untyped-def]
) -> None:
    """As multiprocessing's spawn does: a module found through this process's sys.path
    (a notebook's sys.path.insert, pytest's rootdir or pythonpath) is found by the
    workers too; and the options given to local_group are every worker's."""
    import actorgrad as ag
    from actorgrad.testing import local_group

    (tmp_path / "helpers_only_here.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import helpers_only_here  # type: ignore[import-not-found]

    options = ag.RpcOptions(rpc_timeout=7.5, trace=True, auth_key="a key of ours")
    group = await local_group(2, options=options)
    try:
        assert await ag.rpc_async("worker1", helpers_only_here.double, args=(21,)) == 42
        assert await ag.rpc_async("worker1", _options_here) == (7.5, True, True)
    finally:
        await group.shutdown()
    assert not os.path.exists(group.logdir)  # noqa: ASYNC240


async def test_local_group_workers_import_modules_loaded_from_their_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A module loaded from its file under a name that no finder knows (pytest's
    importlib import mode, importlib.util.spec_from_file_location) is found by the
    workers too, and its packages with it."""
    import actorgrad as ag
    from actorgrad.testing import local_group

    (tmp_path / "loaded_by_file.py").write_text("def triple(x):\n    return 3 * x\n")
    spec = importlib.util.spec_from_file_location("made.up.loaded_by_file", tmp_path / "loaded_by_file.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # its packages, without files, as pytest makes them (pickle imports the name)
    names = {"made": types.ModuleType("made"), "made.up": types.ModuleType("made.up"), spec.name: module}
    sys.modules.update(names)
    try:
        spec.loader.exec_module(module)
        group = await local_group(2)
        try:
            assert await ag.rpc_async("worker1", module.triple, args=(14,)) == 42
        finally:
            await group.shutdown()
    finally:
        for name in names:
            del sys.modules[name]


IMPORTLIB_MODE_SUITE = '''
import dataclasses
import actorgrad as ag


def double(x):
    return 2 * x


@dataclasses.dataclass
class Box:
    value: int


def unbox(box):
    return box.value


async def test_a_worker_process_imports_a_module_pytest_did_not_put_on_the_path(actorgrad_process_group):
    assert await ag.rpc_async("worker1", double, args=(21,)) == 42
    assert await ag.rpc_async("worker1", unbox, args=(Box(7),)) == 7
'''


@pytest.mark.slow
@pytest.mark.parametrize("other_tests", [False, True])
def test_plugin_with_pytests_importlib_import_mode(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                   other_tests: bool) -> None:
    """Under --import-mode=importlib, pytest names test modules after their path from
    the root folder (here not on sys.path: pytest runs from its parent). Another
    folder named ``tests`` on the path (a stray site-packages/tests) made the workers
    look for them there."""
    root = pytester.mkdir("project")
    root.joinpath("pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
    root.joinpath("tests", "sub").mkdir(parents=True)
    root.joinpath("tests", "sub", "test_deep.py").write_text(IMPORTLIB_MODE_SUITE)
    if other_tests:
        other = pytester.mkdir("other")
        other.joinpath("tests").mkdir()
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(other), os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--import-mode=importlib", "-q", "project",
    )
    result.assert_outcomes(passed=1)


async def test_groups_started_one_after_another_do_not_keep_each_other_alive(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A test suite or a notebook starts groups again and again in one process: the
    workers of a group shut down are freed, and garbage an earlier start moved out of
    the collector's reach (init_rpc freezes what lives then) is collected once enough of
    it was frozen (here: at once)."""
    import gc
    import weakref

    from actorgrad import _api
    from actorgrad.testing import start_in_process

    monkeypatch.setattr(_api, "_REFREEZE_GROWTH", 0)

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    first = await start_in_process(2)
    old_worker = weakref.ref(first.workers[0])
    junk = Cycle()
    junk_ref = weakref.ref(junk)
    gc.freeze()  # as a group started after this one would freeze it
    await first.shutdown()
    del first, junk
    second = await start_in_process(2)  # its init_rpc collects what was dropped
    await second.shutdown()
    del second
    gc.collect()
    assert junk_ref() is None
    assert old_worker() is None


async def test_local_group_started_twice_says_to_shut_the_first_down() -> None:
    """A notebook cell run twice: refused before any process starts, saying what to do."""
    from actorgrad.testing import local_group

    def worker_children() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):  # noqa: ASYNC240 - a quick scan
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:  # noqa: ASYNC230
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:  # noqa: ASYNC230
                    cmdline = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid in parents and int(entry) not in servers and b"actorgrad.testing._serve" in cmdline:
                found.append(int(entry))
        return found

    def fork_servers() -> set[int]:
        from actorgrad.testing import _forkserver

        return {server.process.pid for server in [*_forkserver._retired, _forkserver._server] if server}

    group = await local_group(2)
    try:
        servers = fork_servers()  # (workers are forked by a fork server, or ours)
        parents = {os.getpid(), *servers}
        with pytest.raises(RuntimeError, match="group.shutdown"):
            await local_group(2)
        assert worker_children() == group.pids  # the first group's worker only
    finally:
        await group.shutdown()


def test_a_program_that_ends_without_shutting_its_group_down_ends_the_workers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """They waited for worker0's sockets, open until the process was gone, and were
    killed after 3 s with their logs kept as if they had failed."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "no_shutdown.py"
    script.write_text(textwrap.dedent('''
        import asyncio, time

        import actorgrad as ag

        loop = asyncio.new_event_loop()
        group = loop.run_until_complete(ag.local_group(2))
        assert ag.rpc_sync("worker1", max, args=(1, 2)) == 2
        from actorgrad.testing import _forkserver
        server = _forkserver._server.process.pid if _forkserver._server else group.processes[0].pid
        print(group.logdir, group.processes[0].pid, server, time.monotonic(), flush=True)
    '''))
    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    logdir, pid, server, printed = proc.stdout.split()
    assert ended - float(printed) < 2.5, "exit waited for the workers"
    assert not os.path.exists(logdir)  # noqa: ASYNC240
    for gone in (pid, server):  # the worker, and the fork server that forked it
        with pytest.raises(ProcessLookupError):
            os.kill(int(gone), 0)


def test_a_worker_whose_program_ended_while_the_group_formed_ends_too() -> None:
    """A notebook kernel killed during local_group left its workers waiting for the
    rendezvous for the whole init_timeout (a minute), and the fork server with them."""
    import subprocess

    from actorgrad.testing import free_port

    parent = subprocess.Popen(["true"])
    parent.wait()  # its pid names a program that has ended
    root = Path(__file__).parents[2]
    env = dict(os.environ, ACTORGRAD_AUTH_KEY="k",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    # rank 1 of a group whose rendezvous (rank 0) never comes
    worker = subprocess.run(
        [sys.executable, "-m", "actorgrad.testing._serve", "1", "2", f"tcp://127.0.0.1:{free_port()}",
         str(parent.pid)], env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 20, worker.stderr
    assert worker.returncode == 0, worker.stderr


def test_what_the_workers_print_shows_in_worker0s_output(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """It went only to log files, removed at shutdown: a notebook's remote print()
    showed nowhere."""
    import subprocess
    import textwrap

    script = tmp_path / "prints.py"
    script.write_text(textwrap.dedent('''
        import asyncio, sys

        import actorgrad as ag

        def chatty(n):
            print("hello from", ag.get_worker_info().name, n)
            for i in range(60_000):  # just before the group ends: shown to the last
                print(f"line {i} " + "x" * 90)
            print("no newline at the end", end="", file=sys.stderr)
            return n

        async def main(echo):
            group = await ag.local_group(3, echo=echo)
            results = [await ag.rpc_async(f"worker{r}", chatty, args=(r,)) for r in (1, 2)]
            print("results", results, flush=True)
            await group.shutdown()

        asyncio.run(main(sys.argv[1] == "echo"))
    '''))
    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    for mode in ("echo", "quiet"):
        proc = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert "results [1, 2]" in lines, proc.stdout
        many = [line for line in lines if line.startswith("[worker1] line ")]
        assert len(many) == (60_000 if mode == "echo" else 0), len(many)
        shown = sorted(line for line in lines if line.startswith("[worker") and " line " not in line)
        if mode == "echo":
            assert shown == ["[worker1] hello from worker1 1", "[worker1] no newline at the end",
                             "[worker2] hello from worker2 2", "[worker2] no newline at the end"], proc.stdout
        else:
            assert shown == [], proc.stdout
