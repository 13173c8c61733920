#!/usr/bin/env bash
# A/B of two trees on a GPU machine, from the repository root (the new tree): every op's output bits
# and every op's time, old against new, in one run. Not part of the library build.
#   git archive -o .ab/old.tar <old commit>     (on a machine with the repository's history)
#   bash dev/ab.sh                              (on the GPU machine, with .ab/ copied beside the tree)
# 1. builds the library + CLI of the old tree (AB_OLD_TAR, default .ab/old.tar) and of this tree
#    (CUDA, sm_90, Release, -j$(nproc));
# 2. builds dev/digest.cpp (public API only) against each and runs both (CPU and CUDA backends,
#    every workload), then diffs: every differing line is listed; dot-product outputs (grad_weights,
#    wgrad, grad_probs) that differ are listed separately with their max abs diff;
# 3. runs `padmoe bench --device cuda --preset P --json --no-reference` for the four presets, old and
#    new interleaved, and prints op x preset: old us, new us, ratio for the event, graph and
#    in-graph columns.
# Output under ${AB_OUT:-.ab/out}. AB_PRESETS: the presets; AB_BENCH_ARGS: more bench flags (e.g.
# --iters 20 to shorten the run). AB_CPU_ONLY=1: a CPU-only build, the CPU digests, no bench (a check
# of the script itself on a machine without a GPU); AB_DIGEST_ARGS: more digest flags (--small);
# AB_OLD_CXXFLAGS: more flags for the old tree's digest build, e.g. -D macros that map the names
# digest.cpp uses to the ones an older tree spelled differently
# (-Dpadded_rows_bound=capacity_bound -Dsort_chunks_rows_bound=sort_chunks_capacity).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${AB_OUT:-$root/.ab/out}
work=${AB_WORK:-/tmp/padmoe-ab}
jobs=${AB_JOBS:-$(nproc)}
presets=${AB_PRESETS:-"decode mixtral-8x7b qwen3-30b-a3b deepseek-v3"}
mkdir -p "$out" "$work"
start=$SECONDS
stamp() { echo "[$((SECONDS - start)) s] $*"; }

gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cuda_lib=${CUDA_HOME:-/usr/local/cuda}/lib64
cpu_only=${AB_CPU_ONLY:-0}
cuda_flags=(-DPADMOE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90); link_cuda=(-L"$cuda_lib" -lcudart_static)
digest_args=(${AB_DIGEST_ARGS:-})
if [ "$cpu_only" = 1 ]; then cuda_flags=(-DPADMOE_CUDA=OFF); link_cuda=(); digest_args+=(--device cpu); fi

build_tree() {  # $1 source dir, $2 build dir
  cmake -S "$1" -B "$2" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${cuda_flags[@]}" \
    -DPADMOE_BUILD_TESTS=OFF -DPADMOE_BUILD_CLI=ON -DPADMOE_BUILD_PYTHON=OFF -DPADMOE_BUILD_TORCH=OFF > "$2.cmake.log" 2>&1 &&
  cmake --build "$2" -j "$jobs" --target padmoe padmoe_cli > "$2.build.log" 2>&1
}

stamp "unpacking the old tree"
rm -rf "$work/old-src" && mkdir -p "$work/old-src" && tar -xf "${AB_OLD_TAR:-$root/.ab/old.tar}" -C "$work/old-src" || exit 1
stamp "building old and new (library + CLI, -j$jobs each, in parallel)"
build_tree "$work/old-src" "$work/old-build" & p_old=$!
build_tree "$root" "$work/new-build" & p_new=$!
wait $p_old || { echo "old build failed: $work/old-build.build.log"; tail -n 30 "$work/old-build.build.log"; exit 1; }
wait $p_new || { echo "new build failed: $work/new-build.build.log"; tail -n 30 "$work/new-build.build.log"; exit 1; }

for v in old new; do
  src=$root; [ $v = old ] && src=$work/old-src
  lib=$(find "$work/$v-build" -maxdepth 1 -name 'libpadmoe.a' | head -n 1)
  extra=(); [ $v = old ] && extra=(${AB_OLD_CXXFLAGS:-})
  g++ -std=c++17 -O2 "${extra[@]}" -I "$src/include" "$root/dev/digest.cpp" "$lib" "${link_cuda[@]}" -lpthread -ldl -lrt \
    -o "$work/digest-$v" || { echo "digest build ($v) failed"; exit 1; }
