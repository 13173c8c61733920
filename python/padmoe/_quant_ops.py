"""The quantizing dispatch on numpy arrays (and torch tensors for dispatch_quantized, as padmoe.torch
has it): bf16 / f16 / f32 token rows to float8 expert rows with their scales in one pass, and the
quantizer alone. Each function is its unique part under ``@native_op`` (_native_op.py)."""

from __future__ import annotations

from typing import Tuple

from ._arrays import ndim
from ._common import _C, Array, _cols, _native_scales
from ._native_op import PADDED, native_op
from ._plan import INT32_MAX, Plan
from ._plan_ops import _bound_rows

_QUANT_LAYOUTS = ("block128", "mxfp8", "row")


def _quant_args(c):
    if c.scale_layout not in _QUANT_LAYOUTS:
        raise ValueError(f"{c.op}: scale_layout: expected 'block128', 'mxfp8' or 'row', got {c.scale_layout!r}")
    if c.fp8 not in ("e4m3", "e5m2"):
        raise ValueError(f"{c.op}: fp8: expected 'e4m3' or 'e5m2', got {c.fp8!r}")


def _quant_rows_out(arrays, x, n, fp8):
    """Rows of fp8 codes: numpy uint8 (numpy has no float8 dtype), torch float8_e4m3fn / float8_e5m2."""
    if arrays.name == "torch":
        dt = arrays.torch.float8_e4m3fn if fp8 == "e4m3" else arrays.torch.float8_e5m2
    else:
        import numpy as np

        dt = np.uint8
    return arrays.empty((int(n), _cols(x)), dt, x)


def _quant_scales_out(arrays, x, n, scale_layout):
    h = _cols(x)
    if scale_layout == "row":
        return arrays.empty((int(n),), _float32(arrays), x)
    if scale_layout == "mxfp8":
        return arrays.empty((int(n), -(-h // 32)), _uint8(arrays), x)
    return arrays.empty((int(n), -(-h // 128)), _float32(arrays), x)


def _float32(arrays):
    if arrays.name == "torch":
        return arrays.torch.float32
    import numpy as np

    return np.float32


def _uint8(arrays):
    if arrays.name == "torch":
        return arrays.torch.uint8
    import numpy as np

    return np.uint8


def _fp8_arg(arrays, y, fp8):
    """What _C's fp8= takes: the format for uint8 code arrays, "" for torch float8 tensors."""
    return "" if arrays.name == "torch" and str(y.dtype).startswith("torch.float8") else fp8


@native_op(outputs="y y_scales", keywords=PADDED, before=_quant_args)
def dispatch_quantized(
    c, x: Array, plan: Plan, *, scale_layout: str = "block128", fp8: str = "e4m3"
) -> Tuple[Array, Array]:
    """Fused quantizing dispatch: ``(y, y_scales)`` from bfloat16 / float16 / float32 token rows
    ``x[T, H]``, each row read once, quantized once and written to its K padded rows; both outputs
    have ``plan.padded_rows_bound`` rows (R below).

    ``scale_layout``: ``"block128"`` (DeepSeek-V3 1x128 blockwise: float32 ``[R, ceil(H/128)]``,
    scale = amax / fp8_max), ``"mxfp8"`` (OCP MX v1.0: E8M0 bytes uint8 ``[R, ceil(H/32)]``,
    2^(floor(log2 amax) - emax_elem)) or ``"row"`` (float32 ``[R]``, amax over the row). ``fp8``:
    ``"e4m3"`` or ``"e5m2"``. ``y`` holds the float8 codes: a uint8 array for numpy inputs (numpy has
    no float8 dtype; ``ml_dtypes`` can view it), torch.float8_e4m3fn / float8_e5m2 for torch. Padding
    rows and rows past P: zero codes, scale 1 (float32 1.0 / E8M0 127). Not differentiable; unweighted (router
    weights are applied after the expert, in combine). ``out=(y, y_scales)`` (y may be uint8 codes
    or a torch float8 tensor; the layout is read from y_scales' dtype and shape)."""
    op, rows = c.op, c.rows
    if c.y is None:
        if rows is None:
            n = _bound_rows(plan, op)()
        else:
            n = int(rows)
            if n < 0:
                raise ValueError(f"{op}: rows: must be >= 0, got {n}")
        if n > INT32_MAX:  # before allocating, as dispatch: the rows must fit the int32 index outputs
            what = "padded rows" if rows is None else "rows"
            raise ValueError(f"{op}: {what}: size overflow: {n} does not fit the int32 index outputs")
        c.y = _quant_rows_out(c.arrays, x, n, fp8)
    elif rows is not None:
        raise ValueError(f"{op}: pass rows= or out=, not both")
    if c.y_scales is None:
        c.y_scales = _quant_scales_out(c.arrays, x, c.y.shape[0], scale_layout)
    ys = _native_scales(c.arrays, c.y_scales)
    _C.dispatch_quantized_out(x, plan, c.y, ys, _fp8_arg(c.arrays, c.y, fp8), **c.opts)
    return c.y, c.y_scales


@native_op(
    outputs="y y_scales", keywords=("out", "num_threads", "stream"), numpy_only="dispatch_quantized", before=_quant_args
)
def quantize(c, x: Array, *, scale_layout: str = "block128", fp8: str = "e4m3") -> Tuple[Array, Array]:
    """The quantizer of :func:`dispatch_quantized` alone: ``(y[N, H], y_scales)`` from ``x[N, H]``
    (the same codes and scales dispatch_quantized writes for each token). numpy arrays only (torch:
    :func:`padmoe.torch.dispatch_quantized`)."""
    n = int(x.shape[0]) if ndim(x) >= 1 else 0
    if c.y is None:
        c.y = _quant_rows_out(c.arrays, x, n, fp8)
    if c.y_scales is None:
        c.y_scales = _quant_scales_out(c.arrays, x, n, scale_layout)
    ys = _native_scales(c.arrays, c.y_scales)
    _C.quantize_out(x, c.y, ys, _fp8_arg(c.arrays, c.y, fp8), **c.opts)  # (always checked: numpy)
    return c.y, c.y_scales
