"""padmoe.sort_chunks / unsort_chunks (the expert-parallel chunk sort) and their padmoe.torch
operator: against a numpy reference written here from the contract (ops.hpp section 5),
TransformerEngine's moe_sort_chunks_by_index semantics, autograd (gradcheck in float64 and the
reference gradient), torch.compile and named errors."""

import numpy as np
import pytest

import padmoe


def round_up(n, m):
    return (n + m - 1) // m * m


def ref_sort_chunks(received, sizes, num_ranks, alignment, sorted_index=None):
    """(padded float64, map, offsets) with plain loops."""
    received = np.asarray(received, dtype=np.float64)
    sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
    c, r = len(sizes), num_ranks
    e = c // r
    first = [sum(sizes[:i]) for i in range(c)]
    order = list(sorted_index) if sorted_index is not None else [(j % r) * e + j // r for j in range(c)]
    rows, pmap, offsets = [], [], []
    for g in range(e):
        start = len(pmap)
        for j in range(g * r, (g + 1) * r):
            ch = int(order[j])
            for i in range(sizes[ch]):
                rows.append(received[first[ch] + i])
                pmap.append(first[ch] + i)
        while len(pmap) < start + round_up(len(pmap) - start, alignment):
            rows.append(np.zeros(received.shape[1]))
            pmap.append(-1)
        offsets.append(len(pmap))
    padded = np.array(rows, dtype=np.float64).reshape(len(pmap), received.shape[1])
    return padded, np.array(pmap, dtype=np.int64), np.array(offsets, dtype=np.int64)


def te_sort_chunks(inp, sizes, sorted_index):
    """TE's definition: torch.cat of torch.split(inp, sizes) taken in sorted_index order."""
    sizes = [int(s) for s in sizes]
    chunks, start = [], 0
    for s in sizes:
        chunks.append(inp[start : start + s])
        start += s
    return np.concatenate([chunks[int(i)] for i in sorted_index], axis=0)


def ref_unsort(padded, pmap, n, probs=None):
    out = np.zeros((n, padded.shape[1]), dtype=np.float64)
    for p, src in enumerate(pmap):
        if src >= 0:
            out[src] = np.asarray(padded[p], dtype=np.float64) * (1.0 if probs is None else float(probs[src]))
    return out


def problem(seed, R, E, m, H=12, extra=3, dtype=np.float32):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 2 * m + 5, size=(R, E))
    sizes[rng.random((R, E)) < 0.25] = 0
    n = int(sizes.sum()) + extra
    received = rng.uniform(-1, 1, size=(n, H)).astype(dtype)
    return rng, sizes, received


# ---------------------------------------------------------------------------
# numpy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("R,E,m", [(8, 4, 16), (1, 5, 4), (3, 1, 4), (4, 6, 1), (16, 8, 8)])
@pytest.mark.parametrize("sdtype", [np.int32, np.int64])
@pytest.mark.parametrize("flat", [False, True])
def test_numpy_matches_reference(R, E, m, sdtype, flat):
    _, sizes, received = problem(R * 100 + E * 10 + m, R, E, m)
    s = sizes.astype(sdtype).reshape(-1) if flat else sizes.astype(sdtype)
    want_p, want_map, want_off = ref_sort_chunks(received, sizes, R, m)
    padded, pmap, offs = padmoe.sort_chunks(received, s, R, m)
    assert padded.dtype == received.dtype and pmap.dtype == np.int32 and offs.dtype == np.int32
    np.testing.assert_array_equal(padded, want_p.astype(np.float32))
    np.testing.assert_array_equal(pmap, want_map)
    np.testing.assert_array_equal(offs, want_off)
    # rows=the bound: map -1 past P, padded rows past P zero
    cap = padmoe.sort_chunks_rows_bound(received.shape[0], R * E, R, m)
    assert cap == received.shape[0] + E * (m - 1)
    p2, m2, o2 = padmoe.sort_chunks(received, s, R, m, rows=cap)
    P = want_map.shape[0]
    assert p2.shape == (cap, received.shape[1])
    np.testing.assert_array_equal(p2[:P], want_p.astype(np.float32))
    assert not p2[P:].any()
    np.testing.assert_array_equal(m2, np.concatenate([want_map, -np.ones(cap - P, dtype=np.int64)]))
    np.testing.assert_array_equal(o2, want_off)


