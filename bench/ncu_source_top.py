#!/usr/bin/env python3
"""The source lines where a kernel's warps stall, from ncu's source page as CSV.

Usage: bench/ncu_source_top.py PROFILE-SOURCE.csv [N]
The CSV is what scripts/gpu.sh's profile stage writes (`ncu --import R.ncu-rep --page source --csv
--print-source cuda,sass`): per file a header, then CUDA source lines each followed by their SASS.
Prints the N source lines with the most warp-stall samples (their share of all samples, the line,
and its three largest stall reasons). With short kernels pass `--warp-sampling-interval 0` to ncu
(gpu.sh: PADMOE_NCU_ARGS), or there are too few samples to rank lines.
"""

import csv
import sys


def main(path: str, n: int) -> None:
    rows = list(csv.reader(open(path)))
    header, current, lines, total = None, "?", [], 0.0
    for r in rows:
        if not r:
            continue
        if r[0] == "File Path":
            current = r[1].split("/")[-1]
            continue
        if r[0] == "Function Name":
            continue
        if r[0] == "Line No":
            header = r
            continue
        if header is None or not r[0].strip().isdigit():
            continue  # SASS rows (no line number) and separators
        col = header.index("Warp Stall Sampling (All Samples)")
        try:
            samples = float(r[col])
        except (ValueError, IndexError):
            samples = 0.0
        stalls = []
        for i, h in enumerate(header):
            if h.startswith("stall_") and "(Not Issued)" not in h and i < len(r):
                try:
                    stalls.append((float(r[i]), h[len("stall_") :]))
                except ValueError:
                    pass
        stalls.sort(reverse=True)
        lines.append((samples, current, int(r[0]), r[1].strip()[:90], [(k, int(v)) for v, k in stalls[:3] if v > 0]))
        total += samples
    lines.sort(key=lambda x: -x[0])
    print(f"{path}: {total:.0f} samples")
    for s, f, ln, src, top in lines[:n]:
        share = 100 * s / total if total else 0.0
        print(f"{s:7.0f} {share:5.1f}% {f}:{ln}: {src}   {top}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
