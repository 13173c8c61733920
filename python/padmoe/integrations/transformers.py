"""padmoe as an experts implementation of Hugging Face transformers (5.x).

::

    import padmoe.integrations.transformers        # registers "padmoe" (or call register())
    model.set_experts_implementation("padmoe")      # every MoE block's experts now run on padmoe
    # or at load time: AutoModelForCausalLM.from_pretrained(..., experts_implementation="padmoe")

transformers routes the experts of every MoE block through its ``ExpertsInterface``: an experts
module (a class decorated with ``@use_experts_implementation``) keeps its 3D weights and
calls the implementation named by ``config._experts_implementation`` with
``(self, hidden_states[T, H], top_k_index[T, K], top_k_weights[T, K])``; the router, the shared
experts and any scaling stay the model's own code. The decorator records the layout on the module:

- ``has_gate``: ``gate_up_proj`` (a gated MLP; the module's ``_apply_gate`` maps ``[rows, 2I]`` to
  ``[rows, I]``: transformers' default ``act(gate) * up`` on the two halves, or the family's own, e.g.
  GPT-OSS's clamped SwiGLU on interleaved columns) or ``up_proj`` with ``act_fn`` (ungated);
- ``is_transposed``: weights ``[E, in, out]`` instead of ``nn.Linear``'s ``[E, out, in]``;
- ``has_bias``: ``gate_up_proj_bias`` / ``up_proj_bias`` and ``down_proj_bias``, per expert;
- ``is_concatenated``: where gate and up sit in ``gate_up_proj`` (side by side, or interleaved);
- ``has_post_expert_norm`` (newer transformers): ``post_expert_norm`` on each expert's output;
- ``_is_expert_parallel`` (newer transformers): ids ``>= num_experts`` are other ranks' experts.

:func:`padmoe_experts_forward` reads exactly these and runs :func:`padmoe.torch.experts_forward`
(the code of ``padmoe.torch.GroupedExperts``): padmoe's ``Routing`` (plan, dispatch, combine with the
router weights), grouped GEMMs with ``offs = padded_bins`` where torch has them and a loop over
segments otherwise. Where the gate is one padmoe knows (transformers' default ``_apply_gate`` with
an activation of ``torch.nn`` or ``transformers.activations`` that padmoe has by name, GPT-OSS's
clamped SwiGLU) or the ungated ``act_fn`` is, the MLP runs as padmoe's one operator (fused
activation, hand-written backward); a family's own gate runs as the module writes it. An experts module it cannot read (no such attributes, weights that are not 3D
float tensors, a decorator option this version does not know) raises
:class:`UnsupportedExpertsError` naming its class and model family.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

try:
    import transformers as _transformers
    from transformers.integrations import moe as _moe

    _ExpertsInterface = _moe.ExpertsInterface
except (ImportError, AttributeError) as _e:  # pragma: no cover (tested by the skip)
    raise ImportError(
        "padmoe.integrations.transformers needs transformers >= 5 (its ExpertsInterface in "
        f"transformers.integrations.moe): {_e}"
    ) from _e

from padmoe.torch import experts_forward

__all__ = ["register", "padmoe_experts_forward", "family_of", "UnsupportedExpertsError", "NAME"]

NAME = "padmoe"

# Options of the registered implementation (register() sets them).
_OPTIONS = {"alignment": None, "gemm": "auto", "check": None}

# The options of transformers' @use_experts_implementation that this module reads (each becomes a
# module attribute of the same name). Any other option, set to a value other than its default on a
# module, is a layout this module does not know: such modules raise instead of computing
# something else.
_HANDLED = {"has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm"}
_NOT_FLAGS = {"experts_class", "experts_interface"}


def _decorator_defaults() -> dict:
    try:
        params = inspect.signature(_moe.use_experts_implementation).parameters
    except (AttributeError, TypeError, ValueError):  # pragma: no cover
        return {}
    return {n: p.default for n, p in params.items() if n not in _NOT_FLAGS and p.default is not inspect.Parameter.empty}


_UNKNOWN_FLAGS = {n: d for n, d in _decorator_defaults().items() if n not in _HANDLED}


class UnsupportedExpertsError(NotImplementedError):
    """An experts module whose layout the padmoe experts implementation does not know."""


def family_of(module: torch.nn.Module) -> str:
    """The transformers model family of a module (``"mixtral"`` for
    ``transformers.models.mixtral.modeling_mixtral``), else the module path of its class."""
    path = type(module).__module__
    parts = path.split(".")
    if len(parts) >= 3 and parts[0] == "transformers" and parts[1] == "models":
        return parts[2]
    return path


def _unsupported(module, reason: str) -> UnsupportedExpertsError:
    return UnsupportedExpertsError(
        f"padmoe experts implementation: {type(module).__name__} (transformers model family "
        f"'{family_of(module)}') is not supported: {reason}. padmoe runs experts modules made by transformers' "
        "@use_experts_implementation with 3D float expert weights (gate_up_proj or up_proj, down_proj; "
        "optional per-expert biases); use another experts implementation for this model, e.g. "
        "model.set_experts_implementation('grouped_mm') or 'eager'."
    )


def _weight(module, name: str) -> torch.Tensor:
    w = getattr(module, name, None)
    if not isinstance(w, torch.Tensor):
        raise _unsupported(module, f"it has no 3D expert weight `{name}`")
    if w.dim() != 3:
        raise _unsupported(module, f"`{name}` has shape {tuple(w.shape)}, not 3D [experts, ., .]")
    if not w.is_floating_point() or w.element_size() < 2:
        raise _unsupported(
            module, f"`{name}` is {w.dtype} (quantized weights are not supported; float32 / bfloat16 / float16 are)"
        )
    return w


def _bias(module, name: str, experts: int, width: int) -> torch.Tensor:
    b = getattr(module, name, None)
    if not isinstance(b, torch.Tensor) or tuple(b.shape) != (experts, width):
        got = "missing" if not isinstance(b, torch.Tensor) else f"of shape {tuple(b.shape)}"
        raise _unsupported(module, f"has_bias is set but `{name}` is {got}, expected [{experts}, {width}]")
    return b


def _layout(module, hidden: int):
    """(up, down, up_bias, down_bias, gate, activation, post, transposed) of a transformers experts
    module, checked; raises UnsupportedExpertsError naming the module and family."""
    if not hasattr(module, "has_gate") or not hasattr(module, "is_transposed"):
        raise _unsupported(
            module,
            "it has no has_gate / is_transposed attributes (not an experts module of transformers' ExpertsInterface)",
        )
    for flag, default in _UNKNOWN_FLAGS.items():
        if getattr(module, flag, default) != default:
            raise _unsupported(
                module,
                f"it sets the experts option {flag}={getattr(module, flag)!r}, which this "
                f"padmoe version does not handle (transformers {_transformers.__version__})",
            )
    gated, transposed = bool(module.has_gate), bool(module.is_transposed)
    up_name = "gate_up_proj" if gated else "up_proj"
    up, down = _weight(module, up_name), _weight(module, "down_proj")
    experts = up.shape[0]
    if down.shape[0] != experts:
        raise _unsupported(module, f"{up_name} has {experts} experts but down_proj {down.shape[0]}")
    num = getattr(module, "num_experts", experts)
    if isinstance(num, int) and num != experts:
        raise _unsupported(module, f"num_experts is {num} but {up_name} holds {experts} experts")
    up_in, up_out = (up.shape[1], up.shape[2]) if transposed else (up.shape[2], up.shape[1])
    down_in, down_out = (down.shape[1], down.shape[2]) if transposed else (down.shape[2], down.shape[1])
    if up_in != hidden or down_out != hidden:
        layout = "[E, in, out]" if transposed else "[E, out, in]"
        raise _unsupported(
            module,
            f"hidden size {hidden} does not match {up_name} {tuple(up.shape)} and down_proj "
            f"{tuple(down.shape)} in the {layout} layout (is_transposed={transposed})",
        )
    up_bias = down_bias = None
    if getattr(module, "has_bias", False):
        up_bias = _bias(module, up_name + "_bias", experts, up_out)
        down_bias = _bias(module, "down_proj_bias", experts, down_out)
    gate = activation = None
    if gated:
        gate = getattr(module, "_apply_gate", None)
        if not callable(gate):
            raise _unsupported(module, "has_gate is set but it has no _apply_gate")
    else:
        activation = getattr(module, "act_fn", None)
        if not callable(activation):
            raise _unsupported(module, "it is ungated (has_gate=False) but has no act_fn")
    post = None
    if getattr(module, "has_post_expert_norm", False):
        post = getattr(module, "post_expert_norm", None)
        if not callable(post):
            raise _unsupported(module, "has_post_expert_norm is set but it has no post_expert_norm")
    return up, down, up_bias, down_bias, gate, activation, post, transposed, down_in


# Activation modules padmoe has by name: class name -> name (classes of torch.nn and transformers.activations).
_ACTIVATION_CLASSES = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "ReLU": "relu",
    "ReLUSquaredActivation": "relu2",
    "Sigmoid": "sigmoid",
}


def _activation_name(act) -> Optional[str]:
    """padmoe's name for an activation module, or None (then the module's own code runs)."""
    cls = type(act)
    if not (cls.__module__.startswith("torch.nn") or cls.__module__ == "transformers.activations"):
        return None
    if cls.__name__ == "GELU" and cls.__module__.startswith("torch.nn"):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(getattr(act, "approximate", None))
    return _ACTIVATION_CLASSES.get(cls.__name__)


def _named_gate(module):
    """(gate name, interleaved, alpha, limit) where padmoe knows the module's gate, else None."""
    apply = getattr(type(module), "_apply_gate", None)
    qualname = getattr(apply, "__qualname__", "")
    interleaved = not getattr(module, "is_concatenated", True)
    if qualname == "_default_apply_gate":  # act_fn(gate) * up on the halves the layout says
        name = _activation_name(getattr(module, "act_fn", None))
        return None if name is None else (name, interleaved, 1.702, 7.0)
    if qualname == "GptOssExperts._apply_gate" and family_of(module) == "gpt_oss":
        alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
        if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
            return "clamped_swiglu", True, float(alpha), float(limit)  # its _apply_gate reads ::2 / 1::2
    return None


