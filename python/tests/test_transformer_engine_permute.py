"""padmoe.torch.transformer_engine's permute and unpermute against TransformerEngine's definitions,
written here as plain loops in float64: the mask map (with and without probs, the num_out_tokens
cut, zero-probability routing-map padding), the padded mask map (alignment 16 and 128, exact and
sync-free sizes), the index map (top-k 1-8, the cut, -1 ids, with and without num_experts), their
row_id_maps, every gradient, experts with no tokens, bf16 and float32, empty input, the plan kept
on row_id_map against the plan rebuilt from it, torch.compile, CUDA graphs, and bad input."""

import numpy as np
import pytest

import padmoe

torch = pytest.importorskip("torch")
import padmoe.torch.transformer_engine as te  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])
DTYPES = [torch.float32, torch.bfloat16]
# TE's test tolerances
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=1e-5)}


def close(got, want, dtype):
    torch.testing.assert_close(got.detach().cpu().double(), torch.as_tensor(want).double(), **TOL[dtype])


def mask_case(T, E, K, seed, empty_experts=0):
    """A routing map with K distinct experts per token, the last ``empty_experts`` never used, and
    probs normalised over the routed entries (NaN elsewhere, as TE's tests make them)."""
    rng = np.random.default_rng(seed)
    used = E - empty_experts
    routing = np.zeros((T, E), dtype=bool)
    for t in range(T):
        routing[t, rng.permutation(used)[:K]] = True
    raw = rng.random((T, E)) * routing
    with np.errstate(invalid="ignore", divide="ignore"):
        probs = raw / raw.sum(1, keepdims=True)
    probs[~routing] = np.nan
    return routing, probs


# --- references from TE's definitions -------------------------------------------------------


def ref_mask_dest(routing, n_out):
    """dst[t, e]: expert-major, tokens in order; destinations at or past n_out dropped (-1)."""
    T, E = routing.shape
    dst = -np.ones((T, E), dtype=np.int64)
    r = 0
    for e in range(E):
        for t in range(T):
            if routing[t, e]:
                dst[t, e] = r if r < n_out else -1
                r += 1
    return dst


def ref_mask_row_id_map(dst):
    T, E = dst.shape
    out = -np.ones((T, 2 * E + 1), dtype=np.int64)
    for t in range(T):
        pairs = sorted(((dst[t, e], e) for e in range(E) if dst[t, e] >= 0), reverse=True)
        for i, (d, e) in enumerate(pairs):
            out[t, i], out[t, E + i] = d, e
        out[t, 2 * E] = len(pairs)
    return out


def ref_index_dest(index, n_out):
    """dest[t, k]: the stable sort of the flat ids read as uint32; positions at or past n_out -1."""
    T, K = index.shape
    keys = [(int(v) & 0xFFFFFFFF, a) for a, v in enumerate(index.reshape(-1))]
    dest = -np.ones(T * K, dtype=np.int64)
    for j, (_, a) in enumerate(sorted(keys)):
        dest[a] = j if j < n_out else -1
    return dest.reshape(T, K)


def ref_permute(x, dst, rows, probs=None):
    """out[rows, H] (rows no one fills zero) and probs moved with them; a prob of 0 zeroes its row."""
    out = np.zeros((rows, x.shape[1]))
    moved = np.zeros(rows)
    for t, e in zip(*np.nonzero(dst >= 0)):
        d = dst[t, e]
        p = None if probs is None else probs[t, e]
        out[d] = 0.0 if p == 0.0 else x[t]
        if probs is not None:
            moved[d] = p
    return out, moved


def ref_gather_grad(g, dst, rows_of_g):
    """The permute's input gradient: each token sums its rows' gradients."""
    gx = np.zeros((dst.shape[0], g.shape[1]))
    for t, e in zip(*np.nonzero(dst >= 0)):
        gx[t] += g[dst[t, e]]
    return gx


def ref_unpermute(y, dst, w, g):
    """out[t] = sum w * y[dst]; grad_y[dst] = w * g[t] (rows no one reads zero); grad_w = <y[dst], g[t]>."""
    T = dst.shape[0]
    out = np.zeros((T, y.shape[1]))
    gy = np.zeros_like(y)
    gw = np.zeros(dst.shape)
    for t, e in zip(*np.nonzero(dst >= 0)):
        d = dst[t, e]
        wt = 1.0 if w is None else w[t, e]
        out[t] += wt * y[d]
        gy[d] = wt * g[t]
        gw[t, e] = y[d] @ g[t]
    return out, gy, gw


