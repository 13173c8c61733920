"""padmoe's ops on numpy arrays and torch tensors.

Each function allocates its outputs with the caller's framework (numpy in,
numpy out; torch in, torch out on the same device), then fills them with the
native ``_out`` op, which allocates nothing. Arguments follow padmoe/ops.hpp.

Common keyword-only options:

``check`` (default True)
    CUDA checked mode: validate the data-dependent properties (expert ids,
    bins, permutations) on the device before the op runs; one synchronization.
    The CPU backend always checks everything.
``num_threads`` (default 0 = every core)
    CPU worker threads.
``workspace``
    A CUDA buffer (e.g. ``torch.empty(workspace_bound(T, K, E, m), dtype=torch.uint8,
    device="cuda")``) for scratch memory; without it CUDA scratch memory comes
    from padmoe's stream-ordered memory pool on the stream.
``stream``
    A ``cudaStream_t`` as an int. Default: the current torch stream of the
    input's device for CUDA torch tensors, else 0 (the legacy default stream).

Ops that produce padded rows (padded_gather, dispatch, padded_scatter_backward,
combine_backward, pad_to_alignment) allocate exactly P rows by default, which on
CUDA reads P from the device (one synchronization). ``rows=n`` allocates n >= P
rows instead (e.g. ``rows=plan.capacity``: no synchronization); rows at or past
P are left uninitialized. ``out=`` passes caller-owned outputs (a tuple shaped
like the return value for the multi-output ops) and returns them.

Errors: ``ValueError`` (bad value or shape, e.g. an expert id out of range),
``TypeError`` (bad dtype or device), ``NotImplementedError`` (CUDA arrays in a
build without the CUDA backend), ``RuntimeError`` (backend failure), each with
padmoe's message naming the op, the argument and the first offending position.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _C as _native_module
from ._args import check_expert_map, checked_rows, map_experts, no_cols
from ._arrays import arrays_of, last_entry, native_args, ndim, prepare
from ._plan import INT32_MAX, Plan

Array = Any


class _Native:
    """padmoe._C with torch tensors handed over as DLPack capsules (see
    _arrays.native_args: torch's ``__dlpack__`` costs ~2 µs a tensor)."""

    def __getattr__(self, name):
        fn = getattr(_native_module, name)
        if not callable(fn):
            return fn

        op = name[:-4] if name.endswith("_out") else name

        def call(*args, **kwargs):
            if kwargs.get("workspace") is not None:
                kwargs["workspace"] = native_args((kwargs["workspace"],), op)[0]
            return fn(*native_args(args, op), **kwargs)

        setattr(self, name, call)  # __getattr__ runs once per name
        return call


_C = _Native()


def _options(arrays, like, check, num_threads, workspace, stream, zero_tail=False, zero_padding=True):
    if stream is None:
        stream = arrays.stream(like)
    if workspace is not None:
        workspace = arrays_of(workspace, "workspace", "workspace").prepare(workspace)
    return {"stream": int(stream), "check_data": bool(check), "num_threads": int(num_threads), "workspace": workspace,
            "zero_tail": bool(zero_tail), "zero_padding": bool(zero_padding)}


def _cols(a) -> int:
    return int(a.shape[1]) if ndim(a) == 2 else (int(a.shape[-1]) if ndim(a) >= 1 else 0)


def _tokens(indices, top_k) -> int:
    """T = A / K as the native allocating forms compute it (0 on bad input:
    the native op then reports it)."""
    if ndim(indices) != 1 or int(top_k) < 1:
        return 0
    return int(indices.shape[0]) // int(top_k)


def _padded_out(arrays, op, like, rows, out, p_of):
    """The padded-rows output: `out`, or `rows` rows, or exactly P rows."""
    if out is not None:
        if rows is not None:
            raise ValueError(f"{op}: pass rows= or out=, not both")
        return out
    n = p_of() if rows is None else int(rows)
    if n < 0:
        raise ValueError(f"{op}: rows: must be >= 0, got {n}")
    if n > INT32_MAX:  # before allocating: P (or rows) must fit the int32 index outputs
        raise ValueError(f"{op}: {'padded rows' if rows is None else 'rows'}: size overflow: {n} does not fit the "
                         "int32 index outputs")
    return arrays.empty((n, _cols(like)), like.dtype, like)


def _split_out(op, out, count):
    if out is None:
        return (None,) * count
    if not isinstance(out, (tuple, list)) or len(out) != count:
        raise TypeError(f"{op}: out: expected a tuple of {count} arrays (or None entries where allowed)")
    return tuple(out)


def _weight_grad(arrays, like, weights, given, count):
    """The weight-gradient output: the given one (None skips it), else a new
    array of weights' dtype when weights were given."""
    if given is not _UNSET:
        return given
    if weights is None:
        return None
    return arrays.empty((count,), weights.dtype, like)


_UNSET = object()


# --- rows moved with their scales (ops.hpp section 4) ---------------------------


def _native_scales(arrays, s):
    """Scales as padmoe._C takes them: a torch float8_e8m0fnu tensor as its uint8 bytes (same memory)."""
    if s is not None and arrays.name == "torch" and str(s.dtype) == "torch.float8_e8m0fnu":
        return s.view(arrays.torch.uint8)
    return s


def _scales_out(arrays, scales, rows, like, given):
    """The output scales: `given`, or a new array of `rows` rows shaped like the input scales."""
    if given is not None:
        return given
    return arrays.empty((int(rows),) + tuple(int(d) for d in scales.shape[1:]), scales.dtype, like)


def _no_weights_with_scales(op, arg, value):
    if value is not None:
        raise ValueError(f"{op}: scales: not with {arg} (rows move with their scales only in the move-only ops; "
                         f"a weighted move of quantized rows would need requantizing)")


# ---------------------------------------------------------------------------
# Sizes and capabilities
# ---------------------------------------------------------------------------


def capacity_bound(num_tokens: int, top_k: int, num_experts: int, alignment: int) -> int:
    """Host-side bound on the padded row count P: ``num_tokens*top_k + num_experts*(alignment-1)``."""
    return _C.capacity_bound(num_tokens, top_k, num_experts, alignment)


def workspace_bound(num_tokens: int, top_k: int, num_experts: int, alignment: int) -> int:
    """CUDA scratch bytes that suffice for every op on this routing (and pad/unpad
    of up to ``capacity_bound(...)`` rows): allocate once, pass as ``workspace=``."""
    return _C.workspace_bound(num_tokens, top_k, num_experts, alignment)


def has_cuda() -> bool:
    """Whether this build of padmoe has the CUDA backend."""
    return _C.has_cuda()


# ---------------------------------------------------------------------------
# 1. Routing plan
# ---------------------------------------------------------------------------


def _routing(arrays, like, expert_map, first_expert, global_experts, drop_invalid, expert_capacity, drop_policy,
             probs, dropped):
    """make_plan's routing keywords for _C.make_plan_out."""
    if drop_policy not in ("position", "probs"):
        raise ValueError(f"make_plan: drop_policy: expected 'position' or 'probs', got {drop_policy!r}")
    cap = -1 if expert_capacity is None else int(expert_capacity)
    kw = dict(first_expert=int(first_expert), global_experts=int(global_experts), drop_invalid=bool(drop_invalid),
              expert_capacity=cap, drop_policy=drop_policy, dropped=dropped)
    if expert_map is not None:
        (kw["expert_map"],) = prepare(arrays, expert_map)
    if probs is not None:
        (kw["probs"],) = prepare(arrays, probs)  # [T, K] or [A]: read by assignment id
    return kw


def _plan_buffers(op, out, top_experts, num_experts, alignment, expert_capacity=None) -> Plan:
    """The plan an op fills: ``out`` (checked against this call's sizes), else a new one."""
    t, k = (int(top_experts.shape[0]), int(top_experts.shape[1])) if ndim(top_experts) == 2 else (0, 1)
    if out is None:
        return Plan._allocate(t, k, num_experts, alignment, top_experts, expert_capacity)
    if ndim(top_experts) == 2 and (out.num_tokens, out.top_k, out.num_experts, out.alignment) != (
            t, k, num_experts, alignment):
        raise ValueError(
            f"{op}: out: the plan buffers are for num_tokens={out.num_tokens}, top_k={out.top_k}, "
            f"num_experts={out.num_experts}, alignment={out.alignment}; this call needs "
            f"num_tokens={t}, top_k={k}, num_experts={num_experts}, alignment={alignment}")
    return out


def make_plan(top_experts: Array, num_experts: int, alignment: int, *, out: Optional[Plan] = None,
              expert_map: Optional[Array] = None, first_expert: int = 0, global_experts: int = 0,
              drop_invalid: bool = False, expert_capacity: Optional[int] = None, drop_policy: str = "position",
              probs: Optional[Array] = None, check: bool = True, num_threads: int = 0,
              workspace: Optional[Array] = None, stream: Optional[int] = None) -> Plan:
    """Route ``top_experts[T, K]`` (int32 or int64) to ``num_experts`` experts with
    segments padded to multiples of ``alignment``; returns a :class:`Plan` of
    int32 arrays on ``top_experts``' device.

    ``out``: a plan from ``Plan.empty(T, K, E, alignment, like=...)`` to fill
    instead (no allocation; on CUDA with ``check=False`` no synchronization).

    Routing options (docs/design.md, "Dropped assignments"); every one drops assignments
    (``dest_rows`` -1, no sorted position), which the row ops then treat as absent:

    - expert parallelism: ids are global in ``[0, global_experts)`` (0: ``num_experts``); the
      plan's experts are the local range ``[first_expert, first_expert + num_experts)``, or
      ``expert_map[global_experts]`` (global id -> local id, -1 = not local);
    - ``drop_invalid``: ids outside ``[0, global_experts)`` (negative ids, transformers' id E)
      are dropped instead of rejected;
    - ``expert_capacity`` C: every segment exactly C rows (``alignment`` must divide C); an
      expert keeps its first C assignments (``drop_policy="position"``) or the C largest
      ``probs[T, K]`` (``"probs"``, ties to the lower assignment id); ``plan.dropped`` is the
      number dropped, a [1] int32 array on the device.
    """
    op = "make_plan"
    arrays = arrays_of(top_experts, op, "top_experts")
    (top_experts,) = prepare(arrays, top_experts)
    out = _plan_buffers(op, out, top_experts, num_experts, alignment, expert_capacity)
    routing = _routing(arrays, top_experts, expert_map, first_expert, global_experts, drop_invalid, expert_capacity,
                       drop_policy, probs, getattr(out, "dropped", None))
    _C.make_plan_out(top_experts, num_experts, alignment, out, **routing,
                     **_options(arrays, top_experts, check, num_threads, workspace, stream))
    return out


def make_plan_layouts(top_experts: Array, num_experts: int, alignment: int, *, expert_map: Optional[Array] = None,
                      first_expert: int = 0, global_experts: int = 0, drop_invalid: bool = False,
                      expert_capacity: Optional[int] = None, drop_policy: str = "position",
                      probs: Optional[Array] = None, check: bool = True,
                      num_threads: int = 0, workspace: Optional[Array] = None,
                      stream: Optional[int] = None) -> Tuple[Plan, Array, Array, Array]:
    """:func:`make_plan` and, from the same pass, the layouts other kernels consume:
    ``(plan, row_experts, block_experts, padded_total)``, int32 on ``top_experts``' device.
    The routing options are :func:`make_plan`'s.

    ``row_experts[capacity]``: the expert of each padded row, -1 on padding rows and past P
    (DeepGEMM's contiguous grouped layout: its ``m_indices``). ``block_experts[ceil(capacity /
    alignment)]``: the expert of each block of ``alignment`` rows, -1 past P (vLLM's
    ``expert_ids``). ``padded_total[1]``: P, on the device (no synchronization)."""
    op = "make_plan"
    arrays = arrays_of(top_experts, op, "top_experts")
    (top_experts,) = prepare(arrays, top_experts)
    t, k = (int(top_experts.shape[0]), int(top_experts.shape[1])) if ndim(top_experts) == 2 else (0, 1)
    plan = Plan._allocate(t, k, num_experts, alignment, top_experts, expert_capacity)
    cap = int(plan.row_sources.shape[0])
    m = max(int(alignment), 1)
    row_experts = arrays.empty((cap,), arrays.int32, top_experts)
    block_experts = arrays.empty((-(-cap // m),), arrays.int32, top_experts)
    padded_total = arrays.empty((1,), arrays.int32, top_experts)
    routing = _routing(arrays, top_experts, expert_map, first_expert, global_experts, drop_invalid, expert_capacity,
                       drop_policy, probs, plan.dropped)
    _C.make_plan_out(top_experts, num_experts, alignment, plan, row_experts, block_experts, padded_total, **routing,
                     **_options(arrays, top_experts, check, num_threads, workspace, stream))
    return plan, row_experts, block_experts, padded_total


def aligned_rows_bound(assignments: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """``A + min(A, E) * (block_size - 1)``, rounded up to ``block_size`` when ``pad_sorted_ids``: vLLM's
    ``max_num_tokens_padded``, the length of :func:`moe_align_block_size`'s ``sorted_token_ids``."""
    return int(_C.aligned_rows_bound(int(assignments), int(num_experts), int(block_size), bool(pad_sorted_ids)))


def moe_align_block_size(topk_ids: Array, block_size: int, num_experts: int, expert_map: Optional[Array] = None,
                         pad_sorted_ids: bool = False, ignore_invalid_experts: bool = False, *, check: bool = True,
                         num_threads: int = 0, workspace: Optional[Array] = None,
                         stream: Optional[int] = None) -> Tuple[Array, Array, Array]:
    """vLLM's ``moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
    pad_sorted_ids=False, ignore_invalid_experts=False)``: ``(sorted_token_ids, expert_ids,
    num_tokens_post_padded)``, int32 on ``topk_ids``' device.

    ``sorted_token_ids[R]`` (R = :func:`aligned_rows_bound`): each expert's assignment ids
    ``t*K + k`` in ascending order (stable; vLLM's atomic kernel promises no order), the expert's run
    padded to a multiple of ``block_size`` with the sentinel ``T*K``, then the sentinel to the end.
    ``expert_ids[ceil(R / block_size)]``: the expert of each block; 0 for blocks at or past P (as
    vLLM's and SGLang's kernels). ``num_tokens_post_padded[1]``: P. ``expert_map`` (global id ->
    local id, -1 for experts of other ranks; ``[num_experts]`` int32/int64, entries in ``[-1, num_experts)``):
    with ``ignore_invalid_experts=False`` applied to every entry of ``expert_ids`` afterwards, as vLLM
    does; with ``True`` the assignments of experts mapped to -1 get no entry and the rest are grouped
    and ordered by their local id (vLLM's kernel with the map). Ids outside ``[0, num_experts)`` are a
    ``ValueError`` (vLLM's kernel skips them)."""
    op = "moe_align_block_size"
    arrays = arrays_of(topk_ids, op, "topk_ids")
    remap = expert_map is not None and not ignore_invalid_experts  # (the kernel checks a map it is given)
    if remap:  # before anything runs; a CUDA map's entries only with check (one synchronization)
        check_expert_map(op, expert_map, num_experts, bool(check) or not getattr(expert_map, "is_cuda", False))
    (topk_ids,) = prepare(arrays, topk_ids)
    a = 1
    for n in topk_ids.shape:
        a *= int(n)
    m = max(int(block_size), 1)
    r = max(aligned_rows_bound(a, max(int(num_experts), 0), m, pad_sorted_ids), 0)
    if r > INT32_MAX:
        raise ValueError(f"{op}: sorted_token_ids: size overflow: {r} does not fit the int32 outputs")
    sorted_ids = arrays.empty((r,), arrays.int32, topk_ids)
    expert_ids = arrays.empty((-(-r // m),), arrays.int32, topk_ids)
    post = arrays.empty((1,), arrays.int32, topk_ids)
    in_kernel = expert_map if ignore_invalid_experts else None
    _C.moe_align_block_size_out(topk_ids, block_size, num_experts, sorted_ids, expert_ids, post, in_kernel,
                                **_options(arrays, topk_ids, check, num_threads, workspace, stream))
    return sorted_ids, map_experts(expert_ids, expert_map) if remap else expert_ids, post


# ---------------------------------------------------------------------------
# 2. MegaBlocks family (input in token order)
# ---------------------------------------------------------------------------


def padded_gather(x: Array, indices: Array, bin_ids: Array, bins: Array, padded_bins: Array, top_k: int,
                  weights: Optional[Array] = None, *, rows: Optional[int] = None, out: Optional[Array] = None,
                  check: bool = True, num_threads: int = 0, workspace: Optional[Array] = None,
                  stream: Optional[int] = None, zero_tail: bool = False, zero_padding: bool = True,
                  scales: Optional[Array] = None) -> Array:
    """``y[P, H]``: sorted position ``i`` of expert ``e`` lands in padded row
    ``padded_start(e) + i - real_start(e)`` and holds ``x[indices[i] // top_k]``
    (times ``weights[indices[i]]`` when given); padding rows are zero.

    ``x[T, H]`` float32/float16/bfloat16 (float8 without weights), any row
    stride; ``weights[A]`` float32 or x's dtype. Returns x's dtype.
    ``zero_padding=False`` leaves padding rows unwritten (for consumers that skip them: DeepGEMM with
    the -1 row layout, masked grouped GEMMs; an inference forward only, never rows a weight gradient
    reduces over).

    ``scales=x_scales`` moves a scale tensor with the rows in the same pass (no weights) and returns
    ``(y, y_scales)``: per-row float32 ``[T]`` / ``[T, 1]``, per-128-column float32
    ``[T, ceil(H/128)]`` or MXFP8 E8M0 uint8 ``[T, ceil(H/32)]``; padding rows get scale 1
    (``out=(y, y_scales)``)."""
    op = "padded_gather"
    arrays = arrays_of(x, op, "x")
    out_y, out_s = out, None
    if scales is not None:
        _no_weights_with_scales(op, "weights", weights)
        out_y, out_s = _split_out(op, out, 2)
    x, indices, bin_ids, bins, padded_bins, weights, scales, out_y, out_s = prepare(
        arrays, x, indices, bin_ids, bins, padded_bins, weights, scales, out_y, out_s)
    opts = _options(arrays, x, check, num_threads, workspace, stream, zero_tail, zero_padding)
    y = _padded_out(arrays, op, x, rows, out_y, lambda: checked_rows(  # (the scaled op checks x and the routing alike)
        arrays, x, last_entry(arrays, padded_bins), opts, lambda y0: _C.padded_gather_out(
            no_cols(x, _tokens(indices, top_k)), indices, bin_ids, bins, padded_bins, top_k, weights, y0, **opts)))
    if scales is not None:
        ys = _scales_out(arrays, scales, y.shape[0], x, out_s)
        _C.padded_gather_scaled_out(x, indices, bin_ids, bins, padded_bins, top_k, _native_scales(arrays, scales), y,
                                    _native_scales(arrays, ys), **opts)
        return y, ys
    _C.padded_gather_out(x, indices, bin_ids, bins, padded_bins, top_k, weights, y, **opts)
    return y


def padded_scatter(y: Array, indices: Array, bin_ids: Array, weights: Optional[Array], bins: Array,
                   padded_bins: Array, top_k: int, *, out: Optional[Array] = None, check: bool = True,
                   num_threads: int = 0, workspace: Optional[Array] = None, stream: Optional[int] = None) -> Array:
    """``out[T, H]``: ``out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]]`` with
    ``w = weights`` or 1 (pass ``weights=None`` for the unweighted sum),
    accumulated in float32 in ascending k and cast once to y's dtype. Padding
    rows of ``y`` are never read.
    """
    op = "padded_scatter"
    arrays = arrays_of(y, op, "y")
    y, indices, bin_ids, weights, bins, padded_bins, out = prepare(
        arrays, y, indices, bin_ids, weights, bins, padded_bins, out)
    opts = _options(arrays, y, check, num_threads, workspace, stream)
    t = _tokens(indices, top_k)
    if out is None and ndim(y) == 2 and int(y.shape[0]) < t:  # y needs P >= A >= T rows: [T, H] fits, or y is bad
        checked_rows(arrays, y, t, opts, lambda o0: _C.padded_scatter_out(
            no_cols(y), indices, bin_ids, weights, bins, padded_bins, top_k, o0, **opts))
    out = out if out is not None else arrays.empty((t, _cols(y)), y.dtype, y)
    _C.padded_scatter_out(y, indices, bin_ids, weights, bins, padded_bins, top_k, out, **opts)
    return out


def padded_scatter_wgrad(y: Array, grad: Array, indices: Array, bin_ids: Array, bins: Array, padded_bins: Array,
                         top_k: int, *, out: Optional[Array] = None, check: bool = True, num_threads: int = 0,
                         workspace: Optional[Array] = None, stream: Optional[int] = None) -> Array:
    """``wgrad[A]``: ``wgrad[a] = sum_h y[dest_rows[a], h] * grad[a // K, h]``
    accumulated in float32; returned in y's dtype (``out`` may be float32 or
    y's dtype)."""
    op = "padded_scatter_wgrad"
    arrays = arrays_of(y, op, "y")
    y, grad, indices, bin_ids, bins, padded_bins, out = prepare(
        arrays, y, grad, indices, bin_ids, bins, padded_bins, out)
    if out is None:
        a = int(indices.shape[0]) if ndim(indices) == 1 else 0
        out = arrays.empty((a,), y.dtype, y)
    _C.padded_scatter_wgrad_out(y, grad, indices, bin_ids, bins, padded_bins, top_k, out,
                                **_options(arrays, y, check, num_threads, workspace, stream))
    return out


def padded_gather_backward(grad_y: Array, x: Array, indices: Array, bin_ids: Array, bins: Array,
                           padded_bins: Array, top_k: int, weights: Optional[Array] = None, *,
                           out: Optional[Tuple[Array, Optional[Array]]] = None, check: bool = True,
                           num_threads: int = 0, workspace: Optional[Array] = None,
                           stream: Optional[int] = None) -> Tuple[Array, Optional[Array]]:
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
        arrays, grad_y, x, indices, bin_ids, bins, padded_bins, weights, out_x, out_w)
    opts = _options(arrays, x, check, num_threads, workspace, stream)
    t = _tokens(indices, top_k)
    if out_x is None and ndim(x) == 2 and int(x.shape[0]) < t:  # x needs T rows: [T, H] fits, or the op rejects x
        checked_rows(arrays, x, t, opts, lambda g0: _C.padded_gather_backward_out(
            grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, g0, None, **opts))
    grad_x = out_x if out_x is not None else arrays.empty((t, _cols(x)), x.dtype, x)
    a = int(indices.shape[0]) if ndim(indices) == 1 else 0
    grad_w = _weight_grad(arrays, x, weights, out_w if out is not None else _UNSET, a)
    _C.padded_gather_backward_out(grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, grad_x, grad_w,
                                  **opts)
    return grad_x, grad_w


def padded_scatter_backward(grad_out: Array, y: Array, indices: Array, bin_ids: Array, weights: Optional[Array],
                            bins: Array, padded_bins: Array, top_k: int, *, rows: Optional[int] = None,
                            out: Optional[Tuple[Array, Optional[Array]]] = None, check: bool = True,
                            num_threads: int = 0, workspace: Optional[Array] = None,
                            stream: Optional[int] = None, zero_tail: bool = False) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`padded_scatter`: ``(grad_y, grad_weights)``.

    ``grad_y[P, H] = padded_gather(grad_out, weights)`` (y's dtype, padding
    rows zero; ``rows=`` allocates that many rows instead of P);
    ``grad_weights = padded_scatter_wgrad(y, grad_out)`` in weights' dtype when
    weights were given, else None. ``out=(grad_y, grad_weights)`` as in
    :func:`padded_gather_backward`.
    """
    op = "padded_scatter_backward"
    arrays = arrays_of(y, op, "y")
    out_y, out_w = _split_out(op, out, 2)
    grad_out, y, indices, bin_ids, weights, bins, padded_bins, out_y, out_w = prepare(
        arrays, grad_out, y, indices, bin_ids, weights, bins, padded_bins, out_y, out_w)
    opts = _options(arrays, y, check, num_threads, workspace, stream, zero_tail)
    grad_y = _padded_out(arrays, op, y, rows, out_y, lambda: checked_rows(
        arrays, y, last_entry(arrays, padded_bins), opts, lambda g0: _C.padded_scatter_backward_out(
            no_cols(grad_out, _tokens(indices, top_k)), no_cols(y), indices, bin_ids, weights, bins, padded_bins,
            top_k, g0, None, **opts)))
    a = int(indices.shape[0]) if ndim(indices) == 1 else 0
    grad_w = _weight_grad(arrays, y, weights, out_w if out is not None else _UNSET, a)
    _C.padded_scatter_backward_out(grad_out, y, indices, bin_ids, weights, bins, padded_bins, top_k, grad_y, grad_w,
                                   **opts)
    return grad_y, grad_w


# --- fused forms on a plan ----------------------------------------------------


def _plan_rows(arrays, plan):
    return lambda: last_entry(arrays, plan.padded_bins) if int(plan.num_experts) > 0 else 0


def _plan_assignments(plan) -> int:
    return max(int(plan.num_tokens) * int(plan.top_k), 0)


def dispatch(x: Array, plan: Plan, weights: Optional[Array] = None, *, rows: Optional[int] = None,
             out: Optional[Array] = None, check: bool = True, num_threads: int = 0,
             workspace: Optional[Array] = None, stream: Optional[int] = None, zero_tail: bool = False,
             zero_padding: bool = True, scales: Optional[Array] = None) -> Array:
    """``y[P, H]`` = :func:`padded_gather` on a plan, reading each token row
    once and writing its K copies. ``rows=plan.capacity`` avoids reading P
    (no synchronization on CUDA).
    ``zero_padding=False`` leaves padding rows unwritten (for consumers that skip them: DeepGEMM with
    the -1 row layout, masked grouped GEMMs; an inference forward only, never rows a weight gradient
    reduces over).
    ``scales=x_scales`` moves a scale tensor with the rows (as :func:`padded_gather`) and returns
    ``(y, y_scales)``."""
    op = "dispatch"
    arrays = arrays_of(x, op, "x")
    if scales is not None:
        _no_weights_with_scales(op, "weights", weights)
        out_y, out_s = _split_out(op, out, 2)
        x, scales, out_y, out_s = prepare(arrays, x, scales, out_y, out_s)
        y = _padded_out(arrays, op, x, rows, out_y, _plan_rows(arrays, plan))
        ys = _scales_out(arrays, scales, y.shape[0], x, out_s)
        _C.dispatch_scaled_out(x, plan, _native_scales(arrays, scales), y, _native_scales(arrays, ys),
                               **_options(arrays, x, check, num_threads, workspace, stream, zero_tail, zero_padding))
        return y, ys
    x, weights, out = prepare(arrays, x, weights, out)
    y = _padded_out(arrays, op, x, rows, out, _plan_rows(arrays, plan))
    _C.dispatch_out(x, plan, weights, y,
                    **_options(arrays, x, check, num_threads, workspace, stream, zero_tail, zero_padding))
    return y


def make_plan_and_dispatch(x: Array, top_experts: Array, num_experts: int, alignment: int,
                           weights: Optional[Array] = None, *, rows: Optional[int] = None,
                           out: Optional[Tuple[Optional[Plan], Optional[Array]]] = None, check: bool = True,
                           num_threads: int = 0, workspace: Optional[Array] = None, stream: Optional[int] = None,
                           zero_tail: bool = False, zero_padding: bool = True) -> Tuple[Plan, Array]:
    """:func:`make_plan` then :func:`dispatch` in one call: ``(plan, y)``, the plan of
    ``top_experts[T, K]`` and ``y = dispatch(x, plan, weights)``, bit for bit (make_plan's launch
    then dispatch's). Every check (make_plan's on ``top_experts``, dispatch's on ``x`` and
    ``weights``) runs before anything is written.

    ``y`` has exactly P rows by default (a view of the first P rows of a ``plan.capacity``-row
    buffer; on CUDA reading P is one synchronization); ``rows=n`` with ``n >= plan.capacity``
    allocates n rows (no synchronization), rows at or past P left uninitialized (zero with
    ``zero_tail=True``). ``out=(plan, y)``: a plan from ``Plan.empty(T, K, E, alignment, like=...)``
    and/or ``y`` with at least ``len(plan.row_sources)`` rows (either may be None: allocated), filled
    and returned. ``zero_padding`` as :func:`dispatch`."""
    op = "make_plan_and_dispatch"
    arrays = arrays_of(x, op, "x")
    index_arrays = arrays_of(top_experts, op, "top_experts")
    out_plan, out_y = _split_out(op, out, 2)
    x, weights, out_y = prepare(arrays, x, weights, out_y)
    (top_experts,) = prepare(index_arrays, top_experts)
    plan = _plan_buffers(op, out_plan, top_experts, num_experts, alignment)
    slots = int(plan.row_sources.shape[0]) if ndim(plan.row_sources) == 1 else 0
    exact = out_y is None and rows is None
    if out_y is None and rows is not None and int(rows) < slots:  # P is not known before the call
        raise ValueError(f"{op}: rows: must be >= plan.capacity = {slots}, got {int(rows)}")
    y = _padded_out(arrays, op, x, rows, out_y, lambda: slots)
    _C.make_plan_and_dispatch_out(x, top_experts, num_experts, alignment, plan, weights, y,
                                  **_options(arrays, x, check, num_threads, workspace, stream, zero_tail,
                                             zero_padding))
    if exact:
        y = y[: _plan_rows(index_arrays, plan)()]
    return plan, y


_QUANT_LAYOUTS = ("block128", "mxfp8", "row")


def _quant_args(op, scale_layout, fp8):
    if scale_layout not in _QUANT_LAYOUTS:
        raise ValueError(f"{op}: scale_layout: expected 'block128', 'mxfp8' or 'row', got {scale_layout!r}")
    if fp8 not in ("e4m3", "e5m2"):
        raise ValueError(f"{op}: fp8: expected 'e4m3' or 'e5m2', got {fp8!r}")


def _quant_rows_out(arrays, x, n, fp8):
    """Rows of fp8 codes: numpy uint8 (numpy has no float8 dtype), torch float8_e4m3fn / float8_e5m2."""
    if arrays.name == "torch":
        dt = arrays.torch.float8_e4m3fn if fp8 == "e4m3" else arrays.torch.float8_e5m2
    else:
        import numpy as np
        dt = np.uint8
    return arrays.empty((int(n), _cols(x)), dt, x)


def _quant_scales_out(arrays, x, n, scale_layout):
    h = _cols(x)
    if scale_layout == "row":
        return arrays.empty((int(n),), _float32(arrays), x)
    if scale_layout == "mxfp8":
        return arrays.empty((int(n), -(-h // 32)), _uint8(arrays), x)
    return arrays.empty((int(n), -(-h // 128)), _float32(arrays), x)


def _float32(arrays):
    if arrays.name == "torch":
        return arrays.torch.float32
    import numpy as np
    return np.float32


def _uint8(arrays):
    if arrays.name == "torch":
        return arrays.torch.uint8
    import numpy as np
    return np.uint8


def _fp8_arg(arrays, y, fp8):
    """What _C's fp8= takes: the format for uint8 code arrays, "" for torch float8 tensors."""
    return "" if arrays.name == "torch" and str(y.dtype).startswith("torch.float8") else fp8


def dispatch_quantized(x: Array, plan: Plan, *, scale_layout: str = "block128", fp8: str = "e4m3",
                       rows: Optional[int] = None, out: Optional[Tuple[Array, Array]] = None, check: bool = True,
                       num_threads: int = 0, workspace: Optional[Array] = None, stream: Optional[int] = None,
                       zero_tail: bool = False, zero_padding: bool = True) -> Tuple[Array, Array]:
    """Fused quantizing dispatch: ``(y, y_scales)`` from bfloat16 / float16 / float32 token rows
    ``x[T, H]``, each row read once, quantized once and written to its K padded rows.

    ``scale_layout``: ``"block128"`` (DeepSeek-V3 1x128 blockwise: float32 ``[P, ceil(H/128)]``,
    scale = amax / fp8_max), ``"mxfp8"`` (OCP MX v1.0: E8M0 bytes uint8 ``[P, ceil(H/32)]``,
    2^(floor(log2 amax) - emax_elem)) or ``"row"`` (float32 ``[P]``, amax over the row). ``fp8``:
    ``"e4m3"`` or ``"e5m2"``. ``y`` holds the float8 codes: a uint8 array for numpy inputs (numpy has
    no float8 dtype; ``ml_dtypes`` can view it), torch.float8_e4m3fn / float8_e5m2 for torch. Padding
    rows: zero codes, scale 1 (float32 1.0 / E8M0 127). Not differentiable; unweighted (router
    weights are applied after the expert, in combine). ``out=(y, y_scales)`` (y may be uint8 codes
    or a torch float8 tensor; the layout is read from y_scales' dtype and shape)."""
    op = "dispatch_quantized"
    _quant_args(op, scale_layout, fp8)
    arrays = arrays_of(x, op, "x")
    out_y, out_s = _split_out(op, out, 2)
    x, out_y, out_s = prepare(arrays, x, out_y, out_s)
    if out_y is None:
        if rows is None:
            n = _plan_rows(arrays, plan)()
        else:
            n = int(rows)
            if n < 0:
                raise ValueError(f"{op}: rows: must be >= 0, got {n}")
        y = _quant_rows_out(arrays, x, n, fp8)
    elif rows is not None:
        raise ValueError(f"{op}: pass rows= or out=, not both")
    else:
        y = out_y
    ys = out_s if out_s is not None else _quant_scales_out(arrays, x, y.shape[0], scale_layout)
    _C.dispatch_quantized_out(x, plan, y, _native_scales(arrays, ys), _fp8_arg(arrays, y, fp8),
                              **_options(arrays, x, check, num_threads, workspace, stream, zero_tail, zero_padding))
    return y, ys


def quantize(x: Array, *, scale_layout: str = "block128", fp8: str = "e4m3", out: Optional[Tuple[Array, Array]] = None,
             num_threads: int = 0, stream: Optional[int] = None) -> Tuple[Array, Array]:
    """The quantizer of :func:`dispatch_quantized` alone: ``(y[N, H], y_scales)`` from ``x[N, H]``
    (the same codes and scales dispatch_quantized writes for each token)."""
    op = "quantize"
    _quant_args(op, scale_layout, fp8)
    arrays = arrays_of(x, op, "x")
    out_y, out_s = _split_out(op, out, 2)
    x, out_y, out_s = prepare(arrays, x, out_y, out_s)
    n = int(x.shape[0]) if ndim(x) >= 1 else 0
    y = out_y if out_y is not None else _quant_rows_out(arrays, x, n, fp8)
    ys = out_s if out_s is not None else _quant_scales_out(arrays, x, n, scale_layout)
    _C.quantize_out(x, y, _native_scales(arrays, ys), _fp8_arg(arrays, y, fp8),
                    **_options(arrays, x, True, num_threads, None, stream))
    return y, ys


def combine(y: Array, plan: Plan, weights: Optional[Array] = None, *, out: Optional[Array] = None,
            check: bool = True, num_threads: int = 0, workspace: Optional[Array] = None,
            stream: Optional[int] = None) -> Array:
    """``out[T, H]`` = :func:`padded_scatter` on a plan: the weighted top-k sum
    in float32, ascending k, cast once to y's dtype."""
    op = "combine"
    arrays = arrays_of(y, op, "y")
    y, weights, out = prepare(arrays, y, weights, out)
    if out is None:
        out = arrays.empty((max(int(plan.num_tokens), 0), _cols(y)), y.dtype, y)
    _C.combine_out(y, plan, weights, out, **_options(arrays, y, check, num_threads, workspace, stream))
    return out


def combine_backward(grad_out: Array, y: Array, plan: Plan, weights: Optional[Array] = None, *,
                     rows: Optional[int] = None, out: Optional[Tuple[Array, Optional[Array]]] = None,
                     check: bool = True, num_threads: int = 0, workspace: Optional[Array] = None,
                     stream: Optional[int] = None, zero_tail: bool = False) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`combine` from one read of ``grad_out``:
    ``(grad_y, grad_weights)`` with ``grad_y[dest_rows[a]] = w(a) * grad_out[a // K]``
    (P rows, padding zero; y's dtype) and ``grad_weights[a] = <y[dest_rows[a]], grad_out[a // K]>``
    (weights' dtype) when weights were given, else None."""
    op = "combine_backward"
    arrays = arrays_of(y, op, "y")
    out_y, out_w = _split_out(op, out, 2)
    grad_out, y, weights, out_y, out_w = prepare(arrays, grad_out, y, weights, out_y, out_w)
    grad_y = _padded_out(arrays, op, y, rows, out_y, _plan_rows(arrays, plan))
    grad_w = _weight_grad(arrays, y, weights, out_w if out is not None else _UNSET, _plan_assignments(plan))
    _C.combine_backward_out(grad_out, y, plan, weights, grad_y, grad_w,
                            **_options(arrays, y, check, num_threads, workspace, stream, zero_tail))
    return grad_y, grad_w


def dispatch_backward(grad_y: Array, x: Array, plan: Plan, weights: Optional[Array] = None, *,
                      out: Optional[Tuple[Array, Optional[Array]]] = None, check: bool = True,
                      num_threads: int = 0, workspace: Optional[Array] = None,
                      stream: Optional[int] = None) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`dispatch`: ``(grad_x, grad_weights)`` with
    ``grad_x = combine(grad_y, weights)`` (x's dtype) and
    ``grad_weights[a] = <grad_y[dest_rows[a]], x[a // K]>`` (weights' dtype)
    when weights were given, else None."""
    op = "dispatch_backward"
    arrays = arrays_of(x, op, "x")
    out_x, out_w = _split_out(op, out, 2)
    grad_y, x, weights, out_x, out_w = prepare(arrays, grad_y, x, weights, out_x, out_w)
    grad_x = out_x if out_x is not None else arrays.empty((max(int(plan.num_tokens), 0), _cols(x)), x.dtype, x)
    grad_w = _weight_grad(arrays, x, weights, out_w if out is not None else _UNSET, _plan_assignments(plan))
    _C.dispatch_backward_out(grad_y, x, plan, weights, grad_x, grad_w,
                             **_options(arrays, x, check, num_threads, workspace, stream))
    return grad_x, grad_w


# ---------------------------------------------------------------------------
# 3. Megatron family (input already expert-grouped)
# ---------------------------------------------------------------------------


def pad_to_alignment(hidden_states: Array, tokens_per_expert: Array, alignment: int, *, rows: Optional[int] = None,
                     out: Optional[Tuple[Array, Array, Array]] = None, check: bool = True, num_threads: int = 0,
                     workspace: Optional[Array] = None,
                     stream: Optional[int] = None, zero_padding: bool = True,
                     scales: Optional[Array] = None) -> Tuple[Array, Array, Array]:
    """``(padded[P, H], permutation_map[P] int32, inclusive_offsets[E] int32)``:
    expert e's rows of ``hidden_states[N, H]`` keep their order and move to its
    aligned segment; padding rows are zero and map to -1; ``inclusive_offsets``
    are the padded inclusive cumulative sums (grouped-GEMM offsets). Rows past
    ``sum(tokens_per_expert)`` are ignored.

    P is computed from ``tokens_per_expert`` (on CUDA: one synchronization);
    ``rows=n`` allocates n rows instead (``permutation_map`` entries past P are
    -1, padded rows past P are left uninitialized).

    ``scales=hidden_scales`` moves a scale tensor with the rows (layouts as :func:`padded_gather`) and
    returns ``(padded, padded_scales, permutation_map, inclusive_offsets)``; padding rows get scale 1
    (``out=`` then takes the four).
    """
    op = "pad_to_alignment"
    arrays = arrays_of(hidden_states, op, "hidden_states")
    out_s = None
    if scales is not None:
        out_p, out_s, out_m, out_o = _split_out(op, out, 4)
        scales, out_s = prepare(arrays, scales, out_s)
    else:
        out_p, out_m, out_o = _split_out(op, out, 3)
    hidden_states, tokens_per_expert, out_p, out_m, out_o = prepare(
        arrays, hidden_states, tokens_per_expert, out_p, out_m, out_o)
    def p_of():  # P after the op's own checks: counts from bad data never size the output
        return _C.pad_to_alignment_rows(hidden_states, tokens_per_expert, alignment,
                                        **_options(arrays, hidden_states, check, num_threads, workspace, stream))

    padded = _padded_out(arrays, op, hidden_states, rows, out_p, p_of)
    permutation_map = out_m if out_m is not None else arrays.empty((int(padded.shape[0]),), arrays.int32, hidden_states)
    if out_o is None:
        e = int(tokens_per_expert.shape[0]) if ndim(tokens_per_expert) == 1 else 0
        out_o = arrays.empty((e,), arrays.int32, hidden_states)
    if scales is not None:
        padded_scales = _scales_out(arrays, scales, padded.shape[0], hidden_states, out_s)
        _C.pad_to_alignment_scaled_out(hidden_states, tokens_per_expert, alignment, _native_scales(arrays, scales),
                                       padded, _native_scales(arrays, padded_scales), permutation_map, out_o,
                                       **_options(arrays, hidden_states, check, num_threads, workspace, stream,
                                                  zero_padding=zero_padding))
        return padded, padded_scales, permutation_map, out_o
    _C.pad_to_alignment_out(hidden_states, tokens_per_expert, alignment, padded, permutation_map, out_o,
                            **_options(arrays, hidden_states, check, num_threads, workspace, stream, zero_padding=zero_padding))
    return padded, permutation_map, out_o


def unpad_from_alignment(padded: Array, permutation_map: Array, original_size: int, probs: Optional[Array] = None,
                         *, out: Optional[Array] = None, check: bool = True, num_threads: int = 0,
                         workspace: Optional[Array] = None, stream: Optional[int] = None,
                         scales: Optional[Array] = None) -> Array:
    """``out[N, H]`` with ``N = original_size``: ``out[map[p]] = padded[p]``
    (times ``probs[map[p]]`` when given) for every ``map[p] >= 0``; rows no
    entry names are zero. The backward of :func:`pad_to_alignment` is
    ``unpad_from_alignment(grad, permutation_map, N)``.

    ``scales=padded_scales`` moves a scale tensor with the rows (no probs; layouts as
    :func:`padded_gather`) and returns ``(out, out_scales)``: rows no entry names get zero data and
    scale 1 (``out=(out, out_scales)``)."""
    op = "unpad_from_alignment"
    arrays = arrays_of(padded, op, "padded")
    if scales is not None:
        _no_weights_with_scales(op, "probs", probs)
        out_r, out_s = _split_out(op, out, 2)
        padded, permutation_map, scales, out_r, out_s = prepare(arrays, padded, permutation_map, scales, out_r, out_s)
        n = int(original_size)
        if out_r is None:
            if n < 0:
                raise ValueError(f"{op}: original_size: must be >= 0, got {n}")
            out_r = arrays.empty((n, _cols(padded)), padded.dtype, padded)
        elif ndim(out_r) >= 1 and int(out_r.shape[0]) != n:
            raise ValueError(f"{op}: out: expected original_size = {n} rows, got {int(out_r.shape[0])}")
        out_s = _scales_out(arrays, scales, n, padded, out_s)
        _C.unpad_from_alignment_scaled_out(padded, permutation_map, _native_scales(arrays, scales), out_r,
                                           _native_scales(arrays, out_s),
                                           **_options(arrays, padded, check, num_threads, workspace, stream))
        return out_r, out_s
    padded, permutation_map, probs, out = prepare(arrays, padded, permutation_map, probs, out)
    n = int(original_size)
    if out is None:
        if n < 0:
            raise ValueError(f"{op}: original_size: must be >= 0, got {n}")
        out = arrays.empty((n, _cols(padded)), padded.dtype, padded)
    elif ndim(out) >= 1 and int(out.shape[0]) != n:
        raise ValueError(f"{op}: out: expected original_size = {n} rows, got {int(out.shape[0])}")
    _C.unpad_from_alignment_out(padded, permutation_map, probs, out,
                                **_options(arrays, padded, check, num_threads, workspace, stream))
    return out


def unpad_from_alignment_backward(grad_out: Array, padded: Array, permutation_map: Array,
                                  probs: Optional[Array] = None, *,
                                  out: Optional[Tuple[Array, Optional[Array]]] = None, check: bool = True,
                                  num_threads: int = 0, workspace: Optional[Array] = None,
                                  stream: Optional[int] = None) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`unpad_from_alignment`: ``(grad_padded, grad_probs)``
    with ``grad_padded[p] = grad_out[map[p]]`` (times ``probs[map[p]]``), zero
    where ``map[p] < 0`` (padded's shape and dtype), and
    ``grad_probs[n] = <grad_out[n], padded[p]>`` for the p with ``map[p] == n``
    (probs' dtype) when probs were given, else None."""
    op = "unpad_from_alignment_backward"
    arrays = arrays_of(padded, op, "padded")
    out_p, out_pr = _split_out(op, out, 2)
    grad_out, padded, permutation_map, probs, out_p, out_pr = prepare(
        arrays, grad_out, padded, permutation_map, probs, out_p, out_pr)
    grad_padded = out_p if out_p is not None else arrays.empty(tuple(padded.shape), padded.dtype, padded)
    n = int(grad_out.shape[0]) if ndim(grad_out) >= 1 else 0
    grad_probs = _weight_grad(arrays, padded, probs, out_pr if out is not None else _UNSET, n)
    _C.unpad_from_alignment_backward_out(grad_out, padded, permutation_map, probs, grad_padded, grad_probs,
                                         **_options(arrays, padded, check, num_threads, workspace, stream))
    return grad_padded, grad_probs


# ---------------------------------------------------------------------------
# Expert parallelism: chunk sort after an all-to-all
# ---------------------------------------------------------------------------


def sort_chunks_capacity(received_rows: int, num_chunks: int, num_ranks: int, alignment: int) -> int:
    """Host-side bound on :func:`sort_chunks`' padded rows P:
    ``received_rows + (num_chunks // num_ranks) * (alignment - 1)``."""
    return _C.sort_chunks_capacity(received_rows, num_chunks, num_ranks, alignment)


def sort_chunks(received: Array, split_sizes: Array, num_ranks: int, alignment: int,
                sorted_index: Optional[Array] = None, *, rows: Optional[int] = None,
                out: Optional[Tuple[Array, Array, Array]] = None, check: bool = True, num_threads: int = 0,
                workspace: Optional[Array] = None, stream: Optional[int] = None, zero_padding: bool = True,
                zero_tail: bool = False) -> Tuple[Array, Array, Array]:
    """The chunk sort after an expert-parallel all-to-all:
    ``(padded[P, H], permutation_map[P] int32, inclusive_offsets[E] int32)``.

    ``received[N, H]`` is rank-major: chunk ``c = r*E + e`` holds ``split_sizes[c]`` rows
    (``split_sizes`` int32/int64 ``[R*E]`` or ``[R, E]``, ``R = num_ranks``). Output position
    ``j`` holds chunk ``sorted_index[j]`` when given (TransformerEngine's
    ``moe_sort_chunks_by_index``), else ``(j % R)*E + j // R`` (expert-major: local expert e's
    chunks from ranks 0..R-1); every group of R consecutive positions (a local expert) is padded to
    a multiple of ``alignment`` with zero rows (-1 in the map): pad_to_alignment's layout, with
    ``inclusive_offsets`` the grouped-GEMM offsets. Rows past ``sum(split_sizes)`` are ignored.
    The way back is :func:`unsort_chunks`.

    P is computed from ``split_sizes`` on the host (CUDA: one synchronization); ``rows=n``
    allocates n rows instead (e.g. ``sort_chunks_capacity(N, R*E, R, alignment)``: no
    synchronization with ``check=False``); map entries past P are -1, padded rows past P are
    left uninitialized (zero with ``zero_tail=True``).
    """
    op = "sort_chunks"
    arrays = arrays_of(received, op, "received")
    out_p, out_m, out_o = _split_out(op, out, 3)
    received, split_sizes, sorted_index, out_p, out_m, out_o = prepare(
        arrays, received, split_sizes, sorted_index, out_p, out_m, out_o)
    padded = _padded_out(arrays, op, received, rows, out_p,  # P after the op's own checks
                         lambda: _C.sort_chunks_rows(received, split_sizes, num_ranks, alignment, sorted_index,
                                                     **_options(arrays, received, check, num_threads, workspace,
                                                                stream)))
    permutation_map = out_m if out_m is not None else arrays.empty((int(padded.shape[0]),), arrays.int32, received)
    if out_o is None:
        c = 1
        for d in split_sizes.shape:
            c *= int(d)
        e = c // int(num_ranks) if int(num_ranks) >= 1 else 0
        out_o = arrays.empty((max(e, 0),), arrays.int32, received)
    _C.sort_chunks_out(received, split_sizes, num_ranks, alignment, sorted_index, padded, permutation_map, out_o,
                       **_options(arrays, received, check, num_threads, workspace, stream, zero_tail=zero_tail,
                                  zero_padding=zero_padding))
    return padded, permutation_map, out_o


def unsort_chunks(padded: Array, permutation_map: Array, received_rows: int, probs: Optional[Array] = None,
                  **kwargs) -> Array:
    """The inverse of :func:`sort_chunks`: ``out[received_rows, H]`` rank-major again,
    ``out[map[p]] = padded[p]`` (times ``probs[map[p]]``, probs by rank-major row); padding
    dropped, rows no entry names (past ``sum(split_sizes)``) zero. This is exactly
    :func:`unpad_from_alignment` (same options, same errors), one pass."""
    return unpad_from_alignment(padded, permutation_map, received_rows, probs, **kwargs)


# ---------------------------------------------------------------------------
# Utilities
# ---------------------------------------------------------------------------


def copy(src: Array, dst: Array, *, check: bool = True, num_threads: int = 0, workspace: Optional[Array] = None,
         stream: Optional[int] = None) -> Array:
    """``dst[...] = src`` byte for byte (same dtype and element count, both
    contiguous), on any devices (host <-> CUDA too); returns ``dst``."""
    op = "copy"
    dst_arrays = arrays_of(dst, op, "dst")
    src_arrays = arrays_of(src, op, "src")
    (src,) = prepare(src_arrays, src)
    (dst,) = prepare(dst_arrays, dst)
    if stream is None:  # the current torch stream of whichever side is a CUDA tensor
        stream = dst_arrays.stream(dst) or src_arrays.stream(src)
    _C.copy(src, dst, **_options(dst_arrays, dst, check, num_threads, workspace, stream))
    return dst
