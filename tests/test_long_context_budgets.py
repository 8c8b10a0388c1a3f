"""benchmarks/long_context.py's equal-bytes budgets: each baseline gets the largest budget whose KV bytes per decode
step do not exceed lychee's at that context length (no model run; kv_bytes' model of what a step reads)."""
from __future__ import annotations

import torch

from lychee_compile import HeadMap
from lychee_compile.eval.methods import method_spec
from tests.harness import import_benchmarks
from tests.models import make

(long_context,) = import_benchmarks("long_context")


def test_each_baseline_gets_the_largest_budget_within_lychees_bytes():
    model = make("llama")                        # 3 layers x 2 KV heads
    retrieval = torch.zeros(3, 2, dtype=torch.bool)
    retrieval[1, 0] = True
    hm = HeadMap(retrieval).with_model_metadata(model)
    layers, context, block = [0, 1, 2], 4096, 16
    lychee = method_spec("lychee", model, 512, hm)
    target = long_context.method_bytes(model, lychee, layers, context)
    dense = long_context.method_bytes(model, method_spec("dense", model, 512), layers, context)
    assert 0 < target < dense
    for name in long_context.BASELINES:
        def make_spec(b, name=name):
            return method_spec(name, model, b, hm)
        spec, got, matched = long_context.matched_budget(make_spec, model, layers, context, target, block, 80)
        if name == "tidal":        # its whole layers (0, 1, 2 and 13/32 of depth) are every layer of this model
            assert not matched and got == dense
            continue
        assert matched and got <= target and spec.budget % block == 0, name
        above = long_context.method_bytes(model, make_spec(spec.budget + block), layers, context)
        assert above > target, f"{name}: a larger budget still fits ({spec.budget} + {block})"
    # streaming heads read sink + window: StreamingLLM at lychee's bytes attends more than lychee's budget here
    stream, _, _ = long_context.matched_budget(lambda b: method_spec("streamingllm", model, b, hm), model, layers,
                                               context, target, block, 80)
    assert stream.budget > 512
