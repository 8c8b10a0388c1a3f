"""Import DuoAttention's public per-KV-head patterns (e.g. `full_attention_heads.tsv`) into a HeadMap.

The file has one row per layer and one tab-separated value per KV head (numpy.savetxt, e.g. 1.000000000000000000e+00):
the learned gate α (1 = the head needs full attention, i.e. a retrieval head), clipped to [0, 1] as DuoAttention's
load_attn_pattern does. A head is retrieval iff α >= threshold (DuoAttention's rule), or keep the N largest.
Blank lines and lines starting with '#' are skipped.
    python -m lychee_compile.training.duo_import full_attention_heads.tsv --out map.safetensors [--threshold 0.5 |
        --retrieval-heads N]
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..errors import HeadMapError
from ..head_map import HeadMap


def read_duo_tsv(path: str) -> torch.Tensor:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                rows.append([float(x) for x in line.replace(",", "\t").split()])
            except ValueError as exc:
                raise HeadMapError(f"{path}:{n}: not a row of numbers ({exc})") from exc
    if not rows:
        raise HeadMapError(f"{path}: no rows")
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        raise HeadMapError(f"{path}: rows have different numbers of heads {sorted(widths)}")
    return torch.tensor(rows, dtype=torch.float32).clamp(0.0, 1.0)


def duo_to_head_map(scores: torch.Tensor, threshold: float | None = 0.5, retrieval_heads: int | None = None,
                    source: str = "") -> HeadMap:
    """Threshold α (default 0.5), or keep the `retrieval_heads` largest α (ties to the lower layer / head)."""
    if retrieval_heads is not None:
        flat = scores.reshape(-1)
        keep = torch.zeros_like(flat, dtype=torch.bool)
        keep[torch.sort(flat, descending=True, stable=True).indices[:retrieval_heads]] = True
        retrieval = keep.reshape(scores.shape)
        rule = f"top-{retrieval_heads}"
    else:
        retrieval = scores >= threshold
        rule = f"alpha>={threshold}"
    return HeadMap(retrieval, {"method": "duo-import", "source": source, "selection": rule,
                               "retrieval_heads": str(int(retrieval.sum()))})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lychee_compile.training.duo_import", description=__doc__)
    ap.add_argument("tsv")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--retrieval-heads", type=int, default=None)
    args = ap.parse_args(argv)
    hm = duo_to_head_map(read_duo_tsv(args.tsv), args.threshold, args.retrieval_heads, source=args.tsv)
    hm.save(args.out)
    print(f"wrote {args.out}: {hm!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
