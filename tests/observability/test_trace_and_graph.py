"""Traces (Chrome-trace JSON from every worker) and the distributed graph picture."""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import sys
import time

import pytest
import torch

import actorgrad as ag


def my_add(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return torch.add(t1, t2)


async def seed_example() -> tuple[int, torch.Tensor]:
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    t4 = torch.rand(3, 3, requires_grad=True)
    t3 = await ag.rpc_async("worker1", my_add, args=(t1, t2))
    return 0, (t3 * t4).sum()


async def test_trace_records_rpc_and_backward_on_every_worker(group3, tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = torch.rand(4, requires_grad=True)
    with ag.trace():
        async with ag.autograd.context() as cid:
            y = await ag.rpc_async("worker1", torch.mul, args=(x, 2.0))
            z = await ag.rpc_async("worker2", torch.sin, args=(y,))
            await ag.autograd.backward(cid, [z.sum()])
    untraced = await ag.rpc_async("worker1", torch.add, args=(x, 1))  # after the block: not recorded
    assert untraced is not None
    path = tmp_path / "trace.json"
    written = await ag.export_trace(str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    assert written == len(events)
    for event in events:
        assert {"name", "ph", "pid", "tid"} <= event.keys()
        if event["ph"] == "X":
            assert isinstance(event["ts"], float) and event["dur"] > 0
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "worker0 (rank 0)", 1: "worker1 (rank 1)", 2: "worker2 (rank 2)"}
    by_worker = {r: {e["name"] for e in events if e["pid"] == r and e["ph"] != "M"} for r in range(3)}
    assert "call rpc.call" in by_worker[0]
    for rank in (1, 2):
        assert "serve rpc.call" in by_worker[rank]
        assert "backward job" in by_worker[rank]
        assert "serve autograd.propagate" in by_worker[rank]
    assert "SinBackward0" in by_worker[2] and "MulBackward0" in by_worker[1]
    calls = [e for e in events if e["pid"] == 0 and e["name"] == "call rpc.call"]
    assert len(calls) == 2  # the call after the block was not recorded


async def test_graph_joins_send_and_recv_across_workers(group2) -> None:  # type: ignore[no-untyped-def]
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    async with ag.autograd.context() as cid:
        t3 = await ag.rpc_async("worker1", my_add, args=(t1, t2))
        loss = (t3 * t2).sum()
        graph = await ag.autograd.graph(cid, roots=[loss])
    kinds = [(n["worker"], n["kind"]) for n in graph.nodes.values()]
    # a received tensor's own function is drawn as its recv, as torch has one node
    assert not any(n["label"].startswith("RecvRpcBackward") for n in graph.nodes.values())
    assert kinds.count(("worker0", "send")) == 1 and kinds.count(("worker1", "send")) == 1
    assert kinds.count(("worker1", "recv")) == 2 and kinds.count(("worker0", "recv")) == 1
    assert ("worker0", "root") in kinds
    rpc_edges = [(s, d) for s, d, k in graph.edges if k == "rpc"]
    assert len(rpc_edges) == 3
    for src, dst in rpc_edges:
        assert graph.nodes[src]["kind"] == "recv" and graph.nodes[dst]["kind"] == "send"
        assert graph.nodes[src]["worker"] != graph.nodes[dst]["worker"]
    # t2 feeds both the send to worker1 and the local multiplication: two dependencies
    leaves = [n for n in graph.nodes.values() if n["kind"] == "leaf"]
    assert sorted(n["deps"] for n in leaves) == [1, 2]
    dot = graph.to_dot()
    assert dot.startswith("digraph") and dot.count("subgraph") == 2 and "style=dashed" in dot


async def test_graph_used_without_await_where_blocking_calls_work(group2) -> None:  # type: ignore[no-untyped-def]
    """API.md's `ag.autograd.graph(context_id)` ... `.to_dot()` read literally: on an
    asyncio loop (as rpc_sync) the graph is collected on first use; awaited it is the same."""
    t1 = torch.rand(3, 3, requires_grad=True)
    async with ag.autograd.context() as cid:
        t3 = await ag.rpc_async("worker1", my_add, args=(t1, t1))
        loss = t3.sum()
        waited = await ag.autograd.graph(cid, roots=[loss])
        used = ag.autograd.graph(cid, roots=[loss])
        assert used.to_dot() == waited.to_dot()
        assert used.nodes == waited.nodes and sorted(used.edges) == sorted(waited.edges)
        assert any(n["worker"] == "worker1" for n in used.nodes.values())
        tasked = await asyncio.create_task(ag.autograd.graph(cid, roots=[loss]))  # a coroutine
        assert tasked.to_dot() == waited.to_dot()


async def graph_used_without_await_on_a_worker() -> str:
    """On a worker's uvloop loop, where a blocking call cannot wait."""
    t1 = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as cid:
        t3 = await ag.rpc_async("worker0", torch.add, args=(t1, t1))
        try:
            ag.autograd.graph(cid, roots=[t3.sum()]).to_dot()
        except RuntimeError as exc:
            return str(exc)
    return "no error"


async def test_graph_used_without_await_on_uvloop_says_to_await_it(make_process_group) -> None:  # type: ignore[no-untyped-def]
    await make_process_group(2)  # (worker1 runs on uvloop)
    said = await ag.rpc_async("worker1", graph_used_without_await_on_a_worker)
    assert "write `(await ag.autograd.graph(context_id)).to_dot`" in said, said


def _calls(path) -> int:  # type: ignore[no-untyped-def]
    events = json.loads(path.read_text())["traceEvents"]
    return sum(1 for e in events if e["pid"] == 0 and e["name"] == "call rpc.call")


async def test_nested_trace_blocks_keep_the_outer_one_recording(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ag.trace():
        with ag.trace():
            await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
        await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), 2))  # still inside the outer
    await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))  # after both: not recorded
    await ag.export_trace(str(tmp_path / "t.json"))
    assert _calls(tmp_path / "t.json") == 2


