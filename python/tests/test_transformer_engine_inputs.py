"""padmoe.torch.transformer_engine on the edges of TE's API: inputs TE accepts give TE's documented
results (an empty mask-map output, +0.0 rows for probability 0), inputs it cannot take raise a
TypeError / ValueError naming the TE function and its argument, never an inner padmoe op or a raw
torch error, and a row_id_map that padmoe's permute did not make is verified before it is read."""

import numpy as np
import pytest

import padmoe

torch = pytest.importorskip("torch")
import padmoe.torch.transformer_engine as te  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_mask_map_routing_nothing_gives_an_empty_output(device, with_probs):
    # local experts that receive nothing: num_out_tokens = int(routing_map.sum()) = 0
    x = torch.randn(5, 8, device=device, requires_grad=True)
    rmap = torch.zeros(5, 3, dtype=torch.bool, device=device)
    assert int(rmap.sum()) == 0
    if with_probs:
        probs = torch.rand(5, 3, device=device, requires_grad=True)
        out, moved, row_id_map = te.moe_permute_with_probs(x, probs, rmap, 0)
        assert moved.shape == (0,)
    else:
        out, row_id_map = te.moe_permute(x, rmap, 0)
    assert out.shape == (0, 8) and out.dtype == x.dtype
    # TE's row_id_map of a map routing nothing: no rows, no experts, count 0 for every token
    want = np.full((5, 7), -1, dtype=np.int32)
    want[:, 6] = 0
    np.testing.assert_array_equal(row_id_map.cpu().numpy(), want)
    out.sum().backward()
    np.testing.assert_array_equal(x.grad.cpu().numpy(), np.zeros((5, 8), dtype=np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probability_zero_rows_are_positive_zero(device, dtype):
    # TE stores a routed slot of probability 0 as a +0.0 row; x * 0 would be -0.0 for negative x
    x = -(torch.rand(4, 16) + 0.5)
    rmap = torch.ones(4, 3, dtype=torch.bool)
    probs = torch.rand(4, 3) + 0.1
    probs[1, 2] = 0.0
    probs[3, 0] = 0.0
    x, rmap, probs = x.to(device=device, dtype=dtype), rmap.to(device), probs.to(device)
    out, moved, _ = te.moe_permute_with_probs(x, probs, rmap, 12)
    # expert-major rows, tokens in order: row e*4 + t holds token t for expert e
    bits = out.cpu().view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy()
    for e in range(3):
        for t in range(4):
            r = e * 4 + t
            if probs[t, e] == 0:
                assert not bits[r].any(), (t, e)  # every bit clear: +0.0
            else:
                np.testing.assert_array_equal(out[r].cpu().float().numpy(), x[t].cpu().float().numpy())
            assert float(moved[r]) == float(probs[t, e])
    padded = te.moe_permute_and_pad_with_probs(x, probs, rmap, rmap.sum(0), 8)[0]
    pbits = padded.cpu().view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy()
    assert not pbits[1 + 2 * 8].any() and not pbits[3].any()  # expert 2, token 1; expert 0, token 3


def test_bad_inputs_name_the_te_function_and_argument():
    x = torch.randn(4, 8)
    full = torch.ones(4, 3, dtype=torch.bool)
    probs = torch.rand(4, 3)
    with pytest.raises(ValueError, match=r"moe_permute: routing_map: has no experts"):
        te.moe_permute(x, torch.zeros(4, 0, dtype=torch.bool), 4)
    with pytest.raises(TypeError, match=r"moe_permute_with_probs: inp: expected float32.*got torch.int32"):
        te.moe_permute_with_probs(torch.ones(4, 8, dtype=torch.int32), probs, full, 12)
    with pytest.raises(TypeError, match=r"moe_permute_and_pad_with_probs: inp: expected"):
        te.moe_permute_and_pad_with_probs(torch.ones(4, 8, dtype=torch.int64), probs, full, full.sum(0), 4)
    with pytest.raises(ValueError, match=r"moe_permute: num_out_tokens: .*at most 2\^31 - 1"):
        te.moe_permute(x, full, 2**40)
    with pytest.raises(ValueError, match=r"moe_permute_with_probs: num_out_tokens"):
        te.moe_permute_with_probs(x, probs, full, 2**31)
    out, row_id_map = te.moe_permute(x, full, 12)
    with pytest.raises(TypeError, match=r"moe_unpermute: merging_probs: expected a float tensor, got torch.int32"):
        te.moe_unpermute(out, row_id_map, merging_probs=torch.ones(4, 3, dtype=torch.int32), restore_shape=x.shape)
    for bad in (torch.tensor([3.5, 0.5]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match=r"moe_sort_chunks_by_index: split_sizes: expected an integer tensor"):
            te.moe_sort_chunks_by_index(x, bad, torch.tensor([1, 0]))
    with pytest.raises(TypeError, match=r"moe_sort_chunks_by_index_with_probs: sorted_index: expected an integer"):
        te.moe_sort_chunks_by_index_with_probs(x, torch.rand(4), torch.tensor([3, 1]), torch.tensor([1.0, 0.0]))


def _mask_case():
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    rmap = torch.rand(6, 4) < 0.5
    rmap[:, 0] = True
    out, row_id_map = te.moe_permute(x, rmap, int(rmap.sum()))
    return x, rmap, out, row_id_map.clone()  # a clone: the map padmoe did not make (no kept plan)


def test_foreign_mask_map_is_read_as_te_defines_it():
    x, rmap, out, rim = _mask_case()
    want = np.zeros((6, 8))
    for t in range(6):
        for j in range(int(rim[t, 8])):
            want[t] += out[int(rim[t, j])].double().numpy()
    got = te.moe_unpermute(out, rim, restore_shape=x.shape)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.numpy(), x.numpy() * rmap.sum(1, keepdim=True).numpy(), rtol=1e-6, atol=1e-6)


def test_foreign_mask_map_errors():
    x, rmap, out, rim = _mask_case()
    total = int(rmap.sum())
    cases = []
    bad = rim.clone()
    bad[2, 0] = 2**31 - 1  # a destination row past every row of the permute
    cases.append((bad, r"row_id_map: token 2 names row 2147483647, outside \[0, %d\)" % total))
    bad = rim.clone()
    bad[0, 5] = bad[0, 4]  # token 0's second slot names its first expert again
    cases.append((bad, r"row_id_map: token 0 names expert \d twice"))
    bad = rim.clone()
    bad[1, 4] = 7  # an expert outside [0, E)
    cases.append((bad, r"row_id_map: token 1 names expert 7, outside \[0, 4\)"))
    bad = rim.clone()
    bad[3, 8] = 5  # a count past E
    cases.append((bad, r"row_id_map: token 3 has count 5, outside \[0, 4\]"))
    bad = rim.clone()
    bad[1, 0] = rim[0, 0]  # two tokens name one row
    cases.append((bad, r"row_id_map: row \d+ is named twice"))
    for bad, msg in cases:
        with pytest.raises(ValueError, match="moe_unpermute: " + msg):
            te.moe_unpermute(out, bad, restore_shape=x.shape)
    with pytest.raises(TypeError, match=r"moe_unpermute: row_id_map: expected an integer tensor"):
        te.moe_unpermute(out, rim.float(), restore_shape=x.shape)
    # check=False reads nothing on the host: the map is taken as given
    te.moe_unpermute(out, rim, restore_shape=x.shape, check=False)


def test_foreign_padded_map_errors():
    torch.manual_seed(1)
    x = torch.randn(5, 8)
    rmap = torch.rand(5, 3) < 0.6
    rmap[0] = True
    probs = torch.rand(5, 3)
    out, _, rim, pad, _ = te.moe_permute_and_pad_with_probs(x, probs, rmap, rmap.sum(0), 4)
    rim = rim.clone()
    assert pad is not None
    got = te.moe_unpermute(out, rim, restore_shape=x.shape, pad_offsets=pad)
    np.testing.assert_allclose(got.numpy(), (x * (rmap & (probs != 0)).sum(1, keepdim=True)).numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match=r"moe_unpermute: pad_offsets: expected a tensor of shape \[3\]"):
        te.moe_unpermute(out, rim, restore_shape=x.shape, pad_offsets=pad[:2])
    with pytest.raises(ValueError, match=r"moe_unpermute: pad_offsets: token \d+'s row plus its expert's offset"):
        te.moe_unpermute(out, rim, restore_shape=x.shape, pad_offsets=pad + 1000)
    with pytest.raises(ValueError, match=r"moe_unpermute: pad_offsets: entry 0 is negative"):
        te.moe_unpermute(out, rim, restore_shape=x.shape, pad_offsets=pad - 100)
    with pytest.raises(TypeError, match=r"moe_unpermute: pad_offsets: expected an integer tensor"):
        te.moe_unpermute(out, rim, restore_shape=x.shape, pad_offsets=pad.float())


def test_foreign_index_map_errors():
    x = torch.randn(4, 8)
    index = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 1]])
    out, rim = te.moe_permute(x, index, 0, map_type="index")
    rim = rim.clone()
    w = torch.rand(4, 2)
    got = te.moe_unpermute(out, rim, w, map_type="index")
    want = (x * w.sum(1, keepdim=True)).numpy()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    bad = rim.clone()
    bad[3] = 8
    with pytest.raises(ValueError, match=r"moe_unpermute: row_id_map: entry 3 is 8, outside \[0, 8\)"):
        te.moe_unpermute(out, bad, w, map_type="index")
    bad = rim.clone()
    bad[1] = bad[0]
    with pytest.raises(ValueError, match=r"moe_unpermute: row_id_map: row \d+ is named twice"):
        te.moe_unpermute(out, bad, w, map_type="index")


def test_a_device_without_an_index_is_the_current_one():
    """TE's quantized tensors report ``cuda`` where their data is on ``cuda:0``: the TE functions take
    that as the current device of its type, not as a second device."""
    from types import SimpleNamespace as NS

    from padmoe.torch._te_checks import _same_device

    assert _same_device(NS(device=torch.device("cpu")), NS(device=torch.device("cpu", 0)))
    assert not _same_device(NS(device=torch.device("cpu")), NS(device=torch.device("meta")))
    if torch.cuda.is_available():
        here = torch.device("cuda", torch.cuda.current_device())
        assert _same_device(NS(device=torch.device("cuda")), NS(device=here))
        assert _same_device(NS(device="cuda"), torch.zeros(1, device=here))
