"""The expert MLP as one autograd operator (not in the library: measured slower than the composition
on an H100, bench/results/experts.md): routing, both grouped GEMMs, the activation and the combine
with a hand-written backward. bench/bench_experts.py times it beside padmoe.torch.experts_forward;
its tests agreed with float64 loops and the composition (float32, CPU) before it moved here.

Forward (T tokens, K top-k, H hidden, I intermediate, N1 = 2I gated or I, R padded rows)::

    rows = dispatch(x)                     [R, H]   (weighted by the router weights: "before")
    h    = grouped_mm(rows, up)  + b_up    [R, N1]
    a    = act(g) * u   or   act(h)        [R, I]   (g, u: the halves of h, side by side or interleaved)
    ys   = grouped_mm(a, down)  + b_down   [R, H]
    out  = combine(ys)                     [T, H]   (weighted: "after")

Backward, each GEMM once and in the layout its operands have (no transposed copies, no
zero-filled halves, no slicing copies): ``combine_backward`` gives ``d_ys`` and the router
weights' gradient in one pass; ``d_down = d_ys^T a`` (or ``a^T d_ys`` for ``[E, in, out]``
weights), ``d_a = d_ys down``; the activation's backward writes ``d_h`` ``[R, N1]`` in one
tensor; ``d_up`` and ``d_rows`` likewise; ``dispatch_backward`` sums ``d_rows`` back to tokens.
``a`` is recomputed from ``h`` (not kept), and with ``recompute_rows`` so are the dispatched rows
(from ``x``: one more dispatch in the backward, ``R*H`` elements less kept).

The activation is computed in float32 from the GEMM output's dtype and rounded once (the
composition rounds ``act(g)`` before the product); sums are the GEMMs' and padmoe's, so the
operator is deterministic run to run. Rows past P are never read: the GEMMs' segments end at P,
``combine`` reads real rows, and the bias gradients select rows of real experts.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

Tensor = torch.Tensor

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _silu(g: Tensor):
    s = torch.sigmoid(g)
    return g * s, s * (1 + g * (1 - s))


def _gelu(g: Tensor):
    c = 0.5 * (1 + torch.erf(g * _INV_SQRT_2))
    return g * c, c + g * torch.exp(-0.5 * g * g) * _INV_SQRT_2PI


def _gelu_tanh(g: Tensor):
    inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
    t = torch.tanh(inner)
    d = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g)
    return 0.5 * g * (1 + t), d


def _relu(g: Tensor):
    return torch.relu(g), (g > 0).to(g.dtype)


def _relu2(g: Tensor):
    r = torch.relu(g)
    return r * r, 2 * r


def _sigmoid(g: Tensor):
    s = torch.sigmoid(g)
    return s, s * (1 - s)


def _identity(g: Tensor):
    return g, torch.ones_like(g)


# name -> float32 (act(g), act'(g)); the names GroupedExperts takes for its built-in activations
FUSED_ACTIVATIONS = {
    "silu": _silu,
    "swish": _silu,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": _relu,
    "relu2": _relu2,
    "sigmoid": _sigmoid,
    "identity": _identity,
}


def _halves(h: Tensor, gated: bool, interleaved: bool):
    if not gated:
        return h, None
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    n = h.shape[1] // 2
    return h[:, :n], h[:, n:]


def _act_forward(h: Tensor, act: str, gated: bool, interleaved: bool) -> Tensor:
    """``a = act(g) * u`` (gated) or ``act(h)``, in float32, rounded once to h's dtype."""
    g, u = _halves(h, gated, interleaved)
    a, _ = FUSED_ACTIVATIONS[act](g.float())
    if gated:
        a = a * u.float()
    return a.to(h.dtype)


def _act_backward(h: Tensor, grad_a: Tensor, act: str, gated: bool, interleaved: bool) -> Tensor:
    """``d_h`` ``[R, N1]`` in one tensor: ``d_g = d_a * u * act'(g)``, ``d_u = d_a * act(g)``."""
    g, u = _halves(h, gated, interleaved)
    a, d = FUSED_ACTIVATIONS[act](g.float())
    ga = grad_a.float()
    if not gated:
        return (ga * d).to(h.dtype)
    grad_h = torch.empty_like(h)
    dg, du = _halves(grad_h, gated, interleaved)
    dg.copy_(ga * u.float() * d)
    du.copy_(ga * a)
    return grad_h


def _mm(a: Tensor, w: Tensor, offs: Tensor, transposed: bool) -> Tensor:
    """``a[R, in] @ w[e]`` per segment; ``w`` ``[E, out, in]`` or, transposed, ``[E, in, out]``."""
    return torch.nn.functional.grouped_mm(a, w if transposed else w.transpose(-2, -1), offs=offs)


def _mm_dgrad(g: Tensor, w: Tensor, offs: Tensor, transposed: bool) -> Tensor:
    """``g[R, out] @ w[e]^T`` per segment: the input gradient of :func:`_mm`."""
    return torch.nn.functional.grouped_mm(g, w.transpose(-2, -1) if transposed else w, offs=offs)


def _mm_wgrad(a: Tensor, g: Tensor, offs: Tensor, transposed: bool) -> Tensor:
    """The weight gradient of :func:`_mm` in the weight's own layout, written once: ``[E, out, in] =
    g^T a`` or, transposed, ``[E, in, out] = a^T g`` (segment sums in the GEMM's float32)."""
    if transposed:
        return torch.nn.functional.grouped_mm(a.t(), g, offs=offs)
    return torch.nn.functional.grouped_mm(g.t(), a, offs=offs)


