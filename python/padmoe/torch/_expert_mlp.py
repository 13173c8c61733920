"""The expert MLP as one autograd operator: routing, both grouped GEMMs, the activation and the combine,
with a hand-written backward. :func:`padmoe.torch.experts_forward` (so ``GroupedExperts`` and the
transformers integration) runs it for activations given by name; a callable gate or activation, a
``post`` function or the segment-loop GEMM keep the autograd composition.

Forward (T tokens, K top-k, H hidden, I intermediate, N1 = 2I gated or I, R padded rows)::

    rows = dispatch(x)                     [R, H]   (weighted by the router weights: "before")
    h    = grouped_mm(rows, up)            [R, N1]
    a    = act(g) * u   or   act(h + b_up) [R, I]   one pass (g, u: halves of h + b_up, side by side or interleaved)
    ys   = grouped_mm(a, down)  + b_down   [R, H]
    out  = combine(ys)                     [T, H]   (weighted: "after")

Backward, each GEMM once and in the layout its operands have (no transposed copies, no slicing
copies, no zero-filled halves)::

    grad_ys, grad_w = combine_backward(grad_out, ys)          one read of grad_out
    grad_a          = grouped_mm(grad_ys, down^T)
    grad_h, a       = activation_backward(h + b_up, grad_a)   one pass: grad_h [R, N1] whole, a recomputed
    grad_down       = grad_ys^T a  (or a^T grad_ys)           per segment, the weight's own layout
    grad_up         = grad_h^T rows                            likewise
    grad_rows       = grouped_mm(grad_h, up^T)
    grad_x, grad_w  = dispatch_backward(grad_rows)

With the router weights applied after the experts, their gradient wanted, no down bias and I < H
(``fold_weights``: qwen3-30b-a3b, deepseek-v3), the weights fold into the activation's pass instead,
and ys is never read (nor kept)::

    grad_ys                 = dispatch(grad_out)                      unweighted
    grad_a                  = grouped_mm(grad_ys, down^T)
    grad_h, w*a, grad_w     = activation_backward(h + b_up, grad_a, w)  grad_w[a] = <grad_a, a> of its row
    grad_down               = grad_ys^T (w*a)

On CUDA (bf16 / fp16, an alignment that is a multiple of 16) where padding rows dominate (decode),
or without gradients where the up projection is narrow and its tiles full height (qwen3-30b-a3b;
``_gather_gemm.gather_pays``), the up projection reads x's rows through the plan instead
(``padmoe/_triton_gather_gemm.py``, the gather in the GEMM's A-load, tiles of padding skipped):
without gradients with the activation in its epilogue (``a = act(x[sources] @ up)``: neither the
rows nor h written); with gradients and ``recompute_rows``, writing h, and the backward's ``grad_up``
reads x through the plan as well. Otherwise the rows are dispatched for torch's GEMM.

Saved for the backward: x, the dispatched rows, h and, where the router weights' gradient reads it
and the weights are not folded, ys (``a`` is recomputed in the activation's backward pass instead
of kept: ``R * I`` elements less than the composition keeps); with
``recompute_rows`` no rows are kept (``R * H`` elements fewer): read through the plan, or dispatched
again. The activation runs in float32 and rounds once (the composition rounds ``act(g)`` before the product, so results
differ from it by bf16 rounding). Every sum is a GEMM's or padmoe's, in a fixed order: bitwise
deterministic. Rows at or past P are neither computed nor read.

On CUDA the activation is a Triton kernel (``padmoe/_triton_activation.py``); on the CPU the same
formulas as float32 torch operations. Both passes are custom operators (``padmoe_experts::activation``
and ``activation_backward``) that torch.compile sees, so the whole operator traces under
``torch.compile(fullgraph=True)``; in eager mode their bodies are called directly (less host time).
It captures in a CUDA graph (no host synchronization on CUDA).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._common import call, compiling, eager_mode, fake_plan_sizes, packed, plan_args, plan_slices
from ._gather_gemm import _gather_up_call, _gather_wgrad_call, gather_config, gather_pays, up_width

Tensor = torch.Tensor

# name -> the activation code the Triton kernels (padmoe/_triton_activation.py) and _act take
KINDS = {
    "silu": 0,
    "swish": 0,
    "gelu": 1,
    "gelu_tanh": 2,
    "gelu_pytorch_tanh": 2,
    "relu": 3,
    "relu2": 4,
    "sigmoid": 5,
    "identity": 6,
    "clamped_swiglu": 7,
}
CLAMPED_SWIGLU = 7

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# ---------------------------------------------------------------------------
# The activation: float32 torch operations (CPU) or the Triton kernels (CUDA)
# ---------------------------------------------------------------------------


def _act(g: Tensor, kind: int, alpha: float, limit: float, deriv: bool):
    """(act(g), act'(g) or None without ``deriv``) in float32 (for clamped_swiglu: the gate's
    factor, with the clamp's mask)."""
    if kind == 0:
        s = torch.sigmoid(g)
        return g * s, (s * (1 + g * (1 - s)) if deriv else None)
    if kind == 1:
        c = 0.5 * (1 + torch.erf(g * _INV_SQRT_2))
        return g * c, (c + g * torch.exp(-0.5 * g * g) * _INV_SQRT_2PI if deriv else None)
    if kind == 2:
        t = torch.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g))
        if not deriv:
            return 0.5 * g * (1 + t), None
        d = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g)
        return 0.5 * g * (1 + t), d
    if kind == 3:
        return torch.relu(g), ((g > 0).to(g.dtype) if deriv else None)
    if kind == 4:
        r = torch.relu(g)
        return r * r, (2 * r if deriv else None)
    if kind == 5:
        s = torch.sigmoid(g)
        return s, (s * (1 - s) if deriv else None)
    if kind == 6:
        return g, (torch.ones_like(g) if deriv else None)
    gc = g.clamp(max=limit)
    s = torch.sigmoid(alpha * gc)
    return gc * s, (torch.where(g <= limit, s * (1 + alpha * gc * (1 - s)), 0.0) if deriv else None)


