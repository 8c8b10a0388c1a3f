"""Tensor-parallel decode step: lychee_compile against transformers' own tensor parallelism, one process per GPU.

    torchrun --nproc-per-node 2 benchmarks/tp_decode.py --cases 131072x4,65536x8 --out $OUT       # 2 GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/tp_decode.py --device cpu --out /tmp/tp_decode         # CPU ranks, gloo

The CPU run (tiny Llama of benchmarks/e2e.py MODELS, 4 layers, contexts of a few hundred tokens, eager backends)
checks the logic only -- every row, the counters, the JSON -- its times mean nothing.

Model: Llama-3-8B shapes (e2e.MODELS["llama8b"]), random weights, sharded by transformers' tensor parallelism: every
rank calls from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto")) (before DistributedConfig:
tp_plan="auto") on a folder holding the config and an EMPTY safetensors file. transformers builds the model on the
meta device, turns every planned weight into a DTensor placeholder and, all weights being missing, initializes each
on the rank's device shard by shard (_init_weights): no checkpoint, no whole weight anywhere. Each compiled model
loads its own copy (seconds); the rows of one case share one StaticCache of this rank's KV heads, random K/V.

Cases (--cases CTXxB,...): decode steps at position CTX (the cache holds CTX valid tokens) with batch B, as e2e.py
drives them (e2e.DecodeLoop: generate()'s decode loop without the prefill; CUDA events around the compiled call).
Rows, in this order within a case unless --rows orders them (--max-seconds cuts from the end):
  flash_dense   lychee_compile(attention="flash_dense"): lychee's dense baseline (FlashAttention-2 varlen over the
                valid length; on the CPU the op's masked reference), CUDA graphs as lychee defaults them
  hybrid_12.5, hybrid_25
                one lychee_compile (budget --budget), then head maps with 12.5% / 25% retrieval KV heads swapped in by
                set_head_map (no recompile). The maps are balanced over the ranks: in every layer each rank holds the
                same number of retrieval heads (whole rounds of one head per rank spread over the layers; with 8 KV
                heads on 2 ranks, 12.5% = 2 heads in half the layers, one per rank), a remainder smaller than a round
                one head per layer to the ranks in turn (balanced_map). Which KV heads a rank holds is read from
                lychee's record (LycheeState.shard), never assumed. (The first global layer is all retrieval on every
                rank whatever the map says, as in one process.)
  hf_tp         transformers as-is: model.get_compiled_call(generation_config.compile_config), i.e. HF's default
                CompileConfig (Inductor, "reduce-overhead" = CUDA graphs, fullgraph=False) as generate() uses it on
                a GPU. If that compile fails under TP, the row runs the uncompiled model and says why ("mode"). On the
                CPU Dynamo's graph runs eagerly (e2e.cpu_compile_config).

Per case: the collectives of one decode step (counted with torch.profiler over one eager step of transformers' TP
model: the process group's own records, as tests/test_tensor_parallel.py counts them) and their time alone
(allreduce_ms): that many all-reduces of [B, 1, hidden] and all-gathers of [B, 1, vocab / ranks] (lm_head's gathered
logits, logits_to_keep=1), --collective-steps steps, each replayed as one CUDA graph (a loop on the CPU), median;
with --lychee symm_mem_all_reduce=true on CUDA also with the all-reduces as lychee::one_shot_all_reduce
(allreduce_one_shot_ms), which is what those lychee rows run and what their ratio adds to their floor.
Per row: ms per step, median and p90 over the timed steps of each rank (reported: rank 0 and the largest over ranks);
floor_ms = (this rank's weight shards + the KV bytes the row reads) / the device-to-device copy rate measured in the
same run (e2e.measure_copy_bw, mean over ranks), where the KV bytes add each layer's LARGEST rank (the two
all-reduces of every layer make each rank wait for the slowest one's attention); the ratio to floor + all-reduce
(the row's kind of all-reduce, allreduce_kind);
hybrid / flash_dense; the retrieval heads and KV bytes per rank (imbalance); Dynamo compiles during the timed steps
(must be 0); the compile (first call) wall time.
Targets (recorded as met or not, not enforced): hybrid_12.5 >= 2.5x flash_dense (stated for 131072x4; computed for
every case), hybrid <= 1.3x floor + all-reduce, flash_dense <= 1.15x floor + all-reduce.

A row fails (its times are dropped from the table, the exit code is 1) when, on any rank: a lychee row rewrote no
attention site, left a graph dense, did not run its rewritten decode graph once per step, or (CUDA) ran a site on the
op's reference; Dynamo compiled during the timed steps; the logits were not finite; or (no CUDA graphs: the CPU) a
step's collectives differ from transformers' eager step. A row that cannot run (out of memory, a compile error) is
recorded with the reason on every rank and the run goes on. Rank 0 writes $OUT/tp_decode.json and tp_decode.md after
every row.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings

# NVLink multicast stays off (a program using it can take a shared host's GPUs out of service): set before NCCL starts,
# never overriding what the environment says
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.e2e import (GIB, MODELS, BenchError, Budget, DecodeLoop, StepClock, Variant, _ctx, _fmt,  # noqa: E402
                            all_retrieval_map, cpu_compile_config, delta, dynamo_counts, find, first_call,
                            greedy_without_eos, kv_read_bytes, layer_counts, lychee_config, lychee_overrides,
                            make_cache, max_cache_len,
                            measure_copy_bw, memory_now, model_config, quantile, quiet_effective, recompiles_of,
                            release_compiled, reset_peak, setup_environment, sync, targets_table, time_decode,
                            weights_bytes)
from examples.tensor_parallel import load_sharded  # noqa: E402

ROWS = ("flash_dense", "hybrid_12.5", "hybrid_25", "hf_tp")
SHARES = {"hybrid_12.5": 0.125, "hybrid_25": 0.25}
COLLECTIVE_TIMEOUT_S = 600
CPU_DEFAULTS = dict(model="tiny", layers=4, cases="256x2,128x4", budget=64, local=16, steps=8, warmup=2,
                    collective_steps=20)
GPU_DEFAULTS = dict(model="llama8b", layers=None, cases="131072x4,65536x8", budget=4096, local=64, steps=100,
                    warmup=10, collective_steps=100)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="default llama8b (CPU: tiny)")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (CPU default 4)")
    ap.add_argument("--cases", default=None, help="comma list of CONTEXTxBATCH (default 131072x4,65536x8; CPU "
                                                  "256x2,128x4)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}, in priority order")
    ap.add_argument("--budget", type=int, default=None, help="hybrid budget in tokens (default 4096; CPU 64)")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--local", type=int, default=None, help="local tokens (default 64; CPU 16)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per row (default 100; CPU 8)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default 10; CPU 2)")
    ap.add_argument("--collective-steps", type=int, default=None, help="timed steps of the collectives alone")
    ap.add_argument("--max-seconds", type=float, default=540.0,
                    help="start no row after this many seconds (the JSON keeps what ran)")
    ap.add_argument("--compile-reserve", type=float, default=None,
                    help="start no compile with less time left than this (default 100 s on CUDA, 0 on the CPU)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="keep TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR as set (default: fresh ones, cold compile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lychee", action="append", default=[], metavar="KEY=JSON",
                    help="LycheeConfig field for every lychee row, e.g. --lychee defer_selection=false (as e2e.py)")
    ap.add_argument("--kernels", default="", metavar="FIELD=VALUE,...", help="KernelOptions (as e2e.py)")
    ap.add_argument("--profile-rows", default="", metavar="ROW,...",
                    help="after timing these rows, --profile-steps more steps under torch.profiler on every rank "
                         "(CUDA graphs as timed): kernel time by category, NCCL's share, the main stream's idle gaps")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--skip-guard-eval-unsafe", action="store_true",
                    help="a probe, not a setting to use: time the rows under torch.compiler.set_stance("
                         "skip_guard_eval_unsafe=True), Dynamo's guards not evaluated per call (their host cost)")
    ap.add_argument("--no-local-shards", action="store_true",
                    help="a probe, not a setting to use: compiled calls take the DTensor weights themselves "
                         "(tensor_parallel.LocalLinearShards off), to time what the local shards save")
    ap.add_argument("--symm-mem-backend", choices=("NVSHMEM", "CUDA", "NCCL"), default=None,
                    help="torch's symmetric-memory backend for --lychee symm_mem_all_reduce=true (symm_mem."
                         "set_backend before any buffer; default: torch's choice, recorded per case as "
                         "symm_mem_backend_used; CUDA asked this way raised on torch 2.11)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in (CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.no_local_shards:
        import lychee_compile.install
        lychee_compile.install.local_linear_shards = lambda model: None
    if args.compile_reserve is None:
        args.compile_reserve = 100.0 if args.device == "cuda" else 0.0
    args.case_list = [tuple(int(x) for x in c.lower().split("x")) for c in args.cases.split(",") if c.strip()]
    args.row_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.profile_list = [r.strip() for r in args.profile_rows.split(",") if r.strip()]
    unknown = sorted((set(args.row_list) | set(args.profile_list)) - set(ROWS))
    if unknown or not args.case_list or any(len(c) != 2 for c in args.case_list):
        raise BenchError(f"--rows from {ROWS} (got {unknown or args.rows}); --cases as CONTEXTxBATCH,...")
    if args.steps < 1 or args.warmup < 0:
        raise BenchError("--steps must be >= 1 and --warmup >= 0.")
    if args.symm_mem_backend and (args.device != "cuda" or not lychee_overrides(args).get("symm_mem_all_reduce")):
        raise BenchError("--symm-mem-backend needs --device cuda and --lychee symm_mem_all_reduce=true.")
    args.no_cuda_graphs = False               # e2e.lychee_config: lychee's default (CUDA graphs on a GPU)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    args.positions = max(max_cache_len(case_args(args, ctx)) for ctx, _ in args.case_list)
    return args


def case_args(args, ctx: int):
    """The arguments e2e's helpers read (context_list: first_call's and max_cache_len's context)."""
    cargs = copy.copy(args)
    cargs.context_list = [ctx]
    return cargs


