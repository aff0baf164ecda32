"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

import actorgrad as ag
from actorgrad.runtime import _current
from actorgrad.testing import InProcessGroup


@pytest.fixture
async def spawn() -> AsyncIterator[Callable[..., Awaitable[list[Any]]]]:
    """``results = await spawn(specs, timeout)``: run ``init_rpc(**spec)`` for every spec
    concurrently on this loop, each in its own context (as start_in_process does); a
    spec's optional ``context_setup`` callable runs inside that context first.
    Returns per spec the Worker or the exception. Every worker is shut down afterwards."""
    started: list[Any] = []

    async def run(specs: list[dict[str, Any]], timeout: float = 15.0) -> list[Any]:
        loop = asyncio.get_running_loop()
        contexts = [contextvars.copy_context() for _ in specs]
        specs = [dict(spec) for spec in specs]
        for spec, ctx in zip(specs, contexts, strict=True):
            if (setup := spec.pop("context_setup", None)) is not None:
                ctx.run(setup)
        tasks = [
            loop.create_task(ag.init_rpc(**spec), context=ctx)
            for spec, ctx in zip(specs, contexts, strict=True)
        ]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        results: list[Any] = []
        for task, ctx in zip(tasks, contexts, strict=True):
            worker = ctx.get(_current.current_worker)
            if worker is not None:
                started.append(worker)
            if task.cancelled():
                results.append(TimeoutError(f"init_rpc did not return within {timeout}s"))
            elif task.exception() is not None:
                results.append(task.exception())
            else:
                results.append(worker)
        return results

    yield run
    await asyncio.gather(
        *(InProcessGroup([w]).run_as(0, w.shutdown, False, 5.0) for w in started if not w.closed),
        return_exceptions=True,
    )
    _current.set_default(None)
