"""The expert MLP's up projection with the gather in its A-load: one Triton grouped GEMM that reads x's
rows through the plan's ``row_sources`` instead of a dispatched ``[P, H]`` buffer (padmoe.torch's expert
MLP operator runs it on CUDA tensors; on CPU tensors it runs in Triton's interpreter, which is how the
CPU suite tests it).

Program (m, n) computes ``BLOCK_M`` rows of ``x[row_sources // K] @ W[e]`` for output columns
``[n*BLOCK_N, (n+1)*BLOCK_N)``, the rows of one expert ``e``. Where ``BLOCK_M`` divides the plan's
alignment (every segment starts on a multiple of it), tile m is rows ``[m*BLOCK_M, (m+1)*BLOCK_M)``
and its expert is found by counting the segment ends (``padded_bins``) at or before its first row.
Otherwise (segment tiles: 128-row tiles at an alignment of 16, 32 or 64) each expert's padded segment
is tiled from its own start, its last tile cut at the segment's end, and tile m is found in the
running sum of the experts' tile counts; the grid has E tiles more than P needs. Real rows come
first in a segment, so a tile past ``padded_start(e) + count(e)`` holds padding only: it computes
nothing (zeros written only when the caller needs padding rows zero). Tiles past the last exit.
The router weight (``weighting="before"``) multiplies each gathered row in float32 and rounds to x's
dtype before the product, as ``dispatch`` does.

The backward's weight gradient of the up projection reads x through the plan the same way
(:func:`gather_wgrad_kernel`), so with ``recompute_rows`` no ``[P, H]`` rows are dispatched at all.

Two epilogues:
- ``ACT < 0``: ``h = acc (+ bias)`` rounded once, ``[R, N]`` (the forward with gradients keeps h).
- ``ACT = kind``: the activation fused (kinds of padmoe/_triton_activation.py); gated, the program's
  one accumulator is ``BLOCK_M x 2*BLOCK_N``, the gate's and the up half's columns of the same
  outputs (side by side: ``j`` and ``I + j``; interleaved: ``2j`` and ``2j + 1``), read as one B tile
  and split in the epilogue; it writes ``a[R, I]`` only: neither the dispatched rows nor h is ever
  written (the forward without gradients).

The bias is added to the float32 accumulator on real rows (padding rows stay zero). Every output is
one program's dot products in a fixed order: bitwise deterministic, no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_activation import _act, _up_half


@triton.jit
def _segment(pad_ends, counts, row0, E, E_POW2: tl.constexpr):
    """(expert, first padding row) of the segment holding row ``row0`` (< P)."""
    i = tl.arange(0, E_POW2)
    ends = tl.load(pad_ends + i, mask=i < E, other=0)
    e = tl.sum(((ends <= row0) & (i < E)).to(tl.int32), axis=0)
    start = tl.sum(tl.where(i == e - 1, ends, 0), axis=0)
    return e, start + tl.load(counts + e)


@triton.jit
def _segment_tile(pad_ends, counts, tile, E, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, segment end, first padding row) of segment tile ``tile``: each expert's
    padded segment cut into tiles of BLOCK_M rows from its start, the experts' tiles one after
    another; an expert of E or more past the last tile."""
    i = tl.arange(0, E_POW2)
    ends = tl.load(pad_ends + i, mask=i < E, other=0)
    starts = tl.load(pad_ends + i - 1, mask=(i > 0) & (i < E), other=0)
    tiles = tl.where(i < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    through = tl.cumsum(tiles, 0)  # the tiles of experts 0..i
    e = tl.sum((through <= tile).to(tl.int32), axis=0)
    first = tl.sum(tl.where(i == e, through - tiles, 0), axis=0)
    start = tl.sum(tl.where(i == e, starts, 0), axis=0)
    end = tl.sum(tl.where(i == e, ends, 0), axis=0)
    return e, start + (tile - first) * BLOCK_M, end, start + tl.load(counts + e, mask=e < E, other=0)


@triton.jit
def _mainloop(a_ptr, a_mask, b_ptr, b_mask, wv, acc, ks, KDIM, stride_wk, WEIGHTED: tl.constexpr,
              EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``acc += A @ B`` over KDIM: the tiles' pointers formed once by the caller and advanced by
    BLOCK_K (no address arithmetic a step); masks only where the sizes need them (EVEN_K: BLOCK_K
    divides KDIM; EVEN_N: every B column in range). A's rows times ``wv`` (float32, rounded to A's
    dtype) when WEIGHTED."""
    for k0 in range(0, KDIM, BLOCK_K):
        if EVEN_K:
            at = tl.load(a_ptr, mask=a_mask, other=0.0)
            if EVEN_N:
                bt = tl.load(b_ptr)
            else:
                bt = tl.load(b_ptr, mask=b_mask, other=0.0)
        else:
            k_ok = (k0 + ks) < KDIM
            at = tl.load(a_ptr, mask=a_mask & k_ok[None, :], other=0.0)
            bt = tl.load(b_ptr, mask=b_mask & k_ok[:, None], other=0.0)
        if WEIGHTED:
            at = (at.to(tl.float32) * wv[:, None] + 0.0).to(at.dtype)
        acc = tl.dot(at, bt, acc)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K * stride_wk
    return acc


@triton.jit
def gather_gemm_kernel(
    x,
    weights,
    w,
    bias,
    out,
    plan,
    off_counts,
    off_ends,
    off_sources,
    E,
    NUM_M,
    N,
    KDIM,
    TOP_K,
    stride_x,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_o,
    alpha,
    limit,
    WEIGHTED: tl.constexpr,
    BIAS: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ZERO_PADDING: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    SEG_TILES: tl.constexpr,
):
    # Programs in groups of GROUP_M row tiles, column tiles outermost within a group: the row tiles
    # of one expert that run together share each weight tile while it is in L2 (row-major order
    # would read an expert's weights once per row tile).
    num_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(NUM_M - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    counts = plan + off_counts
    pad_ends = plan + off_ends
    sources = plan + off_sources
    if SEG_TILES:
        e, row0, seg_end, real_end = _segment_tile(pad_ends, counts, pid_m, E, E_POW2, BLOCK_M)
        run = e < E
    else:
        row0 = pid_m * BLOCK_M
        run = row0 < tl.load(pad_ends + E - 1)
    if run:
        if not SEG_TILES:
            e, real_end = _segment(pad_ends, counts, row0, E, E_POW2)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        if SEG_TILES:  # the segment's last tile: rows past its end are the next expert's
            out_ok = col_ok[None, :] & (rows < seg_end)[:, None]
        else:
            out_ok = col_ok[None, :]
        optr = out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
        if row0 >= real_end:
            if ZERO_PADDING:
                zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=out.dtype.element_ty)
                tl.store(optr, zero, mask=out_ok)
        else:
            src = tl.load(sources + rows, mask=rows < real_end, other=-1)
            live = src >= 0
            tok = tl.where(live, src // TOP_K, 0).to(tl.int64)
            if WEIGHTED:
                wv = tl.load(weights + src, mask=live, other=0.0).to(tl.float32)
            else:
                wv = 0.0
            wbase = w + e.to(tl.int64) * stride_we
            ks = tl.arange(0, BLOCK_K)
            a_ptr = x + tok[:, None] * stride_x + ks[None, :]
            if ACT >= 0 and GATED:
                # one B tile of 2 * BLOCK_N weight rows: the gate's and the up half's columns of the
                # program's outputs, so each step is one dot of twice the width (the tensor cores'
                # wider shape) instead of two; interleaved they are the contiguous rows
                # [2 * n0, 2 * n0 + 2 * BLOCK_N), side by side the two runs [n0, n0 + BLOCK_N) and
                # [N + n0, N + n0 + BLOCK_N)
                c2 = tl.arange(0, 2 * BLOCK_N)
                if INTERLEAVED:
                    wrow = 2 * pid_n * BLOCK_N + c2
                    wrow_ok = wrow < 2 * N
                else:
                    j2 = pid_n * BLOCK_N + c2 % BLOCK_N
                    wrow = j2 + (c2 // BLOCK_N) * N
                    wrow_ok = j2 < N
                acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            else:
                wrow = cols
                wrow_ok = col_ok
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            b_ptr = wbase + wrow[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
            acc = _mainloop(a_ptr, live[:, None], b_ptr, wrow_ok[None, :], wv, acc, ks, KDIM, stride_wk, WEIGHTED,
                            EVEN_K, EVEN_N, BLOCK_K)  # fmt: skip
            if ACT >= 0 and GATED:
                if INTERLEAVED:  # column 2j the gate's, 2j + 1 the up half's
                    acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
                else:  # columns [0, BLOCK_N) the gate's, [BLOCK_N, 2 * BLOCK_N) the up half's
                    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
                if INTERLEAVED:
                    cg = 2 * cols
                    cu = cg + 1
                else:
                    cg = cols
                    cu = cols + N
            else:
                acc_g = acc
                acc_u = acc
                cg = cols
                cu = cols
            if BIAS:
                bb = bias + e.to(tl.int64) * stride_be
                acc_g += tl.where(live[:, None], tl.load(bb + cg, mask=col_ok, other=0.0).to(tl.float32)[None, :], 0.0)
                if ACT >= 0 and GATED:
                    acc_u += tl.where(
                        live[:, None], tl.load(bb + cu, mask=col_ok, other=0.0).to(tl.float32)[None, :], 0.0
                    )
            if ACT >= 0:
                y, _ = _act(acc_g, ACT, alpha, limit)
                if GATED:
                    y = y * _up_half(acc_u, ACT, limit)
                y = tl.where(live[:, None], y, 0.0)
            else:
                y = acc_g
            m = out_ok
            if not ZERO_PADDING:
                m = m & live[:, None]
            tl.store(optr, y.to(out.dtype.element_ty), mask=m)


@triton.jit
def gather_wgrad_kernel(
    g,
    x,
    weights,
    out,
    plan,
    off_counts,
    off_ends,
    off_sources,
    E,
    N,
    H,
    TOP_K,
    stride_g,
    stride_x,
    stride_oe,
    stride_on,
    stride_oh,
    WEIGHTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The up projection's weight gradient ``out[e] = g[seg(e)]^T x[row_sources // K]`` (``[N, H]`` per
    expert, written through ``stride_on`` / ``stride_oh``: either weight layout), reading x's rows through
    the plan as :func:`gather_gemm_kernel` does; only real rows are summed (padding rows add zero), in
    row order, in float32, rounded once. An expert without rows gets zeros."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_h = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    e = pid // (num_n * num_h)
    rest = pid % (num_n * num_h)
    cols_n = (rest // num_h) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_h = (rest % num_h) * BLOCK_H + tl.arange(0, BLOCK_H)
    n_ok = cols_n < N
    h_ok = cols_h < H
    start = tl.load(plan + off_ends + e - 1, mask=e > 0, other=0)
    end = start + tl.load(plan + off_counts + e)
    sources = plan + off_sources
    acc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    rs = tl.arange(0, BLOCK_R)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + rs
        src = tl.load(sources + rows, mask=rows < end, other=-1)
        live = src >= 0
        tok = tl.where(live, src // TOP_K, 0).to(tl.int64)
        gt = tl.load(g + rows.to(tl.int64)[:, None] * stride_g + cols_n[None, :], mask=live[:, None] & n_ok[None, :],
                     other=0.0)  # fmt: skip
        xt = tl.load(x + tok[:, None] * stride_x + cols_h[None, :], mask=live[:, None] & h_ok[None, :], other=0.0)
        if WEIGHTED:
            wv = tl.load(weights + src, mask=live, other=0.0).to(tl.float32)
            xt = (xt.to(tl.float32) * wv[:, None] + 0.0).to(xt.dtype)
        acc = tl.dot(tl.trans(gt), xt, acc)
    optr = out + e.to(tl.int64) * stride_oe + cols_n[:, None].to(tl.int64) * stride_on + cols_h[None, :] * stride_oh
    tl.store(optr, acc.to(out.dtype.element_ty), mask=n_ok[:, None] & h_ok[None, :])


def block_m(alignment: int, rows_per_expert: float):
    """The tile height: a power of two from 16 to 128, no taller than the average expert's rows need;
    None when ``alignment`` is not a multiple of 16 (the tensor cores' smallest tile), and then the
    caller dispatches and runs torch's grouped GEMM. Below 128 it divides ``alignment`` (a tile never
    spans two experts); 128 (full-height tiles) at any alignment, as segment tiles where it does not
    divide it (:func:`segment_tiles`)."""
    if alignment <= 0 or alignment % 16:
        return None
    want = min(128, triton.next_power_of_2(max(int(rows_per_expert), 16)))
    if want == 128:
        return want
    bm = 16
    while bm < want and alignment % (2 * bm) == 0:
        bm *= 2
    return bm


def segment_tiles(alignment: int, bm: int) -> bool:
    """Whether tiles of ``bm`` rows tile each expert's segment from its own start (``bm`` does not
    divide ``alignment``) rather than the padded rows from row 0."""
    return alignment % bm != 0


def config(alignment: int, rows_per_expert: float, n: int, fused_gated: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an output width ``n`` (I when the gated
    activation is fused: two accumulators a program), or None (see :func:`block_m`)."""
    bm = block_m(alignment, rows_per_expert)
    if bm is None:
        return None
    if bm == 128:
        # Full-height tiles: a 128 x 256 accumulator (gated: 128 gate and 128 up columns), 8 warps, 3
        # stages; against 128 x 128, 0.82x / 0.78x / 0.96x the time with the activation fused at
        # mixtral-8x7b / qwen3-30b-a3b / deepseek-v3 (H100, bench/results/experts.md)
        return bm, min(128 if fused_gated else 256, triton.next_power_of_2(max(n, 16))), 64, 8, 3
    bn = min(64 if fused_gated else 128, triton.next_power_of_2(max(n, 16)))
    warps = 8 if bm * bn * (2 if fused_gated else 1) >= 128 * 128 else 4
    return bm, bn, 64, warps, 3 if bm >= 64 else 4


def wgrad_config(n: int, h: int):
    """(BLOCK_N, BLOCK_H, BLOCK_R, num_warps, num_stages) of :func:`gather_wgrad_kernel`."""
    bn = min(128, triton.next_power_of_2(max(n, 16)))
    bh = min(128, triton.next_power_of_2(max(h, 16)))
    return bn, bh, 64, 8 if bn * bh >= 128 * 128 else 4, 3
