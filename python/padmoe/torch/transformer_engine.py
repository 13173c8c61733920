"""TransformerEngine's MoE permutation API (``transformer_engine.pytorch``) on padmoe: code written
against TE's functions runs with ``import padmoe.torch.transformer_engine as te``.

- ``moe_permute(inp[T, H], routing_map, num_out_tokens, max_token_num=-1, map_type="mask") ->
  (permuted, row_id_map)``. **mask** (``routing_map[T, E]``, bool or 0/1): rows expert-major, tokens
  in order within an expert; ``num_out_tokens`` rows (>= 0; 0 is an empty output, where TE asserts
  > 0): destinations at or past it are dropped (the last in that order: TE's fix of its open
  out-of-bounds bug), rows past the routed count are zero. ``row_id_map[T, 2E+1]`` int32: per token
  its rows in descending order, then their experts, then the count; the rest -1. **index**
  (``routing_map[T, K]`` expert ids, any integer or bool dtype read as int32, as TE casts them): the
  assignments ``t*K + k`` stable-sorted by id read as uint32 (-1 last), ``num_out_tokens`` rows (0:
  T*K), the rest dropped; ``row_id_map[K*T]`` k-major (``row_id_map[k*T + t]``, -1 = dropped).
- ``moe_permute_with_probs(inp, probs[T, E], routing_map, num_out_tokens) -> (output,
  permuted_probs, row_id_map)`` (mask): ``probs`` moved with the rows; a routed slot of probability
  exactly 0 gives a +0.0 row (Megatron's routing-map padding). Unrouted probs are never read.
- ``moe_permute_and_pad_with_probs(inp, probs, routing_map, tokens_per_expert, align_size) ->
  (output, permuted_probs, row_id_map, pad_offsets, target_tokens_per_expert)``: each expert's rows
  padded with zero rows to a multiple of ``align_size``; ``pad_offsets[E]`` (int64, the exclusive
  sum of the pad lengths, None when nothing is padded). The output has exactly P rows, read on the
  host as TE does (one synchronization on CUDA, none when ``tokens_per_expert`` is on the CPU);
  padmoe's ``out_rows=`` keyword is the sync-free form: ``out_rows`` rows (rows past P zero), the
  real size on the device (``target_tokens_per_expert.sum()``), ``pad_offsets`` always a tensor.
- ``moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask",
  probs=None, pad_offsets=None) -> output[T, H]``: each token's rows summed (times
  ``merging_probs[T, E]`` or ``[T, K]``), float32 accumulation, one rounding. Index map without
  probs: ``[T*K, H]`` k-major, one row per map entry (TE's behaviour). ``probs`` is TE's deprecated
  name of ``merging_probs``. A ``row_id_map`` padmoe's permute did not make is verified first
  (``check=``, eager default).
- ``moe_sort_chunks_by_index(inp, split_sizes[S], sorted_index[S]) -> output`` and
  ``moe_sort_chunks_by_index_with_probs(inp, probs[T], split_sizes, sorted_index) -> (output,
  permuted_probs)``: output position j holds chunk ``sorted_index[j]``, chunks back to back; rows
  past ``sum(split_sizes)`` stay where they are.

All are differentiable as in TE: the permute's input gradient sums each token's rows (a row zeroed
for probability 0 passes its gradient too), ``probs``' gradient is the moved probs' gradient, the
unpermute's gradients are the spread rows (zero where no token lands) and, with
``merging_probs``, float32 dot products in their dtype. Empty input returns ``inp.clone()`` and
float32 empty tensors, as TE. Nothing reads the device on the host except the exact-size padded
form and the ``check`` of the eager calls noted below; outputs are bitwise deterministic.

The permutes are padmoe plans: the mask map becomes a plan, TE's row_id_map and the moved probs in
one native operator (``torch.ops.padmoe.mask_plan``), the index map a plan of ``make_plan`` (with
``num_experts``) or of the native ``index_plan`` operator (a radix sort of any int32 ids), and
padmoe's ``dispatch`` / ``combine`` move the rows. ``moe_unpermute`` uses the plan its
``moe_permute`` kept on ``row_id_map`` (eager mode), else rebuilds one from ``row_id_map``.

Where padmoe differs from TE: CPU tensors run too; the unwritten rows of TE's outputs (rows past
the routed count, the input gradient's rows no token uses) are zero; padmoe sums in ascending
expert order where TE's mask path sums descending, and in float32 where TE's index path sums in
the rows' dtype; a non-finite row routed with probability 0 gives NaN where TE writes zeros;
``num_out_tokens`` drops on the mask path (TE writes past its output). padmoe's keywords:
``num_experts=`` (index map: ids in ``[0, E)`` or -1, sorted by padmoe's plan, a counting sort,
and checked in eager mode), ``out_rows=`` (above), ``check=`` (eager default: the index ids with
``num_experts``, ``tokens_per_expert`` against the map, the chunk sizes and order; one read of the
device each; ``check=False`` reads nothing).

TE's quantized (FP8) tensors, told by their attributes (TE is never imported here): the mask-map
permutes (all three) take, as TE, a ``Float8Tensor`` (``_data`` moved, ``_scale_inv`` passed on), a
``Float8BlockwiseQTensor`` of 1x128 blocks and an ``MXFP8Tensor`` with compact scales
(``_rowwise_data`` moved with the rows of ``_rowwise_scale_inv``; a row of probability 0 gets zero
codes, its scales still moved), and return a tensor of the input's own class, made by its
constructor from ``get_metadata()`` (no column-wise data, no quantizer); the chunk sorts take the
three (TE: ``Float8Tensor`` only); the index map's permute and unpermute read the input dequantized
(``inp.dequantize()``), as TE's do; the mask unpermute takes none (TE neither). Codes and scales are
bit copies; a quantized input that requires a gradient gets TE's plain gradient. Not under
torch.compile (TE neither)."""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from padmoe.torch import sort_chunks

