"""padmoe.triton (the seed's Triton-Ascend design) in Triton's interpreter on the CPU, against the
plain-loop reference: moves exact, sums within float32 accumulation. The seed's verification list:
experts with zero tokens, counts on and one over the multiple, several experts in one sub-block,
top_k 1/2/4/8, weighted and unweighted scatter, hidden-size tails, a larger routed batch; with the
ascend-a2 tile configuration and with small ones that force many programs, sub-block steps and
column tails."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import padmoe  # noqa: E402
import padmoe.eager as pe  # noqa: E402

ptr = pytest.importorskip("padmoe.triton")
if not ptr._interpreting():
    pytest.skip("these cases run padmoe.triton on CPU tensors, in Triton's interpreter: TRITON_INTERPRET=1 before "
                "triton is imported (scripts/pytest.sh runs this file so, in a process of its own)",
                allow_module_level=True)

SMALL = dict(programs=3, sub_block_rows=2, block_x=16, buffer_bytes=0, buffers=1)


def routing(T, K, E, m, seed, counts=None):
    g = torch.Generator().manual_seed(seed)
    if counts is None:
        top = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    else:  # exact per-expert counts (K = 1)
        top = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])[torch.randperm(sum(counts), generator=g)]
        top = top.reshape(-1, 1)
    return top.to(torch.int32), pe.make_plan(top.to(torch.int32), E, m)


def ref_gather(x, p, w):
    """y[row(i)] = x[indices[i] // K] (* w[indices[i]]), padding rows zero: plain loops in float64."""
    P = int(p.padded_bins[-1])
    y = np.zeros((P, x.shape[1]))
    bins, pb = p.bins.tolist(), p.padded_bins.tolist()
    for i, (a, e) in enumerate(zip(p.indices.tolist(), p.bin_ids.tolist())):
        row = (pb[e - 1] if e else 0) + i - (bins[e - 1] if e else 0)
        y[row] = x[a // p.top_k].double().numpy() * (1.0 if w is None else float(w[a]))
    return y


CASES = [  # (T, K, E, m, H, counts)
    (7, 1, 4, 4, 1, [0, 4, 5, 0][:4]),   # zero-token experts, a count on and one over the multiple, H = 1
    (9, 1, 3, 4, 3, [4, 5, 0]),
    (13, 2, 5, 4, 33, None),              # several experts inside one sub-block, a column tail
    (11, 4, 8, 8, 17, None),
    (6, 8, 8, 2, 64, None),
    (5, 2, 4, 4, 4097, None),             # the seed's 4097 tail: one full tile and one column
]


def _counts_T(case):
    T, K, E, m, H, counts = case
    return (sum(counts), K, E, m, H, counts) if counts is not None else case


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("config", ["ascend-a2", "small"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gather_scatter_wgrad_match_the_reference(case, config, weighted):
    T, K, E, m, H, counts = _counts_T(case)
    top, p = routing(T, K, E, m, seed=T + H, counts=counts)
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(T, H, generator=g) * 2 - 1)
    w = (torch.rand(T * K, generator=g) + 0.1) if weighted else None
    cfg = None if config == "ascend-a2" else SMALL
    y = ptr.padded_gather(x, p.indices, p.bin_ids, p.bins, p.padded_bins, K, w, config=cfg)
    want = ref_gather(x, p, w)
    if w is None:
        assert np.array_equal(y.double().numpy(), want)  # a move: exact, padding rows zero
    else:
        np.testing.assert_allclose(y.double().numpy(), want, rtol=1e-6, atol=1e-7)
    # scatter: out[t] = sum_k w * y[dest[t*K+k]]
    yy = torch.rand(y.shape, generator=g)
    out = ptr.padded_scatter(yy, p.indices, p.bin_ids, w, p.bins, p.padded_bins, K, config=cfg)
    dest = p.dest_rows.tolist()
    want_out = np.zeros((T, H))
    for a in range(T * K):
        want_out[a // K] += (1.0 if w is None else float(w[a])) * yy[dest[a]].double().numpy()
    np.testing.assert_allclose(out.double().numpy(), want_out, rtol=1e-5, atol=1e-6)
    # wgrad[a] = <yy[dest[a]], grad[a // K]>
    grad = torch.rand(T, H, generator=g)
    wg = ptr.padded_scatter_wgrad(yy, grad, p.indices, p.bin_ids, p.bins, p.padded_bins, K, config=cfg)
    want_wg = np.array([float((yy[dest[a]].double() * grad[a // K].double()).sum()) for a in range(T * K)])
    np.testing.assert_allclose(wg.double().numpy(), want_wg, rtol=1e-5, atol=1e-5)


def test_a_larger_batch_and_the_native_backend():
    T, K, E, m, H = 512, 2, 16, 16, 64
    top, p = routing(T, K, E, m, seed=5)
    x = torch.randn(T, H).to(torch.bfloat16)
    y = ptr.padded_gather(x, p.indices, p.bin_ids, p.bins, p.padded_bins, K)
    assert torch.equal(y, padmoe.padded_gather(x, p.indices, p.bin_ids, p.bins, p.padded_bins, K))  # bitwise
    w = torch.rand(T * K)
    out = ptr.padded_scatter(y, p.indices, p.bin_ids, w, p.bins, p.padded_bins, K)
    native = padmoe.padded_scatter(y, p.indices, p.bin_ids, w, p.bins, p.padded_bins, K)
    torch.testing.assert_close(out.float(), native.float(), rtol=1e-2, atol=1e-2)


def test_tile_config_follows_the_planner():
    c = padmoe.plan_tiles("ascend-a2", "wgrad", 7168, "bfloat16")
    assert c["programs"] == 48 and c["sub_block_rows"] == 1  # H > block_x: one row at a time
    t = ptr.tile_config("gather", 7168, torch.bfloat16)
    assert t["programs"] == 48 and t["block_x"] & (t["block_x"] - 1) == 0 and t["block_x"] * 2 % 32 == 0
    with pytest.raises(ValueError, match="plan_tiles: target"):
        padmoe.plan_tiles("tpu", "gather", 16, "float32")


def test_bad_input_is_padmoes_error():
    top, p = routing(6, 2, 4, 4, seed=2)
    bad = p.indices.clone()
    bad[0] = bad[1]
    with pytest.raises(ValueError, match="padded_gather: indices"):
        ptr.padded_gather(torch.rand(6, 8), bad, p.bin_ids, p.bins, p.padded_bins, 2)


@pytest.mark.parametrize("weighted", [False, True])
def test_torch_dropins_with_the_triton_backend_match_native_forward_and_backward(weighted):
    import padmoe.torch as pt
    top, p = routing(13, 2, 5, 4, seed=9)
    g = torch.Generator().manual_seed(4)
    x = torch.rand(13, 24, generator=g, dtype=torch.float32)
    w = (torch.rand(26, generator=g) + 0.1) if weighted else None
    results = {}
    for backend in ("native", "triton"):
        xr = x.clone().requires_grad_(True)
        wr = None if w is None else w.clone().requires_grad_(True)
        y = pt.padded_gather(xr, p.indices, p.bin_ids, p.bins, p.padded_bins, 2, wr, backend=backend)
        out = pt.padded_scatter(y * 1.5, p.indices, p.bin_ids, wr, p.bins, p.padded_bins, 2, backend=backend)
        out.backward(torch.rand(out.shape, generator=torch.Generator().manual_seed(7)))
        results[backend] = (y.detach(), out.detach(), xr.grad, None if wr is None else wr.grad)
    for a, b in zip(results["native"], results["triton"]):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backend"):
        pt.padded_gather(x, p.indices, p.bin_ids, p.bins, p.padded_bins, 2, backend="cuda")
