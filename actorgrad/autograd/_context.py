"""ContextActor: distributed autograd contexts and the recording of send/recv pairs.

# Theory of operation
Inside ``async with autograd.context()``, every RPC payload carries
``(context_id, message_id)``. The sender records a *send entry* (the tensors that require
grad, where they went); the receiver re-creates those tensors as leaves and records a
*recv entry* (the leaves, where they came from) under the same message id. Results
travel back the same way with the roles swapped. In the backward pass a recv entry's
leaf gradients are shipped to the peer, where the matching send entry feeds them into
its local graph. Ids embed the rank of the worker that minted them, so they are unique
in the group without coordination.
"""

from __future__ import annotations

import atexit
import collections
import collections.abc
import contextlib
import contextvars
import itertools
import numbers
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .._errors import ContextError
from ..rpc import NO_SCOPE, CallHooks
from ..runtime import Worker, get_worker
from ..runtime._current import on_loop
from ..wire import Payload
from ._messages import ReleaseContext, ShareHeld, is_broadcast
from ._plan import recv_anchors

ID_BITS = 48  # ids are (minting worker's rank << ID_BITS) | counter
_RELEASED_MEMORY = 100_000  # ids of released contexts remembered, to ignore late messages
_REAPER_STACK = 512 << 20


class _Reaper:
    """Frees released contexts on a thread with a large stack.

    Freeing a deep autograd graph (tens of thousands of nodes in a chain) whose nodes
    were walked from Python recurses once per node in torch and can overflow the
    event loop thread's stack; a dedicated thread with a big stack frees it safely.
    """

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def drop(self, item: object) -> None:
        with self._lock:
            if self._thread is None:
                previous = threading.stack_size(_REAPER_STACK)
                try:
                    self._thread = threading.Thread(target=self._run, name="actorgrad-reaper", daemon=True)
                    self._thread.start()
                finally:
                    threading.stack_size(previous)
                # A daemon thread still freeing tensors when the interpreter finalizes
                # dies inside torch's destructors and aborts the process: finish first.
                atexit.register(self.flush)
        self._items.put(item)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything handed over so far has been freed."""
        if self._thread is None or not self._thread.is_alive():
            return
        done = threading.Event()
        self._items.put(done)
        done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            if isinstance(item, DistContext):
                _clear(item)
            del item


def _clear(ctx: DistContext) -> None:
    ctx.graph_tasks.clear()
    ctx.sends.clear()
    ctx.recvs.clear()
    ctx.grads.clear()
    ctx.grad_ids.clear()


def _small_graph(ctx: DistContext) -> bool:
    """Whether freeing ``ctx`` here cannot recurse deeply.

    Deep recursion comes from graphs whose nodes a backward plan walked from Python;
    a plan the engine made on the loop (not handed to the pool as too big) bounds that
    walk. A context without a backward holds a forward graph torch frees iteratively,
    as for any user tensor.
    """
    return not ctx.graph_tasks or all(
        task.plan is not None and task.planning is None for task in ctx.graph_tasks.values())


reaper = _Reaper()

current_context: contextvars.ContextVar[DistContext | None] = contextvars.ContextVar(
    "actorgrad_autograd_context", default=None
)


class RecvRpcBackward(torch.autograd.Function):
    """Identity, in place: makes a received tensor the output of a recv function.

    The tensor the user gets keeps its identity but gains this grad_fn, so in-place ops
    on it work as on any computed tensor (as in PyTorch, where received tensors come out
    of RecvRpcBackward). Its gradient goes to ``anchor``, a leaf sharing the tensor's
    memory (no copy), which the recv entry records.
    """

    @staticmethod
    def forward(ctx: Any, received: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(received)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        if not engine_calls.ours(grad):
            # somebody's local backward (loss.backward()) reached a received tensor: its
            # gradient cannot travel back that way (torch refuses it too)
            raise RuntimeError(
                "a local backward (loss.backward(), torch.autograd.backward) reached a tensor "
                "received by RPC inside a distributed autograd context; its gradient cannot go "
                "back to the worker that sent it that way. Use "
                "`await ag.autograd.backward(context_id, [loss])` and read the gradients with "
                "`ag.autograd.get_gradients(context_id)`"
            )
        return None, grad


class _EngineCalls(threading.local):
    """How many torch calls of the distributed engine run on this thread. A recv
    function runs inside one of them, or else inside somebody's local backward, where
    its gradient could never travel back (see ``RecvRpcBackward.backward``). torch runs
    CPU nodes on the thread that called its engine, so that thread's count says; the
    nodes of other devices run on torch's device threads, where nobody can tell: those
    are not checked. (Per thread, so no lock: the engine calls it from the loop and the
    pool at once, and it costs each call two attribute updates.)"""

    count = 0

    def ours(self, grad: torch.Tensor) -> bool:
        """Whether a recv function getting ``grad`` may run in one of our calls."""
        return self.count > 0 or grad.device.type != "cpu"


engine_calls = _EngineCalls()


def _c_apply(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` minus ``torch.autograd.Function.apply``'s Python wrapper.

    The wrapper binds default arguments for ``setup_context`` (ours has none) and
    unwraps functorch tensors (checked at each call instead): going straight to the
    C entry point saves about half the cost of applying it, once per received tensor.
    """
    try:
        return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    except (AttributeError, KeyError, TypeError):  # another torch: the public way
        return function.apply