from . import _te_plans as tp
from ._common import Tensor, compiling, host_check, plan_slices
from ._plan_ops import combine
from ._te_checks import (
    _MAX_ROWS,
    _check_chunks,
    _check_counts,
    _check_index,
    _check_index_map,
    _check_integer,
    _check_map,
    _check_mask_map,
    _check_merging_probs,
    _check_out_tokens,
    _check_probs,
    _check_rows,
    _dequantized,
    _fp8_rows,
    _is_int,
    _is_quantized,
    _same_device,
)

__all__ = [
    "moe_permute",
    "moe_permute_with_probs",
    "moe_permute_and_pad_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
]


# ---------------------------------------------------------------------------
# permute / unpermute
# ---------------------------------------------------------------------------

_ATTR = "_padmoe_te_plan"  # the plan moe_permute made, kept on its row_id_map for moe_unpermute


class _Permute(torch.autograd.Function):
    """dispatch by a plan, ``probs`` moved with the rows; the backward sums each token's rows (a
    row zeroed for probability 0 passes its gradient too, as in TE) and gathers the gradient of
    the moved probs."""

    @staticmethod
    def forward(ctx, inp, probs, packed, top_k, num_experts, capacity, weights, sources, rows, moved_in=None):
        y = torch.ops.padmoe.dispatch.default(
            inp, packed, weights, top_k, num_experts, alignment=1, expert_capacity=capacity, check=0, zero_padding=True
        )
        ctx.tokens = inp.shape[0]
        moved = None
        if moved_in is not None:  # moved by the plan's operator (mask_plan): an output of its own here
            moved = _head(moved_in, moved_in.shape[0])
        elif probs is not None:
            moved = tp.moved_probs(probs, packed, inp.shape[0], top_k, num_experts, capacity, sources)
        if 0 <= rows < y.shape[0]:
            # the first `rows` rows hold every destination: the gradient comes with as many rows, and
            # dispatch_backward reads only the destinations (no zero-padded copy of it is made)
            y = _head(y, rows)
            moved = None if moved is None else _head(moved, rows)
        ctx.plan = (top_k, num_experts, capacity)
        ctx.probs_shape = None if probs is None else probs.shape
        ctx.save_for_backward(packed)
        return y, moved

    @staticmethod
    def backward(ctx, grad_y, grad_moved):
        (packed,) = ctx.saved_tensors
        top_k, num_experts, capacity = ctx.plan
        grad_inp = grad_probs = None
        if ctx.needs_input_grad[0] and grad_y is not None:
            grad_inp, _ = torch.ops.padmoe.dispatch_backward.default(
                grad_y.contiguous(),
                None,
                packed,
                None,
                top_k,
                num_experts,
                alignment=1,
                expert_capacity=capacity,
                need_wgrad=False,
                check=0,
            )
        if ctx.needs_input_grad[1] and grad_moved is not None:
            # grad_probs[a] = grad_moved[dest_rows[a]], 0 where a has no row
            a = ctx.tokens * top_k
            dest = packed[plan_slices(ctx.tokens, top_k, num_experts, 1, capacity).dest_rows].long()
            live = (dest >= 0) & (dest < grad_moved.numel())
            picked = grad_moved[torch.where(live, dest, 0)] if grad_moved.numel() else grad_moved.new_zeros(a)
            grad_probs = torch.where(live, picked, 0).reshape(ctx.probs_shape)
        return grad_inp, grad_probs, None, None, None, None, None, None, None, None


