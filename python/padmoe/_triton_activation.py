"""The expert MLP's activation as one Triton pass each way (padmoe.torch's expert MLP operator runs
these on CUDA tensors; on CPU tensors they run in Triton's interpreter, which is how the CPU suite
tests them).

Forward reads the up projection's output ``h[R, N1]`` and writes ``a[R, I]``: ``act(g) * u`` over the
two halves of ``h`` (side by side, or interleaved: gate and up in alternating columns), or ``act(h)``
ungated (N1 = I). Backward reads ``h`` and ``grad_a`` and writes ``grad_h[R, N1]`` in one tensor and
``a`` again (the down projection's weight gradient needs it; recomputing it here costs one write
instead of keeping ``[R, I]`` from the forward). Everything is computed in float32 and rounded once to
the output's dtype. With a bias, each row's expert's up-projection bias (``bias[row_experts[r]]``, none
on padding rows) is added to h in float32 as it is read, both ways: h is kept without it. Rows at or
past P (``offsets[E-1]``, read on the device) are neither read nor written: a grouped GEMM leaves them
unwritten and nothing downstream reads them.
"""

from __future__ import annotations

import triton
import triton.language as tl

# KIND, the activation code: padmoe/torch/_expert_mlp.py's KINDS maps names to it (0 silu, 1 gelu,
# 2 gelu_tanh, 3 relu, 4 relu2, 5 sigmoid, 6 identity, 7 clamped_swiglu: GPT-OSS's
# g' = min(g, L), u' = clamp(u, -L, L), (u' + 1) * g' * sigmoid(alpha g')).

_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _act(g, KIND: tl.constexpr, alpha, limit):
    """(act(g), act'(g)) in float32; for clamped_swiglu the gate's part with the clamp's mask."""
    if KIND == 0:
        s = _sigmoid(g)
        y = g * s
        d = s * (1.0 + g * (1.0 - s))
    elif KIND == 1:
        c = 0.5 * (1.0 + tl.math.erf(g * _INV_SQRT_2))
        y = g * c
        d = c + g * tl.exp(-0.5 * g * g) * _INV_SQRT_2PI
    elif KIND == 2:
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        t = 2.0 * _sigmoid(2.0 * inner) - 1.0  # tanh(inner)
        y = 0.5 * g * (1.0 + t)
        d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * g * g)
    elif KIND == 3:
        y = tl.maximum(g, 0.0)
        d = tl.where(g > 0.0, 1.0, 0.0)
    elif KIND == 4:
        r = tl.maximum(g, 0.0)
        y = r * r
        d = 2.0 * r
    elif KIND == 5:
        y = _sigmoid(g)
        d = y * (1.0 - y)
    elif KIND == 6:
        y = g
        d = g * 0.0 + 1.0
    else:
        gc = tl.minimum(g, limit)
        s = _sigmoid(alpha * gc)
        y = gc * s
        d = tl.where(g <= limit, s * (1.0 + alpha * gc * (1.0 - s)), 0.0)
    return y, d


@triton.jit
def _up_half(u, KIND: tl.constexpr, limit):
    """The up half as the product uses it: clamped and shifted by one for clamped_swiglu."""
    if KIND == 7:
        return tl.minimum(tl.maximum(u, -limit), limit) + 1.0
    else:
        return u


@triton.jit
def _up_mask(u, KIND: tl.constexpr, limit):
    """d(up half as used)/du: the clamp's mask for clamped_swiglu, else one."""
    if KIND == 7:
        return tl.where((u >= -limit) & (u <= limit), 1.0, 0.0)
    else:
        return u * 0.0 + 1.0


