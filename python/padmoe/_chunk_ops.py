"""The expert-parallel chunk sort on numpy arrays (and torch tensors, as padmoe.torch has them):
sort_chunks / unsort_chunks, and copy across devices."""

from __future__ import annotations

from typing import Optional, Tuple

from ._arrays import arrays_of, prepare
from ._common import (
    _C,
    Array,
    _options,
    _padded_out,
    _split_out,
)
from ._dropin_ops import unpad_from_alignment


def sort_chunks(
    received: Array,
    split_sizes: Array,
    num_ranks: int,
    alignment: int,
    sorted_index: Optional[Array] = None,
    *,
    rows: Optional[int] = None,
    check: Optional[bool] = None,
    zero_padding: bool = True,
    out: Optional[Tuple[Array, Array, Array]] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
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
    op = "sort_chunks"
    arrays = arrays_of(received, op, "received")
    out_p, out_m, out_o = _split_out(op, out, 3)
    received, split_sizes, sorted_index, out_p, out_m, out_o = prepare(
        arrays, received, split_sizes, sorted_index, out_p, out_m, out_o
    )
    padded = _padded_out(
        arrays,
        op,
        received,
        rows,
        out_p,  # P after the op's own checks
        lambda: _C.sort_chunks_rows(
            received,
            split_sizes,
            num_ranks,
            alignment,
            sorted_index,
            **_options(arrays, received, check, num_threads, workspace, stream),
        ),
    )
    permutation_map = out_m if out_m is not None else arrays.empty((int(padded.shape[0]),), arrays.int32, received)
    if out_o is None:
        c = 1
        for d in split_sizes.shape:
            c *= int(d)
        e = c // int(num_ranks) if int(num_ranks) >= 1 else 0
        out_o = arrays.empty((max(e, 0),), arrays.int32, received)
    _C.sort_chunks_out(
        received,
        split_sizes,
        num_ranks,
        alignment,
        sorted_index,
        padded,
        permutation_map,
        out_o,
        **_options(arrays, received, check, num_threads, workspace, stream, zero_padding, out_p is not None),
    )
    return padded, permutation_map, out_o


def unsort_chunks(
    padded: Array,
    permutation_map: Array,
    received_rows: int,
    probs: Optional[Array] = None,
    *,
    check: Optional[bool] = None,
    out: Optional[Array] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Array:
    """The inverse of :func:`sort_chunks`: ``out[received_rows, H]`` rank-major again,
    ``out[map[p]] = padded[p]`` (times ``probs[map[p]]``, probs by rank-major row); padding
    dropped, rows no entry names (past ``sum(split_sizes)``) zero. This is exactly
    :func:`unpad_from_alignment` (same options, same errors), one pass."""
    return unpad_from_alignment(
        padded,
        permutation_map,
        received_rows,
        probs,
        check=check,
        out=out,
        num_threads=num_threads,
        workspace=workspace,
        stream=stream,
    )


# ---------------------------------------------------------------------------
# Utilities
# ---------------------------------------------------------------------------


def copy(
    src: Array,
    dst: Array,
    *,
    check: Optional[bool] = None,
    num_threads: int = 0,
    workspace: Optional[Array] = None,
    stream: Optional[int] = None,
) -> Array:
    """``dst[...] = src`` byte for byte (same dtype and element count, both contiguous), on any
    devices (host <-> CUDA too); returns ``dst``. A utility: numpy arrays and torch tensors alike."""
    op = "copy"
    dst_arrays = arrays_of(dst, op, "dst")
    src_arrays = arrays_of(src, op, "src")
    (src,) = prepare(src_arrays, src)
    (dst,) = prepare(dst_arrays, dst)
    if stream is None:  # the current torch stream of whichever side is a CUDA tensor
        stream = dst_arrays.stream(dst) or src_arrays.stream(src)
    _C.copy(src, dst, **_options(dst_arrays, dst, check, num_threads, workspace, stream))
    return dst
