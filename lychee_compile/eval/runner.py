"""Run a task over methods x budgets with one dense prefill per prompt, and summarize.

    results = run_eval(model, tokenizer, items, specs)       # records: one per (item, method@budget)
    summary = summarize(results)                               # per variant: accuracy / perplexity with 95% CIs
    write_outputs(results, summary, out_dir)                  # results.json, results.md, heatmaps

Prompt-major: each prompt is prefilled once (dense, eager), then every variant scores a copy of that cache, so all
methods see the same prompts (paired) and the prefill cost is paid once.

    results = run_eval(model, tokenizer, items, specs, numerics=parse_numerics("both"))

With numerics (numerics.py), each one scores every variant from its own base model (the fp32 model; a bf16 cast of
it on CUDA) and its own dense prefill of each prompt, prompt by prompt; with more than one, each label carries the
numerics (`lychee@512[kernels]`), a variant's paired difference to dense is to the dense row of its own numerics,
and the kernels rows also get their paired difference to the same variant's reference row.
"""
from __future__ import annotations

import json
import math
import os
import time

from . import stats
from .methods import MethodSpec
from .numerics import KERNELS, REFERENCE, Numerics, require_all
from .scoring import Variant, dense_prefill, dynamo_limits


def run_eval(model, tokenizer, items, specs: list[MethodSpec], progress: bool = True, log=None,
             task: str = "?", on_item=None, numerics: tuple[Numerics, ...] | None = None) -> dict:
    """`on_item(partial_results)` is called after every prompt (the CLI writes partial outputs there). `numerics`:
    None scores `model` and `specs` as given; else every spec under each numerics (refused before any work when
    one cannot run here: numerics.require)."""
    if numerics is not None:
        require_all(numerics)
    with dynamo_limits():
        return _run_eval(model, tokenizer, items, specs, progress, log, task, on_item, numerics)


def _groups(model, specs, numerics) -> list[tuple[object, list[Variant]]]:
    """(base model, its variants) per numerics; one group of `model` itself without numerics."""
    if numerics is None:
        return [(model, [Variant.build(model, spec) for spec in specs])]
    groups = []
    for n in numerics:
        base = n.base_model(model)
        tag = n.tag if len(numerics) > 1 else ""
        groups.append((base, [Variant.build(base, spec, n, tag) for spec in specs]))
    return groups


def _run_eval(model, tokenizer, items, specs, progress, log, task, on_item, numerics) -> dict:
    from tqdm.auto import tqdm

    groups = _groups(model, specs, numerics)
    variants = [v for _, vs in groups for v in vs]
    records = []
    started = time.perf_counter()
    compile_s = {}
    bar = tqdm(total=len(items) * len(variants), desc=f"{task}", unit="score", disable=not progress, dynamic_ncols=True)
    for ii, item in enumerate(items):
        for base, group in groups:
            t0 = time.perf_counter()
            pre = dense_prefill(base, item.input_ids, item.max_cache_len)
            prefill_s = time.perf_counter() - t0
            for v in group:
                bar.set_postfix_str(f"prompt {ii + 1}/{len(items)} {v.label}")
                t0 = time.perf_counter()
                s = v.score(pre, item.targets)
                dt = time.perf_counter() - t0
                if ii == 0:
                    compile_s[v.label] = round(dt, 2)   # includes the first compile
                records.append(dict(item=ii, method=v.spec.name, budget=v.spec.budget,
                                    label=v.label, nll=s.nll, hit_rate=sum(s.hits) / len(s.hits), all_hit=s.all_hit,
                                    n_targets=len(item.targets), score_s=round(dt, 3), prefill_s=round(prefill_s, 3),
                                    sparsity=s.sparsity, **_numerics_fields(v), **item.meta))
                bar.update(1)
            del pre
        if on_item is not None and ii < len(items) - 1:
            on_item(_results(task, records, variants, compile_s, started, partial=True))
    bar.close()
    return _results(task, records, variants, compile_s, started)


