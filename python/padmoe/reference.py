"""padmoe.reference: every padmoe op in plain PyTorch, the reference implementation.

Pure PyTorch, importable on its own (``import padmoe.reference`` or loading this file as a
module needs nothing from the native extension), vectorized (the only Python loops run
over top_k), on any device. Same semantics and argument order as the C++ ops of
``include/padmoe/ops.hpp``:

- index outputs are int32 on the input's device; ``P = padded_bins[-1]`` rows;
- padding rows are zero; rows of a weighted move are ``float32(x) * float32(w)`` cast
  once to the row dtype;
- sums over k run in float32 in ascending k and are cast once to the row dtype;
- dot products (weight gradients) are accumulated in float32 (in PyTorch's reduction
  order, so they agree with padmoe within float32 rounding, not bitwise);
- output dtypes follow the allocating C++ forms: ``padded_scatter_wgrad`` returns the
  rows' dtype, ``grad_weights`` / ``grad_probs`` the weights' / probs' dtype.

They are written the way MegaBlocks and Megatron do routing in eager mode (sort,
``torch.zeros`` then index assignment, ``index_select``), so they serve both as the
"plain PyTorch" check for the padmoe ops and as the PyTorch-eager baseline of
``bench/bench_python.py``. Like those libraries, an op that produces ``P`` rows reads
``P`` on the host (``.item()``: one synchronization on a GPU) and allocates its output,
and padded outputs are zero-filled and then written (real rows twice). ``make_plan``
itself never synchronizes: counts come from a ``searchsorted`` over the sorted expert
ids (exact for any E, unlike ``torch.histc`` on float ids) instead of ``bincount``.

Arguments are not validated beyond what PyTorch itself checks; use the padmoe ops for
checked inputs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

try:
    from ._plan import Plan
except ImportError:  # reference.py loaded from its file, outside the package (python/tests/test_eager.py)
    from padmoe._plan import Plan

__all__ = [
    "Plan",
    "make_plan",
    "padded_gather",
    "padded_scatter",
    "padded_scatter_wgrad",
    "dispatch",
    "combine",
    "combine_backward",
    "dispatch_backward",
    "pad_to_alignment",
    "unpad_from_alignment",
    "unpad_from_alignment_backward",
]


# The plan type is padmoe's one Plan (padmoe/_plan.py), here holding torch tensors.


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _padded_rows(padded_bins: torch.Tensor) -> int:
    # P on the host: one synchronization on a GPU (as MegaBlocks does).
    return int(padded_bins[-1].item()) if padded_bins.numel() > 0 else 0


def _exclusive(inclusive: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum (int64) from an inclusive one."""
    inclusive = inclusive.long()
    return torch.cat([inclusive.new_zeros(1), inclusive[:-1]])


def _sorted_rows(bin_ids: torch.Tensor, bins: torch.Tensor, padded_bins: torch.Tensor) -> torch.Tensor:
    """Padded row (int64) of every sorted position i:
    padded_start(e) + i - real_start(e), e = bin_ids[i]."""
    shift = _exclusive(padded_bins) - _exclusive(bins)  # [E]
    positions = torch.arange(bin_ids.numel(), device=bin_ids.device, dtype=torch.long)
    return positions + shift.index_select(0, bin_ids.long())


def _dest_rows_from_sorted(
    indices: torch.Tensor, bin_ids: torch.Tensor, bins: torch.Tensor, padded_bins: torch.Tensor
) -> torch.Tensor:
    """Inverse map (int64): dest_rows[indices[i]] = row of sorted position i."""
    rows = _sorted_rows(bin_ids, bins, padded_bins)
    dest = torch.empty_like(rows)
    dest[indices.long()] = rows
    return dest