def _halves(h: Tensor, gated: bool, interleaved: bool):
    if not gated:
        return h, None
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    n = h.shape[1] // 2
    return h[:, :n], h[:, n:]


def _up(u: Tensor, kind: int, limit: float):
    """The up half as the product uses it, and its derivative's mask."""
    if kind != CLAMPED_SWIGLU:
        return u, None
    return u.clamp(-limit, limit) + 1, ((u >= -limit) & (u <= limit)).to(u.dtype)


def _live_rows(offsets: Tensor, rows: int) -> int:
    return min(int(offsets[-1]), rows) if offsets.numel() else 0


def _inputs(h, bias, row_experts, p):
    """h's first p rows in float32, plus each row's expert's bias when given (none on padding rows)."""
    hf = h[:p].float()
    if bias is not None:
        hf = hf + _bias_rows(bias, row_experts[:p]).float()
    return hf


def _torch_forward(h, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit):
    width = h.shape[1] // 2 if gated else h.shape[1]
    a = h.new_empty(h.shape[0], width)
    p = _live_rows(offsets, h.shape[0])
    g, u = _halves(_inputs(h, bias, row_experts, p), gated, interleaved)
    y, _ = _act(g, kind, alpha, limit, False)
    if gated:
        y = y * _up(u, kind, limit)[0]
    a[:p] = y
    return a


def _torch_backward(h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit, fold=None):
    """``(grad_h, a)``; with ``fold = (row_sources, weights, assignments)`` (see act_backward_kernel's
    WEIGHTED) ``(grad_h, w_r * a, grad_weights[assignments])``."""
    grad_h = torch.empty_like(h)
    a = h.new_empty(grad_a.shape)
    p = _live_rows(offsets, h.shape[0])
    g, u = _halves(_inputs(h, bias, row_experts, p), gated, interleaved)
    ga = grad_a[:p].float()
    y, d = _act(g, kind, alpha, limit, True)
    if fold is not None:
        sources, weights, assignments = fold
        src = sources[:p].long()
        has = src >= 0
        wr = torch.where(has, weights.reshape(-1)[src.clamp(min=0)].float(), 0.0)
        full = y * _up(u, kind, limit)[0] if gated else y
        grad_w = torch.zeros(assignments, dtype=torch.float32, device=h.device)
        grad_w[src[has]] = (ga * full).sum(1)[has]
        ga = ga * wr[:, None]
    if gated:
        uu, mask = _up(u, kind, limit)
        dg, du = _halves(grad_h[:p], gated, interleaved)
        dg.copy_(ga * uu * d)
        du.copy_(ga * y if mask is None else ga * y * mask)
        y = y * uu
    else:
        grad_h[:p] = ga * d
    if fold is not None:
        a[:p] = y * wr[:, None]
        return grad_h, a, grad_w.to(weights.dtype)
    a[:p] = y
    return grad_h, a


