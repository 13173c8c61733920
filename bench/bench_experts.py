"""The expert MLP on padmoe's routing, per shape, in one run: the dense ``torch.mm`` rate and the copy
bandwidth (the floors); each of the six GEMMs alone (torch's ``grouped_mm`` on the same rows), the
routing ops alone and the activation alone; padmoe's expert MLP operator (``experts_forward`` with the
gate given by name, what ``GroupedExperts`` and the transformers integration run) and the autograd
composition (the same call with the gate as a callable): eager forward and forward + backward (the host
included), the forward replayed in a CUDA graph, the peak memory of forward + backward; and the operator's
forward + backward with ``recompute_rows=True``.

    python bench/bench_experts.py [--shapes qwen3-30b-a3b,mixtral-8x7b,deepseek-v3,decode] [--iters 10]
           [--json FILE] [--vllm-src TREE]

Shapes (bf16, top-k softmax router weights, alignment 128, gated SiLU, ``[E, out, in]`` weights):
qwen3-30b-a3b T=16384 H=2048 I=768 E=128 K=8; mixtral-8x7b T=4096 H=4096 I=14336 E=8 K=2; deepseek-v3
T=4096 H=7168 I=2048 E=256 K=8; decode T=256 with deepseek-v3's sizes (forward only). The floor of a
GEMM is the larger of its FLOPs (over the real rows, A = T*K) at the dense rate and its bytes (operands
and output) at the copy bandwidth; the MLP's floor sums its GEMMs' (two forward, six forward + backward).
The sum of parts is the GEMMs alone plus the routing ops alone (make_plan, dispatch, combine; backward:
combine_backward, dispatch_backward).

``--vllm-src TREE`` also times vLLM's Triton fused MoE forward beside the operator's, without vLLM
installed: TREE is a vLLM source tree (a git checkout, or a copy of its files with the commit on the
first line of a COMMIT.txt at its root) holding ``vllm/model_executor/layers/fused_moe/fused_moe.py``.
That file is parsed with ``ast``: the ``@triton.jit`` function ``fused_moe_kernel``, every module-level
``@triton.jit`` helper it calls (transitively) and the module-level constants they read are executed in
a fresh namespace holding only ``triton`` and ``triton.language as tl`` (at their own line numbers of
that file, so Triton and tracebacks read the file itself); ``get_default_config`` (plain Python) is
extracted the same way, with vLLM's environment as seen here (no batch-invariant mode; ROCm when torch
is a ROCm build). The forward is composed as vLLM's ``fused_experts`` runs its unquantized bf16 path:
block sizes from ``get_default_config(M=T, E, N=I, K=H, topk=K, dtype=None)`` (vLLM would take a tuned
JSON file for the device and shape instead where one exists); ``moe_align_block_size`` with that
BLOCK_SIZE_M (padmoe's drop-in, ``padmoe.torch.moe_align_block_size``, vLLM's semantics; vLLM's
token-wise assignment for ``T*K*4 <= E`` applies to none of these shapes); the first
``fused_moe_kernel`` launch (x @ w1 into ``[T, K, 2I]``, not weighted); SiLU-and-mul as torch ops,
``F.silu(g) * u`` over the two halves (vLLM's CUDA ``silu_and_mul`` is not available standalone); the
second launch (``[T*K, I] @ w2`` with MUL_ROUTED_WEIGHT into ``[T, K, H]``); and ``.sum(1)`` (vLLM's
``moe_sum``). Each launch passes every kernel parameter by keyword, as the tree's kernel names them
(``num_warps`` / ``num_stages`` from the config; no quantization, bias, tensor descriptors or swapped
operands), with the grid and EM of vLLM's ``invoke_fused_moe_triton_kernel``. The weights are the
operator's (``up`` ``[E, 2I, H]`` is vLLM's w1, ``down`` ``[E, H, I]`` its w2), the router weights
float32 and the ids int32 as vLLM's top-k gives them. vLLM's output is first checked against the
operator's on the same inputs (relative Frobenius error; above 1e-2 a line is printed and vLLM's times
are marked), then timed with the same eager / graph forward timing, and each of its two GEMM launches
alone. Where the kernel cannot be extracted (it reads a name that is neither a module-level definition
of the file nor ``triton`` / ``tl``), or it fails to run, the reason is printed and the rest runs
without vLLM.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import inspect
import json
import os
import sys
import types

import torch
import torch.nn.functional as F
from bench_te import copy_bandwidth, eager_time, graph_time  # the timing of the TE page

import padmoe.torch as pt
from padmoe.torch import _expert_mlp
from padmoe.torch._common import plan_args
from padmoe.torch._expert_mlp import KINDS, _mm, _mm_dgrad, _mm_wgrad
from padmoe.torch._gather_gemm import triton_gather_up
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
GATHER_PAYS = _expert_mlp.gather_pays  # the operator's choice of the gather-fused up projection


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


# vLLM's Triton fused MoE (--vllm-src): read from the user's vLLM tree at run time, vLLM not imported.
VLLM_FUSED_MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
VLLM_KERNEL, VLLM_CONFIG = "fused_moe_kernel", "get_default_config"
VLLM_TOLERANCE = 1e-2  # relative (Frobenius) error of vLLM's output against the operator's (bf16)
# The entries of vLLM's config that go to the launch rather than to a kernel parameter; the config's
# other entries that are no kernel parameter are dropped (as vLLM's launcher drops USE_TMA).
VLLM_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _names_read(node):
    """The names a module-level definition reads without binding them itself (parameters, assigned
    locals, loop and comprehension targets, nested lambdas' parameters and the like are bound)."""
    bound, read = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.Name):
            (read if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not node:
            bound.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            read.update(n.names)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        bound.discard(node.name)  # a recursive call is to the module-level definition
    return read - bound


def _is_triton_jit(node):
    for d in getattr(node, "decorator_list", ()):
        f = d.func if isinstance(d, ast.Call) else d
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "jit"
            and isinstance(f.value, ast.Name)
            and f.value.id == "triton"
        ):
            return True
    return False


