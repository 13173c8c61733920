"""examples/moe_mlp.py: a router plus padmoe.torch.GroupedExperts matches the example's float64 dense reference.

The example is loaded by path. Each case runs forward + backward and compares the output and the
gradients of x, the router weight and both expert weights with the float64 reference (per-token
loops, or dense masks past 256 tokens): max|got - ref| <= tol * (max|ref| + 1e-2) with the example's
TOLERANCE (float32: 1e-4, bfloat16: 4e-2). CPU float32 always; CUDA float32 and bfloat16 when a GPU
and padmoe's CUDA backend are present. Negative controls show that the comparison catches router
weights off by 2% and a router gradient cut off; the GEMM path the example reports is checked
against the operators that actually run.
"""

import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

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
SMALL = dict(tokens=48, hidden=32, ffn=40, experts=6, top_k=2)


def _run(**kw):
    result = moe.check(**{**SMALL, "seed": 0, **kw})
    print(result.report())
    return result


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("alignment", [1, 16, 128])
def test_cpu_float32_matches_dense_reference(activation, alignment):
    result = _run(activation=activation, alignment=alignment)
    assert result.tolerance == 1e-4
    result.assert_ok()
    assert max(diff / scale for diff, scale in result.errors.values()) < 1e-5  # float32 rounding, far inside
    assert result.model.experts.alignment == alignment
    assert result.model.experts.gated == (activation == "swiglu")


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_cpu_float32_loop_gemm(activation):
    result = _run(activation=activation, alignment=16, gemm="loop")
    assert result.gemm == "loop"
    result.assert_ok()


@pytest.mark.parametrize("seed", [1, 2])
def test_cpu_float32_odd_shapes(seed):
    # top_k 3 of 5 experts, few tokens, odd sizes
    _run(tokens=7, hidden=20, ffn=12, experts=5, top_k=3, alignment=8, seed=seed).assert_ok()
    # top_k 1 and more experts than tokens: empty experts; H = 18 floats is no multiple of 16 bytes
    result = _run(tokens=5, hidden=18, ffn=10, experts=12, top_k=1, alignment=4, seed=seed)
    result.assert_ok()
    assert result.gemm == "loop"
    with torch.no_grad():
        x, _ = moe.make_inputs(5, 18, "cpu", torch.float32, seed)
        used = result.model.route(x)[1].unique().numel()
    assert used < 12  # some experts got no token


def test_cpu_float32_many_tokens():
    # past 256 tokens the reference uses dense masks
    _run(tokens=300, experts=8, alignment=128, activation="gelu").assert_ok()


def test_main_runs(capsys):
    argv = ["--tokens", "16", "--hidden", "16", "--ffn", "8", "--experts", "4", "--iters", "1"]
    assert moe.main(argv) == 0
    out = capsys.readouterr().out
    assert "alignment 1: 32 rows for 32 assignments" in out  # GroupedExperts' default on the CPU: no padding
    assert "check: ok" in out and "forward + backward:" in out
    assert moe.main(argv + ["--activation", "gelu", "--alignment", "16", "--gemm", "loop"]) == 0
    out = capsys.readouterr().out
    assert "alignment 16:" in out and "expert GEMMs: loop" in out and "check: ok" in out


def _patch_route(monkeypatch, change):
    """Change the router's (weights, top_k ids) before they reach the experts."""
    route = moe.MoEMLP.route
    monkeypatch.setattr(moe.MoEMLP, "route", lambda self, x: change(*route(self, x)))


def test_detects_wrong_router_weights(monkeypatch):
    """Negative control: router weights off by 2% must fail the check, in the output and the gradients."""
    _patch_route(monkeypatch, lambda w, top: (w * 1.02, top))
    result = _run()
    assert not result.passes("out")
    assert not result.passes("grad x")
    assert not result.ok
    with pytest.raises(AssertionError, match="does not match"):
        result.assert_ok()


def test_detects_missing_router_gradient(monkeypatch):
    """Negative control: detached router weights leave the output and the expert weight gradients right,
    but no gradient reaches the router (nor x through it), which the check must catch."""
    _patch_route(monkeypatch, lambda w, top: (w.detach(), top))
    result = _run()
    assert result.passes("out") and result.passes("grad up") and result.passes("grad down")
    assert not result.passes("grad router") and not result.passes("grad x")
    assert not result.ok


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("hidden, ffn, gemm", [(32, 40, "auto"), (18, 10, "auto"), (32, 10, "auto"), (32, 40, "loop")])
def test_gemm_path_is_what_runs(hidden, ffn, gemm):
    """gemm_path names the GEMMs GroupedExperts runs: torch's grouped_mm, the loop per expert, or both."""
    model = moe.MoEMLP(hidden, ffn, 4, 2, gemm=gemm)
    x, grad_out = moe.make_inputs(10, hidden, "cpu", torch.float32, 0)
    with _Ops() as ops:
        model(x).backward(grad_out)
    path = moe.gemm_path(model.experts, x)
    assert ("aten._grouped_mm" in ops.names) == ("grouped_mm" in path), (path, ops.names)
    assert ("padmoe_experts.segment_mm" in ops.names) == ("loop" in path), (path, ops.names)


def test_reference_methods_agree():
    """The per-token-loop and dense-mask forms of the float64 reference are the same math."""
    torch.manual_seed(3)
    t, h, f, e, k = 24, 12, 10, 5, 2
    x, w_r, g = torch.randn(t, h), torch.randn(e, h), torch.randn(t, h)
    for act, width in (("swiglu", 2 * f), ("gelu", f)):
        up, down = torch.randn(e, width, h), torch.randn(e, h, f)
        a = moe.dense_reference(x, w_r, up, down, g, k, act, method="loop")
        b = moe.dense_reference(x, w_r, up, down, g, k, act, method="masks")
        assert torch.equal(a[2], b[2])
        torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-12)
        for name in a[1]:
            torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not CUDA, reason="needs a GPU and padmoe's CUDA backend")
@pytest.mark.parametrize("gemm", ["auto", "loop"])
def test_cuda_float32(gemm):
    result = _run(device="cuda", dtype=torch.float32, gemm=gemm)
    result.assert_ok()
    assert result.model.experts.alignment is None  # GroupedExperts' default: 16 on CUDA


@pytest.mark.skipif(not CUDA, reason="needs a GPU and padmoe's CUDA backend")
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("alignment", [None, 16, 128])
def test_cuda_bfloat16(activation, alignment):
    result = _run(
        device="cuda",
        dtype=torch.bfloat16,
        activation=activation,
        alignment=alignment,
        tokens=256,
        hidden=64,
        ffn=128,
        experts=8,
    )
    assert result.tolerance == 4e-2
    result.assert_ok()
    if torch.cuda.get_device_capability() >= (8, 0):
        assert result.gemm == "grouped_mm"


@pytest.mark.skipif(not CUDA, reason="needs a GPU and padmoe's CUDA backend")
def test_cuda_main_runs(capsys):
    argv = ["--device", "cuda", "--dtype", "bfloat16", "--tokens", "512", "--hidden", "64", "--ffn", "128"]
    assert moe.main(argv + ["--alignment", "128", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "alignment 128:" in out and "check: ok" in out and " µs per iteration" in out
