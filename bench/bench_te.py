#!/usr/bin/env python3
"""padmoe.torch.transformer_engine beside TransformerEngine's own MoE permutation kernels on a GPU.

Per preset: bf16 rows ``x``; from ``torch.randn(T, E).softmax(-1).topk(K)`` (fixed seed) the bool
``routing_map`` [T, E], ``probs`` [T, E] float32 (the softmax where routed, else 0), the int32
``index`` [T, K] and its float32 ``weights``. Forms, each a permute then an unpermute on both sides
(``cases`` spells out the calls): ``mask``, ``with_probs``, ``padded/A`` (tokens_per_expert
``routing_map.sum(0)``; TE's exact-size form, read on the host, and padmoe's sync-free
``out_rows=T*K + E*(A-1)``) and ``index`` (padmoe also with ``num_experts=E``).

``fwd``, ``fwd+bwd`` (x and the probs requiring grad, a fixed random output gradient): one eager
call at a time, CUDA events around the Python call (host time included), median of ``--iters``
after warm-up, L2 warm. ``graph fwd``: ``--graph-inner`` forwards in one CUDA graph, per call (not
the exact-size padded forms: they read the host). padmoe runs with ``check=False`` where it takes
it. ``(xN)``: over the copy floor, bytes over the copy bandwidth of the same run (R rows permuted,
s = 2): forward ``2*(T + R)*H*s`` (the permute reads T rows and writes R, the unpermute the
reverse), backward the same plus ``R*H*s`` where merging probs make it read the forward's input.
Each preset first checks padmoe's forward outputs against TE's (permuted rows and probs bitwise,
unpermuted rows within bf16 rounding) and prints a line where they differ.

TE is not installed: ``--te-src`` names a source checkout, read at run time. Mask map: TE's Triton
kernels and wrappers (``transformer_engine/{common,pytorch}/triton/permutation.py``) are copied into
a temporary package tree of empty ``__init__.py``; TE's public functions
(``transformer_engine/pytorch/permutation.py``, which imports all of TE) are restated here: its
``torch.library`` custom ops, autograd and host logic, host reads included (``torch.equal``,
``.sum().item()``), argument checks and FP8 left out. Index map: ``permutation.cu`` up to ``void
nvte_permute(`` (kernels and launchers on raw pointers), its includes replaced by the few
definitions they use, built by nvcc into a cached library called through ctypes on the current
stream; TE's sort (``nvte_device_radix_sort_pairs``: CUB's radix sort of the ids as uint32, values
the row ids) is the same CUB call, on the current stream where TE passes none (the legacy default
stream, which a CUDA graph capture refuses). What cannot be loaded or built is skipped with the
reason printed, a call that fails is reported in its row; padmoe is timed regardless.

    PYTHONPATH=DIR python3 bench/bench_te.py --te-src TE_CHECKOUT --out-md te.md
"""

import argparse
import atexit
import ctypes
import datetime
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import types

import torch
from torch import Tensor

PRESETS = {
    "mixtral-8x7b": dict(T=16384, E=8, K=2, H=4096, aligns=(16, 128)),
    "qwen3-30b-a3b": dict(T=16384, E=128, K=8, H=2048, aligns=(16, 128)),
    "deepseek-v3": dict(T=16384, E=256, K=8, H=7168, aligns=(16, 128)),
    "decode": dict(T=256, E=256, K=8, H=7168, aligns=(16,)),
}
TE_TRITON = ("transformer_engine/common/triton/permutation.py", "transformer_engine/pytorch/triton/permutation.py")
TE_CUDA = "transformer_engine/common/permutation/permutation.cu"
TE_INCLUDES = ("#include <transformer_engine/permutation.h>", '#include "../common.h"')
NS = "padmoe_bench_te"  # the restated TE custom ops' namespace (TE's own is te_moe)
SCHEMAS = {
    "permute_mask_map_fwd": "(Tensor inp, Tensor routing_map, SymInt num_out_tokens, Tensor? probs, Tensor? pad_offsets) -> (Tensor, Tensor, Tensor)",
    "permute_mask_map_bwd": "(Tensor grad, Tensor? grad_probs, Tensor row_id_map, Tensor? pad_offsets, SymInt t, SymInt e, SymInt h) -> (Tensor, Tensor)",
    "unpermute_mask_map_fwd": "(Tensor inp, Tensor row_id_map, Tensor? merging_probs, SymInt t, SymInt e, SymInt h, Tensor? pad_offsets) -> Tensor",
    "unpermute_mask_map_bwd_with_probs": "(Tensor grad, Tensor row_id_map, Tensor fwd_input, Tensor merging_probs, Tensor? pad_offsets, SymInt t, SymInt e, SymInt rows, SymInt h) -> (Tensor, Tensor)",
    "unpermute_mask_map_bwd_no_probs": "(Tensor grad, Tensor row_id_map, Tensor? pad_offsets, SymInt t, SymInt e, SymInt rows, SymInt h) -> Tensor",
    "permute_index_map": "(Tensor inp, Tensor index, SymInt num_out_tokens, SymInt max_token_num) -> (Tensor, Tensor)",
    "permute_index_map_bwd": "(Tensor grad, Tensor row_id_map, SymInt t, SymInt k) -> Tensor",
    "unpermute_index_map_fwd": "(Tensor inp, Tensor row_id_map, Tensor probs, SymInt t, SymInt k) -> Tensor",
    "unpermute_index_map_bwd": "(Tensor grad, Tensor fwd_input, Tensor row_id_map, Tensor probs) -> (Tensor, Tensor)",
}

