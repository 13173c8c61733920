#!/usr/bin/env bash
# The Python test suite: builds the padmoe package (pyproject.toml: scikit-build-core +
# nanobind, from the same CMake tree; the CUDA backend too when nvcc is found) into a
# virtualenv and runs pytest on python/tests.
#   PADMOE_VENV=DIR      the virtualenv (default: .venv in the repo; created when missing)
#   PADMOE_PY_TORCH=0|1  install torch for the torch tests (default 1; ~4 GB from PyPI)
#   PADMOE_PYTHON=EXE    interpreter that creates a new virtualenv (default python3)
# Extra arguments go to pytest. The build dir build/<wheel tag> is reused between runs and
# the build is not isolated, so a rerun rebuilds only what changed and needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

venv=${PADMOE_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "padmoe: creating the virtualenv $venv" >&2
  "${PADMOE_PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"

need=()
"$py" -c "import numpy" 2>/dev/null || need+=("numpy>=1.22")
"$py" -c "import pytest" 2>/dev/null || need+=(pytest)
"$py" -c "import scikit_build_core" 2>/dev/null || need+=("scikit-build-core>=0.10")
"$py" -c "import nanobind" 2>/dev/null || need+=("nanobind>=2.0")
if [ "${PADMOE_PY_TORCH:-1}" = "1" ]; then
  "$py" -c "import torch" 2>/dev/null || need+=(torch)
  # python/tests/test_transformers.py (padmoe.integrations.transformers; tiny random configs, no downloads)
  "$py" -c "import transformers" 2>/dev/null || need+=("transformers>=5")
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "padmoe: pip installing ${need[*]} into $venv" >&2
  # No pip cache: torch from PyPI brings ~4 GB of CUDA wheels, and a cached second copy
  # has filled a CI machine's disk before.
  "$py" -m pip install -q --no-cache-dir "${need[@]}"
fi

echo "padmoe: building and installing the Python package (nvcc: $(command -v nvcc || echo none))" >&2
"$py" -m pip install -q --no-cache-dir --no-build-isolation .
"$py" -m pytest python/tests -q "$@"
# padmoe.triton in Triton's interpreter (CPU): TRITON_INTERPRET=1 must be set before triton is imported,
# so in a process of its own.
if "$py" -c "import triton" 2>/dev/null; then
  TRITON_INTERPRET=1 "$py" -m pytest python/tests/test_triton.py python/tests/test_triton_activation.py \
    python/tests/test_triton_gather_gemm.py -q "$@"
fi