_apply_recv = _c_apply(RecvRpcBackward)
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled


def _as_recv_output(received: torch.Tensor) -> torch.Tensor:
    """Attach RecvRpcBackward to ``received`` (a leaf that requires grad); return the
    leaf that now collects its gradient."""
    if type(received) is not torch.Tensor or not received.is_leaf:
        return received  # parameters stay leaves: optimizers update them in place
    anchor = received.detach().requires_grad_()
    recv_anchors[id(anchor)] = anchor
    received.requires_grad_(False)
    apply = RecvRpcBackward.apply if _functorch_active() else _apply_recv
    if _grad_enabled():
        apply(received, anchor)
    else:
        with torch.enable_grad():
            apply(received, anchor)
    return anchor


@dataclass(slots=True, eq=False)
class SendEntry:
    """Tensors this worker sent to ``peer``; their gradients come back from it."""

    tensors: list[torch.Tensor]
    peer: int
    fired: bool = False
    leaves: list[torch.Tensor] | None = None  # reachable leaves, computed on first use
    # (grad_fn, output_nr) of each tensor when it was sent; None: taken as they are now
    sent_edges: list[tuple[Any, int]] | None = None

    def starts(self) -> list[torch.Tensor | GradientEdge]:
        """What the gradients from ``peer`` flow into: each tensor's history as it was
        when sent (torch hangs its SendRpcBackward there). A tensor changed in place
        since then has a new grad_fn, which the peer's gradient must not go through;
        it is named by its old edge instead."""
        starts: list[torch.Tensor | GradientEdge] = self.tensors  # type: ignore[assignment]
        if self.sent_edges is None:
            return starts
        for i, (tensor, (node, output_nr)) in enumerate(zip(self.tensors, self.sent_edges, strict=True)):
            if tensor.grad_fn is not node:
                if starts is self.tensors:
                    starts = list(starts)
                starts[i] = GradientEdge(node, output_nr)
        return starts


@dataclass(slots=True, eq=False)
class RecvEntry:
    """Leaves this worker received from ``peer``; their gradients go back to it."""

    leaves: list[torch.Tensor]
    peer: int
    fired: bool = False


