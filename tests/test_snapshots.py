"""Acceptance 3: the rewritten decode graph, in our own stable text format (lychee_compile/passes/snapshot.py).

Regenerate after an intended change with LYCHEE_UPDATE_SNAPSHOTS=1 and review the diff under tests/snapshots/.
"""
from __future__ import annotations

import os
import pathlib

import pytest

from tests.harness import compiled, generate_logits
from tests.models import make_batch
from tests.test_sparse_semantics import mixed_map
from tests.models import make

SNAPSHOTS = pathlib.Path(__file__).parent / "snapshots"
CASES = [("llama", "sdpa", ""), ("gpt_neox", "eager", ""), ("gemma3", "sdpa", ""), ("qwen2_gqa7", "eager", ""),
         ("llama", "sdpa", "heat"), ("llama", "sdpa", "quest")]
EXTRA = {"": {}, "heat": dict(heat_blocks=2, heat_decay=0.8), "quest": dict(quest="sparse", quest_blocks=1)}


@pytest.mark.parametrize("arch,attn,extra", CASES)
def test_rewritten_graph_snapshot(arch, attn, extra):
    model, state = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), budget=8, block_size=4,
                            sink_tokens=4, local_tokens=4, **EXTRA[extra])
    generate_logits(model, *make_batch(lengths=(12, 7)), steps=2)
    assert state.counters.decode_graphs == 1
    assert state.counters.sites_rewritten == len(state.global_layers)
    text = state.snapshots[0]
    assert text.count("lychee graph v6") == 1 and text.count("\nop ") == len(state.global_layers)
    # pass defer_selection: every plain op but the last waits for its selection before its reader (not heat/Quest)
    deferred = 0 if extra else len(state.global_layers) - 1
    assert state.counters.selections_deferred == deferred and text.count("\nindex_ready(") == deferred
    path = SNAPSHOTS / f"{arch}-{attn}{'-' + extra if extra else ''}.txt"
    if os.environ.get("LYCHEE_UPDATE_SNAPSHOTS") == "1" or not path.exists():
        if os.environ.get("CI") and not path.exists():
            pytest.fail(f"snapshot {path.name} missing; create it with LYCHEE_UPDATE_SNAPSHOTS=1 and commit it")
        path.write_text(text)
    assert text == path.read_text(), f"graph changed; if intended, regenerate with LYCHEE_UPDATE_SNAPSHOTS=1"
