"""Passkey accuracy of head maps through lychee_compile (eager backend) on SmolLM2, plus the dense reference.

    python -m lychee_compile.training.compare MAP.safetensors ... --prompts 10 --prompt-tokens 1000 --budget 128 \
        --json results.json

Prompts: eval/passkey.py with seeds 0..P-1 (training uses seeds >= 10000) and depths cycling 0.1, 0.3, 0.5, 0.7, 0.9.
Each map gets a freshly loaded model (lychee_compile installs itself on the model), greedy decoding, 12 new tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def evaluate(maps: list[str], prompts: int, prompt_tokens: int, budget: int, max_new_tokens: int = 12,
             dense: bool = True, log=print):
    import torch

    from .. import LycheeConfig, lychee_compile
    from ..eval.passkey import build_passkey_prompt, run_passkey
    from ..head_map import HeadMap
    from ..real_model import load_smollm2

    model, tok = load_smollm2(progress=False)
    plist = [build_passkey_prompt(tok, prompt_tokens, depth=DEPTHS[i % len(DEPTHS)], seed=i) for i in range(prompts)]
    results = {}
    if dense:
        t0 = time.perf_counter()
        ans = [run_passkey(model, tok, p, max_new_tokens=max_new_tokens) for p in plist]
        results["dense"] = {"correct": sum(a.correct for a in ans), "n": len(ans),
                            "per_prompt": [a.correct for a in ans], "answers": [a.answer for a in ans],
                            "wall_s": round(time.perf_counter() - t0, 1)}
        log(f"dense: {results['dense']['correct']}/{prompts}")
        dense_ans = ans
    for path in maps:
        hm = HeadMap.load(path)
        model, tok = load_smollm2(progress=False)
        cfg = LycheeConfig(backend="eager", budget=budget)
        t0 = time.perf_counter()
        m = lychee_compile(model, hm, cfg)
        ans = [run_passkey(m, tok, p, max_new_tokens=max_new_tokens) for p in plist]
        r = {"method": hm.metadata.get("method", "?"), "retrieval_heads": int(hm.retrieval[1:].sum()),
             "correct": sum(a.correct for a in ans), "n": len(ans), "per_prompt": [a.correct for a in ans],
             "answers": [a.answer for a in ans], "wall_s": round(time.perf_counter() - t0, 1)}
        if dense:
            r["same_tokens_as_dense"] = sum(a.token_ids == d.token_ids for a, d in zip(ans, dense_ans))
        results[path] = r
        log(f"{path}: {r['method']} ({r['retrieval_heads']} retrieval heads beyond layer 0): "
            f"{r['correct']}/{prompts} correct" + (f", {r['same_tokens_as_dense']}/{prompts} token-identical to dense"
                                                  if dense else ""))
        del m, model
    return results


def main(argv=None) -> int:
    import torch
    ap = argparse.ArgumentParser(prog="python -m lychee_compile.training.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("maps", nargs="+")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = evaluate(args.maps, args.prompts, args.prompt_tokens, args.budget, args.max_new_tokens,
                   dense=not args.no_dense, log=lambda s: print(s, flush=True))
    res["_settings"] = {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "budget": args.budget,
                        "max_new_tokens": args.max_new_tokens, "backend": "eager", "threads": args.threads,
                        "seeds": f"0..{args.prompts - 1}", "depths": list(DEPTHS)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
