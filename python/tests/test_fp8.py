"""Rows moved with their scales: dispatch_scaled / padded_gather_scaled / pad_to_alignment_scaled /
unpad_from_alignment_scaled (numpy and torch inputs) and the same padmoe.torch ops (float8 e4m3 / e5m2 rows; float32 per-row / per-128-column scales, MXFP8 E8M0
scales as uint8 or torch.float8_e8m0fnu), against a byte-level numpy reference written here:
data rows bitwise, scale rows byte for byte, padding rows zero with a scale that decodes to 1."""

import numpy as np
import pytest

import padmoe
import reference as ref
from conftest import random_top_experts

LAYOUTS = ["per-row-1d", "per-row-2d", "block128", "mx"]


# ---------------------------------------------------------------------------
# the reference: moves of raw bytes
# ---------------------------------------------------------------------------


def as_bytes(a):
    """A numpy array (or CPU torch tensor) as [rows, bytes per row] uint8."""
    if hasattr(a, "detach"):  # torch
        import torch

        t = a.detach().contiguous()
        a = t.view(torch.uint8).numpy() if t.element_size() == 1 else t.numpy()
    a = np.ascontiguousarray(a)
    rows = a.shape[0]
    return a.view(np.uint8).reshape(rows, -1)


def one_row(layout, cols):
    """The bytes of one scale row that decodes to 1: float32 1.0, or E8M0 127 (2^0)."""
    if layout == "mx":
        return np.full(cols, 127, dtype=np.uint8)
    return np.ones(cols, dtype=np.float32).view(np.uint8)


def move(src, sources, fill):
    """out[r] = src[sources[r]] or `fill` where sources[r] < 0 (bytes)."""
    out = np.empty((len(sources), src.shape[1] if src.ndim == 2 else fill.shape[0]), dtype=np.uint8)
    for r, s in enumerate(sources):
        out[r] = fill if s < 0 else src[s]
    return out


