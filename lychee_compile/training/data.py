"""Passkey training data over real text, and the dense prompt KV cache both teacher and student start from.

A sample is one passkey prompt (eval/passkey.py: a 5-digit needle at a random depth of Jane Austen's *Persuasion*,
a seeded haystack start, the chat template) and its target: the canonical answer "The pass key is NNNNN." fed with
teacher forcing. The dense model encodes prompt[:-1] into a KV cache once; the target forward then runs
[prompt[-1]] + answer[:-1] on that cache, so the L logits predict the L answer tokens (the first digit included).
The teacher's logits on those positions are computed once and kept.

Training seeds start at 10_000 so they never coincide with the evaluation prompts (seeds 0..99 in compare.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random

import torch

ANSWER = "The pass key is {key}."
TRAIN_SEED_BASE = 10_000


@dataclasses.dataclass
class Sample:
    kv: list                    # per layer (k, v), each [1, Hkv, T_prompt - 1, D], fp32, no grad
    inputs: torch.Tensor        # int64 [1, L]: prompt[-1] + answer[:-1]
    targets: torch.Tensor       # int64 [L]: the answer tokens
    teacher: torch.Tensor       # fp32 [L, V]: dense logits at the target positions
    passkey: str
    depth: float
    needle_token_pos: int
    n_prompt: int
    prompt_ids: list | None = None   # the full prompt's token ids (for the retrieval score)

    def cache(self):
        from transformers import DynamicCache
        return DynamicCache(ddp_cache_data=[(k, v) for k, v in self.kv])


def build_sample(model, tokenizer, prompt_tokens: int, seed: int, depth: float) -> Sample:
    from ..eval.passkey import build_passkey_prompt
    from transformers import DynamicCache

    prompt = build_passkey_prompt(tokenizer, prompt_tokens, depth=depth, seed=seed)
    ids = prompt.input_ids.to(model.device)
    answer = tokenizer(ANSWER.format(key=prompt.passkey), add_special_tokens=False,
                       return_tensors="pt").input_ids.to(model.device)
    inputs = torch.cat([ids[:, -1:], answer[:, :-1]], dim=1)
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        teacher_cache = DynamicCache(ddp_cache_data=kv)
        teacher = model(input_ids=inputs, past_key_values=teacher_cache, use_cache=True).logits[0].float()
    return Sample(kv=kv, inputs=inputs, targets=answer[0], teacher=teacher, passkey=prompt.passkey, depth=depth,
                  needle_token_pos=prompt.needle_token_pos, n_prompt=prompt.n_tokens,
                  prompt_ids=ids[0].tolist())   # tensors on the model's device


def sample_plan(num: int, seed: int) -> list[tuple[int, float]]:
    """(prompt seed, depth) per training sample: depths uniform in [0.05, 0.95], deterministic in `seed`."""
    rng = random.Random(seed)
    return [(TRAIN_SEED_BASE + 1000 * seed + i, round(rng.uniform(0.05, 0.95), 3)) for i in range(num)]


def build_dataset(model, tokenizer, prompt_tokens: int, num: int, seed: int, cache_dir: str | None = None,
                  progress: bool = True) -> list[Sample]:
    """`num` samples; cached on disk under cache_dir (keyed by the settings and the model fingerprint) if given."""
    from ..head_map import config_fingerprint

    plan = sample_plan(num, seed)
    key = hashlib.sha256(repr((prompt_tokens, plan, config_fingerprint(model.config), ANSWER)).encode()
                         ).hexdigest()[:16]
    path = os.path.join(cache_dir, f"passkey-{prompt_tokens}-{num}-{key}.pt") if cache_dir else None
    if path and os.path.exists(path):
        samples = [Sample(**d) for d in torch.load(path, weights_only=False, map_location=model.device)]
        for smp, (s, d) in zip(samples, plan):
            if smp.prompt_ids is None:   # caches written before prompt_ids was kept
                from ..eval.passkey import build_passkey_prompt
                smp.prompt_ids = build_passkey_prompt(tokenizer, prompt_tokens, depth=d, seed=s).input_ids[0].tolist()
        return samples
    from tqdm.auto import tqdm
    samples = [build_sample(model, tokenizer, prompt_tokens, s, d)
               for s, d in tqdm(plan, desc="prefill (dense teacher)", disable=not progress)]
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        torch.save([dataclasses.asdict(s) for s in samples], path + ".tmp")
        os.replace(path + ".tmp", path)
    return samples


def describe(samples: list[Sample], prompt_tokens: int, seed: int) -> str:
    return (f"passkey over Persuasion (real text): {len(samples)} prompts of ~{prompt_tokens} tokens, one 5-digit "
            f"needle at depth U(0.05,0.95), prompt seeds {TRAIN_SEED_BASE + 1000 * seed}.."
            f"{TRAIN_SEED_BASE + 1000 * seed + len(samples) - 1}; target = 'The pass key is NNNNN.' (teacher forced)")
