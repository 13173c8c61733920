"""A Mixture-of-Experts MLP layer built on ``padmoe.torch.GroupedExperts``, checked against a dense reference.

What a layer of your own needs (T tokens, hidden size H, E experts, top-k K)::

    probs = softmax(router(x).float())           # router: nn.Linear(H, E), softmax in float32
    w, top = probs.topk(K)                       # [T, K] weights and expert ids
    w = w / w.sum(-1, keepdim=True)              # renormalized top-k weights
    out = experts(x, top, w)                     # experts: padmoe.torch.GroupedExperts(E, H, I)

``GroupedExperts`` runs the rest as one operator: the plan (the T*K assignments sorted by expert,
each expert's segment padded to a multiple of ``alignment`` rows), dispatch (x's rows copied into
that expert-grouped buffer), the up projection as one grouped GEMM over the segments, the
activation (SwiGLU: ``silu(gate) * up``; or a plain GELU), the down projection as a second grouped
GEMM, and combine (``out[t] = sum_k w[t, k] * expert_k(x[t])``). Its backward gives the gradients
of x, of the router weights w (hence of the router) and of the expert weights. The expert weights
are ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first; ``up_proj`` ``[E, I, H]`` for GELU) and
``down_proj`` ``[E, H, I]``, the layout of transformers' experts modules.

Choosing the alignment: 16 rows (the default on CUDA; 1, no padding, on the CPU) is enough for
torch's ``grouped_mm``. 128 matches the height of the GEMM's tiles (each segment a whole number of
tiles); it costs at most ``E * (alignment - 1)`` padding rows, which matters when T*K is small.

The GEMMs are ``torch.nn.functional.grouped_mm`` where torch has a kernel for them: on CUDA sm_80 or
newer, on the CPU torch 2.9 or newer; float32, bfloat16 or float16 (under ``torch.compile``,
bfloat16 only); H and I a multiple of 16 bytes. Otherwise ``GroupedExperts`` falls back to a
loop of one matmul per expert (``gemm="loop"`` asks for it); the example prints which one runs.

The check (:func:`dense_reference`) computes the same layer in float64 on the CPU without padmoe:
plain per-token loops up to 256 tokens, dense [T, E] weight masks beyond. The output and the
gradients of x, the router and both expert weights must match it within a tolerance per dtype;
then forward + backward is timed::

    python examples/moe_mlp.py                                  # CPU, float32, small sizes
    python examples/moe_mlp.py --device cuda --dtype bfloat16 --tokens 4096 --hidden 1024 \\
        --ffn 2048 --experts 16 --top-k 2 --alignment 128
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from padmoe.torch import GroupedExperts, make_plan
from padmoe.torch.grouped import default_alignment, grouped_mm_usable

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# max |got - ref| allowed, relative to max |ref| (see Check.passes)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


class MoEMLP(nn.Module):
    """Router (top-k of a float32 softmax, renormalized) followed by E expert MLPs."""

    def __init__(self, hidden, ffn, experts, top_k, activation="swiglu", alignment=None, gemm="auto"):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        act, gated = {"swiglu": ("silu", True), "gelu": ("gelu", False)}[activation]
        self.experts = GroupedExperts(experts, hidden, ffn, activation=act, gated=gated, alignment=alignment, gemm=gemm)

    def route(self, x):
        probs = torch.softmax(self.router(x).float(), dim=-1)
        w, top = probs.topk(self.top_k, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), top

    def forward(self, x):
        w, top = self.route(x)
        return self.experts(x, top, w)


def gemm_path(experts: GroupedExperts, x: torch.Tensor) -> str:
    """Which GEMMs ``experts`` runs on rows like ``x``: torch's grouped_mm or the loop per expert."""
    if experts.gemm != "auto":
        return experts.gemm
    up = grouped_mm_usable(x, experts.up_weight.transpose(-2, -1))
    down = grouped_mm_usable(x.new_empty(0, experts.intermediate_size), experts.down_proj.transpose(-2, -1))
    up, down = ("grouped_mm" if ok else "loop" for ok in (up, down))
    return up if up == down else f"{up} (up), {down} (down)"


def dense_reference(x, router_w, up_w, down_w, grad_out, top_k, activation="swiglu", top=None, method="auto"):
    """The same layer in float64 on the CPU, no padmoe, no padding: ``(out, grads, top)`` with the
    gradients (x, router, up, down) of ``sum(out * grad_out)``. ``top``: the routing to use instead
    of the reference's own top-k. ``method``: "loop" (``out[t] = sum_k w_k * expert_k(x[t])`` per
    token), "masks" (a dense [T, E] matrix of combine weights, zero where an expert is not chosen)
    or "auto" (the loop up to 256 tokens)."""
    if method == "auto":
        method = "loop" if x.shape[0] <= 256 else "masks"
    x, router_w, up_w, down_w = (
        t.detach().to("cpu", torch.float64).requires_grad_() for t in (x, router_w, up_w, down_w)
    )
    ffn = down_w.shape[-1]

    def expert(xe, e):
        h = xe @ up_w[e].t()
        a = F.silu(h[:, :ffn]) * h[:, ffn:] if activation == "swiglu" else F.gelu(h)
        return a @ down_w[e].t()

    probs = torch.softmax(x @ router_w.t(), dim=-1)
    top = probs.detach().topk(top_k, dim=-1).indices if top is None else top.detach().to("cpu", torch.long)
    if method == "loop":
        rows = []
        for t in range(x.shape[0]):
            norm = sum(probs[t, e] for e in top[t].tolist())
            rows.append(sum(probs[t, e] / norm * expert(x[t : t + 1], e)[0] for e in top[t].tolist()))
        out = torch.stack(rows)
    elif method == "masks":
        chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top, True)
        coef = probs * chosen
        coef = coef / coef.sum(dim=-1, keepdim=True)  # [T, E]: the renormalized top-k weights, else 0
        out = torch.zeros_like(x)
        for e in range(up_w.shape[0]):
            tokens = chosen[:, e].nonzero().squeeze(1)
            if tokens.numel():
                out = out.index_add(0, tokens, coef[tokens, e : e + 1] * expert(x[tokens], e))
    else:
        raise ValueError(f"method: expected auto, loop or masks, got {method!r}")
    (out * grad_out.detach().to("cpu", torch.float64)).sum().backward()
    return out.detach(), {"x": x.grad, "router": router_w.grad, "up": up_w.grad, "down": down_w.grad}, top


