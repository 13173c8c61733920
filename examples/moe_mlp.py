"""A complete Mixture-of-Experts MLP layer on padmoe's padded routing, checked against a dense reference.

Data flow of :class:`MoEMLP` (T tokens, hidden size H, E experts, top-k K, alignment m):

1. **router**: ``logits = x @ W_router^T`` (float32), ``probs = softmax(logits)``,
   ``(w, top_experts) = topk(probs, K)``, ``w /= w.sum(-1)`` (renormalized top-k weights).
2. **plan**: ``plan = make_plan(top_experts, E, m)``: the assignments ``a = t*K + k`` sorted by
   expert; expert ``e`` owns the padded segment ``[padded_bins[e-1], padded_bins[e])`` whose length
   is its token count rounded up to a multiple of m; ``P = padded_bins[-1]`` rows in all.
3. **dispatch**: ``xs = dispatch(x, plan)``: ``[rows >= P, H]`` in expert order; row
   ``dest_rows[a]`` holds ``x[a // K]``. Padding rows (the tail of each segment, and every row at
   or past P) are **zero**.
4. **expert MLPs, grouped GEMM**: ``h = grouped_mm(xs, W_in, offs=padded_bins)`` (one GEMM per
   segment; ``offs`` are the int32 cumulative segment ends, i.e. exactly ``plan.padded_bins``),
   ``a = silu(h_gate) * h_up`` (SwiGLU; ``--activation gelu`` gives a plain GELU MLP),
   ``ys = grouped_mm(a, W_out, offs=padded_bins)``. ``torch.nn.functional.grouped_mm`` (or
   ``torch._grouped_mm``) needs CUDA and bfloat16; elsewhere (CPU, float32) the same math runs as
   a loop of one matmul per padded segment. The alignment m is what keeps every segment's start a
   multiple of m rows, the layout grouped-GEMM kernels like best.
5. **combine**: ``out[t] = sum_k w[t, k] * ys[dest_rows[t*K + k]]``. It reads only the rows of real
   assignments, so the GEMM output rows of padding rows (zero anyway, since the layer has no
   biases and SwiGLU / GELU map 0 to 0, but possibly uninitialized past P) are never read.

Backward runs through autograd: combine's backward yields the gradient of ``ys`` (zero in padding
rows) and of the router weights ``w`` (hence of the router), the GEMMs' backward the expert weight
gradients, and dispatch's backward sums the K copies' gradients back into ``x``.

Ops used: ``padmoe.torch.make_plan / dispatch / combine`` (autograd-enabled) when ``padmoe.torch``
exists; otherwise a small local shim (``torch.autograd.Function`` over the framework-neutral
``padmoe.dispatch``, ``padmoe.combine``, ``padmoe.combine_backward``, ``padmoe.dispatch_backward``).
``--ops`` forces one of them; the chosen path is printed.

The dense reference (:func:`dense_reference`) computes the same layer in float64 on the CPU without
padmoe or padding: plain per-token loops (for each token, the sum over its top-k experts of
``w_k * expert_k(x_t)``) up to 256 tokens, dense [T, E] weight masks beyond.
``main()`` runs forward and backward, compares the output and the gradients of x, the router weight
and both expert weights with the reference (max abs / relative error, asserted within a tolerance
per dtype) and prints a timing of forward + backward (not part of the check)::

    python examples/moe_mlp.py                               # CPU, float32, small sizes
    python examples/moe_mlp.py --device cuda --dtype bfloat16 --tokens 4096 --hidden 1024 \\
        --ffn 2048 --experts 16 --top-k 2 --alignment 128   # grouped_mm path
"""

from __future__ import annotations

import argparse
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

import padmoe

# ---------------------------------------------------------------------------
# Routing ops: padmoe.torch when it exists, else a local autograd shim
# ---------------------------------------------------------------------------


def _zero_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.zeros(rows, like.shape[1], dtype=like.dtype, device=like.device)


class _DispatchFn(torch.autograd.Function):
    """y = dispatch(x, plan, weights) with capacity rows (rows at or past P zero)."""

    @staticmethod
    def forward(ctx, x, weights, plan):
        x_ = x.detach().contiguous()
        w_ = None if weights is None else weights.detach().contiguous()
        y = padmoe.dispatch(x_, plan, w_, out=_zero_rows(x_, plan.padded_rows_bound))
        ctx.plan = plan
        ctx.save_for_backward(x_, w_)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_, w_ = ctx.saved_tensors
        grad_x, grad_w = padmoe.dispatch_backward(grad_y.detach().contiguous(), x_, ctx.plan, w_)
        return grad_x, grad_w, None


