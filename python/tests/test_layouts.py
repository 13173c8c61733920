"""The layouts other kernels consume, against references written here from their owners'
definitions: DeepGEMM's contiguous grouped layout (one int per padded row: its expert, -1 on padding)
and vLLM's moe_align_block_size contract (sorted_token_ids padded per expert to the block size with the
sentinel T*K, expert_ids per block, num_tokens_post_padded), with the cases of vLLM's own test file."""

import numpy as np
import pytest

import padmoe

torch = pytest.importorskip("torch")
import padmoe.torch as pt  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])


def ref_align(top, block, E, pad_sorted_ids=False, expert_map=None, ignore_invalid_experts=False):
    """vLLM's semantics (its kernel, its Python wrapper and its test's golden function): ids outside
    [0, E) skipped; experts in id order (their local id with ignore_invalid_experts, where a -1
    drops the assignment), each run padded to whole blocks, the sentinel A elsewhere, -1 for the
    blocks past P; without ignore_invalid_experts a map is applied to every block afterwards as
    vLLM's ``expert_map[expert_ids]`` does (the blocks past P read the map's last entry)."""
    flat = np.asarray(top).reshape(-1).astype(np.int64)
    A = flat.size
    size = A + min(A, E) * (block - 1)
    if pad_sorted_ids:
        size = -(-size // block) * block
    key = np.where((flat >= 0) & (flat < E), flat, -1)
    if expert_map is not None and ignore_invalid_experts:
        emap = np.asarray(expert_map, dtype=np.int64)
        key = np.where(key >= 0, emap[np.maximum(key, 0)], -1)
    sorted_ids = [A] * size
    expert_ids = [-1] * (-(-size // block))
    start = 0
    for e in range(E):
        mine = np.flatnonzero(key == e).tolist()  # ascending assignment ids
        sorted_ids[start : start + len(mine)] = mine
        end = start + -(-len(mine) // block) * block
        for b in range(start // block, end // block):
            expert_ids[b] = e
        start = end
    if expert_map is not None and not ignore_invalid_experts:
        expert_ids = [int(expert_map[e]) for e in expert_ids]  # e = -1: the last entry, as torch indexing
    return sorted_ids, expert_ids, [start]


def ref_rows(top, E, m, rows):
    flat = [int(v) for v in np.asarray(top).reshape(-1)]
    out = [-1] * rows
    start = 0
    for e in range(E):
        n = sum(1 for v in flat if v == e)
        out[start : start + n] = [e] * n
        start += -(-n // m) * m
    return out


CASES = [  # (T, K, E, block)
    (3, 2, 64, 16),  # A < E: vLLM's smaller buffer
    (1, 8, 256, 16),  # decode: one token
    (200, 2, 8, 64),
    (333, 8, 128, 16),
    (64, 4, 16, 1),
    (0, 2, 8, 16),
]


def routing(T, K, E, seed):
    rng = np.random.default_rng(seed)
    if T == 0:
        return np.zeros((0, K), dtype=np.int64)
    return np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("idx", [np.int32, np.int64])
def test_numpy_moe_align_block_size(case, pad, idx):
    T, K, E, block = case
    top = routing(T, K, E, T + E).astype(idx)
    s, e, n = padmoe.moe_align_block_size(top, block, E, pad_sorted_ids=pad)
    ws, we, wn = ref_align(top, block, E, pad)
    assert s.dtype == np.int32 and e.dtype == np.int32 and n.dtype == np.int32
    assert s.tolist() == ws and e.tolist() == we and n.tolist() == wn
    assert s.shape[0] == padmoe.aligned_rows_bound(T * K, E, block, pad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_torch_moe_align_block_size_with_expert_map(device, case):
    T, K, E, block = case
    top = torch.from_numpy(routing(T, K, E, 7 * T + E)).to(device)
    g = torch.Generator().manual_seed(E)
    emap = torch.full((E,), -1, dtype=torch.int32)
    local = torch.randperm(E, generator=g)[: max(1, E // 2)]
    emap[local] = torch.arange(local.numel(), dtype=torch.int32)
    for expert_map in (None, emap.to(device)):
        for ignore in (False, True):
            for pad in (False, True):
                for fn in (pt.moe_align_block_size, padmoe.moe_align_block_size):
                    s, e, n = fn(top, block, E, expert_map, pad, ignore)
                    ws, we, wn = ref_align(
                        top.cpu(), block, E, pad, None if expert_map is None else emap.tolist(), ignore
                    )
                    assert s.device.type == device and e.device.type == device
                    assert s.cpu().tolist() == ws and e.cpu().tolist() == we and n.cpu().tolist() == wn


# The cases of vLLM's own test file (tests/kernels/moe/test_moe_align_block_size.py), compared entry
# for entry with ref_align (vLLM's test compares expert_ids and the totals exactly and the tokens of
# each expert as a set; padmoe's stable order makes sorted_token_ids exact too).
def distinct_topk(T, K, E, seed):
    """Each token's K experts distinct, as vLLM's test draws them (randperm(E)[:K])."""
    rng = np.random.default_rng(seed)
    return rng.random((T, E)).argsort(axis=1)[:, :K].astype(np.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3, 256, 2256, 4096])
@pytest.mark.parametrize("K", [1, 2, 16, 32])
@pytest.mark.parametrize("E", [32, 160, 256, 257])
@pytest.mark.parametrize("block", [32, 128])
def test_vllm_cases_moe_align_block_size(device, T, K, E, block):
    top = distinct_topk(T, K, E, T * 1000 + K * 10 + E)
    ids = torch.from_numpy(top).to(device)
    for pad in (False, True):
        s, e, n = pt.moe_align_block_size(ids, block, E, pad_sorted_ids=pad)
        ws, we, wn = ref_align(top, block, E, pad)
        assert s.dtype == e.dtype == n.dtype == torch.int32
        assert n.cpu().tolist() == wn and e.cpu().tolist() == we and s.cpu().tolist() == ws
        assert wn[0] % block == 0 and wn[0] >= T * K


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [16, 32, 2048])
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("E", [8, 64])
def test_vllm_cases_with_expert_map(device, T, K, E):
    top = distinct_topk(T, K, E, T + K + E)
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[0::2] = torch.arange((E + 1) // 2, dtype=torch.int32)  # the even experts local, in order
    s, e, n = pt.moe_align_block_size(
        torch.from_numpy(top).to(device), 64, E, expert_map=emap.to(device), ignore_invalid_experts=True
    )
    ws, we, wn = ref_align(top, 64, E, False, emap.tolist(), True)
    assert n.cpu().tolist() == wn and e.cpu().tolist() == we and s.cpu().tolist() == ws


def invalid_topk(T, K, E, all_invalid):
    """vLLM's test pattern: -1, -2, E and E + 7 among valid ids, or only invalid ones."""
    flat = np.arange(T * K, dtype=np.int64) % E
    if all_invalid:
        flat[:] = -1
        flat[1::3] = E
        flat[2::3] = E + 7
    else:
        flat[0::11] = -1
        flat[3::17] = -2
        flat[5::19] = E
        flat[7::23] = E + 7
    return flat.reshape(T, K)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(8, 4, 8, 4), (300, 4, 8, 16), (8, 4, 80, 8)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("use_map, ignore", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("all_invalid", [False, True])
def test_vllm_cases_skip_ids_outside_the_experts(device, shape, dtype, use_map, ignore, all_invalid):
    """Ids outside [0, E) are skipped in every mode, never an error, as vLLM's kernel does."""
    T, K, E, block = shape
    top = invalid_topk(T, K, E, all_invalid).astype(dtype)
    emap = None
    if use_map:
        emap = np.full(E, -1, np.int32)
        emap[0::2] = np.arange((E + 1) // 2)
    for fn, arg, m in (
        (
            pt.moe_align_block_size,
            torch.from_numpy(top).to(device),
            None if emap is None else torch.from_numpy(emap).to(device),
        ),
        (
            padmoe.moe_align_block_size,
            torch.from_numpy(top).to(device),
            None if emap is None else torch.from_numpy(emap).to(device),
        ),
    ):
        s, e, n = fn(arg, block, E, m, False, ignore)
        ws, we, wn = ref_align(top, block, E, False, None if emap is None else emap.tolist(), ignore)
        assert n.cpu().tolist() == wn and e.cpu().tolist() == we and s.cpu().tolist() == ws
        if all_invalid:
            assert wn == [0]


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_cases_deterministic(device):
    top = torch.from_numpy(np.random.default_rng(42).integers(0, 32, (128, 2)).astype(np.int32)).to(device)
    first = pt.moe_align_block_size(top, 64, 32)
    for _ in range(4):
        for a, b in zip(first, pt.moe_align_block_size(top, 64, 32)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_zero_names_top_k(device):
    """A [T, 0] top-k (torch gives it strides (1, 1): no element, so contiguous) gets the error on
    top_k, not on its layout."""
    top = torch.empty(6, 0, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="make_plan: top_k: .*got 0"):
        pt.make_plan(top, 3, 4)
    with pytest.raises(ValueError, match="moe_align_block_size: top_k: .*got 0"):
        pt.moe_align_block_size(top, 16, 3)
    for dtype in (torch.int16, torch.uint8, torch.float32):  # vLLM's argument name, whatever the dtype
        with pytest.raises(
            TypeError, match=f"moe_align_block_size: topk_ids: expected int32 or int64, got {str(dtype)[6:]}$"
        ):
            pt.moe_align_block_size(torch.zeros(6, 2, dtype=dtype, device=device), 16, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_moe_align_block_size_compiles_and_opchecks(device):
    top = torch.from_numpy(routing(50, 2, 16, 3)).to(device)
    f = torch.compile(lambda t: pt.moe_align_block_size(t, 16, 16, check=False), fullgraph=True, backend="aot_eager")
    for got, want in zip(f(top), pt.moe_align_block_size(top, 16, 16)):
        assert torch.equal(got, want)
    torch.library.opcheck(
        torch.ops.padmoe.moe_align_block_size.default,
        (top, 16, 16, False, 1),
        test_utils=("test_schema", "test_faketensor"),
    )
    emap = torch.arange(16, dtype=torch.int32, device=device).flip(0)
    emap[::3] = -1
    g = torch.compile(
        lambda t, m: pt.moe_align_block_size(t, 16, 16, m, ignore_invalid_experts=True, check=False),
        fullgraph=True,
        backend="aot_eager",
    )
    for got, want in zip(g(top, emap), pt.moe_align_block_size(top, 16, 16, emap, ignore_invalid_experts=True)):
        assert torch.equal(got, want)
    torch.library.opcheck(
        torch.ops.padmoe.moe_align_block_size.default,
        (top, 16, 16, False, 1, emap),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("case", CASES)
def test_make_plan_layouts_match_deepgemm_and_vllm(case):
    T, K, E, m = case
    top = routing(T, K, E, 5 * T + 1)
    plan, rows, blocks, total = padmoe.make_plan_layouts(top, E, m)
    ref = padmoe.make_plan(top, E, m)
    for name in ("indices", "bin_ids", "dest_rows", "row_sources", "padded_bins"):
        assert np.array_equal(getattr(plan, name), getattr(ref, name)), name  # the plan itself as make_plan's
    assert rows.tolist() == ref_rows(top, E, m, rows.shape[0])
    P = int(ref.padded_bins[-1]) if E else 0
    assert total.tolist() == [P]
    want_blocks = [-1] * blocks.shape[0]
    for b in range(P // m):
        want_blocks[b] = rows[b * m] if rows[b * m] >= 0 else int(np.searchsorted(ref.padded_bins, b * m, "right"))
    assert blocks.tolist() == want_blocks
    # the torch Routing's DeepGEMM layout is the same
    r = pt.Routing.from_topk(torch.from_numpy(top), None, E, m)
    assert r.row_experts.tolist() == rows.tolist()


def test_bad_input_names_the_argument():
    top = np.array([[1, 0], [0, 1]], dtype=np.int32)
    with pytest.raises(ValueError, match="moe_align_block_size: block_size"):
        padmoe.moe_align_block_size(top, 0, 2)
    with pytest.raises(ValueError, match="moe_align_block_size: block_size"):
        pt.moe_align_block_size(torch.from_numpy(top), 0, 2)
    with pytest.raises(ValueError, match="moe_align_block_size: topk_ids"):
        pt.moe_align_block_size(torch.zeros(4, dtype=torch.int64), 4, 2)
    for fn, m in (
        (padmoe.moe_align_block_size, np.array([0, 2], dtype=np.int32)),
        (pt.moe_align_block_size, torch.tensor([0, 2], dtype=torch.int32)),
    ):
        args = (torch.from_numpy(top),) if fn is pt.moe_align_block_size else (top,)
        with pytest.raises(ValueError, match="moe_align_block_size: expert_map: entry 1 is 2"):
            fn(*args, 4, 2, m, ignore_invalid_experts=True)
        with pytest.raises(ValueError, match="moe_align_block_size: expert_map"):
            fn(*args, 4, 2, m[:1], ignore_invalid_experts=True)


@pytest.mark.parametrize("device", ["numpy"] + DEVICES)
def test_zero_padding_false_leaves_padding_rows_unwritten(device):
    """Options::zero_padding=False: dispatch, padded_gather and pad_to_alignment leave padding rows
    as they were; real rows as with the default."""
    T, K, E, m, H = 40, 2, 6, 8, 5
    top = routing(T, K, E, 11)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, H)).astype(np.float32)
    if device != "numpy":
        top, x = torch.from_numpy(top).to(device), torch.from_numpy(x).to(device)
    plan = padmoe.make_plan(top, E, m)
    rs = np.asarray(plan.row_sources.cpu() if device != "numpy" else plan.row_sources)
    P = int(np.asarray(plan.padded_bins.cpu() if device != "numpy" else plan.padded_bins)[-1])
    pad_rows = [r for r in range(P) if rs[r] < 0]
    assert pad_rows, "the case needs padding rows"

    def nan_rows(n):
        a = np.full((n, H), np.nan, dtype=np.float32)
        return a if device == "numpy" else torch.from_numpy(a).to(device)

    def host(a):
        return np.asarray(a.cpu() if device != "numpy" else a)

    want = host(padmoe.dispatch(x, plan))
    y = padmoe.dispatch(x, plan, out=nan_rows(plan.padded_rows_bound), zero_padding=False)
    got = host(y)
    real = [r for r in range(P) if rs[r] >= 0]
    assert np.array_equal(got[real], want[real]) and np.isnan(got[pad_rows]).all()
    g = padmoe.padded_gather(
        x, plan.indices, plan.bin_ids, plan.bins, plan.padded_bins, K, out=nan_rows(P), zero_padding=False
    )
    assert np.array_equal(host(g)[real], want[real]) and np.isnan(host(g)[pad_rows]).all()
    h = x[(plan.indices // K).long()] if device != "numpy" else x[plan.indices // K]
    # pad_to_alignment allocates its output: with zero_padding=False its padding rows are whatever the
    # allocation held, so only the real rows are compared; the default zeroes the rest
    padded, pmap, _ = padmoe.pad_to_alignment(h, plan.tokens_per_expert, m, zero_padding=False)
    mp = host(pmap)
    assert np.array_equal(host(padded)[mp >= 0], want[:P][mp >= 0])
    default = host(padmoe.pad_to_alignment(h, plan.tokens_per_expert, m)[0])
    assert np.array_equal(default, np.where((mp >= 0)[:, None], want[:P], 0.0))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_zero_padding_false_real_rows_and_gradients(device):
    """padmoe.torch's dispatch / padded_gather / pad_to_alignment with zero_padding=False: real rows as the
    default, gradients as the default (the backward never reads padding rows), compiles, opchecks."""
    T, K, E, m, H = 40, 2, 6, 8, 5
    top = torch.from_numpy(routing(T, K, E, 13)).to(device)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    r = pt.Routing.from_topk(top, w, E, m)
    real = r.plan.row_sources >= 0
    want = r.dispatch(x)
    got = r.dispatch(x, zero_padding=False)
    assert torch.equal(got[real], want[real])
    grads = []
    for zp in (True, False):
        xr = x.clone().requires_grad_(True)
        wr = w.clone().requires_grad_(True)
        rr = pt.Routing.from_topk(top, wr, E, m)
        out = rr.combine(rr.dispatch(xr, zero_padding=zp) * 2.0)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), xr.grad, wr.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    p = r.plan
    y = pt.padded_gather(x, p.indices, p.bin_ids, p.bins, p.padded_bins, K, zero_padding=False)
    P = int(p.padded_bins[-1])
    assert torch.equal(y[real[:P]], want[:P][real[:P]])
    h = x[(p.indices // K).long()]
    padded, pmap, _ = pt.pad_to_alignment(h, p.tokens_per_expert, m, zero_padding=False)
    assert torch.equal(padded[pmap >= 0], want[:P][pmap >= 0])
    f = torch.compile(lambda a: pt.dispatch(a, p, check=False, zero_padding=False), fullgraph=True, backend="aot_eager")
    assert torch.equal(f(x)[real], want[real])
    torch.library.opcheck(
        torch.ops.padmoe.dispatch.default,
        (x, p.packed, None, K, E, m, None, 1, False),
        test_utils=("test_schema", "test_faketensor"),
    )


def ref_batched_align(max_tokens, block, counts):
    """vLLM's batched layout, in plain loops: expert e's rows e * max_tokens + j back to back, each run
    padded to whole blocks; the sentinel E * max_tokens and block id -1 elsewhere."""
    E = len(counts)
    size = -(-max_tokens // block) * block * E
    sorted_ids = [E * max_tokens] * size
    block_ids = [-1] * (size // block)
    i = 0
    for e, n in enumerate(counts):
        for j in range(n):
            sorted_ids[i + j] = e * max_tokens + j
        end = i + -(-n // block) * block
        for b in range(i // block, end // block):
            block_ids[b] = e
        i = end
    return sorted_ids, block_ids, [i]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_tokens", [13, 16, 512])
@pytest.mark.parametrize("E", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("block", [8, 16, 32, 64])
@pytest.mark.parametrize("empty", [False, True])
def test_batched_moe_align_block_size(device, max_tokens, E, block, empty):
    g = torch.Generator().manual_seed(max_tokens * 1000 + E * 10 + block)
    counts = torch.randint(0, max_tokens + 1, (E,), generator=g, dtype=torch.int32)
    if empty:
        counts[torch.randperm(E, generator=g)[: E // 2]] = 0
    s, b, n = pt.batched_moe_align_block_size(max_tokens, block, counts.to(device))
    ws, wb, wn = ref_batched_align(max_tokens, block, counts.tolist())
    assert s.dtype == b.dtype == n.dtype == torch.int32 and s.device.type == device
    assert s.cpu().tolist() == ws and b.cpu().tolist() == wb and n.cpu().tolist() == wn


def test_batched_moe_align_block_size_compiles_and_checks():
    counts = torch.tensor([3, 0, 16, 5], dtype=torch.int32)
    f = torch.compile(
        lambda c: pt.batched_moe_align_block_size(16, 8, c, check=False), fullgraph=True, backend="aot_eager"
    )
    for got, want in zip(f(counts), pt.batched_moe_align_block_size(16, 8, counts)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="batched_moe_align_block_size: expert_num_tokens: entry 1 is 17"):
        pt.batched_moe_align_block_size(16, 8, torch.tensor([3, 17, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="batched_moe_align_block_size: block_size"):
        pt.batched_moe_align_block_size(16, 0, counts)
    s, b, n = pt.batched_moe_align_block_size(16, 8, torch.zeros(0, dtype=torch.int32))
    assert s.numel() == 0 and b.numel() == 0 and n.tolist() == [0]


@pytest.mark.parametrize("device", DEVICES)
def test_batched_moe_align_block_size_operator(device):
    """One native operator: its schema and fake kernel agree with it (opcheck); block_size 1 and past
    max_tokens_per_batch, max_tokens_per_batch 0, no experts and int64 counts match the loops. Bad
    counts raise on the CPU whatever ``check`` says, on CUDA when checked; unchecked on CUDA they
    read as clamped into [0, max_tokens_per_batch]."""
    op = torch.ops.padmoe.batched_moe_align_block_size.default
    for max_tokens, block, counts in ((16, 1, [3, 0, 16]), (5, 64, [5, 0, 2, 5]), (0, 4, [0, 0]), (7, 3, [])):
        c = torch.tensor(counts, dtype=torch.int64, device=device)
        got = pt.batched_moe_align_block_size(max_tokens, block, c)
        assert [t.cpu().tolist() for t in got] == list(ref_batched_align(max_tokens, block, counts))
        torch.library.opcheck(op, (c, max_tokens, block, 1), test_utils=("test_schema", "test_faketensor"))
    bad = torch.tensor([3, 17, -1], dtype=torch.int32, device=device)
    message = (
        r"batched_moe_align_block_size: expert_num_tokens: entry 1 is 17, outside \[0, max_tokens_per_batch = 16\]"
    )
    with pytest.raises(ValueError, match=message):
        pt.batched_moe_align_block_size(16, 8, bad, check=True)
    if device == "cpu":
        with pytest.raises(ValueError, match=message):
            pt.batched_moe_align_block_size(16, 8, bad, check=False)
    else:
        got = pt.batched_moe_align_block_size(16, 8, bad, check=False)
        assert [t.cpu().tolist() for t in got] == list(ref_batched_align(16, 8, [3, 16, 0]))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs CUDA")
@pytest.mark.parametrize("E", [8, 5000])  # the one-launch form and the two-launch one
def test_batched_moe_align_block_size_captures_in_a_cuda_graph(E):
    """check=None reads no data while capturing: the op captures, and replays follow new counts."""
    g = torch.Generator().manual_seed(E)
    counts = torch.randint(0, 25, (E,), generator=g, dtype=torch.int32).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture
        pt.batched_moe_align_block_size(24, 16, counts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pt.batched_moe_align_block_size(24, 16, counts)
    for seed in (1, 2):
        new = torch.randint(0, 25, (E,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        counts.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert [t.cpu().tolist() for t in out] == list(ref_batched_align(24, 16, new.tolist()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,E,align", [(1, 1, 1), (40, 8, 1), (97, 16, 4), (64, 130, 16), (0, 5, 8), (7, 0, 1)])
def test_mask_plan_is_make_plan_of_the_mask(device, T, E, align):
    """pt.mask_plan(routing_map, alignment) is the plan make_plan makes of the ids where(map, e, -1)
    with drop_invalid, entry for entry (the eight arrays), and dispatch / combine with it move rows
    as the loops say; its row_id_map lists each token's rows by descending expert."""
    g = torch.Generator().manual_seed(T * 131 + E + align)
    routing = torch.rand(T, E, generator=g) < 0.3
    ids = torch.where(routing, torch.arange(E, dtype=torch.int32), -1)
    plan, row_id_map = pt.mask_plan(routing.to(device), align)
    assert plan.top_k == E and plan.num_experts == E and plan.alignment == align
    if E:  # make_plan takes E >= 1; with no experts the plan is empty and each count 0
        want = pt.make_plan(ids.to(device), E, align, drop_invalid=True)
        assert torch.equal(plan.packed.cpu(), want.packed.cpu())
    else:
        assert plan.packed.numel() == 0 and row_id_map.shape == (T, 1)
    dest = plan.dest_rows.cpu().view(T, E)
    for t in range(T):
        live = [(int(dest[t, e]), e) for e in reversed(range(E)) if routing[t, e]]
        unpadded = [
            d
            - int(plan.padded_bins[e].cpu() - plan.padded_tokens_per_expert[e].cpu())
            + int(plan.bins[e].cpu() - plan.tokens_per_expert[e].cpu())
            for d, e in live
        ]
        assert row_id_map[t].cpu().tolist() == unpadded + [-1] * (E - len(live)) + [e for _, e in live] + [-1] * (
            E - len(live)
        ) + [len(live)]
    if T and E:
        x = torch.randn(T, 8, generator=g).to(device)
        w = torch.rand(T, E, generator=g).to(device)
        y = pt.dispatch(x, plan)
        out = pt.combine(y, plan, w)
        want_y = torch.zeros(plan.padded_rows_bound, 8, dtype=torch.float64)
        want_out = torch.zeros(T, 8, dtype=torch.float64)
        for t in range(T):
            for e in range(E):
                if routing[t, e]:
                    want_y[int(dest[t, e])] = x[t].cpu().double()
                    want_out[t] += w[t, e].cpu().double() * x[t].cpu().double()
        assert torch.equal(y.cpu().double(), want_y)
        torch.testing.assert_close(out.cpu().double(), want_out, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mask_plan: alignment"):
        pt.mask_plan(routing, 0)
    with pytest.raises(ValueError, match=r"mask_plan: alignment: must be in \[1, 2147483647\], got 2147483648"):
        pt.mask_plan(routing, 2**31)  # the argument named, not a size overflow of the map
    with pytest.raises(TypeError, match="mask_plan: routing_map: expected a bool or integer tensor, got float32$"):
        pt.mask_plan(routing.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T,K,bound,cut,dtype",
    [(1, 1, 4, 1.0, torch.int32), (40, 8, 16, 0.5, torch.int32), (256, 8, 0, 1.0, torch.int64),
     (600, 8, 300, 1.3, torch.int32), (3000, 2, 0, 0.8, torch.int64), (0, 4, 4, 1.0, torch.int32)],
)  # fmt: skip
def test_index_plan_sorts_ids_as_uint32(device, T, K, bound, cut, dtype):
    """``pt.index_plan`` (TE's index map without a number of experts): the assignments
    stable-sorted by their id read as uint32 (int64 ids by their low 32 bits), row j holding the
    j-th, the first ``rows`` kept; checked against a plain sort of (key, assignment), and the rows
    ``dispatch`` moves with it."""
    g = torch.Generator().manual_seed(T * 7 + K)
    if bound:
        ids = torch.randint(0, bound, (T, K), generator=g)
        ids[torch.rand(T, K, generator=g) < 0.1] = -1
    else:
        ids = torch.randint(-(2**40), 2**40, (T, K), generator=g)
    ids = ids.to(dtype)
    a, rows = T * K, int(T * K * cut)
    on_device = pt.index_plan(ids.to(device), rows)
    assert (on_device.num_experts, on_device.alignment, on_device.padded_rows_bound) == (1, 1, rows)
    plan = padmoe.torch.Plan._from_packed(on_device.packed.cpu(), T, K, 1, 1, rows)
    keys = [(int(v) & 0xFFFFFFFF, i) for i, v in enumerate(ids.reshape(-1).tolist())]
    order = [i for _, i in sorted(keys)]
    kept = min(a, rows)
    want_dest = [-1] * a
    for j, i in enumerate(order[:kept]):
        want_dest[i] = j
    assert plan.dest_rows.tolist() == want_dest
    assert plan.row_sources.tolist() == order[:kept] + [-1] * (rows - kept)
    assert plan.indices.tolist() == order[:kept] + [-1] * (a - kept)
    assert plan.bin_ids.tolist() == [0] * kept + [-1] * (a - kept)
    assert [plan.tokens_per_expert.item(), plan.bins.item(), plan.padded_bins.item()] == [kept, kept, rows]
    if a:
        x = torch.randn(T, 4, generator=g, dtype=torch.float64).to(device)
        y = pt.dispatch(x, on_device).cpu()
        want_y = torch.zeros(rows, 4, dtype=torch.float64)
        for j, i in enumerate(order[:kept]):
            want_y[j] = x[i // K].cpu()
        assert torch.equal(y, want_y)
    assert torch.equal(pt.index_plan(ids.to(device)).packed.cpu(), torch.ops.padmoe.index_plan(ids, a))
    with pytest.raises(ValueError, match="index_plan: rows"):
        pt.index_plan(ids.to(device), -1)
    with pytest.raises(TypeError, match="index_plan: top_experts: expected int32 or int64, got float32$"):
        pt.index_plan(ids.to(device).float(), rows)
    with pytest.raises(TypeError, match="index_plan: top_experts: expected int32 or int64, got int16$"):
        pt.index_plan(ids.to(device).short(), rows)
    torch.library.opcheck(torch.ops.padmoe.index_plan.default, (ids.to(device), rows))
