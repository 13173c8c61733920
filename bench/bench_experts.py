"""The expert MLP on padmoe's routing, per shape, in one run: the dense ``torch.mm`` rate and the copy
bandwidth (the floors), the GEMMs' FLOP floor, padmoe's expert MLP (``experts_forward``, the autograd composition)
and the one-operator variant under study (``dev/expert_mlp.py``): eager forward and forward + backward (the host
included), the forward replayed in a CUDA graph, and the peak memory of forward + backward.

    python bench/bench_experts.py [--shapes qwen3-30b-a3b,mixtral-8x7b,deepseek-v3,decode] [--iters 10]
           [--json FILE]

Shapes (bf16, top-k softmax router weights, alignment 128): qwen3-30b-a3b T=16384 H=2048 I=768
E=128 K=8; mixtral-8x7b T=4096 H=4096 I=14336 E=8 K=2; deepseek-v3 T=4096 H=7168 I=2048 E=256 K=8;
decode T=256 with deepseek-v3's sizes (forward only). The floor of the forward is its two GEMMs'
FLOPs (2*A*H*3I for a gated MLP, A = T*K) at the dense rate or its bytes (the weights read once) at
the copy bandwidth, whichever is larger; forward + backward adds four GEMMs of the same FLOPs and
twice the weights' bytes (read, gradient written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from bench_te import copy_bandwidth, eager_time, graph_time  # the timing of the TE page

import padmoe.torch  # noqa: F401  (the operators)
from padmoe.torch.grouped import Routing, experts_forward

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev"))
from expert_mlp import expert_mlp  # noqa: E402  (the one-operator variant under study, dev/)


def operator_forward(x, idx, w, up, down, alignment, check):
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w, up, down))
    r = Routing.from_topk(idx, w, up.shape[0], alignment, check=check)
    return expert_mlp(
        x,
        r,
        up,
        down,
        up_bias=None,
        down_bias=None,
        transposed=False,
        activation="silu",
        gated=True,
        interleaved=False,
        weighting="after",
        grads=grads,
    )


SHAPES = {
    "qwen3-30b-a3b": dict(T=16384, H=2048, I=768, E=128, K=8, backward=True),
    "mixtral-8x7b": dict(T=4096, H=4096, I=14336, E=8, K=2, backward=True),
    "deepseek-v3": dict(T=4096, H=7168, I=2048, E=256, K=8, backward=True),
    "decode": dict(T=256, H=7168, I=2048, E=256, K=8, backward=False),
}


def dense_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = eager_time(lambda: torch.mm(a, a), 10)
    return 2 * 8192**3 / (us * 1e-6)


def run_shape(name, s, iters, flops_rate, bandwidth):
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
    gemm_flops = 2 * T * K * H * 3 * I
    weight_bytes = (up.numel() + down.numel()) * 2
    floor_fwd = max(gemm_flops / flops_rate, weight_bytes / bandwidth) * 1e6
    floor_fb = max(3 * gemm_flops / flops_rate, 3 * weight_bytes / bandwidth) * 1e6
    row = dict(shape=name, floor_fwd_us=floor_fwd, floor_fwd_bwd_us=floor_fb)

    def composition(xx, ww):
        return experts_forward(xx, idx, ww, up, down, gate="silu", alignment=128, check=False)

    def operator(xx, ww):
        return operator_forward(xx, idx, ww, up, down, 128, False)

    for form, call in (("composition", composition), ("operator", operator)):

        def fwd():
            with torch.no_grad():
                return call(x, w)

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
    return row


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
    rows = []
    cols = ["composition", "operator"]
    print(
        "| shape | floor fwd / f+b µs | " + " | ".join(f"{c} fwd / graph fwd / f+b µs (peak MiB)" for c in cols) + " |"
    )
    print("|---|---|" + "---|" * len(cols))
    for name in args.shapes.split(","):
        r = run_shape(name, SHAPES[name], args.iters, rate, bw)
        rows.append(r)
        cells = []
        for c in cols:
            fb = r.get(f"{c}_fwd_bwd_us")
            peak = r.get(f"{c}_peak_mib")
            cells.append(
                f"{r[f'{c}_fwd_us']:.0f} / {r[f'{c}_graph_fwd_us']:.0f} / "
                + (f"{fb:.0f} ({peak:.0f})" if fb is not None else "-")
            )
        print(
            f"| {name} | {r['floor_fwd_us']:.0f} / {r['floor_fwd_bwd_us']:.0f} | " + " | ".join(cells) + " |",
            flush=True,
        )
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(dense_flops=rate, copy_bytes_per_s=bw, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