async def test_export_to_a_bad_path_loses_nothing_and_exports_repeat(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ag.trace():
        for i in range(3):
            await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), i))
    try:
        await ag.export_trace(str(tmp_path / "missing" / "t.json"))
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("a path in a missing directory was accepted")
    await ag.export_trace(str(tmp_path / "a.json"))
    await ag.export_trace(str(tmp_path / "b.json"))  # e.g. the one `launch --trace` writes last
    assert _calls(tmp_path / "a.json") == _calls(tmp_path / "b.json") == 3
    served = [e for e in json.loads((tmp_path / "b.json").read_text())["traceEvents"]
              if e["pid"] == 1 and e["name"] == "serve rpc.call"]
    assert len(served) == 3


# -- review: graphs whose shares fail, DOT quoting, recv dependencies ------------------
_KEPT: dict[str, torch.Tensor] = {}


def keep(x: torch.Tensor) -> torch.Tensor:
    _KEPT["x"] = x  # a tensor received in one context...
    return x * 1


def use_kept() -> torch.Tensor:
    return _KEPT["x"] * 2  # ...reached from another one


async def test_graph_raises_when_a_worker_cannot_describe_its_share(group2) -> None:  # type: ignore[no-untyped-def]
    """A worker whose share fails makes graph() raise, as the backward does: a graph
    without that worker's share would look whole."""
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context():
        await ag.rpc_async("worker1", keep, args=(x,))
        async with ag.autograd.context() as inner:
            y = await ag.rpc_async("worker1", use_kept)
            with pytest.raises(ag.RemoteError, match="ContextError"):
                await ag.autograd.graph(inner, roots=[y.sum()])
            with pytest.raises(ag.RemoteError, match="ContextError"):
                await ag.autograd.backward(inner, [y.sum()])
    await ag.rpc_async("worker1", _KEPT.clear)


