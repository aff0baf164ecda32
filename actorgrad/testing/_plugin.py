"""The actorgrad pytest plugin (registered through the ``pytest11`` entry point).

Fixtures:
    actorgrad_group: a fresh group of in-process workers talking over real loopback
        sockets; the test body runs as ``worker0``, so ``await ag.rpc_async("worker1",
        ...)`` just works. Its size comes from ``@pytest.mark.world_size(n)`` (default
        2). The group is shut down after the test, also when the test fails.
    actorgrad_process_group: the same with workers 1..n-1 in their own processes (for
        tests that kill a worker, or need separate interpreters).

The plugin never runs coroutines itself: pytest-asyncio does. A coroutine test that
asks for one of these fixtures is marked ``asyncio`` when it is not already (strict mode
would not run it otherwise), and the group starts on the loop the test runs on, whatever
its loop scope.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable, Generator
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio

if TYPE_CHECKING:  # (loaded when a group starts: they need torch, seconds to import,
    # and this plugin is imported by every pytest run of the environment)
    from ._group import InProcessGroup, LocalGroup

_FIXTURES = ("actorgrad_group", "actorgrad_process_group")
_LOOP_SCOPES = ("function", "class", "module", "package", "session")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "world_size(n): number of workers of the actorgrad_group fixture (default 2)"
    )


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: object) -> Generator[None, Any, None]:
    # trylast: inside pytest-asyncio's own wrapper, which turns marked coroutine tests
    # into its items once this one has marked them
    outcome = yield
    items = outcome.get_result()
    for item in items if isinstance(items, list) else [items]:
        if (isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj)
                and item.get_closest_marker("asyncio") is None
                and any(name in item.fixturenames for name in _FIXTURES)):
            item.add_marker(pytest.mark.asyncio)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, None]:
    # trylast: inside the capture of the call, which then holds what the workers of a
    # process group printed during the test (the echo follows their logs every 0.1 s:
    # the last lines came at teardown, under the wrong heading)
    yield
    group = getattr(item, "funcargs", {}).get("actorgrad_process_group")
    echo = getattr(group, "echo", None)
    if echo is not None:
        echo.flush()


def _world_size(request: pytest.FixtureRequest) -> int:
    marker = request.node.get_closest_marker("world_size")
    if marker is None:
        return 2
    size = marker.args[0] if marker.args else marker.kwargs.get("n", 2)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise pytest.UsageError(f"@pytest.mark.world_size needs a positive int, got {size!r}")
    return size


def _test_loop_scope(node: Any) -> str:
    """The scope of the event loop the test runs on (pytest-asyncio's rules)."""
    scope = getattr(node, "_loop_scope", None)  # pytest-asyncio's own answer, when it has one
    if scope is None:
        marker = node.get_closest_marker("asyncio")
        if marker is not None:
            scope = marker.kwargs.get("loop_scope") or marker.kwargs.get("scope")
    if scope is None:
        try:
            scope = node.config.getini("asyncio_default_test_loop_scope") or "function"
        except ValueError:  # a pytest-asyncio without that option
            scope = "function"
    return str(scope)


def _on_the_tests_loop(kind: str, request: pytest.FixtureRequest) -> Any:
    scope = _test_loop_scope(request.node)
    if scope not in _LOOP_SCOPES:
        raise pytest.UsageError(f"{request.node.nodeid}: unknown event loop scope {scope!r}")
    return request.getfixturevalue(f"_{kind}_on_{scope}_loop")


@pytest.fixture
def actorgrad_group(request: pytest.FixtureRequest) -> InProcessGroup:
    """In-process workers ``worker0``..; the test body acts as ``worker0``."""
    return _on_the_tests_loop("actorgrad_group", request)


@pytest.fixture
def actorgrad_process_group(request: pytest.FixtureRequest) -> LocalGroup:
    """``worker0`` in this process, the other workers in their own processes."""
    return _on_the_tests_loop("actorgrad_process_group", request)


@contextlib.asynccontextmanager
async def _in_process_group(request: pytest.FixtureRequest) -> AsyncIterator[InProcessGroup]:
    from ._group import start_in_process

    group = await start_in_process(_world_size(request))
    try:
        yield group
    finally:
        await group.shutdown(graceful=False)


@contextlib.asynccontextmanager
async def _process_group(request: pytest.FixtureRequest) -> AsyncIterator[LocalGroup]:
    from ._group import local_group

    group = await local_group(_world_size(request))
    try:
        yield group
    finally:
        try:
            await group.shutdown(graceful=False, timeout=5.0)
        finally:
            for rank in range(1, len(group.processes) + 1):
                group.kill(rank)


def _group_fixture(make: Callable[[pytest.FixtureRequest], Any], name: str, loop_scope: Any) -> Any:
    async def group_on_loop(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
        async with make(request) as group:
            yield group

    return pytest_asyncio.fixture(group_on_loop, loop_scope=loop_scope, name=name)


# one fixture per loop scope (a fixture's loop is fixed when it is defined); each is
# function-scoped: a fresh group for every test, started on that test's loop
for _scope in _LOOP_SCOPES:
    for _kind, _make in (("actorgrad_group", _in_process_group),
                         ("actorgrad_process_group", _process_group)):
        _name = f"_{_kind}_on_{_scope}_loop"
        globals()[_name] = _group_fixture(_make, _name, _scope)
del _scope, _kind, _make, _name
