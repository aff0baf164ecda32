"""Which remote functions run on the event loop thread itself.

A remote Python function normally runs on the worker's thread pool, so one that blocks
(sleeps, waits on a lock, calls another worker with ``rpc_sync``) never stalls the
loop, its heartbeats or other peers' calls. The hop costs two thread wake-ups and a
GIL hand-over, several times the cost of a small function itself.

# Rules
- torch and ``operator`` builtins on small tensors always run inline (see
  ``runs_inline`` in ``_api``): they cannot block.
- A plain Python function whose code can only compute (``_purity``: it cannot block,
  so it cannot stall the loop waiting for something only the loop would bring) is
  *learned*: its runs go to the pool and are timed there. Any other stays there.
  After ``PROMOTE_AFTER`` runs within ``FAST_SECONDS`` (counted since its last slow
  run), later calls run inline. Learning is per *size class* of the call's tensor
  arguments (their total bytes, in powers of two above 64 KiB): a function that is
  quick on small tensors is not assumed to be quick on a hundred times more data.
  ``FAST_SECONDS`` is about what the hop to the pool and back costs the caller (two
  thread wake-ups and a GIL hand-over, ~100-150 us on a small VM, measured on the
  pool where the run itself is slower than on the loop): below it, running inline
  holds the loop no longer than the hop would have delayed the answer.
- A run slower than ``SLOW_SECONDS``, in the pool or inline, counts against the
  function (at that size class) when its previous slow run came at most
  ``SLOW_AGAIN_WITHIN_RUNS`` runs before, or when it took longer than
  ``BLOCKING_SECONDS``: a *strike*. The function goes back to the pool and needs twice
  as many fast runs as before to be inlined again. Slowness is judged by runs, not by
  time: wall time also grows when the machine is busy (a run preempted by another
  process, waiting for the GIL), and a 50 us function called thousands of times a
  second on a small VM takes over a millisecond now and then, so two such runs within
  any fixed time come often and would keep a quick function on the pool. A function
  that really blocks is slow on a good share of its runs (one in eight suffices), so
  it stalls the loop a few times at most. Strikes more than ``FORGIVE_AFTER_RUNS``
  runs apart do not add up (a busy stretch of the machine now and then costs one
  short stay on the pool); after ``MAX_STRIKES`` that do, it stays on the pool.
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
from ._purity import cannot_block

PROMOTE_AFTER = 8
FAST_SECONDS = 200e-6
SLOW_SECONDS = 1e-3
SLOW_AGAIN_WITHIN_RUNS = 8
FORGIVE_AFTER_RUNS = 1000
BLOCKING_SECONDS = 50e-3
MAX_STRIKES = 10
_MAX_TRACKED = 4096

_SMALL_BYTES = 1 << 16  # every call with up to this many tensor bytes is size class 0

_FunctionType = types.FunctionType
_perf_counter = time.perf_counter

Learned = tuple[types.CodeType, int]  # (code object, size class)


def size_class(nbytes: int) -> int:
    """0 up to 64 KiB of tensor arguments, then one class per doubling."""
    return 0 if nbytes <= _SMALL_BYTES else (nbytes - 1).bit_length() - _SMALL_BYTES.bit_length() + 1


class InlinePolicy:
    """Per-worker record of which learned functions run inline, per size class."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._fast_runs: dict[Learned, int] = {}  # fast pool runs since the last strike
        self._strikes: dict[Learned, int] = {}
        self._inline: set[Learned] = set()
        self._never: set[types.CodeType] = set()
        self._cannot_block: dict[types.CodeType, bool] = {}  # read once per code object
        self._runs: dict[Learned, int] = {}  # runs so far (pool and inline)
        self._slow_at: dict[Learned, int] = {}  # the run count at its last slow run
        self._struck_at: dict[Learned, int] = {}  # the run count at its last strike

    def key(self, func: Callable[..., Any]) -> types.CodeType | None:
        """The code object a function is learned by, or None when it is not learnable:
        not a plain function, one of ours, or one whose code might block (``_purity``)."""
        if type(func) is not _FunctionType:
            return None
        module = func.__module__ or ""
        if module == "actorgrad" or module.startswith("actorgrad."):
            return None
        code = func.__code__
        safe = self._cannot_block.get(code)
        if safe is None:
            safe = cannot_block(func)
            if len(self._cannot_block) < _MAX_TRACKED:
                self._cannot_block[code] = safe
        return code if safe else None

    def runs_inline(self, code: types.CodeType | None, nbytes: int = 0) -> bool:
        return code is not None and (code, size_class(nbytes)) in self._inline

    def learning(self, code: types.CodeType | None, nbytes: int = 0) -> bool:
        """Whether pool runs of this function (with this much tensor data) are timed."""
        return (
            self.enabled and code is not None and code not in self._never
            and (code, size_class(nbytes)) not in self._inline
        )

    def timed(self, code: types.CodeType, fn: Callable[[], Any], nbytes: int = 0) -> Callable[[], Any]:
        """Wrap a pool job of a function being learned so that it reports its run."""
        learned = (code, size_class(nbytes))

        def job() -> Any:
            before = blocking_calls()
            start = _perf_counter()
            try:
                return fn()
            finally:
                elapsed = _perf_counter() - start
                # from the pool thread: plain dict/set operations, atomic under the GIL
                self._pool_run(learned, elapsed, blocking_calls() != before)

        return job

    def _pool_run(self, learned: Learned, elapsed: float, blocked: bool) -> None:
        run = self._count(learned)
        if blocked:
            self._ban(learned[0])
        elif elapsed > SLOW_SECONDS:
            if self._slow_again(learned, elapsed, run):
                self._strike(learned, run)
        elif elapsed <= FAST_SECONDS and learned not in self._inline:
            runs = self._fast_runs.get(learned, 0) + 1
            if runs < PROMOTE_AFTER << self._strikes.get(learned, 0):
                if len(self._fast_runs) < _MAX_TRACKED:
                    self._fast_runs[learned] = runs
            elif len(self._inline) < _MAX_TRACKED and learned[0] not in self._never:
                self._fast_runs.pop(learned, None)
                self._inline.add(learned)

    def inline_run(self, code: types.CodeType, elapsed: float, nbytes: int = 0) -> None:
        """An inline run took ``elapsed`` seconds; a slow one may be a strike."""
        learned = (code, size_class(nbytes))
        run = self._count(learned)
        if elapsed > SLOW_SECONDS and self._slow_again(learned, elapsed, run):
            self._strike(learned, run)

    def _count(self, learned: Learned) -> int:
        """Count one more run of ``learned``; its number."""
        runs = self._runs
        run = runs.get(learned, 0) + 1
        if run > 1 or len(runs) < _MAX_TRACKED:
            runs[learned] = run
        return run

    def _slow_again(self, learned: Learned, elapsed: float, run: int) -> bool:
        """A slow run (number ``run``): whether it is a strike (a block, or a second
        slow run within a few runs)."""
        last = self._slow_at.get(learned)
        if len(self._slow_at) < _MAX_TRACKED or last is not None:
            self._slow_at[learned] = run
        return elapsed > BLOCKING_SECONDS or (last is not None and run - last <= SLOW_AGAIN_WITHIN_RUNS)

    def _strike(self, learned: Learned, run: int) -> None:
        self._inline.discard(learned)
        self._fast_runs.pop(learned, None)
        last = self._struck_at.get(learned)
        forgiven = last is None or run - last > FORGIVE_AFTER_RUNS
        strikes = (0 if forgiven else self._strikes.get(learned, 0)) + 1
        if len(self._struck_at) < _MAX_TRACKED or last is not None:
            self._struck_at[learned] = run
        if strikes >= MAX_STRIKES:
            self._ban(learned[0])
        elif len(self._strikes) < _MAX_TRACKED or learned in self._strikes:
            self._strikes[learned] = strikes

    def _ban(self, code: types.CodeType) -> None:
        """Never again inline, at any size: it blocks (or kept being slow)."""
        for table in (self._fast_runs, self._strikes, self._slow_at, self._struck_at, self._runs):
            for learned in [k for k in table if k[0] is code]:
                del table[learned]
        self._inline = {k for k in self._inline if k[0] is not code}
        if len(self._never) < _MAX_TRACKED:
            self._never.add(code)


__all__ = ["InlinePolicy", "size_class"]
