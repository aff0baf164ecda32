"""DistributedDataParallel: gradient buckets all-reduced while the backward runs.

# Theory of operation (PyTorch's DDP design note)
* ``create`` broadcasts rank 0's parameters and buffers (coalesced per dtype) so every
  replica starts equal, then assigns the parameters that require grad to buckets in
  *reverse* registration order (the order the backward tends to produce gradients in),
  each bucket holding up to ``bucket_cap_mb`` of one dtype, with one flat buffer.
* Each parameter gets a post-accumulate-grad hook. ``await ddp.backward(loss)`` runs
  torch's ``loss.backward()`` on the worker's thread pool, so the loop stays free to
  communicate; the hooks fire on that thread, copy the gradient into its bucket slot
  and hand the readiness to the loop (``call_soon_threadsafe``). A bucket whose
  gradients are all in is all-reduced (averaged) at once, but buckets are launched in
  index order only, so every rank issues the same collectives in the same order.
* When the local backward returns, buckets still incomplete are launched too (missing
  gradients count as zeros); then every all-reduce is awaited and the averages are
  written into ``.grad``.
* ``find_unused_parameters=True``: at forward time the output's autograd graph is
  walked; parameters it does not reach are marked ready up front with the gradient they
  hold already (an earlier backward, a ``no_sync()`` pass) or zero, and so are, when
  the local backward ends, those it reached that got no gradient (an output the loss
  did not use); the status all-reduce below tells which parameters no rank used (their
  ``.grad`` is left alone, as torch does).
* A gradient hook that fires for a parameter already marked ready in this backward
  (used outside forward, e.g. in the loss, so the graph walk missed it; or reused across
  reentrant backward passes) cannot be reduced any more: its bucket already went out.
  torch raises "Expected to mark a variable ready only once"; so do we, naming the
  parameter, on every rank (the flag rides on the status all-reduce below).
* Every backward ends with one small all-reduce of a status vector: per parameter
  "used" (``find_unused_parameters``), "came late" and "missing" counts, and the number
  of ranks whose local backward raised. A rank whose backward raised still launches its
  buckets (zeros) and joins that all-reduce and the buffer broadcast, so the ranks stay
  in step; then every rank raises when anything went wrong on any rank, instead of one
  rank raising while the others step on an average that holds its zeros (torch's other
  ranks hang in that case).
* One loss may reach the parameters of several wrappers of a worker (a GAN's
  generator loss goes through the discriminator; an encoder and a head wrapped apart):
  torch's one ``loss.backward()`` averages all of them. ``backward`` walks the loss's
  graph when the worker has other wrappers and takes along those it reaches; their
  buckets go out after the local backward, wrapper after wrapper in creation order, so
  every rank issues the same collectives.
* With distributed autograd (torch's "Combining DDP with distributed RPC"): a wrapper
  whose forward ran and whose parameters got gradients in a context from
  ``autograd.backward`` on this worker averages those, in the context, once the pass is
  over (``after_backward``): the same buckets, status all-reduce and buffer broadcast,
  wrapper after wrapper in creation order. A pass that failed issues them too, saying
  so, as a failed local backward does.
* Buffers: torch broadcasts rank 0's buffers at the start of every forward. Forward is
  synchronous here (``ddp(x)``), so the same broadcast happens at the end of every
  ``backward`` and in :meth:`DistributedDataParallel.sync_buffers`. That is the same
  data for one forward per backward. A forward in eval mode whose buffers changed here
  since they came from rank 0 (a forward in training mode moved the running
  statistics, before the backward) reads this rank's own where torch's reads rank 0's:
  it warns, once, to call ``sync_buffers`` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import numbers
import warnings
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from torch import nn

from .. import collective as C
from ..autograd._context import current_context
from ..autograd._engine import after_backward
from ..collective._api import refuse_next, start_all_reduce, start_broadcast
from ..runtime import Worker, get_worker

_MiB = 1 << 20


class _Bucket:
    __slots__ = ("buffer", "future", "index", "params", "pending", "slots", "written")

    def __init__(self, index: int, params: list[int], slots: list[tuple[int, int]],
                 buffer: torch.Tensor) -> None:
        self.index = index
        self.params = params  # parameter indices
        self.slots = slots  # (offset, numel) per parameter
        self.buffer = buffer
        self.pending = len(params)
        self.future: asyncio.Future[Any] | None = None
        self.written = False


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper of ``module``, as ``torch.nn.parallel.DistributedDataParallel``.

    Build it with ``ddp = await DistributedDataParallel.create(module, ...)`` on every
    member of the group; call ``out = ddp(x)`` and ``await ddp.backward(loss)``; then
    step an ordinary optimizer over ``ddp.parameters()`` (or the module's).
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, group: C.Group | None = None,
                 broadcast_buffers: bool = True, device_ids: list[Any] | None = None,
                 output_device: Any = None, _created: bool = False) -> None:
        if not _created:
            raise TypeError(
                "use `ddp = await DistributedDataParallel.create(module, ...)`: building the "
                "wrapper broadcasts rank 0's state, which needs to be awaited"
            )
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _check_devices(module, device_ids, output_device)
        if not any(p.requires_grad for p in module.parameters()):
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module has no parameter that "
                "requires a gradient (as torch says)"
            )
        cap: Any = bucket_cap_mb  # (typed float; a numpy number or a mistake may come)
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {type(bucket_cap_mb).__name__}")
        if not 0 < bucket_cap_mb < math.inf:  # (NaN too)
            raise ValueError(f"bucket_cap_mb must be a number of MiB > 0, got {bucket_cap_mb}")
        for name, sub in module.named_modules():
            if getattr(sub, "sparse", False) is True and isinstance(sub, (nn.Embedding, nn.EmbeddingBag)):
                raise ValueError(
                    f"{name or 'the module'} ({type(sub).__name__}) makes sparse gradients, which "
                    "this DistributedDataParallel does not average: build it with sparse=False"
                )
            if isinstance(sub, nn.SyncBatchNorm) and not torch.distributed.is_initialized():
                # (it syncs only where torch.distributed has a default process group)
                raise ValueError(
                    f"{name or 'the module'} is a SyncBatchNorm, which shares batch statistics "
                    "through torch.distributed's default process group; none is initialised "
                    "here, so it would normalise each rank's batch alone: use the plain "
                    "BatchNorm it converts from (what it would compute), or set up "
                    "torch.distributed for it"
                )
        self.module = module
        self.group = group
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.bucket_cap_mb = bucket_cap_mb
        self.require_backward_grad_sync = True
        worker = get_worker()
        self._worker: Worker = worker
        self._loop = worker.loop
        self._world_size = len(group.ranks) if group is not None else worker.world_size
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._where: list[tuple[int, int, int]] = []  # param -> (bucket, offset, numel)
        self._buckets = self._make_buckets(int(bucket_cap_mb * _MiB))
        self._next_launch = 0
        self._active = False  # inside backward(): hooks feed the buckets
        self._status_issued = self._buffers_issued = False  # by this backward, so far
        # all-reduces of buckets that a cancelled backward left running: they write into
        # the buckets when they end, so the next backward waits for them first
        self._unfinished: list[asyncio.Future[Any]] = []
        self._ready = [False] * len(self._params)
        # Written by the hooks, on the backward's thread (``_ready`` lags behind, on the
        # loop): which parameters were claimed in this backward, and which came twice.
        self._claimed = [False] * len(self._params)
        self._late: list[int] = []
        self._unused: list[int] = []  # from the last forward (find_unused_parameters)
        self._used_unsynced: set[int] = set()  # got a gradient inside no_sync() since the last sync
        self._unused_now: set[int] = set()  # unused in the backward running now
        self._used_before: set[int] = set()  # used inside no_sync() before it
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)
        ]
        # the parameters outlive a wrapper dropped for a new one (torch users re-wrap
        # after freezing layers): its hooks go with it, and hold it only weakly
        weakref.finalize(self, _remove_hooks, self._hooks)
        self._deferred = False  # in another wrapper's backward: buckets go out after it
        # where the averages go: .grad, or a distributed autograd context's gradients
        self._into: dict[torch.Tensor, torch.Tensor] | None = None
        self._armed = False  # a forward ran since the last synced backward
        self._src = group.ranks[0] if group is not None else 0  # whose state the others take
        # buffers this rank takes from rank 0 (which warns of none: they are its own)
        self._shares_buffers = broadcast_buffers and worker.rank != self._src and self._world_size > 1 \
            and any(True for _ in module.buffers())
        self._synced_versions: tuple[int, ...] | None = None  # the buffers' versions when last received
        self._warned_buffers = False
        self._forward_context: int | None = None  # the autograd context it ran in
        wrappers = _wrappers.setdefault(worker, [])
        wrappers[:] = [ref for ref in wrappers if ref() is not None]  # (re-wrapping drops old ones)
        wrappers.append(weakref.ref(self))

    @classmethod
    async def create(cls, module: nn.Module, bucket_cap_mb: float | None = 25.0,
                     find_unused_parameters: bool = False, group: C.Group | None = None,
                     broadcast_buffers: bool = True, *, process_group: C.Group | None = None,
                     device_ids: list[Any] | None = None, output_device: Any = None,
                     gradient_as_bucket_view: bool = False, static_graph: bool = False,
                     ) -> DistributedDataParallel:
        """Wrap ``module`` (call on every member of ``group``, all with the same model).

        Args:
            module: the local replica.
            bucket_cap_mb: gradient bucket size in MiB (None: the default, 25).
            find_unused_parameters: walk the autograd graph of every forward's output
                and treat parameters it does not reach as ready (needed when some
                parameters get no gradient in an iteration).
            group: the collective group (default: all workers); ``process_group`` is
                torch's name for it.
            broadcast_buffers: keep buffers (batch-norm statistics) equal to rank 0's.
            device_ids, output_device: as torch's, for a module on one device: that
                device (or None); the wrapper works where the module's parameters are.
            gradient_as_bucket_view, static_graph: torch's hints; accepted so torch code
                runs unchanged, and ignored. What ``static_graph=True`` lets torch do
                besides is not done here, and says so when met: parameters unused in
                every step need ``find_unused_parameters=True``, and a parameter used
                in two reentrant checkpoints needs ``use_reentrant=False``.

        Returns:
            The wrapper, after rank 0's parameters and buffers were copied everywhere.
        """
        if process_group is not None:
            if group is not None:
                raise ValueError("pass group or process_group (torch's name for it), not both")
            group = process_group
        if group is not None and not isinstance(group, C.Group):
            raise TypeError(f"group must be an actorgrad.collective.Group or None, got {type(group).__name__}")
        if bucket_cap_mb is None:
            bucket_cap_mb = 25.0
        del gradient_as_bucket_view, static_graph
        try:  # (the constructor checks the arguments)
            ddp = cls(module, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                      group=group, broadcast_buffers=broadcast_buffers, device_ids=device_ids,
                      output_device=output_device, _created=True)
        except (TypeError, ValueError, RuntimeError) as exc:
            # the other members are entering the broadcast of rank 0's state: they fail
            # at once (naming this) instead of at their timeout, and stay in step
            refuse_next(group, "DistributedDataParallel.create", exc)
            raise
        await ddp._check_same_model()
        # as torch: buffers too, unless broadcast_buffers=False keeps them per rank
        tensors = list(module.parameters()) + (list(module.buffers()) if broadcast_buffers else [])
        await ddp._broadcast(tensors)
        ddp._buffers_received()
        return ddp

    def _buffer_versions(self) -> tuple[int, ...]:
        return tuple(b._version for b in self.module.buffers())

    def _buffers_received(self) -> None:
        """Rank 0's buffers are here: a change since (a forward in training mode moving
        running statistics in place) shows in their versions."""
        if self._shares_buffers:
            self._synced_versions = self._buffer_versions()

    async def _check_same_model(self) -> None:
        """Every member wraps the same model with the same settings, as torch checks at
        construction: another shape failed in the broadcast without naming the model,
        another set of parameters that require grad failed in the first backward's
        all-reduce, and other buckets or other checks for unused parameters made the
        ranks' collectives differ, leaving the group out of step for good."""
        mine = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
                for n, p in self.module.named_parameters()]
        if self.broadcast_buffers:
            mine += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in self.module.named_buffers()]
        settings = {"find_unused_parameters": self.find_unused_parameters,
                    "broadcast_buffers": self.broadcast_buffers,
                    "buckets": [b.params for b in self._buckets]}  # (what bucket_cap_mb makes)
        ranks = self.group.ranks if self.group is not None else list(range(self._worker.world_size))
        seen: list[Any] = [None] * len(ranks)
        await C.all_gather_object(seen, (mine, settings, self.bucket_cap_mb), self.group)
        if any(other is None for other in seen):
            return  # not a member (warned): nothing was gathered
        first, first_settings, first_cap = seen[0]
        for rank, (other, other_settings, other_cap) in zip(ranks[1:], seen[1:], strict=True):
            if other != first:
                raise ValueError(
                    "DistributedDataParallel.create: the module differs between ranks, so its "
                    f"replicas cannot be kept equal: {_difference(first, ranks[0], other, rank)}"
                )
            for key, value in first_settings.items():
                if other_settings[key] == value:
                    continue
                if key == "buckets":
                    raise ValueError(
                        "DistributedDataParallel.create: every rank needs the same buckets, and "
                        f"bucket_cap_mb={first_cap!r} on rank {ranks[0]} and bucket_cap_mb="
                        f"{other_cap!r} on rank {rank} make different ones"
                    )
                raise ValueError(
                    f"DistributedDataParallel.create: every rank needs the same {key}, got "
                    f"{value!r} on rank {ranks[0]} and {other_settings[key]!r} on rank {rank}"
                )

    # -- construction -------------------------------------------------------------------
    def _make_buckets(self, cap: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        self._where = [(0, 0, 0)] * len(self._params)
        current: list[int] = []
        size = 0
        key: tuple[torch.dtype, torch.device] | None = None

        def close() -> None:
            nonlocal current, size
            if not current:
                return
            index = len(buckets)
            slots = []
            offset = 0
            for i in current:
                n = self._params[i].numel()
                slots.append((offset, n))
                self._where[i] = (index, offset, n)
                offset += n
            first = self._params[current[0]]
            buffer = torch.zeros(offset, dtype=first.dtype, device=first.device)
            buckets.append(_Bucket(index, current, slots, buffer))
            current, size = [], 0

        for i in reversed(range(len(self._params))):
            p = self._params[i]
            k = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            if current and (k != key or size + nbytes > cap):
                close()
            key = k
            current.append(i)
            size += nbytes
        close()
        return buckets

    def _start_broadcasts(self, tensors: list[torch.Tensor]) -> list[tuple[Any, torch.Tensor, list[torch.Tensor]]]:
        """Start broadcasting rank 0's ``tensors`` (of the group), coalesced by kind."""
        src = self._src
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        started = []
        for _, ts in sorted(by_kind.items(), key=lambda kv: str(kv[0])):
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            started.append((start_broadcast(flat, src, self.group), flat, ts))
        return started

    async def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Copy rank 0's ``tensors`` (of the group) into every replica's, coalesced."""
        for done, flat, ts in self._start_broadcasts(tensors):
            await done
            offset = 0
            with torch.no_grad():
                for t in ts:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n

    # -- forward --------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; with ``find_unused_parameters`` also find the parameters the
        output does not depend on."""
        if self._shares_buffers and not self.module.training and not self._warned_buffers \
                and self._synced_versions is not None and self._buffer_versions() != self._synced_versions:
            self._warned_buffers = True
            warnings.warn(
                "a forward in eval mode after one in training mode, before the backward: its "
                "buffers (running statistics) are this rank's own, where torch's DDP gives every "
                "forward rank 0's; `await ddp.sync_buffers()` before it does the same",
                stacklevel=2)
        out = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._armed = True  # as torch's reducer, prepared for the next backward
            # a distributed backward in this context averages it (see _AverageInContext)
            context = current_context.get()
            self._forward_context = None if context is None else context.context_id
        if self.find_unused_parameters and torch.is_grad_enabled():
            self._unused = self._find_unused(out)
        return out

    def _find_unused(self, out: Any) -> list[int]:
        reached = _reached_leaves(list(_tensors(out)))
        return [i for i, p in enumerate(self._params) if id(p) not in reached]

    # -- backward -------------------------------------------------------------------------
    def _make_hook(self, i: int) -> Any:
        wrapper = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            if (alive := wrapper()) is not None:
                alive._on_gradient(i, p)

        return hook

    def _on_gradient(self, i: int, p: torch.Tensor) -> None:
        """The hook of parameter ``i``: its gradient was accumulated (on a backward thread)."""
        if not self._active:
            if self._armed and self.require_backward_grad_sync:
                # a plain loss.backward(): nobody averages this gradient, and an
                # optimizer step on it would make the replicas diverge for good
                raise RuntimeError(
                    f"parameter {self._names[i]!r} of a DistributedDataParallel module got "
                    "its gradient from `loss.backward()`, which does not average it across "
                    "ranks: use `await ddp.backward(loss)` (inside `with ddp.no_sync():` "
                    "for gradients meant to stay local)"
                )
            # inside no_sync() (or through the bare module, which torch leaves local
            # too): the next synced backward counts it as used here
            self._used_unsynced.add(i)
            return
        if self._claimed[i]:
            # Its slot is (or may be) in flight already: copying now would race the
            # all-reduce. Remember it; backward() raises once the ranks are in step.
            # One parameter's hook runs on one device thread, so no lock is needed.
            self._late.append(i)
            return
        self._claimed[i] = True
        grad = p.grad
        if grad is not None:
            if grad.is_sparse:  # fails this backward on every rank (see backward())
                raise RuntimeError(
                    f"parameter {self._names[i]!r} got a sparse gradient, which this "
                    "DistributedDataParallel does not average; make it dense"
                )
            self._fill_slot(i, grad)
        self._loop.call_soon_threadsafe(self._mark_ready, i)

    def _mark_ready(self, i: int) -> None:
        if self._ready[i] or not self._active:
            return
        self._ready[i] = True
        bucket = self._buckets[self._where[i][0]]
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        if self._deferred:
            return
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            bucket = self._buckets[self._next_launch]
            bucket.written = False
            # divided first, then summed, as torch's allreduce hook does: a float16 sum of
            # world-size gradients overflows where their average does not
            bucket.buffer.div_(self._world_size)
            bucket.future = start_all_reduce(bucket.buffer, C.ReduceOp.SUM, self.group)
            if not self.find_unused_parameters:  # write each bucket's grads as it lands
                bucket.future.add_done_callback(functools.partial(self._bucket_done, bucket))
            self._next_launch += 1

    def _bucket_done(self, bucket: _Bucket, future: asyncio.Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None or not self._active:
            return
        self._write_bucket(bucket, None)

    def _prepare(self) -> None:
        self._next_launch = 0
        self._ready = [False] * len(self._params)
        self._claimed = [False] * len(self._params)
        self._late = []
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
            bucket.future = None
        self._active = True
        for i in self._unused:
            self._claimed[i] = True  # set before the backward thread starts: it sees it
            self._slot_as_is(i)
            self._mark_ready(i)

    def _slot_as_is(self, i: int) -> None:
        """The slot of a parameter unused in this backward: the gradient it holds
        already (no zero_grad, or no_sync()), which counts as in torch, or zero."""
        grad = self._params[i].grad
        if grad is None or grad.is_sparse:
            self._zero_slot(i)
        else:
            self._fill_slot(i, grad)

    def _fill_slot(self, i: int, grad: torch.Tensor) -> None:
        b, offset, n = self._where[i]
        self._buckets[b].buffer[offset : offset + n].copy_(grad.detach().reshape(-1))

    def _zero_slot(self, i: int) -> None:
        b, offset, n = self._where[i]
        self._buckets[b].buffer[offset : offset + n].zero_()

    async def backward(self, loss: torch.Tensor, gradient: torch.Tensor | None = None,
                       retain_graph: bool | None = None) -> None:
        """``loss.backward()`` with gradients averaged over the group into ``.grad``.

        The local backward runs on the worker's thread pool while the buckets that are
        complete are all-reduced on the loop. Inside :meth:`no_sync` only the local
        backward runs (gradients accumulate locally).

        Other wrappers of this worker whose parameters ``loss`` reaches (a GAN's
        discriminator in the generator's loss, a head and an encoder wrapped apart)
        are averaged too, as one ``loss.backward()`` does in torch: after this one, in
        the order they were created (the same on every rank).

        Every rank issues the same collectives whatever happens locally, and all of
        them raise when any rank's step went wrong (the gradients would not be a true
        average): the rank where it happened raises its own error, the others a
        RuntimeError that says so.

        Raises:
            RuntimeError: some parameters got no gradient on some rank and
                ``find_unused_parameters`` is off (their buckets were reduced with
                zeros); a parameter's gradient came after it was marked ready (used
                outside forward, or reused in reentrant backward passes); or the local
                backward raised on another rank.
            Exception: whatever the local ``loss.backward()`` raised on this rank.
            CollectiveError: the all-reduce failed (a rank is gone, ...).
        """
        if self._active:
            raise RuntimeError(
                "a backward of this DistributedDataParallel module is running already (its "
                "own, or another wrapper's whose loss reaches its parameters)"
            )
        # One backward of this worker's wrappers at a time per group, in the order they
        # were called: the collectives of two at once would pair up across ranks in
        # the order their hooks fire, averaging one model's buckets with the other's.
        # That holds for every group whose wrappers this loss reaches (averaged too).
        reached = self._reached_others(loss)  # (those another backward has taken too)
        groups = {_group_key(self.group), *(_group_key(w.group) for w in reached)}
        async with _turns(self._worker).turn(groups):
            await self._backward(loss, gradient, retain_graph, reached)

    async def _backward(self, loss: torch.Tensor, gradient: torch.Tensor | None,
                        retain_graph: bool | None, reached: list[DistributedDataParallel]) -> None:
        # in no_sync() this one's gradients stay local, but those of other wrappers the
        # loss reaches are averaged still (of those, the ones still to average after
        # the wait for this turn: another backward may have taken one meanwhile)
        own = [self] if self.require_backward_grad_sync else []
        wrappers = own + [w for w in reached if w._synchronising() and not w._active]
        local = functools.partial(_local_backward, loss, gradient, retain_graph)
        if not wrappers:
            await _to_its_end(self._worker.run_blocking(local))
            return
        for wrapper in wrappers:
            await wrapper._buckets_settled()
        for wrapper in wrappers:
            wrapper._begin(deferred=wrapper is not self)
        local_error: Exception | None = None
        errors = []
        try:
            try:
                await _to_its_end(self._worker.run_blocking(local))
            except Exception as exc:  # noqa: BLE001 - raised below, once the ranks are in step
                local_error = exc
            for wrapper in wrappers:  # one after the other: the same collectives everywhere
                error = await wrapper._finish(local_error)
                if error is not None:
                    errors.append(error)
        finally:
            for wrapper in wrappers:  # cancelled, or a failure on the way: the rest goes
                wrapper._issue_rest()  # out, and no wrapper stays taken
        if errors:
            raise errors[0]

    async def _average_in_context(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """After a distributed backward on this worker: average the gradients it left in
        its context (``grads``) over the group, there, as torch's DDP does inside
        ``dist_autograd.backward``; the same collectives and checks as :meth:`backward`.
        (Deferred: no bucket goes out before every slot holds the context's value.)"""
        await self._buckets_settled()
        self._begin(deferred=True)
        error: Exception | None = None
        try:
            for i, p in enumerate(self._params):
                grad = grads.get(p)
                if self._claimed[i]:  # unused at forward (find_unused_parameters): the
                    # context's gradient or zero, never a .grad left by another backward
                    if grad is not None:
                        self._fill_slot(i, grad)
                    else:
                        self._zero_slot(i)
                elif grad is not None:
                    self._claimed[i] = True
                    self._fill_slot(i, grad)
                    self._mark_ready(i)
            self._into = grads
            error = await self._finish(None)
        finally:
            self._into = None
            self._issue_rest()  # (a cancelled one: the rest still goes out)
        if error is not None:
            raise error

    def _launch_rest(self) -> list[int]:
        """Launch every bucket not launched yet, with zeros for the gradients that did
        not come (the collectives of all ranks stay in step); those parameters. With
        find_unused_parameters they are unused here (the output reached them, the loss
        did not): their slots hold what they hold already, as the unreached ones'."""
        self._deferred = False
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        for i in missing:
            if self.find_unused_parameters:
                self._slot_as_is(i)
            else:
                self._zero_slot(i)
            self._ready[i] = True
            self._buckets[self._where[i][0]].pending -= 1
        self._launch_ready()
        return missing

    def _synchronising(self) -> bool:
        """Whether a backward would average this wrapper's gradients now."""
        return self._armed and self.require_backward_grad_sync

    def _reached_others(self, loss: Any) -> list[DistributedDataParallel]:
        """This worker's other wrappers, synchronising, whose parameters ``loss`` reaches
        (also those another backward has taken for now)."""
        others = [w for ref in _wrappers.get(self._worker, []) if (w := ref()) is not None
                  and w is not self and w._synchronising()]
        if not others or not isinstance(loss, torch.Tensor):
            return []
        reached = _reached_leaves([loss])
        return [w for w in others if any(id(p) in reached for p in w._params)]

    def _issue_rest(self) -> None:
        """After a backward that was cancelled or failed on the way: issue the
        collectives it had not yet (buckets, the status saying this rank failed, the
        buffers), without waiting, so that every rank's next ones still pair up."""
        if self._active:
            self._launch_rest()
        if not self._status_issued:
            nothing = [False] * len(self._params)
            start_all_reduce(_status(nothing, nothing, nothing, True), C.ReduceOp.SUM, self.group)
            self._status_issued = True
        if not self._buffers_issued and self.broadcast_buffers and (buffers := list(self.module.buffers())):
            self._start_broadcasts(buffers)  # (this rank keeps its own: it gave up the step)
            self._buffers_issued = True
        self._active = False
        self._armed = False
        self._unfinished = [b.future for b in self._buckets if b.future is not None and not b.future.done()]

    async def _buckets_settled(self) -> None:
        """Wait for the all-reduces a cancelled backward left running (their results are
        not this backward's gradients: they land in the buckets, unused)."""
        if self._unfinished:  # (shielded: a wait given up on leaves them to the next)
            await asyncio.shield(asyncio.gather(*self._unfinished, return_exceptions=True))
            self._unfinished = []

    def _begin(self, deferred: bool) -> None:
        self._status_issued = self._buffers_issued = False
        self._used_before = self._used_unsynced  # no_sync() use counts
        self._unused_now = set(self._unused) - self._used_before
        self._used_unsynced = set()
        self._deferred = deferred
        self._prepare()

    async def _finish(self, local_error: Exception | None) -> Exception | None:
        """After the local backward: reduce what is left, learn what went wrong on any
        rank, write the averages; the error to raise, if any."""
        n = len(self._params)
        unused = self._unused_now
        try:
            missing = self._launch_rest()
            # One small all-reduce tells every rank what went wrong anywhere, so that all
            # of them raise instead of one rank raising and the others stepping with
            # gradients averaged against its zeros: [used by] + [came late on] +
            # [missing on] per parameter, then the number of ranks whose backward raised.
            late = set(self._late)
            failed = local_error is not None
            if self.find_unused_parameters and not failed:
                unused = unused | {i for i in missing if i not in self._used_before}
            status = _status([i not in unused for i in range(n)], [i in late for i in range(n)],
                             [not failed and i in missing for i in range(n)], failed)
            status_done = start_all_reduce(status, C.ReduceOp.SUM, self.group)
            self._status_issued = True
            # shielded: a cancelled backward must not cancel the buckets' futures, whose
            # all-reduces go on and write into the buckets (see _buckets_settled)
            landed = asyncio.gather(*(b.future for b in self._buckets if b.future is not None), status_done)
            landed.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read, if left)
            await asyncio.shield(landed)
            counts = [round(v) for v in status.tolist()]
            global_used = [k > 0 for k in counts[:n]] if self.find_unused_parameters else None
            late_ranks, missing_ranks, failed_ranks = counts[n : 2 * n], counts[2 * n : 3 * n], counts[3 * n]
        finally:
            self._active = False
            self._armed = False
        self._write_grads(global_used)  # (_unused holds until the next forward, as torch's)
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                self._buffers_issued = True
                await self._broadcast(buffers)
                self._buffers_received()
        if local_error is not None:
            return local_error
        if failed_ranks:
            return RuntimeError(
                f"the local backward raised on {failed_ranks} other rank(s) (see their error); "
                "this step's gradients were averaged with zeros for them: do not step on them"
            )
        if any(late_ranks):
            return RuntimeError(self._late_message(late_ranks))
        if any(missing_ranks) and not self.find_unused_parameters:
            names = ", ".join(
                f"{self._names[i]} (on {k} rank(s))" for i, k in enumerate(missing_ranks) if k
            )
            return RuntimeError(
                f"{sum(1 for k in missing_ranks if k)} parameter(s) received no gradient in this "
                f"backward: {names}; the other ranks reduced zeros for them. If some "
                "parameters are legitimately not used in some iterations, create the wrapper "
                "with find_unused_parameters=True"
            )
        return None

    def _late_message(self, late_ranks: list[int]) -> str:
        names = ", ".join(f"{self._names[i]!r} (on {k} rank(s))" for i, k in enumerate(late_ranks) if k)
        # Only find_unused_parameters marks a parameter ready before its hook runs; a
        # second hook call otherwise means a second accumulation (reentrant backward).
        outside = (
            "the parameter is used outside the wrapped module's forward (e.g. in the loss), "
            "where find_unused_parameters=True cannot see it and reduces a zero for it: use "
            "it inside forward(); or " if self.find_unused_parameters else ""
        )
        return (
            f"Expected to mark a parameter ready only once, but {names} got a gradient "
            "after being marked ready in this backward; its bucket had been all-reduced "
            f"without it, so the replicas would diverge. Cause: {outside}it is reused across "
            "reentrant backward passes (e.g. torch.utils.checkpoint with use_reentrant=True, "
            "and a parameter used both inside and outside the checkpoint): use "
            "use_reentrant=False"
        )

    def _write_grads(self, global_used: list[bool] | None) -> None:
        for bucket in self._buckets:
            if not bucket.written:
                self._write_bucket(bucket, global_used)

    def _write_bucket(self, bucket: _Bucket, global_used: list[bool] | None) -> None:
        """Put the averaged gradients of ``bucket`` into ``.grad``."""
        bucket.written = True
        buffer = bucket.buffer
        with torch.no_grad():
            for i, (offset, n) in zip(bucket.params, bucket.slots, strict=True):
                if global_used is not None and not global_used[i]:
                    continue
                p = self._params[i]
                avg = buffer[offset : offset + n].view_as(p)
                if self._into is not None:
                    self._into[p] = avg.clone()
                elif p.grad is None or p.grad.is_sparse:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)

    async def sync_buffers(self) -> None:
        """Copy rank 0's buffers into every replica (torch does this each forward)."""
        buffers = list(self.module.buffers())
        if buffers:
            await self._broadcast(buffers)
            self._buffers_received()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient averaging inside (local accumulation, as torch's ``no_sync``)."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def __reduce_ex__(self, protocol: Any) -> Any:
        # (copy, deepcopy, pickle and torch.save all come here)
        raise TypeError(
            "a DistributedDataParallel wrapper belongs to its worker and group, and cannot be "
            "copied or pickled: copy or save its .module (or state_dict()), and wrap a copy "
            "with `await DistributedDataParallel.create(...)`"
        )

    def remove_hooks(self) -> None:
        """Detach the wrapper from the module's parameters."""
        _remove_hooks(self._hooks)
        self._hooks = []

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in bucket order."""
        return [len(b.params) for b in self._buckets]


def _difference(first: list[Any], rank0: int, other: list[Any], rank: int) -> str:
    """The first difference between two ranks' descriptions of their module."""
    mine = {(kind, name): rest for kind, name, *rest in first}
    theirs = {(kind, name): rest for kind, name, *rest in other}
    def said(kind: str, rest: list[Any] | None, on: int) -> str:
        if rest is None:
            return f"none on rank {on}"
        shape, dtype, requires_grad = rest
        grad = "" if kind == "buffer" else (", requires grad" if requires_grad else ", frozen")
        return f"{tuple(shape)} {dtype}{grad} on rank {on}"

    for key in [*mine, *(k for k in theirs if k not in mine)]:
        if mine.get(key) != theirs.get(key):
            kind, name = key
            return f"{kind} {name!r}: {said(kind, mine.get(key), rank0)}, {said(kind, theirs.get(key), rank)}"
    return f"the order of parameters differs between rank {rank0} and rank {rank}"


def _check_devices(module: nn.Module, device_ids: list[Any] | None, output_device: Any) -> None:
    """torch's device_ids / output_device name the one device of the module, if any."""
    devices = {p.device for p in module.parameters()}
    named = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
             for d in (device_ids or [])]
    if output_device is not None:
        named.append(torch.device(output_device) if not isinstance(output_device, int)
                     else torch.device("cuda", output_device))
    for device in named:
        if devices != {device}:
            raise ValueError(
                f"device_ids/output_device name {device}, but the module's parameters are on "
                f"{', '.join(sorted(map(str, devices)))}: move the module to its device first"
            )


async def _to_its_end(job: asyncio.Future[Any]) -> Any:
    """Await a job of the thread pool. A caller that gives up (a timeout) still waits
    for it, since it cannot be stopped midway: a local backward adds into ``.grad``, and
    must have ended when the call raises, not run on beside the caller's next step."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait({job})
        raise


def _local_backward(loss: torch.Tensor, gradient: torch.Tensor | None, retain_graph: bool | None) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
    loss.backward(gradient, retain_graph)


# every wrapper of a worker, in creation order (the same on every rank)
_wrappers: weakref.WeakKeyDictionary[Worker, list[weakref.ref[DistributedDataParallel]]] = (
    weakref.WeakKeyDictionary())
_backward_turns: weakref.WeakKeyDictionary[Worker, _Turns] = weakref.WeakKeyDictionary()


class _AverageInContext:
    """Takes part in every distributed backward (``autograd.backward``) of a worker that
    holds wrappers: those whose forward ran in the context since their last averaged
    backward average the gradients it left there, one after the other in creation order
    (the same on every rank). A pass that failed still issues their collectives, with a
    status saying so, so that the other ranks raise instead of waiting. A pass started
    on another worker that reaches their parameters fails, naming the problem: it would
    leave them unaveraged (torch averages them wherever they are)."""

    @staticmethod
    def _taking_part(worker: Worker, ctx: Any) -> list[DistributedDataParallel]:
        # those whose forward ran in this context, whatever gradients came (on every
        # rank alike); one waiting for its own ddp.backward is left alone
        return [w for ref in _wrappers.get(worker, []) if (w := ref()) is not None
                and w._synchronising() and not w._active
                and w._forward_context == ctx.context_id]

    async def done(self, worker: Worker, ctx: Any) -> None:
        for wrapper in self._taking_part(worker, ctx):
            async with _turns(worker).turn({_group_key(wrapper.group)}):
                await wrapper._average_in_context(ctx.grads)

    def failed(self, worker: Worker, ctx: Any) -> None:
        for wrapper in self._taking_part(worker, ctx):
            wrapper._begin(deferred=False)
            wrapper._issue_rest()

    def reached_elsewhere(self, worker: Worker, ctx: Any, leaves: Any) -> None:
        ids = {id(leaf) for leaf in leaves}
        for wrapper in self._taking_part(worker, ctx):
            if any(id(p) in ids for p in wrapper._params):
                raise RuntimeError(
                    f"parameters of a DistributedDataParallel module on {worker.name} got "
                    "gradients in a distributed backward started on another worker: they are "
                    "averaged over the group only when the worker holding them calls "
                    "`await ag.autograd.backward(context_id, [loss])` (each trainer runs the "
                    "backward of its own loss), or with `await ddp.backward(loss)`"
                )


after_backward.append(_AverageInContext())


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()  # (again after remove_hooks(): does nothing)


def _status(used: list[bool], late: list[bool], missing: list[bool], failed: bool) -> torch.Tensor:
    """One rank's part of a step's status all-reduce (see ``_finish``): per parameter
    whether it was used, came late, is missing, then whether the local backward failed."""
    return torch.tensor([float(x) for x in (*used, *late, *missing, failed)])


class _Turns:
    """The backwards of one worker's wrappers take their turns in the order they were
    called: each starts once no backward called before it, running or waiting, needs
    one of its groups. So a group runs one backward at a time, and ranks that call
    their backwards in the same order run them in that order in every group, also when
    one needs several groups (per-group locks taken one by one let a later backward
    overtake one waiting for its first lock, on one rank and not another)."""

    def __init__(self) -> None:
        self._queue: list[_Turn] = []  # in call order
        self._moved: asyncio.Future[None] | None = None  # done when one ends

    def _blocked(self, entry: _Turn) -> bool:
        for other in self._queue:
            if other is entry:
                return False
            if other.groups & entry.groups:
                return True
        return False

    @contextlib.asynccontextmanager
    async def turn(self, groups: set[int | None]) -> AsyncIterator[None]:
        entry = _Turn(frozenset(groups))
        self._queue.append(entry)
        try:
            while self._blocked(entry):
                if self._moved is None or self._moved.done():
                    self._moved = asyncio.get_running_loop().create_future()
                await asyncio.shield(self._moved)  # (shared: one waiter's cancel is its own)
            yield
        finally:
            self._queue.remove(entry)
            if self._moved is not None and not self._moved.done():
                self._moved.set_result(None)

    def __len__(self) -> int:
        return len(self._queue)


class _Turn:
    """One backward's place in the queue (equal only to itself: two of the same groups
    are two places)."""

    __slots__ = ("groups",)

    def __init__(self, groups: frozenset[int | None]) -> None:
        self.groups = groups


def _turns(worker: Worker) -> _Turns:
    turns = _backward_turns.get(worker)
    if turns is None:
        turns = _backward_turns[worker] = _Turns()
    return turns


def _group_key(group: Any) -> int | None:
    return None if group is None else group.id


def _reached_leaves(outputs: list[torch.Tensor]) -> set[int]:
    """``id()`` of the leaf tensors whose gradients a backward of ``outputs`` accumulates."""
    reached = {id(t) for t in outputs if t.requires_grad and t.grad_fn is None}
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if var is not None:
            reached.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return reached


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output, as torch's DDP finds them: in lists, tuples,
    dicts and dataclasses, nested."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


__all__ = ["DistributedDataParallel"]
