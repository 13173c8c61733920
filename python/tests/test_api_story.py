"""One API story: padmoe (numpy, and torch tensors where padmoe.torch has the same function) and
padmoe.torch agree on names, argument order, defaults and results; the old spellings are
deprecated aliases that still work; the package keeps its layout rules. docs/python.md's table
is checked against the code here too."""

import ast
import inspect
import pathlib
import re

import numpy as np
import pytest

import padmoe
from conftest import random_top_experts

torch = pytest.importorskip("torch")
pt = pytest.importorskip("padmoe.torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "padmoe"
NUMPY_ONLY_KEYWORDS = {"out", "rows", "num_threads", "workspace", "stream"}
TORCH_ONLY_KEYWORDS = {"backend", "dtype"}  # backend: the Triton kernels; dtype: deprecated spelling of fp8


def shared_functions():
    names = sorted(set(padmoe.__all__) & set(pt.__all__))
    return [n for n in names if inspect.isfunction(getattr(padmoe, n))]


def test_the_shared_functions_are_the_ones_expected():
    assert set(padmoe.__all__) - set(pt.__all__) == {
        "copy",
        "has_cuda",
        "tile_config",
        "quantize",
        "make_plan_layouts",
        "__version__",
    }
    assert set(shared_functions()) >= {
        "dispatch_backward",
        "combine_backward",
        "padded_gather_backward",
        "padded_scatter_backward",
        "unpad_from_alignment_backward",
        "make_plan",
        "make_plan_and_dispatch",
        "dispatch",
        "dispatch_scaled",
        "dispatch_quantized",
        "combine",
        "padded_gather",
        "padded_gather_scaled",
        "padded_scatter",
        "padded_scatter_wgrad",
        "pad_to_alignment",
        "pad_to_alignment_scaled",
        "unpad_from_alignment",
        "unpad_from_alignment_scaled",
        "sort_chunks",
        "unsort_chunks",
        "moe_align_block_size",
        "padded_rows_bound",
        "sort_chunks_rows_bound",
        "aligned_rows_bound",
        "workspace_bound",
    }


@pytest.mark.parametrize("name", shared_functions())
def test_same_arguments_order_and_defaults(name):
    """Every argument of padmoe.torch.<name> is padmoe.<name>'s, in the same order, of the same kind,
    with the same default; padmoe adds only its keyword-only buffer and threading options."""
    np_params = inspect.signature(getattr(padmoe, name)).parameters
    pt_params = inspect.signature(getattr(pt, name)).parameters
    common = [p for p in pt_params if p not in TORCH_ONLY_KEYWORDS]
    assert [p for p in np_params if p in pt_params] == common, name
    for p in common:
        a, b = np_params[p], pt_params[p]
        assert a.kind == b.kind and a.default == b.default, (name, p, a, b)
    extra = [p for p in np_params if p not in pt_params]
    assert set(extra) <= NUMPY_ONLY_KEYWORDS, (name, extra)
    assert all(np_params[p].kind == inspect.Parameter.KEYWORD_ONLY for p in extra), name


def public_functions():
    out = []
    for module in (padmoe, pt):
        for n in module.__all__:
            f = getattr(module, n)
            if inspect.isfunction(f):
                out.append((module.__name__, n, f))
    return out


@pytest.mark.parametrize("module,name,fn", public_functions(), ids=lambda v: v if isinstance(v, str) else "")
def test_one_check_style_and_no_return_type_switch(module, name, fn):
    params = inspect.signature(fn).parameters
    if "check" in params:
        assert params["check"].default is None, (module, name)  # None: checked in eager mode, not in capture
    assert "scales" not in params, (module, name)  # a scaled move is its own function
    assert "zero_tail" not in params, (module, name)  # rows past P follow zero_padding
    if "fp8" in params:
        assert params["fp8"].default == "e4m3", (module, name)
    assert "capacity" not in params, (module, name)  # "capacity" is an expert capacity: expert_capacity


def _problem():
    rng = np.random.default_rng(4)
    top = random_top_experts(rng, 13, 2, 5, skip_expert=3)
    x = rng.uniform(-1, 1, size=(13, 16)).astype(np.float32)
    w = rng.uniform(0.1, 1, size=(13, 2)).astype(np.float32)
    return top, x, w


def test_torch_tensors_in_padmoe_give_padmoe_torch_results():
    top, x, w = _problem()
    tt, tx, tw = torch.from_numpy(top), torch.from_numpy(x), torch.from_numpy(w)
    plan = padmoe.make_plan(tt, 5, 4)
    tplan = pt.make_plan(tt, 5, 4)
    for f in (
        "indices",
        "bin_ids",
        "tokens_per_expert",
        "bins",
        "padded_tokens_per_expert",
        "padded_bins",
        "dest_rows",
        "row_sources",
    ):
        assert torch.equal(getattr(plan, f), getattr(tplan, f)), f
    y = padmoe.dispatch(tx, plan, tw)
    ty = pt.dispatch(tx, tplan, tw)
    assert y.shape == ty.shape == (tplan.padded_rows_bound, 16) and torch.equal(y, ty)
    p = int(tplan.padded_bins[-1])
    assert p < tplan.padded_rows_bound and not y[p:].any()  # rows past P zero in both
    # the same return order
    y2, plan2 = padmoe.make_plan_and_dispatch(tx, tt, 5, 4, tw)
    ty2, tplan2 = pt.make_plan_and_dispatch(tx, tt, 5, 4, tw)
    assert isinstance(plan2, padmoe.Plan) and isinstance(tplan2, padmoe.Plan)
    assert torch.equal(y2, ty2) and torch.equal(y2, ty)
    assert torch.equal(padmoe.combine(y, plan, tw), pt.combine(ty, tplan, tw))
    g = torch.randn(13, 16)
    for a, b in zip(padmoe.combine_backward(g, y, plan, tw), pt.combine_backward(g, ty, tplan, tw)):
        assert a.shape == b.shape and torch.equal(a, b)
    for a, b in zip(padmoe.dispatch_backward(y, tx, plan, tw), pt.dispatch_backward(ty, tx, tplan, tw)):
        assert torch.equal(a, b)
    assert padmoe.dispatch_backward(y, tx, plan)[1] is None and pt.dispatch_backward(ty, tx, tplan)[1] is None
    # any object with the plan's attributes is a plan (packed on the way)
    from types import SimpleNamespace

    duck = SimpleNamespace(
        num_tokens=13, top_k=2, num_experts=5, alignment=4, **{f: getattr(plan, f) for f in padmoe._plan.PLAN_ARRAYS}
    )
    assert torch.equal(pt.dispatch(tx, duck, tw), ty) and torch.equal(padmoe.dispatch(tx, duck, tw), ty)
    # numpy in, numpy out: the same values, the same shapes
    ny, nplan = padmoe.make_plan_and_dispatch(x, top, 5, 4, w)
    assert isinstance(ny, np.ndarray) and np.array_equal(ny, ty.numpy())
    np.testing.assert_array_equal(nplan.dest_rows, tplan.dest_rows.numpy())


def test_scaled_and_quantized_forms_agree_across_modules():
    top, x, _ = _problem()
    tt, tx = torch.from_numpy(top), torch.from_numpy(x)
    xs = torch.rand(13, 1)
    tplan = pt.make_plan(tt, 5, 4)
    a = padmoe.dispatch_scaled(tx, padmoe.make_plan(tt, 5, 4), xs)
    b = pt.dispatch_scaled(tx, tplan, xs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    q, qs = pt.dispatch_quantized(tx, tplan, fp8="e5m2", scale_layout="row")
    nq, nqs = padmoe.dispatch_quantized(x, padmoe.make_plan(top, 5, 4), fp8="e5m2", scale_layout="row")
    assert q.dtype == torch.float8_e5m2 and nq.dtype == np.uint8
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), nq)
    np.testing.assert_array_equal(qs.numpy(), nqs)


