"""Long-context quality at equal KV bytes: lychee (a calibrated map at its budget) against Quest, DuoAttention-style
streaming, TidalDecode-style layer sharing and StreamingLLM, each baseline's budget solved so that its KV bytes per
decode step are those of lychee at that context length.

    python benchmarks/long_context.py --model qwen2.5-coder-0.5b --lengths 8192,16384,32768 \
        --tasks passkey,multikey,vartrack --numerics kernels --out $OUT       # the shipped certified map

Per context length T: lychee's bytes per step B(T) (calibrate/kv_bytes.py: K and V rows read, plus Quest's min/max
block descriptors; the model's global layers from lychee_compile's probe); for each baseline the largest budget, in
whole blocks, whose bytes per step are <= B(T) (bytes grow with the budget; a baseline that exceeds B(T) even at its
smallest budget -- sink + local -- is run there and flagged). Every method then scores the same prompts of that
length (eval harness: one dense prefill per prompt, teacher-forced decode steps per method, paired 95% intervals
against dense). Tasks: passkey (needle depths x --trials, heatmap per method) and the RULER-style tasks of
lychee_compile/eval/ruler.py (--prompts each). Duo and random take the given map's retrieval heads; tidal takes
whole layers (eval/methods.py).

Writes into --out: long_context.json (settings, per length the budgets and bytes of every method, every task's
results and summary, and the run's wall time, first-prompt times (compiles included) and counters), long_context.md (one accuracy table: methods x task@length, with budgets and bytes), and
passkey_heatmaps.png (one heatmap per method, depth x length). Each length scores every task's prompts in one run,
so each method compiles once per length; --max-seconds stops before a length that would start past it; what ran is
written after every length. Runs made one length at a time join into one table and heatmap:

    python benchmarks/long_context.py --join RUN_8K,RUN_16K,RUN_32K --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lychee_compile.calibrate.kv_bytes import bytes_per_step  # noqa: E402

BASELINES = ("quest", "duo", "tidal", "streamingllm", "random")


def method_bytes(model, spec, global_layers, context: int) -> float:
    """KV bytes one decode step of `spec` reads per sequence at `context` tokens (dense: spec.config None)."""
    itemsize = 2      # the kernels' bf16 cache; a ratio between methods does not depend on it
    if spec.config is None:
        return bytes_per_step(model.config, None, global_layers, None, context, itemsize)
    hm, cfg = spec.head_map, spec.config
    with warnings.catch_warnings():            # the map's own warnings were shown when it was loaded
        warnings.simplefilter("ignore")
        effective = hm.effective(global_layers, cfg.first_layer_retrieval)
    return bytes_per_step(model.config, effective, global_layers, cfg, context, itemsize, streaming=hm.streaming)


def matched_budget(make_spec, model, global_layers, context: int, target: float, block: int, smallest: int):
    """(spec, bytes, matched) for the largest budget (a multiple of `block`, >= smallest) whose bytes <= target."""
    lo, hi = smallest, max(smallest, context // block * block)
    if method_bytes(model, make_spec(lo), global_layers, context) > target:
        spec = make_spec(lo)
        return spec, method_bytes(model, spec, global_layers, context), False
    if method_bytes(model, make_spec(hi), global_layers, context) <= target:
        lo = hi                                # the whole context fits lychee's bytes
    while hi - lo > block:                     # invariant: bytes(lo) <= target < bytes(hi)
        mid = (lo + hi) // 2 // block * block
        if mid <= lo:
            break
        if method_bytes(model, make_spec(mid), global_layers, context) <= target:
            lo = mid
        else:
            hi = mid
    spec = make_spec(lo)
    return spec, method_bytes(model, spec, global_layers, context), True


def items_for(task: str, tok, length: int, args, chat_template: bool):
    from lychee_compile.eval.ruler import RULER_TASKS
    from lychee_compile.eval.tasks import passkey_items
    if task == "passkey":
        depths = [float(d) for d in args.depths.split(",")]
        return passkey_items(tok, [length], depths, args.trials, args.seed, chat_template=chat_template)
    return RULER_TASKS[task](tok, length, args.prompts, seed=args.seed)


def score_tasks(model, tok, specs, tasks: list[str], length: int, args, chat: bool, numerics) -> tuple[dict, dict]:
    """({task: its records, variants and summary}, the run's wall_s / first_item_s / counters): every task's prompts
    of this length in ONE run_eval, so each method compiles once per length (a run_eval per task would build and
    compile every variant again)."""
    import dataclasses

    from lychee_compile.eval.runner import run_eval, summarize
    items = [dataclasses.replace(it, meta=dict(it.meta, task=task))
             for task in tasks for it in items_for(task, tok, length, args, chat)]
    res = run_eval(model, tok, items, specs, progress=False, task="+".join(tasks), numerics=numerics)
    out = {}
    for task in tasks:
        part = dict(task=task, records=[r for r in res["records"] if r["task"] == task], variants=res["variants"])
        part["summary"] = summarize(part)
        for r in part["records"]:
            r.pop("sparsity", None)
        out[task] = part
    return out, {k: res[k] for k in ("wall_s", "first_item_s", "counters")}


def heatmaps(per_length: list[dict], path: str) -> None:
    """One passkey heatmap per method: context length x needle depth, accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [(pl["length"], r) for pl in per_length if "passkey" in pl["tasks"]
            for r in pl["tasks"]["passkey"]["records"]]
    if not recs:
        return
    methods = list(dict.fromkeys(r["label"].split("@")[0] for _, r in recs))
    lengths = sorted({L for L, _ in recs})
    depths = sorted({r["depth"] for _, r in recs})
    fig, axes = plt.subplots(1, len(methods), figsize=(2.2 * len(methods) + 1, 0.6 * len(lengths) + 1.4),
                             squeeze=False)
    for ax, m in zip(axes[0], methods):
        acc = [[float("nan")] * len(depths) for _ in lengths]
        for li, L in enumerate(lengths):
            for di, d in enumerate(depths):
                cell = [r["all_hit"] for Lr, r in recs if Lr == L and r["depth"] == d
                        and r["label"].split("@")[0] == m]
                if cell:
                    acc[li][di] = sum(cell) / len(cell)
                    ax.text(di, li, f"{100 * acc[li][di]:.0f}", ha="center", va="center", fontsize=7)
        ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)), [_tokens(L) for L in lengths], fontsize=7)
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("depth", fontsize=8)
    fig.suptitle("passkey accuracy (%) at equal KV bytes per step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def table(per_length: list[dict]) -> str:
    head = "| length | method | budget | KV bytes vs dense | " + " | ".join(
        sorted({t for pl in per_length for t in pl["tasks"]})) + " |"
    tasks = sorted({t for pl in per_length for t in pl["tasks"]})
    lines = ["accuracy [paired difference to dense, points, 95%] (n prompts)", "", head, "|" + "---|" * (4 + len(tasks))]
    for pl in per_length:
        for m in pl["methods"]:
            cells = []
            for t in tasks:
                row = next((r for r in pl["tasks"].get(t, {}).get("summary", []) if r["label"] == m["label"]), None)
                if row is None:
                    cells.append("-")
                    continue
                ci = row.get("acc_diff_ci")        # paired difference to dense, accuracy points
                cells.append(f"{100 * row['accuracy']:.0f}%" + (f" [{100 * ci[0]:+.0f}, {100 * ci[1]:+.0f}]"
                                                                if ci else "") + f" (n={row['n']})")
            flag = "" if m.get("matched", True) else " (above lychee's bytes at its smallest budget)"
            lines.append(f"| {_tokens(pl['length'])} | {m['method']} | {m['budget'] or '-'} | "
                         f"{100 * m['bytes_vs_dense']:.1f}%{flag} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--head-map", default=None, help="lychee's map (a calibrated one carries its budget; default: "
                                                     "the certified map shipped for the model)")
    ap.add_argument("--budget", type=int, default=None, help="lychee's budget (default: the map's recommended one)")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--tasks", default="passkey,multikey,vartrack")
    ap.add_argument("--methods", default="dense,lychee," + ",".join(BASELINES))
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--trials", type=int, default=4, help="passkey prompts per depth and length")
    ap.add_argument("--prompts", type=int, default=20, help="RULER-style prompts per task and length")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--numerics", default="kernels", choices=["reference", "kernels"])
    ap.add_argument("--max-seconds", type=float, default=1e9)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--join", default=None, help="comma-separated folders of earlier runs (one length each): write "
                                                  "their joined table and heatmaps to --out, run nothing")
    args = ap.parse_args(argv)
    if args.join:
        join([d for d in args.join.split(",") if d], args.out)
        return 0

    from lychee_compile.api import probe_global_layers
    from lychee_compile.config import LycheeConfig
    from lychee_compile.eval.methods import method_spec
    from lychee_compile.eval.models import load_eval_model
    from lychee_compile.eval.numerics import parse_numerics
    from lychee_compile.head_map import HeadMap

    t0 = time.perf_counter()
    numerics = parse_numerics(args.numerics)
    model, tok, entry = load_eval_model(args.model, progress=False)
    if args.head_map is None:
        from lychee_compile.training import shipped_map_for
        shipped = shipped_map_for(model)
        if shipped is None:
            raise SystemExit(f"no certified map ships for {entry.title}: give --head-map")
        hm, args.head_map = shipped
    else:
        hm = HeadMap.load(args.head_map)
    budget = args.budget or hm.recommended_budget
    if not budget:
        raise SystemExit(f"{args.head_map} records no recommended budget: give --budget")
    if hm.shape != (model.config.num_hidden_layers, model.config.num_key_value_heads):
        raise SystemExit(f"head map {hm.shape} does not match {entry.title}")
    global_layers, _, _ = probe_global_layers(model, LycheeConfig(budget=budget, backend="eager"))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    chat = bool(entry.chat_template)
    results = dict(settings=dict(vars(args), model_title=entry.title, budget=budget, global_layers=global_layers,
                                 torch=torch.__version__, device=torch.cuda.get_device_name() if
                                 torch.cuda.is_available() else "cpu",
                                 date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), lengths=[])
    os.makedirs(args.out, exist_ok=True)
    for length in [int(x) for x in args.lengths.split(",")]:
        lychee = method_spec("lychee", model, budget, hm)
        target = method_bytes(model, lychee, global_layers, length)
        dense_bytes = method_bytes(model, method_spec("dense", model, budget), global_layers, length)
        specs, rows = [], []
        for m in methods:
            if m == "dense":
                spec, b, ok = method_spec("dense", model, budget), dense_bytes, True
            elif m == "lychee":
                spec, b, ok = lychee, target, True
            else:
                smallest = lychee.config.block_size * -(-(lychee.config.sink_tokens + lychee.config.local_tokens)
                                                        // lychee.config.block_size)
                spec, b, ok = matched_budget(lambda x, m=m: method_spec(m, model, x, hm), model, global_layers,
                                             length, target, lychee.config.block_size, smallest)
            specs.append(spec)
            rows.append(dict(method=m, label=spec.label, budget=spec.budget, bytes=b, bytes_vs_dense=b / dense_bytes,
                             matched=ok, description=spec.description))
        entry_l = dict(length=length, methods=rows, tasks={})
        results["lengths"].append(entry_l)
        print(f"== {length}: " + ", ".join(f"{r['label']} {100 * r['bytes_vs_dense']:.1f}%" for r in rows), flush=True)
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if time.perf_counter() - t0 > args.max_seconds:
            entry_l["tasks"] = {t: dict(skipped="--max-seconds") for t in tasks}
            continue
        entry_l["tasks"], entry_l["run"] = score_tasks(model, tok, specs, tasks, length, args, chat, numerics)
        for task, res in entry_l["tasks"].items():
            print(f"   {task} @ {length}: " + ", ".join(f"{s['label']} {100 * s.get('accuracy', 0):.0f}%"
                                                      for s in res["summary"]) +
                  f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        with open(os.path.join(args.out, "long_context.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    write_outputs(results, args.out)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


def write_outputs(results: dict, out: str) -> None:
    """long_context.json (everything, skipped parts included), .md (the table) and passkey_heatmaps.png in `out`."""
    done = [dict(pl, tasks={k: v for k, v in pl["tasks"].items() if "summary" in v}) for pl in results["lengths"]]
    done = [pl for pl in done if pl["tasks"]]          # the JSON keeps what was skipped
    md = table(done)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "long_context.md"), "w") as f:
        f.write(md + "\n")
    heatmaps(done, os.path.join(out, "passkey_heatmaps.png"))
    with open(os.path.join(out, "long_context.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(md)
    print(f"wrote {out}/long_context.json, long_context.md, passkey_heatmaps.png")


def join(dirs: list[str], out: str) -> dict:
    """One table and heatmap from runs made one length at a time (each DIR/long_context.json): the lengths in order,
    each run's settings kept beside its lengths (`runs`)."""
    runs = []
    for d in dirs:
        with open(os.path.join(d, "long_context.json")) as f:
            runs.append(json.load(f))
    lengths = sorted((pl for r in runs for pl in r["lengths"]), key=lambda pl: pl["length"])
    seen = [pl["length"] for pl in lengths]
    if len(set(seen)) != len(seen):
        raise SystemExit(f"--join: a length appears in more than one run ({seen})")
    for r in runs[1:]:
        differ = [k for k in JOIN_SAME if r["settings"].get(k) != runs[0]["settings"].get(k)]
        if _map_key(r["settings"]) != _map_key(runs[0]["settings"]):
            differ.append("head_map")
        if differ:
            raise SystemExit(f"--join: the runs differ in {', '.join(differ)}; only the lengths and tasks may")
    results = dict(runs=[dict(settings=r["settings"], lengths=[pl["length"] for pl in r["lengths"]]) for r in runs],
                   lengths=lengths)
    write_outputs(results, out)
    return results


# what the runs of one table must share (the lengths, tasks, output folder, date and time box may differ)
JOIN_SAME = ("model", "budget", "methods", "depths", "trials", "prompts", "seed", "numerics")


def _map_key(settings: dict) -> str:
    """A run's head map: its digest where the file is here (the same map may sit at two paths), else its file name."""
    path = settings.get("head_map") or ""
    if os.path.exists(path):
        from lychee_compile.head_map import HeadMap
        return HeadMap.load(path).digest()
    return os.path.basename(path)


if __name__ == "__main__":
    sys.exit(main())