def _numerics_fields(v: Variant) -> dict:
    """A record's / variant entry's numerics (none when the run had none: older outputs stay as they were)."""
    return {} if v.numerics is None else dict(numerics=v.numerics.name, numerics_tag=v.tag)


def _results(task, records, variants, compile_s, started, partial=False) -> dict:
    counters = {}
    for v in variants:
        c = v.counters()
        if c is not None:
            v.check_sparse()
            from ..api import state_of
            counters[v.label] = dict(graphs=c.graphs, decode_graphs=c.decode_graphs, sites_rewritten=c.sites_rewritten,
                                     sites_sliding=c.sites_sliding, graphs_left_dense=c.graphs_left_dense,
                                     sites_on_kernel=c.sites_on_kernel, sites_on_reference=c.sites_on_reference,
                                     global_layers=list(state_of(v.model).global_layers))
    return dict(task=task, partial=partial, records=list(records), counters=counters, first_item_s=dict(compile_s),
                variants=[dict(label=v.label, method=v.spec.name, variant=v.spec.variant,
                               description=v.spec.description, budget=v.spec.budget, **_numerics_fields(v),
                               config=None if v.spec.config is None else _cfg_dict(v.spec.config),
                               head_map_digest=None if v.spec.head_map is None else v.spec.head_map.digest(),
                               retrieval_heads=None if v.spec.head_map is None else int(v.spec.head_map.retrieval.sum()),
                               streaming_heads=None if v.spec.head_map is None else int(v.spec.head_map.streaming.sum()))
                          for v in variants],
                wall_s=round(time.perf_counter() - started, 1))


def _cfg_dict(cfg) -> dict:
    import dataclasses
    return dataclasses.asdict(cfg)


def summarize(results: dict, reference: str = "dense") -> list[dict]:
    """Per variant: n prompts, accuracy (all targets argmax) + Wilson CI, perplexity + bootstrap CI, and the paired
    difference to `reference` of the same numerics (accuracy points and perplexity ratio) with bootstrap CIs. A
    variant run under several numerics: its non-reference rows also get the paired difference to its reference-
    numerics row (`*_vs_numerics`: kernels minus reference)."""
    by_label: dict[str, dict[int, dict]] = {}
    for r in results["records"]:
        by_label.setdefault(r["label"], {})[r["item"]] = r
    rows = []
    for v in results["variants"]:
        recs = by_label.get(v["label"], {})
        items = sorted(recs)
        hits = [recs[i]["all_hit"] for i in items]
        nlls = [recs[i]["nll"] for i in items]
        k, n = sum(hits), len(hits)
        # .get: JSON written before the policy methods has no "variant" (its method name is the variant)
        row = dict(label=v["label"], method=v["method"], variant=v.get("variant", v["method"]),
                   budget=v["budget"], n=n, correct=k,
                   accuracy=k / n if n else float("nan"), accuracy_ci=stats.wilson(k, n),
                   ppl=stats.ppl_of(nlls), ppl_ci=tuple(math.exp(x) for x in stats.bootstrap(nlls, stats.mean)),
                   token_hit_rate=stats.mean(recs[i]["hit_rate"] for i in items),
                   sparsity=sparsity_summary([recs[i].get("sparsity") for i in items]))
        tag = v.get("numerics_tag", "")
        if "numerics" in v:
            row.update(numerics=v["numerics"], numerics_tag=tag)
        ref = by_label.get(reference + tag)     # the dense row of the same numerics
        if ref is not None and v["label"] != reference + tag:
            row.update(_paired(recs, ref, items, "vs_ref", "ci"))
        twin = _reference_twin(v)
        if twin is not None and twin in by_label:
            row["vs_numerics"] = REFERENCE.name
            row.update(_paired(recs, by_label[twin], items, "vs_numerics", "vs_numerics_ci"))
        rows.append(row)
    return rows


def _reference_twin(variant: dict) -> str | None:
    """The label of the same variant under the reference numerics, for a variant of another tagged numerics."""
    tag = variant.get("numerics_tag", "")
    if not tag or variant.get("numerics") == REFERENCE.name:
        return None
    return variant["label"][:-len(tag)] + REFERENCE.tag


