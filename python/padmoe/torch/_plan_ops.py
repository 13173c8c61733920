"""The static-shape path: make_plan, dispatch, combine and their fused, scaled and quantized forms.

Padded outputs have ``plan.padded_rows_bound`` rows (known on the host, so nothing reads P); rows at or
past P are zero, so outputs are fully defined. No host synchronization with ``check=False`` (the
default under torch.compile and CUDA-graph capture). Each wrapper sits beside its operators' fake
kernels.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from padmoe._plan import INT32_MAX, Plan, PlanOptions, plan_offsets, routing_options

from ._common import (
    Tensor,
    call,
    eager_mode,
    fake_plan_sizes,
    fake_scales,
    fake_wgrad,
    fp8_dtype,
    mode,
    ops,
    packed,
    plan_args,
)

# ---------------------------------------------------------------------------
# make_plan
# ---------------------------------------------------------------------------


@torch.library.register_fake("padmoe::make_plan")
def _(top_experts, num_experts, alignment, check=2, weights=None):
    t, k = top_experts.shape
    return top_experts.new_empty(plan_offsets(t, k, num_experts, alignment).size, dtype=torch.int32)


@torch.library.register_fake("padmoe::make_plan_routed")
def _(
    top_experts,
    num_experts,
    alignment,
    expert_map,
    first_expert,
    global_experts,
    drop_invalid,
    expert_capacity,
    by_probs,
    probs,
    check=2,
):
    t, k = top_experts.shape
    return (
        top_experts.new_empty(plan_offsets(t, k, num_experts, alignment, expert_capacity).size, dtype=torch.int32),
        top_experts.new_empty(1, dtype=torch.int32),
    )


def routed_plan(top_experts, weights, num_experts, alignment, check, options: PlanOptions) -> Plan:
    """make_plan with routing options (from :func:`padmoe._plan.routing_options`): the Plan (with
    ``expert_capacity`` and ``dropped``)."""
    drop_policy, probs = options.drop_policy, options.probs
    if drop_policy not in ("position", "probs"):
        raise ValueError(f"make_plan: drop_policy: expected 'position' or 'probs', got {drop_policy!r}")
    if drop_policy == "probs" and probs is None:
        probs = weights  # Routing.from_topk: the router weights
    cap = None if options.expert_capacity is None else int(options.expert_capacity)
    if probs is not None and probs.requires_grad:
        probs = probs.detach()
    plan, dropped = ops.make_plan_routed.default(
        top_experts,
        num_experts,
        alignment,
        expert_map=options.expert_map,
        first_expert=int(options.first_expert),
        global_experts=int(options.global_experts),
        drop_invalid=bool(options.drop_invalid),
        expert_capacity=cap,
        by_probs=drop_policy == "probs",
        probs=probs,
        check=eager_mode(check),
    )
    t, k = top_experts.shape
    return Plan._from_packed(plan, t, k, num_experts, alignment, cap, dropped if cap is not None else None)


def make_plan(
    top_experts: Tensor,
    num_experts: int,
    alignment: int,
    *,
    check: Optional[bool] = None,
    expert_map: Optional[Tensor] = None,
    first_expert: int = 0,
    global_experts: int = 0,
    drop_invalid: bool = False,
    expert_capacity: Optional[int] = None,
    drop_policy: str = "position",
    probs: Optional[Tensor] = None,
    options: Optional[PlanOptions] = None,
) -> Plan:
    """Routing plan of ``top_experts[T, K]`` (int32/int64, any stride) over ``num_experts``
    experts, segments padded to multiples of ``alignment``: a :class:`padmoe.Plan` of int32
    tensors on top_experts' device, ``row_sources`` with ``padded_rows_bound`` entries (-1 past P).

    Routing options (docs/design.md "Dropped assignments"): local experts ``[first_expert,
    first_expert + num_experts)`` of ``global_experts``, or ``expert_map[global_experts]`` (global id
    -> local id, -1 = not local); ``drop_invalid`` drops ids outside ``[0, global_experts)``;
    ``expert_capacity`` C makes every segment exactly C rows, each expert keeping its first C
    assignments (``drop_policy="position"``) or the C largest ``probs`` (``"probs"``), and
    ``plan.dropped`` ([1] int32, on the device) counts the dropped. The row ops treat a dropped
    assignment as absent: no row, zero contribution, zero weight gradient. ``options``: the same
    routing options as one :class:`padmoe.PlanOptions` value, instead of the keywords (not both)."""
    if (
        options is not None
        or expert_map is not None
        or first_expert
        or global_experts
        or drop_invalid
        or expert_capacity is not None
        or drop_policy != "position"
        or probs is not None
    ):
        routed = routing_options(
            "make_plan",
            options,
            expert_map,
            first_expert,
            global_experts,
            drop_invalid,
            expert_capacity,
            drop_policy,
            probs,
        )
        if routed is not None:
            return routed_plan(top_experts, None, num_experts, alignment, check, routed)
    # the plain plan, the operator called inline: this is the hot path (a helper call is about 0.1 us)
    op, default = call("make_plan")
    p = op(top_experts, num_experts, alignment, default if check is None else int(bool(check)), None)
    t, k = top_experts.shape
    return Plan._from_packed(p, t, k, num_experts, alignment)


# ---------------------------------------------------------------------------
# dispatch / combine
# ---------------------------------------------------------------------------


@torch.library.register_fake("padmoe::dispatch")
def _(x, plan, weights, top_k, num_experts, alignment, expert_capacity, check=2, zero_padding=True):
    _, _, rows = fake_plan_sizes(plan, top_k, num_experts, alignment, expert_capacity)
    return x.new_empty(rows, x.shape[1])


@torch.library.register_fake("padmoe::dispatch_backward")
def _(grad_y, x, plan, weights, top_k, num_experts, alignment, expert_capacity, need_wgrad, check=2):
    t, a, _ = fake_plan_sizes(plan, top_k, num_experts, alignment, expert_capacity)
    gx = grad_y.new_empty(t, grad_y.shape[1]) if x is None else torch.empty_like(x)
    return gx, fake_wgrad(grad_y, weights, a, need_wgrad)


def dispatch(
    x: Tensor, plan: Plan, weights: Optional[Tensor] = None, *, check: Optional[bool] = None, zero_padding: bool = True
) -> Tensor:
    """``y[plan.padded_rows_bound, H]``: ``y[dest_rows[t*K+k]] = x[t]`` (times ``weights[t*K+k]`` when
    given); padding rows and rows at or past P are zero (``zero_padding=False``: left unwritten, for
    consumers that never read them; see Routing.dispatch). Differentiable wrt ``x`` and ``weights``
    (backward: the ``dispatch_backward`` operator)."""
    op, default = call("dispatch")
    p = getattr(plan, "packed", None)
    return op(
        x,
        packed(plan) if p is None else p,
        weights,
        plan.top_k,
        plan.num_experts,
        plan.alignment,
        getattr(plan, "expert_capacity", None),
        default if check is None else int(bool(check)),
        bool(zero_padding),
    )


def dispatch_backward(
    grad_y: Tensor, x: Tensor, plan: Plan, weights: Optional[Tensor] = None, *, check: Optional[bool] = None
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backward of :func:`dispatch`, called explicitly (autograd calls it for you):
    ``(grad_x, grad_weights)`` with ``grad_x = combine(grad_y, plan, weights)`` (x's dtype) and
    ``grad_weights[a] = <grad_y[dest_rows[a]], x[a // K]>`` (weights' dtype) when weights are given,
    else None. For a hand-written autograd.Function or a captured training step."""
    gx, gw = ops.dispatch_backward.default(
        grad_y, x, packed(plan), weights, *plan_args(plan), weights is not None, eager_mode(check)
    )
    return gx, (gw if weights is not None else None)