class _CombineFn(torch.autograd.Function):
    """out = combine(y, plan, weights): [T, H]; differentiable wrt y and weights."""

    @staticmethod
    def forward(ctx, y, weights, plan):
        y_ = y.detach().contiguous()
        w_ = None if weights is None else weights.detach().contiguous()
        out = padmoe.combine(y_, plan, w_)
        ctx.plan = plan
        ctx.rows = int(y_.shape[0])
        ctx.save_for_backward(y_, w_)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        y_, w_ = ctx.saved_tensors
        grad_w_out = None if w_ is None else torch.empty_like(w_)
        # y's row count (>= P) without reading P: a zeroed buffer, so rows the op leaves
        # unwritten (padding rows past P) stay zero. The rows inside [0, P) are all written.
        grad_y, grad_w = padmoe.combine_backward(
            grad_out.detach().contiguous(), y_, ctx.plan, w_, out=(_zero_rows(y_, ctx.rows), grad_w_out)
        )
        return grad_y, grad_w, None


def _shim_make_plan(top_experts, num_experts, alignment):
    return padmoe.make_plan(top_experts, num_experts, alignment)


def _shim_dispatch(x, plan, weights=None):
    return _DispatchFn.apply(x, weights, plan)


def _shim_combine(y, plan, weights=None):
    return _CombineFn.apply(y, weights, plan)


@dataclass
class RoutingOps:
    make_plan: Callable
    dispatch: Callable
    combine: Callable
    name: str


def routing_ops(which: str = "auto") -> RoutingOps:
    """``which``: "auto" (padmoe.torch if it imports and has make_plan/dispatch/combine, else the
    shim), "padmoe.torch" or "shim"."""
    if which in ("auto", "padmoe.torch"):
        try:
            import padmoe.torch as pt  # noqa: WPS433 (optional module)

            if all(hasattr(pt, n) for n in ("make_plan", "dispatch", "combine")):
                return RoutingOps(pt.make_plan, pt.dispatch, pt.combine, "padmoe.torch")
            reason = "padmoe.torch lacks make_plan/dispatch/combine"
        except ImportError as e:
            reason = f"padmoe.torch does not import ({e})"
        if which == "padmoe.torch":
            raise RuntimeError(reason)
    elif which == "shim":
        reason = "asked for"
    else:
        raise ValueError(f"ops: expected auto, padmoe.torch or shim, got {which!r}")
    return RoutingOps(
        _shim_make_plan,
        _shim_dispatch,
        _shim_combine,
        "local shim: torch.autograd.Function over padmoe.dispatch/combine/combine_backward/"
        f"dispatch_backward ({reason})",
    )


# ---------------------------------------------------------------------------
# Expert GEMM: grouped_mm over the padded segments, or a per-segment loop
# ---------------------------------------------------------------------------


def _grouped_mm_fn() -> Optional[Callable]:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    try:
        params = inspect.signature(fn).parameters
        if "offs" not in params:
            return None
    except (TypeError, ValueError):
        pass  # builtins without a signature (torch._grouped_mm): try it and fall back on error
    return fn


def grouped_mm_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return _grouped_mm_fn() is not None and torch.device(device).type == "cuda" and dtype == torch.bfloat16


def segment_loop_mm(a: torch.Tensor, w: torch.Tensor, padded_bins: torch.Tensor) -> torch.Tensor:
    """out[s:e] = a[s:e] @ w[g] for each padded segment g = [padded_bins[g-1], padded_bins[g]);
    rows at or past P are zero. Reads padded_bins on the host (one sync on a GPU)."""
    ends = [int(v) for v in padded_bins.tolist()]
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            pieces.append(a[start:end] @ w[g])
        start = end
    if a.shape[0] > start:
        pieces.append(a.new_zeros(a.shape[0] - start, w.shape[-1]))
    if not pieces:
        return a.new_zeros(0, w.shape[-1])
    return torch.cat(pieces, dim=0)


