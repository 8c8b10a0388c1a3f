"""Time the Llama-3-8B linears as cuBLAS runs them in this process (torch.mm, bf16), at decode and prefill row
counts, and name the kernels each one launches (torch.profiler). cuBLAS settings that are fixed per process (the
workspace, CUBLAS_WORKSPACE_CONFIG) are compared by running this script once per setting; per-call settings by
flags:

    python benchmarks/probes/blas_probe.py --ms 1,2,4,4096,32768 --tag base --out $OUT
    CUBLAS_WORKSPACE_CONFIG=:0:0 python benchmarks/probes/blas_probe.py ... --tag ws0
    python benchmarks/probes/blas_probe.py ... --no-reduced-precision --tag fp32red

Each product is timed as attention_bench.time_calls times a kernel: the median of CUDA-graph replays of 20
back-to-back calls (weights rotated over enough copies that each call reads its weight from HBM, not L2). A benchmark, not a test."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/, for attention_bench
from attention_bench import time_calls  # noqa: E402  (benchmarks/ is no package)

# (name, K, N) of y = x @ W^T, W [N, K]: Llama-3-8B (q/k/v and gate/up fused, as lychee's fuse_linears pass does)
PRODUCTS = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]


def product_call(form, x, w, out):
    """One product y = x @ w^T in the named form (all compute the same values)."""
    if form == "mm":
        return torch.mm(x, w.t(), out=out)
    if form == "mmT":        # y^T = w @ x^T: the same product with the many-row operand first
        return torch.mm(w, x.t(), out=out)
    if form == "bmm":
        return torch.bmm(x[None], w.t()[None], out=out[None])
    if form == "addmm":      # bias epilogue (cuBLASLt's gemm-and-bias path in PyTorch)
        return torch.addmm(BIAS[w.shape[0]], x, w.t(), out=out)
    raise ValueError(form)


BIAS: dict = {}


def time_product(m, k, n, form="mm"):
    """(median us per product, names of the kernels one product launches)."""
    n_w = max(1, min(8, int(200e6 // (k * n * 2)) + 1))    # > 50 MB of weights in rotation: each call misses L2
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(n_w)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    shape = (n, m) if form == "mmT" else (m, n)
    outs = [torch.empty(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(n_w)]
    BIAS[n] = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    us = time_calls([(lambda w=w, o=o: product_call(form, x, w, o)) for w, o in zip(ws, outs)], min_calls=20) * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        product_call(form, x, ws[0], outs[0])
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return us, kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,4096,32768")
    ap.add_argument("--no-reduced-precision", action="store_true",
                    help="torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False")
    ap.add_argument("--forms", default="mm", help="comma list of product forms: mm, mmT, bmm, addmm")
    ap.add_argument("--blas", default=None, help="torch.backends.cuda.preferred_blas_library(...) first")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.no_reduced_precision:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    rows = []
    for form in args.forms.split(","):
        for m in (int(x) for x in args.ms.split(",")):
            for name, k, n in PRODUCTS:
                us, kernels = time_product(m, k, n, form=form)
                floor_us = (k * n + m * k + m * n) * 2 / 4.24e12 * 1e6    # bytes at the H200's copy rate (reference)
                rows.append(dict(form=form, m=m, product=name, k=k, n=n, us=us, kernels=kernels))
                print(f"{form:5s} M={m:6d} {name:8s} {us:9.2f} us  ({len(kernels)} kernel(s): {', '.join(kk[:60] for kk in kernels)})"
                      f"  [bytes at 4.24 TB/s: {floor_us:.1f} us]", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, tag=args.tag,
                cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"), blas=args.blas,
                bf16_reduced_precision=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    with open(os.path.join(args.out, f"blas_probe_{args.tag or 'run'}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
