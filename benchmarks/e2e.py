"""Whole-model decode TPOT, side by side in one run (random weights; timing needs none).

    python benchmarks/e2e.py --model llama8b --batch 1 --out $OUT            # on the GPU machine
    python benchmarks/e2e.py --dry-run --out /tmp/e2e                       # tiny Llama on the CPU: the logic only
    python benchmarks/e2e.py --plot A.json [B.json ...] --out DIR           # PNG + Markdown table from results
    python benchmarks/e2e.py --dry-run --rows h12_64,h12_64_r32 --contexts 128 --steps 70 --prefill 128,256 \
        --profile-row h12_64 --out /tmp/e2e                                 # the prefill/rectify/profile logic, CPU

Rows (--rows, comma list; each row is timed at every context):
  hf          HF as-is: model.get_compiled_call(generation_config.compile_config) with HF's defaults (Inductor,
              "reduce-overhead"): masked SDPA over max_cache_len after repeat_kv
  flash_dense the best dense path without our kernel: the same rewritten model with
              LycheeConfig(attention="flash_dense"): FlashAttention-2 varlen over the valid length, native GQA
              (on the CPU, dry run: the op's masked reference)
  dense       lychee dense mode: our kernel, every KV head retrieval (budget = the largest of --budgets)
  h12_<b>     lychee hybrid, 12.5% retrieval KV heads (random map), budget <b> tokens
  h25_<b>     lychee hybrid, 25% retrieval KV heads, budget <b>
  h12_<b>_r<R>, h25_<b>_r<R>
              the hybrid row with LycheeConfig(rectify_every=R) (its own compile): rectify.py wraps what
              get_compiled_call returns, so the call this loop times re-encodes the last R tokens densely after every
              R-th step -- through the re-encode's compiled call (compile_reencode, the default; --lychee
              compile_reencode=false times the uncompiled model's). The first call of the variant runs R steps, so
              the re-encode compiles there, not in a timed step. Each context gets a fresh get_compiled_call (a fresh
              rectifier, as each generate() does). TPOT of these rows is the MEAN of the per-step times
              (rectification amortized), not the median; `median_ms` and `rectifications_timed` are recorded next
              to it, and `reencode_ms` (mean time of a step that re-encoded minus the median of those that did not).
              Against the same row without rectification (h12_<b>, timed in the same run at the same batch and
              context): `rectify_overhead` = mean TPOT / its mean TPOT - 1, and `reencode_overhead` = reencode_ms /
              (R x its mean TPOT), the same share from the re-encoding steps alone. With --warmup R and --steps a
              multiple of R every timed window holds exactly steps / R re-encodes
  h12_<b>_heat<N>, h12_<b>_qs<N>, h12_<b>_qall (and h25_)
              the hybrid row with the cross-step cache state (its own compile): heat<N> = LycheeConfig(heat_blocks=N,
              heat_decay=0.9); qs<N> = quest="sparse", quest_blocks=N (sparse heads add their own top N blocks by the
              min/max bound); qall = quest="all" (the Quest baseline: every head selects its own blocks, the head
              map is unused). Their floors add the state's bytes (heat: read + write fp32 per block and KV head;
              Quest: the min/max descriptors of the valid blocks) and the extra blocks' K/V
  floor       per row: (weights bytes + the KV bytes that row must read) / device-to-device copy bandwidth measured
              in the same run (bytes read + written)

How the decode step is driven: exactly as generate()'s _sample() does after the prefill --
model_forward = model.get_compiled_call(generation_config.compile_config); per step
prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs) -> model_forward(**inputs,
return_dict=True) -> _update_model_kwargs_for_generation -> greedy token appended. model_kwargs hold a 2-D
attention_mask and position_ids of the whole sequence, logits_to_keep=1, use_cache=True and the StaticCache
(recorded from a real generate() on transformers 5.17 and 5.23: the compiled call receives input_ids [B,1],
position_ids [B,1], a bool mask [B,1,1,max_cache_len], past_key_values, logits_to_keep, use_cache, return_dict).
No prefill: one StaticCache per batch size (max_cache_len = largest context + warmup + steps), filled with random
K/V on the device; each layer's `cumulative_length` is set to the context, so the next step decodes at that position.
All variants of one batch size share the weights and the cache; each variant is compiled once and timed at every
context and head map (lychee_compile.set_head_map swaps head kinds in place, no recompile). Dynamo's compile count must
not move after the first call of a variant (asserted, >= 200 decode steps per variant with the defaults); CUDA graphs
recorded after it are counted apart (cudagraph_records).

Prefill (--prefill 8192,32768): one forward of a prompt of each length into a fresh StaticCache (max_cache_len =
length + 256, like a generate() with room to decode), HF as-is (the uncompiled base model) and the lychee_compile'd
model (its wrapped forward: prefill stays HF's dense path), alternated, median of --prefill-repeats after one warmup;
logits_to_keep=1 (generate()'s default: only the last position's logits, no [B, L, vocab] tensor); the two last-token
logits must be finite and agree, and lychee's decode counter must not move.

Profile (--profile-row ROW --profile-ctx CTX): that row compiled again WITHOUT CUDA graphs, --profile-steps decode
steps under torch.profiler; kernel time per step grouped by name (lychee split / combine, attention, GEMM, other
Triton, copies/memset, other) plus the top 30 kernels. On the CPU (dry run) the profiler sees CPU ops only. The
warm-up before it: 3 steps, or R + 2 for a rectified row (_r<R>), so the first re-encode's compile and tuning stay out.
Without CUDA graphs a rectified row's re-encode is bound by its host launches there, unlike in the timed rows.

Timing: CUDA events around each compiled call (the decode step itself; the host's prepare/update between steps is
outside), warmup steps first; median, p10 and p90 of the per-step times. `loop_ms` is wall time per step of the
whole generate-like loop (host work included). CPU: perf_counter per step.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2 ** 30
SHARES = {"h12": 0.125, "h25": 0.25}
TARGET_LAYERS = 32


class BenchError(RuntimeError):
    """A precondition of the benchmark is not met; the message says which and what to do."""


# ------------------------------------------------------------------------------------------------ configuration
MODELS = {
    # Llama-3-8B geometry (random weights): 32 layers, 32 q / 8 KV heads, d=128
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                    tie_word_embeddings=False),
    # Llama-3-70B geometry (random weights; tensor-parallel runs: benchmarks/tp_decode.py --model llama70b):
    # 80 layers, 64 q / 8 KV heads, d=128
    "llama70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                     num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                     tie_word_embeddings=False),
    # SmolLM2-135M geometry: 30 layers, 9 q / 3 KV heads, d=64, tied embeddings
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                    tie_word_embeddings=True),
    # dry run: tiny Llama, CPU
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
                 tie_word_embeddings=False),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    ap.add_argument("--batch", default="1", help="comma list of batch sizes (one cache and compile set each)")
    ap.add_argument("--contexts", default="4096,8192,32768,65536,131072",
                    help="comma list of runtime positions (valid lengths) to decode at")
    ap.add_argument("--budgets", default="1024,4096", help="hybrid budgets in tokens (one compile each)")
    ap.add_argument("--rows", default="all",
                    help="comma list of hf, flash_dense, dense, h12_<b>, h25_<b>, h12_<b>_r<R>, h25_<b>_r<R>, all "
                         "(may be combined: all,h12_4096_r32) or none")
    ap.add_argument("--prefill", default="", help="comma list of prompt lengths to time one prefill at (HF vs lychee)")
    ap.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills per model and length")
    ap.add_argument("--profile-row", default=None, help="profile this row (no CUDA graphs) under torch.profiler")
    ap.add_argument("--profile-ctx", type=int, default=None, help="context for --profile-row (default: smallest)")
    ap.add_argument("--profile-steps", type=int, default=10, help="profiled decode steps")
    ap.add_argument("--tag", default="", help="appended to the JSON/PNG file name (separate runs into one $OUT)")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per row and context")
    ap.add_argument("--warmup", type=int, default=10, help="untimed decode steps before each row and context")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--local", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--max-seconds", type=float, default=540.0,
                    help="stop starting new variants/rows after this many seconds (partial JSON is kept)")
    ap.add_argument("--compile-reserve", type=float, default=None,
                    help="do not start a compile with less time left than this (default 100 s on CUDA, 0 on CPU)")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (GPU smoke runs)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny Llama on the CPU, eager backends, small contexts: exercises the whole logic")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="lychee variants without CUDA graphs")
    ap.add_argument("--warm-cache", action="store_true",
                    help="keep TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR as set (default: fresh ones, cold compile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=JSON",
                    help="set torch._inductor.config KEY to the JSON value for every compiled row, e.g. "
                         "combo_kernels=true (a tuning experiment; recorded in the JSON's meta)")
    ap.add_argument("--lychee", action="append", default=[], metavar="KEY=JSON",
                    help="set LycheeConfig KEY to the JSON value for every row compiled by lychee_compile (flash_dense "
                         "too), e.g. tune_kernels=false (an experiment; recorded in the JSON's meta)")
    ap.add_argument("--kernels", default="", metavar="FIELD=VALUE,...",
                    help="LycheeConfig.kernels for every row compiled by lychee_compile, e.g. pdl=false,"
                         "sparse_tile=64:3:2 (KernelOptions.parse; an experiment; recorded in the JSON's meta)")
    ap.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default",
                    help="torch.backends.cuda.preferred_blas_library for the whole run (every row's GEMMs; a "
                         "tuning experiment; recorded in the JSON's meta)")
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="only turn result JSON files into PNG + table")
    args = ap.parse_args(argv)
    return finish_args(args, ap)


def finish_args(args, ap):
    if args.dry_run:
        args.device = "cpu"
        args.model = "tiny" if args.model == "llama8b" else args.model
        if args.contexts == ap.get_default("contexts"):
            args.contexts = "128,256"
        if args.budgets == ap.get_default("budgets"):
            args.budgets = "32,64"
        if args.local == ap.get_default("local"):
            args.local = 16
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.compile_reserve is None:
        args.compile_reserve = 100.0 if args.device == "cuda" else 0.0
    args.batches = [int(x) for x in args.batch.split(",")]
    args.context_list = sorted({int(x) for x in args.contexts.split(",")}, reverse=True)
    args.budget_list = sorted({int(x) for x in args.budgets.split(",")})
    args.row_list = expand_rows(args.rows, args.budget_list)
    args.prefill_list = sorted({int(x) for x in args.prefill.split(",") if x.strip()})
    if args.profile_row is not None:
        expand_rows(args.profile_row, args.budget_list)
        if args.profile_ctx is None:
            args.profile_ctx = min(args.context_list)
    if args.prefill_repeats < 1 or args.profile_steps < 1:
        raise BenchError("--prefill-repeats and --profile-steps must be >= 1.")
    if args.steps < 1 or args.warmup < 0:
        raise BenchError("--steps must be >= 1 and --warmup >= 0.")
    return args


def expand_rows(rows: str, budgets: list[int]) -> list[str]:
    known = ["hf", "flash_dense", "dense"] + [f"{s}_{b}" for b in budgets for s in SHARES]
    if rows.strip() == "none":
        return []
    picked = []
    for r in (r.strip() for r in rows.split(",")):
        for x in (known if r == "all" else [r] if r else []):
            if x not in picked:
                picked.append(x)
    unknown = [r for r in picked if r not in known and feature_of(r) is None]
    if unknown or any(r not in known and feature_of(r)[0] not in known for r in picked):
        raise BenchError(f"unknown rows {unknown or picked}; choose from {known}, all, none, or a hybrid row with "
                         "_r<R> (rectify_every=R, R >= 1), _heat<N>, _qs<N> or _qall (h12_/h25_ take a budget "
                         "from --budgets).")
    return picked


def feature_of(row: str):
    """('h12_4096', 'r32') for 'h12_4096_r32' (likewise _heat<N>, _qs<N>, _qall); None for a plain row."""
    m = re.fullmatch(r"(h12|h25)_(\d+)_(r[1-9]\d*|heat[1-9]\d*|qs[1-9]\d*|qall)", row)
    return None if m is None else (f"{m.group(1)}_{m.group(2)}", m.group(3))


def feature_config(tag: str) -> dict:
    """LycheeConfig keywords of a row suffix (see the module docstring)."""
    if tag == "qall":
        return dict(quest="all")
    if tag.startswith("heat"):
        return dict(heat_blocks=int(tag[4:]), heat_decay=0.9)
    if tag.startswith("qs"):
        return dict(quest="sparse", quest_blocks=int(tag[2:]))
    return dict(rectify_every=int(tag[1:]))


def rectify_of(row: str):
    """('h12_4096', 32) for 'h12_4096_r32'; None for a row without rectification."""
    f = feature_of(row)
    return None if f is None or not f[1].startswith("r") else (f[0], int(f[1][1:]))


def base_row(row: str) -> str:
    """The plain row whose head map and budget a suffixed row uses."""
    f = feature_of(row)
    return row if f is None else f[0]


def variant_of(row: str, budgets: list[int]) -> tuple[str, int]:
    """Which compiled model a row runs on: ('hf'|'flash_dense'|'lychee', budget)."""
    if row in ("hf", "flash_dense"):
        return row, max(budgets)
    if row == "dense":
        return "lychee", max(budgets)
    f = feature_of(row)
    if f is not None:
        return f"lychee_{f[1]}", int(row.split("_")[1])
    return "lychee", int(row.split("_")[1])


def setup_environment(args) -> dict:
    """Fresh compile caches (compile times are cold) unless --warm-cache; a recompile limit that several models on
    one code object cannot reach (each variant is a new cache entry of nn.Module.__call__)."""
    env = {}
    if not args.warm_cache:
        root = tempfile.mkdtemp(prefix="e2e_compile_cache_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    env["inductor_cache"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return env


def lychee_features() -> dict:
    """What the lead's API offers in this checkout: set_head_map, LycheeConfig(cuda_graphs=, attention=)."""
    import lychee_compile
    from lychee_compile import LycheeConfig
    fields = {f.name for f in dataclasses.fields(LycheeConfig)}
    return dict(set_head_map=hasattr(lychee_compile, "set_head_map"), cuda_graphs="cuda_graphs" in fields,
                flash_dense="attention" in fields)


