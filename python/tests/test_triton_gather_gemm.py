"""The gather-fused up projection (padmoe/_triton_gather_gemm.py) against float64 loops: x's rows read
through the plan, weighted or not, both weight layouts, bias, the plain epilogue (h) and the fused
activations (gated side by side and interleaved, ungated, GPT-OSS's clamped SwiGLU); padding rows zero
or unwritten as asked, rows at or past P never written, bitwise the same run to run; the tile choice;
and the expert MLP operator running it (forward without gradients; with gradients and
``recompute_rows``). On the CPU in Triton's interpreter (TRITON_INTERPRET=1, a process of its own:
scripts/pytest.sh), else on CUDA."""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from padmoe import _triton_gather_gemm as tg  # noqa: E402
from padmoe._triton_kernels import _interpreting  # noqa: E402
from padmoe.torch import _expert_mlp  # noqa: E402
from padmoe.torch._expert_mlp import KINDS  # noqa: E402
from padmoe.torch._gather_gemm import gather_config, gather_pays, triton_gather_up, triton_gather_wgrad  # noqa: E402
from padmoe.torch.grouped import Routing, experts_forward  # noqa: E402

if _interpreting():
    DEV = "cpu"
elif torch.cuda.is_available():
    DEV = "cuda"
else:
    pytest.skip("Triton kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1", allow_module_level=True)

ALPHA, LIMIT = 1.702, 2.5
SENTINEL = 77.0
DT = torch.float16 if DEV == "cpu" else torch.bfloat16  # the interpreter's bf16 dot products are wrong


def act64(kind, g, u):
    """The activation in float64: act(g) * u (gated; u None ungated)."""
    if kind == "clamped_swiglu":
        gc = g.clamp(max=LIMIT)
        return (u.clamp(-LIMIT, LIMIT) + 1) * gc * torch.sigmoid(ALPHA * gc)
    if kind == "silu":
        y = g * torch.sigmoid(g)
    elif kind == "gelu_tanh":
        y = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    elif kind == "relu2":
        y = torch.relu(g) ** 2
    else:
        raise AssertionError(kind)
    return y if u is None else y * u


