"""OptimizerActor and DistributedOptimizer: local optimizers applying context gradients.

``DistributedOptimizer`` groups parameter RRefs by owner and asks each owner's
OptimizerActor to build one local optimizer over its parameters. ``step(context_id)``
sends OPT_STEP to every owner at once; each owner takes that context's gradients for its
parameters, assigns them as ``.grad`` for the duration of the step, steps under a
per-optimizer lock (concurrent steps on the same parameters are serialized) and clears
them again. The step itself runs on the worker's thread pool, off the event loop.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ContextError
from ..autograd import _context
from ..rpc import RRef
from ..rpc._api import pickling_for
from ..runtime import Worker, get_worker
from ..wire import Payload, TupleMessage


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateOptimizer(TupleMessage):
    """Build a local optimizer over ``params`` (RRefs owned by the receiving worker)."""

    TARGET = "optim.create"
    optimizer_id: tuple[int, int]
    optimizer_class: Any
    params: tuple[RRef[Any], ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class OptStep(TupleMessage):
    """OPT_STEP: apply the gradients of ``context_id`` with optimizer ``optimizer_id``."""

    TARGET = "optim.step"
    optimizer_id: tuple[int, int]
    context_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DropOptimizer(TupleMessage):
    TARGET = "optim.drop"
    optimizer_id: tuple[int, int]


class _LocalOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params


class OptimizerActor:
    """Holds this worker's local optimizers and applies context gradients with them."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.optimizers: dict[tuple[int, int], _LocalOptimizer] = {}
        # optimizers being created -> whether they were dropped meanwhile (then they
        # are not kept: nobody can step or drop them any more)
        self._creating: dict[tuple[int, int], bool] = {}
        # One lock for all local optimizers: two optimizers may share parameters, and
        # each assigns and clears .grad around its step (PyTorch also uses one lock).
        self.lock = asyncio.Lock()

    def on_create(self, peer: Any, payload: Payload) -> Any:
        msg = CreateOptimizer.load(payload)

        key = msg.optimizer_id
        self._creating[key] = False  # now: a drop may come before the task first runs

        async def create() -> Payload:
            try:
                params = [await p.to_here() for p in msg.params]
                # off the loop: the first optimizer of a process imports torch._dynamo (~2 s)
                optimizer = await self.worker.run_blocking(
                    lambda: msg.optimizer_class(params, *msg.args, **msg.kwargs)
                )
                if not callable(getattr(optimizer, "step", None)):
                    raise TypeError(
                        f"optimizer_class made a {type(optimizer).__name__}, which has no step(): "
                        "DistributedOptimizer needs a torch.optim.Optimizer subclass"
                    )
                if not self._creating[key]:
                    self.optimizers[key] = _LocalOptimizer(optimizer, params)
            finally:
                del self._creating[key]
            return Payload.dump(None)

        return create()

    def on_step(self, peer: Any, payload: Payload) -> Any:
        msg = OptStep.load(payload)
        return self._step(msg.optimizer_id, msg.context_id)

    def on_worker_lost(self, name: str, rank: int, reason: str) -> None:
        """The optimizers a lost worker created can never be stepped or dropped by it."""
        for key in [k for k in self.optimizers if k[0] == rank]:
            del self.optimizers[key]
        for key in self._creating:
            if key[0] == rank:
                self._creating[key] = True

    def on_drop(self, peer: Any, payload: Payload) -> None:
        key = DropOptimizer.load(payload).optimizer_id
        if self.optimizers.pop(key, None) is None and key in self._creating:
            self._creating[key] = True

    async def _step(self, optimizer_id: tuple[int, int], context_id: int) -> Payload:
        local = self.optimizers.get(optimizer_id)
        if local is None:
            raise RuntimeError(f"{self.worker.name} has no optimizer {optimizer_id}")
        ctx = _context.context_actor(self.worker).contexts.get(context_id)
        if ctx is None:
            # the context exists on the caller (step checked): this worker took no part
            # in it, so none of its parameters has a gradient there (torch: no change)
            return Payload.dump(None)
        grads = ctx.grads

        async def locked() -> None:
            async with self.lock:
                update = [(p, grads.get(p)) for p in local.params]

                def apply() -> None:
                    try:
                        for param, grad in update:
                            param.grad = grad
                        local.optimizer.step()
                    finally:
                        for param, _ in update:
                            param.grad = None

                await self.worker.run_blocking(apply)

        # A caller that gives up (timeout, cancel) cancels this handler, but the step
        # already on the thread pool runs on: the lock must stay held until it ends, or
        # the next step would run beside it on the same parameters.
        await asyncio.shield(asyncio.ensure_future(locked()))
        return Payload.dump(None)


