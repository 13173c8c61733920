"""The plan ops on numpy arrays (and, for the names padmoe.torch has, torch tensors): make_plan,
dispatch, combine, their fused and scaled forms, their backward, and the layouts other
kernels consume. Padded outputs have ``plan.padded_rows_bound`` rows, rows at or past P zero.
Each function is its unique part under ``@native_op`` (_native_op.py: the arguments, options and
native call they share)."""

from __future__ import annotations

from typing import Optional, Tuple

from ._args import check_expert_map, map_experts
from ._arrays import arrays_of, ndim, prepare
from ._common import _C, Array, _check_data, _cols, _padded_out, _scales_out
from ._native_op import NO_OUT, PADDED, PADDED_GRAD, native_op
from ._plan import INT32_MAX, PLAIN_ROUTING, Plan, PlanOptions, routing_options
from ._sizes import aligned_rows_bound

# ---------------------------------------------------------------------------
# 1. Routing plan
# ---------------------------------------------------------------------------


# make_plan's routing options, keyword-only after check: PlanOptions' fields, or options= for all.
_ROUTING = (
    ("expert_map", None, "Optional[Array]"),
    ("first_expert", 0, "int"),
    ("global_experts", 0, "int"),
    ("drop_invalid", False, "bool"),
    ("expert_capacity", None, "Optional[int]"),
    ("drop_policy", "position", "str"),
    ("probs", None, "Optional[Array]"),
    ("options", None, "Optional[PlanOptions]"),
)


def _routed(c):
    """make_plan's routing options as one value (``c.routed``), checked before top_experts is."""
    keywords = (c.expert_map, c.first_expert, c.global_experts, c.drop_invalid, c.expert_capacity, c.drop_policy)
    c.routed = routing_options(c.op, c.options, *keywords, c.probs)
    c.capacity = None if c.routed is None else c.routed.expert_capacity


def _routing(arrays, options: Optional[PlanOptions], dropped):
    """make_plan's routing options (from :func:`routing_options`) as _C.make_plan_out's keywords."""
    o = PLAIN_ROUTING if options is None else options
    if o.drop_policy not in ("position", "probs"):
        raise ValueError(f"make_plan: drop_policy: expected 'position' or 'probs', got {o.drop_policy!r}")
    cap = -1 if o.expert_capacity is None else int(o.expert_capacity)
    kw = dict(
        first_expert=int(o.first_expert),
        global_experts=int(o.global_experts),
        drop_invalid=bool(o.drop_invalid),
        expert_capacity=cap,
        drop_policy=o.drop_policy,
        dropped=dropped,
    )
    if o.expert_map is not None:
        (kw["expert_map"],) = prepare(arrays, o.expert_map)
    if o.probs is not None:
        (kw["probs"],) = prepare(arrays, o.probs)  # [T, K] or [A]: read by assignment id
    return kw


def _plan_buffers(op, out, top_experts, num_experts, alignment, expert_capacity=None) -> Plan:
    """The plan an op fills: ``out`` (checked against this call's sizes), else a new one."""
    t, k = (int(top_experts.shape[0]), int(top_experts.shape[1])) if ndim(top_experts) == 2 else (0, 1)
    if out is None:
        return Plan._allocate(t, k, num_experts, alignment, top_experts, expert_capacity)
    if ndim(top_experts) == 2 and (out.num_tokens, out.top_k, out.num_experts, out.alignment) != (
        t,
        k,
        num_experts,
        alignment,
    ):
        raise ValueError(
            f"{op}: out: the plan buffers are for num_tokens={out.num_tokens}, top_k={out.top_k}, "
            f"num_experts={out.num_experts}, alignment={out.alignment}; this call needs "
            f"num_tokens={t}, top_k={k}, num_experts={num_experts}, alignment={alignment}"
        )
    return out