# ------------------------------------------------------------------------------------------------ ranks
def rank() -> int:
    return dist.get_rank()


def say(*parts) -> None:
    if rank() == 0:
        print(*parts, flush=True)


def gathered(value) -> list:
    """value of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def lead_decides(value):
    """Rank 0's value on every rank: decisions that must not differ between ranks (the clock)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_every_rank(fn):
    """fn() on every rank; if it raised on any rank, every rank raises that rank's error (lychee's own
    tensor_parallel.agreed), so no rank walks into a collective the others never reach."""
    from lychee_compile.tensor_parallel import agreed
    return agreed(dist.group.WORLD, fn)


# ------------------------------------------------------------------------------------------------ model
def config_folder(args) -> str:
    """Rank 0 writes the model's config and an empty safetensors file to a temporary folder (from_pretrained then
    initializes every weight, each rank its shards); every rank gets its path."""
    box = [None]
    if rank() == 0:
        from safetensors.torch import save_file
        box[0] = tempfile.mkdtemp(prefix="tp_decode_model_")
        model_config(args.model, args.positions, args.layers).save_pretrained(box[0])
        save_file({}, os.path.join(box[0], "model.safetensors"), metadata={"format": "pt"})
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load(folder: str, args):
    import transformers
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()      # its load report lists every weight as missing: all are, by design
    transformers.logging.disable_progress_bar()
    try:
        torch.manual_seed(args.seed)
        return greedy_without_eos(load_sharded(folder, args.dtype))
    finally:
        transformers.logging.set_verbosity(level)


