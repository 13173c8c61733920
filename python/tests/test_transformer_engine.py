"""padmoe.torch.transformer_engine against TransformerEngine's definitions, written here as plain
loops: the chunk sort (moe_sort_chunks_by_index, _with_probs), forward and backward, with TE's test
shapes (chunks of E experts on tp ranks, sorted expert-major), uneven and empty chunks, rows past
the chunks, bf16 and float32, empty input, torch.compile, and bad input named in TE's terms."""

import numpy as np
import pytest

import padmoe

torch = pytest.importorskip("torch")
import padmoe.torch.transformer_engine as te  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])


def ref_sort_chunks(rows, split_sizes, sorted_index):
    """TE's chunk sort in loops: output position j holds chunk sorted_index[j], chunks back to back;
    rows past sum(split_sizes) keep their place. Returns the source row of each output row."""
    starts = np.concatenate([[0], np.cumsum(split_sizes)[:-1]]).astype(np.int64)
    source = []
    for c in sorted_index:
        source.extend(range(starts[c], starts[c] + split_sizes[c]))
    source.extend(range(int(np.sum(split_sizes)), rows))
    return np.array(source, dtype=np.int64)


def te_case(T, E, tp, seed, tail=0):
    """TE's test: random split sizes over E*tp chunks summing to T - tail, sorted expert-major."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, T - tail + 1, E * tp - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [T - tail]])).astype(np.int64)
    order = np.arange(E * tp).reshape(tp, E).T.ravel()
    return sizes, order


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, tp, tail", [(4096, 7, 2, 0), (512, 16, 8, 0), (300, 4, 2, 37), (64, 3, 1, 64)])
def test_sort_chunks_by_index_with_probs(device, dtype, T, E, tp, tail):
    H = 24
    sizes, order = te_case(T, E, tp, T + E + tp, tail)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    probs = torch.rand(T, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    ss = torch.tensor(sizes, dtype=torch.int32, device=device)
    si = torch.tensor(order, dtype=torch.int32, device=device)
    out, pprobs = te.moe_sort_chunks_by_index_with_probs(x, probs, ss, si)
    source = ref_sort_chunks(T, sizes, order)
    xh, ph = x.detach().cpu(), probs.detach().cpu()
    assert out.dtype == dtype and pprobs.dtype == dtype and out.device.type == device
    assert torch.equal(out.detach().cpu(), xh[source]) and torch.equal(pprobs.detach().cpu(), ph[source])
    assert torch.equal(te.moe_sort_chunks_by_index(x.detach(), ss, si).cpu(), xh[source])
    # backward: each input row gets the gradient of the output row that holds it
    gy = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    gp = torch.randn(T, generator=g).to(device=device, dtype=dtype)
    torch.autograd.backward((out, pprobs), (gy, gp))
    want_gx = torch.empty_like(gy.cpu())
    want_gp = torch.empty_like(gp.cpu())
    for j, i in enumerate(source):
        want_gx[i] = gy.cpu()[j]
        want_gp[i] = gp.cpu()[j]
    assert torch.equal(x.grad.cpu(), want_gx) and torch.equal(probs.grad.cpu(), want_gp)


@pytest.mark.parametrize("device", DEVICES)
def test_sort_chunks_by_index_edges(device):
    x = torch.arange(40.0, device=device).reshape(10, 4)
    # empty chunks, a chunk of every row, int64 arguments, one chunk
    for sizes, order in (([0, 4, 0, 6], [3, 2, 1, 0]), ([10], [0]), ([2, 3], [1, 0]), ([0, 0], [1, 0])):
        ss = torch.tensor(sizes, dtype=torch.int64, device=device)
        si = torch.tensor(order, dtype=torch.int64, device=device)
        source = ref_sort_chunks(10, np.array(sizes), np.array(order))
        assert torch.equal(te.moe_sort_chunks_by_index(x, ss, si).cpu(), x.cpu()[source])
    empty = torch.zeros(0, 4, device=device)
    two, swap = torch.tensor([0, 0], device=device), torch.tensor([1, 0], device=device)
    assert te.moe_sort_chunks_by_index(empty, two, swap).shape == (0, 4)
    out, pp = te.moe_sort_chunks_by_index_with_probs(empty, torch.zeros(0, device=device), two, swap)
    assert out.shape == (0, 4) and pp.shape == (0,)


def test_sort_chunks_by_index_compiles():
    x = torch.randn(12, 8)
    ss = torch.tensor([5, 2, 3], dtype=torch.int32)
    si = torch.tensor([2, 0, 1], dtype=torch.int32)
    f = torch.compile(
        lambda a: te.moe_sort_chunks_by_index(a, ss, si, check=False), fullgraph=True, backend="aot_eager"
    )
    assert torch.equal(f(x), x[ref_sort_chunks(12, np.array([5, 2, 3]), np.array([2, 0, 1]))])


def test_bad_input_names_te_arguments():
    x = torch.randn(20, 4)
    cases = [
        ([3, 0, 5, 4, 6], [2, 0, 4, 1, 1], "moe_sort_chunks_by_index: sorted_index: must be a permutation of"),
        ([3, 0, 5, 4, 16], [2, 0, 4, 1, 3], "split_sizes: the chunks hold 28 rows, more than inp's 20"),
        ([3, 0, 5, 4, -1], [2, 0, 4, 1, 3], "split_sizes: entry 4 is negative"),
        ([3, 0, 5, 4, 6], [2, 0, 4, 1, 7], "sorted_index: position 4 holds chunk 7, outside"),
        ([3, 0, 5], [2, 0, 1, 3], "split_sizes and sorted_index: expected two 1-D tensors of one length"),
    ]
    for sizes, order, message in cases:
        with pytest.raises(ValueError, match=message):
            te.moe_sort_chunks_by_index(x, torch.tensor(sizes), torch.tensor(order))
    with pytest.raises(ValueError, match="moe_sort_chunks_by_index_with_probs: probs: expected \\[20\\]"):
        te.moe_sort_chunks_by_index_with_probs(x, torch.rand(19), torch.tensor([20]), torch.tensor([0]))
    with pytest.raises(TypeError, match="moe_sort_chunks_by_index: split_sizes: expected a torch tensor"):
        te.moe_sort_chunks_by_index(x, [20], torch.tensor([0]))
