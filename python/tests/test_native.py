"""The native layer padmoe._C: DLPack conversion, plan objects, options, errors."""

import ctypes
import types

import numpy as np
import pytest

import padmoe
import reference as ref
from conftest import rows
from padmoe import _C


def plan_namespace(plan, **changes):
    fields = {
        name: getattr(plan, name)
        for name in (
            "indices",
            "bin_ids",
            "tokens_per_expert",
            "bins",
            "padded_tokens_per_expert",
            "padded_bins",
            "dest_rows",
            "row_sources",
            "num_tokens",
            "top_k",
            "num_experts",
            "alignment",
        )
    }
    fields.update(changes)
    return types.SimpleNamespace(**fields)


def test_any_object_with_plan_attributes(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    ns = plan_namespace(plan)
    assert _C.padded_rows(ns) == r.P
    x = rows(r.rng, (r.T, r.H), np.float32)
    y = np.full((r.P + 2, r.H), -5.0, dtype=np.float32)
    assert _C.dispatch_out(x, ns, None, y) is None
    np.testing.assert_array_equal(y[: r.P], ref.gather(x, r.ref).astype(np.float32))
    assert (y[r.P :] == -5.0).all()  # rows past P untouched


def test_plan_object_errors(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    x = rows(r.rng, (r.T, r.H), np.float32)
    y = np.empty((r.P, r.H), dtype=np.float32)
    ns = plan_namespace(plan)
    del ns.dest_rows
    with pytest.raises(TypeError, match="dispatch: plan: .*dest_rows"):
        _C.dispatch_out(x, ns, None, y)
    with pytest.raises(TypeError, match="dispatch: plan.bins"):
        _C.dispatch_out(x, plan_namespace(plan, bins=[1, 2, 3]), None, y)
    with pytest.raises(TypeError, match="dispatch: plan.top_k"):
        _C.dispatch_out(x, plan_namespace(plan, top_k="3"), None, y)
    # make_plan writes into the plan: its arrays must be writable
    out = padmoe.Plan.empty(r.T, r.K, r.E, r.m)
    out.bins.setflags(write=False)
    with pytest.raises(TypeError, match="make_plan: out.bins"):
        _C.make_plan_out(r.top, r.E, r.m, out)


def test_dlpack_conversion_errors(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    y = np.empty((r.P, r.H), dtype=np.float32)
    with pytest.raises(TypeError, match="dispatch: x: unsupported dtype"):
        _C.dispatch_out(np.zeros((r.T, r.H), dtype=np.float64), plan, None, y)
    with pytest.raises(TypeError, match="dispatch: weights: unsupported dtype"):
        _C.dispatch_out(np.zeros((r.T, r.H), np.float32), plan, np.zeros(r.A, dtype=np.int16), y)  # (uint8: scales)
    with pytest.raises(ValueError, match="at most 4 dims"):
        _C.copy(np.zeros((1, 1, 1, 1, 2), np.float32), np.zeros((1, 1, 1, 1, 2), np.float32))
    with pytest.raises(TypeError, match="workspace: expected a CUDA buffer"):
        _C.dispatch_out(np.zeros((r.T, r.H), np.float32), plan, None, y, workspace=np.zeros(64, np.uint8))
    with pytest.raises(TypeError):  # a nanobind argument-conversion failure
        _C.dispatch_out("x", plan, None, y)


def test_options_are_keyword_only(routing):
    r = routing
    plan = padmoe.make_plan(r.top, r.E, r.m)
    x = rows(r.rng, (r.T, r.H), np.float32)
    y = np.empty((r.P, r.H), dtype=np.float32)
    with pytest.raises(TypeError):
        _C.dispatch_out(x, plan, None, y, 0)
    _C.dispatch_out(x, plan, None, y, stream=0, check_data=False, num_threads=1, workspace=None)
    np.testing.assert_array_equal(y, ref.gather(x, r.ref).astype(np.float32))


def test_zero_size_arrays_have_no_stride_requirements():
    top = np.zeros((0, 3), dtype=np.int64)  # numpy 2 reports strides (0, 0) here
    plan = padmoe.make_plan(top, 2, 4)
    np.testing.assert_array_equal(plan.padded_bins, [0, 0])
    assert padmoe.pad_to_alignment(np.zeros((0, 4), np.float16), np.zeros(2, np.int32), 4)[0].shape == (0, 4)


# --- kUnsupported -> NotImplementedError: a CUDA array in a build without CUDA ---------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_CAPSULE_NAME = b"dltensor"


class FakeCudaArray:
    """An int32 array that claims (through DLPack) to live on cuda:0. Its data
    is host memory, so it may only reach code that rejects CUDA arrays."""

    def __init__(self, shape):
        self._buf = (ctypes.c_int32 * max(int(np.prod(shape)), 1))()
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._mt = _DLManagedTensor()
        t = self._mt.dl_tensor
        t.data = ctypes.addressof(self._buf)
        t.device = _DLDevice(2, 0)  # kDLCUDA
        t.ndim = len(shape)
        t.dtype = _DLDataType(0, 32, 1)  # int32
        t.shape = self._shape

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        if max_version is not None:
            raise TypeError("unversioned DLPack only")
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._mt), _CAPSULE_NAME, None)

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.skipif(padmoe.has_cuda(), reason="needs a build without the CUDA backend")
def test_cuda_array_without_cuda_backend_is_not_implemented():
    plan = padmoe.Plan.empty(2, 2, 4, 4)
    with pytest.raises(NotImplementedError, match="make_plan"):
        _C.make_plan_out(FakeCudaArray((2, 2)), 4, 4, plan)
