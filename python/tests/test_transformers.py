"""padmoe.integrations.transformers and padmoe.torch.GroupedExperts against transformers' own experts.

Every reference here is independent of padmoe: transformers' eager experts (its per-expert loop,
``experts_implementation="eager"``), run in the same dtype, or a float64 run of it, or (for
GroupedExperts) a plain float64 loop over tokens written in this file. Configs are tiny, random and
built here (``from_config``, seeded): nothing is downloaded. Skipped when transformers is not
importable (scripts/pytest.sh installs it with torch).
"""

from __future__ import annotations

import copy
import glob
import importlib
import inspect
import math
import os
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
try:
    from transformers.integrations import moe as _tf_moe

    _tf_moe.ExpertsInterface
except (ImportError, AttributeError):  # pragma: no cover
    pytest.skip("transformers without an ExpertsInterface (< 5)", allow_module_level=True)

import padmoe.integrations.transformers as ptf  # noqa: E402
import padmoe.torch as pt  # noqa: E402
from padmoe._plan import Plan  # noqa: E402
from padmoe.torch import _expert_mlp as expert_mlp_module  # noqa: E402
from padmoe.torch import grouped as _grouped  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

H, I, E, K = 32, 48, 8, 2  # hidden, expert intermediate, experts, top-k (multiples of 16 bytes: grouped_mm)


def _attn(**kw):
    return dict(
        vocab_size=64,
        hidden_size=H,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kw,
    )