def _head(t: Tensor, rows: int) -> Tensor:
    """The first ``rows`` rows of ``t`` as a tensor of their own, on ``t``'s memory but not a view
    of it: autograd forbids modifying in place a view made inside a Function, and callers of the
    permute may (the unused rows past ``rows`` stay allocated with it)."""
    shape = (rows,) + tuple(t.shape[1:])
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape, t.stride())


def _permute(inp, probs, plan, weights, sources, rows=None, moved=None):
    """(rows, moved probs) of ``plan``: its first ``rows`` rows (default: all). ``moved``: the plan
    operator's (probs moved, weights) (eager mode), else the probs are moved here. Under torch.compile
    the rows are a slice of the whole (its backward pads the gradient; the compiler may fuse it)."""
    head = -1 if rows is None or compiling() else rows
    moved = None if moved is None else moved[0]
    y, moved = _Permute.apply(
        inp, probs, plan.packed, plan.top_k, plan.num_experts, plan.expert_capacity, weights, sources, head, moved
    )
    if rows is not None and head < 0 and rows < y.shape[0]:
        y, moved = y[:rows], (None if moved is None else moved[:rows])
    return y, moved


class _QuantizedPermute(_Permute):
    """:class:`_Permute` of a TE quantized tensor (``q`` in the place of the weights): codes and scale
    rows moved by the plan, the output of the input's own class (``_te_plans.permute_quantized``).
    The backward is _Permute's: the gradient comes as a plain tensor, as in TE."""

    @staticmethod
    def forward(ctx, inp, probs, packed, top_k, num_experts, capacity, q, sources, rows):
        moved = None
        if probs is not None:
            moved = tp.moved_probs(probs, packed, inp.shape[0], top_k, num_experts, capacity, sources)
            moved = _head(moved, rows) if 0 <= rows < moved.shape[0] else moved
        out = tp.permute_quantized(inp, q, moved, packed, top_k, num_experts, capacity, rows)
        ctx.tokens = inp.shape[0]
        ctx.plan = (top_k, num_experts, capacity)
        ctx.probs_shape = None if probs is None else probs.shape
        ctx.save_for_backward(packed)
        return out, moved


def _permute_quantized(inp, q, probs, plan, sources, rows=None):
    """_permute of a TE quantized tensor (eager mode only)."""
    args = (plan.packed, plan.top_k, plan.num_experts, plan.expert_capacity, q, sources)
    return _QuantizedPermute.apply(inp, probs, *args, -1 if rows is None else rows)


def _empty_float(inp: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=inp.device)


class _Empty(torch.autograd.Function):
    """TE's empty-input result: ``(inp.clone(), float32 empty)``, the gradient passed through and
    ``probs``' gradient zero (so that a caller reading ``probs.grad`` finds a tensor, as with TE)."""

    @staticmethod
    def forward(ctx, inp, probs):
        ctx.probs_like = None if probs is None else (probs.shape, probs.dtype, probs.device)
        return inp.clone(), _empty_float(inp)

    @staticmethod
    def backward(ctx, grad, _grad_moved):
        gp = None
        if ctx.probs_like is not None and ctx.needs_input_grad[1]:
            shape, dtype, device = ctx.probs_like
            gp = torch.zeros(shape, dtype=dtype, device=device)
        return grad, gp