done
stamp "digests (CPU and CUDA backends)"
rm -rf "$work/dump-old" "$work/dump-new" && mkdir -p "$work/dump-old" "$work/dump-new"
"$work/digest-old" "${digest_args[@]}" --dump "$work/dump-old" > "$out/digest-old.txt" 2> "$out/digest-old.err" & d_old=$!
"$work/digest-new" "${digest_args[@]}" --dump "$work/dump-new" > "$out/digest-new.txt" 2> "$out/digest-new.err"
wait $d_old
stamp "digest lines: old $(wc -l < "$out/digest-old.txt"), new $(wc -l < "$out/digest-new.txt")"
python3 - "$out/digest-old.txt" "$out/digest-new.txt" "$work/dump-old" "$work/dump-new" <<'PY' | tee "$out/digest-diff.txt"
import os, struct, sys
old, new, dold, dnew = sys.argv[1:5]
def load(p):
    d = {}
    for line in open(p):
        f = line.split()
        if len(f) < 4: continue
        d[tuple(f[:4]) if f[3] != "ERROR" else tuple(f[:3]) + ("ERROR",)] = line.rstrip("\n")
    return d
a, b = load(old), load(new)
dots = ("grad_weights", "wgrad", "grad_probs")
bits, dot_diffs, missing = [], [], []
for k in sorted(set(a) | set(b)):
    if k not in a or k not in b:
        missing.append((k, a.get(k), b.get(k)))
        continue
    if a[k] == b[k]: continue
    if k[3] in dots:
        name = ".".join(k) + ".bin"
        try:
            x = open(os.path.join(dold, name), "rb").read(); y = open(os.path.join(dnew, name), "rb").read()
            fx = struct.unpack("%df" % (len(x) // 4), x); fy = struct.unpack("%df" % (len(y) // 4), y)
            md = max((abs(p - q) for p, q in zip(fx, fy)), default=0.0)
            mx = max((abs(p) for p in fx), default=0.0)
            dot_diffs.append("%s  max abs diff %.3g (max |old| %.3g)" % (" ".join(k), md, mx))
        except OSError as e:
            dot_diffs.append("%s  (no dump: %s)" % (" ".join(k), e))
    else:
        bits.append("%s\n    old %s\n    new %s" % (" ".join(k), a[k], b[k]))
print("compared %d lines; %d differ bitwise (non-dot), %d dot outputs differ, %d present on one side only"
      % (len(set(a) & set(b)), len(bits), len(dot_diffs), len(missing)))
for l in bits: print("DIFF", l)
for l in dot_diffs: print("DOTS", l)
for k, x, y in missing: print("ONLY", " ".join(k), "| old:", x, "| new:", y)
PY

if [ "$cpu_only" = 1 ]; then stamp "done (CPU only: no bench): $out"; exit 0; fi
stamp "bench: ${presets} (old and new interleaved)"
for p in $presets; do
  for v in old new; do
    cli=$(find "$work/$v-build" -maxdepth 1 -name padmoe -type f | head -n 1)
    "$cli" bench --device cuda --preset "$p" --json --no-reference ${AB_BENCH_ARGS:-} > "$out/bench-$v-$p.json" 2> "$out/bench-$v-$p.err" ||
      { echo "bench $v $p failed:"; tail -n 5 "$out/bench-$v-$p.err"; }
  done
done
python3 - "$out" $presets <<'PY' | tee "$out/bench-table.txt"
import json, sys
out, presets = sys.argv[1], sys.argv[2:]
def load(v, p):
    try: return {o["op"] if "op" in o else o["name"]: o for o in json.load(open("%s/bench-%s-%s.json" % (out, v, p)))["ops"]}
    except Exception as e: return {}
cols = [("us", "event"), ("graph_us", "graph"), ("in_graph_us", "in-graph")]
for p in presets:
    a, b = load("old", p), load("new", p)
    print("\n== %s  (old us / new us / new/old)" % p)
    print("%-34s" % "op" + "".join("%26s" % c[1] for c in cols))
    ratios = {c[0]: [] for c in cols}
    for op in a:
        if op not in b: continue
        row = "%-34s" % op
        for key, _ in cols:
            x, y = a[op].get(key), b[op].get(key)
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x > 0:
                row += "%26s" % ("%.1f / %.1f / %.3f" % (x, y, y / x)); ratios[key].append(y / x)
            else:
                row += "%26s" % "-"
        print(row)
    for key, name in cols:
        r = ratios[key]
        if r:
            import math
            g = math.exp(sum(math.log(v) for v in r) / len(r))
            print("  %s: geometric mean new/old %.3f, min %.3f, max %.3f over %d ops" % (name, g, min(r), max(r), len(r)))
PY
stamp "done: $out"
