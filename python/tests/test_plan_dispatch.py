"""make_plan_and_dispatch: make_plan then dispatch in one call, in both Python layers (padmoe on
numpy arrays / torch tensors, padmoe.torch's operator). Every result is checked two ways: bit for
bit against make_plan + dispatch, and against an independent reference (reference.py's plain
loops; a vectorized numpy stable sort for the large CUDA shapes)."""

import numpy as np
import pytest

import padmoe
import reference as ref
from conftest import random_top_experts, rows

OP = "make_plan_and_dispatch"
PLAN_FIELDS = [
    "indices",
    "bin_ids",
    "tokens_per_expert",
    "bins",
    "padded_tokens_per_expert",
    "padded_bins",
    "dest_rows",
]


def capacity(t, k, e, m):
    return t * k + e * (m - 1)


def ref_y(x, plan_ref, weights, rows_count):
    """reference.py's dispatch (float64 loops; with weights one float32 product, as padmoe computes
    it), in x's dtype, padded to rows_count zero rows."""
    if weights is None:
        y = ref.gather(x, plan_ref)
    else:
        y = ref.gather_f32(x, plan_ref, weights)
    full = np.zeros((rows_count, x.shape[1]), dtype=np.float64)
    full[: y.shape[0]] = y
    return full.astype(x.dtype)


def check_plan_against_ref(plan, r, cap):
    """The plan arrays (numpy or torch) against reference.py's: row_sources -1 from P on."""
    for name in PLAN_FIELDS:
        got = np.asarray(_host(getattr(plan, name)))
        assert got.dtype == np.int32, name
        np.testing.assert_array_equal(got, r[name], err_msg=name)
    rs = np.asarray(_host(plan.row_sources))
    assert rs.shape == (cap,)
    np.testing.assert_array_equal(rs[: r["P"]], r["row_sources"])
    assert np.all(rs[r["P"] :] == -1)


def _host(a):
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return a


def id_cases():
    """(name, top_experts [T, K] int64, E): random top-k, an empty expert, repeated ids within a
    token, one expert, no tokens."""
    rng = np.random.default_rng(7)
    return [
        ("random", random_top_experts(rng, 29, 3, 7).astype(np.int64), 7),
        ("empty_expert", random_top_experts(rng, 23, 2, 5, skip_expert=3).astype(np.int64), 5),
        ("repeated_ids", np.array([[1, 1, 0], [2, 2, 2], [0, 1, 1], [3, 0, 3], [1, 1, 1]], dtype=np.int64), 5),
        ("one_expert", np.zeros((9, 2), dtype=np.int64), 1),
        ("no_tokens", np.zeros((0, 4), dtype=np.int64), 6),
    ]


CASES = id_cases()
CASE_IDS = [c[0] for c in CASES]


# ---------------------------------------------------------------------------
# padmoe (numpy arrays)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("idtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("alignment", [1, 16])
def test_numpy_matches_make_plan_dispatch_and_reference(case, idtype, dtype, weighted, alignment):
    _, top64, E = case
    top = top64.astype(idtype)
    T, K = top.shape
    rng = np.random.default_rng(T * 31 + K)
    x = rows(rng, (T, 24), dtype)
    w = rng.uniform(0.1, 1.0, size=T * K).astype(np.float32) if weighted else None

    y, plan = padmoe.make_plan_and_dispatch(x, top, E, alignment, w)
    assert type(plan) is padmoe.Plan
    assert (plan.num_tokens, plan.top_k, plan.num_experts, plan.alignment) == (T, K, E, alignment)
    # bit for bit: make_plan + dispatch
    p2 = padmoe.make_plan(top, E, alignment)
    for name in PLAN_FIELDS + ["row_sources"]:
        np.testing.assert_array_equal(getattr(plan, name), getattr(p2, name), err_msg=name)
    y2 = padmoe.dispatch(x, p2, w)
    assert y.dtype == y2.dtype == np.dtype(dtype) and y.shape == y2.shape
    np.testing.assert_array_equal(
        y.view(np.uint16 if dtype == np.float16 else np.uint32),
        y2.view(np.uint16 if dtype == np.float16 else np.uint32),
    )
    # the independent reference: the stable counting sort of plain loops
    r = ref.make_plan(top64, E, alignment)
    bound = capacity(T, K, E, alignment)
    assert y.shape == (bound, 24) and plan.padded_rows_bound == bound
    check_plan_against_ref(plan, r, bound)
    np.testing.assert_array_equal(y, ref_y(x, r, w, bound))  # rows at or past P zero


