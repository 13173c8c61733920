#!/usr/bin/env bash
# session 21 call 7: rows past P with zero_tail off: map entries only (both one-launch forms)
export PADMOE_GPU_LOGS=/tmp/gpu-logs PADMOE_CPU_TESTS=0 PADMOE_SANITIZE=0 PADMOE_GPU_DEADLINE=230 PADMOE_BANDWIDTH=0
export PADMOE_GPU_TEST_FILTER='SortChunksGpu*'
export PADMOE_BUILD_TARGETS="padmoe_cli padmoe_cuda_tests" PADMOE_BENCH_PRESETS=none PADMOE_BENCH_OPS=sort_chunks
export PADMOE_AB="f0=PADMOE_CUDA_CHUNK_FAST=0@decode@sort_chunks f1=PADMOE_CUDA_CHUNK_FAST=1@decode@sort_chunks
f0b=PADMOE_CUDA_CHUNK_FAST=0@decode@sort_chunks f1b=PADMOE_CUDA_CHUNK_FAST=1@decode@sort_chunks"
rm -rf /tmp/gpu-logs
scripts/gpu.sh tests ab 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -c 3000
