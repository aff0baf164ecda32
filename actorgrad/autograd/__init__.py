"""Distributed autograd: contexts, send/recv recording and the distributed backward."""

from __future__ import annotations

from .._api import worker_setup as _worker_setup
from ..rpc import install_hooks as _install_hooks
from ..runtime import Worker as _Worker
from ._context import ContextActor as ContextActor
from ._context import context as context
from ._context import context_actor as _context_actor
from ._context import current_context_id as current_context_id
from ._context import debug_info as debug_info
from ._context import get_gradients as get_gradients
from ._engine import EngineActor as EngineActor
from ._engine import backward as backward
from ._inspect import DistGraph as DistGraph
from ._inspect import graph as graph
from ._inspect import install as _install_inspect
from ._loans import RETURN_TARGET as _LOANS_RETURNED
from ._messages import DESCRIBE as _DESCRIBE
from ._messages import PropagateGrads as _PropagateGrads
from ._messages import ReleaseContext as _ReleaseContext
from ._messages import ShareHeld as _ShareHeld
from ._messages import Traverse as _Traverse


class _Hooks(ContextActor):
    """Routes the RPC layer's hooks to the ContextActor of the worker at hand."""

    def __init__(self) -> None:
        pass

    def before_send(self, worker, dst, reply=False):
        return _context_actor(worker).before_send(worker, dst, reply)

    def after_send(self, worker, meta, payload, dst):
        if meta is not None:
            _context_actor(worker).after_send(worker, meta, payload, dst)

    def on_receive(self, worker, meta, payload, src):
        if meta is not None:
            _context_actor(worker).on_receive(worker, meta, payload, src)

    def forget(self, worker, meta, sent):
        _context_actor(worker).forget(worker, meta, sent)

    def scope(self, worker, meta):
        return _context_actor(worker).scope(worker, meta)


def _setup(worker: _Worker) -> None:
    contexts = ContextActor(worker)
    engine = EngineActor(worker, contexts)
    worker.extensions["autograd.context"] = contexts
    worker.extensions["autograd.engine"] = engine
    worker.register(_PropagateGrads.TARGET, engine.on_propagate)
    worker.register(_PropagateGrads.DELEGATED, engine.on_delegated_propagate, tell_only=True)
    worker.register(_ReleaseContext.TARGET, contexts.on_release, tell_only=True)
    worker.register(_ShareHeld.TARGET, contexts.on_share_held, tell_only=True)
    worker.register(_DESCRIBE, contexts.on_describe)
    worker.add_lost_listener(contexts.on_worker_lost)
    worker.register(_LOANS_RETURNED, engine.loans.on_returned, tell_only=True)
    worker.add_lost_listener(engine.loans.on_worker_lost)
    worker.register(_Traverse.TARGET, engine.on_traverse)
    _install_inspect(worker)


_install_hooks(_Hooks())
_worker_setup.append(_setup)

__all__ = (
    "ContextActor",
    "DistGraph",
    "EngineActor",
    "backward",
    "context",
    "current_context_id",
    "debug_info",
    "get_gradients",
    "graph",
)
