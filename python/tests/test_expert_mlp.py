"""padmoe.torch.experts_forward with activations given by name against float64 per-token loops: the
output and every gradient (x, both weights, both biases, the router weights) for each activation,
gated side by side or interleaved and ungated, both weight layouts, weighting after / before /
none; odd cases (one expert, top-1, one token, no tokens, every token on one expert, dropped ids,
alignment 1 and 128, float32 and bfloat16); bitwise determinism."""

import math
import weakref

import pytest

torch = pytest.importorskip("torch")
import padmoe  # noqa: E402
from padmoe.torch import _expert_mlp  # noqa: E402
from padmoe.torch.grouped import _GROUPED_MM, ACTIVATIONS, experts_forward  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])
pytestmark = pytest.mark.skipif(
    _GROUPED_MM is None or tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 9),
    reason="needs torch's grouped_mm on the CPU (torch 2.9 or newer)",
)


def act64(name, g):
    if name == "silu":
        return g * torch.sigmoid(g)
    if name == "gelu":
        return 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    if name == "relu2":
        return torch.relu(g) ** 2
    if name == "relu":
        return torch.relu(g)
    if name == "sigmoid":
        return torch.sigmoid(g)
    if name == "identity":
        return g
    raise AssertionError(name)


def gate64(name, g, u):
    """The gated product in float64; clamped_swiglu as GPT-OSS writes it (alpha 1.702, limit 7)."""
    if name == "clamped_swiglu":
        g = g.clamp(max=7.0)
        return (u.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)
    return act64(name, g) * u


def reference(x, idx, w, up, down, ub, db, act, gated, interleaved, transposed, weighting, num_experts):
    """out[t] = sum_k w[t,k] * mlp_{e}(x[t]) in float64, token by token (ids outside [0, E) dropped)."""
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if not 0 <= e < num_experts:
                continue
            xt = x[t] * w[t, k] if weighting == "before" else x[t]
            wu = up[e] if transposed else up[e].t()
            h = xt @ wu + (ub[e] if ub is not None else 0)
            if gated:
                n = h.shape[0] // 2
                g, u = (h[0::2], h[1::2]) if interleaved else (h[:n], h[n:])
                a = gate64(act, g, u)
            else:
                a = act64(act, h)
            wd = down[e] if transposed else down[e].t()
            y = a @ wd + (db[e] if db is not None else 0)
            acc = acc + (y * w[t, k] if weighting == "after" else y)
        out.append(acc)
    return torch.stack(out) if out else torch.zeros(0, x.shape[1], dtype=torch.float64)


def make_case(T, H, I, E, K, gated, transposed, bias, weighting, seed, one_expert=False, invalid=False):
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * I if gated else I
    x = torch.randn(T, H, generator=g)
    up = torch.randn((E, H, n1) if transposed else (E, n1, H), generator=g) / math.sqrt(H)
    down = torch.randn((E, I, H) if transposed else (E, H, I), generator=g) / math.sqrt(I)
    ub = torch.randn(E, n1, generator=g) * 0.1 if bias else None
    db = torch.randn(E, H, generator=g) * 0.1 if bias else None
    if one_expert:
        idx = torch.zeros(T, K, dtype=torch.int64)
        idx[:, 1:] = torch.arange(1, K).clamp(max=E - 1)
    else:
        idx = (
            torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            if T
            else torch.zeros(0, K, dtype=torch.int64)
        )
    if invalid and T:
        idx[::3, -1] = -1
        idx[1::4, 0] = E + 3
    w = torch.rand(T, K, generator=g) if weighting != "none" else None
    return x, idx, w, up, down, ub, db


