"""The whole exception tree of actorgrad.

Every class says who raises it and what the caller should do about it.
"""

from __future__ import annotations


class ActorgradError(RuntimeError):
    """Base class of every error actorgrad raises on purpose.

    A RuntimeError, as torch.distributed's errors are (and torch RPC's timeouts and
    failures), so code ported from torch that catches RuntimeError catches these too.
    """


class ProtocolError(ActorgradError):
    """Bytes on a connection broke the wire protocol.

    Raised by the sans-IO decoder for malformed, oversized or unexpected frames.
    The transport drops the offending connection; the worker keeps serving others.
    """


class AuthenticationError(ActorgradError):
    """The connection handshake failed: a wrong or missing ``auth_key``.

    Give every worker of the group the same ``RpcOptions(auth_key=...)`` (``actorgrad
    launch`` hands one to its ranks through ``ACTORGRAD_AUTH_KEY``).
    """


class RemoteError(ActorgradError):
    """The function called on another worker raised.

    ``remote_type`` names the exception type, ``remote_traceback`` is the formatted
    traceback on the callee, and ``__cause__`` is the exception itself when it could
    be rebuilt on this side.
    """

    def __init__(self, worker: str, remote_type: str, message: str, remote_traceback: str = ""):
        self.worker = worker
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        super().__init__(f"{remote_type} on {worker}: {message}")

    def __reduce__(self) -> tuple[object, ...]:
        # the cause and the notes travel too: a worker that passes on the RemoteError of
        # its own call gives its caller the original error (see Worker._remote_error)
        state = dict(self.__dict__)
        if self.__cause__ is not None:
            state["__cause__"] = self.__cause__
        return (
            type(self),
            (self.worker, self.remote_type, self.remote_message, self.remote_traceback),
            state,
        )

    def __str__(self) -> str:
        text = f"{self.remote_type} on {self.worker}: {self.remote_message}"
        if self.remote_traceback:
            text += "\n\nRemote traceback:\n" + self.remote_traceback.rstrip()
        return text


class RpcTimeout(ActorgradError, TimeoutError):
    """A call did not complete within its timeout.

    The callee is told it may drop the work. Raise ``timeout=`` (``0`` means no limit)
    or ``RpcOptions(rpc_timeout=...)`` if the work is legitimately slow.
    """


class RendezvousTimeout(ActorgradError, TimeoutError):
    """The group did not form within ``RpcOptions.init_timeout``; the message names the
    ranks that did not arrive (or connect)."""


class WorkerLost(ActorgradError, ConnectionError):
    """The peer died or its connection broke; raised for every call outstanding to it."""

    def __init__(self, worker: str, reason: str = "connection lost"):
        self.worker = worker
        self.reason = reason
        super().__init__(f"worker {worker!r} is lost: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.worker, self.reason))


class ContextError(ActorgradError):
    """Misuse of a distributed autograd context: unknown or released id, a backward
    that cannot complete (for example an unused RPC in FAST mode)."""


class CollectiveError(ActorgradError):
    """A collective or point-to-point operation failed: mismatched ranks, shapes or
    dtypes across workers, or a participant that is gone."""


class CollectiveRankLost(CollectiveError, WorkerLost):
    """A collective or point-to-point operation failed because a participating rank is
    gone. Catch it as CollectiveError or as WorkerLost."""

    def __init__(self, message: str, worker: str = "?", reason: str = ""):
        WorkerLost.__init__(self, worker, reason or message)
        self.message = message
        Exception.__init__(self, message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.worker, self.reason))

    def __str__(self) -> str:
        return self.message


class ActorgradInternalError(ActorgradError):
    """A bug in actorgrad itself; please report it with the traceback."""


for _cls in (
    ActorgradError,
    ProtocolError,
    AuthenticationError,
    RemoteError,
    RpcTimeout,
    RendezvousTimeout,
    WorkerLost,
    ContextError,
    CollectiveError,
    CollectiveRankLost,
    ActorgradInternalError,
):
    _cls.__module__ = "actorgrad"


def error_name(exc: BaseException) -> str:
    """``exc``'s type: its name for a builtin, module-qualified otherwise."""
    kind = type(exc)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def error_message(exc: BaseException) -> str:
    """``str(exc)``, which never raises: a user's exception may break ``str()``."""
    try:
        return str(exc)
    except Exception as str_exc:
        return f"<str() of the exception failed: {type(str_exc).__name__}>"


def error_line(exc: BaseException) -> str:
    """``exc`` in one line: ``Name: message`` (``Name`` where it has no message)."""
    message = error_message(exc)
    return f"{error_name(exc)}: {message}" if message else error_name(exc)
