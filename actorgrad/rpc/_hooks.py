"""Extension points of the RPC layer, filled in by the autograd layer above it.

The RPC layer calls these around every message that carries user values, so that the
autograd layer can record send/recv pairs and run callees inside the caller's
distributed autograd context without the RPC layer knowing about autograd.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runtime import Worker
    from ..wire import Payload


class CallHooks:
    """Default hooks: no autograd recording."""

    def before_send(self, worker: Worker, dst: int, reply: bool = False) -> Any:
        """Metadata to embed in an outgoing payload (None when no context is active).

        ``reply``: the payload is a callee's result, not a call."""
        return None

    def after_send(self, worker: Worker, meta: Any, payload: Payload, dst: int) -> None:
        """The payload was pickled; ``payload.tensors`` are the tensors it carries."""

    def on_receive(self, worker: Worker, meta: Any, payload: Payload, src: int) -> None:
        """A payload was unpickled; ``payload.tensors`` are the rebuilt tensors."""

    def forget(self, worker: Worker, meta: Any, sent: bool) -> None:
        """The call recorded with ``meta`` failed on the callee: drop what was recorded
        for it here (the send, or on the callee the receive)."""

    def scope(self, worker: Worker, meta: Any) -> contextlib.AbstractContextManager[None]:
        """The environment a callee runs in (the caller's autograd context)."""
        return NO_SCOPE


NO_SCOPE = contextlib.nullcontext()  # a callee outside any context: nothing to enter


hooks = CallHooks()


def install(new_hooks: CallHooks) -> None:
    """Replace the hooks (done once by ``actorgrad.autograd`` at import)."""
    global hooks
    hooks = new_hooks


def current() -> CallHooks:
    return hooks
