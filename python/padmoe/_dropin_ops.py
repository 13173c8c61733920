"""The drop-ins on numpy arrays (and torch tensors, as padmoe.torch has them): MegaBlocks'
padded_gather / padded_scatter / padded_scatter_wgrad, Megatron's pad_to_alignment /
unpad_from_alignment, their scaled forms and backward (the chunk sort and copy: _chunk_ops.py).
Their padded outputs have exactly P rows, as MegaBlocks' and Megatron's have. Each function is its
unique part under ``@native_op`` (_native_op.py)."""

from __future__ import annotations

from typing import Optional, Tuple

from ._args import checked_rows, no_cols
from ._arrays import last_entry, ndim
from ._common import _C, Array, _cols, _native_scales, _padded_out, _scales_out, _tokens
from ._native_op import PADDED, PADDED_GRAD, native_op

# ---------------------------------------------------------------------------
# 2. MegaBlocks family (input in token order)
# ---------------------------------------------------------------------------


def _assignments(indices) -> int:
    return int(indices.shape[0]) if ndim(indices) == 1 else 0


def _gather_rows(c, x, indices, bin_ids, bins, padded_bins, top_k, weights):
    """padded_gather's output: P rows, checked before they are allocated (the scaled form checks x and
    the routing alike)."""
    opts = c.opts
    return _padded_out(
        c.arrays,
        c.op,
        x,
        c.rows,
        c.y,
        lambda: checked_rows(
            c.arrays,
            x,
            last_entry(c.arrays, padded_bins),
            opts,
            lambda y0: _C.padded_gather_out(
                no_cols(x, _tokens(indices, top_k)), indices, bin_ids, bins, padded_bins, top_k, weights, y0, **opts
            ),
        ),
    )


@native_op(outputs="y", keywords=PADDED)
def padded_gather(
    c,
    x: Array,
    indices: Array,
    bin_ids: Array,
    bins: Array,
    padded_bins: Array,
    top_k: int,
    weights: Optional[Array] = None,
) -> Array:
    """MegaBlocks ``padded_gather``: ``y[P, H]``, sorted position ``i`` of expert ``e`` lands in
    padded row ``padded_start(e) + i - real_start(e)`` and holds ``x[indices[i] // top_k]``
    (times ``weights[indices[i]]`` when given); padding rows are zero.

    ``x[T, H]`` float32/float16/bfloat16 (float8 without weights), any row
    stride; ``weights[A]`` float32 or x's dtype. Returns x's dtype.
    ``zero_padding=False`` leaves padding rows unwritten (for consumers that skip them: DeepGEMM with
    the -1 row layout, masked grouped GEMMs; an inference forward only, never rows a weight gradient
    reduces over)."""
    c.y = _gather_rows(c, x, indices, bin_ids, bins, padded_bins, top_k, weights)


@native_op(outputs="y y_scales", keywords=PADDED)
def padded_gather_scaled(
    c, x: Array, indices: Array, bin_ids: Array, bins: Array, padded_bins: Array, top_k: int, x_scales: Array
) -> Tuple[Array, Array]:
    """:func:`padded_gather` of quantized rows with their scales moved in the same pass:
    ``(y, y_scales)`` with P rows. Scales: per-row float32 ``[T]`` / ``[T, 1]``, per-128-column
    float32 ``[T, ceil(H/128)]`` or MXFP8 E8M0 uint8 ``[T, ceil(H/32)]``; padding rows get scale 1.
    Unweighted. ``out=(y, y_scales)``."""
    c.y = _gather_rows(c, x, indices, bin_ids, bins, padded_bins, top_k, None)
    c.y_scales = _scales_out(c.arrays, x_scales, c.y.shape[0], x, c.y_scales)


def _token_rows(c, x, indices, top_k, out, stand_in):
    """The ``[T, H]`` output: ``out``, else a new one. x needs P >= A >= T rows, so [T, H] fits unless x
    is bad: with fewer than T rows in x, ``stand_in`` first runs the op on a zero-column stand-in of the
    output (_args.checked_rows), whose checks then reject x before T rows are allocated."""
    t = _tokens(indices, top_k)
    if out is None and ndim(x) == 2 and int(x.shape[0]) < t:
        checked_rows(c.arrays, x, t, c.opts, stand_in)
    return out if out is not None else c.arrays.empty((t, _cols(x)), x.dtype, x)


