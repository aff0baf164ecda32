"""actorgrad: an asyncio actor framework with a distributed backward engine for PyTorch."""

from __future__ import annotations

from . import autograd as autograd
from . import collective as collective
from . import optim as optim
from . import parallel as parallel
from . import rpc as _rpc
from ._api import export_trace as export_trace
from ._api import get_rank as get_rank
from ._api import get_worker_info as get_worker_info
from ._api import get_world_size as get_world_size
from ._api import init_rpc as init_rpc
from ._api import run as run
from ._api import shutdown as shutdown
from ._api import trace as trace
from ._api import worker_setup as _worker_setup
from ._errors import ActorgradError as ActorgradError
from ._errors import ActorgradInternalError as ActorgradInternalError
from ._errors import AuthenticationError as AuthenticationError
from ._errors import CollectiveError as CollectiveError
from ._errors import CollectiveRankLost as CollectiveRankLost
from ._errors import ContextError as ContextError
from ._errors import ProtocolError as ProtocolError
from ._errors import RemoteError as RemoteError
from ._errors import RpcTimeout as RpcTimeout
from ._errors import WorkerLost as WorkerLost
from .rpc import RRef as RRef
from .rpc import remote as remote
from .rpc import rpc_async as rpc_async
from .rpc import rpc_sync as rpc_sync
from .runtime import RpcOptions as RpcOptions
from .runtime import WorkerInfo as WorkerInfo

__version__ = "0.1.0"
dist_backward = autograd.backward

_worker_setup.append(_rpc.install_handlers)


async def local_group(world_size: int = 2, options: RpcOptions | None = None) -> object:
    """Start ``world_size - 1`` local worker processes and join this loop as ``worker0``.

    For notebooks and interactive use: ``group = await ag.local_group(2)`` ... then
    ``await group.shutdown()``.
    """
    from .testing import local_group as _local_group

    return await _local_group(world_size, options)


def rref_debug_info() -> dict[str, int]:
    """This worker's owner-side RRef table: ``num_owner_rrefs`` live values, ``num_forks``."""
    from .runtime import get_worker

    return _rpc.owner_table(get_worker()).debug_info()


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
    "shutdown",
    "trace",
)
