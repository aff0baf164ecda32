"""Dependency computation over the local autograd graph.

A backward job on one worker starts from some tensors (the roots, or the tensors of a
send entry) and must deliver gradients to every leaf it reaches: user leaves (whose
gradients accumulate in the context) and recv leaves (whose gradients travel back to the
worker that sent them). Walking ``grad_fn.next_functions`` finds those leaves; torch's
engine then computes all their gradients in one ``torch.autograd.grad`` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge


class TooManyNodes(Exception):
    """The walk met more nodes than the caller allowed (see ``reachable_leaves``)."""


def reachable_leaves(
    outputs: Sequence[torch.Tensor | GradientEdge], max_nodes: int | None = None
) -> list[torch.Tensor]:
    """Every leaf that requires grad and is reachable backwards from ``outputs``
    (tensors, or gradient edges).

    Raises TooManyNodes once more than ``max_nodes`` nodes were met, so that a caller
    on the event loop can walk small graphs itself and hand big ones to a thread.
    """
    leaves: dict[int, torch.Tensor] = {}
    seen: set[object] = set()
    stack = []
    for tensor in outputs:
        node: Any
        if isinstance(tensor, GradientEdge):
            node = tensor.node
        elif (node := tensor.grad_fn) is None:
            if tensor.requires_grad:
                leaves[id(tensor)] = tensor
            continue
        if node not in seen:
            seen.add(node)
            stack.append(node)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None or child in seen:
                continue
            seen.add(child)
            variable = getattr(child, "variable", None)
            if variable is not None:
                leaves[id(variable)] = variable
            else:
                stack.append(child)
        if max_nodes is not None and len(seen) > max_nodes:
            raise TooManyNodes
    return list(leaves.values())


def count_nodes(outputs: Sequence[torch.Tensor]) -> int:
    """Number of autograd nodes reachable from ``outputs`` (for graphs and traces)."""
    seen: set[object] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return len(seen)