@dataclass(slots=True, eq=False)
class DistContext:
    """One worker's share of a distributed autograd context."""

    context_id: int
    sends: dict[int, SendEntry] = field(default_factory=dict)
    recvs: dict[int, RecvEntry] = field(default_factory=dict)
    recv_of_leaf: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(leaf) -> (msg, i)
    grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    grad_ids: set[int] = field(default_factory=set)  # id() of the tensors in ``grads``
    peers: set[int] = field(default_factory=set)
    running_backwards: int = 0
    graph_tasks: dict[int, Any] = field(default_factory=dict)  # backward id -> GraphTask
    passes_running: int = 0  # backward() calls of this worker on the context, not over yet
    hooked: dict[Any, Any] = field(default_factory=dict)  # stop node -> pre-hook handle
    graph_freed: bool = False  # a backward without retain_graph ran here
    failed_backward: str | None = None  # why a backward started here failed midway
    given_up: dict[int, str] = field(default_factory=dict)  # sends of failed calls, described
    released: bool = False

    def accumulate(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        held = self.grads.get(tensor)
        if held is not None:
            total = self.grads[tensor] = held + grad
            self.grad_ids.discard(id(held))
        elif is_broadcast(grad):
            # a broadcast gradient (d(x.sum())/dx): stored dense, as torch's
            # AccumulateGrad would, so that it can be modified in place
            total = self.grads[tensor] = grad.contiguous()
        elif id(grad) in self.grad_ids:
            # one tensor handed to two leaves (y = a + b gives both the same gradient):
            # each gets its own, as torch's AccumulateGrad clones a shared gradient, so
            # changing one in place (an optimizer, a user) leaves the other alone
            total = self.grads[tensor] = grad.clone()
        else:
            total = self.grads[tensor] = grad
        self.grad_ids.add(id(total))

    def describe(self, message_id: int) -> str:
        if (send := self.sends.get(message_id)) is not None:
            shapes = ", ".join(str(tuple(t.shape)) for t in send.tensors)
            return f"tensors of shape {shapes} sent to rank {send.peer}"
        if (recv := self.recvs.get(message_id)) is not None:
            shapes = ", ".join(str(tuple(t.shape)) for t in recv.leaves)
            return f"tensors of shape {shapes} received from rank {recv.peer}"
        if (given_up := self.given_up.get(message_id)) is not None:
            return f"{given_up}, by a call that failed or was given up on here"
        return "unknown"


class _ContextScope:
    """Within the block, ``current_context`` is ``ctx`` (a callee runs in its caller's
    context). A class rather than a generator: one is entered per served call."""

    __slots__ = ("ctx", "token")

    def __init__(self, ctx: DistContext | None) -> None:
        self.ctx = ctx

    def __enter__(self) -> None:
        self.token = current_context.set(self.ctx)

    def __exit__(self, *exc: object) -> None:
        current_context.reset(self.token)



class ContextActor(CallHooks):
    """Owns this worker's contexts; records send/recv pairs as the RPC hooks."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.contexts: dict[int, DistContext] = {}
        self._ids = itertools.count(1)
        self._released: collections.deque[int] = collections.deque(maxlen=_RELEASED_MEMORY)
        self._released_set: set[int] = set()

    def new_id(self) -> int:
        return (self.worker.rank << ID_BITS) | next(self._ids)

    def _minted_here(self, some_id: int) -> bool:
        return some_id >> ID_BITS == self.worker.rank

    def create(self) -> DistContext:
        ctx = DistContext(self.new_id())
        self.contexts[ctx.context_id] = ctx
        return ctx

    def get(self, context_id: int) -> DistContext:
        ctx = self.contexts.get(context_id)
        if ctx is None:
            check_context_id(context_id)
            raise ContextError(
                f"autograd context {context_id} does not exist on {self.worker.name} "
                "(never created here, or already released)"
            )
        return ctx

    # -- RPC hooks ------------------------------------------------------------------
    def before_send(self, worker: Worker, dst: int, reply: bool = False) -> Any:
        ctx = current_context.get()
        if ctx is None or ctx.released or not (reply or _grad_enabled()):
            # a call made under no_grad is not recorded, on either side (as torch): the
            # callee runs outside the context and its result arrives as a leaf. A
            # reply is recorded whatever the grad mode of the thread that sends it
            # (the loop's is that of whichever coroutine is suspended there): its
            # tensors that require grad are those the callee's function recorded.
            return None
        ctx.peers.add(dst)
        return (ctx.context_id, self.new_id())

    def after_send(self, worker: Worker, meta: Any, payload: Payload, dst: int) -> None:
        if meta is None:
            return
        tensors = [t for t in payload.tensors if t.requires_grad]
        if tensors:
            ctx = self.contexts.get(meta[0])
            if ctx is not None:
                edges = [(t.grad_fn, t.output_nr) for t in tensors]
                ctx.sends[meta[1]] = SendEntry(tensors, dst, sent_edges=edges)
                worker.expect_message()  # the backward's gradients for them

    def on_receive(self, worker: Worker, meta: Any, payload: Payload, src: int) -> None:
        if meta is None:
            return
        context_id, message_id = meta
        ctx = self.contexts.get(context_id)
        if ctx is None:
            if context_id in self._released_set or self._minted_here(context_id):
                return  # a late message for a context released here: nothing to record
            ctx = self.contexts[context_id] = DistContext(context_id)
        ctx.peers.add(src)
        leaves = [_as_recv_output(t) for t in payload.tensors if t.requires_grad]
        if leaves:
            ctx.recvs[message_id] = RecvEntry(leaves, src)
            for i, leaf in enumerate(leaves):
                ctx.recv_of_leaf[id(leaf)] = (message_id, i)

    def forget(self, worker: Worker, meta: Any, sent: bool) -> None:
        ctx = self.contexts.get(meta[0])
        if ctx is None:
            return
        message_id = meta[1]
        if sent:
            if message_id in ctx.sends:  # (described still, should its peer's side stay)
                ctx.given_up[message_id] = ctx.describe(message_id)
                del ctx.sends[message_id]
        elif (entry := ctx.recvs.pop(message_id, None)) is not None:
            for leaf in entry.leaves:
                ctx.recv_of_leaf.pop(id(leaf), None)

    def scope(self, worker: Worker, meta: Any) -> contextlib.AbstractContextManager[None]:
        return NO_SCOPE if meta is None else _ContextScope(self.contexts.get(meta[0]))

    # -- release --------------------------------------------------------------------
    def release(self, context_id: int, came_from: int | None = None) -> None:
        """Drop the context here and tell every worker it touched to do the same."""
        ctx = self.contexts.pop(context_id, None)
        if ctx is None:
            return
        if not self._minted_here(context_id):
            # a late message for it must not recreate it (ours are known by their id)
            if len(self._released) == self._released.maxlen:
                self._released_set.discard(self._released[0])
            self._released.append(context_id)
            self._released_set.add(context_id)
        ctx.released = True
        if ctx.hooked:
            for handle in ctx.hooked.values():
                handle.remove()
            ctx.hooked.clear()
        if _small_graph(ctx):
            # freed right here: a hand-over to the reaper thread costs more, and that
            # thread holding the GIL while it frees delays this loop by milliseconds
            _clear(ctx)
        else:
            reaper.drop(ctx)
        if not ctx.peers:
            return
        peers = ctx.peers - {came_from, self.worker.rank}
        if peers:
            message = ReleaseContext(context_id=context_id).dump()
            for peer in peers:
                with contextlib.suppress(Exception):  # a lost peer has nothing left to free
                    self.worker.tell(peer, ReleaseContext.TARGET, message)

    def on_describe(self, peer: Any, payload: Payload) -> Payload:
        """The description of one send/recv pair (for a FAST mode error elsewhere)."""
        context_id, message_id = payload.load()
        ctx = self.contexts.get(context_id)
        return Payload.dump("unknown (context released)" if ctx is None else ctx.describe(message_id))

    def on_worker_lost(self, name: str, rank: int, reason: str) -> None:
        """A worker that is gone can never leave the contexts it created (its
        ``__aexit__`` sends the release): free them here. Every other worker that took
        part hears of the loss too and does the same."""
        for context_id in [c for c in self.contexts if c >> ID_BITS == rank]:
            self.release(context_id, came_from=rank)
        # A context this worker knows only through the lost one (worker0 called it, it
        # called here): the creator's release would have come that way. Tell the
        # creator, whose release then comes straight here.
        me = self.worker.rank
        for context_id, ctx in list(self.contexts.items()):
            creator = context_id >> ID_BITS
            if rank in ctx.peers and creator not in ctx.peers and creator != me:
                ctx.peers.add(creator)
                with contextlib.suppress(Exception):  # the creator is gone too: freed above
                    self.worker.tell(creator, ShareHeld.TARGET, ShareHeld(context_id=context_id).dump())

    def on_share_held(self, peer: Any, payload: Payload) -> None:
        context_id = ShareHeld.load(payload).context_id
        ctx = self.contexts.get(context_id)
        if ctx is not None:
            ctx.peers.add(peer.rank)  # released with the rest
        else:  # left already (or never ours): the share is to go now
            self.worker.tell(peer.rank, ReleaseContext.TARGET, ReleaseContext(context_id=context_id).dump())

    def on_release(self, peer: Any, payload: Payload) -> None:
        msg = ReleaseContext.load(payload)
        self.release(msg.context_id, came_from=peer.rank)

    def close(self) -> None:
        """The worker shuts down: free every context here before the process may exit."""
        for context_id in list(self.contexts):
            ctx = self.contexts.pop(context_id)
            for handle in ctx.hooked.values():
                handle.remove()
            reaper.drop(ctx)
        reaper.flush()

    def debug_info(self) -> dict[str, int]:
        return {
            "num_autograd_contexts": len(self.contexts),
            # as torch: contexts with a backward in progress here (one pass runs
            # several jobs and waits here at once)
            "num_current_backward_passes": sum(1 for c in self.contexts.values() if c.running_backwards),
            "num_send_entries": sum(len(c.sends) for c in self.contexts.values()),
            "num_recv_entries": sum(len(c.recvs) for c in self.contexts.values()),
        }


def check_context_id(context_id: Any) -> None:
    """Refuse what cannot be a context id (a context id is the int that
    ``autograd.context()`` yields)."""
    if isinstance(context_id, bool) or not isinstance(context_id, numbers.Integral):
        raise TypeError(
            f"context_id must be the int that autograd.context() yields, got {type(context_id).__name__}"
        )


def root_tensors(roots: Any, what: str) -> list[torch.Tensor]:
    """``roots`` (one tensor or a sequence of them) as a list, refusing anything else."""
    if isinstance(roots, torch.Tensor):
        return [roots]
    if not isinstance(roots, collections.abc.Iterable):
        raise TypeError(f"roots must be a tensor or a sequence of tensors, got {type(roots).__name__}")
    roots = list(roots)
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"{what} roots must be tensors, got {type(root).__name__}")
    return roots


def context_actor(worker: Worker | None = None) -> ContextActor:
    worker = worker or get_worker()
    actor = worker.extensions.get("autograd.context")
    if not isinstance(actor, ContextActor):
        raise RuntimeError("distributed autograd is not set up on this worker")
    return actor


class context:  # noqa: N801 - named like torch.distributed.autograd.context
    """A distributed autograd context: ``async with autograd.context() as context_id``.

    RPCs made inside it (and nested RPCs made by callees) record send/recv pairs. On
    exit the context is released on every worker that took part, also when the body
    raised.
    """

    def __init__(self) -> None:
        self._actor: ContextActor | None = None
        self._ctx: DistContext | None = None
        self._token: contextvars.Token[DistContext | None] | None = None

    def __enter__(self) -> int:
        if self._ctx is not None:
            raise RuntimeError(
                f"this autograd.context() is in use already (context {self._ctx.context_id}): "
                "make a new autograd.context() for another context"
            )
        self._actor = context_actor()
        self._ctx = self._actor.create()
        self._token = current_context.set(self._ctx)
        return self._ctx.context_id

    def __exit__(self, *exc: object) -> None:
        if self._actor is None or self._ctx is None or self._token is None:
            raise RuntimeError("an autograd.context() was left without being entered")
        current_context.reset(self._token)
        actor, context_id = self._actor, self._ctx.context_id
        self._actor = self._ctx = self._token = None  # (it may be entered again)
        loop = actor.worker.loop
        if loop.is_running() and not on_loop(actor.worker):
            # left in a thread beside the running loop (a remote function on the pool, a
            # script's thread): the release sends messages, which only the loop may do
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(actor.release, context_id)
            return
        actor.release(context_id)

    async def __aenter__(self) -> int:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's accumulated gradients in the context: ``{tensor: grad}``."""
    return dict(context_actor().get(context_id).grads)


def debug_info() -> dict[str, int]:
    """``num_autograd_contexts`` and ``num_current_backward_passes`` on this worker."""
    return context_actor().debug_info()


def current_context_id() -> int | None:
    """The id of the context the calling code runs in, or None."""
    ctx = current_context.get()
    return None if ctx is None else ctx.context_id
