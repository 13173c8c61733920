"""padmoe.torch.transformer_engine with TransformerEngine's quantized (FP8) tensors, on the CPU and
without TE installed.

TE's tensor classes are mimicked below by small fakes that follow TE's own definitions, read from
TransformerEngine's main branch at commit d0067d0da6cb01811b8072a7d304f0e00344ce2b (after v2.18):
``QuantizedTensor.__new__(shape, dtype, *, fake_dtype, requires_grad, device, stride,
storage_offset)`` (a wrapper subclass whose device defaults to the current CUDA device),
``Float8Tensor`` (``_data`` uint8, ``_scale_inv``, ``_fp8_dtype``, ``_transpose``; keyword
constructor ``data=, fp8_scale_inv=, fp8_dtype=, fake_dtype=, data_transpose=, quantizer=``),
``Float8BlockwiseQTensor`` (``_rowwise_data``, ``_rowwise_scale_inv`` float32 ``[ceil(H/128),
round_up(T, 4)]``, ``_columnwise_*``, ``_is_2D_scaled``) and ``MXFP8Tensor`` (``_rowwise_data``,
``_rowwise_scale_inv`` uint8 E8M0 ``[round_up(T, 128), round_up(ceil(H/32), 4)]``,
``_with_gemm_swizzled_scales``), each with TE's ``get_metadata()``. The fakes refuse every tensor
operation on the wrapper itself, so padmoe can only have read the documented attributes.

What TE's permutation (transformer_engine/pytorch/permutation.py) does, and these tests assert of
padmoe: the mask-map permutes (``moe_permute``, ``moe_permute_with_probs``,
``moe_permute_and_pad_with_probs``) move each row's codes and its scale row together, pass a
``Float8Tensor``'s ``_scale_inv`` on unchanged, and return the input's class with no column-wise
data and no quantizer (block scales ``[S, rows]``, MXFP8 scales ``[rows, S]``); a routed slot of
probability 0 gets zero codes; padding rows get zero codes and zero scales. TE's own FP8 test
(``test_permutation_mask_map_fp8``: 4 recipes x e4m3/e5m2 x E in {7, 16} x topK in {2, 5} x
num_out_tokens in {all, 2039 of 4096 tokens}) is reproduced at a smaller size. The chunk sorts move
the rows with their scales (TE: ``Float8Tensor`` only); the index map reads the input dequantized;
the mask unpermute refuses FP8. References are loops: bytes compared exactly, values dequantized
in float64.
"""

import enum
import math
import sys

import pytest

import padmoe

torch = pytest.importorskip("torch")
import padmoe.torch.transformer_engine as te  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and padmoe.has_cuda() else [])

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


# ---------------------------------------------------------------------------
# fakes of TE's classes (attributes and constructors as TE defines them)
# ---------------------------------------------------------------------------


class DType(enum.IntEnum):
    """TE's DType, the two float8 members."""

    kFloat8E4M3 = 7
    kFloat8E5M2 = 8

    @classmethod
    def cast(cls, v):
        return cls(int(v))


TORCH_FP8 = {DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2}
TE_FP8 = {"e4m3": DType.kFloat8E4M3, "e5m2": DType.kFloat8E5M2}


class FakeQuantizer:
    def copy(self):
        return FakeQuantizer()


class QuantizedTensor(torch.Tensor):
    """TE's QuantizedTensor: a wrapper subclass with a nominal dtype (no storage of its own)."""

    @staticmethod
    def __new__(cls, shape, dtype, *, fake_dtype=None, requires_grad=False, device=None, stride=None, storage_offset=0):
        if fake_dtype is not None and fake_dtype != dtype:
            raise ValueError(f"fake_dtype ({fake_dtype}) does not match dtype ({dtype})")
        if stride is None:
            stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        instance = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=stride,
            storage_offset=storage_offset,
            dtype=dtype,
            layout=torch.strided,
            requires_grad=requires_grad,
            device=torch.cuda.current_device() if device is None else device,
        )
        instance._requires_grad = requires_grad
        instance._dtype = dtype
        return instance

    @property
    def dtype(self):
        return self._dtype

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func == torch.ops.aten.numel.default:
            return math.prod(args[0].size())
        raise AssertionError(f"{func} ran on a {cls.__name__} wrapper: padmoe must read its attributes only")

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype})"

    def clone(self):
        meta = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.get_metadata().items()}
        return type(self)(shape=self.shape, dtype=self.dtype, device=self.device, **meta)


