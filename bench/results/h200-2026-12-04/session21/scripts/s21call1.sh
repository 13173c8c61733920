#!/usr/bin/env bash
# session 21 call 1: sort_chunks pairs variant (tests, sanitizers, A/B), the spin+dispatch+combine bound
export PADMOE_GPU_LOGS=/tmp/gpu-logs PADMOE_CPU_TESTS=0 PADMOE_SANITIZE=1 PADMOE_GPU_DEADLINE=560
export PADMOE_SANITIZE_FILTER='SortChunksGpu*'
export PADMOE_GPU_TEST_FILTER='SortChunksGpu*:CudaGraph*'
export PADMOE_BUILD_TARGETS="padmoe_cli padmoe_bandwidth padmoe_cuda_tests" PADMOE_BENCH_PRESETS=decode PADMOE_BENCH_OPS=sort_chunks
export PADMOE_AB="p0=PADMOE_CUDA_CHUNK_PAIRS=0@decode@sort_chunks p1=PADMOE_CUDA_CHUNK_PAIRS=1@decode@sort_chunks
p0b=PADMOE_CUDA_CHUNK_PAIRS=0@decode@sort_chunks p1b=PADMOE_CUDA_CHUNK_PAIRS=1@decode@sort_chunks
m0=PADMOE_CUDA_CHUNK_ROWS=all,PADMOE_CUDA_CHUNK_PAIRS=0@mixtral-8x7b@sort_chunks
m1=PADMOE_CUDA_CHUNK_ROWS=all,PADMOE_CUDA_CHUNK_PAIRS=1@mixtral-8x7b@sort_chunks
d0=PADMOE_CUDA_CHUNK_PAIRS=0@deepseek-v3@sort_chunks d1=PADMOE_CUDA_CHUNK_PAIRS=1@deepseek-v3@sort_chunks"
rm -rf /tmp/gpu-logs
scripts/gpu.sh tests bench ab 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -c 11500
