#!/usr/bin/env python3
"""padmoe.triton (the Ascend design as Triton kernels) on a GPU, beside padmoe's CUDA kernels
and MegaBlocks' Triton kernels' recorded figures.

Per preset (the user-level benchmark's shapes: bf16 rows, weights from softmax + topk, alignment 128) and
op (padded_gather unweighted, padded_scatter weighted, padded_scatter_wgrad), as in the user-level
benchmark harness:

- ``eager``: one eager call at a time with CUDA events around the Python call, median of ``--iters``
  calls, L2 warm, nothing queued in front (host time that delays the kernels counts). Like
  MegaBlocks, padmoe.triton's gather reads P (``padded_bins[-1]``) on the host; ``check=False``
  (padmoe's argument checks off, as the harness times the drop-ins) and ``+check`` rows.
- ``kernels``: the GPU time of the op's kernels alone, from the profiler, and how many it launched.

The same run times padmoe's CUDA drop-ins (``padmoe.torch``, ``check=False``) and reads MegaBlocks'
figures from the shared results (``--peers``; measured 2026-12-01 by the same harness on an H200).
Floors (docs/spec.md §16) over the device-to-device copy bandwidth measured in this run: gather
``(T*H + P*H)*s``, scatter and wgrad ``(A*H + T*H)*s``.

``--sweep`` times a grid of launch configurations (programs per SM, sub_block_rows, block_x,
num_warps, pass) per preset and op (GPU time of back-to-back calls, ``check=False``, P given) and
prints the best, beside the planner's (``padmoe.triton.tile_config``): what the ``gpu`` target's
defaults in ``src/core/tiling.cpp`` were chosen from.

    PYTHONPATH=DIR python3 bench/bench_triton.py [--sweep] [--out-md r.md] [--out-json r.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import copy_bandwidth, eager_time, kernel_time  # noqa: E402

SHAPES = {  # user_bench.py's (T, E, K, H, alignment)
    "mixtral-8x7b": (16384, 8, 2, 4096, 128),
    "qwen3-30b-a3b": (16384, 128, 8, 2048, 128),
    "deepseek-v3": (16384, 256, 8, 7168, 128),
}
OPS = ("gather", "scatter", "wgrad")


def problem(T, E, K, H, m, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g)
    w, top = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    top = top.int().flatten()
    bin_ids, indices = torch.sort(top, stable=True)
    tpe = torch.bincount(top, minlength=E).int()
    ptpe = (tpe + m - 1) // m * m
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    return dict(
        T=T,
        E=E,
        K=K,
        H=H,
        m=m,
        w=w.flatten().to(torch.bfloat16),
        indices=indices.int(),
        bin_ids=bin_ids.int(),
        bins=torch.cumsum(tpe, 0).int(),
        padded_bins=torch.cumsum(ptpe, 0).int(),
        x=x,
    )


def floor_bytes(p, op, P):
    T, K, H, s = p["T"], p["K"], p["H"], 2
    return (T * H + P * H) * s if op == "gather" else (T * K * H + T * H) * s


def peers(path):
    if not path or not os.path.exists(path):
        return {}
    d = json.load(open(path))
    return {(r["shape"], r["op"]): r for r in d["rows"] if r["impl"] == "megablocks-triton"}


def calls(ptr, pt, p, P, y, grad):
    a = (p["indices"], p["bin_ids"])
    b = (p["bins"], p["padded_bins"], p["K"])
    x, w = p["x"], p["w"]
    return {
        "gather": (
            lambda cfg=None, check=False, rows=None: ptr.padded_gather(
                x, *a, *b, config=cfg, check=check, padded_rows=rows
            ),
            lambda: pt.padded_gather(x, *a, *b, check=False),
        ),
        "scatter": (
            lambda cfg=None, check=False, rows=None: ptr.padded_scatter(y, *a, w, *b, config=cfg, check=check),
            lambda: pt.padded_scatter(y, *a, w, *b, check=False),
        ),
        "wgrad": (
            lambda cfg=None, check=False, rows=None: ptr.padded_scatter_wgrad(y, grad, *a, *b, config=cfg, check=check),
            lambda: pt.padded_scatter_wgrad(y, grad, *a, *b, check=False),
        ),
    }


def host_time(fn, iters=30):
    """µs of host time of one call (perf_counter around the call; the GPU drained before each)."""
    fn()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def gpu_time(fn, reps=10):
    """µs per call of `reps` back-to-back calls (GPU time when the kernels outlast the host)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


