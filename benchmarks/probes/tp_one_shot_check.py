"""Tensor parallel on GPUs: the same greedy generation with LycheeConfig.symm_mem_all_reduce on (one-shot
symmetric-memory all-reduces, lychee::one_shot_all_reduce) and off (NCCL), on one sharded model: tokens, logits, the
pass's counters, and the all-reduce kernels of one decode step (torch.profiler). Random weights, bf16, CUDA graphs.

    torchrun --nproc-per-node 2 benchmarks/probes/tp_one_shot_check.py [--layers 4] [--steps 32]

Prints one JSON line from rank 0; exit 1 if the tokens differ, the pass did not fire, or the one-shot run's decode
steps still ran NCCL all-reduce kernels (the eager prefill runs them either way).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.tensor_parallel import load_sharded  # noqa: E402
from lychee_compile import HeadMap, LycheeConfig, lychee_compile  # noqa: E402


def saved_llama(layers: int) -> str:
    folder = os.path.join(tempfile.gettempdir(), f"lychee_tp_check_{layers}")
    if dist.get_rank() == 0:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048,
                                     num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                     head_dim=64)).save_pretrained(folder)
    dist.barrier()
    return folder


def run(folder: str, on: bool, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    torch._dynamo.reset()
    model = load_sharded(folder)
    lychee_compile(model, HeadMap.for_model(model, layers=[0, 2]),
                   LycheeConfig(budget=64, block_size=16, sink_tokens=16, local_tokens=16, symm_mem_all_reduce=on))
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 300), device=model.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, output_logits=True, return_dict_in_generate=True)
    out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:      # one more generate: its decode steps' kernels
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, **kw)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    state = model._lychee_state
    return dict(seq=out.sequences.cpu(), logits=torch.stack(out.logits).float().cpu(),
                config_on=state.config.symm_mem_all_reduce, one_shot=state.counters.all_reduces_one_shot,
                kept=state.counters.all_reduces_kept,
                nccl_all_reduce_kernels=sum("nccl" in n.lower() and "allreduce" in n.lower().replace("_", "")
                                            for n in names),
                one_shot_kernels=sum("one_shot_all_reduce" in n for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    folder = saved_llama(args.layers)
    off, on = run(folder, False, args.steps), run(folder, True, args.steps)
    same = torch.equal(on["seq"], off["seq"])
    diff = float((on["logits"] - off["logits"]).abs().max())
    report = dict(world=dist.get_world_size(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                  tokens_equal=same, max_logit_diff=diff,
                  **{f"{k}_{name}": v for name, r in (("on", on), ("off", off)) for k, v in r.items()
                     if k not in ("seq", "logits")})
    # the profiled generate's prefill runs eagerly (NCCL either way); its decode steps run one-shot kernels instead
    ok = (same and on["config_on"] and on["one_shot"] == 2 * args.layers and on["kept"] == 0
          and on["one_shot_kernels"] > 0
          and on["nccl_all_reduce_kernels"] < off["nccl_all_reduce_kernels"] and off["one_shot_kernels"] == 0)
    if dist.get_rank() == 0:
        print(json.dumps(dict(report, ok=ok)), flush=True)
    dist.barrier()
    # no destroy_process_group / interpreter teardown: with symmetric memory rendezvoused, the ranks' exit hung
    # (torch 2.11, 2 x H200) after this line had printed
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
