"""Can a hand-written Triton product for a few rows (batch 2-4 decode) beat cuBLAS at Llama-3-8B's shapes? A probe for
the H200 batch-4 step within 1.2x of its bytes floor (docs/design-notes.md): not part of the library.

small_m_probe.py (H200) found cuBLAS 1.3-1.7x over the bytes floor on the small products at M=4 (q/k/v
15.6 us vs 11.9, o_proj 13.5 vs 8.0, down 31.8 vs 27.9) and Inductor's own reductions slower still. Here each
program owns BLOCK_N weight rows and streams them over K once, for all M rows of x at a time, so W is read once
and there is no split-K reduce:

  fma: acc[m] [BLOCK_N, BLOCK_K] fp32 += W_tile * x[m]   (M statically unrolled; one sum over K at the end)
  dot: acc [BLOCK_N, 16] fp32 += tl.dot(W_tile, x_tile^T) (x padded to 16 rows by masked loads; tensor cores)

Every configuration of a small grid is checked against F.linear (relative error) and timed as CUDA-graph replays
rotating over weight copies (> L2), against cuBLAS and the bytes floor (a device copy measured in the same run).

    python benchmarks/probes/small_m_gemv_probe.py [--ms 1,2,4] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/probes/small_m_gemv_probe.py --check-only    (CPU: the kernels' math)
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

@triton.jit
def gemv_fma(x_ptr, w_ptr, y_ptr, N, K, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # x: [M, K], w: [N, K], y: [M, N]; all contiguous
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        w = w.to(tl.float32)
        acc0 += w * tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if M > 1:
            acc1 += w * tl.load(x_ptr + K + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if M > 2:
            acc2 += w * tl.load(x_ptr + 2 * K + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if M > 3:
            acc3 += w * tl.load(x_ptr + 3 * K + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + n, tl.sum(acc0, 1).to(y_ptr.dtype.element_ty), mask=nmask)
    if M > 1:
        tl.store(y_ptr + N + n, tl.sum(acc1, 1).to(y_ptr.dtype.element_ty), mask=nmask)
    if M > 2:
        tl.store(y_ptr + 2 * N + n, tl.sum(acc2, 1).to(y_ptr.dtype.element_ty), mask=nmask)
    if M > 3:
        tl.store(y_ptr + 3 * N + n, tl.sum(acc3, 1).to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def gemv_dot(x_ptr, w_ptr, y_ptr, N, K, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # x: [M, K], w: [N, K], y: [M, N]; acc: [BLOCK_N, 16] = W_tile @ x_tile^T
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, 16)
    nmask, mmask = n < N, m < M
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(x_ptr + m[None, :] * K + k[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
    tl.store(y_ptr + m[None, :] * N + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[None, :] & nmask[:, None])


def launch(kind, x, w, bn, bk, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    fn = gemv_fma if kind == "fma" else gemv_dot
    fn[(triton.cdiv(n, bn),)](x, w, y, n, k, M=m, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y


GRID = {"fma": list(itertools.product([8, 16, 32], [128, 256, 512], [4, 8], [1, 2, 3])),
        "dot": list(itertools.product([16, 32, 64], [128, 256], [4], [2, 3, 4]))}


def check(device):
    """Every kernel kind against F.linear on small odd shapes (masking at both edges); fp32 on the CPU (the
    interpreter), bf16 on the GPU (where tl.dot of fp32 would round to tf32)."""
    dtype, tol = (torch.float32, 1e-5) if device == "cpu" else (torch.bfloat16, 1e-2)
    for kind, m in itertools.product(("fma", "dot"), (1, 2, 3, 4)):
        x = torch.randn(m, 200, device=device, dtype=dtype)
        w = torch.randn(70, 200, device=device, dtype=dtype)
        got, ref = launch(kind, x, w, 16, 64, 4, 2).float(), F.linear(x.float(), w.float())
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < tol, (kind, m, err)
    print(f"check: fma and dot equal F.linear at M=1..4 ({dtype}, N=70, K=200)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.check_only:
        return check("cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]      # probes/ for small_m_probe, benchmarks/ for attention_bench
    from attention_bench import measure_copy_bw, time_calls
    from small_m_probe import header, product_cases, rel_err, write
    check("cuda")
    res = header(measure_copy_bw(), triton=triton.__version__)
    for x, ws, ref, row in product_cases([int(v) for v in args.ms.split(",")], res["copy_TBps"] * 1e12):
        row["best"] = {}
        for kind, grid in GRID.items():
            timed = []
            for bn, bk, warps, stages in grid:
                try:
                    got = launch(kind, x, ws[0], bn, bk, warps, stages)
                except Exception as e:      # noqa: BLE001  (a config Triton refuses: out of resources)
                    timed.append(dict(cfg=[bn, bk, warps, stages], error=type(e).__name__))
                    continue
                err = rel_err(got, ref)
                assert err < 2e-2, (row["product"], row["M"], kind, bn, bk, err)
                us = time_calls([lambda w=w: launch(kind, x, w, bn, bk, warps, stages) for w in ws]) * 1e3
                timed.append(dict(cfg=[bn, bk, warps, stages], us=us, rel_err=err))
            ok = [t for t in timed if "us" in t]
            row[kind] = timed
            row["best"][kind] = min(ok, key=lambda t: t["us"]) if ok else None
        res["rows"].append(row)
        bf, bd = row["best"]["fma"], row["best"]["dot"]
        print(f"{row['product']:16s} M={row['M']} floor {row['floor_us']:6.1f} | cuBLAS {row['cublas_us']:6.1f} | "
              f"fma {bf['us']:6.1f} {bf['cfg']} | dot {bd['us']:6.1f} {bd['cfg']}", flush=True)
    write(res, args.out, "small_m_gemv_probe.json")


if __name__ == "__main__":
    main()
