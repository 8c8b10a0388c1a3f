"""Teacher-forced scoring of several prompts at once (the certification on a GPU): one left-padded dense prefill per
batch, then every variant decodes a copy of that cache, the whole batch per step, through the callable generate()
compiles. With batch 1 the harness's own scoring (eval/scoring.py: Variant.score) runs instead; on equal-length
prompts both give the same numbers (tests/test_calibrate.py).

    scores = score_batches(base, [dense_variant, lychee_variant], items, batch_size=32)   # [variant][item]

Left padding is what lychee reads (masks.py): a row's sink is its first valid tokens; blocks stay aligned to cache
position 0, so a padded row's blocks fall elsewhere in its text than unpadded (the deployed batched behaviour).
"""
from __future__ import annotations

import dataclasses

import torch

from ..eval.scoring import TokenScores, step_logits
from ..eval.scratch_cache import CacheScratch, working_copy


@dataclasses.dataclass
class BatchPrefill:
    cache: object               # StaticCache holding the batch's prompts, left-padded
    last_logits: torch.Tensor   # [B, vocab] fp32
    mask: torch.Tensor          # [B, n] 1 = a prompt token
    length: int                 # n: the longest prompt
    max_cache_len: int


@torch.no_grad()
def batch_prefill(model, items, pad_id: int = 0) -> BatchPrefill:
    from transformers import StaticCache
    from ..eval.tasks import _round_up
    dev = model.device
    n = max(int(it.input_ids.shape[-1]) for it in items)
    ids = torch.full((len(items), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(items), n, dtype=torch.long)
    for b, it in enumerate(items):
        m = int(it.input_ids.shape[-1])
        ids[b, n - m:] = it.input_ids[0]
        mask[b, n - m:] = 1
    max_len = _round_up(n + max(len(it.targets) for it in items))
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    out = model(ids.to(dev), attention_mask=mask.to(dev), position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(dev),
                past_key_values=cache, cache_position=torch.arange(n, device=dev), use_cache=True, logits_to_keep=1)
    return BatchPrefill(cache, out.logits[:, -1].float(), mask.to(dev), n, max_len)


def as_batch(prefill) -> BatchPrefill:
    """eval/scoring.Prefill (one unpadded prompt) as a batch of one."""
    mask = torch.ones(1, prefill.length, dtype=torch.long, device=prefill.last_logits.device)
    return BatchPrefill(prefill.cache, prefill.last_logits[None], mask, prefill.length, prefill.max_cache_len)


def kl_per_token(dense_rows: torch.Tensor, rows: torch.Tensor) -> float:
    """Mean over positions of KL(dense || other); rows: log-probabilities [steps, vocab]."""
    return float((dense_rows.exp() * (dense_rows - rows)).sum(-1).mean())


@torch.no_grad()
def batch_steps(call, pre: BatchPrefill, targets: list[list[int]], with_logprobs: bool = False,
                scratch: CacheScratch | None = None):
    """Teacher-forced per row: target[0] from the prefill, target[i+1] from a decode step fed target[i]. Rows with
    fewer targets are fed their last target again and scored no further. with_logprobs: also each row's
    log-probabilities at its scored positions, fp32 [len(targets[b]), vocab] (for the KL metric). The cache is
    decoded as eval/scoring.score_steps decodes it (working_copy in `scratch`, a mask over the whole cache)."""
    cache = working_copy(pre.cache, scratch)
    dev = pre.last_logits.device
    steps = max(len(t) for t in targets)
    fed = torch.tensor([t + [t[-1]] * (steps - len(t)) for t in targets], device=dev)     # [B, steps]
    pos = pre.mask.sum(-1) - 1                                                               # [B] last position id
    mask = torch.zeros(len(targets), pre.max_cache_len, dtype=pre.mask.dtype, device=dev)  # one shape every step
    mask[:, :pre.length] = pre.mask
    logits = pre.last_logits
    out = [TokenScores([], []) for _ in targets]
    kept = [[] for _ in targets]
    for i in range(steps):
        lp = torch.log_softmax(logits.float(), -1)
        for b, t in enumerate(targets):
            if i < len(t):
                out[b].logprobs.append(float(lp[b, t[i]]))
                out[b].hits.append(int(logits[b].argmax()) == t[i])
                if with_logprobs:
                    kept[b].append(lp[b].cpu())
        if i == steps - 1:
            break
        mask[:, pre.length + i] = 1
        step = call(input_ids=fed[:, i:i + 1], cache_position=torch.tensor([pre.length + i], device=dev),
                    position_ids=(pos + 1 + i)[:, None], past_key_values=cache, attention_mask=mask.clone(),
                    use_cache=True, return_dict=True)
        logits = step_logits(step)
    if with_logprobs:
        return out, [torch.stack(k) for k in kept]
    return out


def score_batches(base, variants, items, batch_size: int = 1, pad_id: int = 0, progress=None,
                  kl: bool = False) -> tuple[list[list], list[list[float]] | None]:
    """([variant][item] TokenScores, [variant][item] KL to variants[0] or None). batch_size 1 without `kl`:
    Variant.score (eval/scoring.py), prompt by prompt."""
    from ..eval.scoring import dense_prefill
    out = [[] for _ in variants]
    kls = [[] for _ in variants] if kl else None
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        if batch_size == 1 and not kl:
            pre = dense_prefill(base, chunk[0].input_ids, chunk[0].max_cache_len)
            for k, v in enumerate(variants):
                out[k].append(v.score(pre, chunk[0].targets))
        else:
            pre = batch_prefill(base, chunk, pad_id)
            ref = None
            for k, v in enumerate(variants):
                res = batch_steps(v.sequence_call(), pre, [it.targets for it in chunk], with_logprobs=kl,
                                  scratch=v.scratch)
                scores, rows = res if kl else (res, None)
                v.check_sparse()
                out[k] += scores
                ref = rows if ref is None else ref
                if kl:
                    kls[k] += [kl_per_token(d, r) for d, r in zip(ref, rows)]
        del pre
        if progress is not None:
            progress(len(chunk))
    return out, kls
