"""Per-worker event recording, exported as one Chrome-trace JSON for the whole group.

Events use the wall clock in microseconds, so the events of workers on one machine line
up; each worker is one "process" (pid = rank) in the trace viewer.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._errors import error_line

MAX_EVENTS = 1_000_000
_ERROR_CHARS = 500  # of an error's text kept in a span
_TID_SPAN = 100_000  # thread ids are taken modulo this; extra rows of a thread add multiples


def now_us() -> float:
    return time.time_ns() / 1000.0


def failed(args: dict[str, Any] | None, exc: BaseException) -> dict[str, Any]:
    """A span's ``args`` for a span that ended in ``exc``."""
    return {**(args or {}), "ok": False, "error": error_line(exc)[:_ERROR_CHARS]}


class Tracer:
    """Collects events while enabled; cheap no-ops otherwise.

    Recording is on for the whole run (``RpcOptions(trace=True)``, ``ACTORGRAD_TRACE``)
    or while any ``ag.trace()`` block is open on any worker: each worker tells the
    others how many it has open, so blocks nest and overlap (concurrent tasks, one
    block object entered twice) and recording stops when the last one ends.
    """

    def __init__(self, rank: int, name: str, enabled: bool = False) -> None:
        self.rank = rank
        self.name = name
        self.always = enabled or bool(os.environ.get("ACTORGRAD_TRACE"))
        self.enabled = self.always
        self._blocks: dict[int, int] = {}  # rank -> trace blocks open there
        self.events: list[dict[str, Any]] = []
        self.dropped = 0  # events past MAX_EVENTS, not kept
        self.full_at = 0.0  # when the first was dropped
        self._lock = threading.Lock()

    def change_blocks(self, rank: int, by: int) -> int:
        """``rank`` (this worker) opened (+1) or closed (-1) a trace block; how many it
        has open now. Blocks may be entered from several threads at once."""
        with self._lock:
            count = max(self._blocks.get(rank, 0) + by, 0)
            self._set_blocks(rank, count)
            return count

    def set_blocks(self, rank: int, count: int) -> None:
        """``rank`` has ``count`` trace blocks open (0 also for a worker that is gone)."""
        with self._lock:
            self._set_blocks(rank, count)

    def _set_blocks(self, rank: int, count: int) -> None:
        if count > 0:
            self._blocks[rank] = count
        else:
            self._blocks.pop(rank, None)
        self.enabled = self.always or bool(self._blocks)

    def complete(self, name: str, cat: str, start_us: float, args: dict[str, Any] | None = None) -> None:
        """A span from ``start_us`` until now. Recorded whether or not recording is
        still on: the caller checked when the span began (a call made inside a trace
        block and answered after it is recorded)."""
        self._add({"name": name, "cat": cat, "ph": "X", "ts": start_us,
                   "dur": max(now_us() - start_us, 0.01), "args": args or {}})

    def instant(self, name: str, cat: str, args: dict[str, Any] | None = None) -> None:
        if self.enabled:
            self._add({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": now_us(), "args": args or {}})

    @contextmanager
    def span(self, name: str, cat: str, args: dict[str, Any] | None = None) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = now_us()
        try:
            yield
        except BaseException as exc:
            self.complete(name, cat, start, failed(args, exc))
            raise
        self.complete(name, cat, start, args)

    def _add(self, event: dict[str, Any]) -> None:
        event["pid"] = self.rank
        event["tid"] = threading.get_ident() % _TID_SPAN
        with self._lock:
            if len(self.events) < MAX_EVENTS:
                self.events.append(event)
            else:
                if not self.dropped:
                    self.full_at = event["ts"]
                self.dropped += 1

    def snapshot(self) -> list[dict[str, Any]]:
        """This worker's events so far plus the metadata naming its process. The events
        stay recorded: every export writes all of them (a user's export does not empty
        the one ``actorgrad launch --trace`` writes at the end)."""
        with self._lock:
            events = list(self.events)
            dropped, full_at = self.dropped, self.full_at
        meta = {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                "args": {"name": f"{self.name} (rank {self.rank})"}}
        if dropped:  # said where it happened, not lost in silence
            events.append({"name": f"trace full: {dropped} later events dropped", "cat": "trace", "ph": "i",
                           "s": "p", "ts": full_at, "pid": self.rank, "tid": 0, "args": {"dropped": dropped}})
        return [meta, *events]


def in_lanes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` with overlapping spans of one thread moved to lanes of their own.

    Spans on one thread (pid, tid) must nest for Perfetto and chrome://tracing, but
    the event loop's thread runs many calls at once: two concurrent calls overlap
    without nesting. Each span keeps the first lane (lane 0: the thread's own tid)
    where it nests; lanes beyond get a tid of their own, named after the thread.
    """
    events = [dict(e) if e.get("ph") == "X" else e for e in events]  # not the recorded ones
    spans: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for event in events:
        if event.get("ph") == "X":
            spans.setdefault((event["pid"], event["tid"]), []).append(event)
    extra: list[dict[str, Any]] = []
    for (pid, tid), group in spans.items():
        group.sort(key=lambda e: (e["ts"], -e["dur"]))
        lanes: list[list[float]] = []  # per lane, the ends of the spans open there
        for event in group:
            start, end = event["ts"], event["ts"] + event["dur"]
            number = _lane_for(lanes, start, end)
            if number == len(lanes):
                lanes.append([])
                if number and isinstance(tid, int):
                    extra.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid + number * _TID_SPAN,
                                  "args": {"name": f"thread {tid}, concurrent {number}"}})
            lanes[number].append(end)
            if number and isinstance(tid, int):
                event["tid"] = tid + number * _TID_SPAN
    return events + extra


def _lane_for(lanes: list[list[float]], start: float, end: float) -> int:
    """The first lane where a span from ``start`` to ``end`` nests (``len(lanes)``:
    none does). Spans come in order of start, so those ended by ``start`` are closed."""
    for number, open_ends in enumerate(lanes):
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        if not open_ends or end <= open_ends[-1]:
            return number
    return len(lanes)
