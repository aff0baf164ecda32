"""Functions and classes of ``__main__``: found by name where the receiver has the same.

cloudpickle sends a function or class of the program's ``__main__`` by value, with
copies of the globals it uses, so that a notebook's or a test's code reaches workers
that cannot import it. torch pickles them by reference instead: every rank started by a
launcher runs the same script, and a remote function then uses the callee's own module
state (a global dict it fills, a lazily created parameter server guarded by a global
lock), and an object of a script's class is an instance of the receiver's own class
(``isinstance``, ``except AppError``, class attributes). A copy by value made those
idioms fail in silence (each call saw fresh copies of the globals; a class arrived as
a look-alike that no ``isinstance`` accepts) or at once (a lock cannot be pickled).

So each worker tells the others which program it runs (the runtime's
``program_identity``: the contents of its ``__main__`` file, or the process for one
without a file, such as a notebook). To a worker that runs the same program a top-level
``__main__`` function or class travels as its qualified name and a fingerprint of its
code, and the receiver uses its own (as torch does; also a method or a nested class,
found by its qualified name); to any other it travels by value
(as cloudpickle sends it, what a worker process running another program needs).

A function sent by value travels with a token of its origin (``origin_token``), as
cloudpickle tracks the classes it sends by value: when a copy comes back to the process
that made it (a worker calling a notebook's function on worker0, to report to it), that
process runs its own function, with its live globals, not the copy of them the function
took along (which made such callbacks change nothing, in silence). The tokens are kept
beside the functions, by identity, not on them: a wrapper that copies a function's
``__dict__`` (``functools.wraps``) is not taken for it. A function that names itself
(recursion) still travels as a plain copy (see the codec).
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
import types
import weakref
import zlib
from typing import Any

Fingerprint = tuple[str, int, int]

_fingerprints: dict[types.CodeType, Fingerprint] = {}
_FINGERPRINTS_MAX = 4096


def fingerprint(code: types.CodeType) -> Fingerprint:
    """Name, first line and a checksum of the bytecode and constants (nested code too):
    equal for the same source compiled by the same Python, in any process."""
    known = _fingerprints.get(code)
    if known is None:
        known = (code.co_qualname, code.co_firstlineno, zlib.crc32(_code_bytes(code)))
        if len(_fingerprints) < _FINGERPRINTS_MAX:
            _fingerprints[code] = known
    return known


def _code_bytes(code: types.CodeType) -> bytes:
    parts = [code.co_code, repr(code.co_names).encode()]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            parts.append(_code_bytes(const))
        elif isinstance(const, frozenset):  # its repr's order follows string hashing
            parts.append(repr(sorted(map(repr, const))).encode())
        else:
            parts.append(repr(const).encode())
    return b"\0".join(parts)


def is_main_object(obj: Any) -> bool:
    """A function or class of this process's ``__main__`` found there by its qualified
    name (what torch pickles by reference): defined at its top level or in a class of it
    (a method, a static method, a nested class). Not a function defined inside another
    (``f.<locals>.g``), a lambda or a wrapper that took another function's name, nor a
    copy that came by value from a worker that runs another program (its ``__module__``
    says ``__main__`` too)."""
    return _named(obj.__qualname__) is obj


def _named(qualname: str) -> Any:
    """What ``qualname`` names in this process's ``__main__``, or None. Inside a class,
    the attribute its statement defined (a static or class method's function)."""
    found: Any = sys.modules.get("__main__")
    for part in qualname.split("."):
        if isinstance(found, type):
            found = vars(found).get(part)
            if isinstance(found, (staticmethod, classmethod)):
                found = found.__func__
        else:
            found = getattr(found, part, None)
        if found is None:
            return None
    return found


_class_prints: dict[type, Fingerprint] = {}


def class_fingerprint(cls: type) -> Fingerprint:
    """Name, first line of its first method (0 without one) and a checksum of its
    bases' names and its methods' names and code: equal for the same class statement run
    by the same Python, in any process. Only what its statement defined counts, as it
    was defined: more is set on classes as a program runs (pickling their objects adds
    ``__slotnames__``; torch's optimizers wrap a subclass's ``step``, its own or the one
    it inherits, in a function of torch's, and ``functools.wraps`` leads back from it).
    """
    known = _class_prints.get(cls)
    if known is None:
        parts = [repr([f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__]).encode()]
        first_line = 0
        prefix = cls.__qualname__ + "."
        for name, value in sorted(vars(cls).items()):
            for func in _functions_of(value):
                func = inspect.unwrap(func)
                if not func.__qualname__.startswith(prefix) or type(func) is not types.FunctionType:
                    continue
                parts.append(name.encode())
                parts.append(_code_bytes(func.__code__))
                line = func.__code__.co_firstlineno
                first_line = line if not first_line else min(first_line, line)
        known = (cls.__qualname__, first_line, zlib.crc32(b"\0".join(parts)))
        if len(_class_prints) < _FINGERPRINTS_MAX:
            _class_prints[cls] = known
    return known


def _functions_of(value: Any) -> list[types.FunctionType]:
    """The plain functions behind a class attribute (a method, a static or class method,
    a property's accessors)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if type(f) is types.FunctionType]
    return [value] if type(value) is types.FunctionType else []


def main_function(name: str, print_: Fingerprint) -> Any:
    """What a ``__main__`` function sent by name is rebuilt by: this process's own
    function of that qualified name, which must have the same code."""
    found = _named(name)
    if type(found) is types.FunctionType and fingerprint(found.__code__) == print_:
        return found
    problem = "has no function of that name" if type(found) is not types.FunctionType else \
        "has a function of that name with other code"
    raise LookupError(
        f"function __main__.{name} came by name from a worker that runs the same program, "
        f"but this process's __main__ {problem}: define it on every worker alike, at module level"
    )


def main_class(name: str, print_: Fingerprint) -> type:
    """What a ``__main__`` class sent by name is rebuilt by: this process's own class
    of that qualified name, which must have the same code."""
    found = _named(name)
    if isinstance(found, type) and class_fingerprint(found) == print_:
        return found
    problem = "has no class of that name" if not isinstance(found, type) else \
        "has a class of that name with other code"
    raise LookupError(
        f"class __main__.{name} came by name from a worker that runs the same program, "
        f"but this process's __main__ {problem}: define it on every worker alike, at module level"
    )


# token -> the function of this process it names; function -> its token (of this
# process, or of the process a copy came from)
_origins: weakref.WeakValueDictionary[str, types.FunctionType] = weakref.WeakValueDictionary()
_tokens: weakref.WeakKeyDictionary[types.FunctionType, str] = weakref.WeakKeyDictionary()
_origin_prefix = os.urandom(8).hex()
_origin_numbers = itertools.count()


def origin_token(func: types.FunctionType) -> str | None:
    """The token ``func`` travels with by value: the one it came with (a copy), or, for
    a top-level ``__main__`` function of this process, one that finds it here."""
    token = _tokens.get(func)
    if token is None and is_main_object(func):
        # (the pid tells apart the processes forked from one that imported this module)
        token = f"{os.getpid()}:{_origin_prefix}:{next(_origin_numbers)}"
        _tokens[func] = token
        _origins[token] = func
    return token


def origin_function(token: str, copy: types.FunctionType) -> types.FunctionType:
    """What a function sent by value with its origin token is rebuilt by: the original
    where this process made it (and still has it), else the copy (which keeps the
    token, to be sent on with it)."""
    original = _origins.get(token)
    if original is not None:
        return original
    _tokens[copy] = token
    return copy