def test_numpy_rows_and_out():
    rng = np.random.default_rng(3)
    top = random_top_experts(rng, 17, 2, 6, skip_expert=1)
    x = rows(rng, (17, 8), np.float32)
    w = rng.uniform(0.1, 1.0, size=34).astype(np.float32)
    E, m = 6, 4
    cap = capacity(17, 2, E, m)
    r = ref.make_plan(top, E, m)
    want = ref_y(x, r, w, cap)
    # rows: at least the bound (P is not known before the call); rows at or past P zero
    y, plan = padmoe.make_plan_and_dispatch(x, top, E, m, w, rows=cap + 2)
    assert y.shape == (cap + 2, 8)
    np.testing.assert_array_equal(y[:cap], want)
    assert np.all(y[cap:] == 0)
    check_plan_against_ref(plan, r, cap)
    with pytest.raises(ValueError, match=rf"{OP}: rows: must be >= plan.padded_rows_bound = {cap}"):
        padmoe.make_plan_and_dispatch(x, top, E, m, rows=r["P"])
    # caller-owned buffers (either may be None), filled and returned
    out_plan = padmoe.Plan.empty(17, 2, E, m)
    out_y = np.full((cap + 3, 8), 7.0, dtype=np.float32)
    y2, plan2 = padmoe.make_plan_and_dispatch(x, top, E, m, w, out=(out_y, out_plan))
    assert plan2 is out_plan and y2 is out_y
    np.testing.assert_array_equal(y2[: r["P"]], want[: r["P"]])
    assert np.all(y2[r["P"] :] == 7.0)  # an out= buffer's rows at or past P are left as they are
    check_plan_against_ref(plan2, r, cap)
    y3, _ = padmoe.make_plan_and_dispatch(x, top, E, m, out=(np.empty((cap, 8), np.float32), None))
    np.testing.assert_array_equal(y3[: r["P"]], ref_y(x, r, None, r["P"]))
    with pytest.raises(ValueError, match=rf"{OP}: out: the plan buffers are for"):
        padmoe.make_plan_and_dispatch(x, top, E, m + 1, out=(None, out_plan))
    with pytest.raises(ValueError, match="rows= or out="):
        padmoe.make_plan_and_dispatch(x, top, E, m, rows=cap, out=(out_y, None))
    # zero_padding=False: padding rows left unwritten, exactly as dispatch's
    a = np.full((cap, 8), 5.0, dtype=np.float32)
    b = a.copy()
    padmoe.make_plan_and_dispatch(x, top, E, m, w, out=(a, None), zero_padding=False)
    padmoe.dispatch(x, padmoe.make_plan(top, E, m), w, out=b, zero_padding=False)
    np.testing.assert_array_equal(a, b)
    real = np.zeros(cap, dtype=bool)
    real[r["dest_rows"]] = True
    assert np.all(a[~real] == 5.0)


def test_numpy_no_tokens():
    top = np.zeros((0, 2), dtype=np.int32)
    x = np.zeros((0, 5), dtype=np.float32)
    y, plan = padmoe.make_plan_and_dispatch(x, top, 3, 8)
    assert y.shape == (21, 5) and np.all(y == 0) and plan.padded_rows() == 0
    np.testing.assert_array_equal(plan.bins, [0, 0, 0])
    assert plan.row_sources.shape == (3 * 7,) and np.all(plan.row_sources == -1)


