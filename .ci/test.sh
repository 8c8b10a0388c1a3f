#!/usr/bin/env bash
# Run the test suite with one venv's python.
#   LYCHEE_VENV=/path/to/venv bash .ci/test.sh [extra pytest args]
# LYCHEE_VENV unset: the `python` on PATH. LYCHEE_PYTEST_MARKERS overrides the marker expression (default "not gpu").
# LYCHEE_TEST_WORKERS=N (N >= 2) runs N pytest-xdist workers, a test file per worker at a time (--dist loadfile: a
# file's module fixtures are built once, and tests that read what an earlier test of their file left run after it),
# slowest files first (tests/ci_ids/slow_files.txt; xdist's own reorder, by test count, would start them last).
# LYCHEE_CI_STACK=b narrows the selection to stack B's (tests/ci_report.py).
# pytest's exit code 5 (no tests collected) is turned into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${LYCHEE_VENV:-}" ]]; then
  PY="$LYCHEE_VENV/bin/python"
else
  PY="$(command -v python || command -v python3)"
fi
MARKERS="${LYCHEE_PYTEST_MARKERS:-not gpu}"
"$PY" - <<'PYEOF'
import importlib.util, torch, transformers
spec = importlib.util.find_spec("lychee_compile")
try:
    import triton
    tv = triton.__version__
except Exception:
    tv = "absent"
print(f"test.sh: torch {torch.__version__}, transformers {transformers.__version__}, triton {tv}; "
      f"lychee_compile from {spec.origin if spec else 'NOT IMPORTABLE'}")
PYEOF
PARALLEL=()
if [[ "${LYCHEE_TEST_WORKERS:-0}" -ge 2 ]]; then
  if "$PY" -c "import xdist" 2>/dev/null; then
    PARALLEL=(-n "$LYCHEE_TEST_WORKERS" --dist loadfile --no-loadscope-reorder)
  else
    echo "test.sh: LYCHEE_TEST_WORKERS=$LYCHEE_TEST_WORKERS but pytest-xdist is not in this venv (pip install pytest-xdist): one process" >&2
  fi
fi
echo "test.sh: $PY -m pytest -q -m \"$MARKERS\" --durations=25 ${PARALLEL[*]:-} $* (stack ${LYCHEE_CI_STACK:-a})"
rc=0
"$PY" -m pytest -q -m "$MARKERS" --durations=25 ${PARALLEL[@]+"${PARALLEL[@]}"} "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
  echo "test.sh: pytest collected no tests (exit 5): treated as a failure" >&2
  exit 1
fi
exit $rc
