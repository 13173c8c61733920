"""make_plan's routing options from numpy and padmoe.torch: local experts
by range or map, dropped invalid ids, a fixed expert capacity with the position and probs drop
policies, the dropped count, and the row ops (with autograd) on plans with dropped assignments.
The reference is written here from docs/spec.md §4's words."""

import numpy as np
import pytest

import padmoe

try:
    import torch

    import padmoe.torch as pt
except ImportError:  # numpy-only installs
    torch = None


def ref_routed(
    top,
    num_experts,
    alignment,
    *,
    global_experts=0,
    first_expert=0,
    expert_map=None,
    drop_invalid=False,
    expert_capacity=None,
    drop_policy="position",
    probs=None,
):
    """The plan's arrays and the dropped count, from plain loops."""
    if drop_policy != "probs":
        probs = None
    top = np.asarray(top).reshape(-1)
    a_count, e_count = top.shape[0], num_experts
    g = global_experts or num_experts
    lists = [[] for _ in range(e_count)]
    for a, gid in enumerate(top):
        gid = int(gid)
        if gid < 0 or gid >= g:
            assert drop_invalid, "invalid id"
            continue
        local = (
            int(expert_map[gid])
            if expert_map is not None
            else (gid - first_expert if first_expert <= gid < first_expert + e_count else -1)
        )
        if local >= 0:
            lists[local].append(a)
    dropped = 0
    if expert_capacity is not None:
        for e, lst in enumerate(lists):
            if len(lst) > expert_capacity:
                dropped += len(lst) - expert_capacity
                if probs is not None:  # largest probs, ties to the lower id, then in id order
                    p = np.asarray(probs, dtype=np.float64).reshape(-1)
                    best = sorted(lst, key=lambda a: (-p[a], a))[:expert_capacity]
                    lists[e] = sorted(best)
                else:
                    lists[e] = lst[:expert_capacity]
    rows = e_count * expert_capacity if expert_capacity is not None else a_count + e_count * (alignment - 1)
    indices = np.full(a_count, -1)
    bin_ids = np.full(a_count, -1)
    dest = np.full(a_count, -1)
    sources = np.full(rows, -1)
    counts, bins, pcounts, pbins = [], [], [], []
    pos = row = 0
    for e, lst in enumerate(lists):
        for j, a in enumerate(lst):
            indices[pos + j], bin_ids[pos + j], dest[a], sources[row + j] = a, e, row + j, a
        seg = expert_capacity if expert_capacity is not None else -(-len(lst) // alignment) * alignment
        pos += len(lst)
        row += seg
        counts.append(len(lst))
        bins.append(pos)
        pcounts.append(seg)
        pbins.append(row)
    return dict(
        indices=indices,
        bin_ids=bin_ids,
        tokens_per_expert=np.array(counts),
        bins=np.array(bins),
        padded_tokens_per_expert=np.array(pcounts),
        padded_bins=np.array(pbins),
        dest_rows=dest,
        row_sources=sources,
    ), dropped


FIELDS = (
    "indices",
    "bin_ids",
    "tokens_per_expert",
    "bins",
    "padded_tokens_per_expert",
    "padded_bins",
    "dest_rows",
    "row_sources",
)


def as_np(v):
    return v.cpu().numpy() if torch is not None and isinstance(v, torch.Tensor) else np.asarray(v)


def assert_plan(plan, want):
    for f in FIELDS:
        np.testing.assert_array_equal(as_np(getattr(plan, f)), want[f], err_msg=f)


CASES = [
    dict(global_experts=16, first_expert=5),
    dict(global_experts=12, expert_map=np.array([-1, 3, -1, 0, 4, -1, -1, -1, 1, -1, -1, 2])),
    dict(drop_invalid=True),
    dict(expert_capacity=8),
    dict(expert_capacity=0),
    dict(expert_capacity=24, probs=True),
    dict(
        global_experts=12,
        expert_map=np.array([-1, 3, -1, 0, 4, -1, -1, -1, 1, -1, -1, 2]),
        drop_invalid=True,
        expert_capacity=16,
        probs=True,
    ),
]


def case_inputs(case, seed=0, tokens=211, top_k=3):
    rng = np.random.default_rng(seed)
    g = case.get("global_experts") or 5
    lo, hi = (-2, g + 1) if case.get("drop_invalid") else (0, g)
    top = rng.integers(lo, hi, size=(tokens, top_k)).astype(np.int32)
    # probs from a few values: ties at the threshold, broken by assignment id
    probs = (rng.integers(0, 6, size=(tokens, top_k)) / 8.0).astype(np.float32) if case.get("probs") else None
    return top, probs


def kwargs_of(case, probs):
    kw = {k: v for k, v in case.items() if k != "probs"}
    if probs is not None:
        kw.update(drop_policy="probs", probs=probs)
    return kw


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("alignment", [1, 4, 8])
def test_numpy_make_plan_options(case, alignment):
    c = CASES[case]
    if c.get("expert_capacity") is not None and c["expert_capacity"] % alignment:
        pytest.skip("alignment must divide the capacity")
    top, probs = case_inputs(c, seed=case)
    want, dropped = ref_routed(top, 5, alignment, **kwargs_of(c, probs))
    plan = padmoe.make_plan(top, 5, alignment, **kwargs_of(c, probs))
    assert_plan(plan, want)
    assert plan.padded_rows_bound == want["row_sources"].shape[0]
    if c.get("expert_capacity") is not None:
        assert int(plan.dropped[0]) == dropped
    # make_plan_layouts with the same options: the same plan, and its row layout
    plan2, row_experts, _, total = padmoe.make_plan_layouts(top, 5, alignment, **kwargs_of(c, probs))
    assert_plan(plan2, want)
    assert int(total[0]) == want["padded_bins"][-1]
    for r in range(want["padded_bins"][-1]):
        e = int(np.searchsorted(want["padded_bins"], r, side="right"))
        assert row_experts[r] == (e if want["row_sources"][r] >= 0 else -1)


def test_numpy_bad_options_are_named_errors():
    top = np.array([[0, 9], [3, 1]], dtype=np.int32)
    with pytest.raises(ValueError, match=r"make_plan: top_experts: expert id 9 at \[0, 1\] is outside \[0, 4\)"):
        padmoe.make_plan(top, 4, 1)
    with pytest.raises(ValueError, match=r"plan_options.expert_map: entry 2 is 7, outside \[-1, 4\)"):
        padmoe.make_plan(top, 4, 1, global_experts=10, expert_map=np.array([0, 1, 7, 2, 3, -1, -1, -1, -1, -1]))
    with pytest.raises(ValueError, match=r"plan_options.expert_capacity: alignment 4 must divide"):
        padmoe.make_plan(top, 4, 4, drop_invalid=True, expert_capacity=6)
    with pytest.raises(ValueError, match=r"plan_options.probs: the probs drop policy needs the router weights"):
        padmoe.make_plan(top, 4, 1, drop_invalid=True, expert_capacity=2, drop_policy="probs")
    with pytest.raises(ValueError, match=r"drop_policy: expected 'position' or 'probs'"):
        padmoe.make_plan(top, 4, 1, drop_policy="random")
    # dropped when asked
    plan = padmoe.make_plan(top, 4, 1, drop_invalid=True)
    np.testing.assert_array_equal(plan.dest_rows, [0, -1, 2, 1])


needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


def devices():
    out = ["cpu"]
    if torch is not None and torch.cuda.is_available() and padmoe.has_cuda():
        out.append("cuda")
    return out


@needs_torch
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(len(CASES)))
def test_torch_make_plan_options(device, case):
    c = CASES[case]
    top, probs = case_inputs(c, seed=10 + case, tokens=3000 if device == "cuda" else 211)
    want, dropped = ref_routed(top, 5, 4 if not c.get("expert_capacity") else 8, **kwargs_of(c, probs))
    m = 4 if not c.get("expert_capacity") else 8
    kw = kwargs_of(c, probs)
    if "expert_map" in kw:
        kw["expert_map"] = torch.as_tensor(kw["expert_map"], device=device)
    if "probs" in kw:
        kw["probs"] = torch.as_tensor(kw["probs"], device=device)
    t = torch.as_tensor(top, device=device)
    for check in (True, False):
        plan = pt.make_plan(t, 5, m, check=check, **kw)
        assert_plan(plan, want)
        if c.get("expert_capacity") is not None:
            assert plan.dropped.device == t.device and int(plan.dropped[0]) == dropped


