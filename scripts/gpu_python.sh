#!/usr/bin/env bash
# The Python package on the GPU machine without a virtualenv or network: an
# unisolated pip build into a target dir, pytest on CUDA, bench_python.
set -u
L=/tmp/logs; mkdir -p $L
export PATH=/usr/local/cuda/bin:$PATH CMAKE_BUILD_PARALLEL_LEVEL=16
python3 -m pip install --no-build-isolation --no-deps --break-system-packages --target /tmp/pyt . > $L/pip.log 2>&1; echo "pip rc $?"; tail -3 $L/pip.log
export PYTHONPATH=/tmp/pyt
timeout 110 python3 -m pytest python/tests -q -rs > $L/pytest-cuda.log 2>&1; echo "pytest rc $?"; tail -n 15 $L/pytest-cuda.log
timeout 110 python3 bench/bench_python.py --device cuda --iters 5 --warmup 1 --out-md $L/python-bench.md --out-json $L/python-bench.json > $L/python-bench.log 2>&1; echo "pybench rc $?"; head -70 $L/python-bench.md; tail -3 $L/python-bench.log
tar czf $OUT/logs.tgz -C /tmp logs
