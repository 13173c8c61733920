"""Size helpers, the same in :mod:`padmoe` and :mod:`padmoe.torch`.

Naming: a ``*_bound`` is computed on the host from sizes alone (what to allocate, no
synchronization); an exact count is read from the device (``Plan.padded_rows()``; P itself is
``plan.padded_bins[-1]``). Every helper checks its arguments and raises ``ValueError`` on a size
that overflows.
"""

from __future__ import annotations

import warnings

from . import _C


def padded_rows_bound(num_tokens: int, top_k: int, num_experts: int, alignment: int) -> int:
    """Host-side bound on P, the padded rows of a plan: ``num_tokens*top_k + num_experts*(alignment-1)``
    (``Plan.padded_rows_bound`` of such a plan)."""
    return _C.padded_rows_bound(num_tokens, top_k, num_experts, alignment)


def workspace_bound(num_tokens: int, top_k: int, num_experts: int, alignment: int) -> int:
    """CUDA scratch bytes that suffice for every op on this routing (and pad/unpad of up to
    ``padded_rows_bound(...)`` rows): allocate once, pass as ``workspace=``."""
    return _C.workspace_bound(num_tokens, top_k, num_experts, alignment)


def aligned_rows_bound(assignments: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """``A + min(A, E) * (block_size - 1)``, rounded up to ``block_size`` when ``pad_sorted_ids``: vLLM's
    ``max_num_tokens_padded``, the length of ``moe_align_block_size``'s ``sorted_token_ids``."""
    return int(_C.aligned_rows_bound(int(assignments), int(num_experts), int(block_size), bool(pad_sorted_ids)))


def sort_chunks_rows_bound(received_rows: int, num_chunks: int, num_ranks: int, alignment: int) -> int:
    """Host-side bound on ``sort_chunks``' padded rows P:
    ``received_rows + (num_chunks // num_ranks) * (alignment - 1)``."""
    return _C.sort_chunks_rows_bound(received_rows, num_chunks, num_ranks, alignment)


def capacity_bound(num_tokens: int, top_k: int, num_experts: int, alignment: int) -> int:
    """Deprecated name of :func:`padded_rows_bound` (removed in the next release)."""
    warnings.warn("padmoe.capacity_bound is deprecated: use padmoe.padded_rows_bound", DeprecationWarning, stacklevel=2)
    return padded_rows_bound(num_tokens, top_k, num_experts, alignment)


def sort_chunks_capacity(received_rows: int, num_chunks: int, num_ranks: int, alignment: int) -> int:
    """Deprecated name of :func:`sort_chunks_rows_bound` (removed in the next release)."""
    warnings.warn(
        "padmoe.sort_chunks_capacity is deprecated: use padmoe.sort_chunks_rows_bound", DeprecationWarning, stacklevel=2
    )
    return sort_chunks_rows_bound(received_rows, num_chunks, num_ranks, alignment)


def has_cuda() -> bool:
    """Whether this build of padmoe has the CUDA backend."""
    return _C.has_cuda()
