"""Long-context decode on one CUDA GPU: ms per decode step of lychee against the best dense path (flash_dense) and
Hugging Face as-is, each timed inside model.generate() on the same prompt.

    python examples/long_context_gpu.py                                 # Llama-3-8B shapes, random bf16 weights, 32K
    python examples/long_context_gpu.py --context 8192 --layers 4       # a quick look: 4 layers
    python examples/long_context_gpu.py --model DIR [--head-map FILE]   # your model folder (bf16), your map

Rows (--rows): `lychee` (the default config: CUDA graphs, Triton kernels; a --head-map file, else round(--share x KV
heads) retrieval heads per layer: timing does not depend on which), `flash_dense` (LycheeConfig(attention=
"flash_dense"): not lychee, plain dense attention over exactly the valid keys, the baseline speedups are quoted
against) and `hf` (no lychee_compile: generate() with a static cache, which transformers compiles itself). Each row
loads its own model; the first decode steps compile (about a minute for 32 layers) and are not timed. The prefill is
HF's own, dense. Random weights make no sense of the prompt: they time, they do not answer. The numbers measured on
an H200 and how to reproduce them are in docs/performance.md (`benchmarks/e2e.py`, which fills the cache instead
of prefilling, so it reaches 128K quickly).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from lychee_compile import HeadMap, LycheeConfig, lychee_compile

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                 tie_word_embeddings=False)


class StepClock:
    """A logits processor: generate() calls it once per new token; the gaps between calls are the decode steps."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def load_model(args):
    if args.model:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                    device_map="cuda").eval()
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**dict(LLAMA3_8B, num_hidden_layers=args.layers), attn_implementation="sdpa",
                         max_position_embeddings=max(8192, args.context + args.steps + 64))
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()


def spread_map(model, share: float) -> HeadMap:
    """round(share x KV heads) retrieval heads in every layer (at least one), their positions rotating by layer; the
    first layer all retrieval, as lychee_compile makes it anyway."""
    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    per_layer = max(1, round(share * kv))
    retrieval = torch.zeros(layers, kv, dtype=torch.bool)
    for layer in range(layers):
        retrieval[layer, [(layer + i) % kv for i in range(per_layer)]] = True
    retrieval[0] = True
    return HeadMap(retrieval, {"method": f"spread {share}"}).with_model_metadata(model)


def time_row(row: str, args) -> float:
    """Median ms per decode step of one row, over --steps steps after --warmup."""
    model = load_model(args)
    kwargs = {}
    if row == "hf":
        kwargs["cache_implementation"] = "static"
    else:
        head_map = HeadMap.load(args.head_map) if args.head_map else spread_map(model, args.share)
        attention = "hybrid" if row == "lychee" else "flash_dense"
        lychee_compile(model, head_map, LycheeConfig(budget=args.budget, attention=attention))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), device="cuda", generator=gen)
    clock = StepClock()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, logits_processor=[clock],
                       max_new_tokens=args.warmup + args.steps + 1, min_new_tokens=args.warmup + args.steps + 1,
                       pad_token_id=0, **kwargs)
    gaps = [b - a for a, b in zip(clock.times[args.warmup:], clock.times[args.warmup + 1:])]
    del model
    gc.collect()
    torch._dynamo.reset()        # each row compiled its own model; let its graphs and CUDA graph pool go
    torch.cuda.empty_cache()
    return 1e3 * statistics.median(gaps)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model folder (default: Llama-3-8B shapes, random weights)")
    p.add_argument("--head-map", help="a HeadMap .safetensors for the lychee row")
    p.add_argument("--context", type=int, default=32768, help="prompt tokens (default 32768)")
    p.add_argument("--layers", type=int, default=32, help="layers of the random model (default 32)")
    p.add_argument("--share", type=float, default=0.125, help="retrieval share without --head-map (default 0.125)")
    p.add_argument("--budget", type=int, default=4096, help="lychee's tokens per sparse head (default 4096)")
    p.add_argument("--rows", default="lychee,flash_dense,hf")
    p.add_argument("--warmup", type=int, default=5, help="decode steps not timed (compiles, CUDA graph capture)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (default 20)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("long_context_gpu.py needs a CUDA GPU (lychee's Triton kernels run in bf16/fp16 on CUDA). "
                         "On a CPU, run examples/cpu_quickstart.py.")
    rows = args.rows.split(",")
    times = {row: time_row(row, args) for row in rows}
    print(f"{torch.cuda.get_device_name()}, context {args.context}, batch 1, "
          f"{args.model or f'Llama-3-8B shapes ({args.layers} layers), random bf16 weights'}:")
    for row, ms in times.items():
        versus = "".join(f"; {other} / lychee: {times[other] / ms:.2f}x" for other in rows
                         if row == "lychee" and other != row)
        print(f"  {row:12s} {ms:8.3f} ms per decode step{versus}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