def _keep(row_id_map: Tensor, plan, padded: bool, rows: int) -> None:
    """Keeps the plan on row_id_map for moe_unpermute (eager mode: under torch.compile the
    unpermute rebuilds it from the map)."""
    if not compiling():
        setattr(row_id_map, _ATTR, (plan, padded, rows))


def _kept(row_id_map: Tensor, padded: bool, rows: int):
    """The plan moe_permute kept on row_id_map, if it was made for this unpermute's input."""
    kept = None if compiling() else getattr(row_id_map, _ATTR, None)
    return kept[0] if kept is not None and kept[1] == padded and kept[2] == rows else None


def _nonzero_weights(probs: Tensor, made) -> Tensor:
    """float32 ``[T*E]``: 1 where ``probs`` is nonzero (NaN included), else 0; the dispatch weights
    that zero the rows of probability 0: the plan operator's (``made``: its pair) when it made them,
    else one comparison written straight into float32 (no bool tensor and cast)."""
    if made is not None:
        return made[1]
    flat = probs.detach().reshape(-1)
    return torch.ne(flat, 0, out=torch.empty(flat.shape, dtype=torch.float32, device=flat.device))


def _mask_permute(op, inp, routing_map, num_out_tokens, probs):
    # 0 rows is a legal output (local experts that receive nothing: num_out_tokens =
    # int(routing_map.sum()) = 0); every destination is then dropped
    _check_out_tokens(op, num_out_tokens, True)
    _check_map(op, inp, routing_map)
    if probs is not None:
        _check_probs(op, probs, routing_map)
    q = _fp8_rows(op, inp)
    plan, row_id_map, moved = tp.mask_plan(routing_map, num_out_tokens, tp.plan_probs(probs, q))
    _, sources = tp.plan_views(plan)
    if q is not None:
        out, moved = _permute_quantized(inp, q, probs, plan, sources)
        _keep(row_id_map, plan, False, num_out_tokens)
        return out, moved, row_id_map
    weights = None if probs is None else _nonzero_weights(probs, moved)  # probability 0: a zero row
    out, moved = _permute(inp, probs, plan, weights, sources, moved=moved)
    _keep(row_id_map, plan, False, num_out_tokens)
    return out, moved, row_id_map


def moe_permute(
    inp: Tensor,
    routing_map: Tensor,
    num_out_tokens: int,
    max_token_num: int = -1,
    map_type: str = "mask",
    *,
    num_experts: Optional[int] = None,
    check: Optional[bool] = None,
) -> Tuple[Tensor, Tensor]:
    """TE's ``moe_permute -> (permuted_inp, row_id_map)`` (this module's docstring): map_type "mask"
    (``routing_map[T, E]``) or "index" (``routing_map[T, K]`` expert ids). ``max_token_num`` is
    accepted and ignored (TE sizes a workspace by it). ``num_experts`` (index map only, padmoe's
    keyword): the ids are in ``[0, num_experts)`` or -1, and padmoe's plan sorts them (a counting
    sort; without it, the ``index_plan`` operator's radix sort does)."""
    op = "moe_permute"
    if map_type not in ("mask", "index"):
        raise ValueError(f"{op}: map_type: expected 'mask' or 'index', got {map_type!r}")
    _check_rows(op, inp)
    if map_type == "index":
        inp = _dequantized(op, inp)  # as TE: a quantized inp is permuted dequantized on the index map
    if inp.numel() == 0:
        return inp.clone(), _empty_float(inp)
    if map_type == "mask":
        out, _, row_id_map = _mask_permute(op, inp, routing_map, num_out_tokens, None)
        return out, row_id_map
    _check_map(op, inp, routing_map, "index")
    routing_map = tp.int_ids(routing_map)
    _check_out_tokens(op, num_out_tokens, False)
    t, k = routing_map.shape
    rows = num_out_tokens if num_out_tokens > 0 else t * k
    if rows > _MAX_ROWS:
        raise ValueError(f"{op}: routing_map: T*K = {rows} rows, more than 2^31 - 1")
    if num_experts is not None:
        if not _is_int(num_experts) or num_experts < 1:
            raise ValueError(f"{op}: num_experts: expected an int >= 1, got {num_experts!r}")
        if not compiling() and host_check(check, inp):
            _check_index(op, routing_map, num_experts)
    plan = tp.index_plan(routing_map, rows, num_experts)
    dest, sources = tp.plan_views(plan)
    row_id_map, side = _k_major(dest, t, k)
    out, _ = _permute(inp, None, plan, None, sources)
    if side is not None:
        torch.cuda.current_stream(inp.device).wait_stream(side)
    _keep(row_id_map, plan, False, rows)
    return out, row_id_map


