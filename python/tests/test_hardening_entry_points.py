"""Hardening of the Python entry points against what a fuzzer feeds them: vLLM's expert map
checked before moe_align_block_size runs (both APIs, the core's words, never an out-of-bounds
gather), the MegaBlocks drop-ins of the numpy API checking their inputs before sizes from the data
allocate anything, and Python sizes that were truncated (a float) or unbounded (2^31 experts)
rejected with padmoe's TypeError / ValueError naming the argument."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import padmoe

torch = pytest.importorskip("torch")
import padmoe.torch as pt  # noqa: E402
from padmoe import _args, _arrays  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])
OP = "moe_align_block_size"
TOP = np.array([[0, 1], [2, 3], [3, 1]], dtype=np.int32)  # T = 3, K = 2 over E = 4 experts


# ---------------------------------------------------------------------------
# vLLM's expert map
# ---------------------------------------------------------------------------


BAD_MAPS = [  # (map, error, message): what the core says of the same map with ignore_invalid_experts=True
    (np.array([0, 1], np.int32), ValueError, f"{OP}: expert_map: expected 4 entries, got 2"),
    (np.array([0, 1, 9, 2], np.int32), ValueError, f"{OP}: expert_map: entry 2 is 9, outside [-1, 4)"),
    (np.array([0, -2, 1, 2], np.int64), ValueError, f"{OP}: expert_map: entry 1 is -2, outside [-1, 4)"),
    (np.array([0, 1, 2**40, 3], np.int64), ValueError, f"{OP}: expert_map: entry 2 is 1099511627776, outside [-1, 4)"),
    (np.array([0, 1.5, 2, 3], np.float32), TypeError, f"{OP}: expert_map: expected int32 or int64, got float32"),
    (np.zeros((2, 2), np.int32), ValueError, f"{OP}: expert_map: expected a 1-D tensor, got shape [2, 2]"),
]


def _align_args(api, device, emap):
    if api == "numpy" and device == "cpu":
        return padmoe.moe_align_block_size, TOP, emap
    fn = pt.moe_align_block_size if api == "torch" else padmoe.moe_align_block_size
    return fn, torch.from_numpy(TOP).to(device), torch.from_numpy(emap).to(device)


@pytest.mark.parametrize("api", ["numpy", "torch"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(BAD_MAPS)))
def test_expert_map_checked_as_the_core_checks_it(api, device, case):
    """With ignore_invalid_experts=False the map was indexed unchecked: a short map raised IndexError
    (on CUDA a device-side assert), an entry of 9 or 2^40 (wrapped to 0) or a float (truncated)
    passed through. Now both values of ignore_invalid_experts give the core's error, word for word."""
    emap, error, message = BAD_MAPS[case]
    fn, ids, m = _align_args(api, device, emap)
    for ignore in (True, False):
        with pytest.raises(error) as info:
            fn(ids, 4, 4, m, ignore_invalid_experts=ignore)
        assert str(info.value) == message, ignore


@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_expert_map_checked_before_the_op_runs(api, monkeypatch):
    calls = []
    if api == "torch":
        from types import SimpleNamespace

        from padmoe.torch import _layouts

        stub = SimpleNamespace(moe_align_block_size=SimpleNamespace(default=lambda *a: calls.append(a)))
        monkeypatch.setattr(_layouts, "ops", stub)
        fn, ids, m = pt.moe_align_block_size, torch.from_numpy(TOP), torch.tensor([0, 1, 9, 2], dtype=torch.int32)
    else:
        monkeypatch.setattr(padmoe._plan_ops._C, "moe_align_block_size_out", lambda *a, **k: calls.append(a))
        fn, ids, m = padmoe.moe_align_block_size, TOP, np.array([0, 1, 9, 2], np.int32)
    with pytest.raises(ValueError, match=r"expert_map: entry 2 is 9"):
        fn(ids, 4, 4, m)
    assert calls == []


