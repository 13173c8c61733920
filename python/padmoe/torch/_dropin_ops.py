"""Drop-ins: MegaBlocks' padded_gather / padded_scatter / padded_scatter_wgrad, Megatron's
pad_to_alignment / unpad_from_alignment, and the expert-parallel chunk sort.

Same arguments and results as MegaBlocks' and Megatron's functions: their padded outputs have exactly
P rows, so P is read on the host (one synchronization on CUDA; not CUDA-graph capturable; under
torch.compile an unbacked symbol). Each wrapper sits beside its operators' fake kernels.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._common import Tensor, call, check_backend, eager_mode, fake_scales, fake_wgrad, host_check, mode, ops

# ---------------------------------------------------------------------------
# MegaBlocks
# ---------------------------------------------------------------------------


@torch.library.register_fake("padmoe::padded_gather")
def _(x, indices, bin_ids, bins, padded_bins, top_k, weights=None, check=2, zero_padding=True):
    p = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(p, x.shape[1])


@torch.library.register_fake("padmoe::padded_gather_backward")
def _(grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, need_wgrad, check=2):
    return torch.empty_like(x), fake_wgrad(x, weights, indices.shape[0], need_wgrad)


def padded_gather(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
    weights: Optional[Tensor] = None,
    *,
    check: Optional[bool] = None,
    backend: str = "native",
    zero_padding: bool = True,
) -> Tensor:
    """MegaBlocks ``padded_gather(x, indices, bin_ids, bins, padded_bins, top_k)``:
    ``y[padded_bins[-1], H]`` with sorted position i of expert e in row
    ``padded_start(e) + i - real_start(e)`` holding ``x[indices[i] // top_k]`` (times
    ``weights[indices[i]]`` when given); padding rows zero. P is read on the host (one
    synchronization on CUDA; not CUDA-graph capturable). Differentiable wrt ``x`` (and
    ``weights``). ``backend="triton"``: padmoe.triton's kernels (docs/ascend.md), with the
    same backward rules and ``check``."""
    check_backend(backend, "padded_gather")
    if backend == "triton":
        from padmoe import triton as _triton

        return _triton.gather_autograd(x, indices, bin_ids, bins, padded_bins, top_k, weights, host_check(check, x))
    op, default = call("padded_gather")
    return op(x, indices, bin_ids, bins, padded_bins, top_k, weights, mode(check, default), bool(zero_padding))


def padded_gather_backward(
    grad_y: Tensor,
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
    weights: Optional[Tensor] = None,
    *,
    check: Optional[bool] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backward of :func:`padded_gather`, called explicitly: ``(grad_x, grad_weights)``,
    ``grad_x = padded_scatter(grad_y, weights)`` (x's dtype) and ``grad_weights[a] =
    <grad_y[dest_rows[a]], x[a // K]>`` (weights' dtype) when weights are given, else None."""
    gx, gw = ops.padded_gather_backward.default(
        grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, weights is not None, eager_mode(check)
    )
    return gx, (gw if weights is not None else None)


@torch.library.register_fake("padmoe::padded_gather_scaled")
def _(x, indices, bin_ids, bins, padded_bins, top_k, x_scales, check=2, zero_padding=True):
    p = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(p, x.shape[1]), fake_scales(x_scales, p)


def padded_gather_scaled(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
    x_scales: Tensor,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
) -> Tuple[Tensor, Tensor]:
    """:func:`padded_gather` of quantized rows with their scales moved alongside: ``(y, y_scales)``
    with P rows (scale layouts as :func:`dispatch_scaled`; padding rows scale 1). Unweighted; not
    differentiable."""
    return ops.padded_gather_scaled.default(
        x, indices, bin_ids, bins, padded_bins, top_k, x_scales, eager_mode(check), bool(zero_padding)
    )


