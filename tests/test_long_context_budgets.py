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


def test_runs_of_one_length_each_join_into_one_table(tmp_path):
    import json

    import pytest

    def run(folder, length, acc):
        rec = dict(label="lychee@256", depth=0.5, all_hit=bool(acc))
        summary = [dict(label="lychee@256", accuracy=acc, n=1)]
        pl = dict(length=length, methods=[dict(method="lychee", label="lychee@256", budget=256, bytes=1.0,
                                              bytes_vs_dense=0.5)],
                  tasks=dict(passkey=dict(records=[rec], summary=summary)))
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "long_context.json").write_text(json.dumps(dict(settings=dict(lengths=str(length)),
                                                                             lengths=[pl])))
        return str(tmp_path / folder)

    a, b = run("a", 16384, 1.0), run("b", 8192, 0.0)
    joined = long_context.join([a, b], str(tmp_path / "out"))
    assert [pl["length"] for pl in joined["lengths"]] == [8192, 16384]
    md = (tmp_path / "out" / "long_context.md").read_text()
    assert md.index("| 8K | lychee") < md.index("| 16K | lychee") and "| 16K | lychee | 256 | 50.0% | 100% (n=1) |" in md
    assert (tmp_path / "out" / "passkey_heatmaps.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="more than one run"):
        long_context.join([a, a], str(tmp_path / "again"))
    data = json.loads((tmp_path / "b" / "long_context.json").read_text())
    data["settings"]["budget"] = 512
    (tmp_path / "b" / "long_context.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="differ in budget"):
        long_context.join([a, b], str(tmp_path / "other"))
