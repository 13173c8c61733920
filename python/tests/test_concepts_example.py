"""docs/concepts.md's worked example: the plan arrays written there are what padmoe.make_plan
returns, and what a plain loop over the definitions gives."""

import ast
import pathlib
import re

import numpy as np
import pytest

padmoe = pytest.importorskip("padmoe")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "concepts.md"
ARRAYS = (
    "indices",
    "bin_ids",
    "tokens_per_expert",
    "bins",
    "padded_tokens_per_expert",
    "padded_bins",
    "dest_rows",
    "row_sources",
)
NUM_EXPERTS = 4
ALIGNMENT = 4


def doc_example() -> dict:
    """The `name = value` lines of the worked example's ```text block."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## A worked example", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.DOTALL)
    assert block, "docs/concepts.md: the worked example's ```text block is missing"
    values = {}
    for line in block.group(1).splitlines():
        if line.strip():
            name, value = line.split("=", 1)
            values[name.strip()] = ast.literal_eval(value.strip())
    return values


def plain_plan(top_experts, num_experts, alignment) -> dict:
    """The plan from its definitions, with plain loops (no padmoe code)."""
    tokens, top_k = len(top_experts), len(top_experts[0])
    assignments = tokens * top_k
    expert_of = [top_experts[a // top_k][a % top_k] for a in range(assignments)]
    indices = [a for e in range(num_experts) for a in range(assignments) if expert_of[a] == e]
    bin_ids = [expert_of[a] for a in indices]
    counts = [expert_of.count(e) for e in range(num_experts)]
    padded = [-(-c // alignment) * alignment for c in counts]
    bins, padded_bins, total, padded_total = [], [], 0, 0
    for c, p in zip(counts, padded):
        total += c
        padded_total += p
        bins.append(total)
        padded_bins.append(padded_total)
    bound = assignments + num_experts * (alignment - 1)
    dest_rows = [0] * assignments
    row_sources = [-1] * bound
    for i, a in enumerate(indices):
        e = bin_ids[i]
        real_start = bins[e - 1] if e > 0 else 0
        padded_start = padded_bins[e - 1] if e > 0 else 0
        row = padded_start + (i - real_start)
        dest_rows[a] = row
        row_sources[row] = a
    return {
        "indices": indices,
        "bin_ids": bin_ids,
        "tokens_per_expert": counts,
        "bins": bins,
        "padded_tokens_per_expert": padded,
        "padded_bins": padded_bins,
        "dest_rows": dest_rows,
        "row_sources": row_sources,
        "P": padded_total,
        "padded_rows_bound": bound,
    }


def test_doc_lists_every_array():
    doc = doc_example()
    for name in ("top_experts", *ARRAYS, "P", "padded_rows_bound"):
        assert name in doc, f"docs/concepts.md: the worked example has no `{name} = ...` line"


def test_doc_matches_make_plan():
    doc = doc_example()
    plan = padmoe.make_plan(np.array(doc["top_experts"], dtype=np.int32), NUM_EXPERTS, ALIGNMENT)
    for name in ARRAYS:
        assert np.asarray(getattr(plan, name)).tolist() == doc[name], name
    assert plan.padded_rows() == doc["P"]
    assert plan.padded_rows_bound == doc["padded_rows_bound"]


def test_doc_matches_plain_loops():
    doc = doc_example()
    expected = plain_plan(doc["top_experts"], NUM_EXPERTS, ALIGNMENT)
    for name, value in expected.items():
        assert doc[name] == value, name


def test_dispatch_and_combine_follow_the_tables():
    doc = doc_example()
    top = np.array(doc["top_experts"], dtype=np.int32)
    plan = padmoe.make_plan(top, NUM_EXPERTS, ALIGNMENT)
    tokens, top_k = top.shape
    x = (np.arange(tokens, dtype=np.float32)[:, None] + 1) * np.ones((1, 4), np.float32)
    y = padmoe.dispatch(x, plan)
    assert y.shape[0] == doc["padded_rows_bound"]
    for row, a in enumerate(doc["row_sources"]):
        want = x[a // top_k] if a >= 0 else np.zeros(4, np.float32)
        assert y[row].tolist() == want.tolist(), row
    w = np.linspace(0.25, 0.75, tokens * top_k, dtype=np.float32).reshape(tokens, top_k)
    out = padmoe.combine(y, plan, w)
    for t in range(tokens):
        acc = np.float32(0)
        for k in range(top_k):
            acc = np.float32(acc + w[t, k] * y[doc["dest_rows"][t * top_k + k]][0])
        assert out[t].tolist() == [acc] * 4, t
