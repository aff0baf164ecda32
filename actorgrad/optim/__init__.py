"""Distributed optimizer: a local optimizer per parameter owner, fed by context grads."""

from __future__ import annotations

from .._api import worker_setup as _worker_setup
from ._optimizer import DistributedOptimizer as DistributedOptimizer
from ._optimizer import OptimizerActor as OptimizerActor
from ._optimizer import setup as _setup

_worker_setup.append(_setup)

__all__ = ("DistributedOptimizer", "OptimizerActor")
