"""How far is cuBLAS from the copy rate on a decode step's matrix-vector products, and would a plain Triton GEMV do
better? A probe toward a batch-1 step within 1.2x of its bytes floor (docs/design-notes.md): not part of the library.

For each Llama-3-8B decode product (x [M, K] @ W[N, K]^T, bf16, M = batch rows; the shapes after fuse_linears):
cuBLAS through F.linear (and through cuBLASLt, torch.backends.cuda.preferred_blas_library), and a Triton GEMV (rows of W per program, optional split-K with fp32 atomics) over a small
grid of tile shapes. Timed as CUDA-graph replays rotating over enough weight copies that each call reads from DRAM;
bytes = weight + activations; rate = bytes / time; "% copy" against a device-to-device copy measured in the same run.
Every Triton result is checked against F.linear (relative error) before it is timed.

    python benchmarks/probes/gemv_probe.py [--m 1] [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import triton
import triton.language as tl

SHAPES = {"qkv (fused)": (6144, 4096), "o_proj": (4096, 4096), "gate_up (fused)": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}


@triton.jit
def gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                K_PER_SPLIT: tl.constexpr, BM: tl.constexpr, ATOMIC: tl.constexpr):
    # program (pid_n, pid_k): rows [pid_n*BLOCK_N, +BLOCK_N) of W over K range [pid_k*K_PER_SPLIT, +K_PER_SPLIT)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BM)
    acc = tl.zeros([BM, BLOCK_N], tl.float32)
    k0 = pid_k * K_PER_SPLIT
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        rk = k0 + kk + tl.arange(0, BLOCK_K)
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        for i in tl.static_range(BM):     # M <= BM rows of x: one multiply-reduce each (no tensor cores at M=1)
            xi = tl.load(X + i * stride_xm + rk, mask=(rk < K) & (rk * 0 + i < M), other=0.0)
            part = tl.sum(w.to(tl.float32) * xi.to(tl.float32)[None, :], 1)
            acc += tl.where(rm[:, None] == i, part[None, :], 0.0)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ATOMIC:
        tl.atomic_add(Y + rm[:, None] * stride_ym + rn[None, :], acc, mask=mask)
    else:
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc, mask=mask)


def triton_gemv(x, w, y32, block_n, block_k, split_k, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    kps = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, kps))
    gemv_kernel[grid](x, w, y32, M, N, K, x.stride(0), w.stride(0), y32.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                      K_PER_SPLIT=kps, BM=max(1, triton.next_power_of_2(M)), ATOMIC=grid[1] > 1,
                      num_warps=warps, num_stages=stages)


def copy_rate() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 20 / (time.perf_counter() - t0)


def time_graph(fns) -> float:
    """Median ms per call: one CUDA graph replays every fn once (rotating weight copies), 20 replays."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / len(fns))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--skip-triton", action="store_true", help="time cuBLAS and cuBLASLt only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_rate()
    rows = []
    configs = list(itertools.product((16, 32, 64), (256, 512), (1, 2, 4), (4, 8), (3,)))
    for name, (N, K) in SHAPES.items():
        copies = max(2, -(-200_000_000 // (N * K * 2)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
        x = torch.randn(args.m, K, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws[0]).float()
        nbytes = N * K * 2 + args.m * (N + K) * 2
        row = dict(shape=name, N=N, K=K, M=args.m, bytes=nbytes, floor_us=nbytes / bw * 1e6)
        row["cublas_us"] = 1e3 * time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
        # the same F.linear through cuBLASLt (torch.backends.cuda.preferred_blas_library: a process-wide setting)
        default_blas = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            y_lt = torch.nn.functional.linear(x, ws[0]).float()
            row["cublaslt_rel_err"] = ((y_lt - ref).norm() / ref.norm()).item()
            row["cublaslt_us"] = 1e3 * time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
        finally:
            torch.backends.cuda.preferred_blas_library(default_blas)
        row["cublas_pct_copy"] = 100 * row["floor_us"] / row["cublas_us"]
        row["cublaslt_pct_copy"] = 100 * row["floor_us"] / row["cublaslt_us"]
        if args.skip_triton:
            rows.append(row)
            print(json.dumps(row), flush=True)
            del ws
            torch.cuda.empty_cache()
            continue
        best = None
        for bn, bk, sk, nw, ns in configs:
            if bk > K // sk:
                continue
            y = torch.zeros(args.m, N, device="cuda", dtype=torch.float32)
            try:
                triton_gemv(x, ws[0], y, bn, bk, sk, nw, ns)
            except Exception as exc:      # e.g. out of shared memory for this tile: skip the config
                print(f"  {name} {bn}x{bk} sk{sk} w{nw} s{ns}: {type(exc).__name__}", flush=True)
                continue
            err = ((y - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise SystemExit(f"{name} {bn}x{bk} sk{sk}: relative error {err}")
            ys = [torch.zeros(args.m, N, device="cuda", dtype=torch.float32) for _ in ws]
            fns = [(lambda w=w, yy=yy: (yy.zero_() if sk > 1 else None, triton_gemv(x, w, yy, bn, bk, sk, nw, ns)))
                   for w, yy in zip(ws, ys)]
            us = 1e3 * time_graph(fns)
            if best is None or us < best[0]:
                best = (us, dict(block_n=bn, block_k=bk, split_k=sk, warps=nw, stages=ns, rel_err=err))
        row["triton_us"], row["triton_config"] = best
        row["triton_pct_copy"] = 100 * row["floor_us"] / row["triton_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_TBps=bw / 1e12, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), m=args.m)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gemv_probe_m{args.m}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n{meta}\n| product | N x K | floor us | cuBLAS us (% copy) | cuBLASLt us (% copy) | Triton GEMV us "
          "(% copy) | Triton config |")
    for r in rows:
        triton_cell = (f"{r['triton_us']:.1f} ({r['triton_pct_copy']:.0f}%) | {r['triton_config']}" if "triton_us" in r
                       else "- | -")
        print(f"| {r['shape']} | {r['N']} x {r['K']} | {r['floor_us']:.1f} | {r['cublas_us']:.1f} "
              f"({r['cublas_pct_copy']:.0f}%) | {r['cublaslt_us']:.1f} ({r['cublaslt_pct_copy']:.0f}%) | {triton_cell} |")


if __name__ == "__main__":
    main()