def extract_definitions(module, roots, provided, jit_only):
    """The module-level statements (in file order) defining ``roots`` and, transitively, every
    module-level function or constant they read. ``provided``: names the namespace supplies.
    ``jit_only``: the functions must all be ``@triton.jit``. Raises LookupError naming what cannot be
    had this way (an import of the file, a name bound elsewhere than at module level)."""
    defs, imported = {}, set()
    for stmt in module.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            defs.update((t.id, stmt) for t in stmt.targets)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            defs[stmt.target.id] = stmt
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    need, todo, missing = {}, list(roots), []
    while todo:
        name = todo.pop()
        if name in need or name in provided or (name not in defs and hasattr(builtins, name)):
            continue
        stmt = defs.get(name)
        if stmt is None:
            missing.append(f"{name} ({'imported by the file' if name in imported else 'not defined at module level'})")
            continue
        if jit_only and isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not _is_triton_jit(stmt):
                missing.append(f"{name} (not a @triton.jit function)")
                continue
        need[name] = stmt
        todo.extend(_names_read(stmt))
    if missing:
        raise LookupError(f"{', '.join(roots)} (or what it calls) reads {', '.join(sorted(set(missing)))}")
    chosen = {id(stmt) for stmt in need.values()}
    return [stmt for stmt in module.body if id(stmt) in chosen]


def exec_definitions(path, module, lines, stmts, namespace):
    """Executes ``stmts`` of the file ``path`` (parsed: ``module``, its ``lines``) in ``namespace``,
    each at its own line numbers (the other lines blank), with the file's own ``__future__`` imports
    (and not this script's): ``inspect.getsource``, which Triton's JIT reads, and tracebacks see the
    file itself."""
    future = [st for st in module.body if isinstance(st, ast.ImportFrom) and st.module == "__future__"]
    keep = [""] * len(lines)
    for stmt in future + list(stmts):
        first = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", ())])
        keep[first - 1 : stmt.end_lineno] = lines[first - 1 : stmt.end_lineno]
    exec(compile("\n".join(keep) + "\n", path, "exec", dont_inherit=True), namespace)
    return namespace