_SIDE_STREAMS = {}  # device index -> the stream of _k_major's graph branch


def _k_major(dest: Tensor, t: int, k: int):
    """TE's k-major ``row_id_map[k*T + t]`` from the plan's token-major ``dest_rows``: ``(map,
    stream to join or None)``. While a CUDA graph is captured the copy is a branch of the graph
    beside the rows' dispatch (a side stream that the caller joins after it), so that in the graph
    it costs no time of its own; eagerly it is one copy on the current stream (a fork and join cost
    the host more than the copy)."""
    if not dest.is_cuda or compiling() or not torch.cuda.is_current_stream_capturing():
        return dest.view(t, k).t().reshape(-1), None
    main = torch.cuda.current_stream(dest.device)
    side = _SIDE_STREAMS.get(dest.device.index)
    if side is None:
        side = _SIDE_STREAMS.setdefault(dest.device.index, torch.cuda.Stream(dest.device))
    row_id_map = torch.empty(t * k, dtype=dest.dtype, device=dest.device)  # on the current stream
    side.wait_stream(main)
    with torch.cuda.stream(side):
        row_id_map.view(k, t).copy_(dest.view(t, k).t())
    return row_id_map, side


def moe_permute_with_probs(
    inp: Tensor, probs: Tensor, routing_map: Tensor, num_out_tokens: int
) -> Tuple[Tensor, Tensor, Tensor]:
    """TE's ``moe_permute_with_probs -> (output, permuted_probs, row_id_map)`` (mask map): the rows
    and their probabilities; a routed slot of probability 0 gives a zero row."""
    op = "moe_permute_with_probs"
    _check_rows(op, inp, weighted=True)
    if inp.numel() == 0:
        out, moved = _Empty.apply(inp, probs if isinstance(probs, Tensor) else None)
        return out, moved, _empty_float(inp)
    return _mask_permute(op, inp, routing_map, num_out_tokens, probs)


