"""Which Python functions may ever run on the event loop: those that cannot block.

Running a remote function inline saves the hop to the thread pool, but a function that
blocks there (waits on a queue for an item a later call brings, calls ``rpc_sync``,
sleeps) stalls the loop: no heartbeats, no other calls, the deadlock it waits on never
resolves. Timing its runs cannot tell: a function quick a thousand times may block on
the next. So a function is learned (``_inline``) only when its code can do nothing but
compute: this module reads its bytecode once.

# The rule
- No closure, no nested code (lambdas, comprehensions), no imports, no global writes.
- Every global it reads resolves, now, to one of: a module of ``SAFE_MODULES``
  (attributes read off it must lead to a C builtin, a function of
  ``torch.nn.functional``, another safe module, or a plain value such as a dtype), a
  Python builtin of ``SAFE_BUILTINS``, a C builtin of ``torch``, ``math`` or
  ``operator``, a tensor, or a plain value.
- At each call, its arguments are plain data (tensors, numbers, strings, None, and
  tuples, lists and dicts of them): methods called on them are then tensor methods.

Anything else may reach code that blocks, and runs on the pool, as torch runs every
remote Python function.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import types
from typing import Any

import torch

SAFE_MODULES = frozenset({"torch", "torch.nn.functional", "math", "operator", "_operator", "cmath"})
SAFE_BUILTINS = frozenset(
    getattr(builtins, name) for name in (
        "abs", "all", "any", "bool", "complex", "divmod", "enumerate", "float", "int", "isinstance",
        "len", "list", "max", "min", "pow", "range", "reversed", "round", "slice", "sorted", "sum",
        "tuple", "dict", "zip", "ValueError", "TypeError", "RuntimeError",
    )
)
_C_MODULES = frozenset({"torch", "torch._C._VariableFunctions", "torch._C._nn", "math", "operator", "_operator"})
# exact types: a subclass of int or str may override methods with any code
_PLAIN = frozenset({int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.Size, torch.device,
                    torch.Tensor, torch.nn.Parameter})
_SAFE_TYPES = frozenset({torch.Tensor, torch.Size, torch.dtype})
_BUILTIN_TYPES = (types.BuiltinFunctionType, types.BuiltinMethodType)
_FORBIDDEN_OPS = frozenset({"IMPORT_NAME", "IMPORT_FROM", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_DEREF",
                            "LOAD_CLASSDEREF", "LOAD_CLOSURE", "MAKE_FUNCTION", "YIELD_VALUE"})
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_SUSPENDING = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_MISSING = object()


def _safe_value(obj: Any) -> bool:
    """Whether reading (and calling) ``obj``, found as a global or off a safe module,
    cannot reach code that blocks."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__ in SAFE_MODULES
    if isinstance(obj, _BUILTIN_TYPES):
        owner = getattr(obj, "__module__", None) or getattr(getattr(obj, "__self__", None), "__name__", "")
        return obj in SAFE_BUILTINS or owner in _C_MODULES
    if isinstance(obj, types.FunctionType):
        return obj.__module__ == "torch.nn.functional"
    if isinstance(obj, type):
        return obj in SAFE_BUILTINS or obj in _SAFE_TYPES
    return type(obj) in _PLAIN


def cannot_block(func: types.FunctionType) -> bool:
    """Whether ``func``'s code only computes (see the module docstring)."""
    code = func.__code__
    if func.__closure__ or code.co_flags & _SUSPENDING:
        return False  # a closure, or a generator / coroutine / async generator
    if any(isinstance(c, types.CodeType) for c in code.co_consts):
        return False
    scope = func.__globals__
    chain: Any = _MISSING  # the object an attribute chain off a global has reached
    for instr in dis.get_instructions(code):
        name = instr.opname
        if name in _FORBIDDEN_OPS:
            return False
        if name in _ATTR_OPS and chain is not _MISSING:
            chain = getattr(chain, instr.argval, _MISSING)
            if chain is _MISSING:
                return False
            continue
        if chain is not _MISSING and not _safe_value(chain):
            return False
        chain = _MISSING
        if name == "LOAD_GLOBAL":
            value = scope.get(instr.argval, _MISSING)
            if value is _MISSING:
                value = getattr(builtins, instr.argval, _MISSING)
            if value is _MISSING or not _safe_value(value):
                return False
            if isinstance(value, types.ModuleType):
                chain = value  # what is read off it is checked when the chain ends
    return chain is _MISSING or _safe_value(chain)


def plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data: calling methods on it cannot reach user code."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    if depth < 4 and kind in (tuple, list):
        return all(plain(v, depth + 1) for v in value)
    if depth < 4 and kind is dict:
        return all(type(k) is str and plain(v, depth + 1) for k, v in value.items())
    return False


__all__ = ["cannot_block", "plain"]
