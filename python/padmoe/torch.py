"""padmoe.torch: padmoe's routing ops as PyTorch custom ops (autograd, torch.compile, CUDA graphs).

Usage::

    import torch
    import padmoe.torch as pt

    logits = router(x)                                    # [T, E]
    probs, top_experts = logits.softmax(-1).topk(2)       # [T, K] weights and expert ids
    r = pt.Routing.from_topk(top_experts, probs, num_experts=E, alignment=16)
    y = r.dispatch(x)                                     # [capacity, H] expert-grouped, padded, tail rows zero
    h = torch._grouped_mm(y, w_experts, offs=r.offsets)   # offs = padded_bins (int32)
    out = r.combine(h)                                    # [T, H], weighted by probs; grads reach x and probs

    # the same, step by step (all static shapes: torch.compile(fullgraph=True) / CUDA-graph capturable)
    plan = pt.make_plan(top_experts, E, 16)               # a padmoe.eager.Plan of int32 tensors
    y = pt.dispatch(x, plan)                              # [plan.capacity, H]
    out = pt.combine(h, plan, probs.reshape(-1))          # [T, H]

    # drop-ins (same arguments and results as MegaBlocks / Megatron; P rows, read on the host)
    y = pt.padded_gather(x, indices, bin_ids, bins, padded_bins, top_k)
    out = pt.padded_scatter(y, indices, bin_ids, weights, bins, padded_bins, top_k)
    padded, permutation_map, inclusive_offsets = pt.pad_to_alignment(hidden, tokens_per_expert, 16)
    out = pt.unpad_from_alignment(padded, permutation_map, hidden.shape[0], probs)

Custom ops (``torch.ops.padmoe.*``, registered with ``torch.library.custom_op``; each
allocates its outputs with ``torch.empty`` and fills them through the native ``_out``
functions on ``torch.cuda.current_stream()``; CUDA scratch memory comes from a
``torch.empty`` workspace, so no raw ``cudaMallocAsync`` happens inside a captured graph):
``make_plan``, ``dispatch``, ``dispatch_backward``, ``combine``, ``combine_backward``,
``padded_gather``, ``padded_gather_backward``, ``padded_scatter``,
``padded_scatter_backward``, ``pad_to_alignment``, ``unpad_from_alignment``,
``unpad_from_alignment_backward``. Each has a fake (meta) implementation; the
differentiable ones have a registered autograd formula whose backward is itself one of
these custom ops (so compiled backward graphs trace too). Double backward is not
supported.

Two paths:

- **Static shapes** (:func:`make_plan`, :func:`dispatch`, :func:`combine`,
  :class:`Routing`): padded buffers have ``capacity = T*K + E*(alignment-1)`` rows, known
  on the host, so nothing reads P. Rows at or past P are zeroed in the same pass
  (``zero_tail``), so outputs are fully defined and deterministic. No host sync: these
  trace under ``torch.compile(fullgraph=True)`` and capture in ``torch.cuda.CUDAGraph``.
- **Drop-ins** (:func:`padded_gather`, :func:`padded_scatter`, :func:`pad_to_alignment`,
  :func:`unpad_from_alignment`): exactly MegaBlocks' / Megatron's results, whose padded
  outputs have P rows; P is read on the host (one synchronization on CUDA), so they are
  not CUDA-graph capturable. Under torch.compile their row count is an unbacked symbol
  (``torch.library.get_ctx().new_dynamic_size()``).

Checking policy (``check``): every wrapper takes ``check: Optional[bool] = None``. None
means "check unless compiling or capturing": True in eager mode, False while
``torch.compiler.is_compiling()`` or while the current CUDA stream is capturing. With
``check=True`` the CUDA backend validates data-dependent properties (expert ids,
permutations, bins) with one small kernel and a host synchronization, raising
``ValueError`` / ``TypeError`` with padmoe's message (naming the op, the argument and the
first offending position). With ``check=False`` on CUDA nothing synchronizes and bad data
is not diagnosed (``make_plan`` drops expert ids outside ``[0, E)``: ``dest_rows`` -1).
The CPU backend always checks everything. Shape/dtype/device checks always run.

Data types: rows float32 / float16 / bfloat16 run natively. **float64 rows** (which the
native library does not support) run through plain-PyTorch float64 formulas inside the
same custom ops and their registered backward ops (exact in float64; computed in float64
rather than padmoe's float32 accumulation). This exists so that
``torch.autograd.gradcheck`` exercises the custom-op + autograd wiring and the backward
formulas; the native float32/bf16 backward is tested separately against
``padmoe.eager``. Index inputs int32 or int64; index outputs int32; weight / probs
gradients in the weights' / probs' dtype.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional, Sequence, Tuple

import torch

import padmoe
from padmoe import eager as _eager
from padmoe.eager import Plan

__all__ = [
    "Plan",
    "Routing",
    "make_plan",
    "dispatch",
    "combine",
    "padded_gather",
    "padded_scatter",
    "pad_to_alignment",
    "unpad_from_alignment",
]

Tensor = torch.Tensor
_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _resolve_check(check: Optional[bool]) -> bool:
    """The checking policy: an explicit bool wins; None = check unless compiling or capturing."""
    if check is not None:
        return bool(check)
    if torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return False
    return True


def _native_kw(like: Tensor, check: bool, ws_sizes=None) -> dict:
    """Options for a padmoe call: check, the current CUDA stream and a torch-allocated workspace."""
    kw = {"check": bool(check)}
    if like.device.type == "cuda":
        kw["stream"] = int(torch.cuda.current_stream(like.device).cuda_stream)
        if ws_sizes is not None:
            n = padmoe.workspace_bound(*[max(int(v), 0) for v in ws_sizes])
            if n > 0:
                kw["workspace"] = torch.empty(n, dtype=torch.uint8, device=like.device)
    return kw


def _is_native(t: Tensor) -> bool:
    if t.dtype == torch.float64:
        return False
    return True  # anything else goes to padmoe, which reports unsupported dtypes


def _plan_ns(plan: Sequence[Tensor], top_k: int, alignment: int) -> SimpleNamespace:
    """A plan object (the attributes padmoe's native layer reads) from the eight plan tensors."""
    (indices, bin_ids, tpe, bins, ptpe, padded_bins, dest_rows, row_sources) = plan
    top_k = int(top_k)
    return SimpleNamespace(indices=indices, bin_ids=bin_ids, tokens_per_expert=tpe, bins=bins,
                           padded_tokens_per_expert=ptpe, padded_bins=padded_bins, dest_rows=dest_rows,
                           row_sources=row_sources, num_tokens=int(dest_rows.shape[0]) // max(top_k, 1),
                           top_k=top_k, num_experts=int(padded_bins.shape[0]), alignment=int(alignment))


def _plan_list(plan) -> List[Tensor]:
    return [plan.indices, plan.bin_ids, plan.tokens_per_expert, plan.bins, plan.padded_tokens_per_expert,
            plan.padded_bins, plan.dest_rows, plan.row_sources]


def _flat(w: Optional[Tensor]) -> Optional[Tensor]:
    return None if w is None else w.reshape(-1)


def _rows_of_p(padded_bins: Tensor) -> int:
    return int(padded_bins[-1].item()) if padded_bins.numel() > 0 else 0  # host read (sync on CUDA)


def _empty_wgrad(like: Tensor, weights: Optional[Tensor], n: int, need: bool) -> Tensor:
    """The weight-gradient output: [n] in weights' dtype when needed, else an empty placeholder
    (custom ops cannot return None)."""
    if need and weights is not None:
        return torch.empty(n, dtype=weights.dtype, device=like.device)
    return torch.empty(0, dtype=like.dtype if weights is None else weights.dtype, device=like.device)


# --- float64: plain-PyTorch formulas (exact in float64) ---------------------


def _w64(weights: Optional[Tensor], n: int, like: Tensor) -> Tensor:
    if weights is None:
        return torch.ones(n, dtype=like.dtype, device=like.device)
    return weights.reshape(-1).to(like.dtype)


def _spread64(x: Tensor, dest: Tensor, top_k: int, w: Optional[Tensor], rows: int) -> Tensor:
    """y[rows, H]: y[dest[a]] = x[a // K] * w[a]; other rows zero (dest < 0: dropped)."""
    a = dest.shape[0]
    src = x.repeat_interleave(top_k, 0) * _w64(w, a, x).unsqueeze(1)
    y = x.new_zeros(rows, x.shape[1])
    keep = dest >= 0
    y[dest.long()[keep]] = src[keep]
    return y


def _reduce64(y: Tensor, dest: Tensor, top_k: int, w: Optional[Tensor]) -> Tensor:
    """out[t] = sum_k w[t*K+k] * y[dest[t*K+k]] (dest < 0 contributes zero)."""
    a = dest.shape[0]
    keep = (dest >= 0).to(y.dtype).unsqueeze(1)
    g = y.index_select(0, dest.long().clamp(min=0)) * keep * _w64(w, a, y).unsqueeze(1)
    return g.view(a // top_k, top_k, y.shape[1]).sum(1)


def _dots64(y: Tensor, dest: Tensor, top_k: int, other: Tensor) -> Tensor:
    """d[a] = <y[dest[a]], other[a // K]> (0 where dest < 0)."""
    keep = (dest >= 0).to(y.dtype)
    g = y.index_select(0, dest.long().clamp(min=0))
    return (g * other.repeat_interleave(top_k, 0)).sum(-1) * keep


def _dest_of(indices, bin_ids, bins, padded_bins) -> Tensor:
    return _eager._dest_rows_from_sorted(indices, bin_ids, bins, padded_bins)


# ---------------------------------------------------------------------------
# 1. static-shape path: make_plan / dispatch / combine
# ---------------------------------------------------------------------------


@torch.library.custom_op("padmoe::make_plan", mutates_args=())
def _make_plan_op(top_experts: Tensor, num_experts: int, alignment: int, check: bool) -> Tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    t, k = (int(top_experts.shape[0]), int(top_experts.shape[1])) if top_experts.dim() == 2 else (0, 1)
    out = padmoe.Plan._allocate(t, k, num_experts, alignment, top_experts)
    padmoe.make_plan(top_experts, num_experts, alignment, out=out,
                     **_native_kw(top_experts, check, (t, k, num_experts, alignment)))
    return tuple(_plan_list(out))


@_make_plan_op.register_fake
def _(top_experts, num_experts, alignment, check):
    t, k = top_experts.shape
    a, e = t * k, num_experts
    cap = a + e * (alignment - 1)
    i32 = dict(dtype=torch.int32, device=top_experts.device)
    return (top_experts.new_empty(a, **i32), top_experts.new_empty(a, **i32), top_experts.new_empty(e, **i32),
            top_experts.new_empty(e, **i32), top_experts.new_empty(e, **i32), top_experts.new_empty(e, **i32),
            top_experts.new_empty(a, **i32), top_experts.new_empty(cap, **i32))


def make_plan(top_experts: Tensor, num_experts: int, alignment: int, *, check: Optional[bool] = None) -> Plan:
    """Routing plan of ``top_experts[T, K]`` (int32/int64) over ``num_experts`` experts,
    segments padded to multiples of ``alignment``: a :class:`padmoe.eager.Plan` (NamedTuple)
    of int32 tensors on top_experts' device, ``row_sources`` with ``capacity`` entries
    (-1 past P). No host synchronization with ``check=False`` (the default under
    torch.compile and CUDA-graph capture)."""
    if top_experts.dim() != 2:
        raise ValueError(f"make_plan: top_experts: expected [T, K], got shape {tuple(top_experts.shape)}")
    fields = torch.ops.padmoe.make_plan(top_experts, int(num_experts), int(alignment), _resolve_check(check))
    t, k = top_experts.shape
    return Plan(*fields, t, k, int(num_experts), int(alignment))


# dispatch -------------------------------------------------------------------


@torch.library.custom_op("padmoe::dispatch", mutates_args=())
def _dispatch_op(x: Tensor, plan: List[Tensor], weights: Optional[Tensor], top_k: int, alignment: int,
                 check: bool) -> Tensor:
    cap = int(plan[7].shape[0])
    if not _is_native(x):
        return _spread64(x, plan[6], top_k, weights, cap)
    p = _plan_ns(plan, top_k, alignment)
    y = torch.empty(cap, x.shape[1], dtype=x.dtype, device=x.device)
    return padmoe.dispatch(x, p, weights, out=y, zero_tail=True,
                           **_native_kw(x, check, (p.num_tokens, top_k, p.num_experts, alignment)))


@_dispatch_op.register_fake
def _(x, plan, weights, top_k, alignment, check):
    return x.new_empty(plan[7].shape[0], x.shape[1])


@torch.library.custom_op("padmoe::dispatch_backward", mutates_args=())
def _dispatch_backward_op(grad_y: Tensor, x: Tensor, plan: List[Tensor], weights: Optional[Tensor], top_k: int,
                          alignment: int, need_wgrad: bool, check: bool) -> Tuple[Tensor, Tensor]:
    grad_y = grad_y.contiguous()
    if not _is_native(x):
        gx = _reduce64(grad_y, plan[6], top_k, weights)
        gw = _dots64(grad_y, plan[6], top_k, x).to(weights.dtype) if need_wgrad and weights is not None else \
            _empty_wgrad(x, weights, 0, False)
        return gx, gw
    p = _plan_ns(plan, top_k, alignment)
    gx = torch.empty_like(x)
    gw = _empty_wgrad(x, weights, int(plan[6].shape[0]), need_wgrad)
    padmoe.dispatch_backward(grad_y, x, p, weights, out=(gx, gw if need_wgrad and weights is not None else None),
                             **_native_kw(x, check, (p.num_tokens, top_k, p.num_experts, alignment)))
    return gx, gw


@_dispatch_backward_op.register_fake
def _(grad_y, x, plan, weights, top_k, alignment, need_wgrad, check):
    return torch.empty_like(x), _empty_wgrad(x, weights, plan[6].shape[0], need_wgrad)


def _plan_op_setup(ctx, inputs, output):
    """setup_context of dispatch and combine: both take (rows, plan, weights, top_k, alignment, check)."""
    rows, plan, weights, top_k, alignment, check = inputs
    ctx.save_for_backward(rows, weights, *plan)
    ctx.top_k, ctx.alignment, ctx.check = top_k, alignment, check
    ctx.need_w = weights is not None and weights.requires_grad


def _dispatch_backward(ctx, grad_y):
    x, weights, *plan = ctx.saved_tensors
    need_w = ctx.need_w
    gx, gw = torch.ops.padmoe.dispatch_backward(grad_y, x, plan, weights, ctx.top_k, ctx.alignment, need_w,
                                                ctx.check and _resolve_check(None))
    return gx, [None] * 8, (gw if need_w else None), None, None, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_plan_op_setup)


def dispatch(x: Tensor, plan: Plan, weights: Optional[Tensor] = None, *, check: Optional[bool] = None) -> Tensor:
    """``y[plan.capacity, H]``: ``y[dest_rows[t*K+k]] = x[t]`` (times ``weights[t*K+k]`` when
    given); padding rows and rows at or past P are zero. Differentiable wrt ``x`` and
    ``weights`` (backward: padmoe ``dispatch_backward``)."""
    return torch.ops.padmoe.dispatch(x, _plan_list(plan), _flat(weights), int(plan.top_k), int(plan.alignment),
                                     _resolve_check(check))


# combine --------------------------------------------------------------------


@torch.library.custom_op("padmoe::combine", mutates_args=())
def _combine_op(y: Tensor, plan: List[Tensor], weights: Optional[Tensor], top_k: int, alignment: int,
                check: bool) -> Tensor:
    if not _is_native(y):
        return _reduce64(y, plan[6], top_k, weights)
    p = _plan_ns(plan, top_k, alignment)
    out = torch.empty(p.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    return padmoe.combine(y, p, weights, out=out,
                          **_native_kw(y, check, (p.num_tokens, top_k, p.num_experts, alignment)))


@_combine_op.register_fake
def _(y, plan, weights, top_k, alignment, check):
    return y.new_empty(plan[6].shape[0] // top_k, y.shape[1])


@torch.library.custom_op("padmoe::combine_backward", mutates_args=())
def _combine_backward_op(grad_out: Tensor, y: Tensor, plan: List[Tensor], weights: Optional[Tensor], top_k: int,
                         alignment: int, need_wgrad: bool, check: bool) -> Tuple[Tensor, Tensor]:
    grad_out = grad_out.contiguous()
    if not _is_native(y):
        gy = _spread64(grad_out, plan[6], top_k, weights, int(y.shape[0]))
        gw = _dots64(y, plan[6], top_k, grad_out).to(weights.dtype) if need_wgrad and weights is not None else \
            _empty_wgrad(y, weights, 0, False)
        return gy, gw
    p = _plan_ns(plan, top_k, alignment)
    gy = torch.empty_like(y)
    gw = _empty_wgrad(y, weights, int(plan[6].shape[0]), need_wgrad)
    padmoe.combine_backward(grad_out, y, p, weights, out=(gy, gw if need_wgrad and weights is not None else None),
                            zero_tail=True, **_native_kw(y, check, (p.num_tokens, top_k, p.num_experts, alignment)))
    return gy, gw


@_combine_backward_op.register_fake
def _(grad_out, y, plan, weights, top_k, alignment, need_wgrad, check):
    return torch.empty_like(y), _empty_wgrad(y, weights, plan[6].shape[0], need_wgrad)


def _combine_backward(ctx, grad_out):
    y, weights, *plan = ctx.saved_tensors
    need_w = ctx.need_w
    gy, gw = torch.ops.padmoe.combine_backward(grad_out, y, plan, weights, ctx.top_k, ctx.alignment, need_w,
                                               ctx.check and _resolve_check(None))
    return gy, [None] * 8, (gw if need_w else None), None, None, None


_combine_op.register_autograd(_combine_backward, setup_context=_plan_op_setup)


def combine(y: Tensor, plan: Plan, weights: Optional[Tensor] = None, *, check: Optional[bool] = None) -> Tensor:
    """``out[T, H]``: ``out[t] = sum_k w[t*K+k] * y[dest_rows[t*K+k]]`` (float32 accumulation,
    ascending k, cast once; ``w`` = weights or 1). ``y`` has at least P rows (e.g. the
    ``capacity`` rows of :func:`dispatch`); rows past P are never read and get zero gradient.
    Differentiable wrt ``y`` and ``weights`` (backward: padmoe ``combine_backward``)."""
    return torch.ops.padmoe.combine(y, _plan_list(plan), _flat(weights), int(plan.top_k), int(plan.alignment),
                                    _resolve_check(check))


# ---------------------------------------------------------------------------
# 2. MegaBlocks drop-ins
# ---------------------------------------------------------------------------


@torch.library.custom_op("padmoe::padded_gather", mutates_args=())
def _padded_gather_op(x: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor, padded_bins: Tensor, top_k: int,
                      weights: Optional[Tensor], check: bool) -> Tensor:
    p = _rows_of_p(padded_bins)
    if not _is_native(x):
        return _spread64(x, _dest_of(indices, bin_ids, bins, padded_bins), top_k, weights, p)
    y = torch.empty(p, x.shape[1], dtype=x.dtype, device=x.device)
    a = int(indices.shape[0])
    return padmoe.padded_gather(x, indices, bin_ids, bins, padded_bins, top_k, weights, out=y,
                                **_native_kw(x, check, (a // max(top_k, 1), top_k, padded_bins.shape[0], 1)))


@_padded_gather_op.register_fake
def _(x, indices, bin_ids, bins, padded_bins, top_k, weights, check):
    p = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(p, x.shape[1])


@torch.library.custom_op("padmoe::padded_gather_backward", mutates_args=())
def _padded_gather_backward_op(grad_y: Tensor, x: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor,
                               padded_bins: Tensor, top_k: int, weights: Optional[Tensor], need_wgrad: bool,
                               check: bool) -> Tuple[Tensor, Tensor]:
    grad_y = grad_y.contiguous()
    if not _is_native(x):
        dest = _dest_of(indices, bin_ids, bins, padded_bins)
        gx = _reduce64(grad_y, dest, top_k, weights)
        gw = _dots64(grad_y, dest, top_k, x).to(weights.dtype) if need_wgrad and weights is not None else \
            _empty_wgrad(x, weights, 0, False)
        return gx, gw
    a = int(indices.shape[0])
    gx = torch.empty_like(x)
    gw = _empty_wgrad(x, weights, a, need_wgrad)
    padmoe.padded_gather_backward(grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights,
                                  out=(gx, gw if need_wgrad and weights is not None else None),
                                  **_native_kw(x, check, (a // max(top_k, 1), top_k, padded_bins.shape[0], 1)))
    return gx, gw


@_padded_gather_backward_op.register_fake
def _(grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, need_wgrad, check):
    return torch.empty_like(x), _empty_wgrad(x, weights, indices.shape[0], need_wgrad)


def _padded_gather_setup(ctx, inputs, output):
    x, indices, bin_ids, bins, padded_bins, top_k, weights, check = inputs
    ctx.save_for_backward(x, indices, bin_ids, bins, padded_bins, weights)
    ctx.top_k, ctx.check = top_k, check
    ctx.need_w = weights is not None and weights.requires_grad


def _padded_gather_backward(ctx, grad_y):
    x, indices, bin_ids, bins, padded_bins, weights = ctx.saved_tensors
    need_w = ctx.need_w
    gx, gw = torch.ops.padmoe.padded_gather_backward(grad_y, x, indices, bin_ids, bins, padded_bins, ctx.top_k,
                                                     weights, need_w, ctx.check and _resolve_check(None))
    return gx, None, None, None, None, None, (gw if need_w else None), None


_padded_gather_op.register_autograd(_padded_gather_backward, setup_context=_padded_gather_setup)


def padded_gather(x: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor, padded_bins: Tensor, top_k: int,
                  weights: Optional[Tensor] = None, *, check: Optional[bool] = None) -> Tensor:
    """MegaBlocks ``padded_gather(x, indices, bin_ids, bins, padded_bins, top_k)``:
    ``y[padded_bins[-1], H]`` with sorted position i of expert e in row
    ``padded_start(e) + i - real_start(e)`` holding ``x[indices[i] // top_k]`` (times
    ``weights[indices[i]]`` when given); padding rows zero. P is read on the host (one
    synchronization on CUDA; not CUDA-graph capturable). Differentiable wrt ``x`` (and
    ``weights``)."""
    return torch.ops.padmoe.padded_gather(x, indices, bin_ids, bins, padded_bins, int(top_k), _flat(weights),
                                          _resolve_check(check))


@torch.library.custom_op("padmoe::padded_scatter", mutates_args=())
def _padded_scatter_op(y: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
                       padded_bins: Tensor, top_k: int, check: bool) -> Tensor:
    if not _is_native(y):
        return _reduce64(y, _dest_of(indices, bin_ids, bins, padded_bins), top_k, weights)
    a = int(indices.shape[0])
    out = torch.empty(a // max(top_k, 1), y.shape[1], dtype=y.dtype, device=y.device)
    return padmoe.padded_scatter(y, indices, bin_ids, weights, bins, padded_bins, top_k, out=out,
                                 **_native_kw(y, check, (a // max(top_k, 1), top_k, padded_bins.shape[0], 1)))


@_padded_scatter_op.register_fake
def _(y, indices, bin_ids, weights, bins, padded_bins, top_k, check):
    return y.new_empty(indices.shape[0] // top_k, y.shape[1])


@torch.library.custom_op("padmoe::padded_scatter_backward", mutates_args=())
def _padded_scatter_backward_op(grad_out: Tensor, y: Tensor, indices: Tensor, bin_ids: Tensor,
                                weights: Optional[Tensor], bins: Tensor, padded_bins: Tensor, top_k: int,
                                need_wgrad: bool, check: bool) -> Tuple[Tensor, Tensor]:
    grad_out = grad_out.contiguous()
    if not _is_native(y):
        dest = _dest_of(indices, bin_ids, bins, padded_bins)
        gy = _spread64(grad_out, dest, top_k, weights, int(y.shape[0]))
        gw = _dots64(y, dest, top_k, grad_out).to(weights.dtype) if need_wgrad and weights is not None else \
            _empty_wgrad(y, weights, 0, False)
        return gy, gw
    a = int(indices.shape[0])
    gy = torch.empty_like(y)
    gw = _empty_wgrad(y, weights, a, need_wgrad)
    padmoe.padded_scatter_backward(grad_out, y, indices, bin_ids, weights, bins, padded_bins, top_k,
                                   out=(gy, gw if need_wgrad and weights is not None else None), zero_tail=True,
                                   **_native_kw(y, check, (a // max(top_k, 1), top_k, padded_bins.shape[0], 1)))
    return gy, gw


@_padded_scatter_backward_op.register_fake
def _(grad_out, y, indices, bin_ids, weights, bins, padded_bins, top_k, need_wgrad, check):
    return torch.empty_like(y), _empty_wgrad(y, weights, indices.shape[0], need_wgrad)


def _padded_scatter_setup(ctx, inputs, output):
    y, indices, bin_ids, weights, bins, padded_bins, top_k, check = inputs
    ctx.save_for_backward(y, indices, bin_ids, weights, bins, padded_bins)
    ctx.top_k, ctx.check = top_k, check
    ctx.need_w = weights is not None and weights.requires_grad


def _padded_scatter_backward(ctx, grad_out):
    y, indices, bin_ids, weights, bins, padded_bins = ctx.saved_tensors
    need_w = ctx.need_w
    gy, gw = torch.ops.padmoe.padded_scatter_backward(grad_out, y, indices, bin_ids, weights, bins, padded_bins,
                                                      ctx.top_k, need_w, ctx.check and _resolve_check(None))
    return gy, None, None, (gw if need_w else None), None, None, None, None


_padded_scatter_op.register_autograd(_padded_scatter_backward, setup_context=_padded_scatter_setup)


def padded_scatter(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
                   padded_bins: Tensor, top_k: int, *, check: Optional[bool] = None) -> Tensor:
    """MegaBlocks ``padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k)``:
    ``out[T, H]``, ``out[t] = sum_k w(t*K+k) * x[dest_rows[t*K+k]]`` (``w`` = weights or 1;
    float32 accumulation in ascending k, cast once). ``x`` is the padded buffer (at least P
    rows; padding rows never read). Differentiable wrt ``x`` and ``weights``."""
    return torch.ops.padmoe.padded_scatter(x, indices, bin_ids, _flat(weights), bins, padded_bins, int(top_k),
                                           _resolve_check(check))


# ---------------------------------------------------------------------------
# 3. Megatron drop-ins
# ---------------------------------------------------------------------------


@torch.library.custom_op("padmoe::pad_to_alignment", mutates_args=())
def _pad_op(hidden_states: Tensor, tokens_per_expert: Tensor, alignment: int, check: bool) -> Tuple[
        Tensor, Tensor, Tensor]:
    if not _is_native(hidden_states):
        padded, pmap, offs = _eager.pad_to_alignment(hidden_states, tokens_per_expert, alignment)  # a move: exact
        return padded, pmap, offs
    e = int(tokens_per_expert.shape[0]) if tokens_per_expert.dim() == 1 else 0
    n = int(hidden_states.shape[0])
    return padmoe.pad_to_alignment(hidden_states, tokens_per_expert, alignment,
                                   **_native_kw(hidden_states, check, (n, 1, e, alignment)))


@_pad_op.register_fake
def _(hidden_states, tokens_per_expert, alignment, check):
    p = torch.library.get_ctx().new_dynamic_size()
    return (hidden_states.new_empty(p, hidden_states.shape[1]),
            hidden_states.new_empty(p, dtype=torch.int32),
            hidden_states.new_empty(tokens_per_expert.shape[0], dtype=torch.int32))


def _pad_setup(ctx, inputs, output):
    hidden_states, tokens_per_expert, alignment, check = inputs
    ctx.save_for_backward(output[1])
    ctx.n, ctx.check = hidden_states.shape[0], check


def _pad_backward(ctx, grad_padded, grad_map, grad_offs):
    (pmap,) = ctx.saved_tensors
    if grad_padded is None:
        return None, None, None, None
    gh = torch.ops.padmoe.unpad_from_alignment(grad_padded.contiguous(), pmap, ctx.n, None,
                                               ctx.check and _resolve_check(None))
    return gh, None, None, None


_pad_op.register_autograd(_pad_backward, setup_context=_pad_setup)


def pad_to_alignment(hidden_states: Tensor, tokens_per_expert: Tensor, alignment: int, *,
                     check: Optional[bool] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Megatron ``pad_to_alignment(hidden_states, tokens_per_expert, alignment)`` ->
    ``(padded_hidden[P, H], permutation_map[P] int32, inclusive_offsets[E] int32)``: expert
    e's rows keep their order and move to its aligned segment; padding rows are zero and
    map to -1; ``inclusive_offsets`` are the grouped-GEMM ``offs``. Rows past
    ``sum(tokens_per_expert)`` are ignored (zero gradient). P is read on the host.
    Differentiable wrt ``hidden_states``."""
    return torch.ops.padmoe.pad_to_alignment(hidden_states, tokens_per_expert, int(alignment),
                                             _resolve_check(check))


@torch.library.custom_op("padmoe::unpad_from_alignment", mutates_args=())
def _unpad_op(padded_output: Tensor, permutation_map: Tensor, original_size: int, probs: Optional[Tensor],
              check: bool) -> Tensor:
    if not _is_native(padded_output):
        out = padded_output.new_zeros(original_size, padded_output.shape[1])
        src = torch.nonzero(permutation_map >= 0).squeeze(1)
        dst = permutation_map.long().index_select(0, src)
        rows = padded_output.index_select(0, src)
        if probs is not None:
            rows = rows * probs.reshape(-1).to(rows.dtype).index_select(0, dst).unsqueeze(1)
        out[dst] = rows
        return out
    out = torch.empty(original_size, padded_output.shape[1], dtype=padded_output.dtype, device=padded_output.device)
    return padmoe.unpad_from_alignment(padded_output, permutation_map, original_size, probs, out=out,
                                       **_native_kw(padded_output, check,
                                                    (original_size + padded_output.shape[0], 1, 1, 1)))


@_unpad_op.register_fake
def _(padded_output, permutation_map, original_size, probs, check):
    return padded_output.new_empty(original_size, padded_output.shape[1])


@torch.library.custom_op("padmoe::unpad_from_alignment_backward", mutates_args=())
def _unpad_backward_op(grad_out: Tensor, padded_output: Tensor, permutation_map: Tensor, probs: Optional[Tensor],
                       need_pgrad: bool, check: bool) -> Tuple[Tensor, Tensor]:
    grad_out = grad_out.contiguous()
    n = int(grad_out.shape[0])
    if not _is_native(padded_output):
        src = torch.nonzero(permutation_map >= 0).squeeze(1)
        dst = permutation_map.long().index_select(0, src)
        g = grad_out.index_select(0, dst)
        gp = torch.zeros_like(padded_output)
        pr = None if probs is None else probs.reshape(-1).to(g.dtype).index_select(0, dst)
        gp[src] = g if pr is None else g * pr.unsqueeze(1)
        if need_pgrad and probs is not None:
            gpr = torch.zeros(n, dtype=g.dtype, device=g.device)
            gpr[dst] = (padded_output.index_select(0, src) * g).sum(-1)
            return gp, gpr.to(probs.dtype)
        return gp, _empty_wgrad(padded_output, probs, 0, False)
    gp = torch.empty_like(padded_output)
    gpr = _empty_wgrad(padded_output, probs, n, need_pgrad)
    padmoe.unpad_from_alignment_backward(grad_out, padded_output, permutation_map, probs,
                                         out=(gp, gpr if need_pgrad and probs is not None else None),
                                         **_native_kw(padded_output, check, (n + padded_output.shape[0], 1, 1, 1)))
    return gp, gpr


@_unpad_backward_op.register_fake
def _(grad_out, padded_output, permutation_map, probs, need_pgrad, check):
    return torch.empty_like(padded_output), _empty_wgrad(padded_output, probs, grad_out.shape[0], need_pgrad)


def _unpad_setup(ctx, inputs, output):
    padded_output, permutation_map, original_size, probs, check = inputs
    ctx.save_for_backward(padded_output, permutation_map, probs)
    ctx.check = check
    ctx.need_w = probs is not None and probs.requires_grad


def _unpad_backward(ctx, grad_out):
    padded_output, permutation_map, probs = ctx.saved_tensors
    need_p = ctx.need_w
    gp, gpr = torch.ops.padmoe.unpad_from_alignment_backward(grad_out, padded_output, permutation_map, probs, need_p,
                                                             ctx.check and _resolve_check(None))
    return gp, None, None, (gpr if need_p else None), None


_unpad_op.register_autograd(_unpad_backward, setup_context=_unpad_setup)


def unpad_from_alignment(padded_output: Tensor, permutation_map: Tensor, original_size: int,
                         probs: Optional[Tensor] = None, *, check: Optional[bool] = None) -> Tensor:
    """Megatron ``unpad_from_alignment(padded_output, permutation_map, original_size, probs=None)``
    -> ``out[original_size, H]``: ``out[map[p]] = padded_output[p]`` (times ``probs[map[p]]``)
    for every ``map[p] >= 0``; rows no entry names are zero. No host synchronization.
    Differentiable wrt ``padded_output`` and ``probs``."""
    return torch.ops.padmoe.unpad_from_alignment(padded_output, permutation_map, int(original_size), _flat(probs),
                                                 _resolve_check(check))


# ---------------------------------------------------------------------------
# Routing: plan + router weights
# ---------------------------------------------------------------------------


class Routing:
    """A routing step: the plan of a top-k router's choices plus its weights.

    ``Routing.from_topk(top_experts[T, K], weights[T, K] or [T*K] or None, num_experts, alignment)``;
    ``.dispatch(x)`` -> ``[capacity, H]`` expert-grouped padded buffer (tail rows zero);
    ``.offsets`` -> ``padded_bins`` (int32, the ``offs`` of ``torch._grouped_mm``);
    ``.tokens_per_expert``; ``.combine(y)`` -> ``[T, H]`` weighted by the router weights
    (differentiable wrt y and the weights). Static shapes: compile- and capture-friendly.
    """

    def __init__(self, plan: Plan, weights: Optional[Tensor] = None, check: Optional[bool] = None):
        self.plan = plan
        self.weights = _flat(weights)
        self.check = check

    @classmethod
    def from_topk(cls, top_experts: Tensor, weights: Optional[Tensor], num_experts: int, alignment: int, *,
                  check: Optional[bool] = None) -> "Routing":
        return cls(make_plan(top_experts, num_experts, alignment, check=check), weights, check)

    @property
    def offsets(self) -> Tensor:
        return self.plan.padded_bins

    @property
    def tokens_per_expert(self) -> Tensor:
        return self.plan.tokens_per_expert

    @property
    def capacity(self) -> int:
        return self.plan.capacity

    def dispatch(self, x: Tensor) -> Tensor:
        return dispatch(x, self.plan, None, check=self.check)

    def combine(self, y: Tensor) -> Tensor:
        return combine(y, self.plan, self.weights, check=self.check)