# What TE's kernels take from TE's headers: CUDA's types and two error macros. The macros throw;
# the extern "C" entry points turn that into a return code and padmoe_te_last_error().
CUDA_SHIM = r"""
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cub/cub.cuh>
#define NVTE_ERROR(msg) throw std::runtime_error(msg)
#define NVTE_CHECK_CUDA(x) do { cudaError_t e_ = (x); if (e_) throw std::runtime_error(cudaGetErrorString(e_)); } while (0)
"""
CUDA_ENTRY_POINTS = r"""
static std::string padmoe_te_error;
template <typename F> static int padmoe_te_guard(F f) {  // TE's errors (exceptions) as 1 and a message
  try { f(); return 0; } catch (const std::exception &e) { padmoe_te_error = e.what(); return 1; } }
extern "C" const char *padmoe_te_last_error() { return padmoe_te_error.c_str(); }
// TE's nvte_device_radix_sort_pairs (keys read as uint32: -1 sorts last), on the given stream
extern "C" int padmoe_te_sort_pairs(void *temp, size_t *bytes, const int *keys_in, int *keys_out, const int *values_in,
                                    int *values_out, int n, cudaStream_t stream) {
  return padmoe_te_guard([&] { NVTE_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(temp, *bytes,
      reinterpret_cast<const uint32_t *>(keys_in), reinterpret_cast<uint32_t *>(keys_out), values_in, values_out, n,
      0, 32, stream)); });
}
#define PADMOE_TE_ENTRY_POINTS(NAME, T) \
  extern "C" int padmoe_te_permute_##NAME(const void *in, void *out, const int *sorted_row_id, int *row_id_map, \
      const float *prob, float *prob_grad, const void *in_fwd, int rows, int top_k, int cols, int out_tokens, \
      cudaStream_t stream) { \
    return padmoe_te_guard([&] { nvte_permute_launcher<T>(static_cast<const T *>(in), static_cast<T *>(out), \
        sorted_row_id, row_id_map, prob, prob_grad, static_cast<const T *>(in_fwd), rows, top_k, cols, \
        out_tokens, stream); }); } \
  extern "C" int padmoe_te_unpermute_##NAME(const void *in, void *out, int *row_id_map, const float *prob, \
      int rows, int top_k, int cols, cudaStream_t stream) { \
    return padmoe_te_guard([&] { nvte_unpermute_launcher<T>(static_cast<const T *>(in), static_cast<T *>(out), \
        row_id_map, prob, rows, top_k, cols, stream); }); }
PADMOE_TE_ENTRY_POINTS(bf16, __nv_bfloat16)
PADMOE_TE_ENTRY_POINTS(f32, float)
"""
# packaging.version.parse as TE's kernels use it (on Triton's version), where packaging is absent
PACKAGING_STUB = 'import re\n\n\ndef parse(v):\n    return tuple(int(n) for n in re.findall(r"\\d+", v)[:3])\n'


def load_te_triton(te_src):
    """TE's Triton wrappers without the rest of TE: the two modules in a temporary package tree of
    empty ``__init__.py`` (TE's own import whole subpackages), first on sys.path."""
    root = tempfile.mkdtemp(prefix="padmoe-bench-te-")
    atexit.register(shutil.rmtree, root, True)
    for rel in TE_TRITON:
        src, dst = os.path.join(te_src, rel), os.path.join(root, rel)
        if not os.path.isfile(src):
            raise FileNotFoundError(f"{src} not found (is --te-src a TransformerEngine checkout?)")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
    stubs = {os.path.join(d, "__init__.py"): "" for d, _, _ in os.walk(os.path.join(root, "transformer_engine"))}
    try:
        import packaging.version  # noqa: F401
    except ImportError:
        os.makedirs(os.path.join(root, "packaging"))
        stubs[os.path.join(root, "packaging", "__init__.py")] = ""
        stubs[os.path.join(root, "packaging", "version.py")] = PACKAGING_STUB
    for path, text in stubs.items():
        pathlib.Path(path).write_text(text)
    sys.path.insert(0, root)
    return importlib.import_module("transformer_engine.pytorch.triton.permutation")