def local_kv_heads(model) -> int:
    """KV heads this rank's attention computes (its k_proj shard's rows / head_dim): what its cache holds."""
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    rows = k_proj.to_local().shape[0] if hasattr(k_proj, "to_local") else k_proj.shape[0]
    return rows // model.config.head_dim


# ------------------------------------------------------------------------------------------------ collectives
def step_collectives(model, forward, cache, ctx: int, batch: int, device: str) -> dict:
    """{kind: count} of the collectives one decode step of `forward` issues on this rank: the process group's own
    operation records (`<backend>:<op>`, what tests/test_tensor_parallel.py counts), kinds all_reduce / all_gather."""
    from torch.profiler import ProfilerActivity, profile
    loop = DecodeLoop(model, forward, cache, batch, model.config.vocab_size, device)
    loop.start(ctx)
    prefix = f"{dist.get_backend()}:"
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        loop.step()
        sync(device)
    names = [e.name[len(prefix):] for e in prof.events() if e.name.startswith(prefix)]
    kinds = ["all_reduce" if "all_reduce" in n or "allreduce" in n else
             "all_gather" if "all_gather" in n or "allgather" in n else n for n in names]
    return dict(collections.Counter(kinds))


def time_collectives(counts: dict, batch: int, cfg, dtype, device: str, steps: int, one_shot=None) -> dict:
    """One decode step's collectives alone, at a TP Llama decode step's sizes: counts["all_reduce"] all-reduces of
    [B, 1, hidden] (o_proj, down_proj, a vocabulary-sharded embedding) and counts["all_gather"] all-gathers of
    [B, 1, vocab / ranks] (lm_head's logits). Each step replays one CUDA graph of them (a loop on the CPU, or where
    capture fails); median and p90 ms per step over `steps`. one_shot = one_shot_group(...): the all-reduces are
    lychee::one_shot_all_reduce, what a lychee row runs with LycheeConfig.symm_mem_all_reduce; the all-gathers stay
    the process group's."""
    world = dist.get_world_size()
    hidden = torch.zeros(batch, 1, cfg.hidden_size, dtype=dtype, device=device)      # zeros: sums stay finite
    part = torch.zeros(batch, 1, cfg.vocab_size // world, dtype=dtype, device=device)
    whole = torch.empty(world * batch, 1, cfg.vocab_size // world, dtype=dtype, device=device)

    def all_reduce():
        if one_shot is None:
            dist.all_reduce(hidden)
        else:
            torch.ops.lychee.one_shot_all_reduce(hidden, one_shot[1], one_shot[0].group_name)

    def step():
        for _ in range(counts.get("all_reduce", 0)):
            all_reduce()
        for _ in range(counts.get("all_gather", 0)):
            dist.all_gather_into_tensor(whole, part)
    for _ in range(3):
        step()
    sync(device)
    run, method = step, "loop"
    if device == "cuda":
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run, method = graph.replay, "CUDA graph, one replay per step"
        except Exception as exc:  # noqa: BLE001  (recorded: the loop's time includes launches)
            method = f"loop (CUDA graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    for _ in range(3):
        run()
    clock = StepClock(device)
    for _ in range(steps):
        clock.around(run)
    ts = clock.times_ms()
    return dict(allreduce_ms=statistics.median(ts), allreduce_p90_ms=quantile(ts, 0.9), method=method)


# ------------------------------------------------------------------------------------------------ head maps, bytes
def balanced_map(model, share: float, shards: list[list[int]], seed: int):
    """round(share * layers * kv_heads) retrieval heads placed so that every rank holds the same number in each layer:
    whole rounds (one head per rank) spread over the layers as evenly as possible (e2e.layer_counts), random heads
    within a rank's shard; a remainder smaller than a round goes one head per layer to the ranks in turn. Each layer's
    all-reduces make every rank wait for the slowest one's attention, so retrieval heads of one layer on one rank would
    cost their time on all ranks."""
    from lychee_compile import HeadMap
    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    world = len(shards)
    total = max(1, round(share * layers * kv))
    gen = torch.Generator().manual_seed(seed)
    rounds, extra = layer_counts(layers, total // world, gen), layer_counts(layers, total % world, gen)
    retrieval = torch.zeros(layers, kv, dtype=torch.bool)
    turn = 0
    for layer in range(layers):
        for r, heads in enumerate(shards):
            k = int(rounds[layer]) + int(bool(extra[layer]) and r == turn % world)
            retrieval[layer, torch.tensor(heads)[torch.randperm(len(heads), generator=gen)[:k]]] = True
        turn += int(extra[layer])
    return HeadMap(retrieval, {"method": f"balanced share {share} over {world} ranks"}).with_model_metadata(model)


def kv_bytes(row: str, effective, shards: list[list[int]], cfg, batch: int, valid: float, args) -> dict:
    """K+V bytes each rank reads per step (e2e.kv_read_bytes, one layer and one rank's KV heads at a time) and the
    synchronized total: each layer's largest rank, summed over the layers."""
    per_rank_layer = []
    for heads in shards:
        one = types.SimpleNamespace(config=types.SimpleNamespace(num_hidden_layers=1, num_key_value_heads=len(heads),
                                                                 head_dim=cfg.head_dim), dtype=args.dtype)
        per_rank_layer.append([kv_read_bytes(one, row, batch, valid, args.budget, args.sink, args.local,
                                             None if effective is None else effective[layer:layer + 1, heads])
                               for layer in range(cfg.num_hidden_layers)])
    return dict(per_rank=[sum(b) for b in per_rank_layer],
                synchronized=sum(max(b) for b in zip(*per_rank_layer)))


def imbalance(effective, shards) -> dict:
    counts = torch.stack([effective[:, heads].sum(1) for heads in shards])           # [ranks, layers]
    return dict(retrieval_heads_per_rank=counts.sum(1).tolist(),
                max_layer_spread=int((counts.max(0).values - counts.min(0).values).max()))


# ------------------------------------------------------------------------------------------------ one case
def run_case(args, ctx: int, batch: int, folder: str, copy_bw: float, clock: Budget, results: dict) -> None:
    cargs = case_args(args, ctx)
    case = dict(context=ctx, batch=batch)
    results["cases"].append(case)
    cache = None
    for group in dict.fromkeys("hybrid" if r in SHARES else r for r in args.row_list):
        rows = [r for r in args.row_list if (r in SHARES and group == "hybrid") or r == group]
        if not lead_decides(clock.left() > args.compile_reserve):
            results["skipped"] += [dict(context=ctx, batch=batch, row=r, reason="--max-seconds (compile reserve)")
                                   for r in rows]
            say(f"skip {rows} at {ctx}x{batch}: less than --compile-reserve {args.compile_reserve:.0f} s left")
            continue
        t0 = time.perf_counter()
        model = load(folder, args)
        load_s = time.perf_counter() - t0
        try:
            if cache is None:
                cache = on_every_rank(lambda: prepare_case(cargs, model, case, copy_bw))
                write_results(args, results)
            run_group(cargs, group, rows, model, cache, case, load_s, clock, results)
        except Exception as exc:  # noqa: BLE001  (raised on every rank by on_every_rank: recorded, the run goes on)
            error = f"{type(exc).__name__}: {str(exc)[:600]}"
            done = {r["row"] for r in results["rows"] if r["context"] == ctx and r["batch"] == batch}
            results["rows"] += [dict(context=ctx, batch=batch, row=r, error=error) for r in rows if r not in done]
            say(f"   FAILED {rows} at {ctx}x{batch}: {error}")
        del model
        release_compiled()
        write_results(args, results)
    del cache
    release_compiled()


def prepare_case(cargs, model, case: dict, copy_bw: float):
    """The case's cache (this rank's KV heads), its weight bytes per rank, and one eager step's collectives (counted,
    then timed alone), taken on a freshly loaded, uncompiled model."""
    ctx, batch, device = case["context"], case["batch"], cargs.device
    kv_heads = local_kv_heads(model)
    cache = make_cache(model, batch, max_cache_len(cargs), device, cargs.dtype, cargs.seed + batch, kv_heads=kv_heads)
    counts, source = step_collectives(model, model, cache, ctx, batch, device), "profiled: one eager decode step"
    if not counts.get("all_reduce"):
        counts = dict(all_reduce=2 * model.config.num_hidden_layers, all_gather=1)
        source = "assumed (the profiler saw none): o_proj and down_proj per layer, lm_head's gather"
    timed = time_collectives(counts, batch, model.config, cargs.dtype, device, cargs.collective_steps)
    # what the lychee rows' all-reduces run as where they opt in (--lychee symm_mem_all_reduce=true)
    one_shot = one_shot_group(model, device) if lychee_overrides(cargs).get("symm_mem_all_reduce") else None
    if one_shot is not None:
        alone = time_collectives(counts, batch, model.config, cargs.dtype, device, cargs.collective_steps, one_shot)
        timed.update(allreduce_one_shot_ms=alone["allreduce_ms"], allreduce_one_shot_p90_ms=alone["allreduce_p90_ms"],
                     symm_mem_backend=one_shot[2])
    per_rank = gathered(dict(kv_heads=kv_heads, weights=weights_bytes(model, batch), collectives=counts, **timed))
    case.update(kv_heads_per_rank=[p["kv_heads"] for p in per_rank], weights_bytes_per_rank=[p["weights"] for p in
                per_rank], collectives_per_step=per_rank[0]["collectives"],
                collectives_agree=all(p["collectives"] == per_rank[0]["collectives"] for p in per_rank),
                collectives_source=source,
                collective_shapes=dict(all_reduce=[batch, 1, model.config.hidden_size],
                                       all_gather=[batch, 1, model.config.vocab_size // len(per_rank)]),
                allreduce_ms=max(p["allreduce_ms"] for p in per_rank),
                allreduce_p90_ms=max(p["allreduce_p90_ms"] for p in per_rank), allreduce_method=per_rank[0]["method"],
                allreduce_one_shot_ms=max((p["allreduce_one_shot_ms"] for p in per_rank
                                           if "allreduce_one_shot_ms" in p), default=None),
                symm_mem_backend_used=per_rank[0].get("symm_mem_backend"),
                copy_bw_TBps=copy_bw / 1e12, max_cache_len=max_cache_len(cargs))
    one_shot_ms = case["allreduce_one_shot_ms"]
    say(f"== case {_ctx(ctx)}x{batch}: {case['kv_heads_per_rank']} KV heads per rank, collectives per step "
        f"{case['collectives_per_step']}, alone {case['allreduce_ms']:.3f} ms ({case['allreduce_method']})"
        f"{'' if one_shot_ms is None else f', with one-shot all-reduces {one_shot_ms:.3f} ms'}, weights "
        f"{max(case['weights_bytes_per_rank']) / GIB:.2f} GiB per rank")
    return cache


def one_shot_group(model, device: str):
    """(the model's TP group, a rendezvoused buffer, torch's symmetric-memory backend that allocated it) as
    lychee_compile makes them for symm_mem_all_reduce, or None where lychee would not use them (CPU ranks; symmetric
    memory failing here: printed)."""
    from lychee_compile.tensor_parallel import process_group, symm_mem_backend, symmetric_buffer
    group = process_group(model)
    if device != "cuda" or group is None:
        return None
    try:
        buffer = symmetric_buffer(group, torch.device("cuda", torch.cuda.current_device()))
        return group, buffer, symm_mem_backend(buffer.device)
    except Exception as exc:  # noqa: BLE001  (the lychee rows will say the same: their config resolves it off)
        say(f"   symmetric memory unavailable: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def run_group(cargs, group: str, rows: list[str], model, cache, case: dict, load_s: float, clock: Budget,
              results: dict) -> None:
    """One compiled model (flash_dense, hybrid = both shares on one compile, hf_tp) and its rows."""
    ctx, batch = case["context"], case["batch"]
    say(f"== {group} {_ctx(ctx)}x{batch}: loaded in {load_s:.1f} s, compiling ...")
    variant, mode = on_every_rank(lambda: build(cargs, group, model))
    compile_info = compile_first_call(cargs, variant, cache, batch)
    mode = compile_info.pop("mode", None) or mode
    graphs = compile_info["cuda_graphs"]
    shards = [list(range(sum(case["kv_heads_per_rank"][:r]), sum(case["kv_heads_per_rank"][:r + 1])))
              for r in range(len(case["kv_heads_per_rank"]))]       # counts only matter for dense rows
    state = getattr(variant.model, "_lychee_state", None)
    if state is not None and state.shard is not None:
        shards = gathered(state.shard.heads)
    for row in rows:
        if not lead_decides(clock.left() > 0):
            results["skipped"].append(dict(context=ctx, batch=batch, row=row, reason="--max-seconds"))
            continue
        effective = None
        if row in SHARES:
            import lychee_compile
            head_map = balanced_map(variant.model, SHARES[row], shards, cargs.seed)
            with warnings.catch_warnings():       # the first global layer is all retrieval: the map says what it says
                warnings.simplefilter("ignore")
                on_every_rank(lambda: lychee_compile.set_head_map(variant.model, head_map))
            effective = quiet_effective(head_map, variant.global_layers)
        mine = on_every_rank(lambda: time_row(cargs, variant, cache, case, graphs, row))
        rec = row_record(cargs, case, row, mode, compile_info, load_s, gathered(mine), effective, shards,
                         variant.model.config)
        results["rows"].append(rec)
        print_row(rec)
        write_results(cargs, results)


def build(cargs, group: str, model):
    """The compiled model of a group (lychee_compile'd with the all-retrieval map; hf_tp: as transformers leaves it)
    and what runs it, in words."""
    from lychee_compile import lychee_compile
    if group == "hf_tp":
        from transformers import CompileConfig
        if cargs.device == "cpu":
            model.generation_config.compile_config = cpu_compile_config()
        cc = model.generation_config.compile_config or CompileConfig()
        return Variant("hf", model), (f"transformers get_compiled_call: backend={cc.backend} mode={cc.mode} "
                                         f"fullgraph={cc.fullgraph}")
    kind = "flash_dense" if group == "flash_dense" else "lychee"
    lychee_compile(model, all_retrieval_map(model), lychee_config(cargs, kind, cargs.budget))
    config = model._lychee_state.config
    return (Variant(group, model, budget=cargs.budget, global_layers=model._lychee_state.global_layers),
            f"lychee_compile: backend={config.backend} cuda_graphs={config.cuda_graphs} attention={config.attention}")


def compile_first_call(cargs, variant, cache, batch: int) -> dict:
    """e2e.first_call on every rank (the compile: first call wall time, then the CUDA-graph recording call), with
    Inductor's CUDA-graph skips counted. hf_tp: if the compile fails, the uncompiled model (mode says why)."""
    from torch._dynamo.utils import counters
    skips0 = counters["inductor"].get("cudagraph_skips", 0)
    try:
        info = on_every_rank(lambda: first_call(variant, cache, cargs, batch))
    except Exception as exc:  # noqa: BLE001  (hf_tp falls back to eager; lychee rows fail)
        if variant.name != "hf":
            raise
        release_compiled()
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        say(f"   hf_tp: HF's compiled call failed under TP ({why}); timing the uncompiled model")
        variant.forward = variant.model
        loop = DecodeLoop(variant.model, variant.model, cache, batch, variant.model.config.vocab_size, cargs.device)
        loop.start(cargs.context_list[0])
        with torch.no_grad():
            loop.step()
        info = dict(compile_s=None, mode=f"eager (HF's compiled call failed under TP: {why})")
    info["cuda_graphs"] = cuda_graphs_of(cargs, variant)
    info["cudagraph_skips"] = counters["inductor"].get("cudagraph_skips", 0) - skips0
    per_rank = gathered(dict(compile_s=info["compile_s"], skips=info["cudagraph_skips"]))
    info["compile_s"] = None if info["compile_s"] is None else max(p["compile_s"] for p in per_rank)
    info["cudagraph_skips"] = max(p["skips"] for p in per_rank)
    say(f"   compile (first call) {_fmt(info['compile_s'], '.1f')} s, counts {info.get('compile_counts')}, "
        f"CUDA-graph skips {info['cudagraph_skips']}")
    info.pop("compile_phases", None)
    return info


def cuda_graphs_of(cargs, variant) -> bool:
    """Whether the variant's step replays CUDA graphs: lychee's resolved config; transformers' "reduce-overhead"
    mode on a GPU (not the uncompiled fallback)."""
    state = getattr(variant.model, "_lychee_state", None)
    if state is not None:
        return bool(state.config.cuda_graphs)
    from transformers import CompileConfig
    cc = variant.model.generation_config.compile_config or CompileConfig()
    return cargs.device == "cuda" and variant.forward is not variant.model and cc.mode == "reduce-overhead"


def time_row(cargs, variant, cache, case: dict, graphs: bool, row: str) -> dict:
    """This rank's timing and checks of one row (graphs: the step replays CUDA graphs); its profile if asked."""
    ctx, batch, device = case["context"], case["batch"], cargs.device
    loop = DecodeLoop(variant.model, variant.forward, cache, batch, variant.model.config.vocab_size, device)
    state = getattr(variant.model, "_lychee_state", None)
    calls0 = state.counters.decode_calls if state is not None else None
    before = dynamo_counts()
    reset_peak(device)
    with (torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if cargs.skip_guard_eval_unsafe
          else contextlib.nullcontext()):
        stats = time_decode(loop, ctx, cargs.warmup, cargs.steps, device)
    mine = dict(ms=stats["tpot_ms"], p90_ms=stats["p90_ms"], loop_ms=stats["loop_ms"],
                logits_finite=stats["logits_finite"], recompiles=recompiles_of(delta(dynamo_counts(), before)),
                peak_gb=memory_now(device)["peak_gb"])
    if state is not None:
        c = state.counters
        mine.update(one_shot_all_reduce=state.config.symm_mem_all_reduce,
                    all_reduces_one_shot=c.all_reduces_one_shot, all_reduces_kept=c.all_reduces_kept)
        mine.update(decode_calls=c.decode_calls - calls0, sites_rewritten=c.sites_rewritten,
                    graphs_left_dense=c.graphs_left_dense, sites_on_kernel=c.sites_on_kernel,
                    sites_on_reference=c.sites_on_reference, linears_fused=c.linears_fused)
    if not graphs:      # a CUDA graph's replay issues its collectives without the records the profiler counts
        mine["collectives"] = step_collectives(variant.model, variant.forward, cache, ctx, batch, device)
    if row in cargs.profile_list:
        mine["profile"] = profile_steps(loop, cargs.profile_steps, device)
    return mine


def host_profile(loop, steps: int, device: str) -> dict:
    """The CPU side of `steps` decode steps under cProfile (a step that launches CUDA graphs should cost the host far
    less than the GPU's step): wall ms per step without a sync inside, and the functions with the most own time."""
    import cProfile
    import pstats
    sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with torch.no_grad():
        prof.enable()
        for _ in range(steps):
            loop.step()
        prof.disable()
        host_s = time.perf_counter() - t0
    sync(device)
    stats = pstats.Stats(prof).stats
    rows = sorted(((fn, st[2], st[3], st[1]) for fn, st in stats.items()), key=lambda x: -x[1])[:30]
    cum = sorted(((fn, st[3], st[1]) for fn, st in stats.items()), key=lambda x: -x[1])[:30]
    name = lambda fn: f"{os.path.basename(fn[0])}:{fn[1]}({fn[2]})"      # noqa: E731
    return dict(host_ms_per_step=host_s * 1e3 / steps,
                own=[dict(fn=name(fn), own_ms=round(t * 1e3 / steps, 4), calls=n / steps) for fn, t, _, n in rows],
                cumulative=[dict(fn=name(fn), ms=round(t * 1e3 / steps, 4), calls=n / steps) for fn, t, n in cum])


def profile_steps(loop, steps: int, device: str) -> dict:
    """This rank's device kernels over `steps` more decode steps (the loop goes on where the timing left it):
    ms per step by category (e2e's, NCCL first), the top kernels, and the last step's main-stream timeline: busy,
    idle gaps, NCCL kernels (their time includes waiting for the other ranks)."""
    from torch.profiler import ProfilerActivity, profile
    from benchmarks.e2e import kernel_category, kernel_timeline, profile_events
    cuda = device == "cuda"
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) \
            as prof:
        for _ in range(steps):
            loop.step()
        sync(device)
    events = profile_events(prof, cuda)
    category = lambda name: ("NCCL" if "nccl" in name.lower() else "one-shot all-reduce (symm_mem)"     # noqa: E731
                             if "one_shot_all_reduce" in name.lower() else kernel_category(name))
    cats = collections.Counter()
    for name, t, _ in events:
        cats[category(name)] += t / 1e3 / steps
    timeline = kernel_timeline(prof, steps) if cuda else []
    main = [k for k in timeline if k["gap_us"] is not None]           # main-stream kernels after the first
    rec = dict(steps=steps, host=host_profile(loop, steps, device), ms_per_step_by_category={c: round(v, 4) for c, v in cats.most_common()},
               top=[dict(name=n[:100], category=category(n), ms_per_step=round(t / 1e3 / steps, 4),
                         calls_per_step=k / steps) for n, t, k in sorted(events, key=lambda x: -x[1])[:25]])
    if timeline:
        span = max(k["start_us"] + k["dur_us"] for k in timeline)
        nccl = [k for k in timeline if "nccl" in k["name"].lower()]
        gaps = sorted((k["gap_us"] for k in main if k["gap_us"]), reverse=True)
        rec.update(last_step_span_us=span, kernels=len(timeline), streams=len({k["stream"] for k in timeline}),
                   nccl_kernels=len(nccl), nccl_us=sum(k["dur_us"] for k in nccl),
                   nccl_us_sorted=[round(k["dur_us"], 1) for k in sorted(nccl, key=lambda k: -k["dur_us"])][:12],
                   main_idle_us=sum(gaps), main_gaps_top_us=[round(g, 1) for g in gaps[:12]],
                   timeline=[dict(name=k["name"][:60], stream=k["stream"], start_us=round(k["start_us"], 1),
                                  dur_us=round(k["dur_us"], 1)) for k in timeline])
    return rec


def row_errors(cargs, case: dict, per_rank: list[dict]) -> list[str]:
    """Why a row's numbers cannot stand (any rank): see the module docstring."""
    errors = []
    for r, p in enumerate(per_rank):
        if not p["logits_finite"]:
            errors.append(f"rank {r}: non-finite logits")
        if p["recompiles"]:
            errors.append(f"rank {r}: {p['recompiles']} Dynamo compiles during the timed steps")
        if ("collectives" in p and case["collectives_source"].startswith("profiled")
                and p["collectives"] != case["collectives_per_step"]):
            errors.append(f"rank {r}: a step issued {p['collectives']}, transformers' eager step "
                          f"{case['collectives_per_step']}")
        if "decode_calls" not in p:
            continue
        if p["sites_rewritten"] == 0 or p["graphs_left_dense"]:
            errors.append(f"rank {r}: {p['sites_rewritten']} sites rewritten, {p['graphs_left_dense']} graphs left "
                          "dense (the sparse path did not run)")
        if p["decode_calls"] != cargs.warmup + cargs.steps:
            errors.append(f"rank {r}: the rewritten decode graph ran {p['decode_calls']} times in "
                          f"{cargs.warmup + cargs.steps} steps")
        if p.get("one_shot_all_reduce") and not p["all_reduces_one_shot"]:
            errors.append(f"rank {r}: symm_mem_all_reduce on, but no all-reduce became one-shot")
        if cargs.device == "cuda" and p["sites_on_reference"]:
            errors.append(f"rank {r}: {p['sites_on_reference']} sites on the op's reference, not the kernels")
    return errors


def row_record(cargs, case, row, mode, compile_info, load_s, per_rank, effective, shards, cfg) -> dict:
    ctx, batch = case["context"], case["batch"]
    valid = ctx + 1 + cargs.warmup + (cargs.steps - 1) / 2        # mean valid length over the timed steps
    kv = kv_bytes(row, effective, shards, cfg, batch, valid, cargs)
    weights = max(case["weights_bytes_per_rank"])
    floor_ms = (weights + kv["synchronized"]) / (case["copy_bw_TBps"] * 1e12) * 1e3
    one_shot = any(p.get("one_shot_all_reduce") for p in per_rank)       # the row's all-reduces, timed alone as such
    allreduce_ms = case["allreduce_one_shot_ms"] if one_shot else case["allreduce_ms"]
    rec = dict(context=ctx, batch=batch, row=row, mode=mode, steps=cargs.steps, warmup=cargs.warmup,
               ms_median_rank0=per_rank[0]["ms"], ms_median_max=max(p["ms"] for p in per_rank),
               ms_p90_rank0=per_rank[0]["p90_ms"], ms_p90_max=max(p["p90_ms"] for p in per_rank),
               loop_ms_max=max(p["loop_ms"] for p in per_rank), floor_ms=floor_ms,
               allreduce_ms=allreduce_ms, allreduce_kind="symm_mem one-shot" if one_shot else "process group",
               weights_bytes_per_rank=weights, kv_bytes_per_rank=kv["per_rank"],
               kv_bytes_synchronized=kv["synchronized"], mean_valid=valid, load_s=load_s,
               compile_s=compile_info["compile_s"], compile_counts=compile_info.get("compile_counts"),
               compile_peak_gb_rank0=compile_info.get("compile_peak_gb"), cuda_graphs=compile_info["cuda_graphs"],
               cudagraph_skips=compile_info["cudagraph_skips"],
               recompiles=max(p["recompiles"] for p in per_rank),
               peak_gb=max((p["peak_gb"] for p in per_rank if p["peak_gb"] is not None), default=None),
               per_rank=per_rank)
    rec["x_floor_allreduce"] = rec["ms_median_max"] / (floor_ms + allreduce_ms)
    if effective is not None:
        rec.update(imbalance(effective, shards), budget=cargs.budget)
    errors = row_errors(cargs, case, per_rank)
    if errors:
        rec["error"] = "; ".join(errors)
        for k in ("ms_median_rank0", "ms_median_max", "ms_p90_rank0", "ms_p90_max", "loop_ms_max",
                  "x_floor_allreduce"):
            rec[f"unreliable_{k}"] = rec.pop(k)
    return rec


def print_row(r: dict) -> None:
    if rank() != 0:
        return
    if "error" in r:
        print(f"   FAILED {r['row']} {_ctx(r['context'])}x{r['batch']}: {r['error']}", flush=True)
        return
    spread = f" retrieval heads per rank {r['retrieval_heads_per_rank']}" if "retrieval_heads_per_rank" in r else ""
    print(f"   {_ctx(r['context'])}x{r['batch']} {r['row']:<12} {r['ms_median_rank0']:.3f} ms (max over ranks "
          f"{r['ms_median_max']:.3f}, p90 {r['ms_p90_max']:.3f}) | floor {r['floor_ms']:.3f} + all-reduce "
          f"{r['allreduce_ms']:.3f} ms -> x{r['x_floor_allreduce']:.2f} | recompiles {r['recompiles']}{spread}",
          flush=True)
    for i, p in enumerate(r["per_rank"]):
        prof = p.get("profile")
        if prof:
            print(f"   profile rank {i}: ms/step by category {prof['ms_per_step_by_category']}; last step: "
                  f"span {_fmt(prof.get('last_step_span_us'), '.0f')} us, {prof.get('kernels')} kernels on "
                  f"{prof.get('streams')} streams, NCCL {prof.get('nccl_kernels')} kernels "
                  f"{_fmt(prof.get('nccl_us'), '.0f')} us (largest {prof.get('nccl_us_sorted')}), main-stream idle "
                  f"{_fmt(prof.get('main_idle_us'), '.0f')} us (largest gaps {prof.get('main_gaps_top_us')})",
                  flush=True)
            host = prof["host"]
            print(f"   host (cProfile, rank {i}): {host['host_ms_per_step']:.3f} ms per step; own time: " + "; ".join(
                f"{h['fn']} {h['own_ms']:.3f} ms x{h['calls']:.0f}" for h in host["own"][:10]), flush=True)
            for t in prof["top"][:12]:
                print(f"      {t['ms_per_step']:.4f} ms x{t['calls_per_step']:.0f} {t['category']}: {t['name']}",
                      flush=True)


# ------------------------------------------------------------------------------------------------ output
def targets(results: dict) -> list[dict]:
    out = []

    def add(name, value, ok):
        out.append(dict(target=name, measured=value, met=None if value is None else bool(ok(value))))
    for case in results["cases"]:
        where = dict(context=case["context"], batch=case["batch"])
        label = f"{_ctx(case['context'])}x{case['batch']}"
        flash = find(results["rows"], row="flash_dense", **where)
        h12 = find(results["rows"], row="hybrid_12.5", **where)
        add(f"hybrid_12.5 >= 2.5x flash_dense ({label})",
            flash and h12 and flash["ms_median_max"] / h12["ms_median_max"], lambda v: v >= 2.5)
        for row in SHARES:
            r = find(results["rows"], row=row, **where)
            add(f"{row} <= 1.3x (floor + all-reduce) ({label})", r and r["x_floor_allreduce"], lambda v: v <= 1.3)
        add(f"flash_dense <= 1.15x (floor + all-reduce) ({label})", flash and flash["x_floor_allreduce"],
            lambda v: v <= 1.15)
    return out


def markdown(results: dict) -> str:
    m = results["meta"]
    lines = [f"tensor-parallel decode step, {m['world']} x {m['devices'][0]} ({m['backend']}), {m['model']} "
             f"({m['layers']} layers), torch {m['torch']}, transformers {m['transformers']}, {m['date']}", "",
             "| ctx x B | row | ms/step median r0 (max) | p90 max | floor ms | all-reduce ms | x (floor+AR) "
             "| flash_dense / row | retrieval heads per rank | KV GB per rank | compile s | recompiles | peak GB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in results["rows"]:
        label = f"{_ctx(r['context'])}x{r['batch']}"
        if "error" in r or "ms_median_max" not in r:
            lines.append(f"| {label} | {r['row']} | FAILED: {r.get('error', '?')[:160]} |||||||||||")
            continue
        flash = find(results["rows"], row="flash_dense", context=r["context"], batch=r["batch"])
        ratio = flash and flash["ms_median_max"] / r["ms_median_max"]
        kv = "/".join(f"{b / 1e9:.2f}" for b in r["kv_bytes_per_rank"])
        lines.append(f"| {label} | {r['row']} | {r['ms_median_rank0']:.3f} ({r['ms_median_max']:.3f}) | "
                     f"{r['ms_p90_max']:.3f} | {r['floor_ms']:.3f} | {r['allreduce_ms']:.3f} | "
                     f"{r['x_floor_allreduce']:.2f} | {_fmt(ratio, '.2f')} | "
                     f"{'/'.join(map(str, r.get('retrieval_heads_per_rank', []))) or '-'} | {kv} | "
                     f"{_fmt(r['compile_s'], '.1f')} | {r['recompiles']} | {_fmt(r['peak_gb'], '.1f')} |")
    lines += ["", targets_table(results)]
    lines += ["", "modes: " + "; ".join(sorted({f"{r['row']}: {r['mode']}" for r in results["rows"] if "mode" in r}))]
    lines += [f"skipped: {s['row']} {_ctx(s['context'])}x{s['batch']} ({s['reason']})" for s in results["skipped"]]
    return "\n".join(lines)


def write_results(args, results: dict) -> None:
    if rank() != 0:
        return
    results["targets"] = targets(results)
    with open(os.path.join(args.out, "tp_decode.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, "tp_decode.md"), "w") as f:
        f.write(markdown(results) + "\n")


def meta_of(args, env: dict, copy_bw: list[float]) -> dict:
    import transformers
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), argv=sys.argv,
                torch=torch.__version__, transformers=transformers.__version__, world=dist.get_world_size(),
                backend=dist.get_backend(), model=args.model,
                layers=args.layers or MODELS[args.model]["num_hidden_layers"], dtype=str(args.dtype),
                cases=args.case_list, rows=args.row_list, budget=args.budget, sink=args.sink, local=args.local,
                steps=args.steps, warmup=args.warmup, collective_steps=args.collective_steps,
                copy_bw_TBps_per_rank=[b / 1e12 for b in copy_bw],
                devices=gathered(torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
                nccl_env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                         "NVSHMEM_DISABLE_NVLS")},
                symm_mem_backend=args.symm_mem_backend,
                # the hybrid rows' config as given (defaults included), so a record says what ran
                lychee_config=dataclasses.asdict(lychee_config(args, "lychee", args.budget)), **env)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


# ------------------------------------------------------------------------------------------------ main
def run(args) -> int:
    if rank() == 0:
        os.makedirs(args.out, exist_ok=True)
    env = setup_environment(args)
    clock = Budget(args.max_seconds)
    folder = config_folder(args)
    copy_bw = gathered(measure_copy_bw(args.device))
    results = dict(meta=meta_of(args, env, copy_bw), cases=[], rows=[], skipped=[], targets=[])
    say(json.dumps(results["meta"], default=str))
    try:
        for ctx, batch in args.case_list:
            run_case(args, ctx, batch, folder, statistics.fmean(copy_bw), clock, results)
    finally:
        write_results(args, results)
        dist.barrier()
        if rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    say("\n" + markdown(results))
    failed = [r for r in results["rows"] if "error" in r]
    say(f"wrote {os.path.join(args.out, 'tp_decode.json')}" + (f"; {len(failed)} rows FAILED" if failed else ""))
    dist.barrier()                     # rank 0 has printed: a failing exit code now ends no rank's output early
    return 1 if failed and rank() == 0 else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        if args.symm_mem_backend:
            from torch.distributed import _symmetric_memory as symm_mem
            symm_mem.set_backend(args.symm_mem_backend)
        return run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
