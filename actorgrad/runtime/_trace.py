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

MAX_EVENTS = 1_000_000


def now_us() -> float:
    return time.time_ns() / 1000.0


class Tracer:
    """Collects events while enabled; cheap no-ops otherwise."""

    def __init__(self, rank: int, name: str, enabled: bool = False) -> None:
        self.rank = rank
        self.name = name
        self.enabled = enabled or bool(os.environ.get("ACTORGRAD_TRACE"))
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def complete(self, name: str, cat: str, start_us: float, args: dict[str, Any] | None = None) -> None:
        """A span from ``start_us`` until now."""
        if self.enabled:
            self._add({"name": name, "cat": cat, "ph": "X", "ts": start_us,
                       "dur": max(now_us() - start_us, 0.01), "args": args or {}})

    def instant(self, name: str, cat: str, args: dict[str, Any] | None = None) -> None:
        if self.enabled:
            self._add({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": now_us(), "args": args or {}})

    @contextmanager
    def span(self, name: str, cat: str, args: dict[str, Any] | None = None) -> Iterator[None]:
        start = now_us()
        try:
            yield
        finally:
            self.complete(name, cat, start, args)

    def _add(self, event: dict[str, Any]) -> None:
        event["pid"] = self.rank
        event["tid"] = threading.get_ident() % 100000
        with self._lock:
            if len(self.events) < MAX_EVENTS:
                self.events.append(event)

    def snapshot(self) -> list[dict[str, Any]]:
        """This worker's events so far plus the metadata naming its process. The events
        stay recorded: every export writes all of them (a user's export does not empty
        the one ``actorgrad launch --trace`` writes at the end)."""
        with self._lock:
            events = list(self.events)
        meta = {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                "args": {"name": f"{self.name} (rank {self.rank})"}}
        return [meta, *events]