def _poisoned_outputs(T, K, E, m, H):
    plan = padmoe.Plan.empty(T, K, E, m)
    for a in plan.arrays:
        a.fill(-77)
    y = np.full((capacity(T, K, E, m), H), 9.0, dtype=np.float32)
    return plan, y


def _untouched(plan, y):
    return all(np.all(a == -77) for a in plan.arrays) and np.all(y == 9.0)


def test_numpy_errors_before_outputs_are_written():
    rng = np.random.default_rng(5)
    T, K, E, m, H = 11, 2, 5, 4, 6
    top = random_top_experts(rng, T, K, E)
    x = rows(rng, (T, H), np.float32)
    w = rng.uniform(0.1, 1.0, size=T * K).astype(np.float32)
    for idtype in (np.int32, np.int64):
        bad = top.astype(idtype)
        bad[4, 1] = E + 2
        plan, y = _poisoned_outputs(T, K, E, m, H)
        with pytest.raises(ValueError) as e:
            padmoe.make_plan_and_dispatch(x, bad, E, m, w, out=(y, plan))
        msg = str(e.value)
        assert msg.startswith(f"{OP}: top_experts:"), msg
        assert "[4, 1]" in msg and str(E + 2) in msg
        assert _untouched(plan, y)
        bad[4, 1] = -1
        with pytest.raises(ValueError, match=rf"{OP}: top_experts: .*\[4, 1\]"):
            padmoe.make_plan_and_dispatch(x, bad, E, m, out=(y, plan))
        assert _untouched(plan, y)
    # x with the wrong row count, weights of the wrong length, a wrong dtype: nothing written
    plan, y = _poisoned_outputs(T, K, E, m, H)
    with pytest.raises(ValueError, match=rf"{OP}: x:"):
        padmoe.make_plan_and_dispatch(rows(rng, (T + 1, H), np.float32), top, E, m, out=(y, plan))
    assert _untouched(plan, y)
    with pytest.raises(ValueError, match=rf"{OP}: weights:"):
        padmoe.make_plan_and_dispatch(x, top, E, m, w[:-1], out=(y, plan))
    assert _untouched(plan, y)
    with pytest.raises(TypeError, match=rf"{OP}: x:"):
        padmoe.make_plan_and_dispatch(x.astype(np.int32), top, E, m, out=(None, plan))
    assert _untouched(plan, y)
    with pytest.raises(ValueError, match=rf"{OP}: y:"):
        padmoe.make_plan_and_dispatch(x, top, E, m, out=(y[:-1], plan))  # fewer rows than row_sources
    assert _untouched(plan, y)
    with pytest.raises(ValueError, match=rf"{OP}: num_experts"):
        padmoe.make_plan_and_dispatch(x, top, 0, m)
    with pytest.raises(ValueError, match=rf"{OP}: alignment"):
        padmoe.make_plan_and_dispatch(x, top, E, 0)
    with pytest.raises(TypeError, match=rf"{OP}: x"):
        padmoe.make_plan_and_dispatch([[1.0]], top, E, m)


def test_numpy_layer_on_torch_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    top = random_top_experts(rng, 21, 2, 6, skip_expert=4)
    x = torch.from_numpy(rows(rng, (21, 16), np.float32)).to(torch.bfloat16)
    w = torch.from_numpy(rng.uniform(0.1, 1.0, size=42).astype(np.float32))
    for ids in (torch.from_numpy(top), torch.from_numpy(top).long()):
        for weights in (None, w, w.to(torch.bfloat16)):
            y, plan = padmoe.make_plan_and_dispatch(x, ids, 6, 16, weights)
            p2 = padmoe.make_plan(ids, 6, 16)
            y2 = padmoe.dispatch(x, p2, weights)
            assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and torch.equal(y, y2)
            for name in PLAN_FIELDS + ["row_sources"]:
                assert torch.equal(getattr(plan, name), getattr(p2, name)), name
            r = ref.make_plan(top, 6, 16)
            check_plan_against_ref(plan, r, capacity(21, 2, 6, 16))
            want = _torch_ref_y(x, torch.from_numpy(r["dest_rows"]), 2, weights, capacity(21, 2, 6, 16))
            assert torch.equal(y, want)


