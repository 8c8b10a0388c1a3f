"""A head map for your own model: calibrate it, save and load it, compile with it, swap maps without recompiling.

    python examples/head_map_for_your_model.py                          # a tiny random Llama, CPU, well under a minute
    python examples/head_map_for_your_model.py --model DIR --out calib  # a Hugging Face folder (slow on a CPU)

`calibrate` (docs/calibrate.md; the same as `lychee calibrate`) orders the KV heads by their retrieval score, walks
head count x budget for the cheapest point within the quality target of dense, checks that point on held-out
prompts and writes `calibrated.safetensors`: a HeadMap whose metadata holds the record and the recommended budget.
`lychee_compile(model, head_map)` then takes that budget when the config sets none, and `set_head_map` swaps
the retrieval / sparse kinds of a compiled model in place (runtime data: no recompile).

On the tiny random model passkey means nothing, so the target is the KL divergence from dense per token on real-text
prompts read by a one-token-per-character tokenizer, and the map is `unconfirmed` (a certified map needs >= 300
held-out prompts per metric). With --model, the default target is `passkey=1pt,ppl=2%` at --context tokens.
"""
from __future__ import annotations

import argparse
import os

import torch

from lychee_compile import HeadMap, LycheeConfig, lychee_compile, set_head_map
from lychee_compile.calibrate import calibrate

# Small enough for a CPU in seconds: 320-token prompts, 4-token blocks, 3 search and 4 held-out prompts.
TINY = dict(lengths=[320], block_size=4, sink_tokens=4, local_tokens=8, budgets=[16, 64], head_counts=[0, 2, 4],
            search_prompts=3, certify_prompts=4, score_tokens=6, score_samples=2)
TINY_TARGET = "kl=0.0004nat"


class CharTokenizer:
    """One token per character: what calibrate's prompt builders need from a tokenizer, for a model without one."""
    chat_template = None
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [ord(c) for c in text]
        return type("Encoding", (), {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids})()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def tiny_model():
    """A random 4-layer Llama (2 KV heads a layer) over 128 character codes, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval(), CharTokenizer()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model folder (default: a tiny random Llama)")
    p.add_argument("--target", help=f"quality target (default: {TINY_TARGET} tiny, passkey=1pt,ppl=2%% --model)")
    p.add_argument("--context", type=int, default=2048, help="prompt length with --model (default 2048)")
    p.add_argument("--out", default="calibration", help="output folder; a rerun with it resumes (default calibration)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
        tokenizer, settings = AutoTokenizer.from_pretrained(args.model), dict(lengths=[args.context])
        target = args.target or "passkey=1pt,ppl=2%"
    else:
        (model, tokenizer), settings, target = tiny_model(), TINY, args.target or TINY_TARGET

    result = calibrate(model, tokenizer, target, args.out, progress=False, log=lambda line: None, **settings)
    if result.head_map is None:
        print(f"calibration: {result.status}; nothing to compile with (report: {result.paths['report']})")
        return 1
    calibrated = HeadMap.load(result.paths["head_map"])       # the saved map and its calibration record
    print(f"calibrated: {calibrated!r}, status {result.status}, recommended budget {calibrated.recommended_budget} "
          f"tokens, KV bytes per step {result.chosen['bytes_ratio']:.2f}x dense; report {result.paths['report']}")

    # A map of your own: whole layers 0 and 2 retrieval (or HeadMap(bool tensor [layers, KV heads])), saved, loaded.
    mine_path = os.path.join(args.out, "layers-0-2.safetensors")
    HeadMap.for_model(model, layers=[0, 2]).save(mine_path)

    small = {k: settings[k] for k in ("block_size", "sink_tokens", "local_tokens") if k in settings}
    lychee_compile(model, calibrated, LycheeConfig(backend="eager", **small))   # budget: the map's recommendation
    state = model._lychee_state
    ids = tokenizer("It was a truth universally acknowledged" * 8, return_tensors="pt").input_ids
    out = {}
    for name, head_map in (("calibrated", calibrated), ("layers 0 and 2", HeadMap.load(mine_path))):
        set_head_map(model, head_map)                          # in place: the compiled step stays
        with torch.no_grad():
            out[name] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        print(f"{name:14s} budget {state.config.budget}, {int(head_map.retrieval.sum())} retrieval KV heads: "
              f"tokens {out[name]}")
    print(f"decode graphs compiled: {state.counters.decode_graphs} (one, for both maps); rewritten decode steps: "
          f"{state.counters.decode_calls}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