def run_case(
    device,
    dtype,
    act,
    gated,
    interleaved,
    transposed,
    bias,
    weighting,
    T=41,
    H=32,
    I=16,
    E=6,
    K=2,
    alignment=8,
    seed=0,
    one_expert=False,
    invalid=False,
):
    x, idx, w, up, down, ub, db = make_case(
        T, H, I, E, K, gated, transposed, bias, weighting, seed, one_expert, invalid
    )
    if act == "clamped_swiglu":
        x = x * 6  # gate and up values past the limit 7, so both clamps act
    leaves = [x, up, down] + [t for t in (ub, db, w) if t is not None]
    ref_in = [t.double().requires_grad_() for t in leaves]
    xr, upr, downr = ref_in[:3]
    rest = iter(ref_in[3:])
    ubr = next(rest) if ub is not None else None
    dbr = next(rest) if db is not None else None
    wr = next(rest) if w is not None else None
    want = reference(xr, idx, wr, upr, downr, ubr, dbr, act, gated, interleaved, transposed, weighting, E)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    want_grads = torch.autograd.grad(want, ref_in, grad_out, allow_unused=True) if T else [None] * len(ref_in)

    dev_in = [t.to(device=device, dtype=dtype if t is not w else torch.float32).requires_grad_() for t in leaves]
    xd, upd, downd = dev_in[:3]
    rest = iter(dev_in[3:])
    ubd = next(rest) if ub is not None else None
    dbd = next(rest) if db is not None else None
    wd = next(rest) if w is not None else None
    kw = dict(up_bias=ubd, down_bias=dbd, transposed=transposed, weighting=weighting, alignment=alignment)
    if gated:
        out = experts_forward(
            xd, idx.to(device), wd, upd, downd, gate=act, interleaved=interleaved, drop_invalid=invalid, **kw
        )
    else:
        out = experts_forward(xd, idx.to(device), wd, upd, downd, activation=act, drop_invalid=invalid, **kw)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(out.double().cpu(), want.detach(), **tol)
    if T == 0:
        return
    got_grads = torch.autograd.grad(out, dev_in, grad_out.to(device=device, dtype=out.dtype), allow_unused=True)
    for name, got, ref in zip(["x", "up", "down", "bias", "bias", "w"], got_grads, want_grads):
        if ref is None:
            assert got is None or not got.abs().any(), name
            continue
        scale = max(ref.abs().max().item(), 1.0)
        torch.testing.assert_close(got.double().cpu() / scale, ref / scale, **tol, msg=lambda m: f"{name}: {m}")
    return out, got_grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "act, gated, interleaved",
    [
        ("silu", True, False),
        ("silu", True, True),
        ("gelu", True, False),
        ("gelu_tanh", True, True),
        ("relu2", True, False),
        ("relu", True, False),
        ("sigmoid", True, True),
        ("identity", True, False),
        ("clamped_swiglu", True, True),
        ("clamped_swiglu", True, False),
        ("gelu", False, False),
        ("gelu_tanh", False, False),
        ("relu2", False, False),
        ("silu", False, False),
    ],
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias, weighting", [(False, "after"), (True, "after"), (True, "before"), (False, "none")])
def test_forms_against_float64_loops(device, act, gated, interleaved, transposed, bias, weighting):
    run_case(device, torch.float32, act, gated, interleaved, transposed, bias, weighting)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T, E, K, alignment, extra",
    [
        (1, 6, 2, 8, {}),  # one token
        (0, 6, 2, 8, {}),  # no tokens
        (33, 1, 1, 8, {}),  # one expert, top-1
        (29, 6, 1, 1, {}),  # top-1, alignment 1
        (50, 4, 2, 128, {}),  # alignment 128: most rows padding
        (40, 5, 2, 16, {"one_expert": True}),  # every token on expert 0
        (45, 6, 3, 8, {"invalid": True}),  # dropped ids (drop_invalid)
        # no biases, I < H: the router weights folded into the activation's backward (fold_weights)
        (41, 6, 2, 8, {"bias": False}),
        (1, 6, 2, 8, {"bias": False}),
        (50, 4, 2, 128, {"bias": False}),
        (45, 6, 3, 8, {"bias": False, "invalid": True}),
        (40, 5, 2, 16, {"bias": False, "one_expert": True}),
        (41, 6, 2, 8, {"bias": False, "H": 16, "I": 32}),  # I > H: not folded, the expert outputs read
    ],
)
def test_odd_cases(device, T, E, K, alignment, extra):
    extra = dict(extra)
    bias = extra.pop("bias", True)
    run_case(
        device, torch.float32, "silu", True, False, False, bias, "after", T=T, E=E, K=K, alignment=alignment, **extra
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transposed", [False, True])
def test_bfloat16(device, transposed):
    run_case(device, torch.bfloat16, "silu", True, False, transposed, True, "after", H=64, I=32)


@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_deterministic(device):
    first = run_case(device, torch.bfloat16, "gelu_tanh", True, True, False, True, "after", T=64, H=64, I=32)
    again = run_case(device, torch.bfloat16, "gelu_tanh", True, True, False, True, "after", T=64, H=64, I=32)
    assert torch.equal(first[0], again[0])
    for a, b in zip(first[1], again[1]):
        assert torch.equal(a, b)


def test_unknown_activation_name_is_an_error():
    x = torch.randn(4, 32)
    idx = torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="gate: unknown activation 'swiglu'"):
        experts_forward(x, idx, torch.ones(4, 1), torch.randn(2, 32, 32), torch.randn(2, 32, 16), gate="swiglu")
    assert set(ACTIVATIONS) >= {"silu", "gelu", "gelu_tanh", "relu2"}


