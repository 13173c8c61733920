"""padmoe.triton's kernel bodies (the launches, the tile plan and the autograd wrappers are in
padmoe/triton.py, which documents the design): the sorted-position and token passes of padded_gather,
padded_scatter and padded_scatter_wgrad, with the padding-zero programs and the dest-rows pass."""

from __future__ import annotations

import triton
import triton.language as tl


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _sorted_rows(i, live, indices, bin_ids, bins, padded_bins):
    """(padded row, assignment id) of sorted positions i: padded_start(e) + i - real_start(e)."""
    e = tl.load(bin_ids + i, mask=live, other=0)
    a = tl.load(indices + i, mask=live, other=0)
    real_start = tl.load(bins + e - 1, mask=live & (e > 0), other=0)
    pad_start = tl.load(padded_bins + e - 1, mask=live & (e > 0), other=0)
    return pad_start + i - real_start, a


@triton.jit
def _zero_padding(
    y, bins, padded_bins, E, NP, H, zpid, ZB, SUB: tl.constexpr, BLOCK_X: tl.constexpr, LOG_E: tl.constexpr
):
    """Zero padding rows j of [zpid*ZB, min((zpid+1)*ZB, NP)) (NP = P - A, all experts' padding rows in
    expert order): expert e holds j in [cum_pad(e-1), cum_pad(e)), cum_pad(e) = padded_bins[e] - bins[e]
    (a binary search over the E experts), and its padding row is bins[e] + j."""
    begin = zpid * ZB
    end = tl.minimum(begin + ZB, NP)
    rows = tl.arange(0, SUB)
    cols = tl.arange(0, BLOCK_X)
    for s in range(begin, end, SUB):
        j = s + rows
        live = j < end
        lo = tl.zeros([SUB], dtype=tl.int32)
        hi = tl.zeros([SUB], dtype=tl.int32) + E
        for _ in range(LOG_E):  # the first e with cum_pad(e) > j
            active = live & (lo < hi)
            mid = (lo + hi) // 2
            cp = tl.load(padded_bins + mid, mask=active, other=0) - tl.load(bins + mid, mask=active, other=0)
            right = cp <= j
            lo = tl.where(active & right, mid + 1, lo)
            hi = tl.where(active & (cp > j), mid, hi)
        row = (tl.load(bins + lo, mask=live, other=0) + j).to(tl.int64)
        for c in range(0, H, BLOCK_X):
            cc = c + cols
            m = live[:, None] & (cc[None, :] < H)
            tl.store(y + row[:, None] * H + cc[None, :], tl.zeros([SUB, BLOCK_X], dtype=y.dtype.element_ty), mask=m)