def moe_permute_and_pad_with_probs(
    inp: Tensor,
    probs: Tensor,
    routing_map: Tensor,
    tokens_per_expert: Tensor,
    align_size: int,
    *,
    out_rows: Optional[int] = None,
    check: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Tensor]:
    """TE's ``moe_permute_and_pad_with_probs -> (output, permuted_probs, row_id_map, pad_offsets,
    target_tokens_per_expert)``: each expert's rows padded with zero rows to a multiple of
    ``align_size``. As TE, the output has exactly P rows, read on the host (and ``pad_offsets`` is
    None when no expert needs padding): one synchronization on CUDA unless ``tokens_per_expert``
    is a CPU tensor. ``out_rows`` (padmoe's keyword) is the sync-free form: the output has
    ``out_rows`` rows (at least P; rows past P zero), ``pad_offsets`` is always a tensor, and
    nothing is read on the host."""
    op = "moe_permute_and_pad_with_probs"
    if tokens_per_expert is None:
        raise ValueError(f"{op}: tokens_per_expert: must be given (the count of each expert)")
    if not _is_int(align_size) or align_size <= 0:
        raise ValueError(f"{op}: align_size: expected an int > 0, got {align_size!r}")
    _check_rows(op, inp, weighted=True)
    _check_map(op, inp, routing_map)
    _check_probs(op, probs, routing_map)
    q = _fp8_rows(op, inp)
    e = routing_map.shape[1]
    if not isinstance(tokens_per_expert, Tensor) or tuple(tokens_per_expert.shape) != (e,):
        raise ValueError(f"{op}: tokens_per_expert: expected a tensor of shape [{e}], got {tokens_per_expert!r}")
    counts = tokens_per_expert.to(torch.int64)
    target = (counts + align_size - 1) // align_size * align_size
    pads = target - counts
    pad_offsets = torch.cumsum(pads, 0) - pads
    if out_rows is None:
        host = counts.cpu()  # TE's size: on CUDA one synchronization (none for CPU counts)
        host_target = (host + align_size - 1) // align_size * align_size
        rows = int(host_target.sum())
        if rows > _MAX_ROWS:
            raise ValueError(f"{op}: tokens_per_expert: the padded total {rows} is more than 2^31 - 1 rows")
        if not compiling() and host_check(check, inp):
            _check_counts(op, routing_map, host)
        if bool((host_target == host).all()):
            pad_offsets = None
    else:
        if not _is_int(out_rows) or out_rows < 0 or out_rows > _MAX_ROWS:
            raise ValueError(f"{op}: out_rows: expected an int in [0, 2^31), got {out_rows!r}")
        rows = out_rows
        if not compiling() and host_check(check, inp):
            _check_counts(op, routing_map, counts, out_rows, int(target.sum()))
    target = target.to(inp.device)
    pad_offsets = None if pad_offsets is None else pad_offsets.to(inp.device)
    if inp.numel() == 0:
        out, moved = _Empty.apply(inp, probs)
        return out, moved, _empty_float(inp), pad_offsets, target
    plan, row_id_map, moved = tp.padded_mask_plan(routing_map, align_size, rows, tp.plan_probs(probs, q))
    _, sources = tp.plan_views(plan)
    if q is not None:
        out, moved = _permute_quantized(inp, q, probs, plan, sources, rows)
    else:
        out, moved = _permute(inp, probs, plan, _nonzero_weights(probs, moved), sources, rows, moved)
    _keep(row_id_map, plan, True, rows)
    return out, moved, row_id_map, pad_offsets, target


