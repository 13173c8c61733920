"""Array frameworks padmoe's Python API serves: numpy and torch.

The native module takes any DLPack array; this module decides what the
*outputs* are: numpy arrays for numpy inputs, torch tensors (on the input's
device) for torch inputs. torch is never imported here: a tensor can only be
a torch tensor if the caller already imported torch.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np


class NumpyArrays:
    """Outputs as numpy arrays (CPU)."""

    name = "numpy"
    int32 = np.int32

    def is_mine(self, a: Any) -> bool:
        return isinstance(a, np.ndarray)

    def empty(self, shape, dtype, like) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def stream(self, like) -> int:
        return 0

    def prepare(self, a):
        return a

    def item(self, a, index: int) -> int:
        return int(a[index])


class TorchArrays:
    """Outputs as torch tensors on the input's device; CUDA work runs on the
    current torch stream of that device."""

    name = "torch"

    def __init__(self, torch):
        self.torch = torch
        self.int32 = torch.int32

    def is_mine(self, a: Any) -> bool:
        return isinstance(a, self.torch.Tensor)

    def empty(self, shape, dtype, like):
        return self.torch.empty(shape, dtype=dtype, device=like.device)

    def stream(self, like) -> int:
        if like.is_cuda:
            # torch's C accessor of the raw cudaStream_t (what inductor's generated code calls):
            # torch.cuda.current_stream() builds a Stream object, several µs a call.
            raw = getattr(self.torch._C, "_cuda_getCurrentRawStream", None)
            if raw is not None:
                return int(raw(like.get_device()))
            return int(self.torch.cuda.current_stream(like.device).cuda_stream)
        return 0

    def prepare(self, a):
        # DLPack refuses tensors that require grad; the data is the same.
        if isinstance(a, self.torch.Tensor) and a.requires_grad:
            return a.detach()
        return a

    def item(self, a, index: int) -> int:
        return int(a[index].item())  # on CUDA: one synchronization


NUMPY = NumpyArrays()
_torch_arrays: Optional[TorchArrays] = None


def arrays_of(a: Any, op: str, arg: str):
    """The framework of array `a` (numpy or torch); TypeError otherwise."""
    global _torch_arrays
    if isinstance(a, np.ndarray):
        return NUMPY
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        if _torch_arrays is None:
            _torch_arrays = TorchArrays(torch)
        return _torch_arrays
    raise TypeError(f"{op}: {arg}: expected a numpy array or a torch tensor, got {type(a).__name__}")


_capsule_export = None  # (torch.Tensor, torch's to_dlpack), found once torch has been imported


def _torch_capsule_maker():
    """(torch.Tensor, torch's C-level DLPack export, about 0.2 µs a tensor), or
    None before torch is imported. The ``__dlpack__`` method that nanobind
    would call instead is Python code in torch, about 2 µs a tensor: at decode
    sizes, with ten tensors per op (the plan's eight arrays among them), that
    was most of a call's host time."""
    global _capsule_export
    if _capsule_export is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        try:
            from torch.utils.dlpack import to_dlpack
        except ImportError:  # pragma: no cover - every torch padmoe supports has it
            return None
        _capsule_export = (torch.Tensor, to_dlpack)
    return _capsule_export


def native_args(args, op="padmoe"):
    """Positional arguments for a padmoe._C call: torch tensors become DLPack
    capsules through torch's C export (same memory, no copy, no stream
    synchronization), a plan becomes a namespace of such capsules; everything
    else passes unchanged. Called right at the native call, after shapes and
    outputs are settled. Kept lean (a plain loop, no per-call closure, no
    device or requires_grad query: torch's C export takes a tensor that
    requires grad, and refuses one on another device with BufferError): at
    decode sizes this loop is a large share of the host time of a
    ``padmoe.dispatch`` call on torch tensors, so every per-tensor step here
    counts."""
    export = _torch_capsule_maker()
    if export is None:
        return args
    tensor, to_dlpack = export
    out = []
    for v in args:
        if isinstance(v, tensor):
            v = _capsule(v, to_dlpack, op)
        elif type(v) is _plan_type or (hasattr(v, "row_sources") and hasattr(v, "dest_rows")):  # a plan
            fields = v.arrays if type(v) is _plan_type else [getattr(v, f) for f in _PLAN_ARRAYS]
            ns = SimpleNamespace(
                num_tokens=v.num_tokens, top_k=v.top_k, num_experts=v.num_experts, alignment=v.alignment
            )
            for f, a in zip(_PLAN_ARRAYS, fields):
                setattr(ns, f, _capsule(a, to_dlpack, op) if isinstance(a, tensor) else a)
            v = ns
        out.append(v)
    return out


def _capsule(v, to_dlpack, op):
    try:
        return to_dlpack(v)
    except BufferError:  # meta, xla, ...: not memory padmoe can address
        raise TypeError(f"{op}: expected tensors on the CPU or a CUDA device, got one on {v.device}") from None


_plan_type = None  # padmoe.Plan, set by _plan.py (its eight arrays read as one list)


_PLAN_ARRAYS = (
    "indices",
    "bin_ids",
    "tokens_per_expert",
    "bins",
    "padded_tokens_per_expert",
    "padded_bins",
    "dest_rows",
    "row_sources",
)


def prepare(arrays, *values):
    """Each value made ready for the native module (None stays None)."""
    return tuple(None if v is None else arrays.prepare(v) for v in values)


def ndim(a) -> int:
    return len(a.shape)


def last_entry(arrays, a) -> int:
    """a[-1] as a non-negative int, 0 when `a` is not a non-empty vector (the
    native op then reports what is wrong with it). On CUDA: one synchronization."""
    if a is None or ndim(a) != 1 or a.shape[0] == 0:
        return 0
    try:
        return max(arrays.item(a, -1), 0)
    except (TypeError, ValueError, OverflowError):
        return 0