@pytest.mark.parametrize(
    "name,args,torch_way",
    [
        ("quantize", lambda t, p: (t,), "dispatch_quantized"),
        ("make_plan_layouts", lambda t, p: (torch.zeros(3, 2, dtype=torch.int32), 4, 4), "row_experts"),
    ],
)
def test_numpy_only_functions_refuse_torch_tensors(name, args, torch_way):
    top, x, _ = _problem()
    plan = padmoe.make_plan(top, 5, 4)
    with pytest.raises(
        TypeError,
        match=rf"{name}: \w+: got a torch tensor; padmoe\.{name} takes numpy arrays\. "
        rf"For torch tensors use padmoe\.torch: .*{torch_way}",
    ):
        getattr(padmoe, name)(*args(torch.from_numpy(x), plan))


def test_operator_schemas_carry_the_expert_capacity_as_its_own_argument():
    for name in (
        "dispatch",
        "dispatch_backward",
        "combine",
        "combine_backward",
        "dispatch_scaled",
        "dispatch_quantized",
        "make_plan_routed",
    ):
        args = [a.name for a in getattr(torch.ops.padmoe, name).default._schema.arguments]
        assert "expert_capacity" in args, name
        assert args.index("expert_capacity") == args.index("alignment") + 1 or name == "make_plan_routed", name
    top, x, _ = _problem()
    plan = pt.make_plan(torch.from_numpy(top), 5, 4, expert_capacity=4)
    assert plan.expert_capacity == 4 and plan.alignment == 4 and plan.padded_rows_bound == 20
    y = pt.dispatch(torch.from_numpy(x), plan)
    assert y.shape == (20, 16)
    with pytest.raises(ValueError, match="alignment"):  # a negative alignment is no longer a capacity
        torch.ops.padmoe.dispatch(torch.from_numpy(x), plan.packed, None, 2, 5, -4, None)