@torch.library.register_fake("padmoe::padded_scatter")
def _(y, indices, bin_ids, weights, bins, padded_bins, top_k, check=2):
    return y.new_empty(indices.shape[0] // top_k, y.shape[1])


@torch.library.register_fake("padmoe::padded_scatter_backward")
def _(grad_out, y, indices, bin_ids, weights, bins, padded_bins, top_k, need_wgrad, check=2):
    return torch.empty_like(y), fake_wgrad(y, weights, indices.shape[0], need_wgrad)


def padded_scatter(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Optional[Tensor],
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
    *,
    check: Optional[bool] = None,
    backend: str = "native",
) -> Tensor:
    """MegaBlocks ``padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k)``:
    ``out[T, H]``, ``out[t] = sum_k w(t*K+k) * x[dest_rows[t*K+k]]`` (``w`` = weights or 1;
    float32 accumulation in ascending k, cast once). ``x`` is the padded buffer (at least P
    rows; padding rows never read). Differentiable wrt ``x`` and ``weights``. ``backend="triton"``:
    padmoe.triton's kernels, with the same backward rules."""
    check_backend(backend, "padded_scatter")
    if backend == "triton":
        from padmoe import triton as _triton

        return _triton.scatter_autograd(x, indices, bin_ids, weights, bins, padded_bins, top_k, host_check(check, x))
    op, default = call("padded_scatter")
    return op(x, indices, bin_ids, weights, bins, padded_bins, top_k, mode(check, default))


def padded_scatter_backward(
    grad_out: Tensor,
    y: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Optional[Tensor],
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
    *,
    check: Optional[bool] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backward of :func:`padded_scatter`, called explicitly: ``(grad_y, grad_weights)``,
    ``grad_y = padded_gather(grad_out, weights)`` with y's rows (padding rows zero; y's dtype) and
    ``grad_weights = padded_scatter_wgrad(y, grad_out)`` (weights' dtype) when weights are given,
    else None."""
    gy, gw = ops.padded_scatter_backward.default(
        grad_out, y, indices, bin_ids, weights, bins, padded_bins, top_k, weights is not None, eager_mode(check)
    )
    return gy, (gw if weights is not None else None)


@torch.library.register_fake("padmoe::padded_scatter_wgrad")
def _(y, grad, indices, bin_ids, bins, padded_bins, top_k, check=2):
    return y.new_empty(indices.shape[0])


def padded_scatter_wgrad(
    x: Tensor,
    grad: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
    *,
    check: Optional[bool] = None,
    backend: str = "native",
) -> Tensor:
    """MegaBlocks ``padded_scatter_wgrad(x, grad, indices, bin_ids, bins, padded_bins, top_k)``:
    ``wgrad[a] = sum_h x[dest_rows[a], h] * grad[a // K, h]`` (float32 accumulation), in
    x's dtype. Not differentiable. ``backend="triton"``: padmoe.triton's kernel."""
    check_backend(backend, "padded_scatter_wgrad")
    if backend == "triton":
        from padmoe import triton as _triton

        return _triton.padded_scatter_wgrad(
            x, grad, indices, bin_ids, bins, padded_bins, top_k, check=host_check(check, x)
        )
    op, default = call("padded_scatter_wgrad")
    return op(x, grad, indices, bin_ids, bins, padded_bins, top_k, mode(check, default))


# ---------------------------------------------------------------------------
# Megatron
# ---------------------------------------------------------------------------


@torch.library.register_fake("padmoe::pad_to_alignment")
def _(hidden_states, tokens_per_expert, alignment, check=2, zero_padding=True):
    p = torch.library.get_ctx().new_dynamic_size()
    return (
        hidden_states.new_empty(p, hidden_states.shape[1]),
        hidden_states.new_empty(p, dtype=torch.int32),
        hidden_states.new_empty(tokens_per_expert.shape[0], dtype=torch.int32),
    )


def pad_to_alignment(
    hidden_states: Tensor,
    tokens_per_expert: Tensor,
    alignment: int,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Megatron ``pad_to_alignment(hidden_states, tokens_per_expert, alignment)`` ->
    ``(padded_hidden[P, H], permutation_map[P] int32, inclusive_offsets[E] int32)``: expert
    e's rows keep their order and move to its aligned segment; padding rows are zero and
    map to -1; ``inclusive_offsets`` are the grouped-GEMM ``offs``. Rows past
    ``sum(tokens_per_expert)`` are ignored (zero gradient). P is read on the host.
    Differentiable wrt ``hidden_states``."""
    op, default = call("pad_to_alignment")
    return op(hidden_states, tokens_per_expert, alignment, mode(check, default), bool(zero_padding))


@torch.library.register_fake("padmoe::pad_to_alignment_scaled")
def _(hidden_states, tokens_per_expert, alignment, hidden_scales, check=2, zero_padding=True):
    p = torch.library.get_ctx().new_dynamic_size()
    return (
        hidden_states.new_empty(p, hidden_states.shape[1]),
        fake_scales(hidden_scales, p),
        hidden_states.new_empty(p, dtype=torch.int32),
        hidden_states.new_empty(tokens_per_expert.shape[0], dtype=torch.int32),
    )


def pad_to_alignment_scaled(
    hidden_states: Tensor,
    tokens_per_expert: Tensor,
    alignment: int,
    hidden_scales: Tensor,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`pad_to_alignment` of quantized rows with their scales: ``(padded, padded_scales,
    permutation_map, inclusive_offsets)`` (scale layouts as :func:`dispatch_scaled`; padding rows
    scale 1). Not differentiable."""
    return ops.pad_to_alignment_scaled.default(
        hidden_states, tokens_per_expert, alignment, hidden_scales, eager_mode(check), bool(zero_padding)
    )


@torch.library.register_fake("padmoe::unpad_from_alignment")
def _(padded_output, permutation_map, original_size, probs=None, check=2):
    return padded_output.new_empty(original_size, padded_output.shape[1])


@torch.library.register_fake("padmoe::unpad_from_alignment_backward")
def _(grad_out, padded_output, permutation_map, probs, need_pgrad, check=2):
    return torch.empty_like(padded_output), fake_wgrad(padded_output, probs, grad_out.shape[0], need_pgrad)


def unpad_from_alignment(
    padded_output: Tensor,
    permutation_map: Tensor,
    original_size: int,
    probs: Optional[Tensor] = None,
    *,
    check: Optional[bool] = None,
) -> Tensor:
    """Megatron ``unpad_from_alignment(padded_output, permutation_map, original_size, probs=None)``
    -> ``out[original_size, H]``: ``out[map[p]] = padded_output[p]`` (times ``probs[map[p]]``)
    for every ``map[p] >= 0``; rows no entry names are zero. No host synchronization.
    Differentiable wrt ``padded_output`` and ``probs``."""
    op, default = call("unpad_from_alignment")
    return op(padded_output, permutation_map, original_size, probs, mode(check, default))


def unpad_from_alignment_backward(
    grad_out: Tensor,
    padded_output: Tensor,
    permutation_map: Tensor,
    probs: Optional[Tensor] = None,
    *,
    check: Optional[bool] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backward of :func:`unpad_from_alignment`, called explicitly: ``(grad_padded, grad_probs)``
    with ``grad_padded[p] = grad_out[map[p]]`` (times ``probs[map[p]]``), zero where ``map[p] < 0``,
    and ``grad_probs[n] = <grad_out[n], padded_output[p]>`` for the p with ``map[p] == n`` (probs' dtype)
    when probs are given, else None."""
    gp, gr = ops.unpad_from_alignment_backward.default(
        grad_out, padded_output, permutation_map, probs, probs is not None, eager_mode(check)
    )
    return gp, (gr if probs is not None else None)


@torch.library.register_fake("padmoe::unpad_from_alignment_scaled")
def _(padded_output, permutation_map, original_size, padded_scales, check=2):
    return padded_output.new_empty(original_size, padded_output.shape[1]), fake_scales(padded_scales, original_size)


def unpad_from_alignment_scaled(
    padded_output: Tensor,
    permutation_map: Tensor,
    original_size: int,
    padded_scales: Tensor,
    *,
    check: Optional[bool] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`unpad_from_alignment` of quantized rows with their scales: ``(out, out_scales)``, rows no
    entry names get zero data and scale 1. Unweighted; not differentiable."""
    return ops.unpad_from_alignment_scaled.default(
        padded_output, permutation_map, original_size, padded_scales, eager_mode(check)
    )


# ---------------------------------------------------------------------------
# Expert parallelism: the chunk sort after an all-to-all
# ---------------------------------------------------------------------------


@torch.library.register_fake("padmoe::sort_chunks")
def _(received, split_sizes, num_ranks, alignment, sorted_index=None, check=2, zero_padding=True, rows=-1):
    p = rows if rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    e = split_sizes.numel() // num_ranks
    return (
        received.new_empty(p, received.shape[1]),
        received.new_empty(p, dtype=torch.int32),
        received.new_empty(e, dtype=torch.int32),
    )


def sort_chunks(
    received: Tensor,
    split_sizes: Tensor,
    num_ranks: int,
    alignment: int,
    sorted_index: Optional[Tensor] = None,
    *,
    rows: Optional[int] = None,
    check: Optional[bool] = None,
    zero_padding: bool = True,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The chunk sort after an expert-parallel all-to-all -> ``(padded[P, H],
    permutation_map[P] int32, inclusive_offsets[E] int32)``: ``received[N, H]`` is rank-major
    (chunk ``r*E + e`` holds ``split_sizes[r, e]`` rows, ``split_sizes`` ``[R, E]`` or ``[R*E]``);
    output position ``j`` holds chunk ``sorted_index[j]`` (TransformerEngine's
    ``moe_sort_chunks_by_index``) or, by default, ``(j % R)*E + j // R`` (expert-major); each group
    of R consecutive positions (a local expert) padded to a multiple of ``alignment`` (zero rows, -1
    in the map); ``inclusive_offsets`` are the grouped-GEMM ``offs``. Rows past
    ``sum(split_sizes)`` are ignored (zero gradient).

    ``rows=None`` gives exactly P rows (read on the host: one synchronization on CUDA);
    ``rows=n`` (e.g. ``padmoe.sort_chunks_rows_bound(N, R*E, R, alignment)``) gives n rows with the
    rows past P zero: static shapes, no synchronization with ``check=False`` (the default under
    torch.compile). Differentiable wrt ``received`` (backward: :func:`unsort_chunks` of the
    gradient)."""
    return ops.sort_chunks.default(
        received,
        split_sizes,
        int(num_ranks),
        int(alignment),
        sorted_index,
        eager_mode(check),
        bool(zero_padding),
        -1 if rows is None else int(rows),
    )


def unsort_chunks(
    padded: Tensor,
    permutation_map: Tensor,
    received_rows: int,
    probs: Optional[Tensor] = None,
    *,
    check: Optional[bool] = None,
) -> Tensor:
    """The inverse of :func:`sort_chunks` -> ``out[received_rows, H]`` rank-major again:
    ``out[map[p]] = padded[p]`` (times ``probs[map[p]]``, probs by rank-major row), padding
    dropped, rows no entry names zero. Exactly :func:`unpad_from_alignment` (the same operator
    and autograd: the backward of the rows is the sort's move again). No host synchronization."""
    return unpad_from_alignment(padded, permutation_map, received_rows, probs, check=check)
