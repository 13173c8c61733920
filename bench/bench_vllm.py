#!/usr/bin/env python3
"""padmoe.torch's vLLM drop-ins beside vLLM's own CUDA kernels on a GPU.

Ops: ``moe_align_block_size`` (vLLM's ``moe_align_block_size(topk_ids, num_experts, block_size,
sorted_token_ids, experts_ids, num_tokens_post_pad[, maybe_expert_map])``, its buffers allocated as
vLLM's Python wrapper allocates them: ``sorted_token_ids[R]``, ``R = T*K + E*(block-1)``
(``min(T*K*block, R)`` where ``T*K < E``), ``experts_ids[ceil(R / block)]``,
``num_tokens_post_pad[1]``, all ``torch.empty`` int32, no expert map) against
``padmoe.torch.moe_align_block_size(topk_ids, block, E, check=False)``; and, where vLLM's file has
it, ``batched_moe_align_block_size`` (``max_tokens_per_batch = T``, the per-expert counts of the
same routing as ``expert_num_tokens``, buffers ``E * round_up(T, block)`` and that over ``block``)
against ``padmoe.torch.batched_moe_align_block_size(T, block, counts, check=False)``. Per preset
``topk_ids`` int32 [T, K] from ``torch.randn(T, E).softmax(-1).topk(K)`` (fixed seed), blocks
``--blocks`` (16 and 128: the ends of the BLOCK_SIZE_M range of vLLM's fused MoE configs).

``eager``: one call at a time, output allocation included, CUDA events around the Python call
(host time included), each waited for, median of ``--iters`` after warm-up. ``graph``:
``--graph-inner`` calls in one CUDA graph, per call. Each (preset, op, block) first checks padmoe's
outputs against vLLM's on the entries vLLM defines: ``num_tokens_post_pad`` P exactly,
``experts_ids`` of the blocks below P / block exactly, ``sorted_token_ids`` below P as the same
multiset per expert region, padding sentinels included (vLLM's atomic kernel fixes no order within
an expert; its own test compares sorted per-expert lists); whether the order is also identical and
whether the entries past P agree is noted. A line is printed where they differ; the run goes on.

vLLM is not installed: ``--vllm-src`` names a source tree holding ``csrc/moe/moe_align_sum_kernels.cu``
(with ``csrc/cuda_compat.h``, ``csrc/dispatch_utils.h``, ``csrc/core/math.hpp``). That file is
built at run time with ``torch.utils.cpp_extension.load`` beside a binding written here (the
function declarations, read from the file's own definitions, registered as ``torch.ops`` under a
namespace of this script), include path ``<vllm-src>/csrc``, in a build directory under the
system's temporary directory, cached by the hash of sources, torch and arch. If it cannot be built
or fails a 4-token example, the reason is printed and padmoe is timed alone.

    PYTHONPATH=DIR python3 bench/bench_vllm.py --vllm-src VLLM_TREE --out-md vllm.md --out-json vllm.json
"""

import argparse
import datetime
import hashlib
import os
import pathlib
import re
import sys
import tempfile

import torch
from bench_te import eager_time, git_commit, graph_time, preset_names, run_presets, write_report  # as the TE page

PRESETS = {
    "mixtral-8x7b": dict(T=16384, E=8, K=2),
    "qwen3-30b-a3b": dict(T=16384, E=128, K=8),
    "deepseek-v3": dict(T=16384, E=256, K=8),
    "decode": dict(T=256, E=256, K=8),
}
VLLM_CU = "csrc/moe/moe_align_sum_kernels.cu"
VLLM_HEADERS = ("csrc/cuda_compat.h", "csrc/dispatch_utils.h", "csrc/core/math.hpp")
NS = "padmoe_bench_vllm"  # the namespace of the ops the binding registers (vLLM's own is _moe_C)
OPS = ("moe_align_block_size", "batched_moe_align_block_size")

# The binding: vLLM's host functions declared as the .cu defines them (the parameter lists are
# read from the file and pasted in by build_vllm), registered as CUDA ops of NS.
BINDING = r"""
#include <optional>
#include <torch/all.h>
#include <torch/library.h>

{declarations}

TORCH_LIBRARY({ns}, m) {{
{defs}
}}

TORCH_LIBRARY_IMPL({ns}, CUDA, m) {{
{impls}
}}
"""
SCHEMAS = {
    # the trailing Tensor? only where vLLM's function takes maybe_expert_map
    "moe_align_block_size": "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
    "Tensor(a!) sorted_token_ids, Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad{map}) -> ()",
    "batched_moe_align_block_size": "batched_moe_align_block_size(int max_tokens_per_batch, int block_size, "
    "Tensor expert_num_tokens, Tensor(a!) sorted_ids, Tensor(b!) expert_ids, Tensor(c!) num_tokens_post_pad) -> ()",
}


