"""The drop-ins on numpy arrays (and torch tensors, as padmoe.torch has them): MegaBlocks'
padded_gather / padded_scatter / padded_scatter_wgrad, Megatron's pad_to_alignment /
unpad_from_alignment, their scaled forms and backward (the chunk sort and copy: _chunk_ops.py).
Their padded outputs have exactly P rows, as MegaBlocks' and Megatron's have."""

from __future__ import annotations

from typing import Optional, Tuple

from ._args import checked_rows, no_cols
from ._arrays import arrays_of, last_entry, ndim, prepare
from ._common import (
    _C,
    _UNSET,
    Array,
    _cols,
    _native_scales,
    _options,
    _padded_out,
    _scales_out,
    _split_out,
    _tokens,
    _weight_grad,
)

# ---------------------------------------------------------------------------
# 2. MegaBlocks family (input in token order)
# ---------------------------------------------------------------------------


def _gather_rows(arrays, op, x, indices, bin_ids, bins, padded_bins, top_k, weights, rows, out, opts):
    """padded_gather's output: P rows, checked before they are allocated (the scaled form checks x and
    the routing alike)."""
    return _padded_out(
        arrays,
        op,
        x,
        rows,
        out,
        lambda: checked_rows(
            arrays,
            x,
            last_entry(arrays, padded_bins),
            opts,
            lambda y0: _C.padded_gather_out(
                no_cols(x, _tokens(indices, top_k)), indices, bin_ids, bins, padded_bins, top_k, weights, y0, **opts
            ),
        ),
    )


