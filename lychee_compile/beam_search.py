"""Beam search on the rewritten decode step: the cache and every cross-step state reordered in place.

transformers' beam search (5.17-5.23) runs each decode step as `model(**inputs)`, not through the compiled call.
While a beam-search generate() runs, the model carries BEAM_STEPS_ATTR (install._guard_generate sets it), and
dynamic_cache.py routes its decode steps (one query token on a static cache, outside Dynamo) through the compiled
call, so each beam step is the rewritten one. Outside beam search an eager call stays eager, as transformers has it
(a user's own reference loop, generation_config.disable_compile). Between steps it reorders the cache along the batch (the flattened batch x beams rows) by
`model._reorder_cache(cache, beam_idx)` where the model has one, else `cache.reorder_cache(beam_idx)`, which replaces
each layer's tensors with index_select copies. Replaced tensors would leave the static addresses that Dynamo's
guards and the CUDA graph were made for, and our state buffers would keep the old rows. So the model gets its own
`_reorder_cache` (install.py), which reorders, in place (same addresses):
  * every cache layer's keys and values (any cache class with `.layers[i].keys / .values`, batch first);
  * the heat (`_lychee_heat`, [B, Lg, Hkv, NB]) and the Quest descriptors (`_lychee_quest`, [B, Lg, Hkv, NB, 2, D]).
The head kinds have no batch dimension; the index state lives inside one decode graph. Rectification keeps a
per-generate() record of the last tokens that a reorder would have to follow too: beam search with rectify_every is
refused (generation_modes.py).
"""
from __future__ import annotations

import torch

from .state_buffers import HEAT_ATTR, QUEST_ATTR

BEAM_STEPS_ATTR = "_lychee_beam_steps"     # True while a beam-search generate() runs


def install_beam_reorder(model) -> None:
    def _reorder_cache(cache, beam_idx: torch.Tensor):
        reorder_in_place(model, cache, beam_idx)
        return cache
    model._reorder_cache = _reorder_cache


@torch.no_grad()
def reorder_in_place(model, cache, beam_idx: torch.Tensor) -> None:
    """Rows of the cache and of the model's batch-indexed state buffers <- rows `beam_idx` (int [B]), in place."""
    tensors = []
    for layer in getattr(cache, "layers", ()):
        tensors += [getattr(layer, name, None) for name in ("keys", "values")]
    tensors += [getattr(model, name, None) for name in (HEAT_ATTR, QUEST_ATTR)]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and t.shape[0] == beam_idx.numel():
            t.copy_(t.index_select(0, beam_idx.to(t.device)))
