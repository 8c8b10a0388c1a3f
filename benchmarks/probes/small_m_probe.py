"""Can a decode step's products at a few rows (batch 2-4) run as Inductor reductions, as batch 1's do? A probe for
the H200 batch-4 step within 1.2x of its bytes floor (docs/design-notes.md): not part of the library.

At batch 1 LycheeConfig.tune_kernels lets Inductor decompose every one-row product into a multiply-reduce that it
fuses and tunes (7.60 -> 7.16 ms a step at 128K on an H100). Its decomposition stops at one row, so at batch 4 every
product stays a cuBLAS call. Written the plain way for M rows, `(x[:, None, :] * W[None]).sum(-1)`, consecutive
outputs share a row of x and read different rows of W, so W would come from DRAM M times. Laid out [N, M] instead,
`(W[:, None, :] * x[None]).sum(-1).t()`, the M outputs of one weight row are neighbours and W is read once.

For each Llama-3-8B product (the shapes after fuse_linears) and M in --ms: cuBLAS (F.linear), and both layouts
compiled by Inductor with coordinate-descent tuning. Timed as CUDA-graph replays rotating over weight copies (each call
reads W from DRAM); "% copy" against a device-to-device copy measured in the same run; every compiled result checked
against F.linear first (relative error).

    python benchmarks/probes/small_m_probe.py [--ms 1,2,4] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/, for attention_bench
from attention_bench import measure_copy_bw, time_calls  # noqa: E402  (benchmarks/ is no package)

SHAPES = {"qkv (fused)": (6144, 4096), "o_proj": (4096, 4096), "gate_up (fused)": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}


def rows_major(x, w):          # [M, N]: outputs of one x row are neighbours
    return (x[:, None, :].float() * w[None].float()).sum(-1).to(x.dtype)


def weight_major(x, w):        # [N, M] then transposed: the M outputs of one weight row are neighbours
    return (w[:, None, :].float() * x[None].float()).sum(-1).t().to(x.dtype)


def header(bw: float, **extra) -> dict:
    """The result JSON's header: date, device, versions, the run's copy rate (printed too)."""
    dev = torch.cuda.get_device_name()
    print(f"device {dev}; copy {bw / 1e12:.3f} TB/s", flush=True)
    return dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), device=dev, torch=torch.__version__,
                copy_TBps=bw / 1e12, rows=[], **extra)


def product_cases(ms, bw: float):
    """Every product of SHAPES at every M in ms: yields (x, weight copies, F.linear of x and the first copy in
    fp32, row). The copies (> L2 in total) are rotated by the timed calls so each reads W from DRAM; row already
    holds the shape, the bytes floor at copy rate bw and the cuBLAS time."""
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(400e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = dict(product=name, N=n, K=k, M=m, floor_us=(n * k * 2) / bw * 1e6)
            row["cublas_us"] = time_calls([lambda w=w: F.linear(x, w) for w in ws]) * 1e3
            yield x, ws, F.linear(x, ws[0]).float(), row
        del ws
        torch.cuda.empty_cache()


def rel_err(got, ref) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


def write(res: dict, out: str, name: str) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch._inductor.config as ic
    ic.coordinate_descent_tuning = True
    res = header(measure_copy_bw())
    # One static compile per (product, M): automatic dynamic shapes would make the kernels generic after the second.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    fns = {"rows_major": torch.compile(rows_major, dynamic=False),
           "weight_major": torch.compile(weight_major, dynamic=False)}
    for x, ws, ref, row in product_cases([int(v) for v in args.ms.split(",")], res["copy_TBps"] * 1e12):
        for fname, fn in fns.items():
            row[f"{fname}_rel_err"] = rel_err(fn(x, ws[0]), ref)
            assert row[f"{fname}_rel_err"] < 2e-2, (row["product"], row["M"], fname, row[f"{fname}_rel_err"])
            row[f"{fname}_us"] = time_calls([lambda w=w, f=fn: f(x, w) for w in ws]) * 1e3
        res["rows"].append(row)
        print(f"{row['product']:16s} M={row['M']} floor {row['floor_us']:7.1f} us | cuBLAS {row['cublas_us']:7.1f} | "
              f"rows-major {row['rows_major_us']:7.1f} | weight-major {row['weight_major_us']:7.1f} us", flush=True)
    write(res, args.out, "small_m_probe.json")


if __name__ == "__main__":
    main()