# family -> (config class name, config kwargs). Each is a whole tiny CausalLM; every layer is MoE.
FAMILIES = {
    "mixtral": ("MixtralConfig", _attn(intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        _attn(
            intermediate_size=64,
            moe_intermediate_size=I,
            num_experts=E,
            num_experts_per_tok=K,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        _attn(
            intermediate_size=64,
            moe_intermediate_size=I,
            num_experts=E,
            num_experts_per_tok=K,
            head_dim=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        ),
    ),
    "olmoe": ("OlmoeConfig", _attn(intermediate_size=I, num_experts=E, num_experts_per_tok=K)),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            vocab_size=64,
            hidden_size=H,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            intermediate_size=64,
            moe_intermediate_size=I,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        _attn(intermediate_size=I, num_local_experts=E, num_experts_per_tok=K, head_dim=8, sliding_window=8),
    ),
}


def _config(family, layers=1):
    name, kw = FAMILIES[family]
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    kw = dict(kw, num_hidden_layers=layers)
    if family == "gpt_oss":
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return cls(**kw)


def _randomize(module, seed):
    """Every parameter ~ N(0, 1/fan_in) (1-D ones: N(0, 0.1^2), norm weights 1 + N(0, 0.1^2)), seeded: outputs
    of order one, so relative errors mean something (from_config's std 0.02 makes them tiny)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                v = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1
                if "norm" in name or "layernorm" in name:
                    v = v + 1
            else:
                fan_in = (
                    p.shape[-2]
                    if name.endswith(("gate_up_proj", "down_proj", "up_proj"))
                    and getattr(_owner(module, name), "is_transposed", False)
                    else p.shape[-1]
                )
                v = torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)
            p.copy_(v.to(p.dtype))


def _owner(root, name):
    m = root
    for part in name.split(".")[:-1]:
        m = getattr(m, part)
    return m


def _model(family, device, dtype=torch.float32, layers=1, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, layers)).to(torch.float32)
    _randomize(model, seed)
    return model.to(device=device, dtype=dtype).train()


def _moe_block(model):
    """The first MoE block: the module whose `experts` is an experts module of the ExpertsInterface."""
    for m in model.modules():
        ex = getattr(m, "experts", None)
        if isinstance(ex, torch.nn.Module) and hasattr(ex, "has_gate"):
            return m
    raise AssertionError("no MoE block found")


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _run_block(model, impl, x):
    """Output and gradients (input, then every block parameter by name) of the first MoE block, with
    the experts implementation `impl`, for the loss sum(out * grad_out)."""
    model.set_experts_implementation(impl)
    block = _moe_block(model)
    assert block.experts.config._experts_implementation == impl
    x = x.detach().clone().requires_grad_(True)
    out = _first(block(x))
    g = torch.Generator().manual_seed(99)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    names, params = zip(*[(n, p) for n, p in block.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad(out, (x,) + params, grad_out, allow_unused=True)
    return out.detach(), dict(zip(("input",) + names, grads))


def _rel(a, ref):
    """max |a - ref| / max |ref|, in float64."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    scale = ref.abs().max().item()
    return (a - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def _x(device, dtype, tokens=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens // 2, H, generator=g).to(device, dtype)


# ---------------------------------------------------------------------------
# Registration, switching
# ---------------------------------------------------------------------------


def test_registered_and_switchable():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert "padmoe" in ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS["padmoe"] is ptf.padmoe_experts_forward
    model = _model("mixtral", "cpu")
    model.set_experts_implementation("padmoe")
    assert all(m.config._experts_implementation == "padmoe" for m in model.modules() if hasattr(m, "has_gate"))
    # and back
    model.set_experts_implementation("eager")
    assert model.config._experts_implementation == "eager"
    # at construction, through the config
    cfg = _config("mixtral")
    m2 = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="padmoe")
    assert m2.config._experts_implementation == "padmoe"


def test_register_options():
    try:
        assert ptf.register("padmoe_loop", gemm="loop", alignment=4) == "padmoe_loop"
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        assert "padmoe_loop" in ALL_EXPERTS_FUNCTIONS
        model = _model("mixtral", "cpu")
        x = _x("cpu", torch.float32)
        ref, ref_g = _run_block(model, "eager", x)
        out, g = _run_block(model, "padmoe_loop", x)
        assert _rel(out, ref) < 2e-6
        assert max(_rel(g[n], ref_g[n]) for n in ref_g) < 2e-6
        with pytest.raises(ValueError, match="gemm"):
            ptf.register(gemm="fast")
    finally:
        ptf.register()  # the defaults again


# ---------------------------------------------------------------------------
# Each family's block against transformers' eager experts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_float32_matches_eager(family, device):
    """Output, input gradient, router / shared-expert / expert weight (and bias) gradients of the
    block, float32, against transformers' eager experts: within 2e-6 of max |ref| each."""
    model = _model(family, device)
    x = _x(device, torch.float32)
    ref, ref_g = _run_block(model, "eager", x)
    out, g = _run_block(model, "padmoe", x)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    errs = {"out": _rel(out, ref)}
    for name, rg in ref_g.items():
        assert g[name] is not None, name
        errs[name] = _rel(g[name], rg)
    experts = [n for n in ref_g if n.startswith("experts.")]
    assert (
        experts and "input" in errs and any("gate" in n or "router" in n for n in ref_g if not n.startswith("experts."))
    )
    bad = {n: e for n, e in errs.items() if not e < 2e-6}
    assert not bad, f"{family}: {bad}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_runs_the_one_operator(family):
    """Every family here has a gate padmoe knows by name (transformers' default gate with SiLU, or
    GPT-OSS's clamped SwiGLU): its experts run as padmoe's one operator, not the composition."""
    model = _model(family, "cpu")
    model.set_experts_implementation("padmoe")
    block = _moe_block(model)
    assert ptf._named_gate(block.experts) is not None
    seen = []
    hook = block.experts.register_forward_hook(lambda mod, args, out: seen.append(out))
    _first(block(_x("cpu", torch.float32).requires_grad_()))
    hook.remove()
    nodes, todo = set(), [seen[0].grad_fn]
    while todo:
        n = todo.pop()
        if n is not None and type(n).__name__ not in nodes:
            nodes.add(type(n).__name__)
            todo.extend(f for f, _ in n.next_functions)
    assert "_ExpertMLPBackward" in nodes


def test_activation_names_of_modules():
    from transformers.activations import ACT2FN

    names = {
        k: ptf._activation_name(ACT2FN[k])
        for k in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "relu2", "sigmoid", "mish")
    }
    assert names == {
        "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
        "relu": "relu", "relu2": "relu2", "sigmoid": "sigmoid", "mish": None,
    }  # fmt: skip
    assert ptf._activation_name(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert ptf._activation_name(lambda t: t) is None


def _routing(model):
    """Capture the top-k ids the experts get (a forward pre-hook)."""
    seen = []
    block = _moe_block(model)
    h = block.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1].detach().sort(-1).values.cpu()))
    return seen, h


