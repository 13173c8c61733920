"""padmoe.triton: a Triton-Ascend design of padded_gather / padded_scatter / padded_scatter_wgrad
(docs/spec.md §15), as Triton kernels. Tested in Triton's interpreter on the CPU (CI) and natively on an
H200; not run on an Ascend NPU (none was available to test on). docs/ascend.md says what ran where.

The launch follows padmoe's tile planner (``padmoe.tile_config``; target ``gpu`` for CUDA tensors with
the device's SM count, ``ascend-a2`` otherwise): ``programs`` programs, each over one contiguous range
``[pid*B, min((pid+1)*B, N))``, ``B = ceil(N / programs)``, stepping ``sub_block_rows`` rows and
``block_x`` columns at a time. Two passes:

- ``sorted`` (the Ascend design's; the default of ``ascend-a2``): ranges of sorted positions (N = A). Each row of
  a step goes to its own padded row ``padded_start(e) + i - real_start(e)``, so rows of several experts
  in one step need no separate flush. Gather reads a token's row once per copy.
- ``tokens`` (the default of ``gpu``; docs/spec.md §16: the floor needs the inverse map): one index-only
  pass over sorted positions writes ``dest_rows[indices[i]]`` (unique ids: no atomics), then ranges of
  tokens (N = T) read each token row (gather, wgrad's grad row) once and write / read its K rows.

Scatter is always the dest-rows pass then the token pass, float32 over k in ascending order, cast once.
Gather's padding rows are zeroed by extra programs of the same launch (a binary search over the
experts' cumulative padding), so every output row is written exactly once and no memset runs. Weights
are indexed by assignment id (``weights[indices[i]]``); padding rows are never read.

Triton features used (all in Triton-Ascend's documented language subset): ``tl.program_id``,
``tl.arange``, masked ``tl.load`` / ``tl.store`` with computed offsets, ``range`` loops with run-time
bounds, a scalar ``if`` on the program id, ``@triton.jit`` helpers called from kernels, integer and
float arithmetic, ``tl.minimum``, ``tl.where``, ``tl.zeros``, ``tl.sum``, dtype casts, ``tl.constexpr``
block sizes. No atomics, no inline assembly, no warp-level operations.

CPU tensors run the kernels in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first
imported: numpy, slow; for tests); CUDA tensors compile them with Triton, and later calls of a compiled
specialization launch it directly (``_Launcher``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

import padmoe

__all__ = ["padded_gather", "padded_scatter", "padded_scatter_wgrad", "tile_config"]


from ._triton_kernels import (
    _dest_rows,
    _gather_rows,
    _gather_tokens,
    _interpreting,
    _scatter_rows,
    _wgrad_rows,
    _wgrad_tokens,
)


def _raw_stream(index):
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811 (what Triton's own launch asks)


class _Launcher:
    """``kernel[(grid,)](*args, **kwargs)`` with Triton's per-call Python work cached for CUDA tensors.

    Triton's ``JITFunction.run`` re-derives the specialization of every argument, reads its knobs and
    checks its globals on every call: tens of µs of host time per launch, more than the kernels of a
    decode-sized op. The first call of each specialization goes through Triton and the compiled kernel
    it returns is kept; later calls with the same specialization launch it directly, as ``run`` itself
    does. The key is at least as fine as Triton's specialization: each tensor's dtype and 16-byte
    alignment, each int's ``== 0`` / ``== 1`` / ``% 16 == 0`` / 32-bit range, constexprs and launch
    options by value. Triton's launch hooks are passed on as ``run`` passes them. Anything unexpected
    (a Triton without ``knobs``, a pre-run hook, an argument list this does not know) turns the cache
    off and every launch goes through Triton."""

    _OPTIONS = ("num_warps", "num_stages", "num_ctas")

    def __init__(self, fn):
        self.fn = fn
        self.names = list(fn.arg_names)
        self.constexpr = {self.names[i] for i in getattr(fn, "constexprs", [])}
        self.cache = {}
        self.fast = hasattr(triton, "knobs") and not getattr(fn, "pre_run_hooks", None)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    @staticmethod
    def _spec(v):
        if isinstance(v, torch.Tensor):
            return (v.dtype, v.data_ptr() % 16 == 0)
        if isinstance(v, bool) or not isinstance(v, int):
            return (type(v), v)
        return (v == 0, v == 1, v % 16 == 0, -(2**31) <= v < 2**31)

    def launch(self, grid, args, kwargs):
        like = args[0]
        if not (self.fast and like.is_cuda):
            return self.fn[grid](*args, **kwargs)
        try:
            opts = tuple((k, kwargs[k]) for k in self._OPTIONS if k in kwargs)
            vals = list(args) + [kwargs[n] for n in self.names[len(args) :]]
            key = (
                like.device.index,
                opts,
                tuple(v if n in self.constexpr else self._spec(v) for n, v in zip(self.names, vals)),
            )
            knobs = triton.knobs.runtime
            hooks = (knobs.launch_enter_hook, knobs.launch_exit_hook)
        except Exception:  # noqa: BLE001 (an argument list or a Triton this path does not know)
            self.fast = False
            return self.fn[grid](*args, **kwargs)
        k = self.cache.get(key)
        if k is None:
            k = self.fn[grid](*args, **kwargs)
            if k is not None and not hasattr(k, "result"):  # a compiled kernel, not a compile still running
                self.cache[key] = k
            return k
        g = tuple(grid) + (1, 1)
        stream = _raw_stream(like.device.index)
        k.run(
            g[0],
            g[1],
            g[2],
            stream,
            k.function,
            k.packed_metadata,
            k.launch_metadata(g[:3], stream, *vals),
            hooks[0],
            hooks[1],
            *vals,
        )
        return k


_KERNELS = {
    name: _Launcher(triton.jit(fn))
    for name, fn in (
        ("gather", _gather_rows),
        ("gather_tokens", _gather_tokens),
        ("dest", _dest_rows),
        ("scatter", _scatter_rows),
        ("wgrad", _wgrad_rows),
        ("wgrad_tokens", _wgrad_tokens),
    )
}


def _kernel(name, like):
    if not like.is_cuda and not _interpreting():
        raise RuntimeError(
            "padmoe.triton on CPU tensors runs in Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported (it also interprets Triton's own library functions)"
        )
    return _KERNELS[name]


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_INDEX_ROWS = 256  # sorted positions a step of the index-only dest-rows pass (12 bytes a row of buffer)

# The pass each target runs for gather and wgrad: "sorted" is the Ascend design's (a program over sorted
# positions, each row read once per copy), "tokens" reads each token row once and writes / reads its
# K rows through dest_rows (docs/spec.md §16: the floor needs the inverse map). Scatter is always the
# dest-rows pass then the token pass.
_DEFAULT_PASS = {"ascend-a2": "sorted", "cpu": "sorted", "gpu": "tokens"}


def _pow2_at_most(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


@functools.lru_cache(maxsize=256)
def _planned(op: str, hidden: int, dtype_name: str, target: str, cores: int) -> dict:
    c = dict(padmoe.tile_config(target, op, hidden, dtype_name, cores))
    c["sub_block_rows"] = max(1, _pow2_at_most(int(c["sub_block_rows"])))
    c["block_x"] = max(16, _pow2_at_most(int(c["block_x"])))
    c["target"] = target
    c["pass"] = _DEFAULT_PASS.get(target, "sorted")
    return c


@functools.lru_cache(maxsize=16)
def _device_cores(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def tile_config(
    op: str,
    hidden: int,
    dtype: torch.dtype,
    target: Optional[str] = None,
    cores: int = 0,
    device: Optional[torch.device] = None,
) -> dict:
    """padmoe's tile planner (``padmoe.tile_config``) for this op, as the kernels launch it.

    ``target`` None: ``"gpu"`` for CUDA tensors (``cores`` = the device's SM count, queried at run
    time), ``"ascend-a2"`` otherwise (the interpreter runs the NPU's configuration; 48 vector cores
    unless ``cores`` is given). Triton's block shapes must be powers of two, so ``sub_block_rows`` and
    ``block_x`` are rounded down to one (``block_x`` at least 16: 32 bytes of 16-bit rows), which keeps
    the planner's buffer budget. ``pass`` says which pass gather and wgrad run (see ``_DEFAULT_PASS``)."""
    return dict(_tile_config(op, hidden, dtype, target, cores, device))  # a copy: the cached one stays as planned


