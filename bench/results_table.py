#!/usr/bin/env python3
"""Print the markdown table of bench/results/ from `padmoe bench --json` files.

    padmoe bench --device cuda --preset decode --no-reference --json > bench-decode.json   # one file a preset
    python bench/results_table.py bench-*.json                     # the table of bench/results/cuda.md
    python bench/results_table.py --ops make_plan,sort_chunks bench-*.json   # a few rows only

A row per op, a column per preset (the presets in the order of PRESETS, any others after them in
the order given). A CUDA file's cell is `eager / graph / in-graph` µs and the in-graph time over
the copy floor: `us` (one call, CUDA events, cold L2), `graph_us` (one captured call a graph
replay), `in_graph_us` (20 calls captured in one graph, per call) and `in_graph_over_floor`. A file
run with --no-graph gives `eager µs (eager × floor)`. A CPU file (`padmoe bench --json` without
--device cuda) gives `µs (% of memcpy)`. An op a preset lacks is `-`, an op that failed `error`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

PRESETS = ["decode", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"]


def load(paths: list[str]) -> list[tuple[str, dict]]:
    """(preset label, bench JSON) a file, in PRESETS order, then any other label in the order given."""
    runs = []
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        if data.get("command") != "bench" or "ops" not in data:
            raise SystemExit(f"{path}: not a `padmoe bench --json` file")
        runs.append((data["workload"]["label"], data))
    known = {p: i for i, p in enumerate(PRESETS)}
    return sorted(runs, key=lambda r: known.get(r[0], len(PRESETS)))


def cell(op: dict | None) -> str:
    """One op at one preset, as described in the module docstring."""
    if op is None:
        return "-"
    if op.get("error") is not None or op.get("us") is None:
        return "error"
    if op.get("in_graph_us") is not None and op.get("graph_us") is not None:
        return f"{op['us']:.1f} / {op['graph_us']:.1f} / {op['in_graph_us']:.1f} ({op['in_graph_over_floor']:.2f}x)"
    if op.get("pct_memcpy") is not None:
        return f"{op['us']:.1f} ({op['pct_memcpy']:.1f}%)"
    return f"{op['us']:.1f} ({op['time_over_floor']:.2f}x)"


def table(runs: list[tuple[str, dict]], ops: list[str] | None = None) -> str:
    """The markdown table: a row per op (the first file's order, then ops only later files have)."""
    names: list[str] = []
    for _, data in runs:
        names += [o["name"] for o in data["ops"] if o["name"] not in names]
    if ops is not None:
        missing = [o for o in ops if o not in names]
        if missing:
            raise SystemExit(f"no such op in the files: {', '.join(missing)}")
        names = [n for n in names if n in ops]
    on_gpu = any(data.get("device", "cpu") != "cpu" for _, data in runs)
    if on_gpu:
        head = "op: eager / graph / in-graph µs (in-graph × floor)"
    else:
        head = "op: µs (% of memcpy)"
    lines = ["| " + " | ".join([head] + [label for label, _ in runs]) + " |", "| --- |" + " ---: |" * len(runs)]
    for name in names:
        cells = [cell(next((o for o in data["ops"] if o["name"] == name), None)) for _, data in runs]
        lines.append("| " + " | ".join([name] + cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="`padmoe bench --json` output, one file a preset")
    parser.add_argument("--ops", help="comma-separated op names: those rows only")
    args = parser.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",")] if args.ops else None
    sys.stdout.write(table(load(args.files), ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
