#!/usr/bin/env bash
# session 21 call 2: sort_chunks in source order (tests, sanitizers, A/B); padmoe.torch at decode; user_bench
export PADMOE_GPU_LOGS=/tmp/gpu-logs PADMOE_CPU_TESTS=0 PADMOE_SANITIZE=1 PADMOE_GPU_DEADLINE=200 PADMOE_BANDWIDTH=0
export PADMOE_SANITIZE_FILTER='SortChunksGpu*'
export PADMOE_GPU_TEST_FILTER='SortChunksGpu*:CudaGraph*'
export PADMOE_BUILD_TARGETS="padmoe_cli padmoe_cuda_tests" PADMOE_BENCH_PRESETS=decode PADMOE_BENCH_OPS=sort_chunks
export PADMOE_AB="s0=PADMOE_CUDA_CHUNK_SOURCE=0@decode@sort_chunks s1=PADMOE_CUDA_CHUNK_SOURCE=1@decode@sort_chunks
s0b=PADMOE_CUDA_CHUNK_SOURCE=0@decode@sort_chunks s1b=PADMOE_CUDA_CHUNK_SOURCE=1@decode@sort_chunks
m0=PADMOE_CUDA_CHUNK_ROWS=all,PADMOE_CUDA_CHUNK_SOURCE=0@mixtral-8x7b@sort_chunks
m1=PADMOE_CUDA_CHUNK_ROWS=all,PADMOE_CUDA_CHUNK_SOURCE=1@mixtral-8x7b@sort_chunks"
rm -rf /tmp/gpu-logs
scripts/gpu.sh tests bench ab 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -c 5000
pyt=/tmp/padmoe-pyt
env CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps --break-system-packages \
   --upgrade --target $pyt -C build-dir=/tmp/padmoe-skbuild . > $OUT/python-build.log 2>&1 || { tail -30 $OUT/python-build.log; exit 1; }
timeout 60 env PYTHONPATH=$pyt python3 .ab/s21probe.py > $OUT/probe.txt 2>&1; echo "probe rc $?"; cat $OUT/probe.txt
timeout 150 env PYTHONPATH=$pyt OUT=$OUT PYTHONUNBUFFERED=1 python3 .ubench/user_bench.py --graphs --shapes decode-256,deepseek-v3 > $OUT/user-bench.txt 2>&1
echo "user_bench rc $?"; grep -E " padmoe " $OUT/user-bench.txt | head -40
