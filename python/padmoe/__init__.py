"""padmoe: padded Mixture-of-Experts token routing (CPU and CUDA).

Framework-neutral API: every function takes numpy arrays or torch tensors and
returns arrays of the same framework (torch tensors on the input's device).
Outputs are allocated here and filled by padmoe's native ``_out`` ops
(``padmoe._C``), which never copy their inputs (arrays cross by DLPack).

    import numpy as np, padmoe
    top = np.array([[0, 2], [1, 0], [2, 2]], dtype=np.int32)    # [T, K] router top-k ids
    w = np.full(top.size, 0.5, dtype=np.float32)               # [T*K] router weights
    x = np.random.rand(3, 8).astype(np.float32)                 # [T, H]
    plan = padmoe.make_plan(top, num_experts=4, alignment=4)
    y = padmoe.dispatch(x, plan)                                # [P, H], expert-grouped, padded
    out = padmoe.combine(y, plan, w)                            # [T, H], weighted top-k sum

Ops (arguments in the order of padmoe/ops.hpp): :func:`make_plan`,
:func:`make_plan_and_dispatch` (make_plan then dispatch in one call),
:func:`padded_gather`, :func:`padded_scatter`, :func:`padded_scatter_wgrad`,
:func:`padded_gather_backward`, :func:`padded_scatter_backward`,
:func:`dispatch`, :func:`combine`, :func:`combine_backward`,
:func:`dispatch_backward`, :func:`dispatch_quantized` (:func:`quantize`), :func:`pad_to_alignment`,
:func:`unpad_from_alignment`, :func:`unpad_from_alignment_backward`,
:func:`copy`; the expert-parallel chunk sort :func:`sort_chunks` / :func:`unsort_chunks`
(:func:`sort_chunks_capacity`); layouts other kernels consume :func:`make_plan_layouts`,
:func:`moe_align_block_size`; sizes :func:`capacity_bound`, :func:`workspace_bound`,
:func:`aligned_rows_bound`;
:func:`has_cuda`. See the docstring of ``padmoe._ops`` for the options every
op takes (``check``, ``num_threads``, ``workspace``, ``stream``, ``rows``,
``out``) and the error mapping.
"""

from . import _C
from ._ops import (
    aligned_rows_bound,
    capacity_bound,
    combine,
    combine_backward,
    copy,
    dispatch,
    dispatch_backward,
    dispatch_quantized,
    has_cuda,
    make_plan,
    make_plan_and_dispatch,
    make_plan_layouts,
    moe_align_block_size,
    pad_to_alignment,
    padded_gather,
    padded_gather_backward,
    padded_scatter,
    padded_scatter_backward,
    padded_scatter_wgrad,
    quantize,
    sort_chunks,
    sort_chunks_capacity,
    unpad_from_alignment,
    unpad_from_alignment_backward,
    unsort_chunks,
    workspace_bound,
)
from ._plan import Plan

plan_tiles = _C.plan_tiles  # the tile planner of SPEC section 6 (padmoe/tiling.hpp), as a dict

__version__ = _C.__version__

__all__ = [
    "Plan",
    "aligned_rows_bound",
    "capacity_bound",
    "combine",
    "combine_backward",
    "copy",
    "dispatch",
    "dispatch_backward",
    "dispatch_quantized",
    "has_cuda",
    "make_plan",
    "make_plan_and_dispatch",
    "make_plan_layouts",
    "moe_align_block_size",
    "pad_to_alignment",
    "padded_gather",
    "padded_gather_backward",
    "padded_scatter",
    "padded_scatter_backward",
    "padded_scatter_wgrad",
    "plan_tiles",
    "quantize",
    "sort_chunks",
    "sort_chunks_capacity",
    "unpad_from_alignment",
    "unpad_from_alignment_backward",
    "unsort_chunks",
    "workspace_bound",
    "__version__",
]