@native_op(outputs="plan", keywords=("check", *_ROUTING, "out", "num_threads", "workspace", "stream"), before=_routed)
def make_plan(c, top_experts: Array, num_experts: int, alignment: int) -> Plan:
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

    ``options``: the same routing options as one :class:`padmoe.PlanOptions` value, instead of the
    keywords (not both).
    """
    plan = _plan_buffers(c.op, c.plan, top_experts, num_experts, alignment, c.capacity)
    routing = _routing(c.arrays, c.routed, getattr(plan, "dropped", None))
    _C.make_plan_out(top_experts, num_experts, alignment, plan, **routing, **c.opts)
    return plan


@native_op(
    keywords=("check", *_ROUTING, "num_threads", "workspace", "stream"),
    numpy_only="Routing.from_topk(...).row_experts",
    before=_routed,
)
def make_plan_layouts(c, top_experts: Array, num_experts: int, alignment: int) -> Tuple[Plan, Array, Array, Array]:
    """:func:`make_plan` and, from the same pass, the layouts other kernels consume:
    ``(plan, row_experts, block_experts, padded_total)``, int32 on ``top_experts``' device.
    The routing options are :func:`make_plan`'s.

    ``row_experts[padded_rows_bound]``: the expert of each padded row, -1 on padding rows and past P
    (DeepGEMM's contiguous grouped layout: its ``m_indices``). ``block_experts[ceil(padded_rows_bound /
    alignment)]``: the expert of each block of ``alignment`` rows, -1 past P (vLLM's
    ``expert_ids``). ``padded_total[1]``: P, on the device (no synchronization). numpy arrays only
    (torch: ``padmoe.torch.Routing``'s ``row_experts`` and ``padded_rows``)."""
    plan = _plan_buffers(c.op, None, top_experts, num_experts, alignment, c.capacity)
    cap = int(plan.row_sources.shape[0])
    m = max(int(alignment), 1)
    row_experts = c.arrays.empty((cap,), c.arrays.int32, top_experts)
    block_experts = c.arrays.empty((-(-cap // m),), c.arrays.int32, top_experts)
    padded_total = c.arrays.empty((1,), c.arrays.int32, top_experts)
    routing = _routing(c.arrays, c.routed, plan.dropped)
    _C.make_plan_out(
        top_experts, num_experts, alignment, plan, row_experts, block_experts, padded_total, **routing, **c.opts
    )
    return plan, row_experts, block_experts, padded_total


@native_op(keywords=NO_OUT)
def moe_align_block_size(
    c,
    topk_ids: Array,
    block_size: int,
    num_experts: int,
    expert_map: Optional[Array] = None,
    pad_sorted_ids: bool = False,
    ignore_invalid_experts: bool = False,
) -> Tuple[Array, Array, Array]:
    """vLLM's ``moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
    pad_sorted_ids=False, ignore_invalid_experts=False)``: ``(sorted_token_ids, expert_ids,
    num_tokens_post_padded)``, int32 on ``topk_ids``' device.

    ``sorted_token_ids[R]`` (R = :func:`aligned_rows_bound`): each expert's assignment ids
    ``t*K + k`` in ascending order (stable; vLLM's atomic kernel promises no order), the expert's run
    padded to a multiple of ``block_size`` with the sentinel ``T*K``, then the sentinel to the end.
    ``expert_ids[ceil(R / block_size)]``: the expert of each block; -1 for blocks at or past P (as
    vLLM's kernel). ``num_tokens_post_padded[1]``: P. ``expert_map`` (global id -> local id, -1 for
    experts of other ranks; ``[num_experts]`` int32/int64, entries in ``[-1, num_experts)``): with
    ``ignore_invalid_experts=False`` applied to every entry of ``expert_ids`` afterwards, as vLLM
    does (``expert_map[expert_ids]``: the blocks past P read the map's last entry); with ``True`` the
    assignments of experts mapped to -1 get no entry and the rest are grouped and ordered by their
    local id (vLLM's kernel with the map). As in vLLM, ids outside ``[0, num_experts)`` are skipped:
    their assignments get no entry (``make_plan`` rejects them)."""
    op, arrays = c.op, c.arrays
    remap = expert_map is not None and not ignore_invalid_experts  # (the kernel checks a map it is given)
    if remap:  # before anything runs; a CUDA map's entries only with check (one synchronization)
        cuda_map = bool(getattr(expert_map, "is_cuda", False))
        check_expert_map(
            op,
            expert_map,
            num_experts,
            not cuda_map or _check_data(arrays_of(expert_map, op, "expert_map"), expert_map, c.check),
        )
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
    _C.moe_align_block_size_out(topk_ids, block_size, num_experts, sorted_ids, expert_ids, post, in_kernel, **c.opts)
    return sorted_ids, map_experts(expert_ids, expert_map) if remap else expert_ids, post


def _plan_assignments(plan) -> int:
    return max(int(plan.num_tokens) * int(plan.top_k), 0)


def _entry_stride(a) -> int:
    """The stride in entries of a 1-D array: numpy and DLPack arrays (``strides`` in bytes) or torch."""
    strides = getattr(a, "strides", None)
    if isinstance(strides, tuple) and strides:
        return int(strides[0]) // max(int(getattr(a, "itemsize", 1)), 1)
    stride = getattr(a, "stride", None)
    return int(stride(0)) if callable(stride) else 1


def _bound_rows(plan, op: str = "dispatch"):
    """The rows of a plan op's padded output: ``plan.padded_rows_bound`` (its ``row_sources``' length).
    What sizes the output is checked first, as the operator checks it, so that a bad plan is an error
    before anything is allocated: a Plan-like object (TypeError otherwise) whose ``row_sources`` is a
    contiguous 1-D array (a zero-stride view could name 2^31 rows)."""

    def rows() -> int:
        if not hasattr(plan, "row_sources"):
            raise TypeError(f"{op}: plan: expected a padmoe Plan (make_plan's result), got {type(plan).__name__}")
        src = plan.row_sources
        if ndim(src) != 1:
            return 0  # the operator reports the shape
        n = int(src.shape[0])
        if n > 1 and _entry_stride(src) != 1:
            raise ValueError(f"{op}: plan.row_sources: expected a contiguous tensor, got stride {_entry_stride(src)}")
        return n

    return rows


@native_op(outputs="y", keywords=PADDED)
def dispatch(c, x: Array, plan: Plan, weights: Optional[Array] = None) -> Array:
    """``y[plan.padded_rows_bound, H]``: ``y[dest_rows[t*K+k]] = x[t]`` (times ``weights[t*K+k]`` when
    given), each token row read once and written to its K padded rows; padding rows and rows at or
    past P are zero. ``zero_padding=False`` leaves them unwritten (for consumers that skip them:
    DeepGEMM with the -1 row layout, masked grouped GEMMs; an inference forward only, never rows a
    weight gradient reduces over). ``rows=n`` (n >= P) or ``out=`` size the output otherwise."""
    c.y = _padded_out(c.arrays, c.op, x, c.rows, c.y, _bound_rows(plan, c.op))


@native_op(outputs="y y_scales", keywords=PADDED)
def dispatch_scaled(c, x: Array, plan: Plan, x_scales: Array) -> Tuple[Array, Array]:
    """:func:`dispatch` of already-quantized rows with their scales moved in the same pass:
    ``(y, y_scales)`` with ``plan.padded_rows_bound`` rows. Scales: per-row float32 ``[T]`` / ``[T, 1]``,
    per-128-column float32 ``[T, ceil(H/128)]``, or MXFP8 E8M0 bytes ``[T, ceil(H/32)]`` (uint8, or a
    torch ``float8_e8m0fnu`` tensor); padding rows (and rows past P) get zero data and scale 1.
    Unweighted. ``out=(y, y_scales)``."""
    c.y = _padded_out(c.arrays, c.op, x, c.rows, c.y, _bound_rows(plan, c.op))
    c.y_scales = _scales_out(c.arrays, x_scales, c.y.shape[0], x, c.y_scales)


@native_op(outputs="y plan", arrays="x top_experts", keywords=PADDED)
def make_plan_and_dispatch(
    c,
    x: Array,
    top_experts: Array,
    num_experts: int,
    alignment: int,
    weights: Optional[Array] = None,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
    rows: Optional[int] = None,
    out: Optional[Tuple[Optional[Array], Optional[Plan]]] = None,
) -> Tuple[Array, Plan]:
    """:func:`make_plan` then :func:`dispatch` in one call: ``(y, plan)``, the plan of
    ``top_experts[T, K]`` and ``y[plan.padded_rows_bound, H] = dispatch(x, plan, weights)``, bit for
    bit (make_plan's launch then dispatch's). Every check (make_plan's on ``top_experts``,
    dispatch's on ``x`` and ``weights``) runs before anything is written.

    ``rows=n`` with ``n >= plan.padded_rows_bound`` allocates n rows. ``out=(y, plan)``: ``y`` with at
    least ``plan.padded_rows_bound`` rows and/or a plan from ``Plan.empty(T, K, E, alignment,
    like=...)`` (either may be None: allocated), filled and returned. ``zero_padding`` as
    :func:`dispatch`."""
    plan = _plan_buffers(c.op, c.plan, top_experts, num_experts, alignment)
    slots = _bound_rows(plan, c.op)()
    if c.y is None and rows is not None and int(rows) < slots:  # P is not known before the call
        raise ValueError(f"{c.op}: rows: must be >= plan.padded_rows_bound = {slots}, got {int(rows)}")
    y = _padded_out(c.arrays, c.op, x, rows, c.y, lambda: slots)
    _C.make_plan_and_dispatch_out(x, top_experts, num_experts, alignment, plan, weights, y, **c.opts)
    return y, plan


def _token_rows(c, like, plan, out):
    """An output of ``plan.num_tokens`` rows shaped like ``like``'s: ``out``, else a new one."""
    return out if out is not None else c.arrays.empty((max(int(plan.num_tokens), 0), _cols(like)), like.dtype, like)


@native_op(outputs="out")
def combine(c, y: Array, plan: Plan, weights: Optional[Array] = None) -> Array:
    """``out[T, H]`` = :func:`padded_scatter` on a plan: the weighted top-k sum
    in float32, ascending k, cast once to y's dtype."""
    c.out = _token_rows(c, y, plan, c.out)


@native_op(outputs="grad_y grad_weights", arrays="y", keywords=PADDED_GRAD)
def combine_backward(
    c, grad_out: Array, y: Array, plan: Plan, weights: Optional[Array] = None
) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`combine` from one read of ``grad_out``:
    ``(grad_y, grad_weights)`` with ``grad_y[dest_rows[a]] = w(a) * grad_out[a // K]``
    (``plan.padded_rows_bound`` rows, padding rows and rows past P zero; y's dtype) and
    ``grad_weights[a] = <y[dest_rows[a]], grad_out[a // K]>`` (weights' dtype) when weights were
    given, else None."""
    c.grad_y = _padded_out(c.arrays, c.op, y, c.rows, c.grad_y, _bound_rows(plan, c.op))
    c.grad_weights = c.weight_grad(weights, _plan_assignments(plan))


@native_op(outputs="grad_x grad_weights", arrays="x")
def dispatch_backward(
    c, grad_y: Array, x: Array, plan: Plan, weights: Optional[Array] = None
) -> Tuple[Array, Optional[Array]]:
    """Backward of :func:`dispatch`: ``(grad_x, grad_weights)`` with
    ``grad_x = combine(grad_y, weights)`` (x's dtype) and
    ``grad_weights[a] = <grad_y[dest_rows[a]], x[a // K]>`` (weights' dtype)
    when weights were given, else None."""
    c.grad_x = _token_rows(c, x, plan, c.grad_x)
    c.grad_weights = c.weight_grad(weights, _plan_assignments(plan))