@triton.jit
def _tile(offsets, E, I, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile of ``[R, I]``: (rows, columns, live rows, mask, P, first column)."""
    p = tl.load(offsets + E - 1)
    col0 = tl.program_id(1) * BLOCK_C
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = col0 + tl.arange(0, BLOCK_C)
    live = rows < p
    return rows.to(tl.int64), cols, live, live[:, None] & (cols < I)[None, :], p, col0


@triton.jit
def _pair_cols(col0, live, I, BLOCK_C: tl.constexpr):
    """The interleaved (gate, up) columns of the tile's outputs, and their mask."""
    c2 = 2 * col0 + tl.arange(0, 2 * BLOCK_C)
    return c2, live[:, None] & (c2 < 2 * I)[None, :]


@triton.jit
def _load_halves(
    base,
    cols,
    live,
    m,
    I,
    col0,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """(gate, up) halves in float32 of the rows ``base`` points at ([BLOCK_R, 1] row pointers)."""
    if GATED:
        if INTERLEAVED:
            c2, m2 = _pair_cols(col0, live, I, BLOCK_C)
            both = tl.load(base + c2[None, :], mask=m2, other=0.0).to(tl.float32)
            g, u = tl.split(tl.reshape(both, [BLOCK_R, BLOCK_C, 2]))
        else:
            g = tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            u = tl.load(base + I + cols[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        g = tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32)
        u = g
    return g, u


@triton.jit
def _inputs(
    h,
    bias,
    row_experts,
    rows,
    cols,
    live,
    m,
    I,
    stride_h,
    stride_b,
    col0,
    BIAS: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The activation's inputs (gate, up) in float32: h's halves, plus, with ``BIAS``, the row's
    expert's bias (``bias[row_experts[r]]``; none on padding rows, whose expert is -1)."""
    g, u = _load_halves(h + rows[:, None] * stride_h, cols, live, m, I, col0, GATED, INTERLEAVED, BLOCK_R, BLOCK_C)
    if BIAS:
        e = tl.load(row_experts + rows, mask=live, other=-1)
        has = live & (e >= 0)
        bb = bias + tl.where(has, e, 0).to(tl.int64)[:, None] * stride_b
        bg, bu = _load_halves(bb, cols, has, m & has[:, None], I, col0, GATED, INTERLEAVED, BLOCK_R, BLOCK_C)
        g += bg
        u += bu
    return g, u


@triton.jit
def act_forward_kernel(
    h,
    a,
    offsets,
    bias,
    row_experts,
    E,
    I,
    stride_h,
    stride_a,
    stride_b,
    alpha,
    limit,
    BIAS: tl.constexpr,
    KIND: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows, cols, live, m, p, col0 = _tile(offsets, E, I, BLOCK_R, BLOCK_C)
    if tl.program_id(0) * BLOCK_R < p:
        g, u = _inputs(h, bias, row_experts, rows, cols, live, m, I, stride_h, stride_b, col0, BIAS, GATED, INTERLEAVED,
                       BLOCK_R, BLOCK_C)  # fmt: skip
        y, _ = _act(g, KIND, alpha, limit)
        if GATED:
            y = y * _up_half(u, KIND, limit)
        tl.store(a + rows[:, None] * stride_a + cols[None, :], y.to(a.dtype.element_ty), mask=m)


@triton.jit
def act_backward_kernel(
    h,
    grad_a,
    grad_h,
    a,
    offsets,
    bias,
    row_experts,
    E,
    I,
    stride_h,
    stride_ga,
    stride_gh,
    stride_a,
    stride_b,
    alpha,
    limit,
    row_sources,
    weights,
    dots,
    NB,
    BIAS: tl.constexpr,
    KIND: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """With ``WEIGHTED`` (the router weights applied after the experts, folded in here): ``grad_a``
    is the unweighted gradient of ``a``; each row's weight ``w_r = weights[row_sources[r]]`` (0 on
    padding rows) scales it before the activation's derivative and scales the ``a`` written (the
    down projection's weight gradient reads ``w_r * a``), and ``dots[row_sources[r], program
    column]`` gets this tile's share of ``<grad_a_r, a_r>``, the router weight's gradient."""
    rows, cols, live, m, p, col0 = _tile(offsets, E, I, BLOCK_R, BLOCK_C)
    if tl.program_id(0) * BLOCK_R < p:
        g, u = _inputs(h, bias, row_experts, rows, cols, live, m, I, stride_h, stride_b, col0, BIAS, GATED, INTERLEAVED,
                       BLOCK_R, BLOCK_C)  # fmt: skip
        ga = tl.load(grad_a + rows[:, None] * stride_ga + cols[None, :], mask=m, other=0.0).to(tl.float32)
        y, d = _act(g, KIND, alpha, limit)
        out = h.dtype.element_ty
        base = grad_h + rows[:, None] * stride_gh
        if WEIGHTED:
            src = tl.load(row_sources + rows, mask=live, other=-1)
            has = live & (src >= 0)
            wr = tl.load(weights + tl.where(has, src, 0).to(tl.int64), mask=has, other=0.0).to(tl.float32)
            full = y * _up_half(u, KIND, limit) if GATED else y
            part = tl.sum(ga * tl.where(m, full, 0.0), axis=1)
            tl.store(dots + tl.where(has, src, 0).to(tl.int64) * NB + tl.program_id(1), part, mask=has)
            ga = ga * wr[:, None]
        if GATED:
            uu = _up_half(u, KIND, limit)
            dg = ga * uu * d
            du = ga * y * _up_mask(u, KIND, limit)
            y = y * uu
            if INTERLEAVED:
                c2, m2 = _pair_cols(col0, live, I, BLOCK_C)
                both = tl.reshape(tl.join(dg, du), [BLOCK_R, 2 * BLOCK_C])
                tl.store(base + c2[None, :], both.to(out), mask=m2)
            else:
                tl.store(base + cols[None, :], dg.to(out), mask=m)
                tl.store(base + I + cols[None, :], du.to(out), mask=m)
        else:
            tl.store(base + cols[None, :], (ga * d).to(out), mask=m)
        if WEIGHTED:
            y = y * wr[:, None]
        tl.store(a + rows[:, None] * stride_a + cols[None, :], y.to(a.dtype.element_ty), mask=m)


def blocks(rows: int, width: int):
    """(BLOCK_R, BLOCK_C, grid) of the activation kernels for ``rows`` x ``width`` (= I) outputs: 256
    columns a program (fewer for narrow I), 4096 elements a program."""
    block_c = min(256, triton.next_power_of_2(max(width, 16)))
    block_r = max(1, 4096 // block_c)
    return block_r, block_c, (triton.cdiv(rows, block_r), triton.cdiv(width, block_c))