class _VllmPlatform:
    """vLLM's ``current_platform`` as far as its config rule asks: the torch build's."""

    @staticmethod
    def is_rocm():
        return torch.version.hip is not None

    @staticmethod
    def is_cuda():
        return torch.version.hip is None and torch.version.cuda is not None

    @staticmethod
    def is_cuda_alike():
        return torch.version.hip is not None or torch.version.cuda is not None


def _next_power_of_2(n):
    return 1 if n < 1 else 1 << (n - 1).bit_length()


# What the extracted get_default_config may read besides the file's own definitions: vLLM's
# environment as it would be here (default environment variables, no batch-invariant mode).
VLLM_CONFIG_ENV = dict(
    envs=types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
    current_platform=_VllmPlatform,
    next_power_of_2=_next_power_of_2,
    vllm_is_batch_invariant=lambda: False,
)


# fused_moe_kernel's arguments that are the same at every launch of the unquantized path (no scales,
# bias, tensor descriptors, swapped operands or token-wise assignment), by the kernel's parameter names.
VLLM_FIXED_ARGS = dict(
    b_desc=None,
    b_bias_ptr=None,
    a_scale_ptr=None,
    b_scale_ptr=None,
    a_desc=None,
    stride_asm=0,
    stride_ask=0,
    stride_bse=0,
    stride_bsk=0,
    stride_bsn=0,
    stride_bbe=0,
    stride_bbn=0,
    group_n=0,
    group_k=0,
    naive_block_assignment=False,
    SPLIT_K=1,
    use_fp8_w8a8=False,
    use_int8_w8a8=False,
    use_int8_w8a16=False,
    per_channel_quant=False,
    HAS_BIAS=False,
    SWAP_AB=False,
    USE_TD=False,
    USE_TMA_B=False,
    USE_TMA_A=False,
    C_IS_SORTED=False,
)
# Those that follow the launch's tensors (VllmFusedMoe.gemm), and those the config gives.
VLLM_LAUNCH_ARGS = (
    "a_ptr b_ptr c_ptr topk_weights_ptr sorted_token_ids_ptr expert_ids_ptr num_tokens_post_padded_ptr N K EM "
    "num_valid_tokens stride_am stride_ak stride_be stride_bk stride_bn stride_cm stride_cn MUL_ROUTED_WEIGHT top_k "
    "compute_type"
).split()
VLLM_CONFIG_ARGS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")


