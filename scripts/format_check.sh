#!/usr/bin/env bash
# The formatting check (CI: .ci/run, before the test suite). C, C++ and CUDA files against
# .clang-format (clang-format --dry-run -Werror); Python files against pyproject.toml's [tool.ruff]
# (ruff check and ruff format --check).
#
# By default it checks the files a change touches: those that differ between the merge base of
# PADMOE_FORMAT_BASE (default HEAD~1) and HEAD, and the working tree (so uncommitted edits count too).
# Without a HEAD~1 (a first commit, a shallow clone of depth 1) or outside a git checkout it checks
# every file.
# Usage: scripts/format_check.sh [--all] [--fix]
#   --all   every tracked file, not only the changed ones
#   --fix   apply the formatters (clang-format -i, ruff check --fix, ruff format) to the same files,
#           then report what is left that needs a hand (a lint finding ruff cannot fix)
# The tools are pinned: clang-format and ruff on PATH are used when they are these versions,
# otherwise they are installed with pip into a virtualenv of their own
# (PADMOE_FORMAT_VENV, default $TMPDIR/padmoe-format-<versions>, reused between runs).
set -euo pipefail
cd "$(dirname "$0")/.."

CLANG_FORMAT_VERSION=23.1.5
RUFF_VERSION=0.17.6

all=0
fix=0
for arg in "$@"; do
  case "$arg" in
    --all) all=1 ;;
    --fix) fix=1 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "format_check: unknown argument '$arg' (usage: scripts/format_check.sh [--all] [--fix])" >&2; exit 2 ;;
  esac
done

# --- the tools ---------------------------------------------------------------------------------------
# clang-format's output is stable within an LLVM major version; ruff's style can change in any release.
cf_ok() { "$1" --version 2>/dev/null | grep -q "version ${CLANG_FORMAT_VERSION%%.*}\."; }
ruff_ok() { [ "$("$1" --version 2>/dev/null)" = "ruff $RUFF_VERSION" ]; }
clang_format=$(command -v clang-format || true)
ruff=$(command -v ruff || true)
if [ -z "$clang_format" ] || ! cf_ok "$clang_format" || [ -z "$ruff" ] || ! ruff_ok "$ruff"; then
  venv=${PADMOE_FORMAT_VENV:-${TMPDIR:-/tmp}/padmoe-format-$CLANG_FORMAT_VERSION-$RUFF_VERSION}
  if ! cf_ok "$venv/bin/clang-format" || ! ruff_ok "$venv/bin/ruff"; then
    echo "format_check: installing clang-format $CLANG_FORMAT_VERSION and ruff $RUFF_VERSION into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      "clang-format==$CLANG_FORMAT_VERSION" "ruff==$RUFF_VERSION"
  fi
  if [ -z "$clang_format" ] || ! cf_ok "$clang_format"; then clang_format=$venv/bin/clang-format; fi
  if [ -z "$ruff" ] || ! ruff_ok "$ruff"; then ruff=$venv/bin/ruff; fi
fi

# --- the files ---------------------------------------------------------------------------------------
c_pattern='\.(c|cc|cpp|cxx|h|hh|hpp|cu|cuh)$'
py_pattern='\.py$'
if git rev-parse --git-dir >/dev/null 2>&1; then
  if [ "$all" = 1 ]; then
    scope="every tracked file"
    listed=$(git ls-files)
  else
    base_ref=${PADMOE_FORMAT_BASE:-HEAD~1}
    if base=$(git rev-parse --verify -q "$base_ref^{commit}"); then
      base=$(git merge-base "$base" HEAD)
      scope="the files changed since $base_ref ($(git rev-parse --short "$base"))"
      listed=$(git diff --name-only --diff-filter=d "$base" --)
    elif [ -n "${PADMOE_FORMAT_BASE:-}" ]; then
      echo "format_check: PADMOE_FORMAT_BASE=$PADMOE_FORMAT_BASE is not a commit" >&2
      exit 2
    else
      scope="every tracked file (HEAD has no parent here)"
      listed=$(git ls-files)
    fi
  fi
else
  scope="every file (not a git checkout)"
  listed=$(find . -type f -not -path './build*' -not -path './.venv/*' -not -path './.git/*' | sed 's|^\./||')
fi
# Results pages and their raw files are not code.
listed=$(printf '%s\n' "$listed" | grep -v '^bench/results/' || true)
c_files=()
py_files=()
while IFS= read -r f; do
  [ -n "$f" ] && [ -f "$f" ] && [ ! -L "$f" ] || continue
  if [[ "$f" =~ $c_pattern ]]; then c_files+=("$f"); elif [[ "$f" =~ $py_pattern ]]; then py_files+=("$f"); fi
done <<< "$listed"
echo "format_check: $scope: ${#c_files[@]} C/C++/CUDA and ${#py_files[@]} Python files" >&2

# --- fix ---------------------------------------------------------------------------------------------
if [ "$fix" = 1 ]; then
  [ ${#c_files[@]} -eq 0 ] || "$clang_format" -i "${c_files[@]}"
  if [ ${#py_files[@]} -gt 0 ]; then
    "$ruff" check --no-cache --fix --force-exclude --quiet --exit-zero "${py_files[@]}" >/dev/null
    "$ruff" format --no-cache --force-exclude --quiet "${py_files[@]}"
  fi
fi

# --- check -------------------------------------------------------------------------------------------
bad_c=()
for f in "${c_files[@]}"; do
  "$clang_format" --dry-run -Werror "$f" >/dev/null 2>&1 || bad_c+=("$f")
done
bad_fmt=()
bad_lint=()
lint_report=""
if [ ${#py_files[@]} -gt 0 ]; then
  mapfile -t bad_fmt < <("$ruff" format --no-cache --check --output-format concise --force-exclude "${py_files[@]}" 2>&1 |
    sed -n 's/^\(.*\.py\):[0-9]*:[0-9]*: unformatted: .*/\1/p' | sort -u || true)
  lint_report=$("$ruff" check --no-cache --force-exclude --output-format concise --quiet "${py_files[@]}" 2>&1 || true)
  if [ -n "$lint_report" ]; then
    mapfile -t bad_lint < <(printf '%s\n' "$lint_report" | grep -oE '^[^:]+\.py' | sort -u)
  fi
fi

if [ ${#bad_c[@]} -eq 0 ] && [ ${#bad_fmt[@]} -eq 0 ] && [ ${#bad_lint[@]} -eq 0 ]; then
  echo "format_check: ok" >&2
  exit 0
fi
{
  if [ ${#bad_c[@]} -gt 0 ]; then
    echo "format_check: not formatted as .clang-format says (fix: clang-format -i FILE):"
    printf '  %s\n' "${bad_c[@]}"
  fi
  if [ ${#bad_fmt[@]} -gt 0 ]; then
    echo "format_check: not formatted as ruff format says (fix: ruff format FILE):"
    printf '  %s\n' "${bad_fmt[@]}"
  fi
  if [ ${#bad_lint[@]} -gt 0 ]; then
    echo "format_check: ruff check findings (fix: ruff check --fix FILE, or by hand where it cannot):"
    printf '%s\n' "$lint_report" | sed 's/^/  /'
  fi
  if [ "$fix" = 1 ]; then
    echo "format_check: the above is left after --fix: it needs a hand."
  else
    echo "format_check: with the pinned versions (clang-format $CLANG_FORMAT_VERSION, ruff $RUFF_VERSION):"
    echo "  bash scripts/format_check.sh --fix$([ "$all" = 1 ] && echo ' --all')"
  fi
} >&2
exit 1
