"""Every tiny test model builds and greedy-generates on the current stack (dense, no lychee)."""
from __future__ import annotations

import pytest
import torch

from tests.models import ARCHS, ATTN_IMPLS, SLIDING_WINDOW, make, make_batch

NEW = 4


def _generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_sdpa_eager_and_padding(arch):
    ids, mask = make_batch((12, 7))
    outs = {}
    for impl in ATTN_IMPLS:
        model = make(arch, impl)
        assert model.config._attn_implementation == impl
        assert not model.training and next(model.parameters()).dtype == torch.float32
        out = _generate(model, ids, mask)
        assert out.shape == (2, ids.shape[1] + NEW)
        assert torch.equal(out[:, :ids.shape[1]], ids)
        outs[impl] = out
    # Same weights (same seed) in both attention implementations: same greedy tokens.
    assert torch.equal(outs["sdpa"], outs["eager"])
    # Left padding is masked: the short row alone (no padding) generates the same tokens.
    alone = _generate(model, ids[1:, 5:], mask[1:, 5:])
    assert torch.equal(alone[0, -NEW:], outs["eager"][1, -NEW:])


def test_seeded_and_deterministic():
    a, b = make("llama", "sdpa"), make("llama", "sdpa")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_zoo_shapes():
    qwen = make("qwen2_gqa7", "sdpa").config
    assert qwen.num_attention_heads // qwen.num_key_value_heads == 7
    gemma = make("gemma3", "sdpa").config
    assert gemma.layer_types.count("full_attention") >= 2 and "sliding_attention" in gemma.layer_types
    assert gemma.sliding_window == SLIDING_WINDOW
    assert make("mistral_swa", "sdpa").config.sliding_window == SLIDING_WINDOW < 12 + NEW
    assert make("mistral", "sdpa").config.sliding_window is None
    ids, mask = make_batch((12, 7))
    assert ids.shape == mask.shape == (2, 12) and mask.sum(1).tolist() == [12, 7]
    assert mask[1, :5].sum() == 0  # left padding


@pytest.mark.parametrize("arch,impl,n_graphs", [("llama", "sdpa", 1), ("gemma3", "eager", 2)])
def test_compiled_generate_canary(arch, impl, n_graphs):
    """The decode-step form docs/STACKS.md describes: generate() compiles the decode step only, fullgraph, with the
    mask as a graph input; tokens equal eager. A failure here means the stack changed what the passes see."""
    from transformers import CompileConfig

    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    ids, mask = make_batch((12, 7))
    model = make(arch, impl)
    ref = _generate(model, ids, mask)
    cc = CompileConfig(backend=backend, fullgraph=True, mode=None)
    cc._compile_all_devices = True
    out = _generate(model, ids, mask, cache_implementation="static", compile_config=cc)
    assert torch.equal(out, ref)
    assert len(graphs) == n_graphs  # sliding layers: one recompile when cumulative_length_int turns symbolic
    gm = graphs[-1]
    sdpa = [n for n in gm.graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention]
    softmax = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and "softmax" in str(n.target)]
    n_layers = model.config.num_hidden_layers
    assert len(sdpa if impl == "sdpa" else softmax) == n_layers
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    assert any("attention_mask" in p for p in placeholders)  # mask built outside the compiled decode step
    assert sum(p.endswith("_keys") for p in placeholders) == n_layers
