"""What every padmoe.torch wrapper shares: the operators, the check policy, the plan's arguments.

Every operator of ``torch.ops.padmoe`` is listed in :data:`OPERATORS` with the public function that
reaches it and in :data:`NO_AUTOGRAD` when it has no autograd rule, with the reason; the test
``test_operator_registry.py`` fails when an operator is registered without a fake kernel, an autograd
rule (or a stated reason) and a wrapper. docs/adding-an-operator.md lists every place an operator
touches.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from padmoe import _torch_ops as _native  # loaded (and its operators registered) by padmoe.torch
from padmoe._plan import PLAN_ARRAYS, PackedPlanOffsets, packed_plan_offsets, packed_plan_sizes, plan_offsets

Tensor = torch.Tensor
ops = torch.ops.padmoe
compiling = torch.compiler.is_compiling

# operator -> the public padmoe.torch function that calls it (a backward operator: autograd calls it too)
OPERATORS = {
    "make_plan": "make_plan",
    "make_plan_routed": "make_plan",
    "dispatch": "dispatch",
    "dispatch_backward": "dispatch_backward",
    "make_plan_and_dispatch": "make_plan_and_dispatch",
    "combine": "combine",
    "combine_backward": "combine_backward",
    "dispatch_scaled": "dispatch_scaled",
    "dispatch_quantized": "dispatch_quantized",
    "padded_gather": "padded_gather",
    "padded_gather_backward": "padded_gather_backward",
    "padded_gather_scaled": "padded_gather_scaled",
    "padded_scatter": "padded_scatter",
    "padded_scatter_backward": "padded_scatter_backward",
    "padded_scatter_wgrad": "padded_scatter_wgrad",
    "pad_to_alignment": "pad_to_alignment",
    "pad_to_alignment_scaled": "pad_to_alignment_scaled",
    "unpad_from_alignment": "unpad_from_alignment",
    "unpad_from_alignment_backward": "unpad_from_alignment_backward",
    "unpad_from_alignment_scaled": "unpad_from_alignment_scaled",
    "sort_chunks": "sort_chunks",
    "moe_align_block_size": "moe_align_block_size",
    "batched_moe_align_block_size": "batched_moe_align_block_size",
    "mask_plan": "mask_plan",
    "index_plan": "index_plan",
}

# operators without an autograd rule, and why
NO_AUTOGRAD = {
    "dispatch_backward": "a backward operator: double backward is not supported",
    "combine_backward": "a backward operator: double backward is not supported",
    "padded_gather_backward": "a backward operator: double backward is not supported",
    "padded_scatter_backward": "a backward operator: double backward is not supported",
    "unpad_from_alignment_backward": "a backward operator: double backward is not supported",
    "padded_scatter_wgrad": "MegaBlocks' weight-gradient kernel: itself a backward, not differentiable",
    "moe_align_block_size": "integer outputs only",
    "batched_moe_align_block_size": "integer outputs only",
    "mask_plan": "integer outputs, probs moved and flagged without a gradient (TE's permute gives them theirs)",
    "index_plan": "integer outputs only",
}

# The module's entry points hand calls they do not take as they are (tensor subclasses, torch
# function modes, ...) to the OpOverloads.
for _i, _name in enumerate(_native.FALLBACK_ORDER):
    _native._set_fallback(_i, getattr(ops, _name).default)

# check=None in eager mode: 2 = check unless the current CUDA stream is capturing a graph (the C++
# side decides); 0 = never check on CUDA, 1 = always. Under torch.compile, check=None never checks.
_eager_check = 2


def set_default_check(check: Optional[bool]) -> None:
    """Deprecated (removed in the next release): pass ``check=`` per call (``Routing.from_topk(...,
    check=False)`` for a whole step). Sets what ``check=None`` means in eager mode."""
    warnings.warn(
        "padmoe.torch.set_default_check is deprecated: pass check= per call", DeprecationWarning, stacklevel=2
    )
    global _eager_check
    _eager_check = 2 if check is None else int(bool(check))


def call(name):
    """(operator, check mode for ``check=None``): the OpOverload while torch.compile traces (no
    check), the module's fast entry point in eager mode."""
    if compiling():
        return getattr(ops, name).default, 0
    return getattr(_native, name), _eager_check


def mode(check: Optional[bool], default: int) -> int:
    return default if check is None else int(bool(check))


def eager_mode(check: Optional[bool]) -> int:
    """The check mode of an operator called through its OpOverload."""
    return mode(check, 0 if compiling() else _eager_check)


def host_check(check: Optional[bool], like: Tensor) -> bool:
    """Whether a check written in Python runs, as the native operators read ``check``: the CPU always
    checks; on CUDA ``None`` checks unless the stream is capturing a graph."""
    if not like.is_cuda:
        return True
    m = mode(check, _eager_check)
    return (not torch.cuda.is_current_stream_capturing()) if m == 2 else bool(m)


def packed(plan) -> Tensor:
    """The packed form of a plan: its own (plans of padmoe.torch.make_plan), else the eight arrays
    concatenated (one extra copy: plans from padmoe.make_plan or padmoe.reference)."""
    p = getattr(plan, "packed", None)
    if p is not None:
        return p
    return torch.cat([getattr(plan, f).reshape(-1).to(torch.int32) for f in PLAN_ARRAYS])


def plan_args(plan):
    """The plan operators' arguments after the packed plan: (top_k, num_experts, alignment,
    expert_capacity)."""
    return plan.top_k, plan.num_experts, plan.alignment, getattr(plan, "expert_capacity", None)


def plan_slices(
    num_tokens: int, top_k: int, num_experts: int, alignment: int, expert_capacity: Optional[int] = None
) -> PackedPlanOffsets:
    """Where each array lies in a packed plan (:func:`padmoe._plan.packed_plan_offsets`): cached in
    eager mode, computed while torch.compile traces (traced code bypasses a cache, and symbolic sizes
    are not hashable)."""
    if not compiling():
        try:
            return packed_plan_offsets(num_tokens, top_k, num_experts, alignment, expert_capacity)
        except TypeError:  # a symbolic size, traced outside Dynamo
            pass
    return plan_offsets(num_tokens, top_k, num_experts, alignment, expert_capacity)


def fake_plan_sizes(plan: Tensor, top_k, num_experts, alignment, expert_capacity):
    """(T, A, rows) of a packed plan tensor, for the fake kernels."""
    return packed_plan_sizes(plan.shape[0], top_k, num_experts, alignment, expert_capacity)


def fake_wgrad(like: Tensor, weights: Optional[Tensor], n, need: bool) -> Tensor:
    if need and weights is not None:
        return like.new_empty(n, dtype=weights.dtype)
    return like.new_empty(0, dtype=like.dtype if weights is None else weights.dtype)


def fake_scales(scales: Tensor, rows) -> Tensor:
    return scales.new_empty((rows,) + tuple(scales.shape[1:]))


def check_backend(backend: str, op: str) -> None:
    if backend not in ("native", "triton"):
        raise ValueError(f"{op}: backend: expected 'native' or 'triton', got {backend!r}")


FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_dtype(op: str, fp8) -> torch.dtype:
    """The torch float8 dtype of an ``fp8=`` format name ("e4m3" or "e5m2", as padmoe takes it)."""
    dt = FP8_DTYPES.get(fp8) if isinstance(fp8, str) else None
    if dt is None:
        raise ValueError(f"{op}: fp8: expected 'e4m3' or 'e5m2', got {fp8!r}")
    return dt
