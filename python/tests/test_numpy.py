"""padmoe on numpy arrays (CPU), against the float64 loops of reference.py."""

import os
import re

import numpy as np
import pytest

import padmoe
import reference as ref
from conftest import TOL, Routing, rows

FLOATS = [np.float32, np.float16]
PLAN_FIELDS = [
    "indices",
    "bin_ids",
    "tokens_per_expert",
    "bins",
    "padded_tokens_per_expert",
    "padded_bins",
    "dest_rows",
]


def weights_for(r, mode, dtype):
    """Router weights: None, float32, or the rows' dtype."""
    if mode is None:
        return None
    wdt = np.float32 if mode == "float32" else dtype
    return r.rng.uniform(0.1, 1.0, size=r.A).astype(wdt)


def padded_input(r, dtype, poison=True):
    """Padded rows [P, H] with real rows random and padding rows NaN (never read)."""
    y = rows(r.rng, (r.P, r.H), dtype)
    if poison:
        real = np.zeros(r.P, dtype=bool)
        real[r.ref["dest_rows"]] = True
        y[~real] = np.nan
    return y


def assert_close(actual, expected, dtype):
    assert actual.dtype == np.dtype(dtype)
    np.testing.assert_allclose(actual.astype(np.float64), expected, **TOL[np.dtype(dtype)])


# ---------------------------------------------------------------------------
# module facts
# ---------------------------------------------------------------------------


def test_version_matches_cmake_project():
    cmake = os.path.join(os.path.dirname(__file__), "..", "..", "CMakeLists.txt")
    if not os.path.exists(cmake):
        pytest.skip("not run from a source tree")
    version = re.search(r"project\(padmoe\s+VERSION\s+([0-9.]+)", open(cmake).read()).group(1)
    assert padmoe.__version__ == version


def test_sizes_and_flags():
    assert isinstance(padmoe.has_cuda(), bool)
    assert padmoe.padded_rows_bound(37, 3, 6, 4) == 37 * 3 + 6 * 3
    assert padmoe.padded_rows_bound(5, 2, 4, 1) == 10
    ws = padmoe.workspace_bound(37, 3, 6, 4)
    assert isinstance(ws, int) and ws > 0
    assert padmoe.workspace_bound(1000, 8, 64, 128) >= ws


# ---------------------------------------------------------------------------
# make_plan
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("alignment", [1, 4, 16])
def test_make_plan_fields(index_dtype, alignment):
    r = Routing(alignment=alignment, seed=alignment)
    plan = padmoe.make_plan(r.top.astype(index_dtype), r.E, alignment)
    assert isinstance(plan, padmoe.Plan)
    for name in PLAN_FIELDS:
        got = getattr(plan, name)
        assert isinstance(got, np.ndarray) and got.dtype == np.int32, name
        np.testing.assert_array_equal(got, r.ref[name], err_msg=name)
    assert plan.tokens_per_expert[2] == 0  # the empty expert
    assert plan.row_sources.shape == (plan.padded_rows_bound,)
    np.testing.assert_array_equal(plan.row_sources[: r.P], r.ref["row_sources"])
    assert (plan.row_sources[r.P :] == -1).all()
    assert (plan.num_tokens, plan.top_k, plan.num_experts, plan.alignment) == (r.T, r.K, r.E, alignment)
    assert plan.num_assignments == r.A
    assert plan.padded_rows_bound == r.A + r.E * (alignment - 1)
    assert plan.padded_rows() == r.P


def test_make_plan_into_caller_buffers(routing):
    r = routing
    plan = padmoe.Plan.empty(r.T, r.K, r.E, r.m)
    for name in PLAN_FIELDS + ["row_sources"]:
        getattr(plan, name).fill(12345)
    got = padmoe.make_plan(r.top, r.E, r.m, out=plan)
    assert got is plan
    for name in PLAN_FIELDS:
        np.testing.assert_array_equal(getattr(plan, name), r.ref[name], err_msg=name)
    np.testing.assert_array_equal(plan.row_sources[: r.P], r.ref["row_sources"])
    assert (plan.row_sources[r.P :] == -1).all()
    with pytest.raises(ValueError, match="out"):
        padmoe.make_plan(r.top, r.E, r.m + 1, out=plan)
    with pytest.raises(ValueError, match="num_experts"):
        padmoe.Plan.empty(r.T, r.K, 0, r.m)


