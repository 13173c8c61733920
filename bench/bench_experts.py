"""The expert MLP on padmoe's routing, per shape, in one run: the dense ``torch.mm`` rate and the copy
bandwidth (the floors); each of the six GEMMs alone (torch's ``grouped_mm`` on the same rows), the
routing ops alone and the activation alone; padmoe's expert MLP operator (``experts_forward`` with the
gate given by name, what ``GroupedExperts`` and the transformers integration run) and the autograd
composition (the same call with the gate as a callable): eager forward and forward + backward (the host
included), the forward replayed in a CUDA graph, the peak memory of forward + backward; and the operator's
forward + backward with ``recompute_rows=True``.

    python bench/bench_experts.py [--shapes qwen3-30b-a3b,mixtral-8x7b,deepseek-v3,decode] [--iters 10]
           [--json FILE]

Shapes (bf16, top-k softmax router weights, alignment 128, gated SiLU, ``[E, out, in]`` weights):
qwen3-30b-a3b T=16384 H=2048 I=768 E=128 K=8; mixtral-8x7b T=4096 H=4096 I=14336 E=8 K=2; deepseek-v3
T=4096 H=7168 I=2048 E=256 K=8; decode T=256 with deepseek-v3's sizes (forward only). The floor of a
GEMM is the larger of its FLOPs (over the real rows, A = T*K) at the dense rate and its bytes (operands
and output) at the copy bandwidth; the MLP's floor sums its GEMMs' (two forward, six forward + backward).
The sum of parts is the GEMMs alone plus the routing ops alone (make_plan, dispatch, combine; backward:
combine_backward, dispatch_backward).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from bench_te import copy_bandwidth, eager_time, graph_time  # the timing of the TE page

import padmoe.torch as pt
from padmoe.torch import _expert_mlp
from padmoe.torch._common import plan_args
from padmoe.torch._expert_mlp import KINDS, _mm, _mm_dgrad, _mm_wgrad, triton_gather_up
from padmoe.torch.grouped import Routing, experts_forward

SHAPES = {
    "qwen3-30b-a3b": dict(T=16384, H=2048, I=768, E=128, K=8, backward=True),
    "mixtral-8x7b": dict(T=4096, H=4096, I=14336, E=8, K=2, backward=True),
    "deepseek-v3": dict(T=4096, H=7168, I=2048, E=256, K=8, backward=True),
    "decode": dict(T=256, H=7168, I=2048, E=256, K=8, backward=False),
}
ALIGN = 128
GEMMS = ("up", "down", "down_dgrad", "down_wgrad", "up_dgrad", "up_wgrad")
SILU = (KINDS["silu"], True, False, 1.702, 7.0)
GATHER_CONFIG = _expert_mlp.gather_config  # the activation ops' (kind, gated, interleaved, alpha, limit)


def dense_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = eager_time(lambda: torch.mm(a, a), 10)
    return 2 * 8192**3 / (us * 1e-6)


def silu_gate(h):
    """The composition's gate: a callable, so experts_forward runs the autograd composition."""
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def gemm_floor_us(m, n, k, e, out_rows, rate, bw):
    """A (m x k) @ (k x n) over the segments: FLOPs at the dense rate or bytes (bf16 operands, the
    weight-side operand per expert, the output) at the copy bandwidth."""
    flops = 2 * m * n * k
    return max(flops / rate, 2 * (m * k + e * k * n + out_rows * n) / bw) * 1e6


