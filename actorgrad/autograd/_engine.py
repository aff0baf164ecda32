"""EngineActor: executes this worker's part of a distributed backward pass.

# Theory of operation
``backward`` on the worker holding the roots mints a backward id; every worker keeps a
*graph task* for it. Execution is planned per worker (``_plan``): the starts are the
roots and the send entries that take part, and every local node runs exactly once, in
the ``torch.autograd.grad`` call of the start that feeds it or, where several starts
meet, as a stop that runs once all their shares have arrived. The calls run on the
worker's thread pool, so the event loop keeps serving peers and heartbeats.

A recv entry whose leaves have all their gradients sends them (PROPAGATE_GRADS) to the
worker that sent the tensors, where the matching send entry is a start. A worker
answers a PROPAGATE_GRADS only when everything it caused (its job, the stops that job
completed, the propagations they made) has finished, so ``backward`` returns exactly
when all gradient propagation everywhere is done, and raises the first failure.

A job that ends in exactly one propagation, with nothing else left to wait for, does
not wait to relay the answer: it passes the duty to answer along with that
propagation (a tell carrying the caller's request id and the report so far), and the
worker where the work ends answers the caller directly. A chain of K round trips is
then answered by one message instead of 2K relayed ones. The duty only moves to the
caller itself or to the worker it called, whose loss fails the caller's call at once;
anything else is called and awaited as before.

A worker whose send job would do nothing but hand the gradients, unchanged, to one recv
entry (a caller passing an RPC's result on as it came: a chain of calls, a driver
handing one stage's output to the next) declares such pairs, *relays*. Relays travel
with PROPAGATE_GRADS (each worker passes on those it knows, once per peer); the worker
holding the recv paired with the send then sends the gradients to where the relaying
worker's recv came from itself: it runs its own matching send job when that is itself,
and calls the other worker otherwise (a call, not a passed-on duty to answer, so losing
that worker fails it at once). A chain of K hops so costs one gradient message each
way, not 2K, and a pipeline's stages pass gradients to each other without the driver.
The relaying worker's plan keeps the pair waiting; nothing waits on it, and the worker
that acts on the relay reports both pairs fired.

FAST mode (PyTorch's): every send entry of the context is a start. An RPC whose output
the roots do not use leaves its send waiting; PyTorch waits forever, we finish all that
can finish, see from the answers which send/recv pairs stayed silent, and raise
ContextError naming them. SMART mode first *discovers* the distributed graph: from the
roots, each reached recv asks the worker holding its send to continue the traversal
(TRAVERSE, acknowledged when the sub-traversal is done). Only reached sends become
starts, so unused RPCs are skipped and every node gets exactly the gradient the roots
induce.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import sys
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch.autograd.graph import GradientEdge

from .._errors import ContextError
from ..runtime import Worker, get_worker
from ..runtime._torch_modes import as_a_fresh_thread, fresh_modes
from ..wire import Payload
from ._context import (
    ID_BITS,
    ContextActor,
    DistContext,
    RecvRpcBackward,
    check_context_id,
    context_actor,
    engine_calls,
    root_tensors,
)
from ._loans import Loans
from ._messages import (
    DESCRIBE,
    BackwardReport,
    PropagateGrads,
    Relay,
    Traverse,
    pack_ids,
    pack_relays,
    travelling,
    unpack_ids,
    unpack_relays,
)
from ._plan import Plan, TooBig, make_plan, reached_recvs, suppressing

ROOTS = ("roots",)
# Work small enough to do on the event loop itself: a hop to the thread pool costs more.
_INLINE_PLAN_NODES = 256
_INLINE_JOB_NODES = 32
_INLINE_JOB_BYTES = 1 << 20
_RECV_NODE = RecvRpcBackward._backward_cls
# torch's node types, which run no user Python (a custom autograd.Function's backward
# does: it may take any time, or make a blocking call into the worker, so never on the
# loop). Only these are kept: Function classes may be made on the fly, and must go.
_RUNS_NO_PYTHON: set[type] = {_RECV_NODE}
_BackwardCFunction = torch.autograd.function.BackwardCFunction
# torch.autograd.grad minus its argument checks (and their first-use imports): our
# gradients always match their outputs.
_torch_run_backward = torch.autograd.Variable._execution_engine.run_backward


def _run_backward(*call: Any) -> Any:
    """torch's engine, counted (the recv functions it runs check that it is ours), in
    the torch modes of a fresh thread (torch runs CPU nodes under the calling thread's
    autocast; a coroutine waiting inside ``torch.autocast`` leaves it on the loop)."""
    calls = engine_calls
    calls.count += 1
    try:
        if fresh_modes():
            return _torch_run_backward(*call)
        with as_a_fresh_thread():
            return _torch_run_backward(*call)
    finally:
        calls.count -= 1


def _references(results: tuple[Any, ...], i: int) -> int:
    """References to ``results[i]`` as _unshared counts them (the results' own among them)."""
    return sys.getrefcount(results[i])


# ... when only the results hold it, once (measured: interpreters differ in what they count)
_ONLY_THE_RESULTS = _references((object(),), 0)


def _unshared(results: tuple[torch.Tensor | None, ...], leaves: int) -> tuple[torch.Tensor | None, ...]:
    """torch's results with the gradients of the job's leaves (the first ``leaves``)
    that something else holds too cloned: a custom Function's backward or a hook may
    return a tensor it keeps (a constant, a saved mask), which the context must not
    store as it is, since changing the context's gradient in place (an optimizer, gradient
    clipping) would change that tensor. torch's AccumulateGrad clones such a gradient
    too. A gradient torch computed is referenced by the results alone; one handed to
    several leaves unchanged is left to DistContext.accumulate, which clones it once."""
    for i in range(leaves):
        if results[i] is not None and _references(results, i) > _ONLY_THE_RESULTS:
            break
    else:
        return results
    seen = collections.Counter(map(id, results))
    held = [i for i in range(leaves) if results[i] is not None
            and _references(results, i) > _ONLY_THE_RESULTS - 1 + seen[id(results[i])]]
    return tuple(grad.clone() if i in held and grad is not None else grad for i, grad in enumerate(results))


T = TypeVar("T")


def _runs_python(region: Sequence[Any]) -> bool:
    """Whether a job's nodes include a custom autograd.Function (other than our recv)."""
    for node in region:
        kind = type(node)
        if kind not in _RUNS_NO_PYTHON:
            if issubclass(kind, _BackwardCFunction):
                return True
            _RUNS_NO_PYTHON.add(kind)
    return False


def _hooked(pairs: Sequence[tuple[Any, torch.Tensor]], inputs: Sequence[Any]) -> bool:
    """Whether a job's start tensors or target leaves carry tensor hooks: user Python
    (it may block, or call ``rpc_sync``), so the job goes to the pool. (Hooks on the
    tensors in between cannot be seen from their nodes: see the README.)"""
    return any(type(start) is not GradientEdge and start._backward_hooks for start, _ in pairs) or any(
        type(target) is not GradientEdge and target._backward_hooks for target in inputs)


class _ReleasedGuard:
    """Around work on ``ctx``: an exception it raises after the context was released
    meanwhile becomes the ContextError of :meth:`EngineActor._released` (a slotted
    class, not a contextlib generator: it wraps every PROPAGATE_GRADS)."""

    __slots__ = ("ctx", "engine")

    def __init__(self, engine: EngineActor, ctx: DistContext | None) -> None:
        self.engine, self.ctx = engine, ctx

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, Exception) and (error := self.engine._failed(self.ctx, exc)) is not exc:
            raise error from exc


