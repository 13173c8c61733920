"""What padmoe's framework-neutral functions share: the native calls, the options, the outputs.

Each function allocates its outputs with the caller's framework (numpy in, numpy out; a torch
tensor in, a torch tensor out on its device, for the functions :mod:`padmoe.torch` has under the
same name, with the same arguments, defaults and results), then fills them with the native
``_out`` op, which allocates nothing. The functions padmoe.torch does not have (``quantize``,
``make_plan_layouts``) take numpy arrays only and refuse a torch tensor with a message that names
padmoe.torch; ``copy`` is a utility and takes either.

Common keyword-only options:

``check`` (default None)
    Validate the data-dependent properties (expert ids, bins, permutations) before the op runs.
    ``None`` checks, except on a CUDA stream that is capturing a graph; ``True`` always, ``False``
    never on CUDA (no synchronization). The CPU backend always checks everything.
``num_threads`` (default 0 = every core)
    CPU worker threads.
``workspace``
    A CUDA buffer (e.g. ``torch.empty(workspace_bound(T, K, E, m), dtype=torch.uint8,
    device="cuda")``) for scratch memory; without it CUDA scratch memory comes
    from padmoe's stream-ordered memory pool on the stream.
``stream``
    A ``cudaStream_t`` as an int. Default: the current torch stream of the
    input's device for CUDA torch tensors, else 0 (the legacy default stream).

Padded outputs: the plan ops (dispatch, make_plan_and_dispatch, dispatch_scaled,
dispatch_quantized, combine_backward) have ``plan.padded_rows_bound`` rows, known on the host;
the drop-ins (padded_gather, pad_to_alignment, sort_chunks, padded_scatter_backward) have exactly
P rows, as MegaBlocks and Megatron have, which on CUDA reads P from the device (one
synchronization). ``rows=n`` allocates n >= P rows instead. Rows at or past P are zero (with the
padding rows; ``zero_padding=False`` leaves both unwritten). ``out=`` passes caller-owned outputs
(a tuple shaped like the return value for the multi-output ops) and returns them; in a padded output
given this way, rows at or past P are left as they are (nothing reads them; a buffer reused every
step is not rewritten past P).

Errors: ``ValueError`` (bad value or shape, e.g. an expert id out of range),
``TypeError`` (bad dtype or device), ``NotImplementedError`` (CUDA arrays in a
build without the CUDA backend), ``RuntimeError`` (backend failure), each with
padmoe's message naming the op, the argument and the first offending position.
"""

from __future__ import annotations

from typing import Any

from . import _C as _native_module
from ._arrays import arrays_of, native_args, ndim
from ._plan import INT32_MAX

Array = Any


class _Native:
    """padmoe._C with torch tensors handed over as DLPack capsules (see
    _arrays.native_args: torch's ``__dlpack__`` costs ~2 µs a tensor)."""

    def __getattr__(self, name):
        fn = getattr(_native_module, name)
        if not callable(fn):
            return fn

        op = name[:-4] if name.endswith("_out") else name

        def call(*args, **kwargs):
            if kwargs.get("workspace") is not None:
                kwargs["workspace"] = native_args((kwargs["workspace"],), op)[0]
            return fn(*native_args(args, op), **kwargs)

        setattr(self, name, call)  # __getattr__ runs once per name
        return call


_C = _Native()


def _check_data(arrays, like, check) -> bool:
    """``check=None``: check, except on a CUDA stream that is capturing a graph (as padmoe.torch)."""
    if check is not None:
        return bool(check)
    if arrays.name == "torch" and like.is_cuda:
        return not arrays.torch.cuda.is_current_stream_capturing()
    return True


def _options(arrays, like, check, num_threads, workspace, stream, zero_padding=True, given=False):
    """The native op's keyword options. Rows at or past P of a padded output padmoe allocates are
    zeroed with the padding rows; in one the caller gives (``given``: ``out=``) they are left as they
    are (a buffer reused every step needs no rewrite of rows nothing reads)."""
    if stream is None:
        stream = arrays.stream(like)
    if workspace is not None:
        workspace = arrays_of(workspace, "workspace", "workspace").prepare(workspace)
    return {
        "stream": int(stream),
        "check_data": _check_data(arrays, like, check),
        "num_threads": int(num_threads),
        "workspace": workspace,
        "zero_tail": bool(zero_padding) and not given,
        "zero_padding": bool(zero_padding),
    }


def numpy_only(op: str, arg: str, a, torch_way: str):
    """The framework of `a` for a function padmoe.torch does not have: numpy only."""
    arrays = arrays_of(a, op, arg)
    if arrays.name == "torch":
        raise TypeError(
            f"{op}: {arg}: got a torch tensor; padmoe.{op} takes numpy arrays. For torch tensors use "
            f"padmoe.torch: {torch_way}"
        )
    return arrays


def _cols(a) -> int:
    return int(a.shape[1]) if ndim(a) == 2 else (int(a.shape[-1]) if ndim(a) >= 1 else 0)


def _tokens(indices, top_k) -> int:
    """T = A / K as the native allocating forms compute it (0 on bad input:
    the native op then reports it)."""
    if ndim(indices) != 1 or int(top_k) < 1:
        return 0
    return int(indices.shape[0]) // int(top_k)


def _padded_out(arrays, op, like, rows, out, p_of):
    """The padded-rows output: `out`, or `rows` rows, or ``p_of()`` rows."""
    if out is not None:
        if rows is not None:
            raise ValueError(f"{op}: pass rows= or out=, not both")
        return out
    n = p_of() if rows is None else int(rows)
    if n < 0:
        raise ValueError(f"{op}: rows: must be >= 0, got {n}")
    if n > INT32_MAX:  # before allocating: P (or rows) must fit the int32 index outputs
        raise ValueError(
            f"{op}: {'padded rows' if rows is None else 'rows'}: size overflow: {n} does not fit the "
            "int32 index outputs"
        )
    return arrays.empty((n, _cols(like)), like.dtype, like)


def _split_out(op, out, count):
    if out is None:
        return (None,) * count
    if not isinstance(out, (tuple, list)) or len(out) != count:
        raise TypeError(f"{op}: out: expected a tuple of {count} arrays (or None entries where allowed)")
    return tuple(out)


def _weight_grad(arrays, like, weights, given, count):
    """The weight-gradient output: the given one (None skips it), else a new
    array of weights' dtype when weights were given."""
    if given is not _UNSET:
        return given
    if weights is None:
        return None
    return arrays.empty((count,), weights.dtype, like)


_UNSET = object()


# --- rows moved with their scales (ops.hpp section 4) ---------------------------


def _native_scales(arrays, s):
    """Scales as padmoe._C takes them: a torch float8_e8m0fnu tensor as its uint8 bytes (same memory)."""
    if s is not None and arrays.name == "torch" and str(s.dtype) == "torch.float8_e8m0fnu":
        return s.view(arrays.torch.uint8)
    return s


def _scales_out(arrays, scales, rows, like, given):
    """The output scales: `given`, or a new array of `rows` rows shaped like the input scales."""
    if given is not None:
        return given
    return arrays.empty((int(rows),) + tuple(int(d) for d in scales.shape[1:]), scales.dtype, like)
