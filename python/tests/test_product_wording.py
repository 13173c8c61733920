"""The repository speaks in product terms: it is the product.

Comments, docstrings, docs and results pages state a rule and its reason. They do not name the
development process that produced them: no numbered or ordinal-named runs ("call 3", "the twelfth
session", a results file named after one), no internal issue or item numbers ("issue 11, item 2"),
no "the seed" for padmoe's starting design notes (name the design itself: "the Ascend design",
"MegaBlocks' padded gather"), nothing about the remote runner the GPU jobs went through ($OUT, "the
device tool", "a 10-minute device call") or the development machine, and no dated history notes in
code ("since 2026-12-04", "added 2026-12-03"): history lives in CHANGELOG.md, which is not scanned.
Results pages may still carry the date, commit, GPU model and command of a measurement.

Every text file git tracks (or would track: new files not yet added) under the product's folders is
read; a hit names file:line and the text.
The patterns are checked against good and bad samples first, so the scan is known to be able to fail.
"""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
THIS = pathlib.Path(__file__).resolve()

# what is scanned: these folders and top-level files (as git lists them)
FOLDERS = ("docs/", "src/", "include/", "python/", "tests/", "tools/", "scripts/", "dev/", "cmake/", "bench/", ".ci/")
TOP_FILES = ("README.md", "CONTRIBUTING.md", "CMakeLists.txt", "pyproject.toml")
# history is the changelog's job
EXCLUDED = ("CHANGELOG.md",)
# bench/results/ holds curated pages (scanned) and the raw output of the tools beside them (not
# scanned as text: machine output, kept as it was written; their file names are checked)
RESULTS = "bench/results/"

_CI = re.IGNORECASE
_ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    r"thirtieth|(?:twenty|thirty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth))"
)

# (what it catches, pattern); matched against one line at a time
PATTERNS = [
    ("a numbered session", re.compile(r"\bsessions?\s*#?\d+|\bsession\d+", _CI)),
    ("an ordinal-named session", re.compile(r"\b" + _ORDINAL + r"\s+session\b", _CI)),
    (
        "a session of the development process",
        re.compile(r"\b(?:this|next|last|previous|earlier|later|same|that)\s+session\b|\bsession's\b", _CI),
    ),
    (
        "a numbered runner call",
        re.compile(
            r"\b(?:device\s+)?calls?\s*#\d+|\bcall\s+\d+\b(?![.,]\d)(?!\s*(?:µs|us|ms)\b)"
            r"|\bcall\d+\b|\bs\d+call\d+\b|\bs\d+c\d+\b",
            _CI,
        ),
    ),
    ("a results page named after a run", re.compile(r"\d{4}-\d\d-\d\d-" + _ORDINAL + r"\b", _CI)),
    ("an internal issue number", re.compile(r"\bissues?\s+#?\d+|\bissue\s+\"[^\"]+\"", _CI)),
    ("an internal item number", re.compile(r"\bitems?\s+#?\d+(?:\s*(?:-|,|and)\s*\d+)*\b", _CI)),
    (
        '"the seed" (name the design itself)',
        re.compile(
            r"\bthe\s+(?:first\s+)?seed(?:'s)?\b(?!\s+(?:of|for|value|argument|given|passed|=))"
            r"|\bseed's\b|\bseed\s+design",
            _CI,
        ),
    ),
    ("the remote runner's output folder", re.compile(r"\$OUT\b")),
    (
        "the remote runner",
        re.compile(
            r"(?<![-\w])device\s+(?:tool|machine)s?\b|(?<![-\w])device\s+call(?:'s)?\b"
            r"|\b\d+-minute\s+(?:device\s+)?call|\bcall's\s+deadline\b",
            _CI,
        ),
    ),
    (
        "the development machine",
        re.compile(
            r"\b(?:development|dev)\s+(?:machine|VM|box)\b|\bCPU\s+box\b|\b\d+-core\s+(?:CPU\s+)?"
            r"(?:development\s+)?(?:VM|box|machine)\b",
            _CI,
        ),
    ),
    ("a dated history note", re.compile(r"\b(?:since|before|until|added(?:\s+on)?)\s+20\d\d-\d\d-\d\d", _CI)),
]
# GitHub links name other projects' issues (github.com/NVIDIA/cutlass/issues/3346): a line with one
# is not read for issue numbers
_LINK = re.compile(r"github\.com/\S+")

# file names: a run number or an ordinal-named run in a tracked path
NAME_PATTERNS = [
    ("a numbered runner call", re.compile(r"(?:^|[/_.-])(?:s\d+)?call\d+(?=[/_.-]|$)", _CI)),
    ("a numbered session", re.compile(r"(?:^|[/_.-])session\d+(?=[/_.-]|$)", _CI)),
    ("an ordinal-named run", re.compile(r"\d{4}-\d\d-\d\d-" + _ORDINAL + r"(?=[/_.-]|$)", _CI)),
]

