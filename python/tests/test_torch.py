"""padmoe's framework-neutral functions on torch tensors: torch in, torch out on
the same device. CPU always; CUDA too when a GPU and padmoe's CUDA backend are
present (a small set, checked against the same float64 reference)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import padmoe  # noqa: E402
import reference as ref  # noqa: E402
from conftest import Routing  # noqa: E402

DEVICES = ["cpu"]
if torch.cuda.is_available() and padmoe.has_cuda():
    DEVICES.append("cuda")

TORCH_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=1e-2),
    torch.bfloat16: dict(rtol=1.6e-2, atol=5e-2),
}
PLAN_FIELDS = [
    "indices",
    "bin_ids",
    "tokens_per_expert",
    "bins",
    "padded_tokens_per_expert",
    "padded_bins",
    "dest_rows",
]


def t64(a):
    return a.detach().to("cpu", torch.float64).numpy()


def setup(device, dtype, seed=0):
    r = Routing(seed=seed)
    top = torch.from_numpy(r.top).to(device)
    x = torch.from_numpy(r.rng.uniform(-1, 1, size=(r.T, r.H))).to(device, dtype)
    w = torch.from_numpy(r.rng.uniform(0.1, 1, size=r.A)).to(device, torch.float32)
    return r, top, x, w


@pytest.mark.parametrize("device", DEVICES)
def test_make_plan_on_device(device):
    r, top, _, _ = setup(device, torch.float32)
    plan = padmoe.make_plan(top, r.E, r.m)
    for name in PLAN_FIELDS:
        got = getattr(plan, name)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int32 and got.device == top.device, name
        np.testing.assert_array_equal(got.cpu().numpy(), r.ref[name], err_msg=name)
    np.testing.assert_array_equal(plan.row_sources[: r.P].cpu().numpy(), r.ref["row_sources"])
    assert plan.padded_rows() == r.P
    # int64 ids and caller-owned buffers
    out = padmoe.Plan.empty(r.T, r.K, r.E, r.m, like=top)
    assert out.indices.device == top.device
    padmoe.make_plan(top.long(), r.E, r.m, out=out, check=False)
    np.testing.assert_array_equal(out.dest_rows.cpu().numpy(), r.ref["dest_rows"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_dispatch_combine_and_backward(device, dtype, weighted):
    r, top, x, w = setup(device, dtype)
    w = w if weighted else None
    wn = None if w is None else w.cpu().numpy()
    plan = padmoe.make_plan(top, r.E, r.m)
    y_all = padmoe.dispatch(x, plan, w)
    assert isinstance(y_all, torch.Tensor) and y_all.device == x.device and y_all.dtype == dtype
    assert y_all.shape == (plan.padded_rows_bound, r.H) and not y_all[r.P :].any()
    y = y_all[: r.P]
    exp_y = ref.gather(t64(x), r.ref, wn)
    if w is None:
        np.testing.assert_array_equal(t64(y), exp_y)
    else:
        np.testing.assert_allclose(t64(y), exp_y, **TORCH_TOL[dtype])
    g = padmoe.padded_gather(x, plan.indices, plan.bin_ids, plan.bins, plan.padded_bins, r.K, w)
    assert torch.equal(g, y)

    out = padmoe.combine(y, plan, w)
    assert out.device == x.device and out.dtype == dtype and out.shape == (r.T, r.H)
    np.testing.assert_allclose(t64(out), ref.scatter(t64(y), r.ref, wn), **TORCH_TOL[dtype])
    s = padmoe.padded_scatter(y, plan.indices, plan.bin_ids, w, plan.bins, plan.padded_bins, r.K)
    assert torch.equal(s, out)

    grad_out = torch.from_numpy(r.rng.uniform(-1, 1, size=(r.T, r.H))).to(device, dtype)
    gy_all, gw = padmoe.combine_backward(grad_out, y, plan, w)
    assert gy_all.device == x.device and gy_all.dtype == dtype
    assert gy_all.shape == (plan.padded_rows_bound, r.H) and not gy_all[r.P :].any()
    gy = gy_all[: r.P]
    np.testing.assert_allclose(t64(gy), ref.gather(t64(grad_out), r.ref, wn), **TORCH_TOL[dtype])
    gx, gxw = padmoe.dispatch_backward(gy, x, plan, w)
    np.testing.assert_allclose(t64(gx), ref.scatter(t64(gy), r.ref, wn), **TORCH_TOL[dtype])
    if w is None:
        assert gw is None and gxw is None
    else:
        assert gw.dtype == torch.float32 and gw.device == x.device
        np.testing.assert_allclose(t64(gw), ref.wgrad(t64(y), t64(grad_out), r.ref), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(t64(gxw), ref.wgrad(t64(gy), t64(x), r.ref), rtol=1e-4, atol=1e-4)
    wg = padmoe.padded_scatter_wgrad(y, grad_out, plan.indices, plan.bin_ids, plan.bins, plan.padded_bins, r.K)
    assert wg.dtype == dtype
    np.testing.assert_allclose(t64(wg), ref.wgrad(t64(y), t64(grad_out), r.ref), **TORCH_TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_capacity_rows_without_checks(device):
    """The no-synchronization path: plan buffers, rows=plan.padded_rows_bound, check=False."""
    r, top, x, w = setup(device, torch.float32)
    plan = padmoe.Plan.empty(r.T, r.K, r.E, r.m, like=top)
    kw = {"check": False}
    if device == "cuda":
        ws = torch.empty(padmoe.workspace_bound(r.T, r.K, r.E, r.m), dtype=torch.uint8, device=device)
        kw["workspace"] = ws
    padmoe.make_plan(top, r.E, r.m, out=plan, **kw)
    y = padmoe.dispatch(x, plan, w, rows=plan.padded_rows_bound, **kw)
    assert y.shape == (plan.padded_rows_bound, r.H)
    out = padmoe.combine(y, plan, w, **kw)
    exp_y = ref.gather(t64(x), r.ref, w.cpu().numpy())
    np.testing.assert_allclose(t64(y[: r.P]), exp_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(t64(out), ref.scatter(exp_y, r.ref, w.cpu().numpy()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_pad_unpad(device):
    counts = torch.tensor([3, 0, 6, 1], dtype=torch.int32, device=device)
    h = torch.from_numpy(np.random.default_rng(5).uniform(-1, 1, size=(10, 6))).to(device, torch.float16)
    padded, pmap, offsets = padmoe.pad_to_alignment(h, counts, 4)
    exp_padded, exp_map, exp_offsets = ref.pad(t64(h), counts.cpu().numpy(), 4)
    assert padded.device == h.device and pmap.dtype == torch.int32
    np.testing.assert_array_equal(t64(padded), exp_padded)
    np.testing.assert_array_equal(pmap.cpu().numpy(), exp_map)
    np.testing.assert_array_equal(offsets.cpu().numpy(), exp_offsets)
    probs = torch.linspace(0.5, 1.0, 10, device=device)
    out = padmoe.unpad_from_alignment(padded, pmap, 10, probs)
    np.testing.assert_allclose(t64(out), ref.unpad(t64(padded), exp_map, 10, probs.cpu().numpy()), rtol=2e-3, atol=2e-3)
    gp, gpr = padmoe.unpad_from_alignment_backward(out, padded, pmap, probs)
    exp_gp, exp_gpr = ref.unpad_backward(t64(out), t64(padded), exp_map, probs.cpu().numpy())
    np.testing.assert_allclose(t64(gp), exp_gp, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(t64(gpr), exp_gpr, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_expert_id(device):
    r, top, _, _ = setup(device, torch.float32)
    top[4, 2] = r.E + 3
    with pytest.raises(ValueError, match=r"top_experts.*\[4, 2\]"):
        padmoe.make_plan(top, r.E, r.m)


def test_cpu_extras():
    """requires_grad inputs, a strided view, float8 moves, numpy/torch agreement."""
    r, top, x, w = setup("cpu", torch.float32)
    plan = padmoe.make_plan(top, r.E, r.m)
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    y = padmoe.dispatch(xg, plan, wg)
    assert not y.requires_grad
    nplan = padmoe.make_plan(r.top, r.E, r.m)
    yn = padmoe.dispatch(x.numpy(), nplan, w.numpy())
    assert isinstance(yn, np.ndarray)
    np.testing.assert_array_equal(y.numpy(), yn)
    big = torch.zeros(r.T, r.H + 3)
    big[:, 1 : 1 + r.H] = x
    assert torch.equal(padmoe.dispatch(big[:, 1 : 1 + r.H], plan, w), y)
    for f8 in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        if f8 is None:
            continue
        x8 = x.to(f8)
        try:
            y8 = padmoe.dispatch(x8, plan)
        except TypeError as e:  # a torch whose DLPack export lacks float8
            pytest.skip(f"float8 through DLPack: {e}")
        assert y8.dtype == f8
        np.testing.assert_array_equal(t64(y8[: r.P].float()), ref.gather(t64(x8.float()), r.ref))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and padmoe's CUDA backend")
def test_cuda_side_stream():
    r, top, x, w = setup("cuda", torch.float32)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        plan = padmoe.make_plan(top, r.E, r.m)
        y = padmoe.dispatch(x, plan, w, rows=plan.padded_rows_bound)
        out = padmoe.combine(y, plan, w)
    s.synchronize()
    exp_y = ref.gather(t64(x), r.ref, w.cpu().numpy())
    np.testing.assert_allclose(t64(out), ref.scatter(exp_y, r.ref, w.cpu().numpy()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_tensors_cross_as_dlpack_capsules(device):
    """Torch tensors reach padmoe._C as DLPack capsules from torch's C export
    (not through the Python-level ``__dlpack__``), plans as namespaces of
    capsules; the capsules alias the tensors' memory (an op writes through)."""
    from padmoe._arrays import native_args

    x = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4).requires_grad_()
    n = np.zeros(3, dtype=np.int32)
    plan = padmoe.make_plan(torch.tensor([[0], [1], [0]], dtype=torch.int32, device=device), 2, 2)
    cx, cn, cp, ci = native_args((x, n, plan, 7))
    assert type(cx).__name__ == "PyCapsule"
    assert cn is n and ci == 7
    assert type(cp.dest_rows).__name__ == "PyCapsule"
    assert (cp.num_tokens, cp.top_k, cp.num_experts, cp.alignment) == (3, 1, 2, 2)
    dst = torch.full((3, 4), -1.0, device=device)
    padmoe.copy(x.detach(), dst)
    assert torch.equal(dst, x.detach())
