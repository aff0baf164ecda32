"""The pluggable ``torch.distributed`` backend (gloo, or NCCL where there is a GPU).

``init_process_group(backend="gloo")`` builds a c10d store from the actorgrad group
itself: rank 0 starts a ``TCPStore`` on a free port and broadcasts its address over
actorgrad, the others connect. Every group then gets its own ``ProcessGroupGloo``
(``ProcessGroupNCCL``) object on that store, created in the background on the worker's
thread pool (creation is a blocking rendezvous). The objects are created directly, not
through ``torch.distributed.init_process_group``, so several workers can live in one
process (the in-process test groups) and nothing global is touched.

Collectives are issued on the loop thread (c10d only enqueues them) in call order, so
the order is the same on every rank; completion comes back through the work's future
(``call_soon_threadsafe``). Point-to-point works have no future in gloo; their blocking
``wait()`` runs on the thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._errors import CollectiveError
from ..runtime import Worker
from ._staging import Staged, staged_apart
from ._staging import staged as _staged_on_cpu
from ._types import Group, ReduceOp

log = logging.getLogger("actorgrad.collective")
_JOIN_WAITS_S = 2.0  # most close() waits for point-to-point waits to end

_OPS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}

PG = Any  # torch's ProcessGroupGloo / ProcessGroupNCCL


class TorchBackend:
    """Runs the collective API on torch.distributed process groups."""

    def __init__(self, worker: Worker, name: str, store: Any, timeout: float, host: str) -> None:
        self.worker = worker
        self.loop = worker.loop
        self.name = name
        self.store = store
        self.timeout = datetime.timedelta(seconds=timeout if timeout > 0 else 1800.0)
        self.host = host
        self.pgs: dict[int, asyncio.Future[PG]] = {}
        self._last_made: asyncio.Future[PG] | None = None  # the process group made last (see create_pg)
        # per group, the operations called while its pg was being made, in call order
        self._queued: dict[int, list[Callable[[], None]]] = {}
        # a thread per point-to-point operation in flight (see _launch)
        self._waiting: set[threading.Thread] = set()
        self.closed = False

    # -- process groups -----------------------------------------------------------------
    def create_pg(self, group: Group) -> None:
        """Start creating the process group of ``group`` (members only)."""
        me = self.worker.rank
        if me not in group.ranks or group.id in self.pgs:
            return
        rank, size = group.ranks.index(me), len(group.ranks)
        prefix = f"actorgrad/{group.id}/"
        gid = group.id
        made: asyncio.Future[PG] = self.loop.create_future()
        previous, self._last_made = self._last_made, made
        self.pgs[gid] = made

        def start(_: Any = None) -> None:
            if self.closed:
                made.set_exception(CollectiveError(f"the {self.name} backend is shut down"))
                made.exception()  # (nobody may ask: not an unretrieved error)
                return
            try:
                _off_loop(self.worker, lambda: self._make_pg(prefix, rank, size), into=made)
            except Exception as exc:  # (the worker's pool is closed: it is shutting down)
                made.set_exception(exc)
                made.exception()

        def shut_down_if_gone(_: Any) -> None:
            if self.pgs.get(gid) is not made:  # destroyed (or the backend closed) meanwhile
                _shut_down(made)

        made.add_done_callback(shut_down_if_gone)

        # One at a time, in new_group order (the same on every rank): making one waits
        # for the other members in the store, through the one store client, and two
        # made at once on each rank could each wait for a key that the other rank's
        # client, held by its wait, cannot set (every rank stuck until the timeout).
        # A group destroyed before its turn is still made: the other members wait for
        # this rank in it.
        if previous is None or previous.done():
            start()
        else:
            previous.add_done_callback(start)

    def _make_pg(self, prefix: str, rank: int, size: int) -> PG:
        store = dist.PrefixStore(prefix, self.store)
        if self.name == "nccl":
            from torch.distributed import ProcessGroupNCCL

            nccl_opts = ProcessGroupNCCL.Options()
            nccl_opts._timeout = self.timeout
            return ProcessGroupNCCL(store, rank, size, nccl_opts)
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        if iface:
            opts._devices = [ProcessGroupGloo.create_device(interface=iface)]
        else:
            opts._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
        opts._timeout = self.timeout
        return ProcessGroupGloo(store, rank, size, opts)

    # -- plumbing -----------------------------------------------------------------------
    def _launch(self, group: Group, issue: Callable[[PG], Any],
                after: Callable[[], Any] | None = None, blocking: bool = False) -> asyncio.Future[Any]:
        """Issue ``issue(pg)`` (returns a c10d Work) once the group's pg exists; the
        future resolves with ``after()`` when the work completes."""
        result: asyncio.Future[Any] = self.loop.create_future()
        pg_future = self.pgs.get(group.id)
        if pg_future is None:
            result.set_exception(CollectiveError(f"no {self.name} process group for {group!r}"))
            return result

        def finish(error: BaseException | None) -> None:
            if result.done():
                return
            if error is not None:
                exc = CollectiveError(f"{self.name}: {error}")
                exc.__cause__ = error
                result.set_exception(exc)
                return
            try:
                result.set_result(after() if after is not None else None)
            except Exception as exc2:
                result.set_exception(exc2)

        def start(_: Any = None) -> None:
            if result.done():
                return
            if pg_future.cancelled() or pg_future.exception() is not None:
                finish(pg_future.exception() or CollectiveError("process group creation cancelled"))
                return
            if self.closed:
                finish(CollectiveError(f"the {self.name} backend is shut down"))
                return
            try:
                work = issue(pg_future.result())
            except Exception as exc:
                finish(exc)
                return
            def settle(outcome: Callable[[], Any]) -> None:
                """On whichever thread the work ends: hand its outcome to the loop."""
                try:
                    outcome()
                    error = None
                except Exception as exc:
                    error = exc
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    self.loop.call_soon_threadsafe(finish, error)

            if blocking:
                # gloo's send and recv have no future, only a blocking wait. Each waits
                # on a thread of its own, not the worker's pool: sixteen receives
                # posted ahead (a server waiting on its clients) would hold every pool
                # thread, and no remote function could run until one completed.
                def wait() -> None:
                    settle(work.wait)
                    self._waiting.discard(threading.current_thread())

                thread = threading.Thread(target=wait, name=f"actorgrad-{self.name}-p2p", daemon=True)
                self._waiting.add(thread)
                thread.start()
                return
            work.get_future().add_done_callback(lambda done: settle(done.value))

        queued = self._queued.get(group.id)
        if pg_future.done() and queued is None:
            start()
        elif queued is not None:
            queued.append(start)
        else:
            # issued in call order once the pg exists: an operation called in the loop
            # turn between the pg's arrival and a per-operation callback would see it
            # done and go first, and gloo pairs operations by their order on each rank
            self._queued[group.id] = [start]
            pg_future.add_done_callback(lambda _: self._issue_queued(group.id))
        return result

    def _issue_queued(self, gid: int) -> None:
        for start in self._queued.pop(gid, ()):
            start()

    # -- the API ------------------------------------------------------------------------
    def all_reduce(self, group: Group, t: torch.Tensor, op: ReduceOp) -> asyncio.Future[Any]:
        _check_complex_op(self.name, t, op)
        work, writeback = _staged(t)
        n = group.size()

        def after() -> None:
            if op is ReduceOp.AVG:
                work.div_(n)
            if writeback is not None:
                writeback()

        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        return self._launch(group, lambda pg: pg.allreduce([_real(work)], opts), after)

    def reduce(self, group: Group, t: torch.Tensor, dst: int, op: ReduceOp) -> asyncio.Future[Any]:
        _check_complex_op(self.name, t, op)
        is_root = dst == self.worker.rank
        work, writeback = _staged(t, copy=not is_root)
        n = group.size()

        def after() -> None:
            if is_root:
                if op is ReduceOp.AVG:
                    work.div_(n)
                if writeback is not None:
                    writeback()

        opts = dist.ReduceOptions()
        opts.reduceOp = _OPS[op]
        opts.rootRank = group.ranks.index(dst)
        opts.rootTensor = 0
        return self._launch(group, lambda pg: pg.reduce([_real(work)], opts), after)

    def broadcast(self, group: Group, t: torch.Tensor, src: int) -> asyncio.Future[Any]:
        work, writeback = _staged(t)
        opts = dist.BroadcastOptions()
        opts.rootRank = group.ranks.index(src)
        opts.rootTensor = 0
        # (the source's tensor is only read: see CollectiveActor.broadcast)
        return self._launch(group, lambda pg: pg.broadcast([_real(work)], opts),
                            writeback if src != self.worker.rank else None)

    def scatter(self, group: Group, t: torch.Tensor, parts: list[torch.Tensor] | None,
                src: int) -> asyncio.Future[Any]:
        work, writeback = staged_apart(t, parts, group.ranks.index(self.worker.rank), _staged)
        opts = dist.ScatterOptions()
        opts.rootRank = group.ranks.index(src)
        inputs = [[_real(_staged(p)[0]) for p in parts]] if parts is not None else []
        return self._launch(group, lambda pg: pg.scatter([_real(work)], inputs, opts), writeback)

    def gather(self, group: Group, t: torch.Tensor, out: list[torch.Tensor] | None,
               dst: int | None) -> asyncio.Future[Any]:
        work, _ = staged_apart(t, out, group.ranks.index(self.worker.rank), _staged)
        staged = [_staged(o) for o in out] if out is not None else []

        def after() -> None:
            for _, wb in staged:
                if wb is not None:
                    wb()

        outputs = [[_real(w) for w, _ in staged]] if out is not None else []
        if dst is None:
            return self._launch(group, lambda pg: pg.allgather(outputs, [_real(work)]), after)
        opts = dist.GatherOptions()
        opts.rootRank = group.ranks.index(dst)
        return self._launch(group, lambda pg: pg.gather(outputs, [_real(work)], opts), after)

    def barrier(self, group: Group) -> asyncio.Future[Any]:
        return self._launch(group, lambda pg: pg.barrier(dist.BarrierOptions()))

    def send(self, group: Group, t: torch.Tensor, dst: int, tag: int) -> asyncio.Future[Any]:
        work, _ = _staged(t)
        peer = group.ranks.index(dst)
        return self._launch(group, lambda pg: pg.send([_real(work)], peer, tag), blocking=True)

    def recv(self, group: Group, t: torch.Tensor, src: int | None, tag: int) -> asyncio.Future[Any]:
        work, writeback = _staged(t)
        holder: list[Any] = []

        def issue(pg: PG) -> Any:
            if src is None:
                w = pg.recv_anysource([_real(work)], tag)
            else:
                w = pg.recv([_real(work)], group.ranks.index(src), tag)
            holder.append(w)
            return w

        def after() -> int:
            if writeback is not None:
                writeback()
            if src is not None:
                return src
            return group.ranks[holder[0]._source_rank()]

        return self._launch(group, issue, after, blocking=True)

    def destroy_pg(self, gid: int) -> None:
        """Shut down the process group of group ``gid`` (destroyed by the user)."""
        fut = self.pgs.pop(gid, None)
        if fut is not None:
            _shut_down(fut)

    def close(self) -> None:
        """Shut the process groups down (their threads must end before the process)."""
        self.closed = True
        for fut in self.pgs.values():
            _shut_down(fut)
        self.pgs.clear()
        self.store = None
        # most waits end with their process groups (a receive from a peer that still
        # lives does not: gloo has no way to withdraw it); a thread still holding
        # tensors when the interpreter exits can abort it inside torch's destructors
        deadline = time.monotonic() + _JOIN_WAITS_S
        for thread in list(self._waiting):
            thread.join(max(0.0, deadline - time.monotonic()))


def _shut_down(fut: asyncio.Future[PG]) -> None:
    if fut.done() and not fut.cancelled() and fut.exception() is None:
        try:
            fut.result().shutdown()
        except Exception:
            log.debug("shutting a process group down failed", exc_info=True)


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the real one of its memory (gloo has no complex types), as
    torch.distributed hands it to gloo; others as they are."""
    return torch.view_as_real(t) if t.is_complex() else t