def test_packed_plan_layout_is_defined_once_per_language_and_they_agree():
    from padmoe import _torch_ops
    from padmoe._plan import packed_plan_layout, packed_plan_offsets, packed_plan_sizes, plan_offsets

    for t, k, e, m, c in (
        (0, 1, 1, 1, None),
        (7, 2, 5, 4, None),
        (13, 8, 256, 128, None),
        (9, 3, 4, 16, 8),
        (5, 1, 3, 1, 0),
    ):
        py = packed_plan_layout(t, k, e, m, c)
        cc = tuple(tuple(f) for f in _torch_ops.packed_plan_layout(t, k, e, m, c))
        assert py == cc, (t, k, e, m, c)
        total = py[-1][1] + py[-1][2]
        # packed_plan_offsets: a slice per array, the layout's offsets and lengths, cached or not
        for offsets in (packed_plan_offsets(t, k, e, m, c), plan_offsets(t, k, e, m, c)):
            assert offsets._fields == tuple(name for name, _, _ in cc)
            assert tuple((n, s.start, s.stop - s.start) for n, s in zip(offsets._fields, offsets)) == cc
            assert offsets.size == total and offsets.rows == cc[-1][2]
            assert offsets.counts == slice(cc[2][1], cc[5][1] + cc[5][2])
        assert packed_plan_sizes(total, k, e, m, c)[:2] == (t, t * k)
        if t and c is None:
            plan = pt.make_plan(torch.zeros(t, k, dtype=torch.int32), e, m)
            assert plan.packed.numel() == total
            o = packed_plan_offsets(t, k, e, m, c)
            for name in o._fields:
                assert torch.equal(plan.packed[getattr(o, name)], getattr(plan, name)), name