class VllmFusedMoe:
    """vLLM's ``fused_moe_kernel`` and ``get_default_config`` from a vLLM tree, and the unquantized
    forward of vLLM's ``fused_experts`` composed from them (see the module docstring)."""

    def __init__(self, kernel, default_config):
        import triton.language as tl

        self.kernel, self.default_config = kernel, default_config
        self.compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
        self.params = inspect.signature(kernel.fn).parameters
        self.config_params = inspect.signature(default_config).parameters
        known = set(VLLM_FIXED_ARGS) | set(VLLM_LAUNCH_ARGS) | set(VLLM_CONFIG_ARGS)
        unknown = [n for n, p in self.params.items() if n not in known and p.default is inspect.Parameter.empty]
        if unknown:
            raise LookupError(f"{VLLM_KERNEL} takes parameters this script does not know: {', '.join(unknown)}")
        self.defaulted = [n for n in self.params if n not in known]  # left at the kernel's defaults

    def config(self, T, E, H, I, K):
        """vLLM's default config for the shape: ``get_default_config`` called as
        ``try_get_optimal_moe_config`` calls it (M = tokens, N = w2's last dim, K = w1's last dim;
        dtype None: bf16 / fp16 without quantization)."""
        args = dict(M=T, E=E, N=I, K=H, topk=K, dtype=None, block_shape=None, is_marlin=False)
        return dict(self.default_config(**{k: v for k, v in args.items() if k in self.config_params}))

    def align(self, topk_ids, config, num_experts):
        """(sorted_token_ids, expert_ids, num_tokens_post_padded) for the config's BLOCK_SIZE_M, as
        vLLM's fused_experts asks them (no expert map)."""
        return pt.moe_align_block_size(
            topk_ids, config["BLOCK_SIZE_M"], num_experts, None, ignore_invalid_experts=True, check=False
        )

    def gemm(self, A, B, C, topk_weights, align, mul_routed_weight, top_k, config):
        """One ``fused_moe_kernel`` launch as vLLM's ``invoke_fused_moe_triton_kernel`` makes it on the
        unquantized path: C[token * top_k + k] = A[token] @ B[expert]^T over the aligned blocks."""
        sorted_ids, expert_ids, post = align
        block_m = config["BLOCK_SIZE_M"]
        EM = sorted_ids.size(0)
        if A.size(0) < block_m:  # vLLM's small-batch bound on the blocks launched
            EM = min(EM, A.size(0) * top_k * block_m)
        values = dict(VLLM_FIXED_ARGS)
        values.update(
            a_ptr=A,
            b_ptr=B,
            c_ptr=C,
            topk_weights_ptr=topk_weights,
            sorted_token_ids_ptr=sorted_ids,
            expert_ids_ptr=expert_ids,
            num_tokens_post_padded_ptr=post,
            N=B.size(1),
            K=B.size(2),
            EM=EM,
            num_valid_tokens=A.size(0) * top_k,
            stride_am=A.stride(0),
            stride_ak=A.stride(1),
            stride_be=B.stride(0),
            stride_bk=B.stride(2),
            stride_bn=B.stride(1),
            stride_cm=C.stride(1),
            stride_cn=C.stride(2),
            MUL_ROUTED_WEIGHT=mul_routed_weight,
            top_k=top_k,
            compute_type=self.compute_type[A.dtype],
        )
        values.update((k, v) for k, v in config.items() if k in VLLM_CONFIG_ARGS)
        kwargs = {n: values[n] for n in self.params if n in values}
        kwargs.update((k, config[k]) for k in VLLM_LAUNCH_OPTIONS if k in config)
        grid = (-(-EM // block_m) * -(-B.size(1) // config["BLOCK_SIZE_N"]),)
        self.kernel[grid](**kwargs)

    def forward(self, x, topk_ids, topk_weights, w1, w2, config):
        """vLLM's fused_experts (unquantized, no expert map): [T, H] from x [T, H], ids int32 and
        weights float32 [T, K], w1 [E, 2I, H], w2 [E, H, I]."""
        T, H = x.shape
        E, N, _ = w1.shape
        K = topk_ids.size(1)
        align = self.align(topk_ids, config, E)
        cache13 = torch.empty(T * K * max(N, H), device=x.device, dtype=x.dtype)  # as vLLM shares it
        c1, c3 = cache13[: T * K * N].view(T, K, N), cache13[: T * K * H].view(T, K, H)
        self.gemm(x, w1, c1, topk_weights, align, False, K, config)
        g, u = c1.view(-1, N).chunk(2, dim=-1)
        c2 = F.silu(g) * u
        self.gemm(c2, w2, c3, topk_weights, align, True, 1, config)
        return c3.sum(1)


def load_vllm_fused_moe(vllm_src):
    """(VllmFusedMoe or None, a status line) from the vLLM tree ``vllm_src``; never raises."""
    path = os.path.join(vllm_src, VLLM_FUSED_MOE)
    try:
        import triton
        import triton.language as tl

        with open(path) as f:
            text = f.read()
        module = ast.parse(text, path)
        lines = text.splitlines()
        kernel_env = dict(triton=triton, tl=tl)
        kernel_stmts = extract_definitions(module, [VLLM_KERNEL], kernel_env, jit_only=True)
        config_stmts = extract_definitions(module, [VLLM_CONFIG], VLLM_CONFIG_ENV, jit_only=False)
        ns = exec_definitions(path, module, lines, kernel_stmts, dict(kernel_env, __name__="padmoe_bench_vllm_kernel"))
        cns = exec_definitions(
            path, module, lines, config_stmts, dict(VLLM_CONFIG_ENV, __name__="padmoe_bench_vllm_config")
        )
        vllm = VllmFusedMoe(ns[VLLM_KERNEL], cns[VLLM_CONFIG])
    except Exception as e:  # noqa: BLE001 - the benchmark goes on without vLLM, with the reason
        return None, f"vLLM fused_moe: not timed: {type(e).__name__}: {e}"
    from bench_vllm import vllm_commit  # the tree's git HEAD, else its COMMIT.txt

    def names(stmts):
        return ", ".join(n for st in stmts for n in (_assigned(st) if not hasattr(st, "name") else [st.name]))

    commit = vllm_commit(vllm_src) or "commit unknown"
    status = f"vLLM fused_moe from {path} ({commit}): kernel {names(kernel_stmts)}; config {names(config_stmts)}"
    if vllm.defaulted:
        status += f"; kernel parameters left at their defaults: {', '.join(vllm.defaulted)}"
    return vllm, status


def _assigned(stmt):
    return [t.id for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]) if isinstance(t, ast.Name)]


