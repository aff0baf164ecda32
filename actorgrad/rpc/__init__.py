"""RPC: calling functions on other workers, and remote references."""

from __future__ import annotations

from ._api import remote as remote
from ._api import rpc_async as rpc_async
from ._api import rpc_sync as rpc_sync
from ._hooks import NO_SCOPE as NO_SCOPE
from ._hooks import CallHooks as CallHooks
from ._hooks import install as install_hooks
from ._rref import RRef as RRef
from ._rref import owner_table as owner_table

__all__ = ("NO_SCOPE", "CallHooks", "RRef", "install_handlers", "install_hooks", "owner_table", "remote",
           "rpc_async", "rpc_sync")


def install_handlers(worker: object) -> None:
    """Register the RPC and RRef handlers on a new worker."""
    from . import _api, _rref

    _api.install_handlers(worker)  # type: ignore[arg-type]
    _rref.install_handlers(worker)  # type: ignore[arg-type]