# ------------------------------------------------------------------------------------------------ model and cache
def model_config(name: str, max_len: int, layers: int | None = None):
    """The LlamaConfig of MODELS[name] (layer count overridden by `layers`), SDPA attention."""
    from transformers import LlamaConfig
    shape = dict(MODELS[name], **({"num_hidden_layers": layers} if layers else {}))
    return LlamaConfig(**shape, max_position_embeddings=max_len, attn_implementation="sdpa")


def greedy_without_eos(model):
    """Decoding as the benchmarks time it: greedy, no end-of-sequence token (every step runs)."""
    gc_ = model.generation_config
    gc_.pad_token_id, gc_.eos_token_id, gc_.do_sample = 0, None, False
    return model


def build_base_model(name: str, device: str, dtype: torch.dtype, max_len: int, layers: int | None = None):
    from transformers import LlamaForCausalLM
    cfg = model_config(name, max_len, layers)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return greedy_without_eos(model.eval())


def clone_model(base):
    """A new module tree sharing the base's parameters (no weight copy); buffers and configs are copied."""
    memo = {id(p): p for p in base.parameters()}
    return copy.deepcopy(base, memo)


def weights_bytes(model, batch: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, except that an untied input embedding is
    read only at the batch's token rows. Tensor parallel (DTensor weights): this rank's shards."""
    total = sum(p.numel() * p.element_size() for p in map(local_tensor, model.parameters()))
    emb = local_tensor(model.get_input_embeddings().weight)
    out = local_tensor(model.get_output_embeddings().weight)
    if emb.data_ptr() != out.data_ptr():
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def make_cache(model, batch: int, max_len: int, device: str, dtype: torch.dtype, seed: int,
               kv_heads: int | None = None):
    """StaticCache initialized ahead of time and filled with random K/V (never zeros), one layer at a time.
    kv_heads: the KV heads one layer's cache holds (default the config's; tensor parallel: this rank's)."""
    from transformers import StaticCache
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    cache.early_initialization(batch, kv_heads or cfg.num_key_value_heads, cfg.head_dim, dtype,
                               torch.device(device))
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.normal_(generator=gen)
    return cache


def set_position(cache, position: int) -> None:
    """The next decode step writes slot `position` and attends to positions 0..position (what a prefill of
    `position` tokens leaves behind: transformers 5.17 and 5.23 keep it in each StaticLayer.cumulative_length)."""
    for layer in cache.layers:
        length = getattr(layer, "cumulative_length", None)
        if not isinstance(length, torch.Tensor):
            raise BenchError(f"{type(layer).__name__} has no cumulative_length tensor; this transformers version "
                             "keeps cache positions differently (checked: 5.17, 5.23).")
        length.fill_(position)


# ------------------------------------------------------------------------------------------------ the decode loop
class DecodeLoop:
    """generate()'s decode loop from a given position, without the prefill (see the module docstring)."""

    def __init__(self, model, forward, cache, batch: int, vocab: int, device: str):
        self.model, self.forward, self.cache = model, forward, cache
        self.batch, self.vocab, self.device = batch, vocab, device

    def start(self, position: int, seed: int = 0) -> None:
        set_position(self.cache, position)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        length = position + 1        # the prompt plus the token the prefill produced
        self.input_ids = torch.randint(3, self.vocab, (self.batch, length), generator=gen, device=self.device)
        mask = torch.ones(self.batch, length, dtype=torch.long, device=self.device)
        self.kwargs = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1), logits_to_keep=1,
                           past_key_values=self.cache, use_cache=True)

    def inputs(self) -> dict:
        return self.model.prepare_inputs_for_generation(self.input_ids, next_sequence_length=1, **self.kwargs)

    def finish(self, outputs) -> torch.Tensor:
        self.kwargs = self.model._update_model_kwargs_for_generation(outputs, self.kwargs, is_encoder_decoder=False)
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
        self.input_ids = torch.cat([self.input_ids, logits.argmax(-1)[:, None]], dim=-1)
        return logits

    def step(self) -> torch.Tensor:
        return self.finish(self.forward(**self.inputs(), return_dict=True))


