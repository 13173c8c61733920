"""padmoe.torch: padmoe's routing ops as native PyTorch operators (autograd, torch.compile, CUDA graphs).

Usage::

    import torch
    import padmoe.torch as pt

    logits = router(x)                                    # [T, E]
    probs, top_experts = logits.softmax(-1).topk(2)       # [T, K] weights and expert ids
    r = pt.Routing.from_topk(top_experts, probs, num_experts=E, alignment=16)
    y = r.dispatch(x)                                     # [capacity, H] expert-grouped, padded, tail rows zero
    h = torch.nn.functional.grouped_mm(y, w_experts, offs=r.offsets)   # offs = padded_bins (int32)
    out = r.combine(h)                                    # [T, H], weighted by probs; grads reach x and probs

    # the same, step by step (static shapes: torch.compile(fullgraph=True) / CUDA-graph capturable)
    plan = pt.make_plan(top_experts, E, 16)               # a padmoe.Plan of int32 tensors
    y = pt.dispatch(x, plan)                              # [plan.capacity, H]
    out = pt.combine(h, plan, probs)                      # [T, H]
    y, plan = pt.make_plan_and_dispatch(x, top_experts, E, 16)   # the first two in one call (one operator)

    # drop-ins (same arguments and results as MegaBlocks / Megatron; P rows, read on the host)
    y = pt.padded_gather(x, indices, bin_ids, bins, padded_bins, top_k)
    out = pt.padded_scatter(y, indices, bin_ids, weights, bins, padded_bins, top_k)
    padded, permutation_map, inclusive_offsets = pt.pad_to_alignment(hidden, tokens_per_expert, 16)
    out = pt.unpad_from_alignment(padded, permutation_map, hidden.shape[0], probs)

The operators (``torch.ops.padmoe.*``) are registered in C++ with the torch dispatcher
(``padmoe/_torch_ops.so``, built by ``pip install .`` against the installed torch; source
``python/src/padmoe_torch.cpp``): CPU and CUDA kernels, autograd written in C++ whose backward is
one call of the matching backward operator, and the fake (meta) kernels below for
``torch.compile``. The functions here only pick the check mode and pass the arguments on;
every check runs once, in C++. Operators: ``make_plan``, ``dispatch``, ``dispatch_backward``,
``make_plan_and_dispatch``,
``combine``, ``combine_backward``, ``padded_gather``, ``padded_gather_backward``,
``padded_scatter``, ``padded_scatter_backward``, ``padded_scatter_wgrad``,
``pad_to_alignment``, ``unpad_from_alignment``, ``unpad_from_alignment_backward``,
``sort_chunks`` (the expert-parallel chunk sort; its inverse :func:`unsort_chunks` is
``unpad_from_alignment``). Double backward is not supported.

Two paths:

- **Static shapes** (:func:`make_plan`, :func:`dispatch`, :func:`make_plan_and_dispatch`,
  :func:`combine`, :class:`Routing`): padded buffers have ``capacity = T*K + E*(alignment-1)`` rows, known
  on the host, so nothing reads P. Rows at or past P are zeroed in the same pass
  (``zero_tail``), so outputs are fully defined and deterministic. No host sync: these
  trace under ``torch.compile(fullgraph=True)`` and capture in ``torch.cuda.CUDAGraph``.
- **Drop-ins** (:func:`padded_gather`, :func:`padded_scatter`, :func:`pad_to_alignment`,
  :func:`unpad_from_alignment`): exactly MegaBlocks' / Megatron's results, whose padded
  outputs have P rows; P is read on the host (one synchronization on CUDA), so they are
  not CUDA-graph capturable. Under torch.compile their row count is an unbacked symbol.

Checking policy (``check``): ``None`` (the default) checks in eager mode, except while the
current CUDA stream is capturing a graph, and not at all under ``torch.compile``. With
checks on, the CUDA backend validates the data-dependent properties (expert ids,
permutations, bins) with one small kernel and a host synchronization, raising
``ValueError`` / ``TypeError`` with padmoe's message (naming the op, the argument and the
first offending position). ``check=False`` on CUDA synchronizes nothing and does not diagnose
bad data (``make_plan`` drops expert ids outside ``[0, E)``: ``dest_rows`` -1). The CPU
backend always checks everything. Shape/dtype/device checks always run.

Data types: rows float32 / float16 / bfloat16 run natively. Router weights and probs may be
of any float dtype, whatever the rows' dtype (read as float32), and of any shape with one
entry per assignment (``[T, K]`` or ``[T*K]``) and any stride; their gradients come back in
their dtype and shape. **float64 rows** (which padmoe's kernels do not take) run through
ATen float64 formulas inside the same operators, so ``torch.autograd.gradcheck`` exercises
the operators and their autograd. Index inputs int32 or int64, any stride; index outputs
int32.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from padmoe._args import check_expert_map, int_arg, map_experts
from padmoe._plan import Plan

__all__ = [
    "Plan",
    "Routing",
    "make_plan",
    "make_plan_and_dispatch",
    "set_default_check",
    "dispatch",
    "dispatch_quantized",
    "combine",
    "padded_gather",
    "padded_scatter",
    "padded_scatter_wgrad",
    "pad_to_alignment",
    "unpad_from_alignment",
    "moe_align_block_size",
    "batched_moe_align_block_size",
    "sort_chunks",
    "unsort_chunks",
]

Tensor = torch.Tensor


try:
    # Loading the module registers the operators with the dispatcher (TORCH_LIBRARY).
    from padmoe import _torch_ops as _native
except ImportError as e:
    raise ImportError(
        f"padmoe.torch: padmoe's torch operators (padmoe/_torch_ops.so) are missing or do not load with torch "
        f"{torch.__version__} ({e}). They are built by `pip install .` when torch is importable at build time; "
        "reinstall padmoe in this environment (pip install --no-build-isolation .).") from e

_ops = torch.ops.padmoe
_OPS = {name: getattr(_ops, name).default for name in (
    "make_plan", "dispatch", "dispatch_backward", "make_plan_and_dispatch", "combine", "combine_backward",
    "padded_gather",
    "padded_gather_backward", "padded_scatter", "padded_scatter_backward", "padded_scatter_wgrad",
    "pad_to_alignment", "unpad_from_alignment", "unpad_from_alignment_backward")}
# The module's entry points hand calls they do not take as they are (tensor subclasses, torch
# function modes, ...) to the OpOverloads.
for _i, _name in enumerate(_native.FALLBACK_ORDER):
    _native._set_fallback(_i, _OPS[_name])
_OPS_ALIGN = _ops.moe_align_block_size.default
_OPS_SORT = _ops.sort_chunks.default
# Rows moved with their scales (the `_scaled` operators; not differentiable): the OpOverloads.
_OPS_SCALED = {name: getattr(_ops, name + "_scaled").default
               for name in ("dispatch", "padded_gather", "pad_to_alignment", "unpad_from_alignment")}
_compiling = torch.compiler.is_compiling
_eager_check = 0 if os.environ.get("PADMOE_TORCH_CHECK", "1") == "0" else 2


def set_default_check(check: Optional[bool]) -> None:
    """What ``check=None`` means in eager mode from now on: ``None`` (the default) checks the data
    except while a CUDA graph is being captured; ``False`` never checks on CUDA (no
    synchronization at all: what a training or serving loop that trusts its router wants);
    ``True`` always checks. The environment variable ``PADMOE_TORCH_CHECK=0`` sets ``False`` at
    import. Under torch.compile, ``check=None`` never checks. The CPU backend always checks."""
    global _eager_check
    _eager_check = 2 if check is None else int(bool(check))


def _call(name):
    """(operator, check mode for None): the OpOverload while torch.compile traces (check off),
    the module's entry point in eager mode (the default of set_default_check)."""
    if _compiling():
        return _OPS[name], 0
    return getattr(_native, name), _eager_check


