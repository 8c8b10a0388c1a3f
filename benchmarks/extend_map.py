"""Extend a head map with the highest-scoring heads another map's scores give (how the rs24 / rs32 maps of
EVALUATION.md were made: the shipped HardKuma map plus the top retrieval-score heads it lacks).

    python benchmarks/extend_map.py --base lychee_compile/data/smollm2-135m.safetensors \
        --scores benchmarks/results/maps/smollm2-retrieval-score-40.safetensors --heads 24 \
        --out benchmarks/results/maps/smollm2-shipped-plus-rs24.safetensors

--scores is a map file whose metadata holds per-(layer, KV head) scores (`lychee train-heads` writes them as
'scores', a JSON list of lists); heads are added in descending score order (ties: higher layer, then higher head) until
the base has --heads retrieval heads beyond layer 0 (the layer the pass always makes all retrieval)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def extend(base, scores: torch.Tensor, heads: int):
    """A new HeadMap: base plus the best-scoring non-retrieval heads beyond layer 0, up to `heads` there."""
    from lychee_compile import HeadMap
    r = base.retrieval.clone().bool()
    if tuple(scores.shape) != tuple(r.shape):
        raise ValueError(f"scores of shape {tuple(scores.shape)} do not match the map's {tuple(r.shape)}")
    have = int(r[1:].sum())
    if heads < have:
        raise ValueError(f"the base already has {have} retrieval heads beyond layer 0; ask for >= {have}")
    if heads > r[1:].numel():
        raise ValueError(f"only {r[1:].numel()} heads exist beyond layer 0; ask for <= {r[1:].numel()}")
    order = sorted(((float(scores[l, h]), l, h) for l in range(1, r.shape[0]) for h in range(r.shape[1])
                    if not r[l, h]), reverse=True)
    for _, l, h in order[: heads - have]:
        r[l, h] = True
    md = {k: v for k, v in base.metadata.items() if k not in ("scores", "expected_l0")}
    md.update(method=f"{base.metadata.get('method', 'map')}+extended", retrieval_heads=str(heads),
              note=f"base map ({have} retrieval heads beyond layer 0) plus the {heads - have} best-scoring heads "
                   "it lacked (benchmarks/extend_map.py)")
    return HeadMap(r, md)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--scores", required=True)
    ap.add_argument("--heads", type=int, required=True, help="retrieval heads beyond layer 0 in the result")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from lychee_compile import HeadMap
    base, scored = HeadMap.load(args.base), HeadMap.load(args.scores)
    if "scores" not in scored.metadata:
        ap.error(f"{args.scores} has no 'scores' metadata (make it with lychee train-heads)")
    try:
        out = extend(base, torch.tensor(json.loads(scored.metadata["scores"])), args.heads)
    except ValueError as exc:
        ap.error(str(exc))
    out.save(args.out)
    added = (out.retrieval.bool() & ~base.retrieval.bool()).nonzero().tolist()
    print(f"wrote {args.out}: {int(out.retrieval[1:].sum())} retrieval heads beyond layer 0; added {added}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
