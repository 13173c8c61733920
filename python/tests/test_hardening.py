"""Hardening of the Python layers: sizes checked before anything is
allocated, float64 rows in padmoe.torch checked like float32, tensors on devices padmoe has no
backend for, negative sizes: each raises padmoe's ValueError / TypeError, never MemoryError,
BufferError or torch's RuntimeError."""

import numpy as np
import pytest

import padmoe

torch = pytest.importorskip("torch")
import padmoe.reference as pe  # noqa: E402
import padmoe.torch as pt  # noqa: E402


def test_make_plan_sizes_checked_before_allocating():
    te = np.zeros((4, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=r"make_plan: capacity: size overflow"):
        padmoe.make_plan(te, 4, 2**31 - 1)  # capacity 8 + 4*(2^31-2): 32 GiB of row_sources before the check
    with pytest.raises(ValueError, match=r"make_plan: capacity: size overflow"):
        pt.make_plan(torch.from_numpy(te), 4, 2**31 - 1)
    with pytest.raises(ValueError, match=r"make_plan: (num_experts|capacity): size overflow"):
        pt.make_plan(torch.from_numpy(te), 2**40, 2)


def test_padded_rows_from_data_checked_before_allocating():
    x = np.zeros((2, 4), dtype=np.float32)
    indices = np.array([0, 1], dtype=np.int32)
    bin_ids = np.array([0, 0], dtype=np.int32)
    bins = np.array([2], dtype=np.int64)
    padded_bins = np.array([2**40], dtype=np.int64)  # P = 2^40: 16 TiB of output rows
    with pytest.raises(ValueError, match=r"padded_gather: .*size overflow"):
        padmoe.padded_gather(x, indices, bin_ids, bins, padded_bins, 1)
    tx = torch.from_numpy(x)
    with pytest.raises(ValueError, match=r"padded_gather: padded_bins: size overflow"):
        pt.padded_gather(
            tx,
            torch.from_numpy(indices),
            torch.from_numpy(bin_ids),
            torch.from_numpy(bins),
            torch.from_numpy(padded_bins),
            1,
        )
    h = np.zeros((2, 4), dtype=np.float32)
    counts = np.array([1, 1], dtype=np.int64)
    with pytest.raises(ValueError, match=r"pad_to_alignment: .*size overflow"):
        padmoe.pad_to_alignment(h, counts, 2**30 + 1)  # P = 2^31 + 2
    with pytest.raises(ValueError, match=r"pad_to_alignment: tokens_per_expert: size overflow"):
        pt.pad_to_alignment(torch.from_numpy(h), torch.from_numpy(counts), 2**30 + 1)


def test_float64_rows_get_the_same_checks():
    top = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    p = pe.make_plan(top, 3, 2)
    x = torch.rand(3, 4, dtype=torch.float64)
    # a repeated assignment id in indices: the same ValueError as float32
    bad = p.indices.clone()
    bad[0] = bad[1]
    for dt in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match="padded_gather: indices"):
            pt.padded_gather(x.to(dt), bad, p.bin_ids, p.bins, p.padded_bins, 2)
    # a permutation map naming one output row twice, or a row at or past N
    padded, pmap, _ = pt.pad_to_alignment(x, torch.tensor([2, 1]), 2)
    twice = pmap.clone()
    twice[1] = twice[0]
    past = pmap.clone()
    past[0] = 3
    neg = pmap.clone()
    neg[0] = -2
    for dt in (torch.float32, torch.float64):
        for m, what in ((twice, "permutation_map"), (past, "permutation_map"), (neg, "permutation_map")):
            with pytest.raises(ValueError, match=f"unpad_from_alignment: {what}"):
                pt.unpad_from_alignment(padded.to(dt), m, 3)
    # counts summing past the rows of hidden_states
    for dt in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match="pad_to_alignment"):
            pt.pad_to_alignment(x.to(dt), torch.tensor([3, 4]), 2)
    # a plan whose dest_rows put two assignments on one row
    plan = pt.make_plan(top, 3, 2)
    broken = plan.packed.clone()
    a = 6
    dest_at = 2 * a + 4 * 3
    broken[dest_at + 1] = broken[dest_at]
    for dt in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match=r"dispatch: plan\."):
            torch.ops.padmoe.dispatch(x.to(dt), broken, None, 2, 3, 2, None, 1)


def test_negative_original_size_is_a_value_error():
    padded = torch.zeros(4, 2)
    pmap = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="unpad_from_alignment: original_size"):
        pt.unpad_from_alignment(padded, pmap, -1)
    with pytest.raises(ValueError, match="unpad_from_alignment: original_size"):
        padmoe.unpad_from_alignment(padded.numpy(), pmap.numpy(), -1)


def test_meta_tensors_are_a_type_error_in_the_neutral_api():
    padded = torch.zeros(4, 2, device="meta")
    pmap = torch.zeros(4, dtype=torch.int32, device="meta")
    with pytest.raises(TypeError, match="unpad_from_alignment: expected tensors on the CPU or a CUDA device"):
        padmoe.unpad_from_alignment(padded, pmap, 2)
    # padmoe.torch on meta tensors: the fake kernels give shapes (what torch.compile uses)
    out = pt.unpad_from_alignment(padded, pmap, 2)
    assert out.device.type == "meta" and tuple(out.shape) == (2, 2)


