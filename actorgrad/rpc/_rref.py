"""Remote references and their lifetime protocol.

# Theory of operation
The owner keeps each shared value in an :class:`OwnerTable` entry together with the set
of live *forks*: one fork per user-side RRef object anywhere in the group. Every time an
RRef is pickled (sent to any worker; only an RPC may pickle it, so the worker is known)
a fresh fork id is minted and announced to the
owner (``rref.add_fork``) *before* the pickled bytes leave; the unpickled copy
announces its end with ``rref.del_fork`` when it is garbage-collected. (A copy sent to
the owner itself needs no fork: it becomes an owner RRef there, and the sender's own
fork outlives the message.) The sender's own
fork is still alive while it sends, and its eventual ``del_fork`` travels on the same
connection after the ``add_fork``, so the owner's set cannot empty early. A ``del_fork``
that overtakes its ``add_fork`` (they come from different workers) leaves a tombstone
that cancels the late ``add_fork``. The entry, and with it the value, is dropped when
the fork set is empty. Owner-side RRef objects hold the value themselves.

A fork is also noted with the worker it went to: when that worker is lost, its RRefs
are gone with it and the owner drops their forks. A fork registered for a message that
then never left (the rest of it failed to pickle, the call could not be sent) is taken
back at once (``_api.forks_made``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import numbers
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .._errors import RemoteError, RpcTimeout, WorkerLost
from ..runtime import PeerRef, Worker, WorkerInfo, await_threadsafe, get_worker
from ..runtime._calls import check_timeout
from ..runtime._worker import describe_error
from ..wire import Payload
from . import _api

T = TypeVar("T")
RRefId = tuple[int, int]
ForkId = tuple[int, int]


@dataclass(slots=True)
class _Entry:
    value: asyncio.Future[Any]
    forks: set[ForkId] = field(default_factory=set)
    tombstones: set[ForkId] = field(default_factory=set)
    holders: dict[ForkId, int] = field(default_factory=dict)  # fork -> rank it went to
    creating: bool = False  # remote() to oneself: kept, forks or not, until created


_EARLY_MAX = 4096
_FAILED_MAX = 1024  # creations that failed before their value's id was read, remembered


def _count_fork(entry: _Entry, added: bool, fork: ForkId, holder: int | None) -> None:
    """A fork made (``added``) or released; either may come first (a tombstone)."""
    if added:
        if fork in entry.tombstones:
            entry.tombstones.discard(fork)
        else:
            entry.forks.add(fork)
            if holder is not None:
                entry.holders[fork] = holder
    elif fork in entry.forks:
        entry.forks.discard(fork)
        entry.holders.pop(fork, None)
    else:
        entry.tombstones.add(fork)


class OwnerTable:
    """Values this worker owns on behalf of RRefs held anywhere (a worker extension)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.entries: dict[RRefId, _Entry] = {}
        # Fork news about a value not created here yet: they may come from other workers
        # before the remote() call that creates it (another connection, or a call that
        # waits, see Worker.serve_deferred), and are applied when it comes.
        self._early: dict[RRefId, list[tuple[bool, ForkId, int | None]]] = {}
        self._early_count = 0  # news in _early, bounded: values that never come leave some
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        # Creations come from each creator in the order of their ids (one connection,
        # in order): the highest id per creator tells a value not created yet (a fetch
        # that overtook its remote(), from a third worker) from one already freed.
        self._created_up_to: dict[int, int] = {}
        self._awaited: dict[RRefId, _Entry] = {}  # asked for before their creation came
        self._failed: dict[RRefId, str] = {}  # not created: why (the latest _FAILED_MAX)
        worker.add_lost_listener(self._on_lost)

    def new_id(self) -> tuple[int, int]:
        with self._lock:
            return (self.worker.rank, next(self._ids))

    def entry_for(self, rref_id: RRefId, value: asyncio.Future[Any]) -> _Entry:
        entry = self.entries.get(rref_id)
        if entry is None:
            entry = self.entries[rref_id] = _Entry(value)
            news = self._early.pop(rref_id, ())
            self._early_count -= len(news)
            for added, fork, holder in news:
                _count_fork(entry, added, fork, holder)  # freed, if at all, by the caller's
        return entry

    def find(self, rref_id: RRefId) -> _Entry | None:
        """The entry of ``rref_id``; for a value whose creation has not come yet, one
        that waits for it (as torch's owner makes one when a fork or fetch comes
        first). None: it was freed, or never will be created here."""
        entry = self.entries.get(rref_id)
        if entry is not None:
            return entry
        creator, number = rref_id
        if number <= self._created_up_to.get(creator, 0) or creator == self.worker.rank \
                or creator not in self.worker.peers:
            return None
        entry = self.entry_for(rref_id, self.worker.loop.create_future())
        entry.creating = True  # kept, forks or not, until its creation comes
        self._awaited[rref_id] = entry
        return entry

    def created(self, rref_id: RRefId) -> _Entry | None:
        """A creation of ``rref_id`` came: the entry that waited for it, if any. Values
        asked for with a lower id of the same creator will not come any more."""
        self._came(rref_id)
        if not self._awaited:
            return None
        waiting = self._awaited.pop(rref_id, None)
        creator, number = rref_id
        for other_id in [k for k in self._awaited if k[0] == creator and k[1] < number]:
            self._give_up(other_id, RuntimeError(
                f"RRef {other_id} was asked for on {self.worker.name}, but its creation never came"
            ))
        return waiting

    def not_created(self, rref_id: RRefId, reason: str) -> None:
        """The remote() call of ``rref_id`` failed (``reason``), maybe before its id was
        read here: then it never will be created, and nobody may wait for it."""
        self._came(rref_id)
        if rref_id in self.entries and rref_id not in self._awaited:
            return  # created after all: the function itself raised, its entry says so
        if len(self._failed) >= _FAILED_MAX:
            del self._failed[next(iter(self._failed))]
        self._failed[rref_id] = reason
        if (news := self._early.pop(rref_id, None)) is not None:  # about a value that never comes
            self._early_count -= len(news)
        if rref_id in self._awaited:
            self._give_up(rref_id, self.missing(rref_id))

    def missing(self, rref_id: RRefId) -> RuntimeError:
        """The error for a use of ``rref_id`` here that ``find`` has no entry for."""
        reason = self._failed.get(rref_id)
        if reason is not None:
            return RuntimeError(
                f"RRef {rref_id} was never created on {self.worker.name}: its remote() call "
                f"failed there ({reason})"
            )
        return RuntimeError(f"RRef {rref_id} is not (or no longer) owned by {self.worker.name}")

    def _came(self, rref_id: RRefId) -> None:
        """The remote() call of ``rref_id`` reached this owner (created or not)."""
        creator, number = rref_id
        if number > self._created_up_to.get(creator, 0):
            self._created_up_to[creator] = number

    def _give_up(self, rref_id: RRefId, error: BaseException) -> None:
        entry = self._awaited.pop(rref_id)
        if not entry.value.done():
            entry.value.set_exception(error)
            entry.value.exception()  # retrieved: it is the waiters' error
        if self.entries.get(rref_id) is entry:
            del self.entries[rref_id]

    def add_fork(self, rref_id: RRefId, fork: ForkId, holder: int | None = None) -> None:
        """Count the fork ``holder`` got (None: not known; it is then kept until that
        RRef releases it, even if its holder is lost)."""
        self._fork_news(rref_id, True, fork, holder)

    def del_fork(self, rref_id: RRefId, fork: ForkId) -> None:
        self._fork_news(rref_id, False, fork, None)

    def _fork_news(self, rref_id: RRefId, added: bool, fork: ForkId, holder: int | None) -> None:
        entry = self.entries.get(rref_id)
        if entry is None:
            if rref_id in self._failed:
                return  # never created here: nothing to count (kept, it would stay for good)
            while self._early_count >= _EARLY_MAX:  # the oldest go first
                self._early_count -= len(self._early.pop(next(iter(self._early))))
            self._early.setdefault(rref_id, []).append((added, fork, holder))
            self._early_count += 1
            return
        _count_fork(entry, added, fork, holder)
        self._maybe_free(rref_id, entry)

    def _on_lost(self, name: str, rank: int, reason: str) -> None:
        """A worker is gone, and so are the RRefs it held: drop their forks (values
        nobody else refers to are freed), as if each had been released."""
        for rref_id in [k for k in self._awaited if k[0] == rank]:  # its creations never come
            self._give_up(rref_id, WorkerLost(name, f"lost before RRef {rref_id} was created: {reason}"))
        for rref_id, entry in list(self.entries.items()):
            gone = [fork for fork, holder in entry.holders.items() if holder == rank]
            for fork in gone:
                entry.forks.discard(fork)
                del entry.holders[fork]
            if gone:
                self._maybe_free(rref_id, entry)
        for rref_id, news in list(self._early.items()):  # and forks it got before creation
            gone_forks = {fork for added, fork, holder in news if added and holder == rank}
            if gone_forks:
                kept = [n for n in news if n[1] not in gone_forks]
                self._early_count -= len(news) - len(kept)
                if kept:
                    self._early[rref_id] = kept
                else:
                    del self._early[rref_id]

    def _maybe_free(self, rref_id: RRefId, entry: _Entry) -> None:
        if not entry.forks and not entry.tombstones and not entry.creating:
            del self.entries[rref_id]

    def debug_info(self) -> dict[str, int]:
        return {
            "num_owner_rrefs": len(self.entries),
            "num_forks": sum(len(e.forks) for e in self.entries.values()),
        }