@native_op(outputs="out")
def padded_scatter(
    c, x: Array, indices: Array, bin_ids: Array, weights: Optional[Array], bins: Array, padded_bins: Array, top_k: int
) -> Array:
    """``out[T, H]``: ``out[t] = sum_k w(t*K+k) * x[dest_rows[t*K+k]]`` with
    ``w = weights`` or 1 (pass ``weights=None`` for the unweighted sum),
    accumulated in float32 in ascending k and cast once to x's dtype. Padding
    rows of ``x`` are never read.
    """
    opts = c.opts
    c.out = _token_rows(
        c,
        x,
        indices,
        top_k,
        c.out,
        lambda o0: _C.padded_scatter_out(no_cols(x), indices, bin_ids, weights, bins, padded_bins, top_k, o0, **opts),
    )


@native_op(outputs="out")
def padded_scatter_wgrad(
    c, x: Array, grad: Array, indices: Array, bin_ids: Array, bins: Array, padded_bins: Array, top_k: int
) -> Array:
    """``wgrad[A]``: ``wgrad[a] = sum_h x[dest_rows[a], h] * grad[a // K, h]``
    accumulated in float32; returned in x's dtype (``out`` may be float32 or
    x's dtype)."""
    if c.out is None:
        c.out = c.arrays.empty((_assignments(indices),), x.dtype, x)


