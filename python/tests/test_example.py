"""examples/moe_mlp.py: the MoE MLP layer on padmoe's routing matches its float64 dense reference.

The example is loaded by path. Each case runs forward + backward and compares the output and the
gradients of x, the router weight and both expert weights with the dense float64 per-token
reference: max|got - ref| <= tol * (max|ref| + 1e-2) with the example's TOLERANCE (float32:
1e-4, bfloat16: 4e-2; CheckResult.passes). CPU float32 always; CUDA float32 (segment loop) and bfloat16 (grouped_mm) when a
GPU and padmoe's CUDA backend are present. Negative controls check that the comparison catches
wrong combine weights and a missing router-weight gradient.
"""

import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch")

import padmoe  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "moe_mlp.py")


def _load_example():
    name = "padmoe_example_moe_mlp"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(EXAMPLE))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look the module up while the file executes
    spec.loader.exec_module(mod)
    return mod


moe = _load_example()

CUDA = torch.cuda.is_available() and padmoe.has_cuda()
OPS = ["shim"]
try:
    moe.routing_ops("padmoe.torch")
    OPS.append("padmoe.torch")
except RuntimeError:
    pass

SMALL = dict(tokens=48, hidden=32, ffn=40, experts=6, top_k=2)


def _run(**kw):
    args = dict(SMALL, seed=0)
    args.update(kw)
    result = moe.check(**args)
    print(result.report())
    return result


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("alignment", [1, 16, 128])
def test_cpu_float32_matches_dense_reference(ops, activation, alignment):
    result = _run(ops=ops, activation=activation, alignment=alignment)
    assert result.tolerance == 1e-4
    result.assert_ok()
    assert "loop" in result.gemm
    assert ops in result.ops or (ops == "shim" and "shim" in result.ops)


@pytest.mark.parametrize("seed", [1, 2])
def test_cpu_float32_other_shapes(seed):
    # top_k 3 of 5 experts with few tokens (an expert may get no tokens), odd sizes.
    _run(tokens=7, hidden=20, ffn=12, experts=5, top_k=3, alignment=8, seed=seed).assert_ok()
    # top_k 1 and more experts than tokens: several empty segments.
    _run(tokens=5, hidden=16, ffn=8, experts=12, top_k=1, alignment=4, seed=seed).assert_ok()


def test_main_runs():
    assert moe.main(["--tokens", "16", "--hidden", "16", "--ffn", "8", "--experts", "4", "--iters", "1"]) == 0


def _wrapped(combine_wrapper):
    base = moe.routing_ops("auto")
    return moe.RoutingOps(base.make_plan, base.dispatch, combine_wrapper(base.combine), "wrapped " + base.name)


def test_padding_rows_never_read_by_combine():
    """NaN in every padding row of the expert output changes nothing: combine reads only
    the rows of real assignments (and its backward writes zero gradients there)."""

    def poison(combine):
        def run(y, plan, weights=None):
            real = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
            real[plan.dest_rows.long()] = True
            assert not bool(real.all()), "test needs padding rows (alignment > 1)"
            return combine(y.masked_fill(~real.unsqueeze(1), float("nan")), plan, weights)

        return run

    result = _run(ops=_wrapped(poison), alignment=16)
    result.assert_ok()


def test_detects_wrong_combine_weights():
    """Negative control: weights off by 2% in combine must fail the check (out and gradients)."""

    def scaled(combine):
        return lambda y, plan, weights=None: combine(y, plan, weights * 1.02)

    result = _run(ops=_wrapped(scaled))
    assert not result.ok
    assert not result.passes("out")
    with pytest.raises(AssertionError, match="does not match"):
        result.assert_ok()


def test_detects_missing_router_gradient():
    """Negative control: detaching the router weights before combine leaves the output right but
    the router gradient wrong, which the check must catch."""

    def detached(combine):
        return lambda y, plan, weights=None: combine(y, plan, weights.detach())

    result = _run(ops=_wrapped(detached))
    assert result.passes("out")
    assert not result.passes("grad router")
    assert not result.ok


@pytest.mark.skipif(not CUDA, reason="needs a GPU and padmoe's CUDA backend")
@pytest.mark.parametrize("ops", OPS)
def test_cuda_float32_loop(ops):
    result = _run(device="cuda", dtype=torch.float32, ops=ops, alignment=16)
    result.assert_ok()
    assert result.gemm == "loop"


@pytest.mark.skipif(not CUDA, reason="needs a GPU and padmoe's CUDA backend")
@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("alignment", [16, 128])
def test_cuda_bfloat16(ops, alignment):
    # grouped_mm where this torch has it (auto falls back to the loop if it raises: then
    # the report says why, and the check still applies).
    result = _run(
        device="cuda",
        dtype=torch.bfloat16,
        ops=ops,
        alignment=alignment,
        tokens=256,
        hidden=64,
        ffn=128,
        experts=8,
        top_k=2,
    )
    assert result.tolerance == 4e-2
    result.assert_ok()
    if moe.grouped_mm_usable("cuda", torch.bfloat16):
        assert result.gemm.startswith("grouped_mm"), result.gemm


@pytest.mark.skipif(
    not (CUDA and moe.grouped_mm_usable("cuda", torch.bfloat16)),
    reason="needs a GPU, padmoe's CUDA backend and torch grouped_mm",
)
def test_cuda_grouped_mm_forced():
    result = _run(
        device="cuda",
        dtype=torch.bfloat16,
        gemm="grouped_mm",
        alignment=16,
        tokens=256,
        hidden=64,
        ffn=128,
        experts=8,
        top_k=2,
    )
    result.assert_ok()
    assert result.gemm == "grouped_mm"


def test_reference_methods_agree():
    """The per-token-loop and dense-mask forms of the float64 reference are the same math."""
    torch.manual_seed(3)
    t, h, f, e, k = 24, 12, 10, 5, 2
    x, w_r, g = torch.randn(t, h), torch.randn(e, h), torch.randn(t, h)
    for act, width in (("swiglu", 2 * f), ("gelu", f)):
        w_in, w_out = torch.randn(e, h, width), torch.randn(e, f, h)
        a = moe.dense_reference(x, w_r, w_in, w_out, g, k, act, method="loop")
        b = moe.dense_reference(x, w_r, w_in, w_out, g, k, act, method="masks")
        assert torch.equal(a[2], b[2])
        torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-12)
        for name in a[1]:
            torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-12, atol=1e-12)
