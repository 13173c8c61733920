"""TransformerEngine's MoE permutation API (``transformer_engine.pytorch``) on padmoe, so that code
written against TE's functions runs with ``import padmoe.torch.transformer_engine as te``.

So far: ``moe_sort_chunks_by_index`` and ``moe_sort_chunks_by_index_with_probs``, the chunk sort
after an expert-parallel all-to-all. TE's ``moe_permute``, ``moe_permute_with_probs``,
``moe_permute_and_pad_with_probs`` and ``moe_unpermute`` are not here yet; padmoe's own
:class:`padmoe.torch.Routing` covers the same routing (plan, dispatch, combine, backward).

``moe_sort_chunks_by_index(inp[T, H], split_sizes[S], sorted_index[S]) -> output[T, H]``: the rows
of ``inp`` are S consecutive chunks of ``split_sizes[i]`` rows; output position j holds chunk
``sorted_index[j]``, chunks back to back (``torch.cat([inp.split(split_sizes)[i] for i in
sorted_index])``), and the rows of ``inp`` past ``sum(split_sizes)`` stay where they are, as in TE.
``moe_sort_chunks_by_index_with_probs(inp, probs[T], split_sizes, sorted_index) -> (output,
permuted_probs[T])`` moves ``probs`` with the rows. Both are differentiable (the backward moves the
gradient rows back; ``probs``' gradient likewise), read nothing on the host with ``check=False``,
under ``torch.compile`` or while a CUDA graph captures (``check=None`` in eager mode checks the
chunk sizes and order: one synchronization on CUDA), and are bitwise deterministic: one padmoe ``sort_chunks`` with a last chunk that holds
the rows past ``sum(split_sizes)`` and stays last.

Where padmoe differs from TE: ``split_sizes`` and ``sorted_index`` may be int32 or int64 and live
on ``inp``'s device (TE requires CUDA tensors); ``sorted_index`` must be a permutation of
``[0, S)`` and ``sum(split_sizes)`` at most T, checked in eager mode (TE leaves rows unwritten or
writes past the output); CPU tensors run too."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from padmoe.torch import sort_chunks

from ._common import Tensor, compiling, host_check

__all__ = ["moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]


def _check_chunks(op: str, rows: int, sizes: Tensor, order: Tensor) -> None:
    """The chunk sizes and order as TE's arguments (on the host): sizes >= 0 summing to at most the
    rows of inp, and sorted_index a permutation of [0, S)."""
    for i, n in enumerate(sizes.tolist()):
        if n < 0:
            raise ValueError(f"{op}: split_sizes: entry {i} is negative ({n})")
    total = int(sizes.sum())
    if total > rows:
        raise ValueError(f"{op}: split_sizes: the chunks hold {total} rows, more than inp's {rows}")
    seen = set()
    for j, c in enumerate(order.tolist()):
        if not 0 <= c < order.numel():
            raise ValueError(f"{op}: sorted_index: position {j} holds chunk {c}, outside [0, {order.numel()})")
        if c in seen:
            raise ValueError(
                f"{op}: sorted_index: must be a permutation of [0, {order.numel()}): chunk {c} appears twice"
            )
        seen.add(c)


def _chunk_sort(op: str, inp: Tensor, split_sizes: Tensor, sorted_index: Tensor, check: Optional[bool]):
    """padmoe's sort_chunks over S + 1 chunks: TE's S, then the rows past sum(split_sizes) as a last
    chunk that sorts to the end. Returns (output[T, H], permutation_map[T]: the input row of each
    output row)."""
    for name, t in (("inp", inp), ("split_sizes", split_sizes), ("sorted_index", sorted_index)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name}: expected a torch tensor, got {type(t).__name__}")
    if inp.dim() != 2:
        raise ValueError(f"{op}: inp: expected [num_tokens, hidden], got shape {list(inp.shape)}")
    if split_sizes.dim() != 1 or sorted_index.dim() != 1 or split_sizes.numel() != sorted_index.numel():
        raise ValueError(
            f"{op}: split_sizes and sorted_index: expected two 1-D tensors of one length, got shapes "
            f"{list(split_sizes.shape)} and {list(sorted_index.shape)}"
        )
    chunks = split_sizes.numel()
    device = inp.device
    sizes = split_sizes.to(device=device, dtype=torch.int64)
    order = sorted_index.to(device=device, dtype=torch.int64)
    if not compiling() and host_check(check, inp):  # in TE's terms (the native op sees S + 1 chunks)
        both = torch.cat([sizes, order]).cpu()  # one read of the device (one synchronization on CUDA)
        _check_chunks(op, inp.shape[0], both[:chunks], both[chunks:])
    tail = (inp.shape[0] - sizes.sum()).reshape(1)  # on the device: no host read
    sizes = torch.cat([sizes, tail])
    order = torch.cat([order, torch.full((1,), chunks, dtype=torch.int64, device=device)])
    out, permutation_map, _ = sort_chunks(inp, sizes, 1, 1, order, rows=inp.shape[0], check=check)
    return out, permutation_map


def moe_sort_chunks_by_index(
    inp: Tensor, split_sizes: Tensor, sorted_index: Tensor, *, check: Optional[bool] = None
) -> Tensor:
    """TE's ``moe_sort_chunks_by_index(inp, split_sizes, sorted_index) -> output`` (this module's
    docstring)."""
    out, _ = _chunk_sort("moe_sort_chunks_by_index", inp, split_sizes, sorted_index, check)
    return out


def moe_sort_chunks_by_index_with_probs(
    inp: Tensor, probs: Tensor, split_sizes: Tensor, sorted_index: Tensor, *, check: Optional[bool] = None
) -> Tuple[Tensor, Tensor]:
    """TE's ``moe_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index) ->
    (output, permuted_probs)``: ``permuted_probs[j] = probs[i]`` for the input row i that output
    row j holds, in ``probs``' dtype."""
    op = "moe_sort_chunks_by_index_with_probs"
    if not isinstance(probs, Tensor):
        raise TypeError(f"{op}: probs: expected a torch tensor, got {type(probs).__name__}")
    if isinstance(inp, Tensor) and inp.dim() == 2 and (probs.dim() != 1 or probs.numel() != inp.shape[0]):
        raise ValueError(f"{op}: probs: expected [{inp.shape[0]}] (one per row of inp), got shape {list(probs.shape)}")
    if probs.device != getattr(inp, "device", probs.device):
        raise ValueError(f"{op}: probs: expected a tensor on {inp.device}, got {probs.device}")
    out, permutation_map = _chunk_sort(op, inp, split_sizes, sorted_index, check)
    # every output row holds an input row (alignment 1, the tail chunk last): the map is a permutation
    permuted_probs = probs[permutation_map.long()]
    return out, permuted_probs