@native_op(outputs="grad_x grad_weights", arrays="x")
def padded_gather_backward(
    c,
    grad_y: Array,
    x: Array,
    indices: Array,
    bin_ids: Array,
    bins: Array,
    padded_bins: Array,
    top_k: int,
    weights: Optional[Array] = None,
) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`padded_gather`: ``(grad_x, grad_weights)``.

    ``grad_x[T, H] = padded_scatter(grad_y, weights)`` (x's dtype);
    ``grad_weights[a] = <grad_y[dest_rows[a]], x[a // K]>`` in weights' dtype
    when weights were given, else None. ``out=(grad_x, grad_weights)``:
    ``grad_weights`` None skips it; an array is filled even without weights
    (the gradient with respect to unit weights).
    """
    opts = c.opts
    c.grad_x = _token_rows(
        c,
        x,
        indices,
        top_k,
        c.grad_x,
        lambda g0: _C.padded_gather_backward_out(
            grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, g0, None, **opts
        ),
    )
    c.grad_weights = c.weight_grad(weights, _assignments(indices))


@native_op(outputs="grad_y grad_weights", arrays="y", keywords=PADDED_GRAD)
def padded_scatter_backward(
    c,
    grad_out: Array,
    y: Array,
    indices: Array,
    bin_ids: Array,
    weights: Optional[Array],
    bins: Array,
    padded_bins: Array,
    top_k: int,
) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`padded_scatter`: ``(grad_y, grad_weights)``.

    ``grad_y = padded_gather(grad_out, weights)`` with y's rows (y's dtype, padding
    rows and rows past P zero; ``rows=`` allocates that many rows instead);
    ``grad_weights = padded_scatter_wgrad(y, grad_out)`` in weights' dtype when
    weights were given, else None. ``out=(grad_y, grad_weights)`` as in
    :func:`padded_gather_backward`.
    """
    c.opts  # made first: this op checks its options before it sizes its output
    c.grad_y = _padded_out(c.arrays, c.op, y, c.rows, c.grad_y, lambda: int(y.shape[0]) if ndim(y) >= 1 else 0)
    c.grad_weights = c.weight_grad(weights, _assignments(indices))


# ---------------------------------------------------------------------------
# 3. Megatron family (input already expert-grouped)
# ---------------------------------------------------------------------------


def _map_and_offsets(c, like, groups):
    """The permutation map (an entry a padded row) and the inclusive offsets (``groups()`` entries)
    an op fills: those from ``out=``, else new int32 arrays."""
    if c.permutation_map is None:
        c.permutation_map = c.arrays.empty((int(c.padded.shape[0]),), c.arrays.int32, like)
    if c.inclusive_offsets is None:
        c.inclusive_offsets = c.arrays.empty((groups(),), c.arrays.int32, like)


def _pad_outputs(c, hidden_states, tokens_per_expert, alignment):
    """pad_to_alignment's padded rows (P, computed after the op's own checks: counts from bad data never
    size the output), map and offsets."""
    opts = c.opts
    c.padded = _padded_out(
        c.arrays,
        c.op,
        hidden_states,
        c.rows,
        c.padded,
        lambda: _C.pad_to_alignment_rows(hidden_states, tokens_per_expert, alignment, **opts),
    )
    _map_and_offsets(c, hidden_states, lambda: int(tokens_per_expert.shape[0]) if ndim(tokens_per_expert) == 1 else 0)


@native_op(outputs="padded permutation_map inclusive_offsets", keywords=PADDED)
def pad_to_alignment(c, hidden_states: Array, tokens_per_expert: Array, alignment: int) -> Tuple[Array, Array, Array]:
    """Megatron ``pad_to_alignment``: ``(padded[P, H], permutation_map[P] int32,
    inclusive_offsets[E] int32)``: expert e's rows of ``hidden_states[N, H]`` keep their order and
    move to its aligned segment; padding rows are zero and map to -1; ``inclusive_offsets`` are the
    padded inclusive cumulative sums (grouped-GEMM offsets). Rows past ``sum(tokens_per_expert)``
    are ignored.

    P is computed from ``tokens_per_expert`` (on CUDA: one synchronization); ``rows=n`` allocates n
    rows instead (``permutation_map`` entries past P are -1, rows past P zero)."""
    _pad_outputs(c, hidden_states, tokens_per_expert, alignment)


@native_op(outputs="padded padded_scales permutation_map inclusive_offsets", keywords=PADDED)
def pad_to_alignment_scaled(
    c, hidden_states: Array, tokens_per_expert: Array, alignment: int, hidden_scales: Array
) -> Tuple[Array, Array, Array, Array]:
    """:func:`pad_to_alignment` of quantized rows with their scales (layouts as
    :func:`padded_gather_scaled`): ``(padded, padded_scales, permutation_map, inclusive_offsets)``;
    padding rows get scale 1. ``out=`` takes the four."""
    _pad_outputs(c, hidden_states, tokens_per_expert, alignment)
    c.padded_scales = _scales_out(c.arrays, hidden_scales, c.padded.shape[0], hidden_states, c.padded_scales)


def _unpad_rows(c, padded, original_size, out):
    n = int(original_size)
    if out is None:
        if n < 0:
            raise ValueError(f"{c.op}: original_size: must be >= 0, got {n}")
        return c.arrays.empty((n, _cols(padded)), padded.dtype, padded)
    if ndim(out) >= 1 and int(out.shape[0]) != n:
        raise ValueError(f"{c.op}: out: expected original_size = {n} rows, got {int(out.shape[0])}")
    return out


@native_op(outputs="out")
def unpad_from_alignment(
    c, padded_output: Array, permutation_map: Array, original_size: int, probs: Optional[Array] = None
) -> Array:
    """Megatron ``unpad_from_alignment``: ``out[N, H]`` with ``N = original_size``:
    ``out[map[p]] = padded_output[p]`` (times ``probs[map[p]]`` when given) for every ``map[p] >= 0``;
    rows no entry names are zero. The backward of :func:`pad_to_alignment` is
    ``unpad_from_alignment(grad, permutation_map, N)``."""
    out = _unpad_rows(c, padded_output, original_size, c.out)
    _C.unpad_from_alignment_out(padded_output, permutation_map, probs, out, **c.opts)  # (N: out's rows)
    return out


@native_op(outputs="out_rows out_scales")
def unpad_from_alignment_scaled(
    c, padded_output: Array, permutation_map: Array, original_size: int, padded_scales: Array
) -> Tuple[Array, Array]:
    """:func:`unpad_from_alignment` of quantized rows with their scales: ``(out, out_scales)``, rows no
    entry names get zero data and scale 1. Unweighted. ``out=(out, out_scales)``."""
    out = _unpad_rows(c, padded_output, original_size, c.out_rows)
    out_scales = _scales_out(c.arrays, padded_scales, int(original_size), padded_output, c.out_scales)
    _C.unpad_from_alignment_scaled_out(
        padded_output,
        permutation_map,
        _native_scales(c.arrays, padded_scales),
        out,
        _native_scales(c.arrays, out_scales),
        **c.opts,
    )
    return out, out_scales


@native_op(outputs="grad_padded grad_probs", arrays="padded_output")
def unpad_from_alignment_backward(
    c, grad_out: Array, padded_output: Array, permutation_map: Array, probs: Optional[Array] = None
) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`unpad_from_alignment`: ``(grad_padded, grad_probs)``
    with ``grad_padded[p] = grad_out[map[p]]`` (times ``probs[map[p]]``), zero
    where ``map[p] < 0`` (padded_output's shape and dtype), and
    ``grad_probs[n] = <grad_out[n], padded_output[p]>`` for the p with ``map[p] == n``
    (probs' dtype) when probs were given, else None."""
    if c.grad_padded is None:
        c.grad_padded = c.arrays.empty(tuple(padded_output.shape), padded_output.dtype, padded_output)
    c.grad_probs = c.weight_grad(probs, int(grad_out.shape[0]) if ndim(grad_out) >= 1 else 0)