def problem(seed, T=24, K=2, E=5, H=72, N=80, alignment=16, capacity=None, weighted=True, bias=False, used=None):
    """(x, ids, weights or None, Routing, up [E, N, H], bias or None); the ids draw from the first
    ``used`` experts (all by default): the others get no rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(DT)
    idx = torch.stack([torch.randperm(used or E, generator=gen)[:K] for _ in range(T)]).to(torch.int64)
    w = torch.rand(T, K, generator=gen)
    r = Routing.from_topk(idx, w, E, alignment, expert_capacity=capacity)
    up = (torch.randn(E, N, H, generator=gen) / math.sqrt(H)).to(DT)
    b = (torch.randn(E, N, generator=gen) * 0.5).to(DT) if bias else None
    return x, idx, w if weighted else None, r, up, b


def reference_h(x, w, r, up, bias):
    """(h [R, N] float64 with real rows only, real-row mask [R], P)."""
    plan = r.plan
    src = plan.row_sources.long()
    ends = plan.padded_bins.long().tolist()
    p = ends[-1] if ends else 0
    K = plan.top_k
    h = torch.zeros(src.shape[0], up.shape[1], dtype=torch.float64)
    real = torch.zeros(src.shape[0], dtype=torch.bool)
    start = 0
    for e, end in enumerate(ends):
        for row in range(start, end):
            a = int(src[row])
            if a < 0:
                continue
            v = x[a // K].float()
            if w is not None:
                v = v * w.reshape(-1)[a]
            v = v.to(DT).double()  # rounded as dispatch rounds the weighted row
            h[row] = up[e].double() @ v
            if bias is not None:
                h[row] += bias[e].double()
            real[row] = True
        start = end
    return h, real, p


def run(x, w, r, up, bias, transposed, act, fused, zero_padding):
    plan = r.plan
    sizes = (plan.top_k, plan.num_experts, plan.alignment, getattr(plan, "expert_capacity", None))
    wt = up.transpose(1, 2).contiguous() if transposed else up
    args = (x.to(DEV), plan.packed.to(DEV), None if w is None else w.to(DEV), wt.to(DEV))
    out = triton_gather_up(*args, None if bias is None else bias.to(DEV), sizes, transposed, act, fused, zero_padding)
    return out.cpu()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_h_against_float64(transposed, weighted, bias):
    x, _, w, r, up, b = problem(1 + 2 * transposed + weighted, weighted=weighted, bias=bias)
    want, real, p = reference_h(x, w, r, up, b)
    act = (KINDS["silu"], True, False, ALPHA, LIMIT)
    got = run(x, w, r, up, b, transposed, act, False, True)
    torch.testing.assert_close(got[:p].double(), want[:p].to(DT).double(), rtol=1e-2, atol=1e-2)
    assert (got[:p][~real[:p]] == 0).all()  # padding rows zero when asked
    again = run(x, w, r, up, b, transposed, act, False, True)
    assert torch.equal(got[:p], again[:p])


@pytest.mark.parametrize(
    "kind, gated, interleaved",
    [("silu", True, False), ("silu", True, True), ("clamped_swiglu", True, True), ("gelu_tanh", False, False),
     ("relu2", True, False)],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("H, even", [(72, False), (128, True)])  # even: the tiles divide K and N (no masks)
def test_fused_activation_against_float64(kind, gated, interleaved, bias, H, even):
    N = (128 if even else 80) if gated else (64 if even else 40)
    x, _, w, r, up, b = problem(11 + len(kind), H=H, N=N, bias=bias)
    h, real, p = reference_h(x, w, r, up, b)
    if gated:
        g, u = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, : N // 2], h[:, N // 2 :])
        want = act64(kind, g, u)
    else:
        want = act64(kind, h, None)
    act = (KINDS[kind], gated, interleaved, ALPHA, LIMIT)
    got = run(x, w, r, up, b, False, act, True, True)
    assert got.shape == (h.shape[0], N // 2 if gated else N)
    torch.testing.assert_close(got[:p][real[:p]].double(), want[:p][real[:p]], rtol=2e-2, atol=2e-2)
    assert (got[:p][~real[:p]] == 0).all()


@pytest.mark.parametrize("fused, interleaved", [(False, False), (True, False), (True, True)])
def test_full_height_tiles_against_float64(fused, interleaved):
    """Alignment 128 and 160 rows an expert: 128-row tiles, 256 columns of h (the gated form: 128 gate
    and 128 up columns), the last column tile partly past N."""
    N = 320
    x, _, w, r, up, b = problem(31 + fused + interleaved, T=160, K=2, E=2, N=N, alignment=128, bias=True)
    sizes = (2, 2, 128, None)
    cfg = gather_config(x.to(DEV), up.to(DEV), sizes, False, fused, True)
    assert cfg[:2] == ((128, 128) if fused else (128, 256))
    h, real, p = reference_h(x, w, r, up, b)
    if fused:
        g, u = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, : N // 2], h[:, N // 2 :])
        want = act64("silu", g, u)
    else:
        want = h
    got = run(x, w, r, up, b, False, (KINDS["silu"], True, interleaved, ALPHA, LIMIT), fused, True)
    torch.testing.assert_close(got[:p][real[:p]].double(), want[:p][real[:p]], rtol=2e-2, atol=2e-2)
    assert (got[:p][~real[:p]] == 0).all()


@pytest.mark.parametrize("alignment", [16, 48])
@pytest.mark.parametrize("fused, zero_padding", [(False, True), (True, False), (True, True)])
def test_segment_tiles_against_float64(alignment, fused, zero_padding):
    """128-row tiles at an alignment 128 does not divide: each expert's segment tiled from its own
    start, the last tile cut at the segment's end (the next expert's rows written by its own tiles
    only), padding rows zero or unwritten as asked, rows at or past P unwritten."""
    N = 160
    x, _, w, r, up, b = problem(41 + alignment + fused, T=260, K=2, E=3, N=N, alignment=alignment, bias=True)
    plan = r.plan
    sizes = (2, 3, alignment, None)
    cfg = gather_config(x.to(DEV), up.to(DEV), sizes, False, fused, True)
    assert cfg[0] == 128 and tg.segment_tiles(alignment, cfg[0])
    counts = plan.tokens_per_expert.tolist()
    assert all(c > 128 and c % 128 for c in counts)  # every segment ends in a partial tile
    h, real, p = reference_h(x, w, r, up, b)
    want = act64("silu", h[:, : N // 2], h[:, N // 2 :]) if fused else h
    act = (KINDS["silu"], True, False, ALPHA, LIMIT)
    got = torch.full((plan.row_sources.shape[0], N // 2 if fused else N), SENTINEL, dtype=DT, device=DEV)
    triton_gather_up(x.to(DEV), plan.packed.to(DEV), w.to(DEV), up.to(DEV), b.to(DEV), sizes, False, act, fused,
                     zero_padding, out=got)  # fmt: skip
    got = got.cpu()
    torch.testing.assert_close(got[:p][real[:p]].double(), want[:p][real[:p]], rtol=2e-2, atol=2e-2)
    assert (got[:p][~real[:p]] == (0 if zero_padding else SENTINEL)).all()
    assert (got[p:] == SENTINEL).all()


def test_unwritten_rows():
    """Without zero_padding, padding rows and rows at or past P keep what the output held: the kernel
    writes real rows only."""
    x, _, w, r, up, _ = problem(5)
    plan = r.plan
    sizes = (plan.top_k, plan.num_experts, plan.alignment, None)
    act = (KINDS["silu"], True, False, ALPHA, LIMIT)
    real = plan.row_sources >= 0
    for fused in (False, True):
        want = run(x, w, r, up, None, False, act, fused, True)
        got = torch.full_like(want, SENTINEL).to(DEV)
        triton_gather_up(x.to(DEV), plan.packed.to(DEV), w.to(DEV), up.to(DEV), None, sizes, False, act, fused, False,
                         out=got)  # fmt: skip
        got = got.cpu()
        assert torch.equal(got[real], want[real])
        assert (got[~real] == SENTINEL).all()


def test_capacity_plan_and_dropped_ids():
    x, _, w, r, up, _ = problem(7, capacity=16)
    want, real, p = reference_h(x, w, r, up, None)
    got = run(x, w, r, up, None, False, (KINDS["silu"], True, False, ALPHA, LIMIT), False, True)
    torch.testing.assert_close(got[:p].double(), want[:p].to(DT).double(), rtol=1e-2, atol=1e-2)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, 6, (24, 2), generator=gen)  # -1 and 5: dropped (E = 5)
    r2 = Routing.from_topk(idx, w, 5, 32, drop_invalid=True)
    want, real, p = reference_h(x, w, r2, up, None)
    got = run(x, w, r2, up, None, False, (KINDS["silu"], True, False, ALPHA, LIMIT), False, True)
    torch.testing.assert_close(got[:p].double(), want[:p].to(DT).double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_wgrad_against_float64(transposed, weighted):
    """The up projection's weight gradient from x's rows through the plan: sum over each expert's real
    rows of grad_h[r] (x) row(r); padding rows (NaN in grad_h here) never read; an expert with no rows
    gets zeros; bitwise the same run to run."""
    x, _, w, r, up, _ = problem(21 + 2 * transposed + weighted, E=6, weighted=weighted, used=5)
    plan = r.plan
    src = plan.row_sources.long()
    gen = torch.Generator().manual_seed(5)
    grad_h = torch.randn(src.shape[0], up.shape[1], generator=gen).to(DT)
    grad_h[src < 0] = float("nan")
    K = plan.top_k
    want = torch.zeros(up.shape, dtype=torch.float64)
    ends = [0] + plan.padded_bins.long().tolist()
    for e in range(up.shape[0]):
        for row in range(ends[e], ends[e + 1]):
            a = int(src[row])
            if a >= 0:
                v = x[a // K].float() * (w.reshape(-1)[a] if w is not None else 1)
                want[e] += torch.outer(grad_h[row].double(), v.to(DT).double())
    assert plan.tokens_per_expert[5] == 0 and (want[5] == 0).all()  # expert 5 of 6 gets no rows
    sizes = (K, plan.num_experts, plan.alignment, None)
    wt = up.transpose(1, 2).contiguous() if transposed else up
    args = (grad_h.to(DEV), x.to(DEV), plan.packed.to(DEV), None if w is None else w.to(DEV), wt.to(DEV), sizes)
    got = triton_gather_wgrad(*args, transposed).cpu()
    assert got.shape == wt.shape
    got = got.transpose(1, 2) if transposed else got
    torch.testing.assert_close(got.double(), want.to(DT).double(), rtol=1e-2, atol=1e-2)
    again = triton_gather_wgrad(*args, transposed).cpu()
    assert torch.equal(again.transpose(1, 2) if transposed else again, got)


def test_tile_choice():
    assert tg.block_m(8, 1000) is None and tg.block_m(24, 1000) is None  # not a multiple of 16
    assert tg.block_m(128, 1024) == 128 and tg.block_m(128, 8) == 16 and tg.block_m(128, 40) == 64
    assert tg.block_m(16, 40) == 16 and tg.block_m(48, 40) == 16 and tg.block_m(64, 40) == 64
    # full height at any alignment: segment tiles where 128 does not divide it
    assert tg.block_m(16, 1024) == 128 and tg.block_m(48, 1024) == 128 and tg.block_m(64, 100) == 128
    for align in (16, 32, 48, 64, 128, 256):
        for rows in (1, 8, 100, 5000):
            bm = tg.block_m(align, rows)
            assert 16 <= bm <= 128 and (align % bm == 0) != tg.segment_tiles(align, bm)
            assert not tg.segment_tiles(align, bm) or bm == 128
    bm, bn, bk, warps, stages = tg.config(128, 1024, 768, True)
    assert (bm, bn) == (128, 128) and warps == 8  # full height: 128 x (2 x 128) accumulators
    assert tg.config(128, 1024, 1536, False)[:2] == (128, 256)
    assert tg.config(128, 40, 768, True)[:2] == (64, 64)
    assert tg.config(128, 1024, 40, False)[1] == 64  # narrow outputs: a narrower tile
    x = torch.zeros(4, 8, dtype=torch.float32, device=DEV)
    assert gather_config(x, torch.zeros(2, 8, 8, device=DEV), (2, 2, 16, None), False, True, True) is None  # fp32


def test_gather_pays():
    """The operator reads x through the plan where padding rows dominate (decode at alignment 128:
    T=256, K=8, E=256; with a capacity, from the rows it leaves empty), with or without gradients;
    and without gradients at qwen3-30b-a3b's sizes (full-height tiles, 256 rows an expert or more,
    up width 1536; at transformers' alignment 16 too, in segment tiles), not at deepseek-v3's (width
    4096) or mixtral-8x7b's (28672)."""
    assert gather_pays(256, (8, 256, 128, None), 4096, True)  # decode
    assert gather_pays(10, (2, 4, 64, None), 64, True) and not gather_pays(10, (2, 4, 16, None), 64, True)
    assert gather_pays(4, (2, 4, 16, 16), 64, True) and not gather_pays(32, (2, 4, 16, 16), 64, True)  # 64 / 8
    qwen3 = (16384, (8, 128, 128, None))
    assert gather_pays(*qwen3, 1536, False) and not gather_pays(*qwen3, 1536, True)
    assert not gather_pays(*qwen3, 2049, False)
    assert gather_pays(16384, (8, 128, 16, None), 1536, False)  # alignment 16: segment tiles
    assert not gather_pays(16384, (8, 128, 16, None), 1536, True)
    assert gather_pays(4096, (8, 128, 128, None), 1536, False)  # 256 rows an expert
    assert not gather_pays(4080, (8, 128, 128, None), 1536, False)  # 255: weight-bound
    for t, k, e, width in ((4096, 2, 8, 28672), (4096, 8, 256, 4096)):
        assert not gather_pays(t, (k, e, 128, None), width, False)


