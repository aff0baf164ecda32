"""Worker runtime: event loop, connections, dispatch, rendezvous, shutdown."""

from __future__ import annotations

from ._current import get_worker as get_worker
from ._current import maybe_worker as maybe_worker
from ._options import RpcOptions as RpcOptions
from ._options import WorkerInfo as WorkerInfo
from ._sync import await_threadsafe as await_threadsafe
from ._sync import run_sync as run_sync
from ._sync import start_threadsafe as start_threadsafe
from ._transport import PeerProtocol as PeerProtocol
from ._worker import PeerRef as PeerRef
from ._worker import Worker as Worker
from ._worker import error_payload as error_payload
