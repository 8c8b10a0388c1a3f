"""The decode attention kernel benchmark: one layer of hybrid decode attention, Llama-3-8B shapes (32 q / 8 KV heads,
d=128, bf16).

Run on a CUDA machine:  PYTHONUNBUFFERED=1 python benchmarks/attention_bench.py --out DIR [--quick]
                        [--head-dim 96]   (another head dim for every row, e.g. Phi-3's 96, padded inside the kernels)

1. Correctness first: random bf16 inputs (fresh per check, never zeros), outputs poisoned (NaN / -7) before the run,
   every element must be written; out vs the eager reference (fp32 math) by relative L2 norm; idx_out identical
   except where the reference's block scores tie at the threshold.
2. Timing: median of CUDA-graph replays (each replay runs many calls back to back, rotating over enough input sets
   that each call's bytes are out of L2), for
     ours        the two Triton kernels (split + combine/select) of lychee_compile/lowering/kernels/
     cudnn/flash F.scaled_dot_product_attention over the valid length, enable_gqa=True, one backend forced
     gather      PyTorch hybrid: SDPA over retrieval heads' full cache + gather of the sparse heads' tokens + SDPA
                 (attention only: no block scores, no selection)
     floor       bytes each must move / device-to-device copy bandwidth measured in the same run
Writes results.json and results.png to --out and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lychee_compile.lowering.standalone import make_launchers, workspace  # noqa: E402
from lychee_compile.ops.reference import hybrid_decode_reference, masked_softmax, block_sum  # noqa: E402
from lychee_compile.ops.index_state import empty_index_state  # noqa: E402

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
BS, SINK, LOCAL = 16, 16, 64
L2_BYTES = 50 * 2 ** 20


def set_head_dim(d: int) -> None:
    """Every row's head dim (the module's D; Llama-3-8B's 128 unless --head-dim)."""
    global D
    D = d


def rand(*shape, device="cuda", dtype=torch.bfloat16):
    return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)


