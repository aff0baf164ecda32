"""A process forked from a worker's (os.fork, multiprocessing's fork start method) that
ends the normal way must leave the parent's group alone: its copies of the worker's
sockets, epoll instance, groups and threads are the parent's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import os, sys, torch, actorgrad as ag

    def fork_here(how):
        """Forks on the calling thread; the child leaves as `how` says."""
        pid = os.fork()
        if pid == 0:
            if how == "exit":
                sys.exit(3)
            if how == "raise":
                raise ValueError("the child's own error")
            return "child returned"
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    async def main():
        group = await ag.local_group(2)
        # on worker1's thread pool: the child's copy of that thread ended the function
        for how in ("exit", "raise", "return"):
            print(how, "in a remote function: child exit", await ag.rpc_async("worker1", fork_here, args=(how,), timeout=20))
        # on this program's own loop thread, a worker's and a local_group's: the child's
        # sys.exit runs asyncio's and the program's exit handlers on copies of both
        pid = os.fork()
        if pid == 0:
            sys.exit(5)
        print("loop thread: child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        for i in range(3):  # the connections and worker1's process are still there
            print("after the fork", (await ag.rpc_async("worker1", torch.add, args=(torch.ones(1), i), timeout=20)).item())
        await group.shutdown()
        print("shut down")

    if __name__ == "__main__":
        ag.run(main())
''')


def test_a_forked_child_that_exits_leaves_the_parents_group_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # (the parent's peers went silent: the child's loop read its messages and
    # unregistered its sockets from the shared epoll; a child's atexit ended the
    # parent's local_group, then waited for good for the fork server's threads; a child
    # of a remote function waited for the next job of a pool that is not there; a child
    # that exited the normal way died of SIGSEGV in libuv's exit handler, which joined
    # the parent's thread pool for name lookups that uvloop had started)
    path = tmp_path / "forking.py"
    path.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("[worker")]  # (theirs)
    assert lines == [
        "exit in a remote function: child exit 3",
        "raise in a remote function: child exit 1",
        "return in a remote function: child exit 0",
        "loop thread: child exit 5",
        "after the fork 1.0", "after the fork 2.0", "after the fork 3.0",
        "shut down",
    ], proc.stdout + proc.stderr[-3000:]
    assert "WorkerLost" not in proc.stderr and "heartbeat" not in proc.stderr, proc.stderr[-3000:]


def test_a_worker_still_starting_is_forsaken_in_a_forked_child() -> None:
    """A worker serves its peers' calls before its own init_rpc returned (as torch's): a
    remote function that forks then must leave a child in which the worker is closed,
    so the child's calls fail at once instead of waiting for the parent's loop."""
    import os

    from actorgrad.runtime import _current

    class Starting:
        closed = False

        def forsake_in_child(self) -> None:
            self.closed = True

    worker = Starting()
    _current.starting(worker)  # type: ignore[arg-type]
    read, write = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            os.write(write, b"closed" if worker.closed else b"open")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 16) == b"closed"
        assert not worker.closed  # (the parent's worker is left as it was)
    finally:
        _current.unregister(worker)  # type: ignore[arg-type]
        os.close(read)
        os.close(write)


async def test_a_worker_is_known_to_the_fork_handler_from_the_start_of_its_rendezvous() -> None:
    """From the moment its peers may learn its address (and call it), until a start that
    failed ended: what the test above relies on, through init_rpc itself."""
    import asyncio
    import contextlib

    import actorgrad as ag
    from actorgrad.runtime import _current
    from actorgrad.testing import free_port

    start = asyncio.ensure_future(ag.init_rpc(
        "alone", rank=0, world_size=2, init_method=f"tcp://127.0.0.1:{free_port()}"))
    for _ in range(500):  # (it waits for rank 1, who never comes)
        if _current._starting:
            break
        await asyncio.sleep(0.01)
    assert [w.name for w in _current._starting] == ["alone"]
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await start
    assert _current._starting == []
