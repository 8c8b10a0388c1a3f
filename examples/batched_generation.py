"""Batched generation: prompts of different lengths in one left-padded batch, dense and through lychee_compile, and
each prompt alone. A row of the batch decodes as its prompt does alone (batch invariance): lychee numbers its
blocks from each row's first real token, so padding moves no block boundary.

    python examples/batched_generation.py                       # a tiny random Llama, CPU, seconds
    python examples/batched_generation.py --model DIR           # a Hugging Face folder and its tokenizer

The rewritten step takes left padding only (tokenizer.padding_side = "left"); right padding, a hole inside a prompt
or an empty row are refused before any work. Prints, for each row, whether its tokens equal its solo run's. Exit
status 0 when every lychee row does. (On the tiny model the budget is far below the prompt lengths, so sparse heads
attend a fraction of the context; greedy tokens of a real model can also differ between a padded and a solo run
where two logits nearly tie, for dense attention as well: the dense column shows it.)
"""
from __future__ import annotations

import argparse

import torch

from lychee_compile import HeadMap, LycheeConfig, lychee_compile

TEXTS = ("It was a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
         "want of a wife. However little known the feelings or views of such a man may be",
         "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, never took "
         "up any book but the Baronetage",
         "Emma Woodhouse, handsome, clever, and rich, with a comfortable home")


def load(folder: str | None):
    """(model factory, tokenizer or None): the folder's model or a tiny random Llama (fp32, 4 layers, 2 KV heads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    if folder:
        tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        return lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval(), tokenizer
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = "sdpa"

    def tiny():
        torch.manual_seed(0)           # the same weights in every copy
        return LlamaForCausalLM(config).eval()
    return tiny, None


def left_padded(texts, tokenizer):
    """input_ids, attention_mask [B, longest]: padding first (id 0 for the character codes of the tiny model)."""
    if tokenizer is not None:
        enc = tokenizer(list(texts), return_tensors="pt", padding=True)
        return enc.input_ids, enc.attention_mask
    rows = [[ord(c) % 128 for c in t] for t in texts]
    n = max(map(len, rows))
    ids = torch.tensor([[0] * (n - len(r)) + r for r in rows])
    return ids, (torch.arange(n) >= torch.tensor([[n - len(r)] for r in rows])).long()


def generate(model, ids, mask, new_tokens: int, pad_id: int):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    return out[:, ids.shape[1]:]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model folder (default: a tiny random Llama)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--budget", type=int, default=16, help="tokens per sparse head (default 16: the tiny prompts)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    make_model, tokenizer = load(args.model)
    ids, mask = left_padded(TEXTS, tokenizer)
    lengths = mask.sum(1).tolist()
    pad_id = tokenizer.pad_token_id if tokenizer is not None else 0
    dense_model, lychee_model = make_model(), make_model()
    head_map = HeadMap.for_model(lychee_model, layers=[0, lychee_model.config.num_hidden_layers // 2])
    # small blocks, sink and window for these short prompts, so that sparse heads attend a fraction of them
    lychee_compile(lychee_model, head_map, LycheeConfig(budget=args.budget, block_size=4, sink_tokens=4,
                                                        local_tokens=8, backend="eager"))
    batch = {"dense": generate(dense_model, ids, mask, args.new_tokens, pad_id),
             "lychee": generate(lychee_model, ids, mask, args.new_tokens, pad_id)}
    invariant = True
    for row, n in enumerate(lengths):
        solo_ids, solo_mask = ids[row:row + 1, -n:], mask[row:row + 1, -n:]      # the prompt alone, no padding
        same = {name: torch.equal(out[row:row + 1], generate(m, solo_ids, solo_mask, args.new_tokens, pad_id))
                for (name, out), m in zip(batch.items(), (dense_model, lychee_model))}
        invariant &= same["lychee"]
        print(f"row {row}: {n} tokens, {ids.shape[1] - n} padding; equals its solo run: dense {same['dense']}, "
              f"lychee {same['lychee']}; lychee tokens {batch['lychee'][row].tolist()}")
    counters = lychee_model._lychee_state.counters
    print(f"rewritten decode steps: {counters.decode_calls}; batch invariant: {invariant}")
    return 0 if invariant else 1


if __name__ == "__main__":
    raise SystemExit(main())
