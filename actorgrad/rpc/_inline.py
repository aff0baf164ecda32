"""Which remote functions run on the event loop thread itself.

A remote Python function normally runs on the worker's thread pool, so one that blocks
(sleeps, waits on a lock, calls another worker with ``rpc_sync``) never stalls the
loop, its heartbeats or other peers' calls. The hop costs two thread wake-ups and a
GIL hand-over, several times the cost of a small function itself.

# Rules
- torch and ``operator`` builtins on small tensors always run inline (see
  ``runs_inline`` in ``_api``): they cannot block.
- A plain Python function is *learned*: its runs go to the pool and are timed there.
  After ``PROMOTE_AFTER`` runs within ``FAST_SECONDS`` (counted since its last slow
  run), later calls with small tensor arguments run inline.
- A run slower than ``SLOW_SECONDS``, in the pool or inline, is a *strike*: the
  function goes back to the pool and needs twice as many fast runs as before to be
  inlined again. Wall time also grows when the machine is busy (a run preempted by
  another process, waiting for the GIL), so one slow run must not condemn a function
  for good; a function that really blocks stalls the loop a few times at most, after
  which it needs thousands of fast runs. After ``MAX_STRIKES`` it stays on the pool.
- A function that made a blocking call into a worker (``rpc_sync`` and friends,
  which a caller on the loop thread could not make) stays on the pool for good.
- Functions are known by their code object, so a lambda or ``__main__`` function that
  arrives by value on every call is recognised too. actorgrad's own helpers (the RRef
  method proxy, which runs arbitrary methods) are never learned.

``RpcOptions(inline_functions=False)`` turns learning off.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

from ..runtime._sync import blocking_calls

PROMOTE_AFTER = 8
FAST_SECONDS = 50e-6
SLOW_SECONDS = 1e-3
MAX_STRIKES = 10
_MAX_TRACKED = 4096

_FunctionType = types.FunctionType
_perf_counter = time.perf_counter


class InlinePolicy:
    """Per-worker record of which learned functions run inline."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._fast_runs: dict[types.CodeType, int] = {}  # fast pool runs since the last strike
        self._strikes: dict[types.CodeType, int] = {}
        self._inline: set[types.CodeType] = set()
        self._never: set[types.CodeType] = set()

    @staticmethod
    def key(func: Callable[..., Any]) -> types.CodeType | None:
        """The code object a function is learned by, or None when it is not learnable."""
        if type(func) is not _FunctionType:
            return None
        module = func.__module__ or ""
        if module == "actorgrad" or module.startswith("actorgrad."):
            return None
        return func.__code__

    def runs_inline(self, code: types.CodeType | None) -> bool:
        return code is not None and code in self._inline

    def learning(self, code: types.CodeType | None) -> bool:
        """Whether pool runs of this function should be timed."""
        return (
            self.enabled and code is not None and code not in self._never
            and code not in self._inline
        )

    def timed(self, code: types.CodeType, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Wrap a pool job of a function being learned so that it reports its run."""

        def job() -> Any:
            before = blocking_calls()
            start = _perf_counter()
            try:
                return fn()
            finally:
                elapsed = _perf_counter() - start
                # from the pool thread: plain dict/set operations, atomic under the GIL
                self._pool_run(code, elapsed, blocking_calls() != before)

        return job

    def _pool_run(self, code: types.CodeType, elapsed: float, blocked: bool) -> None:
        if blocked:
            self._ban(code)
        elif elapsed > SLOW_SECONDS:
            self._strike(code)
        elif elapsed <= FAST_SECONDS and code not in self._inline:
            runs = self._fast_runs.get(code, 0) + 1
            if runs < PROMOTE_AFTER << self._strikes.get(code, 0):
                if len(self._fast_runs) < _MAX_TRACKED:
                    self._fast_runs[code] = runs
            elif len(self._inline) < _MAX_TRACKED:
                self._fast_runs.pop(code, None)
                self._inline.add(code)

    def inline_run(self, code: types.CodeType, elapsed: float) -> None:
        """An inline run took ``elapsed`` seconds; a slow one is a strike."""
        if elapsed > SLOW_SECONDS:
            self._strike(code)

    def _strike(self, code: types.CodeType) -> None:
        self._inline.discard(code)
        self._fast_runs.pop(code, None)
        strikes = self._strikes.get(code, 0) + 1
        if strikes >= MAX_STRIKES:
            self._ban(code)
        elif len(self._strikes) < _MAX_TRACKED:
            self._strikes[code] = strikes

    def _ban(self, code: types.CodeType) -> None:
        self._inline.discard(code)
        self._fast_runs.pop(code, None)
        self._strikes.pop(code, None)
        if len(self._never) < _MAX_TRACKED:
            self._never.add(code)


__all__ = ["InlinePolicy"]