class StepClock:
    """Per-step times of the compiled call: CUDA events (no sync per step) or perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.marks = []

    def around(self, fn):
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = fn()
            e1.record()
            self.marks.append((e0, e1))
            return out
        t0 = time.perf_counter()
        out = fn()
        self.marks.append((t0, time.perf_counter()))
        return out

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1e3 for a, b in self.marks]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def time_decode(loop: DecodeLoop, position: int, warmup: int, steps: int, device: str) -> dict:
    loop.start(position)
    with torch.no_grad(), count_rectifications() as rect:
        for _ in range(warmup):
            loop.step()
        sync(device)
        rect_before = rect[0]
        clock = StepClock(device)
        fired = []                     # per timed step: did it re-encode (rectification)
        t0 = time.perf_counter()
        for _ in range(steps):
            inputs = loop.inputs()
            n = rect[0]
            logits = loop.finish(clock.around(lambda: loop.forward(**inputs, return_dict=True)))
            fired.append(rect[0] != n)
        sync(device)
        wall = time.perf_counter() - t0
    ts = clock.times_ms()
    return dict(tpot_ms=statistics.median(ts), p10_ms=quantile(ts, 0.1), p90_ms=quantile(ts, 0.9),
                min_ms=min(ts), mean_ms=statistics.fmean(ts), loop_ms=wall * 1e3 / steps,
                logits_finite=bool(torch.isfinite(logits).all()), rectifications_timed=rect[0] - rect_before,
                rectifications_total=rect[0], **reencode_time(ts, fired))


def reencode_time(ts: list[float], fired: list[bool]) -> dict:
    """{'reencode_ms': mean time of the steps that re-encoded minus the median of the others} where both exist."""
    with_reencode = [t for t, f in zip(ts, fired) if f]
    plain = [t for t, f in zip(ts, fired) if not f]
    if not with_reencode or not plain:
        return {}
    return dict(reencode_ms=statistics.fmean(with_reencode) - statistics.median(plain))


class count_rectifications:
    """Counts lychee_compile.rectify's dense re-encodes (Rectifier._reencode calls) while active: [count]."""

    def __enter__(self):
        self.count = [0]
        try:
            from lychee_compile.rectify import Rectifier
        except ImportError:
            self.cls = None
            return self.count
        self.cls, self.inner, count = Rectifier, Rectifier.__dict__["_reencode"], self.count
        inner = self.inner

        def _reencode(rectifier, *a, **kw):
            count[0] += 1
            return inner(rectifier, *a, **kw)
        Rectifier._reencode = _reencode
        return self.count

    def __exit__(self, *exc):
        if self.cls is not None:
            self.cls._reencode = self.inner
        return False


# ------------------------------------------------------------------------------------------------ counters
_COUNTS = {"compiles": 0, "cudagraph_records": 0}


def _on_compile_start(args=None, *_rest, **_kwargs) -> None:
    # the start callbacks fire for Dynamo compiles and also for CUDA-graph recordings (cudagraph trees record a
    # function at its second call, at each new place in the tree): counted apart, a recording is no recompile
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "")
    _COUNTS["cudagraph_records" if trigger == "CUDAGRAPH_RECORDING" else "compiles"] += 1


def dynamo_counts() -> dict:
    """Dynamo compiles since start (a compile-start callback, re-registered: torch._dynamo.reset() clears them), CUDA
    graphs recorded (the same callback's other trigger), graphs (counters["stats"]["unique_graphs"]) and frames
    (counted only by the fullgraph=False path)."""
    from torch._dynamo.callback import callback_handler
    from torch._dynamo.utils import counters
    if _on_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_compile_start)
    return dict(_COUNTS, frames=counters["frames"].get("total", 0),
                unique_graphs=counters["stats"].get("unique_graphs", 0))


def recompiles_of(counts: dict) -> int:
    """Recompiles in a delta of dynamo_counts(): Dynamo's counts only (a CUDA-graph recording is not one)."""
    return max(v for k, v in counts.items() if k != "cudagraph_records")


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def memory_now(device: str) -> dict:
    if device != "cuda":
        return dict(allocated_gb=None, peak_gb=None)
    return dict(allocated_gb=torch.cuda.memory_allocated() / GIB, peak_gb=torch.cuda.max_memory_allocated() / GIB)


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def release_compiled() -> None:
    """Drop every compiled artifact (the variant is done): Dynamo's caches and CUDA-graph trees."""
    import gc
    torch._dynamo.reset()           # also resets CUDA-graph trees (torch 2.11+)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ head maps
def all_retrieval_map(model):
    from lychee_compile import HeadMap
    return HeadMap.for_model(model)


def random_map(model, share: float, seed: int):
    """round(share * layers * kv_heads) retrieval heads spread as evenly as possible over the layers, random heads
    within a layer (timing does not depend on which)."""
    from lychee_compile import HeadMap
    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    gen = torch.Generator().manual_seed(seed)
    per_layer = layer_counts(layers, max(1, round(share * layers * kv)), gen)
    retrieval = torch.zeros(layers, kv, dtype=torch.bool)
    for layer in range(layers):
        retrieval[layer, torch.randperm(kv, generator=gen)[: int(per_layer[layer])]] = True
    return HeadMap(retrieval, {"method": f"random share {share}"}).with_model_metadata(model)


