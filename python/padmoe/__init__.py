"""padmoe: padded Mixture-of-Experts token routing (CPU and CUDA).

This module is the framework-neutral API: numpy arrays in, numpy arrays out. The functions that
:mod:`padmoe.torch` (the PyTorch API: autograd, torch.compile, CUDA graphs) also has take torch
tensors too, with the same arguments, defaults and results, and return torch tensors on the
input's device; ``quantize`` and ``make_plan_layouts``, which padmoe.torch does not have, refuse a
torch tensor with a message that names padmoe.torch. Outputs are allocated here and filled by padmoe's
native ``_out`` ops (``padmoe._C``), which never copy their inputs (arrays cross by DLPack).

    import numpy as np, padmoe
    top = np.array([[0, 2], [1, 0], [2, 2]], dtype=np.int32)    # [T, K] router top-k ids
    w = np.full(top.size, 0.5, dtype=np.float32)               # [T*K] router weights
    x = np.random.rand(3, 8).astype(np.float32)                 # [T, H]
    plan = padmoe.make_plan(top, num_experts=4, alignment=4)
    y = padmoe.dispatch(x, plan)                                # [plan.padded_rows_bound, H], rows past P zero
    out = padmoe.combine(y, plan, w)                            # [T, H], weighted top-k sum

docs/python.md has the whole Python API in one table; every function's docstring gives its
semantics, and ``padmoe._common``'s the options every op takes (``check``, ``num_threads``,
``workspace``, ``stream``, ``rows``, ``out``) and the error mapping.
"""

import warnings as _warnings

from . import _C
from ._chunk_ops import copy, sort_chunks, unsort_chunks
from ._dropin_ops import (
    pad_to_alignment,
    pad_to_alignment_scaled,
    padded_gather,
    padded_gather_backward,
    padded_gather_scaled,
    padded_scatter,
    padded_scatter_backward,
    padded_scatter_wgrad,
    unpad_from_alignment,
    unpad_from_alignment_backward,
    unpad_from_alignment_scaled,
)
from ._plan import Plan, PlanOptions
from ._plan_ops import (
    combine,
    combine_backward,
    dispatch,
    dispatch_backward,
    dispatch_scaled,
    make_plan,
    make_plan_and_dispatch,
    make_plan_layouts,
    moe_align_block_size,
)
from ._quant_ops import dispatch_quantized, quantize
from ._sizes import (
    aligned_rows_bound,
    capacity_bound,  # noqa: F401 (deprecated alias)
    has_cuda,
    padded_rows_bound,
    sort_chunks_capacity,  # noqa: F401 (deprecated alias)
    sort_chunks_rows_bound,
    workspace_bound,
)


def tile_config(target: str, op: str, hidden: int, dtype: str, cores: int = 0) -> dict:
    """The tile configuration of a kernel launch (the C++ planner of padmoe/tiling.hpp), as a dict, for
    ``target`` ``"cpu"``, ``"ascend-a2"`` or ``"gpu"``, ``op`` ``"gather"`` / ``"scatter"`` /
    ``"wgrad"``, the hidden size and the row dtype's name; ``cores`` 0: the target's default."""
    return _C.tile_config(target, op, hidden, dtype, cores)


def plan_tiles(*args, **kwargs):
    """Deprecated name of :func:`tile_config` (removed in the next release)."""
    _warnings.warn("padmoe.plan_tiles is deprecated: use padmoe.tile_config", DeprecationWarning, stacklevel=2)
    return tile_config(*args, **kwargs)


__version__ = _C.__version__

__all__ = [
    "Plan",
    "PlanOptions",
    "aligned_rows_bound",
    "combine",
    "combine_backward",
    "copy",
    "dispatch",
    "dispatch_backward",
    "dispatch_quantized",
    "dispatch_scaled",
    "has_cuda",
    "make_plan",
    "make_plan_and_dispatch",
    "make_plan_layouts",
    "moe_align_block_size",
    "pad_to_alignment",
    "pad_to_alignment_scaled",
    "padded_gather",
    "padded_gather_backward",
    "padded_gather_scaled",
    "padded_rows_bound",
    "padded_scatter",
    "padded_scatter_backward",
    "padded_scatter_wgrad",
    "quantize",
    "sort_chunks",
    "sort_chunks_rows_bound",
    "tile_config",
    "unpad_from_alignment",
    "unpad_from_alignment_backward",
    "unpad_from_alignment_scaled",
    "unsort_chunks",
    "workspace_bound",
    "__version__",
]
