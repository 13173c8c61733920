#!/usr/bin/env bash
# session 21 call 4: the layout-dependency pattern (padmoe_bandwidth), decode checks incl. the new composite,
# and the Python suite's chunk / pad / hardening tests on CUDA (pad_to_alignment_rows / sort_chunks_rows' CUDA path)
export PADMOE_GPU_LOGS=/tmp/gpu-logs PADMOE_GPU_DEADLINE=260 PADMOE_CHECK_PRESETS=decode
export PADMOE_BUILD_TARGETS="padmoe_cli padmoe_bandwidth" PADMOE_BENCH_PRESETS=decode
export PADMOE_BENCH_OPS='sort_chunks,plan+dispatch+combine,plan+dispatch(no-pad)+combine'
rm -rf /tmp/gpu-logs
scripts/gpu.sh checks bench 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | grep -E "===|ok|FAIL|PASS|sort_chunks|dispatch|decode-sized|graph|scan" | tail -c 5000
pyt=/tmp/padmoe-pyt
env CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps --break-system-packages \
   --upgrade --target $pyt -C build-dir=/tmp/padmoe-skbuild . > $OUT/python-build.log 2>&1 || { tail -30 $OUT/python-build.log; exit 1; }
timeout 240 env PYTHONPATH=$pyt python3 -m pytest -q -x -p no:cacheprovider python/tests/test_chunks.py python/tests/test_hardening.py \
  python/tests/test_layouts.py python/tests/test_torch_ops.py -k "cuda or CUDA or gpu" > $OUT/pytest.txt 2>&1; echo "pytest rc $?"; tail -5 $OUT/pytest.txt
