"""padmoe.torch: the torch.library custom ops (forward vs padmoe.reference, autograd,
gradcheck, torch.compile, CUDA graphs, errors)."""

import pytest

torch = pytest.importorskip("torch")

import padmoe  # noqa: E402
import padmoe.reference as pe  # noqa: E402
import padmoe.torch as pt  # noqa: E402

DEVICES = ["cpu"]
if torch.cuda.is_available() and padmoe.has_cuda():
    DEVICES.append("cuda")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
}


def routing(device, dtype, T=13, K=2, E=5, m=4, H=12, seed=0, idtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    top = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 empty
    top = top.to(device, idtype)
    x = (torch.rand(T, H, generator=g) * 2 - 1).to(device, dtype)
    w = (torch.rand(T * K, generator=g) * 0.9 + 0.1).to(device, dtype)
    return top, x, w, E, m


def eq(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b)


def close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


def grads(fn, inputs, seed=1):
    out = fn(*inputs)
    g = torch.Generator().manual_seed(seed)
    gout = (torch.rand(out.shape, generator=g) * 2 - 1).to(out.device, out.dtype)
    return out, torch.autograd.grad(out, inputs, gout)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def megatron_input(device, dtype, H=6):
    tpe = torch.tensor([3, 0, 5, 4, 1], device=device)  # counts on, under and over the alignment
    h = (torch.rand(15, H, generator=torch.Generator().manual_seed(2)) * 2 - 1).to(device, dtype)  # 2 ignored rows
    probs = (torch.rand(15, generator=torch.Generator().manual_seed(3)) + 0.1).to(device, dtype)
    return h, tpe, probs


# ---------------------------------------------------------------------------
# forward equality with plain PyTorch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idtype", [torch.int32, torch.int64])
def test_make_plan_matches_eager(device, idtype):
    top, _, _, E, m = routing(device, torch.float32, idtype=idtype)
    plan, ref = pt.make_plan(top, E, m), pe.make_plan(top, E, m)
    for name in pe.Plan._fields[:8]:
        eq(getattr(plan, name), getattr(ref, name))
    assert plan.padded_rows_bound == top.numel() + E * (m - 1) == plan.row_sources.numel()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_dispatch_combine_forward(device, dtype, weighted):
    top, x, w, E, m = routing(device, dtype)
    w = w if weighted else None
    plan, ref = pt.make_plan(top, E, m), pe.make_plan(top, E, m)
    P = int(ref.padded_bins[-1])
    y = pt.dispatch(x, plan, w)
    assert y.shape == (plan.padded_rows_bound, x.shape[1]) and plan.padded_rows_bound > P
    eq(y[:P], pe.dispatch(x, ref, w))
    assert torch.all(y[P:] == 0)  # zero_tail: deterministic capacity-sized output
    close(pt.combine(y, plan, w), pe.combine(y[:P], ref, w), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_megablocks_forward(device, dtype):
    top, x, w, E, m = routing(device, dtype)
    p = pe.make_plan(top, E, m)
    args = (p.indices, p.bin_ids, p.bins, p.padded_bins)
    y = pt.padded_gather(x, *args, top.shape[1])
    eq(y, pe.padded_gather(x, *args, top.shape[1]))  # exactly P rows, like MegaBlocks
    eq(pt.padded_gather(x, *args, top.shape[1], w), pe.padded_gather(x, *args, top.shape[1], w))
    for weights in (None, w):
        close(
            pt.padded_scatter(y, p.indices, p.bin_ids, weights, p.bins, p.padded_bins, top.shape[1]),
            pe.padded_scatter(y, p.indices, p.bin_ids, weights, p.bins, p.padded_bins, top.shape[1]),
            dtype,
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_forward(device, dtype):
    h, tpe, probs = megatron_input(device, dtype)
    got, ref = pt.pad_to_alignment(h, tpe, 4), pe.pad_to_alignment(h, tpe, 4)
    for a, b in zip(got, ref):
        eq(a, b)
    for pr in (None, probs):
        close(
            pt.unpad_from_alignment(got[0], got[1], h.shape[0], pr),
            pe.unpad_from_alignment(ref[0], ref[1], h.shape[0], pr),
            dtype,
        )
    # a move without probs is exact
    eq(pt.unpad_from_alignment(got[0], got[1], h.shape[0]), pe.unpad_from_alignment(ref[0], ref[1], h.shape[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_routing_object(device):
    top, x, w, E, m = routing(device, torch.float32)
    r = pt.Routing.from_topk(top, w.view(top.shape), E, m)
    ref = pe.make_plan(top, E, m)
    eq(r.offsets, ref.padded_bins)
    eq(r.tokens_per_expert, ref.tokens_per_expert)
    y = r.dispatch(x)
    assert y.shape[0] == r.padded_rows_bound
    close(r.combine(y * 2), pe.combine(pe.dispatch(x, ref) * 2, ref, w), torch.float32)


# ---------------------------------------------------------------------------
# gradcheck in float64 (plain-PyTorch float64 path inside the same custom ops)
# ---------------------------------------------------------------------------


def f64(*ts):
    return [leaf(t.double()) for t in ts]


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_static(device):
    top, x, w, E, m = routing(device, torch.float32, T=5, H=3)
    plan = pt.make_plan(top, E, m)
    x, w, w2 = f64(x, w, w.flip(0))
    assert torch.autograd.gradcheck(lambda a, b: pt.dispatch(a, plan, b), (x, w))
    y = leaf(pt.dispatch(x, plan).detach() + 0.5)
    assert torch.autograd.gradcheck(lambda a, b: pt.combine(a, plan, b), (y, w2))
    assert torch.autograd.gradcheck(lambda a: pt.combine(a, plan), (y,))
    assert torch.autograd.gradcheck(lambda a, b: pt.Routing(plan, b).combine(pt.dispatch(a, plan)), (x, w2))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_megablocks(device):
    top, x, w, E, m = routing(device, torch.float32, T=5, H=3)
    p = pe.make_plan(top, E, m)
    K = top.shape[1]
    x, w = f64(x, w)
    args = (p.indices, p.bin_ids, p.bins, p.padded_bins)
    assert torch.autograd.gradcheck(lambda a: pt.padded_gather(a, *args, K), (x,))
    assert torch.autograd.gradcheck(lambda a, b: pt.padded_gather(a, *args, K, b), (x, w))
    y = leaf(pt.padded_gather(x, *args, K).detach() + 0.25)
    assert torch.autograd.gradcheck(
        lambda a, b: pt.padded_scatter(a, p.indices, p.bin_ids, b, p.bins, p.padded_bins, K), (y, w)
    )
    assert torch.autograd.gradcheck(
        lambda a: pt.padded_scatter(a, p.indices, p.bin_ids, None, p.bins, p.padded_bins, K), (y,)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_megatron(device):
    h, tpe, probs = megatron_input(device, torch.float64, H=3)
    h, probs = leaf(h), leaf(probs)
    assert torch.autograd.gradcheck(lambda a: pt.pad_to_alignment(a, tpe, 4)[0], (h,))
    padded, pmap, _ = pt.pad_to_alignment(h.detach(), tpe, 4)
    padded = leaf(padded + 0.5)
    assert torch.autograd.gradcheck(lambda a, b: pt.unpad_from_alignment(a, pmap, 15, b), (padded, probs))
    assert torch.autograd.gradcheck(lambda a: pt.unpad_from_alignment(a, pmap, 15), (padded,))


# ---------------------------------------------------------------------------
# native backward (float32 / bf16) vs eager backward
# ---------------------------------------------------------------------------


def eager_dispatch_combine(x, w, top, E, m):
    """Plain PyTorch with autograd: differentiable index ops, like eager MegaBlocks."""
    plan = pe.make_plan(top, E, m)
    dest = plan.dest_rows.long()
    y = x.new_zeros(plan.padded_rows_bound, x.shape[1]).index_copy(0, dest, x.repeat_interleave(top.shape[1], 0))
    y = y * 1.5  # "expert"
    g = y.index_select(0, dest).float() * w.float().unsqueeze(1)
    return g.view(x.shape[0], top.shape[1], -1).sum(1).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_backward_static(device, dtype):
    top, x, w, E, m = routing(device, dtype)
    plan = pt.make_plan(top, E, m)
    out, (gx, gw) = grads(lambda a, b: pt.combine(pt.dispatch(a, plan) * 1.5, plan, b), (leaf(x), leaf(w)))
    rout, (rgx, rgw) = grads(lambda a, b: eager_dispatch_combine(a, b, top, E, m), (leaf(x), leaf(w)))
    close(out, rout, dtype)
    close(gx, rgx, dtype)
    close(gw, rgw, dtype)
    # and the backward ops against padmoe.reference's backward formulas directly
    ref = pe.make_plan(top, E, m)
    P = int(ref.padded_bins[-1])
    y = pt.dispatch(x, plan)
    yl, wl = leaf(y), leaf(w)
    gout = torch.ones(x.shape, dtype=dtype, device=device)
    gy, gw2 = torch.autograd.grad(pt.combine(yl, plan, wl), (yl, wl), gout)
    rgy, rgw2 = pe.combine_backward(gout, y[:P], ref, w)
    eq(gy[:P], rgy)
    assert torch.all(gy[P:] == 0)
    close(gw2, rgw2, dtype)
    xl = leaf(x)
    (gx3,) = torch.autograd.grad(pt.dispatch(xl, plan), (xl,), y)
    rgx3, _ = pe.dispatch_backward(y[:P], x, ref)
    close(gx3, rgx3, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_backward_dropins(device, dtype):
    top, x, w, E, m = routing(device, dtype)
    p = pe.make_plan(top, E, m)
    K = top.shape[1]
    args = (p.indices, p.bin_ids, p.bins, p.padded_bins)

    def chain(mod):
        def f(a, b):
            y = mod.padded_gather(a, *args, K)
            return mod.padded_scatter(y * 1.5, p.indices, p.bin_ids, b, p.bins, p.padded_bins, K)

        return f

    out, g = grads(chain(pt), (leaf(x), leaf(w)))
    rout, rg = grads(chain(pe), (leaf(x), leaf(w)))  # eager: autograd through index ops
    close(out, rout, dtype)
    for a, b in zip(g, rg):
        close(a, b, dtype)
    # weighted gather: weight gradient
    _, g = grads(lambda a, b: pt.padded_gather(a, *args, K, b), (leaf(x), leaf(w)))
    _, rg = grads(lambda a, b: pe.padded_gather(a, *args, K, b), (leaf(x), leaf(w)))
    for a, b in zip(g, rg):
        close(a, b, dtype)

    h, tpe, probs = megatron_input(device, dtype)

    def megatron(mod):
        def f(a, b):
            padded, pmap, _ = mod.pad_to_alignment(a, tpe, 4)
            return mod.unpad_from_alignment(padded * 1.5, pmap, a.shape[0], b)

        return f

    out, g = grads(megatron(pt), (leaf(h), leaf(probs)))
    rout, rg = grads(megatron(pe), (leaf(h), leaf(probs)))
    close(out, rout, dtype)
    for a, b in zip(g, rg):
        close(a, b, dtype)
    assert torch.all(g[0][int(tpe.sum()) :] == 0)  # ignored rows: zero gradient


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------


def _static_step(x, top, w, E: int, m: int):
    plan = pt.make_plan(top, E, m)
    y = pt.dispatch(x, plan)
    return pt.combine(torch.tanh(y) * 2.0, plan, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_static_path(device, backend):
    torch._dynamo.reset()
    top, x, w, E, m = routing(device, torch.float32)
    compiled = torch.compile(_static_step, fullgraph=True, backend=backend)
    out, g = grads(lambda a, b: compiled(a, top, b, E, m), (leaf(x), leaf(w)))
    rout, rg = grads(lambda a, b: _static_step(a, top, b, E, m), (leaf(x), leaf(w)))
    close(out, rout, torch.float32)
    for a, b in zip(g, rg):
        close(a, b, torch.float32)
    # new routing, same shapes: no recompilation problems, still right
    top2, x2, w2, _, _ = routing(device, torch.float32, seed=5)
    close(compiled(x2, top2, w2, E, m), _static_step(x2, top2, w2, E, m), torch.float32)


def _dropin_step(x, top, w, h, tpe, probs, E: int, m: int):
    p = pt.make_plan(top, E, m)
    K = top.shape[1]
    y = pt.padded_gather(x, p.indices, p.bin_ids, p.bins, p.padded_bins, K)
    out = pt.padded_scatter(y * 2.0, p.indices, p.bin_ids, w, p.bins, p.padded_bins, K)
    padded, pmap, _ = pt.pad_to_alignment(h, tpe, m)
    return out, pt.unpad_from_alignment(padded * 2.0, pmap, h.shape[0], probs)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dropins_dynamic_rows(device):
    torch._dynamo.reset()
    top, x, w, E, m = routing(device, torch.float32)
    h, tpe, probs = megatron_input(device, torch.float32)
    compiled = torch.compile(_dropin_step, fullgraph=True, backend="aot_eager")
    ins = [leaf(x), leaf(w), leaf(h), leaf(probs)]
    got = compiled(ins[0], top, ins[1], ins[2], tpe, ins[3], E, m)
    ref_ins = [leaf(t) for t in (x, w, h, probs)]
    ref = _dropin_step(ref_ins[0], top, ref_ins[1], ref_ins[2], tpe, ref_ins[3], E, m)
    for a, b in zip(got, ref):
        close(a, b, torch.float32)
    g = torch.autograd.grad(got[0].sum() + got[1].sum(), ins)
    rg = torch.autograd.grad(ref[0].sum() + ref[1].sum(), ref_ins)
    for a, b in zip(g, rg):
        close(a, b, torch.float32)


# ---------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and padmoe's CUDA backend")
def test_cuda_graph_capture_replay():
    top, x, w, E, m = routing("cuda", torch.float32, T=64, K=2, E=8, m=16, H=128)
    s_top, s_x, s_w = top.clone(), x.clone(), w.clone()

    def step():
        plan = pt.make_plan(s_top, E, m)
        y = pt.dispatch(s_x, plan)
        return pt.combine(y * 2.0, plan, s_w), y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (allocator, lazy init) off the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_out, s_y = step()
    for seed in (11, 12, 13):
        top2, x2, w2, _, _ = routing("cuda", torch.float32, T=64, K=2, E=8, m=16, H=128, seed=seed)
        s_top.copy_(top2)
        s_x.copy_(x2)
        s_w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        ref = pe.make_plan(top2, E, m)
        P = int(ref.padded_bins[-1])
        eq(s_y[:P], pe.dispatch(x2, ref))
        assert torch.all(s_y[P:] == 0)
        close(s_out, pe.combine(pe.dispatch(x2, ref) * 2.0, ref, w2), torch.float32)


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_carries_padmoe_message(device):
    top, x, w, E, m = routing(device, torch.float32)
    bad = top.clone()
    bad[1, 1] = E + 3
    with pytest.raises(ValueError, match=r"make_plan: top_experts: .*expert id"):
        pt.make_plan(bad, E, m)
    plan = pt.make_plan(top, E, m)
    with pytest.raises(TypeError, match="dispatch: x"):
        pt.dispatch(x.to(torch.int32), plan)
    with pytest.raises(ValueError, match="combine: weights"):
        pt.combine(pt.dispatch(x, plan), plan, w[:-1])
    p = pe.make_plan(top, E, m)
    perm = p.indices.clone()
    perm[0] = perm[1]  # not a permutation
    with pytest.raises(ValueError, match="padded_gather: indices"):
        pt.padded_gather(x, perm, p.bin_ids, p.bins, p.padded_bins, top.shape[1])
    with pytest.raises(ValueError, match="pad_to_alignment"):
        pt.pad_to_alignment(x, torch.tensor([3, 40], device=device), 4)  # more rows than hidden_states has
