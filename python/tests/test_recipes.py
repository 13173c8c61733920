"""Every Python block of docs/recipes.md runs as written; the blocks check their own results (against
float64 loops and exact layouts) with asserts.

The blocks of one ``##`` section form one script: a block runs after the blocks before it in its
section, in one namespace. A block whose first line is ``# needs: cuda`` is skipped without CUDA
(reported as skipped, not passed)."""

import pathlib
import re

import pytest

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "recipes.md"
TEXT = PAGE.read_text(encoding="utf-8")
NEEDS_CUDA = "# needs: cuda"


def _blocks():
    """(section title, source) of every ```python block, in page order."""
    found, section = [], ""
    for match in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```", TEXT, re.S | re.M):
        if match.group(1) is not None:
            section = match.group(1).strip()
        else:
            found.append((section, match.group(2)))
    return found


BLOCKS = _blocks()


def _needs_cuda(source):
    return source.lstrip().startswith(NEEDS_CUDA)


def test_the_page_has_its_sections_and_blocks():
    sections = [s for s, _ in BLOCKS]
    assert sections.count("Your own MoE layer") >= 2, "the layer with GroupedExperts, then with your own GEMMs"
    assert sections.count("vLLM-style inference") >= 3, "moe_align_block_size, the serving step, its CUDA graph"
    assert any(_needs_cuda(src) for _, src in BLOCKS), "the CUDA-graph block is marked"
    assert not any(NEEDS_CUDA in src and not _needs_cuda(src) for _, src in BLOCKS), "the mark is a first line"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(index):
    section, source = BLOCKS[index]
    if _needs_cuda(source) and not torch.cuda.is_available():
        pytest.skip("docs/recipes.md block needs CUDA")
    # the blocks before this one in its section (one script), then this one
    earlier = [i for i in range(index) if BLOCKS[i][0] == section]
    namespace = {"__name__": f"recipes_block_{index}"}
    for i in earlier + [index]:
        code = compile(BLOCKS[i][1], f"docs/recipes.md python block {i} ({section})", "exec")
        exec(code, namespace)  # noqa: S102 (the page's own code; its asserts check it)
