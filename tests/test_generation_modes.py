"""generate() modes (lychee_compile/generation_modes.py): sampling, num_return_sequences and stopping criteria run
the rewritten decode step and, with every head a retrieval head, give dense's tokens (beam search:
tests/test_beam_search.py); modes that would decode
densely are refused by name before any forward (strict), or logged and counted as dense calls (not strict)."""
from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from lychee_compile import HeadMap, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from lychee_compile import LycheeCompileError
from tests.harness import EXACT_TOL, max_logit_diff
from tests.models import make, make_batch

CFG = dict(budget=8, block_size=4, sink_tokens=2, local_tokens=2, backend="eager")
STEPS = 5


def _pair(strict=True):
    model = make("llama", "sdpa")
    lychee_compile(model, HeadMap.for_model(model), LycheeConfig(strict=strict, **CFG))
    return model, make("llama", "sdpa")


def _generate(model, seed=0, **kwargs):
    ids, mask = make_batch(lengths=(14, 9))
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, output_logits=True,
                              return_dict_in_generate=True, cache_implementation="static", **kwargs)


class StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("mode", ["sample", "num_return_sequences", "stopping_criteria"])
def test_supported_modes_run_the_rewrite_and_equal_dense(mode):
    kwargs = {"sample": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
              "num_return_sequences": dict(do_sample=True, num_return_sequences=2),
              "stopping_criteria": dict(stopping_criteria=StoppingCriteriaList([StopAfter(14 + 3)]))}[mode]
    model, dense = _pair()
    out, ref = _generate(model, **kwargs), _generate(dense, **kwargs)
    steps = out.sequences.shape[1] - 14
    assert steps == (3 if mode == "stopping_criteria" else STEPS)
    assert out.sequences.shape[0] == (4 if mode == "num_return_sequences" else 2)
    assert state_of(model).counters.decode_calls == steps - 1      # every step after the prefill was rewritten
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(torch.stack(out.logits), torch.stack(ref.logits)) < EXACT_TOL


REFUSED = {"contrastive_search": dict(penalty_alpha=0.6, top_k=4),
           "dola_generation": dict(dola_layers="low"), "assisted_generation": dict(prompt_lookup_num_tokens=2)}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_dense_modes_are_refused_before_any_forward(name):
    model, _ = _pair()
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(LycheeCompileError, match=name):
        _generate(model, **REFUSED[name])
    assert forwards == [] and state_of(model).counters.decode_calls == 0


def test_a_generate_that_ran_dense_raises_after_or_is_logged_and_counted(caplog):
    # disable_compile: transformers' loop calls the model eagerly, dense; nothing is refused up front, the count
    # catches it after
    model, dense = _pair()
    with pytest.raises(LycheeCompileError, match="without the lychee decode step"):
        _generate(model, disable_compile=True)
    model, dense = _pair(strict=False)
    with caplog.at_level("WARNING", logger="lychee_compile"):
        out = _generate(model, disable_compile=True)
    assert "without the lychee decode step" in caplog.text
    counters = state_of(model).counters
    assert counters.generate_calls_dense == 1 and counters.decode_calls == 0
    assert torch.equal(out.sequences, _generate(dense, disable_compile=True).sequences)


def test_a_dense_mode_from_the_models_defaults_is_refused_under_a_passed_config():
    # generate() fills a passed generation config's unset fields from the model's (a default set on the model)
    from transformers import GenerationConfig
    model, _ = _pair()
    model.generation_config.prompt_lookup_num_tokens = 2
    ids, mask = make_batch(lengths=(14, 9))
    for passed in (GenerationConfig(max_new_tokens=3), None):
        with pytest.raises(LycheeCompileError, match="assisted_generation"):
            if passed is None:
                model.generate(ids, attention_mask=mask, max_new_tokens=3)
            else:
                model.generate(ids, passed, attention_mask=mask)      # positional, as generate(inputs, config)
    assert state_of(model).counters.decode_calls == 0
