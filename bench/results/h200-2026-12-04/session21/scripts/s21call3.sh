#!/usr/bin/env bash
# session 21 call 3: sort_chunks with one chunk a thread, 8 blocks an SM (tests, sanitizers, A/B); decode composites
export PADMOE_GPU_LOGS=/tmp/gpu-logs PADMOE_CPU_TESTS=0 PADMOE_SANITIZE=1 PADMOE_GPU_DEADLINE=400 PADMOE_BANDWIDTH=0
export PADMOE_SANITIZE_FILTER='SortChunksGpu*'
export PADMOE_GPU_TEST_FILTER='SortChunksGpu*:CudaGraph*'
export PADMOE_BUILD_TARGETS="padmoe_cli padmoe_cuda_tests" PADMOE_BENCH_PRESETS=decode
export PADMOE_BENCH_OPS='sort_chunks,plan+dispatch+combine,plan+dispatch(no-pad)+combine,plan+dispatch,dispatch+combine,dispatch(no-pad)'
export PADMOE_AB="k0=PADMOE_CUDA_CHUNK_SMALL=0@decode@sort_chunks k1=PADMOE_CUDA_CHUNK_SMALL=1@decode@sort_chunks
k0b=PADMOE_CUDA_CHUNK_SMALL=0@decode@sort_chunks k1b=PADMOE_CUDA_CHUNK_SMALL=1@decode@sort_chunks
w2=PADMOE_CUDA_CHUNK_SMALL=1,PADMOE_CUDA_CHUNK_ROWS_WAVES=2@decode@sort_chunks"
rm -rf /tmp/gpu-logs
scripts/gpu.sh tests bench ab 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -c 6000
