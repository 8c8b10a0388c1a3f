"""`both` numerics on the GPU (lychee_compile/eval/numerics.py): a tiny model's fp32 reference rows and its bf16 cast's
kernels rows, prompt by prompt. The kernels rows must have run the Triton kernels on every rewritten site (the
counters), under CUDA graphs with no skip and one decode graph for every step and prompt, and lychee with every head
retrieval must predict what dense predicts on the same numerics (the targets are dense's own greedy tokens there).
The CPU suite checks the harness logic (tests/test_eval_numerics.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lychee_compile.eval import numerics as nm
from lychee_compile.eval.methods import method_spec
from lychee_compile.eval.runner import SPARSITY_NOTE, markdown_table, run_eval, summarize
from lychee_compile.eval.scoring import dense_prefill
from lychee_compile.eval.tasks import Item
from lychee_compile.head_map import HeadMap
from tests.models import make
from tests.test_sparse_semantics import mixed_map

CFG = dict(block_size=16, sink_tokens=16, local_tokens=16)
PROMPT, STEPS, CACHE = 100, 6, 128


@torch.no_grad()
def _greedy(base, ids) -> list[int]:
    """`base`'s own greedy tokens after `ids`, decoded as the harness decodes (scoring.score_steps' inputs)."""
    pre = dense_prefill(base, ids, CACHE)
    tokens = [int(pre.last_logits.argmax())]
    mask = torch.zeros(1, CACHE, dtype=torch.long, device=base.device)
    mask[:, :PROMPT] = 1
    for pos in range(PROMPT, PROMPT + STEPS - 1):
        mask[:, pos] = 1
        at = torch.tensor([[pos]], device=base.device)
        out = base(input_ids=torch.tensor([[tokens[-1]]], device=base.device), cache_position=at[0], position_ids=at,
                   past_key_values=pre.cache, attention_mask=mask, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_both_numerics_kernel_rows():
    from torch._dynamo.utils import counters
    model = make("llama").to("cuda")
    kernels_base = nm.KERNELS.base_model(model)          # the same cast run_eval makes: dense's greedy tokens there
    torch.manual_seed(0)
    items = []
    for i in range(3):
        ids = torch.randint(3, 128, (1, PROMPT))
        items.append(Item(ids, _greedy(kernels_base, ids.cuda()), CACHE, dict(index=i)))
    every = HeadMap.for_model(model)                     # every head retrieval: attends every valid key
    all_retrieval = dataclasses.replace(method_spec("lychee", model, 32, every, **CFG), name="lychee-all-retrieval")
    mixed = method_spec("lychee", model, 32, HeadMap(mixed_map(model)).with_model_metadata(model), **CFG)
    specs = [method_spec("dense", model, 32), all_retrieval, mixed]
    res = run_eval(model, None, items, specs, progress=False, task="repeat", numerics=nm.parse_numerics("both"))

    rows = {r["label"]: r for r in summarize(res)}
    assert set(rows) == {f"{m}[{n}]" for m in ("dense", "lychee-all-retrieval@32", "lychee@32")
                         for n in ("reference", "kernels")}
    for label in ("lychee-all-retrieval@32", "lychee@32"):
        k, r = res["counters"][f"{label}[kernels]"], res["counters"][f"{label}[reference]"]
        assert k["sites_on_kernel"] > 0 and k["sites_on_reference"] == 0, k
        assert r["sites_on_reference"] > 0 and r["sites_on_kernel"] == 0, r
        assert k["decode_graphs"] == 1 and k["graphs_left_dense"] == 0, k
        assert rows[f"{label}[kernels]"]["sparsity"] is None and rows[f"{label}[reference]"]["sparsity"] is not None
        assert rows[f"{label}[kernels]"]["n"] == 3 and "ppl_ratio_vs_numerics" in rows[f"{label}[kernels]"]
    assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (see its log for why)"
    dense, full = rows["dense[kernels]"], rows["lychee-all-retrieval@32[kernels]"]
    assert dense["token_hit_rate"] == 1.0                 # the targets are its greedy tokens
    assert full["token_hit_rate"] == dense["token_hit_rate"]
    assert abs(full["ppl_ratio_vs_ref"] - 1.0) < 0.05, full["ppl_ratio_vs_ref"]     # bf16 of a tiny model
    md = markdown_table(summarize(res), "repeat")
    assert "| lychee-all-retrieval[kernels] | 32 | 3 |" in md and "ratio kernels / reference" in md
    assert SPARSITY_NOTE in md