def parts(s, x, idx, w, up, down, iters, rate, bw):
    """µs of each GEMM alone, the routing ops alone and the activation alone, and each GEMM's floor."""
    T, H, I, E, K = s["T"], s["H"], s["I"], s["E"], s["K"]
    A = T * K
    r = Routing.from_topk(idx, w, E, ALIGN, check=False)
    offs = r.offsets
    rows = r.dispatch(x)
    h = _mm(rows, up, offs, False)
    act, act_bwd = torch.ops.padmoe_experts.activation, torch.ops.padmoe_experts.activation_backward
    a = act(h, offs, None, None, *SILU)
    ys = _mm(a, down, offs, False)
    grad_out = torch.randn(T, H, device=x.device, dtype=x.dtype)
    grad_ys, _ = pt.combine_backward(grad_out, ys, r.plan, w)
    grad_a = _mm_dgrad(grad_ys, down, offs, False)
    grad_h, _ = act_bwd(h, grad_a, offs, None, None, *SILU)
    grad_rows = _mm_dgrad(grad_h, up, offs, False)
    calls = {
        "up": (lambda: _mm(rows, up, offs, False), (A, 2 * I, H, A)),
        "down": (lambda: _mm(a, down, offs, False), (A, H, I, A)),
        "down_dgrad": (lambda: _mm_dgrad(grad_ys, down, offs, False), (A, I, H, A)),
        "down_wgrad": (lambda: _mm_wgrad(a, grad_ys, offs, False), (H, I, A, 0)),
        "up_dgrad": (lambda: _mm_dgrad(grad_h, up, offs, False), (A, H, 2 * I, A)),
        "up_wgrad": (lambda: _mm_wgrad(rows, grad_h, offs, False), (2 * I, H, A, 0)),
    }
    out = {}
    for name, (fn, (m, n, k, out_rows)) in calls.items():
        if not s["backward"] and name not in ("up", "down"):
            continue
        if name.endswith("wgrad"):  # the output is the weight gradient [E, m, n]: m, n per expert
            floor = max(2 * m * n * k / rate, 2 * (k * m + k * n + E * m * n) / bw) * 1e6
        else:
            floor = gemm_floor_us(m, n, k, E, out_rows, rate, bw)
        out[name] = (eager_time(fn, iters), floor)

    def routing_fwd():
        rr = Routing.from_topk(idx, w, E, ALIGN, check=False)
        rr.dispatch(x, zero_padding=s["backward"])
        return rr.combine(ys)

    def routing_bwd():
        pt.combine_backward(grad_out, ys, r.plan, w)
        pt.dispatch_backward(grad_rows, x, r.plan)

    # The gather fused into the up projection (h, and with the activation fused: a) against dispatch +
    # torch's grouped GEMM (+ the activation pass).
    pk, sizes = r.plan.packed, plan_args(r.plan)
    up_floor = out["up"][1]
    out["dispatch_up"] = eager_time(lambda: _mm(r.dispatch(x, zero_padding=False), up, offs, False), iters)
    out["gather_up"] = (
        eager_time(lambda: triton_gather_up(x, pk, None, up, None, sizes, False, SILU, False, False), iters),
        up_floor,
    )
    out["dispatch_up_act"] = eager_time(
        lambda: act(_mm(r.dispatch(x, zero_padding=False), up, offs, False), offs, None, None, *SILU), iters
    )
    out["gather_up_act"] = eager_time(
        lambda: triton_gather_up(x, pk, None, up, None, sizes, False, SILU, True, False), iters
    )
    out["routing_fwd"] = eager_time(routing_fwd, iters)
    out["act_fwd"] = eager_time(lambda: act(h, offs, None, None, *SILU), iters)
    if s["backward"]:
        out["routing_bwd"] = eager_time(routing_bwd, iters)
        out["act_bwd"] = eager_time(lambda: act_bwd(h, grad_a, offs, None, None, *SILU), iters)
    return out


