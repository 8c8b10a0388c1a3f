"""Re-run chosen passkey-2K prompts (by index in the harness's seeded order) with lychee and its issue-7 variants at
one attended budget: a diagnosis of the prompts a method lost, not an accuracy estimate.

    python benchmarks/passkey_probe.py --prompts 5,120,191,270,0,145 --out probe.json [--device cpu --threads 1]

Variants (each attends at most --attended tokens per sparse head besides sink and local): dense, lychee@A,
lychee+qs8@(A-128), lychee+qs16@(A-256), lychee+heat8@(A-128) (blocks of 16)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="comma-separated prompt indices (0-299 of the 300-prompt run)")
    ap.add_argument("--attended", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lychee_compile.eval.runner import run_eval
    from lychee_compile.eval.tasks import DEPTHS, passkey_items
    from real_gpu_stages.common import load, shipped_map
    from real_gpu_stages.quality import renamed, specs_for

    idx = [int(x) for x in args.prompts.split(",")]
    model, tok = load(args.device, "float32")
    hm, _ = shipped_map()
    trials = -(-(max(idx) + 1) // len(DEPTHS))
    items = passkey_items(tok, [2048], DEPTHS, trials)
    a = args.attended
    base = specs_for(model, ["dense", "lychee"], [a, a - 128, a - 256], hm, "eager")
    by = {s.label: s for s in base}
    specs = [by["dense"], by[f"lychee@{a}"],
             renamed(by[f"lychee@{a - 128}"], "lychee+qs8", quest="sparse", quest_blocks=8),
             renamed(by[f"lychee@{a - 256}"], "lychee+qs16", quest="sparse", quest_blocks=16),
             renamed(by[f"lychee@{a - 128}"], "lychee+heat8", heat_blocks=8, heat_decay=0.9)]
    res = run_eval(model, tok, [items[i] for i in idx], specs, task="passkey")
    out = [dict(prompt=idx[r["item"]], label=r["label"], passed=r["all_hit"], nll=r["nll"]) for r in res["records"]]
    for o in out:
        print(o)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