@dataclass(slots=True, eq=False)
class GraphTask:
    """One worker's state for one distributed backward pass."""

    backward_id: int
    mode: str
    retain_graph: bool
    reached: set[int] = field(default_factory=set)  # SMART: send ids discovery reached
    traversed: set[int] = field(default_factory=set)  # SMART: recv ids traversed from here
    plan: Plan | None = None
    planning: asyncio.Future[Plan] | None = None
    reported_pairs: bool = False  # FAST: this worker's pairs went into a report already
    # our recv -> (the send it feeds, its rank, the send's tensor count, tensor per leaf)
    relays: dict[int, tuple[int, int, int, tuple[int, ...]]] = field(default_factory=dict)
    relay_table: dict[tuple[int, int], Relay] = field(default_factory=dict)  # all known, in order
    relays_told: dict[int, int] = field(default_factory=dict)  # peer -> table entries sent to it
    declared: bool = False  # our own relays are in the table


@dataclass(slots=True, frozen=True)
class Job:
    """One start's ``torch.autograd`` call, and whether it is small enough for the loop."""

    compute: Callable[[], Sequence[torch.Tensor | None]]
    small: bool


class EngineActor:
    """Runs backward jobs and answers PROPAGATE_GRADS and TRAVERSE for this worker."""

    def __init__(self, worker: Worker, contexts: ContextActor) -> None:
        self.worker = worker
        self.contexts = contexts
        self.loans = Loans(worker)

    # -- planning -------------------------------------------------------------------
    def _graph_task(self, ctx: DistContext, backward_id: int, mode: str, retain: bool) -> GraphTask:
        task = ctx.graph_tasks.get(backward_id)
        if task is None:
            task = ctx.graph_tasks[backward_id] = GraphTask(backward_id, mode, retain)
        return task

    async def plan(self, ctx: DistContext, task: GraphTask, roots: Sequence[torch.Tensor] = ()) -> Plan:
        """The task's plan, made once on the thread pool (big graphs take a while)."""
        plan = self.plan_now(ctx, task, roots)
        if plan is not None:
            return plan
        assert task.planning is not None
        task.plan = await asyncio.shield(task.planning)
        return task.plan

    def plan_now(self, ctx: DistContext, task: GraphTask, roots: Sequence[torch.Tensor] = ()) -> Plan | None:
        """The task's plan if it is made or small enough to make right here; otherwise
        None, with the planning started on the pool (``task.planning``)."""
        if task.plan is not None:
            return task.plan
        if task.planning is None:
            sends = ctx.sends if task.mode == "fast" else {m: ctx.sends[m] for m in task.reached}
            starts: dict[Hashable, Sequence[Any]] = {("send", m): e.starts() for m, e in sends.items()}
            if roots:
                starts[ROOTS] = roots
            try:  # small graphs: right here; big ones on the pool, the loop keeps serving
                task.plan = make_plan(starts, ctx.recv_of_leaf, ctx.hooked, _INLINE_PLAN_NODES)
                return task.plan
            except TooBig:
                task.planning = self.worker.run_blocking(
                    lambda: make_plan(starts, ctx.recv_of_leaf, ctx.hooked)
                )
        return None

    # -- SMART discovery ------------------------------------------------------------
    async def discover(self, ctx: DistContext, task: GraphTask, tensors: Sequence[torch.Tensor]) -> None:
        """Traverse from ``tensors`` to the recvs they reach, and beyond, everywhere."""
        await self._explore(ctx, task, [tensors], None)

    async def _explore(self, ctx: DistContext, task: GraphTask,
                       starts: list[Sequence[torch.Tensor]], caller: int | None,
                       for_caller: set[int] | None = None,
                       calls: list[asyncio.Future[Any]] | None = None) -> set[int]:
        """Walk from ``starts`` and follow every recv reached until discovery from here
        is complete; returns the recvs reached whose sends live on ``caller``.

        Those are not asked for with a TRAVERSE of their own: the caller gets them with
        its answer and walks its sends itself, which saves a round trip per return hop.
        Likewise every answer to our own TRAVERSEs lists sends of ours to walk here.
        (``for_caller`` and ``calls``: what a synchronous first step already found.)
        """
        for_caller = set() if for_caller is None else for_caller
        calls = [] if calls is None else calls
        while starts or calls:
            for tensors in starts:
                found = self._reach_small(ctx, tensors)
                if found is None:  # a big graph: walked on the pool, the loop keeps serving
                    found = await self.worker.run_blocking(_bind(reached_recvs, tensors, ctx.recv_of_leaf))
                self._follow(ctx, task, found, caller, for_caller, calls)
            starts = []
            answers, calls = await _all_or_first_error(calls), []
            for answer in answers:
                for message_id in answer.load():  # sends of ours the peer reached
                    if message_id not in task.reached:
                        task.reached.add(message_id)
                        starts.append(self._send_entry(ctx, message_id).starts())
        return for_caller

    @staticmethod
    def _reach_small(ctx: DistContext, tensors: Sequence[torch.Tensor]) -> set[int] | None:
        """The recvs ``tensors`` reach, walked right here; None for a big graph."""
        try:
            return reached_recvs(tensors, ctx.recv_of_leaf, _INLINE_PLAN_NODES)
        except TooBig:
            return None

    def _follow(self, ctx: DistContext, task: GraphTask, found: set[int], caller: int | None,
                for_caller: set[int], calls: list[asyncio.Future[Any]]) -> None:
        """Ask the workers holding the sends of the newly ``found`` recvs to go on
        (those of ``caller`` go into ``for_caller`` instead)."""
        new = found - task.traversed
        task.traversed |= new
        for message_id in new:
            peer = ctx.recvs[message_id].peer
            if peer == caller:
                for_caller.add(message_id)
                continue
            message = Traverse(context_id=ctx.context_id, backward_id=task.backward_id,
                               message_id=message_id, retain_graph=task.retain_graph)
            calls.append(self.worker.call(peer, Traverse.TARGET, message.dump()))

    def on_traverse(self, peer: Any, payload: Payload) -> Any:
        msg = Traverse.load(payload)
        ctx = self.contexts.get(msg.context_id)
        with _ReleasedGuard(self, ctx):
            outcome = self._traverse(peer, msg, ctx)
        return outcome if isinstance(outcome, Payload) else self._guarded(ctx, outcome)

    def _traverse(self, peer: Any, msg: Traverse, ctx: DistContext) -> Payload | Awaitable[Payload]:
        entry = self._send_entry(ctx, msg.message_id)
        task = self._graph_task(ctx, msg.backward_id, "smart", msg.retain_graph)
        if msg.message_id in task.reached:
            return Payload.dump(())
        task.reached.add(msg.message_id)
        found = self._reach_small(ctx, entry.starts())
        if found is None:
            explore = self._explore(ctx, task, [entry.starts()], peer.rank)
        else:
            for_caller: set[int] = set()
            calls: list[asyncio.Future[Any]] = []
            self._follow(ctx, task, found, peer.rank, for_caller, calls)
            if not calls:  # nothing to wait for: answer at once, without a task
                return Payload.dump(tuple(for_caller))
            explore = self._explore(ctx, task, [], peer.rank, for_caller, calls)

        async def run() -> Payload:
            return Payload.dump(tuple(await explore))

        return run()

    # -- execution ------------------------------------------------------------------
    def _send_entry(self, ctx: DistContext, message_id: int) -> Any:
        entry = ctx.sends.get(message_id)
        if entry is None:
            raise ContextError(
                f"context {ctx.context_id} on {self.worker.name} has no send entry "
                f"{message_id} (gradients arrived for tensors this worker never sent)"
            )
        return entry

    def on_propagate(self, peer: Any, payload: Payload) -> Any:
        """A PROPAGATE_GRADS call: the reply, a task making it, or None when the duty
        to answer went along with the one propagation this one caused."""
        owed = (peer.rank, self.worker.serving_request, self.worker.rank)
        msg = self._borrowed(peer.rank, PropagateGrads.load(payload))
        ctx = self.contexts.get(msg.context_id)
        with _ReleasedGuard(self, ctx):
            outcome = self._serve(msg, owed)
        if outcome is None or isinstance(outcome, BackwardReport):
            return None if outcome is None else outcome.dump()
        guarded = self._guarded(ctx, outcome)

        async def reply() -> Payload | None:
            report = await guarded
            return None if report is None else report.dump()  # None: answered elsewhere

        return reply()

    def _released(self, ctx: DistContext, cause: Exception | None = None) -> ContextError:
        """What a pass fails with whose context was released while it ran: the entries
        it worked on are gone, and whatever broke on that is not the caller's concern."""
        error = ContextError(
            f"autograd context {ctx.context_id} was released on {self.worker.name} while a "
            "backward pass ran in it (its block was left before backward() returned)"
        )
        error.__cause__ = cause
        return error

    def _failed(self, ctx: DistContext | None, exc: Exception) -> Exception:
        """``exc``, or the ContextError of :meth:`_released` when ``ctx`` went meanwhile."""
        return self._released(ctx, exc) if ctx is not None and ctx.released else exc

    async def _guarded(self, ctx: DistContext | None, outcome: Awaitable[T]) -> T:
        """``outcome``, failing as :meth:`_failed` says."""
        with _ReleasedGuard(self, ctx):
            return await outcome

    def on_delegated_propagate(self, peer: Any, payload: Payload) -> None:
        """A PROPAGATE_GRADS tell that carries the duty to answer someone's call."""
        msg = PropagateGrads.load(payload)
        if msg.reply is None:
            with contextlib.suppress(Exception):  # (returns what it lent us, if anything)
                self._borrowed(peer.rank, msg)
            return
        caller, request_id, _ = msg.reply
        ctx = self.contexts.contexts.get(msg.context_id)
        try:
            outcome = self._serve(self._borrowed(peer.rank, msg), msg.reply)
        except Exception as exc:
            self._answer(caller, request_id, self._failed(ctx, exc))
            return
        if outcome is None:
            return
        if isinstance(outcome, BackwardReport):
            self._answer(caller, request_id, outcome)
            return

        async def answer_when_done() -> None:
            try:
                report = await self._guarded(ctx, outcome)
                if report is None:
                    return  # passed along again
                result: BackwardReport | BaseException = report
            except Exception as exc:
                result = exc
            self._answer(caller, request_id, result)

        self.worker.spawn(answer_when_done())

    def _borrowed(self, src: int, msg: PropagateGrads) -> PropagateGrads:
        """``msg`` with the gradients ``src`` lent us read into tensors of ours."""
        grads = self.loans.borrow(src, msg.grads)
        if grads is not msg.grads:
            object.__setattr__(msg, "grads", grads)  # (frozen, but ours: just loaded)
        return msg

    def _answer(self, caller: int, request_id: int, result: BackwardReport | BaseException) -> None:
        worker = self.worker
        if isinstance(result, BaseException):
            reply: Payload | BaseException = result
        elif caller == worker.rank and worker.settle_own_call(request_id, result):
            return  # our own PROPAGATE_GRADS call (see _gather): the report as it is
        else:
            reply = result.dump()
        with contextlib.suppress(Exception):  # a caller that is gone waits for nothing
            worker.answer(caller, request_id, reply)

    def _serve(
        self, msg: PropagateGrads, owed: tuple[int, int, int]
    ) -> BackwardReport | Awaitable[BackwardReport | None] | None:
        """Run the job of the send entry the gradients are for, and what it completes.

        Returns the report when everything is done already, an awaitable of it, or
        None when the duty to answer ``owed`` went along with a delegated propagation.
        """
        ctx = self.contexts.get(msg.context_id)
        entry = self._send_entry(ctx, msg.message_id)
        entry.fired = True
        task = self._graph_task(ctx, msg.backward_id, msg.mode, msg.retain_graph)
        if msg.relays:
            self._learn_relays(ctx, task, unpack_relays(msg.relays))
        key = ("send", msg.message_id)
        grads = list(msg.grads)
        incoming = BackwardReport(pairs=unpack_ids(msg.pairs), fired=unpack_ids(msg.fired) | {msg.message_id})
        job: Job | None = None
        plan = self.plan_now(ctx, task)
        if plan is not None:
            self._check_reached(ctx, plan, key, msg.message_id)
            job = self._job(ctx, task, key, entry.starts(), grads)
            if job.small:  # the common case: all of it right here, no task unless we wait
                report, fires, stops = self._deliver(ctx, task, key, job.compute())
                return self._conclude(ctx, task, report.merge(incoming), fires, stops, owed)

        async def run() -> BackwardReport | None:
            if job is None:
                plan = await self.plan(ctx, task)
                self._check_reached(ctx, plan, key, msg.message_id)
            return await self._run_job(ctx, task, key, entry.starts(), grads, owed, incoming, job)

        return run()

    def _conclude(
        self, ctx: DistContext, task: GraphTask, report: BackwardReport, fires: list[int],
        stops: list[asyncio.Future[Any]], owed: tuple[int, int, int] | None,
    ) -> BackwardReport | Awaitable[BackwardReport] | None:
        """After a job: done (the report), wait for what it started, or pass the duty
        to answer ``owed`` along with its only propagation (None).

        The duty goes along only to the caller itself or to the worker it called, so a
        lost worker on the way still fails the caller's call at once.
        """
        if task.relays and fires:
            report, fires = self._relay(ctx, task, report, fires, stops)
        if not fires and not stops:
            return report
        if owed is not None and len(fires) == 1 and not stops:
            recv = ctx.recvs[fires[0]]
            if recv.peer in (owed[0], owed[2]):
                message = self._propagation(ctx, task, fires[0], owed, report)
                self.worker.tell(recv.peer, PropagateGrads.DELEGATED, message.dump())
                return None
        calls = [self._fire_recv(ctx, task, message_id) for message_id in fires]
        return self._counted(ctx, self._gather(report, [*calls, *stops]))

    @staticmethod
    async def _counted(ctx: DistContext, waiting: Awaitable[BackwardReport]) -> BackwardReport:
        ctx.running_backwards += 1  # a propagation here is not done while it waits
        try:
            return await waiting
        finally:
            ctx.running_backwards -= 1

    @staticmethod
    def _check_reached(ctx: DistContext, plan: Plan, key: Hashable, message_id: int) -> None:
        if key not in plan.feeds:
            raise ContextError(
                f"gradients arrived for send {message_id} of context {ctx.context_id}, "
                "which discovery did not reach"
            )

    async def run_start(
        self, ctx: DistContext, task: GraphTask, key: Hashable,
        outputs: Sequence[Any], grads: Sequence[torch.Tensor | None],
    ) -> BackwardReport:
        """Run one start's job, then everything it completes, here and elsewhere."""
        report = await self._run_job(ctx, task, key, outputs, grads)
        assert report is not None  # nothing owed, so nothing passed on
        return report

    async def _run_job(
        self, ctx: DistContext, task: GraphTask, key: Hashable,
        outputs: Sequence[Any], grads: Sequence[torch.Tensor | None],
        owed: tuple[int, int, int] | None = None, incoming: BackwardReport | None = None,
        job: Job | None = None,
    ) -> BackwardReport | None:
        """One start's job (on the pool when big), then :meth:`_conclude`."""
        job = job or self._job(ctx, task, key, outputs, grads)
        ctx.running_backwards += 1
        try:
            results = job.compute() if job.small else await self.worker.run_blocking(job.compute)
        finally:
            ctx.running_backwards -= 1
        report, fires, stops = self._deliver(ctx, task, key, results)
        if incoming is not None:
            report = report.merge(incoming)
        outcome = self._conclude(ctx, task, report, fires, stops, owed)
        return outcome if outcome is None or isinstance(outcome, BackwardReport) else await outcome

    def _job(
        self, ctx: DistContext, task: GraphTask, key: Hashable,
        outputs: Sequence[Any], grads: Sequence[torch.Tensor | None],
    ) -> Job:
        """The torch call of one start's job (not run yet)."""
        assert task.plan is not None
        plan = task.plan
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
        inputs: Any = plan.feeds[key].inputs(plan)
        if not (pairs and inputs):
            none: Sequence[torch.Tensor | None] = [None] * len(inputs)
            return Job(lambda: none, True)
        if (direct := _leaf_gradients(outputs, pairs, inputs)) is not None:
            return Job(lambda: direct, True)
        suppress = frozenset(plan.feeds[key].stops)
        # torch may run a (blanked) stop node inside this call, which must
        # not free the buffers that node's own job needs later.
        retain = task.retain_graph or bool(suppress)
        tracer = self.worker.tracer
        region = plan.regions.get(key, [])
        call = (tuple(o for o, _ in pairs), tuple(g for _, g in pairs), retain, False, tuple(inputs), True, False)
        leaves = len(plan.feeds[key].leaves)  # the first results: see _unshared
        if not suppress and not tracer.enabled:  # the common case, without context managers

            def compute() -> Sequence[torch.Tensor | None]:
                return _unshared(_run_backward(*call), leaves)
        else:
            traced = region if tracer.enabled else []

            def compute() -> Sequence[torch.Tensor | None]:
                with suppressing(suppress), tracer.span(
                    "backward job", "autograd",
                    {"context": ctx.context_id, "start": _describe_start(key), "nodes": len(region)},
                ), _traced_nodes(tracer, traced):
                    return _unshared(_run_backward(*call), leaves)

        small = len(region) <= _INLINE_JOB_NODES and sum(
            g.numel() * g.element_size() for _, g in pairs) <= _INLINE_JOB_BYTES and not _runs_python(region) \
            and not _hooked(pairs, inputs)
        return Job(compute, small)

    def _deliver(
        self, ctx: DistContext, task: GraphTask, key: Hashable, results: Sequence[torch.Tensor | None],
    ) -> tuple[BackwardReport, list[int], list[asyncio.Future[Any]]]:
        """Hand a job's results to leaves, recvs and stops, and start the stops now
        complete. Returns this worker's report, the recvs now complete (to fire) and
        the started stops."""
        assert task.plan is not None
        plan = task.plan
        feeds = plan.feeds[key]
        if after_backward and feeds.leaves and task.backward_id >> ID_BITS != self.worker.rank:
            # (backward ids carry the rank of the worker that called backward())
            for hook in after_backward:
                hook.reached_elsewhere(self.worker, ctx, feeds.leaves)
        it = iter(results)
        for leaf in feeds.leaves:
            if (grad := next(it)) is not None:
                ctx.accumulate(leaf, grad)
        for _, message_id, index in feeds.recv_leaves:
            if (grad := next(it)) is not None:
                _add(plan.recvs[message_id].grads, index, grad)
        for node in feeds.stops:
            stop = plan.stops[node]
            for slot in stop.slots:
                if (grad := next(it)) is not None:
                    _add(stop.grads, slot, grad)
        # count them in; the recvs now complete are to fire, the stops to run
        started: list[asyncio.Future[Any]] = []
        fired = []
        for message_id in dict.fromkeys(m for _, m, _ in feeds.recv_leaves):
            share = plan.recvs[message_id]
            share.pending -= 1
            if share.pending == 0:
                fired.append(message_id)
        for node in feeds.stops:
            stop = plan.stops[node]
            stop.pending -= 1
            if stop.pending == 0:
                edges = [(GradientEdge(node, s), stop.grads[s]) for s in stop.slots if s in stop.grads]
                stop.grads = {}
                started.append(asyncio.ensure_future(self.run_start(
                    ctx, task, node, [e for e, _ in edges], [g for _, g in edges]
                )))
        pairs_here: frozenset[int] = frozenset()
        if task.mode == "fast" and not task.reported_pairs:  # once per worker and pass
            task.reported_pairs = True
            pairs_here = frozenset((*ctx.sends, *ctx.recvs))
        return BackwardReport(pairs=pairs_here, fired=frozenset(fired)), fired, started

    @staticmethod
    async def _gather(report: BackwardReport, followups: list[asyncio.Future[Any]]) -> BackwardReport:
        # an answer is a reply payload, the report itself (a PROPAGATE_GRADS call whose
        # duty to answer came back to this worker) or a report from a stop's job
        for answer in await _all_or_first_error(followups):
            if isinstance(answer, Payload):
                answer = BackwardReport.load(answer)
            report = report.merge(answer)
        return report

    def _propagation(
        self, ctx: DistContext, task: GraphTask, message_id: int,
        reply: tuple[int, int, int] | None = None, report: BackwardReport | None = None,
    ) -> PropagateGrads:
        """The PROPAGATE_GRADS for a complete recv entry (marked fired)."""
        recv = ctx.recvs[message_id]
        recv.fired = True
        grads = task.plan.recvs[message_id].grads  # type: ignore[union-attr]
        travel = tuple(travelling(grads.get(i)) for i in range(len(recv.leaves)))
        grads.clear()  # (the message holds them now: the pass's state must not, to its end)
        return self._message(ctx, task, recv.peer, message_id, travel, reply, report)

    def _message(
        self, ctx: DistContext, task: GraphTask, to: int, message_id: int, grads: tuple[Any, ...],
        reply: tuple[int, int, int] | None = None, report: BackwardReport | None = None,
    ) -> PropagateGrads:
        """The PROPAGATE_GRADS for ``to``'s send ``message_id``, with the relays ``to``
        has not been told of by us yet."""
        if not task.declared:
            task.declared = True
            for relay in self._own_relays(ctx, task):
                task.relay_table.setdefault((relay[1], relay[2]), relay)
        relays = b""
        told = task.relays_told.get(to, 0)
        if told < len(task.relay_table):
            task.relays_told[to] = len(task.relay_table)
            relays = pack_relays(itertools.islice(task.relay_table.values(), told, None))
        return PropagateGrads(
            context_id=ctx.context_id, backward_id=task.backward_id, message_id=message_id,
            grads=self.loans.lend(to, grads), mode=task.mode, retain_graph=task.retain_graph, reply=reply,
            pairs=pack_ids(report.pairs) if report is not None else b"",
            fired=pack_ids(report.fired) if report is not None else b"",
            relays=relays,
        )

    # -- relays ---------------------------------------------------------------------
    def _own_relays(self, ctx: DistContext, task: GraphTask) -> list[Relay]:
        """Our sends whose job only hands its gradients, unchanged, to one recv entry
        that nothing else feeds (an RPC result passed on as it came: a chain of calls, a
        driver handing one stage's output to the next): the worker the send went to may
        send them to where that recv's tensors came from itself (run its own send, when
        they came from it) instead of through us."""
        plan = task.plan
        assert plan is not None
        me = self.worker.rank
        # How many jobs feed each recv, from the plan's structure: the entries' own
        # counters are live, and jobs (the roots', say) may have delivered shares by
        # the time the first message of the pass declares our relays.
        feeders = collections.Counter(m for feeds in plan.feeds.values() for m in {m for _, m, _ in feeds.recv_leaves})
        relays = []
        for key, feeds in plan.feeds.items():
            if type(key) is not tuple or key[0] != "send" or feeds.leaves or feeds.stops or not feeds.recv_leaves:
                continue
            send = ctx.sends[key[1]]
            recv_id = feeds.recv_leaves[0][1]
            recv = ctx.recvs[recv_id]
            if (send.peer == me or recv.peer == me or feeders[recv_id] != 1
                    or any(m != recv_id for _, m, _ in feeds.recv_leaves)):
                continue
            if (order := _passed_on(send.tensors, recv.leaves)) is not None:
                relays.append((me, send.peer, key[1], recv_id, recv.peer, len(recv.leaves), order))
        return relays

    def _learn_relays(self, ctx: DistContext, task: GraphTask, relays: list[Relay]) -> None:
        """Add relays to the table (to pass on); take those for our recvs."""
        for relay in relays:
            key = (relay[1], relay[2])
            if key not in task.relay_table:
                if relay[1] == self.worker.rank:
                    self._take_relay(ctx, task, relay)
                task.relay_table[key] = relay

    def _take_relay(self, ctx: DistContext, task: GraphTask, relay: Relay) -> None:
        """Our recv ``send_id`` (paired with ``origin``'s send) is relayed: its gradients
        go to the send ``recv_id`` (paired with ``origin``'s recv) on rank ``source``,
        leaf i to tensor ``order[i]`` of ``width``; that send is ours when ``source`` is
        this worker."""
        origin, _, send_id, recv_id, source, width, order = relay
        recv = ctx.recvs.get(send_id)
        valid = (
            recv is not None and recv.peer == origin and len(order) == len(recv.leaves)
            and len(set(order)) == len(order) and all(j < width for j in order)
        )
        if valid and source == self.worker.rank:
            send = ctx.sends.get(recv_id)
            valid = (
                send is not None and send.peer == origin and width == len(send.tensors)
                and all(_meta(leaf) == _meta(send.tensors[j])
                        for leaf, j in zip(recv.leaves, order, strict=True))  # type: ignore[union-attr]
            )
        elif valid:
            valid = source != origin and 0 <= source < self.worker.world_size
        if not valid:
            raise ContextError(
                f"rank {origin} declared a relay from recv {send_id} to send {recv_id} on rank "
                f"{source} that does not match the entries of context {ctx.context_id} "
                f"on {self.worker.name}"
            )
        task.relays[send_id] = (recv_id, source, width, order)

    def _relay(
        self, ctx: DistContext, task: GraphTask, report: BackwardReport, fires: list[int],
        stops: list[asyncio.Future[Any]],
    ) -> tuple[BackwardReport, list[int]]:
        """Of the recvs now complete (``fires``), those a peer relays (see
        :meth:`_own_relays`) run our matching send jobs here, and so on for the recvs
        those complete, or call the worker whose send they feed; returns the report and
        the recvs left to fire. Small jobs run right here, one after the other (a chain
        of K hops is K jobs in this loop, not K round trips); big ones start like stops,
        and so do the calls (a call, not a passed-on duty to answer: the worker called
        is not the one our caller called, and losing it must fail this call at once)."""
        plan = task.plan
        assert plan is not None
        left, todo = [], list(fires)
        while todo:
            recv_id = todo.pop()
            relay = task.relays.get(recv_id)
            if relay is None or (relay[1] == self.worker.rank and ("send", relay[0]) not in plan.feeds):
                left.append(recv_id)
                continue
            del task.relays[recv_id]
            send_id, source, width, order = relay
            ctx.recvs[recv_id].fired = True
            by_leaf = plan.recvs[recv_id].grads
            grads: list[torch.Tensor | None] = [None] * width
            for i, j in enumerate(order):
                grads[j] = by_leaf.get(i)
            by_leaf.clear()  # (as in _propagation)
            report = report.merge(BackwardReport(pairs=frozenset(), fired=frozenset((recv_id, send_id))))
            if source != self.worker.rank:
                message = self._message(ctx, task, source, send_id, tuple(travelling(g) for g in grads))
                stops.append(self.worker.call(source, PropagateGrads.TARGET, message.dump()))
                continue
            entry = ctx.sends[send_id]
            entry.fired = True
            key = ("send", send_id)
            job = self._job(ctx, task, key, entry.starts(), grads)
            if job.small:
                more, new_fires, new_stops = self._deliver(ctx, task, key, job.compute())
                report = report.merge(more)
                todo.extend(new_fires)
                stops.extend(new_stops)
            else:
                stops.append(asyncio.ensure_future(self._run_job(ctx, task, key, entry.starts(), grads, job=job)))
        return report, left

    def _fire_recv(self, ctx: DistContext, task: GraphTask, message_id: int) -> asyncio.Future[Payload]:
        message = self._propagation(ctx, task, message_id)
        return self.worker.call(ctx.recvs[message_id].peer, PropagateGrads.TARGET, message.dump())