def _bf16_case(family, device, seed):
    """(bf16 model, float64 model with the same (bf16-rounded) parameters, input) where the bf16 and
    float64 routers choose the same experts for every token (else None: near-ties)."""
    m16 = _model(family, device, torch.bfloat16, seed=seed)
    m64 = copy.deepcopy(m16).to(torch.float64)
    x = _x(device, torch.bfloat16, seed=seed)
    picks = []
    for m, xx in ((m16, x), (m64, x.double())):
        seen, h = _routing(m)
        m.set_experts_implementation("eager")
        with torch.no_grad():
            _moe_block(m)(xx)
        h.remove()
        picks.append(seen[0])
    return (m16, m64, x) if torch.equal(*picks) else None


def _fro(a, ref):
    """||a - ref|| / ||ref|| (Frobenius), in float64: a rounding-error measure over every element."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return ((a - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_bfloat16_no_worse_than_eager(family, device):
    """bfloat16 block: output and every gradient measured against a float64 run of transformers' eager
    experts (same bf16-rounded parameters, same routing; seeds with a bf16/float64 routing near-tie
    are skipped), over 4 seeds (RMS over seeds of ||err|| / ||ref||). Overall (mean over the output
    and all gradients) padmoe's error is no larger than transformers' own bf16 eager error; per
    tensor it is within 15% of it (both are bf16 rounding noise of the same size: a wrong layout,
    gate or bias would be off by O(1))."""
    runs = []
    for seed in range(20):
        case = _bf16_case(family, device, seed)
        if case is None:
            continue
        m16, m64, x = case
        ref, ref_g = _run_block(m64, "eager", x.double())
        eager, eager_g = _run_block(m16, "eager", x)
        mine, mine_g = _run_block(m16, "padmoe", x)
        assert mine.dtype == torch.bfloat16
        row = {"out": (_fro(mine, ref), _fro(eager, ref))}
        row.update({n: (_fro(mine_g[n], r), _fro(eager_g[n], r)) for n, r in ref_g.items()})
        runs.append(row)
        if len(runs) == 4:
            break
    assert len(runs) == 4, "too many routing near-ties between bf16 and float64"
    rms = {n: tuple(math.sqrt(sum(r[n][i] ** 2 for r in runs) / len(runs)) for i in (0, 1)) for n in runs[0]}
    assert all(0 < e < 0.05 for _, e in rms.values())  # eager's bf16 error: rounding-sized, not zero
    bad = {n: pe for n, pe in rms.items() if not pe[0] <= 1.15 * pe[1]}
    assert not bad, f"{family}: (padmoe err, eager err) {bad}"
    mine_all = sum(p for p, _ in rms.values()) / len(rms)
    eager_all = sum(e for _, e in rms.values()) / len(rms)
    assert mine_all <= eager_all, (mine_all, eager_all, rms)


# ---------------------------------------------------------------------------
# Whole model, autocast, torch.compile
# ---------------------------------------------------------------------------


def _lm_step(model, impl, ids):
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_causal_lm_forward_backward(family, device):
    """A whole 2-layer CausalLM (loss with labels), forward and backward: logits, loss and the
    gradient of every parameter match eager experts in float32."""
    model = _model(family, device, layers=2)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3)).to(device)
    ref_logits, ref_loss, ref_g = _lm_step(model, "eager", ids)
    logits, loss, g = _lm_step(model, "padmoe", ids)
    assert _rel(logits, ref_logits) < 2e-6 and abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    assert set(g) == set(ref_g) and any(".experts." in n for n in g)
    bad = {n: _rel(g[n], ref_g[n]) for n in ref_g if not _rel(g[n], ref_g[n]) < 5e-6}
    assert not bad, bad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_bf16_autocast(family, device):
    """A float32 model under torch.autocast(bfloat16): padmoe's block output and gradients stay float32
    (like eager's) and agree with eager-under-autocast to bf16 rounding (same routing: the router is
    the model's code); their error against the float32 eager run is within 15% of eager-under-autocast's
    own (padmoe casts rows and weights to bf16 for grouped_mm, as autocast does for F.linear)."""
    model = _model(family, device)
    x = _x(device, torch.float32)
    ref, ref_g = _run_block(model, "eager", x)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        eager, eager_g = _run_block(model, "eager", x)
        mine, mine_g = _run_block(model, "padmoe", x)
    assert mine.dtype == eager.dtype == torch.float32
    assert all(mine_g[n].dtype == torch.float32 for n in mine_g)
    rows = [("out", _fro(mine, ref), _fro(eager, ref), _fro(mine, eager))]
    rows += [(n, _fro(mine_g[n], r), _fro(eager_g[n], r), _fro(mine_g[n], eager_g[n])) for n, r in ref_g.items()]
    assert all(e > 1e-4 for _, _, e, _ in rows)  # autocast did run in bf16
    bad = [r for r in rows if not (r[1] <= 1.15 * r[2] + 1e-4 and r[3] < 3e-2)]
    assert not bad, bad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_fullgraph_block(device, dtype):
    """torch.compile(fullgraph=True) of a Mixtral block with padmoe experts (fullgraph: any graph break
    raises), forward and backward, against the same block in eager mode."""
    torch._dynamo.reset()
    model = _model("mixtral", device, dtype)
    model.set_experts_implementation("padmoe")
    block = _moe_block(model)
    x = _x(device, dtype)
    ref, ref_g = _run_block(model, "padmoe", x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    xx = x.detach().clone().requires_grad_(True)
    out = _first(compiled(xx))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64).to(
        device, dtype
    )
    out.backward(grad_out)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(out, ref) <= tol and _rel(xx.grad, ref_g["input"]) <= tol
    assert _rel(block.experts.gate_up_proj.grad, ref_g["experts.gate_up_proj"]) <= tol


# ---------------------------------------------------------------------------
# Unsupported modules: a clear error naming them
# ---------------------------------------------------------------------------


def _mixtral_experts():
    model = _model("mixtral", "cpu")
    return _moe_block(model).experts


def _call(experts):
    x = torch.randn(5, H)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    w = torch.full((5, 2), 0.5)
    return ptf.padmoe_experts_forward(experts, x, idx, w)


def test_unknown_module_raises_naming_it():
    class MyExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, H, H))

    with pytest.raises(ptf.UnsupportedExpertsError, match=r"MyExperts .*family '.*test_transformers'.*has_gate"):
        _call(MyExperts())


def test_unknown_option_raises_naming_family(monkeypatch):
    """An experts option of transformers' decorator this padmoe version does not read (simulated by
    adding one) raises, naming the class, the family and the option."""
    ex = _mixtral_experts()
    monkeypatch.setitem(ptf._UNKNOWN_FLAGS, "has_fancy_norm", False)
    ex.has_fancy_norm = True
    with pytest.raises(
        ptf.UnsupportedExpertsError,
        match=r"MixtralExperts \(transformers model family 'mixtral'\).*"
        r"has_fancy_norm=True",
    ):
        _call(ex)


def test_quantized_or_misshapen_weights_raise():
    ex = _mixtral_experts()
    ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ptf.UnsupportedExpertsError, match=r"MixtralExperts.*'mixtral'.*float8_e4m3fn"):
        _call(ex)
    ex = _mixtral_experts()
    ex.down_proj = torch.nn.Parameter(ex.down_proj.detach().flatten(1))
    with pytest.raises(ptf.UnsupportedExpertsError, match=r"'mixtral'.*down_proj.*not 3D"):
        _call(ex)
    ex = _mixtral_experts()
    ex.is_transposed = True  # a layout flag that contradicts the weights
    with pytest.raises(ptf.UnsupportedExpertsError, match=r"'mixtral'.*is_transposed=True"):
        _call(ex)


# ---------------------------------------------------------------------------
# Every experts class the installed transformers ships (experts level)
# ---------------------------------------------------------------------------

_TINY = dict(
    hidden_size=H,
    moe_hidden_size=H,
    intermediate_size=I,
    moe_intermediate_size=I,
    expert_intermediate_size=I,
    num_experts=E,
    num_local_experts=E,
    n_routed_experts=E,
    moe_num_experts=E,
    num_experts_per_tok=K,
    moe_latent_size=None,
)


def _shrink(cfg, *tinies) -> None:
    """Each tiny value set on ``cfg`` where it has the attribute; a per-layer list stays a list of
    that value (a list value, such as ``mlp_only_layers=[]``, replaces it)."""
    for tiny in tinies:
        for k, v in tiny.items():
            if hasattr(cfg, k):
                old = getattr(cfg, k)
                per_layer = isinstance(old, (list, tuple)) and v is not None and not isinstance(v, list)
                setattr(cfg, k, [v] * len(old) if per_layer else v)


def _experts_classes():
    """(family, modeling module name, class name) of every @use_experts_implementation class, by source scan."""
    root = os.path.dirname(transformers.__file__)
    found = []
    for path in sorted(glob.glob(os.path.join(root, "models", "*", "modeling_*.py"))):
        with open(path, encoding="utf-8") as f:
            src = f.read()
        for m in re.finditer(r"^@use_experts_implementation[^\n]*\nclass (\w+)\(", src, re.M):
            fam = os.path.basename(os.path.dirname(path))
            found.append((fam, f"transformers.models.{fam}.{os.path.basename(path)[:-3]}", m.group(1)))
    return found


def _tiny_experts(modname, clsname):
    """The experts class built from a tiny version of its config (the configs in its modeling module,
    text configs first), or a reason why not."""
    try:
        mod = importlib.import_module(modname)
    except Exception as e:  # noqa: BLE001 (optional dependencies of a family)
        return None, f"import: {type(e).__name__}"
    cls = getattr(mod, clsname)
    configs = [
        v
        for v in vars(mod).values()
        if isinstance(v, type)
        and issubclass(v, transformers.PretrainedConfig)
        and v is not transformers.PretrainedConfig
    ]
    configs.sort(key=lambda c: ("Text" not in c.__name__, c.__name__))
    # required arguments after the config (a layer index): 0; optional sizes (Ernie-VL's
    # intermediate_size, the per-modality width otherwise read from a list): the tiny ones
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]
    extra = [0 for p in params if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    sizes = {p.name: _TINY[p.name] for p in params if p.default is None and p.name in _TINY}
    last = "no config class"
    for ccls in configs:
        try:
            cfg = ccls()
            _shrink(cfg, _TINY)
            with torch.device("meta"):
                probe = cls(cfg, *extra, **sizes)
            if sum(p.numel() for p in probe.parameters()) > 2_000_000:
                last = "too large"
                continue
            torch.manual_seed(0)
            return cls(cfg, *extra, **sizes).float(), None
        except Exception as e:  # noqa: BLE001
            last = f"{ccls.__name__}: {type(e).__name__}: {str(e)[:80]}"
    return None, last


def test_every_shipped_experts_class():
    """Every experts class of the installed transformers that builds from a tiny config: padmoe
    against its eager experts (random routing with an unused expert), float32, output and every
    gradient (rows, router weights, expert weights and biases) within 1e-5 of max |ref|. At least the
    six families of FAMILIES must be among them."""
    built, failures, skipped = [], [], []
    for fam, modname, clsname in _experts_classes():
        ex, why = _tiny_experts(modname, clsname)
        if ex is None:
            skipped.append((fam, why))
            continue
        _randomize(ex, 0)
        e = ex.gate_up_proj.shape[0] if hasattr(ex, "gate_up_proj") else ex.up_proj.shape[0]
        hid = ex.down_proj.shape[2] if ex.is_transposed else ex.down_proj.shape[1]
        # top-2 with random weights; a class whose eager forward takes one route a row (Ergo's
        # projections, called with weights of one) top-1 with unit weights
        why = None
        for k, unit in ((min(2, e - 1), False), (1, True)):
            g = torch.Generator().manual_seed(5)
            t = 29
            top = torch.stack([torch.randperm(e - 1, generator=g)[:k] + 1 for _ in range(t)])  # expert 0 unused
            w = torch.ones(t, k) if unit else torch.rand(t, k, generator=g).softmax(-1)
            x = torch.randn(t, hid, generator=g)
            grad_out = torch.randn(t, hid, generator=g)
            res = {}
            for impl in ("eager", "padmoe"):
                ex.config._experts_implementation = impl
                xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                ps = [p for p in ex.parameters() if p.requires_grad]
                try:
                    out = ex(xx, top, ww)
                    grads = torch.autograd.grad(out, [xx, ww] + ps, grad_out, allow_unused=True)
                except Exception as exc:  # noqa: BLE001
                    if impl == "eager":
                        why = f"eager failed: {type(exc).__name__}"
                        break
                    raise
                res[impl] = (out, grads)
            if len(res) == 2:
                break
        if len(res) < 2:
            skipped.append((fam, why))
            continue
        errs = [_rel(res["padmoe"][0], res["eager"][0])]
        errs += [_rel(a, b) for a, b in zip(res["padmoe"][1], res["eager"][1]) if b is not None]
        built.append(fam)
        if max(errs) > 1e-5:
            failures.append((fam, clsname, max(errs)))
    assert not failures, failures
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"} <= set(built), (built, skipped)
    print(f"\n{len(built)} experts classes checked ({len(skipped)} not buildable from a tiny config: {skipped})")


# The whole model: a tiny CausalLM of each family (two layers, every one MoE where the config says so).
_LM_TINY = dict(
    vocab_size=64,
    pad_token_id=0,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=64,
    intermediate_size=64,
    first_k_dense_replace=0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_group=1,
    topk_group=1,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    sliding_window=8,
)


def _tiny_lm(fam):
    """A tiny CausalLM of the family, float32, or a reason why not."""
    try:
        mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
    except Exception as e:  # noqa: BLE001 (optional dependencies of a family)
        return None, f"import: {type(e).__name__}"
    lms = [v for k, v in sorted(vars(mod).items()) if k.endswith("ForCausalLM") and isinstance(v, type)]
    if not lms:
        return None, "no CausalLM"
    try:
        cfg = lms[0].config_class()
        _shrink(cfg, _TINY, _LM_TINY)
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
        with torch.device("meta"):
            probe = lms[0](cfg)
        if sum(p.numel() for p in probe.parameters()) > 5_000_000:
            return None, "too large"
        torch.manual_seed(0)
        return lms[0](cfg).float(), None
    except Exception as e:  # noqa: BLE001
        return None, f"build: {type(e).__name__}: {str(e)[:80]}"


def test_every_causal_lm_family():
    """Every family of the installed transformers with an experts class and a CausalLM that builds from
    a tiny config and runs eager: padmoe swapped in by set_experts_implementation, the logits and every
    parameter's gradient within 1e-5 of max |ref| of the eager run (or of a thousandth of the
    model's largest gradient, for a gradient that is only rounding). The five of FAMILIES whose configs
    the sweep's generic sizes fit must be among them (DeepSeek-V3's MLA is checked above)."""
    families = sorted({fam for fam, _, _ in _experts_classes()})
    built, failures, skipped = [], [], []
    for fam in families:
        model, why = _tiny_lm(fam)
        if model is None:
            skipped.append((fam, why))
            continue
        ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(1))
        res = {}
        for impl in ("eager", "padmoe"):
            model.set_experts_implementation(impl)
            model.zero_grad(set_to_none=True)
            try:
                logits = model(ids).logits
            except Exception as exc:  # noqa: BLE001
                if impl == "eager":
                    skipped.append((fam, f"eager failed: {type(exc).__name__}"))
                    break
                raise
            (logits.square().mean()).backward()
            res[impl] = (logits.detach(), [p.grad for p in model.parameters()])
        if len(res) < 2:
            continue
        # a gradient that is zero but for rounding (DeepSeek-V4's hash-routed gate with one expert
        # chosen twice: w = s / (s + s)) is measured against the model's largest gradient
        grads = [(a, b) for a, b in zip(res["padmoe"][1], res["eager"][1]) if b is not None]
        floor = 1e-3 * max(b.abs().max().item() for _, b in grads)
        errs = [_rel(res["padmoe"][0], res["eager"][0])]
        errs += [(a - b).abs().max().item() / max(b.abs().max().item(), floor) for a, b in grads]
        built.append(fam)
        if max(errs) > 1e-5:
            failures.append((fam, max(errs)))
    assert not failures, failures
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"} <= set(built), (built, skipped)
    print(f"\n{len(built)} CausalLM families checked ({len(skipped)} not: {skipped})")


# ---------------------------------------------------------------------------
# GroupedExperts (padmoe.torch) against a float64 loop over tokens
# ---------------------------------------------------------------------------


def _loop_reference(mod, x, idx, w, gate64):
    """float64, one token and one expert at a time, from GroupedExperts' documented layout."""
    f = lambda t: None if t is None else t.detach().double().cpu()  # noqa: E731
    up, down, ub, db = f(mod.up_weight), f(mod.down_proj), f(mod.up_bias), f(getattr(mod, "down_proj_bias", None))
    x, w = f(x), f(w)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            xin = x[t] * w[t, k] if mod.weighting == "before" else x[t]
            h = xin @ up[e] if mod.transposed else up[e] @ xin
            if ub is not None:
                h = h + ub[e]
            a = gate64(h) if mod.gated else mod.act_fn(h)
            y = a @ down[e] if mod.transposed else down[e] @ a
            if db is not None:
                y = y + db[e]
            out[t] += y * (w[t, k] if mod.weighting == "after" else 1.0)
    return out