def run_shape(name, s, iters, rate, bw):
    T, H, I, E, K = s["T"], s["H"], s["I"], s["E"], s["K"]
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    logits = torch.randn(T, E, device=dev, generator=g)
    w, idx = logits.softmax(-1).topk(K)
    up = (torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H**-0.5).requires_grad_()
    down = (torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I**-0.5).requires_grad_()
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    row = dict(shape=name)
    with torch.no_grad():
        row["parts"] = parts(s, x, idx, w, up.detach(), down.detach(), iters, rate, bw)
    p = row["parts"]
    row["floor_fwd_us"] = p["up"][1] + p["down"][1]
    row["parts_fwd_us"] = p["up"][0] + p["down"][0] + p["routing_fwd"]
    if s["backward"]:
        row["floor_fwd_bwd_us"] = sum(p[k][1] for k in GEMMS)
        row["parts_fwd_bwd_us"] = sum(p[k][0] for k in GEMMS) + p["routing_fwd"] + p["routing_bwd"]

    forms = {
        "composition": lambda xx, ww: experts_forward(
            xx, idx, ww, up, down, gate=silu_gate, alignment=ALIGN, check=False
        ),
        "operator": lambda xx, ww: experts_forward(xx, idx, ww, up, down, gate="silu", alignment=ALIGN, check=False),
        "recompute": lambda xx, ww: experts_forward(
            xx, idx, ww, up, down, gate="silu", alignment=ALIGN, check=False, recompute_rows=True
        ),
    }
    forms["operator_dispatch"] = forms["operator"]  # the operator with dispatch + torch's GEMM only
    for form, call in forms.items():
        if form == "recompute" and not s["backward"]:
            continue
        if form == "operator_dispatch":
            _expert_mlp.gather_config = lambda *a: None

        def fwd():
            with torch.no_grad():
                return call(x, w)

        if form != "recompute":  # the same forward as the operator's
            row[f"{form}_fwd_us"] = eager_time(fwd, iters)
            row[f"{form}_graph_fwd_us"] = graph_time(fwd, 1, iters)
        if s["backward"]:

            def fwd_bwd():
                out = call(xg, wg)
                out.backward(torch.ones_like(out))
                xg.grad = wg.grad = up.grad = down.grad = None

            row[f"{form}_fwd_bwd_us"] = eager_time(fwd_bwd, max(iters // 2, 3), warm=1)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            row[f"{form}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    _expert_mlp.gather_config = GATHER_CONFIG
    return row


def fmt(r, c):
    fb = r.get(f"{c}_fwd_bwd_us")
    tail = f"{fb:.0f} ({r[f'{c}_peak_mib']:.0f})" if fb is not None else "-"
    return f"{r[f'{c}_fwd_us']:.0f} / {r[f'{c}_graph_fwd_us']:.0f} / {tail}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_experts: needs a CUDA device", file=sys.stderr)
        return 2
    rate, bw = dense_rate(), copy_bandwidth()
    print(
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"dense bf16 mm {rate / 1e12:.0f} TFLOP/s  copy {bw / 1e9:.0f} GB/s"
    )
    rows = [run_shape(n, SHAPES[n], args.iters, rate, bw) for n in args.shapes.split(",")]
    print(
        "\n| shape | floor fwd / f+b µs | parts fwd / f+b µs | composition fwd / graph fwd / f+b µs (peak MiB) "
        "| operator fwd / graph fwd / f+b µs (peak MiB) | operator over parts fwd / f+b |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        fb = r.get("floor_fwd_bwd_us")
        pfb = r.get("parts_fwd_bwd_us")
        ofb = r.get("operator_fwd_bwd_us")
        print(
            f"| {r['shape']} | {r['floor_fwd_us']:.0f} / {fb:.0f} | "
            if fb
            else f"| {r['shape']} | {r['floor_fwd_us']:.0f} / - | ",
            end="",
        )
        print(
            (f"{r['parts_fwd_us']:.0f} / {pfb:.0f} | " if pfb else f"{r['parts_fwd_us']:.0f} / - | ")
            + f"{fmt(r, 'composition')} | {fmt(r, 'operator')} | "
            + f"{r['operator_fwd_us'] / r['parts_fwd_us']:.2f}x / "
            + (f"{ofb / pfb:.2f}x |" if pfb else "- |")
        )
    recomputed = [r for r in rows if "recompute_fwd_bwd_us" in r]
    print("\nrecompute_rows=True, forward + backward µs (peak MiB): ", end="")
    print(
        ", ".join(f"{r['shape']} {r['recompute_fwd_bwd_us']:.0f} ({r['recompute_peak_mib']:.0f})" for r in recomputed)
    )
    print(
        "\n| shape | "
        + " | ".join(f"{k} µs (x floor)" for k in GEMMS)
        + " | routing fwd / bwd µs | activation fwd / bwd µs |"
    )
    print("|---|" + "---|" * (len(GEMMS) + 2))
    for r in rows:
        p = r["parts"]
        cells = [f"{p[k][0]:.0f} ({p[k][0] / p[k][1]:.2f}x)" if k in p else "-" for k in GEMMS]
        rb = f"{p['routing_bwd']:.0f}" if "routing_bwd" in p else "-"
        ab = f"{p['act_bwd']:.0f}" if "act_bwd" in p else "-"
        print(
            f"| {r['shape']} | " + " | ".join(cells) + f" | {p['routing_fwd']:.0f} / {rb} | {p['act_fwd']:.0f} / {ab} |"
        )
    print(
        "\n| shape | up: dispatch + grouped_mm µs | gather-fused µs (x floor) "
        "| up + activation: dispatch + grouped_mm + act µs | gather-fused, activation fused µs |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        p = r["parts"]
        g, fl = p["gather_up"]
        print(
            f"| {r['shape']} | {p['dispatch_up']:.0f} | {g:.0f} ({g / fl:.2f}x) | {p['dispatch_up_act']:.0f} "
            f"| {p['gather_up_act']:.0f} |"
        )
    print(
        "\noperator with dispatch + grouped_mm only, fwd / graph fwd / f+b µs: "
        + ", ".join(f"{r['shape']} {fmt(r, 'operator_dispatch')}" for r in rows)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(dense_flops=rate, copy_bytes_per_s=bw, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
