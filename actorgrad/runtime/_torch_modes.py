"""torch's per-thread modes as a fresh thread has them, for work run on the loop.

Grad mode, inference mode, autocast and the stacks of torch function and dispatch
modes (``with torch.device("meta")``, ``FakeTensorMode``) are per thread in torch. A
coroutine on a worker's event loop that waits inside one of them leaves it set on the
loop thread for as long as it waits. What the loop runs for others meanwhile (receiving
a message, a builtin called inline, a small backward job) must see what a pool thread
sees: grad on, inference mode off, no autocast, no modes (``as_a_fresh_thread``). A
remote ``async def`` function is such work too, but one that may change modes itself
and keep them across an ``await``: ``InOwnModes`` gives each step of it the grad,
inference, autocast and mode stacks it left at its previous step (fresh at the first),
and gives the loop back the modes it had.
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Generator, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _pop_mode as _pop_dispatch_mode
from torch.utils._python_dispatch import _push_mode as _push_dispatch_mode

_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_is_any_autocast_enabled = torch._C._is_any_autocast_enabled
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_AUTOCAST_DEVICES = tuple(torch._C._autocast_supported_devices())

# grad enabled, inference mode, (device, dtype) of each autocast on, the torch function
# modes and the dispatch modes (each stack bottom first)
Modes = tuple[bool, bool, tuple[tuple[str, torch.dtype], ...], tuple[Any, ...], tuple[Any, ...]]
_FRESH: Modes = (True, False, (), (), ())


def fresh_modes() -> bool:
    """Whether this thread's torch modes are those of a fresh thread (five C calls)."""
    return (_is_grad_enabled() and not _is_inference_mode_enabled() and not _is_any_autocast_enabled()
            and not _function_modes() and not _dispatch_modes())


def _autocasts() -> tuple[tuple[str, torch.dtype], ...]:
    if not _is_any_autocast_enabled():
        return ()
    on = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                on.append((device, torch.get_autocast_dtype(device)))
        except RuntimeError:  # a device type this torch's autocast does not know (renamed)
            continue
    return tuple(on)


def _modes() -> Modes:
    functions, dispatches = _function_modes(), _dispatch_modes()
    return (
        _is_grad_enabled(), _is_inference_mode_enabled(), _autocasts(),
        tuple(torch._C._get_function_stack_at(i) for i in range(functions)) if functions else (),
        tuple(torch._C._get_dispatch_stack_at(i) for i in range(dispatches)) if dispatches else (),
    )


def _same(stack: tuple[Any, ...], other: tuple[Any, ...]) -> bool:
    return len(stack) == len(other) and all(a is b for a, b in zip(stack, other, strict=True))


def _set_stack(wanted: tuple[Any, ...], depth: Any, pop: Any, push: Any) -> None:
    """The mode stack that ``depth``/``pop``/``push`` reach holds ``wanted`` from now on."""
    if _same(wanted, tuple(_stack_now(depth))):
        return
    for _ in range(depth()):
        pop()
    for mode in wanted:
        push(mode)


def _stack_now(depth: Any) -> list[Any]:
    at = torch._C._get_function_stack_at if depth is _function_modes else torch._C._get_dispatch_stack_at
    return [at(i) for i in range(depth())]


def _swap_stack(stack: contextlib.ExitStack, wanted: tuple[Any, ...], depth: Any, pop: Any, push: Any) -> None:
    """Within ``stack``: the mode stack that ``depth``/``pop``/``push`` reach holds
    ``wanted``; whatever it holds at the exit is replaced by what it held before."""
    held = tuple(_stack_now(depth))
    _set_stack(wanted, depth, pop, push)
    stack.callback(_set_stack, held, depth, pop, push)


@contextlib.contextmanager
def _in_modes(modes: Modes) -> Iterator[None]:
    """Within: this thread's torch modes are ``modes``; restored after."""
    grad, inference, autocasts, functions, dispatches = modes
    with contextlib.ExitStack() as stack:
        _swap_stack(stack, functions, _function_modes, torch._C._pop_torch_function_stack,
                    torch._C._push_on_torch_function_stack)
        _swap_stack(stack, dispatches, _dispatch_modes, _pop_dispatch_mode, _push_dispatch_mode)
        if _is_inference_mode_enabled() != inference:
            stack.enter_context(torch.inference_mode(inference))
        if _is_grad_enabled() != grad:
            stack.enter_context(torch.set_grad_enabled(grad))
        now, wanted = dict(_autocasts()), dict(autocasts)
        for device in now.keys() | wanted.keys():
            if now.get(device) != wanted.get(device):
                dtype = wanted.get(device)
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=dtype is not None))
        yield


def as_a_fresh_thread() -> contextlib.AbstractContextManager[None]:
    """Within: this thread's torch modes as a fresh thread has them; restored after."""
    return _in_modes(_FRESH)


class InOwnModes:
    """``await InOwnModes(coro)``: ``coro`` awaited with its own torch modes at every
    step (see the module docstring), and the loop's given back after each: what a
    step leaves set (a ``torch.no_grad()`` it waits in) is the coroutine's, not the
    next task's. Cheap when nobody changed any: a few C calls a step."""

    __slots__ = ("_coro", "_modes", "_held")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self._modes = _FRESH
        # Inference mode has no setter, only a guard that restores all it saw when it
        # goes: one made to give the loop back its modes, kept until the next step
        self._held: Any = None

    def __await__(self) -> Generator[Any, None, Any]:
        return self  # (a generator by its methods)

    def __iter__(self) -> InOwnModes:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        return self._step(self._coro.send, value)

    def throw(self, *exc: Any) -> Any:
        return self._step(self._coro.throw, *exc)

    def close(self) -> None:
        self._held = None
        self._coro.close()

    def _step(self, step: Any, *args: Any) -> Any:
        if self._modes is _FRESH and self._held is None and fresh_modes():
            try:  # the common case: nobody set anything
                return step(*args)
            finally:
                if not fresh_modes():
                    self._modes = _modes()
                    _give_back(self, _FRESH)
        loop_modes = _modes()
        self._held = None  # (undoes what the last give-back did to inference mode)
        try:
            with _in_modes(self._modes):
                try:
                    return step(*args)
                finally:
                    self._modes = _modes()
        finally:
            _give_back(self, loop_modes)


def _give_back(coroutine: InOwnModes, loop_modes: Modes) -> None:
    """After a step of ``coroutine``: this thread's modes are the loop's again, set by
    value (whatever the step left open: a ``torch.no_grad()`` it waits in)."""
    if _modes() == loop_modes:
        return
    grad, inference, autocasts, functions, dispatches = loop_modes
    if _is_inference_mode_enabled() != inference:
        # inference mode has no setter, only a guard that restores all it saw when it
        # goes: kept until the coroutine's next step
        coroutine._held = torch._C._InferenceMode(inference)
    _set_stack(functions, _function_modes, torch._C._pop_torch_function_stack,
               torch._C._push_on_torch_function_stack)
    _set_stack(dispatches, _dispatch_modes, _pop_dispatch_mode, _push_dispatch_mode)
    torch._C._set_grad_enabled(grad)
    now, wanted = dict(_autocasts()), dict(autocasts)
    for device in now.keys() | wanted.keys():
        if now.get(device) != wanted.get(device):
            torch.set_autocast_enabled(device, device in wanted)
            if device in wanted:
                torch.set_autocast_dtype(device, wanted[device])
