#!/usr/bin/env python3
"""padmoe.torch as users see it on a GPU: every op timed three ways, in one run.

Per op and preset (bf16 rows, float32 router weights from softmax + topk, int64 ids as topk
returns them, ``check=False``):

- ``kernels``: the GPU time of the op's kernels alone, from the profiler (CUPTI: the sum of
  the device durations of every kernel and memcpy/memset it launched, per call, averaged over
  ``--prof-iters`` calls), and how many it launched. This is the figure the host overhead is
  held against (the "sum of its kernels' GPU times").
- ``eager``: one eager call at a time, CUDA events recorded around the Python call, the
  median of ``--iters`` calls, L2 warm, nothing queued in front (each call waits for the last):
  host time that delays the kernels counts, as for a user who calls the op once.
- ``graph``: ``--graph-inner`` calls captured in one CUDA graph and replayed, per call
  (static-shape ops only: the drop-ins read P on the host and cannot be captured).

Also: the same routing written in plain PyTorch (padmoe.reference, and a transformers-style sort /
index_select / index_add), and with ``--moe`` a Mixtral-style MoE block (router, routing,
two grouped_mm expert GEMMs, combine; T=4096, H=1024, F=1024, E=16, K=2) forward + backward
with padmoe's routing against the plain-PyTorch routing, eager and under torch.compile.

Floors (docs/spec.md §16, bytes over the device-to-device copy bandwidth measured in the same
run): dispatch / gather ``(T*H + P*H)*s``, combine / scatter / wgrad ``(A*H + T*H)*s``,
combine_backward ``(T*H + A*H + P*H)*s``, Routing forward = dispatch + combine, pad
``(A*H + P*H)*s``, unpad ``(A*H + A*H)*s``.

    PYTHONPATH=DIR python3 bench/bench_torch.py --out-md r.md --out-json r.json [--moe]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

PRESETS = {
    "mixtral-8x7b": dict(T=16384, E=8, K=2, H=4096, m=128),
    "qwen3-30b-a3b": dict(T=16384, E=128, K=8, H=2048, m=128),
    "deepseek-v3": dict(T=16384, E=256, K=8, H=7168, m=128),
    "decode": dict(T=256, E=256, K=8, H=7168, m=16),
}


def eager_time(fn, iters, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def graph_time(fn, inner, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / inner)
    del g
    return statistics.median(ts)


def kernel_time(fn, iters):
    """(µs of device time per call, launches per call, kernel names) from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total, count, names = 0.0, 0, {}
    for ev in prof.events():
        dev = getattr(ev, "device_type", None)
        if dev is None or "CUDA" not in str(dev):
            continue
        total += ev.time_range.elapsed_us()
        count += 1
        short = ev.name.split("(")[0].split("<")[0].replace("void ", "")[:60]
        names[short] = names.get(short, 0) + 1
    return total / iters, count / iters, {k: v / iters for k, v in names.items()}


def copy_bandwidth():
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = eager_time(lambda: y.copy_(x), 20)
    return 2 * 2 * 1024**3 / (us * 1e-6)  # bytes/s, read + write