ALTERNATIVES = [  # (op, config with programs per SM): the Ascend design's sorted pass, one launch fewer
    ("wgrad", {"programs": 32, "sub_block_rows": 1, "block_x": 2048, "pass": "sorted"}),
    ("wgrad", {"programs": 16, "sub_block_rows": 16, "block_x": 256, "num_warps": 8, "pass": "sorted"}),
    ("gather", {"programs": 32, "sub_block_rows": 8, "block_x": 1024, "pass": "sorted"}),
    ("gather", {"programs": 32, "sub_block_rows": 32, "block_x": 128, "pass": "sorted"}),
]
SWEEP_TILES = [
    (1, 2048),
    (1, 4096),
    (2, 1024),
    (2, 2048),
    (2, 4096),
    (4, 512),
    (4, 1024),
    (4, 2048),
    (8, 256),
    (8, 512),
    (8, 1024),
    (16, 256),
    (16, 512),
    (32, 128),
]
SWEEP_PPS = (2, 4, 8, 16, 32)


def sweep(name, p, P, fns, sms, ptr, budget_s):
    out = []
    t0 = time.time()
    for op in OPS:
        passes = ("sorted", "tokens") if op != "scatter" else ("tokens",)
        planned = ptr.tile_config(op, p["H"], torch.bfloat16, device="cuda")
        base = gpu_time(lambda: fns[op][0](None, False, P))
        res = []
        for ps in passes:
            for sub, bx in SWEEP_TILES:
                for warps in (4, 8):
                    for pps in SWEEP_PPS:
                        if time.time() - t0 > budget_s:
                            break
                        cfg = {
                            "programs": sms * pps,
                            "sub_block_rows": sub,
                            "block_x": bx,
                            "num_warps": warps,
                            "pass": ps,
                        }
                        try:
                            us = gpu_time(lambda: fns[op][0](cfg, False, P))
                        except Exception as e:  # noqa: BLE001 (a configuration Triton cannot compile)
                            print(f"  sweep {name} {op} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                            continue
                        res.append(dict(preset=name, op=op, us=us, floor_us=None, **cfg))
        fb = floor_bytes(p, op, P)
        res.sort(key=lambda r: r["us"])
        print(
            f"sweep {name} {op}: planned {planned['programs']}x{planned['sub_block_rows']}x{planned['block_x']} "
            f"{planned['pass']} {base:.1f} us; best:",
            flush=True,
        )
        for r in res[:6]:
            print(
                f"    {r['us']:8.1f} us  programs {r['programs']:5d} ({r['programs'] // sms}/SM)  sub {r['sub_block_rows']:3d}"
                f"  block_x {r['block_x']:5d}  warps {r['num_warps']}  pass {r['pass']}",
                flush=True,
            )
        out.append(dict(preset=name, op=op, planned_us=base, floor_bytes=fb, planned=planned, results=res))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--prof-iters", type=int, default=10)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0, help="per preset")
    ap.add_argument("--peers", default="")
    ap.add_argument("--alternatives", action="store_true", help="eager times of the other passes too")
    ap.add_argument("--out-md", default="")
    ap.add_argument("--out-json", default="")
    args = ap.parse_args()
    import triton

    import padmoe.torch as pt
    import padmoe.triton as ptr

    here = os.path.dirname(os.path.abspath(__file__))
    peer_path = args.peers or next(
        (
            q
            for q in (
                os.path.join(here, "..", ".ubench", "results", "2026-12-01-h200.json"),
                os.path.join(here, "..", "..", "shared", "bench", "results", "2026-12-01-h200.json"),
            )
            if os.path.exists(q)
        ),
        "",
    )
    mb = peers(peer_path)
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    head = (
        f"{props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}; copy {bw / 1e12:.2f} "
        f"TB/s (read+write); MegaBlocks figures from {os.path.relpath(peer_path) if peer_path else '(none)'}"
    )
    print(head, flush=True)
    rows, sweeps, alts = [], [], []
    for name, (T, E, K, H, m) in SHAPES.items():
        if args.shapes and name not in args.shapes.split(","):
            continue
        p = problem(T, E, K, H, m)
        P = int(p["padded_bins"][-1])
        y = pt.padded_gather(p["x"], p["indices"], p["bin_ids"], p["bins"], p["padded_bins"], K, check=False)
        grad = torch.randn_like(p["x"])
        fns = calls(ptr, pt, p, P, y, grad)
        for op in OPS:
            tri, native = fns[op]
            got, want = tri(), native()
            bitwise = bool(torch.equal(got, want))
            err = float((got.float() - want.float()).abs().max())
            cfg = ptr.tile_config(op, H, torch.bfloat16, device="cuda")
            fb = floor_bytes(p, op, P)
            floor_us = fb / bw * 1e6
            kus, launches, _ = kernel_time(lambda: tri(None, False, P), args.prof_iters)
            eus = eager_time(lambda: tri(), args.iters)
            cus = eager_time(lambda: tri(None, True), args.iters)
            hus = host_time(lambda: tri())
            nk, nl, _ = kernel_time(native, args.prof_iters)
            nus = eager_time(native, args.iters)
            peer = mb.get((name, op))
            row = dict(
                preset=name,
                op=op,
                floor_us=floor_us,
                triton_kernels_us=kus,
                triton_launches=launches,
                triton_eager_us=eus,
                triton_eager_check_us=cus,
                triton_host_us=hus,
                native_kernels_us=nk,
                native_eager_us=nus,
                megablocks_us=peer["us"] if peer else None,
                megablocks_x_floor=peer["us"] / peer["floor_us"] if peer and peer["floor_us"] else None,
                bitwise_vs_native=bitwise,
                max_abs_diff_vs_native=err,
                config={k: cfg[k] for k in ("programs", "sub_block_rows", "block_x", "pass", "target")},
            )
            rows.append(row)
            mbs = f"{row['megablocks_us']:8.1f} (x{row['megablocks_x_floor']:.2f})" if peer else "        -"
            print(
                f"{name:14} {op:8} floor {floor_us:7.1f}  triton eager {eus:8.1f} (x{eus / floor_us:.2f}) "
                f"+check {cus:8.1f}  host {hus:6.1f}  kernels {kus:8.1f} ({launches:.0f})  cuda eager {nus:8.1f} (x{nus / floor_us:.2f})"
                f"  megablocks {mbs}  bitwise {bitwise} maxdiff {err:.3g}",
                flush=True,
            )
        if args.alternatives:  # eager single calls of other passes / shapes, beside the planner's
            for op, cfg in ALTERNATIVES:
                c = dict(cfg, programs=cfg["programs"] * sms)
                us = eager_time(lambda: fns[op][0](c), args.iters)
                kus, _, _ = kernel_time(lambda: fns[op][0](c, False, P), args.prof_iters)
                row = dict(preset=name, op=op, config=c, eager_us=us, kernels_us=kus)
                alts.append(row)
                print(f"  alternative {name:14} {op:8} {c}: eager {us:8.1f}  kernels {kus:8.1f}", flush=True)
            print(
                f"  P read on the host (int(padded_bins[-1])): {host_time(lambda: int(p['padded_bins'][-1])):.1f} us",
                flush=True,
            )
        if args.sweep:
            sweeps += sweep(name, p, P, fns, sms, ptr, args.sweep_budget_s)
        p = y = grad = fns = None  # free this configuration's buffers
        torch.cuda.empty_cache()
    if args.out_json:
        json.dump(
            dict(
                date=datetime.date.today().isoformat(),
                header=head,
                copy_bytes_per_s=bw,
                rows=rows,
                sweeps=sweeps,
                alternatives=alts,
            ),
            open(args.out_json, "w"),
            indent=1,
        )
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(f"# padmoe.triton on {props.name} ({datetime.date.today().isoformat()})\n\n{head}\n\n")
            f.write(
                "| preset | op | floor µs | triton eager µs (x floor) | +check µs | host µs | triton kernels µs (launches) | "
                "CUDA drop-in eager µs (x floor) | MegaBlocks µs (x floor, recorded) | config (programs x sub x "
                "block_x, pass) | bitwise vs CUDA |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
            )
            for r in rows:
                c = r["config"]
                mbs = f"{r['megablocks_us']:.1f} ({r['megablocks_x_floor']:.2f}x)" if r["megablocks_us"] else "-"
                f.write(
                    f"| {r['preset']} | {r['op']} | {r['floor_us']:.1f} | {r['triton_eager_us']:.1f} "
                    f"({r['triton_eager_us'] / r['floor_us']:.2f}x) | {r['triton_eager_check_us']:.1f} | {r['triton_host_us']:.1f} | "
                    f"{r['triton_kernels_us']:.1f} ({r['triton_launches']:.0f}) | {r['native_eager_us']:.1f} "
                    f"({r['native_eager_us'] / r['floor_us']:.2f}x) | {mbs} | {c['programs']} x "
                    f"{c['sub_block_rows']} x {c['block_x']}, {c['pass']} | "
                    f"{'yes' if r['bitwise_vs_native'] else 'no (max diff %.3g)' % r['max_abs_diff_vs_native']} |\n"
                )


if __name__ == "__main__":
    main()