@needs_torch
@pytest.mark.parametrize("device", devices())
def test_torch_routing_drops_contribute_nothing_with_gradients(device):
    rng = np.random.default_rng(3)
    tokens, k, h = 64, 2, 16
    top = torch.as_tensor(rng.integers(0, 10, size=(tokens, k)), device=device)
    w = torch.rand(tokens, k, dtype=torch.float64, device=device, requires_grad=True)
    x = torch.randn(tokens, h, dtype=torch.float64, device=device, requires_grad=True)
    r = pt.Routing.from_topk(top, w, 4, 4, global_experts=10, first_expert=3, expert_capacity=12, drop_policy="probs")
    want, dropped = ref_routed(
        top.cpu().numpy(),
        4,
        4,
        global_experts=10,
        first_expert=3,
        expert_capacity=12,
        drop_policy="probs",
        probs=w.detach().float().cpu().numpy(),
    )
    assert_plan(r.plan, want)
    assert int(r.plan.dropped[0]) == dropped > 0
    scale = torch.arange(1, r.padded_rows_bound + 1, dtype=torch.float64, device=device)[:, None]
    out = r.combine(r.dispatch(x) * scale)
    # reference: out[t] = sum over kept k of w * x[t] * (dest + 1)
    dest = torch.as_tensor(want["dest_rows"], device=device).view(tokens, k)
    kept = (dest >= 0).to(torch.float64)
    factor = (w * kept * (dest.clamp(min=0) + 1)).sum(1, keepdim=True)
    torch.testing.assert_close(out, x * factor)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    gx_ref, gw_ref = torch.autograd.grad(x * factor, (x, w), g)
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gw, gw_ref)
    assert torch.all(gw[dest < 0] == 0)