def run_vllm(vllm, name, s, x, idx, w, up, down, iters):
    """vLLM's fused MoE forward on the shape's inputs: its config, its error against padmoe's
    operator, eager / graph forward µs and each GEMM launch alone (µs)."""
    T, H, I, E, K = s["T"], s["H"], s["I"], s["E"], s["K"]
    ids, wts = idx.to(torch.int32).contiguous(), w.float().contiguous()
    config = vllm.config(T, E, H, I, K)
    out = dict(config=config)
    with torch.no_grad():
        ref = experts_forward(x, idx, w, up, down, gate="silu", alignment=ALIGN, check=False).float()
        got = vllm.forward(x, ids, wts, up, down, config).float()
    out["rel_err"] = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    out["match"] = out["rel_err"] <= VLLM_TOLERANCE
    if not out["match"]:
        print(
            f"vLLM fused_moe {name}: relative error {out['rel_err']:.2e} against padmoe's operator "
            f"(over {VLLM_TOLERANCE:g}); its times are marked",
            flush=True,
        )

    def fwd():
        with torch.no_grad():
            return vllm.forward(x, ids, wts, up, down, config)

    out["fwd_us"] = eager_time(fwd, iters)
    out["graph_fwd_us"] = graph_time(fwd, 1, iters)
    align = vllm.align(ids, config, E)
    c1 = torch.empty(T, K, 2 * I, device=x.device, dtype=x.dtype)
    c3 = torch.empty(T, K, H, device=x.device, dtype=x.dtype)
    out["gemm1_us"] = eager_time(lambda: vllm.gemm(x, up, c1, wts, align, False, K, config), iters)
    g, u = c1.view(-1, 2 * I).chunk(2, dim=-1)
    a = F.silu(g) * u  # the second GEMM's input as the forward makes it
    out["gemm2_us"] = eager_time(lambda: vllm.gemm(a, down, c3, wts, align, True, 1, config), iters)
    return out


