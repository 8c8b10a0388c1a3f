"""Streaming heads and the unforced first layer (the StreamingLLM / DuoAttention baseline configurations) against
the independent semantics reference; lychee's default semantics are untouched by them (covered elsewhere)."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, HeadMapError, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from tests import semantics_ref
from tests.harness import EXACT_TOL, generate_logits, max_logit_diff
from tests.models import make, make_batch

CFG = dict(budget=8, block_size=4, sink_tokens=3, local_tokens=5)


def maps(kind, n_layers, n_kv):
    retrieval = torch.zeros(n_layers, n_kv, dtype=torch.bool)
    streaming = torch.zeros(n_layers, n_kv, dtype=torch.bool)
    if kind == "streamingllm":
        streaming[:] = True
    elif kind == "duo":
        retrieval[:, 0] = True
        streaming[:, 1:] = True
    elif kind == "lychee+streaming":
        retrieval[0] = True
        retrieval[2, 0] = True
        streaming[1, 1] = True
    return retrieval, streaming


@pytest.mark.parametrize("kind,first", [("streamingllm", False), ("duo", False), ("lychee+streaming", True)])
def test_streaming_kinds_match_semantics(kind, first):
    arch, attn = "llama", "sdpa"
    ids, mask = make_batch(lengths=(26, 17))
    model = make(arch, attn)
    retrieval, streaming = maps(kind, 3, 2)
    head_map = HeadMap(retrieval, streaming=streaming).with_model_metadata(model)
    lychee_compile(model, head_map, LycheeConfig(backend="eager", first_layer_retrieval=first, **CFG))
    seq, logits = generate_logits(model, ids, mask, 5)
    assert state_of(model).counters.sites_rewritten == 3
    if kind != "lychee+streaming":
        assert "drop_inherited" in state_of(model).snapshots[0]

    reference = make(arch, attn)
    sem = semantics_ref.Semantics(retrieval, [0, 1, 2], streaming=streaming, first_layer_retrieval=first, **CFG)
    semantics_ref.register(sem)
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, 5)
    assert max_logit_diff(logits, ref_logits) < EXACT_TOL and torch.equal(seq, ref_seq)
    _, dense = generate_logits(make(arch, attn), ids, mask, 5)
    assert max_logit_diff(ref_logits, dense) > 1e-3


def test_head_cannot_be_retrieval_and_streaming():
    with pytest.raises(HeadMapError, match="both retrieval and streaming"):
        HeadMap(torch.ones(3, 2, dtype=torch.bool), streaming=torch.ones(3, 2, dtype=torch.bool))


def test_streaming_map_round_trips(tmp_path):
    r, s = maps("duo", 3, 2)
    HeadMap(r, {"method": "duo"}, streaming=s).save(tmp_path / "d.safetensors")
    back = HeadMap.load(tmp_path / "d.safetensors")
    assert torch.equal(back.streaming, s) and torch.equal(back.retrieval, r)