def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + torch.sin(x)  # the received x feeds two operations


async def test_a_recv_used_twice_counts_two_dependencies(group2) -> None:  # type: ignore[no-untyped-def]
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as cid:
        y = await ag.rpc_async("worker1", twice, args=(x,))
        graph = await ag.autograd.graph(cid, roots=[y.sum()])
    (recv,) = [(nid, n) for nid, n in graph.nodes.items() if n["kind"] == "recv" and n["worker"] == "worker1"]
    into = sum(1 for _, dst, kind in graph.edges if dst == recv[0] and kind == "local")
    assert recv[1]["deps"] == into == 2


def test_dot_quotes_names_with_quotes_and_backslashes() -> None:
    from actorgrad.autograd._inspect import DistGraph

    names = ['trainer "A"', "ps\\"]
    graph = DistGraph(7)
    for i, name in enumerate(names):
        graph.nodes[f"{name}:0"] = {"worker": name, "label": f'leaf "{i}"', "kind": "leaf", "deps": 1}
    graph.edges.append((f"{names[0]}:0", f"{names[1]}:0", "rpc"))
    dot = graph.to_dot()
    quoted = [re.sub(r"\\(.)", r"\1", q) for q in re.findall(r'"((?:[^"\\]|\\.)*)"', dot)]
    # every quote closes where it should: what the quoted strings say are the names
    for name in names:
        assert name in quoted and f"{name}:0" in quoted
    assert 'leaf "0"n(1)' in quoted  # the label, then the dependency count on a new line
    for line in dot.splitlines():
        assert len(re.sub(r'"(?:[^"\\]|\\.)*"', "", line).split('"')) == 1, line


# -- review: what a trace block records -------------------------------------------------
def slow_add(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.05)
    return x + 1


def tracing_on() -> bool:
    from actorgrad.runtime import get_worker

    return get_worker().tracer.enabled


async def test_a_call_made_in_a_trace_block_is_recorded_when_answered_after_it(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ag.trace():
        fut = ag.rpc_async("worker1", slow_add, args=(torch.zeros(2),))
    await fut
    path = tmp_path / "trace.json"
    await ag.export_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert [e["pid"] for e in events if e["name"] == "call rpc.call"] == [0]
    assert [e["pid"] for e in events if e["name"] == "run remote function"] == [1]


async def test_overlapping_trace_blocks_record_until_the_last_ends(group2) -> None:  # type: ignore[no-untyped-def]
    first, second = ag.trace(), ag.trace()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert tracing_on() and await ag.rpc_async("worker1", tracing_on)  # second still open
    second.__exit__(None, None, None)
    assert not tracing_on() and not await ag.rpc_async("worker1", tracing_on)
    block = ag.trace()
    with block, block:  # one block object entered twice
        pass
    assert not tracing_on() and not await ag.rpc_async("worker1", tracing_on)


async def test_concurrent_calls_nest_in_the_exported_trace(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Spans on one thread must nest (Perfetto refuses others); concurrent calls on
    the event loop's thread overlap, so they go to lanes of their own."""
    with ag.trace():
        await asyncio.gather(*(ag.rpc_async("worker1", slow_add, args=(torch.zeros(2),)) for _ in range(3)))
    path = tmp_path / "trace.json"
    await ag.export_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["name"] == "call rpc.call" for e in events) == 3
    assert sum(e["name"] == "run remote function" for e in events) == 3
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends: list[float] = []
        for start, end in spans:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], "spans on one thread overlap without nesting"
            open_ends.append(end)


# -- review: debug_info counts backward passes, not the jobs of one ---------------------
_SEEN_PASSES: list[int] = []


class _CountPasses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        _SEEN_PASSES.append(ag.autograd.debug_info()["num_current_backward_passes"])
        return grad


async def _back_to_worker0(x: torch.Tensor) -> torch.Tensor:
    return await ag.rpc_async("worker0", torch.mul, args=(x, 3.0))


