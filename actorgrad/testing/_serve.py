"""Entry point of a worker process started by ``local_group``: serve until worker0 leaves.

    python -m actorgrad.testing._serve RANK WORLD_SIZE INIT_METHOD PARENT_PID
    python -m actorgrad.testing._serve --fork-server   (forks the above: see _forkserver)
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable

import actorgrad as ag


async def serve(rank: int, world_size: int, init_method: str, parent: int) -> None:
    from ..runtime import get_worker
    from ._group import child_setup, follow_leader

    def parent_alive() -> bool:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        return True

    options = child_setup()
    # A parent that dies while the group forms (a notebook kernel killed or restarted
    # during local_group) ends the rendezvous too: it would wait for init_timeout.
    joining = asyncio.current_task()
    assert joining is not None
    watcher = asyncio.ensure_future(_cancel_when_gone(parent_alive, joining))
    try:
        await ag.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, init_method=init_method,
                          options=options)
    except asyncio.CancelledError:
        if watcher.done() and joining.uncancel() == 0:
            return  # (init_rpc closed what it had started)
        raise
    finally:
        watcher.cancel()
    await follow_leader(get_worker(), parent_alive)


async def _cancel_when_gone(alive: Callable[[], bool], task: asyncio.Task[None]) -> None:
    while alive():  # noqa: ASYNC110 - another process: nothing to wait on but polling
        await asyncio.sleep(0.25)
    task.cancel()


def main() -> None:
    forked = sys.argv[1:] == ["--fork-server"]
    if forked:  # see _forkserver: each child returns here
        from . import _forkserver

        _forkserver.become(_forkserver.serve_forever())
    rank, world_size, init_method, parent = sys.argv[1:5]
    ag.run(serve(int(rank), int(world_size), init_method, int(parent)))
    if forked:
        _forkserver.exit_at_once()


if __name__ == "__main__":
    main()
