"""padmoe.triton (a Triton-Ascend design) in Triton's interpreter on the CPU, against the
plain-loop reference: moves exact, sums within float32 accumulation. The Ascend design's verification list:
experts with zero tokens, counts on and one over the multiple, several experts in one sub-block,
top_k 1/2/4/8, weighted and unweighted scatter, hidden-size tails, a larger routed batch; with the
ascend-a2 tile configuration and with small ones that force many programs, sub-block steps and
column tails."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import padmoe  # noqa: E402
import padmoe.reference as pe  # noqa: E402

ptr = pytest.importorskip("padmoe.triton")
if ptr._interpreting():
    DEV = "cpu"  # Triton's interpreter on CPU tensors (CI)
elif torch.cuda.is_available():
    DEV = "cuda"  # Triton compiled for the GPU: the same cases natively, and bitwise against padmoe's CUDA backend
else:
    pytest.skip(
        "padmoe.triton runs on CUDA tensors, or on CPU tensors in Triton's interpreter: TRITON_INTERPRET=1 "
        "before triton is imported (scripts/pytest.sh runs this file so, in a process of its own)",
        allow_module_level=True,
    )

SMALL = dict(programs=3, sub_block_rows=2, block_x=16, buffer_bytes=0, buffers=1)
CONFIGS = {  # name -> config for (op, H, dtype)
    "planned": lambda op, H, dt: None,  # the planner's for the device: ascend-a2 (interpreter), gpu (CUDA)
    "ascend-a2": lambda op, H, dt: ptr.tile_config(op, H, dt, target="ascend-a2"),
    "small-sorted": lambda op, H, dt: dict(SMALL, **{"pass": "sorted"}),
    "small-tokens": lambda op, H, dt: dict(SMALL, **{"pass": "tokens"}),
}
MID = dict(programs=5, sub_block_rows=16, block_x=64, buffer_bytes=0, buffers=1)
CONFIGS["mid-sorted"] = lambda op, H, dt: dict(MID, **{"pass": "sorted"})
CONFIGS["mid-tokens"] = lambda op, H, dt: dict(MID, **{"pass": "tokens"})
if DEV == "cpu":
    del CONFIGS["ascend-a2"]  # "planned" is ascend-a2 in the interpreter
SMALL_CASES = [c for c in CONFIGS if not c.startswith("mid")]
# the larger batches: in the interpreter (slow) with configurations of more rows a step
LARGE_CASES = [c for c in CONFIGS if DEV == "cuda" or not c.startswith("small")]


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
    (7, 1, 4, 4, 1, [0, 4, 5, 0][:4]),  # zero-token experts, a count on and one over the multiple, H = 1
    (9, 1, 3, 4, 3, [4, 5, 0]),
    (13, 2, 5, 4, 33, None),  # several experts inside one sub-block, a column tail
    (11, 4, 8, 8, 17, None),
    (6, 8, 8, 2, 64, None),
    (5, 2, 4, 4, 4097, None),  # a 4097 tail: one full tile and one column
]


def _counts_T(case):
    T, K, E, m, H, counts = case
    return (sum(counts), K, E, m, H, counts) if counts is not None else case


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("config", SMALL_CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_gather_scatter_wgrad_match_the_reference(case, config, weighted):
    T, K, E, m, H, counts = _counts_T(case)
    top, p = routing(T, K, E, m, seed=T + H, counts=counts)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(T, H, generator=g) * 2 - 1
    w = (torch.rand(T * K, generator=g) + 0.1) if weighted else None
    cfg = CONFIGS[config]
    d = dict(
        indices=p.indices.to(DEV), bin_ids=p.bin_ids.to(DEV), bins=p.bins.to(DEV), padded_bins=p.padded_bins.to(DEV)
    )
    wd = None if w is None else w.to(DEV)
    P = int(p.padded_bins[-1])
    del_me = torch.full((P, H), float("nan"), device=DEV)  # freed: the caching allocator hands it out again
    del del_me
    y = ptr.padded_gather(
        x.to(DEV), d["indices"], d["bin_ids"], d["bins"], d["padded_bins"], K, wd, config=cfg("gather", H, x.dtype)
    ).cpu()
    want = ref_gather(x, p, w)
    if w is None:
        assert np.array_equal(y.double().numpy(), want)  # a move: exact, padding rows zero
    else:
        np.testing.assert_allclose(y.double().numpy(), want, rtol=1e-6, atol=1e-7)
    # scatter: out[t] = sum_k w * y[dest[t*K+k]]
    yy = torch.rand(y.shape, generator=g)
    out = ptr.padded_scatter(
        yy.to(DEV), d["indices"], d["bin_ids"], wd, d["bins"], d["padded_bins"], K, config=cfg("scatter", H, x.dtype)
    ).cpu()
    dest = p.dest_rows.tolist()
    want_out = np.zeros((T, H))
    for a in range(T * K):
        want_out[a // K] += (1.0 if w is None else float(w[a])) * yy[dest[a]].double().numpy()
    np.testing.assert_allclose(out.double().numpy(), want_out, rtol=1e-5, atol=1e-6)
    # wgrad[a] = <yy[dest[a]], grad[a // K]>
    grad = torch.rand(T, H, generator=g)
    wg = ptr.padded_scatter_wgrad(
        yy.to(DEV),
        grad.to(DEV),
        d["indices"],
        d["bin_ids"],
        d["bins"],
        d["padded_bins"],
        K,
        config=cfg("wgrad", H, x.dtype),
    ).cpu()
    want_wg = np.array([float((yy[dest[a]].double() * grad[a // K].double()).sum()) for a in range(T * K)])
    np.testing.assert_allclose(wg.double().numpy(), want_wg, rtol=1e-5, atol=1e-5)


LARGE = (
    [(512, 2, 16, 16, 64)]
    if DEV == "cpu"
    else [(4096, 8, 64, 128, 1024), (2048, 2, 8, 16, 4097), (1024, 4, 256, 16, 7168)]
)


@pytest.mark.parametrize("shape", LARGE)
@pytest.mark.parametrize("config", LARGE_CASES)
def test_a_larger_batch_against_the_native_backend(shape, config):
    """Moves bitwise equal to padmoe's own backend on the same device (CPU in the interpreter, the
    CUDA backend natively); sums and dot products within one bf16 rounding of it; a second call
    bitwise identical to the first (no atomics: deterministic)."""
    import padmoe.torch as pt

    T, K, E, m, H = shape
    top, p = routing(T, K, E, m, seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    idx, bid, bins, pb = (t.to(DEV) for t in (p.indices, p.bin_ids, p.bins, p.padded_bins))
    cfg = CONFIGS[config]
    c = {op: cfg(op, H, x.dtype) for op in ("gather", "scatter", "wgrad")}
    y = ptr.padded_gather(x, idx, bid, bins, pb, K, config=c["gather"])
    assert torch.equal(y, pt.padded_gather(x, idx, bid, bins, pb, K))  # a move: bitwise
    assert torch.equal(y, ptr.padded_gather(x, idx, bid, bins, pb, K, config=c["gather"]))
    w = torch.rand(T * K, generator=torch.Generator().manual_seed(3)).to(DEV)
    yw = ptr.padded_gather(x, idx, bid, bins, pb, K, w, config=c["gather"])
    torch.testing.assert_close(yw.float(), pt.padded_gather(x, idx, bid, bins, pb, K, w).float(), rtol=8e-3, atol=1e-6)
    out = ptr.padded_scatter(y, idx, bid, w, bins, pb, K, config=c["scatter"])
    torch.testing.assert_close(
        out.float(), pt.padded_scatter(y, idx, bid, w, bins, pb, K).float(), rtol=8e-3, atol=1e-3
    )
    assert torch.equal(out, ptr.padded_scatter(y, idx, bid, w, bins, pb, K, config=c["scatter"]))
    grad = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEV)
    wg = ptr.padded_scatter_wgrad(y, grad, idx, bid, bins, pb, K, config=c["wgrad"])
    ref = pt.padded_scatter_wgrad(y, grad, idx, bid, bins, pb, K)
    torch.testing.assert_close(wg.float(), ref.float(), rtol=8e-3, atol=1e-2)
    assert torch.equal(wg, ptr.padded_scatter_wgrad(y, grad, idx, bid, bins, pb, K, config=c["wgrad"]))
    if DEV == "cuda":  # the second calls launched the kept compiled kernels (padmoe.triton._Launcher)
        assert ptr._KERNELS["dest"].cache and ptr._KERNELS["dest"].fast


def test_tile_config_follows_the_planner():
    c = padmoe.tile_config("ascend-a2", "wgrad", 7168, "bfloat16")
    assert c["programs"] == 48 and c["sub_block_rows"] == 1  # H > block_x: one row at a time
    t = ptr.tile_config("gather", 7168, torch.bfloat16)
    assert t["programs"] == 48 and t["block_x"] & (t["block_x"] - 1) == 0 and t["block_x"] * 2 % 32 == 0
    assert t["target"] == "ascend-a2" and t["pass"] == "sorted"  # the Ascend design's pass on the NPU configuration
    gp = padmoe.tile_config("gpu", "gather", 4096, "bfloat16", 100)
    assert gp["programs"] % 100 == 0  # programs per SM times the SMs passed
    tg = ptr.tile_config("gather", 4096, torch.bfloat16, target="gpu", cores=100)
    assert tg["programs"] == gp["programs"] and tg["pass"] == "tokens"
    assert tg["sub_block_rows"] <= gp["sub_block_rows"] < 2 * tg["sub_block_rows"]  # rounded down to a power of 2
    if DEV == "cuda":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert (
            ptr.tile_config("scatter", 2048, torch.bfloat16, device="cuda")["programs"]
            == padmoe.tile_config("gpu", "scatter", 2048, "bfloat16", sms)["programs"]
        )  # SMs queried at run time
    with pytest.raises(ValueError, match="tile_config: target"):
        padmoe.tile_config("tpu", "gather", 16, "float32")


def test_bad_input_is_padmoes_error():
    top, p = routing(6, 2, 4, 4, seed=2)
    bad = p.indices.clone()
    bad[0] = bad[1]
    with pytest.raises(ValueError, match="padded_gather: indices"):
        ptr.padded_gather(
            torch.rand(6, 8, device=DEV), bad.to(DEV), p.bin_ids.to(DEV), p.bins.to(DEV), p.padded_bins.to(DEV), 2
        )
    with pytest.raises(ValueError, match="padded_rows"):
        ptr.padded_gather(
            torch.rand(6, 8, device=DEV),
            p.indices.to(DEV),
            p.bin_ids.to(DEV),
            p.bins.to(DEV),
            p.padded_bins.to(DEV),
            2,
            padded_rows=int(p.padded_bins[-1]) + 1,
        )
    y = ptr.padded_gather(
        torch.rand(6, 8, device=DEV),
        p.indices.to(DEV),
        p.bin_ids.to(DEV),
        p.bins.to(DEV),
        p.padded_bins.to(DEV),
        2,
        padded_rows=int(p.padded_bins[-1]),
        check=False,
    )
    assert y.shape == (int(p.padded_bins[-1]), 8)
    d = [t.to(DEV) for t in (p.indices, p.bin_ids, p.bins, p.padded_bins)]
    P = int(p.padded_bins[-1])
    # wgrad's and scatter's y: fewer rows than P (P read on the host: "has"; on CUDA it is not, and the
    # op names the rows it needs: "output capacity")
    with pytest.raises(ValueError, match="padded_scatter_wgrad: y: (has|output capacity)"):
        ptr.padded_scatter_wgrad(
            torch.rand(P - 1, 8, device=DEV), torch.rand(6, 8, device=DEV), d[0], d[1], d[2], d[3], 2
        )
    with pytest.raises(ValueError, match="padded_scatter_wgrad: grad"):
        ptr.padded_scatter_wgrad(torch.rand(P, 8, device=DEV), torch.rand(6, 7, device=DEV), d[0], d[1], d[2], d[3], 2)
    with pytest.raises(ValueError, match="padded_scatter: y: (has|output capacity)"):
        ptr.padded_scatter(torch.rand(P - 1, 8, device=DEV), d[0], d[1], None, d[2], d[3], 2)


@pytest.mark.parametrize("weighted", [False, True])
def test_torch_dropins_with_the_triton_backend_match_native_forward_and_backward(weighted):
    import padmoe.torch as pt

    top, p = routing(13, 2, 5, 4, seed=9)
    g = torch.Generator().manual_seed(4)
    x = torch.rand(13, 24, generator=g, dtype=torch.float32).to(DEV)
    w = (torch.rand(26, generator=g) + 0.1).to(DEV) if weighted else None
    p = type("P", (), {k: getattr(p, k).to(DEV) for k in ("indices", "bin_ids", "bins", "padded_bins")})
    results = {}
    for backend in ("native", "triton"):
        xr = x.clone().requires_grad_(True)
        wr = None if w is None else w.clone().requires_grad_(True)
        y = pt.padded_gather(xr, p.indices, p.bin_ids, p.bins, p.padded_bins, 2, wr, backend=backend)
        out = pt.padded_scatter(y * 1.5, p.indices, p.bin_ids, wr, p.bins, p.padded_bins, 2, backend=backend)
        out.backward(torch.rand(out.shape, generator=torch.Generator().manual_seed(7)).to(DEV))
        results[backend] = (y.detach(), out.detach(), xr.grad, None if wr is None else wr.grad)
    for a, b in zip(results["native"], results["triton"]):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backend"):
        pt.padded_gather(x, p.indices, p.bin_ids, p.bins, p.padded_bins, 2, backend="cuda")
