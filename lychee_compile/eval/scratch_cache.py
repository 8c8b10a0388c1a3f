"""The cache a variant decodes on: a copy of a prompt's prefilled cache, in tensors that keep their addresses.

    scratch = scratch_for(base)                    # one per base model, shared by the variants built from it
    cache = working_copy(prefill.cache, scratch)   # a new cache object in the scratch's tensors, written in place

Every variant decodes a copy, so the prefill is never changed and every method sees the same prompt. The copy is a
new cache object each time (state kept per cache object, the Quest descriptors, is rebuilt for it:
state_buffers.QuestDescriptors.before_decode), but its tensors are the same from prompt to prompt, as those of a
cache that generate() reuses are: a decode step captured in a CUDA graph (Inductor's cudagraph trees, the kernels
numerics) reads the cache at the addresses it was captured with, so it is replayed for the next prompt instead of
captured again. A tensor of another shape, dtype or device (another cache length or batch) replaces the kept one.
"""
from __future__ import annotations

import copy
import weakref

import torch

_SCRATCH: "weakref.WeakKeyDictionary[object, CacheScratch]" = weakref.WeakKeyDictionary()


class CacheScratch:
    def __init__(self):
        self.kept: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def copy_of(self, cache):
        """A deep copy of `cache` whose tensor attributes (the cache's and its layers') are the kept tensors."""
        memo = {}
        for i, holder in enumerate([cache, *getattr(cache, "layers", ())]):
            for name, value in vars(holder).items():
                if isinstance(value, torch.Tensor) and id(value) not in memo:
                    memo[id(value)] = self._holding((i, name), value)
        return copy.deepcopy(cache, memo)

    def _holding(self, key: tuple, value: torch.Tensor) -> torch.Tensor:
        kept = self.kept.get(key)
        if (kept is None or kept.shape != value.shape or kept.stride() != value.stride() or kept.dtype != value.dtype
                or kept.device != value.device):
            kept = self.kept[key] = copy.deepcopy(value)    # deepcopy keeps transformers' mark_static_address
        else:
            kept.copy_(value)
        return kept


def scratch_for(base) -> CacheScratch:
    """The scratch shared by every variant built from `base` (they score one after another)."""
    if base not in _SCRATCH:
        _SCRATCH[base] = CacheScratch()
    return _SCRATCH[base]


def working_copy(cache, scratch: CacheScratch | None = None):
    """What a variant decodes on: a copy in `scratch`'s tensors, or a plain deep copy without one."""
    return copy.deepcopy(cache) if scratch is None else scratch.copy_of(cache)
