#!/usr/bin/env python3
"""Render `padmoe bench --device cuda --json` files (one per preset) into a markdown table.

Usage: bench/render_cuda_results.py DIR > table.md   (DIR holds bench-<preset>.json)
A second table gives the CUDA-graph replay column (graph_us, warm L2) when the files have it, a third
the in-graph column (in_graph_us: 20 calls captured in one graph, per call).
"""
import json
import pathlib
import sys

PRESETS = ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "decode"]


def table(data, first, heads, cells) -> None:
    """One markdown table: a row per op of `first`, the columns `heads` per preset from cells(op)."""
    print("| op | " + " | ".join(" | ".join(f"{p} {h}" if i == 0 else h for i, h in enumerate(heads))
                                 for p in PRESETS) + " |")
    print("|---|" + "---:|" * len(heads) * len(PRESETS))
    for op in first["ops"]:
        row = [op["name"]]
        for p in PRESETS:
            row += cells(next(x for x in data[p]["ops"] if x["name"] == op["name"]))
        print("| " + " | ".join(row) + " |")
    print()


def main(folder: str) -> None:
    data = {p: json.loads((pathlib.Path(folder) / f"bench-{p}.json").read_text()) for p in PRESETS}
    first = data["deepseek-v3"]
    print(f"Card: {first['card']}. Method: {first['timing']}; {first['iters']} timed runs after "
          f"{first['warmup']} warm-up runs, median. Copy bandwidth measured: "
          + ", ".join(f"{p} {data[p]['copy_tbps']:.2f} TB/s" for p in PRESETS) + ".\n")
    table(data, first, ["µs", "TB/s", "×floor"], lambda o: [f"{o['us']:.1f}", f"{o['tbps']:.2f}", f"{o['time_over_floor']:.2f}"])
    if all(o.get("graph_us") is not None for p in PRESETS for o in data[p]["ops"]):
        print("Replayed from a CUDA graph (" + first.get("graph_timing", "graph replay") + "):\n")
        table(data, first, ["graph µs", "×floor"], lambda o: [f"{o['graph_us']:.1f}", f"{o['graph_over_floor']:.2f}"])
    if all(o.get("in_graph_us") is not None for p in PRESETS for o in data[p]["ops"]):
        print("20 calls captured in one graph, per call (the op inside a larger captured step):\n")
        table(data, first, ["in-graph µs", "×floor"],
              lambda o: [f"{o['in_graph_us']:.1f}", f"{o['in_graph_over_floor']:.2f}"])
    print("Workloads: " + "; ".join(
        f"{p}: T={data[p]['workload']['tokens']}, E={data[p]['workload']['experts']}, K={data[p]['workload']['top_k']}, "
        f"H={data[p]['workload']['hidden']}, alignment {data[p]['workload']['alignment']}, P={data[p]['workload']['padded_rows']}"
        for p in PRESETS) + ".")


if __name__ == "__main__":
    main(sys.argv[1])
