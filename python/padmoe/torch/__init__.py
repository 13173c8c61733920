"""padmoe.torch: padmoe's routing ops as native PyTorch operators (autograd, torch.compile, CUDA graphs).

Usage::

    import torch
    import padmoe.torch as pt

    logits = router(x)                                    # [T, E]
    probs, top_experts = logits.softmax(-1).topk(2)       # [T, K] weights and expert ids
    r = pt.Routing.from_topk(top_experts, probs, num_experts=E, alignment=16)
    y = r.dispatch(x)                                     # [padded_rows_bound, H] expert-grouped, padded, tail zero
    h = torch.nn.functional.grouped_mm(y, w_experts, offs=r.offsets)   # offs = padded_bins (int32)
    out = r.combine(h)                                    # [T, H], weighted by probs; grads reach x and probs

    # the same, step by step (static shapes: torch.compile(fullgraph=True) / CUDA-graph capturable)
    plan = pt.make_plan(top_experts, E, 16)               # a padmoe.Plan of int32 tensors
    y = pt.dispatch(x, plan)                              # [plan.padded_rows_bound, H]
    out = pt.combine(h, plan, probs)                      # [T, H]
    y, plan = pt.make_plan_and_dispatch(x, top_experts, E, 16)   # the first two in one call (one operator)

    # drop-ins (same arguments and results as MegaBlocks / Megatron; P rows, read on the host)
    y = pt.padded_gather(x, indices, bin_ids, bins, padded_bins, top_k)
    out = pt.padded_scatter(y, indices, bin_ids, weights, bins, padded_bins, top_k)
    padded, permutation_map, inclusive_offsets = pt.pad_to_alignment(hidden, tokens_per_expert, 16)
    out = pt.unpad_from_alignment(padded, permutation_map, hidden.shape[0], probs)

The operators (``torch.ops.padmoe.*``) are registered in C++ with the torch dispatcher
(``padmoe/_torch_ops.so``, sources ``python/src/torch/``): CPU and CUDA kernels, autograd written
in C++ whose backward is one call of the matching backward operator, and fake kernels (beside each
wrapper, in this package) for ``torch.compile``. The functions here pick the check mode and pass
the arguments on; every check runs once, in C++. Double backward is not supported.

Two paths:

- **Static shapes** (:func:`make_plan`, :func:`dispatch`, :func:`make_plan_and_dispatch`,
  :func:`combine`, :func:`dispatch_scaled`, :func:`dispatch_quantized`, :class:`Routing`): padded
  outputs have ``plan.padded_rows_bound = T*K + E*(alignment-1)`` rows, known on the host, so
  nothing reads P. Rows at or past P are zeroed in the same pass, so outputs are fully defined and
  deterministic. These trace under ``torch.compile(fullgraph=True)`` and capture in
  ``torch.cuda.CUDAGraph``.
- **Drop-ins** (:func:`padded_gather`, :func:`padded_scatter`, :func:`pad_to_alignment`,
  :func:`unpad_from_alignment`, their ``_scaled`` forms, :func:`sort_chunks` without ``rows``):
  exactly MegaBlocks' / Megatron's results, whose padded outputs have P rows; P is read on the host
  (one synchronization on CUDA), so they are not CUDA-graph capturable. Under torch.compile their
  row count is an unbacked symbol.

``check`` (every function): ``None`` (the default) checks the data in eager mode, except while the
current CUDA stream is capturing a graph, and not at all under ``torch.compile``; ``True`` always
checks; ``False`` never checks on CUDA (no synchronization at all: what a training or serving loop
that trusts its router passes). With checks on, the CUDA backend validates the data-dependent
properties (expert ids, permutations, bins) with one small kernel and a host synchronization,
raising ``ValueError`` / ``TypeError`` with padmoe's message (naming the op, the argument and the
first offending position). The CPU backend always checks everything. Shape/dtype/device checks
always run.

Data types: rows float32 / float16 / bfloat16 run natively. Router weights and probs may be
of any float dtype, whatever the rows' dtype (read as float32), and of any shape with one
entry per assignment (``[T, K]`` or ``[T*K]``) and any stride; their gradients come back in
their dtype and shape. **float64 rows** (which padmoe's kernels do not take) run through
ATen float64 formulas inside the same operators, so ``torch.autograd.gradcheck`` exercises
the operators and their autograd. Index inputs int32 or int64, any stride; index outputs
int32. fp8 formats are named ``fp8="e4m3"`` / ``"e5m2"``, as in :mod:`padmoe`.

docs/python.md has the whole Python API in one table (this module, :mod:`padmoe`, the reference
and the Triton kernels).
"""