class Float8Tensor(QuantizedTensor):
    def __new__(
        cls,
        *args,
        data,
        fp8_scale_inv,
        fp8_dtype,
        fake_dtype=None,
        data_transpose=None,
        quantizer=None,
        **kwargs,
    ):
        instance = super().__new__(cls, *args, fake_dtype=fake_dtype, **kwargs)
        instance._data = data
        instance._quantizer = quantizer.copy() if quantizer is not None else None
        instance._fp8_dtype = DType.cast(fp8_dtype)
        instance._scale_inv = fp8_scale_inv
        instance._transpose = data_transpose
        instance._transpose_invalid = data_transpose is None
        return instance

    def get_metadata(self):
        return {
            "data": self._data,
            "fp8_scale_inv": self._scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "data_transpose": self._transpose,
            "quantizer": self._quantizer,
            "fake_dtype": self._dtype,
        }

    def dequantize(self, *, dtype=None):  # TE's CPU path
        codes = self._data.view(TORCH_FP8[self._fp8_dtype]).float()
        return (codes * self._scale_inv).to(dtype or self.dtype)


class _RowwiseBlocks(QuantizedTensor):
    """What TE's Float8BlockwiseQTensorStorage and MXFP8TensorStorage share."""

    def _set(self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype, quantizer):
        self._rowwise_data = rowwise_data
        self._columnwise_data = columnwise_data
        self._quantizer = quantizer.copy() if quantizer is not None else None
        self._fp8_dtype = DType.cast(fp8_dtype)
        self._rowwise_scale_inv = rowwise_scale_inv
        self._columnwise_scale_inv = columnwise_scale_inv

    def _metadata(self):
        return {
            "rowwise_data": self._rowwise_data,
            "rowwise_scale_inv": self._rowwise_scale_inv,
            "columnwise_data": self._columnwise_data,
            "columnwise_scale_inv": self._columnwise_scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "quantizer": self._quantizer,
        }


class Float8BlockwiseQTensor(_RowwiseBlocks):
    def __new__(
        cls,
        *args,
        rowwise_data,
        rowwise_scale_inv,
        columnwise_data,
        columnwise_scale_inv,
        fp8_dtype,
        quantizer,
        is_2D_scaled,
        fake_dtype=None,
        **kwargs,
    ):
        instance = super().__new__(cls, *args, fake_dtype=fake_dtype, **kwargs)
        instance._set(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype, quantizer)
        instance._is_2D_scaled = is_2D_scaled
        return instance

    def get_metadata(self):
        return {**self._metadata(), "is_2D_scaled": self._is_2D_scaled, "fake_dtype": self._dtype}

    def dequantize(self, *, dtype=None):  # 1x128 blocks
        t, h = self._rowwise_data.shape
        codes = self._rowwise_data.view(TORCH_FP8[self._fp8_dtype]).float()
        scale = self._rowwise_scale_inv[:, :t].t().repeat_interleave(128, dim=1)[:, :h]
        return (codes * scale).to(dtype or self.dtype)


