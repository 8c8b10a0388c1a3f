#!/usr/bin/env bash
# Run the test suite with one venv's python.
#   LYCHEE_VENV=/path/to/venv bash .ci/test.sh [extra pytest args]
# LYCHEE_VENV unset: the `python` on PATH. LYCHEE_PYTEST_MARKERS overrides the marker expression (default "not gpu").
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
echo "test.sh: $PY -m pytest -q -m \"$MARKERS\" --durations=10 $*"
rc=0
"$PY" -m pytest -q -m "$MARKERS" --durations=10 "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
  echo "test.sh: pytest collected no tests (exit 5): treated as a failure" >&2
  exit 1
fi
exit $rc