def _mode(check: Optional[bool], default: int) -> int:
    return default if check is None else int(bool(check))


def _triton_check(check: Optional[bool], like: Tensor) -> bool:
    """check= of the backend="triton" drop-ins as the native ones read it: CPU always checks; on CUDA
    None follows set_default_check (on, except while the stream captures)."""
    if not like.is_cuda:
        return True
    m = _mode(check, _eager_check)
    return (not torch.cuda.is_current_stream_capturing()) if m == 2 else bool(m)


# ---------------------------------------------------------------------------
# fake (meta) kernels: shapes for torch.compile
# ---------------------------------------------------------------------------


def _wgrad_fake(like: Tensor, weights: Optional[Tensor], n, need: bool) -> Tensor:
    if need and weights is not None:
        dt = weights.dtype
        return like.new_empty(n, dtype=dt)
    return like.new_empty(0, dtype=like.dtype if weights is None else weights.dtype)


def _plan_sizes(plan, top_k, num_experts, alignment):
    """(T, A, capacity) of a packed plan of 4*A + E*(alignment+3) entries, or with alignment = -C
    (a plan with an expert capacity C) of 3*A + E*(C+4)."""
    if alignment <= 0:
        a = (plan.shape[0] - num_experts * (4 - alignment)) // 3
        return a // top_k, a, -alignment * num_experts
    a = (plan.shape[0] - num_experts * (alignment + 3)) // 4
    return a // top_k, a, a + num_experts * (alignment - 1)


@torch.library.register_fake("padmoe::make_plan_routed")
def _(top_experts, num_experts, alignment, expert_map, first_expert, global_experts, drop_invalid, expert_capacity,
      by_probs, probs, check=2):
    t, k = top_experts.shape
    a = t * k
    rows = num_experts * expert_capacity if expert_capacity >= 0 else a + num_experts * (alignment - 1)
    return (top_experts.new_empty(3 * a + 4 * num_experts + rows, dtype=torch.int32),
            top_experts.new_empty(1, dtype=torch.int32))


@torch.library.register_fake("padmoe::make_plan")
def _(top_experts, num_experts, alignment, check=2, weights=None):
    t, k = top_experts.shape
    return top_experts.new_empty(4 * t * k + num_experts * (alignment + 3), dtype=torch.int32)


@torch.library.register_fake("padmoe::dispatch")
def _(x, plan, weights, top_k, num_experts, alignment, check=2, zero_padding=True):
    _, _, cap = _plan_sizes(plan, top_k, num_experts, alignment)
    return x.new_empty(cap, x.shape[1])


@torch.library.register_fake("padmoe::make_plan_and_dispatch")
def _(x, top_experts, num_experts, alignment, weights=None, check=2, zero_padding=True):
    t, k = top_experts.shape
    a = t * k
    return (x.new_empty(a + num_experts * (alignment - 1), x.shape[1]),
            top_experts.new_empty(4 * a + num_experts * (alignment + 3), dtype=torch.int32))


@torch.library.register_fake("padmoe::dispatch_backward")
def _(grad_y, x, plan, weights, top_k, num_experts, alignment, need_wgrad, check=2):
    t, a, _ = _plan_sizes(plan, top_k, num_experts, alignment)
    gx = grad_y.new_empty(t, grad_y.shape[1]) if x is None else torch.empty_like(x)
    return gx, _wgrad_fake(grad_y, weights, a, need_wgrad)


@torch.library.register_fake("padmoe::combine")
def _(y, plan, weights, top_k, num_experts, alignment, check=2):
    t, _, _ = _plan_sizes(plan, top_k, num_experts, alignment)
    return y.new_empty(t, y.shape[1])


@torch.library.register_fake("padmoe::combine_backward")
def _(grad_out, y, plan, weights, top_k, num_experts, alignment, need_wgrad, check=2, rows=-1):
    _, a, cap = _plan_sizes(plan, top_k, num_experts, alignment)
    if rows < 0:
        rows = y.shape[0] if y is not None else cap
    gy = grad_out.new_empty(rows, grad_out.shape[1], dtype=grad_out.dtype if y is None else y.dtype)
    return gy, _wgrad_fake(grad_out, weights, a, need_wgrad)