def run_shape(name, s, iters, rate, bw, vllm=None):
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
    # The operator with its choice forced: dispatch + torch's GEMM, or the gather-fused up projection
    # (where it applies: forward without gradients, and recompute_rows).
    forms["operator_dispatch"] = forms["operator_gather"] = forms["operator"]
    forms["recompute_gather"] = forms["recompute"]
    for form, call in forms.items():
        if form.startswith("recompute") and not s["backward"]:
            continue
        _expert_mlp.gather_pays = {"operator_dispatch": lambda *a: False, "operator_gather": lambda *a: True,
                                   "recompute_gather": lambda *a: True}.get(form, GATHER_PAYS)  # fmt: skip

        def fwd():
            with torch.no_grad():
                return call(x, w)

        if not form.startswith("recompute"):  # the same forward as the operator's
            row[f"{form}_fwd_us"] = eager_time(fwd, iters)
            row[f"{form}_graph_fwd_us"] = graph_time(fwd, 1, iters)
        if s["backward"] and form != "operator_gather":  # (its forward + backward is the operator's)

            def fwd_bwd():
                out = call(xg, wg)
                out.backward(torch.ones_like(out))
                xg.grad = wg.grad = up.grad = down.grad = None

            row[f"{form}_fwd_bwd_us"] = eager_time(fwd_bwd, iters, warm=1)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            row[f"{form}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    _expert_mlp.gather_pays = GATHER_PAYS
    if vllm is not None:
        try:
            row["vllm"] = run_vllm(vllm, name, s, x, idx, w, up.detach(), down.detach(), iters)
        except Exception as e:  # noqa: BLE001 - the other shapes and tables go on without it
            print(f"vLLM fused_moe {name}: failed: {type(e).__name__}: {e}", flush=True)
            row["vllm"] = dict(error=f"{type(e).__name__}: {e}")
    return row


def fmt(r, c):
    fb = r.get(f"{c}_fwd_bwd_us")
    tail = f"{fb:.0f} ({r[f'{c}_peak_mib']:.0f})" if fb is not None else "-"
    return f"{r[f'{c}_fwd_us']:.0f} / {r[f'{c}_graph_fwd_us']:.0f} / {tail}"


def print_vllm(rows, status):
    """vLLM's fused MoE forward beside the operator's, per shape."""
    print(f"\n{status}")
    print(
        "\n| shape | vLLM config (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, warps, stages) | vLLM error vs operator "
        "| vllm fused_moe fwd / graph fwd µs | operator fwd / graph fwd µs | vLLM over operator fwd / graph "
        "| vLLM GEMM1 / GEMM2 µs | padmoe up / down grouped_mm µs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        v = r.get("vllm")
        if v is None or "error" in v:
            why = (v["error"].splitlines() or ["failed"])[0][:120].replace("|", "/") if v else "not run"
            print(f"| {r['shape']} | - | {why} | - | - | - | - | - |")
            continue
        c = v["config"]
        cfg = "/".join(str(c.get(k, "-")) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"))
        cfg += f", {c.get('GROUP_SIZE_M', '-')}, {c.get('num_warps', '-')}, {c.get('num_stages', '-')}"
        mark = "" if v["match"] else " (mismatch)"
        p = r["parts"]
        print(
            f"| {r['shape']} | {cfg} | {v['rel_err']:.1e}{mark} | {v['fwd_us']:.0f} / {v['graph_fwd_us']:.0f}{mark} "
            f"| {r['operator_fwd_us']:.0f} / {r['operator_graph_fwd_us']:.0f} "
            f"| {v['fwd_us'] / r['operator_fwd_us']:.2f}x / {v['graph_fwd_us'] / r['operator_graph_fwd_us']:.2f}x "
            f"| {v['gemm1_us']:.0f} / {v['gemm2_us']:.0f} | {p['up'][0]:.0f} / {p['down'][0]:.0f} |"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--vllm-src",
        default=None,
        metavar="TREE",
        help="a vLLM source tree: time vLLM's Triton fused MoE forward beside the operator's (vLLM not imported)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_experts: needs a CUDA device", file=sys.stderr)
        return 2
    vllm, vllm_status = load_vllm_fused_moe(args.vllm_src) if args.vllm_src else (None, None)
    rate, bw = dense_rate(), copy_bandwidth()
    print(
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"dense bf16 mm {rate / 1e12:.0f} TFLOP/s  copy {bw / 1e9:.0f} GB/s"
    )
    if vllm_status:
        print(vllm_status, flush=True)
    rows = []
    for n in args.shapes.split(","):  # each shape's numbers as they come (a long run may be cut short)
        rows.append(run_shape(n, SHAPES[n], args.iters, rate, bw, vllm))
        print(f"# {n}: {json.dumps(rows[-1], default=str)}", flush=True)
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
    print(
        "operator with the gather-fused up projection, fwd / graph fwd µs: "
        + ", ".join(
            f"{r['shape']} {r['operator_gather_fwd_us']:.0f} / {r['operator_gather_graph_fwd_us']:.0f}" for r in rows
        )
    )
    print(
        "recompute_rows=True with the gather-fused GEMMs, forward + backward µs (peak MiB): "
        + ", ".join(
            f"{r['shape']} {r['recompute_gather_fwd_bwd_us']:.0f} ({r['recompute_gather_peak_mib']:.0f})"
            for r in rows
            if "recompute_gather_fwd_bwd_us" in r
        )
    )
    if vllm_status:
        print_vllm(rows, vllm_status)
    if args.json:
        report = dict(dense_flops=rate, copy_bytes_per_s=bw, rows=rows)
        if vllm_status:
            report.update(vllm_src=args.vllm_src, vllm_status=vllm_status)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