def _paired(recs: dict, ref: dict, items: list, name: str, ci: str) -> dict:
    """Paired over the prompts both have: accuracy difference (points / 100) and perplexity ratio, bootstrap CIs:
    acc_diff_<name>, acc_diff_<ci>, ppl_ratio_<name>, ppl_ratio_<ci>."""
    pairs = [(recs[i], ref[i]) for i in items if i in ref]

    def acc(ps):
        return stats.mean(float(a["all_hit"]) - float(b["all_hit"]) for a, b in ps)

    def nll(ps):
        return stats.mean(a["nll"] - b["nll"] for a, b in ps)
    return {f"acc_diff_{name}": acc(pairs), f"acc_diff_{ci}": stats.bootstrap(pairs, acc),
            f"ppl_ratio_{name}": math.exp(nll(pairs)),
            f"ppl_ratio_{ci}": tuple(math.exp(x) for x in stats.bootstrap(pairs, nll))}


def sparsity_summary(per_prompt: list[dict | None]) -> dict | None:
    """Per variant, from each prompt's ops/sparsity.py summary: for the attended fraction of non-retrieval heads and
    the blocks kept per retrieval selection, the mean of the prompts' means (prompts weigh equally), the SD of those
    means across prompts, and the min / max over every sample. None for dense (nothing measured)."""
    got = [p for p in per_prompt if p is not None]
    if not got:
        return None
    if len(got) != len(per_prompt):
        raise ValueError("some prompts of a variant have sparsity numbers and some do not; refusing to mix them")
    out = dict(prompts=len(got), capacity=got[0]["capacity"])
    for key in ("attended", "kept_blocks"):
        ms = [p[key] for p in got if p[key] is not None]
        if not ms:
            out[key] = None
            continue
        means = [m["mean"] for m in ms]
        mu = stats.mean(means)
        sd = math.sqrt(sum((x - mu) ** 2 for x in means) / (len(means) - 1)) if len(means) > 1 else 0.0
        out[key] = dict(mean=mu, sd_prompts=sd, min=min(m["min"] for m in ms), max=max(m["max"] for m in ms),
                        samples=sum(m["n"] for m in ms))
    return out


def sparsity_table(summary: list[dict], task: str) -> str:
    """LycheeDecode Table 6 style: per variant its quality and what it attended. Empty if nothing was measured."""
    rows = [r for r in summary if r.get("sparsity")]
    if not rows:
        return ""
    acc = task not in ("repeat", "ppl")
    head = ("| method | budget (K blocks) | n | " + ("accuracy %" if acc else "perplexity")
            + " | attended % of context, non-retrieval heads: mean (sd over prompts) [min, max] | sparsity % "
              "| blocks kept per retrieval selection: mean (sd) [min, max] |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        sp = r["sparsity"]
        a, kb = sp["attended"], sp["kept_blocks"]
        att = "n/a" if a is None else (f"{100 * a['mean']:.1f} ({100 * a['sd_prompts']:.1f}) "
                                       f"[{100 * a['min']:.1f}, {100 * a['max']:.1f}]")
        spa = "n/a" if a is None else f"{100 * (1 - a['mean']):.1f}"
        kept = "n/a" if kb is None else (f"{kb['mean']:.2f} ({kb['sd_prompts']:.2f}) "
                                         f"[{kb['min']:.0f}, {kb['max']:.0f}]")
        quality = _pct(r["accuracy"]) if acc else f"{r['ppl']:.3f}"
        lines.append(f"| {_name(r)} | {r['budget']} ({sp['capacity']}) | {r['n']} | {quality} | {att} | {spa} "
                     f"| {kept} |")
    return head + "\n".join(lines) + "\n"


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}"


def _name(row: dict) -> str:
    """The table's method column: the variant, with its numerics when several ran ("lychee[kernels]")."""
    return row["variant"] + row.get("numerics_tag", "")


SPARSITY_NOTE = ("Sparsity is measured by the eager reference op (ops/sparsity.py): on the reference rows only; the "
                 "kernels rows run the Triton kernels, which report nothing.\n")


