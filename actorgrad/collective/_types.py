"""Value types of the collective layer: ReduceOp, Group, Work."""

from __future__ import annotations

import asyncio
import datetime
import enum
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from ..runtime import get_worker
from ..runtime._calls import check_timeout


class ReduceOp(enum.Enum):
    """How :func:`all_reduce` and :func:`reduce` combine the tensors of the ranks.

    ``AVG`` is the sum divided by the group size (floating point and complex only);
    ``MIN``/``MAX`` are not defined for complex tensors; ``BAND``/``BOR``/``BXOR``
    (bitwise and, or, exclusive or) are for integer and bool tensors, as in torch.
    """

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


@dataclass(frozen=True, slots=True)
class Group:
    """A set of workers that run collectives together (torch's ``ProcessGroup``).

    Created by :func:`new_group` on every worker, with the same ``id`` everywhere.
    ``ranks`` are the members' global ranks, sorted; a member's rank inside the group
    is its index in ``ranks``. The object is a plain value: it names the group and can
    be passed between workers of the same job.
    """

    id: int
    ranks: tuple[int, ...]
    backend: str = "actorgrad"

    def rank(self) -> int:
        """The current worker's rank in this group, or -1 when it is not a member."""
        me = get_worker().rank
        try:
            return self.ranks.index(me)
        except ValueError:
            return -1

    def size(self) -> int:
        """The number of members."""
        return len(self.ranks)

    def group_rank(self, global_rank: int) -> int:
        """The group rank of ``global_rank`` (ValueError when it is not a member)."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(
                f"rank {global_rank} is not a member of group {self.id} (ranks {list(self.ranks)})"
            ) from None

    def __repr__(self) -> str:
        return f"Group(id={self.id}, ranks={list(self.ranks)}, backend={self.backend!r})"


class Work:
    """Handle of an operation that runs in the background (``isend``, ``irecv``,
    ``async_op=True``), like torch's ``Work``.

    ``await work`` or ``await work.wait()`` waits for it and re-raises its error;
    ``is_completed()`` polls. For a receive, ``source_rank()`` is the global rank the
    message came from.
    """

    __slots__ = ("_future", "_tensors")

    def __init__(self, future: asyncio.Future[Any], tensors: list[torch.Tensor] | None = None) -> None:
        self._future = future
        self._tensors = tensors or []
        future.add_done_callback(_consume_exception)

    def __await__(self) -> Generator[Any, None, bool]:
        return self.wait().__await__()

    async def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Wait until the operation finished; raises its error. Returns True (as torch).

        Args:
            timeout: seconds (or a ``timedelta``, as torch's ``Work.wait`` takes) to wait
                at most (``None``: the operation's own deadline); on expiry
                ``TimeoutError`` is raised and the operation keeps running.
        """
        if isinstance(timeout, datetime.timedelta):
            # (torch's default, timedelta(0), means no limit)
            timeout = timeout.total_seconds() or None
        if timeout is None:
            await asyncio.shield(self._future)
            return True
        check_timeout(timeout, meaning="")
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._future)
        except TimeoutError:
            if self._future.done():  # (it finished as the time ran out)
                raise
            raise TimeoutError(f"the operation did not finish within {float(timeout):g}s (it goes on; "
                               "wait again for it)") from None
        return True

    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._future.done()

    def is_success(self) -> bool:
        """True once the operation finished without an error."""
        return self._future.done() and not self._future.cancelled() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        """The error of a finished operation, or None."""
        if not self._future.done() or self._future.cancelled():
            return None
        return self._future.exception()

    def source_rank(self) -> int:
        """For a completed receive: the global rank of the sender."""
        if not self._future.done():
            raise RuntimeError("source_rank() is only known once the receive completed")
        value = self._future.result()
        if not isinstance(value, int):
            raise RuntimeError("source_rank() is only defined for receives")
        return value

    def result(self) -> list[torch.Tensor]:
        """The tensors the operation wrote (as torch's ``Work.result``)."""
        return list(self._tensors)

    def get_future(self) -> asyncio.Future[Any]:
        """The asyncio future behind this handle."""
        return self._future

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"<Work {state}>"


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # a failed Work nobody waits on is not worth a log line


__all__ = ["Group", "ReduceOp", "Work"]
