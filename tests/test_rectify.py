"""Dense rectification: after a rectification the rectified tokens' cache entries equal those of a dense
run over the same tokens; the compiled decode graph is not recompiled; without rectification they differ."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, LycheeConfig, LycheeConfigError, lychee_compile
from lychee_compile.api import state_of
from tests.harness import compiled
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=4, block_size=2, sink_tokens=2, local_tokens=2)
R = 4


def run(model, ids, mask, steps):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             return_dict_in_generate=True)
    return out.sequences, out.past_key_values


def dense_cache(arch, attn, sequences, mask_prompt, fed):
    """K/V of an uncompiled dense forward over prompt + the `fed` generated tokens that were fed back."""
    model = make(arch, attn)
    seq = sequences[:, : mask_prompt.shape[1] + fed]
    mask = torch.cat([mask_prompt, torch.ones(seq.shape[0], fed, dtype=mask_prompt.dtype)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(input_ids=seq, attention_mask=mask, position_ids=positions, use_cache=True)
    return out.past_key_values


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen2_gqa7", "eager")])
def test_rectified_entries_equal_dense(arch, attn):
    ids, mask = make_batch(lengths=(26, 17))
    n = ids.shape[1]
    model, state = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), rectify_every=R, **CFG)
    seq, cache = run(model, ids, mask, 2 * R + 1)          # 2R decode steps -> two rectifications
    assert state.counters.decode_graphs == 1
    plain, _ = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), **CFG)
    seq_plain, cache_plain = run(plain, ids, mask, 2 * R + 1)
    ref = dense_cache(arch, attn, seq, mask, 2 * R)

    span = slice(n, n + 2 * R)
    for layer in range(1, model.config.num_hidden_layers):   # layer 0's K/V never depend on attention
        got = cache.layers[layer].keys[:, :, span]
        want = ref.layers[layer].keys[:, :, span]
        assert (got - want).abs().max() < 1e-4, f"layer {layer}: rectified keys differ from dense"
        assert torch.allclose(cache.layers[layer].values[:, :, span], ref.layers[layer].values[:, :, span],
                              atol=1e-4)
    if torch.equal(seq, seq_plain):
        deltas = [(cache_plain.layers[layer].keys[:, :, span] - ref.layers[layer].keys[:, :, span]).abs().max()
                  for layer in range(1, model.config.num_hidden_layers)]
        assert max(deltas) > 1e-4, "without rectification the sparse cache should differ from dense"


def test_rectification_refused_with_sliding_layers():
    model = make("gemma3")
    with pytest.raises(LycheeConfigError, match="every layer to be global"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager", rectify_every=8))
    assert not hasattr(model, "_lychee_state")


def test_rectified_entries_equal_dense_in_teacher_forced_scoring():
    # the evaluation harness drives the compiled decode call itself (eval/scoring.py), passing cache_position and a
    # 2-D mask: rectification must rewrite exactly the same slots there; the unrectified tail must still differ
    from lychee_compile.eval.scoring import dense_prefill, score_steps
    ids = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(3, 120, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    dense = make("llama", "sdpa")
    dense_pre = dense_prefill(dense, ids, 96)
    score_steps(lambda **kw: dense(**kw), dense_pre, targets, copy_cache=False)
    model, _ = compiled("llama", "sdpa", retrieval=mixed_map(make("llama", "sdpa")), budget=8, block_size=4,
                        sink_tokens=4, local_tokens=4, rectify_every=4)
    pre = dense_prefill(model, ids, 96)
    score_steps(model.get_compiled_call(model.generation_config.compile_config), pre, targets, copy_cache=False)
    end = 60 + len(targets) - 1                    # positions written: prompt + every target but the last
    rectified = 60 + (len(targets) - 1) // 4 * 4
    for mine, ref in zip(pre.cache.layers, dense_pre.cache.layers):
        assert torch.allclose(mine.keys[:, :, :rectified], ref.keys[:, :, :rectified], atol=1e-5)
        assert torch.allclose(mine.values[:, :, :rectified], ref.values[:, :, :rectified], atol=1e-5)
    tail = max((m.keys[:, :, rectified:end] - r.keys[:, :, rectified:end]).abs().max().item()
               for m, r in zip(pre.cache.layers, dense_pre.cache.layers))
    assert tail > 1e-3, "the tail after the last rectification is sparse-decoded and must differ from dense"