def numerics_table(summary: list[dict], task: str) -> str:
    """Per variant run under several numerics: both rows' quality and the paired difference (e.g. kernels minus
    reference, same prompts) with its 95% interval. Empty when a single numerics ran."""
    rows = [r for r in summary if "vs_numerics" in r]
    if not rows:
        return ""
    by_label = {r["label"]: r for r in summary}
    acc = task not in ("repeat", "ppl")
    lines = []
    for r in rows:
        ref, other = r["vs_numerics"], r["numerics"]
        base = by_label[_reference_twin(r)]
        if acc:
            lo, hi = r["acc_diff_vs_numerics_ci"]
            cells = (f"{_pct(base['accuracy'])} | {_pct(r['accuracy'])} | {100 * r['acc_diff_vs_numerics']:+.1f} "
                     f"[{100 * lo:+.1f}, {100 * hi:+.1f}]")
        else:
            lo, hi = r["ppl_ratio_vs_numerics_ci"]
            cells = f"{base['ppl']:.3f} | {r['ppl']:.3f} | {r['ppl_ratio_vs_numerics']:.3f} [{lo:.3f}, {hi:.3f}]"
        lines.append(f"| {r['variant']} | {r['budget'] or '-'} | {r['n']} | {cells} |")
    what = ("accuracy %", "Δ {o} − {r}, points [95% CI]") if acc else ("perplexity", "ratio {o} / {r} [95% CI]")
    head = (f"| method | budget | n | {ref} {what[0]} | {other} {what[0]} | "
            + what[1].format(o=other, r=ref) + " |\n|---|---|---|---|---|---|\n")
    return head + "\n".join(lines) + "\n"


def markdown_table(summary: list[dict], task: str) -> str:
    if task not in ("repeat", "ppl"):       # accuracy tasks: passkey and the RULER-style ones
        head = "| method | budget | n | accuracy % [95% CI] | Δ vs dense, points [95% CI] | answer-token hit % |\n|---|---|---|---|---|---|\n"
        lines = [f"| {_name(r)} | {r['budget'] or '-'} | {r['n']} | {_pct(r['accuracy'])} "
                 f"[{_pct(r['accuracy_ci'][0])}, {_pct(r['accuracy_ci'][1])}] | "
                 + (f"{100 * r['acc_diff_vs_ref']:+.1f} [{100 * r['acc_diff_ci'][0]:+.1f}, {100 * r['acc_diff_ci'][1]:+.1f}]"
                    if "acc_diff_vs_ref" in r else "-")
                 + f" | {_pct(r['token_hit_rate'])} |" for r in summary]
    else:
        head = "| method | budget | n | perplexity [95% CI] | ratio vs dense [95% CI] | token hit % |\n|---|---|---|---|---|---|\n"
        lines = [f"| {_name(r)} | {r['budget'] or '-'} | {r['n']} | {r['ppl']:.3f} "
                 f"[{r['ppl_ci'][0]:.3f}, {r['ppl_ci'][1]:.3f}] | "
                 + (f"{r['ppl_ratio_vs_ref']:.3f} [{r['ppl_ratio_ci'][0]:.3f}, {r['ppl_ratio_ci'][1]:.3f}]"
                    if "ppl_ratio_vs_ref" in r else "-")
                 + f" | {_pct(r['token_hit_rate'])} |" for r in summary]
    table = head + "\n".join(lines) + "\n"
    paired = numerics_table(summary, task)
    if paired:
        table += "\nThe same variants under each numerics, paired over the same prompts:\n\n" + paired
    sparse = sparsity_table(summary, task)
    if sparse:
        table += "\nWhat the variants attended (ops/sparsity.py; per decode step and global layer):\n\n" + sparse
    if any(r.get("numerics") == KERNELS.name for r in summary):
        table += "\n" + SPARSITY_NOTE
    return table