@torch.library.register_fake("padmoe::make_plan_and_dispatch")
def _(x, top_experts, num_experts, alignment, weights=None, check=2, zero_padding=True):
    t, k = top_experts.shape
    o = plan_offsets(t, k, num_experts, alignment)
    return x.new_empty(o.rows, x.shape[1]), top_experts.new_empty(o.size, dtype=torch.int32)


def make_plan_and_dispatch(
    x: Tensor,
    top_experts: Tensor,
    num_experts: int,
    alignment: int,
    weights: Optional[Tensor] = None,
    *,
    check: Optional[bool] = None,
    zero_padding: bool = True,
) -> Tuple[Tensor, Plan]:
    """:func:`make_plan` then :func:`dispatch` in one operator: ``(y, plan)`` with ``plan`` the
    :class:`padmoe.Plan` that ``make_plan(top_experts, num_experts, alignment)`` returns and
    ``y[plan.padded_rows_bound, H]`` what ``dispatch(x, plan, weights)`` returns, bit for bit (the
    host cost of one op). Every check runs before anything is written. Differentiable wrt ``x`` and
    ``weights`` exactly as :func:`dispatch`; the plan is not. Plain routing only (no ``make_plan``
    routing options)."""
    op, default = call("make_plan_and_dispatch")
    y, p = op(x, top_experts, num_experts, alignment, weights, mode(check, default), bool(zero_padding))
    t, k = top_experts.shape
    return y, Plan._from_packed(p, t, k, num_experts, alignment)


