"""The public collective API: torch.distributed's names and arguments, as coroutines.

Arguments are validated here, the same way for every backend, then the call goes to
the group's backend: our own (``"actorgrad"``, the default) or a torch.distributed
process group (``"gloo"``, ``"nccl"``) after :func:`init_process_group`.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import operator
import warnings
from collections.abc import Iterator
from typing import Any, overload

import cloudpickle
import torch

from .._errors import CollectiveError
from ..runtime import get_worker
from ..runtime._calls import check_timeout
from ..runtime._current import off_loop_error
from ..wire import dumps
from ._actor import CollectiveActor, actor
from ._types import Group, ReduceOp, Work

BACKENDS = ("actorgrad", "gloo", "nccl")


# ---------------------------------------------------------------------------------------
# groups and backends
# ---------------------------------------------------------------------------------------
async def init_process_group(backend: str = "actorgrad", timeout: float | None = None) -> None:
    """Choose the default backend of this worker's collectives (call on every worker).

    The actorgrad group (``init_rpc``) already is the process group: with the default
    ``backend="actorgrad"`` nothing needs to be called at all. ``"gloo"`` (or ``"nccl"``
    for CUDA tensors) creates a torch.distributed process group from the same
    rendezvous and runs every collective of ``group=None`` (and of later
    :func:`new_group` calls) on it.

    Args:
        backend: ``"actorgrad"``, ``"gloo"`` or ``"nccl"``.
        timeout: seconds any collective may wait (default ``RpcOptions.rpc_timeout``).

    Raises:
        ValueError: unknown backend, or a different torch backend is already running.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    act = actor()
    if timeout is not None:
        check_timeout(timeout)  # (a number of seconds >= 0)
        act.timeout = float(timeout)
    world_ranks = act.world.ranks
    if backend == "actorgrad":
        act.default_backend = backend
        act.world = act.groups[0] = Group(0, world_ranks, backend)
        return
    if act.torch is not None:
        if act.torch.name != backend:
            raise ValueError(
                f"the {act.torch.name} backend is already initialized; call "
                "destroy_process_group() first"
            )
    else:
        from ._torch import create_backend

        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, which is not available here")
        act.torch = await create_backend(act.worker, backend, act.deadline(), act.world)
    act.default_backend = backend
    act.world = act.groups[0] = Group(0, world_ranks, backend)
    act.torch.create_pg(act.world)
    await act.torch.pgs[0]


def destroy_process_group(group: Group | None = None) -> None:
    """With a group (as torch's ``destroy_process_group(group)``): free what this worker
    holds for it (a job that makes groups as it goes must destroy them, here as in
    torch: each keeps a shared-memory arena, an open file, per member); operations
    still running on it fail, and the group cannot be used any more. Every member
    destroys it once done with it.

    Without: drop the torch.distributed backend; collectives use actorgrad's own again.
    """
    act = actor()
    if group is not None:
        g = _group(act, group)
        if g.id == 0:
            raise ValueError("the group of all workers cannot be destroyed; call "
                             "destroy_process_group() to drop the torch backend")
        act.destroy_group(g)
        return
    if act.torch is not None:
        act.torch.close()
        act.torch = None
    act.default_backend = "actorgrad"
    act.world = act.groups[0] = Group(0, act.world.ranks, "actorgrad")


def is_initialized() -> bool:
    """True when this code runs on a started worker (collectives can be used)."""
    try:
        get_worker()
    except RuntimeError:
        return False
    return True


