"""The fused quantizing dispatch: padmoe.dispatch_quantized / padmoe.quantize
(numpy and torch inputs) and padmoe.torch.dispatch_quantized, against a numpy reference quantizer
written here from the DeepSeek-V3 (1x128 blockwise, scale = amax / fp8_max) and OCP MX v1.0 (MXFP8:
E8M0 shared exponent floor(log2 amax) - emax_elem, elements x / 2^X) definitions, with saturating
round-to-nearest-even fp8 conversion found by bracketing in a table of every fp8 value: codes and
scale bytes exactly, padding rows zero codes with a scale that decodes to 1."""

import numpy as np
import pytest

import padmoe
import reference as ref
from conftest import random_top_experts

LAYOUTS = ["block128", "mxfp8", "row"]
FP8 = ["e4m3", "e5m2"]

# ---------------------------------------------------------------------------
# the reference quantizer (numpy, float32 arithmetic as the definitions say)
# ---------------------------------------------------------------------------

FMT = {  # man_bits, bias, max code, emax_elem
    "e4m3": (3, 7, 0x7E, 8),
    "e5m2": (2, 15, 0x7B, 15),
}


def fp8_table(fmt):
    """Magnitudes of the codes 0..max (float64, exact)."""
    mb, bias, top, _ = FMT[fmt]
    vals = []
    for c in range(top + 1):
        e, m = c >> mb, c & ((1 << mb) - 1)
        vals.append(m * 2.0 ** (1 - bias - mb) if e == 0 else (1 + m / 2**mb) * 2.0 ** (e - bias))
    return np.array(vals)


def fp8_codes(v, fmt):
    """float32 array -> fp8 codes: nearest, ties to the even code, |v| >= max -> max, NaN -> 0x7f."""
    table = fp8_table(fmt)
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v.astype(np.float64))
    lo = np.clip(np.searchsorted(table, a, side="right") - 1, 0, len(table) - 2)
    mid = (table[lo] + table[lo + 1]) / 2
    code = np.where(a < mid, lo, np.where(a > mid, lo + 1, np.where(lo % 2 == 0, lo, lo + 1)))
    code = np.where(a >= table[-1], len(table) - 1, code)
    code = code.astype(np.uint8) | np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(v), 0x7F, code).astype(np.uint8)


