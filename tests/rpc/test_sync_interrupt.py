"""Ctrl-C during a blocking call of a plain script whose main thread drives the loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

SCRIPT = textwrap.dedent('''
    import asyncio, os, random, signal, sys, threading, time

    import torch

    import actorgrad as ag

    random.seed(int(sys.argv[1]))
    loop = asyncio.new_event_loop()
    group = loop.run_until_complete(ag.local_group(2))
    x = torch.ones(1_000_000)  # 4 MB each way: a read of it spans several callbacks


    def interrupt_soon(delay):
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGINT)


    for attempt in range(12):
        threading.Thread(target=interrupt_soon, args=(0.1 + random.random() * 0.3,), daemon=True).start()
        try:
            while True:
                ag.rpc_sync("worker1", torch.add, args=(x, 1))
        except KeyboardInterrupt:
            pass
        assert ag.rpc_sync("worker1", max, args=(attempt, -1), timeout=10) == attempt
        print("ok", attempt, flush=True)
    loop.run_until_complete(group.shutdown(timeout=15))
''')


@pytest.mark.parametrize("seed", [1, 2])
def test_interrupts_during_rpc_sync_leave_the_group_working(tmp_path: Path, seed: int) -> None:
    """A KeyboardInterrupt raised where it lands, inside a transport's callback, lost
    bytes already read off the socket: the connection broke and the group with it."""
    script = tmp_path / "interrupted.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 12, proc.stdout + proc.stderr


EXITS_WHILE_A_CALL_RUNS = textwrap.dedent('''
    import asyncio, atexit, sys, time

    import torch

    import actorgrad as ag
    from actorgrad.testing import free_port

    atexit.register(print, "the program's own exit handler ran", flush=True)


    def busy():  # a call a peer made, still running torch code as the program fails
        a = torch.randn(200, 200)
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            a = torch.tanh(a @ a)


    async def start_call():
        return ag.rpc_async("w0", busy, timeout=0)


    loop = asyncio.new_event_loop()
    loop.run_until_complete(ag.init_rpc("w0", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}"))
    call = loop.run_until_complete(start_call())
    loop.run_until_complete(asyncio.sleep(0.5))  # busy() runs on a pool thread by now
    raise RAISED("the program fails")  # (a plain script: nothing shuts the worker down)
''')


@pytest.mark.parametrize("raised", ["ValueError", "KeyboardInterrupt"])
def test_a_program_that_fails_while_its_threads_run_torch_exits_with_its_status(tmp_path: Path, raised: str) -> None:
    """A pool thread stopped inside torch's C++ at exit aborted the process (status 134,
    "terminate called without an active exception") in place of the failure's status:
    running calls get as long to finish as closing the pool gives them, and the
    program's exit handlers all run."""
    script = tmp_path / "fails.py"
    script.write_text(EXITS_WHILE_A_CALL_RUNS.replace("RAISED", raised))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == (1 if raised == "ValueError" else -signal.SIGINT), proc.stderr
    assert f"{raised}: the program fails" in proc.stderr
    assert "terminate called" not in proc.stderr
    assert "the program's own exit handler ran" in proc.stdout


THREAD_BESIDE_THE_TRAINING_LOOP = textwrap.dedent('''
    import threading, time

    import torch

    import actorgrad as ag


    def slow_metric(x):
        time.sleep(0.02)
        return x.sum()


    def forward(x, w):
        return torch.tanh(x @ w)


    group = ag.run_sync(ag.local_group(2))  # before init: a loop of this thread's own
    stop = threading.Event()


    def metrics():  # another thread in rpc_sync, driving the loop in turns
        while not stop.is_set():
            ag.rpc_sync("worker1", slow_metric, args=(torch.ones(3),))


    thread = threading.Thread(target=metrics)
    thread.start()
    w = torch.randn(4, 4, requires_grad=True)
    for step in range(20):
        x = torch.randn(4, 4)
        with ag.autograd.context() as context_id:
            y = ag.rpc_sync("worker1", forward, args=(x, w))
            time.sleep(0.01)
            ag.run_sync(ag.autograd.backward(context_id, [y.sum()]))
            grad = ag.autograd.get_gradients(context_id)[w]
        local_w = w.detach().clone().requires_grad_()
        torch.tanh(x @ local_w).sum().backward()
        torch.testing.assert_close(grad, local_w.grad)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    ag.run_sync(group.shutdown(timeout=15))
    print("trained", step + 1, flush=True)
''')


