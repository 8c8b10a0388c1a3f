"""Dense rectification of the KV cache (ReSA §2.2; LycheeDecode's cache correction).

Sparse decode steps write K/V computed from approximate hidden states. Every R decode steps the last R tokens are
re-encoded in one dense, parallel forward pass at their original positions, overwriting their K/V entries, so the
approximation error in the cache stays bounded.

Where it runs: outside the compiled graph. transformers' generate() obtains its compiled decode call from
`model.get_compiled_call(...)`; we wrap what that returns. The wrapper records each decode step's token and position
and, after every R-th step, rewinds each cache layer's write offset by R and runs the uncompiled model (dense
attention, the prefill path) over those R tokens. The compiled decode graph is untouched (no recompiles); each
generate() call gets a fresh wrapper, so nothing leaks between calls.

Quest descriptors (ops/quest.py) of the re-encoded blocks are recomputed by the model's wrapped forward
(state_buffers.py), which rebuilds every block from the cache after any eager forward that carries one -- this
re-encode included. All blocks rather than the R tokens' ones: simpler, and a dense pass over the cache costs more
than the min / max anyway.

Limits: only caches whose slot is the position (every layer global: no sliding-window ring buffers, which
lychee_compile checks); the 2-D padding mask is recovered from the decode step's mask.
"""
from __future__ import annotations

import torch

from .cache_kwarg import cache_kwarg, cache_of

REENCODING_ATTR = "_lychee_reencoding"     # True while a re-encode's forward runs


class Rectifier:
    def __init__(self, model, every: int):
        self.model, self.every = model, every
        self.tokens, self.positions = [], []

    def after_step(self, kwargs) -> None:
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        cache, mask = cache_of(kwargs), kwargs.get("attention_mask")
        if ids is None or cache is None or ids.shape[1] != 1:
            return
        self.tokens.append(ids)
        self.positions.append(positions)
        if len(self.tokens) == self.every:
            self._reencode(cache, mask)
            self.tokens, self.positions = [], []

    def _reencode(self, cache, mask) -> None:
        tokens = torch.cat(self.tokens, dim=1)                                    # [B, R]
        length = int(cache.layers[0].cumulative_length)                           # positions written so far
        padding = padding_mask(mask, length, tokens.shape[0], tokens.device)      # [B, length] 0/1
        positions = (torch.cat(self.positions, dim=1) if all(p is not None for p in self.positions)
                     else (padding.cumsum(-1) - 1).clamp_min(0)[:, -self.every:])
        for layer in cache.layers:
            layer.cumulative_length.sub_(self.every)
        # marked: the state wrapper (state_buffers.py) must not take this multi-token eager forward for a prefill
        # (a prefill starts a new sequence and zeroes the heat)
        setattr(self.model, REENCODING_ATTR, True)
        try:
            with torch.no_grad():
                self.model(input_ids=tokens, position_ids=positions, attention_mask=padding, use_cache=True,
                           **{cache_kwarg(self.model): cache})
        finally:
            setattr(self.model, REENCODING_ATTR, False)


def padding_mask(mask, length: int, batch: int, device) -> torch.Tensor:
    """The 2-D padding mask [B, length] (1 = real token) behind a forward's mask (2-D, or 4-D bool/additive)."""
    if isinstance(mask, dict):   # transformers may pass one mask per layer type
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    if mask is None:
        return torch.ones(batch, length, dtype=torch.long, device=device)
    if mask.dim() == 4:
        row = mask[:, 0, -1, :length]
        row = row if row.dtype == torch.bool else row == 0
        return row.expand(batch, -1).long()
    return mask[:, :length].long()


def install_rectification(model, every: int) -> None:
    inner = model.get_compiled_call

    def get_compiled_call(compile_config):
        compiled = inner(compile_config)
        rectifier = Rectifier(model, every)

        def decode_step(*args, **kwargs):
            out = compiled(*args, **kwargs)
            rectifier.after_step(kwargs)
            return out
        return decode_step

    model.get_compiled_call = get_compiled_call