def spy(monkeypatch):
    """The list of ``fused`` flags of the operator's gather-fused GEMM calls."""
    calls, real = [], _expert_mlp._gather_up_call

    def counting(*args):
        calls.append(args[8])
        return real(*args)

    monkeypatch.setattr(_expert_mlp, "_gather_up_call", counting)
    return calls


@pytest.mark.parametrize("weighting", ["after", "before"])
@pytest.mark.parametrize(
    "T, E, alignment",
    # padding rows dominate; a narrow up projection, 256 rows an expert (at alignment 16: segment tiles)
    [(10, 4, 64), (256, 2, 128), (256, 2, 16)],
)
def test_operator_without_gradients(weighting, T, E, alignment, monkeypatch):
    """experts_forward under no_grad runs the gather and the activation fused; against float64."""
    calls = spy(monkeypatch)
    K, H, I = 2, 64, 32
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, generator=gen).to(DT).to(DEV)
    idx = torch.randint(0, E, (T, K), generator=gen).to(DEV)
    w = torch.rand(T, K, generator=gen).to(DEV)
    up = (torch.randn(E, 2 * I, H, generator=gen) / 8).to(DT).to(DEV)
    down = (torch.randn(E, H, I, generator=gen) / 6).to(DT).to(DEV)
    with torch.no_grad():
        out = experts_forward(x, idx, w, up, down, gate="silu", alignment=alignment, weighting=weighting)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            v = x[t].cpu().double()
            if weighting == "before":
                v = (x[t].cpu().float() * w[t, k].cpu()).to(DT).double()
            hh = up[e].cpu().double() @ v
            a = act64("silu", hh[:I], hh[I:])
            y = down[e].cpu().double() @ a
            want[t] += y * (w[t, k].cpu().double() if weighting == "after" else 1)
    assert calls == [True]  # one call, the activation fused
    torch.testing.assert_close(out.cpu().double(), want, rtol=3e-2, atol=3e-2)


