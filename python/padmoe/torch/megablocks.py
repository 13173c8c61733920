"""MegaBlocks' ``megablocks.ops`` names for the padded routing path, so that code (or a test suite)
written against ``from megablocks import ops`` runs on padmoe with ``import padmoe.torch.megablocks
as ops``.

- ``padded_gather``, ``padded_scatter``, ``padded_scatter_wgrad``: padmoe's drop-ins (native
  operators with autograd; ``padmoe.torch``'s docstrings).
- ``sort(x, end_bit=None) -> (values, indices)``: a stable ascending sort of the expert ids, both
  in ``x``'s dtype (MegaBlocks' radix sort; ``end_bit`` is accepted and unused: every bit is
  sorted).
- ``histogram(x, max_val) -> counts[max_val]`` (int32): how many entries of ``x`` hold each value
  in ``[0, max_val)``; other values are not counted.
- ``inclusive_cumsum(x, dim)``, ``exclusive_cumsum(x, dim)``: in ``x``'s dtype.
- ``round_up(x, value)``: each entry rounded up to a multiple of ``value``, in ``x``'s dtype.

The helpers are a few torch ops each, with no host synchronization (graph-capturable)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from padmoe.torch import padded_gather, padded_scatter, padded_scatter_wgrad

__all__ = [
    "padded_gather",
    "padded_scatter",
    "padded_scatter_wgrad",
    "sort",
    "histogram",
    "inclusive_cumsum",
    "exclusive_cumsum",
    "round_up",
]

Tensor = torch.Tensor


def sort(x: Tensor, end_bit: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``(values, indices)``: ``x`` sorted ascending, stable (equal ids keep their order), both in
    ``x``'s dtype, as MegaBlocks' ``ops.sort`` returns them."""
    del end_bit  # MegaBlocks sorts the low end_bit bits; every bit is sorted here, same result for ids below 2^end_bit
    values, indices = torch.sort(x, stable=True)
    return values, indices.to(x.dtype)


def histogram(x: Tensor, max_val: int) -> Tensor:
    """``counts[max_val]`` (int32): entries of ``x`` equal to each value in ``[0, max_val)``."""
    n = int(max_val)
    if n < 0:
        raise ValueError(f"histogram: max_val: must be >= 0, got {n}")
    flat = x.reshape(-1).to(torch.int64)
    inside = (flat >= 0) & (flat < n)
    slot = torch.where(inside, flat, torch.full_like(flat, n))  # one spill bin for the rest: no sync
    counts = torch.zeros(n + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, slot, torch.ones_like(slot))
    return counts[:n].to(torch.int32)


def inclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """``x[0] + ... + x[i]`` along ``dim``, in ``x``'s dtype."""
    return torch.cumsum(x, dim).to(x.dtype)


def exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """``x[0] + ... + x[i - 1]`` along ``dim`` (0 first), in ``x``'s dtype."""
    return (torch.cumsum(x, dim) - x).to(x.dtype)


def round_up(x: Tensor, value: int) -> Tensor:
    """Each entry of ``x`` (>= 0) rounded up to a multiple of ``value``, in ``x``'s dtype."""
    v = int(value)
    if v < 1:
        raise ValueError(f"round_up: value: must be >= 1, got {v}")
    return torch.div(x + (v - 1), v, rounding_mode="floor") * v
