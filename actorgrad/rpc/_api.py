"""rpc_async, rpc_sync and remote: calling functions on other workers."""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import contextvars
import functools
import inspect
import pickle
import threading
import time
import types
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch

from .._errors import RemoteError, WorkerLost
from ..runtime import PeerRef, Worker, get_worker, run_sync, start_threadsafe
from ..runtime._calls import check_timeout
from ..runtime._current import off_loop_error, on_loop
from ..runtime._torch_modes import InOwnModes, as_a_fresh_thread, fresh_modes
from ..wire import Payload
from ..wire._codec import forward_transform_active, sending_for_forward_transform
from . import _hooks
from ._inline import InlinePolicy
from ._purity import plain

_perf_counter = time.perf_counter
_is_grad_enabled = torch.is_grad_enabled

T = TypeVar("T")

if TYPE_CHECKING:
    from ._rref import RRef


_INLINE_MAX_BYTES = 1 << 16


def runs_inline(func: Callable[..., Any], tensors: list[torch.Tensor], nbytes: int | None = None) -> bool:
    """Whether ``func`` may run on the loop thread itself.

    Only torch and ``operator`` builtins (``torch.add``, ``operator.mul``...) applied to
    small tensors: they finish in microseconds, while a hop to the thread pool costs
    tens. Anything else may block or run long (``time.sleep``, a factory such as
    ``torch.randn(20000, 20000)``, a Python function) and goes to the pool.
    """
    if not isinstance(func, _BUILTIN_TYPES) or not tensors:
        return False
    module = getattr(func, "__module__", None) or getattr(getattr(func, "__self__", None), "__name__", "")
    if module not in _INLINE_MODULES:
        return False
    return (_nbytes(tensors) if nbytes is None else nbytes) <= _INLINE_MAX_BYTES


_BUILTIN_TYPES = (types.BuiltinFunctionType, types.BuiltinMethodType)
_INLINE_MODULES = frozenset({"torch", "torch._C._VariableFunctions", "_operator", "operator"})


async def run_user_function(
    worker: Worker, func: Callable[..., Any], args: Any, kwargs: Any, inline: bool = False,
    policy: InlinePolicy | None = None, nbytes: int = 0,
) -> Any:
    """Run a remote function: coroutine functions on the loop, others in the thread pool
    (or inline, when ``inline`` says so; ``policy`` learns which may be, by the
    function and ``nbytes``, the size of its tensor arguments)."""
    if inspect.iscoroutinefunction(func):
        value = await InOwnModes(func(*args, **kwargs))
    elif inline:
        value = _call_inline(policy, func, args, kwargs, nbytes)
    else:
        job: Callable[[], Any] = lambda: func(*args, **kwargs)  # noqa: E731
        if policy is not None and policy.learning(code := policy.key(func), nbytes):
            job = policy.timed(code, job, nbytes)  # type: ignore[arg-type]
        value = await worker.run_blocking(job)
    return await _resolved(value) if _pending(value) else value


_TorchFuture = torch._C.Future  # (then() and collect_all() make these, not torch.futures.Future)


def _pending(value: Any) -> bool:
    """Whether a remote function's return value stands for one still to come: an
    awaitable, or a torch future (torch's ``@rpc.functions.async_execution`` idiom)."""
    return isinstance(value, _TorchFuture) or inspect.isawaitable(value)


async def _resolved(value: Any) -> Any:
    if inspect.iscoroutine(value):
        value = await InOwnModes(value)
    elif inspect.isawaitable(value):
        value = await value
    if isinstance(value, _TorchFuture):
        value = await _torch_future_value(value)
    return value


