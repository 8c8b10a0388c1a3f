"""Per-KV-head scores that order the heads for the search: the retrieval score (default, training-free) or HardKuma
E[z] (training), both from lychee_compile/training on its passkey samples over Persuasion; or the sensitivity, which
calibrate's session measures on its own search prompts (Session.sensitivity_scores: each later global head made
sparse alone, the loss it costs), for models whose few global heads the other two cannot tell apart.

    scores = score_heads(model, tokenizer, "retrieval-score", prompt_tokens=2048, samples=8)   # float [L, Hkv]
    retrieval = top_heads(scores, n, global_layers)                                            # bool [L, Hkv]

The search's map for n heads is the first global layer (all retrieval anyway) plus the n best-scoring heads of the
later global layers; heads of sliding-window layers are never counted (their rows are ignored by the ops).
"""
from __future__ import annotations

import torch

SCORERS = ("retrieval-score", "hardkuma", "sensitivity")


def score_heads(model, tokenizer, scorer: str, prompt_tokens: int, samples: int, seed: int = 0,
                progress: bool = True, hardkuma_steps: int = 40, hardkuma_target: int = 16,
                checkpoint: str | None = None) -> torch.Tensor:
    from ..training.data import build_dataset
    if scorer not in SCORERS:
        raise ValueError(f"unknown head scorer {scorer!r}; choose from {', '.join(SCORERS)}")
    if scorer == "sensitivity":
        raise ValueError("the sensitivity scorer needs calibrate's search prompts and variants: "
                         "calibrate/session.py Session.sensitivity_scores")
    data = build_dataset(model, tokenizer, prompt_tokens, samples, seed, None, progress)
    if scorer == "retrieval-score":
        from ..training.retrieval_score import retrieval_scores
        return retrieval_scores(model, tokenizer, data, progress)
    from ..training.trainer import TrainConfig, Trainer
    # the target's warm-up path ends halfway, whatever the step count (a scorer's run is shorter than train-heads')
    cfg = TrainConfig(method="hardkuma", retrieval_heads=hardkuma_target, steps=hardkuma_steps, seed=seed,
                      target_warmup=max(1, hardkuma_steps // 2))
    trainer = Trainer(model, data, cfg, checkpoint=checkpoint)
    trainer.train(progress)
    return trainer.score_matrix()


def beyond_first(global_layers: list[int], num_kv: int) -> int:
    """Heads the search may make retrieval: those of the global layers after the first."""
    return max(0, len(global_layers) - 1) * num_kv


def top_heads(scores: torch.Tensor, n: int, global_layers: list[int]) -> torch.Tensor:
    """bool [L, Hkv]: the first global layer and the n best-scoring heads of the later global layers (ties: the
    lower layer / head, map_from_scores' rule)."""
    from ..training.trainer import map_from_scores
    room = beyond_first(global_layers, scores.shape[1])
    if not 0 <= n <= room:
        raise ValueError(f"{n} retrieval heads do not fit in the {room} heads of the later global layers")
    keep = torch.zeros(scores.shape, dtype=torch.bool)
    keep[global_layers] = map_from_scores(scores[global_layers].float(), "topk", n=n)   # row 0: the first global
    return keep