def test_numpy_sorted_index_is_te_semantics():
    rng, sizes, received = problem(7, 4, 6, 4)
    flat = sizes.reshape(-1)
    perm = rng.permutation(flat.size)
    want = te_sort_chunks(received, flat, perm)
    for ranks in (1, 2, 4, 24):
        padded, _, offs = padmoe.sort_chunks(received, flat, ranks, 1, perm.astype(np.int64))
        np.testing.assert_array_equal(padded, want)
        np.testing.assert_array_equal(offs, np.cumsum(flat[perm]).reshape(-1, ranks)[:, -1])
    # padded, any order: the reference
    want_p, want_map, want_off = ref_sort_chunks(received, sizes, 4, 8, perm)
    padded, pmap, offs = padmoe.sort_chunks(received, sizes, 4, 8, perm.astype(np.int32))
    np.testing.assert_array_equal(padded, want_p.astype(np.float32))
    np.testing.assert_array_equal(pmap, want_map)
    np.testing.assert_array_equal(offs, want_off)
    # the default order is Megatron's sort_input_by_local_experts
    megatron = np.arange(flat.size).reshape(4, 6).T.ravel()
    a = padmoe.sort_chunks(received, sizes, 4, 4)
    b = padmoe.sort_chunks(received, sizes, 4, 4, megatron)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_numpy_unsort_round_trip_with_probs():
    rng, sizes, received = problem(3, 8, 4, 16)
    n, total = received.shape[0], int(sizes.sum())
    padded, pmap, _ = padmoe.sort_chunks(received, sizes, 8, 16)
    back = padmoe.unsort_chunks(padded, pmap, n)
    np.testing.assert_array_equal(back[:total], received[:total])
    assert not back[total:].any()
    probs = rng.uniform(0, 1, size=n).astype(np.float32)
    got = padmoe.unsort_chunks(padded, pmap, n, probs)
    np.testing.assert_allclose(got, ref_unsort(padded, pmap, n, probs), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "case,needle",
    [
        ("negative", "sort_chunks: split_sizes: entry [1, 0] is negative (-2)"),
        ("sum", "split_sizes: sums to"),
        ("ranks", "num_ranks: the 6 chunks of split_sizes are not a multiple of num_ranks = 4"),
        ("repeat", "sorted_index: must be a permutation of [0, 6): chunk 1 appears more than once"),
        ("oor", "sorted_index: position 0 holds chunk 6, outside [0, 6)"),
        ("float", "split_sizes: expected int32 or int64"),
    ],
)
def test_numpy_errors(case, needle):
    received = np.ones((10, 4), dtype=np.float32)
    sizes = np.array([[1, 2, 0], [3, 1, 1]], dtype=np.int32)
    ranks, si = 2, None
    if case == "negative":
        sizes[1, 0] = -2
    elif case == "sum":
        sizes[0, 2] = 5
    elif case == "ranks":
        sizes, ranks = sizes.reshape(-1), 4
    elif case == "repeat":
        si = np.array([0, 1, 2, 1, 4, 5], dtype=np.int64)
    elif case == "oor":
        si = np.array([6, 1, 2, 3, 4, 5], dtype=np.int64)
    elif case == "float":
        sizes = sizes.astype(np.float32)
    kind = TypeError if case == "float" else ValueError
    with pytest.raises(kind) as e:
        padmoe.sort_chunks(received, sizes, ranks, 4, si)
    assert needle in str(e.value)
    # and the _out path (out=) writes nothing
    out = (np.full((64, 4), 7.0, np.float32), np.full(64, 9, np.int32), np.full(3, 9, np.int32))
    with pytest.raises(kind):
        padmoe.sort_chunks(received, sizes, ranks, 4, si, out=out)
    assert (out[0] == 7.0).all() and (out[1] == 9).all() and (out[2] == 9).all()


