"""Opt-in measurement of how much context the hybrid decode op actually attends (evaluation only).

    with collect_sparsity() as sp:           # the evaluation harness, around one prompt's decode steps
        ...compiled decode steps (eager backend, or Inductor's extern reference)...
    sp.calls, sp.summary()                    # attended fraction of non-retrieval heads, blocks kept per selection

Why a collector read by the eager reference, and not an extra op output or a graph pass: the quantities are already
computed inside ops/reference.py (the attended mask, the selection); returning them would change the op's schema,
every lowering and every compiled graph, for a number only the evaluation wants. The reference checks one module
global per call (None in normal use: no graph change, no cost beyond that read) and, when a collector is active, reads
tensors it computed anyway -- it writes nothing the op returns, so numerics cannot change (tested). The catch: only
the eager reference reports. A path that does not run it (the Triton lowering on bf16/fp16 CUDA) records nothing,
and the harness refuses a variant whose call count does not match its decode steps x global layers
(eval/scoring.py), so a missing measurement is an error, never a silent zero.

Per call (one global layer, one decode step) and per (row, KV head):
    attended fraction  non-retrieval heads (sparse, streaming, Quest): attended valid tokens / valid tokens;
                       sink + local + kept blocks, in tokens, clipped to the valid positions
    kept blocks        retrieval heads whose selection someone reads (`select`): non-EMPTY slots of idx_out,
                       <= K = capacity (LycheeConfig.num_select); Quest heads' own selections are not counted here
"""
from __future__ import annotations

import contextlib

import torch

ACTIVE: "SparsityCollector | None" = None    # read by ops/reference.py; set only inside collect_sparsity()


class SparsityCollector:
    def __init__(self) -> None:
        self.calls = 0
        # (values [B, Hkv], which entries count [B, Hkv]) per call, left on the op's device: selecting the entries
        # here (boolean indexing) would synchronize a CUDA device at every layer; summary() does it once, on the CPU
        self._attended: list[tuple[torch.Tensor, torch.Tensor]] = []   # fp32 fractions, non-retrieval heads
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []       # int64 kept blocks, reading retrieval heads
        self.capacity: int | None = None

    def record(self, attend: torch.Tensor, valid: torch.Tensor, is_retrieval: torch.Tensor, idx_out: torch.Tensor,
               select: torch.Tensor | None) -> None:
        """attend bool [B, Hkv, T] (what each head attended); valid bool [B, T]; is_retrieval bool [1, Hkv, 1];
        idx_out int32 [B, Hkv, K]; select bool [Hkv] or None."""
        self.calls += 1
        self.capacity = int(idx_out.shape[-1])
        B, Hkv = attend.shape[:2]
        retrieval = is_retrieval.reshape(1, Hkv).expand(B, Hkv)
        n_valid = valid.sum(-1, keepdim=True).clamp_min(1).to(torch.float32)             # [B, 1]
        frac = attend.sum(-1).to(torch.float32) / n_valid                                 # [B, Hkv]
        self._attended.append((frac.detach(), ~retrieval))
        reads = retrieval if select is None else retrieval & select.to(torch.bool).reshape(1, Hkv)
        self._kept.append(((idx_out >= 0).sum(-1).detach(), reads))

    def summary(self) -> dict:
        """n / mean / sd / min / max of the attended fraction (samples: step x layer x row x non-retrieval head)
        and of the kept blocks (samples: step x layer x row x reading retrieval head); None where no sample."""
        return dict(calls=self.calls, capacity=self.capacity, attended=_moments(self._attended),
                    kept_blocks=_moments(self._kept))


def _moments(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict | None:
    x = torch.cat([v.to("cpu", torch.float64)[m.to("cpu")] for v, m in parts]) if parts else torch.zeros(0)
    if x.numel() == 0:
        return None
    sd = float(x.std(correction=0)) if x.numel() > 1 else 0.0
    return dict(n=int(x.numel()), mean=float(x.mean()), sd=sd, min=float(x.min()), max=float(x.max()))


@contextlib.contextmanager
def collect_sparsity():
    """Enable the collector for the block (not re-entrant: nested collection would double-count, so it raises)."""
    global ACTIVE
    if ACTIVE is not None:
        raise RuntimeError("collect_sparsity() is already active; nested collection is not supported.")
    ACTIVE = SparsityCollector()
    try:
        yield ACTIVE
    finally:
        ACTIVE = None
