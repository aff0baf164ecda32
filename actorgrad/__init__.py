"""actorgrad: an asyncio actor framework with a distributed backward engine for PyTorch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are; at run time they load on first use
    from . import autograd as autograd
    from . import collective as collective
    from . import optim as optim
    from . import parallel as parallel
    from . import rpc as rpc
    from . import runtime as runtime
    from . import wire as wire
    from ._api import export_trace as export_trace
    from ._api import get_rank as get_rank
    from ._api import get_worker_info as get_worker_info
    from ._api import get_world_size as get_world_size
    from ._api import init_rpc as init_rpc
    from ._api import run as run
    from ._api import run_sync as run_sync
    from ._api import shutdown as shutdown
    from ._api import trace as trace
    from ._errors import ActorgradError as ActorgradError
    from ._errors import ActorgradInternalError as ActorgradInternalError
    from ._errors import AuthenticationError as AuthenticationError
    from ._errors import CollectiveError as CollectiveError
    from ._errors import CollectiveRankLost as CollectiveRankLost
    from ._errors import ContextError as ContextError
    from ._errors import ProtocolError as ProtocolError
    from ._errors import RemoteError as RemoteError
    from ._errors import RendezvousTimeout as RendezvousTimeout
    from ._errors import RpcTimeout as RpcTimeout
    from ._errors import WorkerLost as WorkerLost
    from .autograd import backward as dist_backward
    from .rpc import RRef as RRef
    from .rpc import remote as remote
    from .rpc import rpc_async as rpc_async
    from .rpc import rpc_sync as rpc_sync
    from .runtime import RpcOptions as RpcOptions
    from .runtime import WorkerInfo as WorkerInfo
    from .testing import LocalGroup

__version__ = "0.1.0"

# The public names and where they live. They are imported on first use, so a program
# that needs none of them (the ``actorgrad launch`` command) starts without loading
# torch; init_rpc loads every layer before it starts a worker (see _api.load_layers).
_LAZY: dict[str, tuple[str, str | None]] = {
    **{name: (f".{name}", None) for name in (
        "autograd", "collective", "optim", "parallel", "rpc", "runtime", "wire")},
    **{name: ("._api", name) for name in (
        "export_trace", "get_rank", "get_worker_info", "get_world_size", "init_rpc", "run",
        "run_sync", "shutdown", "trace")},
    **{name: ("._errors", name) for name in (
        "ActorgradError", "ActorgradInternalError", "AuthenticationError", "CollectiveError",
        "CollectiveRankLost", "ContextError", "ProtocolError", "RemoteError", "RendezvousTimeout",
        "RpcTimeout", "WorkerLost")},
    **{name: (".rpc", name) for name in ("RRef", "remote", "rpc_async", "rpc_sync")},
    **{name: (".runtime", name) for name in ("RpcOptions", "WorkerInfo")},
    "dist_backward": (".autograd", "backward"),
}


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'actorgrad' has no attribute {name!r}") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    # the public names and the module's own dunders, not what this file imports
    return sorted({*__all__, *_LAZY, *(name for name in globals() if name.startswith("__"))})


async def local_group(world_size: int = 2, options: RpcOptions | None = None, *,
                      echo: bool = True) -> LocalGroup:
    """Start ``world_size - 1`` local worker processes and join this loop as ``worker0``.

    For notebooks and interactive use: ``group = await ag.local_group(2)`` ... then
    ``await group.shutdown()``. With ``echo``, what the workers print shows here (in
    the cell), each line prefixed ``[workerN]``.
    """
    from .testing import local_group as _local_group

    return await _local_group(world_size, options, echo=echo)


def rref_debug_info() -> dict[str, int]:
    """This worker's owner-side RRef table: ``num_owner_rrefs`` live values, ``num_forks``."""
    from .rpc import owner_table
    from .runtime import get_worker

    return owner_table(get_worker()).debug_info()


__all__ = (
    "ActorgradError",
    "ActorgradInternalError",
    "AuthenticationError",
    "CollectiveError",
    "CollectiveRankLost",
    "ContextError",
    "ProtocolError",
    "RRef",
    "RemoteError",
    "RendezvousTimeout",
    "RpcOptions",
    "RpcTimeout",
    "WorkerInfo",
    "WorkerLost",
    "autograd",
    "collective",
    "dist_backward",
    "export_trace",
    "optim",
    "parallel",
    "get_rank",
    "get_world_size",
    "get_worker_info",
    "init_rpc",
    "local_group",
    "remote",
    "rpc_async",
    "rpc_sync",
    "rref_debug_info",
    "run",
    "run_sync",
    "shutdown",
    "trace",
)