@torch.library.register_fake("padmoe::combine")
def _(y, plan, weights, top_k, num_experts, alignment, expert_capacity, check=2):
    t, _, _ = fake_plan_sizes(plan, top_k, num_experts, alignment, expert_capacity)
    return y.new_empty(t, y.shape[1])


@torch.library.register_fake("padmoe::combine_backward")
def _(grad_out, y, plan, weights, top_k, num_experts, alignment, expert_capacity, need_wgrad, check=2, rows=-1):
    _, a, bound = fake_plan_sizes(plan, top_k, num_experts, alignment, expert_capacity)
    if rows < 0:
        rows = y.shape[0] if y is not None else bound
    gy = grad_out.new_empty(rows, grad_out.shape[1], dtype=grad_out.dtype if y is None else y.dtype)
    return gy, fake_wgrad(grad_out, weights, a, need_wgrad)


def combine(y: Tensor, plan: Plan, weights: Optional[Tensor] = None, *, check: Optional[bool] = None) -> Tensor:
    """``out[T, H]``: ``out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]]`` (float32 accumulation
    in ascending k, cast once); ``y`` has at least P rows (padding rows never read).
    Differentiable wrt ``y`` and ``weights`` (backward: ``combine_backward``, one read of the
    output gradient)."""
    op, default = call("combine")
    p = getattr(plan, "packed", None)
    return op(
        y,
        packed(plan) if p is None else p,
        weights,
        plan.top_k,
        plan.num_experts,
        plan.alignment,
        getattr(plan, "expert_capacity", None),
        default if check is None else int(bool(check)),
    )


