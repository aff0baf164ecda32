"""Modules a parent process loaded from files that its import path does not lead to.

A local_group worker gets its parent's ``sys.path``, so it imports the parent's modules
as the parent did, and a test module's functions run there by reference. A module
loaded from its file under a name no finder knows is the exception: pytest's
``--import-mode=importlib`` imports ``tests/sub/test_x.py`` as ``tests.sub.test_x``
without putting its root on the path, and ``importlib.util.spec_from_file_location``
does the same for any program. The parent lists those modules (name and file, and
the packages without a file that pytest makes to hold them); the worker finds them
through a finder placed after all others, so it never stands in for a module that the
path leads to.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


def modules_off_the_path() -> dict[str, str | None]:
    """This process's modules that no finder of its import system finds by name:
    name -> file, or None for a package without a file that holds one of them."""
    findable: dict[str, bool] = {}
    files: dict[str, str | None] = {}
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top.startswith("__") or not isinstance(module, ModuleType):
            continue  # __main__ and its kind: each process has its own
        if top not in findable:
            findable[top] = _findable(top, sys.modules.get(top))
        file = getattr(module, "__file__", None)
        if not findable[top] and isinstance(file, str):
            files[name] = file
    for name in list(files):
        parts = name.split(".")
        for end in range(1, len(parts)):
            files.setdefault(".".join(parts[:end]), None)
    return files


def _findable(top: str, loaded: Any) -> bool:
    """Whether importing ``top`` by name finds the module this process loaded as
    ``top`` (not another of that name: a folder ``tests`` elsewhere on the path)."""
    if top in sys.builtin_module_names:
        return True
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        try:
            spec = find_spec(top, None) if find_spec is not None else None
        except Exception:  # a finder of someone else's that fails: not ours to judge
            continue
        if spec is not None:
            return _same_place(spec, loaded)
    return False


def _same_place(spec: Any, loaded: Any) -> bool:
    file = getattr(loaded, "__file__", None)
    if isinstance(file, str) and isinstance(spec.origin, str) and os.path.exists(spec.origin):
        return os.path.realpath(file) == os.path.realpath(spec.origin)
    mine, found = getattr(loaded, "__path__", None), spec.submodule_search_locations
    if mine is None or found is None:
        return True  # nothing to compare: taken as found
    return {os.path.realpath(p) for p in mine} <= {os.path.realpath(p) for p in found}


class ModuleFiles:
    """A finder for the modules :func:`modules_off_the_path` listed in the parent."""

    def __init__(self, files: dict[str, str | None]) -> None:
        self.files = files

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> Any:
        if name not in self.files:
            return None
        file = self.files[name]
        if file is None:  # a package that only holds listed modules
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = []
            return spec
        return importlib.util.spec_from_file_location(name, file)


def find_module_files(files: dict[str, str | None]) -> None:
    """Let this process import ``files`` (see :func:`modules_off_the_path`)."""
    if files:
        sys.meta_path.append(ModuleFiles(files))