def moe_unpermute(
    inp: Tensor,
    row_id_map: Tensor,
    merging_probs: Optional[Tensor] = None,
    restore_shape: Optional[torch.Size] = None,
    map_type: str = "mask",
    probs: Optional[Tensor] = None,
    pad_offsets: Optional[Tensor] = None,
    *,
    check: Optional[bool] = None,
) -> Tensor:
    """TE's ``moe_unpermute -> output``: each token's rows summed back (times ``merging_probs``
    when given), float32 accumulation in ascending expert order (mask) or ascending k (index),
    cast once. ``probs`` is TE's deprecated name of ``merging_probs``. A ``row_id_map`` that
    padmoe's permute did not make (or any map under torch.compile) is read as TE defines it;
    ``check`` (eager default) first verifies it on the host (one read of the device): integer
    entries, each token's experts in ``[0, E)`` and distinct, its rows naming each output row of
    the permute once, ``pad_offsets[E]`` keeping them inside ``inp``."""
    op = "moe_unpermute"
    if probs is not None:
        if merging_probs is not None:
            raise ValueError(f"{op}: both merging_probs and probs are given (probs is deprecated)")
        warnings.warn("moe_unpermute: probs is deprecated, use merging_probs", DeprecationWarning, stacklevel=2)
        merging_probs = probs
    if map_type not in ("mask", "index"):
        raise ValueError(f"{op}: map_type: expected 'mask' or 'index', got {map_type!r}")
    _check_rows(op, inp, weighted=merging_probs is not None)
    if _is_quantized(inp):
        if map_type == "mask":
            raise TypeError(
                f"{op}: inp: a quantized (FP8) tensor is not taken on the mask map (TE's moe_unpermute "
                "does not take one either); pass the rows in high precision, e.g. inp.dequantize()"
            )
        inp = _dequantized(op, inp)  # as TE: the index map's unpermute reads a quantized inp dequantized
    if merging_probs is not None:
        _check_merging_probs(op, merging_probs, inp)
    if inp.numel() == 0:
        return _Empty.apply(inp, merging_probs)[0]
    if not isinstance(row_id_map, Tensor):
        raise TypeError(f"{op}: row_id_map: expected a torch tensor, got {type(row_id_map).__name__}")
    _check_integer(op, "row_id_map", row_id_map, "an integer tensor (TE's int32 map)")
    if not _same_device(row_id_map, inp):
        raise ValueError(f"{op}: row_id_map: expected a tensor on {inp.device}, got {row_id_map.device}")
    if map_type == "index":
        return _unpermute_index(op, inp, row_id_map, merging_probs, check)
    if row_id_map.dim() != 2 or row_id_map.shape[1] % 2 != 1:
        raise ValueError(f"{op}: row_id_map: expected the mask map's [T, 2E+1], got shape {list(row_id_map.shape)}")
    t, w = row_id_map.shape
    e = (w - 1) // 2
    if restore_shape is None:
        restore_shape = inp.shape
    if tuple(restore_shape) != (t, inp.shape[1]):
        raise ValueError(
            f"{op}: restore_shape: expected ({t}, {inp.shape[1]}) (row_id_map's tokens, inp's hidden), "
            f"got {tuple(restore_shape)}"
        )
    if merging_probs is not None and tuple(merging_probs.shape) != (t, e):
        raise ValueError(f"{op}: merging_probs: expected shape [{t}, {e}], got {list(merging_probs.shape)}")
    padded = pad_offsets is not None
    if padded:
        if not isinstance(pad_offsets, Tensor) or tuple(pad_offsets.shape) != (e,):
            got = list(pad_offsets.shape) if isinstance(pad_offsets, Tensor) else type(pad_offsets).__name__
            raise ValueError(f"{op}: pad_offsets: expected a tensor of shape [{e}] (one per expert), got {got}")
        _check_integer(op, "pad_offsets", pad_offsets)
    plan = _kept(row_id_map, padded, inp.shape[0])
    if plan is None and not compiling() and host_check(check, inp):
        _check_mask_map(op, row_id_map, pad_offsets, inp.shape[0])
    if plan is None and padded:
        dest = tp.mask_dest_from_map(row_id_map, pad_offsets)
        plan, _ = tp.padded_plan_from_dest(dest, pad_offsets, inp.shape[0])
    elif plan is None:
        dest = tp.mask_dest_from_map(row_id_map).reshape(-1)
        dest = torch.where(dest < inp.shape[0], dest, -1)
        plan = tp.row_plan(dest, None, (dest >= 0).sum(dtype=torch.int32), inp.shape[0], t, e)
    return combine(inp, plan, merging_probs, check=False)


def _unpermute_index(op, inp, row_id_map, merging_probs, check):
    if row_id_map.dim() != 1:
        raise ValueError(f"{op}: row_id_map: expected the index map's [T*K], got shape {list(row_id_map.shape)}")
    rows = inp.shape[0]
    plan = _kept(row_id_map, False, rows)
    if plan is None and not compiling() and host_check(check, inp):
        _check_index_map(op, row_id_map, row_id_map.numel())
    if merging_probs is None:
        # TE: one output row per map entry (k-major), no sum over k
        live = (row_id_map >= 0) & (row_id_map < rows)
        picked = inp.index_select(0, torch.where(live, row_id_map, 0).long())
        return torch.where(live.unsqueeze(1), picked, picked.new_zeros(()))
    if merging_probs.dim() != 2 or merging_probs.numel() != row_id_map.numel():
        raise ValueError(
            f"{op}: merging_probs: expected [T, K] with T*K = {row_id_map.numel()} (row_id_map's entries), "
            f"got shape {list(merging_probs.shape)}"
        )
    if merging_probs.dtype != torch.float32:
        warnings.warn(f"moe_unpermute: merging_probs is {merging_probs.dtype}; TE reads them as float32", stacklevel=3)
        merging_probs = merging_probs.to(torch.float32)
    t, k = merging_probs.shape
    if plan is None or plan.top_k != k:
        dest = tp.index_dest_from_map(row_id_map, k)
        dest = torch.where(dest < rows, dest, -1)
        plan = tp.row_plan(dest, None, (dest >= 0).sum(dtype=torch.int32), rows, t, k)
    return combine(inp, plan, merging_probs, check=False)