def _oai_gate(h):
    g, u = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
    return (u + 1) * (g * torch.sigmoid(1.702 * g))


GE_CASES = {
    "swiglu": dict(),
    "gelu_ungated_bias": dict(activation="gelu", gated=False, bias=True),
    "transposed_interleaved_bias_oai": dict(transposed=True, interleaved=True, bias=True, gate_fn=_oai_gate),
    "weight_before": dict(weighting="before"),
    "relu_transposed": dict(activation="relu", transposed=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gemm", ["auto", "loop"])
@pytest.mark.parametrize("case", sorted(GE_CASES))
def test_grouped_experts_against_loop(case, gemm, device):
    kw = GE_CASES[case]
    torch.manual_seed(0)
    mod = pt.GroupedExperts(E, H, I, gemm=gemm, alignment=4, **kw).to(device)
    g = torch.Generator().manual_seed(7)
    t = 19
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] + 1 for _ in range(t)]).to(device)  # expert 0 unused
    w = torch.rand(t, K, generator=g).softmax(-1).to(device).requires_grad_(True)
    x = torch.randn(t, H, generator=g).to(device).requires_grad_(True)
    out = mod(x, idx, w)
    gate64 = (
        (lambda h: kw["gate_fn"](h))
        if "gate_fn" in kw
        else (
            lambda h: (
                mod.act_fn(h[..., ::2]) * h[..., 1::2]
                if mod.interleaved
                else mod.act_fn(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]
            )
        )
    )
    ref = _loop_reference(mod, x, idx.cpu(), w, gate64)
    assert _rel(out, ref) < 2e-6
    # gradients: float64 autograd through the same loop
    ref_mod = copy.deepcopy(mod).cpu().double()
    leaves = dict(ref_mod.named_parameters())
    x64, w64 = x.detach().double().cpu().requires_grad_(True), w.detach().double().cpu().requires_grad_(True)
    go = torch.randn(t, H, generator=g)

    def loop_autograd():
        up, down = ref_mod.up_weight, ref_mod.down_proj
        ub, db = ref_mod.up_bias, getattr(ref_mod, "down_proj_bias", None)
        rows = []
        for tt in range(t):
            acc = 0
            for k in range(K):
                e = int(idx[tt, k])
                xin = x64[tt] * w64[tt, k] if mod.weighting == "before" else x64[tt]
                h = xin @ up[e] if mod.transposed else up[e] @ xin
                h = h + ub[e] if ub is not None else h
                a = gate64(h) if mod.gated else mod.act_fn(h)
                y = a @ down[e] if mod.transposed else down[e] @ a
                y = y + db[e] if db is not None else y
                acc = acc + y * (w64[tt, k] if mod.weighting == "after" else 1.0)
            rows.append(acc)
        return torch.stack(rows)

    (loop_autograd() * go.double()).sum().backward()
    out.backward(go.to(device))
    assert _rel(x.grad, x64.grad) < 2e-6 and _rel(w.grad, w64.grad) < 2e-6
    for n, p in mod.named_parameters():
        assert _rel(p.grad, leaves[n].grad) < 2e-6, n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(GE_CASES))
