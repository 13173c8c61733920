"""padmoe.triton: the seed's Triton-Ascend design of padded_gather / padded_scatter / padded_scatter_wgrad
(SPEC section 6), as Triton kernels. Work in progress (issue "The seed's own design as Triton kernels"):
tested in Triton's interpreter on the CPU; not yet run natively on a GPU nor on an Ascend NPU.

The launch follows padmoe's tile planner (``padmoe.plan_tiles``; target ``ascend-a2`` by default):
``programs`` programs, each over one contiguous range of sorted positions ``[pid*B, min((pid+1)*B, A))``
with ``B = ceil(A / programs)``, stepping ``sub_block_rows`` rows at a time and ``block_x`` columns at a
time. Each row of a sub-block goes to its own padded row (``padded_start(e) + i - real_start(e)``), so
rows of several experts in one sub-block need no separate flush; padding rows are zeroed by a second
launch over the experts' tails, so every output row is written exactly once. Weights are indexed by
assignment id (``weights[indices[i]]``). Scatter accumulates in float32 over k in ascending order
(token partition, no atomics) after one sorted-position pass that builds the inverse map; wgrad is a
float32 dot product per assignment over the column tiles.

Only what Triton-Ascend documents is used: ``tl.program_id``, ``tl.arange``, masked ``tl.load`` /
``tl.store``, integer and float arithmetic, ``tl.sum``, dtype casts; no atomics, no inline assembly, no
warp-level operations.

CPU tensors run the kernels in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first
imported: numpy, slow; for tests); CUDA tensors compile them with Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

import padmoe

__all__ = ["padded_gather", "padded_scatter", "padded_scatter_wgrad", "tile_config"]


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


def _gather_rows(x, y, w, indices, bin_ids, bins, padded_bins, A, H, K, B,
                 SUB: tl.constexpr, BLOCK_X: tl.constexpr, WEIGHTED: tl.constexpr):
    pid = tl.program_id(0)
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
                v = (v.to(tl.float32) * wv[:, None]).to(v.dtype)
            tl.store(y + dst[:, None] * H + cc[None, :], v, mask=m)


def _zero_padding(y, bins, padded_bins, H, BLOCK_ROWS: tl.constexpr, BLOCK_X: tl.constexpr):
    e = tl.program_id(0)
    real_end = tl.load(bins + e)
    real_start = tl.load(bins + e - 1, mask=e > 0, other=0)
    pad_end = tl.load(padded_bins + e).to(tl.int64)
    pad_start = tl.load(padded_bins + e - 1, mask=e > 0, other=0).to(tl.int64)
    first = pad_start + (real_end - real_start)  # the expert's tail: its padding rows
    rows = tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_X)
    for r0 in range(first, pad_end, BLOCK_ROWS):
        r = r0 + rows
        for c in range(0, H, BLOCK_X):
            cc = c + cols
            m = (r[:, None] < pad_end) & (cc[None, :] < H)
            tl.store(y + r[:, None] * H + cc[None, :], tl.zeros([BLOCK_ROWS, BLOCK_X], dtype=y.dtype.element_ty), mask=m)


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


def _scatter_rows(y, out, w, dest, T, H, K, BT, SUB: tl.constexpr, BLOCK_X: tl.constexpr,
                  WEIGHTED: tl.constexpr):
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


def _wgrad_rows(y, g, wgrad, indices, bin_ids, bins, padded_bins, A, H, K, B,
                SUB: tl.constexpr, BLOCK_X: tl.constexpr):
    """wgrad[indices[i]] = <y[row(i)], g[indices[i] // K]>, float32 over the column tiles."""
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


_KERNELS = {name: triton.jit(fn) for name, fn in (("gather", _gather_rows), ("zero", _zero_padding),
                                                    ("dest", _dest_rows), ("scatter", _scatter_rows),
                                                    ("wgrad", _wgrad_rows))}


def _kernel(name, like):
    if not like.is_cuda and not _interpreting():
        raise RuntimeError("padmoe.triton on CPU tensors runs in Triton's interpreter: set TRITON_INTERPRET=1 before "
                           "triton is first imported (it also interprets Triton's own library functions)")
    return _KERNELS[name]


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _pow2_at_most(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def tile_config(op: str, hidden: int, dtype: torch.dtype, target: str = "ascend-a2", cores: int = 0) -> dict:
    """padmoe's tile planner (``padmoe.plan_tiles``) for this op; Triton's block shapes must be powers of
    two, so ``sub_block_rows`` and ``block_x`` are rounded down to one (``block_x`` at least 16: 32 bytes
    of 16-bit rows), which keeps the planner's Unified Buffer budget."""
    c = dict(padmoe.plan_tiles(target, op, hidden, _DTYPE_NAMES.get(dtype, "float32"), cores))
    c["sub_block_rows"] = max(1, _pow2_at_most(int(c["sub_block_rows"])))
    c["block_x"] = max(16, _pow2_at_most(int(c["block_x"])))
    return c


def _config(op, hidden, dtype, config):
    return tile_config(op, hidden, dtype) if config is None else config


def _check(op, x, indices, bin_ids, bins, padded_bins, top_k, weights):
    # Every argument through padmoe's own checks on column-less stand-ins: nothing is moved, and
    # bad input raises padmoe's ValueError / TypeError before any kernel runs.
    stand_in = torch.empty(x.shape[0], 0, dtype=torch.float32, device=x.device)
    w = None if weights is None else weights.reshape(-1).to(torch.float32)
    if op == "scatter":
        padmoe.padded_scatter(stand_in, indices, bin_ids, w, bins, padded_bins, top_k)
    else:
        padmoe.padded_gather(stand_in, indices, bin_ids, bins, padded_bins, top_k, w)


def padded_gather(x: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor, bins: torch.Tensor,
                  padded_bins: torch.Tensor, top_k: int, weights: Optional[torch.Tensor] = None, *,
                  config: Optional[dict] = None) -> torch.Tensor:
    """MegaBlocks ``padded_gather`` in the seed's design: ``y[P, H]`` (P = padded_bins[-1], read on the
    host), real rows gathered (times ``weights[indices[i]]`` when given), padding rows zero."""
    _check("gather", x, indices, bin_ids, bins, padded_bins, top_k, weights)
    x = x.contiguous()
    A, H = int(indices.shape[0]), int(x.shape[1])
    E = int(bins.shape[0])
    P = int(padded_bins[-1]) if E > 0 else 0
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    if A == 0 and P == 0:
        return y
    c = _config("gather", H, x.dtype, config)
    programs = max(1, min(int(c["programs"]), A))
    B = -(-A // programs) if A > 0 else 0
    w = x if weights is None else weights.reshape(-1).contiguous()
    i32 = torch.int32
    idx, bid = indices.to(i32).contiguous(), bin_ids.to(i32).contiguous()
    b, pb = bins.to(i32).contiguous(), padded_bins.to(i32).contiguous()
    if A > 0 and H > 0:
        _kernel("gather", x)[(programs,)](x, y, w, idx, bid, b, pb, A, H, int(top_k), B,
                                           SUB=c["sub_block_rows"], BLOCK_X=c["block_x"],
                                           WEIGHTED=weights is not None)
    if E > 0 and H > 0:
        _kernel("zero", x)[(E,)](y, b, pb, H, BLOCK_ROWS=c["sub_block_rows"], BLOCK_X=c["block_x"])
    return y


def padded_scatter(y: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor, weights: Optional[torch.Tensor],
                   bins: torch.Tensor, padded_bins: torch.Tensor, top_k: int, *,
                   config: Optional[dict] = None) -> torch.Tensor:
    """MegaBlocks ``padded_scatter``: ``out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]]`` in float32,
    ascending k, cast once; padding rows of ``y`` never read."""
    _check("scatter", y, indices, bin_ids, bins, padded_bins, top_k, weights)
    y = y.contiguous()
    A, H, K = int(indices.shape[0]), int(y.shape[1]), int(top_k)
    T = A // K
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if A == 0 or H == 0:
        return out.zero_() if H > 0 else out
    c = _config("scatter", H, y.dtype, config)
    programs = max(1, min(int(c["programs"]), A))
    i32 = torch.int32
    idx, bid = indices.to(i32).contiguous(), bin_ids.to(i32).contiguous()
    b, pb = bins.to(i32).contiguous(), padded_bins.to(i32).contiguous()
    dest = torch.empty(A, dtype=i32, device=y.device)
    _kernel("dest", y)[(programs,)](dest, idx, bid, b, pb, A, -(-A // programs), SUB=c["sub_block_rows"])
    tprograms = max(1, min(programs, T))
    w = y if weights is None else weights.reshape(-1).contiguous()
    _kernel("scatter", y)[(tprograms,)](y, out, w, dest, T, H, K, -(-T // tprograms), SUB=c["sub_block_rows"],
                                         BLOCK_X=c["block_x"], WEIGHTED=weights is not None)
    return out


def padded_scatter_wgrad(y: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, bin_ids: torch.Tensor,
                         bins: torch.Tensor, padded_bins: torch.Tensor, top_k: int, *,
                         config: Optional[dict] = None) -> torch.Tensor:
    """MegaBlocks ``padded_scatter_wgrad``: ``wgrad[a] = sum_h y[dest_rows[a], h] * grad[a // K, h]``,
    float32 accumulation, in y's dtype. ``sub_block_rows`` is 1 when H > block_x (the planner's rule)."""
    _check("gather", grad, indices, bin_ids, bins, padded_bins, top_k, None)
    y, grad = y.contiguous(), grad.contiguous()
    A, H = int(indices.shape[0]), int(y.shape[1])
    if A == 0 or H == 0:
        return torch.zeros(A, dtype=y.dtype, device=y.device)
    wgrad = torch.empty(A, dtype=y.dtype, device=y.device)  # every entry written once (indices: a permutation)
    c = _config("wgrad", H, y.dtype, config)
    programs = max(1, min(int(c["programs"]), A))
    i32 = torch.int32
    _kernel("wgrad", y)[(programs,)](y, grad, wgrad, indices.to(i32).contiguous(), bin_ids.to(i32).contiguous(),
                                      bins.to(i32).contiguous(), padded_bins.to(i32).contiguous(), A, H, int(top_k),
                                      -(-A // programs), SUB=c["sub_block_rows"], BLOCK_X=c["block_x"])
    return wgrad


# ---------------------------------------------------------------------------
# autograd (padmoe.torch's drop-ins with backend="triton"): SPEC section 2's backward rules
# ---------------------------------------------------------------------------


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, bin_ids, bins, padded_bins, top_k, weights):
        ctx.save_for_backward(x, indices, bin_ids, bins, padded_bins, weights)
        ctx.top_k = top_k
        return padded_gather(x, indices, bin_ids, bins, padded_bins, top_k, weights)

    @staticmethod
    def backward(ctx, grad_y):
        x, indices, bin_ids, bins, padded_bins, weights = ctx.saved_tensors
        k = ctx.top_k
        # grad_x[t] = sum_k w * grad_y[row]; grad_w[a] = <grad_y[row(a)], x[a // K]>
        gx = padded_scatter(grad_y, indices, bin_ids, weights, bins, padded_bins, k) if ctx.needs_input_grad[0] else None
        gw = None
        if weights is not None and ctx.needs_input_grad[6]:
            gw = padded_scatter_wgrad(grad_y, x, indices, bin_ids, bins, padded_bins, k).to(weights.dtype)
            gw = gw.view(weights.shape)
        return gx, None, None, None, None, None, gw


class _ScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, indices, bin_ids, weights, bins, padded_bins, top_k):
        ctx.save_for_backward(y, indices, bin_ids, weights, bins, padded_bins)
        ctx.top_k = top_k
        return padded_scatter(y, indices, bin_ids, weights, bins, padded_bins, top_k)

    @staticmethod
    def backward(ctx, grad_out):
        y, indices, bin_ids, weights, bins, padded_bins = ctx.saved_tensors
        k = ctx.top_k
        grad_out = grad_out.contiguous()
        # grad_y = gather(grad_out, weights) into y's rows (padding rows zero); grad_w = wgrad(y, grad_out)
        gy = None
        if ctx.needs_input_grad[0]:
            g = padded_gather(grad_out, indices, bin_ids, bins, padded_bins, k, weights)
            gy = g if g.shape[0] == y.shape[0] else torch.cat([g, g.new_zeros(y.shape[0] - g.shape[0], g.shape[1])])
        gw = None
        if weights is not None and ctx.needs_input_grad[3]:
            gw = padded_scatter_wgrad(y, grad_out, indices, bin_ids, bins, padded_bins, k).to(weights.dtype)
            gw = gw.view(weights.shape)
        return gy, None, None, gw, None, None, None


def gather_autograd(x, indices, bin_ids, bins, padded_bins, top_k, weights=None):
    """padded_gather through autograd (backward: padmoe.triton's scatter and wgrad)."""
    return _GatherFn.apply(x, indices, bin_ids, bins, padded_bins, int(top_k), weights)


def scatter_autograd(y, indices, bin_ids, weights, bins, padded_bins, top_k):
    """padded_scatter through autograd (backward: padmoe.triton's gather and wgrad)."""
    return _ScatterFn.apply(y, indices, bin_ids, weights, bins, padded_bins, int(top_k))