def _tile_config(op, hidden, dtype, target, cores, device) -> dict:
    dev = torch.device(device) if device is not None else None
    if target is None:
        target = "gpu" if dev is not None and dev.type == "cuda" else "ascend-a2"
    if target == "gpu" and cores <= 0 and dev is not None and dev.type == "cuda":
        cores = _device_cores(dev.index if dev.index is not None else torch.cuda.current_device())
    return _planned(op, int(hidden), _DTYPE_NAMES.get(dtype, "float32"), target, int(cores))


def _config(op, like, config):
    # the kernels only read the configuration: the cached dict, no copy per call
    return _tile_config(op, like.shape[1], like.dtype, None, 0, like.device) if config is None else config


def _opts(c, like):
    # num_warps (a GPU launch option) only when the config names it
    return {"num_warps": int(c["num_warps"])} if like.is_cuda and "num_warps" in c else {}


def _check(op, x, indices, bin_ids, bins, padded_bins, top_k, weights):
    # Every argument through padmoe's own checks on column-less stand-ins: nothing is moved, and
    # bad input raises padmoe's ValueError / TypeError before any kernel runs.
    stand_in = torch.empty(x.shape[0], 0, dtype=torch.float32, device=x.device)
    w = None if weights is None else weights.reshape(-1).to(torch.float32)
    if op == "scatter":
        padmoe.padded_scatter(stand_in, indices, bin_ids, w, bins, padded_bins, top_k)
    else:
        padmoe.padded_gather(stand_in, indices, bin_ids, bins, padded_bins, top_k, w)