# ---------------------------------------------------------------------------
# padmoe.torch
# ---------------------------------------------------------------------------

try:  # the numpy tests above run without torch
    import torch

    import padmoe.torch as pt
except ImportError:  # pragma: no cover - torch is in the dev environment
    torch = pt = None

pytestmark_torch = pytest.mark.skipif(torch is None, reason="torch / padmoe.torch not available")
DEVICES = ["cpu"]
if torch is not None and torch.cuda.is_available() and padmoe.has_cuda():
    DEVICES.append("cuda")
DTYPES = ["float32", "bfloat16", "float16"]


def torch_problem(device, dtype, R=4, E=3, m=8, H=6, seed=0, extra=2):
    rng, sizes, received = problem(seed, R, E, m, H=H, extra=extra)
    return (
        torch.tensor(received, dtype=dtype, device=device),
        torch.tensor(sizes, dtype=torch.int64, device=device),
        rng,
    )


@pytestmark_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_forward_matches_reference(device, dtype):
    dtype = getattr(torch, dtype)
    h, sizes, _ = torch_problem(device, dtype)
    want_p, want_map, want_off = ref_sort_chunks(h.float().cpu().numpy(), sizes.cpu().numpy(), 4, 8)
    padded, pmap, offs = pt.sort_chunks(h, sizes, 4, 8)
    assert padded.dtype == dtype and padded.device == h.device
    np.testing.assert_array_equal(padded.float().cpu().numpy(), want_p)
    np.testing.assert_array_equal(pmap.cpu().numpy(), want_map)
    np.testing.assert_array_equal(offs.cpu().numpy(), want_off)
    cap = padmoe.sort_chunks_rows_bound(h.shape[0], sizes.numel(), 4, 8)
    p2, m2, o2 = pt.sort_chunks(h, sizes.to(torch.int32), 4, 8, rows=cap)
    P = want_map.shape[0]
    assert p2.shape == (cap, h.shape[1])
    np.testing.assert_array_equal(p2[:P].float().cpu().numpy(), want_p)
    assert not p2[P:].any()  # static shape: rows past P zero
    assert (m2[P:] == -1).all()


@pytestmark_torch
def test_torch_float8_moves_bitwise():
    h, sizes, _ = torch_problem("cpu", torch.float32)
    h8 = h.to(torch.float8_e4m3fn)
    padded, pmap, _ = pt.sort_chunks(h8, sizes, 4, 8)
    raw = h8.view(torch.uint8).numpy()
    want = np.zeros((pmap.shape[0], h.shape[1]), np.uint8)
    m = pmap.numpy()
    want[m >= 0] = raw[m[m >= 0]]
    np.testing.assert_array_equal(padded.view(torch.uint8).numpy(), want)