@dataclass
class Check:
    """The layer's errors against the reference: ``errors[name] = (max |got - ref|, max |ref|)``."""

    model: MoEMLP
    gemm: str  # the expert GEMMs that ran (gemm_path)
    tolerance: float
    errors: dict
    near_ties: int  # tokens whose top-k set differs from the reference's (float rounding)

    def passes(self, name):
        """max_abs <= tol * (max|ref| + 1e-2): relative, with a small floor for a gradient that is
        zero in exact arithmetic (the router's with top_k = 1)."""
        diff, scale = self.errors[name]
        return diff <= self.tolerance * (scale + 1e-2)

    @property
    def ok(self):
        return all(self.passes(name) for name in self.errors)

    def report(self):
        lines = [f"expert GEMMs: {self.gemm}"]
        if self.near_ties:
            lines.append(
                f"{self.near_ties} token(s) with a near-tie in the router: the reference used the layer's top-k"
            )
        for name, (diff, scale) in self.errors.items():
            flag = "ok" if self.passes(name) else "FAIL"
            rel = diff / scale if scale else float(diff > 0)
            lines.append(f"  {name:12s} max_abs={diff:.3e}  rel={rel:.3e}  (tol {self.tolerance:.0e}) {flag}")
        return "\n".join(lines)

    def assert_ok(self):
        assert self.ok, "MoE MLP does not match the float64 dense reference:\n" + self.report()


def make_inputs(tokens, hidden, device, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    return x, torch.randn(tokens, hidden, generator=g).to(device, dtype)


def check(
    device="cpu",
    dtype=torch.float32,
    tokens=64,
    hidden=32,
    ffn=48,
    experts=8,
    top_k=2,
    alignment=None,
    activation="swiglu",
    gemm="auto",
    seed=0,
):
    """Build the layer, run forward + backward and compare with :func:`dense_reference`."""
    torch.manual_seed(seed)
    model = MoEMLP(hidden, ffn, experts, top_k, activation, alignment, gemm).to(device, dtype)
    x, grad_out = make_inputs(tokens, hidden, device, dtype, seed)
    out = model(x)
    out.backward(grad_out)

    ex = model.experts
    params = (x, model.router.weight, ex.up_weight, ex.down_proj)
    ref_out, ref_grads, ref_top = dense_reference(*params, grad_out, top_k, activation)
    with torch.no_grad():
        top = model.route(x)[1].cpu()
    # the same expert set per token? (the order within the top-k does not matter)
    near_ties = int((top.sort(-1).values != ref_top.sort(-1).values).any(-1).sum())
    if near_ties:  # the selection has no gradient: use the layer's where float rounding chose otherwise
        ref_out, ref_grads, _ = dense_reference(*params, grad_out, top_k, activation, top=top)

    def error(got, ref):
        got = torch.zeros_like(ref) if got is None else got.detach().to("cpu", torch.float64)
        return (got - ref).abs().max().item(), ref.abs().max().item()

    got = {"x": x.grad, "router": model.router.weight.grad, "up": ex.up_weight.grad, "down": ex.down_proj.grad}
    errors = {"out": error(out, ref_out)}
    errors.update({f"grad {name}": error(got[name], ref_grads[name]) for name in got})
    return Check(model, gemm_path(ex, x), TOLERANCE[dtype], errors, near_ties)


def time_forward_backward(model, x, grad_out, iters=10, warmup=3):
    """Mean seconds of one forward + backward."""
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
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
    p.add_argument("--ffn", type=int, default=48, help="the experts' intermediate size I")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--alignment", type=int, default=None, help="default: 16 on CUDA, 1 on the CPU")
    p.add_argument("--activation", default="swiglu", choices=["swiglu", "gelu"])
    p.add_argument("--gemm", default="auto", choices=["auto", "grouped_mm", "loop"])
    p.add_argument("--iters", type=int, default=10, help="timed forward + backward iterations (0: none)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    dtype = DTYPES[a.dtype]

    result = check(
        a.device, dtype, a.tokens, a.hidden, a.ffn, a.experts, a.top_k, a.alignment, a.activation, a.gemm, a.seed
    )
    model = result.model
    x, grad_out = make_inputs(a.tokens, a.hidden, a.device, dtype, a.seed)
    alignment = model.experts.alignment or default_alignment(x.device)
    with torch.no_grad():
        rows = int(make_plan(model.route(x)[1], a.experts, alignment).padded_bins[-1])
    print(
        f"MoE MLP: T={a.tokens} H={a.hidden} I={a.ffn} E={a.experts} K={a.top_k} {a.activation} "
        f"{a.dtype} on {a.device}; alignment {alignment}: {rows} rows for {a.tokens * a.top_k} assignments"
    )
    print(result.report())
    result.assert_ok()
    print("check: ok")
    if a.iters > 0:
        secs = time_forward_backward(model, x, grad_out, a.iters)
        us = f" = {secs * 1e6:.0f} µs" if x.device.type == "cuda" else ""
        print(f"forward + backward: {secs * 1e3:.3f} ms{us} per iteration (mean of {a.iters})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
