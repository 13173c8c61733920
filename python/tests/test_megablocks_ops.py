"""padmoe.torch.megablocks: MegaBlocks' ``ops`` names (sort, histogram, cumsums, round_up and the padded
drop-ins) used the way MegaBlocks' own padded path uses them, against plain loops in float64."""

import numpy as np
import pytest

import padmoe

torch = pytest.importorskip("torch")
import padmoe.torch.megablocks as ops  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_helpers_against_loops(device, dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 9, (300,), generator=g, dtype=dtype)
    values, indices = ops.sort(x.to(device), end_bit=4)
    assert values.dtype == indices.dtype == dtype
    order = sorted(range(300), key=lambda i: (int(x[i]), i))  # stable
    assert indices.cpu().tolist() == order and values.cpu().tolist() == [int(x[i]) for i in order]
    with_outside = torch.cat([x, torch.tensor([-1, 9, 100], dtype=dtype)]).to(device)
    counts = ops.histogram(with_outside, 8)
    assert counts.dtype == torch.int32
    assert counts.cpu().tolist() == [sum(1 for v in x.tolist() if v == e) for e in range(8)]
    c = torch.tensor([3, 0, 5, 2], dtype=dtype, device=device)
    assert ops.inclusive_cumsum(c, 0).cpu().tolist() == [3, 3, 8, 10]
    assert ops.exclusive_cumsum(c, 0).cpu().tolist() == [0, 3, 3, 8]
    assert ops.round_up(c, 4).cpu().tolist() == [4, 0, 8, 4]
    assert ops.inclusive_cumsum(c, 0).dtype == ops.exclusive_cumsum(c, 0).dtype == ops.round_up(c, 4).dtype == dtype
    with pytest.raises(ValueError, match="round_up: value"):
        ops.round_up(c, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sl,hs,ne,top_k", [(4, 2, 2, 2), (1024, 1, 64, 4), (1024, 96, 4, 2), (333, 40, 128, 1)])
def test_megablocks_padded_path(device, sl, hs, ne, top_k):
    g = torch.Generator().manual_seed(sl + ne + top_k)
    x = torch.randn(sl, hs, generator=g, dtype=torch.float32)
    top_expert = torch.randint(0, ne, (sl * top_k,), generator=g).int()
    weights = torch.rand(sl * top_k, generator=g)
    xd, ted, wd = x.to(device), top_expert.to(device), weights.to(device)
    bin_ids, indices = ops.sort(ted)
    tokens_per_expert = ops.histogram(ted, ne)
    padded_bins = ops.inclusive_cumsum(ops.round_up(tokens_per_expert, 128), 0)
    bins = ops.inclusive_cumsum(tokens_per_expert, 0)
    y = ops.padded_gather(xd, indices, bin_ids, bins, padded_bins, top_k)
    out = ops.padded_scatter(y, indices, bin_ids, wd, bins, padded_bins, top_k)

    # plain loops: each expert's assignments (ascending id) at its 128-aligned segment
    xn, ten, wn = x.double().numpy(), top_expert.numpy(), weights.double().numpy()
    want_y, want_out = [], np.zeros((sl, hs))
    for e in range(ne):
        mine = [a for a in range(sl * top_k) if ten[a] == e]
        rows = np.zeros((-(-len(mine) // 128) * 128, hs))
        for i, a in enumerate(mine):
            rows[i] = xn[a // top_k]
            want_out[a // top_k] += wn[a] * xn[a // top_k]
        want_y.append(rows)
    want_y = np.concatenate(want_y) if want_y else np.zeros((0, hs))
    assert torch.equal(y.cpu().double(), torch.from_numpy(want_y))  # moves are exact
    np.testing.assert_allclose(out.cpu().double().numpy(), want_out, rtol=1e-5, atol=1e-5)
