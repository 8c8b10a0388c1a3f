"""The re-encode's dense attention (lychee::dense_decode with L queries, FlashAttention-2 varlen over key segments,
the segment plan given as the rewrite gives it) at Llama-3-8B shapes, for several key-segment counts: ms per layer
under a CUDA graph, against the layer's K/V bytes at the copy rate measured in the same run. Outputs are compared
with the first count's.

    python benchmarks/probes/reencode_segments.py --context 131072 --queries 32 --segments 8,16,32,64,128 [--sdpa]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.attention_bench import measure_copy_bw, time_calls  # noqa: E402
from lychee_compile.ops.dense_decode import _flash_varlen, segment_plan, valid_ranges  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--queries", type=int, default=32, help="L: the re-encoded tokens (rectify_every)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32, help="for the per-step total only")
    ap.add_argument("--segments", default="8,16,32,64,128")
    ap.add_argument("--sdpa", action="store_true", help="also time SDPA's cuDNN and FlashAttention backends on the "
                    "same segment shapes, dense (every segment full, no varlen; batch 1): what another kernel gives")
    args = ap.parse_args()
    B, Hkv, G, D, T, L = args.batch, args.kv_heads, args.group, args.head_dim, args.context, args.queries
    torch.manual_seed(0)
    q = torch.randn(B, Hkv * G, L, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(B, T, dtype=torch.bool, device="cuda")
    kv_bytes = 2 * k.numel() * k.element_size()
    rate = measure_copy_bw() / 1e12                                      # TB/s, read + write counted
    floor = kv_bytes / rate / 1e9                                        # ms a layer
    print(f"{torch.cuda.get_device_name()}: context {T}, L {L}, B {B}, {Hkv} KV heads x G {G}, D {D}; K+V "
          f"{kv_bytes / 1e9:.3f} GB a layer, copy rate {rate:.2f} TB/s -> floor {floor:.3f} ms a layer")
    print("| segments | ms a layer | x floor | ms a step (x layers) | max |diff| vs first |")
    print("|---:|---:|---:|---:|---:|")
    first = None
    for S in (int(s) for s in args.segments.split(",")):
        # the plan as the rewrite gives it: computed once per graph, outside every layer's op
        plan = segment_plan(valid_ranges(valid), Hkv, G, T, L, S)
        out = _flash_varlen(q, k, v, valid, D ** -0.5, plan=plan).float()
        first = out if first is None else first
        ms = time_calls([lambda plan=plan: _flash_varlen(q, k, v, valid, D ** -0.5, plan=plan)])
        diff = (out - first).abs().max().item()
        print(f"| {S} | {ms:.3f} | {ms / floor:.2f} | {ms * args.layers:.2f} | {diff:.2e} |", flush=True)
    if args.sdpa:
        time_sdpa(args, floor)


def time_sdpa(args, floor: float) -> None:
    """Each segment a head of L * G query rows over T / S keys, as the varlen path cuts them, but dense."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    Hkv, G, D, T, L = args.kv_heads, args.group, args.head_dim, args.context, args.queries
    print("| segments | SDPA backend | ms a layer | x floor | TFLOP/s |")
    print("|---:|---|---:|---:|---:|")
    for S in (int(s) for s in args.segments.split(",")):
        q = torch.randn(1, Hkv * S, L * G, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, Hkv * S, T // S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v)
            ms = time_calls([run])
            flops = 4 * L * G * T * D * Hkv                                  # QK and PV, 2 flops a multiply-add
            print(f"| {S} | {backend.name} | {ms:.3f} | {ms / floor:.2f} | {flops / ms / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
