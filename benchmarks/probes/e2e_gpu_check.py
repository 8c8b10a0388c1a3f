"""Whole-model check on the GPU, over a long run, of lychee_compile + Inductor + the Triton lowering: a
SmolLM2-135M-shaped LlamaForCausalLM with random bf16 weights (the 98 MB GGUF cannot travel to the device in one call;
NaN/recompile/memory checks and timing do not depend on the weights).

    python benchmarks/probes/e2e_gpu_check.py --out DIR [--steps 2000] [--context 4000]

1. dense: HF generate, static cache, compiled with Inductor (HF as-is)            -> tokens, logits, TPOT
2. lychee all-retrieval map (dense semantics through our kernels)                -> logits vs dense (bf16)
3. lychee hybrid, 1 of 3 KV heads retrieval per layer, budget 1024, `steps` tokens -> finite, no recompiles,
   no memory growth across two calls, TPOT; the generated code is searched for our kernels
Prints a table and writes DIR/e2e_gpu_check.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the repository root


def smollm2_shaped(device, layers=30):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=16384,
                      rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    gc = model.generation_config
    gc.pad_token_id, gc.eos_token_id, gc.do_sample = 0, None, False
    return model


def generate(model, ids, mask, steps, **kw):
    torch.cuda.synchronize() if ids.is_cuda else None
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             return_dict_in_generate=True, output_logits=True, **kw)
    torch.cuda.synchronize() if ids.is_cuda else None
    return out, time.perf_counter() - start


class Clock:
    """generate() streamer: a synchronized timestamp per emitted token (the cache size stays the same, so timing
    needs no second compile)."""

    def __init__(self):
        self.stamps = []

    def put(self, _tokens):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())

    def end(self):
        pass

    def tpot_ms(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.stamps[len(self.stamps) // 2:], self.stamps[len(self.stamps) // 2 + 1:]))
        return gaps[len(gaps) // 2] * 1e3


def _settled_memory(device) -> int:
    import gc
    gc.collect()
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(args.out, "inductor_cache"))
    from transformers import CompileConfig
    from lychee_compile import HeadMap, LycheeConfig, lychee_compile
    from lychee_compile.api import state_of

    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "context": args.context, "steps": args.steps}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 49152, (2, args.context), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, : args.context // 3] = 0                                   # row 1 left-padded
    ids[1, : args.context // 3] = 0

    dense = smollm2_shaped(device, args.layers)
    cc = CompileConfig(fullgraph=True, mode=None)
    cc._compile_all_devices = True
    t0 = time.perf_counter()
    d_out, _ = generate(dense, ids, mask, 32, cache_implementation="static", compile_config=cc)
    res["dense_first_call_s"] = time.perf_counter() - t0
    d_logits = torch.stack(d_out.logits).float()
    clock = Clock()
    generate(dense, ids, mask, 32, cache_implementation="static", compile_config=cc, streamer=clock)
    res["dense_tpot_ms"] = clock.tpot_ms()
    print("dense done", res, flush=True)

    full = smollm2_shaped(device, args.layers)
    t0 = time.perf_counter()
    lychee_compile(full, HeadMap.for_model(full), LycheeConfig(budget=1024))
    f_out, _ = generate(full, ids, mask, 32)
    res["allretrieval_first_call_s"] = time.perf_counter() - t0
    f_logits = torch.stack(f_out.logits).float()
    res["allretrieval_vs_dense_max_abs"] = (f_logits - d_logits).abs().max().item()
    res["allretrieval_vs_dense_rel"] = ((f_logits - d_logits).norm() / d_logits.norm()).item()
    res["allretrieval_tokens_equal_steps"] = int((f_out.sequences == d_out.sequences).all(0).long().cumprod(0)
                                                 .sum().item()) - args.context
    clock = Clock()
    generate(full, ids, mask, 32, streamer=clock)
    res["allretrieval_tpot_ms"] = clock.tpot_ms()
    print("all-retrieval done", res, flush=True)

    hybrid = smollm2_shaped(device, args.layers)
    r = torch.zeros(args.layers, 3, dtype=torch.bool)
    r[:, 0] = True
    lychee_compile(hybrid, HeadMap(r).with_model_metadata(hybrid), LycheeConfig(budget=1024))
    h_out, _ = generate(hybrid, ids, mask, args.steps)
    logits = torch.stack(h_out.logits).float()
    finite, steps_done, first_seq = bool(torch.isfinite(logits).all()), logits.shape[0], h_out.sequences.cpu()
    del h_out, logits                     # outputs (logits, the returned cache) would otherwise count as growth
    mem1 = _settled_memory(device)
    clock = Clock()
    h_out2, _ = generate(hybrid, ids, mask, args.steps, streamer=clock)
    same = bool(torch.equal(first_seq, h_out2.sequences.cpu()))
    del h_out2
    mem2 = _settled_memory(device)
    c = state_of(hybrid).counters
    res.update(hybrid_steps=steps_done, hybrid_finite=finite, hybrid_decode_graphs=c.decode_graphs,
               hybrid_graphs=c.graphs, hybrid_decode_calls=c.decode_calls, hybrid_repeat_identical=same,
               memory_allocated_after_first_mb=mem1 / 2**20, memory_allocated_after_second_mb=mem2 / 2**20,
               hybrid_tpot_ms=clock.tpot_ms())
    sources = [p for p in glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "**", "*.py"),
                                    recursive=True)]
    res["inductor_files_with_our_split_kernel"] = sum("lychee_hybrid_split" in open(p).read() for p in sources)
    res["inductor_files_with_our_combine_kernel"] = sum("lychee_hybrid_combine" in open(p).read() for p in sources)
    print(json.dumps(res, indent=1))
    with open(os.path.join(args.out, "e2e_gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    assert res["hybrid_finite"] and res["hybrid_decode_graphs"] == 1
    assert res["memory_allocated_after_second_mb"] - res["memory_allocated_after_first_mb"] < 16


if __name__ == "__main__":
    main()