def build_te_cuda(te_src, arch):
    """TE's index-map kernels as a ctypes library: TE's permutation.cu up to ``void nvte_permute(``,
    its two includes replaced by CUDA_SHIM, then CUDA_ENTRY_POINTS, built by nvcc for ``arch`` (sm_90
    on H100 and H200) and cached in the temporary directory under the hash of source, arch and nvcc."""
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.isfile(nvcc):
        raise RuntimeError("nvcc not found (not on PATH nor in $CUDA_HOME/bin)")
    path = os.path.join(te_src, TE_CUDA)
    head, cut, _ = pathlib.Path(path).read_text().partition("\nvoid nvte_permute(")
    missing = ([] if cut else ["void nvte_permute("]) + [i for i in TE_INCLUDES if i not in head]
    if missing:
        raise RuntimeError(f"{path}: no {missing[0]!r} (a layout other than the one this script reads)")
    src = head.replace(TE_INCLUDES[0], CUDA_SHIM).replace(TE_INCLUDES[1], "") + CUDA_ENTRY_POINTS
    cache = os.path.join(tempfile.gettempdir(), "padmoe-bench-te")
    so = os.path.join(cache, f"te_permutation_{hashlib.sha256(f'{src}{arch}{nvcc}'.encode()).hexdigest()[:16]}.so")
    if not os.path.isfile(so):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cu, out = os.path.join(tmp, "te_permutation.cu"), os.path.join(tmp, "te_permutation.so")
            pathlib.Path(cu).write_text(src)
            cmd = [nvcc, "-O3", f"-arch={arch}", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-o", out, cu]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{(r.stderr or r.stdout)[-2000:]}")
            os.replace(out, so)  # atomic: a concurrent run loads the whole library or builds its own
    lib = ctypes.CDLL(so)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.padmoe_te_last_error.restype = ctypes.c_char_p
    lib.padmoe_te_sort_pairs.argtypes = [P, ctypes.POINTER(ctypes.c_size_t), P, P, P, P, I, P]
    for dt in ("bf16", "f32"):
        getattr(lib, f"padmoe_te_permute_{dt}").argtypes = [P] * 7 + [I] * 4 + [P]
        getattr(lib, f"padmoe_te_unpermute_{dt}").argtypes = [P] * 4 + [I] * 3 + [P]
    return lib


