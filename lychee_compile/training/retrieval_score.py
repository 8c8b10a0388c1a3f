"""Training-free retrieval score (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality").

Run the dense model on passkey prompts; while it produces each passkey digit (teacher forced on the canonical answer),
a query head scores a hit when its strongest attention lands on a needle position holding the very token being
produced (it is copying from the needle). A KV head's score is the hit rate of its GQA query group, averaged over
prompts and digits. The map keeps the N highest-scoring heads (the first layer is always all retrieval).
"""
from __future__ import annotations

import torch

from .mixed_attention import MixedAttention, use_mixed_attention


def _needle_span(prompt_ids: list[int], tokenizer, passkey: str, start_hint: int) -> range:
    """Token positions of the needle sentence (searched near the builder's needle_token_pos)."""
    from ..eval.passkey import NEEDLE
    needle_len = len(tokenizer(NEEDLE.format(key=passkey), add_special_tokens=False).input_ids)
    lo = max(0, start_hint - 4)
    return range(lo, min(len(prompt_ids), start_hint + needle_len + 4))


def retrieval_scores(model, tokenizer, samples, progress: bool = True) -> torch.Tensor:
    """float [num_layers, Hkv]: per KV head, the fraction of (prompt, digit, query head) copies that hit the needle."""
    from tqdm.auto import tqdm
    from ..eval.passkey import build_passkey_prompt
    from .data import sample_plan  # noqa: F401  (samples carry their own seed/depth via needle_token_pos)

    n_layers = model.config.num_hidden_layers
    n_kv = model.config.num_key_value_heads
    hits = torch.zeros(n_layers, n_kv)
    total = 0
    for s in tqdm(samples, desc="retrieval score", disable=not progress):
        prompt_ids = s.prompt_ids
        seq = prompt_ids[:-1] + s.inputs[0].tolist()        # cache positions, then the target inputs
        t0 = len(prompt_ids) - 1
        span = set(_needle_span(prompt_ids, tokenizer, s.passkey, s.needle_token_pos))
        digit_rows = [j for j, t in enumerate(s.targets.tolist()) if tokenizer.decode([t]).strip().isdigit()]
        st = MixedAttention(None, num_select=1, record=True)
        with torch.no_grad(), use_mixed_attention(model, st):
            model(input_ids=s.inputs, past_key_values=s.cache(), use_cache=True)
        for layer, am in st.argmax.items():                  # am [1, Hq, L]
            G = am.shape[1] // n_kv
            for j in digit_rows:
                want = int(s.targets[j])
                for hq in range(am.shape[1]):
                    pos = int(am[0, hq, j])
                    if pos < t0 and pos in span and seq[pos] == want:
                        hits[layer, hq // G] += 1.0 / G
        total += len(digit_rows)
    return hits / max(total, 1)
