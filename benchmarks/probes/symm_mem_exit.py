"""Whether a process that rendezvoused lychee::one_shot_all_reduce's symmetric buffer exits on its own: each rank
makes the buffer as lychee_compile does (tensor_parallel.symmetric_buffer), runs one one-shot all-reduce against the
process group's, then ends as asked. Run it under `timeout`: the exit code and the time say whether the exit hung.

    timeout -k 5 60 torchrun --nproc-per-node 2 benchmarks/probes/symm_mem_exit.py [--backend CUDA] \
        [--teardown none|destroy|free]

--backend: symm_mem.set_backend(NAME) before the buffer is made (default: torch's choice);
--teardown none: return from main with the buffer alive (held by this module until interpreter exit);
           free: drop the buffer and synchronize first; destroy: that, then dist.destroy_process_group().
Rank 0 prints one JSON line before the teardown starts.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lychee_compile.ops.one_shot_all_reduce import one_shot_all_reduce  # noqa: E402
from lychee_compile.tensor_parallel import symm_mem_backend, symmetric_buffer  # noqa: E402

_KEPT: dict = {}      # --teardown none: the buffer outlives main(), as a compiled model's state buffer does


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("NVSHMEM", "CUDA", "NCCL"))
    ap.add_argument("--teardown", choices=("none", "free", "destroy"), default="none")
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    from torch.distributed import _symmetric_memory as symm_mem
    if args.backend:
        symm_mem.set_backend(args.backend)
    group = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = _KEPT["buffer"] = symmetric_buffer(group, device)
    x = torch.randn(4, 4096, dtype=torch.bfloat16, device=device)          # [B, hidden]: one step's all-reduce
    expected = x.clone()
    dist.all_reduce(expected)
    got = one_shot_all_reduce(x, buffer, group.group_name)
    torch.cuda.synchronize()
    report = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), asked_backend=args.backend,
                  backend=symm_mem_backend(device), teardown=args.teardown,
                  same_sum=bool(torch.allclose(got.float(), expected.float(), atol=1e-2, rtol=1e-2)),
                  unix_time=round(time.time(), 1))
    if dist.get_rank() == 0:
        print(json.dumps(report), flush=True)
    if args.teardown in ("free", "destroy"):
        del buffer, got, _KEPT["buffer"]
        gc.collect()
        torch.cuda.synchronize()
        dist.barrier()
    if args.teardown == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