BAD = [
    "measured in the twenty-first session",
    "first run by the next session",
    "see session21",
    "s21call1-bench.json",
    "in call 3 of the day",
    "the fused dispatch (issue 11, item 2)",
    "issue 13's targets",
    "make_plan's options (items 3 and 4)",
    "Options::zero_padding (item 7)",
    'hardening (issue "Hardening")',
    "the seed's Ascend design",
    "The seed describes the kernels",
    "the seed design's verification list",
    "logs go to $OUT",
    "the device tool brings back a few files",
    "under one 10-minute device call",
    "past one call's deadline",
    "on the 2-core development VM",
    "(since 2026-12-04)",
    "as it was before 2026-12-01",
    "(added 2026-12-03)",
    "bench/results/cuda-h200-2026-12-04-twenty-first.md",
    "cuda-h200-2026-12-02-eleventh.md",
]
GOOD = [
    "call sites",
    "seed=0",
    "issue a warning",
    "GitHub issues/123 of vLLM",
    "the same seed gives the same routing",
    "--seed N: the seed of the router",
    "torch.manual_seed(0)",
    "a.item()",
    "for seed in (11, 12):",
    "see https://github.com/NVIDIA/cutlass/issues/3346",
    "the first call of each specialization",
    "one call of the backward operator",
    "16.2 µs a call",
    "a mixed-device call",
    "${OUT:-gpu-out}",
    "out=$out",
    "the kernel may issue it before its wait",
    "measured on an H200 on 2026-12-04",
    "bench/results/cuda-h200-2026-12-04.md",
    "the items of a batch",
    "work item 3 of the grid",
]
# "work item 3": a GPU work item, not an internal one
_WORK_ITEM = re.compile(r"\bwork\s+items?\s+\d", _CI)


def offences(line: str):
    """(what, text) for each pattern the line matches."""
    found = []
    for what, pat in PATTERNS:
        if what == "an internal issue number" and _LINK.search(line):
            continue
        if what == "an internal item number" and _WORK_ITEM.search(line):
            continue
        m = pat.search(line)
        if m:
            found.append((what, m.group(0)))
    return found


def name_offences(path: str):
    return [(what, m.group(0)) for what, pat in NAME_PATTERNS for m in [pat.search(path)] if m]


def tracked_files():
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the scan reads the tracked file list")
    try:
        # tracked files, and new ones not yet added (ignored files stay out)
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except subprocess.CalledProcessError:
        pytest.skip(f"{ROOT} is not a git checkout (e.g. an installed package): nothing to scan")
    names = sorted({n for n in out.decode("utf-8", "surrogateescape").split("\0") if n})
    if not names:
        pytest.skip("git lists no tracked files")
    return [
        n
        for n in names
        if (n in TOP_FILES or n.startswith(FOLDERS)) and n not in EXCLUDED and (ROOT / n).resolve() != THIS
    ]


def text_of(path: pathlib.Path):
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_patterns_catch_bad_wording_and_spare_product_text():
    for s in BAD:
        assert offences(s) or name_offences(s), f"not caught: {s!r}"
    for s in GOOD:
        assert not offences(s), f"flagged product text: {s!r}: {offences(s)}"
    assert name_offences("bench/results/h200-2026-12-01-dots/variants/call2-ab-d0-decode.json")
    assert name_offences("bench/results/cuda-h200-2026-12-03-fourteenth.md")
    assert not name_offences("bench/results/cuda-h200-2026-12-03.md")
    assert not name_offences("python/tests/test_calls.py")


def test_tracked_text_uses_product_wording():
    problems = []
    files = tracked_files()
    for name in files:
        if name.startswith(RESULTS) and not name.endswith(".md"):
            continue
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        text = text_of(path)
        if text is None:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            for what, hit in offences(line):
                problems.append(f"{name}:{no}: {what}: {hit!r} in {line.strip()[:160]!r}")
    assert len(files) > 100, files  # the scan found the tree
    if problems:
        pytest.fail(
            f"{len(problems)} lines name the development process, not the product:\n" + "\n".join(problems),
            pytrace=False,
        )


def test_tracked_file_names_carry_no_run_numbers():
    problems = [
        f"{name}: {what}: {hit!r}"
        for name in tracked_files()
        if (ROOT / name).exists()
        for what, hit in name_offences(name)
    ]
    if problems:
        pytest.fail("file names that number a run:\n" + "\n".join(problems), pytrace=False)
