#!/usr/bin/env bash
# Quick GPU iteration (device machine): build, the GPU suite, then the
# experiment below; logs packed into $OUT/logs.tgz (one file comes back).
set -u
L=/tmp/logs; mkdir -p $L
B=build-gpu
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DPADMOE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 > $L/build.log 2>&1 && cmake --build $B -j16 >> $L/build.log 2>&1 || { tail -30 $L/build.log; exit 1; }
echo build ok
timeout 200 $B/padmoe_cuda_tests > $L/gpu-tests.log 2>&1; echo "gpu-tests rc $?"; grep -E "PASSED|FAILED" $L/gpu-tests.log | head
line() { python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
print(sys.argv[2], ' '.join(f\"{o['name']}={o['us']:.1f}us/x{o['time_over_floor']:.2f}\" for o in d['ops']))" "$@"; }
for p in mixtral-8x7b qwen3-30b-a3b deepseek-v3 decode; do
  for shape in 0 1 2 3 4 5 6; do
    PADMOE_REDUCE_SHAPE=$shape $B/padmoe bench --device cuda --preset $p --no-reference --iters 30 --json --ops "combine(w),padded_scatter" > $L/r.json 2>/dev/null && line $L/r.json "$p shape$shape"
  done
  $B/padmoe bench --device cuda --preset $p --no-reference --iters 30 --json --ops "make_plan,dispatch,plan+dispatch+combine,pad_to_alignment,unpad_from_alignment,combine_backward(w)" > $L/r.json 2>/dev/null && line $L/r.json "$p default"
done
timeout 120 ncu --cache-control none --clock-control none --launch-count 6 --metrics gpu__time_duration.sum -k regex:plan_ $B/padmoe bench --device cuda --preset deepseek-v3 --no-reference --iters 3 --warmup 1 --ops make_plan > $L/ncu-plan.log 2>&1; grep -E "^  [a-z_<>:]*plan_|duration" $L/ncu-plan.log | sed 's/(IndexRef.*) (/ (/' | head -12
timeout 150 ncu --cache-control none --clock-control none --launch-count 1 --launch-skip 3 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers -k regex:spread_kernel $B/padmoe bench --device cuda --preset deepseek-v3 --no-reference --iters 3 --warmup 1 --ops dispatch > $L/ncu-spread.log 2>&1; grep -E "spread|dram__|duration|warps_active|registers" $L/ncu-spread.log | head -12
tar czf $OUT/logs.tgz -C /tmp logs