@needs_torch
def test_torch_routed_plan_compiles_without_graph_breaks():
    top = torch.tensor([[0, 3], [5, 1], [2, 2], [7, 4]], dtype=torch.int32)
    w = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.9, 0.5], [0.6, 0.7]])
    x = torch.randn(4, 8)

    def block(x, top, w):
        r = pt.Routing.from_topk(top, w, 8, 1, expert_capacity=1, drop_policy="probs")
        return r.combine(r.dispatch(x) * 2)

    eager = block(x, top, w)
    compiled = torch.compile(block, fullgraph=True)(x, top, w)
    torch.testing.assert_close(compiled, eager)
    # expert 2 keeps only assignment 4 (prob .9 over .5): token 2 gets one copy
    torch.testing.assert_close(eager[2], 2 * w[2, 0] * x[2])


# ---------------------------------------------------------------------------
# PlanOptions: the routing options as one value, the same plans and errors as the keywords
# ---------------------------------------------------------------------------


def assert_same_plan(a, b):
    for f in FIELDS:
        np.testing.assert_array_equal(as_np(getattr(a, f)), as_np(getattr(b, f)), err_msg=f)
    assert (a.num_tokens, a.top_k, a.num_experts, a.alignment) == (b.num_tokens, b.top_k, b.num_experts, b.alignment)
    assert a.expert_capacity == b.expert_capacity
    assert (a.dropped is None) == (b.dropped is None)
    if a.dropped is not None:
        assert int(a.dropped[0]) == int(b.dropped[0])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_numpy_plan_options_give_the_keywords_plans(case):
    c = CASES[case]
    top, probs = case_inputs(c, seed=20 + case)
    m = 8 if c.get("expert_capacity") else 4
    kw = kwargs_of(c, probs)
    options = padmoe.PlanOptions(**kw)
    assert_same_plan(padmoe.make_plan(top, 5, m, options=options), padmoe.make_plan(top, 5, m, **kw))
    got = padmoe.make_plan_layouts(top, 5, m, options=options)
    want = padmoe.make_plan_layouts(top, 5, m, **kw)
    assert_same_plan(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g, w)


def test_plan_options_defaults_give_the_plain_plan():
    top = np.array([[0, 3], [2, 1], [3, 3]], dtype=np.int32)
    assert not padmoe.PlanOptions().routed
    assert_same_plan(padmoe.make_plan(top, 4, 4, options=padmoe.PlanOptions()), padmoe.make_plan(top, 4, 4))
    with pytest.raises(Exception):  # frozen
        padmoe.PlanOptions().expert_capacity = 4
    with pytest.raises(TypeError):  # keywords only, as make_plan's
        padmoe.PlanOptions(None, 0)