def test_plan_object_whose_sizes_overflow_is_a_value_error():
    """num_tokens * top_k wrapping to 0 used to pass every check and read out of bounds (the
    interpreter died); the library now rejects the sizes before any product is used."""
    from types import SimpleNamespace

    z = np.zeros(0, dtype=np.int32)
    plan = SimpleNamespace(
        indices=z,
        bin_ids=z,
        tokens_per_expert=np.zeros(1, np.int32),
        bins=np.zeros(1, np.int32),
        padded_tokens_per_expert=np.zeros(1, np.int32),
        padded_bins=np.zeros(1, np.int32),
        dest_rows=z,
        row_sources=z,
        num_tokens=2**62,
        top_k=4,
        num_experts=1,
        alignment=1,
    )
    with pytest.raises(ValueError, match=r"combine: plan\.num_tokens: size overflow"):
        padmoe.combine(np.zeros((0, 0), np.float32), plan, out=np.zeros((0, 0), np.float32))
    with pytest.raises(ValueError, match=r"combine: plan\.num_tokens: size overflow"):
        padmoe.combine(torch.zeros(0, 0), plan, out=torch.zeros(0, 0))


@pytest.mark.parametrize("api", ["torch", "numpy"])
def test_counts_are_checked_before_they_size_the_output(api):
    """pad_to_alignment / sort_chunks size their output from counts read on the host: a count of
    2^31 - 1 against one row asked for a 128 GiB tensor (MemoryError / torch's allocator error)
    before the op's own check ran. Now the counts are checked first, with the op's own words."""
    h = torch.randn(1, 16)
    r = torch.randn(4, 8)
    cases = [
        ("pad", [2**31 - 1], r"pad_to_alignment: tokens_per_expert: entry 0 \(2147483647\) exceeds the 1 rows"),
        ("pad", [-3], r"pad_to_alignment: tokens_per_expert: entry 0 is negative \(-3\)"),
        ("sort", [1, 2**31 - 1, 1, 1], r"sort_chunks: split_sizes: entry \[0, 1\] \(2147483647\) exceeds the 4 rows"),
        ("sort", [3, 3, 0, 0], r"sort_chunks: split_sizes: sums to 6 but received has 4 rows"),
        ("sort", [1, 1, -1, 1], r"sort_chunks: split_sizes: entry \[1, 0\] is negative \(-1\)"),
    ]
    for op, counts, msg in cases:
        c = torch.tensor(counts, dtype=torch.int32)
        with pytest.raises(ValueError, match=msg):
            if op == "pad":
                if api == "torch":
                    pt.pad_to_alignment(h, c, 1)
                else:
                    padmoe.pad_to_alignment(h.numpy(), c.numpy(), 1)
            elif api == "torch":
                pt.sort_chunks(r, c, 2, 1)
            else:
                padmoe.sort_chunks(r.numpy(), c.numpy(), 2, 1)
    # valid counts still pass (a zero-count expert, fewer rows used than held)
    if api == "torch":
        padded, pmap, offs = pt.pad_to_alignment(h, torch.tensor([0, 1], dtype=torch.int32), 2)
    else:
        padded, pmap, offs = padmoe.pad_to_alignment(h.numpy(), np.array([0, 1], np.int32), 2)
    assert list(np.asarray(pmap)) == [0, -1] and list(np.asarray(offs)) == [0, 2]
    assert np.array_equal(np.asarray(padded)[0], h.numpy()[0]) and not np.asarray(padded)[1].any()


def _plan_with_sources(sources):
    plan = padmoe.make_plan(np.array([[0, 1], [1, 0]], dtype=np.int32), 2, 2)
    object.__setattr__(plan, "row_sources", sources)
    return plan


def test_plan_ops_check_what_sizes_their_output_before_allocating():
    from numpy.lib.stride_tricks import as_strided

    x = np.ones((2, 8), dtype=np.float32)
    # a zero-stride row_sources naming 2^31 - 1 rows: 64 GiB of output before the plan's own checks
    plan = _plan_with_sources(as_strided(np.zeros(1, dtype=np.int32), shape=(2**31 - 1,), strides=(0,)))
    for op, call in (
        ("dispatch", lambda: padmoe.dispatch(x, plan)),
        ("combine_backward", lambda: padmoe.combine_backward(x, np.ones((6, 8), np.float32), plan)),
        ("dispatch_quantized", lambda: padmoe.dispatch_quantized(x, plan)),
    ):
        with pytest.raises(ValueError, match=op + r": plan.row_sources: expected a contiguous tensor, got stride 0"):
            call()
    good = padmoe.make_plan(np.array([[0, 1], [1, 0]], dtype=np.int32), 2, 2)
    with pytest.raises(ValueError, match=r"dispatch_quantized: rows: size overflow"):
        padmoe.dispatch_quantized(x, good, rows=2**40)  # 8 TiB of codes before

    class NotAPlan:  # a duck-typed plan without row_sources
        num_tokens, top_k, num_experts, alignment = 2, 2, 2, 2

    for call in (lambda: padmoe.dispatch(x, NotAPlan()), lambda: padmoe.dispatch_quantized(x, NotAPlan())):
        with pytest.raises(TypeError, match=r"plan: expected a padmoe Plan"):
            call()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else []))
def test_sort_chunks_size_sums_past_2_63_are_reported(device):
    # received of 2^62 rows without columns and four chunks of 2^62: the sizes sum to 2^64. The CPU's
    # checked sum reports the overflow; on CUDA the 64-bit layout's sums saturate and are reported
    # (before, the choice of the 32-bit layout overflowed and the wrapped sums passed validation)
    received = torch.empty((2**62, 0), device=device)
    sizes = torch.full((4,), 2**62, dtype=torch.int64, device=device)
    want = "size overflow" if device == "cpu" else "sums to at least 9223372036854775807 but received"
    with pytest.raises(ValueError, match=r"sort_chunks: split_sizes: " + want):
        pt.sort_chunks(received, sizes, 1, 1, rows=8)