@pytestmark_torch
@pytest.mark.parametrize("device", DEVICES)
def test_torch_autograd_against_reference(device):
    h, sizes, rng = torch_problem(device, torch.float32, seed=4)
    h = h.requires_grad_()
    padded, pmap, _ = pt.sort_chunks(h, sizes, 4, 8)
    g = torch.tensor(rng.uniform(-1, 1, size=tuple(padded.shape)), dtype=torch.float32, device=device)
    (padded * g).sum().backward()
    want = ref_unsort(g.cpu().numpy(), pmap.cpu().numpy(), h.shape[0])  # the unsort of the gradient
    np.testing.assert_array_equal(h.grad.cpu().numpy(), want.astype(np.float32))
    # unsort: grad of the rows is the sort's move (times probs), grad of probs the row dots
    y = padded.detach().clone().requires_grad_()
    probs = torch.tensor(rng.uniform(0, 1, size=h.shape[0]), dtype=torch.float32, device=device, requires_grad=True)
    out = pt.unsort_chunks(y, pmap, h.shape[0], probs)
    go = torch.tensor(rng.uniform(-1, 1, size=tuple(out.shape)), dtype=torch.float32, device=device)
    (out * go).sum().backward()
    m = pmap.cpu().numpy()
    want_y = np.zeros(tuple(y.shape))
    want_p = np.zeros(h.shape[0])
    for p, src in enumerate(m):
        if src >= 0:
            want_y[p] = go[src].cpu().numpy().astype(np.float64) * float(probs[src].detach())
            want_p[src] = float(np.dot(go[src].cpu().numpy().astype(np.float64), y[p].detach().cpu().numpy()))
    np.testing.assert_allclose(y.grad.cpu().numpy(), want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(probs.grad.cpu().numpy(), want_p, rtol=1e-5, atol=1e-6)


@pytestmark_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sorted_index", [False, True])
def test_torch_gradcheck_float64(device, sorted_index):
    h, sizes, rng = torch_problem(device, torch.float64, R=3, E=2, m=4, H=3, seed=9)
    si = torch.tensor(rng.permutation(6), device=device) if sorted_index else None
    h = h.requires_grad_()
    assert torch.autograd.gradcheck(lambda a: pt.sort_chunks(a, sizes, 3, 4, si)[0], (h,))
    cap = padmoe.sort_chunks_rows_bound(h.shape[0], 6, 3, 4)
    assert torch.autograd.gradcheck(lambda a: pt.sort_chunks(a, sizes, 3, 4, si, rows=cap)[0], (h,))
    padded, pmap, _ = pt.sort_chunks(h.detach(), sizes, 3, 4, si)
    y = (padded + 0.5).requires_grad_()
    probs = torch.rand(h.shape[0], dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: pt.unsort_chunks(a, pmap, h.shape[0], b), (y, probs))
    # float64 forward equals the reference exactly
    want_p, want_map, _ = ref_sort_chunks(
        h.detach().cpu().numpy(), sizes.cpu().numpy(), 3, 4, None if si is None else si.cpu().numpy()
    )
    np.testing.assert_array_equal(padded.cpu().numpy(), want_p)
    np.testing.assert_array_equal(pmap.cpu().numpy(), want_map)


@pytestmark_torch
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_static_rows(device):
    h, sizes, _ = torch_problem(device, torch.float32, seed=2)
    cap = padmoe.sort_chunks_rows_bound(h.shape[0], sizes.numel(), 4, 8)

    def step(x, s):
        padded, pmap, offs = pt.sort_chunks(x, s, 4, 8, rows=cap)
        return pt.unsort_chunks(padded * 2, pmap, x.shape[0]), offs

    torch._dynamo.reset()
    out, offs = torch.compile(step, fullgraph=True)(h, sizes)
    total = int(sizes.sum())
    torch.testing.assert_close(out[:total], h[:total] * 2, rtol=0, atol=0)
    assert not out[total:].any()
    _, _, want_off = ref_sort_chunks(h.cpu().numpy(), sizes.cpu().numpy(), 4, 8)
    np.testing.assert_array_equal(offs.cpu().numpy(), want_off)


@pytestmark_torch
def test_torch_opcheck():
    h, sizes, _ = torch_problem("cpu", torch.float32, seed=5)
    cap = padmoe.sort_chunks_rows_bound(h.shape[0], sizes.numel(), 4, 8)
    op = torch.ops.padmoe.sort_chunks.default
    torch.library.opcheck(op, (h, sizes, 4, 8, None, 2, True, cap))


@pytestmark_torch
def test_torch_errors_named():
    h = torch.ones(10, 4)
    sizes = torch.tensor([[1, 2, 0], [3, 1, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sort_chunks: split_sizes: entry \[1, 2\] is negative \(-1\)"):
        pt.sort_chunks(h, sizes, 2, 4)
    with pytest.raises(ValueError, match=r"sort_chunks: num_ranks: must be >= 1"):
        pt.sort_chunks(h, sizes.abs(), 0, 4)
    with pytest.raises(ValueError, match=r"chunk 0 appears more than once"):
        pt.sort_chunks(h, sizes.abs(), 2, 4, torch.zeros(6, dtype=torch.int64))