def _chunk_sort(op: str, inp: Tensor, split_sizes: Tensor, sorted_index: Tensor, check: Optional[bool]):
    """padmoe's sort_chunks over S + 1 chunks: TE's S, then the rows past sum(split_sizes) as a last
    chunk that sorts to the end. Returns (output[T, H], permutation_map[T]: the input row of each
    output row)."""
    for name, t in (("inp", inp), ("split_sizes", split_sizes), ("sorted_index", sorted_index)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name}: expected a torch tensor, got {type(t).__name__}")
    if inp.dim() != 2:
        raise ValueError(f"{op}: inp: expected [num_tokens, hidden], got shape {list(inp.shape)}")
    if split_sizes.dim() != 1 or sorted_index.dim() != 1 or split_sizes.numel() != sorted_index.numel():
        raise ValueError(
            f"{op}: split_sizes and sorted_index: expected two 1-D tensors of one length, got shapes "
            f"{list(split_sizes.shape)} and {list(sorted_index.shape)}"
        )
    _check_integer(op, "split_sizes", split_sizes)
    _check_integer(op, "sorted_index", sorted_index)
    chunks = split_sizes.numel()
    device = inp.device
    sizes = split_sizes.to(device=device, dtype=torch.int64)
    order = sorted_index.to(device=device, dtype=torch.int64)
    if not compiling() and host_check(check, inp):  # in TE's terms (the native op sees S + 1 chunks)
        both = torch.cat([sizes, order]).cpu()  # one read of the device (one synchronization on CUDA)
        _check_chunks(op, inp.shape[0], both[:chunks], both[chunks:])
    tail = (inp.shape[0] - sizes.sum()).reshape(1)  # on the device: no host read
    sizes = torch.cat([sizes, tail])
    order = torch.cat([order, torch.full((1,), chunks, dtype=torch.int64, device=device)])
    out, permutation_map, _ = sort_chunks(inp, sizes, 1, 1, order, rows=inp.shape[0], check=check)
    return out, permutation_map


def _sort_chunks_any(op, inp, split_sizes, sorted_index, check):
    """_chunk_sort of a plain tensor or of a TE quantized one (its codes as bytes, its scales with them)."""
    q = _fp8_rows(op, inp)
    if q is None:
        return _chunk_sort(op, inp, split_sizes, sorted_index, check)
    data, perm = _chunk_sort(op, tp.as_bytes(q.data), split_sizes, sorted_index, check)
    return tp.QuantizedChunkSort.apply(inp, q, tp.from_bytes(data, q.data), perm), perm


def moe_sort_chunks_by_index(
    inp: Tensor, split_sizes: Tensor, sorted_index: Tensor, *, check: Optional[bool] = None
) -> Tensor:
    """TE's ``moe_sort_chunks_by_index(inp, split_sizes, sorted_index) -> output`` (this module's
    docstring)."""
    out, _ = _sort_chunks_any("moe_sort_chunks_by_index", inp, split_sizes, sorted_index, check)
    return out


def moe_sort_chunks_by_index_with_probs(
    inp: Tensor, probs: Tensor, split_sizes: Tensor, sorted_index: Tensor, *, check: Optional[bool] = None
) -> Tuple[Tensor, Tensor]:
    """TE's ``moe_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index) ->
    (output, permuted_probs)``: ``permuted_probs[j] = probs[i]`` for the input row i that output
    row j holds, in ``probs``' dtype."""
    op = "moe_sort_chunks_by_index_with_probs"
    if not isinstance(probs, Tensor):
        raise TypeError(f"{op}: probs: expected a torch tensor, got {type(probs).__name__}")
    if isinstance(inp, Tensor) and inp.dim() == 2 and (probs.dim() != 1 or probs.numel() != inp.shape[0]):
        raise ValueError(f"{op}: probs: expected [{inp.shape[0]}] (one per row of inp), got shape {list(probs.shape)}")
    if hasattr(inp, "device") and not _same_device(probs, inp):
        raise ValueError(f"{op}: probs: expected a tensor on {inp.device}, got {probs.device}")
    out, permutation_map = _sort_chunks_any(op, inp, split_sizes, sorted_index, check)
    # every output row holds an input row (alignment 1, the tail chunk last): the map is a permutation
    permuted_probs = probs[permutation_map.long()]
    return out, permuted_probs