BAD_OPTIONS = [
    (dict(global_experts=10, expert_map=np.array([0, 1, 7, 2, 3, -1, -1, -1, -1, -1])), r"expert_map: entry 2 is 7"),
    (dict(drop_invalid=True, expert_capacity=6), r"expert_capacity: alignment 4 must divide"),
    (dict(drop_invalid=True, expert_capacity=4, drop_policy="probs"), r"probs: the probs drop policy needs"),
    (dict(drop_policy="random"), r"drop_policy: expected 'position' or 'probs'"),
    (dict(expert_capacity=-4), r"expert_capacity"),
    (dict(first_expert=-1), r"first_expert"),
]


@pytest.mark.parametrize("bad", range(len(BAD_OPTIONS)))
def test_bad_plan_options_raise_the_keywords_errors(bad):
    kw, match = BAD_OPTIONS[bad]
    top = np.array([[0, 3], [2, 1]], dtype=np.int32)
    with pytest.raises(ValueError, match=match) as by_keywords:
        padmoe.make_plan(top, 4, 4, **kw)
    with pytest.raises(ValueError) as by_options:
        padmoe.make_plan(top, 4, 4, options=padmoe.PlanOptions(**kw))
    assert str(by_options.value) == str(by_keywords.value)
    if torch is None:
        return
    tkw = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    tt = torch.as_tensor(top)
    with pytest.raises(ValueError, match=match) as by_keywords:
        pt.make_plan(tt, 4, 4, **tkw)
    with pytest.raises(ValueError) as by_options:
        pt.make_plan(tt, 4, 4, options=pt.PlanOptions(**tkw))
    assert str(by_options.value) == str(by_keywords.value)
    if "probs" in match:
        return  # from_topk ranks by its weights
    with pytest.raises(ValueError) as by_keywords:
        pt.Routing.from_topk(tt, None, 4, 4, **tkw)
    with pytest.raises(ValueError) as by_options:
        pt.Routing.from_topk(tt, None, 4, 4, options=pt.PlanOptions(**tkw))
    assert str(by_options.value) == str(by_keywords.value)


def test_plan_options_and_keywords_not_both():
    top = np.array([[0, 3], [2, 1]], dtype=np.int32)
    with pytest.raises(ValueError, match="make_plan: options: .* not both"):
        padmoe.make_plan(top, 4, 4, drop_invalid=True, options=padmoe.PlanOptions(expert_capacity=4))
    with pytest.raises(TypeError, match="make_plan: options: expected a padmoe.PlanOptions, got dict"):
        padmoe.make_plan(top, 4, 4, options={"expert_capacity": 4})
    if torch is None:
        return
    tt = torch.as_tensor(top)
    with pytest.raises(ValueError, match="make_plan: options: .* not both"):
        pt.make_plan(tt, 4, 4, expert_capacity=4, options=pt.PlanOptions(drop_invalid=True))
    with pytest.raises(ValueError, match="Routing.from_topk: options: .* not both"):
        pt.Routing.from_topk(tt, None, 4, 4, drop_invalid=True, options=pt.PlanOptions(drop_invalid=True))


@needs_torch
@pytest.mark.parametrize("case", range(len(CASES)))
def test_torch_plan_options_give_the_keywords_plans(case):
    assert pt.PlanOptions is padmoe.PlanOptions
    c = CASES[case]
    top, probs = case_inputs(c, seed=30 + case)
    m = 8 if c.get("expert_capacity") else 4
    kw = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs_of(c, probs).items()}
    t = torch.as_tensor(top)
    options = pt.PlanOptions(**kw)
    assert_same_plan(pt.make_plan(t, 5, m, options=options), pt.make_plan(t, 5, m, **kw))
    # Routing.from_topk: the keywords it has (its weights are the probs)
    w = torch.as_tensor(probs) if probs is not None else torch.rand(top.shape)
    rkw = {k: v for k, v in kw.items() if k != "probs"}
    want = pt.Routing.from_topk(t, w, 5, m, **rkw)
    got = pt.Routing.from_topk(t, w, 5, m, options=pt.PlanOptions(**rkw))
    assert_same_plan(got.plan, want.plan)
    # the options' probs rank in place of the weights
    if probs is not None:
        got = pt.Routing.from_topk(t, torch.rand(top.shape), 5, m, options=options)
        assert_same_plan(got.plan, want.plan)
    # the plain plan through options
    plain = pt.Routing.from_topk(t % 5, w, 5, m, options=pt.PlanOptions())
    assert_same_plan(plain.plan, pt.Routing.from_topk(t % 5, w, 5, m).plan)
    assert plain.plan.packed.data_ptr() != 0 and plain.plan.expert_capacity is None