class ExpertGemm:
    """``a[rows, K] x w[E, K, N] -> [rows, N]`` segment by segment (offs = plan.padded_bins).
    mode "auto" uses grouped_mm where usable (CUDA + bf16) and falls back to the loop if it raises."""

    def __init__(self, mode: str = "auto"):
        if mode not in ("auto", "grouped_mm", "loop"):
            raise ValueError(f"gemm: expected auto, grouped_mm or loop, got {mode!r}")
        self.mode = mode
        self.used = set()
        self.fallback_reason: Optional[str] = None

    def __call__(self, a: torch.Tensor, w: torch.Tensor, padded_bins: torch.Tensor) -> torch.Tensor:
        want_grouped = self.mode == "grouped_mm" or (
            self.mode == "auto" and self.fallback_reason is None and grouped_mm_usable(a.device, a.dtype)
        )
        if want_grouped:
            fn = _grouped_mm_fn()
            try:
                if fn is None:
                    raise RuntimeError("no torch.nn.functional.grouped_mm / torch._grouped_mm with offs=")
                out = fn(a, w, offs=padded_bins.to(torch.int32))
                self.used.add("grouped_mm")
                return out
            except Exception as e:  # noqa: BLE001 (any failure: fall back, unless forced)
                if self.mode == "grouped_mm":
                    raise
                self.fallback_reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.used.add("loop")
        return segment_loop_mm(a, w, padded_bins)

    def describe(self) -> str:
        s = "+".join(sorted(self.used)) or "none"
        if self.fallback_reason:
            s += f" (grouped_mm failed, fell back: {self.fallback_reason})"
        return s


# ---------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------


