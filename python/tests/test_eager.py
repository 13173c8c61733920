"""Tests of padmoe.reference (the plain-PyTorch ops) against plain-Python loops in float64.

The reference loops below are written straight from docs/spec.md §3-§7 and share no
code with eager.py (dest_rows, for instance, comes from walking the experts in order,
not from a sort). eager.py is loaded from its file (its Plan type comes from the
installed padmoe).

Tolerances: moves without weights must be bitwise equal; a weighted move may differ from
the float64 product by the float32 product's rounding plus the cast to the row dtype;
sums over k and dot products by float32 accumulation (a bound proportional to the sum of
|terms|) plus the final cast. Padding rows must be exactly zero. A separate bitwise test
checks "float32, ascending k, cast once" for the k-sums against a float32 loop.

Run: python -m pytest python/tests/test_eager.py -q (skipped without torch)
"""

import importlib.util
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

_EAGER_PATH = pathlib.Path(__file__).resolve().parents[1] / "padmoe" / "reference.py"
_spec = importlib.util.spec_from_file_location("padmoe_eager_under_test", _EAGER_PATH)
eager = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eager)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# unit roundoff of each row dtype
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# absolute slack for results that underflow (half of the smallest subnormal, rounded up)
TINY = {torch.float32: 1e-44, torch.float16: 2.0**-24, torch.bfloat16: 1e-39}
U32 = 2.0**-24

# (T, E, K, H, alignment, routing): "distinct" = K distinct experts per token drawn from a
# random subset of the experts (so some experts are empty); "any" = ids drawn with
# repetition (a token may pick one expert twice: make_plan allows it); "one" = every
# token on expert E-1 only (all other experts empty).
CASES = [
    (1, 1, 1, 1, 1, "distinct"),
    (7, 3, 2, 5, 4, "distinct"),
    (64, 9, 4, 33, 8, "distinct"),
    (33, 8, 2, 16, 1, "distinct"),
    (50, 9, 3, 17, 4, "any"),
    (20, 6, 1, 33, 8, "distinct"),
    (13, 5, 2, 7, 8, "one"),
    (0, 4, 2, 8, 4, "distinct"),
]
CASE_IDS = [f"T{c[0]}-E{c[1]}-K{c[2]}-H{c[3]}-m{c[4]}-{c[5]}" for c in CASES]


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


