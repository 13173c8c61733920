"""The CUDA sources keep the rule programmatic dependent launch relies on (docs/design.md).

Every kernel is launched with programmatic stream serialization on sm_90 (launch_kernel), so the
next kernel may start before this one ends; that is safe only because every kernel begins with
pdl_begin() or pdl_wait() (griddepcontrol.wait) before its first memory access. A kernel added
without it, or a launch with <<<...>>> that skips launch_kernel, is caught here on the CPU
(nothing runs the GPU code in CI).
"""

import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "cuda"


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def kernel_bodies(text: str):
    """(name, first statement) of each __global__ function."""
    for m in re.finditer(r"__global__", text):
        i = m.end()
        depth, j = 0, i
        # the parameter list: the first '(' after the name (skipping __launch_bounds__(...))
        lb = re.match(r"\s*void\s+__launch_bounds__\s*\(", text[i:])
        if lb:
            j = i + lb.end() - 1
            while True:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
                if depth == 0:
                    break
        name = re.match(r"[\s\w]*?(\w+)\s*\(", text[j:]).group(1)
        p = text.index("(", j)
        depth = 0
        while True:
            depth += {"(": 1, ")": -1}.get(text[p], 0)
            p += 1
            if depth == 0:
                break
        body = text.index("{", p)
        yield name, text[body + 1 :].lstrip().split(";", 1)[0]


def test_every_kernel_waits_for_its_predecessor_first():
    files = sorted(SRC.glob("*.cu*"))
    assert files, SRC
    kernels = 0
    for f in files:
        for name, first in kernel_bodies(strip_comments(f.read_text())):
            kernels += 1
            # pdl_begin(L2Rows): L2 prefetches (no value reaches the SM), then pdl_begin(); its
            # argument may call only the helpers that form the rows from the kernel's parameters
            ok = first in ("pdl_begin()", "pdl_wait()")
            if not ok and first.startswith("pdl_begin("):
                calls = set(re.findall(r"(\w+)\s*(?:<[^<>()]*>)?\s*\(", first[len("pdl_begin(") :]))
                ok = calls <= {"l2_share"}
            assert ok, f"{f.name}: kernel {name} starts with {first!r}"
    assert kernels >= 30  # the backend has at least 30 kernels: the parser found them


def test_no_launch_skips_launch_kernel():
    for f in sorted(SRC.glob("*.cu*")):
        text = strip_comments(f.read_text())
        assert "<<<" not in text, f"{f.name}: a <<<...>>> launch (use launch_kernel)"
