"""padmoe plans for TransformerEngine's routing maps (used by :mod:`padmoe.torch.transformer_engine`).

TE's permute API names the rows of its outputs by routing maps; padmoe moves rows by plans. Every
builder here makes a packed padmoe plan (``Plan._from_packed``) whose ``dest_rows`` are TE's
destination rows, with sync-free tensor ops only (no value is read on the host), so that padmoe's
dispatch / combine operators and their backward do the moves:

- a **row plan** (one expert, capacity R): ``dest_rows[a]`` in ``[0, R)`` or -1, rows
  ``[kept, R)`` zero. TE's unpadded layouts (mask map without padding, index map) fill a prefix
  ``[0, kept)`` of the output, so one expert covers them, and the output has exactly R rows.
- an **expert plan** (E experts, capacity C, ``E*C >= R``): the padded mask layout, whose padding
  rows lie between the experts' rows.

The mask forms come from the native ``mask_plan`` operator (the plan, TE's row_id_map and the probs
moved with the rows, in two or three launches on CUDA); the index form from ``make_plan`` (with
``num_experts``) or the native ``index_plan`` operator (without); the unpermute without a kept
plan rebuilds one from TE's row_id_map.

An assignment is ``a = t*K + k``: for the mask map K = E and ``k`` is the expert (``a = t*E + e``),
for the index map ``k`` is the column of ``index``.

TE's quantized (FP8) tensors: their one-byte codes and their scale rows (any dtype, as bytes) go
through the same operators as float8 rows, which padmoe moves bit for bit; the outputs are tensors
of the input's own class (:func:`quantized_output`)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from padmoe._plan import Plan

from ._common import Tensor, compiling, ops, plan_slices
from ._te_checks import QuantizedRows

MovedProbs = Tuple[Tensor, Tensor]  # (the probs moved with the rows, the dispatch weights: probs != 0)


def row_plan(dest: Tensor, sources: Optional[Tensor], kept, rows: int, tokens: int, top_k: int) -> Plan:
    """A one-expert plan with capacity ``rows``: ``dest_rows = dest`` ([A] int32, entries in
    ``[0, rows)`` or -1, the used rows exactly ``[0, kept)``), ``row_sources`` = ``sources`` ([at
    least min(kept, rows)] int32: the assignment of each row, then -1) or, when None, the inverse of
    ``dest``. ``kept`` is an int or a 0-d/[1] int32 tensor on the device. ``indices`` and
    ``bin_ids`` are left unwritten: the row operators read only ``dest_rows``, ``row_sources``
    and the counts."""
    a = tokens * top_k
    device = dest.device
    o = plan_slices(tokens, top_k, 1, 1, rows)  # one expert, alignment 1, capacity `rows`
    # one scratch entry past the plan when row_sources is the inverse of dest
    packed = torch.empty(o.size + (1 if sources is None else 0), dtype=torch.int32, device=device)
    counts = packed[o.counts]  # tokens_per_expert, bins (kept), padded_tokens_per_expert, padded_bins (rows)
    if isinstance(kept, Tensor):
        counts[:2].copy_(kept.reshape(1).expand(2))
    else:
        counts[:2].fill_(kept)
    counts[2:].fill_(rows)
    packed[o.dest_rows].copy_(dest)
    src = packed[o.row_sources.start :]
    if sources is None:
        # row_sources[dest[a]] = a; a dropped assignment (dest -1) writes the scratch entry at the end
        src.fill_(-1)
        src.index_put_((dest.long(),), torch.arange(a, dtype=torch.int32, device=device))
        src[-1] = -1
        packed = packed[:-1]
    else:
        n = min(sources.numel(), rows)
        src[:n].copy_(sources[:n])
        if n < rows:
            src[n:].fill_(-1)
    return Plan._from_packed(packed, tokens, top_k, 1, 1, rows)


def plan_probs(probs: Optional[Tensor], quantized) -> Optional[Tensor]:
    """The probs the mask plan's operator moves with the rows (eager mode, rows not ``quantized``,
    a dtype it takes; no gradient through it: the permute's backward gives the probs theirs), else
    None (the permute moves them itself)."""
    if probs is None or quantized is not None or compiling():
        return None
    return probs.detach() if probs.dtype in (torch.float32, torch.bfloat16, torch.float16) else None


def mask_plan(
    routing_map: Tensor, rows: int, probs: Optional[Tensor] = None
) -> Tuple[Plan, Tensor, Optional[MovedProbs]]:
    """TE's mask-map permute without padding: ``(row plan with R = rows, TE's row_id_map[T, 2E+1],
    the probs moved with the rows)`` from one native operator; the rows go expert-major, tokens in
    order within an expert, and destinations at or past ``rows`` are dropped (the last ones in that
    order: TE's num_out_tokens cut). ``probs`` ([T, E] float32 / bfloat16 / float16, no gradient
    taken): ``(moved, nonzero)``, the probs moved as the rows are (0 in rows without an assignment)
    and the dispatch weights that zero the rows of probability 0 (float32 ``[T*E]``); None: not
    moved (None back)."""
    t, e = routing_map.shape
    flags = probs is not None
    packed, row_id_map, moved, nonzero = ops.mask_plan.default(
        routing_map, rows, alignment=1, one_bin=True, with_row_id_map=True, probs=probs, probs_nonzero=flags
    )
    return Plan._from_packed(packed, t, e, 1, 1, rows), row_id_map, None if probs is None else (moved, nonzero)


def padded_mask_plan(
    routing_map: Tensor, alignment: int, rows: int, probs: Optional[Tensor] = None
) -> Tuple[Plan, Tensor, Optional[MovedProbs]]:
    """TE's mask-map permute padded to ``alignment`` per expert: ``(expert plan of capacity C =
    ceil(rows / E), so E*C >= rows, TE's row_id_map with the unpadded rows, the probs moved as in
    :func:`mask_plan`)``."""
    t, e = routing_map.shape
    flags = probs is not None
    packed, row_id_map, moved, nonzero = ops.mask_plan.default(
        routing_map, rows, alignment=alignment, one_bin=False, with_row_id_map=True, probs=probs, probs_nonzero=flags
    )
    cap = -(-rows // e) if e else 0
    return Plan._from_packed(packed, t, e, e, 1, cap), row_id_map, None if probs is None else (moved, nonzero)


def mask_dest_from_map(row_id_map: Tensor, shift: Optional[Tensor] = None) -> Tensor:
    """``dest[T, E]`` (-1 = not routed) from TE's mask-map ``row_id_map[T, 2E+1]`` (entries past
    each token's count ignored); ``shift[E]`` is added to each expert's rows (TE's pad_offsets)."""
    t, w = row_id_map.shape
    e = (w - 1) // 2
    m = row_id_map.to(torch.int64)
    n = m[:, 2 * e : 2 * e + 1]
    live = torch.arange(e, device=m.device).unsqueeze(0) < n
    experts = torch.where(live, m[:, e : 2 * e], e)  # a dead slot goes to the scratch column e
    rows = m[:, :e]
    if shift is not None:
        rows = rows + shift.to(torch.int64)[experts.clamp(max=e - 1)]
    dest = torch.full((t, e + 1), -1, dtype=torch.int32, device=m.device)
    dest.scatter_(1, experts, torch.where(live, rows, -1).to(torch.int32))
    return dest[:, :e].contiguous()


def int_ids(index: Tensor) -> Tensor:
    """An index map as int32 or int64 ids: TE casts any index map to int32, exact for the bool,
    (u)int8 and int16 maps the checks and plans here would otherwise refuse or misread."""
    return index if index.dtype in (torch.int32, torch.int64) else index.to(torch.int32)


def index_plan(index: Tensor, rows: int, num_experts: Optional[int]) -> Plan:
    """TE's index-map permute: a row plan of ``index[T, K]`` with R = ``rows``. The assignments
    ``t*K + k`` are stable-sorted by expert id read as uint32 (so -1 sorts last, as in TE) and
    position j holds the j-th; positions at or past ``rows`` are dropped. With ``num_experts`` (ids
    in ``[0, E)`` or -1) and ``rows = T*K``, padmoe's plan of E + 1 experts at alignment 1 (a
    counting sort) is the plan as it is; otherwise the native ``index_plan`` operator (a radix sort
    of the ids as uint32 keys: one launch up to 4096 assignments on CUDA, three above) writes the
    row plan: for ids in ``[0, E)`` or -1 the same order."""
    t, k = index.shape
    if num_experts is None or rows != t * k:
        return Plan._from_packed(ops.index_plan.default(index, rows), t, k, 1, 1, rows)
    e = num_experts + 1  # -1 -> the extra expert E, whose rows come last
    # every id in [0, e) after the remainder: the plain plan, unchecked (no dropped count to write)
    packed = ops.make_plan.default(index.remainder(e), e, alignment=1, check=0)
    return Plan._from_packed(packed, t, k, e, 1)


def moved_probs(probs, packed, tokens, top_k, num_experts, capacity, sources):
    """``moved[r] = probs[row_sources[r]]``, 0 on rows with no source: a dispatch of one column of
    ones weighted by the probs (one launch; 1 * p is p exactly), or a gather for the dtypes the
    dispatch does not take. No trailing ``.to(probs.dtype)``: torch.compile of some torch releases
    (2.11) drops the gradient of a Function output that a no-op ``.to()`` returned."""
    flat = probs.reshape(-1)
    if probs.dtype in (torch.float32, torch.bfloat16, torch.float16):
        ones = torch.ones(tokens, 1, dtype=probs.dtype, device=probs.device)
        moved = torch.ops.padmoe.dispatch.default(
            ones, packed, flat, top_k, num_experts, alignment=1, expert_capacity=capacity, check=0, zero_padding=True
        )
        return moved.view(-1)
    return torch.where(sources >= 0, flat[sources.clamp(min=0).long()], 0)


def plan_views(plan: Plan) -> Tuple[Tensor, Tensor]:
    """(dest_rows, row_sources) views of a packed plan of this module (row or expert plan)."""
    o = plan_slices(
        plan.num_tokens, plan.top_k, plan.num_experts, plan.alignment, getattr(plan, "expert_capacity", None)
    )
    return plan.packed[o.dest_rows], plan.packed[o.row_sources.start :]


def index_dest_from_map(row_id_map: Tensor, top_k: int) -> Tensor:
    """Token-major ``dest[T*K]`` from TE's k-major index-map ``row_id_map[K*T]``."""
    return row_id_map.reshape(top_k, -1).t().reshape(-1).to(torch.int32)


def padded_plan_from_dest(dest: Tensor, pad_offsets: Tensor, rows: int) -> Tuple[Plan, int]:
    """An expert plan (capacity C = ceil(rows / E)) from padded ``dest[T, E]`` (-1 = not routed)
    and TE's ``pad_offsets[E]`` (expert e's rows start ``pad_offsets[e]`` after its unpadded
    start), for an input of ``rows`` rows: ``(plan, C)``."""
    t, e = dest.shape
    a = t * e
    cap = -(-rows // e)
    device = dest.device
    routed = dest >= 0
    n = routed.sum(0, dtype=torch.int32)
    bins = n.cumsum(0, dtype=torch.int32)
    pstart = bins - n + pad_offsets.to(torch.int32)
    pbins = torch.cat([pstart[1:], pstart.new_full((1,), rows)])
    o = plan_slices(t, e, e, 1, cap)  # K = E, alignment 1, capacity C
    # indices, bin_ids unread; one scratch entry past the plan for the dropped assignments' writes
    packed = torch.empty(o.size + 1, dtype=torch.int32, device=device)
    torch.cat([n, bins, pbins - pstart, pbins], out=packed[o.counts])
    flat = dest.reshape(-1)
    flat = torch.where(flat < e * cap, flat, -1)  # a row past the input names nothing
    packed[o.dest_rows].copy_(flat)
    src = packed[o.row_sources.start :]
    src.fill_(-1)
    src.index_put_((flat.long(),), torch.arange(a, dtype=torch.int32, device=device))
    src[-1] = -1
    return Plan._from_packed(packed[:-1], t, e, e, 1, cap), cap


# ---------------------------------------------------------------------------
# TE's quantized (FP8) tensors
# ---------------------------------------------------------------------------

_BYTES = torch.float8_e4m3fn  # one-byte rows padmoe's row operators move bit for bit


def as_bytes(rows: Tensor) -> Tensor:
    """``[N, W]`` rows of any dtype as ``[N, W * itemsize]`` one-byte rows for padmoe's operators."""
    if not rows.is_contiguous() or rows.stride(-1) != 1:  # a [N, 1] transpose counts as contiguous
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows.view(torch.uint8).view(_BYTES)


def from_bytes(moved: Tensor, like: Tensor) -> Tensor:
    """Moved byte rows back in ``like``'s dtype."""
    return moved.view(torch.uint8).view(like.dtype)


def quantized_output(inp, q: QuantizedRows, data: Tensor, scales: Optional[Tensor]):
    """A tensor of ``inp``'s own class (TE's) holding ``data`` and ``scales`` as its row-wise parts,
    made as TE's permute makes its outputs: no column-wise parts, no quantizer, 1x128 (not 2-D) block
    scales, unswizzled MXFP8 scales, a ``Float8Tensor``'s ``_scale_inv`` passed on as it is; the
    other constructor arguments are ``inp.get_metadata()``'s (TE's keyword arguments of the class)."""
    get = getattr(inp, "get_metadata", None)
    meta = dict(get()) if callable(get) else {}
    meta.update(fp8_dtype=inp._fp8_dtype, quantizer=None)
    if q.kind == "tensor":
        meta.update(data=data, fp8_scale_inv=inp._scale_inv, data_transpose=None)
    else:
        meta.update(rowwise_data=data, rowwise_scale_inv=scales, columnwise_data=None, columnwise_scale_inv=None)
        if q.kind == "blockwise":
            meta["is_2D_scaled"] = False
        elif "with_gemm_swizzled_scales" in meta or hasattr(inp, "_with_gemm_swizzled_scales"):
            meta["with_gemm_swizzled_scales"] = False
    if not (data.is_cuda and data.device.index == torch.cuda.current_device()):
        meta["device"] = data.device  # TE's classes default to the current CUDA device
    return type(inp)(shape=data.shape, dtype=inp.dtype, requires_grad=False, **meta)


def permute_quantized(inp, q: QuantizedRows, moved, packed, top_k, num_experts, capacity, rows):
    """TE's permute of a quantized ``inp`` by a packed plan: its codes and scale rows moved by
    padmoe's dispatch (bit copies; rows no assignment names get zero bytes), the first ``rows``
    (-1: all); with ``moved`` (the moved probs) a row of probability 0 gets zero codes, its scales
    still moved (TE's routing-map padding). Returns the output of ``inp``'s class."""

    def move(t: Tensor) -> Tensor:
        y = ops.dispatch.default(
            as_bytes(t), packed, None, top_k, num_experts, alignment=1, expert_capacity=capacity, check=0
        )
        return from_bytes(y[:rows] if 0 <= rows < y.shape[0] else y, t)

    data = move(q.data)
    scales = None if q.scales is None else move(q.scales)
    if moved is not None:
        data.view(torch.uint8).masked_fill_((moved == 0).unsqueeze(1), 0)
    if q.kind == "blockwise":
        scales = scales.t().contiguous()  # TE's [S, rows]
    return quantized_output(inp, q, data, scales)


class QuantizedChunkSort(torch.autograd.Function):
    """TE's chunk sort of a quantized ``inp``, its codes already sorted (``data``, by padmoe's
    sort_chunks: output row j holds input row ``perm[j]``): the scale rows gathered with them (a
    padded scale layout keeps its padding), the output of the input's own class. The backward
    sends the (plain) gradient back: ``grad_inp[perm[j]] = grad[j]``."""

    @staticmethod
    def forward(ctx, inp, q, data, perm):
        scales = None
        if q.scales is not None:
            moved = q.scales.index_select(0, perm.long())
            scales = inp._rowwise_scale_inv.clone()  # the input's layout, its padding included
            if q.kind == "blockwise":
                scales[:, : data.shape[0]] = moved.t()
            else:
                scales[: data.shape[0]] = moved
        ctx.save_for_backward(perm)
        return quantized_output(inp, q, data, scales)

    @staticmethod
    def backward(ctx, grad):
        (perm,) = ctx.saved_tensors
        grad_inp = None
        if ctx.needs_input_grad[0] and grad is not None:
            grad_inp = torch.empty_like(grad).index_copy_(0, perm.long(), grad)
        return grad_inp, None, None, None