def test_operator_recompute_rows_gradients(monkeypatch):
    """With gradients and recompute_rows the forward keeps h from the gather-fused GEMM and the backward
    dispatches the rows: the same results as the operator that keeps the rows, to bf16 rounding."""
    T, K, E, H, I = 10, 2, 4, 64, 32  # alignment 64: padding rows dominate, so the gather runs
    gen = torch.Generator().manual_seed(4)
    x0 = torch.randn(T, H, generator=gen).to(DT).to(DEV)
    idx = torch.randint(0, E, (T, K), generator=gen).to(DEV)
    w0 = torch.rand(T, K, generator=gen).to(DEV)
    up0 = (torch.randn(E, 2 * I, H, generator=gen) / 8).to(DT).to(DEV)
    down0 = (torch.randn(E, H, I, generator=gen) / 6).to(DT).to(DEV)
    grads = []
    calls = spy(monkeypatch)
    for recompute in (False, True):
        x, w, up, down = (t.clone().requires_grad_() for t in (x0, w0, up0, down0))
        out = experts_forward(x, idx, w, up, down, gate="silu", alignment=64, recompute_rows=recompute)
        out.float().square().sum().backward()
        grads.append((out.detach(), x.grad, w.grad, up.grad, down.grad))
        assert calls == ([False] if recompute else [])  # kept rows: dispatch; recomputed: h from the gather
    for a, b in zip(*grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


def test_custom_operators_compiled_fullgraph():
    """The gather-fused GEMMs as the custom operators torch.compile sees (their schemas and fakes):
    compiled with fullgraph, the same bits as eager. (The whole operator under torch.compile runs
    bf16 only, which the interpreter cannot: test_expert_mlp.py covers it on CUDA.)"""
    x, _, w, r, up, b = problem(31, bias=True)
    plan = r.plan
    sizes = (plan.top_k, plan.num_experts, plan.alignment, None)
    x, pk, w, up, b = (t.to(DEV) for t in (x, plan.packed, w, up, b))
    act = (KINDS["silu"], True, True, ALPHA, LIMIT)
    real = (plan.row_sources >= 0).to(DEV)

    def f(x, w, up, b):
        h = torch.ops.padmoe_experts.gather_up(x, pk, w, up, b, *sizes, False, *act, False, True)
        a = torch.ops.padmoe_experts.gather_up(x, pk, w, up, b, *sizes, False, *act, True, False)
        g = torch.ops.padmoe_experts.gather_wgrad(h, x, pk, w, up, *sizes, False)
        return h, a, g

    want = f(x, w, up, b)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, w, up, b)
    p = int(plan.padded_bins[-1])  # rows at or past P: unwritten
    assert torch.equal(got[0][:p], want[0][:p]) and torch.equal(got[2], want[2])
    assert torch.equal(got[1][real], want[1][real])  # padding rows of a: unwritten too


def test_operator_rows_of_x_checked_before_the_gather():
    """The gather-fused path reads x's rows through the plan without dispatch's checks: x with more
    or fewer rows than the routing's tokens is an error naming hidden_states, raised before any launch."""
    T, K, E, H, I = 10, 2, 4, 64, 32
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, E, (T, K), generator=gen).to(DEV)
    w = torch.rand(T, K, generator=gen).to(DEV)
    up = torch.randn(E, 2 * I, H, generator=gen).to(DT).to(DEV)
    down = torch.randn(E, H, I, generator=gen).to(DT).to(DEV)
    for rows in (T - 1, T + 1):
        x = torch.randn(rows, H, generator=gen).to(DT).to(DEV)
        with torch.no_grad(), pytest.raises(ValueError, match=rf"hidden_states: expected {T} rows .*got {rows}"):
            experts_forward(x, idx, w, up, down, gate="silu", alignment=64)