def test_empty_routing():
    top = np.zeros((0, 2), dtype=np.int32)
    plan = padmoe.make_plan(top, 3, 8)
    assert plan.padded_rows() == 0
    np.testing.assert_array_equal(plan.bins, [0, 0, 0])
    x = np.zeros((0, 5), dtype=np.float32)
    y = padmoe.dispatch(x, plan)
    assert y.shape == (3 * 7, 5) and not y.any()  # padded_rows_bound rows, all past P
    assert padmoe.combine(y, plan).shape == (0, 5)


# ---------------------------------------------------------------------------
# MegaBlocks family
# ---------------------------------------------------------------------------


def sorted_args(plan):
    return plan.indices, plan.bin_ids, plan.bins, plan.padded_bins


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("wmode", [None, "float32", "row"])
def test_padded_gather(routing, dtype, wmode):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    x = rows(r.rng, (r.T, r.H), dtype)
    w = weights_for(r, wmode, dtype)
    y = padmoe.padded_gather(x, *sorted_args(plan), r.K, w)
    assert y.shape == (r.P, r.H) and y.dtype == np.dtype(dtype)
    expected = ref.gather(x, r.ref, w)
    if w is None:
        np.testing.assert_array_equal(y.astype(np.float64), expected)  # a pure move: exact
    else:
        assert_close(y, expected, dtype)
        np.testing.assert_array_equal(y, ref.gather_f32(x, r.ref, w).astype(dtype))  # one float32 product
    # the fused form agrees bit for bit, with its rows past P zero
    fused = padmoe.dispatch(x, plan, w)
    assert fused.shape == (plan.padded_rows_bound, r.H)
    np.testing.assert_array_equal(fused[: r.P], y)
    assert not fused[r.P :].any()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("wmode", [None, "float32", "row"])
def test_padded_scatter(routing, dtype, wmode):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    y = padded_input(r, dtype)
    w = weights_for(r, wmode, dtype)
    out = padmoe.padded_scatter(y, *plan_args_scatter(plan, w), r.K)
    assert out.shape == (r.T, r.H) and out.dtype == np.dtype(dtype)
    assert_close(out, ref.scatter(y, r.ref, w), dtype)
    # float32 sums in ascending k, cast once: bitwise equal to the float32 loop
    np.testing.assert_array_equal(out, ref.scatter_f32(y, r.ref, w).astype(dtype))
    np.testing.assert_array_equal(padmoe.combine(y, plan, w), out)


def plan_args_scatter(plan, w):
    return plan.indices, plan.bin_ids, w, plan.bins, plan.padded_bins


