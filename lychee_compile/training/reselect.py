"""Re-derive a map from the per-head scores a trained map keeps in its metadata, e.g. at another retrieval-head count.

    python -m lychee_compile.training.reselect MAP.safetensors --topk 7 --out MAP-top7.safetensors
    python -m lychee_compile.training.reselect MAP.safetensors --threshold 0.5 --out ...
The metadata is kept; `selection` and `retrieval_heads` are updated and `reselected_from` names the source.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..head_map import HeadMap, HeadMapError
from .trainer import map_from_scores


def reselect(hm: HeadMap, topk: int | None = None, threshold: float | None = None, source: str = "") -> HeadMap:
    if "scores" not in hm.metadata:
        raise HeadMapError("this map has no 'scores' metadata (only maps written by `lychee train-heads` do)")
    scores = torch.tensor(json.loads(hm.metadata["scores"]))
    if topk is not None:
        retrieval, rule = map_from_scores(scores, "topk", n=topk), "topk"
    else:
        retrieval, rule = map_from_scores(scores, "threshold", threshold=threshold), f"threshold>{threshold}"
    meta = dict(hm.metadata, selection=rule, retrieval_heads=str(int(retrieval[1:].sum())), reselected_from=source)
    return HeadMap(retrieval, meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lychee_compile.training.reselect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("map")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--topk", type=int)
    g.add_argument("--threshold", type=float)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    hm = reselect(HeadMap.load(args.map), args.topk, args.threshold, source=args.map)
    hm.save(args.out)
    print(f"wrote {args.out}: {hm!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