def _i32(t):
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _dest(c, A, idx, bid, b, pb, like):
    """dest_rows[a] (the inverse map) from the sorted-position pass, int32 [A]."""
    dest = torch.empty(A, dtype=torch.int32, device=like.device)
    programs = max(1, min(int(c["programs"]), -(-A // _INDEX_ROWS)))
    _kernel("dest", like)[(programs,)](dest, idx, bid, b, pb, A, -(-A // programs), SUB=_INDEX_ROWS)
    return dest


def padded_gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
    weights: Optional[torch.Tensor] = None,
    *,
    config: Optional[dict] = None,
    check: bool = True,
    padded_rows: Optional[int] = None,
) -> torch.Tensor:
    """MegaBlocks ``padded_gather`` in the Ascend design: ``y[P, H]`` (P = padded_bins[-1], read on the
    host unless ``padded_rows`` gives it), real rows gathered (times ``weights[indices[i]]`` when
    given), padding rows zero. ``check=False`` skips padmoe's argument checks (a device
    synchronization on CUDA); with ``check=False`` and ``padded_rows`` the call does not synchronize."""
    if check:
        _check("gather", x, indices, bin_ids, bins, padded_bins, top_k, weights)
    x = x.contiguous()
    A, H, K = int(indices.shape[0]), int(x.shape[1]), int(top_k)
    E = int(bins.shape[0])
    if padded_rows is not None:
        P = int(padded_rows)
        if check and E > 0:
            actual = int(padded_bins[-1])
            if P != actual:
                raise ValueError(f"padded_gather: padded_rows: {P} is not padded_bins[-1] = {actual}")
    else:
        P = int(padded_bins[-1]) if E > 0 else 0
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    if P == 0 or H == 0:
        return y
    c = _config("gather", x, config)
    w = x if weights is None else weights.reshape(-1).contiguous()
    idx, bid, b, pb = _i32(indices), _i32(bin_ids), _i32(bins), _i32(padded_bins)
    # programs [0, main) move the rows; programs [main, main + zero) zero the NP = P - A padding rows
    NP = max(0, P - A)
    sub = int(c["sub_block_rows"])
    zero = min(int(c["programs"]), -(-NP // sub)) if NP > 0 else 0
    ZB = -(-NP // zero) if zero else 0
    pad = dict(
        E=E,
        NP=NP,
        ZB=ZB,
        SUB=sub,
        BLOCK_X=c["block_x"],
        WEIGHTED=weights is not None,
        LOG_E=max(1, E.bit_length()),
        **_opts(c, x),
    )
    if c.get("pass", "sorted") == "tokens":
        dest = _dest(c, A, idx, bid, b, pb, x) if A > 0 else idx
        T = A // K
        main = max(1, min(int(c["programs"]), T)) if T > 0 else 0
        _kernel("gather_tokens", x)[(main + zero,)](
            x, y, w, dest, b, pb, T, H, K, -(-T // main) if main else 0, NMAIN=main, **pad
        )
    else:
        main = max(1, min(int(c["programs"]), A)) if A > 0 else 0
        _kernel("gather", x)[(main + zero,)](
            x, y, w, idx, bid, b, pb, A, H, K, -(-A // main) if main else 0, NMAIN=main, **pad
        )
    return y


def padded_scatter(
    y: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: Optional[torch.Tensor],
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
    *,
    config: Optional[dict] = None,
    check: bool = True,
) -> torch.Tensor:
    """MegaBlocks ``padded_scatter``: ``out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]]`` in float32,
    ascending k, cast once; padding rows of ``y`` never read."""
    if check:
        _check("scatter", y, indices, bin_ids, bins, padded_bins, top_k, weights)
    y = y.contiguous()
    A, H, K = int(indices.shape[0]), int(y.shape[1]), int(top_k)
    T = A // K
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if A == 0 or H == 0:
        return out
    c = _config("scatter", y, config)
    dest = _dest(c, A, _i32(indices), _i32(bin_ids), _i32(bins), _i32(padded_bins), y)
    programs = max(1, min(int(c["programs"]), T))
    w = y if weights is None else weights.reshape(-1).contiguous()
    _kernel("scatter", y)[(programs,)](
        y,
        out,
        w,
        dest,
        T,
        H,
        K,
        -(-T // programs),
        SUB=c["sub_block_rows"],
        BLOCK_X=c["block_x"],
        WEIGHTED=weights is not None,
        **_opts(c, y),
    )
    return out


def padded_scatter_wgrad(
    y: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
    *,
    config: Optional[dict] = None,
    check: bool = True,
) -> torch.Tensor:
    """MegaBlocks ``padded_scatter_wgrad``: ``wgrad[a] = sum_h y[dest_rows[a], h] * grad[a // K, h]``,
    float32 accumulation, in y's dtype. The sorted-position pass (``sub_block_rows`` 1 when H > block_x, the
    planner's rule) or the token pass (``grad`` rows read once), as the configuration says."""
    if check:
        try:
            _check("scatter", y, indices, bin_ids, bins, padded_bins, top_k, None)  # y: at least P rows
        except (ValueError, TypeError) as e:  # the same checks, named for this op
            raise type(e)(str(e).replace("padded_scatter:", "padded_scatter_wgrad:", 1)) from None
        A, K = int(indices.shape[0]), int(top_k)
        want = (A // K, int(y.shape[1]))
        if grad.dim() != 2 or tuple(grad.shape) != want or grad.device != y.device:
            raise ValueError(
                f"padded_scatter_wgrad: grad: expected shape {list(want)} on {y.device}, got "
                f"{list(grad.shape)} on {grad.device}"
            )
    y, grad = y.contiguous(), grad.contiguous()
    A, H, K = int(indices.shape[0]), int(y.shape[1]), int(top_k)
    if A == 0 or H == 0:
        return torch.zeros(A, dtype=y.dtype, device=y.device)
    wgrad = torch.empty(A, dtype=y.dtype, device=y.device)  # every entry written once (indices: a permutation)
    c = _config("wgrad", y, config)
    idx, bid, b, pb = _i32(indices), _i32(bin_ids), _i32(bins), _i32(padded_bins)
    if c.get("pass", "sorted") == "tokens":
        dest = _dest(c, A, idx, bid, b, pb, y)
        T = A // K
        programs = max(1, min(int(c["programs"]), T))
        _kernel("wgrad_tokens", y)[(programs,)](
            y,
            grad,
            wgrad,
            dest,
            T,
            H,
            K,
            -(-T // programs),
            SUB=c["sub_block_rows"],
            BLOCK_X=c["block_x"],
            KP=triton.next_power_of_2(K),
            **_opts(c, y),
        )
    else:
        programs = max(1, min(int(c["programs"]), A))
        _kernel("wgrad", y)[(programs,)](
            y,
            grad,
            wgrad,
            idx,
            bid,
            b,
            pb,
            A,
            H,
            K,
            -(-A // programs),
            SUB=c["sub_block_rows"],
            BLOCK_X=c["block_x"],
            **_opts(c, y),
        )
    return wgrad


# ---------------------------------------------------------------------------
# autograd (padmoe.torch's drop-ins with backend="triton"): docs/spec.md §9's backward rules
# ---------------------------------------------------------------------------


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, bin_ids, bins, padded_bins, top_k, weights, check):
        ctx.save_for_backward(x, indices, bin_ids, bins, padded_bins, weights)
        ctx.top_k = top_k
        return padded_gather(x, indices, bin_ids, bins, padded_bins, top_k, weights, check=check)

    @staticmethod
    def backward(ctx, grad_y):
        x, indices, bin_ids, bins, padded_bins, weights = ctx.saved_tensors
        k = ctx.top_k
        # grad_x[t] = sum_k w * grad_y[row]; grad_w[a] = <grad_y[row(a)], x[a // K]>
        # the forward checked the routing arrays (when asked): the backward does not again
        gx = None
        if ctx.needs_input_grad[0]:
            gx = padded_scatter(grad_y, indices, bin_ids, weights, bins, padded_bins, k, check=False)
        gw = None
        if weights is not None and ctx.needs_input_grad[6]:
            gw = padded_scatter_wgrad(grad_y, x, indices, bin_ids, bins, padded_bins, k, check=False).to(weights.dtype)
            gw = gw.view(weights.shape)
        return gx, None, None, None, None, None, gw, None


class _ScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, indices, bin_ids, weights, bins, padded_bins, top_k, check):
        ctx.save_for_backward(y, indices, bin_ids, weights, bins, padded_bins)
        ctx.top_k = top_k
        return padded_scatter(y, indices, bin_ids, weights, bins, padded_bins, top_k, check=check)

    @staticmethod
    def backward(ctx, grad_out):
        y, indices, bin_ids, weights, bins, padded_bins = ctx.saved_tensors
        k = ctx.top_k
        grad_out = grad_out.contiguous()
        # grad_y = gather(grad_out, weights) into y's rows (padding rows zero); grad_w = wgrad(y, grad_out)
        gy = None
        if ctx.needs_input_grad[0]:
            g = padded_gather(grad_out, indices, bin_ids, bins, padded_bins, k, weights, check=False)
            gy = g if g.shape[0] == y.shape[0] else torch.cat([g, g.new_zeros(y.shape[0] - g.shape[0], g.shape[1])])
        gw = None
        if weights is not None and ctx.needs_input_grad[3]:
            gw = padded_scatter_wgrad(y, grad_out, indices, bin_ids, bins, padded_bins, k, check=False)
            gw = gw.to(weights.dtype).view(weights.shape)
        return gy, None, None, gw, None, None, None, None


def gather_autograd(x, indices, bin_ids, bins, padded_bins, top_k, weights=None, check=True):
    """padded_gather through autograd (backward: padmoe.triton's scatter and wgrad)."""
    return _GatherFn.apply(x, indices, bin_ids, bins, padded_bins, int(top_k), weights, bool(check))


def scatter_autograd(y, indices, bin_ids, weights, bins, padded_bins, top_k, check=True):
    """padded_scatter through autograd (backward: padmoe.triton's gather and wgrad)."""
    return _ScatterFn.apply(y, indices, bin_ids, weights, bins, padded_bins, int(top_k), bool(check))
