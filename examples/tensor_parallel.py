"""lychee_compile on a model sharded by transformers' tensor parallelism: one process per GPU (or CPU rank).

    torchrun --nproc-per-node 2 examples/tensor_parallel.py MODEL_DIR [HEAD_MAP.safetensors]

Every rank loads the model sharded (`DistributedConfig(tp_plan="auto")`; transformers versions before it take
`tp_plan="auto"`), compiles it with the same global head map, and runs the same generate(). Each rank's decode step
attends with its own KV heads' columns of the map; the step's collectives are transformers' own
(docs/tensor-parallel.md).
Without a GPU it runs on CPU ranks with gloo (slowly: it shows the wiring, not the speed). Without MODEL_DIR it saves
a tiny random Llama (4 KV heads) to a temporary folder first.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from lychee_compile import HeadMap, LycheeConfig, lychee_compile


def load_sharded(path: str, dtype: torch.dtype | None = None):
    """The model at `path`, sharded over the ranks by transformers' own tensor parallelism; bf16 on GPUs, fp32 on
    CPU ranks unless `dtype` says. Weights missing from the checkpoint are initialized shard by shard."""
    try:
        from transformers.distributed import DistributedConfig
        kwargs = dict(distributed_config=DistributedConfig(tp_plan="auto"))
    except ImportError:
        kwargs = dict(tp_plan="auto")
    if dtype is None:
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **kwargs).eval()


def tiny_llama(folder: str) -> str:
    """Rank 0 saves a tiny random Llama; the others wait for it."""
    if dist.get_rank() == 0:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=4, head_dim=16)).save_pretrained(folder)
    dist.barrier()
    return folder


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    path = sys.argv[1] if len(sys.argv) > 1 else tiny_llama(os.path.join(tempfile.gettempdir(), "lychee_tp_llama"))
    model = load_sharded(path)
    head_map = HeadMap.load(sys.argv[2]) if len(sys.argv) > 2 else HeadMap.for_model(model, layers=[0, 2])
    # The map is global ([layers, all KV heads]) and the same on every rank; lychee_compile checks that on every rank
    # and raises the same error everywhere if a rank's input or the model's layout does not fit.
    lychee_compile(model, head_map, LycheeConfig(budget=64, block_size=16, sink_tokens=16, local_tokens=16))

    torch.manual_seed(0)     # the same prompt on every rank: tensor parallelism splits the model, not the batch
    ids = torch.randint(3, model.config.vocab_size, (1, 256), device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    if dist.get_rank() == 0:
        counters = model._lychee_state.counters
        print(f"rank 0 of {dist.get_world_size()}: KV heads {model._lychee_state.shard.heads}, "
              f"{counters.sites_rewritten} attention sites rewritten, {counters.decode_calls} rewritten decode steps; "
              f"tokens {out[0, -16:].tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