def _bias_args(h, bias, row_experts):
    """The kernels' (bias, row_experts, stride) arguments: h stands in for absent ones."""
    if bias is None:
        return h, h, 0, False
    bias = bias.contiguous()
    return bias, row_experts, bias.stride(0), True


def triton_forward(h, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit) -> Tensor:
    """The forward pass as the Triton kernel (CUDA tensors; CPU tensors in Triton's interpreter)."""
    from padmoe import _triton_activation as ta

    width = h.shape[1] // 2 if gated else h.shape[1]
    a = h.new_empty(h.shape[0], width)
    if h.shape[0] and width:
        br, bc, grid = ta.blocks(h.shape[0], width)
        b, rx, sb, has = _bias_args(h, bias, row_experts)
        ta.act_forward_kernel[grid](
            h, a, offsets, b, rx, offsets.shape[0], width, h.stride(0), a.stride(0), sb, float(alpha), float(limit),
            BIAS=has, KIND=kind, GATED=gated, INTERLEAVED=interleaved, BLOCK_R=br, BLOCK_C=bc,
        )  # fmt: skip
    return a


def triton_backward(h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit, fold=None):
    """The backward pass as the Triton kernel: ``(grad_h, a)``, or with ``fold`` (as
    :func:`_torch_backward`) ``(grad_h, w_r * a, grad_weights)``: the kernel writes each row's dot
    products by column block, summed here in a fixed order."""
    from padmoe import _triton_activation as ta

    width = grad_a.shape[1]
    grad_h = torch.empty_like(h)
    a = h.new_empty(grad_a.shape)
    br, bc, grid = ta.blocks(h.shape[0], width)
    dots = sources = weights = None
    if fold is not None:
        sources, weights, assignments = fold
        weights = weights.reshape(-1)
        dots = torch.zeros(assignments, grid[1], dtype=torch.float32, device=h.device)
    if h.shape[0] and width:
        b, rx, sb, has = _bias_args(h, bias, row_experts)
        ta.act_backward_kernel[grid](
            h, grad_a, grad_h, a, offsets, b, rx, offsets.shape[0], width,
            h.stride(0), grad_a.stride(0), grad_h.stride(0), a.stride(0), sb, float(alpha), float(limit),
            h if sources is None else sources, h if weights is None else weights, h if dots is None else dots,
            grid[1], BIAS=has, KIND=kind, GATED=gated, INTERLEAVED=interleaved, WEIGHTED=fold is not None,
            BLOCK_R=br, BLOCK_C=bc,
        )  # fmt: skip
    if fold is not None:
        return grad_h, a, dots.sum(1).to(weights.dtype)
    return grad_h, a


def _activation_impl(h, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit) -> Tensor:
    if h.is_cuda:
        return triton_forward(h, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit)
    return _torch_forward(h, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit)


def _activation_backward_impl(h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit, fold=None):
    if h.is_cuda:
        return triton_backward(h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit, fold)
    return _torch_backward(h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit, fold)


