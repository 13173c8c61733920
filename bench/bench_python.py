#!/usr/bin/env python3
"""padmoe's Python API vs plain PyTorch eager (python/padmoe/reference.py), side by side,
against the copy-bandwidth floor of docs/spec.md §16.

For each preset it builds a seeded random routing (top-k distinct experts per token from
``torch.randn(T, E).topk``, softmax weights over the K picked logits), then times every op
once through ``padmoe`` and once through ``padmoe.reference`` in the same run, and measures the
device-to-device copy bandwidth (``dst.copy_(src)``, read + written bytes over time) in the
same run. Per op it reports the median time, TB/s (floor bytes / time) and time over the
floor time (floor bytes / copy bandwidth), for both sides.

Usage (from the repository root; padmoe importable, e.g. ``pip install .`` or
``PYTHONPATH=python`` beside a built ``padmoe/_C``):

    python bench/bench_python.py --device cuda                          # every preset, bf16
    python bench/bench_python.py --device cpu --small --tokens 256      # a quick CPU run
    python bench/bench_python.py --device cuda --out-md r.md --out-json r.json --out-png r.png

Timing. CUDA: CUDA events around each call on the current stream, a read of a 256 MiB
buffer before every timed call (outside the timed region) to start with a cold L2, warm-up
runs, the median of ``--iters`` runs. CPU: ``time.perf_counter`` around each call, median,
warm caches (no flush). padmoe calls run unchecked (``check=False``, the sync-free fast path)
into outputs allocated once before timing (``out=`` where the API takes it, else
``rows=plan.padded_rows_bound``), with a caller workspace when the API takes one; the eager ops
allocate their outputs and read P on the host (``.item()``), as MegaBlocks / Megatron do in
eager mode. Before timing, each op's padmoe and eager outputs are compared (the ``check``
column).

Floor bytes (s = bytes per row element, A = T*K, P = padded rows, N = A rows for pad/unpad,
R = capacity = A + E*(m-1)):
    make_plan                 A*4 + (3*A + 4*E + R)*4   (int32 ids read; plan arrays written)
    dispatch, padded_gather   (T*H + P*H)*s
    combine, padded_scatter   (A*H + T*H)*s
    combine_backward(w)       (T*H + A*H + P*H)*s       (grad_out read once, y's A real rows
                                                          read for grad_weights, grad_y's P
                                                          rows written; docs/spec.md §16)
    pad_to_alignment          (N*H + P*H)*s
    unpad_from_alignment      (P*H + N*H)*s
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import inspect
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

# torch's OpenMP workers spin between parallel regions by default; on a small (virtual) CPU
# that starves the next op's threads and turns eager CPU timings into multiples of the
# scheduler tick. Sleeping workers measure what the ops cost. Must be set before torch
# loads libgomp; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]

PRESETS: Dict[str, Dict[str, int]] = {
    "mixtral-8x7b": dict(T=16384, E=8, K=2, H=4096, m=128),
    "qwen3-30b-a3b": dict(T=16384, E=128, K=8, H=2048, m=128),
    "deepseek-v3": dict(T=16384, E=256, K=8, H=7168, m=128),
    "decode": dict(T=256, E=256, K=8, H=7168, m=16),
}

OPS = [
    "make_plan",
    "dispatch",
    "combine(w)",
    "combine_backward(w)",
    "padded_gather",
    "padded_scatter(w)",
    "pad_to_alignment",
    "unpad_from_alignment",
]

FLOOR_RULES = {
    "make_plan": "A*4 + (3*A + 4*E + R)*4",
    "dispatch": "(T*H + P*H)*s",
    "padded_gather": "(T*H + P*H)*s",
    "combine(w)": "(A*H + T*H)*s",
    "padded_scatter(w)": "(A*H + T*H)*s",
    "combine_backward(w)": "(T*H + A*H + P*H)*s",
    "pad_to_alignment": "(N*H + P*H)*s",
    "unpad_from_alignment": "(P*H + N*H)*s",
}

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def floor_bytes(op: str, T: int, E: int, K: int, H: int, m: int, P: int, s: int) -> float:
    A = T * K
    N = A
    R = A + E * (m - 1)
    return {
        "make_plan": A * 4 + (3 * A + 4 * E + R) * 4,
        "dispatch": (T * H + P * H) * s,
        "padded_gather": (T * H + P * H) * s,
        "combine(w)": (A * H + T * H) * s,
        "padded_scatter(w)": (A * H + T * H) * s,
        "combine_backward(w)": (T * H + A * H + P * H) * s,
        "pad_to_alignment": (N * H + P * H) * s,
        "unpad_from_alignment": (P * H + N * H) * s,
    }[op]


# ---------------------------------------------------------------------------
# the two implementations
# ---------------------------------------------------------------------------


def load_eager():
    """python/padmoe/reference.py from this checkout, loaded by path (needs nothing native)."""
    path = REPO / "python" / "padmoe" / "eager.py"
    spec = importlib.util.spec_from_file_location("padmoe_eager_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_padmoe(device: str):
    """(module, None) or (None, why it is unavailable)."""
    errors = []
    for extra in (None, REPO / "python"):
        if extra is not None:
            sys.path.insert(0, str(extra))
        try:
            import padmoe  # noqa: F401

            break
        except Exception as exc:  # ImportError, or a broken native module
            errors.append(f"{type(exc).__name__}: {exc}")
            if extra is not None:
                sys.path.remove(str(extra))
            for name in [n for n in sys.modules if n == "padmoe" or n.startswith("padmoe.")]:
                del sys.modules[name]
    else:
        return None, "import padmoe failed (" + "; ".join(errors) + ")"
    import padmoe

    if device == "cuda" and hasattr(padmoe, "has_cuda") and not padmoe.has_cuda():
        return None, f"padmoe at {pathlib.Path(padmoe.__file__).parent} was built without the CUDA backend"
    return padmoe, None


def _takes(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


class Timer:
    def __init__(self, device: str, iters: int, warmup: int, flush_mib: int):
        self.device, self.iters, self.warmup = device, iters, warmup
        self.flush_buf = None
        if device == "cuda" and flush_mib > 0:
            self.flush_buf = torch.zeros(flush_mib * 2**20 // 4, dtype=torch.float32, device="cuda")
            self.flush_out = torch.zeros((), dtype=torch.float32, device="cuda")

    def flush(self):
        if self.flush_buf is not None:  # a read-only pass: no dirty lines left in L2
            torch.sum(self.flush_buf, dim=0, out=self.flush_out)

    def median_us(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device == "cuda":
            torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
            for i in range(self.iters):
                self.flush()
                starts[i].record()
                fn()
                ends[i].record()
            torch.cuda.synchronize()
            return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


def reuse_freed_host_memory() -> bool:
    """CPU: keep freed blocks in glibc's heap (no mmap per large allocation, no trimming), as
    torch's CUDA caching allocator does on a GPU. Without it every eager allocation of a large
    output maps fresh pages and page-faults on first touch, which on a VM can cost more than
    the op itself. Returns whether glibc accepted it."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def copy_bandwidth(timer: Timer, device: str, copy_mib: int, padmoe=None) -> Dict[str, Any]:
    """dst.copy_(src) (the floor): read + written bytes over the median time. With padmoe,
    padmoe.copy on the same buffers too (a second ceiling, reported, not used)."""
    n = copy_mib * 2**20
    src = torch.ones(n // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    us = timer.median_us(lambda: dst.copy_(src))
    result: Dict[str, Any] = {"bytes": 2 * n, "us": us, "tbps": 2 * n / (us * 1e-6) / 1e12, "what": "dst.copy_(src)"}
    if padmoe is not None and hasattr(padmoe, "copy"):
        try:
            pus = timer.median_us(lambda: padmoe.copy(src, dst, check=False))
            result["padmoe_copy_tbps"] = 2 * n / (pus * 1e-6) / 1e12
        except Exception as exc:
            result["padmoe_copy_error"] = f"{type(exc).__name__}: {exc}"
    src = dst = None  # free the buffers before the next measurement
    return result


# ---------------------------------------------------------------------------
# one preset
# ---------------------------------------------------------------------------


def build_workload(cfg: Dict[str, int], device: str, dtype: torch.dtype, seed: int) -> Dict[str, Any]:
    T, E, K, H = cfg["T"], cfg["E"], cfg["K"], cfg["H"]
    g = torch.Generator().manual_seed(seed)  # routing on the CPU: the same on every device
    logits = torch.randn(T, E, generator=g)
    top_logits, top_ids = logits.topk(K, dim=-1)  # K distinct experts per token
    weights = torch.softmax(top_logits, dim=-1).reshape(-1).to(torch.float32)
    gd = torch.Generator(device=device).manual_seed(seed + 1)
    return dict(
        top_experts=top_ids.to(torch.int32).to(device),
        weights=weights.to(device),
        x=torch.randn(T, H, generator=gd, device=device).to(dtype),
        grad_out=torch.randn(T, H, generator=gd, device=device).to(dtype),
        hidden=torch.randn(T * K, H, generator=gd, device=device).to(dtype),  # expert-grouped rows
    )


def compare(a: torch.Tensor, b: torch.Tensor, exact: bool) -> str:
    if a.shape != b.shape:
        return f"MISMATCH shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(a, b):
        return "bitwise"
    if exact:
        return f"MISMATCH ({int((a != b).sum())} elements differ)"
    a64, b64 = a.double(), b.double()
    scale = max(float(b64.abs().max()), 1e-30)
    err = float((a64 - b64).abs().max())
    return f"close ({err / scale:.1e} rel)" if err <= 1e-3 * scale else f"MISMATCH ({err / scale:.1e} rel)"


def worst(*results: str) -> str:
    for r in results:
        if r.startswith("MISMATCH"):
            return r
    for r in results:
        if r.startswith("close"):
            return r
    return results[0] if results else "-"


def run_preset(name: str, cfg: Dict[str, int], args, eager, padmoe, timer: Timer) -> Dict[str, Any]:
    device, dtype = args.device, DTYPES[args.dtype]
    T, E, K, H, m = cfg["T"], cfg["E"], cfg["K"], cfg["H"], cfg["m"]
    A = T * K
    s = torch.empty((), dtype=dtype).element_size()
    wl = build_workload(cfg, device, dtype, args.seed)
    top, w, x, grad_out, hidden = wl["top_experts"], wl["weights"], wl["x"], wl["grad_out"], wl["hidden"]

    eplan = eager.make_plan(top, E, m)
    P = int(eplan.padded_bins[-1])
    capacity = eplan.padded_rows_bound
    y = eager.dispatch(x, eplan)  # [P, H]: the input of combine / scatter / combine_backward
    tpe = eplan.tokens_per_expert
    padded, pmap, _ = eager.pad_to_alignment(hidden, tpe, m)  # [P, H], [P]: the input of unpad
    ip = (eplan.indices, eplan.bin_ids, eplan.bins, eplan.padded_bins)

    eager_fns = {
        "make_plan": lambda: eager.make_plan(top, E, m),
        "dispatch": lambda: eager.dispatch(x, eplan),
        "combine(w)": lambda: eager.combine(y, eplan, w),
        "combine_backward(w)": lambda: eager.combine_backward(grad_out, y, eplan, w),
        "padded_gather": lambda: eager.padded_gather(x, *ip, K),
        "padded_scatter(w)": lambda: eager.padded_scatter(y, ip[0], ip[1], w, ip[2], ip[3], K),
        "pad_to_alignment": lambda: eager.pad_to_alignment(hidden, tpe, m),
        "unpad_from_alignment": lambda: eager.unpad_from_alignment(padded, pmap, A),
    }

    padmoe_fns: Dict[str, Callable[[], Any]] = {}
    checks: Dict[str, str] = {}
    padmoe_notes: List[str] = []
    if padmoe is not None:
        pm = padmoe
        common = dict(check=False)
        if hasattr(pm, "workspace_bound") and _takes(pm.dispatch, "workspace") and device == "cuda":
            ws = torch.empty(pm.workspace_bound(T, K, E, m), dtype=torch.uint8, device=device)
            common["workspace"] = ws
            padmoe_notes.append("caller workspace")
        pplan = pm.make_plan(top, E, m, check=False)
        import padmoe.torch as pt  # noqa: F401 (registers torch.ops.padmoe)

        tplan = pt.make_plan(top, E, m, check=False)
        cap = pplan.padded_rows_bound
        assert cap == capacity, (cap, capacity)
        # outputs allocated once, capacity rows where P is unknown on the host
        y_cap = torch.empty(cap, H, dtype=dtype, device=device)
        out_t = torch.empty(T, H, dtype=dtype, device=device)
        pad_cap = torch.empty(cap, H, dtype=dtype, device=device)
        map_cap = torch.empty(cap, dtype=torch.int32, device=device)
        offs = torch.empty(E, dtype=torch.int32, device=device)
        out_n = torch.empty(A, H, dtype=dtype, device=device)
        pip = (pplan.indices, pplan.bin_ids, pplan.bins, pplan.padded_bins)

        def kw(fn, out=None, rows=None):
            """out= when fn takes it, else rows= (padded outputs), plus the common options."""
            extra = dict(common)
            if "workspace" in extra and not _takes(fn, "workspace"):
                del extra["workspace"]
            if out is not None and _takes(fn, "out"):
                extra["out"] = out
            elif rows is not None:
                extra["rows"] = rows
            return extra

        plan_out = None
        if _takes(pm.make_plan, "out") and hasattr(pm, "Plan") and hasattr(pm.Plan, "empty"):
            plan_out = pm.Plan.empty(T, K, E, m, like=top)
        k_plan = kw(pm.make_plan, out=plan_out)
        k_disp = kw(pm.dispatch, out=y_cap, rows=cap)
        k_comb = kw(pm.combine, out=out_t)
        k_gath = kw(pm.padded_gather, out=y_cap, rows=cap)
        k_scat = kw(pm.padded_scatter, out=out_t)
        k_pad = kw(pm.pad_to_alignment, out=(pad_cap, map_cap, offs), rows=cap)
        k_unpad = kw(pm.unpad_from_alignment, out=out_n)
        padmoe_fns = {
            "make_plan": lambda: pm.make_plan(top, E, m, **k_plan),
            "dispatch": lambda: pm.dispatch(x, pplan, **k_disp),
            "combine(w)": lambda: pm.combine(y, pplan, w, **k_comb),
            # padmoe.combine_backward takes numpy arrays only; on torch tensors it is padmoe.torch's
            # operator, what autograd runs for padmoe.torch.combine
            "combine_backward(w)": lambda: torch.ops.padmoe.combine_backward.default(
                grad_out, y, tplan.packed, w, K, E, m, None, True, 0, cap
            ),
            "padded_gather": lambda: pm.padded_gather(x, *pip, K, **k_gath),
            "padded_scatter(w)": lambda: pm.padded_scatter(y, pip[0], pip[1], w, pip[2], pip[3], K, **k_scat),
            "pad_to_alignment": lambda: pm.pad_to_alignment(hidden, pplan.tokens_per_expert, m, **k_pad),
            "unpad_from_alignment": lambda: pm.unpad_from_alignment(padded, pmap, A, **k_unpad),
        }
        if "out" in k_disp:
            padmoe_notes.append("outputs preallocated (out=)")
        else:
            padmoe_notes.append("rows=plan.padded_rows_bound")

        # correctness: padmoe against eager on this workload (padded outputs: the first P rows)
        if not args.no_check:
            for op in args.ops:
                got = want = None
                try:
                    got, want = padmoe_fns[op](), eager_fns[op]()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if op == "make_plan":
                        fields = (
                            "indices",
                            "bin_ids",
                            "tokens_per_expert",
                            "bins",
                            "padded_tokens_per_expert",
                            "padded_bins",
                            "dest_rows",
                            "row_sources",
                        )
                        checks[op] = worst(*(compare(getattr(got, f), getattr(want, f), True) for f in fields))
                    elif op in ("dispatch", "padded_gather"):
                        checks[op] = compare(got[:P], want, True)
                    elif op in ("combine(w)", "padded_scatter(w)"):
                        checks[op] = compare(got, want, False)
                    elif op == "combine_backward(w)":
                        checks[op] = worst(compare(got[0][:P], want[0], False), compare(got[1], want[1], False))
                    elif op == "pad_to_alignment":
                        checks[op] = worst(
                            compare(got[0][:P], want[0], True),
                            compare(got[1][:P], want[1], True),
                            compare(got[2], want[2], True),
                        )
                    else:
                        checks[op] = compare(got, want, True)
                except Exception as exc:
                    checks[op] = f"error: {type(exc).__name__}: {exc}"
                del got, want

    copy = copy_bandwidth(timer, device, args.copy_mib, padmoe)
    rows_out = []
    for op in args.ops:
        fb = floor_bytes(op, T, E, K, H, m, P, s)
        floor_us = fb / (copy["tbps"] * 1e12) * 1e6
        entry: Dict[str, Any] = {
            "op": op,
            "floor_rule": FLOOR_RULES[op],
            "floor_bytes": fb,
            "floor_us": floor_us,
            "check": checks.get(op, "-" if padmoe is None or args.no_check else "not run"),
        }
        for side, fns in (("padmoe", padmoe_fns), ("eager", eager_fns)):
            if side == "padmoe" and padmoe is None:
                entry[side] = None
                continue
            try:
                us = timer.median_us(fns[op])
                entry[side] = {"us": us, "tbps": fb / (us * 1e-6) / 1e12, "x_floor": us / floor_us}
            except Exception as exc:
                entry[side] = {"error": f"{type(exc).__name__}: {exc}"}
        rows_out.append(entry)
        if args.verbose:
            print(
                f"  {name} {op}: "
                + ", ".join(
                    f"{k} {v['us']:.1f} us"
                    for k, v in (("padmoe", entry["padmoe"]), ("eager", entry["eager"]))
                    if v and "us" in v
                ),
                file=sys.stderr,
            )
    result = {
        "preset": name,
        "T": T,
        "E": E,
        "K": K,
        "H": H,
        "alignment": m,
        "A": A,
        "P": P,
        "capacity": capacity,
        "element_size": s,
        "copy": copy,
        "ops": rows_out,
        "padmoe_notes": padmoe_notes,
    }
    wl = eplan = y = padded = pmap = None  # free the workload's buffers
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


def card_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or "CPU"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def _fmt_tbps(v: float) -> str:
    return f"{v:.2f}" if v >= 1 else f"{v:.3f}" if v >= 0.001 else f"{v:.1e}"


def _side_cells(side: Optional[Dict[str, Any]]) -> List[str]:
    if side is None:
        return ["n/a", "n/a", "n/a"]
    if "error" in side:
        return ["error", "", ""]
    return [f"{side['us']:.1f}", _fmt_tbps(side["tbps"]), f"{side['x_floor']:.2f}"]


def render_markdown(report: Dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"# padmoe vs PyTorch eager — {meta['card']} — {meta['date']}", ""]
    lines.append(
        f"device {meta['device']}, rows {meta['dtype']}, torch {meta['torch']}, "
        f"{meta['iters']} timed runs after {meta['warmup']} warm-up runs, median; {meta['timing']}."
    )
    if not meta["padmoe_available"]:
        lines += ["", f"**padmoe unavailable**: {meta['padmoe_error']}. Only the eager half was measured."]
    for pr in report["presets"]:
        c = pr["copy"]
        lines += [
            "",
            f"## {pr['preset']}: T={pr['T']}, E={pr['E']}, K={pr['K']}, H={pr['H']}, "
            f"alignment {pr['alignment']} (A={pr['A']}, P={pr['P']})",
            "",
            f"copy bandwidth (the floor: dst.copy_(src), {c['bytes'] / 2 / 2**20:.0f} MiB, read + write): "
            f"{_fmt_tbps(c['tbps'])} TB/s"
            + (
                f"; padmoe.copy on the same buffers: {_fmt_tbps(c['padmoe_copy_tbps'])} TB/s (not the floor)"
                if "padmoe_copy_tbps" in c
                else ""
            ),
            "",
            "| op | floor MB | padmoe µs | TB/s | ×floor | eager µs | TB/s | ×floor | eager / padmoe | check |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for o in pr["ops"]:
            pad, eag = o["padmoe"], o["eager"]
            ratio = f"{eag['us'] / pad['us']:.2f}x" if pad and eag and "us" in pad and "us" in eag else ""
            lines.append(
                "| "
                + " | ".join(
                    [o["op"], f"{o['floor_bytes'] / 1e6:.1f}", *_side_cells(pad), *_side_cells(eag), ratio, o["check"]]
                )
                + " |"
            )
        errors = [
            (o["op"], side, o[side]["error"])
            for o in pr["ops"]
            for side in ("padmoe", "eager")
            if o[side] and "error" in o[side]
        ]
        for op, side, err in errors:
            lines.append(f"\n{op} ({side}) failed: {err}")
        if pr["padmoe_notes"]:
            lines.append(f"\npadmoe: {', '.join(pr['padmoe_notes'])}.")
    lines += [
        "",
        "Notes:",
        "",
        "- TB/s = floor bytes / time; ×floor = time / (floor bytes / copy bandwidth). Floor bytes "
        "(s = bytes per element, A = T·K, P = padded rows, N = A, R = A + E·(m-1)): "
        + "; ".join(f"{op} {rule}" for op, rule in FLOOR_RULES.items() if op in meta["ops"])
        + ".",
        "- combine_backward(w): docs/spec.md §16's rule, grad_out read once + y's A real rows read "
        "(for grad_weights) + grad_y's P rows written (as `padmoe bench`). unpad counts all P padded rows "
        "read, as the task asked (`padmoe bench` counts only the N real rows).",
        "- padmoe: `check=False` (unchecked, sync-free), outputs allocated once before timing (`out=`, "
        "capacity rows where P is unknown on the host). eager (python/padmoe/reference.py) allocates its "
        "outputs on every call, zero-fills padded outputs before writing them, and reads P (or the "
        "valid-row count) on the host with `.item()` / `nonzero`, as MegaBlocks and Megatron do in eager "
        "mode; its make_plan is sync-free.",
        "- check: padmoe's output against eager's on this workload (padded outputs: the first P rows): "
        "`bitwise`, `close` (relative max difference, float32 dot products in a different order) or "
        "MISMATCH.",
        "- weighted ops use float32 router weights (softmax over the top-k logits).",
    ]
    return "\n".join(lines) + "\n"


def render_png(report: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = report["presets"]
    n = len(presets)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 4.2 * rows), squeeze=False)
    width = 0.38
    for ax, pr in zip(axes.flat, presets):
        ops = [o["op"] for o in pr["ops"]]
        xs = list(range(len(ops)))
        for shift, side, color in ((-width / 2, "padmoe", "tab:blue"), (width / 2, "eager", "tab:orange")):
            vals = [o[side]["tbps"] if o[side] and "tbps" in o[side] else 0.0 for o in pr["ops"]]
            ax.bar(
                [x + shift for x in xs],
                vals,
                width,
                label="padmoe" if side == "padmoe" else "PyTorch eager",
                color=color,
            )
        copy = pr["copy"]["tbps"]
        ax.axhline(copy, color="black", linestyle="--", linewidth=1)
        ax.text(-0.5, copy, f" copy {_fmt_tbps(copy)} TB/s", ha="left", va="bottom", fontsize=8)
        ax.set_xticks(xs)
        ax.set_xticklabels(ops, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("TB/s (floor bytes / time)")
        ax.set_title(
            f"{pr['preset']}: T={pr['T']} E={pr['E']} K={pr['K']} H={pr['H']} m={pr['alignment']}", fontsize=10
        )
        ax.set_ylim(0, max(copy, ax.get_ylim()[1]) * 1.3)  # room for the legend
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    meta = report["meta"]
    title = f"padmoe vs PyTorch eager — {meta['card']} — {meta['dtype']} — {meta['date']}"
    if not meta["padmoe_available"]:
        title += " (padmoe unavailable)"
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset",
        dest="presets",
        action="append",
        choices=list(PRESETS),
        help="preset to run (repeatable; default: all)",
    )
    p.add_argument("--small", action="store_true", help="divide T by 8")
    p.add_argument("--tokens", type=int, help="override T for every preset (after --small)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--ops", nargs="+", choices=OPS, default=OPS, help="ops to time (default: all)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flush-mib", type=int, default=256, help="CUDA: L2 flush buffer read before each timed run")
    p.add_argument("--copy-mib", type=int, help="copy-bandwidth buffer (default 1024 on CUDA, 128 on CPU)")
    p.add_argument("--threads", type=int, help="CPU: torch.set_num_threads")
    p.add_argument("--no-padmoe", action="store_true", help="time the eager side only")
    p.add_argument("--no-check", action="store_true", help="skip the padmoe-vs-eager output comparison")
    p.add_argument("--out-md", help="write the Markdown table here too")
    p.add_argument("--out-json", help="write the results as JSON")
    p.add_argument("--out-png", help="write the bar chart (matplotlib, Agg)")
    p.add_argument("--verbose", "-v", action="store_true", help="progress on stderr")
    args = p.parse_args(argv)
    args.presets = args.presets or list(PRESETS)
    if args.copy_mib is None:
        args.copy_mib = 1024 if args.device == "cuda" else 128
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.ops = [op for op in OPS if op in args.ops]

    eager = load_eager()
    padmoe, padmoe_error = (None, "--no-padmoe") if args.no_padmoe else load_padmoe(args.device)
    if padmoe is None:
        print(f"padmoe unavailable: {padmoe_error}; timing the eager side only", file=sys.stderr)

    timer = Timer(args.device, args.iters, args.warmup, args.flush_mib)
    if args.device == "cuda":
        timing = f"CUDA events, a {args.flush_mib} MiB read before each timed run (cold L2)"
    else:
        timing = f"time.perf_counter, warm caches, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
        if reuse_freed_host_memory():
            timing += ", glibc told to reuse freed memory (mallopt: no mmap, no trim)"
    report: Dict[str, Any] = {
        "meta": {
            "card": card_name(args.device),
            "device": args.device,
            "dtype": args.dtype,
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "iters": args.iters,
            "warmup": args.warmup,
            "timing": timing,
            "seed": args.seed,
            "ops": args.ops,
            "padmoe_available": padmoe is not None,
            "padmoe_error": padmoe_error,
            "padmoe_version": getattr(padmoe, "__version__", None) if padmoe else None,
            "padmoe_path": str(pathlib.Path(padmoe.__file__).parent) if padmoe else None,
        },
        "presets": [],
    }

    for name in args.presets:
        cfg = dict(PRESETS[name])
        if args.small:
            cfg["T"] = max(1, cfg["T"] // 8)
        if args.tokens:
            cfg["T"] = args.tokens
        if args.verbose:
            print(f"{name}: {cfg}", file=sys.stderr)
        report["presets"].append(run_preset(name, cfg, args, eager, padmoe, timer))

    md = render_markdown(report)
    sys.stdout.write(md)
    if args.out_md:
        pathlib.Path(args.out_md).write_text(md)
    if args.out_json:
        pathlib.Path(args.out_json).write_text(json.dumps(report, indent=1) + "\n")
    if args.out_png:
        render_png(report, args.out_png)
    mismatches = [
        (pr["preset"], o["op"])
        for pr in report["presets"]
        for o in pr["ops"]
        if o["check"].startswith(("MISMATCH", "error"))
    ]
    if mismatches:
        print(f"padmoe and eager disagree on: {mismatches}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