def passkey_grid(results: dict, label: str) -> tuple[list, list, list[list[float]], list[list[int]]]:
    """(lengths, depths, accuracy[length][depth], n[length][depth]) of one variant."""
    recs = [r for r in results["records"] if r["label"] == label]
    lengths = sorted({r["length"] for r in recs})
    depths = sorted({r["depth"] for r in recs})
    acc = [[float("nan")] * len(depths) for _ in lengths]
    cnt = [[0] * len(depths) for _ in lengths]
    for li, L in enumerate(lengths):
        for di, d in enumerate(depths):
            cell = [r["all_hit"] for r in recs if r["length"] == L and r["depth"] == d]
            cnt[li][di] = len(cell)
            if cell:
                acc[li][di] = sum(cell) / len(cell)
    return lengths, depths, acc, cnt


def plot_heatmap(results: dict, label: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths, acc, cnt = passkey_grid(results, label)
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(depths), 1.2 + 0.6 * len(lengths)))
    im = ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context tokens")
    for li in range(len(lengths)):
        for di in range(len(depths)):
            if cnt[li][di]:
                ax.text(di, li, f"{100 * acc[li][di]:.0f}%\nn={cnt[li][di]}", ha="center", va="center", fontsize=7)
    ax.set_title(f"passkey accuracy: {label}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(results: dict, summary: list[dict], out_dir: str, heatmaps: bool = True) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    task = results["task"]
    paths = {"json": os.path.join(out_dir, f"{task}.json"), "md": os.path.join(out_dir, f"{task}.md")}
    with open(paths["json"], "w") as f:
        json.dump(dict(results, summary=summary), f, indent=1)
    md = markdown_table(summary, task)
    if results.get("partial"):
        md = f"(partial: {len({r['item'] for r in results['records']})} prompts scored so far)\n\n" + md
    with open(paths["md"], "w") as f:
        f.write(md)
    if heatmaps and task == "passkey":
        for v in results["variants"]:
            name = v["label"].replace("@", "_").replace("[", "_").replace("]", "")    # lychee_512_kernels
            p = os.path.join(out_dir, f"passkey_{name}.png")
            plot_heatmap(results, v["label"], p)
            paths.setdefault("png", []).append(p)
    return paths


def plot_budget_sweep(summaries: list[list[dict]], path: str, task: str, title: str = "") -> None:
    """Accuracy (passkey/RULER) or perplexity (repeat/ppl) vs budget, one line per method with 95% CI bars, dense
    as a band. `summaries`: summarize() outputs of runs over the same prompts (e.g. a main and a supplementary run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = task not in ("repeat", "ppl")
    rows = [r for s in summaries for r in s]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    dense = next((r for r in rows if r["method"] == "dense"), None)
    if dense is not None:
        val, ci = (dense["accuracy"], dense["accuracy_ci"]) if acc else (dense["ppl"], dense["ppl_ci"])
        ax.axhline(val, color="k", lw=1, label=f"dense (n={dense['n']})")
        ax.axhspan(ci[0], ci[1], color="k", alpha=0.08)
    methods = []

    def line(r):       # one line per variant (lychee-topp=0.8 and =0.9 apart) and numerics; older summaries: method
        return r.get("variant", r["method"]) + r.get("numerics_tag", "")
    for r in rows:
        if r["method"] != "dense" and line(r) not in methods:
            methods.append(line(r))
    for i, m in enumerate(methods):
        pts = sorted((r for r in rows if line(r) == m), key=lambda r: r["budget"])
        xs = [r["budget"] * (1 + 0.03 * (i - len(methods) / 2)) for r in pts]   # small offsets: bars stay apart
        ys = [r["accuracy"] if acc else r["ppl"] for r in pts]
        cis = [r["accuracy_ci"] if acc else r["ppl_ci"] for r in pts]
        ax.errorbar(xs, ys, yerr=[[y - c[0] for y, c in zip(ys, cis)], [c[1] - y for y, c in zip(ys, cis)]],
                    marker="o", capsize=3, label=m)
    ax.set_xscale("log", base=2)
    budgets = sorted({r["budget"] for r in rows if r["budget"]})
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (tokens per non-retrieval head, beyond sink + local)")
    ax.set_ylabel("accuracy" if acc else "perplexity (log scale)")
    if not acc:
        ax.set_yscale("log")
    ax.set_title(title or task, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