def _bind(fn: Any, *args: Any) -> Any:
    return lambda: fn(*args)


def _describe_start(key: Hashable) -> str:
    if key == ROOTS:
        return "roots"
    if isinstance(key, tuple) and key[0] == "send":
        return f"send {key[1]}"
    return f"stop {type(key).__name__}"


@contextlib.contextmanager
def _traced_nodes(tracer: Any, nodes: list[Any]) -> Iterator[None]:
    """While tracing, record every autograd node execution in ``nodes`` as a span; a
    node that raised (started, never finished) as a failed one."""
    if not nodes:
        yield
        return
    from ..runtime._trace import failed, now_us

    started: dict[Any, float] = {}
    handles = []
    for node in nodes:
        if getattr(node, "variable", None) is not None:
            continue

        def pre(grads: Any, node: Any = node) -> None:
            started[node] = now_us()

        def post(grad_inputs: Any, grad_outputs: Any, node: Any = node) -> None:
            tracer.complete(node.name(), "autograd node", started.pop(node, now_us()))

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(post))
    try:
        yield
    except BaseException as exc:
        for node, start in started.items():
            tracer.complete(node.name(), "autograd node", start, failed(None, exc))
        raise
    finally:
        for handle in handles:
            handle.remove()


def _leaf_gradients(
    outputs: Sequence[Any], pairs: list[tuple[torch.Tensor, torch.Tensor]], inputs: Sequence[Any],
) -> list[torch.Tensor | None] | None:
    """A job's results without a torch call, when there is nothing to compute: each of
    the start's tensors hands its gradient unchanged to one leaf (it is a leaf, or a
    received tensor passed on as it came, whose recv leaf takes it), those leaves are
    distinct and are exactly the job's targets, no hook waits on the tensors, and every
    gradient matches its tensor. The send of an RPC's leaf arguments ends this way on
    the caller, and so does each hop of a chain that passes results on. None when
    torch has to run."""
    if len(inputs) != len(outputs):
        return None
    by_leaf: dict[int, torch.Tensor | None] = {}
    leaf_of: dict[int, int] = {}
    for tensor in outputs:
        if not isinstance(tensor, torch.Tensor) or tensor._backward_hooks:
            return None  # a stop's edge, or a hook to run
        node = tensor.grad_fn
        if node is None:
            leaf = tensor
        elif type(node) is _RECV_NODE:
            leaf = node.next_functions[1][0].variable  # type: ignore[union-attr]  # the recv leaf (see _as_recv_output)
        else:
            return None  # computed: torch has work to do
        if id(leaf) in by_leaf:
            return None  # two tensors for one leaf: torch sums them
        by_leaf[id(leaf)] = None
        leaf_of[id(tensor)] = id(leaf)
    for tensor, grad in pairs:
        if grad.shape != tensor.shape or grad.dtype != tensor.dtype or grad.device != tensor.device:
            return None  # torch's own checks name the problem
        by_leaf[leaf_of[id(tensor)]] = grad
    results = []
    for target in inputs:
        if type(target) is GradientEdge or id(target) not in by_leaf:
            return None
        results.append(by_leaf[id(target)])
    return results


