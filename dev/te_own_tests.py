#!/usr/bin/env python3
"""TransformerEngine's own permutation tests, run against padmoe.torch.transformer_engine.

TE's ``tests/pytorch/test_permutation.py`` imports ``transformer_engine.pytorch``. This script
writes, in a temporary directory, a ``transformer_engine`` package whose ``pytorch`` module is
padmoe's drop-in (the six ``moe_*`` functions) plus the few other names the file imports: TE's
``DType`` enum, availability queries that report FP8 as unavailable (so the FP8 cases skip), and
``Fp8Padding`` / ``Fp8Unpadding``, which the padded cases use as their reference (each of the
``m_splits`` row blocks padded with zero rows to a multiple of ``align_size``, and back). TE's test
file is copied unchanged, except with ``--device cpu``, where its ``"cuda"`` and ``.cuda()`` become
the CPU. Nothing of TE is kept in the repository: pass a TE checkout.

    PYTHONPATH=PADMOE_DIR python3 dev/te_own_tests.py --te-src TE_CHECKOUT [--device cpu] [-- PYTEST_ARGS]
"""

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

TEST = "tests/pytorch/test_permutation.py"

PYTORCH_MODULE = '''"""padmoe's TransformerEngine drop-in under TE's module name, for TE's own tests."""
import enum

import torch
from padmoe.torch.transformer_engine import (  # noqa: F401
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)


class DType(enum.Enum):
    kFloat32 = 0
    kFloat16 = 1
    kBFloat16 = 2
    kFloat8E4M3 = 3
    kFloat8E5M2 = 4


def is_bf16_available():
    return True


def _no_fp8(return_reason=False):
    return (False, "padmoe's drop-in takes no float8 QuantizedTensor") if return_reason else False


is_fp8_available = is_mxfp8_available = is_fp8_block_scaling_available = _no_fp8


class _Quantizer:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("padmoe's drop-in takes no float8 QuantizedTensor")


Float8Quantizer = Float8CurrentScalingQuantizer = Float8BlockQuantizer = MXFP8Quantizer = _Quantizer


class _Aligned(torch.nn.Module):
    """TE's constructor (num_gemms, align_size) and the padded size of each block."""

    def __init__(self, num_gemms, align_size=16):
        super().__init__()
        self.align = align_size

    def padded(self, m_splits):
        return [(m + self.align - 1) // self.align * self.align for m in m_splits]


class Fp8Padding(_Aligned):
    """Each block of m_splits rows padded with zero rows to a multiple of align_size."""

    def forward(self, inp, m_splits):
        padded = self.padded(m_splits)
        blocks = torch.split(inp, list(m_splits))
        pad = [(0, 0) * (inp.dim() - 1) + (0, q - m) for m, q in zip(m_splits, padded)]
        return torch.cat([torch.nn.functional.pad(b, p) for b, p in zip(blocks, pad)]), padded


class Fp8Unpadding(_Aligned):
    """The inverse of Fp8Padding: the first m rows of each padded block."""

    def forward(self, inp, m_splits):
        blocks = torch.split(inp, self.padded(m_splits))
        return torch.cat([b[:m] for b, m in zip(blocks, m_splits)])
'''

RECIPE_MODULE = '''"""TE's recipe classes, as far as TE's permutation tests ask them (FP8 cases skip)."""


class _Recipe:
    def mxfp8(self):
        return False

    def delayed(self):
        return False

    def float8_current_scaling(self):
        return False

    def float8_block_scaling(self):
        return False


class MXFP8BlockScaling(_Recipe):
    pass


class DelayedScaling(_Recipe):
    pass


class Float8CurrentScaling(_Recipe):
    pass


class Float8BlockScaling(_Recipe):
    pass
'''


def write_tree(root: pathlib.Path, test_text: str) -> pathlib.Path:
    pkg = root / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "common").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "common" / "__init__.py").write_text("")
    (pkg / "common" / "recipe.py").write_text(RECIPE_MODULE)
    (pkg / "pytorch" / "__init__.py").write_text(PYTORCH_MODULE)
    test = root / "test_permutation.py"
    test.write_text(test_text)
    return test


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--te-src", required=True, help=f"a TransformerEngine checkout (holding {TEST})")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where TE's tests run (default cuda)")
    p.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (e.g. -k compile -x)")
    args = p.parse_args(argv)
    src = pathlib.Path(args.te_src) / TEST
    if not src.is_file():
        p.error(f"--te-src: {src} not found")
    text = src.read_text()
    if args.device == "cpu":
        text = re.sub(r"\.cuda\(\)", ".cpu()", text).replace('"cuda"', '"cpu"')
    with tempfile.TemporaryDirectory(prefix="padmoe-te-tests-") as tmp:
        test = write_tree(pathlib.Path(tmp), text)
        path = os.pathsep.join(x for x in (tmp, os.environ.get("PYTHONPATH")) if x)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(test), *args.pytest_args]
        return subprocess.run(cmd, cwd=tmp, env={**os.environ, "PYTHONPATH": path}).returncode


if __name__ == "__main__":
    sys.exit(main())
