"""A sliding/global hybrid (tiny Gemma3: layers 0, 2 sliding, 1, 3 global): lychee rewrites only the global layers,
and the sliding ones are counted and logged as left alone, not skipped silently (the Gemma-3-270M evaluation relies
on this: 15 sliding + 3 global layers)."""
from __future__ import annotations

import logging
import re

import torch

from tests.harness import batch, compiled, generate_logits
from tests.models import SLIDING_WINDOW


def test_only_global_layers_are_rewritten_and_sliding_ones_are_logged(caplog):
    retrieval = torch.zeros(4, 1, dtype=torch.bool)      # only the forced first global layer is retrieval
    with caplog.at_level(logging.INFO, logger="lychee_compile"):
        model, state = compiled("gemma3", "sdpa", retrieval, budget=4, block_size=2, sink_tokens=2, local_tokens=2)
        ids, mask = batch(1)
        assert ids.shape[1] + 6 > SLIDING_WINDOW      # the sliding layers really slide
        generate_logits(model, ids, mask, 6)
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    sliding = [i for i, t in enumerate(model.config.layer_types) if "sliding" in t]
    assert state.global_layers == full == [1, 3]
    c = state.counters
    assert c.decode_graphs >= 1 and c.graphs_left_dense == 0 and c.sites_refused == 0
    assert c.sites_rewritten == c.decode_graphs * len(full)
    assert c.sites_sliding == c.decode_graphs * len(sliding)
    # the lychee ops in every rewritten decode graph sit in the global layers only; the sliding layers' own
    # attention (one SDPA each) is still there
    assert state.snapshots
    for snap in state.snapshots:
        assert sorted(int(l) for l in re.findall(r"^op \d+ \w+ layer=(\d+)", snap, re.M)) == full
        assert f"dense attention left: sdpa={len(sliding)} " in snap
    logged = [r.getMessage() for r in caplog.records if "rewritten, sliding-window layers" in r.getMessage()]
    assert logged and all(f"layers {full} rewritten, sliding-window layers {sliding} left as they are" in m
                          for m in logged)


def test_eval_results_report_global_and_sliding_layers():
    """`lychee eval` writes each variant's global layers and sliding-site count into its results."""
    from lychee_compile.eval.methods import method_spec
    from lychee_compile.eval.runner import run_eval
    from lychee_compile.eval.tasks import Item
    from lychee_compile.head_map import HeadMap
    from tests.models import make

    base = make("gemma3", "sdpa")
    torch.manual_seed(0)
    items = [Item(torch.randint(3, 128, (1, 24)), [5, 6, 7], 32, dict(length=24, depth=0.5, trial=0, seed=0))]
    hm = HeadMap(torch.tensor([[False], [True], [False], [False]])).with_model_metadata(base)
    spec = method_spec("lychee", base, 4, hm, block_size=2, sink_tokens=2, local_tokens=2)
    c = run_eval(base, None, items, [spec], progress=False, task="passkey")["counters"]["lychee@4"]
    assert c["global_layers"] == [1, 3] and c["graphs_left_dense"] == 0
    assert c["sites_rewritten"] == 2 * c["decode_graphs"] and c["sites_sliding"] == 2 * c["decode_graphs"]