def te_api(tp, lib):
    """TE's public functions over its Triton wrappers ``tp`` (mask map) and CUDA kernels ``lib`` (index
    map), either None when absent: TE's custom ops (here under NS; they return tensors, an empty one
    for None), their autograd and TE's host logic."""
    ops = getattr(torch.ops, NS)

    def define(name, fn, backward=None, setup=None):
        op = torch.library.custom_op(f"{NS}::{name}", fn, mutates_args=(), schema=SCHEMAS[name])
        if backward is not None:
            op.register_autograd(backward, setup_context=setup)

    if tp is not None:

        def permute_mask(inp, routing_map, n_out, probs, pad_offsets):
            (t, h), e = inp.shape, routing_map.size(1)
            row_id_map = tp.make_row_id_map(routing_map, t, e)
            out, _, moved = tp.permute_with_mask_map(inp, row_id_map, probs, None, pad_offsets, t, e, n_out, h, None)
            return out, row_id_map, moved if moved is not None else torch.empty(0, device=inp.device)

        def permute_mask_bwd(grad, grad_probs, row_id_map, pad_offsets, t, e, h):
            act, probs_grad = tp.unpermute_with_mask_map(grad, row_id_map, None, grad_probs, pad_offsets, t, e, h)
            return act, probs_grad if probs_grad is not None else torch.empty(0, device=grad.device)

        def permute_mask_setup(ctx, inputs, output):
            inp, routing_map, _, probs, pad_offsets = inputs
            ctx.save_for_backward(output[1], pad_offsets)
            ctx.dims = (inp.size(0), routing_map.size(1), inp.size(1))
            ctx.needs_probs_grad = probs is not None and probs.requires_grad

        def permute_mask_backward(ctx, grad, _grad_map, grad_probs):
            given = grad_probs if grad_probs.numel() > 0 else None
            act, probs_grad = ops.permute_mask_map_bwd(grad, given, *ctx.saved_tensors, *ctx.dims)
            return act, None, None, probs_grad if ctx.needs_probs_grad and probs_grad.numel() else None, None

        def unpermute_mask(inp, row_id_map, merging_probs, t, e, h, pad_offsets):
            return tp.unpermute_with_mask_map(inp, row_id_map, merging_probs, None, pad_offsets, t, e, h)[0]

        def unpermute_mask_bwd_no_probs(grad, row_id_map, pad_offsets, t, e, rows, h):
            return tp.permute_with_mask_map(grad, row_id_map, None, None, pad_offsets, t, e, rows, h, None)[0]

        def unpermute_mask_setup(ctx, inputs, output):
            inp, row_id_map, merging_probs, t, e, h, pad_offsets = inputs
            ctx.dims, ctx.with_probs = (t, e, inp.size(0), h), merging_probs is not None
            ctx.needs_probs_grad = ctx.with_probs and merging_probs.requires_grad
            # saved in the order of the backward ops' arguments
            ctx.save_for_backward(row_id_map, *((inp, merging_probs) if ctx.with_probs else ()), pad_offsets)

        def unpermute_mask_backward(ctx, grad):
            if not ctx.with_probs:
                return ops.unpermute_mask_map_bwd_no_probs(grad, *ctx.saved_tensors, *ctx.dims), *[None] * 6
            act, probs_grad = ops.unpermute_mask_map_bwd_with_probs(grad, *ctx.saved_tensors, *ctx.dims)
            return act, None, probs_grad if ctx.needs_probs_grad else None, *[None] * 4

        define("permute_mask_map_fwd", permute_mask, permute_mask_backward, permute_mask_setup)
        define("permute_mask_map_bwd", permute_mask_bwd)
        define("unpermute_mask_map_fwd", unpermute_mask, unpermute_mask_backward, unpermute_mask_setup)
        define("unpermute_mask_map_bwd_with_probs", tp.unpermute_with_mask_map_bwd_with_merging_probs)
        define("unpermute_mask_map_bwd_no_probs", unpermute_mask_bwd_no_probs)

    if lib is not None:
        workspace = {"n": 0}  # TE's module-level sort workspace: kept, grown to the largest T*K seen
        suffix = {None: "", torch.bfloat16: "_bf16", torch.float32: "_f32"}  # the kernels' row types

        def launch(name, dtype, *args):  # a tensor passes its data pointer, null if empty (TE's TensorWrapper)
            fn = getattr(lib, f"padmoe_te_{name}{suffix[dtype]}")
            ptrs = [(a.data_ptr() if a.numel() else None) if isinstance(a, Tensor) else a for a in args]
            if fn(*ptrs, torch.cuda.current_stream().cuda_stream):
                raise RuntimeError(f"TE's {name}: {lib.padmoe_te_last_error().decode()}")

        def unpermute_index(inp, row_id_map, probs, t, k):  # TE's moe_unpermute_fwd (C++)
            out = torch.empty((t, inp.size(1)), dtype=inp.dtype, device=inp.device)
            launch("unpermute", inp.dtype, inp, out, row_id_map, probs, t, k, inp.size(1))
            return out

        def permute_index(inp, index, num_out_tokens, max_token_num):  # TE's moe_permute_fwd (C++)
            index = index if index.dtype == torch.int32 else index.to(torch.int32)
            (t, h), k, ws = inp.shape, index.size(1), workspace
            n = max(max_token_num, t) * k
            if ws["n"] < n:
                i32 = dict(dtype=torch.int32, device=inp.device)
                nbytes = ctypes.c_size_t(0)
                launch("sort_pairs", None, None, ctypes.byref(nbytes), None, None, None, None, n)
                # sorted keys, the row ids 0..n-1 (values in), the sorted row ids (values out)
                ws.update(n=n, sort=(torch.empty(n, **i32), torch.arange(n, **i32), torch.empty(n, **i32)))
                ws["temp"] = torch.empty(nbytes.value, dtype=torch.int8, device=inp.device)
            nbytes = ctypes.c_size_t(ws["temp"].numel())
            launch("sort_pairs", None, ws["temp"], ctypes.byref(nbytes), index, *ws["sort"], t * k)
            rows = num_out_tokens if num_out_tokens > 0 else t * k
            out = torch.empty((rows, h), dtype=inp.dtype, device=inp.device)
            row_id_map = torch.empty(t * k, dtype=torch.int32, device=inp.device)
            launch("permute", inp.dtype, inp, out, ws["sort"][2], row_id_map, None, None, None, t, k, h, rows)
            return out, row_id_map

        def unpermute_index_bwd(grad, fwd_input, row_id_map, probs):  # TE's moe_unpermute_bwd (C++)
            (t, k), h = (probs.shape if probs.numel() > 0 else (row_id_map.size(0), 1)), grad.size(1)
            act = torch.empty((fwd_input.size(0), h), dtype=grad.dtype, device=grad.device)
            probs_grad = torch.empty((t, k), dtype=torch.float32, device=grad.device)
            launch("permute", grad.dtype, grad, act, None, row_id_map, probs, probs_grad, fwd_input, t, k, h, 0)
            return act, probs_grad

        def permute_index_setup(ctx, inputs, output):
            ctx.save_for_backward(output[1])
            ctx.dims = tuple(inputs[1].shape)

        def permute_index_backward(ctx, grad, _grad_map):
            (row_id_map,) = ctx.saved_tensors
            return ops.permute_index_map_bwd(grad.contiguous(), row_id_map, *ctx.dims), None, None, None

        def unpermute_index_setup(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:3])
            ctx.needs_probs_grad = inputs[2].requires_grad

        def unpermute_index_backward(ctx, grad):
            act, probs_grad = ops.unpermute_index_map_bwd(grad.contiguous(), *ctx.saved_tensors)
            return act, None, probs_grad if ctx.needs_probs_grad else None, None, None

        define("permute_index_map", permute_index, permute_index_backward, permute_index_setup)
        define("permute_index_map_bwd", lambda grad, rim, t, k: unpermute_index(grad, rim, None, t, k))
        define("unpermute_index_map_fwd", unpermute_index, unpermute_index_backward, unpermute_index_setup)
        define("unpermute_index_map_bwd", unpermute_index_bwd)

    def moe_permute(inp, routing_map, num_out_tokens, max_token_num=-1, map_type="mask"):
        if map_type == "index":
            return ops.permute_index_map(inp, routing_map, num_out_tokens, max_token_num)
        out, row_id_map, _ = ops.permute_mask_map_fwd(inp, routing_map, num_out_tokens, None, None)
        return out, row_id_map

    def moe_permute_with_probs(inp, probs, routing_map, num_out_tokens):
        out, row_id_map, moved = ops.permute_mask_map_fwd(inp, routing_map, num_out_tokens, probs, None)
        return out, moved, row_id_map

    def moe_permute_and_pad_with_probs(inp, probs, routing_map, tokens_per_expert, align_size):
        if tokens_per_expert.device != inp.device:
            tokens_per_expert = tokens_per_expert.to(inp.device)
        target = (torch.ceil(tokens_per_expert / align_size) * align_size).long()
        if torch.equal(tokens_per_expert, target):  # TE's first host read
            pad_offsets = None
        else:
            cum_pad = torch.cumsum(target - tokens_per_expert, dim=0)
            pad_offsets = torch.cat([torch.zeros(1, dtype=cum_pad.dtype, device=inp.device), cum_pad[:-1]])
        rows = target.sum().item()  # TE's second
        out, row_id_map, moved = ops.permute_mask_map_fwd(inp, routing_map, rows, probs, pad_offsets)
        return out, moved, row_id_map, pad_offsets, target

    def moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask", pad_offsets=None):
        if map_type == "index":
            if merging_probs is None:
                t, k, merging_probs = row_id_map.size(0), 1, torch.empty(0, device=inp.device)
            else:
                merging_probs = merging_probs if merging_probs.dtype == torch.float32 else merging_probs.float()
                t, k = merging_probs.shape
            return ops.unpermute_index_map_fwd(inp, row_id_map, merging_probs, t, k)
        t, h = restore_shape if restore_shape is not None else inp.shape
        e = (row_id_map.size(1) - 1) // 2 if row_id_map.dim() > 1 else 0
        return ops.unpermute_mask_map_fwd(inp, row_id_map, merging_probs, t, e, h, pad_offsets)

    api = (moe_permute, moe_permute_with_probs, moe_permute_and_pad_with_probs, moe_unpermute)
    return types.SimpleNamespace(mask=tp is not None, index=lib is not None, **{f.__name__: f for f in api})


