#!/usr/bin/env bash
# The README's install, checked (CI: .ci/run, after scripts/test.sh). From a fresh clone of this
# repository (HEAD), outside it:
#  1. `pip install .` exactly as the README says (pip's defaults, build isolation on) into the
#     virtualenv of scripts/pytest.sh, which has torch (padmoe is uninstalled from it first); then
#     `import padmoe.torch, padmoe.torch.distributed` from outside the source tree, the operators
#     built against that torch, and the ImportError that a torch other than the build's gets.
#     Skipped, with a warning, when scripts/pytest.sh left torch out for lack of disk;
#  2. `pip install .` into a new virtualenv without torch (CPU backend only, to save time): the
#     install works, `import padmoe` works, and the error names the command that builds the operators.
#   PADMOE_VENV=DIR         the virtualenv with torch (default .venv, made by scripts/pytest.sh)
#   PADMOE_PYTHON=EXE       interpreter that creates the virtualenv without torch (default python3)
#   PADMOE_INSTALL_SRC=DIR  install from a copy of DIR (without its build*/ and .venv/) instead of a
#                           clone of HEAD, e.g. to check uncommitted work
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=${PADMOE_VENV:-.venv}
bin=$(cd "$venv/bin" && pwd)
with_torch=1
if ! "$bin/python" -c "import torch" 2>/dev/null; then
  # scripts/pytest.sh leaves torch out when the disk is short, and says so; so does this.
  echo "padmoe: WARNING: $venv has no torch: the install into an environment with torch is not checked" >&2
  with_torch=0
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/padmoe-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ -n "${PADMOE_INSTALL_SRC:-}" ]; then
  mkdir "$work/clone"
  (cd "$PADMOE_INSTALL_SRC" && tar -c --exclude='./build*' --exclude=./.venv --exclude=./.git .) | tar -x -C "$work/clone"
elif git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
  git clone -q "$repo" "$work/clone"
else  # a checkout without .git: its files
  mkdir "$work/clone"
  tar -c --exclude='./build*' --exclude=./.venv . | tar -x -C "$work/clone"
fi

# 1. The README's command, in an environment that has torch.
if [ "$with_torch" = "1" ]; then
"$bin/python" -m pip uninstall -y -q padmoe || true
echo "padmoe: (fresh clone) pip install .   [into $venv, torch $("$bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)]" >&2
start=$SECONDS
if ! (cd "$work/clone" && PATH="$bin:$PATH" pip install .) > "$work/pip.log" 2>&1; then
  cat "$work/pip.log" >&2
  exit 1
fi
echo "padmoe: pip install . took $((SECONDS - start)) s" >&2
cd "$work"  # outside the source trees: the installed package is imported
"$bin/python" - <<'EOF'
import torch
import padmoe.torch, padmoe.torch.distributed  # noqa: F401
import padmoe._build_info as b
assert b.TORCH_VERSION == str(torch.__version__), (b.TORCH_VERSION, torch.__version__)
assert "site-packages" in padmoe.__file__, padmoe.__file__
print(f"padmoe: import padmoe.torch works ({padmoe.__file__}), operators built against torch {b.TORCH_VERSION}")
EOF
"$bin/python" - <<'EOF'
import padmoe._build_info as b
b.TORCH_VERSION = "0.0.0"  # as after `pip install -U torch`: the running torch is not the build's
try:
    import padmoe.torch  # noqa: F401
except ImportError as e:
    assert "built against torch 0.0.0" in str(e) and b.REBUILD in str(e), str(e)
    print("padmoe: another torch than the build's gets:", e)
else:
    raise SystemExit("padmoe: import padmoe.torch loaded operators built against another torch")
EOF
fi

# 2. Without torch: the package installs and imports; the error names the command.
"${PADMOE_PYTHON:-python3}" -m venv "$work/notorch"
start=$SECONDS
if ! (cd "$work/clone" && "$work/notorch/bin/pip" install . -C cmake.define.PADMOE_CUDA=OFF \
        -C build-dir="$work/build-notorch") > "$work/pip-notorch.log" 2>&1; then
  cat "$work/pip-notorch.log" >&2
  exit 1
fi
echo "padmoe: pip install . without torch took $((SECONDS - start)) s" >&2
"$work/notorch/bin/python" - <<'EOF'
import os
import padmoe, padmoe._build_info as b
assert b.TORCH_VERSION is None and not os.path.exists(os.path.join(padmoe.__path__[0], "_torch_ops.so"))
message = b.torch_ops_error("2.0.0")
assert "built without its torch operators" in message and b.REBUILD in message, message
print("padmoe: without torch at build time, import padmoe.torch gets:", message)
EOF
echo "padmoe: the README's install works" >&2