def padded_gather(
    x: Array,
    indices: Array,
    bin_ids: Array,
    bins: Array,
    padded_bins: Array,
    top_k: int,
    weights: Optional[Array] = None,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
    rows: Optional[int] = None,
    out: Optional[Array] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Array:
    """MegaBlocks ``padded_gather``: ``y[P, H]``, sorted position ``i`` of expert ``e`` lands in
    padded row ``padded_start(e) + i - real_start(e)`` and holds ``x[indices[i] // top_k]``
    (times ``weights[indices[i]]`` when given); padding rows are zero.

    ``x[T, H]`` float32/float16/bfloat16 (float8 without weights), any row
    stride; ``weights[A]`` float32 or x's dtype. Returns x's dtype.
    ``zero_padding=False`` leaves padding rows unwritten (for consumers that skip them: DeepGEMM with
    the -1 row layout, masked grouped GEMMs; an inference forward only, never rows a weight gradient
    reduces over)."""
    op = "padded_gather"
    arrays = arrays_of(x, op, "x")
    x, indices, bin_ids, bins, padded_bins, weights, out = prepare(
        arrays, x, indices, bin_ids, bins, padded_bins, weights, out
    )
    opts = _options(arrays, x, check, num_threads, workspace, stream, zero_padding, out is not None)
    y = _gather_rows(arrays, op, x, indices, bin_ids, bins, padded_bins, top_k, weights, rows, out, opts)
    _C.padded_gather_out(x, indices, bin_ids, bins, padded_bins, top_k, weights, y, **opts)
    return y


def padded_gather_scaled(
    x: Array,
    indices: Array,
    bin_ids: Array,
    bins: Array,
    padded_bins: Array,
    top_k: int,
    x_scales: Array,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
    rows: Optional[int] = None,
    out: Optional[Tuple[Array, Array]] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Tuple[Array, Array]:
    """:func:`padded_gather` of quantized rows with their scales moved in the same pass:
    ``(y, y_scales)`` with P rows. Scales: per-row float32 ``[T]`` / ``[T, 1]``, per-128-column
    float32 ``[T, ceil(H/128)]`` or MXFP8 E8M0 uint8 ``[T, ceil(H/32)]``; padding rows get scale 1.
    Unweighted. ``out=(y, y_scales)``."""
    op = "padded_gather_scaled"
    arrays = arrays_of(x, op, "x")
    out_y, out_s = _split_out(op, out, 2)
    x, indices, bin_ids, bins, padded_bins, x_scales, out_y, out_s = prepare(
        arrays, x, indices, bin_ids, bins, padded_bins, x_scales, out_y, out_s
    )
    opts = _options(arrays, x, check, num_threads, workspace, stream, zero_padding, out_y is not None)
    y = _gather_rows(arrays, op, x, indices, bin_ids, bins, padded_bins, top_k, None, rows, out_y, opts)
    ys = _scales_out(arrays, x_scales, y.shape[0], x, out_s)
    _C.padded_gather_scaled_out(
        x,
        indices,
        bin_ids,
        bins,
        padded_bins,
        top_k,
        _native_scales(arrays, x_scales),
        y,
        _native_scales(arrays, ys),
        **opts,
    )
    return y, ys


def padded_scatter(
    x: Array,
    indices: Array,
    bin_ids: Array,
    weights: Optional[Array],
    bins: Array,
    padded_bins: Array,
    top_k: int,
    *,
    check: Optional[bool] = None,
    out: Optional[Array] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Array:
    """``out[T, H]``: ``out[t] = sum_k w(t*K+k) * x[dest_rows[t*K+k]]`` with
    ``w = weights`` or 1 (pass ``weights=None`` for the unweighted sum),
    accumulated in float32 in ascending k and cast once to x's dtype. Padding
    rows of ``x`` are never read.
    """
    op = "padded_scatter"
    arrays = arrays_of(x, op, "x")
    x, indices, bin_ids, weights, bins, padded_bins, out = prepare(
        arrays, x, indices, bin_ids, weights, bins, padded_bins, out
    )
    opts = _options(arrays, x, check, num_threads, workspace, stream)
    t = _tokens(indices, top_k)
    if out is None and ndim(x) == 2 and int(x.shape[0]) < t:  # x needs P >= A >= T rows: [T, H] fits, or x is bad
        checked_rows(
            arrays,
            x,
            t,
            opts,
            lambda o0: _C.padded_scatter_out(
                no_cols(x), indices, bin_ids, weights, bins, padded_bins, top_k, o0, **opts
            ),
        )
    out = out if out is not None else arrays.empty((t, _cols(x)), x.dtype, x)
    _C.padded_scatter_out(x, indices, bin_ids, weights, bins, padded_bins, top_k, out, **opts)
    return out


def padded_scatter_wgrad(
    x: Array,
    grad: Array,
    indices: Array,
    bin_ids: Array,
    bins: Array,
    padded_bins: Array,
    top_k: int,
    *,
    check: Optional[bool] = None,
    out: Optional[Array] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Array:
    """``wgrad[A]``: ``wgrad[a] = sum_h x[dest_rows[a], h] * grad[a // K, h]``
    accumulated in float32; returned in x's dtype (``out`` may be float32 or
    x's dtype)."""
    op = "padded_scatter_wgrad"
    arrays = arrays_of(x, op, "x")
    x, grad, indices, bin_ids, bins, padded_bins, out = prepare(
        arrays, x, grad, indices, bin_ids, bins, padded_bins, out
    )
    if out is None:
        a = int(indices.shape[0]) if ndim(indices) == 1 else 0
        out = arrays.empty((a,), x.dtype, x)
    _C.padded_scatter_wgrad_out(
        x,
        grad,
        indices,
        bin_ids,
        bins,
        padded_bins,
        top_k,
        out,
        **_options(arrays, x, check, num_threads, workspace, stream),
    )
    return out


def padded_gather_backward(
    grad_y: Array,
    x: Array,
    indices: Array,
    bin_ids: Array,
    bins: Array,
    padded_bins: Array,
    top_k: int,
    weights: Optional[Array] = None,
    *,
    check: Optional[bool] = None,
    out: Optional[Tuple[Array, Optional[Array]]] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`padded_gather`: ``(grad_x, grad_weights)``.

    ``grad_x[T, H] = padded_scatter(grad_y, weights)`` (x's dtype);
    ``grad_weights[a] = <grad_y[dest_rows[a]], x[a // K]>`` in weights' dtype
    when weights were given, else None. ``out=(grad_x, grad_weights)``:
    ``grad_weights`` None skips it; an array is filled even without weights
    (the gradient with respect to unit weights).
    """
    op = "padded_gather_backward"
    arrays = arrays_of(x, op, "x")
    out_x, out_w = _split_out(op, out, 2)
    grad_y, x, indices, bin_ids, bins, padded_bins, weights, out_x, out_w = prepare(
        arrays, grad_y, x, indices, bin_ids, bins, padded_bins, weights, out_x, out_w
    )
    opts = _options(arrays, x, check, num_threads, workspace, stream)
    t = _tokens(indices, top_k)
    if out_x is None and ndim(x) == 2 and int(x.shape[0]) < t:  # x needs T rows: [T, H] fits, or the op rejects x
        checked_rows(
            arrays,
            x,
            t,
            opts,
            lambda g0: _C.padded_gather_backward_out(
                grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, g0, None, **opts
            ),
        )
    grad_x = out_x if out_x is not None else arrays.empty((t, _cols(x)), x.dtype, x)
    a = int(indices.shape[0]) if ndim(indices) == 1 else 0
    grad_w = _weight_grad(arrays, x, weights, out_w if out is not None else _UNSET, a)
    _C.padded_gather_backward_out(
        grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, grad_x, grad_w, **opts
    )
    return grad_x, grad_w


def padded_scatter_backward(
    grad_out: Array,
    y: Array,
    indices: Array,
    bin_ids: Array,
    weights: Optional[Array],
    bins: Array,
    padded_bins: Array,
    top_k: int,
    *,
    check: Optional[bool] = None,
    rows: Optional[int] = None,
    out: Optional[Tuple[Array, Optional[Array]]] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`padded_scatter`: ``(grad_y, grad_weights)``.

    ``grad_y = padded_gather(grad_out, weights)`` with y's rows (y's dtype, padding
    rows and rows past P zero; ``rows=`` allocates that many rows instead);
    ``grad_weights = padded_scatter_wgrad(y, grad_out)`` in weights' dtype when
    weights were given, else None. ``out=(grad_y, grad_weights)`` as in
    :func:`padded_gather_backward`.
    """
    op = "padded_scatter_backward"
    arrays = arrays_of(y, op, "y")
    out_y, out_w = _split_out(op, out, 2)
    grad_out, y, indices, bin_ids, weights, bins, padded_bins, out_y, out_w = prepare(
        arrays, grad_out, y, indices, bin_ids, weights, bins, padded_bins, out_y, out_w
    )
    opts = _options(arrays, y, check, num_threads, workspace, stream, True, out_y is not None)
    grad_y = _padded_out(arrays, op, y, rows, out_y, lambda: int(y.shape[0]) if ndim(y) >= 1 else 0)
    a = int(indices.shape[0]) if ndim(indices) == 1 else 0
    grad_w = _weight_grad(arrays, y, weights, out_w if out is not None else _UNSET, a)
    _C.padded_scatter_backward_out(
        grad_out, y, indices, bin_ids, weights, bins, padded_bins, top_k, grad_y, grad_w, **opts
    )
    return grad_y, grad_w


# ---------------------------------------------------------------------------
# 3. Megatron family (input already expert-grouped)
# ---------------------------------------------------------------------------


def _pad_outputs(arrays, op, hidden_states, tokens_per_expert, alignment, rows, out_p, out_m, out_o, opts):
    """pad_to_alignment's padded rows (P, computed after the op's own checks: counts from bad data never
    size the output), map and offsets."""
    padded = _padded_out(
        arrays,
        op,
        hidden_states,
        rows,
        out_p,
        lambda: _C.pad_to_alignment_rows(hidden_states, tokens_per_expert, alignment, **opts),
    )
    permutation_map = out_m if out_m is not None else arrays.empty((int(padded.shape[0]),), arrays.int32, hidden_states)
    if out_o is None:
        e = int(tokens_per_expert.shape[0]) if ndim(tokens_per_expert) == 1 else 0
        out_o = arrays.empty((e,), arrays.int32, hidden_states)
    return padded, permutation_map, out_o


def pad_to_alignment(
    hidden_states: Array,
    tokens_per_expert: Array,
    alignment: int,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
    rows: Optional[int] = None,
    out: Optional[Tuple[Array, Array, Array]] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Tuple[Array, Array, Array]:
    """Megatron ``pad_to_alignment``: ``(padded[P, H], permutation_map[P] int32,
    inclusive_offsets[E] int32)``: expert e's rows of ``hidden_states[N, H]`` keep their order and
    move to its aligned segment; padding rows are zero and map to -1; ``inclusive_offsets`` are the
    padded inclusive cumulative sums (grouped-GEMM offsets). Rows past ``sum(tokens_per_expert)``
    are ignored.

    P is computed from ``tokens_per_expert`` (on CUDA: one synchronization); ``rows=n`` allocates n
    rows instead (``permutation_map`` entries past P are -1, rows past P zero)."""
    op = "pad_to_alignment"
    arrays = arrays_of(hidden_states, op, "hidden_states")
    out_p, out_m, out_o = _split_out(op, out, 3)
    hidden_states, tokens_per_expert, out_p, out_m, out_o = prepare(
        arrays, hidden_states, tokens_per_expert, out_p, out_m, out_o
    )
    opts = _options(arrays, hidden_states, check, num_threads, workspace, stream, zero_padding, out_p is not None)
    padded, permutation_map, out_o = _pad_outputs(
        arrays, op, hidden_states, tokens_per_expert, alignment, rows, out_p, out_m, out_o, opts
    )
    _C.pad_to_alignment_out(hidden_states, tokens_per_expert, alignment, padded, permutation_map, out_o, **opts)
    return padded, permutation_map, out_o


def pad_to_alignment_scaled(
    hidden_states: Array,
    tokens_per_expert: Array,
    alignment: int,
    hidden_scales: Array,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
    rows: Optional[int] = None,
    out: Optional[Tuple[Array, Array, Array, Array]] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Tuple[Array, Array, Array, Array]:
    """:func:`pad_to_alignment` of quantized rows with their scales (layouts as
    :func:`padded_gather_scaled`): ``(padded, padded_scales, permutation_map, inclusive_offsets)``;
    padding rows get scale 1. ``out=`` takes the four."""
    op = "pad_to_alignment_scaled"
    arrays = arrays_of(hidden_states, op, "hidden_states")
    out_p, out_s, out_m, out_o = _split_out(op, out, 4)
    hidden_states, tokens_per_expert, hidden_scales, out_p, out_s, out_m, out_o = prepare(
        arrays, hidden_states, tokens_per_expert, hidden_scales, out_p, out_s, out_m, out_o
    )
    opts = _options(arrays, hidden_states, check, num_threads, workspace, stream, zero_padding, out_p is not None)
    padded, permutation_map, out_o = _pad_outputs(
        arrays, op, hidden_states, tokens_per_expert, alignment, rows, out_p, out_m, out_o, opts
    )
    padded_scales = _scales_out(arrays, hidden_scales, padded.shape[0], hidden_states, out_s)
    _C.pad_to_alignment_scaled_out(
        hidden_states,
        tokens_per_expert,
        alignment,
        _native_scales(arrays, hidden_scales),
        padded,
        _native_scales(arrays, padded_scales),
        permutation_map,
        out_o,
        **opts,
    )
    return padded, padded_scales, permutation_map, out_o


def _unpad_rows(arrays, op, padded, original_size, out):
    n = int(original_size)
    if out is None:
        if n < 0:
            raise ValueError(f"{op}: original_size: must be >= 0, got {n}")
        return arrays.empty((n, _cols(padded)), padded.dtype, padded)
    if ndim(out) >= 1 and int(out.shape[0]) != n:
        raise ValueError(f"{op}: out: expected original_size = {n} rows, got {int(out.shape[0])}")
    return out


def unpad_from_alignment(
    padded_output: Array,
    permutation_map: Array,
    original_size: int,
    probs: Optional[Array] = None,
    *,
    check: Optional[bool] = None,
    out: Optional[Array] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Array:
    """Megatron ``unpad_from_alignment``: ``out[N, H]`` with ``N = original_size``:
    ``out[map[p]] = padded_output[p]`` (times ``probs[map[p]]`` when given) for every ``map[p] >= 0``;
    rows no entry names are zero. The backward of :func:`pad_to_alignment` is
    ``unpad_from_alignment(grad, permutation_map, N)``."""
    op = "unpad_from_alignment"
    arrays = arrays_of(padded_output, op, "padded_output")
    padded_output, permutation_map, probs, out = prepare(arrays, padded_output, permutation_map, probs, out)
    out = _unpad_rows(arrays, op, padded_output, original_size, out)
    _C.unpad_from_alignment_out(
        padded_output,
        permutation_map,
        probs,
        out,
        **_options(arrays, padded_output, check, num_threads, workspace, stream),
    )
    return out


def unpad_from_alignment_scaled(
    padded_output: Array,
    permutation_map: Array,
    original_size: int,
    padded_scales: Array,
    *,
    check: Optional[bool] = None,
    out: Optional[Tuple[Array, Array]] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Tuple[Array, Array]:
    """:func:`unpad_from_alignment` of quantized rows with their scales: ``(out, out_scales)``, rows no
    entry names get zero data and scale 1. Unweighted. ``out=(out, out_scales)``."""
    op = "unpad_from_alignment_scaled"
    arrays = arrays_of(padded_output, op, "padded_output")
    out_r, out_s = _split_out(op, out, 2)
    padded_output, permutation_map, padded_scales, out_r, out_s = prepare(
        arrays, padded_output, permutation_map, padded_scales, out_r, out_s
    )
    out_r = _unpad_rows(arrays, op, padded_output, original_size, out_r)
    out_s = _scales_out(arrays, padded_scales, int(original_size), padded_output, out_s)
    _C.unpad_from_alignment_scaled_out(
        padded_output,
        permutation_map,
        _native_scales(arrays, padded_scales),
        out_r,
        _native_scales(arrays, out_s),
        **_options(arrays, padded_output, check, num_threads, workspace, stream),
    )
    return out_r, out_s


def unpad_from_alignment_backward(
    grad_out: Array,
    padded_output: Array,
    permutation_map: Array,
    probs: Optional[Array] = None,
    *,
    check: Optional[bool] = None,
    out: Optional[Tuple[Array, Optional[Array]]] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`unpad_from_alignment`: ``(grad_padded, grad_probs)``
    with ``grad_padded[p] = grad_out[map[p]]`` (times ``probs[map[p]]``), zero
    where ``map[p] < 0`` (padded_output's shape and dtype), and
    ``grad_probs[n] = <grad_out[n], padded_output[p]>`` for the p with ``map[p] == n``
    (probs' dtype) when probs were given, else None."""
    op = "unpad_from_alignment_backward"
    arrays = arrays_of(padded_output, op, "padded_output")
    out_p, out_pr = _split_out(op, out, 2)
    grad_out, padded_output, permutation_map, probs, out_p, out_pr = prepare(
        arrays, grad_out, padded_output, permutation_map, probs, out_p, out_pr
    )
    grad_padded = (
        out_p if out_p is not None else arrays.empty(tuple(padded_output.shape), padded_output.dtype, padded_output)
    )
    n = int(grad_out.shape[0]) if ndim(grad_out) >= 1 else 0
    grad_probs = _weight_grad(arrays, padded_output, probs, out_pr if out is not None else _UNSET, n)
    _C.unpad_from_alignment_backward_out(
        grad_out,
        padded_output,
        permutation_map,
        probs,
        grad_padded,
        grad_probs,
        **_options(arrays, padded_output, check, num_threads, workspace, stream),
    )
    return grad_padded, grad_probs
