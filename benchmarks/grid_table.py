"""Markdown table of an attention_bench.py results JSON (no GPU, no torch): one row per grid row.

    python benchmarks/grid_table.py benchmarks/results/attention_grid_h100.json [--variant dp]

"critical path" is the variant named by --variant (run with --variants '{"dp": {"defer": true, "defer_launch":
false, "pdl": 1}}': the split and the key-writing combine launched with PDL, what a compiled model waits for; the
top-k then runs on a side stream), "all work" is `ours` (split + a combine that also selects)."""
from __future__ import annotations

import argparse
import json


def _ms(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def table(results: dict, variant: str = "dp") -> str:
    head = ("| T | B | retr | budget | floor ms | critical path ms | % floor | x cuDNN | all work ms | x cuDNN "
            "| cuDNN ms | flash ms | gather ms |")
    lines = [head, "|" + "|".join(["---:"] * (head.count("|") - 1)) + "|"]
    for r in results["rows"]:
        cp = r.get(f"{variant}_ms")
        cu = r.get("cudnn_ms")
        lines.append("| " + " | ".join([
            str(r["T"]), str(r["B"]), f"{r['n_retr']}/8", str(r["budget"]), _ms(r["floor_ours_ms"]), _ms(cp),
            "-" if cp is None else f"{100 * r['floor_ours_ms'] / cp:.0f}%",
            "-" if cp is None or cu is None else f"{cu / cp:.2f}", _ms(r["ours_ms"]),
            "-" if cu is None else f"{cu / r['ours_ms']:.2f}", _ms(cu), _ms(r.get("flash_ms")),
            _ms(r.get("gather_ms"))]) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--variant", default="dp")
    args = ap.parse_args()
    with open(args.json) as fh:
        print(table(json.load(fh), args.variant))


if __name__ == "__main__":
    main()
