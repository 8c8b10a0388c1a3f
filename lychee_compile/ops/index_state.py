"""The index state: which KV blocks each (row, KV head) selected, threaded from one global layer's op to the next.

Layout (a plain tensor, passed as an explicit op input and returned as an explicit op output):

    idx: int32 [B, Hkv, K]
        B    batch rows (each row selects on its own)
        Hkv  KV heads of the layer (selection is per KV head, shared by its G query heads)
        K    = LycheeConfig.num_select = ceil(budget / block_size), the fixed capacity
    idx[b, h, j] is a text-relative block number of row b (block i = positions [lo_b + i*block_size,
    lo_b + (i+1)*block_size), lo_b the row's first valid position: ops/row_alignment.py), or EMPTY (-1) for an
    unused slot.
    Invariants: the real entries of a slot row are distinct, sorted ascending, and come before every EMPTY;
    sink and local blocks are never stored (they are attended by every head anyway and are outside the budget).

Producer/consumer: a retrieval head writes its top-K candidate blocks; a sparse head copies its input row through
unchanged. The first global layer's op receives `empty_index_state(...)` (every head there is retrieval, so the
input is read by no one) and the last layer's output is dropped: no state lives across decode steps.
"""
from __future__ import annotations

import torch

EMPTY = -1
INDEX_DTYPE = torch.int32


def empty_index_state(batch: int, kv_heads: int, num_select: int, device) -> torch.Tensor:
    return torch.full((batch, kv_heads, num_select), EMPTY, dtype=INDEX_DTYPE, device=device)