class MXFP8Tensor(_RowwiseBlocks):
    def __new__(
        cls,
        *args,
        rowwise_data,
        rowwise_scale_inv,
        columnwise_data,
        columnwise_scale_inv,
        fp8_dtype,
        quantizer,
        with_gemm_swizzled_scales,
        fake_dtype=None,
        **kwargs,
    ):
        instance = super().__new__(cls, *args, fake_dtype=fake_dtype, **kwargs)
        instance._set(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype, quantizer)
        instance._with_gemm_swizzled_scales = with_gemm_swizzled_scales
        return instance

    def get_metadata(self):
        return {
            **self._metadata(),
            "with_gemm_swizzled_scales": self._with_gemm_swizzled_scales,
            "fake_dtype": self._dtype,
        }

    def dequantize(self, *, dtype=None):
        t, h = self._rowwise_data.shape
        codes = self._rowwise_data.view(TORCH_FP8[self._fp8_dtype]).float()
        scale = torch.exp2(self._rowwise_scale_inv[:t].float() - 127).repeat_interleave(32, dim=1)[:, :h]
        return (codes * scale).to(dtype or self.dtype)


class NVFP4Tensor(QuantizedTensor):
    """A quantized class padmoe does not move (TE's NVFP4: ``_fp4_dtype``, no ``_fp8_dtype``)."""

    def __new__(cls, *args, rowwise_data, rowwise_scale_inv, **kwargs):
        instance = super().__new__(cls, *args, **kwargs)
        instance._rowwise_data, instance._rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        instance._fp4_dtype, instance._quantizer = 0, None
        instance._with_gemm_swizzled_scales = False
        return instance

    def dequantize(self, *, dtype=None):
        return torch.zeros(self.shape, dtype=dtype or self.dtype)


# ---------------------------------------------------------------------------
# inputs and loop references
# ---------------------------------------------------------------------------

RECIPES = ["delayed", "current", "blockwise", "mxfp8"]  # TE's test: the first two give a Float8Tensor


def _round_up(n, m):
    return (n + m - 1) // m * m


def quantize(x, recipe, fmt, requires_grad=False, dtype=torch.float32, pad_byte=0x55, device="cpu"):
    """A fake TE tensor of ``x`` [T, H] (codes of x / scale) on ``device``; scale padding filled with
    junk. The device carries its index ("cuda" is the current device), as TE's tensors' do."""
    device = torch.empty(0, device=device).device
    q = _quantize_cpu(x.cpu(), recipe, fmt, dtype, pad_byte)
    meta = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in q.get_metadata().items()}
    return type(q)(shape=q.shape, dtype=dtype, device=device, requires_grad=requires_grad, **meta)


