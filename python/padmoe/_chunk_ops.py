"""The expert-parallel chunk sort on numpy arrays (and torch tensors, as padmoe.torch has them):
sort_chunks / unsort_chunks, and copy across devices. Each function is its unique part under
``@native_op`` (_native_op.py)."""

from __future__ import annotations

from typing import Optional, Tuple

from ._arrays import arrays_of
from ._common import _C, Array, _padded_out
from ._dropin_ops import _map_and_offsets, unpad_from_alignment
from ._native_op import NO_OUT, PADDED, native_op


def _groups(split_sizes, num_ranks) -> int:
    """E, the local experts: the chunks (R*E) over the ranks."""
    chunks = 1
    for d in split_sizes.shape:
        chunks *= int(d)
    e = chunks // int(num_ranks) if int(num_ranks) >= 1 else 0
    return max(e, 0)


@native_op(outputs="padded permutation_map inclusive_offsets", keywords=PADDED)
def sort_chunks(
    c,
    received: Array,
    split_sizes: Array,
    num_ranks: int,
    alignment: int,
    sorted_index: Optional[Array] = None,
    *,
    rows: Optional[int] = None,
) -> Tuple[Array, Array, Array]:
    """The chunk sort after an expert-parallel all-to-all:
    ``(padded[P, H], permutation_map[P] int32, inclusive_offsets[E] int32)``.

    ``received[N, H]`` is rank-major: chunk ``c = r*E + e`` holds ``split_sizes[c]`` rows
    (``split_sizes`` int32/int64 ``[R*E]`` or ``[R, E]``, ``R = num_ranks``). Output position
    ``j`` holds chunk ``sorted_index[j]`` when given (TransformerEngine's
    ``moe_sort_chunks_by_index``), else ``(j % R)*E + j // R`` (expert-major: local expert e's
    chunks from ranks 0..R-1); every group of R consecutive positions (a local expert) is padded to
    a multiple of ``alignment`` with zero rows (-1 in the map): pad_to_alignment's layout, with
    ``inclusive_offsets`` the grouped-GEMM offsets. Rows past ``sum(split_sizes)`` are ignored.
    The way back is :func:`unsort_chunks`.

    P is computed from ``split_sizes`` on the host (CUDA: one synchronization); ``rows=n``
    allocates n rows instead (e.g. ``sort_chunks_rows_bound(N, R*E, R, alignment)``: no
    synchronization with ``check=False``); map entries past P are -1, padded rows past P zero.
    """
    c.padded = _padded_out(
        c.arrays,
        c.op,
        received,
        rows,
        c.padded,  # P after the op's own checks
        lambda: _C.sort_chunks_rows(received, split_sizes, num_ranks, alignment, sorted_index, **c.opts),
    )
    _map_and_offsets(c, received, lambda: _groups(split_sizes, num_ranks))


@native_op(arrays="")
def unsort_chunks(c, padded: Array, permutation_map: Array, received_rows: int, probs: Optional[Array] = None) -> Array:
    """The inverse of :func:`sort_chunks`: ``out[received_rows, H]`` rank-major again,
    ``out[map[p]] = padded[p]`` (times ``probs[map[p]]``, probs by rank-major row); padding
    dropped, rows no entry names (past ``sum(split_sizes)``) zero. This is exactly
    :func:`unpad_from_alignment` (same options, same errors), one pass."""
    return unpad_from_alignment(
        padded,
        permutation_map,
        received_rows,
        probs,
        check=c.check,
        out=c.out,
        num_threads=c.num_threads,
        workspace=c.workspace,
        stream=c.stream,
    )


# ---------------------------------------------------------------------------
# Utilities
# ---------------------------------------------------------------------------


@native_op(arrays="dst src", keywords=NO_OUT)
def copy(c, src: Array, dst: Array) -> Array:
    """``dst[...] = src`` byte for byte (same dtype and element count, both contiguous), on any
    devices (host <-> CUDA too); returns ``dst``. A utility: numpy arrays and torch tensors alike."""
    if c.stream is None:  # the current torch stream of whichever side is a CUDA tensor
        c.stream = c.arrays.stream(dst) or arrays_of(src, c.op, "src").stream(src)
    _C.copy(src, dst, **c.opts)
    return dst