_ids = itertools.count(1)


class _ReachedParameters(BaseException):  # noqa: N818 - a signal, not an error
    """Raised by ``_NoParameters`` once an optimizer's constructor reads its parameters
    (a BaseException, so that a constructor's ``except Exception`` lets it through)."""


class _NoParameters(list[Any]):
    """Stands for the parameters in ``_check_arguments``: the constructor's argument
    checks run before it reads them (torch's optimizers check their hyperparameters
    first, then hand the parameters to ``Optimizer.__init__``); reading them in any way
    (iterating, ``len``, indexing) ends the check, so nothing about the real parameters
    (Muon takes 2-D ones only) is judged on a stand-in."""

    def __iter__(self) -> Any:
        raise _ReachedParameters

    def __len__(self) -> int:
        raise _ReachedParameters

    def __getitem__(self, index: Any) -> Any:
        raise _ReachedParameters

    def __bool__(self) -> bool:
        raise _ReachedParameters


def _check_arguments(optimizer_class: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse what every owner would refuse (a negative learning rate, an unknown
    keyword) here and now, as torch's constructor does, instead of at the first step:
    the constructor runs until it reads its parameters. Other failures are the
    owners' to report (an optimizer may need the real parameters)."""
    if not callable(optimizer_class) or (
            isinstance(optimizer_class, type) and not issubclass(optimizer_class, torch.optim.Optimizer)
            and not callable(getattr(optimizer_class, "step", None))):
        if isinstance(optimizer_class, torch.optim.Optimizer):  # (its repr lists every group)
            got = f"a {type(optimizer_class).__name__} already made: pass its class and arguments"
        else:
            got = f"{optimizer_class!r:.80}"
        raise TypeError(
            f"optimizer_class must be an optimizer class (a torch.optim.Optimizer subclass), got {got}")
    try:
        optimizer_class(_NoParameters(), *args, **kwargs)
    except _ReachedParameters:
        pass
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{getattr(optimizer_class, '__name__', optimizer_class)}: {exc}") from exc
    except Exception:  # noqa: BLE001 - not an argument problem: the owners will tell
        pass


class DistributedOptimizer:
    """One ``optimizer_class`` per owner of the parameters in ``params_rref``.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass, e.g. ``torch.optim.SGD``.
        params_rref: RRefs to parameters, local or remote.
        *args, **kwargs: passed to every ``optimizer_class`` instance.

    The remote optimizers are created in the background; ``step`` waits for them.
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params_rref: Sequence[RRef[Any]],
                 *args: Any, **kwargs: Any) -> None:
        if isinstance(params_rref, RRef) or not isinstance(params_rref, collections.abc.Iterable):
            raise TypeError(f"params_rref must be a list of RRefs, got {type(params_rref).__name__}")
        params_rref = list(params_rref)
        if not params_rref:
            raise ValueError("DistributedOptimizer needs at least one parameter RRef")
        _check_arguments(optimizer_class, args, kwargs)
        worker = get_worker()
        by_owner: dict[int, list[RRef[Any]]] = {}
        for rref in params_rref:
            if not isinstance(rref, RRef):
                raise TypeError(f"params_rref must hold RRefs, got {type(rref).__name__}")
            by_owner.setdefault(rref.owner().id, []).append(rref)
        self._worker = worker  # from here on, __del__ drops what was created
        self._id = (worker.rank, next(_ids))
        self._owners = sorted(by_owner)
        created = []
        for owner, rrefs in by_owner.items():
            message = CreateOptimizer(optimizer_id=self._id, optimizer_class=optimizer_class,
                                      params=tuple(rrefs), args=args, kwargs=kwargs)
            with pickling_for(owner):  # the RRefs go to their owner
                # (an optimizer class of the script is the owner's own where it runs it)
                payload = message.dump(main_by_name=worker.same_program(owner))
            # (no rpc timeout: a first optimizer may take long to make, importing what it
            # needs, and a creation given up would leave this optimizer failing for good;
            # a lost owner still fails it)
            created.append(worker.call(owner, CreateOptimizer.TARGET, payload, timeout=0))
        # every owner's optimizer, awaited by the steps until it succeeded
        self._creation: asyncio.Future[list[Payload]] | None = asyncio.gather(*created)
        self._creation.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def step(self, context_id: int) -> None:
        """Apply the gradients of ``context_id`` on every owner, in parallel.

        Owners that took no part in the context have no gradients in it: their
        parameters stay as they are (as in torch). Every owner has answered before an
        error is raised, so no step is still running when it is; a step given up here
        (cancelled) also returns only once the owners' steps ended. The owners' steps
        (and the making of their optimizers) are not timed out by ``rpc_timeout``: one
        given up here would still be applied there afterwards; a lost owner fails it.

        Raises:
            ContextError: ``context_id`` is not a live context of this worker, a
                backward in it failed midway (cancelled, a peer lost...), or one is
                still running.
        """
        if self._worker.closed:
            # (its contexts are gone: the error read as if the live context did not exist)
            raise RuntimeError(
                f"this DistributedOptimizer belongs to {self._worker.name} of a group that was shut "
                "down; make a new one for the parameters of the current group"
            )
        ctx = _context.context_actor(self._worker).get(context_id)
        if ctx.failed_backward is not None:
            raise ContextError(
                f"a backward in context {context_id} failed ({ctx.failed_backward}): its "
                "gradients are partial (some owners may have theirs, others not), and a step "
                "on them would update only part of the model: run the iteration again in a "
                "new context"
            )
        if ctx.passes_running:
            raise ContextError(
                f"a backward in context {context_id} is still running: its gradients are "
                "partial until it ends (some owners have theirs, others not yet), and a step "
                "on them would update only part of the model: await the backward first"
            )
        if self._creation is not None:
            # shielded: a step given up here (a timeout) must not cancel the creation
            # of the owners' optimizers, which every later step needs
            await asyncio.shield(self._creation)
            self._creation = None
        message = OptStep(optimizer_id=self._id, context_id=context_id).dump()
        # (no rpc timeout: an owner's step given up here would still be applied there
        # afterwards, behind the caller's back; a lost owner still fails it)
        steps = asyncio.gather(
            *(self._worker.call(o, OptStep.TARGET, message, timeout=0) for o in self._owners),
            return_exceptions=True
        )
        try:
            results = await asyncio.shield(steps)
        except asyncio.CancelledError:
            # Given up here, the owners' steps run on (one on a thread pool cannot be
            # stopped midway): wait for them (each bounded by the rpc timeout), so that
            # the caller's next iteration never runs beside them on the parameters.
            await steps
            raise
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def zero_grad(self) -> None:
        """Nothing to do: gradients live in autograd contexts, not in ``.grad``."""

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is None or worker.closed or worker.loop.is_closed():
            return
        message = DropOptimizer(optimizer_id=self._id).dump()

        def drop() -> None:
            for owner in self._owners:
                with contextlib.suppress(Exception):  # owner gone: its optimizers went with it
                    worker.tell(owner, DropOptimizer.TARGET, message)

        with contextlib.suppress(RuntimeError):  # the loop is closed
            worker.loop.call_soon_threadsafe(drop)


def setup(worker: Worker) -> None:
    actor = OptimizerActor(worker)
    worker.extensions["optim"] = actor
    worker.register(CreateOptimizer.TARGET, actor.on_create)
    worker.register(OptStep.TARGET, actor.on_step)
    worker.register(DropOptimizer.TARGET, actor.on_drop, tell_only=True)
    worker.add_lost_listener(actor.on_worker_lost)