def _quantize_cpu(x, recipe, fmt, dtype, pad_byte):
    t, h = x.shape
    kind = {"delayed": "tensor", "current": "tensor"}.get(recipe, recipe)
    common = dict(shape=x.shape, dtype=dtype, device="cpu", fp8_dtype=TE_FP8[fmt])
    if kind == "tensor":
        scale_inv = torch.cat([x.abs().reshape(-1), torch.ones(1)]).amax().reshape(1) / FP8_MAX[fmt]
        data = (x / scale_inv).to(FP8[fmt]).view(torch.uint8)
        return Float8Tensor(data=data, fp8_scale_inv=scale_inv, **common)
    if kind == "blockwise":
        s = -(-h // 128)
        scale = torch.full((s, _round_up(t, 4)), 7.0)
        data = torch.empty(t, h, dtype=torch.uint8)
        for b in range(s):
            blk = x[:, b * 128 : (b + 1) * 128]
            sc = blk.abs().amax(1).clamp(min=1e-6) / FP8_MAX[fmt]
            scale[b, :t] = sc
            data[:, b * 128 : (b + 1) * 128] = (blk / sc[:, None]).to(FP8[fmt]).view(torch.uint8)
        return Float8BlockwiseQTensor(
            rowwise_data=data,
            rowwise_scale_inv=scale,
            columnwise_data=None,
            columnwise_scale_inv=None,
            quantizer=FakeQuantizer(),
            is_2D_scaled=False,
            **common,
        )
    s = -(-h // 32)
    scale = torch.full((_round_up(t, 128), _round_up(s, 4)), pad_byte, dtype=torch.uint8)
    data = torch.empty(t, h, dtype=torch.uint8)
    emax = 8 if fmt == "e4m3" else 15
    for b in range(s):
        blk = x[:, b * 32 : (b + 1) * 32]
        e = torch.floor(torch.log2(blk.abs().amax(1).clamp(min=1e-30))) - emax
        scale[:t, b] = (e.clamp(-127, 127) + 127).to(torch.uint8)
        # saturated as TE's quantizer does (x / 2^e reaches 2 * 2^emax; the cast of a value past the
        # format's largest is NaN in some torch releases)
        codes = (blk / torch.exp2(e)[:, None]).clamp(-FP8_MAX[fmt], FP8_MAX[fmt])
        data[:, b * 32 : (b + 1) * 32] = codes.to(FP8[fmt]).view(torch.uint8)
    return MXFP8Tensor(
        rowwise_data=data,
        rowwise_scale_inv=scale,
        columnwise_data=None,
        columnwise_scale_inv=None,
        quantizer=FakeQuantizer(),
        with_gemm_swizzled_scales=False,
        **common,
    )


def codes_of(q):
    return (q._data if isinstance(q, Float8Tensor) else q._rowwise_data).cpu()


def scale_rows(q):
    """One scale row per data row, in TE's attribute layout ([T, S]); None for a Float8Tensor."""
    t = codes_of(q).shape[0]
    if isinstance(q, Float8Tensor):
        return None
    if isinstance(q, Float8BlockwiseQTensor):
        return q._rowwise_scale_inv[:, :t].t().cpu().clone(memory_format=torch.contiguous_format)
    return q._rowwise_scale_inv[:t].cpu()


def dequantized_loop(q):
    """float64 values of q, a row and a scale block at a time."""
    codes = codes_of(q)
    t, h = codes.shape
    fp8 = TORCH_FP8[q._fp8_dtype]
    scales = (q._scale_inv if isinstance(q, Float8Tensor) else q._rowwise_scale_inv).cpu()
    out = torch.empty(t, h, dtype=torch.float64)
    for r in range(t):
        vals = codes[r].view(fp8).to(torch.float64)
        if isinstance(q, Float8Tensor):
            out[r] = vals * float(scales)
        elif isinstance(q, Float8BlockwiseQTensor):
            for b in range(-(-h // 128)):
                out[r, b * 128 : (b + 1) * 128] = vals[b * 128 : (b + 1) * 128] * float(scales[b, r])
        else:
            for b in range(-(-h // 32)):
                scale = 2.0 ** (int(scales[r, b]) - 127)
                out[r, b * 32 : (b + 1) * 32] = vals[b * 32 : (b + 1) * 32] * scale
    return out


def mask_sources(rmap, rows, align=None):
    """Loop: the source token of each output row (-1: none), expert-major, tokens in order; rows at
    or past ``rows`` dropped; with ``align`` each expert's rows padded to a multiple of it."""
    t, e = rmap.shape
    src = []
    for j in range(e):
        mine = [i for i in range(t) if bool(rmap[i, j])]
        src += mine
        if align:
            src += [-1] * (_round_up(len(mine), align) - len(mine))
    src = src[:rows]
    return src + [-1] * (rows - len(src))


def random_map(gen, t, e, ones):
    flat = torch.zeros(t * e, dtype=torch.bool)
    flat[torch.randperm(t * e, generator=gen)[:ones]] = True
    return flat.reshape(t, e)


def check_moved(out, q, src, zero_rows=()):
    """out moved q's rows to positions src (-1: zero codes and zero scales) with their scales."""
    assert type(out) is type(q) and out.dtype == q.dtype and out.device == q.device
    assert tuple(out.shape) == (len(src), q.shape[1])
    assert out._fp8_dtype == q._fp8_dtype and out._quantizer is None
    codes = codes_of(out)
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (len(src), q.shape[1])
    want_scales = scale_rows(q)
    got_scales = scale_rows(out)
    if isinstance(q, Float8Tensor):
        assert out._scale_inv is q._scale_inv and out._transpose is None
    else:
        assert out._columnwise_data is None and out._columnwise_scale_inv is None
        if isinstance(q, Float8BlockwiseQTensor):
            assert out._is_2D_scaled is False
        else:
            assert out._with_gemm_swizzled_scales is False
    for r, s in enumerate(src):
        if s < 0:
            assert int(codes[r].count_nonzero()) == 0, r
            if got_scales is not None:
                assert int(got_scales[r].view(torch.uint8).count_nonzero()) == 0, r
            continue
        if r in zero_rows:
            assert int(codes[r].count_nonzero()) == 0, r
        else:
            assert torch.equal(codes[r], codes_of(q)[s]), r
        if got_scales is not None:
            assert torch.equal(got_scales[r].view(torch.uint8), want_scales[s].view(torch.uint8)), r
    # values: the moved rows' dequantized values are their source rows'
    got = dequantized_loop(out)
    want = dequantized_loop(q)
    for r, s in enumerate(src):
        if s >= 0 and r not in zero_rows:
            assert torch.equal(got[r], want[s]), r


# ---------------------------------------------------------------------------
# TE's own FP8 case (test_permutation_mask_map_fp8), smaller
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("num_expert", [7, 16])
@pytest.mark.parametrize("top_k", [2, 5])
@pytest.mark.parametrize("num_out", [None, 61])
@pytest.mark.parametrize("device", DEVICES)
def test_mask_permute_moves_rows_with_their_scales(device, recipe, fmt, num_expert, top_k, num_out):
    t, h = 128, 160  # a partial last block of 128 and an MXFP8 scale row padded from 5 to 8
    gen = torch.Generator().manual_seed(num_expert * 10 + top_k)
    num_out = t * top_k if num_out is None else num_out
    rmap = random_map(gen, t, num_expert, num_out)  # as TE's test: exactly num_out routed slots
    q = quantize(torch.randn(t, h, generator=gen), recipe, fmt, device=device)
    out, row_id_map = te.moe_permute(q, rmap.to(device), num_out_tokens=num_out, map_type="mask")
    check_moved(out, q, mask_sources(rmap, num_out))
    assert row_id_map.dtype == torch.int32 and tuple(row_id_map.shape) == (t, 2 * num_expert + 1)
    if recipe == "blockwise":
        assert tuple(out._rowwise_scale_inv.shape) == (2, num_out) and out._rowwise_scale_inv.is_contiguous()
    elif recipe == "mxfp8":
        assert tuple(out._rowwise_scale_inv.shape) == (num_out, 8)
        assert out._rowwise_scale_inv.dtype == torch.uint8
    assert "transformer_engine" not in sys.modules


@pytest.mark.parametrize("recipe", ["current", "blockwise", "mxfp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_scale_rows_past_the_tokens_and_a_cut(device, recipe):
    # T not a multiple of 4 / 128 (scale layouts padded, TE's own check wants them exact) and
    # num_out_tokens below the routed count: the last rows in expert-major order are dropped
    t, h, e = 37, 256, 5
    gen = torch.Generator().manual_seed(3)
    rmap = random_map(gen, t, e, 80)
    q = quantize(torch.randn(t, h, generator=gen), recipe, "e4m3", dtype=torch.bfloat16, device=device)
    out, _ = te.moe_permute(q, rmap.to(device), 70)
    check_moved(out, q, mask_sources(rmap, 70))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", RECIPES[1:])
@pytest.mark.parametrize("device", DEVICES)
def test_permute_with_probs_zeroes_rows_of_probability_zero(device, recipe):
    t, h, e = 40, 128, 6
    gen = torch.Generator().manual_seed(5)
    rmap = random_map(gen, t, e, 90)
    probs = torch.rand(t, e, generator=gen)
    probs[rmap & (torch.rand(t, e, generator=gen) < 0.2)] = 0.0  # Megatron's routing-map padding
    probs[~rmap] = float("nan")  # never read
    q = quantize(torch.randn(t, h, generator=gen), recipe, "e5m2", device=device)
    out, moved, _ = te.moe_permute_with_probs(q, probs.to(device), rmap.to(device), 90)
    moved = moved.cpu()
    src = mask_sources(rmap, 90)
    order = [(i, j) for j in range(e) for i in range(t) if bool(rmap[i, j])]
    want = torch.tensor([float(probs[i, j]) for i, j in order])
    assert torch.equal(moved, want)
    zero = {r for r, (i, j) in enumerate(order) if float(probs[i, j]) == 0.0}
    assert zero  # the case is exercised
    check_moved(out, q, src, zero_rows=zero)


@pytest.mark.parametrize("recipe", RECIPES[1:])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_permute_and_pad_pads_with_zero_codes_and_zero_scales(device, recipe, exact):
    t, h, e, align = 30, 128, 4, 8
    gen = torch.Generator().manual_seed(7)
    rmap = random_map(gen, t, e, 50)
    probs = torch.rand(t, e, generator=gen) + 0.5
    q = quantize(torch.randn(t, h, generator=gen), recipe, "e4m3", device=device)
    counts = rmap.sum(0)
    kw = {} if exact else {"out_rows": t * e + e * (align - 1)}
    got = te.moe_permute_and_pad_with_probs(q, probs.to(device), rmap.to(device), counts.to(device), align, **kw)
    out, moved, _, pad_offsets, target = got
    moved, pad_offsets, target = moved.cpu(), pad_offsets.cpu(), target.cpu()
    padded_total = sum(_round_up(int(c), align) for c in counts)
    rows = padded_total if exact else kw["out_rows"]
    src = mask_sources(rmap, rows, align)
    check_moved(out, q, src)
    assert torch.equal(target, torch.tensor([_round_up(int(c), align) for c in counts]))
    pads = [_round_up(int(c), align) - int(c) for c in counts]
    assert torch.equal(pad_offsets, torch.tensor([sum(pads[:j]) for j in range(e)]))
    order = [(i, j) for j in range(e) for i in range(t) if bool(rmap[i, j])]
    want = [float(probs[i, j]) for i, j in order]
    assert [float(v) for v in moved[torch.tensor(src) >= 0]] == want
    assert int(moved[torch.tensor(src) < 0].count_nonzero()) == 0


@pytest.mark.parametrize("recipe", RECIPES[1:])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_sort_chunks_moves_rows_with_their_scales(device, recipe, with_probs):
    t, h = 45, 128
    gen = torch.Generator().manual_seed(11)
    q = quantize(torch.randn(t, h, generator=gen), recipe, "e4m3", device=device)
    split_sizes = torch.tensor([7, 0, 12, 9, 14])  # 42 rows; the last 3 stay where they are
    sorted_index = torch.tensor([3, 0, 4, 1, 2])
    starts = [sum(split_sizes[:c].tolist()) for c in range(5)]
    src = [starts[c] + i for c in sorted_index.tolist() for i in range(int(split_sizes[c]))] + [42, 43, 44]
    if with_probs:
        probs = torch.rand(t, generator=gen)
        out, moved = te.moe_sort_chunks_by_index_with_probs(q, probs.to(device), split_sizes, sorted_index)
        assert torch.equal(moved.cpu(), torch.stack([probs[s] for s in src]))
    else:
        out = te.moe_sort_chunks_by_index(q, split_sizes.to(device), sorted_index.to(device))
    check_moved(out, q, src)
    if recipe != "current":  # the scale layout, its padding included, is the input's
        assert out._rowwise_scale_inv.shape == q._rowwise_scale_inv.shape
        pad = out._rowwise_scale_inv[:, t:] if recipe == "blockwise" else out._rowwise_scale_inv[t:].view(torch.uint8)
        ref = q._rowwise_scale_inv[:, t:] if recipe == "blockwise" else q._rowwise_scale_inv[t:]
        assert torch.equal(pad, ref)


def test_index_map_reads_the_input_dequantized():
    # TE's index-map kernels are not pass-through operators of its tensor class: they get it dequantized
    t, h, k = 24, 128, 2
    gen = torch.Generator().manual_seed(13)
    q = quantize(torch.randn(t, h, generator=gen), "blockwise", "e4m3")
    index = torch.stack([torch.randperm(6, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    out, row_id_map = te.moe_permute(q, index, 0, map_type="index")
    want, want_map = te.moe_permute(q.dequantize(), index, 0, map_type="index")
    assert type(out) is torch.Tensor and torch.equal(out, want) and torch.equal(row_id_map, want_map)
    probs = torch.rand(t, k, generator=gen)
    qo = quantize(out, "current", "e4m3")
    back = te.moe_unpermute(qo, row_id_map, probs, map_type="index")
    assert torch.equal(back, te.moe_unpermute(qo.dequantize(), row_id_map, probs, map_type="index"))


def test_mask_unpermute_refuses_fp8():
    gen = torch.Generator().manual_seed(17)
    rmap = random_map(gen, 8, 3, 12)
    _, row_id_map = te.moe_permute(torch.randn(8, 64), rmap, 12)
    q = quantize(torch.randn(12, 64, generator=gen), "current", "e4m3")
    with pytest.raises(TypeError, match="moe_unpermute: inp: .*quantized"):
        te.moe_unpermute(q, row_id_map)


def _variant(recipe, **changes):
    q = quantize(torch.randn(16, 128), recipe, "e4m3")
    meta = {**q.get_metadata(), **changes}
    return type(q)(shape=q.shape, dtype=q.dtype, device="cpu", **meta)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: _variant("blockwise", is_2D_scaled=True), TypeError, "128x128"),
        (lambda: _variant("mxfp8", with_gemm_swizzled_scales=True), TypeError, "swizzled"),
        (lambda: _variant("mxfp8", rowwise_data=None), ValueError, "no row-wise data"),
        (lambda: _variant("current", data=None), ValueError, "no row-wise data"),
        (lambda: _variant("blockwise", rowwise_scale_inv=torch.ones(1, 8)), ValueError, "_rowwise_scale_inv"),
        (lambda: _variant("mxfp8", rowwise_scale_inv=torch.ones(8, 4, dtype=torch.uint8)), ValueError, "scale"),
        (lambda: _variant("current", data=torch.zeros(16, 128)), ValueError, "one-byte"),
        (
            lambda: NVFP4Tensor(
                shape=(16, 128),
                dtype=torch.float32,
                device="cpu",
                rowwise_data=torch.zeros(16, 64, dtype=torch.uint8),
                rowwise_scale_inv=torch.zeros(128, 8, dtype=torch.uint8),
            ),
            TypeError,
            "NVFP4Tensor is not taken",
        ),
    ],
)
def test_inputs_not_taken_name_the_function_and_argument(make, error, match):
    q = make()
    rmap = torch.zeros(16, 4, dtype=torch.bool)
    rmap[:, 1] = True
    with pytest.raises(error, match=f"moe_permute: inp: .*{match}"):
        te.moe_permute(q, rmap, 16)
    with pytest.raises(error, match=f"moe_sort_chunks_by_index: inp: .*{match}"):
        te.moe_sort_chunks_by_index(q, torch.tensor([16]), torch.tensor([0]))


def test_not_under_torch_compile(monkeypatch):
    # as TE: quantized inputs are refused while compiling (checked without compiling: the flag is faked)
    q = quantize(torch.randn(8, 128), "mxfp8", "e4m3")
    import padmoe.torch._te_checks as checks

    monkeypatch.setattr(checks, "compiling", lambda: True)
    with pytest.raises(RuntimeError, match="moe_permute: inp: .*torch.compile"):
        te.moe_permute(q, torch.ones(8, 2, dtype=torch.bool), 16)


@pytest.mark.parametrize("recipe", ["current", "mxfp8"])
def test_empty_input_is_cloned(recipe):
    q = quantize(torch.randn(0, 64), recipe, "e4m3")
    out, row_id_map = te.moe_permute(q, torch.zeros(0, 3, dtype=torch.bool), 4)
    assert type(out) is type(q) and out.shape == (0, 64) and row_id_map.numel() == 0


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_gradient_reaches_a_quantized_input(recipe):
    # TE: the permute of an FP8 input is differentiable; the gradient comes (and goes back) plain
    t, h, e = 12, 128, 4
    gen = torch.Generator().manual_seed(19)
    rmap = random_map(gen, t, e, 20)
    probs = (torch.rand(t, e, generator=gen) + 0.1).requires_grad_()
    q = quantize(torch.randn(t, h, generator=gen), recipe, "e4m3", requires_grad=True)
    out, moved, _ = te.moe_permute_with_probs(q, probs, rmap, 20)
    assert out.requires_grad and moved.requires_grad
    g, gp = torch.randn(20, h, generator=gen), torch.randn(20, generator=gen)
    grad_q, grad_p = torch.autograd.grad([out, moved], [q, probs], [g, gp])
    src = mask_sources(rmap, 20)
    order = [(i, j) for j in range(e) for i in range(t) if bool(rmap[i, j])]
    want_q = torch.zeros(t, h)
    want_p = torch.zeros(t, e)
    for r, s in enumerate(src):
        want_q[s] += g[r]
        want_p[order[r]] = gp[r]
    assert type(grad_q) is torch.Tensor
    torch.testing.assert_close(grad_q, want_q)
    assert torch.equal(grad_p, want_p)
    # the chunk sort's gradient goes back to the rows it moved
    out = te.moe_sort_chunks_by_index(q, torch.tensor([5, 7]), torch.tensor([1, 0]))
    (grad_q,) = torch.autograd.grad(out, q, g[:t])
    src = list(range(5, 12)) + list(range(5))
    assert torch.equal(grad_q, torch.stack([g[src.index(i)] for i in range(t)]))


# ---------------------------------------------------------------------------
# plain tensors: unchanged
# ---------------------------------------------------------------------------


def test_plain_rows_are_unchanged():
    t, h, e = 20, 16, 5
    gen = torch.Generator().manual_seed(23)
    rmap = random_map(gen, t, e, 33)
    x = torch.randn(t, h, generator=gen)
    out, _ = te.moe_permute(x, rmap, 33)
    src = mask_sources(rmap, 33)
    assert type(out) is torch.Tensor and torch.equal(out, torch.stack([x[s] for s in src]))
    probs = torch.rand(t, e, generator=gen)
    out, moved, row_id_map = te.moe_permute_with_probs(x, probs, rmap, 33)
    assert torch.equal(out, torch.stack([x[s] for s in src]))
    back = te.moe_unpermute(out, row_id_map, probs, restore_shape=(t, h))
    want = torch.zeros(t, h, dtype=torch.float64)
    for r, (i, j) in enumerate((i, j) for j in range(e) for i in range(t) if bool(rmap[i, j])):
        want[i] += out[r].double() * float(probs[i, j])
    torch.testing.assert_close(back, want.float())
    # fp8 rows given as a torch float8 tensor stay what they were: moved bit for bit
    x8 = x.to(torch.float8_e4m3fn)
    out8, _ = te.moe_permute(x8, rmap, 33)
    assert out8.dtype == torch.float8_e4m3fn
    assert torch.equal(out8.view(torch.uint8), torch.stack([x8.view(torch.uint8)[s] for s in src]))
    out = te.moe_sort_chunks_by_index(x, torch.tensor([8, 12]), torch.tensor([1, 0]))
    assert torch.equal(out, torch.cat([x[8:], x[:8]]))
