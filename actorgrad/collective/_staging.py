"""The tensors a collective works on: dense CPU copies or views of the caller's, and
whether the caller's tensor shares memory with another rank's entry of a list.

Shared by both backends, so they stage alike."""

from __future__ import annotations

from collections.abc import Callable

import torch

Staged = tuple[torch.Tensor, Callable[[], None] | None]


def staged(t: torch.Tensor, copy: bool = False) -> Staged:
    """A contiguous CPU tensor to work on, and the write-back into ``t`` if it is a copy."""
    d = t.detach()
    # (a conjugate or negative view reads as other values than its memory holds: a
    # copy resolves it, and the write-back goes through the view)
    if not copy and d.is_cpu and d.is_contiguous() and not d.is_conj() and not d.is_neg():
        dense = _dense_strides(d.shape)
        if d.stride() != dense:
            # contiguous, with odd strides in dimensions of size 1 (x[1::2] of a 3-long x):
            # the same memory under the strides that flat and byte views need
            d = d.as_strided(d.shape, dense)
        return d, None
    work = torch.empty(d.shape, dtype=d.dtype)  # dense strides (a copy keeps odd ones)
    work.copy_(d)

    def writeback() -> None:
        d.copy_(work)

    return work, writeback


def staged_apart(t: torch.Tensor, entries: list[torch.Tensor] | None, mine: int,
                 stage: Callable[[torch.Tensor, bool], Staged] = staged) -> Staged:
    """``t`` staged (with ``stage``) as a copy of its own when it shares memory with an
    entry of ``entries`` other than ``entries[mine]``: the input of a gather that is
    another rank's output entry would be written while still being sent; the output of
    a scatter root that is another rank's part would send that rank the root's part."""
    return stage(t, entries is not None and _aliased(t, entries, mine))


def _aliased(t: torch.Tensor, tensors: list[torch.Tensor], mine: int) -> bool:
    span = _memory_span(t)
    if span is None:
        return False
    for i, other in enumerate(tensors):
        if i != mine and (o := _memory_span(other)) is not None and o[0] < span[1] and span[0] < o[1]:
            return True
    return False


def _memory_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of memory ``t``'s elements lie in (first, past the last); None if none."""
    if not t.numel() or not t.is_cpu:
        return None
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _dense_strides(shape: torch.Size) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