def cdiv(a, b):
    return -(-a // b)


def vllm_signatures(cu_text):
    """{op: parameter list} of vLLM's host functions in the .cu text (the text between the
    parentheses of ``void op(...) {``), for the ops of OPS it defines."""
    found = {}
    for op in OPS:
        m = re.search(r"(?m)^void\s+" + op + r"\s*\(([^)]*)\)\s*\{", cu_text)
        if m:
            found[op] = " ".join(m.group(1).split())
    return found


def binding_source(signatures):
    decls, defs, impls = [], [], []
    for op, params in signatures.items():
        decls.append(f"void {op}({params});")
        schema = SCHEMAS[op].format(map=", Tensor? maybe_expert_map" if "maybe_expert_map" in params else "")
        defs.append(f'  m.def("{schema}");')
        impls.append(f'  m.impl("{op}", &{op});')
    return BINDING.format(declarations="\n".join(decls), ns=NS, defs="\n".join(defs), impls="\n".join(impls))


def build_plan(vllm_src, arch):
    """(sources to write {name: text}, the .cu path, include dir, signatures, cache key) for the
    vLLM kernels in ``vllm_src``; raises where the tree lacks what the build needs."""
    cu = os.path.join(vllm_src, VLLM_CU)
    missing = [p for p in (VLLM_CU, *VLLM_HEADERS) if not os.path.isfile(os.path.join(vllm_src, p))]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} not found under {vllm_src} (is --vllm-src a vLLM tree?)")
    text = pathlib.Path(cu).read_text()
    signatures = vllm_signatures(text)
    if "moe_align_block_size" not in signatures:
        raise RuntimeError(f"{cu}: no 'void moe_align_block_size(...) {{' (a layout other than the one read here)")
    binding = binding_source(signatures)
    headers = "".join(pathlib.Path(vllm_src, h).read_text() for h in VLLM_HEADERS)
    key = f"{text}{headers}{binding}{torch.__version__}{torch.version.cuda}{arch}"
    return dict(binding=binding, cu=cu, include=os.path.join(vllm_src, "csrc"), signatures=signatures, key=key)