def _check_complex_op(backend: str, t: torch.Tensor, op: ReduceOp) -> None:
    # (a complex product is no product of the real and imaginary parts: the real view
    # would give a wrong value; torch refuses it too)
    if t.is_complex() and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"ReduceOp.{op.name} on complex tensors is not supported by the {backend} backend "
                         "(SUM and AVG are; actorgrad's own backend also does PRODUCT)")


def _staged(t: torch.Tensor, copy: bool = False) -> Staged:
    if t.device.type == "cuda":  # NCCL works on the device itself
        d = t.detach()
        if d.is_contiguous() and not copy and not d.is_conj() and not d.is_neg():
            return d, None
        work = d.clone(memory_format=torch.contiguous_format)

        def writeback() -> None:
            d.copy_(work)

        return work, writeback
    return _staged_on_cpu(t, copy)


async def create_backend(worker: Worker, name: str, timeout: float, world: Group) -> TorchBackend:
    """Create the store and the world process group (called by every worker)."""
    from ._api import broadcast_object_list

    limit = timeout if timeout > 0 else 1800.0
    delta = datetime.timedelta(seconds=limit)
    if worker.rank == 0:
        host = _host(worker)
        store = await _off_loop(
            worker, lambda: dist.TCPStore(host, 0, worker.world_size, True, delta, wait_for_workers=False)
        )
        address: list[Any] = [host, int(store.port)]
    else:
        address = [None, None]
        store = None
    await broadcast_object_list(address, src=0, group=world, _backend="actorgrad")
    host, port = address
    if store is None:
        store = await _off_loop(
            worker, lambda: dist.TCPStore(host, port, worker.world_size, False, delta)
        )
    backend = TorchBackend(worker, name, store, timeout, host)
    return backend


def _off_loop(worker: Worker, make: Callable[[], Any],
              into: asyncio.Future[Any] | None = None) -> asyncio.Future[Any]:
    """``worker.run_blocking(make)``, except that the pool thread keeps no reference to
    the result: a c10d object whose last reference dies on a daemon thread during
    interpreter shutdown aborts the process (its destructor drops the GIL). The result
    goes ``into`` that future when one is given."""
    holder: list[Any] = []
    result: asyncio.Future[Any] = worker.loop.create_future() if into is None else into

    def run() -> None:
        holder.append(make())

    def done(f: asyncio.Future[Any]) -> None:
        if result.done():
            return
        if f.cancelled():
            result.cancel()
        elif (exc := f.exception()) is not None:
            result.set_exception(exc)
        else:
            result.set_result(holder.pop())

    worker.run_blocking(run, waits_on_peers=True).add_done_callback(done)
    return result


def _host(worker: Worker) -> str:
    """The address the other ranks reach rank 0's store on."""
    opts = worker.options
    for host in (opts.advertise_host, opts.listen_host):
        if host and host not in ("0.0.0.0", "::"):
            return host
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


__all__ = ["TorchBackend", "create_backend"]
