"""Functions of ``__main__``: found by name where the receiver has the same one.

cloudpickle sends a function of the program's ``__main__`` by value, with copies of the
globals it uses, so that a notebook's or a test's functions reach workers that cannot
import them. torch pickles them by reference instead: every rank started by a launcher
runs the same script, and a remote function then uses the callee's own module state (a
global dict it fills, a lazily created parameter server guarded by a global lock). A
copy by value made those idioms fail in silence (each call saw fresh copies of the
globals) or at once (a lock cannot be pickled).

So each worker tells the others which program it runs (the runtime's
``program_identity``: the contents of its ``__main__`` file, or the process for one
without a file, such as a notebook). To a worker that runs the same program a ``__main__`` function travels as its
qualified name and a fingerprint of its code, and the receiver uses its own (as torch
does); to any other it travels by value (as cloudpickle sends it, what a worker process
running another program needs).
"""

from __future__ import annotations

import sys
import types
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


def is_main_function(obj: Any) -> bool:
    """A function defined at the top level of this process's ``__main__`` and found
    there by its name (what torch pickles by reference). Not a method (its class goes by
    value, and its methods with it: ``super()`` needs them to), a lambda or a wrapper
    that took another function's name, nor a copy that came by value from a worker that
    runs another program (its ``__module__`` says ``__main__`` too)."""
    name = obj.__qualname__
    return "." not in name and getattr(sys.modules.get("__main__"), name, None) is obj


def main_function(name: str, print_: Fingerprint) -> Any:
    """What a ``__main__`` function sent by name is rebuilt by: this process's own
    top-level function of that name, which must have the same code."""
    found = getattr(sys.modules.get("__main__"), name, None)
    if type(found) is types.FunctionType and fingerprint(found.__code__) == print_:
        return found
    problem = "has no function of that name" if type(found) is not types.FunctionType else \
        "has a function of that name with other code"
    raise LookupError(
        f"function __main__.{name} came by name from a worker that runs the same program, "
        f"but this process's __main__ {problem}: define it on every worker alike, at module level"
    )