def eager_time(fn, iters, warm=5, per=1):
    """Median µs of ``fn()`` between two CUDA events, each waited for (nothing queued ahead), over
    ``iters`` calls after ``warm`` more; divided by ``per``."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / per)
    return statistics.median(ts)


def graph_time(fn, inner, reps=20):
    s = torch.cuda.Stream()  # warm-up on a side stream before capture, as torch.cuda.graphs asks
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    return eager_time(g.replay, reps, warm=1, per=inner)


def copy_bandwidth():
    x, y = (torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda") for _ in range(2))
    return 2 * x.numel() / (eager_time(lambda: y.copy_(x), 20) * 1e-6)  # bytes/s, read + write


def workload(cfg, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, E, K, H = cfg["T"], cfg["E"], cfg["K"], cfg["H"]
    soft = torch.randn(T, E, device="cuda", generator=g).softmax(-1)
    weights, top = soft.topk(K, dim=-1)
    routing_map = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, top, True)
    x, gout = (torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    probs = torch.where(routing_map, soft, 0.0)
    return dict(x=x, gout=gout, routing_map=routing_map, probs=probs, index=top.to(torch.int32), weights=weights)


def cases(cfg, d, te, pte):
    """(form, impl, fn(x, p) -> (permuted, permuted probs or None, unpermuted), p, rows R of the
    permuted tensor, merging probs?, capturable?) for every form either side runs, TE's first."""
    T, E, K = cfg["T"], cfg["E"], cfg["K"]
    rmap, probs, weights = d["routing_map"], d["probs"], d["weights"]
    tokens_per_expert = rmap.sum(0)

    def mask(api, x, p):
        y, row_id_map = api.moe_permute(x, rmap, T * K)
        return y, None, api.moe_unpermute(y, row_id_map, merging_probs=p, restore_shape=x.shape)

    def with_probs(api, x, p):
        y, moved, row_id_map = api.moe_permute_with_probs(x, p, rmap, T * K)
        return y, moved, api.moe_unpermute(y, row_id_map, restore_shape=x.shape)

    def padded(api, align, x, p, **kw):
        y, moved, row_id_map, pads, _ = api.moe_permute_and_pad_with_probs(x, p, rmap, tokens_per_expert, align, **kw)
        return y, moved, api.moe_unpermute(y, row_id_map, merging_probs=p, restore_shape=x.shape, pad_offsets=pads)

    def index(api, x, p, **kw):
        y, row_id_map = api.moe_permute(x, d["index"], 0, map_type="index", **kw)
        return y, None, api.moe_unpermute(y, row_id_map, merging_probs=p, map_type="index")

    P = functools.partial
    sides = [(te, "TE")] if te is not None and te.mask else []
    out = [("mask", impl, P(mask, api), probs, T * K, True, True) for api, impl in sides + [(pte, "padmoe")]]
    out += [("with_probs", i, P(with_probs, api), probs, T * K, False, True) for api, i in sides + [(pte, "padmoe")]]
    for a in cfg["aligns"]:
        rows, bound = int(((tokens_per_expert + a - 1) // a * a).sum()), T * K + E * (a - 1)
        if sides:
            out.append((f"padded/{a}", "TE", P(padded, te, a), probs, rows, True, False))
        out.append((f"padded/{a}", "padmoe", P(padded, pte, a, check=False), probs, rows, True, False))
        sync_free = P(padded, pte, a, out_rows=bound, check=False)
        out.append((f"padded/{a}", "padmoe out_rows", sync_free, probs, bound, True, True))
    if te is not None and te.index:
        out.append(("index", "TE (CUDA)", P(index, te), weights, T * K, True, True))
    out.append(("index", "padmoe", P(index, pte), weights, T * K, True, True))
    out.append(("index", "padmoe num_experts", P(index, pte, num_experts=E, check=False), weights, T * K, True, True))
    return out


def check_agreement(name, cfg, d, table):
    """padmoe's forwards against TE's, form by form: permuted rows and probs bitwise (TE's rows
    first, for the sync-free padded form), unpermuted rows within the bf16 rounding of K weighted
    rows summed (TE's index path sums in bf16). Returns the lines of what differs."""
    x, scale = d["x"], 2**-8 * cfg["K"] * float(d["x"].abs().max())
    ref, checked, bad = None, [], []
    for form, impl, fn, p, _, merging, _ in table:
        try:
            y, moved, out = fn(x, p)
        except Exception as e:  # noqa: BLE001 - report, time the rest
            bad.append(f"{form} {impl}: forward failed: {repr(e)[:300]}")
            continue
        if impl.startswith("TE"):
            ref = (form, y, moved, out, scale * (float(p.abs().max()) if merging else 1.0))
            checked.append(form)
            continue
        if ref is None or ref[0] != form:
            continue
        _, ry, rmoved, rout, tol = ref
        head = y[: ry.shape[0]]
        if head.shape != ry.shape or not torch.equal(head, ry):
            what = f"{int((head != ry).any(1).sum())} rows" if head.shape == ry.shape else f"shape {list(y.shape)}"
            bad.append(f"{form} {impl}: permuted rows differ from TE's ({what} of {ry.shape[0]})")
        if rmoved is not None and not torch.equal(moved[: rmoved.shape[0]], rmoved):
            bad.append(f"{form} {impl}: permuted probs differ from TE's")
        if not torch.allclose(out.float(), rout.float(), rtol=2**-6, atol=tol):
            err = float((out.float() - rout.float()).abs().max())
            bad.append(f"{form} {impl}: unpermuted rows differ from TE's by up to {err:.3g} (atol {tol:.3g})")
    for line in bad:
        print(f"{name:14} MISMATCH {line}", flush=True)
    if checked and not bad:
        print(f"{name:14} padmoe's forward outputs agree with TE's ({', '.join(checked)})", flush=True)
    return [f"{name}: {line}" for line in bad]


def run_preset(name, cfg, args, bw, te, pte):
    d = workload(cfg)
    T, H, s, rows = cfg["T"], cfg["H"], 2, []
    table = cases(cfg, d, te, pte)
    mismatches = check_agreement(name, cfg, d, table)
    for form, impl, fn, p, R, merging, capturable in table:
        floor = 2 * (T + R) * H * s / bw * 1e6  # the forward's; the backward's adds R*H*s with merging probs
        row = dict(preset=name, form=form, impl=impl, rows=R, floor_fwd_us=floor)
        row["floor_fwd_bwd_us"] = 2 * floor + (R * H * s / bw * 1e6 if merging else 0.0)
        xr, pr = d["x"].clone().requires_grad_(True), p.clone().requires_grad_(True)
        fwd = functools.partial(fn, d["x"], p)

        def step(fn=fn, xr=xr, pr=pr):
            xr.grad = pr.grad = None  # no AccumulateGrad add kernels: the gradients are new each step
            fn(xr, pr)[2].backward(d["gout"])

        timings = {"fwd_us": lambda: eager_time(fwd, args.iters), "fwd_bwd_us": lambda: eager_time(step, args.iters)}
        if capturable:
            timings["graph_fwd_us"] = lambda: graph_time(fwd, args.graph_inner)
        for key, measure in timings.items():
            try:
                row[key] = measure()
            except Exception as e:  # noqa: BLE001 - report, keep the other figures
                row[key], row[key + "_error"] = None, repr(e)[:300]
                print(f"{name:14} {form:12} {impl:20} {key}: failed: {repr(e)[:300]}", flush=True)
        rows.append(row)
        print(f"{name:14} {form:12} {impl:20} R {R:7d}  " + "  ".join(cells(row)), flush=True)
    torch.cuda.empty_cache()
    return rows, mismatches


def cells(r):
    """'µs (xN over the floor)' for fwd, fwd+bwd and graph fwd; '-' where not timed."""
    keys = (("fwd_us", "floor_fwd_us"), ("fwd_bwd_us", "floor_fwd_bwd_us"), ("graph_fwd_us", "floor_fwd_us"))
    return [f"{r[k]:.1f} (x{r[k] / r[f]:.2f})" if r.get(k) is not None else "-" for k, f in keys]


def render_md(rep):
    te = f"TE {rep['te_src']} {rep['te_commit'] or ''}".rstrip() if rep["te_src"] else "no TE source"
    lines = [
        f"# padmoe.torch.transformer_engine beside TransformerEngine on {rep['card']} ({rep['date']})",
        "",
        f"torch {rep['torch']}, triton {rep['triton']}, copy {rep['copy_tbps']:.2f} TB/s, padmoe "
        f"{rep['padmoe_commit'] or '(commit unknown)'}, {te}. bf16; eager: one call, host included, median of "
        f"{rep['iters']}; graph: {rep['graph_inner']} forwards in one CUDA graph, per call; (xN): over the copy "
        "floor; R: rows permuted; padmoe with `check=False` (bench/bench_te.py's docstring says more).",
        "",
        *[f"- {k}: {v}" for k, v in rep["te_status"].items()],
        "",
        "| preset | form | impl | R | fwd µs | fwd+bwd µs | graph fwd µs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {r['preset']} | {r['form']} | {r['impl']} | {r['rows']} | {' | '.join(cells(r))} |" for r in rep["rows"]],
        *(["", "Forward outputs that differ from TE's:", ""] if rep["mismatches"] else []),
        *[f"- {m}" for m in rep["mismatches"]],
    ]
    return "\n".join(lines) + "\n"


def git_commit(path, own_root=False):
    """The short HEAD commit of the git checkout holding ``path`` (None without one). With
    ``own_root``, only of a checkout rooted at ``path``: a tree copied into another repository
    names no commit of its own."""
    if not shutil.which("git"):
        return None
    if own_root:
        top = subprocess.run(["git", "-C", path, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if top.returncode or os.path.realpath(top.stdout.strip()) != os.path.realpath(path):
            return None
    r = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def load_te(te_src):
    """TE's restated API over what loads (None if nothing does) and a status line per piece. The
    CUDA library must also permute a 4-token example right: a library that built but cannot run
    here (a driver older than the compiler) is skipped before timing."""
    if not te_src:
        return None, {"TE": "not timed (no --te-src)"}
    tp = lib = None
    status = {"TE mask map (Triton)": f"loaded from {te_src}", "TE index map (CUDA)": f"built from {te_src}/{TE_CUDA}"}
    try:
        tp = load_te_triton(te_src)
    except Exception as e:  # noqa: BLE001 - skip TE's Triton rows with the reason
        status["TE mask map (Triton)"] = f"skipped: {e!r}"[:400]
    try:
        lib = build_te_cuda(te_src, "sm_{}{}".format(*torch.cuda.get_device_capability()))
    except Exception as e:  # noqa: BLE001 - skip TE's CUDA rows with the reason
        status["TE index map (CUDA)"] = f"skipped: {e!r}"[:400]
    te = te_api(tp, lib) if tp is not None or lib is not None else None
    x = torch.arange(32, device="cuda", dtype=torch.bfloat16).view(4, 8)
    index = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1]], dtype=torch.int32, device="cuda")
    try:
        if lib is not None and not torch.equal(te.moe_permute(x, index, 0, map_type="index")[0], x[[0, 1, 2, 3] * 2]):
            raise RuntimeError("wrong rows on a 4-token example")
    except Exception as e:  # noqa: BLE001 - skip TE's CUDA rows with the reason
        te.index = False
        status["TE index map (CUDA)"] = f"skipped: {e!r}"[:400]
    return te, status


