"""Text-relative blocks: each row's blocks start at its first valid position.

Row b's valid positions are one range [lo_b, hi_b) (masks.py refuses anything else). Block j of row b covers the
cache positions [lo_b + j * bs, lo_b + (j + 1) * bs), so a prompt gets the same blocks whatever padding precedes it
(a padded row selects what it selects alone). The index state, heat and Quest descriptors hold these block numbers;
nb = ceil(T / bs) per row stays, the blocks past a row's end holding no valid position. Without padding (lo_b = 0)
block j is positions [j * bs, (j + 1) * bs).

The block code of the reference works on a text-relative position axis: `to_text` gathers each row's positions
lo_b + t (t in [0, T)), `to_cache` puts a text-relative axis back at the cache positions. Both are exact gathers
(with lo_b = 0 the identity), guard-free under a symbolic T, and never synchronise with the device.
"""
from __future__ import annotations

import torch


def row_range(valid: torch.Tensor, ranges: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """valid bool [B, T] -> (lo, n) int64 [B]: each row's first valid position and its number of valid positions
    (one range [lo, lo + n)); (0, 0) for a row without one. ranges: lychee::valid_ranges(valid) when the caller
    has it (the rewrite computes it once per graph and passes it to every layer's op)."""
    # Through lychee::valid_ranges, an op opaque to Inductor: the Quest and heat composites trace this into their
    # decode graphs, and Inductor (torch 2.11) miscompiled the mask reductions fused there at batch 1 and 8K keys
    # (a split-scan kernel with a reduction fused in; a split reduction's second stage inside a pointwise kernel).
    if ranges is None:
        ranges = torch.ops.lychee.valid_ranges(valid)
    start, end = ranges.to(torch.int64)                                                      # [B] each
    has = torch.gather(valid, -1, start[:, None])[:, 0]                                      # an empty row: False
    return start, torch.where(has, end - start, torch.zeros_like(start))


def row_start(valid: torch.Tensor) -> torch.Tensor:
    """valid bool [B, T] -> int64 [B]: each row's first valid position (0 for a row without one)."""
    return row_range(valid)[0]


def shift_positions(x: torch.Tensor, offset: torch.Tensor, dim: int = -1, fill=0) -> torch.Tensor:
    """out[b, ..., t, ...] = x[b, ..., t + offset[b], ...] along `dim` (x [B, ..., T, ...], offset int [B]); `fill`
    where t + offset[b] falls outside [0, T)."""
    dim = dim % x.dim()
    T = x.shape[dim]
    src = torch.arange(T, device=x.device)[None, :] + offset.to(x.device)[:, None]           # [B, T]
    inside = (src >= 0) & (src < T)
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = T
    gathered = torch.gather(x, dim, src.clamp(0, T - 1).reshape(shape).expand(x.shape))
    return torch.where(inside.reshape(shape), gathered, torch.tensor(fill, dtype=x.dtype, device=x.device))


def to_text(x: torch.Tensor, lo: torch.Tensor, dim: int = -1, fill=0) -> torch.Tensor:
    """Cache positions -> text-relative positions: out[b, t] = x[b, lo[b] + t] (`fill` past the cache's end)."""
    return shift_positions(x, lo, dim, fill)


def to_cache(x: torch.Tensor, lo: torch.Tensor, dim: int = -1, fill=0) -> torch.Tensor:
    """Text-relative positions -> cache positions: out[b, p] = x[b, p - lo[b]] (`fill` before lo[b])."""
    return shift_positions(x, -lo, dim, fill)
