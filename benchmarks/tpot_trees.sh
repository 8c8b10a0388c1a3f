#!/usr/bin/env bash
# Decode TPOT of two source trees, interleaved in one session on one GPU: old, new, old, new, ... (N pairs).
#   bash benchmarks/tpot_trees.sh OLD_DIR NEW_DIR N [e2e.py arguments...]
# Each tree is a folder holding lychee_compile/ and benchmarks/ (e.g. `git archive <rev> lychee_compile benchmarks`
# unpacked); each process compiles with an Inductor cache of its tree's own (the first one cold, the others warm:
# TPOT is what is compared, not compile time). Prints one line per process and the medians per tree.
set -euo pipefail
old=$1 new=$2 n=$3
shift 3
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--model llama8b --batch 1 --contexts 131072 --rows h12_4096 --steps 200)
log=$(mktemp -d)
for i in $(seq "$n"); do
  for tree in old new; do
    dir=${!tree}
    TORCHINDUCTOR_CACHE_DIR=$log/inductor_$tree TRITON_CACHE_DIR=$log/triton_$tree PYTHONPATH=$dir \
      python3 "$dir/benchmarks/e2e.py" "${args[@]}" --warm-cache --out "$log/out_${tree}_$i" > "$log/${tree}_$i.txt" 2>&1 \
      || { echo "$tree $i failed:"; tail -20 "$log/${tree}_$i.txt"; exit 1; }
    tpot=$(grep -oE "TPOT +[0-9][0-9.]* ms" "$log/${tree}_$i.txt" | tail -1)
    [ -n "$tpot" ] || { echo "$tree $i: no timed row (e.g. --max-seconds reached: $log/${tree}_$i.txt)"; exit 1; }
    echo "$tree $i: $tpot"
  done
done | tee "$log/summary.txt"
python3 - "$log/summary.txt" <<'PY'
import re, statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if "TPOT" in l]
for tree in ("old", "new"):
    xs = [float(r[3]) for r in rows if r[0] == tree]
    print(f"{tree}: median {statistics.median(xs):.3f} ms over {len(xs)} processes ({', '.join(f'{x:.3f}' for x in xs)})")
PY