def _gather_rows(
    x,
    y,
    w,
    indices,
    bin_ids,
    bins,
    padded_bins,
    A,
    H,
    K,
    B,
    E,
    NP,
    NMAIN,
    ZB,
    SUB: tl.constexpr,
    BLOCK_X: tl.constexpr,
    WEIGHTED: tl.constexpr,
    LOG_E: tl.constexpr,
):
    """The sorted-position gather: programs [0, NMAIN) over sorted positions; programs [NMAIN, grid) zero the
    padding rows (one launch writes every output row once)."""
    pid = tl.program_id(0)
    if pid >= NMAIN:
        _zero_padding(y, bins, padded_bins, E, NP, H, pid - NMAIN, ZB, SUB, BLOCK_X, LOG_E)
    else:
        begin = pid * B
        end = tl.minimum(begin + B, A)
        rows = tl.arange(0, SUB)
        cols = tl.arange(0, BLOCK_X)
        for s in range(begin, end, SUB):
            i = s + rows
            live = i < end
            row, a = _sorted_rows(i, live, indices, bin_ids, bins, padded_bins)
            dst = row.to(tl.int64)
            tok = (a // K).to(tl.int64)
            if WEIGHTED:
                wv = tl.load(w + a, mask=live, other=0.0).to(tl.float32)
            for c in range(0, H, BLOCK_X):
                cc = c + cols
                m = live[:, None] & (cc[None, :] < H)
                v = tl.load(x + tok[:, None] * H + cc[None, :], mask=m, other=0.0)
                if WEIGHTED:
                    v = (v.to(tl.float32) * wv[:, None] + 0.0).to(v.dtype)  # + 0: a zero product is +0.0
                tl.store(y + dst[:, None] * H + cc[None, :], v, mask=m)


def _dest_rows(dest, indices, bin_ids, bins, padded_bins, A, B, SUB: tl.constexpr):
    """dest[indices[i]] = padded row of sorted position i (unique assignment ids: no atomics)."""
    pid = tl.program_id(0)
    begin = pid * B
    end = tl.minimum(begin + B, A)
    rows = tl.arange(0, SUB)
    for s in range(begin, end, SUB):
        i = s + rows
        live = i < end
        row, a = _sorted_rows(i, live, indices, bin_ids, bins, padded_bins)
        tl.store(dest + a, row.to(tl.int32), mask=live)


def _gather_tokens(
    x,
    y,
    w,
    dest,
    bins,
    padded_bins,
    T,
    H,
    K,
    BT,
    E,
    NP,
    NMAIN,
    ZB,
    SUB: tl.constexpr,
    BLOCK_X: tl.constexpr,
    WEIGHTED: tl.constexpr,
    LOG_E: tl.constexpr,
):
    """The token pass (docs/spec.md §16's one read per token): x[t] read once per column tile and
    stored to its K rows dest[t*K+k] (times w[t*K+k] when weighted); programs [NMAIN, grid) zero the
    padding rows."""
    pid = tl.program_id(0)
    if pid >= NMAIN:
        _zero_padding(y, bins, padded_bins, E, NP, H, pid - NMAIN, ZB, SUB, BLOCK_X, LOG_E)
    else:
        begin = pid * BT
        end = tl.minimum(begin + BT, T)
        toks = tl.arange(0, SUB)
        cols = tl.arange(0, BLOCK_X)
        for s in range(begin, end, SUB):
            t = s + toks
            live = t < end
            for c in range(0, H, BLOCK_X):
                cc = c + cols
                m = live[:, None] & (cc[None, :] < H)
                v = tl.load(x + t.to(tl.int64)[:, None] * H + cc[None, :], mask=m, other=0.0)
                for k in range(0, K):
                    a = t * K + k
                    r = tl.load(dest + a, mask=live, other=0).to(tl.int64)
                    if WEIGHTED:
                        wv = tl.load(w + a, mask=live, other=0.0).to(tl.float32)
                        tl.store(
                            y + r[:, None] * H + cc[None, :], (v.to(tl.float32) * wv[:, None] + 0.0).to(v.dtype), mask=m
                        )
                    else:
                        tl.store(y + r[:, None] * H + cc[None, :], v, mask=m)


def _scatter_rows(y, out, w, dest, T, H, K, BT, SUB: tl.constexpr, BLOCK_X: tl.constexpr, WEIGHTED: tl.constexpr):
    """out[t] = sum_k w[t*K+k] * y[dest[t*K+k]], float32, ascending k, cast once."""
    pid = tl.program_id(0)
    begin = pid * BT
    end = tl.minimum(begin + BT, T)
    toks = tl.arange(0, SUB)
    cols = tl.arange(0, BLOCK_X)
    for s in range(begin, end, SUB):
        t = s + toks
        live = t < end
        for c in range(0, H, BLOCK_X):
            cc = c + cols
            m = live[:, None] & (cc[None, :] < H)
            acc = tl.zeros([SUB, BLOCK_X], dtype=tl.float32)
            for k in range(0, K):
                a = t * K + k
                r = tl.load(dest + a, mask=live, other=0).to(tl.int64)
                v = tl.load(y + r[:, None] * H + cc[None, :], mask=m, other=0.0).to(tl.float32)
                if WEIGHTED:
                    v = v * tl.load(w + a, mask=live, other=0.0).to(tl.float32)[:, None]
                acc += v
            tl.store(out + t.to(tl.int64)[:, None] * H + cc[None, :], acc.to(out.dtype.element_ty), mask=m)


def _wgrad_rows(y, g, wgrad, indices, bin_ids, bins, padded_bins, A, H, K, B, SUB: tl.constexpr, BLOCK_X: tl.constexpr):
    """The wgrad over sorted positions: wgrad[indices[i]] = <y[row(i)], g[indices[i] // K]>,
    float32 over the column tiles."""
    pid = tl.program_id(0)
    begin = pid * B
    end = tl.minimum(begin + B, A)
    rows = tl.arange(0, SUB)
    cols = tl.arange(0, BLOCK_X)
    for s in range(begin, end, SUB):
        i = s + rows
        live = i < end
        row, a = _sorted_rows(i, live, indices, bin_ids, bins, padded_bins)
        src = row.to(tl.int64)
        tok = (a // K).to(tl.int64)
        acc = tl.zeros([SUB], dtype=tl.float32)
        for c in range(0, H, BLOCK_X):
            cc = c + cols
            m = live[:, None] & (cc[None, :] < H)
            yv = tl.load(y + src[:, None] * H + cc[None, :], mask=m, other=0.0).to(tl.float32)
            gv = tl.load(g + tok[:, None] * H + cc[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(yv * gv, axis=1)
        tl.store(wgrad + a, acc.to(wgrad.dtype.element_ty), mask=live)


def _wgrad_tokens(y, g, wgrad, dest, T, H, K, BT, SUB: tl.constexpr, BLOCK_X: tl.constexpr, KP: tl.constexpr):
    """The token pass: g[t] read once per column tile, its K rows y[dest[t*K+k]] against it;
    K float32 sums per token carried across the column tiles (KP = K rounded up to a power of two)."""
    pid = tl.program_id(0)
    begin = pid * BT
    end = tl.minimum(begin + BT, T)
    toks = tl.arange(0, SUB)
    cols = tl.arange(0, BLOCK_X)
    ks = tl.arange(0, KP)
    for s in range(begin, end, SUB):
        t = s + toks
        live = t < end
        acc = tl.zeros([SUB, KP], dtype=tl.float32)
        for c in range(0, H, BLOCK_X):
            cc = c + cols
            m = live[:, None] & (cc[None, :] < H)
            gv = tl.load(g + t.to(tl.int64)[:, None] * H + cc[None, :], mask=m, other=0.0).to(tl.float32)
            for k in range(0, K):
                r = tl.load(dest + t * K + k, mask=live, other=0).to(tl.int64)
                yv = tl.load(y + r[:, None] * H + cc[None, :], mask=m, other=0.0).to(tl.float32)
                part = tl.sum(yv * gv, axis=1)
                acc = tl.where(ks[None, :] == k, acc + part[:, None], acc)
        a2 = t[:, None] * K + ks[None, :]
        tl.store(wgrad + a2, acc.to(wgrad.dtype.element_ty), mask=live[:, None] & (ks[None, :] < K))