@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_valid_expert_map_still_maps_every_block(api):
    emap = np.array([2, -1, 0, 1], np.int64)  # expert 1 on another rank
    fn, ids, m = _align_args(api, "cpu", emap)
    _, plain, _ = fn(ids, 2, 4)
    _, mapped, _ = fn(ids, 2, 4, m)
    plain, mapped = np.asarray(plain), np.asarray(mapped)
    assert mapped.dtype == np.int32
    assert plain.tolist() == [0, 1, 2, 3, -1]  # one block of 2 rows per expert, then -1 past P
    # every block mapped, the one past P too: vLLM's expert_map[expert_ids] reads expert_map[-1] there
    assert mapped.tolist() == [2, -1, 0, 1, 1]


def test_expert_map_gather_stays_in_bounds():
    """The map's gather reads only indices inside the map, whatever expert_ids hold (no
    out-of-bounds gather: on CUDA that is a device-side assert ending the CUDA context). Indices in
    [-n, 0) count from the end, as torch's indexing (vLLM's expert_map[expert_ids]) does."""
    table = torch.tensor([7, 8, 9, 10], dtype=torch.int64)
    got = _args.map_experts(torch.tensor([0, 5, -1, 3, -4, -5], dtype=torch.int32), table)
    assert got.dtype == torch.int32 and got.tolist() == [7, -1, 10, 10, 7, -1]
    got = _args.map_experts(np.array([3, 4, -5, 1, -1], np.int32), table.numpy())
    assert got.dtype == np.int32 and got.tolist() == [10, -1, -1, 8, 10]