_X, _UP, _DOWN = (6, 8), (4, 32, 8), (4, 8, 16)  # T, H; E, 2I, H; E, H, I


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_states=torch.zeros(6, 8, dtype=torch.int32)), "hidden_states: expected a float tensor, got int32"),
        (dict(up=torch.zeros(32, 8)), r"up: expected a 3-D \[E, out, in\] tensor, got shape \[32, 8\]"),
        (dict(up=torch.zeros(4, 32, 9)), r"up: expected \[E, out, in\] with in = H = 8, got shape \[4, 32, 9\]"),
        (dict(up=torch.zeros(4, 33, 8)), r"up: a gate needs an even number of outputs \(2I\), got shape \[4, 33, 8\]"),
        (dict(down=torch.zeros(4, 8, 17)), r"down: expected in = I = 16 \(from up's 32\), got shape \[4, 8, 17\]"),
        (dict(down=torch.zeros(5, 8, 16)), r"down: expected \[E, out, in\] with E = 4 \(up's\) and out = H = 8"),
        (dict(down=torch.zeros(4, 8)), r"down: expected a 3-D \[E, out, in\] tensor, got shape \[4, 8\]"),
        (dict(up_bias=torch.zeros(4, 16)), r"up_bias: expected shape \[4, 32\], got \[4, 16\]"),
        (dict(down_bias=torch.zeros(4, 9)), r"down_bias: expected shape \[4, 8\], got \[4, 9\]"),
        (dict(transposed=True), r"up: expected \[E, in, out\] \(transposed\) with in = H = 8"),
        (dict(gate=None, activation="silu"), r"down: expected in = I = 32 \(from up's 32\)"),
    ],
)
def test_bad_shapes_name_the_argument(change, message):
    """Each misshapen or mistyped tensor is named, with the shape it needs, before any work (the GEMMs
    would otherwise fail inside torch with no argument named)."""
    args = dict(hidden_states=torch.zeros(_X), up=torch.zeros(_UP), down=torch.zeros(_DOWN), gate="silu")
    args.update(change)
    idx, w = torch.zeros(6, 2, dtype=torch.int64), torch.ones(6, 2)
    with pytest.raises((ValueError, TypeError), match="^padmoe experts: " + message):
        experts_forward(
            args.pop("hidden_states"), idx, w, args.pop("up"), args.pop("down"), **args
        )  # fmt: skip