def test_grouped_experts_inference_leaves_padding_unwritten(case, device, monkeypatch):
    """With no gradient to take, the experts' dispatch leaves padding rows and rows past P unwritten
    (combine reads real rows only); with one, they are zero. The outputs are the same either way."""
    kw = GE_CASES[case]
    torch.manual_seed(0)
    mod = pt.GroupedExperts(E, H, I, alignment=4, **{k: v for k, v in kw.items() if k != "gate_fn"}).to(device)
    g = torch.Generator().manual_seed(11)
    t = 13
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(device)
    w = torch.rand(t, K, generator=g).softmax(-1).to(device)
    x = torch.randn(t, H, generator=g).to(device)
    seen = []

    def poison(y, plan, zero_padding):
        seen.append(zero_padding)
        if not zero_padding:  # what the rows nobody reads may hold: NaN must not reach the output
            keep = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
            keep[plan.dest_rows.long()[plan.dest_rows >= 0]] = True
            y = torch.where(keep.unsqueeze(1), y, float("nan"))
        return y

    real = pt.Routing.dispatch  # the composition's dispatch (a callable gate)

    def spy(self, xx, weighted=False, zero_padding=True):
        return poison(real(self, xx, weighted=weighted, zero_padding=zero_padding), self.plan, zero_padding)

    real_op = expert_mlp_module._dispatch  # the one operator's (a gate by name)

    def spy_op(xx, packed, weights, sizes, check, zero_padding):
        plan = Plan._from_packed(packed, xx.shape[0], sizes[0], sizes[1], sizes[2])
        return poison(real_op(xx, packed, weights, sizes, check, zero_padding), plan, zero_padding)

    monkeypatch.setattr(pt.Routing, "dispatch", spy)
    monkeypatch.setattr(expert_mlp_module, "_dispatch", spy_op)
    with torch.no_grad():
        out_inference = mod(x, idx, w)
    out_grad = mod(x, idx, w)  # parameters require grad: padding rows zeroed
    assert seen == [False, True]
    assert out_grad.requires_grad and not out_inference.requires_grad
    assert torch.isfinite(out_inference).all()
    assert torch.equal(out_inference, out_grad.detach())