def test_deprecated_aliases_warn_and_still_work():
    top, x, w = _problem()
    plan = padmoe.make_plan(top, 5, 4)
    tplan = pt.make_plan(torch.from_numpy(top), 5, 4)
    r = pt.Routing.from_topk(torch.from_numpy(top), torch.from_numpy(w), 5, 4)
    cases = [
        (lambda: plan.capacity, plan.padded_rows_bound),
        (lambda: r.capacity, r.padded_rows_bound),
        (lambda: padmoe.capacity_bound(13, 2, 5, 4), padmoe.padded_rows_bound(13, 2, 5, 4)),
        (lambda: padmoe.sort_chunks_capacity(30, 8, 2, 4), padmoe.sort_chunks_rows_bound(30, 8, 2, 4)),
        (
            lambda: padmoe.plan_tiles("gpu", "gather", 512, "float32", 132),
            padmoe.tile_config("gpu", "gather", 512, "float32", 132),
        ),
    ]
    for call, want in cases:
        with pytest.warns(DeprecationWarning):
            assert call() == want
    with pytest.warns(DeprecationWarning, match="padmoe.eager is deprecated"):
        import importlib
        import sys

        sys.modules.pop("padmoe.eager", None)
        eager = importlib.import_module("padmoe.eager")
    assert eager.make_plan is padmoe.reference.make_plan
    with pytest.warns(DeprecationWarning, match="set_default_check"):
        pt.set_default_check(None)
    assert padmoe.reference.make_plan(torch.from_numpy(top), 5, 4).padded_rows_bound == tplan.padded_rows_bound


def test_the_package_reads_no_environment_switches():
    """Options are arguments: no PADMOE_* variable is read (Triton's own TRITON_INTERPRET is Triton's)."""
    for path in PACKAGE.rglob("*.py"):
        assert not re.search(r"(environ|getenv)[^\n]*PADMOE_", path.read_text()), path


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                yield "." * node.level + (node.module or ""), a.name


def test_no_import_cycle_in_padmoe_torch():
    """The modules padmoe.torch's __init__ imports never import the padmoe.torch package back."""
    init = PACKAGE / "torch" / "__init__.py"
    mods = {name for module, name in _imports(init) if module == "" and name} | {
        module.lstrip(".") for module, _ in _imports(init) if module.startswith(".")
    }
    assert {"_common", "_plan_ops", "_dropin_ops", "_layouts", "_routing", "grouped"} <= mods
    for m in mods:
        for module, name in _imports(PACKAGE / "torch" / f"{m}.py"):
            assert not (module == "padmoe" and name == "torch") and module != "padmoe.torch", (m, module, name)


def test_integrations_import_public_names_only():
    for module, name in _imports(PACKAGE / "integrations" / "transformers.py"):
        if module.startswith("padmoe"):
            assert not any(part.startswith("_") for part in module.split(".")), module
            assert name is None or not name.startswith("_"), (module, name)


def test_file_sizes():
    for path in PACKAGE.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path
    for folder in ("src", "tests", "python/src"):  # the library, its tests and the bindings
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".cpp", ".hpp", ".cu", ".cuh"):
                assert len(path.read_text().splitlines()) <= 800, path


def _doc_table_rows():
    text = (ROOT / "docs" / "python.md").read_text()
    start = text.index("<!-- api-table -->")
    end = text.index("<!-- /api-table -->")
    return [line for line in text[start:end].splitlines() if line.startswith("| `")]


def test_docs_table_matches_the_code():
    """Every public name of padmoe and padmoe.torch is in docs/python.md's table, and every name
    there exists, in the modules its row says."""
    listed = {}
    for row in _doc_table_rows():
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", cells[0])
        modules = re.findall(r"`(padmoe(?:\.torch)?)`", cells[1])
        assert names and modules, row
        for n in names:
            listed.setdefault(n, set()).update(modules)
    for module in (padmoe, pt):
        for n in module.__all__:
            if n.startswith("__"):
                continue
            assert module.__name__ in listed.get(n, set()), (module.__name__, n)
    for n, modules in listed.items():
        for m in modules:
            assert hasattr(padmoe if m == "padmoe" else pt, n), (m, n)