def random_index(B, T, K, device):
    """Distinct sorted blocks per (row, head), outside sink/local blocks (all rows fully valid here)."""
    nb = -(-T // BS)
    lo_blk = -(-SINK // BS)
    hi_blk = (T - LOCAL) // BS
    cand = torch.arange(lo_blk, hi_blk, device=device)
    idx = torch.full((B, HKV, K), -1, dtype=torch.int32, device=device)      # EMPTY-padded if K > candidates
    for b in range(B):
        for h in range(HKV):
            perm = cand[torch.randperm(len(cand), device=device)[:K]]
            idx[b, h, :len(perm)] = torch.sort(perm).values.to(torch.int32)
    return idx


def measure_copy_bw():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    t = statistics.median(ts)
    del a, b
    return 2 * n / t


def time_calls(calls, reps=10, min_calls=16):
    """Median ms per call: calls is a list of zero-arg closures (one per input set); a CUDA graph runs them round
    robin `per_graph` times; replays timed with events."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    per_graph = max(min_calls, len(calls))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(per_graph):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / per_graph)
    del g
    return statistics.median(ts)


def n_sets_for(bytes_touched, cap=12):
    return max(1, min(cap, math.ceil(4 * L2_BYTES / max(bytes_touched, 1))))


# ------------------------------------------------------------------------------------------------ correctness
def ref_block_scores(q, k, valid, scale):
    B = q.shape[0]
    T = k.shape[2]
    nb = -(-T // BS)
    s = torch.einsum("bhgd,bhtd->bhgt", q.float().reshape(B, k.shape[1], -1, q.shape[-1]), k.float()) * scale
    return block_sum(masked_softmax(s, valid[:, None, None, :]).sum(2), BS, nb)


def check_once(B, Hkv, Gq, Dh, T, K, retr, pads, dtype=torch.bfloat16, **kw):
    dev = "cuda"
    q, k, v = rand(B, Hkv * Gq, 1, Dh, dtype=dtype), rand(B, Hkv, T, Dh, dtype=dtype), rand(B, Hkv, T, Dh, dtype=dtype)
    valid = torch.zeros(B, T, dtype=torch.bool, device=dev)
    for b, (lo, hi) in enumerate(pads):
        valid[b, lo:hi] = True
    retrieval = torch.tensor(retr, dtype=torch.bool, device=dev)
    q0 = rand(B, Hkv * Gq, 1, Dh, dtype=dtype)
    _, idx_in = hybrid_decode_reference(q0, k, v, valid, torch.ones(Hkv, dtype=torch.bool, device=dev),
                                        empty_index_state(B, Hkv, K, dev), Dh ** -0.5, BS, SINK, LOCAL)
    out = torch.full_like(q, float("nan"))
    idx_out = torch.full_like(idx_in, -7)
    split, combine, out, idx_out, _ = make_launchers(q, k, v, valid, retrieval, idx_in, Dh ** -0.5, BS, SINK, LOCAL,
                                                  out=out, idx_out=idx_out, **kw)
    split()
    combine()
    torch.cuda.synchronize()
    ref_out, ref_idx = hybrid_decode_reference(q, k, v, valid, retrieval, idx_in, Dh ** -0.5, BS, SINK, LOCAL)
    ok_written = bool(torch.isfinite(out.float()).all()) and bool((idx_out >= -1).all())
    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    mism = (idx_out != ref_idx)
    idx_ok = True
    n_mism_rows = 0
    if mism.any():
        sc = ref_block_scores(q, k, valid, Dh ** -0.5)
        for b, h in mism.any(-1).nonzero().tolist():
            n_mism_rows += 1
            a = set(idx_out[b, h].tolist()) - {-1}
            r = set(ref_idx[b, h].tolist()) - {-1}
            diff = sorted(a ^ r)
            if len(a) != len(r) or not retr[h] or any(x < 0 or x >= sc.shape[-1] for x in diff):
                idx_ok = False
                continue
            vals = sc[b, h, diff]
            if (vals.max() - vals.min()).item() > 1e-5 * vals.abs().max().item():
                idx_ok = False
    res = dict(B=B, Hkv=Hkv, G=Gq, D=Dh, T=T, K=K, dtype=str(dtype), written=ok_written, rel_err=err,
               idx_ok=idx_ok, idx_mismatch_rows=n_mism_rows, passed=ok_written and err < 1e-2 and idx_ok)
    print("check", res, flush=True)
    return res


# ------------------------------------------------------------------------------------------------ benchmark
def bench_config(T, B, n_retr, budget, bw, variants=None, time_baselines=True, cache=None, parts=True, cap=None):
    """One row. T valid tokens per row; cap (>= T, default T) the cache length they sit in (the decode step's
    situation: a 4K prompt in a 128K static cache)."""
    dev = "cuda"
    cap = T if cap is None else cap
    K = budget // BS
    scale = D ** -0.5
    kv_bytes_full = B * HKV * T * D * 2 * 2
    sparse_tok = (K + (-(-SINK // BS) + 1) + (-(-LOCAL // BS) + 1)) * BS
    ours_bytes = B * D * 2 * 2 * (n_retr * T + (HKV - n_retr) * min(sparse_tok, T))
    n_sets = n_sets_for(ours_bytes)
    free = torch.cuda.mem_get_info()[0]
    n_sets = max(1, min(n_sets, int(0.5 * free // (kv_bytes_full * cap // T + 1))))
    sets = []
    for _ in range(n_sets):
        q = rand(B, HQ, 1, D)
        k = rand(B, HKV, cap, D)
        v = rand(B, HKV, cap, D)
        sets.append((q, k, v))
    valid = torch.zeros(B, cap, dtype=torch.bool, device=dev)
    valid[:, :T] = True
    retrieval = torch.zeros(HKV, dtype=torch.bool, device=dev)
    retrieval[:n_retr] = True
    idx_in = random_index(B, T, K, dev)
    row = dict(T=T, cap=cap, B=B, D=D, n_retr=n_retr, share=n_retr / HKV, budget=budget, n_sets=n_sets,
               ours_bytes=ours_bytes, dense_bytes=kv_bytes_full)
    row["floor_ours_ms"] = ours_bytes / bw * 1e3
    row["floor_dense_ms"] = kv_bytes_full / bw * 1e3
    variants = variants or {"ours": {}}
    first = {}
    for name, kw in variants.items():
        launchers = []
        ws = workspace(B, HKV, G, D, cap, BS, kw.get("num_splits") or 2 * torch.cuda.get_device_properties(0).multi_processor_count, dev)
        idx_v = idx_in
        if "extra_width" in kw:     # the mass variant (heat / Quest picks): KX extra blocks, disjoint from idx_in
            kw = dict(kw)
            both = random_index(B, T, K + kw.pop("extra_width"), dev)
            idx_v, kw["extra"] = both[..., :K].contiguous(), both[..., K:].contiguous()
        for (q, k, v) in sets:
            launchers.append(make_launchers(q, k, v, valid, retrieval, idx_v, scale, BS, SINK, LOCAL, ws=ws, **kw))
        s0, c0, out0, idx0, _ = launchers[0]
        s0(), c0()
        torch.cuda.synchronize()
        first[name] = (out0.clone(), idx0.clone())
        if name != "ours" and "ours" in first and "extra_width" not in variants[name]:
            # a tuning variant must compute the same function: same inputs, same outputs and index sets as ours
            o_ref, i_ref = first["ours"]
            row[f"{name}_same_idx"] = bool(torch.equal(idx0, i_ref))
            row[f"{name}_max_out_diff"] = (out0.float() - o_ref.float()).abs().max().item()
        row[f"{name}_ms"] = time_calls([(lambda s=s, c=c: (s(), c())) for s, c, *_ in launchers])
        if name != "ours":
            row[f"{name}_combine_ms"] = time_calls([c for _, c, *_ in launchers])
            row[f"{name}_split_ms"] = time_calls([s for s, *_ in launchers])
        if name == "ours" and parts:
            row["ours_split_ms"] = time_calls([s for s, *_ in launchers])
            row["ours_combine_ms"] = time_calls([c for _, c, *_ in launchers])
            # the same combine with no retrieval head (merge + index copy only): selection ~ the difference
            q, k, v = sets[0]
            s_, c_, _, _, _ = make_launchers(q, k, v, valid, torch.zeros_like(retrieval), idx_in, scale, BS, SINK, LOCAL,
                                          ws=ws, **kw)
            s_()
            row["ours_combine_nosel_ms"] = time_calls([c_])
            row["selection_share"] = (row["ours_combine_ms"] - row["ours_combine_nosel_ms"]) / row["ours_ms"]
    if time_baselines:
        key = (T, B)
        if cache is not None and key in cache:
            row.update(cache[key])
        else:
            base = {}
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for bname, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    def mk(q, k, v, backend=backend):
                        def f():
                            with sdpa_kernel(backend):
                                F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
                        return f
                    base[f"{bname}_ms"] = time_calls([mk(q, k[:, :, :T], v[:, :, :T]) for q, k, v in sets])
                except Exception as e:  # noqa: BLE001
                    base[f"{bname}_ms"] = None
                    base[f"{bname}_error"] = repr(e)[:300]
            if cache is not None:
                cache[key] = base
            row.update(base)
        # PyTorch gather + SDPA hybrid (attention only)
        nb = -(-T // BS)
        sink_b = torch.arange(0, -(-SINK // BS), device=dev)
        loc_b = torch.arange((T - LOCAL) // BS, nb, device=dev)
        blocks = torch.cat([sink_b[None, None].expand(B, HKV - n_retr, -1), idx_in[:, n_retr:].long(),
                            loc_b[None, None].expand(B, HKV - n_retr, -1)], -1)
        tok = (blocks[..., None] * BS + torch.arange(BS, device=dev)).flatten(-2).clamp(0, T - 1)
        tokx = tok[..., None].expand(-1, -1, -1, D)

        def mkg(q, k, v):
            k, v = k[:, :, :T], v[:, :, :T]
            def f():
                outs = []
                if n_retr:
                    outs.append(F.scaled_dot_product_attention(q[:, :n_retr * G], k[:, :n_retr], v[:, :n_retr],
                                                               scale=scale, enable_gqa=True))
                if n_retr < HKV:
                    ks = torch.gather(k[:, n_retr:], 2, tokx)
                    vs = torch.gather(v[:, n_retr:], 2, tokx)
                    outs.append(F.scaled_dot_product_attention(q[:, n_retr * G:], ks, vs, scale=scale,
                                                               enable_gqa=True))
                return torch.cat(outs, 1)
            return f
        try:
            row["gather_ms"] = time_calls([mkg(*s) for s in sets])
        except Exception as e:  # noqa: BLE001
            row["gather_ms"] = None
            row["gather_error"] = repr(e)[:300]
    row["ours_pct_of_floor"] = 100 * row["floor_ours_ms"] / row["ours_ms"]
    if row.get("cudnn_ms"):
        row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["ours_ms"]
    if parts:
        row["combine_share"] = row["ours_combine_ms"] / row["ours_ms"]
    del sets
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--tune", action="store_true", help="time kernel variants on the headline configs")
    ap.add_argument("--profile", action="store_true", help="torch.profiler kernel times of the headline config")
    ap.add_argument("--variants", default=None, help='extra kernel variants timed beside ours on every row, JSON '
                    '{"name": {make_launchers keyword: value}}, e.g. \'{"cw8": {"combine_warps": 8}}\'; "extra_width": N times the mass variant with N extra blocks per sparse head')
    ap.add_argument("--rows", default=None, help="only these rows: T:B:n_retr:budget[:cap],... (cap = cache length "
                    "the T valid tokens sit in, default T)")
    ap.add_argument("--plot", default=None, metavar="JSON", help="only redraw the plot of a results JSON (no GPU)")
    ap.add_argument("--head-dim", type=int, default=D, help="head dim of every row (default 128; e.g. 96 for Phi-3: "
                    "the kernels pad it to a power of two inside; bytes and floors count the true head dim)")
    args = ap.parse_args()
    set_head_dim(args.head_dim)
    os.makedirs(args.out, exist_ok=True)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.join(args.out, os.path.basename(args.plot).rsplit(".", 1)[0] + ".png"))
        return
    t_start = time.time()
    prop = torch.cuda.get_device_properties(0)
    import triton
    meta = dict(device=prop.name, sms=prop.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), argv=sys.argv)
    print(meta, flush=True)
    results = dict(meta=meta, checks=[], rows=[], tune=[])
    torch.manual_seed(0)
    if not args.skip_check:
        for c in [
            dict(B=1, Hkv=8, Gq=4, Dh=128, T=16384, K=256, retr=[True, True] + [False] * 6, pads=[(0, 16384)]),
            dict(B=2, Hkv=8, Gq=4, Dh=128, T=8192 + 77, K=128, retr=[False, True, False, False, True, False, False, True],
                 pads=[(0, 8269), (1234, 8269)]),
            dict(B=2, Hkv=4, Gq=1, Dh=64, T=4000, K=64, retr=[True, False, True, False], pads=[(0, 4000), (17, 3990)]),
            dict(B=1, Hkv=2, Gq=3, Dh=256, T=5000, K=64, retr=[True, False], pads=[(100, 5000)]),
            dict(B=2, Hkv=2, Gq=7, Dh=128, T=3000, K=32, retr=[False, True], pads=[(0, 3000), (500, 2900)]),
            dict(B=1, Hkv=2, Gq=8, Dh=128, T=6000, K=64, retr=[True, False], pads=[(0, 6000)], dtype=torch.float16),
            dict(B=1, Hkv=8, Gq=4, Dh=128, T=131072, K=256, retr=[True, True] + [False] * 6, pads=[(0, 131072)]),
            dict(B=1, Hkv=8, Gq=4, Dh=128, T=20000, K=128, retr=[True] * 8, pads=[(0, 20000)], nbr_max=256),
            dict(B=2, Hkv=8, Gq=4, Dh=96, T=8192 + 77, K=128, retr=[True, False] * 4, pads=[(0, 8269), (901, 8269)]),
            dict(B=1, Hkv=32, Gq=1, Dh=80, T=6000, K=64, retr=[True] * 4 + [False] * 28, pads=[(0, 6000)],
                 dtype=torch.float16),
        ]:
            results["checks"].append(check_once(**c))
        print("all checks passed:", all(c["passed"] for c in results["checks"]), flush=True)
    bw = measure_copy_bw()
    results["meta"]["copy_bw_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    sms = prop.multi_processor_count
    if args.tune:
        no_reader = torch.zeros(HKV, dtype=torch.bool, device="cuda")
        variants = {
            "ours": {},
            "cost1": dict(sparse_cost=1),
            "cost3": dict(sparse_cost=3),
            "cw8": dict(combine_warps=8),
            "cw32": dict(combine_warps=32),
            "cost2_s3x": dict(num_splits=3 * sms),
            "noselect": dict(select=no_reader),     # no head's selection is read (e.g. the next layer all retrieval)
        }
        for T, B, nr, bud in [(131072, 1, 2, 4096), (131072, 1, 1, 4096), (131072, 1, 8, 4096), (131072, 4, 1, 4096)]:
            r = bench_config(T, B, nr, bud, bw, variants=variants, time_baselines=False)
            print("tune", json.dumps(r), flush=True)
            results["tune"].append(r)
    if args.profile:
        profile_headline(results)
    ctxs = [16384, 32768, 65536, 131072]
    batches = [1, 2, 4]
    shares = [1, 2, 4]
    budgets = [1024, 2048, 4096]
    if args.rows:
        grid = [tuple(int(x) for x in r.split(":")) for r in args.rows.split(",")]
    elif args.quick:
        grid = [(131072, 1, 2, 4096), (131072, 1, 1, 4096), (131072, 1, 8, 4096), (131072, 4, 1, 4096),
                (32768, 2, 2, 2048), (16384, 4, 4, 1024)]
    else:
        grid = [(T, B, nr, bud) for T in ctxs for B in batches for nr in shares for bud in budgets]
    cache = {}
    for T, B, nr, bud, *cap in grid:
        variants = dict({"ours": {}}, **json.loads(args.variants)) if args.variants else None
        r = bench_config(T, B, nr, bud, bw, cache=cache, parts=(bud == 4096 or bool(args.rows)),
                         cap=cap[0] if cap else None, variants=variants)
        results["rows"].append(r)
        print(f"T={T:6d} cap={r['cap']} B={B} D={D} retr={nr}/8 budget={bud}: ours {r['ours_ms']:.4f} ms ({r['ours_pct_of_floor']:.0f}% "
              f"of floor {r['floor_ours_ms']:.4f}) split {r.get('ours_split_ms')} combine {r.get('ours_combine_ms')} "
              f"| cudnn {r.get('cudnn_ms')} flash {r.get('flash_ms')} gather {r.get('gather_ms')} "
              f"| x{r.get('speedup_vs_cudnn', float('nan')):.2f} vs cudnn "
              + "".join(f"| {k} {v:.4f} " for k, v in r.items() if k.endswith("_ms") and not k.startswith(("ours", "floor", "cudnn", "flash", "gather")))
              + "".join(f"| {k} {v} " for k, v in r.items() if k.endswith(("_same_idx", "_max_out_diff")))
              + f" [{time.time() - t_start:.0f}s]", flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    try:
        plot(results, os.path.join(args.out, "results.png"))
    except Exception as e:  # noqa: BLE001
        print("plot failed", e)
    print("\nT       B  retr budget | ours_ms  %floor  split  combine | cudnn_ms flash_ms gather_ms | x_cudnn")
    for r in results["rows"]:
        f = lambda x: f"{x:.4f}" if isinstance(x, float) else str(x)  # noqa: E731
        print(f"{r['T']:6d} {r['B']} {r['n_retr']}/8 {r['budget']:5d} | {f(r['ours_ms'])} {r['ours_pct_of_floor']:5.0f}% "
              f"{f(r.get('ours_split_ms'))} {f(r.get('ours_combine_ms'))} | {f(r.get('cudnn_ms'))} {f(r.get('flash_ms'))} "
              f"{f(r.get('gather_ms'))} | {r.get('speedup_vs_cudnn', float('nan')):.2f}")
    print(f"total {time.time() - t_start:.0f}s")


def profile_headline(results, T=131072, B=1, n_retr=2, budget=4096):
    """Per-kernel device times (torch.profiler, no graph) of split + combine, to see where time goes."""
    from torch.profiler import ProfilerActivity, profile
    K = budget // BS
    q, k, v = rand(B, HQ, 1, D), rand(B, HKV, T, D), rand(B, HKV, T, D)
    valid = torch.ones(B, T, dtype=torch.bool, device="cuda")
    retrieval = torch.zeros(HKV, dtype=torch.bool, device="cuda")
    retrieval[:n_retr] = True
    idx_in = random_index(B, T, K, "cuda")
    split, combine, _, _, _ = make_launchers(q, k, v, valid, retrieval, idx_in, D ** -0.5, BS, SINK, LOCAL)
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        split(); combine()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            flush.zero_()
            split()
            combine()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)
    print(table, flush=True)
    results["profile"] = table


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in results["rows"] if r["budget"] == 4096]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), sharey=False)
    for ax, B in zip(axes, [1, 2, 4]):
        for nr, color in [(1, "C0"), (2, "C1"), (4, "C2")]:
            rs = sorted([r for r in rows if r["B"] == B and r["n_retr"] == nr], key=lambda r: r["T"])
            if rs:
                ax.plot([r["T"] for r in rs], [r["ours_ms"] for r in rs], "o-", color=color,
                        label=f"ours {nr}/8 retr (all work)")
            if rs and all(r.get("dp_ms") for r in rs):   # --variants dp: what the compiled model runs
                ax.plot([r["T"] for r in rs], [r["dp_ms"] for r in rs], "^--", color=color,
                        label=f"ours {nr}/8 retr (critical path)")
        rs = sorted({r["T"]: r for r in rows if r["B"] == B}.values(), key=lambda r: r["T"])
        for key, lab, fmt, color in [("cudnn_ms", "cuDNN dense", "s-", "k"), ("flash_ms", "flash dense", "s-", "0.55"),
                                     ("floor_dense_ms", "dense floor", "s:", "0.3")]:
            if rs and all(r.get(key) for r in rs):
                ax.plot([r["T"] for r in rs], [r[key] for r in rs], fmt, color=color, label=lab, alpha=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"batch {B}, budget 4096")
        ax.set_xlabel("context")
        ax.set_ylabel("ms per layer")
        ax.legend(fontsize=7)
    fig.suptitle(f"hybrid decode, Llama-3-8B attention, {results['meta']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