def _bias_rows(bias: Tensor, row_experts: Tensor) -> Tensor:
    """``bias[row_experts]`` per padded row, zero on padding rows (row_experts -1)."""
    table = torch.cat([bias, bias.new_zeros(1, bias.shape[-1])])
    return table[torch.where(row_experts >= 0, row_experts, bias.shape[0]).long()]


def _bias_grad(grad: Tensor, row_experts: Tensor, num_experts: int) -> Tensor:
    """Per-expert sums of the row gradients as one GEMM (one-hot ``[E, R]`` times ``grad``): float32
    accumulation, one rounding, no atomics; padding rows and rows past P (maybe garbage) excluded."""
    live = (row_experts >= 0).unsqueeze(1)
    grad = torch.where(live, grad, 0)
    experts = torch.arange(num_experts, device=row_experts.device, dtype=row_experts.dtype)
    onehot = (row_experts.unsqueeze(0) == experts.unsqueeze(1)).to(grad.dtype)
    return onehot @ grad


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, up, down, up_bias, down_bias, row_experts, packed, spec):
        (k, e, align, cap, check, transposed, act, gated, interleaved, weighting, grads, recompute) = spec
        before = w if weighting == "before" else None
        after = w if weighting == "after" else None
        rows = _dispatch(x, packed, before, k, e, align, cap, check, grads)
        offs = _offsets(packed, x.shape[0] * k, e)
        h = _mm(rows, up, offs, transposed)
        if up_bias is not None:
            h = h + _bias_rows(up_bias, row_experts)
        a = _act_forward(h, act, gated, interleaved)
        ys = _mm(a, down, offs, transposed)
        if down_bias is not None:
            ys = ys + _bias_rows(down_bias, row_experts)
        out = torch.ops.padmoe.combine.default(ys, packed, after, k, e, align, cap, 0)
        ctx.spec = spec
        ctx.has_bias = (up_bias is not None, down_bias is not None)
        ctx.save_for_backward(x, w, up, down, row_experts, packed, h, ys, None if recompute else rows)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w, up, down, row_experts, packed, h, ys, rows = ctx.saved_tensors
        (k, e, align, cap, check, transposed, act, gated, interleaved, weighting, grads, recompute) = ctx.spec
        need = ctx.needs_input_grad
        before = w if weighting == "before" else None
        after = w if weighting == "after" else None
        offs = _offsets(packed, x.shape[0] * k, e)
        grad_ys, grad_w = torch.ops.padmoe.combine_backward.default(
            grad_out.contiguous(), ys, packed, after, k, e, align, cap, after is not None and need[1], 0, ys.shape[0]
        )
        grad_down_bias = _bias_grad(grad_ys, row_experts, e) if ctx.has_bias[1] and need[5] else None
        a = _act_forward(h, act, gated, interleaved)
        grad_down = _mm_wgrad(a, grad_ys, offs, transposed) if need[3] else None
        del a
        grad_a = _mm_dgrad(grad_ys, down, offs, transposed)
        del grad_ys
        grad_h = _act_backward(h, grad_a, act, gated, interleaved)
        del grad_a
        grad_up_bias = _bias_grad(grad_h, row_experts, e) if ctx.has_bias[0] and need[4] else None
        if rows is None and need[2]:
            rows = _dispatch(x, packed, before, k, e, align, cap, 0, True)
        grad_up = _mm_wgrad(rows, grad_h, offs, transposed) if need[2] else None
        grad_x = None
        if need[0] or (before is not None and need[1]):
            grad_rows = _mm_dgrad(grad_h, up, offs, transposed)
            grad_x, gw = torch.ops.padmoe.dispatch_backward.default(
                grad_rows, x, packed, before, k, e, align, cap, before is not None and need[1], 0
            )
            if before is not None:
                grad_w = gw
        if not need[1] or weighting == "none":
            grad_w = None
        return grad_x, grad_w, grad_up, grad_down, grad_up_bias, grad_down_bias, None, None, None


def _dispatch(x, packed, weights, k, e, align, cap, check, zero_padding) -> Tensor:
    """The rows of the plan; ``zero_padding`` False (no gradient to take) leaves padding rows and
    rows past P unwritten: the GEMMs and the activation work row by row and combine reads real rows."""
    return torch.ops.padmoe.dispatch.default(x, packed, weights, k, e, align, cap, check, zero_padding)


def _offsets(packed: Tensor, a: int, e: int) -> Tensor:
    """``padded_bins`` [E] of a packed plan (indices, bin_ids [A], then the four [E] arrays)."""
    return packed[2 * a + 3 * e : 2 * a + 4 * e]


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
    recompute_rows: bool = False,
) -> Tensor:
    """``[T, H]``: the expert MLP of ``routing`` (a :class:`Routing`) over ``x[T, H]`` as one operator
    (this module's docstring). ``activation`` a name of :data:`FUSED_ACTIVATIONS`."""
    plan = routing.plan
    cap = getattr(plan, "expert_capacity", None)
    check = 2 if routing.check is None else int(bool(routing.check))
    spec = (
        plan.top_k,
        plan.num_experts,
        plan.alignment,
        cap,
        check,
        transposed,
        activation,
        gated,
        interleaved,
        weighting,
        grads,
        recompute_rows,
    )
    w = routing.weights if weighting != "none" else None
    if w is not None and w.dim() != 1:
        w = w.reshape(-1)
    row_experts = routing.row_experts if (up_bias is not None or down_bias is not None) else None
    return _ExpertMLP.apply(x, w, up, down, up_bias, down_bias, row_experts, plan.packed, spec)