def combine_backward(
    grad_out: Tensor, y: Tensor, plan: Plan, weights: Optional[Tensor] = None, *, check: Optional[bool] = None
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backward of :func:`combine`, called explicitly (autograd calls it for you), from one read
    of ``grad_out``: ``(grad_y, grad_weights)`` with ``grad_y[dest_rows[a]] = w(a) * grad_out[a // K]``
    (``plan.padded_rows_bound`` rows, padding rows and rows past P zero; y's dtype) and
    ``grad_weights[a] = <y[dest_rows[a]], grad_out[a // K]>`` (weights' dtype) when weights are
    given, else None."""
    gy, gw = ops.combine_backward.default(
        grad_out,
        y,
        packed(plan),
        weights,
        *plan_args(plan),
        weights is not None,
        eager_mode(check),
        plan.padded_rows_bound,
    )
    return gy, (gw if weights is not None else None)


# ---------------------------------------------------------------------------
# rows moved with their scales; the fused quantizing dispatch (not differentiable)
# ---------------------------------------------------------------------------


@torch.library.register_fake("padmoe::dispatch_scaled")
def _(x, plan, x_scales, top_k, num_experts, alignment, expert_capacity, check=2, zero_padding=True):
    _, _, rows = fake_plan_sizes(plan, top_k, num_experts, alignment, expert_capacity)
    return x.new_empty(rows, x.shape[1]), fake_scales(x_scales, rows)


def dispatch_scaled(
    x: Tensor, plan: Plan, x_scales: Tensor, *, check: Optional[bool] = None, zero_padding: bool = True
) -> Tuple[Tensor, Tensor]:
    """:func:`dispatch` of already-quantized rows with their scales moved in the same kernel:
    ``(y, y_scales)``, both with ``plan.padded_rows_bound`` rows. Scales: per-row float32 ``[T]`` /
    ``[T, 1]``, per-128-column float32 ``[T, ceil(H/128)]``, or MXFP8 E8M0 ``[T, ceil(H/32)]`` as
    uint8 or ``torch.float8_e8m0fnu``; padding rows (and rows past P) get zero data and scale 1.
    Unweighted; not differentiable."""
    return ops.dispatch_scaled.default(
        x, packed(plan), x_scales, *plan_args(plan), eager_mode(check), bool(zero_padding)
    )


@torch.library.register_fake("padmoe::dispatch_quantized")
def _(
    x, plan, top_k, num_experts, alignment, expert_capacity, scale_layout, dtype, check=2, zero_padding=True, rows=-1
):
    _, _, bound = fake_plan_sizes(plan, top_k, num_experts, alignment, expert_capacity)
    rows = bound if rows < 0 else rows
    h = x.shape[1]
    if scale_layout == "row":
        scales = x.new_empty(rows, dtype=torch.float32)
    elif scale_layout == "mxfp8":
        scales = x.new_empty(rows, (h + 31) // 32, dtype=torch.uint8)
    else:
        scales = x.new_empty(rows, (h + 127) // 128, dtype=torch.float32)
    return x.new_empty(rows, h, dtype=dtype), scales


_UNSET = object()


def dispatch_quantized(
    x: Tensor,
    plan: Plan,
    *,
    scale_layout: str = "block128",
    fp8: str = "e4m3",
    check: Optional[bool] = None,
    zero_padding: bool = True,
    rows: Optional[int] = None,
    dtype=_UNSET,
) -> Tuple[Tensor, Tensor]:
    """Fused quantizing dispatch: ``(y, y_scales)`` with ``plan.padded_rows_bound`` rows from bfloat16
    / float16 / float32 rows ``x[T, H]``, each token row read once, quantized once and written to its
    K padded rows. ``fp8``: ``"e4m3"`` (``y`` is ``torch.float8_e4m3fn``) or ``"e5m2"``
    (``torch.float8_e5m2``). ``scale_layout``: ``"block128"`` (DeepSeek-V3 1x128: float32
    ``[rows, ceil(H/128)]``), ``"mxfp8"`` (OCP MX v1.0 E8M0 bytes: uint8 ``[rows, ceil(H/32)]``;
    ``.view(torch.float8_e8m0fnu)`` decodes them to 2^X) or ``"row"`` (float32 ``[rows]``). Padding
    rows and rows past P: zero codes, scale 1 (``zero_padding=False``: left unwritten). Not
    differentiable (an ``x`` that requires a gradient under grad mode raises NotImplementedError);
    unweighted. ``rows=``: allocate that many rows instead (at least P; rows past P as above), as
    :func:`padmoe.dispatch_quantized`'s. ``dtype=`` (a torch float8 dtype) is the deprecated spelling
    of ``fp8=``."""
    op = "dispatch_quantized"
    if dtype is not _UNSET:
        warnings.warn(
            "padmoe.torch.dispatch_quantized: dtype= is deprecated: pass fp8='e4m3' or 'e5m2'",
            DeprecationWarning,
            stacklevel=2,
        )
        names = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", None: "e4m3"}
        if dtype not in names:
            raise ValueError(f"{op}: dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
        fp8 = names[dtype]
    n = -1  # the op's default: plan.padded_rows_bound rows
    if rows is not None:
        n = int(rows)
        if n < 0:
            raise ValueError(f"{op}: rows: must be >= 0, got {n}")
        if n > INT32_MAX:  # before allocating, as padmoe.dispatch_quantized: within the int32 index outputs
            raise ValueError(f"{op}: rows: size overflow: {n} does not fit the int32 index outputs")
    return ops.dispatch_quantized.default(
        x,
        packed(plan),
        *plan_args(plan),
        scale_layout,
        fp8_dtype("dispatch_quantized", fp8),
        eager_mode(check),
        bool(zero_padding),
        n,
    )