def layer_counts(layers: int, total: int, gen) -> torch.Tensor:
    """total heads spread over the layers as evenly as possible (the remainder on random layers): int [layers]."""
    order = torch.randperm(layers, generator=gen)
    per_layer = torch.full((layers,), total // layers)
    per_layer[order[: total % layers]] += 1
    return per_layer


def row_head_map(row: str, model, seed: int):
    if row in ("dense", "flash_dense"):
        return all_retrieval_map(model)
    return random_map(model, SHARES[row.split("_")[0]], seed)    # h12_<b>_r<R>: the same map as h12_<b>


# ------------------------------------------------------------------------------------------------ bytes floor
def kv_read_bytes(model, row: str, batch: int, valid: float, budget: int, sink: int, local: int,
                  effective) -> float:
    """K+V bytes a row must read: dense rows every KV head over the valid length; hybrid rows retrieval heads over
    the valid length, sparse heads sink + local + budget tokens (capped at the valid length). Suffixed rows add
    their state and extra blocks: heat<N> N blocks more per sparse head and its fp32 heat per block read and
    written; qs<N> N blocks more per sparse head and the sparse heads' min/max descriptors; qall every head sparse,
    reading every head's descriptors."""
    cfg = model.config
    itemsize = model.dtype.itemsize
    per_token = batch * cfg.head_dim * 2 * itemsize                    # K and V of one head, one position
    heads_total = cfg.num_hidden_layers * cfg.num_key_value_heads
    if effective is None:
        return per_token * heads_total * valid
    tag = (feature_of(row) or (row, ""))[1]
    n_retr = 0 if tag == "qall" else int(effective.sum())
    extra_tokens = 16 * int(tag[4:] if tag.startswith("heat") else tag[2:] if tag.startswith("qs") else 0)
    sparse_tokens = min(valid, sink + local + budget + extra_tokens)
    state = 0.0
    blocks = batch * valid / 16
    if tag.startswith("heat"):
        state = heads_total * blocks * 4 * 2
    elif tag.startswith("q"):
        state = (heads_total - n_retr) * blocks * 2 * cfg.head_dim * itemsize
    return per_token * (n_retr * valid + (heads_total - n_retr) * sparse_tokens) + state


# ------------------------------------------------------------------------------------------------ variants
@dataclasses.dataclass
class Variant:
    name: str                   # hf | flash_dense | lychee_b<budget>
    model: object
    forward: object = None
    budget: int = 0
    global_layers: list = None
    setup_s: float = 0.0
    rectify_every: int = 0      # LycheeConfig.rectify_every of a _r<R> variant


def lychee_config(args, kind: str, budget: int):
    from lychee_compile import LycheeConfig
    kw = dict(budget=budget, block_size=16, sink_tokens=args.sink, local_tokens=args.local)
    if kind.startswith("lychee_"):
        kw.update(feature_config(kind[len("lychee_"):]))
    if args.device == "cpu":
        kw["backend"] = "eager"
    else:                                     # preflight() checked that this checkout has the field
        kw["cuda_graphs"] = not args.no_cuda_graphs
    if kind == "flash_dense":
        kw["attention"] = "flash_dense"
    kw.update(lychee_overrides(args))
    return LycheeConfig(**kw)


def lychee_overrides(args) -> dict:
    """--lychee KEY=JSON pairs as LycheeConfig keyword arguments (unknown fields refused here, not at the first row)."""
    import dataclasses

    from lychee_compile import LycheeConfig
    fields = {f.name for f in dataclasses.fields(LycheeConfig)}
    out = dict(key_json_pairs(getattr(args, "lychee", []), "--lychee"))
    unknown = sorted(set(out) - fields)
    if unknown:
        raise BenchError(f"--lychee: LycheeConfig has no field {unknown}; fields: {sorted(fields)}")
    if getattr(args, "kernels", "") and "kernels" in fields:
        from lychee_compile import KernelOptions
        out["kernels"] = KernelOptions.parse(args.kernels)
    return out


def key_json_pairs(items: list[str], flag: str) -> list[tuple[str, object]]:
    """KEY=JSON command-line pairs -> [(key, value)]."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchError(f"{flag} {item}: expected KEY=JSON")
        out.append((key, json.loads(value)))
    return out


def build_variant(args, base, kind: str, budget: int) -> Variant:
    from lychee_compile import lychee_compile
    model = clone_model(base)
    t0 = time.perf_counter()
    if kind == "hf":
        if args.device == "cpu":
            model.generation_config.compile_config = cpu_compile_config()
        return Variant("hf", model, setup_s=time.perf_counter() - t0)
    head_map = all_retrieval_map(model)
    lychee_compile(model, head_map, lychee_config(args, kind, budget))
    name = "flash_dense" if kind == "flash_dense" else f"lychee_b{budget}"
    if kind.startswith("lychee_"):
        name += kind[len("lychee"):]
    layers = model._lychee_state.global_layers
    return Variant(name, model, budget=budget, global_layers=layers, setup_s=time.perf_counter() - t0,
                   rectify_every=model._lychee_state.config.rectify_every)


def cpu_compile_config():
    """HF as-is on the CPU (dry runs): HF's default (Inductor, reduce-overhead) needs a GPU, so Dynamo's graph runs
    eagerly, and generate() compiles on the CPU too."""
    from transformers import CompileConfig
    cc = CompileConfig(backend="eager", fullgraph=True, mode=None)
    cc._compile_all_devices = True
    return cc


def compiled_forward(variant: Variant, loop_kwargs: dict):
    """What generate() uses for its decode steps; refuses a model generate() would not compile."""
    model = variant.model
    config = model.generation_config
    if not model._valid_auto_compile_criteria(loop_kwargs, config):
        raise BenchError(f"{variant.name}: generate() would not compile this decode step (device/cache/config).")
    if variant.name != "hf":
        backend = getattr(config.compile_config, "backend", None)
        name = getattr(backend, "__name__", str(backend))
        if not name.startswith("lychee_backend_"):
            raise BenchError(f"{variant.name}: compile_config.backend is {name!r}, not lychee's backend.")
    return model.get_compiled_call(config.compile_config)


def apply_head_map(args, variant: Variant, row: str):
    """Swap the compiled model's head kinds in place (no recompile); returns the map."""
    import lychee_compile
    head_map = row_head_map(row, variant.model, args.seed)
    lychee_compile.set_head_map(variant.model, head_map)
    return head_map


# ------------------------------------------------------------------------------------------------ one batch size
class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.time(), seconds

    def left(self) -> float:
        return self.seconds - (time.time() - self.t0)


def variants_needed(args) -> list[tuple[str, int]]:
    """Compiled models in order of importance (what --max-seconds cuts last): lychee at the largest budget (dense
    mode + the headline hybrid rows), the best dense path, HF as-is, then the other budgets."""
    wanted = {variant_of(row, args.budget_list) for row in args.row_list}
    top = max(args.budget_list)
    order = [("lychee", top), ("flash_dense", top), ("hf", top)] + [("lychee", b) for b in
                                                                      sorted(args.budget_list, reverse=True)[1:]]
    order += sorted(v for v in wanted if v[0].startswith("lychee_"))   # rectification, heat, Quest: one compile each
    return [v for v in order if v in wanted]


def rows_of(args, kind: str, budget: int) -> list[str]:
    return [r for r in args.row_list if variant_of(r, args.budget_list) == (kind, budget)]


def skip_reason(args, kind: str, features: dict) -> str | None:
    """(On the CPU the flash_dense row runs lychee.dense_decode's masked reference: a logic check, not a baseline.)"""
    if kind == "flash_dense" and not features["flash_dense"]:
        return "LycheeConfig has no attention= field in this checkout (lead's flash_dense change not merged)"
    return None


def first_call(variant: Variant, cache, args, batch: int) -> dict:
    """The compile: the first call of the compiled decode step (at the largest context), then a second call
    (CUDA-graph recording); with rectification, more steps up to the second re-encode: the first compiles the
    re-encode's own graph, the second records its CUDA graph (reencode_compile_s: those steps' time); Dynamo's
    counters before/after."""
    forward = compiled_forward(variant, {"past_key_values": cache})
    loop = DecodeLoop(variant.model, forward, cache, batch, variant.model.config.vocab_size, args.device)
    loop.start(args.context_list[0])
    before = dynamo_counts()
    phases = CompilePhases()
    reset_peak(args.device)
    with torch.no_grad(), phases:
        t0 = time.perf_counter()
        loop.step()
        sync(args.device)
        t1 = time.perf_counter()
        loop.step()
        sync(args.device)
        t2 = time.perf_counter()
        with count_rectifications() as rect:
            for _ in range(max(2 * variant.rectify_every - 2, 0)):
                loop.step()
            sync(args.device)
        t3 = time.perf_counter()
    variant.forward = forward
    info = dict(compile_s=t1 - t0, second_call_s=t2 - t1, compile_counts=delta(dynamo_counts(), before),
                compile_peak_gb=memory_now(args.device)["peak_gb"], compile_phases=phases.result)
    if variant.rectify_every:
        info.update(reencode_compile_s=t3 - t2, reencodes_in_compile=rect[0])
        if rect[0] < 2 and variant.rectify_every > 2:
            raise BenchError(f"{variant.name}: {2 * variant.rectify_every} decode steps ran {rect[0]} rectification "
                             "re-encodes, not 2 (the first compiles the re-encode's graph, the second records it)")
    return info


class CompilePhases:
    """Where a compile's seconds went: the lychee pass pipeline (timed around backend.run_passes), Dynamo's and
    Inductor's own `dynamo_timed` phases (torch._dynamo.utils.compilation_time_metrics, nested: they overlap, so they
    do not add up), and how many kernel variants Inductor's coordinate-descent tuning compiled and timed."""

    TOP = 14

    def __enter__(self):
        from torch._dynamo.utils import compilation_time_metrics, counters
        import lychee_compile.backend as backend
        self._metrics, self._counters, self._backend = compilation_time_metrics, counters, backend
        self._seen = {k: len(v) for k, v in compilation_time_metrics.items()}
        self._bench0 = counters["inductor"].get("coordesc_tuning_bench", 0)
        self._passes_s, run = [0.0], backend.run_passes

        def timed_run_passes(ctx):
            t = time.perf_counter()
            try:
                return run(ctx)
            finally:
                self._passes_s[0] += time.perf_counter() - t
        backend.run_passes, self._run = timed_run_passes, run
        self._tuned = []
        # what to wrap: the library's tuning entry points (inductor_changes puts them in place of Inductor's inside
        # our compiled calls, looked up by name), or Inductor's own in a checkout without them
        try:
            from lychee_compile.lowering import inductor_changes as owner
            names = ("_tune", "_bench")
        except ImportError:
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner as owner
            names = ("coordinate_descent_tuning", "bench")
        tune, bench = (getattr(owner, n) for n in names)
        tuned, timings = self._tuned, []

        def timed_tune(tuner, *a, **kw):
            t, n, launcher = time.perf_counter(), counters["inductor"].get("coordesc_tuning_bench", 0), None
            timings.clear()
            try:
                launcher = tune(tuner, *a, **kw)
                return launcher
            finally:
                tuned.append(dict(kernel=tuner.inductor_meta.get("kernel_name", "?"),
                                  config=str(getattr(launcher, "config", None)),
                                  kind=str(getattr(tuner, "heuristic_type", "?")).split(".")[-1],
                                  s=round(time.perf_counter() - t, 3),
                                  configs=counters["inductor"].get("coordesc_tuning_bench", 0) - n,
                                  timed_us=list(timings)))

        def recording_bench(tuner, launcher, *a, **kw):
            # every variant the tuning times, in order: [config kwargs + warps, microseconds]
            ms = bench(tuner, launcher, *a, **kw)
            c = launcher.config
            timings.append([" ".join(f"{k}={v}" for k, v in c.kwargs.items()) + f" w={c.num_warps}",
                            round(float(ms) * 1e3, 2)])
            return ms
        self._owner, self._names, self._tune, self._bench = owner, names, tune, bench
        setattr(owner, names[0], timed_tune)
        setattr(owner, names[1], recording_bench)
        return self

    def __exit__(self, *exc):
        self._backend.run_passes = self._run
        setattr(self._owner, self._names[0], self._tune)
        setattr(self._owner, self._names[1], self._bench)
        kinds = {}
        for t in self._tuned:
            k = kinds.setdefault(t["kind"], dict(kernels=0, configs=0, s=0.0))
            k["kernels"], k["configs"], k["s"] = k["kernels"] + 1, k["configs"] + t["configs"], k["s"] + t["s"]
        new = {k: sum(v[self._seen.get(k, 0):]) for k, v in self._metrics.items()}
        top = sorted(((k, s) for k, s in new.items() if s > 0), key=lambda kv: -kv[1])[:self.TOP]
        self.result = dict(lychee_passes_s=round(self._passes_s[0], 3),
                           coordesc_configs_timed=self._counters["inductor"].get("coordesc_tuning_bench", 0)
                           - self._bench0,
                           dynamo_timed_s={k: round(s, 2) for k, s in top},
                           tuning_by_kind={k: dict(v, s=round(v["s"], 2)) for k, v in kinds.items()},
                           tuned_kernels=sorted(self._tuned, key=lambda t: -t["s"]))
        return False


def time_rows(args, variant, rows, cache, batch, ctx_info, budget_clock, results) -> int:
    """Every row of one compiled variant at every context; returns the decode steps run."""
    steps_run = 0
    for row in rows:
        current, effective = variant, None
        if row not in ("hf", "flash_dense"):
            effective = quiet_effective(apply_head_map(args, variant, row), variant.global_layers)
        for ctx in args.context_list:
            if budget_clock.left() <= 0:
                results["skipped"].append(dict(batch=batch, row=row, context=ctx, reason="--max-seconds reached"))
                continue
            if rectify_of(row) is not None:
                # a fresh get_compiled_call (same compiled graph, no recompile): a fresh rectifier, as each
                # generate() gets, so no tokens of the previous context are re-encoded at this one
                current.forward = compiled_forward(current, {"past_key_values": cache})
            loop = DecodeLoop(current.model, current.forward, cache, batch, current.model.config.vocab_size,
                              args.device)
            rec = time_row(args, loop, current, row, ctx, batch, effective, ctx_info)
            rec.update(rectify_overhead(rec, results["rows"]))
            steps_run += args.warmup + args.steps
            results["rows"].append(rec)
            print_row(rec)
            write_json(args, results)
    return steps_run


def rectify_overhead(rec: dict, rows: list[dict]) -> dict:
    """A rectification row against the same row without it (same model, batch and context, timed earlier in this
    run): rectify_overhead = its mean TPOT / that row's mean TPOT - 1, reencode_overhead = reencode_ms / (R x that
    row's mean TPOT). {} for other rows or where that row was not timed."""
    rect = rectify_of(rec["row"])
    base = rect and find(rows, model=rec["model"], batch=rec["batch"], context=rec["context"], row=rect[0])
    if not base:
        return {}
    out = dict(base_row=rect[0], base_mean_ms=base["mean_ms"], rectify_overhead=rec["mean_ms"] / base["mean_ms"] - 1)
    if "reencode_ms" in rec:
        out["reencode_overhead"] = rec["reencode_ms"] / (rect[1] * base["mean_ms"])
    return out


def quiet_effective(head_map, global_layers):
    """The map the ops use (first global layer all retrieval), without HeadMap's warning about it."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return head_map.effective(global_layers)


def time_row(args, loop, variant, row, ctx, batch, effective, ctx_info) -> dict:
    counters = getattr(getattr(variant.model, "_lychee_state", None), "counters", None)
    calls0 = counters.decode_calls if counters is not None else None
    reset_peak(args.device)
    stats = time_decode(loop, ctx, args.warmup, args.steps, args.device)
    valid = ctx + 1 + args.warmup + (args.steps - 1) / 2                 # mean valid length over the timed steps
    kv = kv_read_bytes(variant.model, row, batch, valid, variant.budget, args.sink, args.local,
                       None if row in ("hf", "flash_dense") else effective)
    w = ctx_info["weights_bytes"][batch]
    rec = dict(model=args.model, batch=batch, context=ctx, row=row, variant=variant.name, budget=variant.budget,
               steps=args.steps,
               **stats, floor_ms=(w + kv) / ctx_info["copy_bw"] * 1e3, weights_bytes=w, kv_bytes=kv,
               mean_valid=valid, **memory_now(args.device))
    if effective is not None:
        rec["retrieval_share_effective"] = float(effective.float().mean())
    rect = rectify_of(row)
    if rect is not None:
        every = rect[1]
        rec.update(tpot_ms=stats["mean_ms"], median_ms=stats["tpot_ms"], tpot_stat="mean (rectification amortized)",
                   rectify_every=every)
        expected = (args.warmup + args.steps) // every - args.warmup // every
        if stats["rectifications_timed"] == 0:
            rec["error"] = (f"no rectification ran in the {args.steps} timed steps (rectify_every={every}): the "
                            "rectify wrapper of get_compiled_call did not fire")
        elif stats["rectifications_timed"] != expected:
            rec["warning"] = f"{stats['rectifications_timed']} rectifications timed, expected {expected}"
        if stats["rectifications_timed"] < 2:
            rec["warning"] = (rec.get("warning", "") + f" fewer than 2 rectifications in the timed window: use "
                              f"--steps >= {2 * every}").strip()
    if calls0 is not None:
        rec["lychee_decode_calls"] = counters.decode_calls - calls0
        if rec["lychee_decode_calls"] == 0:
            rec["error"] = "the rewritten lychee decode graph never ran (decode_calls did not move)"
        elif rec["lychee_decode_calls"] != args.warmup + args.steps:
            rec["warning"] = f"decode_calls moved by {rec['lychee_decode_calls']}, not {args.warmup + args.steps}"
    return rec


def run_batch(args, base, batch, features, copy_bw, budget_clock, results) -> None:
    max_len = max_cache_len(args)
    dtype = base.dtype
    cache = make_cache(base, batch, max_len, args.device, dtype, args.seed + batch)
    results["meta"]["max_cache_len"][str(batch)] = max_len
    ctx_info = dict(copy_bw=copy_bw, weights_bytes={batch: weights_bytes(base, batch)})
    for kind, budget in variants_needed(args):
        reason = skip_reason(args, kind, features)
        rows = rows_of(args, kind, budget)
        if reason is None and budget_clock.left() <= args.compile_reserve:
            reason = f"--max-seconds: less than --compile-reserve {args.compile_reserve:.0f}s left for a compile"
        if reason:
            results["skipped"] += [dict(batch=batch, row=r, reason=reason) for r in rows]
            print(f"skip {rows} (batch {batch}): {reason}", flush=True)
            continue
        run_variant(args, base, kind, budget, rows, cache, batch, ctx_info, budget_clock, results)
    del cache
    release_compiled()


def run_variant(args, base, kind, budget, rows, cache, batch, ctx_info, budget_clock, results) -> None:
    variant = build_variant(args, base, kind, budget)
    print(f"== {variant.name} batch {batch}: setup {variant.setup_s:.1f}s, compiling ...", flush=True)
    info = first_call(variant, cache, args, batch)
    print(f"   compile (first call) {info['compile_s']:.1f}s, second call {info['second_call_s']:.2f}s, "
          f"counts {info['compile_counts']}\n   phases "
          f"{ {k: v for k, v in info['compile_phases'].items() if k != 'tuned_kernels'} }", flush=True)
    before = dynamo_counts()
    steps = time_rows(args, variant, rows, cache, batch, ctx_info, budget_clock, results)
    recompiles = delta(dynamo_counts(), before)
    rec = dict(model=args.model, layers=variant.model.config.num_hidden_layers, batch=batch, variant=variant.name,
               rows=rows, setup_s=variant.setup_s, **info,
               compile_cache=compile_cache_state(args, batch),
               steps_after_compile=steps, recompile_counts=recompiles,
               recompiles=recompiles_of(recompiles),
               lychee_counters=_lychee_counters(variant.model))
    results["variants"].append(rec)
    print(f"   {variant.name}: {steps} decode steps after the compile, recompiles {rec['recompiles']} "
          f"({recompiles})", flush=True)
    write_json(args, results)
    del variant
    release_compiled()


def compile_cache_state(args, batch: int) -> str:
    if args.warm_cache:
        return "as set in the environment (--warm-cache)"
    return "cold" if batch == args.batches[0] else "fresh for this process, shared with its earlier batch sizes"


def _lychee_counters(model):
    state = getattr(model, "_lychee_state", None)
    if state is None:
        return None
    c = state.counters.as_dict()
    c.pop("reasons", None)
    return c


def max_cache_len(args) -> int:
    every = max((rectify_of(r)[1] for r in args.row_list if rectify_of(r)), default=0)
    # + the compile's two calls (2R with rectification: the re-encode compiles and records there, at the largest
    # context)
    need = max(args.context_list) + max(args.warmup + args.steps + 2, 2 * every) + 2
    return -(-need // 256) * 256


# ------------------------------------------------------------------------------------------------ prefill
PREFILL_EXTRA = 256        # cache slots beyond the prompt (a generate() has room to decode)


def prefill_cache_len(args) -> int:
    return -(-(max(args.prefill_list) + PREFILL_EXTRA) // 256) * 256 if args.prefill_list else 0


def prefill_once(model, cache, ids, clock):
    """One prefill as generate() runs it (eager model call, 2-D mask, positions, logits_to_keep=1) from position 0."""
    set_position(cache, 0)
    mask = torch.ones_like(ids)
    return clock.around(lambda: model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1),
                                      past_key_values=cache, use_cache=True, logits_to_keep=1,
                                      return_dict=True)).logits[:, -1].float()


def run_prefill(args, base, results) -> None:
    """--prefill: HF as-is (the uncompiled base model) vs the lychee_compile'd model, alternated, one cache."""
    batch, budget = args.batches[0], max(args.budget_list)
    variant = build_variant(args, base, "lychee", budget)
    counters = variant.model._lychee_state.counters
    cache = make_cache(base, batch, prefill_cache_len(args), args.device, base.dtype, args.seed)
    models = dict(hf=base, lychee=variant.model)
    tol = 1e-4 if base.dtype == torch.float32 else 2e-2
    for length in args.prefill_list:
        rec = dict(model=args.model, batch=batch, prompt=length, cache_len=prefill_cache_len(args),
                   logits_to_keep=1, repeats=args.prefill_repeats)
        ids = torch.randint(3, base.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(
            length)).to(args.device)
        calls0 = counters.decode_calls
        reset_peak(args.device)
        try:
            clocks, logits = {k: StepClock(args.device) for k in models}, {}
            with torch.no_grad():
                for k, m in models.items():                                   # warmup (not recorded)
                    prefill_once(m, cache, ids, StepClock(args.device))
                sync(args.device)
                for _ in range(args.prefill_repeats):
                    for k, m in models.items():
                        logits[k] = prefill_once(m, cache, ids, clocks[k])
            times = {k: c.times_ms() for k, c in clocks.items()}
            diff = (logits["hf"] - logits["lychee"]).abs().max().item()
            scale = max(1.0, logits["hf"].abs().max().item())
            rec.update(hf_ms=statistics.median(times["hf"]), lychee_ms=statistics.median(times["lychee"]),
                       hf_all_ms=times["hf"], lychee_all_ms=times["lychee"],
                       logits_finite=all(bool(torch.isfinite(x).all()) for x in logits.values()),
                       max_abs_diff=diff, logits_close=diff <= tol * scale,
                       lychee_decode_calls=counters.decode_calls - calls0, **memory_now(args.device))
            rec["ratio"] = rec["lychee_ms"] / rec["hf_ms"]
            if rec["lychee_decode_calls"]:
                rec["error"] = "the lychee decode graph ran during the prefill (it must stay HF's dense path)"
            elif not (rec["logits_finite"] and rec["logits_close"]):
                rec["error"] = f"prefill logits differ (max |diff| {diff:.3g}, finite {rec['logits_finite']})"
        except torch.OutOfMemoryError as e:      # a 32K prompt on a small GPU: keep the other lengths
            rec["error"] = f"out of memory: {str(e).splitlines()[0]}"
            logits = None
        results["prefill"].append(rec)
        print(f"   prefill b{batch} {length:>7} tokens: HF {_fmt(rec.get('hf_ms'))} ms, lychee "
              f"{_fmt(rec.get('lychee_ms'))} ms, ratio {_fmt(rec.get('ratio'))}, max |logit diff| "
              f"{_fmt(rec.get('max_abs_diff'), '.2e')} | peak {_fmt(rec.get('peak_gb'), '.1f')} GB"
              f"{'  ERROR ' + rec['error'] if 'error' in rec else ''}", flush=True)
        write_json(args, results)
    del cache, variant, models
    release_compiled()


# ------------------------------------------------------------------------------------------------ profile
PROFILE_CATEGORIES = [      # first match wins (lower-case substrings of the kernel / op name)
    ("lychee select (side stream, overlapped)", ("lychee_select_rows",)),
    ("lychee combine", ("lychee_hybrid_combine", "combine")),
    ("lychee split", ("lychee_hybrid_split", "hybrid_decode", "triton_tem")),
    ("attention (flash/cuDNN/SDPA)", ("flash", "fmha", "cudnn", "attention", "sdpa", "attn")),
    ("GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::matmul", "aten::linear")),
    ("other Triton fused", ("triton",)),
    ("copies/memset", ("memcpy", "memset", "copy", "aten::fill_", "aten::zero_")),
]


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, keys in PROFILE_CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def profile_events(prof, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, self time us, calls): CUDA kernels (device events) on CUDA, CPU ops' self time on the CPU."""
    out = []
    for e in prof.key_averages():
        is_device = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        if cuda:
            t = getattr(e, "self_device_time_total", None)
            t = getattr(e, "self_cuda_time_total", 0) if t is None else t
            if not is_device:
                continue
        else:
            t = e.self_cpu_time_total
        if t > 0:
            out.append((e.key, float(t), int(e.count)))
    return out