def preset_names(parser, arg, table):
    """The comma-separated preset names of ``arg``, each a key of ``table`` (else a usage error)."""
    names = arg.split(",")
    if any(n not in table for n in names):
        parser.error(f"--presets: expected names among {', '.join(table)}, got {arg}")
    return names


def run_presets(names, run):
    """``run(name) -> (rows, mismatches)`` for each preset in order, both lists concatenated."""
    rows, mismatches = [], []
    for name in names:
        r, m = run(name)
        rows, mismatches = rows + r, mismatches + m
    return rows, mismatches


def write_report(report, md, out_json, out_md):
    """The report as JSON to ``out_json`` and its page ``md`` to ``out_md`` (where given), and
    the page printed."""
    if out_json:
        pathlib.Path(out_json).write_text(json.dumps(report, indent=1))
    if out_md:
        pathlib.Path(out_md).write_text(md)
    print(md)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--graph-inner", type=int, default=10)
    p.add_argument("--te-src", help="a TransformerEngine source checkout (its files are read, TE is not imported)")
    p.add_argument("--out-md")
    p.add_argument("--out-json")
    args = p.parse_args(argv)
    presets = preset_names(p, args.presets, PRESETS)
    if not torch.cuda.is_available():
        p.error("a CUDA device is needed")
    import padmoe.torch.transformer_engine as pte

    te, te_status = load_te(args.te_src)
    print("\n".join(f"{k}: {v}" for k, v in te_status.items()), flush=True)
    triton = importlib.util.find_spec("triton") and importlib.import_module("triton")
    triton_version = triton.__version__ if triton else "(not installed)"
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy {bw / 1e12:.2f} TB/s  torch {torch.__version__}", flush=True)
    rows, mismatches = run_presets(presets, lambda name: run_preset(name, PRESETS[name], args, bw, te, pte))
    report = dict(card=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), copy_tbps=bw / 1e12)
    report.update(torch=torch.__version__, triton=triton_version, iters=args.iters, graph_inner=args.graph_inner)
    report.update(padmoe_commit=git_commit(os.path.dirname(os.path.abspath(__file__))), te_src=args.te_src)
    report.update(te_commit=git_commit(args.te_src, own_root=True) if args.te_src else None, te_status=te_status)
    report.update(rows=rows, mismatches=mismatches)
    write_report(report, render_md(report), args.out_json, args.out_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