def test_grouped_experts_validation_and_compile():
    with pytest.raises(ValueError, match="activation"):
        pt.GroupedExperts(E, H, I, activation="swoosh")
    with pytest.raises(ValueError, match="weighting"):
        pt.GroupedExperts(E, H, I, weighting="middle")
    with pytest.raises(ValueError, match="gated"):
        pt.GroupedExperts(E, H, I, gated=False, interleaved=True)
    torch._dynamo.reset()
    torch.manual_seed(0)
    mod = pt.GroupedExperts(E, H, I, bias=True)
    idx = torch.randint(0, E, (16, 1))
    w = torch.rand(16, 1)
    x = torch.randn(16, H)
    ref = mod(x, idx, w)
    out = torch.compile(mod, fullgraph=True, backend="aot_eager")(x, idx, w)  # float32 on CPU: the loop op
    assert _rel(out, ref) < 1e-6 and ref.abs().max() > 0


def test_grouped_mm_usable_rules():
    a = torch.zeros(8, 32)
    assert _grouped.grouped_mm_usable(a, torch.zeros(2, 32, 16)) == (
        _grouped._GROUPED_MM is not None and _grouped._TORCH >= (2, 9)
    )
    assert not _grouped.grouped_mm_usable(a, torch.zeros(2, 32, 5))  # 20-byte rows
    assert not _grouped.grouped_mm_usable(a.double(), torch.zeros(2, 32, 16, dtype=torch.float64))