def test_run_sync_takes_turns_with_threads_in_rpc_sync(tmp_path: Path) -> None:
    """A plain script's main thread runs backward (and starts and stops the group)
    with run_sync while another thread calls rpc_sync: ``loop.run_until_complete``
    failed ("This event loop is already running") whenever that thread drove the loop."""
    script = tmp_path / "plain.py"
    script.write_text(THREAD_BESIDE_THE_TRAINING_LOOP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trained 20" in proc.stdout, proc.stdout + proc.stderr


async def test_run_sync_refuses_what_is_not_awaitable_and_a_running_loop() -> None:
    import actorgrad as ag

    with pytest.raises(TypeError, match="awaitable"):
        ag.run_sync(42)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="await it instead"):
        ag.run_sync(ag.init_rpc("w", rank=0, world_size=1))


def test_run_sync_before_init_rpc_keeps_one_loop_per_thread() -> None:
    import asyncio
    import threading

    import actorgrad as ag

    async def running_loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    loops: list[asyncio.AbstractEventLoop] = []

    def in_a_thread() -> None:  # (a thread of its own: the test's loop stays as it is)
        loops.extend(ag.run_sync(running_loop()) for _ in range(3))
        loops[0].close()

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(30)
    assert len(loops) == 3 and len({id(loop) for loop in loops}) == 1


SIGTERM_UNDER_TRACE = textwrap.dedent('''
    import asyncio, os, signal, sys, threading, time

    import actorgrad as ag
    import actorgrad.runtime._worker as worker_module
    from actorgrad.testing import free_port

    arrange = worker_module.in_lanes


    def slow_arrange(events):  # a big trace takes seconds to arrange: SIGTERM comes meanwhile
        time.sleep(1.5)
        return arrange(events)


    worker_module.in_lanes = slow_arrange


    async def main():
        await ag.init_rpc("w0", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
        with ag.trace():
            await ag.rpc_async("w0", max, args=(1, 2))
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        if sys.argv[1] == "fails":
            raise RuntimeError("the program fails")


    ag.run(main())
    print("not reached: the process ends by SIGTERM", flush=True)
''')


@pytest.mark.parametrize("ending", ["fails", "returns"])
def test_a_sigterm_while_the_trace_is_written_lets_it_finish(tmp_path: Path, ending: str) -> None:
    """Under actorgrad launch --trace, SIGTERM cancels the program so that rank 0 writes
    the trace; one that came after the program ended cancelled the export itself (no
    trace, and the program's own error unprinted), or was lost (the process went on)."""
    script = tmp_path / "terminated.py"
    script.write_text(SIGTERM_UNDER_TRACE)
    trace = tmp_path / "trace.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               ACTORGRAD_TRACE=str(trace))
    proc = subprocess.run([sys.executable, str(script), ending], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert trace.exists(), proc.stderr
    assert ("RuntimeError: the program fails" in proc.stderr) == (ending == "fails"), proc.stderr
    assert "not reached" not in proc.stdout


def test_run_sync_in_a_forked_child_makes_its_own_loop(tmp_path: Path) -> None:
    script = tmp_path / "forks.py"
    script.write_text(textwrap.dedent('''
        import asyncio, os

        import actorgrad as ag


        async def running_loop():
            return asyncio.get_running_loop()


        parents = ag.run_sync(running_loop())
        pid = os.fork()
        if pid == 0:
            os._exit(0 if ag.run_sync(running_loop()) is not parents else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), flush=True)
    '''))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "child 0" in proc.stdout, proc.stdout + proc.stderr