def build_vllm(vllm_src, arch, verbose=False):
    """vLLM's ops (``torch.ops.NS``) built from ``vllm_src`` for ``arch`` (e.g. "9.0"), and the
    signatures found. Built by torch.utils.cpp_extension.load in a directory under the system's
    temporary directory named by the hash of sources, torch and arch (a rerun loads the cached
    library)."""
    from torch.utils import cpp_extension

    plan = build_plan(vllm_src, arch)
    digest = hashlib.sha256(plan["key"].encode()).hexdigest()[:16]
    build = os.path.join(tempfile.gettempdir(), "padmoe-bench-vllm", digest)
    os.makedirs(build, exist_ok=True)
    binding = os.path.join(build, "padmoe_vllm_binding.cpp")
    if not os.path.isfile(binding) or pathlib.Path(binding).read_text() != plan["binding"]:
        pathlib.Path(binding).write_text(plan["binding"])
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        cpp_extension.load(
            name=f"padmoe_vllm_{digest}",
            sources=[binding, plan["cu"]],
            extra_include_paths=[plan["include"]],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            build_directory=build,
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    return getattr(torch.ops, NS), plan["signatures"]


class Vllm:
    """vLLM's ops called as vLLM's Python wrappers call them: output buffers allocated (torch.empty,
    int32, on topk_ids' device) in the sizes the wrappers use, then the op."""

    def __init__(self, ops, signatures):
        self.ops, self.with_map = ops, "maybe_expert_map" in signatures["moe_align_block_size"]
        self.batched = "batched_moe_align_block_size" in signatures

    def moe_align_block_size(self, topk_ids, block_size, num_experts):
        n = topk_ids.numel()
        rows = n + num_experts * (block_size - 1)
        if n < num_experts:
            rows = min(n * block_size, rows)
        opt = dict(dtype=torch.int32, device=topk_ids.device)
        sorted_ids, expert_ids = torch.empty((rows,), **opt), torch.empty((cdiv(rows, block_size),), **opt)
        post = torch.empty((1,), **opt)
        tail = (None,) if self.with_map else ()
        self.ops.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids, post, *tail)
        return sorted_ids, expert_ids, post

    def batched_moe_align_block_size(self, max_tokens_per_batch, block_size, expert_num_tokens):
        rows = expert_num_tokens.size(0) * cdiv(max_tokens_per_batch, block_size) * block_size
        opt = dict(dtype=torch.int32, device=expert_num_tokens.device)
        sorted_ids, expert_ids = torch.empty((rows,), **opt), torch.empty((rows // block_size,), **opt)
        post = torch.empty((1,), **opt)
        self.ops.batched_moe_align_block_size(
            max_tokens_per_batch, block_size, expert_num_tokens, sorted_ids, expert_ids, post
        )
        return sorted_ids, expert_ids, post


def workload(cfg, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    T, E, K = cfg["T"], cfg["E"], cfg["K"]
    top = torch.randn(T, E, device=device, generator=g).softmax(-1).topk(K, dim=-1).indices
    topk_ids = top.to(torch.int32).contiguous()
    counts = torch.bincount(topk_ids.flatten().long(), minlength=E).to(torch.int32)
    return dict(topk_ids=topk_ids, counts=counts)


def compare(ours, ref, block, n, ordered=False):
    """'' where padmoe's ``ours`` = (sorted_ids, expert_ids, post) agrees with vLLM's ``ref`` on
    the entries vLLM defines, else what differs; and a note (order, entries past P). ``n``: the
    sentinel (the number of real entries); ``ordered``: compare sorted_ids below P entry for entry
    (vLLM's batched kernel fixes the order) rather than as per-expert multisets."""
    (s, e, p), (rs, re_, rp) = ours, ref
    P, rP = int(p.reshape(-1)[0]), int(rp.reshape(-1)[0])
    if P != rP:
        return f"num_tokens_post_pad {P} != vLLM's {rP}", ""
    blocks = P // block
    if P % block or s.numel() < P or e.numel() < blocks or rs.numel() < P or re_.numel() < blocks:
        return f"num_tokens_post_pad {P}: not a multiple of {block} or past the buffers", ""
    if not torch.equal(e[:blocks], re_[:blocks]):
        bad = int((e[:blocks] != re_[:blocks]).sum())
        return f"experts_ids differ in {bad} of the {blocks} blocks below P", ""
    same_order = torch.equal(s[:P], rs[:P])
    if ordered and not same_order:
        return f"sorted_ids differ in {int((s[:P] != rs[:P]).sum())} of the {P} entries below P", ""
    if not same_order:
        # per expert region (blocks of one expert are contiguous), the same entries: sort the keys
        # expert * (n + 1) + entry of both sides (the sentinel n included)
        owner = e[:blocks].repeat_interleave(block).long() * (n + 1)
        mine, theirs = torch.sort(owner + s[:P].long()).values, torch.sort(owner + rs[:P].long()).values
        if not torch.equal(mine, theirs):
            return "sorted_token_ids below P: not the same entries per expert", ""
    notes = [] if same_order else ["order within experts differs"]
    tail_s = s.numel() == rs.numel() and torch.equal(s[P:], rs[P:])
    tail_e = e.numel() == re_.numel() and torch.equal(e[blocks:], re_[blocks:])
    if not (tail_s and tail_e):
        what = [w for w, ok in (("sorted_ids", tail_s), ("experts_ids", tail_e)) if not ok]
        vals = sorted({int(v) for v in re_[blocks:].unique()[:4]}) if not tail_e else []
        notes.append(f"past P {' and '.join(what)} differ" + (f" (vLLM's experts_ids there: {vals})" if vals else ""))
    return "", "; ".join(notes)


def cases(cfg, d, vllm, pm, blocks):
    """(op, block, impl, fn) for every op each side runs, vLLM's first."""
    T, E = cfg["T"], cfg["E"]
    x, counts = d["topk_ids"], d["counts"]
    out = []
    for b in blocks:
        if vllm is not None:
            out.append(("moe_align_block_size", b, "vLLM", lambda b=b: vllm.moe_align_block_size(x, b, E)))
        out.append(("moe_align_block_size", b, "padmoe", lambda b=b: pm.moe_align_block_size(x, b, E, check=False)))
    if vllm is not None and not vllm.batched:
        return out
    for b in blocks:
        if vllm is not None:
            out.append(
                ("batched_moe_align_block_size", b, "vLLM", lambda b=b: vllm.batched_moe_align_block_size(T, b, counts))
            )
        padmoe = lambda b=b: pm.batched_moe_align_block_size(T, b, counts, check=False)  # noqa: E731
        out.append(("batched_moe_align_block_size", b, "padmoe", padmoe))
    return out


def run_preset(name, cfg, args, vllm, pm):
    d = workload(cfg)
    n = d["topk_ids"].numel()
    rows, mismatches, ref = [], [], None
    for op, block, impl, fn in cases(cfg, d, vllm, pm, args.blocks):
        row = dict(preset=name, op=op, block=block, impl=impl, T=cfg["T"], E=cfg["E"], K=cfg["K"])
        try:
            got = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - report, time the rest
            got, row["error"] = None, repr(e)[:300]
            print(f"{name:14} {op:29} {block:4} {impl:7} failed: {repr(e)[:300]}", flush=True)
        if impl == "vLLM":
            ref = (op, block, got)
        elif ref is not None and ref[:2] == (op, block) and ref[2] is not None and got is not None:
            sentinel = cfg["E"] * cfg["T"] if op.startswith("batched") else n
            bad, note = compare(got, ref[2], block, sentinel, ordered=op.startswith("batched"))
            row["agreement"] = f"differs: {bad}" if bad else "agrees" + (f" ({note})" if note else "")
            if bad:
                mismatches.append(f"{name} {op} block {block}: {bad}")
                print(f"{name:14} MISMATCH {op} block {block}: {bad}", flush=True)
        if got is not None:
            for key, measure in (
                ("eager_us", lambda fn=fn: eager_time(fn, args.iters)),
                ("graph_us", lambda fn=fn: graph_time(fn, args.graph_inner)),
            ):
                try:
                    row[key] = measure()
                except Exception as e:  # noqa: BLE001 - report, keep the other figure
                    row[key], row[key + "_error"] = None, repr(e)[:300]
                    print(f"{name:14} {op:29} {block:4} {impl:7} {key}: failed: {repr(e)[:300]}", flush=True)
        rows.append(row)
        agreement = f"  {row['agreement']}" if "agreement" in row else ""
        print(f"{name:14} {op:29} {block:4} {impl:7} " + "  ".join(cells(row)) + agreement, flush=True)
    torch.cuda.empty_cache()
    return rows, mismatches


def cells(r):
    """µs for eager and graph; '-' where not timed."""
    return [f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in ("eager_us", "graph_us")]


def render_md(rep):
    src = f"vLLM {rep['vllm_src']} {rep['vllm_commit'] or ''}".rstrip() if rep["vllm_src"] else "no vLLM source"
    lines = [
        f"# padmoe.torch's vLLM drop-ins beside vLLM's kernels on {rep['card']} ({rep['date']})",
        "",
        f"torch {rep['torch']}, padmoe {rep['padmoe_commit'] or '(commit unknown)'}, {src}. int32 topk_ids; "
        f"eager: one call, output allocation and host included, median of {rep['iters']}; graph: "
        f"{rep['graph_inner']} calls in one CUDA graph, per call; padmoe with `check=False` "
        "(bench/bench_vllm.py's docstring says more).",
        "",
        *[f"- {k}: {v}" for k, v in rep["vllm_status"].items()],
        "",
        "| preset | op | block | impl | eager µs | graph µs |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {r['preset']} | {r['op']} | {r['block']} | {r['impl']} | {' | '.join(cells(r))} |" for r in rep["rows"]],
        "",
        "Agreement with vLLM's outputs (the entries vLLM defines):",
        "",
        *[
            f"- {r['preset']} {r['op']} block {r['block']}: {r['agreement']}"
            for r in rep["rows"]
            if r.get("agreement") is not None
        ],
        *(["", "Outputs that differ from vLLM's:", ""] if rep["mismatches"] else []),
        *[f"- {m}" for m in rep["mismatches"]],
    ]
    return "\n".join(lines) + "\n"


def vllm_commit(vllm_src):
    """The tree's commit: its git HEAD, else the first line of a COMMIT.txt at its root."""
    commit = git_commit(vllm_src, own_root=True)
    note = os.path.join(vllm_src, "COMMIT.txt")
    if commit is None and os.path.isfile(note):
        commit = (pathlib.Path(note).read_text().strip().splitlines() or [""])[0].strip()[:120] or None
    return commit


def load_vllm(vllm_src, verbose=False):
    """vLLM's ops (None where they cannot be built or run) and a status line. The built op must
    also align a 4-token example right before it is timed."""
    if not vllm_src:
        return None, {"vLLM": "not timed (no --vllm-src)"}
    arch = "{}.{}".format(*torch.cuda.get_device_capability())
    try:
        ops, signatures = build_vllm(vllm_src, arch, verbose)
        vllm = Vllm(ops, signatures)
    except Exception as e:  # noqa: BLE001 - time padmoe alone, with the reason
        msg = f"{e!r}"
        print(f"vLLM's kernels could not be built from {vllm_src}:\n{msg[-3000:]}", file=sys.stderr, flush=True)
        return None, {"vLLM": f"not timed: build failed: {msg[-400:]}"}
    try:
        topk_ids = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1]], dtype=torch.int32, device="cuda")
        s, e, p = vllm.moe_align_block_size(topk_ids, 4, 2)
        torch.cuda.synchronize()
        ok = int(p[0]) == 8 and e[:2].tolist() == [0, 1] and sorted(s[:4].tolist()) == [1, 2, 5, 6]
        if not ok or sorted(s[4:8].tolist()) != [0, 3, 4, 7]:
            raise RuntimeError(f"wrong outputs on a 4-token example: {s.tolist()}, {e.tolist()}, {p.tolist()}")
    except Exception as e:  # noqa: BLE001 - time padmoe alone, with the reason
        print(f"vLLM's kernels built but do not run here: {e!r}", file=sys.stderr, flush=True)
        return None, {"vLLM": f"not timed: {e!r}"[:400]}
    ops = ", ".join(
        f"{op}({'with' if 'maybe_expert_map' in sig else 'no'} expert map)" for op, sig in signatures.items()
    )
    return vllm, {"vLLM": f"built from {vllm_src}/{VLLM_CU} for sm_{arch.replace('.', '')}: {ops}"}


