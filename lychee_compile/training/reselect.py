"""Re-derive a map from the per-head scores a trained map keeps in its metadata, e.g. at another retrieval-head count.

    python -m lychee_compile.training.reselect MAP.safetensors --topk 7 --out MAP-top7.safetensors
    python -m lychee_compile.training.reselect MAP.safetensors --threshold 0.5 --out ...
    python -m lychee_compile.training.reselect SCORED.safetensors --extend BASE.safetensors --topk 24 --out ...
The metadata is kept; `selection` and `retrieval_heads` are updated and `reselected_from` names the source.
--extend: BASE's retrieval heads plus SCORED's best-scoring heads BASE lacks, until --topk heads beyond layer 0 (the
layer the pass always makes all retrieval); ties: higher layer, then higher head. docs/quality.md's rs24 / rs32 maps are
the shipped map extended by a retrieval-score map.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..errors import HeadMapError
from ..head_map import HeadMap
from .trainer import map_from_scores


def scores_of(hm: HeadMap) -> torch.Tensor:
    """float [layers, KV heads]: the per-head scores `lychee train-heads` keeps in a map's metadata."""
    if "scores" not in hm.metadata:
        raise HeadMapError("this map has no 'scores' metadata (only maps written by `lychee train-heads` do)")
    return torch.tensor(json.loads(hm.metadata["scores"]))


def reselect(hm: HeadMap, topk: int | None = None, threshold: float | None = None, source: str = "") -> HeadMap:
    scores = scores_of(hm)
    if topk is not None:
        retrieval, rule = map_from_scores(scores, "topk", n=topk), "topk"
    else:
        retrieval, rule = map_from_scores(scores, "threshold", threshold=threshold), f"threshold>{threshold}"
    meta = dict(hm.metadata, selection=rule, retrieval_heads=str(int(retrieval[1:].sum())), reselected_from=source)
    return HeadMap(retrieval, meta)


def extend(base: HeadMap, scores: torch.Tensor, heads: int, source: str = "") -> HeadMap:
    """base plus the best-scoring heads beyond layer 0 it lacks, up to `heads` retrieval heads there."""
    r = base.retrieval.clone().bool()
    if tuple(scores.shape) != tuple(r.shape):
        raise HeadMapError(f"scores of shape {tuple(scores.shape)} do not match the map's {tuple(r.shape)}")
    have, room = int(r[1:].sum()), r[1:].numel()
    if not have <= heads <= room:
        raise HeadMapError(f"ask for {have}..{room} retrieval heads beyond layer 0: the base already has {have}, "
                           f"only {room} exist; got {heads}")
    order = sorted(((float(scores[l, h]), l, h) for l in range(1, r.shape[0]) for h in range(r.shape[1])
                    if not r[l, h]), reverse=True)
    for _, l, h in order[: heads - have]:
        r[l, h] = True
    meta = {k: v for k, v in base.metadata.items() if k not in ("scores", "expected_l0")}
    meta.update(selection=f"extended by the top scores of {source or 'a scored map'}", retrieval_heads=str(heads),
                reselected_from=source)
    return HeadMap(r, meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lychee_compile.training.reselect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("map")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--topk", type=int)
    g.add_argument("--threshold", type=float)
    ap.add_argument("--extend", metavar="BASE", help="keep BASE's retrieval heads and add MAP's best-scoring ones "
                                                     "(with --topk: the heads beyond layer 0 in the result)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.extend and args.topk is None:
        ap.error("--extend needs --topk N (retrieval heads beyond layer 0 in the result)")
    try:
        if args.extend:
            hm = extend(HeadMap.load(args.extend), scores_of(HeadMap.load(args.map)), args.topk, source=args.map)
        else:
            hm = reselect(HeadMap.load(args.map), args.topk, args.threshold, source=args.map)
    except HeadMapError as exc:
        ap.error(str(exc))
    hm.save(args.out)
    print(f"wrote {args.out}: {hm!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