def _torch_future_value(future: torch._C.Future[Any]) -> asyncio.Future[Any]:
    """An asyncio future of ``future``'s value; it may be completed on any thread."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[Any] = loop.create_future()

    def settle(done: torch._C.Future[Any]) -> None:
        if waiter.done():
            return
        try:
            waiter.set_result(done.value())
        except BaseException as exc:  # the future's own error, as torch raises it
            waiter.set_exception(exc)

    def completed(done: torch._C.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, done)

    future.add_done_callback(completed)
    return waiter


def _call_inline(
    policy: InlinePolicy | None, func: Callable[..., Any], args: Any, kwargs: Any, nbytes: int = 0
) -> Any:
    """Run ``func`` on the loop thread as a pool thread would run it: with torch's
    modes as a fresh thread has them (a coroutine suspended inside ``torch.no_grad()``
    or ``torch.autocast(...)`` leaves them set for the whole loop thread)."""
    if not fresh_modes():
        with as_a_fresh_thread():
            return _call_inline(policy, func, args, kwargs, nbytes)
    code = policy.key(func) if policy is not None else None
    if code is None:
        return func(*args, **kwargs)
    start = _perf_counter()
    try:
        return func(*args, **kwargs)
    finally:
        policy.inline_run(code, _perf_counter() - start, nbytes)  # type: ignore[union-attr]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# The rank a payload being pickled goes to, while send_request / dump_value pickle it
# (an RRef sent to its own owner needs no new fork, see RRef.__reduce__).
sending_to: contextvars.ContextVar[int | None] = contextvars.ContextVar("actorgrad_sending_to", default=None)


# What RRef.__reduce__ registered while a payload is pickled (a fork at the owner): each
# fork and the way to take it back, should the message not leave (or not be loaded).
TakeBack = tuple[Any, Callable[[], None]]
forks_made: contextvars.ContextVar[list[TakeBack] | None] = contextvars.ContextVar(
    "actorgrad_forks_made", default=None)


class _Loading(threading.local):
    forks: list[Any] | None = None  # forks the payload being loaded on this thread rebuilt


loading = _Loading()
# On the error of a call that could not be loaded: (caller's rank, its request id, the
# forks of the RRefs rebuilt before the failure)
FORKS_REBUILT = "actorgrad_forks_rebuilt"


def load_noting_forks(worker: Worker, caller: int, payload: Payload) -> Any:
    """Load the call ``payload`` that ``caller`` sent; should that fail, its error names
    the call and the forks of the RRefs rebuilt before (they release themselves): the
    caller takes back the others."""
    outer, loading.forks = loading.forks, []
    try:
        return payload.load()
    except Exception as exc:
        with contextlib.suppress(Exception):  # (an exception type that takes no attributes)
            setattr(exc, FORKS_REBUILT, (caller, worker.serving_request, list(loading.forks)))
        raise
    finally:
        loading.forks = outer


def _take_back_unloaded(worker: Worker, undo: list[TakeBack], reply: asyncio.Future[Any]) -> None:
    """This call could not be loaded by its callee: take back the forks it did not
    rebuild (not those of another call failing further on, passed on to us)."""
    if reply.cancelled() or not isinstance(exc := reply.exception(), RemoteError):
        return
    unloaded = getattr(exc.__cause__, FORKS_REBUILT, None)
    if isinstance(unloaded, tuple) and len(unloaded) == 3 \
            and unloaded[:2] == (worker.rank, getattr(reply, "request_id", None)):
        kept = {tuple(fork) for fork in unloaded[2]}
        _take_back([item for item in undo if item[0] not in kept])


@contextlib.contextmanager
def pickling_for(dst: int, undo: list[TakeBack] | None = None) -> Iterator[None]:
    """Within the block, what is pickled goes to rank ``dst``: RRefs may be pickled, and
    the forks they register go into ``undo`` (taken back at once when the block fails:
    an unpicklable argument beside an RRef)."""
    undo = [] if undo is None else undo
    token, forks_token = sending_to.set(dst), forks_made.set(undo)
    try:
        yield
    except BaseException:
        _take_back(undo)
        raise
    finally:
        sending_to.reset(token)
        forks_made.reset(forks_token)


def _dump_to(worker: Worker, dst: int, obj: Any, undo: list[TakeBack] | None = None,
             recording: bool = False) -> Payload:
    """Pickle ``obj`` for ``dst`` (see :func:`pickling_for`); ``recording``: an autograd
    context records it (see ``Payload.dump``)."""
    with pickling_for(dst, undo):
        return Payload.dump(obj, main_by_name=worker.same_program(dst), recording=recording)


def _take_back(undo: list[TakeBack]) -> None:
    for _, take_back in undo:
        with contextlib.suppress(Exception):  # best effort: an owner that is gone keeps nothing
            take_back()
    undo.clear()


def dump_value(worker: Worker, value: Any, dst: int) -> Payload:
    """Pickle a result (with autograd metadata) to send back to ``dst``."""
    hooks = _hooks.current()
    meta = hooks.before_send(worker, dst, reply=True)
    try:
        payload = _dump_to(worker, dst, (value, meta), recording=meta is not None)
    except (TypeError, AttributeError, pickle.PicklingError) as exc:
        # (the caller would read the function's own TypeError otherwise)
        raise TypeError(
            f"the result ({type(value).__name__}) could not be sent back: {type(exc).__name__}: {exc}"
        ) from exc
    hooks.after_send(worker, meta, payload, dst)
    return payload


def load_value(worker: Worker, payload: Payload, src: int) -> Any:
    """Unpickle a result produced by :func:`dump_value` on ``src``."""
    value, meta = payload.load()
    _hooks.current().on_receive(worker, meta, payload, src)
    return value


def _serve_call(worker: Worker, policy: InlinePolicy, peer: Any, payload: Payload) -> Any:
    func, args, kwargs, meta = load_noting_forks(worker, peer.rank, payload)
    if worker.tracer.enabled:
        worker.serving_label = function_name(func)
    hooks = _hooks.current()
    hooks.on_receive(worker, meta, payload, peer.rank)
    if meta is None:
        return _answer_call(worker, policy, peer, payload, func, args, kwargs, meta, hooks)
    # In an autograd context, a call that fails records no pair: the caller, told of
    # the failure, forgets its send too (see send_request)
    try:
        outcome = _answer_call(worker, policy, peer, payload, func, args, kwargs, meta, hooks)
    except BaseException:
        hooks.forget(worker, meta, sent=False)
        raise
    if isinstance(outcome, Payload):
        return outcome

    async def answered() -> Payload:
        try:
            return await outcome
        except BaseException:
            hooks.forget(worker, meta, sent=False)
            raise

    return answered()


def _answer_call(worker: Worker, policy: InlinePolicy, peer: Any, payload: Payload, func: Any, args: Any,
                 kwargs: Any, meta: Any, hooks: _hooks.CallHooks) -> Any:
    nbytes = _nbytes(payload.tensors)

    async def run() -> Payload:
        with hooks.scope(worker, meta):
            value = await run_user_function(worker, func, args, kwargs, inline, policy, nbytes)
            return dump_value(worker, value, peer.rank)

    # (coroutine functions are neither builtins nor ever learned: never inline here)
    inline = runs_inline(func, payload.tensors, nbytes) or (
        policy.runs_inline(policy.key(func), nbytes) and plain(args) and plain(kwargs))
    if inline:  # answer without a task
        with hooks.scope(worker, meta):
            value = _call_inline(policy, func, args, kwargs, nbytes)
            if not _pending(value):
                return dump_value(worker, value, peer.rank)

        async def finish() -> Payload:  # a function that returned an awaitable
            with hooks.scope(worker, meta):
                return dump_value(worker, await _resolved(value), peer.rank)

        return finish()

    return run()


def install_handlers(worker: Worker) -> None:
    policy = InlinePolicy(worker.options.inline_functions)
    worker.register("rpc.call", lambda peer, payload: _serve_call(worker, policy, peer, payload))


def send_request(
    worker: Worker, to: PeerRef, target: str, obj_without_meta: tuple[Any, ...], timeout: float | None,
    decode_value: bool = False, label_of: Any = None,
) -> tuple[int, asyncio.Future[Any]]:
    """Pickle ``(*obj, meta)``, record it for autograd, send it; returns (dst, future).

    The future resolves with the reply payload, or with the value the callee sent
    with :func:`dump_value` when ``decode_value`` is set. ``label_of``: the function
    the call runs, named in a trace."""
    dst = worker.resolve(to).id
    hooks = _hooks.current()
    meta = hooks.before_send(worker, dst)
    undo: list[TakeBack] = []
    try:
        payload = _dump_to(worker, dst, (*obj_without_meta, meta), undo, recording=meta is not None)
    except WorkerLost as lost:
        # an RRef among the arguments whose owner is gone (its fork cannot be registered
        # there): the call fails where it is awaited, as a call to a worker that is gone
        failed: asyncio.Future[Any] = worker.loop.create_future()
        failed.set_exception(lost)
        failed.never_sent = True  # type: ignore[attr-defined]  # (see RRef._check_not_given_up)
        return dst, failed
    decode = (lambda reply: load_value(worker, reply, dst)) if decode_value else None
    label = function_name(label_of) if worker.tracer.enabled and label_of is not None else None
    try:
        reply = worker.call(dst, target, payload, timeout, decode, label)
    except BaseException:
        _take_back(undo)  # never sent (too big for a frame, ...)
        raise
    if reply.done():  # failed at once, never sent: the peer is gone
        _take_back(undo)
        return dst, reply
    if label_of is not None:
        reply.runs = label_of  # type: ignore[attr-defined]  # (a CallFuture)
    # recorded once it left: a send that failed must not wait for gradients (the reply
    # cannot be handled before this returns, it comes through the loop)
    hooks.after_send(worker, meta, payload, dst)
    if meta is not None:  # a call that failed records no pair (see _serve_call)
        reply.add_done_callback(functools.partial(_forget_failed, worker, meta))
    if undo:  # RRefs in it: those the callee could not load are taken back
        reply.add_done_callback(functools.partial(_take_back_unloaded, worker, undo))
    return dst, reply


def function_name(func: Any) -> str:
    """How a trace names a remote function: module-qualified where it has one."""
    # (a builtin's qualname is its class's: torch.add is _VariableFunctionsClass.add)
    name = func.__name__ if isinstance(func, _BUILTIN_TYPES) else (
        getattr(func, "__qualname__", None) or type(func).__qualname__)
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module and module not in ("builtins", "__main__") else name


def _forget_failed(worker: Worker, meta: Any, reply: asyncio.Future[Any]) -> None:
    """A call whose result never came (it failed, timed out, was cancelled, its peer
    was lost) has no output here that a loss could use, so no gradient can come for
    its send: forget it. (The callee forgets its recv when the call fails or is called
    off there.)"""
    if reply.cancelled() or reply.exception() is not None:
        _hooks.current().forget(worker, meta, sent=True)


def call_arguments(what: str, args: Any, kwargs: Any, timeout: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` of a call as sent, refusing what they cannot be (a tensor
    or a string for ``args`` would be split into its elements), and the timeout."""
    if args is None:
        args = ()
    elif type(args) is not tuple and (isinstance(args, (torch.Tensor, str, bytes, dict))
                                     or not isinstance(args, collections.abc.Iterable)):
        # (a tensor or a string would be split into its elements)
        hint = " (one argument: args=(x,))" if isinstance(args, (torch.Tensor, str, bytes)) else ""
        raise TypeError(f"{what} args must be a tuple of arguments, got {type(args).__name__}{hint}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, collections.abc.Mapping) or not all(type(k) is str for k in kwargs):
        raise TypeError(f"{what} kwargs must be a dict of keyword arguments by name, got {kwargs!r:.80}")
    check_timeout(timeout)
    return tuple(args), dict(kwargs)


# What a remote function returns, as the caller receives it: an ``async def`` function's
# (or any awaitable's) value, and a torch future's value (the ``async_execution`` idiom),
# are awaited on the callee, so the caller gets ``T`` in every case (see the overloads).
@overload
def rpc_async(
    to: PeerRef,
    func: Callable[..., Awaitable[T]],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> asyncio.Future[T]: ...


@overload
def rpc_async(
    to: PeerRef,
    func: Callable[..., torch.futures.Future[T]],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> asyncio.Future[T]: ...


@overload
def rpc_async(
    to: PeerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> asyncio.Future[T]: ...


def rpc_async(
    to: PeerRef,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> asyncio.Future[Any]:
    """Call ``func(*args, **kwargs)`` on worker ``to``; the call is sent at once.

    Args:
        to: worker name, rank or WorkerInfo.
        func: any picklable callable (cloudpickle: lambdas and closures too); an
            ``async def`` function is awaited on the callee's loop, others run in the
            callee's thread pool.
        timeout: seconds; None uses ``RpcOptions.rpc_timeout``, 0 means no limit.

    Returns:
        A future with the result. Awaiting it raises RemoteError when ``func`` raised,
        RpcTimeout on timeout and WorkerLost when the callee died. Called from a
        thread while the worker's loop runs (a remote function that is not ``async``,
        as torch's idiom has it), a ``torch.futures.Future`` instead: ``.wait()``,
        ``.then()``, or return it to answer with its value.

    Raises:
        TypeError: ``func`` is not callable, ``args`` not a tuple (or list),
            ``kwargs`` not a dict by name, ``to`` not a name, rank or WorkerInfo.
        ValueError: ``to`` names no worker of the group; ``timeout`` is negative.
        RuntimeError: RPC is not initialized on this process.
    """
    if not callable(func):
        raise TypeError(f"rpc func must be callable, got {type(func).__name__}")
    worker = get_worker()
    args, kwargs = call_arguments("rpc", args, kwargs, timeout)

    def send() -> asyncio.Future[Any]:
        return send_request(worker, to, "rpc.call", (func, args, kwargs), timeout, True, func)[1]

    if on_loop(worker):
        return send()
    # (checked once, here; the loop only sends)
    started = start_threadsafe(worker.loop, _in_callers_grad_mode(send))
    if started is None:
        raise off_loop_error(worker, "rpc_async")
    return started  # (a torch.futures.Future)


@overload
def rpc_sync(
    to: PeerRef,
    func: Callable[..., Awaitable[T]],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> T: ...


@overload
def rpc_sync(
    to: PeerRef,
    func: Callable[..., torch.futures.Future[T]],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> T: ...


@overload
def rpc_sync(
    to: PeerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> T: ...


def rpc_sync(
    to: PeerRef,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> Any:
    """Blocking :func:`rpc_async`: works in plain scripts, in threads (a remote function
    calling another worker) and in Jupyter's running loop."""
    # (bad arguments first, wherever it runs; an iterator of arguments is read once)
    args, kwargs = call_arguments("rpc", args, kwargs, timeout)
    return blocking_call(get_worker(), lambda: rpc_async(to, func, args, kwargs, timeout), timeout)


def blocking_call(worker: Worker, start: Callable[[], Any], timeout: float | None) -> Any:
    """Run the call that ``start()`` makes (it returns its future) on the worker's loop,
    as this thread would make it, and block for its value (see ``run_sync``)."""
    return run_sync(worker, _in_callers_grad_mode(start), _answer_within(worker, timeout))


def _answer_within(worker: Worker, timeout: float | None) -> float | None:
    """The time limit of a call made with ``timeout`` (None: no limit)."""
    limit = worker.options.rpc_timeout if timeout is None else timeout
    return limit if isinstance(limit, (int, float)) and limit > 0 else None


def _in_callers_grad_mode(start: Callable[[], Any]) -> Callable[[], Any]:
    """``start`` as it would run in this thread: run_sync runs it on the loop thread,
    and grad mode (kept per thread by torch) decides whether the call is recorded in
    the autograd context, so a remote function's ``torch.no_grad()`` block counts."""
    grad = _is_grad_enabled()
    forward = forward_transform_active()  # (its tangents are invisible to the loop thread)

    def run() -> Any:
        token = sending_for_forward_transform.set(True) if forward else None
        try:
            if _is_grad_enabled() is grad:
                return start()
            with torch.set_grad_enabled(grad):
                return start()
        finally:
            if token is not None:
                sending_for_forward_transform.reset(token)

    return run


@overload
def remote(
    to: PeerRef,
    func: Callable[..., Awaitable[T]],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> RRef[T]: ...


@overload
def remote(
    to: PeerRef,
    func: Callable[..., torch.futures.Future[T]],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> RRef[T]: ...


@overload
def remote(
    to: PeerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> RRef[T]: ...


def remote(
    to: PeerRef,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> RRef[Any]:
    """Run ``func`` on ``to`` and keep the result there; returns an RRef at once.

    Creation continues in the background; its failure surfaces on the next use.
    """
    from ._rref import create_remote

    if not callable(func):
        raise TypeError(f"remote func must be callable, got {type(func).__name__}")
    args, kwargs = call_arguments("remote", args, kwargs, timeout)
    worker = get_worker()
    if not on_loop(worker):
        return blocking_call(
            worker, lambda: _as_future(worker, create_remote(worker, to, func, args, kwargs, timeout)), timeout)
    return create_remote(worker, to, func, args, kwargs, timeout)


def _as_future(worker: Worker, value: Any) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = worker.loop.create_future()
    fut.set_result(value)
    return fut


__all__ = ["remote", "rpc_async", "rpc_sync", "run_user_function", "threading"]