from __future__ import annotations

import torch

try:
    # Written by the build: the torch the operators were built against, or why they were not built.
    from padmoe import _build_info
except ImportError:  # a build from before padmoe/_build_info.py
    _build_info = None
if _build_info is not None:
    _build_info.check_torch(torch.__version__)  # ImportError unless built against this very torch
try:
    # Loading the module registers the operators with the dispatcher (TORCH_LIBRARY).
    from padmoe import _torch_ops  # noqa: F401
except ImportError as e:
    if _build_info is not None:
        raise ImportError(_build_info.torch_ops_error(torch.__version__, e)) from e
    raise ImportError(
        f"padmoe.torch: padmoe's torch operators (padmoe/_torch_ops.so) are missing or do not load with torch "
        f"{torch.__version__} ({e}). To build them against this torch, run in padmoe's source directory, with "
        "this environment's pip:\n    pip install scikit-build-core nanobind && pip install --no-build-isolation ."
    ) from e

from padmoe._plan import Plan, PlanOptions  # noqa: E402
from padmoe._sizes import aligned_rows_bound, padded_rows_bound, sort_chunks_rows_bound, workspace_bound  # noqa: E402

from ._common import set_default_check  # noqa: E402, F401 (deprecated)
from ._dropin_ops import (  # noqa: E402
    pad_to_alignment,
    pad_to_alignment_scaled,
    padded_gather,
    padded_gather_backward,
    padded_gather_scaled,
    padded_scatter,
    padded_scatter_backward,
    padded_scatter_wgrad,
    sort_chunks,
    unpad_from_alignment,
    unpad_from_alignment_backward,
    unpad_from_alignment_scaled,
    unsort_chunks,
)
from ._layouts import batched_moe_align_block_size, index_plan, mask_plan, moe_align_block_size  # noqa: E402
from ._plan_ops import (  # noqa: E402
    combine,
    combine_backward,
    dispatch,
    dispatch_backward,
    dispatch_quantized,
    dispatch_scaled,
    make_plan,
    make_plan_and_dispatch,
)
from ._routing import Routing  # noqa: E402
from .grouped import GroupedExperts, experts_forward  # noqa: E402

__all__ = [
    "Plan",
    "PlanOptions",
    "Routing",
    "GroupedExperts",
    "experts_forward",
    "make_plan",
    "make_plan_and_dispatch",
    "dispatch",
    "dispatch_scaled",
    "dispatch_quantized",
    "combine",
    "dispatch_backward",
    "combine_backward",
    "padded_gather",
    "padded_gather_scaled",
    "padded_scatter",
    "padded_scatter_wgrad",
    "padded_gather_backward",
    "padded_scatter_backward",
    "pad_to_alignment",
    "pad_to_alignment_scaled",
    "unpad_from_alignment",
    "unpad_from_alignment_scaled",
    "unpad_from_alignment_backward",
    "sort_chunks",
    "unsort_chunks",
    "moe_align_block_size",
    "batched_moe_align_block_size",
    "mask_plan",
    "index_plan",
    "padded_rows_bound",
    "sort_chunks_rows_bound",
    "aligned_rows_bound",
    "workspace_bound",
]