def autograd_nodes(t):
    """Names of the autograd nodes behind ``t``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        names.add(type(n).__name__)
        todo.extend(f for f, _ in n.next_functions)
    return names


def small_inputs(device, dtype, T=64, H=64, I=32, E=4, K=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype).requires_grad_()
    up = (torch.randn(E, 2 * I, H, generator=g) / 8).to(device, dtype).requires_grad_()
    down = (torch.randn(E, H, I, generator=g) / 6).to(device, dtype).requires_grad_()
    w, idx = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    return x, idx.to(device), w.to(device).requires_grad_(), up, down


@pytest.mark.parametrize("device", DEVICES)
def test_named_gate_is_one_operator_and_agrees_with_the_composition(device):
    """A gate by name runs the one-operator MLP; the same gate as a callable runs the composition.
    In float32 they agree to rounding (the operator rounds the activation once, the composition twice)."""
    x, idx, w, up, down = small_inputs(device, torch.float32)

    def silu_gate(h):
        g, u = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    fused = experts_forward(x, idx, w, up, down, gate="silu", alignment=8)
    composed = experts_forward(x, idx, w, up, down, gate=silu_gate, alignment=8)
    assert "_ExpertMLPBackward" in autograd_nodes(fused)
    assert "_ExpertMLPBackward" not in autograd_nodes(composed)
    torch.testing.assert_close(fused, composed, rtol=1e-5, atol=1e-5)
    leaves = (x, w, up, down)
    for a, b in zip(torch.autograd.grad(fused.sum(), leaves), torch.autograd.grad(composed.sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_experts_runs_the_operator(device):
    from padmoe.torch import GroupedExperts

    torch.manual_seed(0)
    named = GroupedExperts(4, 64, 32, activation="silu", device=device)
    custom = GroupedExperts(4, 64, 32, gate_fn=lambda h: torch.nn.functional.silu(h[:, :32]) * h[:, 32:], device=device)
    custom.load_state_dict(named.state_dict())
    x, idx, w, _, _ = small_inputs(device, torch.float32)
    out = named(x, idx, w)
    assert "_ExpertMLPBackward" in autograd_nodes(out)
    assert "_ExpertMLPBackward" not in autograd_nodes(custom(x, idx, w))
    torch.testing.assert_close(out, custom(x, idx, w), rtol=1e-5, atol=1e-5)


# (tokens, alignment): padding rows few (dispatch + torch's GEMM), or dominant (on CUDA the
# gather-fused up projection without gradients and with recompute_rows)
SHAPES = {"dispatch": (64, 16), "gather": (8, 128)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_fullgraph_is_bitwise_eager(device, shape):
    """torch.compile(fullgraph=True) over the operator, forward and backward: no graph break, the
    same bits as eager."""
    tokens, alignment = SHAPES[shape]
    x, idx, w, up, down = small_inputs(device, torch.bfloat16, T=tokens)

    for recompute in (False, True):  # on CUDA, recompute_rows runs the gather-fused GEMMs

        def mlp(x, idx, w):
            return experts_forward(
                x, idx, w, up, down, gate="gelu_tanh", interleaved=True, alignment=alignment, recompute_rows=recompute
            )

        leaves = (x, w, up, down)
        want = mlp(x, idx, w)
        want_grads = torch.autograd.grad(want.float().square().sum(), leaves)
        with torch.no_grad():
            want_nograd = mlp(x, idx, w)  # on CUDA: the activation fused into the gathered up projection
        torch._dynamo.reset()
        compiled = torch.compile(mlp, fullgraph=True)
        got = compiled(x, idx, w)
        got_grads = torch.autograd.grad(got.float().square().sum(), leaves)
        assert torch.equal(got, want)
        for a, b in zip(got_grads, want_grads):
            assert torch.equal(a, b)
        with torch.no_grad():
            assert torch.equal(compiled(x, idx, w), want_nograd)


def capture(step):
    """(graph, outputs): ``step`` warmed up on a side stream, then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs CUDA")