def kernel_timeline(prof, steps: int) -> list[dict]:
    """The last profiled step's device kernels in start order: name, stream, start and duration (us), and the gap
    since the previous kernel on the main stream ended -- where a step's time goes kernel by kernel."""
    evs = sorted((e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    per_step = len(evs) // max(steps, 1)
    last = evs[len(evs) - per_step:]
    if not last:
        return []
    t0, out, prev_end = last[0].time_range.start, [], None
    main = getattr(last[0], "device_resource_id", None)
    for e in last:
        stream = getattr(e, "device_resource_id", None)
        gap = None if prev_end is None or stream != main else e.time_range.start - prev_end
        out.append(dict(name=e.name[:100], stream=stream, start_us=e.time_range.start - t0,
                        dur_us=e.time_range.end - e.time_range.start, gap_us=gap))
        if stream == main:
            prev_end = e.time_range.end
    return out


def run_profile(args, base, results) -> None:
    row, ctx, steps = args.profile_row, args.profile_ctx, args.profile_steps
    batch = args.batches[0]
    kind, budget = variant_of(row, args.budget_list)
    pargs = copy.copy(args)
    pargs.no_cuda_graphs = True
    variant = build_variant(pargs, base, kind, budget)
    if kind == "hf" and args.device == "cuda":           # HF's defaults minus CUDA graphs ("reduce-overhead")
        from transformers import CompileConfig
        cc = CompileConfig()
        cc.mode = "default"
        variant.model.generation_config.compile_config = cc
    if kind != "hf" and row != "flash_dense":
        apply_head_map(args, variant, base_row(row))
    rect = rectify_of(row)
    # a rectified row warms past its first re-encode: that one compiles and tunes, which is not the re-encode's cost
    warm = 3 if rect is None else rect[1] + 2
    if rect is not None and steps < rect[1]:
        print(f"note: --profile-steps {steps} < R = {rect[1]}: the profiled window holds no re-encode", flush=True)
    cache = make_cache(base, batch, -(-(ctx + warm + steps + 4) // 256) * 256, args.device, base.dtype, args.seed)
    forward = compiled_forward(variant, {"past_key_values": cache})
    loop = DecodeLoop(variant.model, forward, cache, batch, base.config.vocab_size, args.device)
    loop.start(ctx)
    print(f"== profile {row} b{batch} ctx {ctx}: compiling (no CUDA graphs) ...", flush=True)
    from torch.profiler import ProfilerActivity, profile
    cuda = args.device == "cuda"
    with torch.no_grad():
        for _ in range(warm):                            # compile + warmup
            loop.step()
        sync(args.device)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(steps):
                loop.step()
            sync(args.device)
    events = profile_events(prof, cuda)
    total = sum(t for _, t, _ in events) or 1.0
    cats = {}
    for name, t, _ in events:
        c = kernel_category(name)
        cats[c] = cats.get(c, 0.0) + t
    rec = dict(model=args.model, batch=batch, context=ctx, row=row, variant=variant.name, steps=steps,
               source="CUDA kernels (self device time)" if cuda else "CPU ops (self CPU time; no CUDA in a dry run)",
               total_ms_per_step=total / 1e3 / steps,
               categories=[dict(category=c, ms_per_step=t / 1e3 / steps, share=t / total)
                           for c, t in sorted(cats.items(), key=lambda kv: -kv[1])],
               top=[dict(name=n, category=kernel_category(n), ms_per_step=t / 1e3 / steps, calls_per_step=k / steps,
                         share=t / total) for n, t, k in sorted(events, key=lambda x: -x[1])[:30]])
    rec["timeline"] = kernel_timeline(prof, steps) if cuda else []
    results["profile"] = rec
    print(profile_table(rec), flush=True)
    write_json(args, results)
    del loop, forward, cache, variant
    release_compiled()


def profile_table(p: dict) -> str:
    lines = [f"profile: {p['model']} b{p['batch']} ctx {p['context']} row {p['row']} (no CUDA graphs), "
             f"{p['steps']} steps, {p['source']}: {p['total_ms_per_step']:.3f} ms per step",
             "| category | ms / step | % |", "|---|---:|---:|"]
    lines += [f"| {c['category']} | {c['ms_per_step']:.4f} | {100 * c['share']:.1f} |" for c in p["categories"]]
    lines += ["", "| top kernel | category | ms / step | calls / step | % |", "|---|---|---:|---:|---:|"]
    lines += [f"| `{t['name'][:90]}` | {t['category']} | {t['ms_per_step']:.4f} | {t['calls_per_step']:.1f} | "
              f"{100 * t['share']:.1f} |" for t in p["top"]]
    return "\n".join(lines)


def prefill_table(results) -> str:
    lines = ["| model | B | prompt | HF ms | lychee ms | lychee / HF | max abs logit diff | peak GB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results.get("prefill", []):
        lines.append(f"| {r['model']} | {r['batch']} | {_ctx(r['prompt'])} | {_fmt(r.get('hf_ms'))} | "
                     f"{_fmt(r.get('lychee_ms'))} | {_fmt(r.get('ratio'))} | {_fmt(r.get('max_abs_diff'), '.2e')} | "
                     f"{_fmt(r.get('peak_gb'), '.1f')} |" + (f" ERROR {r['error']}" if "error" in r else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ bandwidth
def measure_copy_bw(device: str) -> float:
    """Device-to-device copy of a 1 GiB buffer (CPU: 64 MiB), bytes read + written per second; median of 20."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    clock = StepClock(device)
    for _ in range(20):
        clock.around(lambda: b.copy_(a))
    t = statistics.median(clock.times_ms()) * 1e-3
    del a, b
    return 2 * n / t


# ------------------------------------------------------------------------------------------------ targets
def find(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()) and "error" not in r:
            return r
    return None


def targets(results) -> list[dict]:
    """The project's speed targets (H100) next to what this run measured; None where the run has no such row."""
    models = [r["model"] for r in results["rows"]]
    model = "llama8b" if "llama8b" in models else (models[0] if models else None)
    rows, out = [r for r in results["rows"] if r["model"] == model], []
    big = max((r["context"] for r in rows), default=None)
    hyb = "h12_4096"

    def add(name, value, ok):
        out.append(dict(target=name, measured=value, met=None if value is None else ok(value)))

    dense = find(rows, row="dense", batch=1, context=big)
    h = find(rows, row=hyb, batch=1, context=big)
    flash = find(rows, row="flash_dense", batch=1, context=big)
    hf = find(rows, row="hf", batch=1, context=big)
    add(f"dense mode <= 1.15x its floor at {big} b1", dense and dense["tpot_ms"] / dense["floor_ms"],
        lambda v: v <= 1.15)
    add(f"hybrid 12.5%/4096 <= 1.2x its floor at {big} b1", h and h["tpot_ms"] / h["floor_ms"], lambda v: v <= 1.2)
    add(f"hybrid 12.5%/4096 >= 1.5x over best dense at {big} b1", h and flash and flash["tpot_ms"] / h["tpot_ms"],
        lambda v: v >= 1.5)
    add(f"hybrid 12.5%/4096 >= 9x over HF as-is at {big} b1", h and hf and hf["tpot_ms"] / h["tpot_ms"],
        lambda v: v >= 9)
    rect = find(rows, row=f"{hyb}_r32", batch=1, context=big)
    add(f"rectification every 32 steps <= 10% TPOT over hybrid 12.5%/4096 at {big} b1 (mean over mean)",
        rect and rect.get("rectify_overhead"), lambda v: v <= 0.10)
    small = min((r["context"] for r in rows), default=None)
    d4 = find(rows, row="dense", batch=1, context=small)
    worst = max((r["tpot_ms"] / d4["tpot_ms"] for r in rows if d4 and r["context"] == small and r["batch"] == 1
                 and r["row"].startswith("h") and r["row"] != "hf" and "error" not in r), default=None)
    add(f"at {small} every hybrid row within 5% of dense mode (b1; worst ratio)", worst, lambda v: v <= 1.05)
    for p in results.get("prefill", []):
        if p["model"] == model:
            add(f"prefill lychee <= 1.05x HF ({p['prompt']} tokens, b{p['batch']})", p.get("ratio"),
                lambda v: v <= 1.05)
    for v in results["variants"]:
        if v["variant"] != "hf" and v["model"] == model:
            add(f"compile <= 90 s ({model} {v['variant']}, b{v['batch']}, {v['layers']} layers)",
                v["compile_s"], lambda s: s <= 90)
    return out


# ------------------------------------------------------------------------------------------------ output
def write_json(args, results) -> str:
    tag = f"_{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"e2e_{args.model}_b{'-'.join(map(str, args.batches))}{tag}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    return path


def print_row(r: dict) -> None:
    rect = f" ({r['rectifications_timed']} rectif.)" if "rectify_every" in r else ""
    if "rectify_overhead" in r:
        rect += (f" re-encode {_fmt(r.get('reencode_ms'))} ms, {100 * r['rectify_overhead']:+.1f}% over "
                 f"{r['base_row']} ({_fmt(r.get('reencode_overhead') and 100 * r['reencode_overhead'], '.1f')}% "
                 "from the re-encoding steps)")
    print(f"   b{r['batch']} ctx {r['context']:>7} {r['row']:<12} TPOT {r['tpot_ms']:8.3f} ms "
          f"(p10 {r['p10_ms']:.3f} p90 {r['p90_ms']:.3f}) loop {r['loop_ms']:.3f} | floor {r['floor_ms']:.3f} ms "
          f"| peak {_fmt(r['peak_gb'], '.1f')} GB{rect}{'  ERROR ' + r['error'] if 'error' in r else ''}", flush=True)


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(results) -> str:
    rows = results["rows"]
    comp = {(v["model"], v["batch"], v["variant"]): v for v in results["variants"]}
    lines = ["| model | B | ctx | row | TPOT ms (median) | p10-p90 ms | loop ms | floor ms | x floor | x best dense "
             "| x HF | compile s | peak GB | recompiles |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["batch"], r["context"], _row_order(r["row"]))):
        ref = {k: find(rows, model=r["model"], batch=r["batch"], context=r["context"], row=k)
               for k in ("flash_dense", "hf")}
        v = comp.get((r["model"], r["batch"], r["variant"]), {})
        lines.append(
            f"| {r['model']} | {r['batch']} | {_ctx(r['context'])} | {_row_label(r)} | {r['tpot_ms']:.3f} | "
            f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f} | {r['loop_ms']:.3f} | {r['floor_ms']:.3f} | "
            f"{r['tpot_ms'] / r['floor_ms']:.2f} | {_ratio(ref['flash_dense'], r)} | {_ratio(ref['hf'], r)} | "
            f"{_fmt(v.get('compile_s'), '.1f')} | {_fmt(r['peak_gb'], '.1f')} | {v.get('recompiles', '-')} |")
    return "\n".join(lines)


def _row_label(r: dict) -> str:
    if "rectify_every" not in r:
        return r["row"]
    return f"{r['row']} (mean; {r.get('rectifications_timed', '?')} rectif. in {r.get('steps', '?')} steps)"


def _row_order(row: str) -> int:
    order = ["hf", "flash_dense", "dense"]
    if row in order:
        return order.index(row)
    base = base_row(row)
    return 3 + 4 * int(base.split("_")[1]) + (0 if base.startswith("h12") else 2) + (1 if base != row else 0)


def _ctx(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def _ratio(ref, r) -> str:
    return "-" if ref is None else f"{ref['tpot_ms'] / r['tpot_ms']:.2f}"


def targets_table(results) -> str:
    lines = ["| target | measured | met |", "|---|---:|---|"]
    for t in results.get("targets", []):
        met = "-" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['target']} | {_fmt(t['measured'], '.2f')} | {met} |")
    return "\n".join(lines)


def plot(results, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(r["model"], r["batch"]) for r in results["rows"]})
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (model, batch) in zip(axes[0], groups):
        rs = [r for r in results["rows"] if r["model"] == model and r["batch"] == batch]
        for row in sorted({r["row"] for r in rs}, key=_row_order):
            pts = sorted((r["context"], r["tpot_ms"], r["floor_ms"]) for r in rs if r["row"] == row)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=row)
            if row in ("dense", "h12_4096"):
                ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=line.get_color(),
                        label=f"{row} floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (valid length)")
        ax.set_ylabel("TPOT ms (median)")
        ax.set_title(f"{model}, batch {batch}")
        ax.legend(fontsize=7)
    fig.suptitle(f"decode TPOT, {results['meta'].get('device', '?')}, {results['meta'].get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths: list[str]) -> dict:
    merged = dict(meta={}, rows=[], variants=[], skipped=[], targets=[])
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        merged["meta"] = merged["meta"] or r["meta"]
        for k in ("rows", "variants", "skipped", "prefill"):
            merged.setdefault(k, []).extend(r.get(k, []))
        if r.get("profile"):
            merged.setdefault("profiles", []).append(r["profile"])
    merged["targets"] = targets(merged)
    return merged


def report(results, out_dir: str, stem: str) -> None:
    png = os.path.join(out_dir, f"{stem}.png")
    try:
        plot(results, png)
        if os.path.exists(png):
            print(f"wrote {png}")
    except ImportError as e:
        print(f"no PNG (matplotlib missing: {e})")
    print()
    print(markdown_table(results))
    if results.get("prefill"):
        print()
        print(prefill_table(results))
    for p in ([results["profile"]] if results.get("profile") else []) + results.get("profiles", []):
        print()
        print(profile_table(p))
    print()
    print(targets_table(results))


# ------------------------------------------------------------------------------------------------ dry-run check
def check_harness(args, base) -> dict:
    """Dry run only: the loop reproduces generate() -- generate's prefill (1 token) into a user StaticCache, then
    DecodeLoop continues; logits must equal a plain generate() on an identical cache, for HF and a hybrid model."""
    from transformers import StaticCache
    out = {}
    prompt = torch.randint(3, base.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    n_new = 6
    for kind in ("hf", "lychee"):
        ref_model, loop_model = (harness_variant(args, base, kind) for _ in range(2))
        ref = ref_model.model.generate(prompt, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                       past_key_values=StaticCache(config=base.config, max_cache_len=96),
                                       return_dict_in_generate=True, output_logits=True)
        cache = StaticCache(config=base.config, max_cache_len=96)
        first = loop_model.model.generate(prompt, attention_mask=mask, max_new_tokens=1, past_key_values=cache)
        loop = DecodeLoop(loop_model.model, compiled_forward(loop_model, {"past_key_values": cache}), cache,
                          2, base.config.vocab_size, "cpu")
        loop.input_ids = first
        length = first.shape[1]
        loop.kwargs = dict(attention_mask=torch.ones(2, length, dtype=torch.long),
                           position_ids=torch.arange(length).expand(2, -1), logits_to_keep=1,
                           past_key_values=cache, use_cache=True)
        with torch.no_grad():
            logits = torch.stack([loop.step() for _ in range(n_new - 1)])
        err = (logits - torch.stack(ref.logits[1:])).abs().max().item()
        out[kind] = dict(max_abs_diff=err, tokens_equal=bool(torch.equal(loop.input_ids, ref.sequences)))
        print(f"harness vs generate ({kind}): max |logit diff| {err:.2e}, tokens equal {out[kind]['tokens_equal']}",
              flush=True)
        if err > 1e-4 or not out[kind]["tokens_equal"]:
            raise BenchError(f"the decode loop does not reproduce generate() for {kind}: {out[kind]}")
        release_compiled()
    return out


def harness_variant(args, base, kind) -> Variant:
    variant = build_variant(args, base, kind, args.budget_list[0])
    if kind == "lychee":
        apply_head_map(args, variant, f"h25_{args.budget_list[0]}")
    variant.model.generation_config.cache_implementation = None     # the check passes its own StaticCache
    return variant


# ------------------------------------------------------------------------------------------------ main
def meta_of(args, env, features, base) -> dict:
    import transformers
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                argv=sys.argv, torch=torch.__version__, transformers=transformers.__version__,
                device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", model=args.model,
                layers=base.config.num_hidden_layers, dtype=str(base.dtype), batches=args.batches,
                contexts=args.context_list, budgets=args.budget_list, rows=args.row_list, steps=args.steps,
                warmup=args.warmup, sink=args.sink, local=args.local, lychee_features=features, max_cache_len={},
                **env)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def apply_inductor_config(pairs: list[str]) -> dict:
    """--inductor KEY=JSON: global Inductor settings (every row's compile sees them, ours and the baselines')."""
    import torch._inductor.config as inductor_config
    applied = {}
    for key, value in key_json_pairs(pairs, "--inductor"):
        obj, name = inductor_config, key
        while "." in name:
            head, name = name.split(".", 1)
            obj = getattr(obj, head)
        if not hasattr(obj, name):
            raise BenchError(f"--inductor {key}: torch._inductor.config has no {key}")
        setattr(obj, name, value)
        applied[key] = value
    return applied


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.plot:
        results = merge(args.plot)
        report(results, args.out, "e2e")
        return 0
    env = setup_environment(args)
    env["inductor_config"] = apply_inductor_config(args.inductor)
    env["lychee_config"] = lychee_overrides(args)
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    env["blas"] = str(torch.backends.cuda.preferred_blas_library())
    features = lychee_features()
    preflight(args, features)
    budget_clock = Budget(args.max_seconds)
    copy_bw = measure_copy_bw(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    positions = max(max_cache_len(args), prefill_cache_len(args), (args.profile_ctx or 0) + 512)
    base = build_base_model(args.model, args.device, dtype, positions, args.layers)
    results = dict(meta=meta_of(args, env, features, base), rows=[], variants=[], skipped=[], targets=[],
                   prefill=[], profile=None)
    results["meta"]["copy_bw_TBps"] = copy_bw / 1e12
    print(json.dumps(results["meta"]), flush=True)
    if args.dry_run:
        results["harness_check"] = check_harness(args, base)
    if args.prefill_list:
        run_prefill(args, base, results)
    for batch in (args.batches if args.row_list else []):
        run_batch(args, base, batch, features, copy_bw, budget_clock, results)
    if args.profile_row is not None:
        if budget_clock.left() <= args.compile_reserve:
            results["skipped"].append(dict(row=args.profile_row, reason="profile: --max-seconds reached"))
            print(f"skip the profile of {args.profile_row}: less than --compile-reserve left", flush=True)
        else:
            run_profile(args, base, results)
    results["targets"] = targets(results)
    path = write_json(args, results)
    print(f"wrote {path}")
    report(results, args.out, os.path.splitext(os.path.basename(path))[0])
    return verdict(results)


def preflight(args, features) -> None:
    """Refuse at once (before minutes of model building and compiling) what cannot run on this checkout."""
    lychee_rows = [r for r in args.row_list if variant_of(r, args.budget_list)[0].startswith("lychee")]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but torch.cuda.is_available() is False; use --dry-run on a CPU machine.")
    if lychee_rows and not features["set_head_map"]:
        raise BenchError("lychee_compile.set_head_map is missing in this checkout: the lychee rows "
                         f"{lychee_rows} swap head maps on one compiled model with it. Merge main (commit 02c8449+).")
    if args.device == "cuda" and lychee_rows and not args.no_cuda_graphs and not features["cuda_graphs"]:
        raise BenchError("LycheeConfig has no cuda_graphs field in this checkout (lead's change not merged); "
                         "merge it or pass --no-cuda-graphs.")


def verdict(results) -> int:
    """Non-zero exit when a row failed or a variant recompiled (results are written first)."""
    bad = [r for r in results["rows"] if "error" in r or not r["logits_finite"]]
    bad += [dict(r, row="prefill", context=r["prompt"]) for r in results.get("prefill", []) if "error" in r]
    recompiled = [v for v in results["variants"] if v["recompiles"]]
    if results["skipped"]:
        print(f"note: {len(results['skipped'])} rows/contexts skipped (reasons in the JSON's 'skipped')")
    few = [v["variant"] for v in results["variants"] if v["steps_after_compile"] < 200]
    if few:
        print(f"note: fewer than 200 decode steps after the compile for {few} (recompile check weaker)")
    for r in bad:
        print(f"FAILED row {r['row']} b{r['batch']} ctx {r['context']}: {r.get('error', 'non-finite logits')}")
    for v in recompiled:
        print(f"FAILED {v['variant']} b{v['batch']}: {v['recompiles']} recompiles after the first call "
              f"({v['recompile_counts']})")
    return 1 if bad or recompiled else 0


if __name__ == "__main__":
    sys.exit(main())
