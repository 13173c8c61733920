"""bench/results_table.py: the tables of bench/results/ from `padmoe bench --json` files.

The files below are written by hand in the schema tools/cli/bench.cpp prints (--device cuda with
the graph columns; the CPU's memcpy floor), with round values so that the expected cells are exact.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "results_table.py"


def workload(label, tokens, experts, top_k, hidden, alignment, padded_rows, device):
    return {
        "label": label,
        "tokens": tokens,
        "experts": experts,
        "top_k": top_k,
        "hidden": hidden,
        "alignment": alignment,
        "assignments": tokens * top_k,
        "padded_rows": padded_rows,
        "capacity": tokens * top_k + experts * (alignment - 1),
        "dtype": "bfloat16",
        "device": device,
        "seed": 0,
    }


def cuda_op(name, us, graph_us, in_graph_us, floor_us, error=None):
    """One entry of "ops" as `padmoe bench --device cuda --json` writes it."""
    return {
        "name": name,
        "us": us,
        "gbps": 1.0,
        "tbps": 0.001,
        "min_bytes": 1000,
        "floor_us": floor_us,
        "time_over_floor": us / floor_us,
        "pct_memcpy": None,
        "pct_copy": 90.0,
        "reference_us": None,
        "graph_us": graph_us,
        "graph_over_floor": graph_us / floor_us,
        "graph_nodes": 1,
        "in_graph_us": in_graph_us,
        "in_graph_over_floor": in_graph_us / floor_us,
        "graph_error": None,
        "error": error,
    }


def cuda_run(label, ops, **sizes):
    return {
        "command": "bench",
        "date": "2026-12-04 06:56:30 UTC",
        "device": "cuda:0",
        "card": "NVIDIA H200",
        "workload": workload(label, device="cuda:0", **sizes),
        "variant": "",
        "timing": "CUDA events around each call on one stream; cold L2",
        "cold_l2": True,
        "l2_flush_bytes": 268435456,
        "check_data": False,
        "workspace_bytes": 25856,
        "warmup": 5,
        "iters": 50,
        "floor": "padmoe::copy device->device",
        "copy_bytes": 1073741824,
        "copy_reps": 10,
        "copy_gbps": 4282.22,
        "copy_tbps": 4.28222,
        "memcpy_gbps": None,
        "graph_timing": "each op captured once into a CUDA graph",
        "graph_replays": 10,
        "ops": ops,
    }


@pytest.fixture
def cuda_files(tmp_path):
    """deepseek-v3 first and decode second on the command line; decode lacks sort_chunks."""
    deepseek = cuda_run(
        "deepseek-v3",
        [
            cuda_op("make_plan", 14.1, 10.7, 9.7, 0.5),
            cuda_op("dispatch", 637.25, 637.8, 636.2, 550.0),
            cuda_op("sort_chunks", 938.1, 939.6, 937.7, 884.625),
        ],
        tokens=16384,
        experts=256,
        top_k=8,
        hidden=7168,
        alignment=128,
        padded_rows=147200,
    )
    decode = cuda_run(
        "decode",
        [
            cuda_op("make_plan", 8.72, 4.9984, 3.8768, 0.0141086),
            cuda_op("dispatch", 19.1, 18.4, 17.0, 14.65),
        ],
        tokens=256,
        experts=256,
        top_k=8,
        hidden=7168,
        alignment=16,
        padded_rows=4128,
    )
    paths = []
    for name, data in (("bench-deepseek-v3.json", deepseek), ("bench-decode.json", decode)):
        path = tmp_path / name
        path.write_text(json.dumps(data))
        paths.append(str(path))
    return paths


def run(*args):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False)
    return done.returncode, done.stdout, done.stderr


def test_cuda_table_rows(cuda_files):
    rc, out, err = run(*cuda_files)
    assert rc == 0, err
    assert out.splitlines() == [
        "| op: eager / graph / in-graph µs (in-graph × floor) | decode | deepseek-v3 |",
        "| --- | ---: | ---: |",
        "| make_plan | 8.7 / 5.0 / 3.9 (274.78x) | 14.1 / 10.7 / 9.7 (19.40x) |",
        "| dispatch | 19.1 / 18.4 / 17.0 (1.16x) | 637.2 / 637.8 / 636.2 (1.16x) |",
        "| sort_chunks | - | 938.1 / 939.6 / 937.7 (1.06x) |",
    ]


def test_ops_filter_and_unknown_op(cuda_files):
    rc, out, _ = run("--ops", "sort_chunks,dispatch", *cuda_files)
    assert rc == 0
    assert [line.split(" | ")[0] for line in out.splitlines()[2:]] == ["| dispatch", "| sort_chunks"]
    rc, _, err = run("--ops", "no_such_op", *cuda_files)
    assert rc != 0 and "no_such_op" in err


def test_failed_op_and_no_graph(tmp_path):
    data = cuda_run(
        "mixtral-8x7b",
        [
            cuda_op("dispatch", 107.1, 108.2, 106.9, 94.5, error="out of memory"),
            {
                "name": "combine(w)",
                "us": 96.8,
                "gbps": 4160.0,
                "tbps": 4.16,
                "min_bytes": 402653184,
                "floor_us": 94.0,
                "time_over_floor": 1.0298,
                "pct_memcpy": None,
                "pct_copy": 97.1,
                "reference_us": None,
                "error": None,
            },  # a --no-graph entry: no graph keys at all
        ],
        tokens=16384,
        experts=8,
        top_k=2,
        hidden=4096,
        alignment=128,
        padded_rows=33152,
    )
    path = tmp_path / "bench-mixtral-8x7b.json"
    path.write_text(json.dumps(data))
    rc, out, err = run(str(path))
    assert rc == 0, err
    assert out.splitlines()[2:] == ["| dispatch | error |", "| combine(w) | 96.8 (1.03x) |"]


def test_cpu_table(tmp_path):
    data = {
        "command": "bench",
        "date": "2026-11-30 16:08:57 UTC",
        "device": "cpu",
        "card": None,
        "workload": workload("deepseek-v3", 2048, 256, 8, 7168, 128, 32768, "cpu"),
        "variant": "",
        "timing": "steady_clock wall time",
        "threads": 2,
        "hardware_threads": 2,
        "warmup": 2,
        "iters": 10,
        "floor": "memcpy",
        "memcpy_gbps": 42.6,
        "copy_gbps": 51.1,
        "copy_tbps": 0.0511,
        "ops": [
            {
                "name": "padded_gather",
                "us": 11155.0,
                "gbps": 44.7,
                "tbps": 0.0447,
                "min_bytes": 498900000,
                "floor_us": 11711.2,
                "time_over_floor": 0.95,
                "pct_memcpy": 104.986,
                "pct_copy": 87.5,
                "reference_us": 5039654,
                "error": None,
            },
            {
                "name": "combine(w)",
                "us": 10114.04,
                "gbps": 26.1,
                "tbps": 0.0261,
                "min_bytes": 264120000,
                "floor_us": 6200.0,
                "time_over_floor": 1.63,
                "pct_memcpy": 61.3,
                "pct_copy": 51.1,
                "reference_us": 213789,
                "error": None,
            },
        ],
    }
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    rc, out, err = run(str(path))
    assert rc == 0, err
    assert out.splitlines() == [
        "| op: µs (% of memcpy) | deepseek-v3 |",
        "| --- | ---: |",
        "| padded_gather | 11155.0 (105.0%) |",
        "| combine(w) | 10114.0 (61.3%) |",
    ]


def test_not_a_bench_file(tmp_path):
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"command": "check", "ops": []}))
    rc, _, err = run(str(path))
    assert rc != 0 and "not a `padmoe bench --json` file" in err