def owner_table(worker: Worker) -> OwnerTable:
    table = worker.extensions.get("rref")
    if table is None:
        table = worker.extensions["rref"] = OwnerTable(worker)
    assert isinstance(table, OwnerTable)
    return table


class RRef(Generic[T]):
    """A reference to a value owned by one worker of the group.

    ``RRef(value)`` wraps a local value (this worker is the owner). RRefs returned by
    :func:`actorgrad.remote` or received in arguments refer to values elsewhere.
    """

    def __init__(self, value: T) -> None:
        worker = get_worker()
        future: asyncio.Future[Any] = worker.loop.create_future()
        future.set_result(value)
        self._init(worker, worker.rank, owner_table(worker).new_id(), None, future)

    def _init(
        self, worker: Worker, owner: int, rref_id: RRefId, fork: ForkId | None,
        value: asyncio.Future[Any] | None,
    ) -> None:
        self._worker = worker
        self._owner = owner
        self._id = rref_id
        self._fork = fork
        self._value = value  # set on the owner only
        self._creation: asyncio.Future[Any] | None = None  # the remote() call that made it

    @classmethod
    def _make(cls, worker: Worker, owner: int, rref_id: RRefId, fork: ForkId | None,
              value: asyncio.Future[Any] | None) -> RRef[Any]:
        rref: RRef[Any] = cls.__new__(cls)
        rref._init(worker, owner, rref_id, fork, value)
        if fork is not None and owner != worker.rank:
            weakref.finalize(rref, _release_fork, weakref.ref(worker), owner, rref_id, fork)
        return rref

    # -- identity -------------------------------------------------------------------
    def owner(self) -> WorkerInfo:
        """The owner's :class:`WorkerInfo`."""
        return self._worker.resolve(self._owner)

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self.owner().name

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._owner == self._worker.rank

    def confirmed_by_owner(self) -> bool:
        """Whether the owner is known to keep the value for this RRef: always on the owner
        and for an RRef received from another worker (its sender registered it with the
        owner before sending it); for one made by ``remote()``, once creating the value
        succeeded there."""
        creation = self._creation
        return creation is None or (creation.done() and not creation.cancelled()
                                    and creation.exception() is None)

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(owner={self.owner_name()}, id={self._id})"

    # -- values ---------------------------------------------------------------------
    def local_value(self) -> T:
        """The value itself; only on the owner. Blocks a thread until creation ends."""
        if self._value is None:
            raise RuntimeError(
                f"local_value() called on {self.owner_name()}'s RRef from "
                f"{self._worker.name}; use `await rref.to_here()` on non-owners"
            )
        if not self._value.done():
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return await_threadsafe(self._worker.loop, self._value, None)
            raise RuntimeError("the RRef's value is still being created; `await rref.to_here()`")
        return self._value.result()

    async def to_here(self, timeout: float | None = None) -> T:
        """A copy of the value on this worker (inside an autograd context, recorded).

        Fails alike on the owner and elsewhere.

        Raises:
            RemoteError: the function creating the value raised.
            RpcTimeout: the value did not arrive within ``timeout`` (None:
                ``RpcOptions.rpc_timeout``; 0: no limit), or its creation timed out.
            WorkerLost: the owner, or the worker that asked for the value, is gone.
            ValueError: ``timeout`` is negative.
        """
        worker = self._live_worker()
        if self._value is not None:
            return await self._owner_value(self._value, timeout)
        self._check_not_given_up()
        src, reply = _api.send_request(worker, self._owner, "rref.fetch", (self._id,), timeout)
        try:
            payload = await reply
        finally:
            # a failed fetch's future holds the error, whose traceback holds this frame:
            # without this the cycle kept the RRef (and the owner's entry) until a gc
            del reply
        self._check_not_given_up()  # (it may have expired meanwhile)
        return _api.load_value(worker, payload, src)

    def _check_not_given_up(self) -> None:
        """Raise when the remote() call that makes the value was never sent (an RRef
        among its arguments whose owner is gone), or when this worker gave up on it (its
        timeout): the owner may still have made it (its loop busy, the cancel late), but
        it belongs to a call forgotten here (in an autograd context, its send is gone)."""
        creation = self._creation
        if creation is not None and getattr(creation, "never_sent", False):
            raise creation.exception()  # type: ignore[misc]  # (the owner never heard of it)
        if creation is not None and getattr(creation, "expired", False):
            error = creation.exception()
            raise RpcTimeout(f"the remote() call creating RRef {self._id} on {self.owner_name()} gave "
                             f"up: {error}") from error

    def to_here_sync(self, timeout: float | None = None) -> T:
        """Blocking :meth:`to_here` (torch's ``rref.to_here()``), for plain code: a
        remote function on the worker's thread pool, a script, a thread, Jupyter (see
        :func:`actorgrad.rpc_sync`)."""
        return _api.blocking_call(self._live_worker(), lambda: asyncio.ensure_future(self.to_here(timeout)), timeout)

    async def _owner_value(self, value: asyncio.Future[Any], timeout: float | None) -> T:
        """``to_here`` on the owner: fails as a fetch from any other worker would."""
        check_timeout(timeout)
        worker = self._worker
        if not value.done():
            limit = worker.options.rpc_timeout if timeout is None else timeout
            await asyncio.wait((value,), timeout=limit or None)  # leaves the value be
            if not value.done():
                raise RpcTimeout(
                    f"to_here() on {worker.name} timed out after {limit}s: "
                    "the RRef's value is still being created"
                )
        exc = value.exception()
        if exc is None:
            return value.result()
        if isinstance(exc, (RpcTimeout, WorkerLost)):
            raise exc  # a fetch from elsewhere passes these through too (Worker._remote_error)
        raise RemoteError(worker.name, *describe_error(exc)) from exc

    async def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run a backward pass from the value (a scalar tensor) as its root, as torch's
        ``RRef.backward``: with a distributed autograd context id, a distributed
        backward started on the owner (read the gradients with ``get_gradients``);
        with -1, a local backward, on the owner only."""
        if isinstance(dist_autograd_ctx_id, bool) or not isinstance(dist_autograd_ctx_id, numbers.Integral):
            raise TypeError(f"dist_autograd_ctx_id must be an int, got {type(dist_autograd_ctx_id).__name__}")
        if not isinstance(retain_graph, bool):
            raise TypeError(f"retain_graph must be True or False, got {retain_graph!r}")
        if dist_autograd_ctx_id == -1:
            if not self.is_owner():
                raise RuntimeError(
                    f"a local backward of {self!r} runs on its owner only; pass a distributed "
                    "autograd context id to start a distributed backward there"
                )
            value: Any = await self.to_here()
            _check_backward_root(self, value)
            value.backward(retain_graph=retain_graph)
            return
        if self.is_owner():
            await _backward_here(self, dist_autograd_ctx_id, retain_graph)
        else:
            done: Any = _api.rpc_async(self._owner, _backward_here, args=(self, dist_autograd_ctx_id, retain_graph))
            await done

    # -- proxies --------------------------------------------------------------------
    def rpc_async(self, timeout: float | None = None) -> Any:
        """``await rref.rpc_async().method(*args)`` runs ``value.method`` on the owner."""
        return _Proxy(self, _api.rpc_async, timeout)

    def rpc_sync(self, timeout: float | None = None) -> Any:
        """``rref.rpc_sync().method(*args)``: the blocking form of :meth:`rpc_async`."""
        return _Proxy(self, _api.rpc_sync, timeout)

    def remote(self, timeout: float | None = None) -> Any:
        """``rref.remote().method(*args)`` runs ``value.method`` on the owner and keeps
        its result there: an RRef to it, at once."""
        return _Proxy(self, _api.remote, timeout)

    def _live_worker(self) -> Worker:
        """The worker this RRef belongs to, refusing one that was shut down: ids start
        over in a group started after it, so the same id there names another value."""
        worker = self._worker
        if worker.closed:
            raise RuntimeError(
                f"this RRef (id {self._id}) belongs to {worker.name} of a group that was shut "
                "down; RRefs do not outlive their group"
            )
        return worker

    # -- pickling: every copy is a new fork -----------------------------------------
    def __copy__(self) -> RRef[T]:
        return self  # a reference to one value: a copy of it is the same reference

    def __deepcopy__(self, memo: dict[int, Any]) -> RRef[T]:
        return self

    def __reduce__(self) -> Any:
        worker = self._live_worker()
        self._check_not_given_up()  # (sent on, its value would reach the program after all)
        holder = _api.sending_to.get()  # where the pickled RRef goes
        if holder is None:
            # The owner must learn of every copy (a fork) and of the worker holding it;
            # bytes made by pickle, torch.save or an object collective go who knows
            # where, and as often as they are loaded. torch refuses them too.
            raise TypeError(
                f"{self!r} can only be pickled as part of an RPC (the arguments or result "
                "of rpc_async, rpc_sync or remote): send it with an RPC, not with pickle, "
                "torch.save or an object collective"
            )
        if self._owner != worker.rank and holder == self._owner:
            # To the owner itself (``rref.rpc_sync().method()``, an RRef argument of a
            # call to its owner): this RRef's own fork keeps the value alive until the
            # message arrives, since its release would travel after it on the same
            # connection, and the owner rebuilds an owner RRef. No new fork, no message.
            return (_rebuild, (self._owner, self._id, None))
        table = owner_table(worker)
        fork = table.new_id()
        owner, rref_id = self._owner, self._id
        if owner == worker.rank:
            assert self._value is not None
            table.entry_for(rref_id, self._value)
            table.add_fork(rref_id, fork, holder)
        else:
            worker.tell(owner, "rref.add_fork", Payload.dump((rref_id, fork, holder)))
        if (made := _api.forks_made.get()) is not None:  # to take back if it does not leave
            if owner == worker.rank:
                made.append((fork, lambda: table.del_fork(rref_id, fork)))
            else:
                made.append((fork, lambda: worker.tell(owner, "rref.del_fork", Payload.dump((rref_id, fork)))))
        return (_rebuild, (owner, rref_id, fork))


async def _backward_here(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    """RRef.backward on the owner (the autograd layer sits above this one)."""
    from ..autograd import backward

    root: Any = await rref.to_here()  # the value itself here, once created (as torch waits)
    _check_backward_root(rref, root)
    await backward(context_id, [root], retain_graph=retain_graph)


def _check_backward_root(rref: RRef[Any], value: Any) -> None:
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{rref!r}.backward() needs a tensor as its value, not a {type(value).__name__}")


def _rebuild(owner: int, rref_id: RRefId, fork: ForkId | None) -> RRef[Any]:
    worker = get_worker()
    if fork is not None and (rebuilt := _api.loading.forks) is not None:
        rebuilt.append(tuple(fork))  # (released from here on, even if the rest fails to load)
    if owner == worker.rank:
        table = owner_table(worker)
        entry = table.find(rref_id)
        if entry is None:
            raise table.missing(rref_id)
        value = entry.value
        if fork is not None:
            table.del_fork(rref_id, fork)
        return RRef._make(worker, owner, rref_id, None, value)
    if fork is None:
        raise RuntimeError(f"RRef {rref_id} was sent for its owner (rank {owner}) but arrived on {worker.name}")
    return RRef._make(worker, owner, rref_id, fork, None)


def _release_fork(worker_ref: weakref.ref[Worker], owner: int, rref_id: RRefId, fork: ForkId) -> None:
    worker = worker_ref()
    if worker is None or worker.closed or worker.loop.is_closed():
        return

    def send() -> None:
        if not worker.closed:
            with contextlib.suppress(Exception):  # the owner is gone: nothing left to free
                worker.tell(owner, "rref.del_fork", Payload.dump((rref_id, fork)))

    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        worker.loop.call_soon_threadsafe(send)


class _Proxy:
    def __init__(self, rref: RRef[Any], how: Any, timeout: float | None) -> None:
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, name: str) -> Any:
        def invoke(*args: Any, **kwargs: Any) -> Any:
            self._rref._check_not_given_up()  # as to_here
            return self._how(self._rref._owner, _call_method, args=(self._rref, name, args, kwargs),
                             timeout=self._timeout)
        return invoke


def _call_method(rref: RRef[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    value = rref._value
    if value is not None and not value.done():
        # a proxy call that came before the remote() creating the value: it waits on the
        # loop (returned, the coroutine is awaited there), not blocking a pool thread,
        # which the creating function may need (pool threads all waiting: nothing runs)
        return _call_method_once_created(rref, value, name, args, kwargs)
    return getattr(rref.local_value(), name)(*args, **kwargs)


async def _call_method_once_created(rref: RRef[Any], value: asyncio.Future[Any], name: str,
                                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    await asyncio.shield(value)  # (the value is the owner's: a caller's cancel must not cancel it)
    # as a remote function: an `async def` method on the loop, any other on the pool
    return await _api.run_user_function(rref._worker, getattr(value.result(), name), args, kwargs)


def create_remote(worker: Worker, to: PeerRef, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  timeout: float | None) -> RRef[Any]:
    table = owner_table(worker)
    rref_id = table.new_id()
    owner = worker.resolve(to).id
    value: asyncio.Future[Any] | None = None
    fork: ForkId | None = table.new_id()
    if owner == worker.rank:
        # This worker owns the result: the RRef holds the value future itself (no fork),
        # and the create handler below finds this entry and resolves it.
        value = worker.loop.create_future()
        # the create handler below resolves this entry's value: a fork of it released
        # meanwhile (or taken back) must not free the entry first
        table.entries[rref_id] = _Entry(value, creating=True)
        fork = None
    try:
        _, reply = _api.send_request(
            worker, owner, "rref.create", (rref_id, fork, func, args, kwargs), timeout, label_of=func
        )
    except BaseException:
        table.entries.pop(rref_id, None)  # never sent: nothing will resolve or free it
        raise
    if value is not None and reply.done() and not reply.cancelled() and reply.exception() is not None:
        table.entries.pop(rref_id, None)  # never sent (an argument's owner is gone): never created
        value.set_exception(reply.exception())  # type: ignore[arg-type]
        value.exception()  # (retrieved: its uses raise it; unused, it is no stray error)
    reply.add_done_callback(functools.partial(_created_or_not, worker, owner, rref_id))
    if getattr(reply, "never_sent", False):
        fork = None  # the owner never heard of it: nothing there to release
    rref = RRef._make(worker, owner, rref_id, fork, value)
    if owner != worker.rank:  # the owner keeps its own value (confirmed_by_owner)
        rref._creation = reply
    return rref


def _created_or_not(worker: Worker, owner: int, rref_id: RRefId, reply: asyncio.Future[Any]) -> None:
    """The remote() call answered; its failure surfaces on the RRef's next use. One the
    owner refused before reading which value it creates (arguments it cannot unpickle)
    never reached its table: tell it, so that nobody there waits for that value."""
    if reply.cancelled() or not isinstance(exc := reply.exception(), RemoteError):
        return
    reason = f"{exc.remote_type}: {exc.remote_message}"
    with contextlib.suppress(Exception):  # the owner is gone: nobody waits there either
        worker.tell(owner, "rref.not_created", Payload.dump((rref_id, reason[:500])))


def _creation_error(worker: Worker, peer: Any, rref_id: RRefId, exc: BaseException, func: Any) -> BaseException:
    """The error that uses of an RRef raise when creating its value ended with ``exc``.

    The create call's own cancellation must not be stored as it is: the owner's
    to_here would raise it into its caller as if that task was cancelled, and fetches
    would re-raise it as a cancellation of theirs.
    """
    task = asyncio.current_task()
    if not isinstance(exc, asyncio.CancelledError) or task is None or not task.cancelling():
        return exc  # the function's own error (a CancelledError it raised included)
    if worker.closed:
        return WorkerLost(worker.name, f"shut down before RRef {rref_id} was created")
    if not peer.can_send:
        return WorkerLost(
            peer.name or "?", f"left before RRef {rref_id} it asked {worker.name} for was created"
        )
    return RpcTimeout(
        f"creating RRef {rref_id} ({_api.function_name(func)}) on {worker.name} was abandoned: "
        f"the remote() call from {peer.name} timed out"
    )


def install_handlers(worker: Worker) -> None:
    table = owner_table(worker)
    from . import _hooks

    def create(peer: Any, payload: Payload) -> Any:
        rref_id, fork, func, args, kwargs, meta = _api.load_noting_forks(worker, peer.rank, payload)
        if worker.tracer.enabled:
            worker.serving_label = _api.function_name(func)
        hooks = _hooks.current()
        hooks.on_receive(worker, meta, payload, peer.rank)
        rref_id = tuple(rref_id)
        awaited = table.created(rref_id)
        entry = table.entries.get(rref_id)
        created_here = entry is not None and awaited is None  # remote() to oneself registered it
        if awaited is not None:  # asked for before it came: the askers wait on this entry
            entry = awaited
            entry.creating = False
            table.add_fork(rref_id, tuple(fork), peer.rank)
        elif entry is None:
            entry = table.entry_for(rref_id, worker.loop.create_future())
            table.add_fork(rref_id, tuple(fork), peer.rank)  # the caller holds it
        value = entry.value

        async def run() -> Payload:
            try:
                with hooks.scope(worker, meta):
                    result = await _api.run_user_function(worker, func, args, kwargs)
            except BaseException as exc:
                value.set_exception(_creation_error(worker, peer, rref_id, exc, func))
                value.exception()  # retrieved: the error surfaces on the RRef's next use
                if meta is not None:  # no value: no gradient for its arguments (see _serve_call)
                    hooks.forget(worker, meta, sent=False)
                raise
            finally:
                if created_here and table.entries.get(rref_id) is entry:
                    entry.creating = False
                    table._maybe_free(rref_id, entry)  # the local RRef holds the value
            value.set_result(result)
            return Payload.dump(None)

        return run()

    def fetch(peer: Any, payload: Payload) -> Any:
        rref_id, meta = payload.load()
        _hooks.current().on_receive(worker, meta, payload, peer.rank)
        entry = table.find(tuple(rref_id))
        if entry is None:
            raise table.missing(tuple(rref_id))

        async def reply() -> Payload:
            with _hooks.current().scope(worker, meta):
                value = await asyncio.shield(entry.value)
                return _api.dump_value(worker, value, peer.rank)

        return reply()

    def add_fork(peer: Any, payload: Payload) -> None:
        rref_id, fork, holder = payload.load()
        table.add_fork(tuple(rref_id), tuple(fork), holder if type(holder) is int else None)

    def del_fork(peer: Any, payload: Payload) -> None:
        rref_id, fork = payload.load()
        table.del_fork(tuple(rref_id), tuple(fork))

    worker.register("rref.create", create)
    worker.register("rref.fetch", fetch)

    def not_created(peer: Any, payload: Payload) -> None:
        rref_id, reason = payload.load()
        table.not_created(tuple(rref_id), str(reason))

    worker.register("rref.not_created", not_created, tell_only=True)
    worker.register("rref.add_fork", add_fork, tell_only=True)
    worker.register("rref.del_fork", del_fork, tell_only=True)
