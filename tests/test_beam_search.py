"""Beam search runs the rewritten decode step (dynamic_cache.py routes its steps through the compiled call) and
reorders the cache and the cross-step state in place (beam_search.py): with every head a retrieval head it equals
dense beam search; with a sparse map (plain, heat, Quest) the final beam teacher-forced alone gets the logits it got
inside the beam search -- which holds only if every reorder moved the state with the rows."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from lychee_compile import HeadMap, LycheeCompileError, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from lychee_compile.ops.sparsity import collect_sparsity
from tests.harness import EXACT_TOL, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=8, block_size=4, sink_tokens=2, local_tokens=2, backend="eager")
PROMPT, STEPS, BEAMS = 48, 6, 3


def _compiled(retrieval=None, **config):
    model = make("llama", "sdpa")
    head_map = HeadMap.for_model(model) if retrieval is None else HeadMap(retrieval(model)).with_model_metadata(model)
    lychee_compile(model, head_map, LycheeConfig(**dict(CFG, **config)))
    return model


def _prompt():
    return make_batch(lengths=(PROMPT,), seed=3)


def _beams(model, **kwargs):
    ids, mask = _prompt()
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, num_beams=BEAMS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, early_stopping=False,
                              length_penalty=0.0, pad_token_id=0, eos_token_id=None, **kwargs)


class Force(LogitsProcessor):
    def __init__(self, tokens):
        self.tokens = tokens

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - PROMPT
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[step]] = 0.0
        return forced


def _teacher_forced(model, tokens):
    ids, mask = _prompt()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=len(tokens), do_sample=False,
                             logits_processor=LogitsProcessorList([Force(tokens)]), output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    assert out.sequences[0, PROMPT:].tolist() == tokens
    return torch.stack(out.logits)[:, 0]                                                # [steps, vocab]


def _path_logits(out):
    """Raw logits of the best beam's tokens, each from the row that produced it ([steps, vocab])."""
    rows = out.beam_indices[0, :STEPS]
    return torch.stack([out.logits[t][rows[t]] for t in range(STEPS)])


def test_all_retrieval_beam_search_equals_dense():
    model, dense = _compiled(), make("llama", "sdpa")
    out, ref = _beams(model), _beams(dense)
    assert state_of(model).counters.decode_calls == STEPS - 1        # every step after the prefill was rewritten
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.beam_indices, ref.beam_indices)
    assert max_logit_diff(torch.stack(out.logits), torch.stack(ref.logits)) < EXACT_TOL


@pytest.mark.parametrize("feature", ["plain", "heat", "quest"])
def test_sparse_beam_search_state_follows_the_beams(feature):
    extra = {"plain": {}, "heat": dict(heat_blocks=1), "quest": dict(quest="sparse", quest_blocks=1)}[feature]
    model = _compiled(mixed_map, **extra)
    with collect_sparsity() as sp:
        out = _beams(model)
    assert state_of(model).counters.decode_calls == STEPS - 1
    assert sp.summary()["attended"]["max"] < 0.5, sp.summary()          # sparse heads read under half the context
    rows = out.beam_indices[0, :STEPS]
    assert len(set(rows.tolist())) > 1, "the best beam never changed rows: the reorder would go untested"
    if feature == "quest":
        _assert_descriptors_describe(model, out.past_key_values)
    forced = _teacher_forced(model, out.sequences[0, PROMPT:].tolist())
    assert max_logit_diff(_path_logits(out), forced) < EXACT_TOL


def _assert_descriptors_describe(model, cache):
    """The Quest descriptors after the beam search are those of the final (reordered) cache, block for block."""
    from lychee_compile.ops.quest import block_descriptors
    from lychee_compile.state_buffers import QUEST_ATTR
    desc, layers = getattr(model, QUEST_ATTR), state_of(model).global_layers
    length = cache.get_seq_length()
    keys = cache.layers[layers[0]].keys
    valid = torch.zeros(keys.shape[0], keys.shape[2], dtype=torch.bool)
    valid[:, :length] = True
    used = -(-length // CFG["block_size"])
    for slot, layer in enumerate(layers):
        fresh = block_descriptors(cache.layers[layer].keys, valid, CFG["block_size"], desc.shape[3])
        assert torch.equal(desc[:, slot, :, :used], fresh[:, :, :used]), (slot, layer)


def test_beam_search_with_rectification_is_refused_before_any_forward():
    model = _compiled(mixed_map, rectify_every=2)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(LycheeCompileError, match="rectify_every"):
        _beams(model)
    assert forwards == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sparse_beam_search_on_cuda_graphs_gpu():
    # the default CUDA path (Inductor, CUDA graphs, bf16 kernels): beam steps replay the captured graph (no skip, no
    # recompile per step) and the final beam teacher-forced alone gets the logits it got inside the beam search
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    model = make("llama", "sdpa").to("cuda", torch.bfloat16)
    lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model),
                   LycheeConfig(budget=32, block_size=16, sink_tokens=16, local_tokens=16, heat_blocks=1))
    assert state_of(model).config.cuda_graphs
    ids, mask = (x.cuda() for x in make_batch(lengths=(120,), seed=3))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, num_beams=BEAMS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, early_stopping=False,
                             length_penalty=0.0, pad_token_id=0, eos_token_id=None)
    graphs = counters["stats"]["unique_graphs"]
    tokens = out.sequences[0, ids.shape[1]:].tolist()

    class ForceGpu(LogitsProcessor):
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, tokens[input_ids.shape[1] - ids.shape[1]]] = 0.0
            return forced
    with torch.no_grad():
        alone = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                               logits_processor=LogitsProcessorList([ForceGpu()]), output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert state_of(model).counters.decode_calls == 2 * (STEPS - 1)
    rows = out.beam_indices[0, :STEPS]
    path = torch.stack([out.logits[t][rows[t]] for t in range(STEPS)]).float()
    # one batch size more (beams x 1 vs 1) may compile once more, nothing per step
    assert counters["stats"]["unique_graphs"] <= graphs + 1
    assert (path - torch.stack(alone.logits)[:, 0].float()).abs().max() < 5e-2


def test_switching_between_greedy_and_beam_search_compiles_the_step_once():
    # the beam-steps flag is read outside the traced frame: no guard on it, so no recompile when the mode changes
    model = _compiled(mixed_map)
    ids, mask = make_batch(lengths=(PROMPT,) * BEAMS, seed=3)          # one batch size and cache length for all
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        graphs = state_of(model).counters.graphs
        _beams(model)
        model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    assert state_of(model).counters.graphs == graphs and state_of(model).counters.decode_graphs == 1
