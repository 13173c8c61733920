"""Expert MLPs on padmoe's padded routing: :func:`experts_forward` and :class:`GroupedExperts`.

One code path for two users: :class:`GroupedExperts` (``padmoe.torch.GroupedExperts``), a module
for people who build their own MoE layer, and the transformers integration
(``padmoe.integrations.transformers``), which calls :func:`experts_forward` with the weights of a
transformers experts module. Data flow (T tokens, K top-k, E experts, H hidden, I intermediate)::

    r   = Routing.from_topk(top_k_index, top_k_weights, E, alignment)
    xs  = r.dispatch(x)                      # [rows, H] expert-grouped, padded (weighted=True: weights first)
    h   = grouped_mm(xs, W_up, offs=r.offsets) (+ up_bias[r.row_experts])     # [rows, 2I] or [rows, I]
    a   = gate(h)  or  act(h)                # SwiGLU-style gate (or a custom one), or a plain activation
    ys  = grouped_mm(a, W_down, offs=r.offsets) (+ down_bias[r.row_experts])   # [rows, H]
    ys  = post(ys)                           # optional per-row post-expert norm
    out = r.combine(ys)                      # [T, H], weighted (after the experts) or a plain sum

Expert weights are 3D, either in ``nn.Linear`` layout (``[E, out, in]``, transformers' default) or
transposed (``[E, in, out]``, GPT-OSS); both go to ``grouped_mm`` without a copy (a transposed view is
the column-major operand the kernel takes). Biases are per expert (``[E, out]``) and are added per
padded row through ``row_experts`` (padding rows: a zero row appended to the table). Rows at or past P
(``padded_bins[-1]``) may hold garbage after a ``grouped_mm`` (the kernel leaves them unwritten); nothing
reads them: ``combine`` reads only real rows, its backward gives them a zero gradient, and the GEMMs'
weight gradients stop at P.

GEMMs: ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``) with ``offs = padded_bins`` where
torch has a kernel for the inputs (see :func:`grouped_mm_usable`), else a loop of one matmul per
segment (the custom operator ``padmoe_experts::segment_mm``: opaque to torch.compile, so a compiled
graph has no break; it reads the offsets on the host, one synchronization on a GPU).

Autocast: ``grouped_mm`` is not autocast-aware, so under ``torch.autocast`` the rows, weights and
biases are cast to the autocast dtype here (what autocast does for ``F.linear``), and the expert
outputs are widened back to the input's dtype before ``combine`` (as transformers' eager loop
accumulates into an output of the input's dtype).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from padmoe._args import int_arg
from padmoe._plan import INT32_MAX

from ._expert_mlp import _GROUPED_MM, _bias_grad, _bias_rows, _mm, expert_mlp
from ._routing import Routing

Tensor = torch.Tensor

__all__ = ["GroupedExperts", "experts_forward", "grouped_mm_usable", "ACTIVATIONS"]


# ---------------------------------------------------------------------------
# GEMM over padded segments
# ---------------------------------------------------------------------------


def _torch_version() -> tuple:
    parts = []
    for p in torch.__version__.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


_TORCH = _torch_version()
_CUDA_CAPABLE = {}  # device index -> bool (compute capability >= 8.0)


def _cuda_ok(device: torch.device) -> bool:
    ok = _CUDA_CAPABLE.get(device.index)
    if ok is None:
        if torch.compiler.is_compiling():
            return True  # while tracing, before any eager call filled the cache: sm80+ assumed
        ok = _CUDA_CAPABLE[device.index] = torch.cuda.get_device_capability(device) >= (8, 0)
    return ok


def grouped_mm_usable(a: Tensor, b: Tensor) -> bool:
    """Whether ``grouped_mm(a[rows, K], b[E, K, N], offs=...)`` has a kernel for these inputs:
    torch has the function; float32 / bfloat16 / float16 (one dtype); on CUDA compute capability
    8.0 or newer, on the CPU torch 2.9 or newer (earlier CPU builds have no kernel; up to 2.10 the
    CPU kernel also wants 16-byte aligned data pointers); K and N a multiple of 16 bytes (the
    kernel's stride rule). Under torch.compile only bfloat16 (what inductor lowers)."""
    if _GROUPED_MM is None or a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    size = a.element_size()
    if (a.shape[-1] * size) % 16 or (b.shape[-1] * size) % 16:
        return False
    compiling = torch.compiler.is_compiling()
    if compiling and a.dtype != torch.bfloat16:
        return False
    if a.device.type == "cuda":
        return _cuda_ok(a.device)
    if a.device.type == "cpu":
        if _TORCH < (2, 9):
            return False
        if _TORCH < (2, 11) and not compiling and (a.data_ptr() % 16 or b.data_ptr() % 16):
            return False
        return True
    return False


@torch.library.custom_op("padmoe_experts::segment_mm", mutates_args=())
def _segment_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """out[s:e] = a[s:e] @ b[g] for each segment g = [offs[g-1], offs[g]); rows at or past offs[-1] zero."""
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host read of the offsets
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


@_segment_mm.register_fake
def _(a, b, offs):
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("padmoe_experts::segment_mm_backward", mutates_args=())
def _segment_mm_backward(grad: Tensor, a: Tensor, b: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    grad_a = torch.zeros_like(a)
    grad_b = a.new_zeros(b.shape)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            grad_a[start:end] = grad[start:end] @ b[g].transpose(0, 1)
            grad_b[g] = a[start:end].transpose(0, 1) @ grad[start:end]
        start = end
    return grad_a, grad_b


@_segment_mm_backward.register_fake
def _(grad, a, b, offs):
    return torch.empty_like(a), a.new_empty(b.shape)


def _segment_mm_setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _segment_mm_bwd(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad_a, grad_b = torch.ops.padmoe_experts.segment_mm_backward(grad.contiguous(), a, b, offs)
    return grad_a, grad_b, None


_segment_mm.register_autograd(_segment_mm_bwd, setup_context=_segment_mm_setup)


def _gemm(a: Tensor, w: Tensor, offs: Tensor, transposed: bool, gemm: str) -> Tensor:
    """``a[rows, in] x w`` per padded segment; ``w`` is ``[E, out, in]`` (nn.Linear layout) or, with
    ``transposed``, ``[E, in, out]``."""
    b = w if transposed else w.transpose(-2, -1)  # [E, in, out]; a view, no copy
    if gemm == "grouped_mm" or (gemm == "auto" and grouped_mm_usable(a, b)):
        if _GROUPED_MM is None:
            raise RuntimeError(
                "padmoe experts: gemm='grouped_mm' but this torch has no "
                "torch.nn.functional.grouped_mm / torch._grouped_mm"
            )
        return _mm(a, w, offs, transposed)
    return torch.ops.padmoe_experts.segment_mm(a, b, offs)


class _RowBias(torch.autograd.Function):
    """``bias[row_experts]`` per padded row, zero on padding rows (row_experts -1). Backward: the
    per-expert sum of the row gradients as one GEMM (one-hot ``[E, rows]`` times the gradient), so a
    bfloat16 bias gradient is accumulated in float32 and rounded once (an indexed accumulate would
    round after every row)."""

    @staticmethod
    def forward(ctx, bias, row_experts):
        ctx.save_for_backward(row_experts)
        ctx.num_experts = bias.shape[0]
        return _bias_rows(bias, row_experts)

    @staticmethod
    def backward(ctx, grad):
        (row_experts,) = ctx.saved_tensors
        return _bias_grad(grad, row_experts, ctx.num_experts), None


def _row_bias(bias: Tensor, row_experts: Tensor) -> Tensor:
    return _RowBias.apply(bias, row_experts)


# ---------------------------------------------------------------------------
# The shared forward
# ---------------------------------------------------------------------------


def _cast(t: Optional[Tensor], dtype) -> Optional[Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def default_alignment(device: torch.device) -> int:
    """16 rows on CUDA (grouped-GEMM tiles like aligned segment starts), 1 elsewhere (no padding)."""
    return 16 if torch.device(device).type == "cuda" else 1


def _check_weights(x, up, down, up_bias, down_bias, transposed, gate, activation) -> None:
    """The shapes the expert MLP needs, named argument by argument before any work: ``up`` [E, N1, H]
    (N1 = 2I for a gate given by name, I for an activation given by name; a callable may map N1 to
    any width), ``down`` [E, H, I] ([E, H, N1] / [E, I, H] with ``transposed``), biases [E, N1] and
    [E, H], float tensors on x's device."""
    for name, t in (("hidden_states", x), ("up", up), ("down", down), ("up_bias", up_bias), ("down_bias", down_bias)):
        if t is None and name.endswith("bias"):
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"padmoe experts: {name}: expected a torch tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"padmoe experts: {name}: expected a float tensor, got {str(t.dtype)[6:]}")
        if t.device != x.device:
            raise ValueError(f"padmoe experts: {name}: expected a tensor on {x.device}, got {t.device}")
    if x.dim() < 1:
        raise ValueError("padmoe experts: hidden_states: expected [..., H], got a 0-d tensor")
    layout = "[E, in, out] (transposed)" if transposed else "[E, out, in]"
    for name, t in (("up", up), ("down", down)):
        if t.dim() != 3:
            raise ValueError(f"padmoe experts: {name}: expected a 3-D {layout} tensor, got shape {list(t.shape)}")
    h, e = x.shape[-1], up.shape[0]
    n1, h_up = (up.shape[2], up.shape[1]) if transposed else (up.shape[1], up.shape[2])
    h_down, i = (down.shape[2], down.shape[1]) if transposed else (down.shape[1], down.shape[2])
    if h_up != h:
        raise ValueError(f"padmoe experts: up: expected {layout} with in = H = {h}, got shape {list(up.shape)}")
    if down.shape[0] != e or h_down != h:
        raise ValueError(
            f"padmoe experts: down: expected {layout} with E = {e} (up's) and out = H = {h}, got shape {list(down.shape)}"
        )
    if isinstance(gate, str) and n1 % 2:
        raise ValueError(f"padmoe experts: up: a gate needs an even number of outputs (2I), got shape {list(up.shape)}")
    want = n1 // 2 if isinstance(gate, str) else n1 if isinstance(activation, str) else i  # a callable: any
    if i != want:
        raise ValueError(
            f"padmoe experts: down: expected in = I = {want} (from up's {n1}), got shape {list(down.shape)}"
        )
    for name, t, shape in (("up_bias", up_bias, [e, n1]), ("down_bias", down_bias, [e, h])):
        if t is not None and list(t.shape) != shape:
            raise ValueError(f"padmoe experts: {name}: expected shape {shape}, got {list(t.shape)}")


def experts_forward(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Optional[Tensor],
    up: Tensor,
    down: Tensor,
    *,
    up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    transposed: bool = False,
    gate: Optional[Union[str, Callable[[Tensor], Tensor]]] = None,
    activation: Optional[Union[str, Callable[[Tensor], Tensor]]] = None,
    post: Optional[Callable[[Tensor], Tensor]] = None,
    weighting: str = "after",
    alignment: Optional[int] = None,
    gemm: str = "auto",
    drop_invalid: bool = False,
    check: Optional[bool] = None,
    interleaved: bool = False,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    recompute_rows: bool = False,
) -> Tensor:
    """The experts of a MoE layer on padmoe's routing: ``out[t] = sum_k w[t,k] * expert_{e[t,k]}(x[t])``.

    ``hidden_states`` ``[..., H]``; ``top_k_index`` / ``top_k_weights`` ``[T, K]`` (the router's ids
    and weights; weights may be None with ``weighting="none"``). ``up`` ``[E, N1, H]`` (``[E, H, N1]``
    with ``transposed``), N1 = 2I for a gated MLP (``gate`` maps ``[rows, 2I] -> [rows, I]``) or I
    for an ungated one (``activation``); ``down`` ``[E, H, I]`` (``[E, I, H]``); biases ``[E, N1]`` and
    ``[E, H]``. ``post``: a per-row function of the expert output (post-expert norm). ``weighting``:
    ``"after"`` (combine weighted by the router weights), ``"before"`` (the weights scale each
    token copy before the experts; combine sums) or ``"none"``. ``alignment``: rows per segment
    multiple (default 16 on CUDA, 1 elsewhere). ``gemm``: ``"auto"`` (grouped_mm where usable),
    ``"grouped_mm"`` or ``"loop"``. ``drop_invalid``: ids outside ``[0, E)`` (expert-parallel
    sentinels) contribute nothing, instead of raising. Differentiable in everything float.

    ``gate`` or ``activation`` may be given by name (a key of :data:`ACTIVATIONS`: ``"silu"``,
    ``"gelu"``, ``"gelu_tanh"``, ``"relu2"``, ...): ``gate="silu"`` is ``silu(g) * u`` over the two
    halves of the up projection, side by side or, with ``interleaved``, alternating columns.
    ``gate="clamped_swiglu"`` is GPT-OSS's: ``(clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g')`` with
    ``g' = min(g, L)``, ``alpha = swiglu_alpha``, ``L = swiglu_limit``.

    With a gate or activation given by name, no ``post`` and torch's ``grouped_mm`` usable, the whole
    MLP runs as one operator (padmoe/torch/_expert_mlp.py: the activation one fused pass each way, a
    hand-written backward, the activation computed in float32 and rounded once); otherwise as an
    autograd composition of padmoe's routing ops, the GEMMs and the callables. On CUDA (bf16 / fp16,
    ``alignment`` a multiple of 16) where padding rows dominate (decode), and without gradients
    where the up projection is narrow and each expert's rows fill full-height tiles (qwen3-30b-a3b;
    ``_gather_gemm.gather_pays``), the operator's up projection reads x's rows through the plan
    (the gather fused into its A-load; without gradients the activation too). ``recompute_rows``
    (the operator only): keep no ``[rows, H]`` dispatched rows for the backward (it dispatches x
    again, or where the gather runs, the up projection's weight gradient reads x through the plan)."""
    if weighting not in ("after", "before", "none"):
        raise ValueError(f"padmoe experts: weighting: expected 'after', 'before' or 'none', got {weighting!r}")
    if gemm not in ("auto", "grouped_mm", "loop"):
        raise ValueError(f"padmoe experts: gemm: expected 'auto', 'grouped_mm' or 'loop', got {gemm!r}")
    if (gate is None) == (activation is None):
        raise ValueError("padmoe experts: give exactly one of gate= (gated MLP) and activation= (ungated)")
    if weighting != "none" and top_k_weights is None:
        raise ValueError(f"padmoe experts: weighting={weighting!r} needs the router weights (got None)")

    for name, fn, known in (("gate", gate, GATES), ("activation", activation, ACTIVATIONS)):
        if isinstance(fn, str) and fn not in known:
            raise ValueError(f"padmoe experts: {name}: unknown activation {fn!r} (known: {', '.join(sorted(known))})")
    if interleaved and not isinstance(gate, str):
        raise ValueError("padmoe experts: interleaved= is for gate= given by name (a callable gate splits h itself)")

    _check_weights(hidden_states, up, down, up_bias, down_bias, transposed, gate, activation)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    out_dtype = x.dtype
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        cdt = torch.get_autocast_dtype(dev)
        x, up, down = _cast(x, cdt), _cast(up, cdt), _cast(down, cdt)
        up_bias, down_bias = _cast(up_bias, cdt), _cast(down_bias, cdt)
    elif up.dtype != x.dtype:
        x = x.to(up.dtype)  # like transformers' grouped_mm path: rows follow the weights
    num_experts = up.shape[0]
    if alignment is None:
        alignment = default_alignment(x.device)
    weights = top_k_weights if weighting != "none" else None
    r = Routing.from_topk(top_k_index, weights, num_experts, alignment, check=check, drop_invalid=drop_invalid)
    offs = r.offsets
    # With no gradient to take (generation, serving: no_grad / inference_mode) the padding rows and
    # the rows past P are left unwritten: the GEMMs, the activation and `post` work row by row and
    # combine reads real rows only, so their contents reach nothing (at decode those rows outnumber
    # the real ones). A weight gradient sums over every row of a segment, so with gradients they are
    # zero, as Routing.dispatch writes them by default.
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, up, down, up_bias, down_bias, weights)
    )
    name = gate if gate is not None else activation
    if (
        isinstance(name, str)
        and post is None
        and gemm != "loop"
        and x.dtype == out_dtype
        and all(t is None or t.dtype == x.dtype for t in (up, down, up_bias, down_bias))
        and _operator_gemms(x, up, down, transposed)
    ):
        return expert_mlp(
            x, r, up, down, up_bias=up_bias, down_bias=down_bias, transposed=transposed, activation=name,
            gated=gate is not None, interleaved=interleaved, weighting=weighting, grads=grads,
            alpha=swiglu_alpha, limit=swiglu_limit, recompute_rows=recompute_rows,
        ).reshape(shape)  # fmt: skip
    if isinstance(gate, str):
        gate = _named_gate(gate, interleaved, swiglu_alpha, swiglu_limit)
    if isinstance(activation, str):
        activation = ACTIVATIONS[activation]
    rows = r.dispatch(x, weighted=(weighting == "before"), zero_padding=grads)
    h = _gemm(rows, up, offs, transposed, gemm)
    if up_bias is not None:
        h = h + _row_bias(up_bias, r.row_experts)
    h = gate(h) if gate is not None else activation(h)
    ys = _gemm(h, down, offs, transposed, gemm)
    if down_bias is not None:
        ys = ys + _row_bias(down_bias, r.row_experts)
    if post is not None:
        ys = post(ys)
    if ys.dtype != out_dtype and torch.finfo(out_dtype).bits > torch.finfo(ys.dtype).bits:
        ys = ys.to(out_dtype)  # autocast: sum the expert outputs in the caller's (wider) dtype
    out = r.combine(ys, weighted=(weighting == "after"))
    return out.to(out_dtype).reshape(shape)


# ---------------------------------------------------------------------------
# GroupedExperts: the module
# ---------------------------------------------------------------------------


def _gelu_tanh(t: Tensor) -> Tensor:
    return F.gelu(t, approximate="tanh")


def _apply_gate(act: Callable[[Tensor], Tensor], h: Tensor, interleaved: bool) -> Tensor:
    """``act(g) * u`` over h's two halves: side by side, or alternating columns (``interleaved``)."""
    g, u = (h[..., 0::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    return act(g) * u


def _named_gate(name: str, interleaved: bool, alpha: float, limit: float) -> Callable[[Tensor], Tensor]:
    """The gate of ``gate=name`` as torch operations (the composition's)."""
    if name == "clamped_swiglu":
        return lambda h: _clamped_swiglu(h, interleaved, alpha, limit)
    act = ACTIVATIONS[name]
    return lambda h: _apply_gate(act, h, interleaved)


def _clamped_swiglu(h: Tensor, interleaved: bool, alpha: float, limit: float) -> Tensor:
    """GPT-OSS's gate, as transformers writes it."""
    g, u = (h[..., 0::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    g = g.clamp(min=None, max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def _operator_gemms(x: Tensor, up: Tensor, down: Tensor, transposed: bool) -> bool:
    """Whether torch's grouped_mm takes both projections' operands (the operator's GEMMs)."""
    up_b = up if transposed else up.transpose(-2, -1)
    down_b = down if transposed else down.transpose(-2, -1)
    # The down projection's rows are the activation's, a new tensor of x's dtype and device, I wide:
    # x stands in for them, with the I-wide stride rule checked here.
    i_bytes = down_b.shape[-2] * x.element_size()
    return grouped_mm_usable(x, up_b) and grouped_mm_usable(x, down_b) and i_bytes % 16 == 0


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
    "relu2": lambda t: F.relu(t).square(),
    "sigmoid": torch.sigmoid,
    "identity": lambda t: t,
}
GATES = frozenset(ACTIVATIONS) | {"clamped_swiglu"}  # the names gate= takes


class GroupedExperts(nn.Module):
    """E expert MLPs with 3D weights, run on padmoe's padded routing with grouped GEMMs.

    ``GroupedExperts(num_experts, hidden_size, intermediate_size, activation="silu", gated=True)``
    holds (the parameter names and layouts of transformers' experts modules, so their state dicts
    load as they are):

    - gated: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first, then up; ``interleaved=True``:
      gate and up alternate, GPT-OSS's layout), ungated: ``up_proj`` ``[E, I, H]``;
    - ``down_proj`` ``[E, H, I]``;
    - with ``bias=True``: ``gate_up_proj_bias`` / ``up_proj_bias`` ``[E, 2I]`` / ``[E, I]`` and
      ``down_proj_bias`` ``[E, H]``;
    - ``transposed=True`` stores every weight as ``[E, in, out]`` instead.

    ``forward(hidden_states[..., H], top_k_index[T, K], top_k_weights[T, K])`` -> ``[..., H]``:
    the combined output ``sum_k w[t,k] * expert(x[t])`` (``weighting="before"``: the weights scale
    the expert inputs instead, as routers that weight before the experts do; ``"none"``: no
    weights). ``activation``: a name in :data:`ACTIVATIONS` or a callable; ``gate_fn``: a callable
    ``[rows, 2I] -> [rows, I]`` replacing the default ``act(gate) * up`` (e.g. a clamped SwiGLU).
    ``alignment`` (default 16 on CUDA, 1 elsewhere), ``gemm`` ("auto", "grouped_mm", "loop"),
    ``check`` and ``recompute_rows`` go to :func:`experts_forward`, the function the transformers
    integration runs too.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: Union[str, Callable[[Tensor], Tensor]] = "silu",
        gated: bool = True,
        bias: bool = False,
        transposed: bool = False,
        interleaved: bool = False,
        gate_fn: Optional[Callable[[Tensor], Tensor]] = None,
        weighting: str = "after",
        alignment: Optional[int] = None,
        gemm: str = "auto",
        check: Optional[bool] = None,
        recompute_rows: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        op = "GroupedExperts"
        num_experts = int_arg(op, "num_experts", num_experts, 1, INT32_MAX)  # padmoe's plans index experts in int32
        hidden_size = int_arg(op, "hidden_size", hidden_size, 1)
        intermediate_size = int_arg(op, "intermediate_size", intermediate_size, 1)
        if alignment is not None:
            alignment = int_arg(op, "alignment", alignment, 1, INT32_MAX)
        self._named = isinstance(activation, str) and gate_fn is None  # the one-operator MLP
        if isinstance(activation, str):
            known = GATES if gated else ACTIVATIONS
            if activation not in known:
                raise ValueError(
                    f"GroupedExperts: activation: unknown name {activation!r} "
                    f"(known: {', '.join(sorted(known))}; or pass a callable)"
                )
            self.activation_name = activation
            activation = ACTIVATIONS.get(activation)
        else:
            self.activation_name = getattr(activation, "__name__", type(activation).__name__)
        if weighting not in ("after", "before", "none"):
            raise ValueError(f"GroupedExperts: weighting: expected 'after', 'before' or 'none', got {weighting!r}")
        if gemm not in ("auto", "grouped_mm", "loop"):
            raise ValueError(f"GroupedExperts: gemm: expected 'auto', 'grouped_mm' or 'loop', got {gemm!r}")
        if (interleaved or gate_fn is not None) and not gated:
            raise ValueError("GroupedExperts: interleaved= and gate_fn= are for gated experts (gated=True)")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.act_fn = activation
        self.gated, self.has_bias, self.transposed, self.interleaved = gated, bias, transposed, interleaved
        self.gate_fn, self.weighting, self.alignment, self.gemm, self.check = gate_fn, weighting, alignment, gemm, check
        self.recompute_rows = bool(recompute_rows)
        kw = dict(device=device, dtype=dtype)
        n1 = 2 * intermediate_size if gated else intermediate_size
        up_shape = (num_experts, hidden_size, n1) if transposed else (num_experts, n1, hidden_size)
        down_shape = (
            (num_experts, intermediate_size, hidden_size)
            if transposed
            else (num_experts, hidden_size, intermediate_size)
        )
        up_name = "gate_up_proj" if gated else "up_proj"
        setattr(self, up_name, nn.Parameter(torch.empty(up_shape, **kw)))
        self.down_proj = nn.Parameter(torch.empty(down_shape, **kw))
        if bias:
            setattr(self, up_name + "_bias", nn.Parameter(torch.empty(num_experts, n1, **kw)))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self._up_name = up_name
        self.reset_parameters()

    @property
    def up_weight(self) -> Tensor:
        return getattr(self, self._up_name)

    @property
    def up_bias(self) -> Optional[Tensor]:
        return getattr(self, self._up_name + "_bias", None)

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, per expert: uniform in +-1/sqrt(fan_in)."""
        for w, fan_in in ((self.up_weight, self.hidden_size), (self.down_proj, self.intermediate_size)):
            nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        if self.has_bias:
            nn.init.uniform_(self.up_bias, -1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
            b = 1 / math.sqrt(self.intermediate_size)
            nn.init.uniform_(self.down_proj_bias, -b, b)

    def _gate(self, h: Tensor) -> Tensor:
        return self.gate_fn(h) if self.gate_fn is not None else _apply_gate(self.act_fn, h, self.interleaved)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Optional[Tensor] = None) -> Tensor:
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"GroupedExperts: hidden_states: expected [..., hidden_size = {self.hidden_size}], got "
                f"shape {list(hidden_states.shape)}"
            )
        return experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.up_weight,
            self.down_proj,
            up_bias=self.up_bias,
            down_bias=getattr(self, "down_proj_bias", None),
            transposed=self.transposed,
            gate=(self.activation_name if self._named else self._gate) if self.gated else None,
            activation=None if self.gated else (self.activation_name if self._named else self.act_fn),
            interleaved=self.interleaved and self._named,
            weighting=self.weighting,
            alignment=self.alignment,
            gemm=self.gemm,
            check=self.check,
            recompute_rows=self.recompute_rows,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, activation={self.activation_name}, gated={self.gated}, "
            f"bias={self.has_bias}, transposed={self.transposed}, weighting={self.weighting!r}"
        )