def padmoe_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: Optional[torch.Tensor] = None,
    top_k_weights: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """The "padmoe" experts implementation: ``(experts module, hidden_states[T, H], top_k_index[T, K],
    top_k_weights[T, K]) -> [T, H]``, ``sum_k w[t, k] * expert_{e[t, k]}(x[t])`` in
    ``hidden_states``' dtype, differentiable in the rows, the router weights and every expert
    weight and bias."""
    if top_k_index is None:
        top_k_index = kwargs.pop("router_indices", None)
    if top_k_weights is None:
        top_k_weights = kwargs.pop("routing_weights", None)
    if kwargs:
        raise TypeError(
            f"padmoe experts implementation: unexpected arguments {sorted(kwargs)} from "
            f"{type(self).__name__} (transformers model family '{family_of(self)}')"
        )
    if top_k_index is None or top_k_weights is None:
        raise _unsupported(self, "its block calls the experts without top-k ids and weights")
    up, down, up_bias, down_bias, gate, activation, post, transposed, _ = _layout(self, hidden_states.shape[-1])
    named = {}
    if gate is not None:
        known = _named_gate(self)
        if known is not None:
            gate = known[0]
            named = dict(interleaved=known[1], swiglu_alpha=known[2], swiglu_limit=known[3])
    else:
        activation = _activation_name(activation) or activation
    return experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        up,
        down,
        up_bias=up_bias,
        down_bias=down_bias,
        transposed=transposed,
        gate=gate,
        activation=activation,
        post=post,
        weighting="after",
        alignment=_OPTIONS["alignment"],
        gemm=_OPTIONS["gemm"],
        check=_OPTIONS["check"],
        drop_invalid=bool(getattr(self, "_is_expert_parallel", False)),
        **named,
    )


def register(
    name: str = NAME, *, alignment: Optional[int] = None, gemm: str = "auto", check: Optional[bool] = None
) -> str:
    """Add (or update) the experts implementation ``name`` ("padmoe") in transformers'
    ``ExpertsInterface``; returns the name. Importing this module already calls ``register()``.

    ``alignment``: segment row multiple (default: 16 on CUDA, 1 elsewhere); ``gemm``: ``"auto"``
    (``grouped_mm`` where torch has a kernel for the inputs, else a loop over segments),
    ``"grouped_mm"`` or ``"loop"``; ``check``: padmoe's data checks (``None``: checked in eager mode
    except during CUDA-graph capture, never under torch.compile; ``False``: never). The options apply to every model using the implementation."""
    if gemm not in ("auto", "grouped_mm", "loop"):
        raise ValueError(f"register: gemm: expected 'auto', 'grouped_mm' or 'loop', got {gemm!r}")
    if alignment is not None and int(alignment) < 1:
        raise ValueError(f"register: alignment: expected a positive integer or None, got {alignment!r}")
    _OPTIONS.update(alignment=None if alignment is None else int(alignment), gemm=gemm, check=check)
    _ExpertsInterface.register(name, padmoe_experts_forward)
    return name


register()