@pytest.mark.parametrize("device", DEVICES)
def test_expert_map_entries_follow_the_check_policy(device):
    """The map's entries are data: checked on the CPU always and on CUDA in checked mode; on CUDA with
    check=False nothing is read on the host (entries pass through unclamped); under torch.compile the
    path traces sync-free with the shape and dtype still checked."""
    ids = torch.from_numpy(TOP).to(device)
    bad = torch.tensor([0, 1, 9, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"expert_map: entry 2 is 9, outside \[-1, 4\)"):
        pt.moe_align_block_size(ids, 4, 4, bad, check=True)
    if device == "cpu":
        with pytest.raises(ValueError, match=r"expert_map: entry 2 is 9, outside \[-1, 4\)"):
            pt.moe_align_block_size(ids, 4, 4, bad, check=False)
    else:
        # the op's expert_ids [0, 1, 2, 3, -1] read through the map: the block past P reads its last entry
        _, e, _ = pt.moe_align_block_size(ids, 4, 4, bad, check=False)
        assert e.cpu().tolist() == [0, 1, 9, 2, 2]
    good = torch.tensor([3, 2, -1, 0], dtype=torch.int32, device=device)
    f = torch.compile(
        lambda t, m: pt.moe_align_block_size(t, 4, 4, m, check=False), fullgraph=True, backend="aot_eager"
    )
    for got, want in zip(f(ids, good), pt.moe_align_block_size(ids, 4, 4, good)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"expert_map: expected 4 entries, got 3"):
        pt.moe_align_block_size(ids, 4, 4, good[:3], check=False)


# ---------------------------------------------------------------------------
# MegaBlocks drop-ins (numpy API): checks before sizes from the data allocate
# ---------------------------------------------------------------------------


@pytest.fixture
def allocations(monkeypatch):
    """Bytes of every output the numpy API allocates (numpy arrays and torch tensors)."""
    sizes = []

    def spy(original):
        def empty(self, shape, dtype, like):
            a = original(self, shape, dtype, like)
            sizes.append(int(a.nbytes))
            return a

        return empty

    monkeypatch.setattr(_arrays.NumpyArrays, "empty", spy(_arrays.NumpyArrays.empty))
    monkeypatch.setattr(_arrays.TorchArrays, "empty", spy(_arrays.TorchArrays.empty))
    return sizes


def _routing(framework):
    """Two tokens, top-1, one expert; bins[0] = 5 (there are 2 assignments) and padded_bins[-1] =
    2^31 - 1: a [P, 4] float32 output of 32 GiB if P were taken from the data unchecked."""
    x = np.ones((2, 4), np.float32)
    idx = np.array([0, 1], np.int32)
    bin_ids = np.array([0, 0], np.int32)
    bins = np.array([5], np.int32)
    padded_bins = np.array([2**31 - 1], np.int32)
    arrays = (x, idx, bin_ids, bins, padded_bins)
    return arrays if framework == "numpy" else tuple(torch.from_numpy(a) for a in arrays)


BINS_ERROR = "{op}: bins: bins[E-1] = 5 must equal the number of assignments 2"


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_padded_rows_from_bad_bins_raise_the_op_error_not_memory_error(framework, allocations):
    x, idx, bin_ids, bins, padded_bins = _routing(framework)
    scales = np.ones((2, 1), np.float32) if framework == "numpy" else torch.ones(2, 1)
    calls = {
        "padded_gather": lambda **kw: padmoe.padded_gather(x, idx, bin_ids, bins, padded_bins, 1, **kw),
        "padded_gather scaled": lambda **kw: padmoe.padded_gather_scaled(
            x, idx, bin_ids, bins, padded_bins, 1, scales, **kw
        ),
    }
    if framework == "numpy":  # (a backward op: padmoe.torch runs it through autograd)
        calls["padded_scatter_backward"] = lambda **kw: padmoe.padded_scatter_backward(
            x, x, idx, bin_ids, None, bins, padded_bins, 1, **kw
        )
    for name, call in calls.items():
        message = BINS_ERROR.format(op=name.split()[0])
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message, name
        with pytest.raises(ValueError) as small:  # the same input with a small output: the core's own error
            call(rows=4)
        assert str(small.value) == message, name
    assert max(allocations) <= 64, allocations  # the [4, 4] float32 outputs of rows=4 at most


def test_torch_padded_gather_checks_before_sizing_from_the_data():
    """padmoe.torch's drop-in sizes y by padded_bins[-1] too: under a 4 GiB address-space limit a
    32 GiB request was torch's out-of-memory RuntimeError; it now waits for the op's checks, which
    name the bad bins. A small output is allocated first and gets the same error."""
    script = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        import torch
        import padmoe.torch as pt
        x = torch.ones(2, 4)
        idx = torch.tensor([0, 1], dtype=torch.int32)
        bins = torch.tensor([5], dtype=torch.int32)
        for last in (2**31 - 1, 8):
            try:
                pt.padded_gather(x, idx, torch.zeros(2, dtype=torch.int32), bins, torch.tensor([last], dtype=torch.int32), 1)
            except Exception as e:
                print(type(e).__name__, e)
    """)
    pytest.importorskip("resource")
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    want = "ValueError " + BINS_ERROR.format(op="padded_gather")
    assert done.stdout.splitlines() == [want, want], (done.stdout + done.stderr)[-2000:]
    # valid routing: the rows the reference loop gives
    x = torch.tensor([[1.0] * 4, [2.0] * 4])
    y = pt.padded_gather(
        x,
        torch.tensor([0, 1], dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int32),
        1,
    )
    assert torch.equal(y, torch.cat([x, torch.zeros(2, 4)]))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_token_rows_of_a_bad_row_input_raise_the_op_error(framework, allocations):
    """[T, H] outputs take H from an input: an input of no rows but 2^32 columns (no memory) and
    four assignments asked for 64 GiB before the op said the input lacks rows."""
    idx = np.array([0, 1, 2, 3], np.int32)
    bin_ids = np.array([0, 0, 1, 1], np.int32)
    bins = np.array([2, 4], np.int32)
    empty = np.empty((0, 2**32), np.float32)
    args = (empty, idx, bin_ids, bins, bins)
    if framework == "torch":
        args = (torch.empty(0, 2**32),) + tuple(torch.from_numpy(a) for a in args[1:])
    rows, idx, bin_ids, bins, padded_bins = args
    with pytest.raises(ValueError) as info:
        padmoe.padded_scatter(rows, idx, bin_ids, None, bins, padded_bins, 1)
    assert str(info.value) == "padded_scatter: y: has 0 rows but the routing has 4 padded rows"
    with pytest.raises(ValueError) as info:
        padmoe.padded_gather_backward(rows, rows, idx, bin_ids, bins, padded_bins, 1)
    assert str(info.value) == "padded_gather_backward: x: expected 4 rows, got shape [0, 4294967296]"
    assert allocations and max(allocations) == 0  # the zero-column stand-ins only


def test_megablocks_drop_ins_unchanged_on_valid_input():
    rng = np.random.default_rng(3)
    top = rng.integers(0, 4, size=(6, 2)).astype(np.int32)
    plan = padmoe.make_plan(top, 4, 4)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    routing = (plan.indices, plan.bin_ids, plan.bins, plan.padded_bins)
    y = padmoe.padded_gather(x, *routing, 2)
    assert np.array_equal(y, padmoe.dispatch(x, plan)[: y.shape[0]])
    out = padmoe.padded_scatter(y, plan.indices, plan.bin_ids, None, plan.bins, plan.padded_bins, 2)
    assert np.allclose(out, 2 * x)  # each token's two copies summed
    gx, _ = padmoe.padded_gather_backward(y, x, *routing, 2)
    assert np.allclose(gx, 2 * x)
    gy, _ = padmoe.padded_scatter_backward(x, y, plan.indices, plan.bin_ids, None, plan.bins, plan.padded_bins, 2)
    assert np.array_equal(gy, y)


# ---------------------------------------------------------------------------
# Python sizes: integers, in range, checked first
# ---------------------------------------------------------------------------


def test_int_arg_rule():
    assert _args.int_arg("op", "n", np.int64(5), 1) == 5 and type(_args.int_arg("op", "n", np.int64(5), 1)) is int
    assert _args.int_arg("op", "n", torch.tensor(7), 1, 8) == 7
    for bad, what in (
        (2.5, "float"),
        (True, "a bool"),
        (torch.tensor(2.0), "Tensor"),
        (torch.tensor(True), "a bool"),
        ("3", "str"),
    ):
        with pytest.raises(TypeError, match=f"op: n: expected an integer, got {what}"):
            _args.int_arg("op", "n", bad, 1)
    with pytest.raises(ValueError, match=r"op: n: must be in \[1, 8\], got 9"):
        _args.int_arg("op", "n", 9, 1, 8)
    with pytest.raises(ValueError, match="op: n: must be >= 0, got -1"):
        _args.int_arg("op", "n", -1, 0)


def test_batched_moe_align_block_size_takes_integers_only():
    op = "batched_moe_align_block_size"
    counts = torch.tensor([3, 0, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match=rf"{op}: block_size: expected an integer, got float \(2.5\)"):
        pt.batched_moe_align_block_size(16, 2.5, counts)  # was used as 2
    with pytest.raises(TypeError, match=rf"{op}: max_tokens_per_batch: expected an integer, got float"):
        pt.batched_moe_align_block_size(16.0, 2, counts)
    with pytest.raises(TypeError, match=rf"{op}: expert_num_tokens: expected int32 or int64, got float32"):
        pt.batched_moe_align_block_size(16, 2, counts.float())  # was a ValueError
    with pytest.raises(ValueError, match=rf"{op}: expert_num_tokens: expected a 1-D tensor, got shape \[3, 1\]"):
        pt.batched_moe_align_block_size(16, 2, counts[:, None])
    with pytest.raises(ValueError, match=rf"{op}: block_size: must be >= 1, got 0"):
        pt.batched_moe_align_block_size(16, 0, counts)
    for got, want in zip(
        pt.batched_moe_align_block_size(np.int64(16), torch.tensor(8), counts),
        pt.batched_moe_align_block_size(16, 8, counts),
    ):
        assert torch.equal(got, want)


def test_grouped_experts_checks_its_sizes():
    for args, kw, error, message in (
        ((-1, 8, 8), {}, ValueError, r"num_experts: must be in \[1, 2147483647\], got -1"),
        ((4, 0, 8), {}, ValueError, "hidden_size: must be >= 1, got 0"),
        ((4, 8, 2.5), {}, TypeError, r"intermediate_size: expected an integer, got float \(2.5\)"),
        ((4, 8, 8), dict(alignment=0), ValueError, r"alignment: must be in \[1, 2147483647\], got 0"),
    ):
        with pytest.raises(error, match="GroupedExperts: " + message):
            pt.GroupedExperts(*args, **kw)
    mod = pt.GroupedExperts(np.int64(4), 8, torch.tensor(8))
    assert (mod.num_experts, mod.hidden_size, mod.intermediate_size) == (4, 8, 8)
    assert type(mod.intermediate_size) is int and tuple(mod.down_proj.shape) == (4, 8, 8)
    idx = torch.zeros(3, 1, dtype=torch.long)
    w = torch.ones(3, 1)
    with pytest.raises(
        ValueError,
        match=r"GroupedExperts: hidden_states: expected \[\.\.\., hidden_size = 8\], "
        r"got shape \[3, 7\]",
    ):
        mod(torch.randn(3, 7), idx, w)  # was torch's RuntimeError from the GEMM
    assert mod(torch.randn(3, 8), idx, w).shape == (3, 8)


@pytest.fixture
def one_rank_group(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_expert_parallel_rejects_non_integers(one_rank_group):
    import padmoe.torch.distributed as pd

    op = "ExpertParallel"
    with pytest.raises(TypeError, match=rf"{op}: num_experts: expected an integer, got float \(4.7\)"):
        pd.ExpertParallel(4.7)  # was 4 experts
    with pytest.raises(TypeError, match=rf"{op}: num_experts: expected an integer, got a bool"):
        pd.ExpertParallel(True)
    with pytest.raises(TypeError, match=rf"{op}: expert_ranks: entry 1: expected an integer, got float \(0.5\)"):
        pd.ExpertParallel(2, expert_ranks=[0, 0.5])  # was rank 0
    with pytest.raises(TypeError, match=rf"{op}: expert_ranks: entry 0: expected an integer, got float"):
        pd.ExpertParallel(2, expert_ranks=torch.tensor([0.0, 0.0]))
    with pytest.raises(TypeError, match=rf"{op}: alignment: expected an integer, got float"):
        pd.ExpertParallel(2, 1.5)
    with pytest.raises(ValueError, match=rf"{op}: capacity: must be in \[1, 2147483647\], got 0"):
        pd.ExpertParallel(2, mode="sync_free", capacity=0)
    with pytest.raises(ValueError, match=rf"{op}: num_experts: must be in \[1, 2147483647\], got 0"):
        pd.ExpertParallel(0)
    ep = pd.ExpertParallel(np.int64(4), torch.tensor(2), expert_ranks=np.zeros(4, np.int64))
    assert (ep.num_experts, ep.alignment, ep.expert_ranks) == (4, 2, [0, 0, 0, 0])
    assert type(ep.num_experts) is int and type(ep.alignment) is int and type(ep.expert_ranks[0]) is int


def test_expert_parallel_checks_num_experts_before_building_lists(tmp_path):
    """ExpertParallel(2**31) built lists of 2^31 entries (tens of GB) before any size check: run in
    a process limited to 4 GiB of address space, it must fail at once with the range error."""
    script = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        import torch.distributed as dist
        import padmoe.torch.distributed as pd
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        try:
            pd.ExpertParallel(2**31)
        except Exception as e:
            print(type(e).__name__, e)
        dist.destroy_process_group()
    """)
    pytest.importorskip("resource")
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert done.stdout.strip() == (
        "ValueError ExpertParallel: num_experts: must be in [1, 2147483647], got 2147483648"
    ), done.stderr[-2000:]