def spread_sources(plan):
    """dispatch / padded_gather: the token of each padded row, -1 for padding."""
    k = plan["top_k"]
    return [a // k if a >= 0 else -1 for a in plan["row_sources"]]


def unpad_sources(pmap, n):
    src = [-1] * n
    for p, m in enumerate(pmap):
        if m >= 0:
            src[m] = p
    return src


def poison(shape, dtype):
    """An array whose every byte is 0xFF (NaN in float32 and float16)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(b"\xff" * n, dtype=dtype).reshape(shape).copy()


def cols_of(layout, hidden):
    return {"per-row-1d": 1, "per-row-2d": 1, "block128": -(-hidden // 128), "mx": -(-hidden // 32)}[layout]


def make_scales(rng, layout, rows, hidden):
    c = cols_of(layout, hidden)
    if layout == "mx":
        return rng.integers(100, 151, size=(rows, c), dtype=np.uint8)
    s = rng.uniform(0.01, 4.0, size=(rows, c)).astype(np.float32)
    return s.reshape(rows) if layout == "per-row-1d" else s


def expect(rows_out, scales_out, rows_src, scales_src, sources, layout, hidden, real_only=None):
    """rows / scales equal the reference move (padding: zero / one)."""
    rb = as_bytes(rows_src)
    want_rows = move(rb, sources, np.zeros(rb.shape[1], dtype=np.uint8))
    want_scales = move(as_bytes(scales_src), sources, one_row(layout, cols_of(layout, hidden)))
    got_rows, got_scales = as_bytes(rows_out), as_bytes(scales_out)
    keep = slice(None) if real_only is None else real_only
    np.testing.assert_array_equal(got_rows[: len(sources)][keep], want_rows[keep])
    np.testing.assert_array_equal(got_scales[: len(sources)][keep], want_scales[keep])


class Case:
    def __init__(self, tokens=41, top_k=3, experts=7, alignment=8, hidden=200, seed=0):
        self.rng = np.random.default_rng(seed)
        self.T, self.K, self.E, self.m, self.H = tokens, top_k, experts, alignment, hidden
        self.top = random_top_experts(self.rng, tokens, top_k, experts, skip_expert=2)
        self.ref = ref.make_plan(self.top, experts, alignment)
        self.P = self.ref["P"]
        self.plan = padmoe.make_plan(self.top, experts, alignment)


# ---------------------------------------------------------------------------
# padmoe (numpy): float16 rows (scales are metadata the op moves), every layout
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hidden", [200, 96])
def test_numpy_dispatch_and_gather(layout, hidden):
    c = Case(hidden=hidden, seed=hidden)
    x = c.rng.uniform(-1, 1, size=(c.T, c.H)).astype(np.float16)
    xs = make_scales(c.rng, layout, c.T, c.H)
    srcs = spread_sources(c.ref)
    bound = c.plan.padded_rows_bound
    y, ys = padmoe.dispatch_scaled(x, c.plan, xs)
    assert y.shape == (bound, c.H) and ys.shape == (bound,) + xs.shape[1:] and ys.dtype == xs.dtype
    expect(y, ys, x, xs, srcs, layout, c.H)
    g, gs = padmoe.padded_gather_scaled(
        x, c.ref["indices"], c.ref["bin_ids"], c.ref["bins"], c.ref["padded_bins"], c.K, xs
    )
    assert g.shape[0] == gs.shape[0] == c.P
    np.testing.assert_array_equal(g, y[: c.P])
    np.testing.assert_array_equal(gs, ys[: c.P])
    # rows past P: zero with scale 1 in the outputs padmoe allocates (above); in buffers passed as
    # out= they are left as they are
    assert not as_bytes(y)[c.P :].any()
    assert (as_bytes(ys)[c.P :] == one_row(layout, cols_of(layout, c.H))).all()
    out = (poison((bound, c.H), np.float16), poison((bound,) + xs.shape[1:], xs.dtype))
    y2, ys2 = padmoe.dispatch_scaled(x, c.plan, xs, out=out)
    assert y2 is out[0] and ys2 is out[1]
    expect(y2, ys2, x, xs, srcs, layout, c.H)
    assert (as_bytes(y2)[c.P :] == 0xFF).all() and (as_bytes(ys2)[c.P :] == 0xFF).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_zero_padding_false_leaves_padding_unwritten(layout):
    c = Case(seed=3)
    x = c.rng.uniform(-1, 1, size=(c.T, c.H)).astype(np.float32)
    xs = make_scales(c.rng, layout, c.T, c.H)
    y = poison((c.P, c.H), np.float32)
    ys = poison((c.P,) + xs.shape[1:], xs.dtype)
    padmoe.dispatch_scaled(x, c.plan, xs, out=(y, ys), zero_padding=False)
    real = np.array([s >= 0 for s in spread_sources(c.ref)])
    assert (~real).any()
    expect(y, ys, x, xs, spread_sources(c.ref), layout, c.H, real_only=real)
    assert (as_bytes(y)[~real] == 0xFF).all()
    assert (as_bytes(ys)[~real] == 0xFF).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_pad_and_unpad(layout):
    rng = np.random.default_rng(7)
    counts = np.array([5, 0, 17, 1, 0, 8], dtype=np.int32)
    n, h, m = int(counts.sum()) + 3, 160, 8  # 3 trailing rows ignored
    hidden = rng.uniform(-1, 1, size=(n, h)).astype(np.float16)
    hs = make_scales(rng, layout, n, h)
    padded, ps, pmap, offs = padmoe.pad_to_alignment_scaled(hidden, counts, m, hs)
    want_padded, want_map, want_offs = ref.pad(hidden, counts, m)
    np.testing.assert_array_equal(pmap, want_map)
    np.testing.assert_array_equal(offs, want_offs)
    expect(padded, ps, hidden, hs, list(want_map), layout, h)
    # unpad with some entries dropped: those rows get zero data and scale 1
    drop = pmap.copy()
    drop[::3] = -1
    out, os_ = padmoe.unpad_from_alignment_scaled(padded, drop, n, ps)
    assert out.shape == (n, h) and os_.shape == (n,) + hs.shape[1:]
    srcs = unpad_sources(drop, n)
    assert any(s < 0 for s in srcs)
    expect(out, os_, padded, ps, srcs, layout, h)


def test_numpy_bad_scales_are_named_errors():
    c = Case(seed=5)
    x = np.zeros((c.T, c.H), dtype=np.float16)
    with pytest.raises(ValueError, match=r"dispatch: x_scales: float32 scales must be .*ceil\(H/128\)\] = \[rows, 2\]"):
        padmoe.dispatch_scaled(x, c.plan, np.zeros((c.T, 3), dtype=np.float32))
    with pytest.raises(
        ValueError, match=r"x_scales: uint8 \(E8M0\) scales must be \[rows, ceil\(H/32\)\] = \[rows, 7\]"
    ):
        padmoe.dispatch_scaled(x, c.plan, np.zeros((c.T, 4), dtype=np.uint8))
    with pytest.raises(TypeError, match=r"x_scales: expected float32 scales .* got float16"):
        padmoe.dispatch_scaled(x, c.plan, np.zeros((c.T,), dtype=np.float16))
    with pytest.raises(ValueError, match=r"x_scales: expected 41 rows"):
        padmoe.dispatch_scaled(x, c.plan, np.zeros((c.T - 1,), dtype=np.float32))
    y = np.full((c.P, c.H), 7, dtype=np.float16)
    with pytest.raises(ValueError, match=r"y_scales: expected the input scales' layout"):
        padmoe.dispatch_scaled(
            x, c.plan, np.zeros((c.T, 2), dtype=np.float32), out=(y, np.zeros(c.P, dtype=np.float32))
        )
    assert (y == 7).all()  # nothing written before the error


# ---------------------------------------------------------------------------
# torch: float8 rows, e8m0 scales, the padmoe.torch operators
# ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")
F8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]
E8M0 = getattr(torch, "float8_e8m0fnu", None)


def f8_rows(rng, shape, dtype):
    """Random float8 rows (NaN-free bit patterns)."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    t = torch.from_numpy(b).view(dtype)
    return torch.where(torch.isnan(t.float()), torch.zeros_like(t.float()), t.float()).to(dtype)


def torch_scales(rng, layout, rows, hidden, e8m0_dtype=False):
    s = torch.from_numpy(make_scales(rng, layout, rows, hidden))
    return s.view(E8M0) if (layout == "mx" and e8m0_dtype) else s


def _ptorch():
    try:
        import padmoe.torch as pt
    except ImportError as e:
        pytest.skip(f"padmoe.torch not built: {e}")
    return pt


@pytest.mark.parametrize("dtype", F8, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS + ["mx-e8m0fnu"])
def test_torch_float8_every_op(dtype, layout):
    lay = "mx" if layout.startswith("mx") else layout
    if layout == "mx-e8m0fnu" and E8M0 is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    pt = _ptorch()
    c = Case(seed=11, hidden=200)
    x = f8_rows(c.rng, (c.T, c.H), dtype)
    xs = torch_scales(c.rng, lay, c.T, c.H, layout == "mx-e8m0fnu")
    srcs = spread_sources(c.ref)
    tplan = pt.make_plan(torch.from_numpy(c.top), c.E, c.m)

    # padmoe.torch.dispatch_scaled: padded_rows_bound rows, rows past P zero with scale 1
    y, ys = pt.dispatch_scaled(x, tplan, xs)
    assert y.dtype == dtype and ys.dtype == xs.dtype and y.shape[0] == ys.shape[0] == tplan.padded_rows_bound
    expect(y, ys, x, xs, srcs, lay, c.H)
    assert not as_bytes(y)[c.P :].any()
    assert (as_bytes(ys)[c.P :] == one_row(lay, cols_of(lay, c.H))).all()

    # the numpy-layer functions on torch tensors agree
    y2, ys2 = padmoe.dispatch_scaled(x, padmoe.make_plan(torch.from_numpy(c.top), c.E, c.m), xs)
    expect(y2, ys2, x, xs, srcs, lay, c.H)
    assert torch.equal(y2.view(torch.uint8), y.view(torch.uint8)) and torch.equal(ys2, ys)

    idx = {k: torch.from_numpy(c.ref[k]) for k in ("indices", "bin_ids", "bins", "padded_bins")}
    g, gs = pt.padded_gather_scaled(x, idx["indices"], idx["bin_ids"], idx["bins"], idx["padded_bins"], c.K, xs)
    assert g.shape[0] == c.P
    expect(g, gs, x, xs, srcs, lay, c.H)

    counts = torch.tensor([3, 0, 9, 4], dtype=torch.int32)
    h = f8_rows(c.rng, (16, c.H), dtype)
    hs = torch_scales(c.rng, lay, 16, c.H, layout == "mx-e8m0fnu")
    padded, ps, pmap, offs = pt.pad_to_alignment_scaled(h, counts, 8, hs)
    _, want_map, want_offs = ref.pad(np.zeros((16, 1)), counts.numpy(), 8)
    np.testing.assert_array_equal(pmap.numpy(), want_map)
    np.testing.assert_array_equal(offs.numpy(), want_offs)
    expect(padded, ps, h, hs, list(want_map), lay, c.H)
    drop = pmap.clone()
    drop[::2] = -1
    out, os_ = pt.unpad_from_alignment_scaled(padded, drop, 16, ps)
    expect(out, os_, padded, ps, unpad_sources(drop.tolist(), 16), lay, c.H)


def test_torch_errors_and_no_autograd():
    pt = _ptorch()
    c = Case(seed=13)
    tplan = pt.make_plan(torch.from_numpy(c.top), c.E, c.m)
    x = torch.zeros(c.T, c.H, dtype=torch.bfloat16, requires_grad=True)
    xs = torch.ones(c.T)
    with pytest.raises(NotImplementedError, match="dispatch: rows moved with their scales are not differentiable"):
        pt.dispatch_scaled(x, tplan, xs)
    with torch.no_grad():
        y, ys = pt.dispatch_scaled(x, tplan, xs)
    assert not y.requires_grad and not ys.requires_grad
    with pytest.raises(ValueError, match=r"dispatch: x_scales: float32 scales must be"):
        pt.dispatch_scaled(x.detach(), tplan, torch.ones(c.T, 5))
    with pytest.raises(TypeError, match="scales"):
        pt.dispatch(x.detach(), tplan, scales=xs)  # the keyword is gone: a scaled dispatch is its own function


def test_torch_compile_traces_the_scaled_ops():
    pt = _ptorch()
    c = Case(seed=17, hidden=256)
    tplan = pt.make_plan(torch.from_numpy(c.top), c.E, c.m)
    x = f8_rows(c.rng, (c.T, c.H), F8[0]) if F8 else torch.randn(c.T, c.H)
    xs = torch_scales(c.rng, "block128", c.T, c.H)

    def step(x, xs):
        y, ys = pt.dispatch_scaled(x, tplan, xs)
        return y, ys

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    y, ys = compiled(x, xs)
    y0, ys0 = step(x, xs)
    np.testing.assert_array_equal(as_bytes(y), as_bytes(y0))
    assert torch.equal(ys, ys0)
    counts = torch.tensor([5, 3, 0, 8], dtype=torch.int32)
    h = torch.randn(16, c.H, dtype=torch.float16)
    hs = torch_scales(c.rng, "mx", 16, c.H)

    def pad_unpad(h, hs):
        padded, ps, pmap, _ = pt.pad_to_alignment_scaled(h, counts, 16, hs)
        return pt.unpad_from_alignment_scaled(padded, pmap, 16, ps)

    out, os_ = torch.compile(pad_unpad, backend="aot_eager", fullgraph=False)(h, hs)
    assert torch.equal(out, h) and torch.equal(os_, hs)


def test_opcheck_scaled_ops():
    _ptorch()
    c = Case(seed=19, hidden=64)
    import padmoe.torch as pt
    from padmoe.torch._common import packed as _packed

    tplan = pt.make_plan(torch.from_numpy(c.top), c.E, c.m)
    x = torch.randn(c.T, c.H, dtype=torch.bfloat16)
    xs = torch.rand(c.T, 1)
    torch.library.opcheck(
        torch.ops.padmoe.dispatch_scaled.default,
        (x, _packed(tplan), xs, c.K, c.E, c.m, None, 2, True),
        test_utils=("test_schema", "test_faketensor"),
    )
    counts = torch.tensor([5, 3, 0, 8], dtype=torch.int32)
    h = torch.randn(16, c.H, dtype=torch.float16)
    hs = torch.randint(0, 255, (16, 2), dtype=torch.uint8)
    torch.library.opcheck(
        torch.ops.padmoe.pad_to_alignment_scaled.default,
        (h, counts, 8, hs, 2, True),
        test_utils=("test_schema", "test_faketensor"),
    )