def _as_float32(w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if w is None else w.reshape(-1).to(torch.float32)


def _weighted(rows: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(rows) * w (float32, broadcast over the last dim), cast once to dtype; a zero
    product is +0.0 (the ``+ 0``). Type promotion forms the product in float32 without a float32
    copy of rows."""
    return (rows * w.unsqueeze(-1) + 0.0).to(dtype)


def _combine_rows(y: torch.Tensor, dest2d: torch.Tensor, w2d: Optional[torch.Tensor]) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[dest2d[t, k]]: float32, ascending k, cast once."""
    num_tokens, top_k = dest2d.shape
    acc = None
    for k in range(top_k):
        rows = y.index_select(0, dest2d[:, k])
        if w2d is not None:
            term = rows * w2d[:, k].unsqueeze(1)  # float32 by type promotion
            acc = term if acc is None else acc.add_(term)
        else:
            acc = rows.to(torch.float32) if acc is None else acc.add_(rows)  # rows is a fresh tensor
    if acc is None:  # top_k >= 1 always; keeps shapes right for malformed input
        return y.new_zeros(num_tokens, y.shape[1])
    return acc.to(y.dtype)


def _row_dots(y: torch.Tensor, dest2d: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """dots[t, k] = <y[dest2d[t, k]], other[t]> accumulated in float32; returns [T*K] float32."""
    num_tokens, top_k = dest2d.shape
    other32 = other.to(torch.float32)
    dots = [(y.index_select(0, dest2d[:, k]) * other32).sum(dim=-1) for k in range(top_k)]
    if not dots:
        return other32.new_zeros(0)
    return torch.stack(dots, dim=1).reshape(num_tokens * top_k)


def _plan_dest2d(plan, num_tokens: int) -> torch.Tensor:
    return plan.dest_rows.long().view(num_tokens, int(plan.top_k))


# ---------------------------------------------------------------------------
# 1. routing plan
# ---------------------------------------------------------------------------


def make_plan(top_experts: torch.Tensor, num_experts: int, alignment: int) -> Plan:
    """docs/spec.md §3: stable sort of assignment ids by expert, counts, padded counts,
    their inclusive cumsums, dest_rows and row_sources (all int32, on the input's device).
    No host synchronization."""
    if top_experts.dim() != 2:
        raise ValueError(f"make_plan: top_experts must be [T, K], got shape {tuple(top_experts.shape)}")
    if alignment < 1:
        raise ValueError(f"make_plan: alignment must be >= 1, got {alignment}")
    num_tokens, top_k = top_experts.shape
    num_experts, alignment = int(num_experts), int(alignment)
    device = top_experts.device
    flat = top_experts.reshape(-1)
    num_assignments = flat.numel()

    bin_ids, indices = torch.sort(flat, stable=True)
    # bins[e] = number of assignments with expert <= e (the inclusive cumsum of the counts).
    experts = torch.arange(num_experts, device=device, dtype=bin_ids.dtype)
    bins = torch.searchsorted(bin_ids, experts, right=True)
    tokens_per_expert = torch.diff(bins, prepend=bins.new_zeros(1))
    padded_tokens_per_expert = (tokens_per_expert + (alignment - 1)) // alignment * alignment
    padded_bins = torch.cumsum(padded_tokens_per_expert, 0)

    rows = _sorted_rows(bin_ids, bins, padded_bins)
    dest_rows = torch.empty(num_assignments, device=device, dtype=torch.int32)
    dest_rows[indices] = rows.to(torch.int32)
    capacity = num_assignments + num_experts * (alignment - 1)
    row_sources = torch.full((capacity,), -1, device=device, dtype=torch.int32)
    row_sources[rows] = indices.to(torch.int32)

    i32 = torch.int32
    return Plan(
        indices.to(i32),
        bin_ids.to(i32),
        tokens_per_expert.to(i32),
        bins.to(i32),
        padded_tokens_per_expert.to(i32),
        padded_bins.to(i32),
        dest_rows,
        row_sources,
        int(num_tokens),
        int(top_k),
        num_experts,
        alignment,
    )


# ---------------------------------------------------------------------------
# 2. MegaBlocks family
# ---------------------------------------------------------------------------


def padded_gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
    weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y[row(i)] = x[indices[i] // K] (* weights[indices[i]]); padding rows zero. y: [P, H]."""
    rows = _sorted_rows(bin_ids, bins, padded_bins)
    src = x.index_select(0, indices.long() // int(top_k))
    if weights is not None:
        src = _weighted(src, _as_float32(weights).index_select(0, indices.long()), x.dtype)
    y = x.new_zeros(_padded_rows(padded_bins), x.shape[1])
    y[rows] = src
    return y


def padded_scatter(
    y: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: Optional[torch.Tensor],
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]] (float32, ascending k). out: [A/K, H]."""
    top_k = int(top_k)
    dest = _dest_rows_from_sorted(indices, bin_ids, bins, padded_bins).view(-1, top_k)
    w = _as_float32(weights)
    return _combine_rows(y, dest, None if w is None else w.view(-1, top_k))


def padded_scatter_wgrad(
    y: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """wgrad[a] = <y[dest_rows[a]], grad[a // K]> (float32 accumulation), in y's dtype."""
    dest = _dest_rows_from_sorted(indices, bin_ids, bins, padded_bins).view(-1, int(top_k))
    return _row_dots(y, dest, grad).to(y.dtype)


def dispatch(x: torch.Tensor, plan, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """= padded_gather on a plan: y[dest_rows[t*K+k]] = x[t] (* weights[t*K+k]). y: [P, H]."""
    num_tokens, hidden = x.shape
    dest2d = _plan_dest2d(plan, num_tokens)
    y = x.new_zeros(_padded_rows(plan.padded_bins), hidden)
    if weights is None:
        src = x.unsqueeze(1).expand(num_tokens, dest2d.shape[1], hidden)  # no [T, K, H] copy
    else:
        src = _weighted(x.unsqueeze(1), _as_float32(weights).view_as(dest2d), x.dtype)
    y[dest2d] = src
    return y


def combine(y: torch.Tensor, plan, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """= padded_scatter on a plan. out: [T, H]."""
    num_tokens = int(plan.num_tokens)
    w = _as_float32(weights)
    return _combine_rows(y, _plan_dest2d(plan, num_tokens), None if w is None else w.view(num_tokens, int(plan.top_k)))


def combine_backward(
    grad_out: torch.Tensor, y: torch.Tensor, plan, weights: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """grad_y[dest_rows[a]] = w(a) * grad_out[a // K] ([P, H], padding rows zero) and, when
    weights are given, grad_weights[a] = <y[dest_rows[a]], grad_out[a // K]> (weights' dtype)."""
    num_tokens, hidden = grad_out.shape
    dest2d = _plan_dest2d(plan, num_tokens)
    grad_y = grad_out.new_zeros(_padded_rows(plan.padded_bins), hidden)
    if weights is None:
        grad_y[dest2d] = grad_out.unsqueeze(1).expand(num_tokens, dest2d.shape[1], hidden)
        return grad_y, None
    grad_y[dest2d] = _weighted(grad_out.unsqueeze(1), _as_float32(weights).view_as(dest2d), grad_out.dtype)
    grad_weights = _row_dots(y, dest2d, grad_out).to(weights.dtype)
    return grad_y, grad_weights


def dispatch_backward(
    grad_y: torch.Tensor, x: torch.Tensor, plan, weights: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """grad_x = combine(grad_y, plan, weights) and, when weights are given,
    grad_weights[a] = <grad_y[dest_rows[a]], x[a // K]> (weights' dtype)."""
    num_tokens = x.shape[0]
    dest2d = _plan_dest2d(plan, num_tokens)
    w = _as_float32(weights)
    grad_x = _combine_rows(grad_y, dest2d, None if w is None else w.view_as(dest2d)).to(x.dtype)
    if weights is None:
        return grad_x, None
    return grad_x, _row_dots(grad_y, dest2d, x).to(weights.dtype)


# ---------------------------------------------------------------------------
# 3. Megatron family
# ---------------------------------------------------------------------------


def pad_to_alignment(
    hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, alignment: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e's rows [excl(e), excl(e)+count(e)) of hidden_states move, in order, to
    [pexcl(e), pexcl(e)+count(e)); padding rows are zero and map to -1. Rows at or past
    sum(tokens_per_expert) are ignored. Returns (padded [P, H], permutation_map [P] int32,
    inclusive_offsets [E] int32)."""
    if alignment < 1:
        raise ValueError(f"pad_to_alignment: alignment must be >= 1, got {alignment}")
    device = hidden_states.device
    counts = tokens_per_expert.to(device=device, dtype=torch.long)
    num_experts = counts.numel()
    padded_counts = (counts + (alignment - 1)) // alignment * alignment
    inclusive_offsets = torch.cumsum(padded_counts, 0)
    shift = (inclusive_offsets - padded_counts) - (torch.cumsum(counts, 0) - counts)  # pexcl - excl
    # P and the number of valid rows on the host: one synchronization.
    padded_rows, valid_rows = torch.stack([inclusive_offsets[-1], counts.sum()]).tolist() if num_experts > 0 else (0, 0)

    experts = torch.arange(num_experts, device=device)
    expert_of_row = torch.repeat_interleave(experts, counts, output_size=valid_rows)
    src = torch.arange(valid_rows, device=device)
    dst = src + shift.index_select(0, expert_of_row)

    padded = hidden_states.new_zeros(padded_rows, hidden_states.shape[1])
    padded[dst] = hidden_states[:valid_rows]
    permutation_map = torch.full((padded_rows,), -1, device=device, dtype=torch.int32)
    permutation_map[dst] = src.to(torch.int32)
    return padded, permutation_map, inclusive_offsets.to(torch.int32)


def unpad_from_alignment(
    padded: torch.Tensor, permutation_map: torch.Tensor, original_size: int, probs: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """out[map[p]] = padded[p] (* probs[map[p]]) for every map[p] >= 0; other rows zero.
    out: [original_size, H]."""
    source = torch.nonzero(permutation_map >= 0).squeeze(1)  # padded rows that hold a token
    dest = permutation_map.long().index_select(0, source)
    rows = padded.index_select(0, source)
    if probs is not None:
        rows = _weighted(rows, _as_float32(probs).index_select(0, dest), padded.dtype)
    out = padded.new_zeros(int(original_size), padded.shape[1])
    out[dest] = rows
    return out


def unpad_from_alignment_backward(
    grad_out: torch.Tensor, padded: torch.Tensor, permutation_map: torch.Tensor, probs: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """grad_padded[p] = grad_out[map[p]] (* probs[map[p]]), zero where map[p] < 0 (padded's
    shape); grad_probs[n] = <grad_out[n], padded[p]> for the p with map[p] == n, else 0
    (probs' dtype, only when probs are given)."""
    source = torch.nonzero(permutation_map >= 0).squeeze(1)
    dest = permutation_map.long().index_select(0, source)
    grads = grad_out.index_select(0, dest)
    grad_padded = torch.zeros_like(padded)
    if probs is None:
        grad_padded[source] = grads.to(padded.dtype)
        return grad_padded, None
    grad_padded[source] = _weighted(grads, _as_float32(probs).index_select(0, dest), padded.dtype)
    dots = (padded.index_select(0, source) * grads.to(torch.float32)).sum(dim=-1)
    grad_probs = torch.zeros(grad_out.shape[0], device=grad_out.device, dtype=torch.float32)
    grad_probs[dest] = dots
    return grad_padded, grad_probs.to(probs.dtype)