async def test_one_backward_pass_counts_once_while_it_runs(group2) -> None:  # type: ignore[no-untyped-def]
    """x -> worker1 -> worker0 -> worker1: worker0 runs a job of the pass while it
    also waits for the pass it started; torch counts one pass per context."""
    _SEEN_PASSES.clear()
    x = torch.rand(3, requires_grad=True)
    async with ag.autograd.context() as cid:
        y = await ag.rpc_async("worker1", _back_to_worker0, args=(_CountPasses.apply(x),))
        await ag.autograd.backward(cid, [y.sum()])
    assert _SEEN_PASSES == [1]


def fails_here() -> None:
    raise ValueError("on purpose")


async def test_a_traced_call_names_its_function_and_whether_it_failed(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # (every call read "call rpc.call" with no function and no outcome: a trace did
    # not tell one call from another, nor the failed one)
    with ag.trace():
        await ag.rpc_async("worker1", my_add, args=(torch.ones(1), torch.ones(1)))
        with pytest.raises(ag.RemoteError):
            await ag.rpc_async("worker1", fails_here)
        await ag.remote("worker1", torch.add, args=(torch.ones(1), 1)).to_here()
    path = tmp_path / "t.json"
    await ag.export_trace(str(path))
    calls = [e["args"] for e in json.loads(path.read_text())["traceEvents"]
             if e["pid"] == 0 and e["name"] in ("call rpc.call", "call rref.create")]
    assert [(c["function"], c["ok"]) for c in calls] == [
        (f"{__name__}.my_add", True), (f"{__name__}.fails_here", False), ("torch.add", True)], calls
    # the callee's spans name it too, whether it ran inline or as a task
    served = [(e["name"], e["args"].get("function")) for e in json.loads(path.read_text())["traceEvents"]
              if e["pid"] == 1 and e["name"] in ("serve rpc.call", "serve rref.create", "run remote function")]
    assert ("serve rpc.call", f"{__name__}.my_add") in served, served
    assert ("serve rpc.call", f"{__name__}.fails_here") in served, served
    assert ("serve rref.create", "torch.add") in served, served
    assert ("run remote function", "torch.add") in served, served


async def test_the_callee_marks_calls_that_failed_where_it_answered_them(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ag.trace():
        with pytest.raises(ag.RemoteError):  # a builtin run inline, failing at once
            await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), torch.ones(3)))
        await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    path = tmp_path / "t.json"
    await ag.export_trace(str(path))
    served = [e["args"] for e in json.loads(path.read_text())["traceEvents"]
              if e["pid"] == 1 and e["name"] == "serve rpc.call"]
    assert [(a["function"], a["ok"]) for a in served] == [("torch.add", False), ("torch.add", True)], served