def dry_run(args):
    """The build plan without building or timing (no GPU needed): the signatures found, the binding
    and the load() arguments."""
    plan = build_plan(args.vllm_src, "9.0")
    print(f"vLLM source {args.vllm_src} ({vllm_commit(args.vllm_src) or 'commit unknown'})")
    print(f"sources: <build>/padmoe_vllm_binding.cpp, {plan['cu']}; include {plan['include']}")
    for op, params in plan["signatures"].items():
        print(f"  {op}({params})")
    print(plan["binding"])
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}")
    p.add_argument("--blocks", default="16,128", help="comma-separated block sizes (default 16,128)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--graph-inner", type=int, default=10)
    p.add_argument("--vllm-src", help="a vLLM source tree (its kernel file is built here, vLLM is not imported)")
    p.add_argument("--verbose-build", action="store_true", help="show the build's commands and compiler output")
    p.add_argument("--dry-run", action="store_true", help="print the build plan for --vllm-src and stop")
    p.add_argument("--out-md")
    p.add_argument("--out-json")
    args = p.parse_args(argv)
    presets = preset_names(p, args.presets, PRESETS)
    try:
        args.blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        p.error(f"--blocks: expected comma-separated integers, got {args.blocks}")
    if args.dry_run:
        if not args.vllm_src:
            p.error("--dry-run needs --vllm-src")
        return dry_run(args)
    if not torch.cuda.is_available():
        p.error("a CUDA device is needed")
    import padmoe.torch as pm

    vllm, vllm_status = load_vllm(args.vllm_src, args.verbose_build)
    print("\n".join(f"{k}: {v}" for k, v in vllm_status.items()), flush=True)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows, mismatches = run_presets(presets, lambda name: run_preset(name, PRESETS[name], args, vllm, pm))
    report = dict(card=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__)
    report.update(iters=args.iters, graph_inner=args.graph_inner, blocks=args.blocks)
    report.update(padmoe_commit=git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    report.update(vllm_src=args.vllm_src, vllm_commit=vllm_commit(args.vllm_src) if args.vllm_src else None)
    report.update(vllm_status=vllm_status, rows=rows, mismatches=mismatches)
    write_report(report, render_md(report), args.out_json, args.out_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
