"""training.reselect.extend: a head map extended by another map's per-head scores (how docs/quality.md's rs24 / rs32
maps were made); and the committed maps are what it makes from the committed inputs."""
from __future__ import annotations

import os

import pytest
import torch

from lychee_compile import HeadMap
from lychee_compile.training import reselect as em

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAPS = os.path.join(ROOT, "benchmarks", "results", "maps")


def test_adds_the_best_scoring_missing_heads_beyond_layer_0():
    r = torch.zeros(4, 2, dtype=torch.bool)
    r[0] = True
    r[2, 1] = True
    scores = torch.tensor([[9.0, 9.0], [0.1, 0.5], [0.2, 0.9], [0.7, 0.3]])
    out = em.extend(HeadMap(r, {"method": "hardkuma"}), scores, 3)
    want = r.clone()
    want[3, 0] = want[1, 1] = True            # 0.7 and 0.5; (2, 1) was there already; layer 0 is not counted
    assert torch.equal(out.retrieval.bool(), want)
    assert out.metadata["retrieval_heads"] == "3" and "scores" not in out.metadata
    assert out.metadata["method"] == "hardkuma"
    assert torch.equal(em.extend(HeadMap(r), scores, 1).retrieval.bool(), r)     # already there: unchanged


@pytest.mark.parametrize("heads, match", [(0, "already has 1"), (7, "only 6 exist")])
def test_refuses_counts_it_cannot_make(heads, match):
    r = torch.zeros(4, 2, dtype=torch.bool)
    r[1, 0] = True
    with pytest.raises(ValueError, match=match):
        em.extend(HeadMap(r), torch.zeros(4, 2), heads)
    with pytest.raises(ValueError, match="do not match"):
        em.extend(HeadMap(r), torch.zeros(3, 2), 2)


@pytest.mark.parametrize("n", [24, 32])
def test_the_committed_extended_maps_are_reproducible(n):
    base = HeadMap.load(os.path.join(ROOT, "lychee_compile", "data", "smollm2-135m-hardkuma.safetensors"))
    scored = HeadMap.load(os.path.join(MAPS, "smollm2-retrieval-score-40.safetensors"))
    made = em.extend(base, em.scores_of(scored), n)
    committed = HeadMap.load(os.path.join(MAPS, f"smollm2-shipped-plus-rs{n}.safetensors"))
    assert torch.equal(made.retrieval.bool(), committed.retrieval.bool())
    assert int(committed.retrieval[1:].sum()) == n


def test_cli_extends_and_refuses_without_a_count(tmp_path):
    src = os.path.join(MAPS, "smollm2-retrieval-score-40.safetensors")
    base = os.path.join(ROOT, "lychee_compile", "data", "smollm2-135m-hardkuma.safetensors")
    out = tmp_path / "rs24.safetensors"
    assert em.main([src, "--extend", base, "--topk", "24", "--out", str(out)]) == 0
    committed = HeadMap.load(os.path.join(MAPS, "smollm2-shipped-plus-rs24.safetensors"))
    assert torch.equal(HeadMap.load(out).retrieval.bool(), committed.retrieval.bool())
    with pytest.raises(SystemExit):
        em.main([src, "--extend", base, "--threshold", "0.5", "--out", str(out)])
    with pytest.raises(SystemExit):
        em.main([src, "--extend", base, "--topk", "3", "--out", str(out)])      # fewer than the base has
