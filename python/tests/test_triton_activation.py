"""The expert MLP's activation kernels (padmoe/_triton_activation.py) against float64 formulas: every
activation, gated side by side or interleaved and ungated, float32 and bfloat16, forward and backward;
rows at or past P neither read (NaN there changes nothing) nor written (a sentinel survives). On the
CPU in Triton's interpreter (TRITON_INTERPRET=1, a process of its own: scripts/pytest.sh), else on CUDA."""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from padmoe import _triton_activation as ta  # noqa: E402
from padmoe._triton_kernels import _interpreting  # noqa: E402
from padmoe.torch._expert_mlp import KINDS  # noqa: E402

if _interpreting():
    DEV = "cpu"
elif torch.cuda.is_available():
    DEV = "cuda"
else:
    pytest.skip("Triton kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1", allow_module_level=True)

ALPHA, LIMIT = 1.702, 2.5
SENTINEL = 123.0


def act64(kind, g):
    """(act(g), act'(g)) in float64, by the textbook formulas."""
    if kind == "silu":
        s = torch.sigmoid(g)
        return g * s, s + g * s * (1 - s)
    if kind == "gelu":
        c = 0.5 * (1 + torch.erf(g / math.sqrt(2)))
        return g * c, c + g * torch.exp(-g * g / 2) / math.sqrt(2 * math.pi)
    if kind == "gelu_tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (g + 0.044715 * g**3))
        return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)
    if kind == "relu":
        return torch.relu(g), (g > 0).double()
    if kind == "relu2":
        return torch.relu(g) ** 2, 2 * torch.relu(g)
    if kind == "sigmoid":
        s = torch.sigmoid(g)
        return s, s * (1 - s)
    if kind == "identity":
        return g, torch.ones_like(g)
    gc = g.clamp(max=LIMIT)
    s = torch.sigmoid(ALPHA * gc)
    return gc * s, torch.where(g <= LIMIT, s + ALPHA * gc * s * (1 - s), 0.0)


def reference(kind, h, ga, gated, interleaved):
    """(a, grad_h) in float64."""
    h, ga = h.double(), ga.double()
    if not gated:
        y, d = act64(kind, h)
        return y, ga * d
    n = h.shape[1] // 2
    g, u = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :n], h[:, n:])
    y, d = act64(kind, g)
    if kind == "clamped_swiglu":
        uu, mask = u.clamp(-LIMIT, LIMIT) + 1, ((u >= -LIMIT) & (u <= LIMIT)).double()
    else:
        uu, mask = u, torch.ones_like(u)
    grad_h = torch.empty_like(h)
    dg, du = (grad_h[:, 0::2], grad_h[:, 1::2]) if interleaved else (grad_h[:, :n], grad_h[:, n:])
    dg.copy_(ga * uu * d)
    du.copy_(ga * y * mask)
    return y * uu, grad_h


def launch(h, ga, offsets, kind, gated, interleaved, bias=None, row_experts=None, fold=None):
    """Both kernels into outputs pre-filled with SENTINEL: (a, grad_h, a recomputed); with ``fold =
    (row_sources, weights, assignments)`` the backward folds the router weights in (WEIGHTED) and a
    fourth item is its dots ``[assignments, column blocks]``."""
    width = ga.shape[1]
    a = torch.full((h.shape[0], width), SENTINEL, dtype=h.dtype, device=h.device)
    grad_h = torch.full_like(h, SENTINEL)
    a2 = torch.full_like(a, SENTINEL)
    br, bc, grid = ta.blocks(h.shape[0], width)
    meta = dict(BIAS=bias is not None, KIND=KINDS[kind], GATED=gated, INTERLEAVED=interleaved, BLOCK_R=br, BLOCK_C=bc)
    b, rx, sb = (h, h, 0) if bias is None else (bias, row_experts, bias.stride(0))
    e = offsets.shape[0]
    ta.act_forward_kernel[grid](h, a, offsets, b, rx, e, width, h.stride(0), a.stride(0), sb, ALPHA, LIMIT, **meta)
    src, wts, dots = h, h, h
    if fold is not None:
        src, wts, n = fold
        dots = torch.zeros(n, grid[1], dtype=torch.float32, device=h.device)
    ta.act_backward_kernel[grid](
        h, ga, grad_h, a2, offsets, b, rx, e, width, h.stride(0), ga.stride(0), grad_h.stride(0), a2.stride(0), sb,
        ALPHA, LIMIT, src, wts, dots, grid[1], WEIGHTED=fold is not None, **meta,
    )  # fmt: skip
    return (a, grad_h, a2) if fold is None else (a, grad_h, a2, dots)


FORMS = [(k, True, False) for k in KINDS if k not in ("swish", "gelu_pytorch_tanh")]
FORMS += [(k, True, True) for k in ("silu", "gelu_tanh", "clamped_swiglu", "relu2")]
FORMS += [(k, False, False) for k in ("silu", "gelu", "gelu_tanh", "relu", "relu2", "sigmoid", "identity")]


