"""padmoe.torch's native operators: what a user wiring padmoe into a model hits (mixed weight
dtypes, strided router outputs, early weight checks, the Routing object), which operators a
routing step runs, torch.compile of a whole MoE layer, and the unboxed Python entry points'
fallback to the OpOverloads. References: padmoe.reference (plain PyTorch) and plain loops."""

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import padmoe  # noqa: E402
import padmoe.reference as pe  # noqa: E402
import padmoe.torch as pt  # noqa: E402
from padmoe import _torch_ops  # noqa: E402

DEVICES = ["cpu"]
if torch.cuda.is_available() and padmoe.has_cuda():
    DEVICES.append("cuda")


def routing(device, T=19, K=2, E=6, H=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    probs, top = logits.softmax(-1).topk(K, dim=-1)
    x = torch.rand(T, H, generator=g) * 2 - 1
    return top.to(device), probs.to(device), x.to(device)


def loop_combine(y, dest, w, K):
    """out[t] = sum_k w[t, k] * y[dest[t*K+k]] in float64, plain loops."""
    T = dest.numel() // K
    out = torch.zeros(T, y.shape[1], dtype=torch.float64)
    y64, w64, d = y.double().cpu(), w.reshape(-1).double().cpu(), dest.cpu().tolist()
    for t in range(T):
        for k in range(K):
            out[t] += w64[t * K + k] * y64[d[t * K + k]]
    return out


# ---------------------------------------------------------------------------
# one Plan type
# ---------------------------------------------------------------------------


def test_one_plan_type():
    top, _, _ = routing("cpu")
    assert type(pt.make_plan(top, 6, 4)) is padmoe.Plan
    assert type(pe.make_plan(top, 6, 4)) is padmoe.Plan
    assert type(padmoe.make_plan(top, 6, 4)) is padmoe.Plan
    assert pe.Plan is padmoe.Plan and pt.Plan is padmoe.Plan
    p = pt.make_plan(top, 6, 4)
    assert p.arrays[6] is p.dest_rows and p.padded_rows_bound == 19 * 2 + 6 * 3
    # padmoe.torch's plan: the eight arrays are views of one packed int32 tensor
    assert p.packed.dtype == torch.int32 and p.packed.numel() == 4 * 38 + 6 * (4 + 3)
    assert torch.equal(torch.cat(p.arrays), p.packed)
    assert p.row_sources.numel() == p.padded_rows_bound


# ---------------------------------------------------------------------------
# router outputs as models produce them
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rows_dtype,w_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.float64),
    ],
)
def test_weights_of_another_float_dtype(device, rows_dtype, w_dtype):
    """Under bf16 autocast routers emit bf16 weights beside float32 rows: accepted, read as float32."""
    top, probs, x = routing(device)
    w = probs.to(w_dtype).requires_grad_(True)
    xr = x.to(rows_dtype).requires_grad_(True)
    r = pt.Routing.from_topk(top, w, 6, 4)
    y = r.dispatch(xr)
    out = r.combine(y * 1.5)
    assert out.dtype == rows_dtype
    want = loop_combine(y.detach().float() * 1.5, r.plan.dest_rows, w.detach().float(), 2)
    tol = 1e-5 if rows_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), want.to(rows_dtype).double(), rtol=tol, atol=tol)
    g = torch.randn_like(out)
    out.backward(g)
    assert w.grad.dtype == w_dtype and w.grad.shape == w.shape
    # grad_w[t, k] = 1.5 * <x[t], g[t]> (y's row of assignment (t, k) holds x[t])
    want_gw = 1.5 * (xr.detach().double() * g.double()).sum(-1, keepdim=True).expand(-1, 2)
    gtol = 1e-4 if rows_dtype == torch.float32 and w_dtype in (torch.float32, torch.float64) else 5e-2
    torch.testing.assert_close(w.grad.double().cpu(), want_gw.cpu(), rtol=gtol, atol=gtol)
    # weighted dispatch with the same weights
    yw = r.dispatch(xr.detach(), weighted=True)
    ref = pe.dispatch(xr.detach(), pe.make_plan(top, 6, 4), w.detach().float().reshape(-1))
    P = int(r.padded_rows)
    torch.testing.assert_close(yw[:P].float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_router_outputs(device):
    """topk results sliced or transposed (non-contiguous ids and weights) give the contiguous result."""
    top, probs, x = routing(device, K=3)
    top_t = top.t().contiguous().t()  # same values, column-major
    w_t = probs.t().contiguous().t()
    assert not top_t.is_contiguous() and not w_t.is_contiguous()
    wide = torch.stack([probs, probs], dim=2).reshape(probs.shape[0], -1)[:, ::2]  # column stride 2
    assert not wide.is_contiguous() and torch.equal(wide, probs)
    ref = pt.Routing.from_topk(top, probs, 6, 4)
    want = ref.combine(ref.dispatch(x))
    for ids, w in ((top_t, w_t), (top_t, wide)):
        r = pt.Routing.from_topk(ids, w, 6, 4)
        for a, b in zip(r.plan.arrays, ref.plan.arrays):
            assert torch.equal(a, b)
        assert torch.equal(r.combine(r.dispatch(x)), want)
    # strided rows (a view of every other row) dispatch like their contiguous copy
    big = torch.cat([x, x], dim=1)[:, :16]
    assert not big.is_contiguous()
    assert torch.equal(ref.dispatch(big), ref.dispatch(x))


@pytest.mark.parametrize("device", DEVICES)
def test_weights_checked_at_from_topk(device):
    top, probs, x = routing(device)
    with pytest.raises(ValueError, match=r"make_plan: weights: expected 38 elements"):
        pt.Routing.from_topk(top, probs[:-1], 6, 4)
    with pytest.raises(TypeError, match=r"make_plan: weights: expected a float dtype"):
        pt.Routing.from_topk(top, (probs * 10).int(), 6, 4)
    with pytest.raises(ValueError, match=r"make_plan: top_experts: expected \[T, K\]"):
        pt.Routing.from_topk(top.reshape(-1), probs, 6, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_routing_exposes_what_a_layer_needs(device):
    top, probs, x = routing(device)
    E, m = 6, 4
    r = pt.Routing.from_topk(top, probs, E, m)
    ref = pe.make_plan(top, E, m)
    assert (r.num_experts, r.top_k, r.num_tokens, r.padded_rows_bound) == (E, 2, 19, 19 * 2 + E * (m - 1))
    P = int(ref.padded_bins[-1])
    assert isinstance(r.padded_rows, torch.Tensor) and r.padded_rows.dim() == 0
    assert r.padded_rows.device == top.device and int(r.padded_rows) == P
    assert torch.equal(r.offsets, ref.padded_bins) and torch.equal(r.tokens_per_expert, ref.tokens_per_expert)
    # row_experts: expert of each padded row, -1 on padding rows and past P (plain loop over the plan)
    want = [-1] * r.padded_rows_bound
    start = 0
    for e in range(E):
        count, padded = int(ref.tokens_per_expert[e]), int(ref.padded_tokens_per_expert[e])
        for i in range(count):
            want[start + i] = e
        start += padded
    got = r.row_experts
    assert got.dtype == torch.int32 and got.device == top.device
    assert got.cpu().tolist() == want
    # weighted dispatch + unweighted combine == unweighted dispatch + weighted combine (in float64)
    x64 = x.double()
    a = r.combine(r.dispatch(x64, weighted=True), weighted=False)
    b = r.combine(r.dispatch(x64))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="weighted=True needs router weights"):
        pt.Routing.from_topk(top, None, E, m).dispatch(x, weighted=True)


# ---------------------------------------------------------------------------
# which operators a routing step runs
# ---------------------------------------------------------------------------


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_routing_forward_backward_runs_only_padmoe_ops(device):
    top, probs, x = routing(device)
    xr = x.clone().requires_grad_(True)
    w = probs.clone().requires_grad_(True)
    g = torch.randn_like(x)
    with OpLog() as log:
        r = pt.Routing.from_topk(top, w, 6, 4, check=False)
        out = r.combine(r.dispatch(xr))
        out.backward(g)
    # Ops that only make views (no kernel): the weight gradient viewed in the weights' shape,
    # AccumulateGrad's detach of a first gradient.
    views = {"aten.view", "aten.detach", "aten.alias", "aten._unsafe_view"}
    kernels = [op for op in log.ops if op not in views]
    assert kernels == [
        "padmoe.make_plan",
        "padmoe.dispatch",
        "padmoe.combine",
        "padmoe.combine_backward",
        "padmoe.dispatch_backward",
    ], log.ops
    # the gradients those five ops produced, against plain-PyTorch autograd (padmoe.reference)
    ex = x.clone().requires_grad_(True)
    ew = probs.clone().requires_grad_(True)
    ep = pe.make_plan(top, 6, 4)
    pe.combine(pe.dispatch(ex, ep), ep, ew.reshape(-1)).backward(g)
    torch.testing.assert_close(xr.grad, ex.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, ew.grad, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# the unboxed Python entry points and their fallback
# ---------------------------------------------------------------------------


class Tagged(torch.Tensor):
    """A trivial tensor subclass: padmoe's entry points hand it to the OpOverload."""


@pytest.mark.parametrize("device", DEVICES)
def test_entry_points_fall_back_for_subclasses_and_modes(device):
    top, probs, x = routing(device)
    plan = pt.make_plan(top, 6, 4)
    want = pt.dispatch(x, plan)
    sub = x.as_subclass(Tagged)
    got = pt.dispatch(sub, plan)
    assert torch.equal(torch.Tensor(got.as_subclass(torch.Tensor)), want)
    with torch.device(device):  # a torch function mode
        assert torch.equal(pt.dispatch(x, plan), want)
        assert torch.equal(pt.combine(want, plan, probs), pt.combine(want, plan, probs.reshape(-1)))
    # a bool where an int is expected (not taken by the entry point: the OpOverload's answer)
    assert torch.equal(_torch_ops.dispatch(x, plan.packed, None, 2, 6, 4, None, True), want)
    # a plan without the packed form (padmoe.reference's): packed on the way, same result
    assert torch.equal(pt.dispatch(x, pe.make_plan(top, 6, 4)), want)
    with pytest.raises(TypeError, match="dispatch: x"):
        pt.dispatch(x.int(), plan)


@pytest.mark.parametrize("device", DEVICES)
def test_padded_scatter_wgrad_dropin(device):
    top, probs, x = routing(device)
    p = pe.make_plan(top, 6, 4)
    y = pe.dispatch(x, p)
    grad = torch.randn_like(x)
    got = pt.padded_scatter_wgrad(y, grad, p.indices, p.bin_ids, p.bins, p.padded_bins, 2)
    want = pe.padded_scatter_wgrad(y, grad, p.indices, p.bin_ids, p.bins, p.padded_bins, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_static_ops(device):
    """torch.library.opcheck: schema, fake kernels, autograd registration, AOT dispatch."""
    top, probs, x = routing(device)
    plan = pt.make_plan(top, 6, 4)
    xr = x.clone().requires_grad_(True)
    w = probs.reshape(-1).clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.padmoe.make_plan.default, (top, 6, 4, 1, None))
    torch.library.opcheck(torch.ops.padmoe.dispatch.default, (xr, plan.packed, None, 2, 6, 4, None, 1))
    y = pt.dispatch(x, plan).requires_grad_(True)
    torch.library.opcheck(torch.ops.padmoe.combine.default, (y, plan.packed, w, 2, 6, 4, None, 1))


# ---------------------------------------------------------------------------
# torch.compile of a whole MoE layer
# ---------------------------------------------------------------------------


class MoE(torch.nn.Module):
    def __init__(self, H=16, F=24, E=4, K=2, m=8):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.router = torch.nn.Linear(H, E, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(E, H, F, generator=g) / H**0.5)
        self.w_out = torch.nn.Parameter(torch.randn(E, F, H, generator=g) / F**0.5)
        self.E, self.K, self.m = E, K, m

    def forward(self, x):
        probs, top = self.router(x).softmax(-1).topk(self.K, dim=-1)
        r = pt.Routing.from_topk(top, probs, self.E, self.m)
        y = r.dispatch(x)
        h = torch.nn.functional.grouped_mm(y, self.w_in, offs=r.offsets)
        h = torch.nn.functional.grouped_mm(torch.nn.functional.silu(h), self.w_out, offs=r.offsets)
        return r.combine(h)


def _grouped_mm_works(device):
    try:
        x = torch.randn(16, 16, device=device, dtype=torch.bfloat16)
        torch.nn.functional.grouped_mm(
            x,
            torch.randn(2, 16, 16, device=device, dtype=torch.bfloat16),
            offs=torch.tensor([8, 16], dtype=torch.int32, device=device),
        )
        return True
    except Exception:  # noqa: BLE001 - an older torch or a device without it
        return False


@pytest.mark.parametrize("device", DEVICES)
def test_compile_moe_layer_fullgraph(device):
    if not hasattr(torch.nn.functional, "grouped_mm") or not _grouped_mm_works(device):
        pytest.skip("torch.nn.functional.grouped_mm (bfloat16) is not available here")
    torch._dynamo.reset()
    # bfloat16: grouped_mm's fake (meta) kernel takes only bf16 in some torch releases
    model = MoE().to(device, torch.bfloat16)
    x = torch.randn(40, 16, device=device, dtype=torch.bfloat16)
    ref_x = x.clone().requires_grad_(True)
    ref = model(ref_x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    cx = x.clone().requires_grad_(True)
    out = compiled(cx)
    out.square().sum().backward()
    # aot_eager runs the same kernels as eager: equal up to bf16 rounding of reordered adds
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cx.grad, ref_x.grad, rtol=2e-2, atol=2e-2)
    for p, rg in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, rg, rtol=2e-2, atol=2e-2)
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0
