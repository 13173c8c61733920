#!/usr/bin/env bash
# session 21 call 5: sort_chunks' layout in one scan, one row a block (tests, sanitizers, A/B)
export PADMOE_GPU_LOGS=/tmp/gpu-logs PADMOE_CPU_TESTS=0 PADMOE_SANITIZE=1 PADMOE_GPU_DEADLINE=300 PADMOE_BANDWIDTH=0
export PADMOE_SANITIZE_FILTER='SortChunksGpu*'
export PADMOE_GPU_TEST_FILTER='SortChunksGpu*:CudaGraph*'
export PADMOE_BUILD_TARGETS="padmoe_cli padmoe_cuda_tests" PADMOE_BENCH_PRESETS=decode PADMOE_BENCH_OPS=sort_chunks
export PADMOE_AB="f0=PADMOE_CUDA_CHUNK_FAST=0@decode@sort_chunks f1=PADMOE_CUDA_CHUNK_FAST=1@decode@sort_chunks
f0b=PADMOE_CUDA_CHUNK_FAST=0@decode@sort_chunks f1b=PADMOE_CUDA_CHUNK_FAST=1@decode@sort_chunks
m0=PADMOE_CUDA_CHUNK_ROWS=all,PADMOE_CUDA_CHUNK_FAST=0@mixtral-8x7b@sort_chunks
m1=PADMOE_CUDA_CHUNK_ROWS=all,PADMOE_CUDA_CHUNK_FAST=1@mixtral-8x7b@sort_chunks"
rm -rf /tmp/gpu-logs
scripts/gpu.sh tests bench ab 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -c 4000
grep -E "FAILED|Failure|error" /tmp/gpu-logs/gpu-tests.log | head -20