@pytest.mark.parametrize("kind, gated, interleaved", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_float64(kind, gated, interleaved, dtype):
    rows, width, p = 45, 40, 37  # a column tail (40 of a 64-wide block), rows past P
    gen = torch.Generator().manual_seed(len(kind) + 7 * gated + 3 * interleaved)
    n1 = 2 * width if gated else width
    h = (torch.randn(rows, n1, generator=gen) * 3).to(dtype)
    ga = torch.randn(rows, width, generator=gen).to(dtype)
    h[p:] = float("nan")  # never read
    ga[p:] = float("nan")
    offsets = torch.tensor([10, 10, 30, p], dtype=torch.int32)  # padded_bins: P = offsets[-1]
    want_a, want_gh = reference(kind, h[:p], ga[:p], gated, interleaved)
    a, grad_h, a2 = launch(h.to(DEV), ga.to(DEV), offsets.to(DEV), kind, gated, interleaved)
    for got, want in ((a, want_a), (a2, want_a), (grad_h, want_gh)):
        got = got.cpu()
        scale = max(want.abs().max().item(), 1.0)  # float32 formulas cancel: error relative to the largest
        tol = dict(rtol=1e-5, atol=1e-6 * scale) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3 * scale)
        torch.testing.assert_close(got[:p].double(), want.to(dtype).double(), **tol)
        assert (got[p:] == SENTINEL).all()  # rows at or past P not written
    assert torch.equal(a.cpu(), a2.cpu())  # the backward's recomputed output is the forward's, bit for bit


@pytest.mark.parametrize("kind, gated, interleaved", [("silu", True, False), ("clamped_swiglu", True, True),
                                                      ("gelu", False, False)])  # fmt: skip
def test_router_weights_folded_in(kind, gated, interleaved):
    """WEIGHTED: grad_a unweighted; each row's weight w_r = weights[row_sources[r]] (0 on padding rows,
    source -1) scales it before the derivative and scales the a written; dots[source] gets the row's
    <grad_a, a> by column block (their sum: the router weight's gradient); assignments without a row
    stay 0."""
    rows, width, p, n = 45, 300, 37, 50  # two column blocks (256 + a 44-column tail), rows past P
    gen = torch.Generator().manual_seed(11 + gated)
    n1 = 2 * width if gated else width
    h = torch.randn(rows, n1, generator=gen) * 2
    ga = torch.randn(rows, width, generator=gen)
    h[p:] = float("nan")
    ga[p:] = float("nan")
    offsets = torch.tensor([12, 20, 20, p], dtype=torch.int32)
    sources = torch.randperm(n, generator=gen)[:rows].to(torch.int32)
    sources[[3, 15, 30]] = -1  # padding rows
    weights = torch.rand(n, generator=gen)
    a_ref, gh_ref = reference(kind, h[:p], ga[:p], gated, interleaved)
    has = sources[:p] >= 0
    wr = torch.where(has, weights.double()[sources[:p].clamp(min=0).long()], 0.0)
    _, gh_w = reference(kind, h[:p], ga[:p] * wr[:, None], gated, interleaved)
    dots_ref = torch.zeros(n, dtype=torch.float64)
    dots_ref[sources[:p][has].long()] = (ga[:p].double() * a_ref).sum(1)[has]
    _, grad_h, a2, dots = launch(
        h.to(DEV), ga.to(DEV), offsets.to(DEV), kind, gated, interleaved,
        fold=(sources.to(DEV), weights.to(DEV), n),
    )  # fmt: skip
    scale = max(gh_w.abs().max().item(), 1.0)
    torch.testing.assert_close(grad_h.cpu()[:p].double(), gh_w, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(a2.cpu()[:p].double(), a_ref * wr[:, None], rtol=1e-5, atol=1e-5)
    assert (a2.cpu()[p:] == SENTINEL).all() and (grad_h.cpu()[p:] == SENTINEL).all()
    torch.testing.assert_close(dots.cpu().double().sum(1), dots_ref, rtol=1e-5, atol=1e-4)


def test_no_rows():
    h = torch.randn(16, 64).to(DEV)
    a, grad_h, _ = launch(
        h, torch.randn(16, 32).to(DEV), torch.zeros(3, dtype=torch.int32, device=DEV), "silu", True, False
    )
    assert (a.cpu() == SENTINEL).all() and (grad_h.cpu() == SENTINEL).all()


@pytest.mark.parametrize("kind, gated, interleaved", [("silu", True, False), ("clamped_swiglu", True, True),
                                                      ("gelu_tanh", False, False)])  # fmt: skip
def test_bias_added_as_h_is_read(kind, gated, interleaved):
    """With a bias, both passes act on h + bias[row_experts[r]] (float32), padding rows (expert -1)
    without it: the same as the kernels on h with the bias added beforehand in float64."""
    rows, width, p = 45, 40, 37
    gen = torch.Generator().manual_seed(17 + gated)
    n1 = 2 * width if gated else width
    h = torch.randn(rows, n1, generator=gen) * 2
    ga = torch.randn(rows, width, generator=gen)
    bias = torch.randn(3, n1, generator=gen)
    row_experts = torch.tensor(
        [0] * 8 + [-1] * 2 + [1] * 20 + [2] * 5 + [-1] * 2 + [-1] * (rows - p), dtype=torch.int32
    )
    offsets = torch.tensor([10, 30, p], dtype=torch.int32)
    table = torch.cat([bias.double(), torch.zeros(1, n1, dtype=torch.float64)])
    hb = h[:p].double() + table[row_experts[:p].long()]  # -1: the zero row
    want_a, want_gh = reference(kind, hb, ga[:p], gated, interleaved)
    a, grad_h, a2 = launch(*(t.to(DEV) for t in (h, ga, offsets)), kind, gated, interleaved, bias.to(DEV),
                           row_experts.to(DEV))  # fmt: skip
    for got, want in ((a, want_a), (a2, want_a), (grad_h, want_gh)):
        scale = max(want.abs().max().item(), 1.0)
        torch.testing.assert_close(got.cpu()[:p].double(), want, rtol=1e-5, atol=1e-6 * scale)
        assert (got.cpu()[p:] == SENTINEL).all()