def tensors(device, dtype, *arrays, grad=False):
    return [torch.tensor(a).to(device=device, dtype=dtype).requires_grad_(grad) for a in arrays]


# --- mask map ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, E, K, cut, empty",
    [(96, 7, 2, 0, 0), (64, 16, 5, 0, 3), (80, 8, 1, 0, 0), (40, 8, 8, 0, 0), (96, 7, 2, 120, 2), (64, 16, 5, 17, 0)],
)
def test_mask_permute_unpermute(device, dtype, T, E, K, cut, empty):
    H = 24
    routing, probs = mask_case(T, E, K, T * E + K, empty)
    n_out = cut or int(routing.sum())
    rng = np.random.default_rng(1)
    xa = rng.standard_normal((T, H))
    x = torch.tensor(xa).to(device=device, dtype=dtype).requires_grad_(True)
    xr = x.detach().cpu().double().numpy()
    rmap = torch.tensor(routing, device=device)
    out, row_id_map = te.moe_permute(x, rmap, n_out)
    dst = ref_mask_dest(routing, n_out)
    want, _ = ref_permute(xr, dst, n_out)
    assert out.shape == (n_out, H) and out.dtype == dtype
    assert torch.equal(out.detach().cpu().double(), torch.tensor(want))
    assert row_id_map.dtype == torch.int32 and torch.equal(
        row_id_map.cpu().long(), torch.tensor(ref_mask_row_id_map(dst))
    )
    # permute backward
    g = torch.tensor(rng.standard_normal((n_out, H))).to(device=device, dtype=dtype)
    out.backward(g)
    close(x.grad, ref_gather_grad(g.cpu().double().numpy(), dst, n_out), dtype)
    # unpermute with merging probs (NaN where not routed: never read), forward and backward
    y = torch.tensor(rng.standard_normal((n_out, H))).to(device=device, dtype=dtype).requires_grad_(True)
    p = torch.tensor(probs).to(device=device, dtype=dtype).requires_grad_(True)
    res = te.moe_unpermute(y, row_id_map, merging_probs=p, restore_shape=(T, H))
    go = torch.tensor(rng.standard_normal((T, H))).to(device=device, dtype=dtype)
    res.backward(go)
    pr = np.where(routing, p.detach().cpu().double().numpy(), 0.0)
    w_out, w_gy, w_gw = ref_unpermute(y.detach().cpu().double().numpy(), dst, pr, go.cpu().double().numpy())
    assert res.shape == (T, H) and res.dtype == dtype
    close(res, w_out, dtype)
    close(y.grad, w_gy, dtype)
    assert p.grad.dtype == dtype and not torch.isnan(p.grad).any()
    close(p.grad, w_gw, dtype)
    # without probs: the plain sum; the plan rebuilt from row_id_map gives the same bits
    plain = te.moe_unpermute(y.detach(), row_id_map, restore_shape=(T, H))
    close(plain, ref_unpermute(y.detach().cpu().double().numpy(), dst, None, go.cpu().double().numpy())[0], dtype)
    rebuilt = te.moe_unpermute(y.detach(), row_id_map.clone(), restore_shape=(T, H))
    assert torch.equal(rebuilt, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_permute_with_probs(device, dtype):
    T, E, K, H = 90, 8, 3, 16
    routing, probs = mask_case(T, E, K, 5, 1)
    probs[routing & (np.arange(T)[:, None] % 7 == 0)] = 0.0  # routing-map padding: routed, probability 0
    n_out = int(routing.sum())
    rng = np.random.default_rng(2)
    (x,) = tensors(device, dtype, rng.standard_normal((T, H)), grad=True)
    (p,) = tensors(device, dtype, probs, grad=True)
    out, moved, row_id_map = te.moe_permute_with_probs(x, p, torch.tensor(routing, device=device), n_out)
    dst = ref_mask_dest(routing, n_out)
    want, want_p = ref_permute(x.detach().cpu().double().numpy(), dst, n_out, p.detach().cpu().double().numpy())
    assert torch.equal(out.detach().cpu().double(), torch.tensor(want))
    assert moved.dtype == dtype and torch.equal(moved.detach().cpu().double(), torch.tensor(want_p))
    assert torch.equal(row_id_map.cpu().long(), torch.tensor(ref_mask_row_id_map(dst)))
    g, gp = tensors(device, dtype, rng.standard_normal((n_out, H)), rng.standard_normal(n_out))
    torch.autograd.backward((out, moved), (g, gp))
    # TE: a zeroed row still passes its gradient to the input
    close(x.grad, ref_gather_grad(g.cpu().double().numpy(), dst, n_out), dtype)
    want_gp = np.zeros((T, E))
    for t, e in zip(*np.nonzero(dst >= 0)):
        want_gp[t, e] = gp.cpu().double().numpy()[dst[t, e]]
    assert p.grad.dtype == dtype and torch.equal(p.grad.cpu().double(), torch.tensor(want_gp))


# --- padded mask map -----------------------------------------------------------------------------


def ref_padded(routing, tokens_per_expert, align):
    counts = np.asarray(tokens_per_expert, dtype=np.int64)
    target = -(-counts // align) * align
    pads = target - counts
    offsets = np.concatenate([[0], np.cumsum(pads)[:-1]])
    dst = ref_mask_dest(routing, routing.size)
    padded = dst.copy()
    for t, e in zip(*np.nonzero(dst >= 0)):
        padded[t, e] += offsets[e]
    return dst, padded, offsets, target


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, E, K, align, static",
    [(96, 8, 2, 16, False), (64, 16, 5, 16, True), (40, 4, 1, 128, False), (48, 4, 4, 4, True), (64, 4, 2, 1, False)],
)
def test_permute_and_pad(device, dtype, T, E, K, align, static):
    H = 16
    routing, probs = mask_case(T, E, K, T + E + align, 1 if E > 4 else 0)
    probs[routing & (np.arange(T)[:, None] % 5 == 0)] = 0.0
    rng = np.random.default_rng(3)
    (x,) = tensors(device, dtype, rng.standard_normal((T, H)), grad=True)
    (p,) = tensors(device, dtype, probs, grad=True)
    rmap = torch.tensor(routing, device=device)
    tpe = torch.tensor(routing.sum(0), device=device)
    dst, padded, offsets, target = ref_padded(routing, routing.sum(0), align)
    P = int(target.sum())
    kw = dict(out_rows=T * K + E * (align - 1), check=True) if static else {}
    out, moved, row_id_map, pad_offsets, tgt = te.moe_permute_and_pad_with_probs(x, p, rmap, tpe, align, **kw)
    rows = kw["out_rows"] if static else P
    want, want_p = ref_permute(x.detach().cpu().double().numpy(), padded, rows, p.detach().cpu().double().numpy())
    assert out.shape == (rows, H) and torch.equal(out.detach().cpu().double(), torch.tensor(want))
    assert torch.equal(moved.detach().cpu().double(), torch.tensor(want_p))
    assert tgt.dtype == torch.int64 and tgt.tolist() == target.tolist()
    if not static and not (target != routing.sum(0)).any():
        assert pad_offsets is None
    else:
        assert pad_offsets.dtype == torch.int64 and pad_offsets.tolist() == offsets.tolist()
    assert torch.equal(row_id_map.cpu().long(), torch.tensor(ref_mask_row_id_map(dst)))  # TE's unpadded rows
    # unpermute with pad_offsets: back to [T, H]; the kept plan and the rebuilt one agree
    y = out.detach().clone().requires_grad_(True)
    pm = p.detach().clone().requires_grad_(True)
    res = te.moe_unpermute(y, row_id_map, merging_probs=pm, restore_shape=(T, H), pad_offsets=pad_offsets)
    (go,) = tensors(device, dtype, rng.standard_normal((T, H)))
    res.backward(go)
    pr = np.where(routing, pm.detach().cpu().double().numpy(), 0.0)
    w_out, w_gy, w_gw = ref_unpermute(y.detach().cpu().double().numpy(), padded, pr, go.cpu().double().numpy())
    close(res, w_out, dtype)
    close(y.grad, w_gy, dtype)  # padding rows: zero gradient
    close(pm.grad, w_gw, dtype)
    again = te.moe_unpermute(
        y.detach(), row_id_map.clone(), merging_probs=pm.detach(), restore_shape=(T, H), pad_offsets=pad_offsets
    )
    assert torch.equal(again, res.detach())
    # permute backward through the padding
    g, gp = tensors(device, dtype, rng.standard_normal((rows, H)), rng.standard_normal(rows))
    torch.autograd.backward((out, moved), (g, gp))
    close(x.grad, ref_gather_grad(g.cpu().double().numpy(), padded, rows), dtype)
    want_gp = np.zeros((T, E))
    for t, e in zip(*np.nonzero(padded >= 0)):
        want_gp[t, e] = gp.cpu().double().numpy()[padded[t, e]]
    assert torch.equal(p.grad.cpu().double(), torch.tensor(want_gp))


# --- index map ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, E, K, cut, minus",
    [
        (96, 7, 2, 0, 0),
        (64, 16, 5, 0, 0),
        (80, 8, 1, 0, 0),
        (40, 8, 8, 0, 0),
        (96, 7, 2, 77, 0),
        (64, 16, 5, 150, 9),
        (50, 4, 3, 0, 7),
    ],
)
def test_index_permute_unpermute(device, dtype, T, E, K, cut, minus):
    H = 24
    rng = np.random.default_rng(T * K + cut)
    index = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    if minus:  # expert-parallel masking: -1 ids sort last and are permuted too
        index.reshape(-1)[rng.permutation(T * K)[:minus]] = -1
    n_out = cut or T * K
    (x,) = tensors(device, dtype, rng.standard_normal((T, H)), grad=True)
    idx = torch.tensor(index, device=device)
    out, row_id_map = te.moe_permute(x, idx, cut, map_type="index")
    dest = ref_index_dest(index, n_out)
    xr = x.detach().cpu().double().numpy()
    want = np.zeros((n_out, H))
    for t, k in zip(*np.nonzero(dest >= 0)):
        want[dest[t, k]] = xr[t]
    assert out.shape == (n_out, H) and torch.equal(out.detach().cpu().double(), torch.tensor(want))
    assert row_id_map.shape == (T * K,) and row_id_map.dtype == torch.int32
    assert torch.equal(row_id_map.cpu().long(), torch.tensor(dest.T.reshape(-1)))  # k-major
    fast, fast_map = te.moe_permute(x.detach(), idx, cut, map_type="index", num_experts=E)
    assert torch.equal(fast, out.detach()) and torch.equal(fast_map, row_id_map)
    (g,) = tensors(device, dtype, rng.standard_normal((n_out, H)))
    out.backward(g)
    close(x.grad, ref_gather_grad(g.cpu().double().numpy(), dest, n_out), dtype)
    # unpermute with float32 merging probs [T, K]
    (y,) = tensors(device, dtype, rng.standard_normal((n_out, H)), grad=True)
    (p,) = tensors(device, torch.float32, rng.random((T, K)), grad=True)
    res = te.moe_unpermute(y, row_id_map, merging_probs=p, map_type="index")
    (go,) = tensors(device, dtype, rng.standard_normal((T, H)))
    res.backward(go)
    w_out, w_gy, w_gw = ref_unpermute(
        y.detach().cpu().double().numpy(), dest, p.detach().cpu().double().numpy(), go.cpu().double().numpy()
    )
    close(res, w_out, dtype)
    close(y.grad, w_gy, dtype)
    assert p.grad.dtype == torch.float32
    close(p.grad, w_gw, dtype)
    rebuilt = te.moe_unpermute(y.detach(), row_id_map.clone(), merging_probs=p.detach(), map_type="index")
    assert torch.equal(rebuilt, res.detach())
    # without probs: one row per map entry, k-major, no sum (TE's behaviour)
    each = te.moe_unpermute(y.detach(), row_id_map, map_type="index")
    yr = y.detach().cpu().double().numpy()
    want_each = np.zeros((T * K, H))
    for i, r in enumerate(dest.T.reshape(-1)):
        if r >= 0:
            want_each[i] = yr[r]
    assert torch.equal(each.cpu().double(), torch.tensor(want_each))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T,E,align,one_bin,cut",
    [
        (37, 8, 1, True, 1.0),
        (37, 8, 1, True, 0.5),
        (300, 40, 16, False, 1.0),
        (65, 256, 128, False, 0.9),
        (0, 4, 4, False, 1.0),
        (17000, 4, 1, True, 0.9),  # CUDA: more tiles than the grid's blocks, several a block
    ],
)
def test_mask_plan_operator(device, T, E, align, one_bin, cut):
    """torch.ops.padmoe.mask_plan, the native plan of the mask forms, against the loops: the packed
    plan's indices / bin_ids (the kept pairs expert-major, then -1), counts, dest_rows and
    row_sources, TE's row_id_map (its rows unpadded); int32 and uint8 maps read as bool; the fake
    kernel agrees (opcheck)."""
    rng = np.random.default_rng(T * E + align)
    routing = rng.random((T, E)) < 0.2
    n = routing.sum(0)
    padded = -(-n // align) * align
    rows = int((n.sum() if one_bin else padded.sum()) * cut)
    pstart = np.concatenate([[0], np.cumsum(padded)[:-1]])
    ustart = np.concatenate([[0], np.cumsum(n)[:-1]])
    dst = -np.ones((T, E), dtype=np.int64)
    for e in range(E):
        ts = np.nonzero(routing[:, e])[0]
        for i, t in enumerate(ts):
            d = pstart[e] + i
            dst[t, e] = d if d < rows else -1
    bins = 1 if one_bin else E
    cap = rows if one_bin else -(-rows // E)
    src = -np.ones(bins * cap, dtype=np.int64)
    for t, e in zip(*np.nonzero(dst >= 0)):
        if dst[t, e] < src.size:
            src[dst[t, e]] = t * E + e
    kept = min(int(n.sum()), rows)
    pairs = sorted((e, t) for t, e in zip(*np.nonzero(dst >= 0)))  # the kept pairs, expert-major
    indices = [int(t) * E + int(e) for e, t in pairs] + [-1] * (T * E - len(pairs))
    bin_ids = [int(e) for e, _ in pairs] + [-1] * (T * E - len(pairs))
    counts = [kept, kept, rows, rows] if one_bin else [*n, *np.cumsum(n), *padded, *np.cumsum(padded)]
    want_map = ref_mask_row_id_map(np.where(dst >= 0, dst - (pstart - ustart)[None, :], -1))
    a = T * E
    for m in (torch.tensor(routing), torch.tensor(routing.astype(np.int32)), torch.tensor(routing.astype(np.uint8))):
        m = m.to(device)
        packed, row_id_map, no_probs, no_nonzero = torch.ops.padmoe.mask_plan(m, rows, align, one_bin, True)
        assert no_probs.numel() == 0 and no_nonzero.numel() == 0
        got = packed.cpu().long().numpy()
        assert got.size == 3 * a + 4 * bins + bins * cap
        assert got[:a].tolist() == indices and got[a : 2 * a].tolist() == bin_ids
        assert got[2 * a : 2 * a + 4 * bins].tolist() == [int(v) for v in counts]
        assert (got[2 * a + 4 * bins : 3 * a + 4 * bins] == dst.reshape(-1)).all()
        assert (got[3 * a + 4 * bins :] == src).all()
        assert (row_id_map.cpu().long().numpy() == want_map).all()
    torch.library.opcheck(
        torch.ops.padmoe.mask_plan.default,
        (m, rows, align, one_bin, True),
        test_utils=("test_schema", "test_faketensor"),
    )
    _, none, _, _ = torch.ops.padmoe.mask_plan(m, rows, align, one_bin, False)
    assert none.shape == (0, 0)
    # probs moved with the rows: row r gets the probability of the pair in it (bit for bit), 0 in
    # the rows without one; unrouted probs (NaN here) are never read. probs_nonzero: 1.0 where the
    # pair has a row and a nonzero prob (+-0 in some routed pairs, a NaN in one: nonzero), else 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        probs = torch.rand(T, E, generator=torch.Generator().manual_seed(5)).to(dtype)
        probs[torch.rand(T, E, generator=torch.Generator().manual_seed(6)) < 0.3] = 0.0
        probs[torch.rand(T, E, generator=torch.Generator().manual_seed(7)) < 0.1] = -0.0
        probs[~torch.tensor(routing)] = float("nan")
        live = np.nonzero(dst.reshape(-1) >= 0)[0]
        if live.size:
            probs.view(-1)[int(live[0])] = float("nan")
        _, _, moved, nonzero = torch.ops.padmoe.mask_plan(m, rows, align, one_bin, True, probs.to(device), True)
        flat = probs.reshape(-1)
        want = torch.where(torch.tensor(src) >= 0, flat[torch.tensor(src).clamp(min=0)], torch.zeros((), dtype=dtype))
        assert moved.dtype == dtype and torch.equal(moved.cpu().view(torch.uint8), want.view(torch.uint8))
        want_nz = ((dst.reshape(-1) >= 0) & (flat.float().numpy() != 0.0)).astype(np.float32)
        assert nonzero.dtype == torch.float32 and (nonzero.cpu().numpy() == want_nz).all()
        _, _, _, none_nz = torch.ops.padmoe.mask_plan(m, rows, align, one_bin, True, probs.to(device))
        assert none_nz.numel() == 0
    for nz in (False, True):
        torch.library.opcheck(
            torch.ops.padmoe.mask_plan.default,
            (m, rows, align, one_bin, True, probs.to(device), nz),
            test_utils=("test_schema", "test_faketensor"),
        )
    with pytest.raises(ValueError, match="mask_plan: probs_nonzero: needs probs"):
        torch.ops.padmoe.mask_plan(m, rows, align, one_bin, True, None, True)
    with pytest.raises(ValueError, match="mask_plan: probs: expected"):
        torch.ops.padmoe.mask_plan(m, rows, align, one_bin, True, probs[:, :1].to(device))
    with pytest.raises(TypeError, match="mask_plan: routing_map: expected a bool or integer tensor"):
        torch.ops.padmoe.mask_plan(m.float(), rows, align, one_bin, True)
    with pytest.raises(ValueError, match="mask_plan: alignment: one_bin needs alignment 1"):
        torch.ops.padmoe.mask_plan(m, rows, 2, True, True)


def test_index_probs_dtype_warns_and_grad_dtype():
    T, E, K, H = 16, 4, 2, 8
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    y = torch.randn(T * K, H)
    _, row_id_map = te.moe_permute(torch.randn(T, H), idx, 0, map_type="index")
    p = torch.rand(T, K, dtype=torch.bfloat16, requires_grad=True)
    with pytest.warns(UserWarning, match="float32"):
        out = te.moe_unpermute(y, row_id_map, merging_probs=p, map_type="index")
    out.sum().backward()
    assert p.grad.dtype == torch.bfloat16


# --- sizes at the edges, modes, bad input ---------------------------------------------------------


def test_empty_input():
    x = torch.empty(0, 8, requires_grad=True)
    rmap = torch.zeros(0, 4, dtype=torch.bool)
    out, row_id_map = te.moe_permute(x, rmap, 0)
    assert out.shape == (0, 8) and row_id_map.dtype == torch.float32 and row_id_map.numel() == 0
    probs = torch.empty(0, 4, requires_grad=True)
    out, moved, row_id_map = te.moe_permute_with_probs(x, probs, rmap, 0)
    assert moved.dtype == torch.float32 and moved.numel() == 0
    # as in TE, the gradients are tensors: the input's passed through, probs' zero
    torch.autograd.backward((out, moved), (torch.empty(0, 8), torch.empty(0)))
    assert x.grad.shape == (0, 8) and probs.grad.shape == (0, 4)
    merging = torch.empty(0, 4, requires_grad=True)
    back = te.moe_unpermute(out.detach(), row_id_map, merging_probs=merging)
    assert back.shape == (0, 8)
    back.backward(torch.empty(0, 8))
    assert merging.grad.shape == (0, 4)


def test_deprecated_probs_keyword():
    routing, probs = mask_case(12, 4, 2, 0)
    out, row_id_map = te.moe_permute(torch.randn(12, 8), torch.tensor(routing), 24)
    p = torch.tensor(probs, dtype=torch.float32)
    with pytest.warns(DeprecationWarning):
        a = te.moe_unpermute(out, row_id_map, probs=p, restore_shape=(12, 8))
    assert torch.equal(a, te.moe_unpermute(out, row_id_map, merging_probs=p, restore_shape=(12, 8)))
    with pytest.raises(ValueError, match="probs is deprecated"):
        te.moe_unpermute(out, row_id_map, merging_probs=p, probs=p)


def test_bad_input_names_the_argument():
    x = torch.randn(6, 8)
    rmap = torch.ones(6, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="num_out_tokens"):
        te.moe_permute(x, rmap, -1)
    with pytest.raises(ValueError, match="map_type"):
        te.moe_permute(x, rmap, 18, map_type="dense")
    with pytest.raises(ValueError, match="routing_map: expected \\[6, E\\]"):
        te.moe_permute(x, rmap[:5], 15)
    with pytest.raises(ValueError, match="num_out_tokens"):
        te.moe_permute(x, torch.zeros(6, 2, dtype=torch.int32), -1, map_type="index")
    with pytest.raises(ValueError, match=r"index: entry \[2, 1\] is 9"):
        te.moe_permute(x, torch.tensor([[0, 1]] * 2 + [[0, 9]] + [[0, 1]] * 3), 0, map_type="index", num_experts=4)
    with pytest.raises(ValueError, match="tokens_per_expert: expert 1 has 5"):
        te.moe_permute_and_pad_with_probs(x, torch.rand(6, 3), rmap, torch.tensor([6, 5, 6]), 4)
    with pytest.raises(ValueError, match="out_rows: 20 rows cannot hold the padded total 24"):
        te.moe_permute_and_pad_with_probs(x, torch.rand(6, 3), rmap, torch.tensor([6, 6, 6]), 4, out_rows=20)
    with pytest.raises(ValueError, match="align_size"):
        te.moe_permute_and_pad_with_probs(x, torch.rand(6, 3), rmap, torch.tensor([6, 6, 6]), 0)
    with pytest.raises(ValueError, match="probs: expected shape"):
        te.moe_permute_with_probs(x, torch.rand(6, 2), rmap, 18)
    out, row_id_map = te.moe_permute(x, rmap, 18)
    with pytest.raises(ValueError, match="restore_shape"):
        te.moe_unpermute(out, row_id_map)  # restore_shape defaults to inp's shape, 18 rows: not T


def test_num_experts_path_sorts_minus_one_last():
    idx = torch.tensor([[2, -1], [-1, 0], [1, 2]], dtype=torch.int32)
    x = torch.arange(3.0).repeat_interleave(4).view(3, 4)
    a, ma = te.moe_permute(x, idx, 0, map_type="index")
    b, mb = te.moe_permute(x, idx, 0, map_type="index", num_experts=3)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    assert a[:, 0].tolist() == [1.0, 2.0, 0.0, 2.0, 0.0, 1.0]  # experts 0, 1, 2, 2, then the -1s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16])
@pytest.mark.parametrize("num_experts", [None, 2])
def test_index_map_of_any_integer_dtype(device, dtype, num_experts):
    """TE casts an index map of any dtype to int32: a bool, (u)int8 or int16 map permutes as its int32
    values do (rows, row_id_map, and the unpermute back), expert ids written out by hand."""
    ids = [[1, 0], [0, 1], [1, 1], [0, 0], [1, 0]]
    x = torch.arange(5.0, device=device).repeat_interleave(3).view(5, 3)
    idx = torch.tensor(ids, dtype=dtype, device=device)
    y, row_id_map = te.moe_permute(x, idx, 0, map_type="index", num_experts=num_experts)
    # stable by id: the (t, k) with id 0 in order, then those with id 1
    order = [(t, k) for want in (0, 1) for t in range(5) for k in range(2) if ids[t][k] == want]
    assert y[:, 0].tolist() == [float(t) for t, _ in order]
    want_map = [0] * 10
    for row, (t, k) in enumerate(order):
        want_map[k * 5 + t] = row
    assert row_id_map.tolist() == want_map
    back = te.moe_unpermute(y, row_id_map, torch.full((5, 2), 0.5, device=device), map_type="index")
    assert torch.equal(back, x)


@pytest.mark.parametrize("form", ["mask", "index"])
def test_torch_compile(form):
    T, E, K, H = 32, 6, 2, 8
    routing, probs = mask_case(T, E, K, 11)
    idx = torch.tensor(np.argsort(~routing, axis=1, kind="stable")[:, :K].astype(np.int32))
    rmap = torch.tensor(routing)
    p = torch.tensor(np.nan_to_num(probs), dtype=torch.float32) if form == "mask" else torch.rand(T, K)

    def step(x, p):
        if form == "mask":
            y, m = te.moe_permute(x, rmap, T * K)
            return te.moe_unpermute(y * 2, m, merging_probs=p, restore_shape=x.shape)
        y, m = te.moe_permute(x, idx, 0, map_type="index", num_experts=E)
        return te.moe_unpermute(y * 2, m, merging_probs=p, map_type="index")

    x = torch.randn(T, H, requires_grad=True)
    eager = step(x, p)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, p)
    assert torch.equal(eager, compiled)
    (gx,) = torch.autograd.grad(compiled.sum(), x)
    (gx_eager,) = torch.autograd.grad(eager.sum(), x)
    assert torch.equal(gx, gx_eager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_probs_gradient(device, backend):
    """The moved probs' gradient under torch.compile (TE's permute-with-probs, chunk sort, unpermute
    chain), against the plain-loop gradient: probs.grad[t, e] = c[dst[t, e]] for the loss sum(moved
    * c), 0 where (t, e) has no row."""
    T, E, K, H = 40, 5, 2, 4
    n_out = T * K - 7  # some routed slots dropped
    routing, probs = mask_case(T, E, K, 21)
    dst = ref_mask_dest(routing, n_out)
    rmap = torch.tensor(routing, device=device)
    p0 = torch.tensor(np.nan_to_num(probs), dtype=torch.float32, device=device)
    c = np.arange(1.0, n_out + 1.0) / n_out
    ct = torch.tensor(c, dtype=torch.float32, device=device)
    sizes = torch.tensor([n_out - 30, 30], device=device)
    order = torch.tensor([1, 0], device=device)  # its own inverse: sorting by it again restores the rows

    def step(x, p):
        y, moved, m = te.moe_permute_with_probs(x, p, rmap, n_out)
        y, moved = te.moe_sort_chunks_by_index_with_probs(y, moved, sizes, order)
        y = te.moe_sort_chunks_by_index(y, sizes[order], order)
        moved = te.moe_sort_chunks_by_index(moved.unsqueeze(1), sizes[order], order)
        return te.moe_unpermute(y, m, restore_shape=x.shape).sum() + (moved.squeeze(1) * ct).sum()

    want = np.zeros((T, E))
    for t in range(T):
        for e in range(E):
            if dst[t, e] >= 0:
                want[t, e] = c[dst[t, e]]
    x = torch.randn(T, H, device=device, requires_grad=True)
    p = p0.clone().requires_grad_(True)
    torch.compile(step, fullgraph=True, backend=backend)(x, p).backward()
    close(p.grad, want, torch.float32)
    close(x.grad, np.asarray(routing & (dst >= 0)).sum(1, keepdims=True).repeat(H, 1), torch.float32)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs CUDA")
def test_cuda_graph_capture():
    T, E, K, H = 256, 16, 4, 64
    routing, probs = mask_case(T, E, K, 3)
    rmap = torch.tensor(routing, device="cuda")
    p = torch.tensor(np.nan_to_num(probs), dtype=torch.float32, device="cuda")
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int().cuda()
    pk = torch.rand(T, K, device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        y, m = te.moe_permute(x, rmap, T * K)
        a = te.moe_unpermute(y, m, merging_probs=p, restore_shape=x.shape)
        y2, m2 = te.moe_permute(x, idx, 0, map_type="index", num_experts=E, check=False)
        b = te.moe_unpermute(y2, m2, merging_probs=pk, map_type="index")
        y3, _, m3, off, _ = te.moe_permute_and_pad_with_probs(
            x, p, rmap, rmap.sum(0), 16, out_rows=T * K + E * 15, check=False
        )
        c = te.moe_unpermute(y3, m3, merging_probs=p, restore_shape=x.shape, pad_offsets=off)
        return a, b, c, y2, m2  # the index row_id_map: a branch of the graph beside the rows

    want = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("static", [False, True])
def test_permute_and_pad_rows_not_a_multiple_of_experts(device, static):
    """Output rows that E does not divide (the exact P = 144 at E = 5, P + 7): values, the outputs
    modified in place, and the gradients through them."""
    T, E, K, H, align = 50, 5, 2, 8, 16
    dtype = torch.float32
    routing, probs = mask_case(T, E, K, 13)
    rng = np.random.default_rng(4)
    (x,) = tensors(device, dtype, rng.standard_normal((T, H)), grad=True)
    (p,) = tensors(device, dtype, probs, grad=True)
    rmap = torch.tensor(routing, device=device)
    _, padded, _, target = ref_padded(routing, routing.sum(0), align)
    P = int(target.sum())
    rows = P + 7 if static else P
    kw = dict(out_rows=rows, check=True) if static else {}
    out, moved, _, _, _ = te.moe_permute_and_pad_with_probs(x, p, rmap, rmap.sum(0), align, **kw)
    assert rows % E != 0 and out.shape == (rows, H) and moved.shape == (rows,)
    want, want_p = ref_permute(x.detach().cpu().double().numpy(), padded, rows, p.detach().cpu().double().numpy())
    assert torch.equal(out.detach().cpu().double(), torch.tensor(want))
    assert torch.equal(moved.detach().cpu().double(), torch.tensor(want_p))
    out.mul_(2.0)
    moved.mul_(3.0)
    g, gp = tensors(device, dtype, rng.standard_normal((rows, H)), rng.standard_normal(rows))
    torch.autograd.backward((out, moved), (g, gp))
    close(x.grad, ref_gather_grad(2.0 * g.cpu().double().numpy(), padded, rows), dtype)
    want_gp = np.zeros((T, E))
    for t, e in zip(*np.nonzero(padded >= 0)):
        want_gp[t, e] = 3.0 * gp.cpu().double().numpy()[padded[t, e]]
    close(p.grad, want_gp, dtype)
