"""Every Python block of README.md runs as written (on the CPU), and the README keeps its promises
of shape: the quick start's two commands, at most about 200 lines, links that resolve."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, re.S | re.M)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3, "the README's quick starts (PyTorch, numpy) and the transformers example"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(index):
    source = BLOCKS[index]
    if "import torch" in source:
        pytest.importorskip("torch")
    if "transformers" in source:
        pytest.importorskip("transformers")
    namespace = {"__name__": f"readme_block_{index}"}
    exec(compile(source, f"README.md python block {index}", "exec"), namespace)  # its own asserts check it


def test_quick_start_is_the_two_commands():
    block = re.search(r"## Quick start\n.*?```bash\n(.*?)```", TEXT, re.S)
    assert block, "README.md has a Quick start with a bash block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["bash scripts/run.sh", "bash scripts/test.sh"]
    for script in ("scripts/run.sh", "scripts/test.sh"):
        assert (ROOT / script).is_file()


def test_short_and_links_resolve():
    assert len(TEXT.splitlines()) <= 210
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", TEXT):
        if target.startswith(("http://", "https://")):
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_cpp_block_compiles(tmp_path):
    """The C++ example compiles against the headers as written, inside a function that declares
    what its comment says the caller has (device pointers, sizes)."""
    import shutil
    import subprocess

    cxx = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cxx is None:
        pytest.skip("no C++ compiler")
    block = re.search(r"^```cpp\n(.*?)^```", TEXT, re.S | re.M)
    assert block, "README.md has a C++ example"
    lines = block.group(1).splitlines()
    includes = [line for line in lines if line.startswith("#include")]
    body = [line for line in lines if not line.startswith("#include")]
    src = tmp_path / "readme_example.cpp"
    src.write_text(
        "\n".join(includes)
        + "\nvoid readme_example(void* top_ids, void* probs, void* hidden, int64_t T, int64_t K, int64_t H, int E) {\n"
        + "\n".join(body)
        + "\n  (void)out;\n}\n"
    )
    done = subprocess.run(
        [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-I", str(ROOT / "include"), str(src)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