@pytest.mark.parametrize("dtype", FLOATS)
def test_padded_scatter_wgrad(routing, dtype):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    y = padded_input(r, dtype)
    grad = rows(r.rng, (r.T, r.H), dtype)
    wgrad = padmoe.padded_scatter_wgrad(y, grad, *sorted_args(plan), r.K)
    assert wgrad.shape == (r.A,) and wgrad.dtype == np.dtype(dtype)  # y's dtype, as MegaBlocks
    expected = ref.wgrad(y, grad, r.ref)
    assert_close(wgrad, expected, dtype)
    out32 = np.full(r.A, np.nan, dtype=np.float32)
    got = padmoe.padded_scatter_wgrad(y, grad, *sorted_args(plan), r.K, out=out32)
    assert got is out32
    np.testing.assert_allclose(out32, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("wmode", [None, "float32"])
def test_gather_backward_and_dispatch_backward(routing, dtype, wmode):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    x = rows(r.rng, (r.T, r.H), dtype)
    grad_y = padded_input(r, dtype)
    w = weights_for(r, wmode, dtype)
    gx, gw = padmoe.padded_gather_backward(grad_y, x, *sorted_args(plan), r.K, w)
    assert gx.shape == (r.T, r.H)
    assert_close(gx, ref.scatter(grad_y, r.ref, w), dtype)
    np.testing.assert_array_equal(gx, ref.scatter_f32(grad_y, r.ref, w).astype(dtype))
    expected_gw = ref.wgrad(grad_y, x, r.ref)
    if w is None:
        assert gw is None
    else:
        assert gw.dtype == w.dtype and gw.shape == (r.A,)
        np.testing.assert_allclose(gw, expected_gw, rtol=1e-5, atol=1e-5)
    dx, dw = padmoe.dispatch_backward(grad_y, x, plan, w)
    np.testing.assert_array_equal(dx, gx)
    if w is None:
        assert dw is None
    else:
        np.testing.assert_allclose(dw, expected_gw, rtol=1e-5, atol=1e-5)
    # a given weight-gradient output is filled even without weights
    out_gx = np.empty_like(gx)
    out_gw = np.full(r.A, np.nan, dtype=np.float32)
    res = padmoe.dispatch_backward(grad_y, x, plan, None, out=(out_gx, out_gw))
    assert res[0] is out_gx and res[1] is out_gw
    np.testing.assert_allclose(out_gw, expected_gw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("wmode", [None, "float32", "row"])
def test_scatter_backward_and_combine_backward(routing, dtype, wmode):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    y = padded_input(r, dtype)
    grad_out = rows(r.rng, (r.T, r.H), dtype)
    w = weights_for(r, wmode, dtype)
    gy, gw = padmoe.padded_scatter_backward(
        grad_out, y, plan.indices, plan.bin_ids, w, plan.bins, plan.padded_bins, r.K
    )
    assert gy.shape == (r.P, r.H) and gy.dtype == np.dtype(dtype)
    expected_gy = ref.gather(grad_out, r.ref, w)
    if w is None:
        np.testing.assert_array_equal(gy.astype(np.float64), expected_gy)
        assert gw is None
    else:
        assert_close(gy, expected_gy, dtype)
        assert gw.dtype == w.dtype
        assert_close(gw, ref.wgrad(y, grad_out, r.ref), w.dtype)
    cy, cw = padmoe.combine_backward(grad_out, y, plan, w)
    assert cy.shape == (plan.padded_rows_bound, r.H) and not cy[r.P :].any()
    np.testing.assert_array_equal(cy[: r.P], gy)
    if w is None:
        assert cw is None
    else:
        np.testing.assert_array_equal(cw, gw)


def test_thread_count_does_not_change_results(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    y = padded_input(r, np.float32)
    w = weights_for(r, "float32", np.float32)
    a = padmoe.combine(y, plan, w, num_threads=1)
    b = padmoe.combine(y, plan, w, num_threads=2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, ref.scatter_f32(y, r.ref, w))


# ---------------------------------------------------------------------------
# Megatron family
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("alignment", [1, 8])
def test_pad_to_alignment(dtype, alignment):
    rng = np.random.default_rng(7)
    counts = np.array([5, 0, 9, 1, 16], dtype=np.int32)
    n = int(counts.sum()) + 3  # rows past sum(counts) are ignored
    h = rows(rng, (n, 10), dtype)
    padded, pmap, offsets = padmoe.pad_to_alignment(h, counts, alignment)
    exp_padded, exp_map, exp_offsets = ref.pad(h, counts, alignment)
    assert padded.dtype == np.dtype(dtype) and pmap.dtype == np.int32 and offsets.dtype == np.int32
    np.testing.assert_array_equal(padded.astype(np.float64), exp_padded)
    np.testing.assert_array_equal(pmap, exp_map)
    np.testing.assert_array_equal(offsets, exp_offsets)
    # int64 counts give the same
    p2, m2, o2 = padmoe.pad_to_alignment(h, counts.astype(np.int64), alignment)
    np.testing.assert_array_equal(p2, padded)
    # its backward: unpad without probs, exact
    back = padmoe.unpad_from_alignment(padded, pmap, n)
    expected_back = ref.unpad(padded, exp_map, n)
    np.testing.assert_array_equal(back.astype(np.float64), expected_back)
    assert (back[int(counts.sum()) :] == 0).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("pmode", [None, "float32", "row"])
def test_unpad_from_alignment(dtype, pmode):
    rng = np.random.default_rng(11)
    counts = np.array([3, 7, 0, 4], dtype=np.int32)
    n = int(counts.sum())
    _, pmap, _ = ref.pad(np.zeros((n, 1)), counts, 4)
    pmap = pmap.astype(np.int32)
    padded = rows(rng, (pmap.shape[0], 12), dtype)
    probs = None if pmode is None else rng.uniform(0.1, 1, size=n).astype(np.float32 if pmode == "float32" else dtype)
    out = padmoe.unpad_from_alignment(padded, pmap, n, probs)
    assert out.shape == (n, 12) and out.dtype == np.dtype(dtype)
    expected = ref.unpad(padded, pmap, n, probs)
    if probs is None:
        np.testing.assert_array_equal(out.astype(np.float64), expected)
    else:
        assert_close(out, expected, dtype)

    grad_out = rows(rng, (n, 12), dtype)
    gp, gpr = padmoe.unpad_from_alignment_backward(grad_out, padded, pmap, probs)
    exp_gp, exp_gpr = ref.unpad_backward(grad_out, padded, pmap, probs)
    assert gp.shape == padded.shape and gp.dtype == np.dtype(dtype)
    if probs is None:
        np.testing.assert_array_equal(gp.astype(np.float64), exp_gp)
        assert gpr is None
    else:
        assert_close(gp, exp_gp, dtype)
        assert gpr.dtype == probs.dtype and gpr.shape == (n,)
        assert_close(gpr, exp_gpr, probs.dtype)


# ---------------------------------------------------------------------------
# Output capacity: rows= and out=
# ---------------------------------------------------------------------------


def test_rows_capacity_form(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    x = rows(r.rng, (r.T, r.H), np.float32)
    w = weights_for(r, "float32", np.float32)
    exact = ref.gather(x, r.ref, w)
    assert plan.padded_rows_bound > r.P
    y = padmoe.dispatch(x, plan, w, rows=plan.padded_rows_bound)
    assert y.shape == (plan.padded_rows_bound, r.H)
    np.testing.assert_allclose(y[: r.P], exact, rtol=1e-6, atol=1e-6)
    y2 = padmoe.padded_gather(x, *sorted_args(plan), r.K, w, rows=plan.padded_rows_bound)
    np.testing.assert_array_equal(y2[: r.P], y[: r.P])
    # rows past P: zero in the outputs padmoe allocates, left as they are in an out= buffer
    assert (y[r.P :] == 0).all()
    sentinel = np.full((plan.padded_rows_bound, r.H), 777.0, dtype=np.float32)
    got = padmoe.dispatch(x, plan, w, out=sentinel)
    assert got is sentinel
    np.testing.assert_array_equal(sentinel[: r.P], y[: r.P])
    assert (sentinel[r.P :] == 777.0).all()

    grad_out = rows(r.rng, (r.T, r.H), np.float32)
    gy, gw = padmoe.combine_backward(grad_out, y, plan, w, rows=plan.padded_rows_bound)
    assert gy.shape == (plan.padded_rows_bound, r.H)
    np.testing.assert_allclose(gy[: r.P], ref.gather(grad_out, r.ref, w), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gw, ref.wgrad(y[: r.P], grad_out, r.ref), rtol=1e-5, atol=1e-5)
    sy, _ = padmoe.padded_scatter_backward(
        grad_out, y, plan.indices, plan.bin_ids, w, plan.bins, plan.padded_bins, r.K, rows=plan.padded_rows_bound
    )
    np.testing.assert_array_equal(sy[: r.P], gy[: r.P])
    # combine reads only the real rows of a capacity-sized y
    np.testing.assert_allclose(padmoe.combine(y, plan, w), ref.scatter(exact, r.ref, w), rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="rows= or out="):
        padmoe.dispatch(x, plan, rows=plan.padded_rows_bound, out=sentinel)
    with pytest.raises(ValueError, match="y"):
        padmoe.dispatch(x, plan, rows=r.P - 1)  # short output


def test_pad_rows_capacity():
    counts = np.array([3, 0, 6], dtype=np.int32)
    h = rows(np.random.default_rng(3), (9, 4), np.float32)
    exp_padded, exp_map, exp_offsets = ref.pad(h, counts, 4)
    p = exp_padded.shape[0]
    padded, pmap, offsets = padmoe.pad_to_alignment(h, counts, 4, rows=p + 5)
    assert padded.shape == (p + 5, 4) and pmap.shape == (p + 5,)
    np.testing.assert_array_equal(padded[:p], exp_padded)
    np.testing.assert_array_equal(pmap[:p], exp_map)
    assert (pmap[p:] == -1).all()
    assert (padded[p:] == 0).all()  # rows past P zero, as documented (not whatever memory held)
    np.testing.assert_array_equal(offsets, exp_offsets)
    # an out= buffer: its rows past P are left as they are
    sentinel = (np.full((p + 5, 4), 7.0, np.float32), np.full(p + 5, 9, np.int32), np.zeros(3, np.int32))
    padded, pmap, _ = padmoe.pad_to_alignment(h, counts, 4, out=sentinel)
    np.testing.assert_array_equal(padded[:p], exp_padded)
    assert (padded[p:] == 7.0).all() and (pmap[p:] == -1).all()
    # the scaled form: rows past P zero with scale 1, as padding rows
    scales = np.full((9, 1), 2.0, np.float32)
    padded, pscales, pmap, _ = padmoe.pad_to_alignment_scaled(h, counts, 4, scales, rows=p + 5)
    np.testing.assert_array_equal(padded[:p], exp_padded)
    assert (padded[p:] == 0).all() and (pscales[p:] == 1.0).all() and (pmap[p:] == -1).all()


# ---------------------------------------------------------------------------
# Layouts: strided views, read-only arrays
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_strided_row_views(routing, dtype):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    x = rows(r.rng, (r.T, r.H), dtype)
    w = weights_for(r, "float32", dtype)
    big = np.full((r.T, r.H + 7), 5.0, dtype=dtype)
    big[:, 3 : 3 + r.H] = x
    xs = big[:, 3 : 3 + r.H]  # row stride H + 7, nonzero offset
    assert not xs.flags.c_contiguous
    np.testing.assert_array_equal(padmoe.dispatch(xs, plan, w), padmoe.dispatch(x, plan, w))
    np.testing.assert_array_equal(padmoe.padded_gather(xs, *sorted_args(plan), r.K), ref.gather(x, r.ref).astype(dtype))

    y = padded_input(r, dtype, poison=False)
    ybig = np.zeros((r.P, 2 * r.H), dtype=dtype)
    ybig[:, r.H :] = y
    ys = ybig[:, r.H :]
    np.testing.assert_array_equal(padmoe.combine(ys, plan, w), padmoe.combine(y, plan, w))

    # a strided output view: only its own elements are written
    outbig = np.full((r.T, r.H + 5), 9.0, dtype=dtype)
    outv = outbig[:, : r.H]
    got = padmoe.combine(y, plan, w, out=outv)
    assert got is outv
    np.testing.assert_array_equal(outbig[:, : r.H], padmoe.combine(y, plan, w))
    assert (outbig[:, r.H :] == 9.0).all()

    counts = np.bincount(r.top.ravel(), minlength=r.E).astype(np.int32)
    hbig = np.zeros((r.A, r.H + 1), dtype=dtype)
    hbig[:, : r.H] = rows(r.rng, (r.A, r.H), dtype)
    padded, _, _ = padmoe.pad_to_alignment(hbig[:, : r.H], counts, r.m)
    np.testing.assert_array_equal(padded.astype(np.float64), ref.pad(hbig[:, : r.H], counts, r.m)[0])


def test_read_only_inputs(routing):
    r = routing
    top = r.top.copy()
    top.setflags(write=False)
    plan = padmoe.make_plan(top, r.E, r.m)
    for name in PLAN_FIELDS + ["row_sources"]:
        getattr(plan, name).setflags(write=False)
    x = rows(r.rng, (r.T, r.H), np.float32)
    w = weights_for(r, "float32", np.float32)
    x.setflags(write=False)
    w.setflags(write=False)
    y = padmoe.dispatch(x, plan, w)
    np.testing.assert_allclose(y[: r.P], ref.gather(x, r.ref, w), rtol=1e-6, atol=1e-6)
    y.setflags(write=False)
    out = padmoe.combine(y, plan, w)
    np.testing.assert_allclose(out, ref.scatter(y[: r.P], r.ref, w), rtol=1e-5, atol=1e-5)
    gy, gw = padmoe.combine_backward(out, y, plan, w)
    assert gy.flags.writeable and gw.flags.writeable
    # a read-only output is refused
    ro_out = np.empty((r.T, r.H), dtype=np.float32)
    ro_out.setflags(write=False)
    with pytest.raises(TypeError):
        padmoe.combine(y, plan, w, out=ro_out)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_bad_expert_id_names_argument_and_position(routing):
    r = routing
    top = r.top.copy()
    top[5, 1] = r.E
    with pytest.raises(ValueError) as e:
        padmoe.make_plan(top, r.E, r.m)
    msg = str(e.value)
    assert msg.startswith("make_plan: top_experts:"), msg
    assert "[5, 1]" in msg and str(r.E) in msg
    top[5, 1] = -1
    top[2, 0] = -3
    with pytest.raises(ValueError, match=r"top_experts.*\[2, 0\]"):
        padmoe.make_plan(top, r.E, r.m)


def test_wrong_dtypes_are_type_errors(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    with pytest.raises(TypeError, match="top_experts"):
        padmoe.make_plan(r.top.astype(np.float32), r.E, r.m)
    with pytest.raises(TypeError, match="x"):
        padmoe.dispatch(rows(r.rng, (r.T, r.H), np.float64), plan)  # float64: not a padmoe dtype
    with pytest.raises(TypeError, match="x"):
        padmoe.dispatch(np.zeros((r.T, r.H), dtype=np.int32), plan)
    with pytest.raises(TypeError, match="indices"):
        padmoe.padded_gather(
            rows(r.rng, (r.T, r.H), np.float32),
            plan.indices.astype(np.float32),
            plan.bin_ids,
            plan.bins,
            plan.padded_bins,
            r.K,
        )
    with pytest.raises(TypeError, match="weights"):
        padmoe.combine(padded_input(r, np.float16), plan, np.ones(r.A, dtype=np.float64))
    with pytest.raises(TypeError):
        padmoe.dispatch([[1.0, 2.0]], plan)  # not an array
    with pytest.raises(TypeError):
        padmoe.dispatch(
            rows(r.rng, (r.T, r.H), np.float32), plan, out=np.empty((r.P, r.H), dtype=np.float16)
        )  # output dtype != x's


def test_mismatched_shapes_are_value_errors(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    x = rows(r.rng, (r.T, r.H), np.float32)
    with pytest.raises(ValueError, match="x"):
        padmoe.dispatch(rows(r.rng, (r.T + 1, r.H), np.float32), plan)
    with pytest.raises(ValueError, match="weights"):
        padmoe.dispatch(x, plan, np.ones(r.A - 1, dtype=np.float32))
    y = padmoe.dispatch(x, plan)
    with pytest.raises(ValueError, match="grad"):
        padmoe.padded_scatter_wgrad(y, rows(r.rng, (r.T, r.H + 1), np.float32), *sorted_args(plan), r.K)
    with pytest.raises(ValueError, match="top_k"):
        padmoe.padded_scatter(y, plan.indices, plan.bin_ids, None, plan.bins, plan.padded_bins, 2)  # 111 % 2 != 0
    with pytest.raises(ValueError, match="out"):
        padmoe.combine(y, plan, out=np.empty((r.T - 1, r.H), dtype=np.float32))
    with pytest.raises(ValueError, match="top_experts"):
        padmoe.make_plan(r.top.ravel(), r.E, r.m)  # 1-D
    with pytest.raises(ValueError, match="alignment"):
        padmoe.make_plan(r.top, r.E, 0)


def test_corrupt_routing_is_rejected(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    x = rows(r.rng, (r.T, r.H), np.float32)
    indices = plan.indices.copy()
    indices[4] = indices[3]  # not a permutation
    with pytest.raises(ValueError, match="indices"):
        padmoe.padded_gather(x, indices, plan.bin_ids, plan.bins, plan.padded_bins, r.K)
    padded_bins = plan.padded_bins.copy()
    padded_bins[0] -= r.m  # a segment shorter than its expert's count
    with pytest.raises(ValueError, match="padded_bins"):
        padmoe.padded_gather(x, plan.indices, plan.bin_ids, plan.bins, padded_bins, r.K)
    with pytest.raises(ValueError, match="permutation_map"):
        padmoe.unpad_from_alignment(np.zeros((4, 2), np.float32), np.array([0, 0, -1, 1], np.int32), 2)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        padmoe.pad_to_alignment(np.zeros((4, 2), np.float32), np.array([2, -1, 3], np.int32), 2)


# ---------------------------------------------------------------------------
# copy
# ---------------------------------------------------------------------------


def test_copy():
    src = np.arange(24, dtype=np.float32).reshape(4, 6)
    dst = np.zeros_like(src)
    assert padmoe.copy(src, dst) is dst
    np.testing.assert_array_equal(dst, src)
    with pytest.raises((TypeError, ValueError)):
        padmoe.copy(src, np.zeros((4, 6), dtype=np.float16))
