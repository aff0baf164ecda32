"""Test support: worker groups for tests and notebooks (and the pytest plugin).

The names load on first use: the pytest plugin imports this package in every pytest
run of an environment that has actorgrad, also one that never starts a group, and the
groups need torch (seconds to import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._group import InProcessGroup as InProcessGroup
    from ._group import LocalGroup as LocalGroup
    from ._group import free_port as free_port
    from ._group import local_group as local_group
    from ._group import start_in_process as start_in_process

__all__ = ("InProcessGroup", "LocalGroup", "free_port", "local_group", "start_in_process")


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'actorgrad.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module("._group", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
