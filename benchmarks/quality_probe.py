"""Small paired quality probes on SmolLM2 with named variants: a diagnosis or a confirmation on chosen prompts, not
the harness's full grid (that is `lychee eval` / benchmarks/real_gpu.py).

    # the passkey-2K prompts lychee@512 lost in the 300-prompt run, with heat / Quest-sparse at <= 512 tokens:
    python benchmarks/quality_probe.py --task passkey --prompts 5,120,191,270,0,145 \
        --variants lychee@512,lychee+qs8@384,lychee+qs16@256,lychee+heat8@384 --out probe.json
    # a configuration chosen on the repeat test's seed-0 prompts, confirmed on 16 fresh ones:
    python benchmarks/quality_probe.py --task repeat --seed 1 --prompts 0-15 \
        --variants lychee@768,lychee+qs24@384 --out confirm.json

Variants: `lychee@B`, `lychee+qsN@B` (LycheeConfig quest="sparse", quest_blocks=N), `lychee+heatN@B` (heat_blocks=N,
decay 0.9), each optionally `:MAP` to run with a head map named by `--maps MAP=PATH` instead of the shipped one;
dense always runs first. Prompts: passkey = indices in the harness's seeded order (prompt i of the
300-prompt run is index i); repeat = indices of repeat_items(seed=--seed). Prints and writes one record per
(prompt, variant) and, for perplexity tasks, every variant's paired ratio vs dense and vs the first variant."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANT = re.compile(r"^lychee(?:\+(qs|heat)(\d+))?@(\d+)(?::([A-Za-z0-9_-]+))?$")


def parse_variant(text: str) -> tuple[str | None, int, int, str | None]:
    """'lychee+qs24@384' -> ('qs', 24, 384, None); 'lychee@768:rs32' -> (None, 0, 768, 'rs32') (a map named by
    --maps)."""
    m = VARIANT.match(text.strip())
    if m is None:
        raise ValueError(f"bad variant {text!r}: use lychee@B, lychee+qsN@B or lychee+heatN@B, optionally :MAP")
    return m.group(1), int(m.group(2) or 0), int(m.group(3)), m.group(4)


def parse_maps(text: str | None) -> dict[str, str]:
    """'rs24=a.safetensors,rs32=b.safetensors' -> {name: path}."""
    out = {}
    for part in (text or "").split(","):
        if part:
            name, eq, path = part.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"bad --maps entry {part!r}: use NAME=PATH")
            out[name] = path
    return out


def parse_prompts(text: str) -> list[int]:
    """'5,120' or '0-15' (inclusive) or a mix."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return out


def _specs(model, hm, variants, maps=None):
    """dense, then one spec per variant; a variant with :MAP runs with that head map (loaded, checked against the
    model) instead of the shipped one and is labelled lychee[MAP]."""
    import dataclasses

    from lychee_compile import HeadMap
    from real_gpu_stages.quality import renamed, specs_for
    parsed = [parse_variant(v) for v in variants]
    maps = maps or {}
    unknown = sorted({m for *_, m in parsed if m is not None and m not in maps})
    if unknown:
        raise ValueError(f"variants name maps {unknown} that --maps does not define")
    loaded = {name: HeadMap.load(path) for name, path in maps.items()}
    for m in loaded.values():
        m.validate_for(model, strict=True)
    base = {s.label: s for s in specs_for(model, ["dense", "lychee"], sorted({p[2] for p in parsed}), hm, "eager")}
    specs = [base["dense"]]
    for (kind, n, b, mname), text in zip(parsed, variants):
        plain = base[f"lychee@{b}"]
        cfg = {"qs": dict(quest="sparse", quest_blocks=n), "heat": dict(heat_blocks=n, heat_decay=0.9)}.get(kind)
        spec = renamed(plain, f"lychee+{kind}{n}", **cfg) if cfg else plain
        if mname is not None:
            spec = dataclasses.replace(spec, name=f"{spec.name}[{mname}]", head_map=loaded[mname])
        specs.append(spec)
    return specs


def _items(task, tok, prompts, seed, score_tokens):
    from lychee_compile.eval.tasks import DEPTHS, passkey_items, repeat_items
    if task == "passkey":
        return passkey_items(tok, [2048], DEPTHS, -(-(max(prompts) + 1) // len(DEPTHS)), seed=seed)
    return repeat_items(tok, 2048, max(prompts) + 1, score_tokens, seed=seed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("passkey", "repeat"), required=True)
    ap.add_argument("--prompts", required=True, help="indices: '5,120,191' or '0-15'")
    ap.add_argument("--variants", required=True, help="comma-separated, e.g. lychee@768,lychee+qs24@384")
    ap.add_argument("--maps", default=None, help="NAME=PATH,...: head maps a variant can name (lychee@768:NAME)")
    ap.add_argument("--seed", type=int, default=0, help="the task's prompt seed (0 = the harness's prompts)")
    ap.add_argument("--score-tokens", type=int, default=32, help="repeat: tokens scored by decode steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    try:
        [parse_variant(v) for v in variants]
        prompts = parse_prompts(args.prompts)
        maps = parse_maps(args.maps)
    except ValueError as exc:
        ap.error(str(exc))
    torch.set_num_threads(args.threads)
    from lychee_compile.eval.runner import run_eval, summarize
    from real_gpu_stages.common import load, shipped_map

    model, tok = load(args.device, "float32")
    hm, _ = shipped_map()
    items = _items(args.task, tok, prompts, args.seed, args.score_tokens)
    specs = _specs(model, hm, variants, maps)
    res = run_eval(model, tok, [items[i] for i in prompts], specs, task=args.task)
    records = [dict(r, prompt=prompts[r["item"]]) for r in res["records"]]
    for r in records:
        print({k: r[k] for k in ("prompt", "label", "all_hit", "nll")})
    out = dict(argv=vars(args), records=records)
    if args.task == "repeat":
        out["vs_dense"] = summarize(res)
        out["vs_first_variant"] = summarize(res, reference=specs[1].label)
        for row in out["vs_dense"]:
            print(row["label"], "ppl", round(row["ppl"], 4), "vs dense", row.get("ppl_ratio_vs_ref"), row.get("ppl_ratio_ci"))
        for row in out["vs_first_variant"]:
            print(row["label"], f"vs {specs[1].label}", row.get("ppl_ratio_vs_ref"), row.get("ppl_ratio_ci"))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