def make_routing(case, seed=0, index_dtype=torch.int32):
    T, E, K, H, m, kind = case
    g = torch.Generator().manual_seed(seed)
    if kind == "distinct":
        active = max(K, (E + 1) // 2)  # leave about half the experts empty
        subset = torch.randperm(E, generator=g)[:active]
        rows = [subset[torch.randperm(active, generator=g)[:K]] for _ in range(T)]
        top = torch.stack(rows) if T else torch.zeros(0, K, dtype=torch.long)
    elif kind == "any":
        top = torch.randint(0, E, (T, K), generator=g)
    else:
        top = torch.full((T, K), E - 1, dtype=torch.long)
    return top.to(index_dtype)


def rand_rows(n, h, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=g).to(dtype).to(device)


def rand_weights(a, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(a, generator=g) * 1.5 + 0.05).to(dtype).to(device)


# ---------------------------------------------------------------------------
# the reference loops (float64, plain Python)
# ---------------------------------------------------------------------------


def round_up(c, m):
    return c if c % m == 0 else c + m - c % m


def ref_plan(top, E, m):
    """top: list of T lists of K ints."""
    T = len(top)
    K = len(top[0]) if T else 0
    flat = [e for row in top for e in row]
    A = len(flat)
    indices = sorted(range(A), key=lambda a: flat[a])  # Python's sort is stable
    bin_ids = [flat[a] for a in indices]
    tpe = [0] * E
    for e in flat:
        tpe[e] += 1
    bins, padded_tpe, padded_bins = [], [], []
    run = prun = 0
    for e in range(E):
        run += tpe[e]
        bins.append(run)
        padded_tpe.append(round_up(tpe[e], m))
        prun += padded_tpe[e]
        padded_bins.append(prun)
    # dest_rows by walking each expert's assignments in ascending id (no sort involved)
    dest_rows = [-1] * A
    capacity = A + E * (m - 1)
    row_sources = [-1] * capacity
    start = 0
    for e in range(E):
        row = start
        for a in range(A):
            if flat[a] == e:
                dest_rows[a] = row
                row_sources[row] = a
                row += 1
        start += padded_tpe[e]
    return dict(
        indices=indices,
        bin_ids=bin_ids,
        tokens_per_expert=tpe,
        bins=bins,
        padded_tokens_per_expert=padded_tpe,
        padded_bins=padded_bins,
        dest_rows=dest_rows,
        row_sources=row_sources,
        P=prun,
        K=K,
        T=T,
    )


def ref_gather(x, plan, w=None):
    """y[dest_rows[a]] = x[a // K] * w[a]; returns (y, P, padding row ids)."""
    H = len(x[0]) if x else 0
    K = plan["K"]
    y = [[0.0] * H for _ in range(plan["P"])]
    for a, row in enumerate(plan["dest_rows"]):
        scale = 1.0 if w is None else w[a]
        y[row] = [v * scale for v in x[a // K]]
    padding = [p for p in range(plan["P"]) if plan["row_sources"][p] < 0]
    return y, padding


def ref_scatter(y, plan, w, H):
    """out[t] = sum_k w[a] * y[dest_rows[a]]; also the sum of |terms| per element."""
    T, K = plan["T"], plan["K"]
    out = [[0.0] * H for _ in range(T)]
    mag = [[0.0] * H for _ in range(T)]
    for t in range(T):
        for k in range(K):
            a = t * K + k
            scale = 1.0 if w is None else w[a]
            src = y[plan["dest_rows"][a]]
            for h in range(H):
                out[t][h] += scale * src[h]
                mag[t][h] += abs(scale * src[h])
    return out, mag


def ref_dots(rows, plan, tok):
    """dots[a] = sum_h rows[dest_rows[a]][h] * tok[a // K][h]; also sum of |terms|."""
    K = plan["K"]
    dots, mag = [], []
    for a, row in enumerate(plan["dest_rows"]):
        s = m = 0.0
        for u, v in zip(rows[row], tok[a // K]):
            s += u * v
            m += abs(u * v)
        dots.append(s)
        mag.append(m)
    return dots, mag


def ref_pad(h, tpe, m):
    H = len(h[0]) if h else 0
    padded, pmap, offsets = [], [], []
    src = 0
    for c in tpe:
        for j in range(c):
            padded.append(list(h[src + j]))
            pmap.append(src + j)
        for _ in range(round_up(c, m) - c):
            padded.append([0.0] * H)
            pmap.append(-1)
        src += c
        offsets.append(len(padded))
    return padded, pmap, offsets


def ref_unpad(padded, pmap, n, H, probs=None):
    out = [[0.0] * H for _ in range(n)]
    for p, dst in enumerate(pmap):
        if dst >= 0:
            scale = 1.0 if probs is None else probs[dst]
            out[dst] = [v * scale for v in padded[p]]
    return out


def ref_unpad_backward(grad_out, padded, pmap, H, probs=None):
    grad_padded = [[0.0] * H for _ in pmap]
    grad_probs = [0.0] * len(grad_out)
    mag = [0.0] * len(grad_out)
    for p, n in enumerate(pmap):
        if n < 0:
            continue
        scale = 1.0 if probs is None else probs[n]
        grad_padded[p] = [v * scale for v in grad_out[n]]
        grad_probs[n] = sum(u * v for u, v in zip(grad_out[n], padded[p]))
        mag[n] = sum(abs(u * v) for u, v in zip(grad_out[n], padded[p]))
    return grad_padded, grad_probs, mag


# ---------------------------------------------------------------------------
# comparison helpers
# ---------------------------------------------------------------------------


def as_list(t):
    return t.detach().cpu().double().tolist()


def check_exact(got, ref, what):
    ref_t = torch.tensor(ref, dtype=torch.float64).reshape(got.shape)
    assert torch.equal(got.cpu().double(), ref_t), f"{what}: not bitwise equal to the reference"


def check_within(got, ref, what, dtype, extra=None, rel_units=1.0):
    """|got - ref| <= rel_units * u(dtype) * |ref| + extra + tiny, elementwise."""
    g = got.detach().cpu().double()
    r = torch.tensor(ref, dtype=torch.float64).reshape(g.shape)
    bound = rel_units * UNIT[dtype] * r.abs() + TINY[dtype]
    if extra is not None:
        bound = bound + torch.tensor(extra, dtype=torch.float64).reshape(g.shape)
    err = (g - r).abs()
    bad = (err > bound) | torch.isnan(g)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off, first at "
        f"{tuple(bad.nonzero()[0].tolist())}: got {g[bad][0].item()!r}, "
        f"want {r[bad][0].item()!r}"
    )


def check_padding_zero(y, padding, what):
    if padding:
        rows = y[torch.tensor(padding, dtype=torch.long, device=y.device)]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{what}: a padding row is not zero"
        # bitwise: no -0.0 either
        assert not torch.signbit(rows).any(), f"{what}: a padding row holds -0.0"


def plan_args(plan):
    return plan.indices, plan.bin_ids, plan.bins, plan.padded_bins


# ---------------------------------------------------------------------------
# 1. make_plan
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_make_plan(case, index_dtype, device):
    T, E, K, H, m, _ = case
    top = make_routing(case, seed=1, index_dtype=index_dtype)
    ref = ref_plan(top.tolist(), E, m)
    plan = eager.make_plan(top.to(device), E, m)
    for field in (
        "indices",
        "bin_ids",
        "tokens_per_expert",
        "bins",
        "padded_tokens_per_expert",
        "padded_bins",
        "dest_rows",
        "row_sources",
    ):
        got = getattr(plan, field)
        assert got.dtype == torch.int32, f"{field}: dtype {got.dtype}"
        assert got.device.type == device, f"{field}: on {got.device}"
        assert got.cpu().tolist() == ref[field], f"{field}: {got.cpu().tolist()} != {ref[field]}"
    assert (plan.num_tokens, plan.top_k, plan.num_experts, plan.alignment) == (T, K, E, m)
    assert plan.padded_rows_bound == T * K + E * (m - 1) == len(ref["row_sources"])


def test_make_plan_stable_on_ties():
    # every assignment on one expert: a stable sort keeps ascending assignment ids
    top = torch.full((40, 3), 2, dtype=torch.int32)
    plan = eager.make_plan(top, 4, 1)
    assert plan.indices.tolist() == list(range(120))
    assert plan.dest_rows.tolist() == list(range(120))


# ---------------------------------------------------------------------------
# 2. MegaBlocks family
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("op", ["padded_gather", "dispatch"])
def test_gather_and_dispatch(op, case, dtype, weighted, device):
    T, E, K, H, m, _ = case
    top = make_routing(case, seed=2)
    ref_p = ref_plan(top.tolist(), E, m)
    plan = eager.make_plan(top.to(device), E, m)
    x = rand_rows(T, H, dtype, seed=3, device=device)
    w = rand_weights(T * K, seed=4, device=device) if weighted else None
    if op == "padded_gather":
        y = eager.padded_gather(x, *plan_args(plan), K, w)
    else:
        y = eager.dispatch(x, plan, w)
    assert y.shape == (ref_p["P"], H) and y.dtype == dtype and y.device.type == device
    ref, padding = ref_gather(as_list(x), ref_p, None if w is None else as_list(w))
    if weighted:  # float32 product, then one cast to the row dtype
        check_within(y, ref, op, dtype, rel_units=1.0 + 2.0 * U32 / UNIT[dtype])
    else:
        check_exact(y, ref, op)
    check_padding_zero(y, padding, op)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("op", ["padded_scatter", "combine"])
def test_scatter_and_combine(op, case, dtype, weighted, device):
    T, E, K, H, m, _ = case
    top = make_routing(case, seed=5)
    ref_p = ref_plan(top.tolist(), E, m)
    plan = eager.make_plan(top.to(device), E, m)
    # y with garbage (NaN) in the padding rows: they must never be read
    y = rand_rows(ref_p["P"], H, dtype, seed=6, device=device)
    padding = [p for p in range(ref_p["P"]) if ref_p["row_sources"][p] < 0]
    if padding:
        y[torch.tensor(padding, device=device)] = float("nan")
    w = rand_weights(T * K, seed=7, device=device) if weighted else None
    if op == "padded_scatter":
        out = eager.padded_scatter(y, plan.indices, plan.bin_ids, w, plan.bins, plan.padded_bins, K)
    else:
        out = eager.combine(y, plan, w)
    assert out.shape == (T, H) and out.dtype == dtype and out.device.type == device
    ref, mag = ref_scatter(as_list(y), ref_p, None if w is None else as_list(w), H)
    extra = [[(K + 1) * U32 * v for v in row] for row in mag]
    check_within(out, ref, op, dtype, extra=extra)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["padded_scatter", "combine", "dispatch_backward"])
def test_k_sum_is_float32_ascending_cast_once(op, dtype, weighted):
    """Bitwise: acc = 0f; for k ascending: acc += f32(w) * f32(y); out = cast(acc)."""
    case = (48, 7, 4, 29, 4, "distinct")
    T, E, K, H, m, _ = case
    top = make_routing(case, seed=8)
    plan = eager.make_plan(top, E, m)
    P = int(plan.padded_bins[-1])
    # values spread over many magnitudes so that order and precision matter
    g = torch.Generator().manual_seed(9)
    y = (torch.randn(P, H, generator=g) * torch.exp2(torch.randint(-12, 12, (P, H), generator=g).float())).to(dtype)
    w = rand_weights(T * K, seed=10) if weighted else None
    if op == "padded_scatter":
        out = eager.padded_scatter(y, plan.indices, plan.bin_ids, w, plan.bins, plan.padded_bins, K)
    elif op == "combine":
        out = eager.combine(y, plan, w)
    else:
        x = rand_rows(T, H, dtype, seed=11)
        out, _ = eager.dispatch_backward(y, x, plan, w)
    y32 = y.float().numpy()
    w32 = None if w is None else w.numpy()
    dest = plan.dest_rows.tolist()
    acc = np.zeros((T, H), dtype=np.float32)
    for t in range(T):
        for k in range(K):
            a = t * K + k
            term = y32[dest[a]] if w32 is None else y32[dest[a]] * w32[a]  # float32 product
            acc[t] = acc[t] + term  # float32 add, ascending k
    want = torch.from_numpy(acc).to(dtype)  # one cast
    assert torch.equal(out, want), f"{op}: {int((out != want).sum())} elements differ bitwise"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_padded_scatter_wgrad(case, dtype, device):
    T, E, K, H, m, _ = case
    top = make_routing(case, seed=12)
    ref_p = ref_plan(top.tolist(), E, m)
    plan = eager.make_plan(top.to(device), E, m)
    y = rand_rows(ref_p["P"], H, dtype, seed=13, device=device)
    grad = rand_rows(T, H, dtype, seed=14, device=device)
    wgrad = eager.padded_scatter_wgrad(y, grad, *plan_args(plan), K)
    assert wgrad.shape == (T * K,) and wgrad.dtype == dtype
    ref, mag = ref_dots(as_list(y), ref_p, as_list(grad))
    check_within(wgrad, ref, "wgrad", dtype, extra=[(H + 1) * U32 * v for v in mag])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights_dtype", [None, "float32", "rows"], ids=["unweighted", "w-f32", "w-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_combine_backward(case, dtype, weights_dtype, device):
    weighted = weights_dtype is not None
    T, E, K, H, m, _ = case
    top = make_routing(case, seed=15)
    ref_p = ref_plan(top.tolist(), E, m)
    plan = eager.make_plan(top.to(device), E, m)
    y = rand_rows(ref_p["P"], H, dtype, seed=16, device=device)
    grad_out = rand_rows(T, H, dtype, seed=17, device=device)
    wdt = torch.float32 if weights_dtype == "float32" else dtype
    w = rand_weights(T * K, seed=18, dtype=wdt, device=device) if weighted else None
    grad_y, grad_w = eager.combine_backward(grad_out, y, plan, w)
    assert grad_y.shape == (ref_p["P"], H) and grad_y.dtype == dtype
    ref_gy, padding = ref_gather(as_list(grad_out), ref_p, None if w is None else as_list(w))
    if weighted:
        check_within(grad_y, ref_gy, "grad_y", dtype, rel_units=1.0 + 2.0 * U32 / UNIT[dtype])
    else:
        check_exact(grad_y, ref_gy, "grad_y")
    check_padding_zero(grad_y, padding, "grad_y")
    if not weighted:
        assert grad_w is None
        return
    assert grad_w.shape == (T * K,) and grad_w.dtype == wdt
    ref_gw, mag = ref_dots(as_list(y), ref_p, as_list(grad_out))
    check_within(grad_w, ref_gw, "grad_weights", wdt, extra=[(H + 1) * U32 * v for v in mag])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_dispatch_backward(case, dtype, weighted, device):
    T, E, K, H, m, _ = case
    top = make_routing(case, seed=19)
    ref_p = ref_plan(top.tolist(), E, m)
    plan = eager.make_plan(top.to(device), E, m)
    grad_y = rand_rows(ref_p["P"], H, dtype, seed=20, device=device)
    padding = [p for p in range(ref_p["P"]) if ref_p["row_sources"][p] < 0]
    if padding:  # never read
        grad_y[torch.tensor(padding, device=device)] = float("nan")
    x = rand_rows(T, H, dtype, seed=21, device=device)
    w = rand_weights(T * K, seed=22, device=device) if weighted else None
    grad_x, grad_w = eager.dispatch_backward(grad_y, x, plan, w)
    assert grad_x.shape == (T, H) and grad_x.dtype == dtype
    ref_gx, mag = ref_scatter(as_list(grad_y), ref_p, None if w is None else as_list(w), H)
    check_within(grad_x, ref_gx, "grad_x", dtype, extra=[[(K + 1) * U32 * v for v in r] for r in mag])
    if not weighted:
        assert grad_w is None
        return
    assert grad_w.shape == (T * K,) and grad_w.dtype == torch.float32
    ref_gw, mag = ref_dots(as_list(grad_y), ref_p, as_list(x))
    check_within(grad_w, ref_gw, "grad_weights", torch.float32, extra=[(H + 1) * U32 * v for v in mag])


# ---------------------------------------------------------------------------
# 3. Megatron family
# ---------------------------------------------------------------------------

# (tokens_per_expert, extra rows of h past the valid ones, H, alignment)
PAD_CASES = [
    ([3, 0, 5, 1], 0, 7, 4),
    ([0, 0, 0], 2, 5, 8),
    ([16, 8], 3, 33, 8),
    ([1], 0, 1, 1),
    ([2, 9, 0, 0, 4, 7, 1, 0, 3], 5, 17, 8),
    ([5, 5, 5], 0, 16, 1),
]
PAD_IDS = [f"tpe{'-'.join(map(str, c[0]))}-x{c[1]}-H{c[2]}-m{c[3]}" for c in PAD_CASES]


def _pad_inputs(case, dtype, device, seed):
    tpe, extra, H, m = case
    n = sum(tpe) + extra
    h = rand_rows(n, H, dtype, seed=seed, device=device)
    return h, torch.tensor(tpe, dtype=torch.int32, device=device), H, m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAD_CASES, ids=PAD_IDS)
def test_pad_to_alignment(case, dtype, device):
    h, tpe, H, m = _pad_inputs(case, dtype, device, seed=23)
    padded, pmap, offsets = eager.pad_to_alignment(h, tpe, m)
    ref_padded, ref_map, ref_offsets = ref_pad(as_list(h), case[0], m)
    assert padded.dtype == dtype and padded.shape == (len(ref_map), H)
    assert pmap.dtype == torch.int32 and offsets.dtype == torch.int32
    assert pmap.cpu().tolist() == ref_map
    assert offsets.cpu().tolist() == ref_offsets
    if ref_padded:
        check_exact(padded, ref_padded, "padded")
    check_padding_zero(padded, [p for p, s in enumerate(ref_map) if s < 0], "padded")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True], ids=["plain", "probs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAD_CASES, ids=PAD_IDS)
def test_unpad_from_alignment(case, dtype, with_probs, device):
    tpe, extra, H, m = case
    h, tpe_t, _, _ = _pad_inputs(case, dtype, device, seed=24)
    _, ref_map, _ = ref_pad(as_list(h), tpe, m)
    # padded input with NaN garbage in the padding rows (never read)
    padded = rand_rows(len(ref_map), H, dtype, seed=25, device=device)
    pmap = torch.tensor(ref_map, dtype=torch.int32, device=device)
    if (pmap < 0).any():
        padded[pmap < 0] = float("nan")
    n = h.shape[0]  # includes rows no entry names: they must come back zero
    probs = rand_weights(n, seed=26, device=device) if with_probs else None
    out = eager.unpad_from_alignment(padded, pmap, n, probs)
    assert out.shape == (n, H) and out.dtype == dtype
    ref = ref_unpad(as_list(padded), ref_map, n, H, None if probs is None else as_list(probs))
    if with_probs:
        check_within(out, ref, "unpad", dtype, rel_units=1.0 + 2.0 * U32 / UNIT[dtype])
    else:
        check_exact(out, ref, "unpad")
    named = set(s for s in ref_map if s >= 0)
    check_padding_zero(out, [r for r in range(n) if r not in named], "unpad (unnamed rows)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAD_CASES, ids=PAD_IDS)
def test_pad_unpad_round_trip(case, dtype, device):
    h, tpe, H, m = _pad_inputs(case, dtype, device, seed=27)
    padded, pmap, _ = eager.pad_to_alignment(h, tpe, m)
    valid = sum(case[0])
    out = eager.unpad_from_alignment(padded, pmap, valid)
    assert torch.equal(out, h[:valid])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True], ids=["plain", "probs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAD_CASES, ids=PAD_IDS)
def test_unpad_from_alignment_backward(case, dtype, with_probs, device):
    tpe, extra, H, m = case
    h, _, _, _ = _pad_inputs(case, dtype, device, seed=28)
    _, ref_map, _ = ref_pad(as_list(h), tpe, m)
    n = h.shape[0]
    padded = rand_rows(len(ref_map), H, dtype, seed=29, device=device)
    pmap = torch.tensor(ref_map, dtype=torch.int32, device=device)
    grad_out = rand_rows(n, H, dtype, seed=30, device=device)
    probs = rand_weights(n, seed=31, device=device) if with_probs else None
    grad_padded, grad_probs = eager.unpad_from_alignment_backward(grad_out, padded, pmap, probs)
    assert grad_padded.shape == padded.shape and grad_padded.dtype == dtype
    ref_gp, ref_gprobs, mag = ref_unpad_backward(
        as_list(grad_out), as_list(padded), ref_map, H, None if probs is None else as_list(probs)
    )
    if ref_gp:
        if with_probs:
            check_within(grad_padded, ref_gp, "grad_padded", dtype, rel_units=1.0 + 2.0 * U32 / UNIT[dtype])
        else:
            check_exact(grad_padded, ref_gp, "grad_padded")
    check_padding_zero(grad_padded, [p for p, s in enumerate(ref_map) if s < 0], "grad_padded")
    if not with_probs:
        assert grad_probs is None
        return
    assert grad_probs.shape == (n,) and grad_probs.dtype == torch.float32
    check_within(grad_probs, ref_gprobs, "grad_probs", torch.float32, extra=[(H + 1) * U32 * v for v in mag])