@torch.library.register_fake("padmoe::padded_gather")
def _(x, indices, bin_ids, bins, padded_bins, top_k, weights=None, check=2, zero_padding=True):
    p = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(p, x.shape[1])


@torch.library.register_fake("padmoe::padded_gather_backward")
def _(grad_y, x, indices, bin_ids, bins, padded_bins, top_k, weights, need_wgrad, check=2):
    return torch.empty_like(x), _wgrad_fake(x, weights, indices.shape[0], need_wgrad)


@torch.library.register_fake("padmoe::padded_scatter")
def _(y, indices, bin_ids, weights, bins, padded_bins, top_k, check=2):
    return y.new_empty(indices.shape[0] // top_k, y.shape[1])


@torch.library.register_fake("padmoe::padded_scatter_backward")
def _(grad_out, y, indices, bin_ids, weights, bins, padded_bins, top_k, need_wgrad, check=2):
    return torch.empty_like(y), _wgrad_fake(y, weights, indices.shape[0], need_wgrad)


@torch.library.register_fake("padmoe::padded_scatter_wgrad")
def _(y, grad, indices, bin_ids, bins, padded_bins, top_k, check=2):
    return y.new_empty(indices.shape[0])


@torch.library.register_fake("padmoe::pad_to_alignment")
def _(hidden_states, tokens_per_expert, alignment, check=2, zero_padding=True):
    p = torch.library.get_ctx().new_dynamic_size()
    return (hidden_states.new_empty(p, hidden_states.shape[1]),
            hidden_states.new_empty(p, dtype=torch.int32),
            hidden_states.new_empty(tokens_per_expert.shape[0], dtype=torch.int32))


@torch.library.register_fake("padmoe::moe_align_block_size")
def _(topk_ids, block_size, num_experts, pad_sorted_ids=False, check=2, expert_map=None):
    a = topk_ids.numel()
    r = a + min(a, num_experts) * (block_size - 1)
    if pad_sorted_ids:
        r = -(-r // block_size) * block_size
    return (topk_ids.new_empty(r, dtype=torch.int32), topk_ids.new_empty(-(-r // block_size), dtype=torch.int32),
            topk_ids.new_empty(1, dtype=torch.int32))


@torch.library.register_fake("padmoe::sort_chunks")
def _(received, split_sizes, num_ranks, alignment, sorted_index=None, check=2, zero_padding=True, rows=-1):
    p = rows if rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    e = split_sizes.numel() // num_ranks
    return (received.new_empty(p, received.shape[1]), received.new_empty(p, dtype=torch.int32),
            received.new_empty(e, dtype=torch.int32))


@torch.library.register_fake("padmoe::unpad_from_alignment")
def _(padded_output, permutation_map, original_size, probs=None, check=2):
    return padded_output.new_empty(original_size, padded_output.shape[1])


@torch.library.register_fake("padmoe::unpad_from_alignment_backward")
def _(grad_out, padded_output, permutation_map, probs, need_pgrad, check=2):
    return torch.empty_like(padded_output), _wgrad_fake(padded_output, probs, grad_out.shape[0], need_pgrad)


def _scales_fake(scales: Tensor, rows) -> Tensor:
    return scales.new_empty((rows,) + tuple(scales.shape[1:]))


@torch.library.register_fake("padmoe::dispatch_scaled")
def _(x, plan, x_scales, top_k, num_experts, alignment, check=2, zero_padding=True):
    _, _, cap = _plan_sizes(plan, top_k, num_experts, alignment)
    return x.new_empty(cap, x.shape[1]), _scales_fake(x_scales, cap)


@torch.library.register_fake("padmoe::padded_gather_scaled")
def _(x, indices, bin_ids, bins, padded_bins, top_k, x_scales, check=2, zero_padding=True):
    p = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(p, x.shape[1]), _scales_fake(x_scales, p)


@torch.library.register_fake("padmoe::pad_to_alignment_scaled")
def _(hidden_states, tokens_per_expert, alignment, hidden_scales, check=2, zero_padding=True):
    p = torch.library.get_ctx().new_dynamic_size()
    return (hidden_states.new_empty(p, hidden_states.shape[1]), _scales_fake(hidden_scales, p),
            hidden_states.new_empty(p, dtype=torch.int32),
            hidden_states.new_empty(tokens_per_expert.shape[0], dtype=torch.int32))


@torch.library.register_fake("padmoe::unpad_from_alignment_scaled")
def _(padded_output, permutation_map, original_size, padded_scales, check=2):
    return padded_output.new_empty(original_size, padded_output.shape[1]), _scales_fake(padded_scales, original_size)


# The fused quantizing dispatch (not differentiable): its OpOverload and fake kernel.
_OPS_QUANT = _ops.dispatch_quantized.default


@torch.library.register_fake("padmoe::dispatch_quantized")
def _(x, plan, top_k, num_experts, alignment, scale_layout, dtype, check=2, zero_padding=True):
    _, _, cap = _plan_sizes(plan, top_k, num_experts, alignment)
    h = x.shape[1]
    if scale_layout == "row":
        scales = x.new_empty(cap, dtype=torch.float32)
    elif scale_layout == "mxfp8":
        scales = x.new_empty(cap, (h + 31) // 32, dtype=torch.uint8)
    else:
        scales = x.new_empty(cap, (h + 127) // 128, dtype=torch.float32)
    return x.new_empty(cap, h, dtype=dtype), scales


def _scaled_mode(check: Optional[bool]) -> int:
    return _mode(check, 0 if _compiling() else _eager_check)


def _no_weights(op: str, arg: str, value) -> None:
    if value is not None:
        raise ValueError(f"{op}: scales: not with {arg} (rows move with their scales only in the move-only ops; "
                         "a weighted move of quantized rows would need requantizing)")


# ---------------------------------------------------------------------------
# 1. static-shape path: make_plan / dispatch / combine
# ---------------------------------------------------------------------------


def _backend(backend: str, op: str) -> None:
    if backend != "native":
        raise ValueError(f"{op}: backend: expected 'native' or 'triton', got {backend!r}")


def _packed(plan) -> Tensor:
    """The packed form of a plan: its own (plans of padmoe.torch.make_plan), else the eight arrays
    concatenated (one extra copy: plans from padmoe.make_plan or padmoe.eager)."""
    packed = getattr(plan, "packed", None)
    if packed is not None:
        return packed
    return torch.cat([getattr(plan, f).reshape(-1).to(torch.int32) for f in _PLAN_FIELDS])


_PLAN_FIELDS = ("indices", "bin_ids", "tokens_per_expert", "bins", "padded_tokens_per_expert", "padded_bins",
                "dest_rows", "row_sources")


def _align(plan) -> int:
    """The alignment argument of the plan operators: the plan's alignment, or -C for a plan with an
    expert capacity C (its row_sources then has E*C entries)."""
    c = getattr(plan, "expert_capacity", None)
    return plan.alignment if c is None else -int(c)


def _routed(top_experts, weights, num_experts, alignment, check, expert_map, first_expert, global_experts,
            drop_invalid, expert_capacity, drop_policy, probs):
    """make_plan with routing options: the Plan (with ``expert_capacity`` and ``dropped``)."""
    if drop_policy not in ("position", "probs"):
        raise ValueError(f"make_plan: drop_policy: expected 'position' or 'probs', got {drop_policy!r}")
    if drop_policy == "probs" and probs is None:
        probs = weights  # Routing.from_topk: the router weights
    cap = -1 if expert_capacity is None else int(expert_capacity)
    op = _ops.make_plan_routed.default
    check_mode = 0 if _compiling() else _mode(check, _eager_check)  # 2: checked unless the stream captures
    if probs is not None and probs.requires_grad:
        probs = probs.detach()
    packed, dropped = op(top_experts, num_experts, alignment, expert_map, int(first_expert), int(global_experts),
                         bool(drop_invalid), cap, drop_policy == "probs", probs, check_mode)
    t, k = top_experts.shape
    return Plan._from_packed(packed, t, k, num_experts, alignment, None if cap < 0 else cap,
                             dropped if cap >= 0 else None)


def make_plan(top_experts: Tensor, num_experts: int, alignment: int, *, check: Optional[bool] = None,
              expert_map: Optional[Tensor] = None, first_expert: int = 0, global_experts: int = 0,
              drop_invalid: bool = False, expert_capacity: Optional[int] = None, drop_policy: str = "position",
              probs: Optional[Tensor] = None) -> Plan:
    """Routing plan of ``top_experts[T, K]`` (int32/int64, any stride) over ``num_experts``
    experts, segments padded to multiples of ``alignment``: a :class:`padmoe.Plan` of int32
    tensors on top_experts' device, ``row_sources`` with ``capacity`` entries (-1 past P).
    No host synchronization with ``check=False`` (the default under torch.compile and
    CUDA-graph capture).

    Routing options (as :func:`padmoe.make_plan`; docs/design.md "Dropped assignments"): local
    experts ``[first_expert, first_expert + num_experts)`` of ``global_experts``, or
    ``expert_map[global_experts]`` (global id -> local id, -1 = not local); ``drop_invalid`` drops
    ids outside ``[0, global_experts)``; ``expert_capacity`` C makes every segment exactly C rows,
    each expert keeping its first C assignments (``drop_policy="position"``) or the C largest
    ``probs`` (``"probs"``), and ``plan.dropped`` ([1] int32, on the device) counts the dropped.
    The row ops (dispatch, combine and their backward) treat a dropped assignment as absent: no
    row, zero contribution, zero weight gradient."""
    if (expert_map is not None or first_expert or global_experts or drop_invalid or expert_capacity is not None
            or drop_policy != "position" or probs is not None):
        return _routed(top_experts, None, num_experts, alignment, check, expert_map, first_expert, global_experts,
                       drop_invalid, expert_capacity, drop_policy, probs)
    op, default = _call("make_plan")
    packed = op(top_experts, num_experts, alignment, _mode(check, default), None)
    t, k = top_experts.shape
    return Plan._from_packed(packed, t, k, num_experts, alignment)


def dispatch(x: Tensor, plan: Plan, weights: Optional[Tensor] = None, *, check: Optional[bool] = None,
             zero_padding: bool = True, scales: Optional[Tensor] = None) -> Tensor:
    """``y[plan.capacity, H]``: ``y[dest_rows[t*K+k]] = x[t]`` (times ``weights[t*K+k]`` when
    given); padding rows and rows at or past P are zero (``zero_padding=False``: left unwritten, for
    consumers that never read them; see Routing.dispatch). Differentiable wrt ``x`` and ``weights``
    (backward: the ``dispatch_backward`` operator).

    ``scales=x_scales`` (no weights) moves a scale tensor with the rows in the same kernel and
    returns ``(y, y_scales)``, both with ``plan.capacity`` rows: per-row float32 ``[T]`` / ``[T, 1]``,
    per-128-column float32 ``[T, ceil(H/128)]``, or MXFP8 E8M0 ``[T, ceil(H/32)]`` as uint8 or
    ``torch.float8_e8m0fnu``; padding rows (and rows past P) get zero data and scale 1. Not
    differentiable (float8 rows)."""
    if scales is not None:
        _no_weights("dispatch", "weights", weights)
        return _OPS_SCALED["dispatch"](x, _packed(plan), scales, plan.top_k, plan.num_experts, _align(plan),
                                       _scaled_mode(check), bool(zero_padding))
    op, default = _call("dispatch")
    return op(x, _packed(plan), weights, plan.top_k, plan.num_experts, _align(plan), _mode(check, default),
              bool(zero_padding))


def make_plan_and_dispatch(x: Tensor, top_experts: Tensor, num_experts: int, alignment: int,
                           weights: Optional[Tensor] = None, *, check: Optional[bool] = None,
                           zero_padding: bool = True) -> Tuple[Tensor, Plan]:
    """:func:`make_plan` then :func:`dispatch` in one operator: ``(y, plan)`` with ``plan`` the
    :class:`padmoe.Plan` that ``make_plan(top_experts, num_experts, alignment)`` returns and
    ``y[plan.capacity, H]`` what ``dispatch(x, plan, weights)`` returns, bit for bit (make_plan's
    launch then dispatch's, one operator call: the host cost of one op). Every check runs before
    anything is written. No host synchronization with ``check=False`` (the default under
    torch.compile and CUDA-graph capture). Differentiable wrt ``x`` and ``weights`` exactly as
    :func:`dispatch` (backward: ``dispatch_backward`` on the returned plan); the plan is not. Plain
    routing only (no ``make_plan`` routing options)."""
    op, default = _call("make_plan_and_dispatch")
    y, packed = op(x, top_experts, num_experts, alignment, weights, _mode(check, default), bool(zero_padding))
    t, k = top_experts.shape
    return y, Plan._from_packed(packed, t, k, num_experts, alignment)


def dispatch_quantized(x: Tensor, plan: Plan, *, scale_layout: str = "block128", dtype: Optional[torch.dtype] = None,
                       check: Optional[bool] = None, zero_padding: bool = True) -> Tuple[Tensor, Tensor]:
    """Fused quantizing dispatch: ``(y, y_scales)`` with ``plan.capacity`` rows from bfloat16 /
    float16 / float32 rows ``x[T, H]``, each token row read once, quantized once and written to its
    K padded rows. ``dtype``: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
    ``scale_layout``: ``"block128"`` (DeepSeek-V3 1x128: float32 ``[cap, ceil(H/128)]``),
    ``"mxfp8"`` (OCP MX v1.0 E8M0 bytes: uint8 ``[cap, ceil(H/32)]``; ``.view(torch.float8_e8m0fnu)``
    decodes them to 2^X) or ``"row"`` (float32 ``[cap]``). Padding rows and rows past P: zero codes,
    scale 1 (``zero_padding=False``: left unwritten). Not differentiable (an ``x`` that requires a
    gradient under grad mode raises NotImplementedError); unweighted."""
    dtype = torch.float8_e4m3fn if dtype is None else dtype
    return _OPS_QUANT(x, _packed(plan), plan.top_k, plan.num_experts, _align(plan), scale_layout, dtype,
                      _scaled_mode(check), bool(zero_padding))


def combine(y: Tensor, plan: Plan, weights: Optional[Tensor] = None, *, check: Optional[bool] = None) -> Tensor:
    """``out[T, H]``: ``out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]]`` (float32 accumulation
    in ascending k, cast once); ``y`` has at least P rows (padding rows never read).
    Differentiable wrt ``y`` and ``weights`` (backward: ``combine_backward``, one read of the
    output gradient)."""
    op, default = _call("combine")
    return op(y, _packed(plan), weights, plan.top_k, plan.num_experts, _align(plan), _mode(check, default))


# ---------------------------------------------------------------------------
# 2. MegaBlocks drop-ins
# ---------------------------------------------------------------------------


def padded_gather(x: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor, padded_bins: Tensor, top_k: int,
                  weights: Optional[Tensor] = None, *, check: Optional[bool] = None, backend: str = "native",
                  zero_padding: bool = True, scales: Optional[Tensor] = None) -> Tensor:
    """MegaBlocks ``padded_gather(x, indices, bin_ids, bins, padded_bins, top_k)``:
    ``y[padded_bins[-1], H]`` with sorted position i of expert e in row
    ``padded_start(e) + i - real_start(e)`` holding ``x[indices[i] // top_k]`` (times
    ``weights[indices[i]]`` when given); padding rows zero. P is read on the host (one
    synchronization on CUDA; not CUDA-graph capturable). Differentiable wrt ``x`` (and
    ``weights``). ``backend="triton"``: padmoe.triton's kernels (the seed's Ascend design, see
    docs/ascend.md), with the same backward rules and ``check``. ``scales=x_scales`` (native
    backend, no weights): ``(y, y_scales)`` as :func:`dispatch` with P rows."""
    if scales is not None:
        _no_weights("padded_gather", "weights", weights)
        _backend(backend, "padded_gather")
        return _OPS_SCALED["padded_gather"](x, indices, bin_ids, bins, padded_bins, top_k, scales,
                                            _scaled_mode(check), bool(zero_padding))
    if backend == "triton":
        from padmoe import triton as _triton
        return _triton.gather_autograd(x, indices, bin_ids, bins, padded_bins, top_k, weights, _triton_check(check, x))
    _backend(backend, "padded_gather")
    op, default = _call("padded_gather")
    return op(x, indices, bin_ids, bins, padded_bins, top_k, weights, _mode(check, default), bool(zero_padding))


def padded_scatter(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
                   padded_bins: Tensor, top_k: int, *, check: Optional[bool] = None, backend: str = "native") -> Tensor:
    """MegaBlocks ``padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k)``:
    ``out[T, H]``, ``out[t] = sum_k w(t*K+k) * x[dest_rows[t*K+k]]`` (``w`` = weights or 1;
    float32 accumulation in ascending k, cast once). ``x`` is the padded buffer (at least P
    rows; padding rows never read). Differentiable wrt ``x`` and ``weights``. ``backend="triton"``:
    padmoe.triton's kernels, with the same backward rules."""
    if backend == "triton":
        from padmoe import triton as _triton
        return _triton.scatter_autograd(x, indices, bin_ids, weights, bins, padded_bins, top_k, _triton_check(check, x))
    _backend(backend, "padded_scatter")
    op, default = _call("padded_scatter")
    return op(x, indices, bin_ids, weights, bins, padded_bins, top_k, _mode(check, default))


def padded_scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor,
                         padded_bins: Tensor, top_k: int, *, check: Optional[bool] = None,
                         backend: str = "native") -> Tensor:
    """MegaBlocks ``padded_scatter_wgrad(x, grad, indices, bin_ids, bins, padded_bins, top_k)``:
    ``wgrad[a] = sum_h x[dest_rows[a], h] * grad[a // K, h]`` (float32 accumulation), in
    x's dtype. Not differentiable. ``backend="triton"``: padmoe.triton's kernel."""
    if backend == "triton":
        from padmoe import triton as _triton
        return _triton.padded_scatter_wgrad(x, grad, indices, bin_ids, bins, padded_bins, top_k,
                                            check=_triton_check(check, x))
    _backend(backend, "padded_scatter_wgrad")
    op, default = _call("padded_scatter_wgrad")
    return op(x, grad, indices, bin_ids, bins, padded_bins, top_k, _mode(check, default))


# ---------------------------------------------------------------------------
# 3. Megatron drop-ins
# ---------------------------------------------------------------------------


def pad_to_alignment(hidden_states: Tensor, tokens_per_expert: Tensor, alignment: int, *,
                     check: Optional[bool] = None, zero_padding: bool = True,
                     scales: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Megatron ``pad_to_alignment(hidden_states, tokens_per_expert, alignment)`` ->
    ``(padded_hidden[P, H], permutation_map[P] int32, inclusive_offsets[E] int32)``: expert
    e's rows keep their order and move to its aligned segment; padding rows are zero and
    map to -1; ``inclusive_offsets`` are the grouped-GEMM ``offs``. Rows past
    ``sum(tokens_per_expert)`` are ignored (zero gradient). P is read on the host.
    Differentiable wrt ``hidden_states``. ``scales=hidden_scales`` (layouts as :func:`dispatch`):
    ``(padded, padded_scales, permutation_map, inclusive_offsets)``, padding rows scale 1; not
    differentiable."""
    if scales is not None:
        return _OPS_SCALED["pad_to_alignment"](hidden_states, tokens_per_expert, alignment, scales,
                                               _scaled_mode(check), bool(zero_padding))
    op, default = _call("pad_to_alignment")
    return op(hidden_states, tokens_per_expert, alignment, _mode(check, default), bool(zero_padding))


def unpad_from_alignment(padded_output: Tensor, permutation_map: Tensor, original_size: int,
                         probs: Optional[Tensor] = None, *, check: Optional[bool] = None,
                         scales: Optional[Tensor] = None) -> Tensor:
    """Megatron ``unpad_from_alignment(padded_output, permutation_map, original_size, probs=None)``
    -> ``out[original_size, H]``: ``out[map[p]] = padded_output[p]`` (times ``probs[map[p]]``)
    for every ``map[p] >= 0``; rows no entry names are zero. No host synchronization.
    Differentiable wrt ``padded_output`` and ``probs``. ``scales=padded_scales`` (no probs):
    ``(out, out_scales)``, rows no entry names get zero data and scale 1; not differentiable."""
    if scales is not None:
        _no_weights("unpad_from_alignment", "probs", probs)
        return _OPS_SCALED["unpad_from_alignment"](padded_output, permutation_map, original_size, scales,
                                                   _scaled_mode(check))
    op, default = _call("unpad_from_alignment")
    return op(padded_output, permutation_map, original_size, probs, _mode(check, default))


# ---------------------------------------------------------------------------
# Expert parallelism: chunk sort after an all-to-all
# ---------------------------------------------------------------------------


def sort_chunks(received: Tensor, split_sizes: Tensor, num_ranks: int, alignment: int,
                sorted_index: Optional[Tensor] = None, *, rows: Optional[int] = None, check: Optional[bool] = None,
                zero_padding: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    """The chunk sort after an expert-parallel all-to-all -> ``(padded[P, H],
    permutation_map[P] int32, inclusive_offsets[E] int32)``: ``received[N, H]`` is rank-major
    (chunk ``r*E + e`` holds ``split_sizes[r, e]`` rows, ``split_sizes`` ``[R, E]`` or ``[R*E]``);
    output position ``j`` holds chunk ``sorted_index[j]`` (TransformerEngine's
    ``moe_sort_chunks_by_index``) or, by default, ``(j % R)*E + j // R`` (expert-major); each group
    of R consecutive positions (a local expert) padded to a multiple of ``alignment`` (zero rows, -1
    in the map); ``inclusive_offsets`` are the grouped-GEMM ``offs``. Rows past
    ``sum(split_sizes)`` are ignored (zero gradient).

    ``rows=None`` gives exactly P rows (read on the host: one synchronization on CUDA);
    ``rows=n`` (e.g. ``padmoe.sort_chunks_capacity(N, R*E, R, alignment)``) gives n rows with the
    rows past P zero: static shapes, no synchronization with ``check=False`` (the default under
    torch.compile). Differentiable wrt ``received`` (backward: :func:`unsort_chunks` of the
    gradient)."""
    default = 0 if _compiling() else _eager_check
    return _OPS_SORT(received, split_sizes, int(num_ranks), int(alignment), sorted_index, _mode(check, default),
                     bool(zero_padding), -1 if rows is None else int(rows))


def unsort_chunks(padded: Tensor, permutation_map: Tensor, received_rows: int, probs: Optional[Tensor] = None, *,
                  check: Optional[bool] = None) -> Tensor:
    """The inverse of :func:`sort_chunks` -> ``out[received_rows, H]`` rank-major again:
    ``out[map[p]] = padded[p]`` (times ``probs[map[p]]``, probs by rank-major row), padding
    dropped, rows no entry names zero. Exactly :func:`unpad_from_alignment` (the same operator
    and autograd: the backward of the rows is the sort's move again). No host synchronization."""
    return unpad_from_alignment(padded, permutation_map, received_rows, probs, check=check)


# ---------------------------------------------------------------------------
# 4. vLLM / SGLang fused-MoE input
# ---------------------------------------------------------------------------


def moe_align_block_size(topk_ids: Tensor, block_size: int, num_experts: int, expert_map: Optional[Tensor] = None,
                         pad_sorted_ids: bool = False, ignore_invalid_experts: bool = False, *,
                         check: Optional[bool] = None):
    """vLLM / SGLang ``moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
    pad_sorted_ids=False, ignore_invalid_experts=False)`` -> ``(sorted_token_ids, expert_ids,
    num_tokens_post_padded)``, int32 on ``topk_ids``' device, from one make_plan (no host
    synchronization with ``check=False``; static shapes under torch.compile).

    ``sorted_token_ids[R]``, ``R = T*K + min(T*K, E) * (block_size - 1)`` (rounded up to
    ``block_size`` with ``pad_sorted_ids``): each expert's flattened assignment ids ``t*K + k`` in
    ascending order (stable; vLLM's atomic kernel promises no order within an expert), padded to a
    multiple of ``block_size`` with the sentinel ``T*K``, then the sentinel to the end.
    ``expert_ids[ceil(R / block_size)]``: each block's expert, 0 for blocks at or past
    ``num_tokens_post_padded`` (as vLLM's and SGLang's kernels write). ``expert_map`` (global ->
    local expert id, -1 not local): with ``ignore_invalid_experts=False`` applied to every entry of
    ``expert_ids`` afterwards, as vLLM does; with ``True`` handed to the kernel, as vLLM's: the
    assignments of experts mapped to -1 get no entry, the rest are grouped and ordered by local id,
    and ``expert_ids`` hold local ids. Either way the map must be ``[num_experts]`` int32/int64 (always
    checked) with entries in ``[-1, num_experts)`` (checked with the op's data: on CUDA in checked mode,
    one synchronization). Ids outside ``[0, num_experts)`` are a ``ValueError`` when checked (vLLM's
    kernel skips them)."""
    compiling = _compiling()
    default = 0 if compiling else _eager_check
    if expert_map is not None and not isinstance(expert_map, Tensor):
        raise TypeError(f"moe_align_block_size: expert_map: expected a torch tensor, got {type(expert_map).__name__}")
    remap = expert_map is not None and not ignore_invalid_experts  # (the operator checks a map it is given)
    if remap:  # before the operator runs; entries as the op's data are (never under torch.compile)
        check_expert_map("moe_align_block_size", expert_map, num_experts,
                         not compiling and _triton_check(check, expert_map))
    in_kernel = expert_map if ignore_invalid_experts else None
    sorted_ids, expert_ids, post = _OPS_ALIGN(topk_ids, int(block_size), int(num_experts), bool(pad_sorted_ids),
                                              _mode(check, default), in_kernel)
    if remap:
        expert_ids = map_experts(expert_ids, expert_map)
    return sorted_ids, expert_ids, post


def batched_moe_align_block_size(max_tokens_per_batch: int, block_size: int, expert_num_tokens: Tensor, *,
                                 check: Optional[bool] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """vLLM's ``batched_moe_align_block_size(max_tokens_per_batch, block_size, expert_num_tokens)`` for
    the batched layout (expert e's tokens at rows ``e * max_tokens_per_batch + j``, ``j <
    expert_num_tokens[e]``) -> ``(sorted_ids, block_ids, num_tokens_post_pad)``, int32 on the counts'
    device, in a few torch ops with no host synchronization when unchecked (graph-capturable).

    With ``N = ceil(max_tokens_per_batch / block_size) * block_size * E`` (``E =
    expert_num_tokens.numel()``): ``sorted_ids[N]`` holds each expert's row ids in order, its run
    padded to a multiple of ``block_size``, runs back to back, the sentinel ``E *
    max_tokens_per_batch`` elsewhere; ``block_ids[N / block_size]`` each block's expert, -1 past
    the runs; ``num_tokens_post_pad[1]`` the padded total. Checked (eager, as ``check=None``
    reads it; one synchronization on CUDA): every count in ``[0, max_tokens_per_batch]``, a
    ``ValueError`` naming the first one outside (vLLM does not check)."""
    op = "batched_moe_align_block_size"
    max_tokens = int_arg(op, "max_tokens_per_batch", max_tokens_per_batch, 0)
    block = int_arg(op, "block_size", block_size, 1)
    if not isinstance(expert_num_tokens, Tensor):
        raise TypeError(f"{op}: expert_num_tokens: expected a torch tensor, got {type(expert_num_tokens).__name__}")
    if expert_num_tokens.dim() != 1:
        raise ValueError(f"{op}: expert_num_tokens: expected a 1-D tensor, got shape {list(expert_num_tokens.shape)}")
    if expert_num_tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: expert_num_tokens: expected int32 or int64, got "
                        f"{str(expert_num_tokens.dtype).replace('torch.', '')}")
    e_count = expert_num_tokens.numel()
    size = -(-max_tokens // block) * block * e_count
    if size > 2**31 - 1:
        raise ValueError(f"{op}: sorted_ids: size overflow: {size} entries do not fit the int32 outputs")
    counts = expert_num_tokens.to(torch.int64)
    if not _compiling() and _triton_check(check, expert_num_tokens) and e_count:
        bad = (counts < 0) | (counts > max_tokens)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{op}: expert_num_tokens: entry {i} is {int(counts[i])}, outside "
                             f"[0, max_tokens_per_batch = {max_tokens}]")
    device = expert_num_tokens.device
    sentinel = e_count * max_tokens
    if e_count == 0:
        empty = torch.empty(0, dtype=torch.int32, device=device)
        return empty, empty.clone(), torch.zeros(1, dtype=torch.int32, device=device)
    # Block by block: ends are multiples of block_size, so every block lies in one expert's run (or
    # past them all); only the final [blocks, block_size] fill touches N entries.
    padded = (counts + (block - 1)) // block * block
    ends = torch.cumsum(padded, 0)
    first = torch.arange(0, size, block, dtype=torch.int64, device=device)  # each block's first position
    owner = torch.searchsorted(ends, first, right=True)  # its expert (E past the runs)
    mine = owner.clamp(max=e_count - 1)
    offset = first - (ends - padded)[mine]  # the block's first position inside its expert's run
    live = torch.where(owner < e_count, counts[mine] - offset, torch.zeros_like(offset))  # real rows in the block
    lane = torch.arange(block, dtype=torch.int64, device=device)
    ids = (mine * max_tokens + offset).unsqueeze(1) + lane
    sorted_ids = torch.where(lane < live.unsqueeze(1), ids, sentinel).reshape(-1).to(torch.int32)
    block_ids = torch.where(owner < e_count, owner, -1).to(torch.int32)
    return sorted_ids, block_ids, ends[-1:].to(torch.int32)


# ---------------------------------------------------------------------------
# Routing: plan + router weights
# ---------------------------------------------------------------------------


class Routing:
    """A routing step: the plan of a top-k router's choices plus its weights.

    ``Routing.from_topk(top_experts[T, K], weights[T, K] (or [T*K], any float dtype) or None,
    num_experts, alignment)`` builds the plan (weights are checked here, before any GEMM);

    - ``.dispatch(x)`` -> ``[capacity, H]`` expert-grouped padded buffer (tail rows zero);
      ``.dispatch(x, weighted=True)`` scales each copy by its router weight (for routers that
      weight before the experts; then combine with ``weighted=False``);
    - ``.combine(y)`` -> ``[T, H]`` weighted by the router weights (``weighted=False``: plain sum);
    - ``.offsets`` = ``padded_bins`` (int32, the ``offs`` of ``grouped_mm``),
      ``.tokens_per_expert``, ``.num_experts``, ``.top_k``, ``.num_tokens``, ``.capacity``,
      ``.padded_rows`` (P as a 0-d device tensor, no synchronization), ``.row_experts``
      (``[capacity]`` int32 expert of each padded row, -1 on padding rows and past P:
      DeepGEMM's contiguous grouped layout; per-expert biases).

    Differentiable wrt x, y and the weights. Static shapes: compile- and capture-friendly.
    """

    __slots__ = ("plan", "weights", "check", "_row_experts")

    def __init__(self, plan: Plan, weights: Optional[Tensor] = None, check: Optional[bool] = None):
        self.plan = plan
        self.weights = weights
        self.check = check
        self._row_experts = None

    @classmethod
    def from_topk(cls, top_experts: Tensor, weights: Optional[Tensor], num_experts: int, alignment: int, *,
                  check: Optional[bool] = None, expert_map: Optional[Tensor] = None, first_expert: int = 0,
                  global_experts: int = 0, drop_invalid: bool = False, expert_capacity: Optional[int] = None,
                  drop_policy: str = "position") -> "Routing":
        """The routing options are :func:`make_plan`'s; ``drop_policy="probs"`` ranks by ``weights``.
        Dropped assignments (other ranks' experts, invalid ids, past the capacity) get no row,
        contribute zero to ``combine`` and get a zero weight gradient."""
        if (expert_map is not None or first_expert or global_experts or drop_invalid or expert_capacity is not None
                or drop_policy != "position"):
            plan = _routed(top_experts, weights, num_experts, alignment, check, expert_map, first_expert,
                           global_experts, drop_invalid, expert_capacity, drop_policy, None)
        else:
            op, default = _call("make_plan")
            packed = op(top_experts, num_experts, alignment, _mode(check, default), weights)
            t, k = top_experts.shape
            plan = Plan._from_packed(packed, t, k, num_experts, alignment)
        r = cls.__new__(cls)
        r.plan = plan
        r.weights = weights
        r.check = check
        r._row_experts = None
        return r

    @property
    def offsets(self) -> Tensor:
        return self.plan.padded_bins

    @property
    def tokens_per_expert(self) -> Tensor:
        return self.plan.tokens_per_expert

    @property
    def num_experts(self) -> int:
        return self.plan.num_experts

    @property
    def top_k(self) -> int:
        return self.plan.top_k

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def capacity(self) -> int:
        return self.plan.capacity

    @property
    def padded_rows(self) -> Tensor:
        """P = ``padded_bins[-1]`` as a 0-d int32 tensor on the plan's device (no synchronization)."""
        return self.plan.padded_bins[-1]

    @property
    def row_experts(self) -> Tensor:
        """``[capacity]`` int32: the expert of each padded row, -1 on padding rows and rows at
        or past P (computed once per Routing, on the device, without synchronization)."""
        if self._row_experts is None:
            p = self.plan
            rows = torch.arange(p.capacity, device=p.padded_bins.device, dtype=torch.int32)
            expert = torch.searchsorted(p.padded_bins, rows, right=True, out_int32=True)
            self._row_experts = torch.where(p.row_sources >= 0, expert, -1)
        return self._row_experts

    def dispatch(self, x: Tensor, weighted: bool = False, zero_padding: bool = True) -> Tensor:
        """``zero_padding=False`` leaves the padding rows (and the rows past P) unwritten: for a
        consumer that never reads them (DeepGEMM with ``row_experts``, a masked grouped GEMM) in an
        inference forward; never when an expert weight gradient reduces over every row."""
        if weighted and self.weights is None:
            raise ValueError("Routing.dispatch: weighted=True needs router weights (from_topk got None)")
        return dispatch(x, self.plan, self.weights if weighted else None, check=self.check, zero_padding=zero_padding)

    def combine(self, y: Tensor, weighted: bool = True) -> Tensor:
        return combine(y, self.plan, self.weights if weighted else None, check=self.check)


# Expert MLPs on this routing (grouped GEMMs; the transformers integration's code path): padmoe/_grouped.py.
from padmoe._grouped import GroupedExperts  # noqa: E402

__all__.append("GroupedExperts")