# ---------------------------------------------------------------------------
# padmoe.torch
# ---------------------------------------------------------------------------


def _torch_ref_y(x, dest, K, weights, rows_count):
    """y[dest[a]] = x[a // K] (times weights[a]: one float32 product, cast once), other rows zero;
    plain torch indexing, no padmoe."""
    import torch

    src = x.repeat_interleave(K, 0)
    if weights is not None:
        src = (src.float() * weights.reshape(-1).float().unsqueeze(1)).to(x.dtype)
    y = torch.zeros(rows_count, x.shape[1], dtype=x.dtype, device=x.device)
    y[dest.long().to(x.device)] = src
    return y


def _torch():
    return pytest.importorskip("torch")


def _devices():
    try:
        import torch
    except ImportError:
        return ["cpu"]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])


DEVICES = _devices()
needs_cuda = pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and padmoe's CUDA backend")


def _pt():
    _torch()
    import padmoe.torch as pt

    return pt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("idtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("wdtype", [None, "float32", "rows"])
@pytest.mark.parametrize("alignment", [1, 16])
def test_torch_matches_make_plan_dispatch_and_reference(device, case, idtype, dtype, wdtype, alignment):
    torch = _torch()
    pt = _pt()
    _, top64, E = case
    T, K = top64.shape
    top = torch.from_numpy(top64).to(device, getattr(torch, idtype))
    g = torch.Generator().manual_seed(T + 3 * K)
    x = (torch.rand(T, 20, generator=g) * 2 - 1).to(device, getattr(torch, dtype))
    w = None
    if wdtype is not None:
        w = (torch.rand(T, K, generator=g) * 0.9 + 0.1).to(device, x.dtype if wdtype == "rows" else torch.float32)

    y, plan = pt.make_plan_and_dispatch(x, top, E, alignment, w)
    assert type(plan) is padmoe.Plan and plan.packed is not None
    cap = capacity(T, K, E, alignment)
    assert plan.padded_rows_bound == cap and y.shape == (cap, 20) and y.dtype == x.dtype and y.device == x.device
    assert not y.requires_grad and not plan.packed.requires_grad
    # bit for bit: padmoe.torch.make_plan + dispatch (plan.padded_rows_bound rows, rows at or past P zero)
    p2 = pt.make_plan(top, E, alignment)
    assert plan.packed.dtype == torch.int32 and torch.equal(plan.packed, p2.packed)
    assert torch.equal(y, pt.dispatch(x, p2, w))
    # the independent reference
    r = ref.make_plan(top64, E, alignment)
    check_plan_against_ref(plan, r, cap)
    want = _torch_ref_y(x, torch.from_numpy(r["dest_rows"]), K, w, cap)
    assert torch.equal(y, want)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_zero_padding_false(device):
    torch = _torch()
    pt = _pt()
    top64, E = CASES[1][1], CASES[1][2]
    top = torch.from_numpy(top64).to(device)
    x = torch.randn(top.shape[0], 12, device=device)
    y, plan = pt.make_plan_and_dispatch(x, top, E, 8, zero_padding=False)
    real = plan.dest_rows.long()
    # only the rows of assignments are written: they hold dispatch's values
    assert torch.equal(y[real], pt.dispatch(x, plan)[real])
    assert torch.equal(y[real], x.repeat_interleave(top.shape[1], 0))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_errors(device):
    torch = _torch()
    pt = _pt()
    T, K, E, m = 11, 2, 5, 4
    top = torch.from_numpy(random_top_experts(np.random.default_rng(1), T, K, E)).to(device)
    x = torch.randn(T, 6, device=device)
    w = torch.rand(T * K, device=device)
    for ids in (top, top.long()):
        bad = ids.clone()
        bad[4, 1] = E + 2
        with pytest.raises(ValueError) as e:
            pt.make_plan_and_dispatch(x, bad, E, m, w, check=True)
        msg = str(e.value)
        assert f"{OP}: top_experts:" in msg and "[4, 1]" in msg and str(E + 2) in msg, msg
    with pytest.raises(ValueError, match=rf"{OP}: x:"):
        pt.make_plan_and_dispatch(torch.randn(T + 1, 6, device=device), top, E, m)
    with pytest.raises(ValueError, match=rf"{OP}: weights:"):
        pt.make_plan_and_dispatch(x, top, E, m, w[:-1])
    with pytest.raises(TypeError, match=rf"{OP}: x"):
        pt.make_plan_and_dispatch(x.int(), top, E, m)
    with pytest.raises(ValueError, match=rf"{OP}: top_experts: expected \[T, K\]"):
        pt.make_plan_and_dispatch(x, top.reshape(-1), E, m)
    with pytest.raises(ValueError, match=rf"{OP}: num_experts"):
        pt.make_plan_and_dispatch(x, top, 0, m)
    with pytest.raises(ValueError, match=rf"{OP}: alignment"):
        pt.make_plan_and_dispatch(x, top, E, 0)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("w_grad", [False, True])
def test_torch_grads_equal_dispatch_grads(device, dtype, w_grad):
    torch = _torch()
    pt = _pt()
    T, K, E, m, H = 9, 3, 6, 4, 5
    top = torch.from_numpy(random_top_experts(np.random.default_rng(2), T, K, E, skip_expert=0)).to(device)
    g = torch.Generator().manual_seed(4)
    dt = getattr(torch, dtype)
    x = (torch.rand(T, H, generator=g) * 2 - 1).to(device, dt)
    w = (torch.rand(T, K, generator=g) + 0.1).to(device, dt)
    gy = (torch.rand(capacity(T, K, E, m), H, generator=g) * 2 - 1).to(device, dt)

    def run(fused):
        xl, wl = _leaf(x), _leaf(w) if w_grad else w
        if fused:
            y, _ = pt.make_plan_and_dispatch(xl, top, E, m, wl)
        else:
            y = pt.dispatch(xl, pt.make_plan(top, E, m), wl)
        ins = (xl, wl) if w_grad else (xl,)
        return y, torch.autograd.grad(y, ins, gy)

    y, grads = run(True)
    y2, grads2 = run(False)
    assert y.grad_fn is not None and y.grad_fn.name() == "padmoe::DispatchBackward"
    assert torch.equal(y, y2)
    for a, b in zip(grads, grads2):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    # an independent formula: grad_x[t] = sum_k w[t,k] gy[dest[t*K+k]], grad_w[t,k] = <gy[dest], x[t]>
    dest = pt.make_plan(top, E, m).dest_rows.long()
    rows_g = gy.double()[dest].view(T, K, H)
    want_gx = (rows_g * w.double().unsqueeze(-1)).sum(1)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == "float64" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[0].double(), want_gx, **tol)
    if w_grad:
        torch.testing.assert_close(grads[1].double(), (rows_g * x.double().unsqueeze(1)).sum(-1), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_gradcheck(device):
    torch = _torch()
    pt = _pt()
    T, K, E, m = 5, 2, 4, 4
    top = torch.from_numpy(random_top_experts(np.random.default_rng(6), T, K, E, skip_expert=2)).to(device)
    x = _leaf(torch.rand(T, 3, dtype=torch.float64, device=device) * 2 - 1)
    w = _leaf(torch.rand(T * K, dtype=torch.float64, device=device) + 0.1)
    assert torch.autograd.gradcheck(lambda a, b: pt.make_plan_and_dispatch(a, top, E, m, b)[0], (x, w))
    assert torch.autograd.gradcheck(lambda a: pt.make_plan_and_dispatch(a, top, E, m)[0], (x,))
    # through combine on the returned plan
    assert torch.autograd.gradcheck(
        lambda a, b: (lambda y, p: pt.combine(y * 1.5, p, b))(*pt.make_plan_and_dispatch(a, top, E, m)), (x, w)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_torch_runs_one_forward_and_one_backward_op(device):
    torch = _torch()
    pt = _pt()
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    top = torch.from_numpy(random_top_experts(np.random.default_rng(8), 13, 2, 5)).to(device)
    x = torch.randn(13, 8, device=device, requires_grad=True)
    w = torch.rand(13, 2, device=device, requires_grad=True)
    gy = torch.rand(13 * 2 + 5 * 3, 8, device=device)
    with OpLog() as log:
        y, plan = pt.make_plan_and_dispatch(x, top, 5, 4, w, check=False)
        y.backward(gy)
    views = {"aten.view", "aten.detach", "aten.alias", "aten._unsafe_view"}
    assert [op for op in log.ops if op not in views] == ["padmoe.make_plan_and_dispatch", "padmoe.dispatch_backward"], (
        log.ops
    )
    xr, wr = _leaf(x), _leaf(w)
    pt.dispatch(xr, pt.make_plan(top, 5, 4), wr).backward(gy)
    assert torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_entry_point_falls_back(device):
    torch = _torch()
    pt = _pt()

    class Tagged(torch.Tensor):
        """A trivial tensor subclass: the entry point hands it to the OpOverload."""

    top = torch.from_numpy(random_top_experts(np.random.default_rng(10), 7, 2, 4)).to(device)
    x = torch.randn(7, 4, device=device)
    want_y, want_plan = pt.make_plan_and_dispatch(x, top, 4, 2)
    y, plan = pt.make_plan_and_dispatch(x.as_subclass(Tagged), top, 4, 2)
    assert torch.equal(torch.Tensor(y.as_subclass(torch.Tensor)), want_y)
    assert torch.equal(torch.Tensor(plan.packed.as_subclass(torch.Tensor)), want_plan.packed)
    with torch.device(device):  # a torch function mode
        y, plan = pt.make_plan_and_dispatch(x, top, 4, 2)
        assert torch.equal(y, want_y) and torch.equal(plan.packed, want_plan.packed)
    # a bool where an int is expected: not taken by the entry point, the OpOverload's answer
    from padmoe import _torch_ops

    y, packed = _torch_ops.make_plan_and_dispatch(x, top, 4, 2, None, True, True)
    assert torch.equal(y, want_y) and torch.equal(packed, want_plan.packed)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_opcheck(device):
    """torch.library.opcheck: schema, fake kernel, autograd registration, AOT dispatch."""
    torch = _torch()
    top = torch.from_numpy(random_top_experts(np.random.default_rng(11), 13, 2, 5, skip_expert=1)).to(device)
    x = torch.randn(13, 6, device=device, requires_grad=True)
    w = torch.rand(26, device=device, requires_grad=True)
    op = torch.ops.padmoe.make_plan_and_dispatch.default
    torch.library.opcheck(op, (x, top, 5, 4, w, 1))
    torch.library.opcheck(op, (x, top.long(), 5, 16, None, 1, True))
    torch.library.opcheck(op, (x.detach(), top, 5, 1, w.detach(), 1))


def _fused_step(x, top, w, E: int, m: int):
    import torch

    import padmoe.torch as pt

    y, plan = pt.make_plan_and_dispatch(x, top, E, m)
    return pt.combine(torch.tanh(y) * 2.0, plan, w), y


def _two_step(x, top, w, E: int, m: int):
    import torch

    import padmoe.torch as pt

    plan = pt.make_plan(top, E, m)
    y = pt.dispatch(x, plan)
    return pt.combine(torch.tanh(y) * 2.0, plan, w), y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(device, backend):
    torch = _torch()
    torch._dynamo.reset()
    E, m = 5, 4

    def inputs(seed):
        rng = np.random.default_rng(seed)
        top = torch.from_numpy(random_top_experts(rng, 13, 2, E, skip_expert=seed % E)).to(device)
        x = torch.from_numpy(rows(rng, (13, 12), np.float32)).to(device)
        w = torch.from_numpy(rng.uniform(0.1, 1.0, size=(13, 2)).astype(np.float32)).to(device)
        return top, x, w

    compiled = torch.compile(_fused_step, fullgraph=True, backend=backend)
    for seed in (0, 1):  # new routing, same shapes: no recompilation problems, still right
        top, x, w = inputs(seed)
        xs, ws = _leaf(x), _leaf(w)
        out, y = compiled(xs, top, ws, E, m)
        xr, wr = _leaf(x), _leaf(w)
        rout, ry = _two_step(xr, top, wr, E, m)
        assert torch.equal(y, ry)
        torch.testing.assert_close(out, rout, rtol=1e-5, atol=1e-5)
        gout = torch.ones_like(out)
        g = torch.autograd.grad(out, (xs, ws), gout)
        rg = torch.autograd.grad(rout, (xr, wr), gout)
        for a, b in zip(g, rg):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    explain = torch._dynamo.explain(_fused_step)(x, top, w, E, m)
    assert explain.graph_break_count == 0


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU): the decode shape and a larger one
# ---------------------------------------------------------------------------


def _np_stable_plan(top, E, m):
    """reference plan arrays by a vectorized numpy stable sort (independent of padmoe), for the
    sizes reference.py's loops are too slow for: (dest_rows, tokens_per_expert, padded_bins, P)."""
    flat = np.asarray(top, dtype=np.int64).reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    bins = np.cumsum(counts)
    padded = (counts + m - 1) // m * m
    padded_bins = np.cumsum(padded)
    e_sorted = flat[order]
    real_start = np.concatenate([[0], bins[:-1]])
    pad_start = np.concatenate([[0], padded_bins[:-1]])
    dest = np.empty(flat.size, dtype=np.int64)
    dest[order] = pad_start[e_sorted] + np.arange(flat.size) - real_start[e_sorted]
    return dict(
        indices=order,
        bin_ids=e_sorted,
        tokens_per_expert=counts,
        bins=bins,
        padded_tokens_per_expert=padded,
        padded_bins=padded_bins,
        dest_rows=dest,
        P=int(padded_bins[-1]),
    )


def test_np_stable_plan_matches_reference_loops():
    top = random_top_experts(np.random.default_rng(12), 31, 3, 9, skip_expert=4)
    a, b = _np_stable_plan(top, 9, 8), ref.make_plan(top, 9, 8)
    for name in PLAN_FIELDS + ["P"]:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _router_ids(torch, T, K, E, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, E, generator=g).topk(K, dim=-1).indices.to(device)


@needs_cuda
@pytest.mark.parametrize("T", [256, 4096], ids=["decode", "large"])
@pytest.mark.parametrize("idtype", ["int32", "int64"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("check", [None, False])
def test_cuda_deepseek_shapes(T, idtype, weighted, check):
    """T=256 (decode) and T=4096, K=8,
    E=256, H=7168 bf16, alignment 16: equal to make_plan + dispatch on the GPU, and to the CPU
    backend and a numpy stable sort."""
    torch = _torch()
    pt = _pt()
    K, E, H, m = 8, 256, 7168, 16
    top = _router_ids(torch, T, K, E, T + K, "cuda").to(getattr(torch, idtype))
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(T, H, generator=g) * 2 - 1).to("cuda", torch.bfloat16)
    w = (torch.rand(T, K, generator=g) + 0.1).to("cuda", torch.float32) if weighted else None
    y, plan = pt.make_plan_and_dispatch(x, top, E, m, w, check=check)
    p2 = pt.make_plan(top, E, m, check=check)
    y2 = pt.dispatch(x, p2, w, check=check)
    torch.cuda.synchronize()
    assert torch.equal(plan.packed, p2.packed)
    assert torch.equal(y, y2)
    # the CPU backend and the independent numpy sort
    cpu_plan = pt.make_plan(top.cpu(), E, m)
    assert torch.equal(plan.packed.cpu(), cpu_plan.packed)
    r = _np_stable_plan(top.cpu().numpy(), E, m)
    for name in PLAN_FIELDS:
        np.testing.assert_array_equal(getattr(plan, name).cpu().numpy(), r[name], err_msg=name)
    want = _torch_ref_y(
        x.cpu(), torch.from_numpy(r["dest_rows"]), K, None if w is None else w.cpu(), plan.padded_rows_bound
    )
    assert torch.equal(y.cpu(), want)
    # the array layer on the same tensors: the same padded_rows_bound rows, padding zero
    y3, plan3 = padmoe.make_plan_and_dispatch(x, top, E, m, w)
    assert y3.shape == y.shape and torch.equal(y3, y)
    for name in PLAN_FIELDS + ["row_sources"]:
        assert torch.equal(getattr(plan3, name), getattr(plan, name)), name


@needs_cuda
@pytest.mark.parametrize("T", [1, 37, 256, 300])
def test_cuda_sizes_around_the_fused_limit(T):
    """Small and odd T, with float32 rows and an empty H: the fused path and the two launches."""
    torch = _torch()
    pt = _pt()
    K, E, m = 8, 256, 16
    top = _router_ids(torch, T, K, E, T, "cuda")
    for H in (0, 1, 136):
        x = torch.randn(T, H, device="cuda")
        w = torch.rand(T * K, device="cuda")
        for weights in (None, w):
            y, plan = pt.make_plan_and_dispatch(x, top, E, m, weights)
            p2 = pt.make_plan(top, E, m)
            assert torch.equal(plan.packed, p2.packed), (T, H)
            assert torch.equal(y, pt.dispatch(x, p2, weights)), (T, H)


@needs_cuda
def test_cuda_unchecked_bad_ids_as_make_plan():
    """check=False: ids outside [0, E) are not diagnosed; make_plan drops them (dest_rows -1), and
    so does make_plan_and_dispatch, to the same bits."""
    torch = _torch()
    pt = _pt()
    for T in (64, 4096):
        top = _router_ids(torch, T, 8, 256, 3, "cuda")
        top[1, 2] = 256
        top[5, 0] = -1
        x = torch.randn(T, 64, device="cuda", dtype=torch.bfloat16)
        y, plan = pt.make_plan_and_dispatch(x, top, 256, 16, check=False)
        p2 = pt.make_plan(top, 256, 16, check=False)
        assert torch.equal(plan.packed, p2.packed)
        assert torch.equal(y, pt.dispatch(x, p2, check=False))
        with pytest.raises(ValueError, match=rf"{OP}: top_experts: .*\[1, 2\]"):
            pt.make_plan_and_dispatch(x, top, 256, 16, check=True)


@needs_cuda
def test_cuda_graph_capture_replay():
    torch = _torch()
    pt = _pt()
    T, K, E, H, m = 256, 8, 256, 7168, 16
    s_top = _router_ids(torch, T, K, E, 0, "cuda")
    s_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    s_w = torch.rand(T, K, device="cuda")

    def step():
        y, plan = pt.make_plan_and_dispatch(s_x, s_top, E, m)
        return pt.combine(y, plan, s_w), y, plan.packed

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # check=None: no checks (and no synchronization) while capturing
        s_out, s_y, s_plan = step()
    for seed in (11, 12):
        s_top.copy_(_router_ids(torch, T, K, E, seed, "cuda"))
        s_x.copy_(torch.randn(T, H, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        p2 = pt.make_plan(s_top, E, m)
        y2 = pt.dispatch(s_x, p2)
        assert torch.equal(s_plan, p2.packed) and torch.equal(s_y, y2)
        assert torch.equal(s_out, pt.combine(y2, p2, s_w))