def test_cuda_graph_replay_is_bitwise_eager():
    """The forward and forward + backward captured in a CUDA graph (no host synchronization) and
    replayed on new inputs give eager's bits."""
    x, idx, w, up, down = small_inputs("cuda", torch.bfloat16)
    sx, sidx, sw = x.detach().clone().requires_grad_(), idx.clone(), w.detach().clone().requires_grad_()

    def step():
        out = experts_forward(sx, sidx, sw, up, down, gate="silu", alignment=16)
        return (out,) + torch.autograd.grad(out.float().square().sum(), (sx, sw, up, down))

    graph, captured = capture(step)
    x2, idx2, w2, _, _ = small_inputs("cuda", torch.bfloat16, seed=9)
    with torch.no_grad():
        sx.copy_(x2)
        sidx.copy_(idx2)
        sw.copy_(w2)
    graph.replay()
    want = step()
    for a, b in zip(captured, want):
        assert torch.equal(a, b)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_graph_replay_without_gradients(shape):
    """The forward without gradients (where padding rows dominate, as at decode: the gather and the
    activation fused into the up projection) captured in a CUDA graph and replayed on new inputs
    gives eager's bits."""
    tokens, alignment = SHAPES[shape]
    x, idx, w, up, down = small_inputs("cuda", torch.bfloat16, T=tokens)
    sx, sidx, sw = x.detach().clone(), idx.clone(), w.detach().clone()

    @torch.no_grad()
    def step():
        return experts_forward(sx, sidx, sw, up, down, gate="silu", alignment=alignment)

    graph, captured = capture(step)
    x2, idx2, w2, _, _ = small_inputs("cuda", torch.bfloat16, T=tokens, seed=9)
    sx.copy_(x2)
    sidx.copy_(idx2)
    sw.copy_(w2)
    graph.replay()
    assert torch.equal(captured, step())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighting", ["after", "before"])
def test_recompute_rows_gives_the_same_bits(device, weighting):
    """recompute_rows=True keeps no dispatched rows (the backward dispatches x again, padding rows
    being few here): the same output and gradients, bit for bit. (Where padding rows dominate, on
    CUDA, the gather-fused GEMMs run instead: test_triton_gather_gemm.py.)"""
    x, idx, w, up, down = small_inputs(device, torch.bfloat16)
    leaves = (x, w, up, down)
    results = []
    for recompute in (False, True):
        out = experts_forward(
            x, idx, w, up, down, gate="silu", alignment=16, weighting=weighting, recompute_rows=recompute
        )
        results.append((out,) + torch.autograd.grad(out.float().square().sum(), leaves))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("H, I", [(64, 32), (32, 64)])
def test_backward_frees_intermediates_after_last_use(monkeypatch, H, I):
    """The operator's eager backward frees the expert outputs before the activation's backward and
    the up projection's output right after it (their last uses), instead of keeping both until the
    backward returns: the peak memory of forward + backward is at most that of the composition.
    Where the router weights fold into the activation's backward (I < H), the expert outputs are
    not kept at all."""
    x, idx, w, up, down = small_inputs("cpu", torch.bfloat16, H=H, I=I)
    folded = I < H
    made, seen = [], {}
    real_mm, real_wgrad = _expert_mlp._mm, _expert_mlp._mm_wgrad
    name = "_act_backward_weighted" if folded else "_act_backward"
    real_act = getattr(_expert_mlp, name)

    def mm(*args):
        out = real_mm(*args)
        made.append(weakref.ref(out))
        return out

    def act_backward(*args):
        seen["ys alive at the activation's backward"] = made[1]() is not None
        return real_act(*args)

    def wgrad(*args):
        seen.setdefault("h alive at the weight gradients", made[0]() is not None)
        return real_wgrad(*args)

    monkeypatch.setattr(_expert_mlp, "_mm", mm)
    monkeypatch.setattr(_expert_mlp, name, act_backward)
    monkeypatch.setattr(_expert_mlp, "_mm_wgrad", wgrad)
    out = experts_forward(x, idx, w, up, down, gate="silu", alignment=16)
    assert len(made) == 2 and made[0]() is not None  # h, kept for the backward
    assert (made[1]() is None) == folded  # ys: kept only where the weights' gradient reads it
    out.float().sum().backward(retain_graph=True)
    assert seen == {"ys alive at the activation's backward": False, "h alive at the weight gradients": False}
    with pytest.raises(RuntimeError, match="a second time"):
        out.float().sum().backward()
