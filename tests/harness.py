"""Test-side helpers: run generate() and compare logits step by step; import the benchmark scripts."""
from __future__ import annotations

import importlib
import os
import sys

import torch
from transformers import DynamicCache

from lychee_compile import HeadMap, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from tests.models import make, make_batch

EXACT_TOL = 1e-4


def generate_logits(model, input_ids, attention_mask, steps: int, cache: str = "static", **generate_kwargs):
    """Greedy generate with a static cache, or (cache="dynamic") a DynamicCache passed in as past_key_values;
    returns (sequences, logits [steps, B, vocab]). generate_kwargs go to generate() (e.g. logits_processor)."""
    cache_kwargs = (dict(cache_implementation="static") if cache == "static"
                    else dict(past_key_values=DynamicCache(config=model.config)))
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, **cache_kwargs,
                             **generate_kwargs)
    return out.sequences, torch.stack(out.logits)


def max_logit_diff(a, b) -> float:
    return (a - b).abs().max().item()


def batch(batch_size: int, lengths=(12, 7)):
    return make_batch(lengths=lengths[:batch_size])


def compiled(arch, attn, retrieval=None, **config):
    """A fresh tiny model of `arch` through lychee_compile (eager FX backend unless config says otherwise)."""
    model = make(arch, attn)
    head_map = HeadMap.for_model(model) if retrieval is None else HeadMap(retrieval).with_model_metadata(model)
    config.setdefault("backend", "eager")
    lychee_compile(model, head_map, LycheeConfig(**config))
    return model, state_of(model)


def import_benchmarks(*names: str):
    """Modules of benchmarks/ imported the way its scripts import them (benchmarks/ on sys.path), e.g.
    import_benchmarks("real_gpu", "real_gpu_stages.evolve")."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, folder)
    try:
        return tuple(importlib.import_module(n) for n in names)
    finally:
        sys.path.remove(folder)