def quantize_ref(x, layout, fmt):
    """x [N, H] float32 -> (codes uint8 [N, H], scale bytes uint8 [N, row bytes])."""
    x = np.asarray(x, dtype=np.float32)
    n, h = x.shape
    fp8_max = np.float32(fp8_table(fmt)[-1])
    emax = FMT[fmt][3]
    block = {"block128": 128, "mxfp8": 32, "row": max(h, 1)}[layout]
    cols = 1 if layout == "row" else -(-h // block)
    codes = np.zeros((n, h), dtype=np.uint8)
    scales = np.zeros((n, cols), dtype=np.uint8 if layout == "mxfp8" else np.float32)
    for r in range(n):
        for b in range(cols):
            blk = x[r, b * block : (b + 1) * block]
            finite = bool(np.isfinite(blk).all())
            amax = np.float32(np.abs(blk).max()) if finite and blk.size else np.float32(0)
            if layout == "mxfp8":
                if not finite:
                    scales[r, b] = 0xFF
                    codes[r, b * block : (b + 1) * block] = 0x7F
                    continue
                xe = 0 if amax == 0 else int(np.clip(np.frexp(amax)[1] - 1 - emax, -127, 127))
                scales[r, b] = xe + 127
                div = np.ldexp(np.float32(1), xe).astype(np.float32)
            else:
                if not finite:
                    scales[r, b] = np.uint32(0x7FC00000).view(np.float32)
                    codes[r, b * block : (b + 1) * block] = 0x7F
                    continue
                s = np.float32(amax / fp8_max)
                div = np.float32(1) if s == 0 else s
                scales[r, b] = div
            codes[r, b * block : (b + 1) * block] = fp8_codes((blk / div).astype(np.float32), fmt)
    return codes, scales.view(np.uint8).reshape(n, -1)


def one_row(layout, cols):
    return np.full(cols, 127, dtype=np.uint8) if layout == "mxfp8" else np.ones(cols, np.float32).view(np.uint8)


def dispatch_ref(x, plan, layout, fmt):
    """Padded codes and scale bytes [P, ...]: token rows moved, padding zero / scale 1."""
    codes, sb = quantize_ref(x, layout, fmt)
    k = plan["top_k"]
    h = codes.shape[1]
    cols = sb.shape[1] // (1 if layout == "mxfp8" else 4)
    yc = np.zeros((plan["P"], h), dtype=np.uint8)
    ys = np.empty((plan["P"], sb.shape[1]), dtype=np.uint8)
    for r in range(plan["P"]):
        a = plan["row_sources"][r]
        if a >= 0:
            yc[r], ys[r] = codes[a // k], sb[a // k]
        else:
            ys[r] = one_row(layout, cols)
    return yc, ys


def as_bytes(a):
    if hasattr(a, "detach"):
        import torch

        t = a.detach().contiguous().cpu()
        a = t.view(torch.uint8).numpy() if t.element_size() == 1 else t.numpy()
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape[0], -1)


def make_values(rng, t, h, dtype, fmt):
    """Rows with every kind of 32-column block: random, all zero, tiny, huge, exact ties at scale 1,
    near-saturating, NaN and inf; exact in `dtype` (a numpy dtype, or "bfloat16" as float32 values)."""
    table = fp8_table(fmt)
    tiny, huge = (3e-6, 3e4) if dtype == np.float16 else (1e-38, 1e37)
    x = np.zeros((t, h), dtype=np.float32)
    for r in range(t):
        for c0 in range(0, h, 32):
            n = min(32, h - c0)
            kind = (r * 7 + c0 // 32 * 3) % 9
            if kind in (0, 1):
                v = rng.uniform(-3, 3, n)
            elif kind == 2:
                v = np.where(rng.integers(0, 3, n) == 0, -0.0, 0.0)
            elif kind == 3:
                v = tiny * rng.uniform(-4, 4, n)
            elif kind == 4:
                v = huge * rng.uniform(-1, 1, n)
            elif kind == 5:
                i = rng.integers(0, len(table) - 1, n)
                v = (table[i] + table[i + 1]) / 2 * rng.choice([-1.0, 1.0], n)
                v[0] = table[-1]
            elif kind == 6:
                v = rng.uniform(-1.9, 1.9, n) * 1024
                v[0] = 1.96875 * 1024
            elif kind == 7:
                v = rng.uniform(-2, 2, n)
                v[min(5, n - 1)] = np.nan
            else:
                v = rng.uniform(-2, 2, n)
                v[min(3, n - 1)] = -np.inf
            x[r, c0 : c0 + n] = v
    if dtype == "bfloat16":
        u = x.view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)  # round to nearest even bf16
        return np.where(np.isnan(x), np.float32(np.nan), u.view(np.float32))  # NaN stays NaN
    return x.astype(dtype)


class Case:
    def __init__(self, tokens=41, top_k=3, experts=7, alignment=8, hidden=200, seed=0):
        self.rng = np.random.default_rng(seed)
        self.T, self.K, self.E, self.m, self.H = tokens, top_k, experts, alignment, hidden
        self.top = random_top_experts(self.rng, tokens, top_k, experts, skip_expert=2)
        self.ref = ref.make_plan(self.top, experts, alignment)
        self.ref["top_k"] = top_k
        self.P = self.ref["P"]
        self.plan = padmoe.make_plan(self.top, experts, alignment)


# ---------------------------------------------------------------------------
# the reference quantizer itself, by hand
# ---------------------------------------------------------------------------


def test_reference_quantizer_by_hand():
    assert list(fp8_codes(np.array([1.0625, -1.1875, 464.0, 3 / 1024, 1e9, -0.0], np.float32), "e4m3")) == [
        0x38,
        0xBA,
        0x7E,
        0x02,
        0x7E,
        0x80,
    ]
    c, s = quantize_ref(np.array([[448.0] + [7.0] * 31 + [0.0] * 32], np.float32), "mxfp8", "e4m3")
    assert list(s[0]) == [127, 127] and c[0, 0] == 0x7E and c[0, 1] == 0x4E
    c, s = quantize_ref(np.array([[7.0] + [1.0] * 31], np.float32), "mxfp8", "e4m3")
    assert s[0, 0] == 127 - 6 and c[0, 0] == 0x7E  # 7 * 64 = 448


# ---------------------------------------------------------------------------
# numpy inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("hidden", [1, 31, 32, 127, 128, 200, 7168])
def test_numpy_matches_reference(layout, fmt, dtype, hidden):
    c = Case(tokens=9 if hidden > 1000 else 41, hidden=hidden, seed=hidden)
    x = make_values(c.rng, c.T, c.H, dtype, fmt)
    want_c, want_s = dispatch_ref(x.astype(np.float32), c.ref, layout, fmt)
    y, ys = padmoe.dispatch_quantized(x, c.plan, scale_layout=layout, fp8=fmt)
    bound = c.plan.padded_rows_bound
    assert y.dtype == np.uint8 and y.shape == (bound, c.H)
    assert ys.shape[0] == bound and ys.dtype == (np.uint8 if layout == "mxfp8" else np.float32)
    assert ys.ndim == (1 if layout == "row" else 2)
    np.testing.assert_array_equal(y[: c.P], want_c)
    np.testing.assert_array_equal(as_bytes(ys)[: c.P], want_s)
    assert not y[c.P :].any()
    # quantize alone: the token rows' codes and scales
    q, qs = padmoe.quantize(x, scale_layout=layout, fp8=fmt)
    tc, ts = quantize_ref(x.astype(np.float32), layout, fmt)
    np.testing.assert_array_equal(q, tc)
    np.testing.assert_array_equal(as_bytes(qs), ts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_rows_past_p_and_zero_padding(layout):
    c = Case(seed=5, hidden=160)
    x = make_values(c.rng, c.T, c.H, np.float16, "e4m3")
    want_c, want_s = dispatch_ref(x.astype(np.float32), c.ref, layout, "e4m3")
    cap = c.plan.padded_rows_bound
    assert cap > c.P
    for rows in (None, cap + 3):
        y, ys = padmoe.dispatch_quantized(x, c.plan, scale_layout=layout, rows=rows)
        assert y.shape[0] == ys.shape[0] == (cap if rows is None else rows)
        np.testing.assert_array_equal(y[: c.P], want_c)
        np.testing.assert_array_equal(as_bytes(ys)[: c.P], want_s)
        assert not y[c.P :].any()  # rows past P: zero codes, the padding rows' scale
        assert (as_bytes(ys)[c.P :] == want_s[[r for r in range(c.P) if c.ref["row_sources"][r] < 0][0]]).all()
    # zero_padding=False: padding rows (and their scales) left as they were
    y = np.full((cap, c.H), 0xAB, dtype=np.uint8)
    ys = np.full(
        (cap,) if layout == "row" else (cap, want_s.shape[1] // (1 if layout == "mxfp8" else 4)),
        0xCD,
        dtype=np.float32 if layout != "mxfp8" else np.uint8,
    )
    if layout != "mxfp8":
        ys = np.frombuffer(b"\xcd" * ys.nbytes, dtype=np.float32).reshape(ys.shape).copy()
    y2, ys2 = padmoe.dispatch_quantized(x, c.plan, scale_layout=layout, out=(y, ys), zero_padding=False)
    assert y2 is y and ys2 is ys
    real = np.array([c.ref["row_sources"][r] >= 0 for r in range(c.P)])
    assert (~real).any()
    np.testing.assert_array_equal(y[: c.P][real], want_c[real])
    np.testing.assert_array_equal(as_bytes(ys)[: c.P][real], want_s[real])
    assert (y[: c.P][~real] == 0xAB).all() and (as_bytes(ys)[: c.P][~real] == 0xCD).all()
    assert (y[c.P :] == 0xAB).all()


def test_numpy_empty_expert_no_tokens_no_columns():
    c = Case(seed=9, hidden=64)  # expert 2 never chosen
    assert c.ref["tokens_per_expert"][2] == 0
    x = make_values(c.rng, c.T, c.H, np.float32, "e5m2")
    y, ys = padmoe.dispatch_quantized(x, c.plan, scale_layout="mxfp8", fp8="e5m2")
    want_c, want_s = dispatch_ref(x, c.ref, "mxfp8", "e5m2")
    np.testing.assert_array_equal(y[: c.P], want_c)
    np.testing.assert_array_equal(ys[: c.P], want_s)
    empty = padmoe.make_plan(np.zeros((0, 2), np.int32), 4, 8)
    y0, ys0 = padmoe.dispatch_quantized(np.zeros((0, 64), np.float16), empty)
    assert y0.shape == (4 * 7, 64) and ys0.shape == (4 * 7, 1) and not y0.any()
    yr, ysr = padmoe.dispatch_quantized(np.zeros((c.T, 0), np.float16), c.plan, scale_layout="row")
    assert yr.shape == (c.plan.padded_rows_bound, 0) and (ysr == 1.0).all()


def test_numpy_bad_inputs_are_named_errors():
    c = Case(seed=3)
    x = np.zeros((c.T, c.H), dtype=np.float16)
    with pytest.raises(
        TypeError,
        match=r"dispatch_quantized: x: expected float32, float16 or bfloat16 rows to quantize, "
        r"got int32",
    ):
        padmoe.dispatch_quantized(np.zeros((c.T, c.H), np.int32), c.plan)
    with pytest.raises(ValueError, match=r"dispatch_quantized: scale_layout: expected 'block128', 'mxfp8' or 'row'"):
        padmoe.dispatch_quantized(x, c.plan, scale_layout="per-tensor")
    with pytest.raises(ValueError, match=r"dispatch_quantized: fp8: expected 'e4m3' or 'e5m2'"):
        padmoe.dispatch_quantized(x, c.plan, fp8="e3m4")
    y = np.full((c.P, c.H), 7, dtype=np.uint8)
    with pytest.raises(
        ValueError, match=r"dispatch_quantized: y_scales: uint8 \(E8M0\) scales must be \[rows, ceil\(H/32\)\]"
    ):
        padmoe.dispatch_quantized(x, c.plan, out=(y, np.zeros((c.P, 3), np.uint8)))
    with pytest.raises(ValueError, match=r"dispatch_quantized: y: output capacity"):
        padmoe.dispatch_quantized(x, c.plan, out=(y[:-1], np.zeros((c.P - 1, 2), np.float32)))
    with pytest.raises(TypeError, match=r"dispatch_quantized: y: fp8='e4m3' reads uint8 code bytes, got float16"):
        padmoe.dispatch_quantized(x, c.plan, out=(np.zeros((c.P, c.H), np.float16), np.zeros((c.P, 2), np.float32)))
    assert (y == 7).all()  # nothing written before an error


# ---------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")
E8M0 = getattr(torch, "float8_e8m0fnu", None)
TORCH_FP8 = {"e4m3": getattr(torch, "float8_e4m3fn", None), "e5m2": getattr(torch, "float8_e5m2", None)}


def _ptorch():
    try:
        import padmoe.torch as pt
    except ImportError as e:
        pytest.skip(f"padmoe.torch not built: {e}")
    return pt


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FP8)
def test_torch_bf16_matches_reference_and_two_pass(layout, fmt):
    if TORCH_FP8[fmt] is None:
        pytest.skip("this torch has no float8")
    pt = _ptorch()
    c = Case(seed=21, hidden=200)
    xf = make_values(c.rng, c.T, c.H, "bfloat16", fmt)
    x = torch.from_numpy(xf).to(torch.bfloat16)
    assert np.array_equal(x.float().numpy(), xf, equal_nan=True)  # the values are exact in bf16
    want_c, want_s = dispatch_ref(xf, c.ref, layout, fmt)
    tplan = pt.make_plan(torch.from_numpy(c.top), c.E, c.m)
    y, ys = pt.dispatch_quantized(x, tplan, scale_layout=layout, fp8=fmt)
    assert (
        y.dtype == TORCH_FP8[fmt]
        and y.shape == (tplan.padded_rows_bound, c.H)
        and ys.shape[0] == tplan.padded_rows_bound
    )
    np.testing.assert_array_equal(as_bytes(y)[: c.P], want_c)
    np.testing.assert_array_equal(as_bytes(ys)[: c.P], want_s)
    assert not as_bytes(y)[c.P :].any()
    assert (as_bytes(ys)[c.P :] == one_row(layout, want_s.shape[1] // (1 if layout == "mxfp8" else 4))).all()
    # the numpy-layer functions on torch tensors: float8 rows out
    y2, ys2 = padmoe.dispatch_quantized(
        x, padmoe.make_plan(torch.from_numpy(c.top), c.E, c.m), scale_layout=layout, fp8=fmt
    )
    assert y2.dtype == TORCH_FP8[fmt]
    np.testing.assert_array_equal(as_bytes(y2), as_bytes(y))
    # the two-pass way: quantize (numpy), then move rows + scales with dispatch_scaled
    q, qs = padmoe.quantize(xf, scale_layout=layout, fp8=fmt)
    y3, ys3 = pt.dispatch_scaled(torch.from_numpy(q).view(TORCH_FP8[fmt]), tplan, torch.from_numpy(qs))
    np.testing.assert_array_equal(as_bytes(y3), as_bytes(y))
    np.testing.assert_array_equal(as_bytes(ys3), as_bytes(ys))
    with pytest.raises(TypeError, match=r"quantize: x: got a torch tensor; .*padmoe\.torch"):
        padmoe.quantize(x, scale_layout=layout, fp8=fmt)


def test_torch_e8m0_view_decodes_to_powers_of_two():
    if E8M0 is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    pt = _ptorch()
    c = Case(seed=23, hidden=96)
    xf = make_values(c.rng, c.T, c.H, np.float32, "e4m3")
    tplan = pt.make_plan(torch.from_numpy(c.top), c.E, c.m)
    y, ys = pt.dispatch_quantized(torch.from_numpy(xf), tplan, scale_layout="mxfp8")
    assert ys.dtype == torch.uint8
    b = ys.numpy()
    decoded = ys.view(E8M0).float().numpy()
    finite = b != 0xFF
    np.testing.assert_array_equal(decoded[finite], np.ldexp(np.float32(1), b[finite].astype(np.int32) - 127))
    assert np.isnan(decoded[~finite]).all() and (~finite).any()
    want_c, want_s = dispatch_ref(xf, c.ref, "mxfp8", "e4m3")
    np.testing.assert_array_equal(b[: c.P], want_s)


def test_torch_compile_fullgraph_and_no_grad():
    pt = _ptorch()
    c = Case(seed=25, hidden=256)
    tplan = pt.make_plan(torch.from_numpy(c.top), c.E, c.m)
    x = torch.from_numpy(make_values(c.rng, c.T, c.H, np.float16, "e4m3"))

    def step(x):
        y, ys = pt.dispatch_quantized(x, tplan, scale_layout="mxfp8")
        z, zs = pt.dispatch_quantized(x, tplan, scale_layout="block128", fp8="e5m2")
        return y, ys, z, zs

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got, want = compiled(x), step(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(as_bytes(g), as_bytes(w))
    want_c, want_s = dispatch_ref(x.numpy().astype(np.float32), c.ref, "mxfp8", "e4m3")
    np.testing.assert_array_equal(as_bytes(got[0])[: c.P], want_c)
    np.testing.assert_array_equal(as_bytes(got[1])[: c.P], want_s)
    # not differentiable: a clear error, not a silently detached output
    xg = x.float().requires_grad_()
    with pytest.raises(NotImplementedError, match="dispatch_quantized: not differentiable"):
        pt.dispatch_quantized(xg, tplan)
    with torch.no_grad():
        pt.dispatch_quantized(xg, tplan)
    with pytest.raises(ValueError, match="scale_layout"):
        pt.dispatch_quantized(x, tplan, scale_layout="tensor")
    with pytest.raises(ValueError, match="dispatch_quantized: fp8: expected 'e4m3' or 'e5m2'"):
        pt.dispatch_quantized(x, tplan, fp8="float16")
    with pytest.warns(DeprecationWarning, match="dtype= is deprecated"):
        z, _ = pt.dispatch_quantized(x, tplan, dtype=torch.float8_e5m2)
    assert z.dtype == torch.float8_e5m2
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="dispatch_quantized: dtype"):
        pt.dispatch_quantized(x, tplan, dtype=torch.float16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_rows_matches_numpy(layout):
    # padmoe.torch.dispatch_quantized takes rows= as padmoe.dispatch_quantized does: that many rows
    # (at least P), rows past P zero codes with the padding rows' scale; the same checks
    if TORCH_FP8["e4m3"] is None:
        pytest.skip("this torch has no float8")
    pt = _ptorch()
    c = Case(seed=27, hidden=160)
    xf = make_values(c.rng, c.T, c.H, np.float16, "e4m3")
    tplan = pt.make_plan(torch.from_numpy(c.top), c.E, c.m)
    cap = c.plan.padded_rows_bound
    assert tplan.padded_rows_bound == cap > c.P
    for rows in (None, c.P, cap, cap + 3):
        want_y, want_s = padmoe.dispatch_quantized(xf, c.plan, scale_layout=layout, rows=rows)
        y, ys = pt.dispatch_quantized(torch.from_numpy(xf), tplan, scale_layout=layout, rows=rows)
        n = cap if rows is None else rows
        assert y.dtype == TORCH_FP8["e4m3"] and y.shape == (n, c.H) and ys.shape == want_s.shape
        np.testing.assert_array_equal(as_bytes(y), want_y)
        np.testing.assert_array_equal(as_bytes(ys), as_bytes(want_s))
    compiled = torch.compile(
        lambda x: pt.dispatch_quantized(x, tplan, scale_layout=layout, rows=cap + 3),
        backend="aot_eager",
        fullgraph=True,
    )
    y, ys = compiled(torch.from_numpy(xf))
    want_y, want_s = padmoe.dispatch_quantized(xf, c.plan, scale_layout=layout, rows=cap + 3)
    np.testing.assert_array_equal(as_bytes(y), want_y)
    np.testing.assert_array_equal(as_bytes(ys), as_bytes(want_s))
    for f, x, plan in (
        (padmoe.dispatch_quantized, xf, c.plan),
        (pt.dispatch_quantized, torch.from_numpy(xf), tplan),
    ):
        with pytest.raises(ValueError, match=r"dispatch_quantized: rows: must be >= 0, got -1"):
            f(x, plan, scale_layout=layout, rows=-1)
        with pytest.raises(ValueError, match=r"dispatch_quantized: rows: size overflow: 2147483648 does not fit"):
            f(x, plan, scale_layout=layout, rows=2**31)
        with pytest.raises(ValueError, match=r"dispatch_quantized: y: output capacity"):
            f(x, plan, scale_layout=layout, rows=c.P - 1)
