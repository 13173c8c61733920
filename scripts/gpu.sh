#!/usr/bin/env bash
# The GPU job, in one invocation on a GPU machine (written for an H200, sm_90): build with
# CUDA, run the CPU suite, the GPU suite, compute-sanitizer memcheck and
# racecheck on a representative subset, `padmoe check --device cuda` on every
# preset, `padmoe bench --device cuda` on every preset with the memory
# system's bandwidth by traffic mix (padmoe_bandwidth), and the Python package
# (pip install ., pytest on CUDA, bench/bench_python.py with its chart).
# Logs go to the folder the OUT variable names (default: ./gpu-out), packed into gpu-logs.tgz there
# as well (for a machine whose logs are collected as a few files: PADMOE_GPU_LOGS=DIR writes the logs
# to DIR instead and leaves only the archive in OUT's folder). The archive is written on every exit,
# and PADMOE_GPU_DEADLINE=S (seconds from the start, default 540: under a 600 s time limit per
# invocation) stops the step running at it (timeout) and skips the steps still to come, so that an
# invocation that runs long still leaves its logs.
# Usage: scripts/gpu.sh [STAGE...]  stages: tests checks bench profile ab python triton ep, or
#        all (default all; profile and ab are never in all). ab: kernel variants timed
#        against each other, PADMOE_AB="TAG=KEY=V[,KEY=V]@PRESET@OPS ..." (`padmoe bench --variant`
#        keys; see the stage). PADMOE_CHECK_PRESETS the
#        checks stage's presets (default all five). PADMOE_SANITIZE=0 skips the
#        sanitizer runs of the tests stage (PADMOE_SANITIZE_FILTER: their gtest filter), PADMOE_CPU_TESTS=0 its ctest run,
#        PADMOE_GPU_TEST_FILTER the GPU suite's gtest filter (default all),
#        PADMOE_BANDWIDTH=0 skips the bench stage's padmoe_bandwidth, PADMOE_BENCH_PRESETS /
#        PADMOE_BENCH_OPS its presets (default the four) and ops (default all). A lean invocation
#        for a short time limit (about 2 minutes, build included): PADMOE_CPU_TESTS=0
#        PADMOE_SANITIZE=0 PADMOE_BANDWIDTH=0 PADMOE_BUILD_TARGETS="padmoe_cli padmoe_cuda_tests"
#        PADMOE_GPU_TEST_FILTER='ReduceShapes*:DotKernels*:Determinism*' PADMOE_BENCH_PRESETS=decode
#        scripts/gpu.sh tests bench. Where only a few files are collected: PADMOE_GPU_LOGS=/tmp/gpu-logs, so
#        that OUT's folder holds only gpu-logs.tgz (one file), and every step's output is in the printed tail.
#        PADMOE_TORCH_BENCH=0 the python stage's bench_torch.py, PADMOE_PYTEST_ARGS its pytest selection (default
#        python/tests: the whole suite, which runs past the default deadline on CUDA), PADMOE_BUILD_TARGETS the CMake
#        targets built (all; padmoe_cli padmoe_bandwidth for bench / profile / ab alone). profile: ncu (clocks left alone) on
#        the kernels of make_plan, dispatch and combine_backward at deepseek-v3
#        and decode (PADMOE_PROFILE_SPECS="PRESET:OP ..." to choose; PADMOE_PROFILE_KERNELS a
#        kernel-name regex, PADMOE_PROFILE_SKIP launches to skip, PADMOE_NCU_ARGS more ncu options such as
#        --warp-sampling-interval 0; a .ncu-rep and its source page
#        as CSV are kept per op), one launch
#        each, its sections to profile-*.log; the build then has -lineinfo, so the
#        source counters name source lines (where warps stall). triton: padmoe.triton's tests natively and
#        bench/bench_triton.py (PADMOE_TRITON_SWEEP=1 adds its launch sweep).
#        ep: padmoe.torch.distributed over NCCL: its tests on the GPUs present (one GPU: the group
#        of one and the CUDA-graph capture), then every test with CUDA tensors over gloo (ranks
#        sharing the GPUs), bench/bench_ep.py on 2, 4 and 8 GPUs (those present).
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-gpu-out}
out=${PADMOE_GPU_LOGS:-$dest}
mkdir -p "$out" "$dest"
deadline=${PADMOE_GPU_DEADLINE:-540}
late() { [ "$SECONDS" -ge "$deadline" ]; }
bounded() { timeout "$((deadline - SECONDS))" "$@"; }  # a command stopped at the deadline (after late)
pack() {
  tar czf /tmp/padmoe-gpu-logs.tgz -C "$out" --exclude gpu-logs.tgz . 2>/dev/null && mv /tmp/padmoe-gpu-logs.tgz "$dest/gpu-logs.tgz"
}
trap pack EXIT
build=${BUILD_DIR:-build-gpu}
stages=" ${*:-all} "
want() { [[ ( "$stages" == *" all "* && "$1" != profile && "$1" != ab ) || "$stages" == *" $1 "* ]]; }
status=0
step() { echo; echo "=== $*"; }
run() {  # run a step, keep going, remember failures (skipped past the deadline)
  local name=$1; shift
  step "$name"
  if late; then echo "$name: SKIPPED (past PADMOE_GPU_DEADLINE=$deadline s)"; status=1; return; fi
  if bounded "$@" > "$out/$name.log" 2>&1; then echo "$name: ok"; else echo "$name: FAILED (rc $?)"; tail -n 30 "$out/$name.log"; status=1; fi
}
ops_table() {  # a `padmoe bench --json` file's ops: us, x floor, graph us, graph x floor, in-graph us, x floor (--head: card and columns first)
  python3 - "$@" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
def f(v, n=1):
    return "-" if v is None else f"{v:.{n}f}"
if "--head" in sys.argv[2:]:
    print(f"{d.get('card')}  copy {d.get('copy_tbps', 0):.2f} TB/s  {d['workload']['label']}")
    print(f"  {'op':<38} {'us':>8} {'floor':>6} {'graph us':>9} {'graph/floor':>6} {'in-graph':>9} {'/floor':>6}")
for o in d["ops"]:
    print(f"  {o['name']:<38} {f(o.get('us')):>8} {f(o.get('time_over_floor'), 2):>6} {f(o.get('graph_us')):>9}"
          f" {f(o.get('graph_over_floor'), 2):>6} {f(o.get('in_graph_us')):>9} {f(o.get('in_graph_over_floor'), 2):>6}")
PY
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
if want tests || want checks || want bench || want profile || want ab; then
  step build
  lineinfo=()  # the profile stage: source lines in ncu's source counters
  want profile && lineinfo=(-DCMAKE_CUDA_FLAGS=-lineinfo)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPADMOE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${lineinfo[@]}" \
    > "$out/build.log" 2>&1 && cmake --build "$build" -j "$(nproc)" --target ${PADMOE_BUILD_TARGETS:-all} >> "$out/build.log" 2>&1 \
    || { echo "build FAILED"; tail -n 40 "$out/build.log"; exit 1; }
  echo "build: ok"
fi

if want tests; then
  [ "${PADMOE_CPU_TESTS:-1}" = "1" ] && run cpu-tests ctest --test-dir "$build" -j "$(nproc)" --output-on-failure
  run gpu-tests "$build/padmoe_cuda_tests" --gtest_filter="${PADMOE_GPU_TEST_FILTER:-*}"
  subset=${PADMOE_SANITIZE_FILTER:-'Determinism*:CheckedMode*:CudaGraph*:CpuVsGpuEdge*:PlanKernels*:RowSlices*:DotKernels*:ReduceShapes*:Pdl*:SortChunksGpu*:DestSearch*:RowDots*:PlanAndDispatchGpu*:PadUnpadGpu*'}
  [ "${PADMOE_SANITIZE:-1}" = "1" ] && run memcheck compute-sanitizer --tool memcheck --error-exitcode 3 "$build/padmoe_cuda_tests" --gtest_filter="$subset"
  [ "${PADMOE_SANITIZE:-1}" = "1" ] && run racecheck compute-sanitizer --tool racecheck --error-exitcode 3 "$build/padmoe_cuda_tests" --gtest_filter="$subset"
fi
if want checks; then
  for p in ${PADMOE_CHECK_PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3 decode awkward}; do
    run "check-$p" "$build/padmoe" check --device cuda --preset "$p"
  done
fi
if want bench; then
  if [ "${PADMOE_BANDWIDTH:-1}" = "1" ]; then
    run bandwidth "$build/padmoe_bandwidth"
    cat "$out/bandwidth.log"
  fi
  bops=(); [ -n "${PADMOE_BENCH_OPS:-}" ] && bops=(--ops "$PADMOE_BENCH_OPS")
  for p in ${PADMOE_BENCH_PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3 decode}; do
    step "bench $p"
    if late; then echo "bench $p: SKIPPED (past the deadline)"; status=1; continue; fi
    bounded "$build/padmoe" bench --device cuda --preset "$p" --no-reference --json "${bops[@]}" > "$out/bench-$p.json" 2> "$out/bench-$p.err" || status=1
    ops_table "$out/bench-$p.json" --head | tee "$out/bench-$p.txt"
  done
fi
if want profile; then
  sections=(--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
            --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters)
  for spec in ${PADMOE_PROFILE_SPECS:-decode:make_plan deepseek-v3:make_plan decode:dispatch(w) deepseek-v3:dispatch(w) decode:combine_backward(w)}; do
    p=${spec%%:*}; o=${spec#*:}; tag=$(echo "$p-$o" | tr -c 'a-zA-Z0-9\n-' _)
    # The bench's L2 flush is a wgrad (reduce_token_kernel): the default regex leaves it out (reduce_kernel,
    # not reduce_), so that the flushes do not use up the launch count (profiling wgrad or the weighted
    # backward ops: PADMOE_PROFILE_KERNELS with reduce_token_|dots_, and PADMOE_PROFILE_SKIP=N to skip the flushes
    # before the op).
    run "profile-$tag" ncu --clock-control none ${PADMOE_NCU_ARGS:-} "${sections[@]}" -f -o "$out/profile-$tag" \
      --kernel-name regex:"${PADMOE_PROFILE_KERNELS:-plan_|spread_|reduce_kernel|gather_|pad_|fill_|invert_|map_|layout_|quant_|chunk_|sorted_}" \
      --launch-skip "${PADMOE_PROFILE_SKIP:-0}" --launch-count 12 \
      "$build/padmoe" bench --device cuda --preset "$p" --ops "$o" --warmup 0 --iters 1 --no-reference --no-graph
    # the details page into the log, and the source page (per-line stalls, CUDA source beside SASS) as CSV
    ncu --import "$out/profile-$tag.ncu-rep" --page details >> "$out/profile-$tag.log" 2>&1
    ncu --import "$out/profile-$tag.ncu-rep" --page source --csv --print-source cuda,sass \
      > "$out/profile-source-$tag.csv" 2>&1 || echo "profile-$tag: no source page (see the csv)"
    python3 bench/ncu_source_top.py "$out/profile-source-$tag.csv" 25 > "$out/profile-top-$tag.txt" 2>&1
    head -n 12 "$out/profile-top-$tag.txt"
    grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Memory Throughput|DRAM Throughput|Block Size|Grid Size|Waves Per SM|Warp Cycles Per Issued|Issued Ipc|No Eligible|Theoretical Occ" \
      "$out/profile-$tag.log" | head -n 80
  done
fi
if want ab; then
  # Variants against each other in one run (each a kernel choice forced by `padmoe bench --variant`;
  # `padmoe bench --variant help` lists the keys): PADMOE_AB="NAME=KEY=VALUE[,KEY=VALUE]@PRESET@OPS ..."
  # (OPS comma-separated, or all; KEY=auto for the policy's choice, the baseline).
  for spec in ${PADMOE_AB:-}; do
    name=${spec%%@*}; rest=${spec#*@}; preset=${rest%%@*}; ops=${rest#*@}
    variants=${name#*=}; tag=${name%%=*}
    oparg=(); [ "$ops" != all ] && oparg=(--ops "$ops")
    step "ab $tag ($variants) $preset"
    if late; then echo "ab $tag: SKIPPED (past the deadline)"; status=1; continue; fi
    bounded "$build/padmoe" bench --device cuda --preset "$preset" --no-reference --json --variant "$variants" \
      "${oparg[@]}" > "$out/ab-$tag-$preset.json" 2> "$out/ab-$tag-$preset.err" || { status=1; tail -n 5 "$out/ab-$tag-$preset.err"; }
    ops_table "$out/ab-$tag-$preset.json"
  done
fi
pyt=${PADMOE_GPU_PYTARGET:-/tmp/padmoe-pyt}
if want python || want triton || want ep; then
  # The machine's own python3 with its torch / nanobind / scikit-build-core and
  # no network: an unisolated pip build into a target directory (a virtualenv
  # there does not see the system's torch), then PYTHONPATH.
  # The build tree outside the working tree: a build/ left in a copied working tree from an earlier run
  # (its objects newer than the sources copied in) once linked stale objects into the extension.
  run python-build env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" python3 -m pip install -v --no-build-isolation --no-deps \
    --break-system-packages --upgrade --target "$pyt" -C build-dir="${PADMOE_GPU_SKBUILD:-/tmp/padmoe-skbuild}" .
fi
if want triton; then
  if ! want python; then  # the python stage's pytest runs test_triton.py natively too
    run triton-tests env PYTHONPATH="$pyt" python3 -m pytest python/tests/test_triton.py -q -rs
    tail -n 3 "$out/triton-tests.log" 2>/dev/null
  fi
  sweep=()
  [ "${PADMOE_TRITON_SWEEP:-0}" = "1" ] && sweep=(--sweep)
  run triton-bench env PYTHONPATH="$pyt" PYTHONUNBUFFERED=1 python3 bench/bench_triton.py "${sweep[@]}" \
    --out-md "$out/triton-bench.md" --out-json "$out/triton-bench.json" ${PADMOE_TRITONBENCH_ARGS:-}
  cat "$out/triton-bench.log"
fi
if want python; then
  # PADMOE_PYTEST_ARGS: what pytest runs (default the whole python/tests, which takes longer than the
  # default 540 s deadline on CUDA; e.g. "python/tests/test_torch_ops.py -k sort_chunks")
  run pytest-cuda env PYTHONPATH="$pyt" python3 -m pytest ${PADMOE_PYTEST_ARGS:-python/tests} -q -rs
  tail -n 5 "$out/pytest-cuda.log" 2>/dev/null
  # padmoe.torch as users see it: per op the kernels' GPU time (profiler), one eager call with the
  # host included, and CUDA-graph replay; the MoE block with grouped_mm experts.
  if [ "${PADMOE_TORCH_BENCH:-1}" = "1" ]; then
    run torch-bench env PYTHONPATH="$pyt" PYTHONUNBUFFERED=1 python3 bench/bench_torch.py --moe \
      --out-md "$out/torch-bench.md" --out-json "$out/torch-bench.json" ${PADMOE_TORCHBENCH_ARGS:-}
    cat "$out/torch-bench.log"
  fi
  # the per-op cold-L2 GPU figure beside padmoe.reference (bench_python.py) only when asked: PADMOE_PYBENCH=1
  if [ "${PADMOE_PYBENCH:-0}" = "1" ]; then
    png=()
    python3 -c "import matplotlib" 2>/dev/null && png=(--out-png "$out/python-bench.png")
    run python-bench env PYTHONPATH="$pyt" python3 bench/bench_python.py --device cuda --out-md "$out/python-bench.md" \
      --out-json "$out/python-bench.json" "${png[@]}" ${PADMOE_PYBENCH_ARGS:-}
    cat "$out/python-bench.md" 2>/dev/null
  fi
  # The shared benchmark harness, when a copy of it is in .ubench (it is not part of the repository):
  # single eager calls with the host included, CUDA-graph replay, beside PyTorch eager.
  if [ -f .ubench/user_bench.py ] && [ "${PADMOE_USER_BENCH:-1}" = "1" ]; then
    run user-bench env PYTHONPATH="$pyt" OUT="$out" PYTHONUNBUFFERED=1 python3 .ubench/user_bench.py --graphs
    cat "$out/user-bench.log"
    run host-overhead env PYTHONPATH="$pyt" python3 .ubench/host_overhead.py
    cat "$out/host-overhead.log"
  fi
fi
if want ep; then
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  # The tests on every GPU count present (a group of one on a single GPU: the NCCL path and the
  # sync-free mode's CUDA-graph capture; the tests of more ranks than GPUs skip themselves).
  run ep-tests env PYTHONPATH="$pyt" PADMOE_EP_BACKEND=nccl python3 -m pytest python/tests/test_distributed.py -q -rs
  tail -n 3 "$out/ep-tests.log" 2>/dev/null
  # every multi-rank test with CUDA tensors over gloo (2 and 4 ranks sharing the GPUs present): padmoe's
  # CUDA kernels on each rank, the rows through host memory
  run ep-tests-gloo-cuda env PYTHONPATH="$pyt" PADMOE_EP_BACKEND=gloo PADMOE_EP_DEVICE=cuda \
    python3 -m pytest python/tests/test_distributed.py -q -rs
  tail -n 3 "$out/ep-tests-gloo-cuda.log" 2>/dev/null
  if [ "$gpus" -lt 2 ]; then
    step ep-bench; echo "ep-bench: skipped ($gpus GPU: the exchange between GPUs needs 2 or more)"
  else
    for r in 2 4 8; do
      [ "$r" -le "$gpus" ] || continue
      run "ep-bench-$r" env PYTHONPATH="$pyt" python3 bench/bench_ep.py --ranks "$r" --backend nccl \
        --out-md "$out/ep-bench.md" ${PADMOE_EPBENCH_ARGS:-}
      cat "$out/ep-bench-$r.log"
    done
  fi
fi
step summary
if [ $status = 0 ]; then echo "GPU job: all steps ok"; else echo "GPU job: some step FAILED (logs in $out)"; fi
exit $status  # the trap packs the logs
