#!/usr/bin/env bash
# The Python test suite: builds the padmoe package (pyproject.toml: scikit-build-core +
# nanobind, from the same CMake tree; the CUDA backend too when nvcc is found) into a
# virtualenv and runs pytest on python/tests.
#   PADMOE_VENV=DIR      the virtualenv (default: .venv in the repo; created when missing)
#   PADMOE_PY_TORCH=0|1  install torch for the torch tests (default 1; ~6 GB unpacked from PyPI:
#                        with less than 7 GiB free on the virtualenv's disk the torch tests are
#                        skipped, and the script says so)
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
if [ "${PADMOE_PY_TORCH:-1}" = "1" ] && ! "$py" -c "import torch" 2>/dev/null; then
  # torch from PyPI is a CUDA build: ~6 GB unpacked with its nvidia-* wheels.
  free_kib=$(df -Pk "$venv" | awk 'NR == 2 {print $4}')
  if [ "$free_kib" -lt $((7 * 1024 * 1024)) ]; then
    echo "padmoe: WARNING: $((free_kib / 1024)) MiB free on the disk of $venv; torch from PyPI needs" \
      "~7 GiB while it installs: torch is not installed and the torch tests are skipped" >&2
    export PADMOE_PY_TORCH=0
  else
    need+=(torch)
  fi
fi
if [ "${PADMOE_PY_TORCH:-1}" = "1" ]; then
  # python/tests/test_transformers.py (padmoe.integrations.transformers; tiny random configs, no downloads)
  "$py" -c "import transformers" 2>/dev/null || need+=("transformers>=5")
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "padmoe: pip installing ${need[*]} into $venv" >&2
  # pip resolves the whole set (metadata only), then installs one wheel at a time: a single
  # request downloads every wheel before it unpacks any, and torch's ~3.5 GB of compressed
  # CUDA wheels beside their unpacked copies filled a CI machine's disk. No pip cache, for
  # the same reason.
  report=$(mktemp)
  pins=()
  if "$py" -m pip install -q --no-cache-dir --dry-run --report "$report" "${need[@]}"; then
    mapfile -t pins < <("$py" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"] + "==" + item["metadata"]["version"])' "$report")
  fi
  rm -f "$report"
  if [ ${#pins[@]} -eq 0 ]; then  # a pip without --report (before 22.2): one request
    "$py" -m pip install -q --no-cache-dir "${need[@]}"
  fi
  for pin in "${pins[@]}"; do
    "$py" -m pip install -q --no-cache-dir --no-deps "$pin"
  done
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
