"""Input checks of padmoe.torch.transformer_engine, in TE's terms: every error names the TE function
and its argument (``ValueError`` / ``TypeError``), before anything is computed; the checks that read
the device (a row_id_map padmoe did not make, the counts, the chunk order) read it once when the
input is valid."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._common import Tensor, compiling

_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))

_MAX_ROWS = 2**31 - 1  # padmoe's row indices are int32


def _check_rows(op: str, inp, weighted: bool = False) -> None:
    """inp: a 2-D tensor of rows padmoe moves: float32 / float16 / bfloat16 / float64, or float8
    where the rows are only moved (not ``weighted`` by probs)."""
    if not isinstance(inp, Tensor):
        raise TypeError(f"{op}: inp: expected a torch tensor, got {type(inp).__name__}")
    if inp.dim() != 2:
        raise ValueError(f"{op}: inp: expected [num_tokens, hidden], got shape {list(inp.shape)}")
    if inp.dtype not in _ROW_DTYPES and (weighted or inp.dtype not in _FP8_DTYPES):
        kinds = "float32, float16, bfloat16 or float64" + ("" if weighted else " (or float8)")
        raise TypeError(f"{op}: inp: expected {kinds} rows, got {inp.dtype}")


def _check_out_tokens(op: str, num_out_tokens, mask: bool) -> None:
    """num_out_tokens: an int in [0, 2^31); the mask map's output rows, or the index map's (0: T*K)."""
    if not _is_int(num_out_tokens) or num_out_tokens < 0 or num_out_tokens > _MAX_ROWS:
        what = "the mask map's output rows (an int >= 0" if mask else "an int >= 0 (0: all T*K"
        raise ValueError(
            f"{op}: num_out_tokens: expected {what}, at most 2^31 - 1), got {num_out_tokens!r}; "
            "pass int(routing_map.sum()) or num_tokens * top_k"
        )


def _device_index(d: torch.device) -> int:
    if d.index is not None:
        return d.index
    return torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_available() else 0


def _same_device(a, b) -> bool:
    """Whether two tensors' devices are one device: an index left out is the current device of its
    type (TE's quantized tensors report ``cuda`` where their data is on ``cuda:0``)."""
    da, db = torch.device(a.device), torch.device(b.device)
    return da.type == db.type and _device_index(da) == _device_index(db)


def _check_map(op: str, inp: Tensor, routing_map, name: str = "routing_map") -> None:
    if not isinstance(routing_map, Tensor):
        raise TypeError(f"{op}: {name}: expected a torch tensor, got {type(routing_map).__name__}")
    if routing_map.dim() != 2 or routing_map.shape[0] != inp.shape[0]:
        raise ValueError(
            f"{op}: {name}: expected [{inp.shape[0]}, E] (one row per row of inp), got shape {list(routing_map.shape)}"
        )
    if not _same_device(routing_map, inp):
        raise ValueError(f"{op}: {name}: expected a tensor on {inp.device}, got {routing_map.device}")
    if routing_map.is_floating_point() or routing_map.is_complex():
        raise TypeError(f"{op}: {name}: expected a bool or integer tensor, got {routing_map.dtype}")
    if routing_map.shape[1] == 0:
        raise ValueError(f"{op}: {name}: has no experts (shape {list(routing_map.shape)}); expected [T, E] with E >= 1")


def _check_probs(op: str, probs, like: Tensor) -> None:
    if not isinstance(probs, Tensor):
        raise TypeError(f"{op}: probs: expected a torch tensor, got {type(probs).__name__}")
    if tuple(probs.shape) != tuple(like.shape):
        raise ValueError(f"{op}: probs: expected shape {list(like.shape)} (the routing map's), got {list(probs.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"{op}: probs: expected a float tensor, got {probs.dtype}")
    if not _same_device(probs, like):
        raise ValueError(f"{op}: probs: expected a tensor on {like.device}, got {probs.device}")


def _check_integer(op: str, name: str, t: Tensor, what: str = "an integer tensor") -> None:
    """An integer tensor (not float, complex or bool): index maps, offsets, chunk sizes and order."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{op}: {name}: expected {what}, got {t.dtype}")


def _repeats(values: Tensor, live: Tensor, size: int) -> Tensor:
    """Where a live entry of ``values`` (each in [0, size)) holds a value another live entry holds too."""
    at = torch.where(live, values, size)
    hits = torch.zeros(size + 1, dtype=torch.int64, device=values.device)
    hits.scatter_add_(0, at.reshape(-1), torch.ones_like(at).reshape(-1))
    return live & (hits[at] > 1)


def _is_int(v) -> bool:
    """A Python int (or the symbolic int torch.compile passes), not a bool."""
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _check_index(op: str, index: Tensor, num_experts: int) -> None:
    """With num_experts: every id in [0, num_experts) or -1 (one read of the device)."""
    flat = index.reshape(-1)
    bad = ((flat < -1) | (flat >= num_experts)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"{op}: index: entry [{i // index.shape[1]}, {i % index.shape[1]}] is {int(flat[i])}, "
            f"outside [0, num_experts={num_experts}) and not -1"
        )


def _check_counts(op, routing_map, counts, out_rows=None, padded=None) -> None:
    """tokens_per_expert equal to the routing map's column counts (TE trusts them); with out_rows,
    the padded total at most out_rows."""
    have = routing_map.bool().sum(0).cpu()
    want = counts.cpu()
    diff = (have != want).nonzero()
    if diff.numel():
        e = int(diff[0])
        raise ValueError(
            f"{op}: tokens_per_expert: expert {e} has {int(want[e])}, but routing_map routes {int(have[e])} tokens to it"
        )
    if out_rows is not None and padded > out_rows:
        raise ValueError(f"{op}: out_rows: {out_rows} rows cannot hold the padded total {padded}")


def _check_merging_probs(op: str, merging_probs, inp: Tensor) -> None:
    if not isinstance(merging_probs, Tensor):
        raise TypeError(f"{op}: merging_probs: expected a torch tensor, got {type(merging_probs).__name__}")
    if not merging_probs.is_floating_point():
        raise TypeError(f"{op}: merging_probs: expected a float tensor, got {merging_probs.dtype}")
    if not _same_device(merging_probs, inp):
        raise ValueError(f"{op}: merging_probs: expected a tensor on {inp.device}, got {merging_probs.device}")


def _first(bad: Tensor) -> int:
    """The flat position of the first True of ``bad``."""
    return int(bad.reshape(-1).nonzero()[0])


def _check_mask_map(op: str, row_id_map: Tensor, pad_offsets: Optional[Tensor], rows: int) -> None:
    """A mask-map ``row_id_map[T, 2E+1]`` as TE defines it: per token a count n in [0, E], then n
    distinct experts in [0, E), and its n rows; the rows of all tokens name each row of the
    permute's output once ([0, total), total = the counts' sum; rows at or past ``rows`` were cut
    by num_out_tokens). With ``pad_offsets[E]`` (>= 0), each row plus its expert's offset lies in
    [0, rows) and names one row. One read of the device when the map is valid."""
    t, w = row_id_map.shape
    e = (w - 1) // 2
    m = row_id_map.to(torch.int64)
    n = m[:, 2 * e]
    live = torch.arange(e, device=m.device).unsqueeze(0) < n.clamp(0, e).unsqueeze(1)
    experts = m[:, e : 2 * e]
    dest = m[:, :e]
    bad_n = (n < 0) | (n > e)
    bad_e = live & ((experts < 0) | (experts >= e))
    ex = torch.where(live & ~bad_e, experts, e)  # distinct experts: a token's live ones counted once
    seen = torch.zeros(t, e + 1, dtype=torch.int64, device=m.device).scatter_add_(1, ex, torch.ones_like(ex))
    repeated = live & (seen.gather(1, ex) > 1) & (ex < e)
    if pad_offsets is not None:
        shift = pad_offsets.to(device=m.device, dtype=torch.int64)
        dest = dest + shift[ex.clamp(max=e - 1)]
        bound = torch.full((), rows, device=m.device)
        bad_shift = (shift < 0).any()
    else:
        bound = n.clamp(0, e).sum()
        bad_shift = torch.zeros((), dtype=torch.bool, device=m.device)
    out = live & ((dest < 0) | (dest >= bound))
    twice = _repeats(dest, live & ~out, t * e + rows)
    flags = torch.stack([bad_n.any(), bad_e.any(), repeated.any(), bad_shift, out.any(), twice.any()]).cpu()
    if not bool(flags.any()):
        return
    if flags[0]:
        i = _first(bad_n)
        raise ValueError(f"{op}: row_id_map: token {i} has count {int(n[i])}, outside [0, {e}]")
    if flags[1]:
        i = _first(bad_e)
        raise ValueError(
            f"{op}: row_id_map: token {i // e} names expert {int(experts.reshape(-1)[i])}, outside [0, {e})"
        )
    if flags[2]:
        i = _first(repeated)
        raise ValueError(f"{op}: row_id_map: token {i // e} names expert {int(ex.reshape(-1)[i])} twice")
    if flags[3]:
        raise ValueError(f"{op}: pad_offsets: entry {_first(shift < 0)} is negative")
    if flags[4]:
        i = _first(out)
        if pad_offsets is not None:
            raise ValueError(
                f"{op}: pad_offsets: token {i // e}'s row plus its expert's offset is {int(dest.reshape(-1)[i])}, "
                f"outside inp's {rows} rows"
            )
        raise ValueError(
            f"{op}: row_id_map: token {i // e} names row {int(dest.reshape(-1)[i])}, outside [0, {int(bound)}) "
            "(the routed rows)"
        )
    i = _first(twice)
    raise ValueError(f"{op}: row_id_map: row {int(dest.reshape(-1)[i])} is named twice (first repeat: token {i // e})")


def _check_index_map(op: str, row_id_map: Tensor, rows_total: int) -> None:
    """An index-map ``row_id_map[K*T]``: entries -1 (dropped) or in [0, T*K), each row once; one
    read of the device when the map is valid."""
    m = row_id_map.to(torch.int64)
    bad = (m < -1) | (m >= rows_total)
    twice = _repeats(m, (m >= 0) & ~bad, rows_total)
    flags = torch.stack([bad.any(), twice.any()]).cpu()
    if flags[0]:
        i = _first(bad)
        raise ValueError(f"{op}: row_id_map: entry {i} is {int(m[i])}, outside [0, {rows_total}) and not -1")
    if flags[1]:
        i = _first(twice)
        raise ValueError(f"{op}: row_id_map: row {int(m[i])} is named twice (first repeat: entry {i})")


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


# ---------------------------------------------------------------------------
# TE's quantized (FP8) tensors, read by their attributes (TE is never imported)
# ---------------------------------------------------------------------------


class QuantizedRows(NamedTuple):
    """A TE quantized tensor's row-wise parts: ``kind`` ``"tensor"`` (``Float8Tensor``: one
    ``_scale_inv`` for the whole tensor), ``"blockwise"`` (``Float8BlockwiseQTensor``, 1x128
    blocks) or ``"mxfp8"`` (``MXFP8Tensor``, E8M0 per 32 columns); ``data`` the ``[T, H]`` one-byte
    codes; ``scales`` one scale row per data row (``[T, S]``, the input's dtype), None for
    ``"tensor"``."""

    kind: str
    data: Tensor
    scales: Optional[Tensor]


def _is_quantized(t) -> bool:
    """A TE ``QuantizedTensor`` (a torch tensor subclass holding a ``_quantizer`` and its own
    ``dequantize``), told by its attributes."""
    return (
        isinstance(t, Tensor)
        and type(t) is not Tensor
        and hasattr(t, "_quantizer")
        and callable(getattr(t, "dequantize", None))
    )


def _quantized(op: str, inp) -> Optional[QuantizedRows]:
    """None for a plain tensor; the row-wise parts of a TE quantized ``inp`` whose rows padmoe can
    move with their scales (per-tensor scaling, 1x128 blocks, MXFP8 with compact scales); else a
    ``TypeError`` / ``ValueError`` naming ``op`` and what is not taken."""
    if not _is_quantized(inp):
        return None
    name = type(inp).__name__
    if not hasattr(inp, "_fp8_dtype"):
        raise TypeError(
            f"{op}: inp: {name} is not taken (padmoe moves the rows of TE's Float8Tensor, "
            "Float8BlockwiseQTensor and MXFP8Tensor)"
        )
    t = inp.shape[0]
    if hasattr(inp, "_rowwise_data"):
        kind = "blockwise" if hasattr(inp, "_is_2D_scaled") else "mxfp8"
        data, scales = inp._rowwise_data, inp._rowwise_scale_inv
    elif hasattr(inp, "_data") and hasattr(inp, "_scale_inv"):
        kind, data, scales = "tensor", inp._data, None
    else:
        raise TypeError(f"{op}: inp: {name} holds neither _data nor _rowwise_data (not a TE FP8 tensor padmoe knows)")
    if not isinstance(data, Tensor):
        raise ValueError(
            f"{op}: inp: {name} holds no row-wise data (column-wise only); quantize it with row-wise usage"
        )
    if tuple(data.shape) != tuple(inp.shape) or data.element_size() != 1 or not _same_device(data, inp):
        raise ValueError(
            f"{op}: inp: {name}'s row-wise data is {data.dtype} of shape {list(data.shape)} on {data.device}; "
            f"expected one-byte codes of shape {list(inp.shape)} on {inp.device}"
        )
    if kind == "blockwise":
        if inp._is_2D_scaled:
            raise TypeError(
                f"{op}: inp: {name} has 128x128 block scales, each shared by 128 rows, which a row move "
                "cannot carry; quantize with 1x128 blocks (block_scaling_dim=1)"
            )
        ready = getattr(inp, "_is_gemm_ready_format", None)
        if callable(ready) and not ready():
            raise TypeError(f"{op}: inp: {name} has its scales in the compact format; expected the GEMM-ready one")
        # [ceil(H/128), T rounded up to 4]: a column per row
        ok = isinstance(scales, Tensor) and scales.dim() == 2 and scales.shape[1] >= t
        expect = f"[S, >= {t}] (a column of block scales per row)"
        rows = scales[:, :t].t() if ok else None
    else:
        if kind == "mxfp8" and getattr(inp, "_with_gemm_swizzled_scales", False):
            raise TypeError(
                f"{op}: inp: {name} has GEMM-swizzled scales, which interleave the scales of 128 rows; "
                "a row move needs the compact (unswizzled) scales"
            )
        # mxfp8: [T rounded up to 128, ceil(H/32) rounded up to 4]: a row of E8M0 scales per row
        ok = kind == "tensor" or (isinstance(scales, Tensor) and scales.dim() == 2 and scales.shape[0] >= t)
        expect = f"[>= {t}, S] (a row of scales per row)"
        rows = scales[:t] if ok and scales is not None else None
    if not ok:
        got = list(scales.shape) if isinstance(scales, Tensor) else type(scales).__name__
        raise ValueError(f"{op}: inp: {name}'s _rowwise_scale_inv: expected {expect}, got {got}")
    if rows is not None and not _same_device(rows, inp):
        raise ValueError(f"{op}: inp: {name}'s _rowwise_scale_inv is on {rows.device}, its data on {inp.device}")
    return QuantizedRows(kind, data, rows)


def _no_compile(op: str) -> None:
    if compiling():
        raise RuntimeError(
            f"{op}: inp: a quantized (FP8) tensor is not taken under torch.compile (nor by TE); quantize "
            "outside the compiled region"
        )


def _fp8_rows(op: str, inp) -> Optional[QuantizedRows]:
    """The row-wise parts of a TE quantized ``inp`` (None for a plain tensor); not under torch.compile."""
    if not _is_quantized(inp):
        return None
    _no_compile(op)
    return _quantized(op, inp)


def _dequantized(op: str, inp):
    """``inp``, a TE quantized one dequantized by its own ``dequantize()`` (TE's index-map kernels get
    it dequantized too: its tensor class dequantizes for the operators it does not pass through)."""
    if not _is_quantized(inp):
        return inp
    _no_compile(op)
    return inp.dequantize()
