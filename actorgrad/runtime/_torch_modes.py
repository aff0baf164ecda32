"""torch's per-thread modes as a fresh thread has them, for work run on the loop.

Grad mode, inference mode and autocast are per thread in torch. A coroutine on a
worker's event loop that waits inside ``torch.no_grad()``, ``torch.inference_mode()``
or ``torch.autocast(...)`` leaves them set on the loop thread for as long as it waits.
What the loop runs for others meanwhile (a builtin called inline, a small backward
job) must see what a pool thread sees: grad on, inference mode off, no autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_is_any_autocast_enabled = torch._C._is_any_autocast_enabled
# every device type torch's autocast may know; those this torch does not are skipped
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu", "privateuseone")


def fresh_modes() -> bool:
    """Whether this thread's torch modes are those of a fresh thread (three C calls)."""
    return _is_grad_enabled() and not _is_inference_mode_enabled() and not _is_any_autocast_enabled()


@contextlib.contextmanager
def as_a_fresh_thread() -> Iterator[None]:
    """Within: this thread's torch modes as a fresh thread has them; restored after."""
    with contextlib.ExitStack() as stack:
        if _is_inference_mode_enabled():
            stack.enter_context(torch.inference_mode(False))
        if not _is_grad_enabled():
            stack.enter_context(torch.enable_grad())
        if _is_any_autocast_enabled():
            for device in _AUTOCAST_DEVICES:
                try:
                    enabled = torch.is_autocast_enabled(device)
                except RuntimeError:  # a device type this torch's autocast does not know
                    continue
                if enabled:
                    stack.enter_context(torch.autocast(device, enabled=False))
        yield