def new_group(ranks: list[int] | tuple[int, ...] | None = None, timeout: float | None = None,
              backend: str | None = None) -> Group:
    """Create a group of workers (every worker must call it, in the same order).

    Args:
        ranks: global ranks of the members (default: all); the group rank of a member
            is its position in the sorted list.
        timeout: accepted for torch compatibility; deadlines come from
            :func:`init_process_group`.
        backend: default: the backend chosen by :func:`init_process_group`.

    Returns:
        The Group. On a worker that is not a member, it cannot be used: collectives on
        it do nothing and warn, ``get_rank(group)`` is -1 (as in torch).
    """
    act = actor()
    world_size = act.worker.world_size
    if ranks is None:
        members = tuple(range(world_size))
    else:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, collections.abc.Iterable):
            raise TypeError(f"new_group: ranks must be a list of global ranks, got {ranks!r:.60}")
        members = tuple(sorted(_rank_arg(r, "ranks") for r in ranks))
        if len(set(members)) != len(members):
            raise ValueError(f"new_group: duplicate ranks in {list(ranks)}")
        if not members:
            raise ValueError("new_group: ranks must not be empty")
        bad = [r for r in members if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"new_group: rank {bad[0]} is out of range for world size {world_size}")
    name = backend or act.default_backend
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "actorgrad" and (act.torch is None or act.torch.name != name):
        raise ValueError(f"new_group(backend={name!r}): call init_process_group(backend={name!r}) first")
    group = act.new_group(members, name)
    if name != "actorgrad":
        act.torch.create_pg(group)
    return group


def get_rank(group: Group | None = None) -> int:
    """This worker's rank in ``group`` (global rank for None); -1 for a non-member."""
    act = actor()
    g = _group(act, group)
    return g.ranks.index(act.worker.rank) if act.worker.rank in g.ranks else -1


def get_world_size(group: Group | None = None) -> int:
    """The number of members of ``group`` (all workers for None); -1 for a non-member."""
    act = actor()
    g = _group(act, group)
    return len(g.ranks) if act.worker.rank in g.ranks else -1


def get_backend(group: Group | None = None) -> str:
    """The backend that runs ``group``'s collectives."""
    return _group(actor(), group).backend


def get_global_rank(group: Group, group_rank: int) -> int:
    """The global rank of the member with rank ``group_rank`` in ``group``."""
    g = _group(actor(), group)
    group_rank = _rank_arg(group_rank, "group_rank")
    if not 0 <= group_rank < len(g.ranks):
        raise ValueError(f"group rank {group_rank} out of range for {g!r}")
    return g.ranks[group_rank]


def get_group_rank(group: Group, global_rank: int) -> int:
    """The rank inside ``group`` of global rank ``global_rank``."""
    return _group(actor(), group).group_rank(_rank_arg(global_rank, "global_rank"))


# ---------------------------------------------------------------------------------------
# point-to-point
# ---------------------------------------------------------------------------------------
async def send(tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0,
               group_dst: int | None = None) -> None:
    """Send ``tensor`` to global rank ``dst`` (or rank ``group_dst`` of ``group``);
    returns once ``tensor`` may be reused.

    Raises:
        CollectiveError: the receiver is gone, or rejected the tensor (shape/dtype).
    """
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        await work.wait()


async def recv(tensor: torch.Tensor, src: int | None = None, group: Group | None = None,
               tag: int = 0, group_src: int | None = None) -> int:
    """Receive into ``tensor`` from global rank ``src`` (or rank ``group_src`` of
    ``group``; neither: any member of the group).

    Returns:
        The global rank of the sender (-1 on a non-member of ``group``).

    Cancelling the call (a timeout) withdraws the receive on our backend: the next
    message goes to the next receive, also one that reached this receive as it was
    cancelled (into ``tensor`` then). ``irecv``'s Work keeps its receive posted.

    Raises:
        CollectiveError: the message has another number of elements (or, on our
            backend, another dtype; gloo takes the bytes as they come, as torch's does),
            the sender is gone, or the deadline passed. The same elements in another
            shape are taken, as by torch.
    """
    work = irecv(tensor, src, group, tag, group_src)
    if work is None:
        return -1
    try:
        await work.wait()
    except asyncio.CancelledError:
        # the caller stopped waiting (a timeout): a receive nobody waits for must not
        # take the next message, which a retry expects (gloo cannot withdraw one)
        actor().withdraw_recv(work._future, tensor)
        raise
    return work.source_rank()


@overload
def isend(tensor: torch.Tensor, dst: int | None = None, group: None = None, tag: int = 0,
          group_dst: int | None = None) -> Work: ...


