"""Point-to-point and collective communication: ``torch.distributed``'s API as coroutines.

```python
import actorgrad.collective as C

t = torch.ones(4) * ag.get_rank()
await C.all_reduce(t)                       # in place, like torch.distributed
group = C.new_group([0, 1])                 # every worker calls it
await C.broadcast(t, src=1, group=group)    # src/dst are global ranks
work = C.isend(t, dst=1); await work        # Work: awaitable, .wait(), .is_completed()
```

The default backend is actorgrad's own: messages over the worker's connections, keyed
by (group, sequence number) so concurrent collectives never mix; a direct exchange for
small all-reduces and a chunked, pipelined ring for large ones; between workers on one
machine, large data is read straight from the sender's memory (``process_vm_readv``).
Every rank validates every other rank's shapes, dtypes and arguments, so a mismatch
raises ``CollectiveError`` on all of them; a lost rank or the deadline
(``RpcOptions.rpc_timeout``) fails the operations that wait on it.

``await C.init_process_group(backend="gloo")`` runs the same API on a torch.distributed
process group built from the same rendezvous (``"nccl"`` for CUDA tensors).
"""

from __future__ import annotations

from .._api import worker_setup as _worker_setup
from .._errors import CollectiveError as CollectiveError
from ._actor import CollectiveActor as CollectiveActor
from ._actor import setup as _setup
from ._api import all_gather as all_gather
from ._api import all_gather_object as all_gather_object
from ._api import all_reduce as all_reduce
from ._api import barrier as barrier
from ._api import broadcast as broadcast
from ._api import broadcast_object_list as broadcast_object_list
from ._api import destroy_process_group as destroy_process_group
from ._api import gather as gather
from ._api import get_backend as get_backend
from ._api import get_global_rank as get_global_rank
from ._api import get_group_rank as get_group_rank
from ._api import get_rank as get_rank
from ._api import get_world_size as get_world_size
from ._api import init_process_group as init_process_group
from ._api import irecv as irecv
from ._api import is_initialized as is_initialized
from ._api import isend as isend
from ._api import new_group as new_group
from ._api import recv as recv
from ._api import reduce as reduce
from ._api import scatter as scatter
from ._api import send as send
from ._types import Group as Group
from ._types import ReduceOp as ReduceOp
from ._types import Work as Work

if _setup not in _worker_setup:
    _worker_setup.append(_setup)

__all__ = (
    "CollectiveActor",
    "CollectiveError",
    "Group",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "scatter",
    "send",
)