def _passed_on(tensors: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """For each of a send's ``tensors``, the index of the recv leaf it hands its
    gradient to unchanged: each is a received tensor passed on as it came (its grad_fn
    the recv node of one of ``leaves``), without hooks, each leaf once. None otherwise."""
    index = {id(leaf): i for i, leaf in enumerate(leaves)}
    order = []
    for tensor in tensors:
        node = tensor.grad_fn
        if type(node) is not _RECV_NODE or tensor._backward_hooks:
            return None
        i = index.pop(id(node.next_functions[1][0].variable), None)  # type: ignore[union-attr]  # see _as_recv_output
        if i is None:
            return None  # another entry's leaf, or this one's twice
        order.append(i)
    return tuple(order)


def _meta(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tensor.shape, tensor.dtype, tensor.device


def _add(grads: dict[int, torch.Tensor], index: int, grad: torch.Tensor) -> None:
    held = grads.get(index)
    grads[index] = grad if held is None else held + grad


async def _all_or_first_error(futures: list[asyncio.Future[Any]]) -> list[Any]:
    """Wait for all; on the first failure cancel the rest and raise it (never hang).
    Cancelled, cancel them all (as awaiting a single one does, and gather)."""
    if not futures:
        return []
    if len(futures) == 1:  # the common case, without asyncio.wait's waiter and callbacks
        return [await futures[0]]
    try:
        done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:  # (asyncio.wait leaves what it waited for running)
        for fut in futures:
            fut.cancel()
        raise
    first: BaseException | None = None
    for fut in futures:
        if fut in done and not fut.cancelled():
            # every failure is read (asyncio logs those never read), the first raised
            error = fut.exception()
            if first is None:
                first = error
    if first is not None:
        for other in pending:
            other.cancel()
        raise first
    return [f.result() for f in futures]


def _unused_to_name(ctx: DistContext, task: GraphTask, unused: list[int]) -> tuple[int, str]:
    """Which of the silent pairs a FAST mode error names, and how it says so.

    A call whose output nothing uses holds up the calls whose outputs went into its
    arguments (their recvs wait for its share), and those have lower ids. A pair whose
    recv is here and no start reaches (its output is used by nothing here) is the one
    to name; else the first."""
    plan = task.plan
    if plan is not None:
        for message_id in unused:
            if message_id in ctx.recvs and message_id not in plan.recvs:
                return message_id, "nothing used the output of"
    return unused[0], "the first is"


async def _describe_pair(worker: Worker, ctx: DistContext, message_id: int) -> str:
    """What the send/recv pair ``message_id`` carried, asked of the worker that sent it
    (the one that minted the id), for an error message."""
    sender = message_id >> ID_BITS
    if sender == worker.rank or sender not in worker.peers:
        return ctx.describe(message_id)
    try:
        reply = await worker.call(sender, DESCRIBE, Payload.dump((ctx.context_id, message_id)))
        return str(reply.load())
    except Exception as exc:  # the error being reported matters more than this detail
        return f"not described: {type(exc).__name__} from rank {sender}"


def engine_actor(worker: Worker | None = None) -> EngineActor:
    worker = worker or get_worker()
    actor = worker.extensions.get("autograd.engine")
    if not isinstance(actor, EngineActor):
        raise RuntimeError("distributed autograd is not set up on this worker")
    return actor


class AfterBackward(Protocol):
    """Work a backward's caller does once the pass is over, on its own worker: data
    parallel wrappers average their parameters' gradients in the context there, as
    torch's DDP does inside ``dist_autograd.backward``."""

    async def done(self, worker: Worker, ctx: DistContext) -> None:
        """The pass succeeded (may raise: backward raises it)."""

    def failed(self, worker: Worker, ctx: DistContext) -> None:
        """The pass failed or was cancelled: issue, without waiting, what the other
        ranks expect of this one."""

    def reached_elsewhere(self, worker: Worker, ctx: DistContext, leaves: Sequence[torch.Tensor]) -> None:
        """A pass started on another worker is about to give ``leaves`` of this one
        their gradients (may raise: the pass fails)."""


after_backward: list[AfterBackward] = []


async def backward(
    context_id: int,
    roots: Sequence[torch.Tensor],
    retain_graph: bool = False,
    mode: str | None = None,
) -> None:
    """Run the distributed backward pass of ``roots`` in context ``context_id``.

    Args:
        context_id: the id yielded by ``autograd.context()``.
        roots: local scalar tensors (losses).
        retain_graph: keep the graph for another ``backward`` in the same context; the
            gradients of both add up.
        mode: ``"fast"`` (PyTorch's FAST mode: every RPC of the context must take part;
            an unused one raises ContextError naming it instead of hanging) or
            ``"smart"`` (discover the distributed graph first; RPCs the roots do not use
            are skipped). Default: ``RpcOptions.autograd_mode``.

    Returns when every gradient propagation on every worker has finished. Gradients
    accumulate in the context (``get_gradients``), never in ``.grad``.

    Raises:
        ContextError: unknown context, bad roots, a second backward after one without
            ``retain_graph`` or after one that failed midway (its gradients are partial),
            or (FAST mode) an RPC whose output the roots do not use.
        RemoteError / WorkerLost / RpcTimeout: a peer failed during the backward.
    """
    worker = get_worker()
    check_context_id(context_id)
    if not isinstance(retain_graph, bool):  # (a string spoilt the context halfway)
        raise TypeError(f"retain_graph must be True or False, got {retain_graph!r}")
    mode = mode or worker.options.autograd_mode
    if mode not in ("fast", "smart"):
        raise ValueError(f"mode must be 'fast' or 'smart', got {mode!r}")
    roots = root_tensors(roots, "backward")
    if not roots:
        raise ContextError("backward needs at least one root tensor")
    for root in roots:
        if not root.requires_grad:
            raise ContextError("a backward root does not require grad and has no grad_fn")
        if root.numel() != 1:
            raise ContextError(
                f"backward roots must be scalars (got shape {tuple(root.shape)}); reduce the "
                "loss, e.g. with .sum()"
            )
    contexts = context_actor(worker)
    ctx = contexts.get(context_id)
    if ctx.failed_backward is not None:
        raise ContextError(
            f"a backward in context {context_id} failed ({ctx.failed_backward}); the "
            "gradients it added there are partial, so the context takes no other "
            "backward: run the forward again in a new context"
        )
    if ctx.graph_freed:
        raise ContextError(
            f"backward already ran in context {context_id} without retain_graph=True; "
            "pass retain_graph=True to the earlier call to backpropagate again"
        )
    engine = engine_actor(worker)
    task = GraphTask(contexts.new_id(), mode, retain_graph)
    ctx.graph_tasks[task.backward_id] = task
    ctx.passes_running += 1
    try:
        try:
            await _pass(worker, engine, ctx, task, roots)
        except BaseException:
            for hook in after_backward:
                hook.failed(worker, ctx)
            raise
        for hook in after_backward:
            await hook.done(worker, ctx)
    finally:
        ctx.passes_running -= 1


async def _pass(worker: Worker, engine: EngineActor, ctx: DistContext, task: GraphTask,
                roots: list[torch.Tensor]) -> None:
    """The pass of :func:`backward` from ``roots``, everywhere; raises what failed."""
    running = False
    try:
        with _ReleasedGuard(engine, ctx):
            if task.mode == "smart":
                await engine.discover(ctx, task, roots)
            await engine.plan(ctx, task, roots)
            running = True
            report = await engine.run_start(ctx, task, ROOTS, roots, [torch.ones_like(r) for r in roots])
    except BaseException as error:
        if running:  # some gradients may have been added already
            ctx.failed_backward = type(error).__name__
        raise
    finally:
        ctx.graph_tasks.pop(task.backward_id, None)
    if ctx.released:  # its entries went mid-pass: what was planned from them is partial
        raise engine._released(ctx)
    if not task.retain_graph:
        ctx.graph_freed = True
    if task.mode == "fast":
        unused = sorted(report.pairs - report.fired)
        if unused:
            ctx.failed_backward = "FAST mode, unused RPC"
            named, which = _unused_to_name(ctx, task, unused)
            described = await _describe_pair(worker, ctx, named)
            raise ContextError(
                f"FAST mode backward in context {ctx.context_id}: {len(unused)} RPC send/recv "
                f"pair(s) received no gradient; {which} autograd message {named} "
                f"(rank {named >> ID_BITS}: {described}). FAST mode assumes every RPC's output takes part "
                "in the loss (PyTorch would wait forever here); run the forward again "
                "in a new context and call backward(..., mode=\"smart\") (or set "
                "RpcOptions(autograd_mode=\"smart\")) to skip unused RPCs."
            )
