"""Would prefetching the next product's weights into L2, during the latency-bound kernels before it, speed up a
decode step? A probe toward a batch-1 step within 1.2x of its bytes floor (docs/design-notes.md): not part of the
library.

Why: at batch 1 the o_proj (32 MB) and fused q/k/v (48 MB) products run at ~70-77% of the copy rate (a profile of
the step), while the kernels just before them (the hybrid combine, the residual add + RMSNorm) move almost no bytes
for ~5-12 us. The H100's L2 holds 50 MB. If a fire-and-forget prefetch issued before those kernels lands (part of)
the next weight in L2, the product reads it from there.

Scenarios (Llama-3-8B shapes, bf16, batch 1), each timed as CUDA-graph replays rotating over weight copies so that
every product starts from DRAM unless a prefetch brought it in:
  O: attention split -> [prefetch W_o] -> combine (DEFER, the model's critical path) -> o_proj
  Q: down_proj -> [prefetch W_qkv] -> residual add + RMSNorm -> q/k/v (fused)
Prefetch kinds: "bulk" (cp.async.bulk.prefetch.L2, one instruction per CHUNK bytes, sm_90), "line"
(prefetch.global.L2::evict_last per 128-byte line), "load" (ld with evict_last, summed into a dummy).

    python benchmarks/probes/l2_prefetch_probe.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(BENCH))   # the repository root, for lychee_compile
sys.path.insert(0, BENCH)                    # benchmarks/, for attention_bench
from attention_bench import measure_copy_bw, time_calls  # noqa: E402  (benchmarks/ is no package)


@triton.jit
def _prefetch_bulk(W, DUMMY, NCHUNK, CHUNK: tl.constexpr, PER: tl.constexpr):
    # program p: chunks [p*PER, (p+1)*PER) of CHUNK bytes each
    c = tl.program_id(0) * PER + tl.arange(0, PER)
    ptr = W.to(tl.pointer_type(tl.int8)) + c.to(tl.int64) * CHUNK
    ptr = tl.where(c < NCHUNK, ptr, W.to(tl.pointer_type(tl.int8)))
    r = tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK}; mov.u32 $0, 0;", "=r,l",
                                  [ptr], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(DUMMY + tl.program_id(0), tl.sum(r, 0))


@triton.jit
def _prefetch_line(W, DUMMY, NLINE, PER: tl.constexpr):
    c = tl.program_id(0) * PER + tl.arange(0, PER)
    ptr = W.to(tl.pointer_type(tl.int8)) + c.to(tl.int64) * 128
    ptr = tl.where(c < NLINE, ptr, W.to(tl.pointer_type(tl.int8)))
    r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [ptr], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(DUMMY + tl.program_id(0), tl.sum(r, 0))


@triton.jit
def _prefetch_load(W, DUMMY, N, PER: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    base = tl.program_id(0).to(tl.int64) * PER
    for i in range(0, PER, BLOCK):
        o = base + i + tl.arange(0, BLOCK)
        acc += tl.load(W + o, mask=o < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(DUMMY + tl.program_id(0), tl.sum(acc, 0))


DUMMY = {}


def prefetch(w: torch.Tensor, kind: str, nbytes: int | None = None):
    nbytes = w.numel() * w.element_size() if nbytes is None else nbytes
    dummy = DUMMY.setdefault(w.device, torch.zeros(4096, dtype=torch.float32, device=w.device))
    if kind == "bulk":
        chunk, per = 16384, 32
        n = nbytes // chunk
        _prefetch_bulk[(triton.cdiv(n, per),)](w, dummy, n, CHUNK=chunk, PER=per, num_warps=1)
    elif kind == "line":
        per = 1024
        n = nbytes // 128
        _prefetch_line[(triton.cdiv(n, per),)](w, dummy, n, PER=per, num_warps=4)
    elif kind == "load":
        n = nbytes // w.element_size()
        per = 1 << 18
        _prefetch_load[(triton.cdiv(n, per),)](w, dummy, n, PER=per, BLOCK=2048, num_warps=8)
    else:
        raise ValueError(kind)


def graph_time(body, reps: int) -> float:
    """us per call of body(r), r = 0 .. reps-1 round robin in one CUDA graph (attention_bench.time_calls)."""
    return time_calls([lambda r=r: body(r) for r in range(reps)], reps=30) * 1e3


def attention_setup(T=131072, retr=1, budget=4096):
    from lychee_compile.lowering.standalone import make_launchers
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hkv, G, D, BS = 1, 8, 4, 128, 16
    q = torch.randn(B, Hkv * G, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool, device="cuda")
    retrieval = torch.zeros(Hkv, dtype=torch.bool, device="cuda")
    retrieval[:retr] = True
    nb = T // BS
    idx = torch.stack([torch.randperm(nb, device="cuda", generator=g)[:budget // BS].sort().values
                       for _ in range(B * Hkv)]).view(B, Hkv, -1).to(torch.int32)
    split, combine, out, _, _ = make_launchers(q, k, v, valid, retrieval, idx, D ** -0.5, BS, 16, 64,
                                               defer=True, defer_launch=False)
    return split, combine, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    bw = measure_copy_bw()
    print(f"device {dev}; copy {bw / 1e12:.3f} TB/s", flush=True)
    res = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), device=dev, torch=torch.__version__,
               triton=triton.__version__, copy_TBps=bw / 1e12, rows=[])
    NC = 8
    wo = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(NC)]
    wqkv = [torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(NC)]
    wd = [torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(NC)]
    x14 = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    res_in = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    gamma = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    split, combine, out = attention_setup()
    x_o = out.view(1, 4096)

    # check: a prefetch changes no value (it writes only the dummy)
    y0 = F.linear(x_o, wo[0]).clone()
    for kind in ("bulk", "line", "load"):
        prefetch(wo[0], kind)
        torch.cuda.synchronize()
        assert torch.equal(F.linear(x_o, wo[0]), y0), kind

    def row(name, body, reps=NC * 2):
        t = graph_time(body, reps)
        res["rows"].append(dict(name=name, us=t))
        print(f"{name:40s} {t:8.2f} us", flush=True)
        return t

    # ---- O: o_proj after the attention ----
    row("o_proj alone (DRAM)", lambda r: F.linear(x_o, wo[r % NC]))
    row("o_proj alone (same weight: L2 warm)", lambda r: F.linear(x_o, wo[0]))
    row("combine alone", lambda r: combine())
    row("split+combine", lambda r: (split(), combine()))
    row("O base: split, combine, o_proj", lambda r: (split(), combine(), F.linear(x_o, wo[r % NC])))
    for kind in ("bulk", "line", "load"):
        row(f"O {kind}: prefetch alone", lambda r, k=kind: prefetch(wo[r % NC], k))
        row(f"O {kind}: prefetch, o_proj", lambda r, k=kind: (prefetch(wo[r % NC], k), F.linear(x_o, wo[r % NC])))
        row(f"O {kind}: split, pf, combine, o_proj",
            lambda r, k=kind: (split(), prefetch(wo[r % NC], k), combine(), F.linear(x_o, wo[r % NC])))
        row(f"O {kind}: pf, split, combine, o_proj",
            lambda r, k=kind: (prefetch(wo[r % NC], k), split(), combine(), F.linear(x_o, wo[r % NC])))

    # ---- Q: q/k/v after down_proj + residual add + RMSNorm ----
    def norm(h):
        return F.rms_norm(h + res_in, (4096,), gamma, 1e-5)

    row("qkv alone (DRAM)", lambda r: F.linear(res_in, wqkv[r % NC]))
    row("down alone (DRAM)", lambda r: F.linear(x14, wd[r % NC]))
    row("Q base: down, norm, qkv", lambda r: F.linear(norm(F.linear(x14, wd[r % NC])), wqkv[r % NC]))
    for kind in ("bulk", "line"):
        for frac in (0.5, 1.0):
            nb = int(6144 * 4096 * 2 * frac)
            row(f"Q {kind} {frac}: down, pf, norm, qkv",
                lambda r, k=kind, n=nb: (h := F.linear(x14, wd[r % NC]), prefetch(wqkv[r % NC], k, n),
                                         F.linear(norm(h), wqkv[r % NC])))
    with open(os.path.join(args.out, "l2_prefetch_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