@torch.library.custom_op("padmoe_experts::activation", mutates_args=())
def _activation(
    h: Tensor,
    offsets: Tensor,
    bias: Optional[Tensor],
    row_experts: Optional[Tensor],
    kind: int,
    gated: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> Tensor:
    """``a[R, I]``: ``act(g) * u`` over the halves of ``h + bias[row_experts]`` (gated) or ``act(h +
    bias[row_experts])``, the bias optional; rows at or past ``offsets[-1]`` unwritten."""
    return _activation_impl(h, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit)


@_activation.register_fake
def _(h, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit):
    return h.new_empty(h.shape[0], h.shape[1] // 2 if gated else h.shape[1])


@torch.library.custom_op("padmoe_experts::activation_backward", mutates_args=())
def _activation_backward(
    h: Tensor,
    grad_a: Tensor,
    offsets: Tensor,
    bias: Optional[Tensor],
    row_experts: Optional[Tensor],
    kind: int,
    gated: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[Tensor, Tensor]:
    """``(grad_h[R, N1], a[R, I])``: the activation's input gradient and its output recomputed."""
    return _activation_backward_impl(h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit)


@_activation_backward.register_fake
def _(h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit):
    return torch.empty_like(h), h.new_empty(grad_a.shape)


@torch.library.custom_op("padmoe_experts::activation_backward_weighted", mutates_args=())
def _activation_backward_weighted(
    h: Tensor,
    grad_a: Tensor,
    offsets: Tensor,
    bias: Optional[Tensor],
    row_experts: Optional[Tensor],
    kind: int,
    gated: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    row_sources: Tensor,
    weights: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_h[R, N1], w_r * a[R, I], grad_weights[T*K])`` from the unweighted ``grad_a``: the
    router weights (weighting "after") folded into the activation's backward (``fold_weights``)."""
    fold = (row_sources, weights, weights.numel())
    return _activation_backward_impl(
        h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit, fold
    )


@_activation_backward_weighted.register_fake
def _(h, grad_a, offsets, bias, row_experts, kind, gated, interleaved, alpha, limit, row_sources, weights):
    return torch.empty_like(h), h.new_empty(grad_a.shape), weights.new_empty(weights.numel())


def _act_backward_weighted(*args):
    """The folded backward, chosen as :func:`_act_forward` is."""
    if compiling():
        return torch.ops.padmoe_experts.activation_backward_weighted(*args)
    *head, row_sources, weights = args
    return _activation_backward_impl(*head, (row_sources, weights, weights.numel()))


def _act_forward(*args) -> Tensor:
    """The activation's forward: the custom operator while torch.compile traces, else its body
    directly (a Python custom operator's dispatch costs more host time than the pass at small sizes)."""
    return torch.ops.padmoe_experts.activation(*args) if compiling() else _activation_impl(*args)


def _act_backward(*args):
    """The activation's backward, chosen as :func:`_act_forward` is."""
    return torch.ops.padmoe_experts.activation_backward(*args) if compiling() else _activation_backward_impl(*args)


# ---------------------------------------------------------------------------
# GEMMs in the operands' layouts, biases
# ---------------------------------------------------------------------------

# torch's grouped GEMM (the public name, or the private one of older releases), or None.
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _mm(a: Tensor, w: Tensor, offs: Tensor, transposed: bool) -> Tensor:
    """``a[R, in] @ w[e]`` per segment; ``w`` ``[E, out, in]`` or, transposed, ``[E, in, out]``."""
    return _GROUPED_MM(a, w if transposed else w.transpose(-2, -1), offs=offs)


def _mm_dgrad(g: Tensor, w: Tensor, offs: Tensor, transposed: bool) -> Tensor:
    """``g[R, out] @ w[e]^T`` per segment: the input gradient of :func:`_mm`."""
    return _GROUPED_MM(g, w.transpose(-2, -1) if transposed else w, offs=offs)


def _mm_wgrad(a: Tensor, g: Tensor, offs: Tensor, transposed: bool) -> Tensor:
    """The weight gradient of :func:`_mm` in the weight's own layout, written once: ``[E, out, in] =
    g^T a`` or, transposed, ``[E, in, out] = a^T g`` (segment sums in the GEMM's float32)."""
    if transposed:
        return _GROUPED_MM(a.t(), g, offs=offs)
    return _GROUPED_MM(g.t(), a, offs=offs)


def _bias_rows(bias: Tensor, row_experts: Tensor) -> Tensor:
    """``bias[row_experts]`` per padded row, zero on padding rows (row_experts -1)."""
    table = torch.cat([bias, bias.new_zeros(1, bias.shape[-1])])
    return table[torch.where(row_experts >= 0, row_experts, bias.shape[0]).long()]


def _bias_grad(grad: Tensor, row_experts: Tensor, num_experts: int) -> Tensor:
    """Per-expert sums of the row gradients as one GEMM (one-hot ``[E, R]`` times ``grad``): float32
    accumulation, one rounding, no atomics; padding rows and rows past P (unwritten) excluded."""
    grad = torch.where((row_experts >= 0).unsqueeze(1), grad, 0)
    experts = torch.arange(num_experts, device=row_experts.device, dtype=row_experts.dtype)
    onehot = (row_experts.unsqueeze(0) == experts.unsqueeze(1)).to(grad.dtype)
    return onehot @ grad


# ---------------------------------------------------------------------------
# The operator
# ---------------------------------------------------------------------------


def fold_weights(weighting: str, weights_grad: bool, down_bias, a: Tensor, x: Tensor) -> bool:
    """Whether the backward folds the router weights (weighting "after", their gradient wanted, no
    down bias) into the activation's backward instead of reading the expert outputs ``ys[R, H]``:
    the unweighted gradient rows go through the down projection's dgrad, the activation pass scales
    them by each row's weight, writes ``w_r * a`` for the down weight gradient and the dot
    ``<grad_a, a>`` as the weight's gradient. It writes ``R * I`` elements more and reads ``R * H``
    fewer, and ``ys`` is not kept: chosen where I < H (qwen3-30b-a3b, deepseek-v3; not
    mixtral-8x7b)."""
    return weighting == "after" and weights_grad and down_bias is None and a.shape[1] < x.shape[1]


def _check_rows(x: Tensor, packed: Tensor, sizes) -> None:
    """The check dispatch makes of x before the gather-fused GEMM reads x's rows through the plan (the
    plan itself is padmoe's, valid by construction)."""
    tokens, _, _ = fake_plan_sizes(packed, *sizes)
    if x.shape[0] != tokens:
        raise ValueError(
            f"padmoe experts: hidden_states: expected {tokens} rows (the routing's tokens), got {x.shape[0]}"
        )


def _dispatch(x, packed, weights, plan_sizes, check, zero_padding) -> Tensor:
    op, _ = call("dispatch")  # the native fast entry point in eager mode, the OpOverload under compile
    return op(x, packed, weights, *plan_sizes, check, zero_padding)


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, up, down, up_bias, down_bias, row_experts, packed, offs, spec):
        sizes, check, transposed, act, weighting, grads, recompute = spec
        kind, gated, interleaved, alpha, limit = act
        before = w if weighting == "before" else None
        after = w if weighting == "after" else None
        # The gather fused into the up projection where it applies and pays (see gather_pays):
        # without gradients the activation too (neither the rows nor h written); with gradients and
        # recompute_rows, h with zero padding rows (the backward's up weight gradient reads x through
        # the plan too). Otherwise the dispatch, then torch's GEMM.
        fuse = (
            (not grads or recompute)
            and gather_pays(x.shape[0], sizes, up_width(up, transposed), grads)
            and gather_config(x, up, sizes, transposed, not grads, gated) is not None
        )
        if fuse:
            _check_rows(x, packed, sizes)
        rows = h = None
        act_bias = None if fuse else up_bias  # the gather-fused GEMM adds it itself
        if fuse and not grads:
            a = _gather_up_call(x, packed, before, up, up_bias, sizes, transposed, act, True, False)
        else:
            if fuse:
                h = _gather_up_call(x, packed, before, up, up_bias, sizes, transposed, act, False, True)
            else:
                rows = _dispatch(x, packed, before, sizes, check, grads)
                h = _mm(rows, up, offs, transposed)  # the bias: added by the activation as it reads h
            a = _act_forward(h, offs, act_bias, row_experts, kind, gated, interleaved, alpha, limit)
        ys = _mm(a, down, offs, transposed)
        ctx.compiled = compiling()
        ctx.fold = grads and fold_weights(weighting, ctx.needs_input_grad[1], down_bias, a, x)
        del a
        if down_bias is not None:
            ys = ys + _bias_rows(down_bias, row_experts)
        out = call("combine")[0](ys, packed, after, *sizes, 0)
        ctx.spec = spec
        ctx.gathered = fuse
        ctx.has_bias = (up_bias is not None, down_bias is not None)
        kept = None if recompute else rows
        if ctx.compiled:  # the compiled backward frees each tensor after its last use itself
            ctx.save_for_backward(
                x, w, up, down, act_bias, row_experts, packed, offs, kept, h, None if ctx.fold else ys
            )
            ctx.inter = None
        else:
            # The large intermediates live on ctx, not in saved tensors (which last until the backward
            # returns), so that the backward frees each after its last use: ys after combine's
            # backward, h after the activation's, the rows after the up weight gradient. ys only
            # where the router weights' gradient reads it (weighting "after", not folded).
            keep_ys = after is not None and ctx.needs_input_grad[1] and not ctx.fold
            ctx.save_for_backward(x, w, up, down, act_bias, row_experts, packed, offs)
            ctx.inter = [kept, h, ys if keep_ys else None]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.inter is None and not ctx.compiled:
            raise RuntimeError(
                "padmoe experts: the expert MLP operator's backward ran a second time (retain_graph=True): "
                "it frees its intermediates as it goes; run the forward again for a second backward"
            )
        if ctx.compiled:
            x, w, up, down, act_bias, row_experts, packed, offs, rows, h, ys = ctx.saved_tensors
        else:
            x, w, up, down, act_bias, row_experts, packed, offs = ctx.saved_tensors
            (rows, h, ys), ctx.inter = ctx.inter, None
        sizes, _, transposed, act, weighting, _, _ = ctx.spec
        kind, gated, interleaved, alpha, limit = act
        e = sizes[1]
        need = ctx.needs_input_grad
        before = w if weighting == "before" else None
        after = w if weighting == "after" else None
        if ctx.fold:
            # the router weights folded into the activation's backward (see fold_weights): the
            # unweighted gradient rows, grad_w from <grad_a, a> per row, grad_down from w_r * a
            grad_ys = _dispatch(grad_out.contiguous(), packed, None, sizes, 0, True)
            grad_a = _mm_dgrad(grad_ys, down, offs, transposed)
            sources = packed[plan_slices(x.shape[0], *sizes).row_sources]
            grad_h, a, grad_w = _act_backward_weighted(
                h, grad_a, offs, act_bias, row_experts, kind, gated, interleaved, alpha, limit, sources, w
            )
        else:
            grad_ys, grad_w = torch.ops.padmoe.combine_backward.default(
                grad_out.contiguous(), ys, packed, after, *sizes, ys is not None and need[1], 0, h.shape[0]
            )
            del ys
            grad_a = _mm_dgrad(grad_ys, down, offs, transposed)
            grad_h, a = _act_backward(h, grad_a, offs, act_bias, row_experts, kind, gated, interleaved, alpha, limit)
        grad_down_bias = _bias_grad(grad_ys, row_experts, e) if ctx.has_bias[1] and need[5] else None
        del grad_a, h
        grad_down = _mm_wgrad(a, grad_ys, offs, transposed) if need[3] else None
        del a, grad_ys
        grad_up_bias = _bias_grad(grad_h, row_experts, e) if ctx.has_bias[0] and need[4] else None
        grad_up = None
        if need[2] and rows is None and ctx.gathered:  # x's rows read through the plan: nothing dispatched
            grad_up = _gather_wgrad_call(grad_h, x, packed, before, up, sizes, transposed)
        elif need[2]:
            if rows is None:  # recompute_rows: dispatched again (padding rows zero) instead of kept
                rows = _dispatch(x, packed, before, sizes, 0, True)
            grad_up = _mm_wgrad(rows, grad_h, offs, transposed)
        del rows
        grad_x = None
        if need[0] or (before is not None and need[1]):
            grad_rows = _mm_dgrad(grad_h, up, offs, transposed)
            grad_x, gw = torch.ops.padmoe.dispatch_backward.default(
                grad_rows, x, packed, before, *sizes, before is not None and need[1], 0
            )
            if before is not None:
                grad_w = gw
        if not need[1] or weighting == "none":
            grad_w = None
        elif grad_w is not None:
            grad_w = grad_w.view(w.shape)
        return grad_x, grad_w, grad_up, grad_down, grad_up_bias, grad_down_bias, None, None, None, None


def expert_mlp(
    x: Tensor,
    routing,
    up: Tensor,
    down: Tensor,
    *,
    up_bias: Optional[Tensor],
    down_bias: Optional[Tensor],
    transposed: bool,
    activation: str,
    gated: bool,
    interleaved: bool,
    weighting: str,
    grads: bool,
    alpha: float = 1.702,
    limit: float = 7.0,
    recompute_rows: bool = False,
) -> Tensor:
    """``[T, H]``: the expert MLP of ``routing`` (a :class:`Routing`) over ``x[T, H]`` as one operator
    (this module's docstring). ``activation``: a key of :data:`KINDS`; ``alpha`` / ``limit`` are
    clamped_swiglu's. ``grads``: whether a gradient will be taken (else padding rows stay unwritten).
    ``recompute_rows``: the backward dispatches x again instead of keeping the dispatched rows."""
    plan = routing.plan
    spec = (
        plan_args(plan),
        eager_mode(routing.check),
        transposed,
        (KINDS[activation], gated, interleaved, float(alpha), float(limit)),
        weighting,
        grads,
        bool(recompute_rows),
    )
    w = routing.weights if weighting != "none" else None
    row_experts = routing.row_experts if (up_bias is not None or down_bias is not None) else None
    return _ExpertMLP.apply(x, w, up, down, up_bias, down_bias, row_experts, packed(plan), plan.padded_bins, spec)
