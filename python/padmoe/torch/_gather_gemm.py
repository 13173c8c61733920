"""The expert MLP's up projection with the gather in its A-load, and its weight gradient, as torch
operators over the Triton kernels of ``padmoe/_triton_gather_gemm.py`` (what ``_expert_mlp.py``'s
operator runs on CUDA; on CPU fp16 tensors in Triton's interpreter, which is how the CPU suite tests
them): the launchers, the custom operators torch.compile sees, and where they apply."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from ._common import compiling, fake_plan_sizes, plan_slices

Tensor = torch.Tensor


# Read once, at import (torch.compile traces the choice): whether Triton is installed, and whether it
# runs kernels in its interpreter (the variable Triton itself reads when imported).
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def up_width(up: Tensor, transposed: bool) -> int:
    """The up projection's output columns N1 (2I gated): ``up`` is ``[E, N1, H]``, or transposed
    ``[E, H, N1]``."""
    return up.shape[2] if transposed else up.shape[1]


def gather_pays(tokens: int, sizes, width: int, grads: bool) -> bool:
    """Whether the expert MLP's up projection reads x through the plan instead of dispatching it
    (``width``: its output columns, 2I gated; ``grads``: a forward with gradients). Two cases,
    measured on an H100 (bench/results/experts.md):

    - padding rows dominate (the expected padding rows, ``E * (alignment - 1) / 2`` or ``E * C - T*K``
      with a capacity C, at least twice the ``T*K`` real ones, as at decode): the gather-fused GEMM's
      tiles skip the padding that torch's grouped GEMM computes (decode: 0.84x dispatch + grouped_mm);
    - a forward without gradients with full-height tiles (128 rows; segment tiles where 128 does
      not divide the alignment), a GEMM bound by its FLOPs rather than by its weights (at least 256
      rows an expert on average: a weight element is read once for 2 FLOPs a row, and a GPU does a
      few hundred FLOPs in the time it reads 2 bytes) and a narrow up projection (``width`` at most
      2048), where the dispatch it saves (4H bytes a row) is a large share of the GEMM (2 * width *
      H FLOPs a row): qwen3-30b-a3b (width 1536, 1024 rows an expert) 0.90x dispatch + grouped_mm +
      activation at alignment 128, the whole forward 0.92x / 0.94x at alignment 16 (two runs);
      deepseek-v3 (width 4096, 128 rows an expert: it streams 15 GB of weights) 1.03x and
      mixtral-8x7b (28672) 0.99x keep torch's GEMM. With gradients the gather would also be read in
      the weight gradient, which is slower there (recompute_rows at qwen3-30b-a3b 1.08x).
    """
    top_k, e, alignment, capacity = sizes
    real = tokens * top_k
    padding = e * capacity - real if capacity is not None else e * (alignment - 1) / 2
    if padding >= 2 * real:
        return True
    return not grads and alignment % 16 == 0 and real >= 256 * e and width <= 2048


def gather_config(x: Tensor, up: Tensor, sizes, transposed: bool, fused: bool, gated: bool):
    """The gather-fused up projection's tile configuration, or None where it does not apply: it runs on
    CUDA (or in Triton's interpreter) on bf16/fp16 operands of one dtype, for plans whose alignment
    is a multiple of 16 (see ``padmoe/_triton_gather_gemm.py``)."""
    if not _HAS_TRITON or x.dtype not in (torch.bfloat16, torch.float16) or up.dtype != x.dtype:
        return None  # without Triton: dispatch and torch's grouped GEMM
    if not x.is_cuda and not (_INTERPRETING and x.dtype == torch.float16):
        return None  # Triton's interpreter (the CPU tests) gets bf16 dot products wrong: fp16 only there
    from padmoe import _triton_gather_gemm as tg

    top_k, e, alignment, _ = sizes
    n = up_width(up, transposed)
    if fused and gated:
        n //= 2
    return tg.config(alignment, x.shape[0] * top_k / max(e, 1), n, fused and gated)


def triton_gather_up(
    x, packed, weights, up, bias, sizes, transposed, act, fused, zero_padding, out: Optional[Tensor] = None
) -> Tensor:
    """``h[R, N1]`` (``fused`` False) or ``a[R, I]`` (``fused``: the activation in the epilogue) of the
    rows ``x[row_sources // K]`` (times ``weights`` when given), never writing the dispatched rows.
    Padding rows: zero with ``zero_padding``, else unwritten; rows at or past P unwritten. ``out``: the
    output to write (a new tensor when None)."""
    from padmoe import _triton_gather_gemm as tg

    kind, gated, interleaved, alpha, limit = act
    top_k, e, alignment, capacity = sizes
    o = plan_slices(x.shape[0], *sizes)
    rows = o.rows
    width = up_width(up, transposed)
    n = width // 2 if fused and gated else width
    if out is None:
        out = x.new_empty(rows, n)
    cfg = gather_config(x, up, sizes, transposed, fused, gated)
    bm, bn, bk, warps, stages = cfg
    if rows and n and e:
        x = x.contiguous()
        sw = (up.stride(0), up.stride(2), up.stride(1)) if transposed else (up.stride(0), up.stride(1), up.stride(2))
        bias = None if bias is None else bias.contiguous()
        seg = tg.segment_tiles(alignment, bm)
        num_m = -(-rows // bm) + (e if seg else 0)  # segment tiles: at most one partial tile an expert
        grid = (num_m * -(-n // bn),)
        tg.gather_gemm_kernel[grid](
            x, x if weights is None else weights.contiguous(), up, x if bias is None else bias, out, packed,
            o.tokens_per_expert.start, o.padded_bins.start, o.row_sources.start,
            e, num_m, n, x.shape[1], top_k, x.stride(0), *sw, 0 if bias is None else bias.stride(0), out.stride(0),
            float(alpha), float(limit),
            WEIGHTED=weights is not None, BIAS=bias is not None, ACT=kind if fused else -1, GATED=gated,
            INTERLEAVED=interleaved, ZERO_PADDING=zero_padding, E_POW2=1 << (e - 1).bit_length(),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EVEN_K=x.shape[1] % bk == 0, EVEN_N=n % bn == 0,
            SEG_TILES=seg, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


@torch.library.custom_op("padmoe_experts::gather_up", mutates_args=())
def _gather_up(
    x: Tensor,
    packed: Tensor,
    weights: Optional[Tensor],
    up: Tensor,
    bias: Optional[Tensor],
    top_k: int,
    num_experts: int,
    alignment: int,
    capacity: Optional[int],
    transposed: bool,
    kind: int,
    gated: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    fused: bool,
    zero_padding: bool,
) -> Tensor:
    """:func:`triton_gather_up` as an operator torch.compile sees."""
    return triton_gather_up(
        x, packed, weights, up, bias, (top_k, num_experts, alignment, capacity), transposed,
        (kind, gated, interleaved, alpha, limit), fused, zero_padding,
    )  # fmt: skip


@_gather_up.register_fake
def _(x, packed, weights, up, bias, top_k, num_experts, alignment, capacity, transposed, kind, gated, interleaved,
      alpha, limit, fused, zero_padding):  # fmt: skip
    _, _, rows = fake_plan_sizes(packed, top_k, num_experts, alignment, capacity)
    width = up_width(up, transposed)
    return x.new_empty(rows, width // 2 if fused and gated else width)


def triton_gather_wgrad(
    grad_h: Tensor, x: Tensor, packed: Tensor, weights, up: Tensor, sizes, transposed: bool
) -> Tensor:
    """The up projection's weight gradient, shaped and laid out as ``up``, from ``grad_h[R, N1]`` and
    x's rows read through the plan (times ``weights`` when given): no dispatched rows."""
    from padmoe import _triton_gather_gemm as tg

    top_k, e = sizes[0], sizes[1]
    o = plan_slices(x.shape[0], *sizes)
    out = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = up_width(up, transposed)
    h = x.shape[1]
    if out.numel():
        bn, bh, br, warps, stages = tg.wgrad_config(n, h)
        so = (out.stride(0), out.stride(2), out.stride(1)) if transposed else out.stride()
        x, grad_h = x.contiguous(), grad_h.contiguous()
        grid = (e * -(-n // bn) * -(-h // bh),)
        tg.gather_wgrad_kernel[grid](
            grad_h, x, x if weights is None else weights.contiguous(), out, packed,
            o.tokens_per_expert.start, o.padded_bins.start, o.row_sources.start,
            e, n, h, top_k, grad_h.stride(0), x.stride(0), *so,
            WEIGHTED=weights is not None, BLOCK_N=bn, BLOCK_H=bh, BLOCK_R=br, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


@torch.library.custom_op("padmoe_experts::gather_wgrad", mutates_args=())
def _gather_wgrad(
    grad_h: Tensor,
    x: Tensor,
    packed: Tensor,
    weights: Optional[Tensor],
    up: Tensor,
    top_k: int,
    num_experts: int,
    alignment: int,
    capacity: Optional[int],
    transposed: bool,
) -> Tensor:
    """:func:`triton_gather_wgrad` as an operator torch.compile sees."""
    return triton_gather_wgrad(grad_h, x, packed, weights, up, (top_k, num_experts, alignment, capacity), transposed)


@_gather_wgrad.register_fake
def _(grad_h, x, packed, weights, up, top_k, num_experts, alignment, capacity, transposed):
    return torch.empty_like(up, memory_format=torch.contiguous_format)


def _gather_wgrad_call(grad_h, x, packed, weights, up, sizes, transposed) -> Tensor:
    if compiling():
        return torch.ops.padmoe_experts.gather_wgrad(grad_h, x, packed, weights, up, *sizes, transposed)
    return triton_gather_wgrad(grad_h, x, packed, weights, up, sizes, transposed)


def _gather_up_call(x, packed, weights, up, bias, sizes, transposed, act, fused, zero_padding) -> Tensor:
    """The gather-fused up projection: the custom operator while torch.compile traces, else its body."""
    if compiling():
        return torch.ops.padmoe_experts.gather_up(
            x, packed, weights, up, bias, *sizes, transposed, *act, fused, zero_padding
        )
    return triton_gather_up(x, packed, weights, up, bias, sizes, transposed, act, fused, zero_padding)