async def test_exports_to_one_path_at_once_and_bytes_paths(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # (both wrote one temporary file of the process's id: one export failed, and the
    # file left behind could be the two interleaved)
    with ag.trace():
        for i in range(50):
            await ag.rpc_async("worker1", torch.add, args=(torch.ones(2), i))
    path = tmp_path / "t.json"
    counts = await asyncio.gather(*(ag.export_trace(str(path)) for _ in range(3)))
    assert len(set(counts)) == 1 and _calls(path) == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # no partial file left
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # as open() makes it, not private
    assert await ag.export_trace(bytes(tmp_path / "b.json")) == counts[0]
    assert _calls(tmp_path / "b.json") == 50
    with pytest.raises(FileNotFoundError, match="missing"):
        await ag.export_trace(str(tmp_path / "missing" / "t.json"))


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 3

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise ValueError("backward fails on purpose")


def fails_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _FailsInBackward.apply(x * 2)


async def test_a_failed_backward_traces_the_node_that_raised(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # (the node that raised and its job left no span at all: the trace of a failed
    # backward showed the nodes that ran before it and nothing of the failure)
    x = torch.ones(3, requires_grad=True)
    with ag.trace():
        async with ag.autograd.context() as cid:
            y = await ag.rpc_async("worker1", fails_in_backward, args=(x,))
            with pytest.raises(ag.RemoteError, match="backward fails on purpose"):
                await ag.autograd.backward(cid, [y.sum()])
    path = tmp_path / "t.json"
    await ag.export_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["pid"] == 1]
    failed = [(e["name"], e["args"]["error"]) for e in events if "error" in e["args"]]
    assert ("_FailsInBackwardBackward", "ValueError: backward fails on purpose") in failed, failed
    assert [name for name, _ in failed].count("backward job") == 1, failed
    # the node after it never ran, and is not drawn
    assert not any(e["name"] == "MulBackward0" for e in events), events


async def test_an_export_names_the_workers_missing_and_never_leaves_half_a_file(  # type: ignore[no-untyped-def]
        make_process_group, tmp_path, monkeypatch, caplog) -> None:
    # (a worker that did not answer was left out silently, so a partial trace looked
    # whole; an export cut short left a truncated file that no JSON reader takes)
    group = await make_process_group(3)
    with ag.trace():
        await ag.rpc_async("worker1", torch.add, args=(torch.ones(1), 1))
        await ag.rpc_async("worker2", torch.add, args=(torch.ones(1), 2))
    group.kill(2)
    path = tmp_path / "t.json"
    await ag.export_trace(str(path))
    document = json.loads(path.read_text())
    assert document["otherData"] == {"workers_missing": ["worker2"]}
    assert {e["pid"] for e in document["traceEvents"]} == {0, 1}
    assert "has no events of worker2" in caplog.text

    from actorgrad.runtime import _worker

    def broken(events):  # type: ignore[no-untyped-def]
        raise OSError("disk full")

    monkeypatch.setattr(_worker, "in_lanes", broken)
    with pytest.raises(OSError, match="disk full"):
        await ag.export_trace(str(tmp_path / "u.json"))
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_a_full_trace_says_how_many_events_it_dropped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from actorgrad.runtime import _trace

    monkeypatch.setattr(_trace, "MAX_EVENTS", 3)
    tracer = _trace.Tracer(0, "worker0", enabled=True)
    for i in range(5):
        tracer.instant(f"event {i}", "test")
    events = tracer.snapshot()
    assert [e["name"] for e in events[1:4]] == ["event 0", "event 1", "event 2"]
    assert events[-1]["name"] == "trace full: 2 later events dropped"
    assert events[-1]["ts"] >= events[3]["ts"]


async def test_trace_blocks_entered_from_threads_all_end(group2) -> None:  # type: ignore[no-untyped-def]
    """Blocks from several threads at once: the count of open blocks must not lose an
    update (recording then stayed on for good)."""
    import threading

    from actorgrad.runtime import get_worker

    worker = get_worker()

    def many() -> None:
        for _ in range(300):
            with ag.trace():
                pass

    threads = [threading.Thread(target=many) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: a lost update shows at once
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):  # noqa: ASYNC110 - the threads' tells need this loop
            await asyncio.sleep(0.01)
    finally:
        sys.setswitchinterval(interval)
    await asyncio.sleep(0.05)  # their last tells went out
    assert not tracing_on() and not await ag.rpc_async("worker1", tracing_on)
    assert worker.tracer._blocks == {}


async def test_a_second_export_draws_the_same_rows(group2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ag.trace():
        await asyncio.gather(*(ag.rpc_async("worker1", slow_add, args=(torch.zeros(2),)) for _ in range(2)))
    rows = []
    for name in ("one.json", "two.json"):
        await ag.export_trace(str(tmp_path / name))
        events = json.loads((tmp_path / name).read_text())["traceEvents"]
        rows.append(sorted((e["pid"], e["tid"], e.get("args", {}).get("name")) for e in events if e["ph"] == "M"))
    assert rows[0] == rows[1] and any("concurrent 1" in str(name) for _, _, name in rows[0])