@overload
def isend(tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None: ...


def isend(tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to ``dst``; the returned Work is awaitable.

    Do not modify ``tensor`` before the Work completed. Returns None (as torch does)
    on a worker that is not a member of ``group``; with ``group=None``, always a Work.
    """
    act, g, impl = _prepare(group, "isend")
    _check_tensor(tensor, "tensor")
    _check_tag(tag)
    if g is None:
        return None
    dst = _global_rank(g, dst, group_dst, "dst")
    _check_peer(dst, g, act, "dst")
    return Work(impl.send(g, tensor, dst, tag), [tensor])


@overload
def irecv(tensor: torch.Tensor, src: int | None = None, group: None = None,
          tag: int = 0, group_src: int | None = None) -> Work: ...


@overload
def irecv(tensor: torch.Tensor, src: int | None = None, group: Group | None = None,
          tag: int = 0, group_src: int | None = None) -> Work | None: ...


def irecv(tensor: torch.Tensor, src: int | None = None, group: Group | None = None,
          tag: int = 0, group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor``; the returned Work is awaitable and its
    ``source_rank()`` names the sender. Do not read ``tensor`` before it completed.
    Returns None on a worker that is not a member of ``group`` (as torch does)."""
    act, g, impl = _prepare(group, "irecv")
    _check_tensor(tensor, "tensor")
    _check_tag(tag)
    if g is None:
        return None
    if group_src is not None:
        src = _global_rank(g, src, group_src, "src")
    if src is not None:
        _check_peer(src, g, act, "src")
    return Work(impl.recv(g, tensor, src, tag), [tensor])


# ---------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------
async def broadcast(tensor: torch.Tensor, src: int | None = None, group: Group | None = None,
                    async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Copy ``tensor`` of global rank ``src`` (or rank ``group_src`` of ``group``) into
    ``tensor`` of every member."""
    act, g, impl = _prepare(group, "broadcast")
    with _refusal(act, g, "broadcast"):
        _check_tensor(tensor, "tensor")
        if g is None:
            return None
        src = _global_rank(g, src, group_src, "src")
        _check_member(src, g, act, "src")
    return await _finish(impl.broadcast(g, tensor, src), async_op, [tensor])


async def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None,
                     async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` over the group, in place, on every member."""
    act, g, impl = _prepare(group, "all_reduce")
    try:  # not _refusal: the smallest collective pays nothing for it unless refused
        _check_tensor(tensor, "tensor")
        _check_op(op, tensor)
    except (TypeError, ValueError) as exc:
        if g is not None:
            if g.backend == "actorgrad" and not act.arenas.settled(g.id):
                # the group's arena negotiation counts small all-reduces alike on every
                # member; the refused one counts on the others only
                act.arenas.refused(g)
            _refuse(act, g, "all_reduce", exc)
        raise
    if g is None:
        return None
    if len(g.ranks) == 1:
        return await _finish(_done(act), async_op, [tensor])
    return await _finish(impl.all_reduce(g, tensor, op), async_op, [tensor])


def start_all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                     group: Group | None = None) -> asyncio.Future[Any]:
    """Start :func:`all_reduce` now, from plain (non-async) code on the loop thread;
    returns its future. For layers that launch collectives from callbacks (DDP)."""
    act, g, impl = _prepare(group, "all_reduce")
    _check_tensor(tensor, "tensor")
    _check_op(op, tensor)
    if g is None or len(g.ranks) == 1:
        return _done(act)
    fut: asyncio.Future[Any] = impl.all_reduce(g, tensor, op)
    fut.add_done_callback(_retrieved)  # a caller that gives up early is not an error to log
    return fut


def start_broadcast(tensor: torch.Tensor, src: int, group: Group | None = None) -> asyncio.Future[Any]:
    """Start :func:`broadcast` of global rank ``src`` now, from plain code on the loop
    thread (as :func:`start_all_reduce`); returns its future."""
    act, g, impl = _prepare(group, "broadcast")
    _check_tensor(tensor, "tensor")
    if g is None or len(g.ranks) == 1:
        return _done(act)
    _check_member(src, g, act, "src")
    fut: asyncio.Future[Any] = impl.broadcast(g, tensor, src)
    fut.add_done_callback(_retrieved)
    return fut


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def reduce(tensor: torch.Tensor, dst: int | None = None, op: ReduceOp = ReduceOp.SUM,
                 group: Group | None = None, async_op: bool = False,
                 group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` over the group into ``tensor`` of global rank ``dst`` (or rank
    ``group_dst`` of ``group``); the other ranks' tensors are left unchanged."""
    act, g, impl = _prepare(group, "reduce")
    with _refusal(act, g, "reduce"):
        _check_tensor(tensor, "tensor")
        _check_op(op, tensor)
        if g is None:
            return None
        dst = _global_rank(g, dst, group_dst, "dst")
        _check_member(dst, g, act, "dst")
    if len(g.ranks) == 1:
        return await _finish(_done(act), async_op, [tensor])
    return await _finish(impl.reduce(g, tensor, dst, op), async_op, [tensor])


async def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
                  src: int | None = None, group: Group | None = None, async_op: bool = False,
                  group_src: int | None = None) -> Work | None:
    """Global rank ``src`` (or rank ``group_src`` of ``group``; neither: global rank 0)
    sends ``scatter_list[i]`` to the member of group rank ``i``, which receives it into
    ``tensor``."""
    act, g, impl = _prepare(group, "scatter")
    with _refusal(act, g, "scatter"):
        _check_tensor(tensor, "tensor")
        if g is None:
            return None
        src = _global_rank(g, src, group_src, "src", default=0)
        parts = _root_list("scatter", act, g, tensor, src, "src", scatter_list, "scatter_list", "the source rank")
    return await _finish(impl.scatter(g, tensor, parts, src), async_op, [tensor])


async def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
                 dst: int | None = None, group: Group | None = None, async_op: bool = False,
                 group_dst: int | None = None) -> Work | None:
    """Collect ``tensor`` of every member into ``gather_list`` on global rank ``dst``
    (or rank ``group_dst`` of ``group``; neither: global rank 0), in group rank order."""
    act, g, impl = _prepare(group, "gather")
    with _refusal(act, g, "gather"):
        _check_tensor(tensor, "tensor")
        if g is None:
            return None
        dst = _global_rank(g, dst, group_dst, "dst", default=0)
        out = _root_list("gather", act, g, tensor, dst, "dst", gather_list, "gather_list", "the destination rank")
    return await _finish(impl.gather(g, tensor, out, dst), async_op, out or [])


async def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group | None = None,
                     async_op: bool = False) -> Work | None:
    """Collect ``tensor`` of every member into ``tensor_list`` on every member."""
    act, g, impl = _prepare(group, "all_gather")
    with _refusal(act, g, "all_gather"):
        _check_tensor(tensor, "tensor")
        if g is None:
            return None
        out = _check_list(tensor_list, g, tensor, "tensor_list", "every rank")
    return await _finish(impl.gather(g, tensor, out, None), async_op, out)


async def barrier(group: Group | None = None, async_op: bool = False) -> Work | None:
    """Wait until every member of the group entered the barrier."""
    act, g, impl = _prepare(group, "barrier")
    if g is None:
        return None
    if len(g.ranks) == 1:
        return await _finish(_done(act), async_op, [])
    return await _finish(impl.barrier(g), async_op, [])


async def broadcast_object_list(object_list: list[Any], src: int = 0, group: Group | None = None,
                                _backend: str | None = None) -> None:
    """Broadcast the picklable objects of ``object_list`` on ``src`` into
    ``object_list`` (same length) of every member."""
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    act, member, _ = _prepare(group, "broadcast_object_list")
    if member is None:
        return  # not a member: the list stays as it is, as in torch
    g = member
    if _backend is not None:
        g = Group(g.id, g.ranks, _backend)
    if act.worker.rank == src:
        data = _pickled(act, g, "broadcast_object_list", object_list)
        size = torch.tensor([len(data)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    await broadcast(size, src, g)
    if act.worker.rank == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    await broadcast(buf, src, g)
    if act.worker.rank != src:
        values = cloudpickle.loads(buf.numpy().tobytes())
        if len(values) != len(object_list):
            raise ValueError(
                f"broadcast_object_list: rank {src} sent {len(values)} objects, this rank's "
                f"object_list has {len(object_list)} slots"
            )
        object_list[:] = values


async def all_gather_object(object_list: list[Any], obj: Any, group: Group | None = None) -> None:
    """Gather the picklable ``obj`` of every member into ``object_list`` (one slot per
    member, in group rank order)."""
    act, member, _ = _prepare(group, "all_gather_object")
    if member is None:
        return  # not a member: the list stays as it is, as in torch
    g = member
    n = len(g.ranks)
    with _refusal(act, g, "all_gather_object"):
        if not isinstance(object_list, list) or len(object_list) != n:
            raise ValueError(f"all_gather_object: object_list must be a list of {n} slots")
    data = _pickled(act, g, "all_gather_object", obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    await all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), g)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    await all_gather(bufs, mine, g)
    for i in range(n):
        object_list[i] = cloudpickle.loads(bufs[i][: int(sizes[i].item())].numpy().tobytes())


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def _pickled(act: CollectiveActor, g: Group, what: str, obj: Any) -> bytes:
    """``obj`` pickled for an object collective (objects of the script's classes by
    name where every member runs the script); when it cannot be, the other members'
    part fails at once, naming the reason, as for a refused argument."""
    try:
        return dumps(obj, main_by_name=all(act.worker.same_program(r) for r in g.ranks))
    except Exception as exc:
        _refuse(act, g, what, TypeError(f"{what}: cannot pickle the objects: {exc}"))
        raise


def _prepare(group: Group | None, what: str) -> tuple[CollectiveActor, Group | None, Any]:
    """The actor, the group (None for a non-member: warn, do nothing) and its backend."""
    act = actor()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not act.worker.loop:
        raise off_loop_error(act.worker, what, "hand a coroutine that calls it to that loop "
                             "(asyncio.run_coroutine_threadsafe)")
    g = _group(act, group)
    if act.worker.rank not in g.ranks:
        warnings.warn(
            f"{what}: rank {act.worker.rank} is not a member of {g!r}; the call does nothing",
            stacklevel=3,
        )
        return act, None, None
    if g.backend == "actorgrad":
        return act, g, act
    if act.torch is None or act.torch.name != g.backend:
        raise CollectiveError(f"{g!r} needs the {g.backend} backend, which is not initialized")
    return act, g, act.torch


@contextlib.contextmanager
def _refusal(act: CollectiveActor, g: Group | None, what: str) -> Iterator[None]:
    """Around a member's argument checks: when they refuse this rank's part of a
    collective of ours, the other members' part fails at once (naming the problem)
    instead of waiting for this rank until their timeout, and the group's operations
    stay numbered alike on every member (a refused call is not paired with this rank's
    next one)."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        if g is not None:
            _refuse(act, g, what, exc)
        raise


def refuse_next(group: Group | None, what: str, exc: Exception) -> None:
    """For a layer above (DDP) whose argument checks refused its part of a collective
    the other members are about to enter: their part fails at once, naming ``exc``."""
    act = actor()
    g = _group(act, group)
    if act.worker.rank in g.ranks:
        _refuse(act, g, what, exc)


def _refuse(act: CollectiveActor, g: Group, what: str, exc: Exception) -> None:
    if g.backend == "actorgrad" and len(g.ranks) > 1:
        text = str(exc)
        act.refuse(g, text if text.startswith(f"{what}:") else f"{what}: {text}")


def _root_list(what: str, act: CollectiveActor, g: Group, tensor: torch.Tensor, root: Any, root_name: str,
               items: list[torch.Tensor] | None, list_name: str, role: str) -> list[torch.Tensor] | None:
    """Check ``root`` and the list that only the root passes; the list, on the root."""
    _check_member(root, g, act, root_name)
    if act.worker.rank == root:
        return _check_list(items, g, tensor, list_name, role)
    if items:
        raise ValueError(f"{what}: {list_name} must be None (or empty) on ranks other than {root_name}")
    return None


def _group(act: CollectiveActor, group: Group | None) -> Group:
    if group is None:
        return act.world
    if not isinstance(group, Group):
        raise TypeError(f"group must be an actorgrad.collective.Group or None, got {type(group).__name__}")
    known = act.groups.get(group.id)
    if known is None and act.destroyed(group.id):
        raise ValueError(f"{group!r} was destroyed (destroy_process_group) on this worker")
    if known is None or known.ranks != group.ranks:
        raise ValueError(
            f"{group!r} was not created on this worker; every worker must call new_group() "
            "with the same ranks, in the same order"
        )
    return known


def _global_rank(g: Group, rank: Any, group_rank: Any, name: str, default: int | None = None) -> Any:
    """The global rank a root argument names: ``rank`` itself, or (torch's
    ``group_src``/``group_dst``) the member of rank ``group_rank`` inside ``g``."""
    if group_rank is None:
        if rank is None:
            if default is not None:
                return default
            raise ValueError(f"{name} or group_{name} is required")
        return rank
    if rank is not None:
        raise ValueError(f"pass {name} or group_{name}, not both")
    r = _rank_arg(group_rank, f"group_{name}")
    if not 0 <= r < len(g.ranks):
        raise ValueError(f"group_{name}={r} is out of range for {g!r} of {len(g.ranks)} ranks")
    return g.ranks[r]


def _rank_arg(r: Any, name: str) -> int:
    """``r`` as an int rank: an int or any integer (numpy's, a one-element int tensor)."""
    if not isinstance(r, bool):
        with contextlib.suppress(TypeError):
            return operator.index(r)
    raise TypeError(f"{name} must be an int rank, got {type(r).__name__}")


def _check_member(r: Any, g: Group, act: CollectiveActor, name: str) -> None:
    r = _rank_arg(r, name)
    world = act.worker.world_size
    if not 0 <= r < world:
        raise ValueError(f"{name}={r} is out of range for world size {world}")
    if r not in g.ranks:
        raise ValueError(f"{name}={r} is not a member of {g!r} ({name} is a global rank)")


def _check_peer(r: Any, g: Group, act: CollectiveActor, name: str) -> None:
    _check_member(r, g, act, name)
    if r == act.worker.rank:
        raise ValueError(f"{name}={r} is this worker's own rank; it cannot send to or receive from itself")


_TAG_LIMIT = 1 << 31


def _check_tag(tag: Any) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not 0 <= tag < _TAG_LIMIT:
        raise ValueError(f"tag must be >= 0 and < 2**31 (a C int, as torch.distributed takes it), got {tag}")


def _check_tensor(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise ValueError(f"{name}: only dense (strided) tensors are supported, got layout {t.layout}")
    if t.is_quantized:
        raise ValueError(f"{name}: quantized tensors are not supported")


def _check_op(op: Any, t: torch.Tensor) -> None:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be an actorgrad.collective.ReduceOp, got {op!r}")
    if op is ReduceOp.AVG and not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"ReduceOp.AVG needs a floating point or complex tensor, got {t.dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and t.is_complex():
        raise TypeError(f"ReduceOp.{op.name} is not defined for complex tensors")
    if op in _BITWISE and (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"ReduceOp.{op.name} needs an integer or bool tensor, got {t.dtype}")


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _check_list(lst: Any, g: Group, like: torch.Tensor, name: str, where: str) -> list[torch.Tensor]:
    n = len(g.ranks)
    if not isinstance(lst, (list, tuple)):
        raise TypeError(f"{name} must be a list of {n} tensors on {where}, got {type(lst).__name__}")
    if len(lst) != n:
        raise ValueError(f"{name} must have one tensor per group member ({n}), got {len(lst)}")
    for i, t in enumerate(lst):
        _check_tensor(t, f"{name}[{i}]")
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)} and dtype {t.dtype}; it must match "
                f"tensor ({tuple(like.shape)}, {like.dtype})"
            )
    return list(lst)


def _done(act: CollectiveActor) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = act.loop.create_future()
    fut.set_result(None)
    return fut


async def _finish(fut: asyncio.Future[Any], async_op: bool, tensors: list[torch.Tensor]) -> Work | None:
    if async_op:
        return Work(fut, tensors)
    await fut
    return None

