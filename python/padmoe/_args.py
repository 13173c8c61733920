"""Argument checks the numpy API (padmoe) and the torch API (padmoe.torch) share, with padmoe's
errors: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a bad value or shape, each
message naming the op and the argument (the wording of padmoe's C++ checks where they make the
same check)."""

from __future__ import annotations

import operator
from typing import Any, Optional

import numpy as np

from ._arrays import arrays_of, ndim


def int_arg(op: str, name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (None: no bound on that side). Integers are what
    ``operator.index`` takes (int, numpy integer scalars, 0-d integer tensors); a float is a
    TypeError rather than truncated, and so is a bool (True is not a count)."""
    if isinstance(value, (bool, np.bool_)) or "bool" in str(getattr(value, "dtype", "")):
        raise TypeError(f"{op}: {name}: expected an integer, got a bool ({value!r})")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {name}: expected an integer, got {type(value).__name__} ({value!r})") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{op}: {name}: must be {bound}, got {v}")
    return int(v)


def _dtype_name(a) -> str:
    return str(a.dtype).replace("torch.", "")


def check_expert_map(op: str, expert_map, num_experts: int, entries: bool) -> None:
    """vLLM's ``expert_map`` (global expert id -> local id, -1 = not local) as padmoe's core checks
    it for ``ignore_invalid_experts=True``, in its words: 1-D, ``num_experts`` entries, int32 or
    int64, and with ``entries`` every entry in ``[-1, num_experts)`` (a ValueError naming the
    first outside; on a CUDA tensor reading them is one synchronization). With ``num_experts``
    below 1 nothing is checked: the op itself names ``num_experts``."""
    arrays_of(expert_map, op, "expert_map")  # a numpy array or a torch tensor, else TypeError
    e = int(num_experts)
    if e < 1:
        return
    if ndim(expert_map) != 1:
        raise ValueError(f"{op}: expert_map: expected a 1-D tensor, got shape {list(expert_map.shape)}")
    if _dtype_name(expert_map) not in ("int32", "int64"):
        raise TypeError(f"{op}: expert_map: expected int32 or int64, got {_dtype_name(expert_map)}")
    if int(expert_map.shape[0]) != e:
        raise ValueError(f"{op}: expert_map: expected {e} entries, got {int(expert_map.shape[0])}")
    if not entries:
        return
    bad = (expert_map < -1) | (expert_map >= e)
    if bool(bad.any()):
        i = int(bad.nonzero()[0][0])  # numpy: a tuple of index arrays; torch: [n, 1] indices
        raise ValueError(f"{op}: expert_map: entry {i} is {int(expert_map[i])}, outside [-1, {e})")


def map_experts(expert_ids, expert_map):
    """vLLM's ``expert_map[expert_ids]`` for every entry, int32, on expert_ids' device. The op's
    expert_ids are in ``[0, num_experts)``, or -1 for the blocks past P, which torch's indexing (and
    so vLLM) reads as the map's last entry: an index in ``[-n, 0)`` counts from the end here too.
    The gather reads only indices inside the map: the map's length is checked, but unchecked data on
    a CUDA device must not be able to make an out-of-bounds gather (a device-side assert ends the
    process's CUDA context); an index outside ``[-n, n)`` gives -1. Entries are not clamped: with
    checks off a bad entry passes through (an int64 entry past int32 wraps)."""
    n = int(expert_map.shape[0])
    if hasattr(expert_ids, "new_full"):  # torch
        import torch

        if n == 0:
            return torch.full_like(expert_ids, -1, dtype=torch.int32)
        idx = expert_ids.long()
        idx = torch.where(idx < 0, idx + n, idx)
        inside = (idx >= 0) & (idx < n)
        table = expert_map.to(device=expert_ids.device, dtype=torch.int32)
        return torch.where(inside, table[torch.where(inside, idx, 0)], -1)
    if n == 0:
        return np.full(expert_ids.shape, -1, dtype=np.int32)
    idx = expert_ids.astype(np.int64)
    idx = np.where(idx < 0, idx + n, idx)
    inside = (idx >= 0) & (idx < n)
    table = np.asarray(expert_map).astype(np.int32)
    return np.where(inside, table[np.where(inside, idx, 0)], -1).astype(np.int32)


def no_cols(a, rows: Optional[int] = None):
    """Rows ``a`` as a zero-column view (no copy): a stand-in on which an op runs its checks, moving
    nothing. ``a`` itself when it is not 2-D or has not the ``rows`` rows the op wants: the op's check
    of ``a`` then raises, naming its real shape, before the op looks at any output."""
    if a is None or ndim(a) != 2 or (rows is not None and int(a.shape[0]) != rows):
        return a
    return a[:, :0]


# Outputs the data sizes from this many bytes up are allocated only after the op's checks passed;
# a smaller one is allocated first (the op's checks then raise the same error, having cost less
# than running them twice).
CHECK_BEFORE_BYTES = 1 << 28


def checked_rows(arrays, like, n: int, options: dict, run) -> int:
    """``n``, the rows of an output the data sizes, once ``run(stand_in)`` has run the op (with
    ``options``) on a zero-column stand-in of n rows for that output: data the op's own checks reject
    raises their error before it sizes an allocation (a padded_bins[-1] of 2^31 - 1 asked for 32 GiB
    before the op named the bad bins). The data then passed, so the op proper runs with
    ``check_data`` off (on CUDA one validation and one synchronization, not two; the CPU backend
    checks everything either way). On CUDA with ``check_data`` off nothing reads the data: n is
    taken as it is. Outputs under ``CHECK_BEFORE_BYTES`` skip the stand-in run."""
    cols = int(like.shape[1]) if ndim(like) == 2 else 1
    if n * max(cols, 1) * int(getattr(like, "itemsize", 4)) < CHECK_BEFORE_BYTES:
        return n
    if options["check_data"] or not getattr(like, "is_cuda", False):
        run(arrays.empty((n, 0), like.dtype, like))
        options["check_data"] = False
    return n