class MoEMLP(nn.Module):
    """Top-k routed MoE MLP: router -> plan -> dispatch -> expert GEMMs -> combine.

    Parameters: ``router.weight [E, H]``, ``w_in [E, H, 2F]`` (SwiGLU: gate then up) or
    ``[E, H, F]`` (GELU), ``w_out [E, F, H]``; expert weights are stored [in, out] so that
    they are grouped_mm's ``mat_b`` ``(groups, K, N)`` as they are.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        alignment: int = 16,
        activation: str = "swiglu",
        ops="auto",
        gemm: str = "auto",
    ):
        super().__init__()
        if activation not in ("swiglu", "gelu"):
            raise ValueError(f"activation: expected swiglu or gelu, got {activation!r}")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.alignment, self.activation = alignment, activation
        self.router = nn.Linear(hidden, num_experts, bias=False)
        width = 2 * ffn if activation == "swiglu" else ffn
        self.w_in = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.w_out = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        nn.init.normal_(self.w_in, std=1.0 / math.sqrt(hidden))
        nn.init.normal_(self.w_out, std=1.0 / math.sqrt(ffn))
        self.ops = ops if isinstance(ops, RoutingOps) else routing_ops(ops)
        self.gemm = ExpertGemm(gemm)
        self.last_top_experts: Optional[torch.Tensor] = None

    def route(self, x: torch.Tensor):
        """(renormalized top-k weights [T, K] float32, expert ids [T, K] int64); the router runs in float32."""
        logits = F.linear(x.float(), self.router.weight.float())
        probs = torch.softmax(logits, dim=-1)
        w, top = torch.topk(probs, self.top_k, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, top = self.route(x)
        self.last_top_experts = top.detach()
        plan = self.ops.make_plan(top.to(torch.int32), self.num_experts, self.alignment)
        xs = self.ops.dispatch(x, plan)  # [rows >= P, H], expert order, padding rows zero
        offs = plan.padded_bins  # int32 cumulative segment ends: the grouped GEMM's offsets
        h = self.gemm(xs, self.w_in, offs)
        if self.activation == "swiglu":
            gate, up = h.split(self.ffn, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(h)
        ys = self.gemm(a, self.w_out, offs)  # padding rows' outputs are never read below
        return self.ops.combine(ys, plan, w.reshape(-1))  # [T, H]: sum_k w[t, k] * ys[dest_rows[t*K+k]]


# ---------------------------------------------------------------------------
# Dense float64 reference
# ---------------------------------------------------------------------------


def _expert_ref(xe, w_in_e, w_out_e, activation):
    h = xe @ w_in_e
    if activation == "swiglu":
        gate, up = h.split(w_out_e.shape[0], dim=-1)
        return (F.silu(gate) * up) @ w_out_e
    return F.gelu(h) @ w_out_e


def dense_reference(x, router_w, w_in, w_out, grad_out, top_k, activation="swiglu", top_experts=None, method="auto"):
    """The same layer in float64 on the CPU, no padmoe, no padding. Returns (out, grads, top):
    out [T, H], the grads of x, router weight, w_in, w_out for the loss ``sum(out * grad_out)``,
    and the routing used ``top`` [T, K] (the reference's own float64 top-k unless ``top_experts``).

    method "loop": plain per-token loops, ``out[t] = sum_k w_k * expert_k(x[t])``; "masks": one
    dense [T, E] matrix of combine weights (zero where an expert is not chosen) and, per expert,
    the tokens its mask selects (fast enough for large T); "auto": loop up to 256 tokens."""
    if method == "auto":
        method = "loop" if x.shape[0] <= 256 else "masks"
    f64 = lambda t: t.detach().to("cpu", torch.float64).clone().requires_grad_(True)  # noqa: E731
    x, router_w, w_in, w_out = f64(x), f64(router_w), f64(w_in), f64(w_out)
    num_tokens, num_experts = x.shape[0], w_in.shape[0]
    probs = torch.softmax(x @ router_w.t(), dim=-1)
    if top_experts is None:
        top = torch.topk(probs.detach(), top_k, dim=-1).indices
    else:
        top = top_experts.detach().to("cpu", torch.long)
    if method == "loop":
        rows = []
        for t in range(num_tokens):
            chosen = [int(e) for e in top[t]]
            norm = sum(probs[t, e] for e in chosen)
            acc = torch.zeros(x.shape[1], dtype=torch.float64)
            for e in chosen:
                acc = acc + (probs[t, e] / norm) * _expert_ref(x[t : t + 1], w_in[e], w_out[e], activation)[0]
            rows.append(acc)
        out = torch.stack(rows)
    elif method == "masks":
        chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
        masked = probs * chosen
        coef = masked / masked.sum(dim=-1, keepdim=True)  # [T, E] renormalized top-k weights, else 0
        out = torch.zeros_like(x)
        for e in range(num_experts):
            tokens = chosen[:, e].nonzero().squeeze(1)
            if tokens.numel():
                ye = _expert_ref(x[tokens], w_in[e], w_out[e], activation)
                out = out.index_add(0, tokens, coef[tokens, e : e + 1] * ye)
    else:
        raise ValueError(f"method: expected auto, loop or masks, got {method!r}")
    (out * grad_out.detach().to("cpu", torch.float64)).sum().backward()
    grads = {"x": x.grad, "router.weight": router_w.grad, "w_in": w_in.grad, "w_out": w_out.grad}
    return out.detach(), grads, top


# ---------------------------------------------------------------------------
# Check against the reference
# ---------------------------------------------------------------------------

# max |got - ref| / max |ref| allowed, per dtype (forward and every gradient; see CheckResult.passes).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class CheckResult:
    ops: str
    gemm: str
    tolerance: float
    errors: Dict[str, Dict[str, float]] = field(default_factory=dict)  # name -> {max_abs, rel}
    routing_mismatch_tokens: int = 0

    def passes(self, name: str) -> bool:
        """max_abs <= tol * max|ref| + tol * 1e-2: relative, with a small absolute floor for
        gradients that are zero in exact arithmetic (the router's with top_k = 1)."""
        e = self.errors[name]
        return e["max_abs"] <= self.tolerance * (e["scale"] + 1e-2)

    @property
    def ok(self) -> bool:
        return all(self.passes(name) for name in self.errors)

    def report(self) -> str:
        lines = [f"routing ops: {self.ops}", f"expert GEMM: {self.gemm}"]
        if self.routing_mismatch_tokens:
            lines.append(
                f"note: {self.routing_mismatch_tokens} token(s) with a near-tie top-k choice; "
                "the reference used the layer's choice there"
            )
        for name, e in self.errors.items():
            flag = "ok" if self.passes(name) else "FAIL"
            lines.append(
                f"  {name:14s} max_abs={e['max_abs']:.3e}  rel={e['rel']:.3e}  (tol {self.tolerance:.0e}) {flag}"
            )
        return "\n".join(lines)

    def assert_ok(self):
        assert self.ok, "MoE MLP does not match the float64 dense reference:\n" + self.report()


def _error(got: Optional[torch.Tensor], ref: torch.Tensor) -> Dict[str, float]:
    if got is None:  # no gradient reached this tensor
        got = torch.zeros_like(ref)
    diff = (got.detach().to("cpu", torch.float64) - ref).abs().max().item()
    scale = ref.abs().max().item()
    return {"max_abs": diff, "rel": diff / scale if scale > 0 else (math.inf if diff > 0 else 0.0), "scale": scale}


def make_inputs(tokens, hidden, device, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_(True)
    grad_out = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    return x, grad_out


def check(
    device="cpu",
    dtype=torch.float32,
    tokens=64,
    hidden=32,
    ffn=48,
    experts=8,
    top_k=2,
    alignment=16,
    seed=0,
    activation="swiglu",
    ops="auto",
    gemm="auto",
) -> CheckResult:
    """Build the layer, run forward + backward, and measure the errors against dense_reference."""
    torch.manual_seed(seed)
    model = MoEMLP(hidden, ffn, experts, top_k, alignment, activation, ops=ops, gemm=gemm).to(device, dtype)
    x, grad_out = make_inputs(tokens, hidden, device, dtype, seed)
    out = model(x)
    out.backward(grad_out)

    params = (x, model.router.weight, model.w_in, model.w_out)
    ref_out, ref_grads, ref_top = dense_reference(*params, grad_out, top_k, activation)
    # The same expert set per token (order within the top-k does not matter).
    mine = model.last_top_experts.to("cpu").sort(dim=-1).values
    mismatch = int((mine != ref_top.sort(dim=-1).values).any(dim=-1).sum())
    if mismatch:  # near-ties in the router: use the layer's routing (top-k selection has no gradient)
        ref_out, ref_grads, _ = dense_reference(
            *params, grad_out, top_k, activation, top_experts=model.last_top_experts
        )

    result = CheckResult(model.ops.name, model.gemm.describe(), TOLERANCE[dtype], routing_mismatch_tokens=mismatch)
    result.errors["out"] = _error(out, ref_out)
    result.errors["grad x"] = _error(x.grad, ref_grads["x"])
    result.errors["grad router"] = _error(model.router.weight.grad, ref_grads["router.weight"])
    result.errors["grad w_in"] = _error(model.w_in.grad, ref_grads["w_in"])
    result.errors["grad w_out"] = _error(model.w_out.grad, ref_grads["w_out"])
    result.model = model  # for timing
    return result


def time_forward_backward(model, tokens, device, dtype, seed, iters=10, warmup=3) -> float:
    """Mean seconds of one forward + backward (not part of the check)."""
    x, grad_out = make_inputs(tokens, model.hidden, device, dtype, seed)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for i in range(warmup + iters):
        if i == warmup:
            sync()
            start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        x.grad = None
        model(x).backward(grad_out)
    sync()
    return (time.perf_counter() - start) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=48)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--alignment", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--activation", default="swiglu", choices=["swiglu", "gelu"])
    p.add_argument("--ops", default="auto", choices=["auto", "padmoe.torch", "shim"])
    p.add_argument("--gemm", default="auto", choices=["auto", "grouped_mm", "loop"])
    p.add_argument("--iters", type=int, default=10, help="timed forward+backward iterations")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]

    print(
        f"MoE MLP: T={args.tokens} H={args.hidden} F={args.ffn} E={args.experts} K={args.top_k} "
        f"m={args.alignment} {args.activation} {args.dtype} on {args.device}"
    )
    result = check(
        args.device,
        dtype,
        args.tokens,
        args.hidden,
        args.ffn,
        args.experts,
        args.top_k,
        args.alignment,
        args.seed,
        args.activation,
        args.ops,
        args.gemm,
    )
    print(result.report())
    result.assert_ok()
    print("check: ok")
    if args.iters > 0:
        secs = time_forward_backward(result.model, args.tokens, args.device, dtype, args.seed, iters=args.iters)
        print(
            f"forward+backward: {secs * 1e3:.3f} ms/iter (mean of {args.iters}; GEMM path "
            f"{result.model.gemm.describe()})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