def workload(cfg, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, E, K, H = cfg["T"], cfg["E"], cfg["K"], cfg["H"]
    logits = torch.randn(T, E, device="cuda", generator=g)
    w, top = logits.softmax(-1).topk(K, dim=-1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    return top, w, x


def run_preset(name, cfg, args, bw, pt, pe):
    T, E, K, H, m = cfg["T"], cfg["E"], cfg["K"], cfg["H"], cfg["m"]
    A, s = T * K, 2
    top, w, x = workload(cfg)
    plan = pt.make_plan(top, E, m, check=False)
    P = int(plan.padded_bins[-1])
    y = pt.dispatch(x, plan, check=False)
    gout = torch.randn_like(x)
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    ref = pe.make_plan(top, E, m)
    floors = {
        "dispatch": (T * H + P * H) * s,
        "combine": (A * H + T * H) * s,
        "combine_backward": (T * H + A * H + P * H) * s,
    }
    floors["Routing forward"] = floors["dispatch"] + floors["combine"]
    floors["padded_gather"] = floors["dispatch"]
    floors["padded_scatter"] = floors["combine"]
    floors["padded_scatter_wgrad"] = floors["combine"]
    xs = x.index_select(0, (ref.indices // K).long())  # expert-grouped rows for pad / unpad
    tpe = ref.tokens_per_expert
    floors["pad_to_alignment"] = (A * H + P * H) * s
    floors["unpad_from_alignment"] = (A * H + A * H) * s
    padded, pmap, _ = pt.pad_to_alignment(xs, tpe, m, check=False)
    probs = w.reshape(-1)[ref.indices.long()].contiguous()

    def routing_fwd():
        r = pt.Routing.from_topk(top, w, E, m, check=False)
        return r.combine(r.dispatch(x))

    def routing_fwd_bwd():
        xr.grad = None  # no AccumulateGrad add kernels: the gradients are new each step
        wr.grad = None
        r = pt.Routing.from_topk(top, wr, E, m, check=False)
        r.combine(r.dispatch(xr)).backward(gout)

    def eager_routing_fwd():
        p = pe.make_plan(top, E, m)
        return pe.combine(pe.dispatch(x, p), p, w.reshape(-1))

    xt = x.clone().requires_grad_(True)
    wt = w.clone().requires_grad_(True)

    def transformers_style_fwd_bwd():  # sort / index_select / index_add, as transformers' MoE blocks route
        xt.grad = None
        wt.grad = None
        order = torch.argsort(top.reshape(-1), stable=True)
        tok = order // K
        ys = xt.index_select(0, tok)
        out = torch.zeros_like(xt).index_add_(0, tok, ys * wt.reshape(-1)[order].unsqueeze(1).to(ys.dtype))
        out.backward(gout)

    cases = [
        ("make_plan", lambda: pt.make_plan(top, E, m, check=False), True),
        ("dispatch", lambda: pt.dispatch(x, plan, check=False), True),
        ("combine", lambda: pt.combine(y, plan, w, check=False), True),
        ("Routing forward", routing_fwd, True),
        ("Routing forward+backward", routing_fwd_bwd, False),
        (
            "padded_gather",
            lambda: pt.padded_gather(x, ref.indices, ref.bin_ids, ref.bins, ref.padded_bins, K, check=False),
            False,
        ),
        (
            "padded_scatter",
            lambda: pt.padded_scatter(y, ref.indices, ref.bin_ids, w, ref.bins, ref.padded_bins, K, check=False),
            False,
        ),
        (
            "padded_scatter_wgrad",
            lambda: pt.padded_scatter_wgrad(
                y, gout, ref.indices, ref.bin_ids, ref.bins, ref.padded_bins, K, check=False
            ),
            False,
        ),
        ("pad_to_alignment", lambda: pt.pad_to_alignment(xs, tpe, m, check=False), False),
        ("unpad_from_alignment", lambda: pt.unpad_from_alignment(padded, pmap, A, probs, check=False), False),
        ("eager: Routing forward (padmoe.reference)", eager_routing_fwd, False),
        ("eager: sort/index_select/index_add forward+backward", transformers_style_fwd_bwd, False),
    ]
    rows = []
    for op, fn, capturable in cases:
        if args.ops and not any(o in op for o in args.ops.split(",")):
            continue
        kus, launches, names = kernel_time(fn, args.prof_iters)
        eus = eager_time(fn, args.iters)
        gus = graph_time(fn, args.graph_inner) if capturable else None
        fb = floors.get(op)
        floor_us = fb / bw * 1e6 if fb else None
        rows.append(
            dict(
                preset=name,
                op=op,
                kernels_us=kus,
                launches=launches,
                kernel_names=names,
                eager_us=eus,
                graph_us=gus,
                floor_us=floor_us,
                eager_over_kernels=eus / kus if kus else None,
                eager_over_floor=eus / floor_us if floor_us else None,
            )
        )
        g = f"{gus:9.1f}" if gus is not None else "        -"
        f = f"{eus / floor_us:6.2f}" if floor_us else "     -"
        print(
            f"{name:14} {op:52} kernels {kus:9.1f} us ({launches:4.1f} launches)  eager {eus:9.1f} us "
            f"(x{eus / kus if kus else 0:5.2f} kernels, x{f} floor)  graph {g} us",
            flush=True,
        )
    return rows


def moe_block(args, pt):
    """A Mixtral-style MoE block with grouped_mm experts, forward + backward: padmoe's routing
    against transformers-style routing (sort / index_select / index_add), eager and compiled."""
    T, H, F, E, K, m = 4096, 1024, 1024, 16, 2, 128
    dt = torch.bfloat16
    gm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    g = torch.Generator(device="cuda").manual_seed(1)
    router = (torch.randn(E, H, device="cuda", generator=g) / H**0.5).to(dt).requires_grad_(True)
    w1 = (torch.randn(E, H, 2 * F, device="cuda", generator=g) / H**0.5).to(dt).requires_grad_(True)
    w2 = (torch.randn(E, F, H, device="cuda", generator=g) / F**0.5).to(dt).requires_grad_(True)
    x = torch.randn(T, H, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    gout = torch.randn(T, H, device="cuda", dtype=dt, generator=g)
    params = (router, w1, w2, x)

    def experts(y, offs):
        h = gm(y, w1, offs=offs)
        a, b = h.chunk(2, dim=-1)
        return gm(torch.nn.functional.silu(a) * b, w2, offs=offs)

    def route(xx):
        probs, top = torch.nn.functional.linear(xx, router).float().softmax(-1).topk(K, dim=-1)
        return probs / probs.sum(-1, keepdim=True), top

    def padmoe_block(xx):
        probs, top = route(xx)
        r = pt.Routing.from_topk(top, probs, E, m)
        return r.combine(experts(r.dispatch(xx), r.offsets))

    def torch_block(xx):  # transformers-style: sort, index_select, ragged grouped_mm, weighted index_add
        probs, top = route(xx)
        flat = top.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // K
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        o = experts(xx.index_select(0, tok), offs)
        return torch.zeros_like(xx).index_add_(0, tok, o * probs.reshape(-1)[order].unsqueeze(1).to(o.dtype))

    def routing_only_padmoe():
        r = pt.Routing.from_topk(top0, probs0, E, m, check=False)
        r.combine(r.dispatch(x)).backward(gout)

    def routing_only_torch():
        order = torch.argsort(top0.reshape(-1), stable=True)
        tok = order // K
        ys = x.index_select(0, tok)
        torch.zeros_like(x).index_add_(0, tok, ys * pw[order].unsqueeze(1).to(ys.dtype)).backward(gout)

    with torch.no_grad():
        probs0, top0 = route(x)
    probs0 = probs0.detach().requires_grad_(True)
    pw = probs0.reshape(-1)

    def step(block):
        def run():
            for p in params:
                p.grad = None
            block(x).backward(gout)

        return run

    out = {}
    with torch.no_grad():
        a, b = padmoe_block(x), torch_block(x)
        out["max_abs_diff_padmoe_vs_torch"] = (a.float() - b.float()).abs().max().item()
    for label, fn in (
        ("routing ops fwd+bwd: padmoe", routing_only_padmoe),
        ("routing ops fwd+bwd: sort/index_select/index_add", routing_only_torch),
        ("block fwd+bwd: padmoe", step(padmoe_block)),
        ("block fwd+bwd: transformers-style grouped_mm", step(torch_block)),
    ):

        def wrapped(fn=fn):
            for p in (x, probs0):
                p.grad = None
            fn()

        kus, launches, _ = kernel_time(wrapped, args.prof_iters)
        eus = eager_time(wrapped, args.iters)
        out[label] = dict(kernels_us=kus, launches=launches, eager_us=eus)
        print(f"moe-block {label:52} kernels {kus:9.1f} us ({launches:5.1f} launches)  eager {eus:9.1f} us", flush=True)
    for label, block in (
        ("block fwd+bwd compiled: padmoe", padmoe_block),
        ("block fwd+bwd compiled: transformers-style grouped_mm", torch_block),
    ):
        try:
            torch._dynamo.reset()
            cb = torch.compile(block, fullgraph=True)
            fn = step(cb)
            for _ in range(3):
                fn()
            eus = eager_time(fn, args.iters)
            out[label] = dict(eager_us=eus)
            print(f"moe-block {label:52} eager {eus:9.1f} us", flush=True)
        except Exception as e:  # noqa: BLE001 - report, keep the other figures
            out[label] = dict(error=repr(e)[:300])
            print(f"moe-block {label}: failed: {repr(e)[:300]}", flush=True)
    return out


def render_md(report):
    lines = [
        f"# padmoe.torch on {report['card']} ({report['date']})",
        "",
        f"torch {report['torch']}, copy {report['copy_tbps']:.2f} TB/s; bf16 rows, `check=False`. "
        "kernels = GPU time of the op's kernels (profiler); eager = one call, host included (CUDA events "
        "around the Python call, nothing queued ahead, warm L2); graph = CUDA-graph replay per call.",
        "",
        "| preset | op | kernels µs (launches) | eager µs | eager / kernels | eager / floor | graph µs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        f = f"{r['eager_over_floor']:.2f}" if r["eager_over_floor"] else "-"
        g = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else "-"
        lines.append(
            f"| {r['preset']} | {r['op']} | {r['kernels_us']:.1f} ({r['launches']:.0f}) | {r['eager_us']:.1f} | "
            f"{r['eager_over_kernels']:.2f} | {f} | {g} |"
        )
    if report.get("moe"):
        lines += [
            "",
            "MoE block (T=4096, H=1024, F=1024, E=16, K=2, bf16, grouped_mm experts), forward + backward:",
            "",
            "| case | kernels µs (launches) | eager µs |",
            "| --- | --- | --- |",
        ]
        for k, v in report["moe"].items():
            if isinstance(v, dict):
                kk = f"{v['kernels_us']:.1f} ({v['launches']:.0f})" if "kernels_us" in v else "-"
                lines.append(f"| {k} | {kk} | {v.get('eager_us', float('nan')):.1f} |")
        lines.append(
            f"\nmax |padmoe block - torch block| (forward): {report['moe']['max_abs_diff_padmoe_vs_torch']:.3g}"
        )
    return "\n".join(lines) + "\n"


README_OPS = (
    "padded_gather",
    "padded_scatter",
    "padded_scatter_wgrad",
    "pad_to_alignment",
    "unpad_from_alignment",
    "Routing forward",
    "Routing forward+backward",
)


def render_readme(report):
    """The README's performance table: one eager call (host included), µs and (× the copy floor),
    op by preset; the Routing forward's CUDA-graph replay per call under it."""
    presets = list(dict.fromkeys(r["preset"] for r in report["rows"]))
    cell = {(r["preset"], r["op"]): r for r in report["rows"]}
    lines = ["| op, eager µs (x floor) | " + " | ".join(presets) + " |", "| --- |" + " ---: |" * len(presets)]
    for op in README_OPS:
        vals = []
        for pr in presets:
            r = cell.get((pr, op))
            if r is None:
                vals.append("-")
            else:
                f = f" ({r['eager_over_floor']:.1f}x)" if r["eager_over_floor"] else ""
                vals.append(f"{r['eager_us']:.1f}{f}")
        lines.append(f"| `{op}` | " + " | ".join(vals) + " |")
    graph = [cell.get((pr, "Routing forward"), {}).get("graph_us") for pr in presets]
    lines.append(
        "| `Routing forward`, CUDA graph | " + " | ".join("-" if g is None else f"{g:.1f}" for g in graph) + " |"
    )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--ops", default="", help="comma-separated substrings of op names to run")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--prof-iters", type=int, default=10)
    p.add_argument("--graph-inner", type=int, default=20)
    p.add_argument("--moe", action="store_true", help="also the MoE block")
    p.add_argument("--out-md")
    p.add_argument("--out-json")
    p.add_argument("--readme-md", help="also write the README's performance table here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_torch.py needs a CUDA device", file=sys.stderr)
        return 2
    import padmoe.reference as pe
    import padmoe.torch as pt

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy {bw / 1e12:.2f} TB/s  torch {torch.__version__}", flush=True)
    rows = []
    for name in args.presets.split(","):
        rows += run_preset(name, PRESETS[name], args, bw, pt, pe)
        torch.cuda.empty_cache()
    report = dict(
        card=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        copy_tbps=bw / 1e12,
        rows=rows,
        moe=moe_block(args, pt) if args.moe else None,
    )
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(report, f, indent=1)
    md = render_md(report)
    if args.readme_md:
        with open(args.readme_md, "w") as f:
            f.write(render_readme(report))
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
