"""Test support: worker groups for tests and notebooks (and the pytest plugin)."""

from __future__ import annotations

from ._group import InProcessGroup as InProcessGroup
from ._group import LocalGroup as LocalGroup
from ._group import free_port as free_port
from ._group import local_group as local_group
from ._group import start_in_process as start_in_process
