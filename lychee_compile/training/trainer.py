"""Training loop for head gates: seeded, resumable (checkpoint every step), with a progress bar.

    L = mean over the step's sequences of Σ_j ‖y_S[j] − y_T[j]‖²  (+ λ·(E‖z‖₀ − N_target) | + l1·Σα for Duo)
(α, β) (or the family's parameters) take Adam steps; λ takes a gradient-ascent step (lagrangian.py: either sign for
the default equality constraint, clamped at 0 for an at-most budget).
Model weights are frozen. Determinism: each step's sample order and gate noise come from a generator seeded with
(seed, step), so a resumed run follows exactly the path of an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import torch

from .gates import FAMILIES
from .lagrangian import Lagrangian
from .mixed_attention import MixedAttention, use_mixed_attention


@dataclasses.dataclass
class TrainConfig:
    method: str = "hardkuma"
    retrieval_heads: int = 16          # N_target: retrieval heads wanted beyond the all-retrieval first layer
    steps: int = 100
    batch: int = 2                     # sequences per step
    lr: float = 0.05                   # Adam on the gate parameters (LycheeDecode: 0.01)
    lambda_lr: float = 0.002           # gradient ascent on λ
    # the head-count constraint (lagrangian.py): "equality" (E‖z‖₀ = N_target, λ of either sign) or "at-most"
    # (E‖z‖₀ <= N_target, λ >= 0); rho: the augmented term (ρ/2)(E‖z‖₀ − N_target)²
    constraint: str = "equality"
    rho: float = 0.5
    # the first target_warmup steps move the target linearly from the gates' initial E‖z‖₀ down to N_target: the
    # constraint never sits far from its current target, so λ does not wind up (a wound-up λ pushed every head down
    # together and left E‖z‖₀ below N_target, or spread it thinly over many heads), and the distillation loss has
    # the time to tell heads apart. A step count, not a fraction, so a run resumed with more --steps keeps its path.
    target_warmup: int = 50
    l1: float = 0.05                   # Duo only
    budget_frac: float = 0.3           # sparse heads' token budget during training, fraction of the prompt
    # "sum": Σ_j ‖y_S[j] − y_T[j]‖² as in LycheeDecode; "vocab-mean": the same divided by the vocabulary size
    # (keeps λ and the distillation term on one scale, so short runs with λ-lr ~0.01-0.1 can reach the budget)
    loss_norm: str = "vocab-mean"
    block_size: int = 16
    sink_tokens: int = 16
    local_tokens: int = 64
    seed: int = 0

    def fingerprint(self) -> str:
        import hashlib
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _num_select(samples, cfg: TrainConfig) -> int:
    n = max(s.n_prompt for s in samples)
    return max(1, math.ceil(cfg.budget_frac * n / cfg.block_size))


class Trainer:
    def __init__(self, model, samples, cfg: TrainConfig, checkpoint: str | None = None):
        self.model, self.samples, self.cfg, self.checkpoint = model, samples, cfg, checkpoint
        self.num_layers = model.config.num_hidden_layers
        self.num_kv = model.config.num_key_value_heads
        self.trainable = (self.num_layers - 1) * self.num_kv   # the first (global) layer is all retrieval
        torch.manual_seed(cfg.seed)
        fam = FAMILIES[cfg.method]
        self.gates = fam(self.trainable, l1=cfg.l1) if cfg.method == "duo" else fam(self.trainable)
        self.opt = torch.optim.Adam(self.gates.parameters(), lr=cfg.lr)
        if cfg.constraint not in ("equality", "at-most"):
            raise ValueError(f"constraint must be 'equality' or 'at-most', got {cfg.constraint!r}")
        self.lag = Lagrangian(cfg.retrieval_heads, lr=cfg.lambda_lr, equality=cfg.constraint == "equality",
                              rho=cfg.rho)
        self.step = 0
        self.history: list[dict] = []        # per step: loss, distill, E‖z‖₀, λ, score [H]
        self.num_select = _num_select(samples, cfg)
        for p in model.parameters():
            p.requires_grad_(False)
        if checkpoint and os.path.exists(checkpoint):
            self.load(checkpoint)

    # --- persistence ------------------------------------------------------------------------------------------
    def state(self):
        return {"cfg": dataclasses.asdict(self.cfg), "step": self.step, "gates": self.gates.state_dict(),
                "opt": self.opt.state_dict(), "lag": self.lag.state_dict(), "history": self.history}

    def save(self, path):
        torch.save(self.state(), path + ".tmp")
        os.replace(path + ".tmp", path)

    def load(self, path):
        st = torch.load(path, weights_only=False)
        if st["cfg"] != dataclasses.asdict(self.cfg):
            diff = {k: (st["cfg"].get(k), v) for k, v in dataclasses.asdict(self.cfg).items() if st["cfg"].get(k) != v}
            if set(diff) - {"steps"}:
                raise ValueError(f"checkpoint {path} was made with other settings {diff}; use another --checkpoint "
                                 "or the same settings (only --steps may change on resume)")
        self.gates.load_state_dict(st["gates"])
        self.opt.load_state_dict(st["opt"])
        self.lag.load_state_dict(st["lag"])
        self.step = st["step"]
        self.history = st["history"]

    # --- one step -----------------------------------------------------------------------------------------------
    def gate_matrix(self, z_row: torch.Tensor) -> torch.Tensor:
        """[H] trainable gates -> [num_layers, Hkv] with the first layer fixed at 1."""
        return torch.cat([torch.ones(self.num_kv, dtype=z_row.dtype), z_row]).reshape(self.num_layers, self.num_kv)

    def student_logits(self, sample, gates_matrix):
        state = MixedAttention(gates_matrix, self.num_select, self.cfg.block_size, self.cfg.sink_tokens,
                               self.cfg.local_tokens)
        with use_mixed_attention(self.model, state):
            return self.model(input_ids=sample.inputs, past_key_values=sample.cache(), use_cache=True).logits[0]

    def train_step(self):
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
        order = torch.randperm(len(self.samples), generator=g)[:cfg.batch].tolist()
        z = self.gates.sample(len(order), generator=g)                 # [batch, H]
        self.opt.zero_grad(set_to_none=True)
        distill = 0.0
        for b, i in enumerate(order):
            s = self.samples[i]
            logits = self.student_logits(s, self.gate_matrix(z[b]))
            sq = ((logits.float() - s.teacher) ** 2).sum()
            if cfg.loss_norm == "vocab-mean":
                sq = sq / logits.shape[-1]
            loss_b = sq / len(order)
            loss_b.backward(retain_graph=b < len(order) - 1)
            distill += float(loss_b.detach())
        constraint = self.gates.constraint()
        if constraint is not None and self.gates.lagrangian:
            self.lag.target = self.target_now(float(constraint.detach()))
        extra = torch.zeros(())
        if constraint is not None and self.gates.lagrangian:
            extra = extra + self.lag.term(constraint)
        extra = extra + self.gates.penalty()
        if extra.requires_grad:
            extra.backward()
        self.opt.step()
        self.gates.after_step()
        el0 = float(constraint.detach()) if constraint is not None else float(self.gates.score().sum())
        lam = self.lag.step(el0) if self.gates.lagrangian else 0.0
        self.step += 1
        rec = {"step": self.step, "distill": distill, "expected_l0": el0, "lambda": lam, "target": self.lag.target,
               "score": self.gates.score().tolist()}
        self.history.append(rec)
        return rec

    def target_now(self, expected_l0: float) -> float:
        """N_target, or during the first target_warmup steps a linear path to it from the first step's E‖z‖₀ (kept
        in the history, so a resumed run follows the same path)."""
        cfg = self.cfg
        start = self.history[0]["expected_l0"] if self.history else expected_l0
        left = max(0.0, 1.0 - self.step / cfg.target_warmup) if cfg.target_warmup > 0 else 0.0
        return cfg.retrieval_heads + max(0.0, start - cfg.retrieval_heads) * left

    def train(self, progress: bool = True):
        from tqdm.auto import tqdm
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"train-heads {self.cfg.method}",
                   disable=not progress)
        while self.step < self.cfg.steps:
            t0 = time.perf_counter()
            rec = self.train_step()
            if self.checkpoint:
                self.save(self.checkpoint)
            bar.set_postfix(distill=f"{rec['distill']:.3g}", EL0=f"{rec['expected_l0']:.1f}",
                            lam=f"{rec['lambda']:.3g}", s=f"{time.perf_counter() - t0:.1f}")
            bar.update(1)
        bar.close()
        return self.history

    # --- the map ------------------------------------------------------------------------------------------------
    def scores(self) -> torch.Tensor:
        return self.gates.score()

    def score_matrix(self) -> torch.Tensor:
        """[num_layers, Hkv] scores (E[z]; Duo: α), first layer 1."""
        return self.gate_matrix(self.scores().float())


def map_from_scores(score_matrix: torch.Tensor, select: str, n: int | None = None,
                    threshold: float = 0.5) -> torch.Tensor:
    """bool [num_layers, Hkv]: first layer always True; the rest by `select`:
    "threshold": score > threshold;  "topk": the n highest-scoring heads (ties to the lower layer/head)."""
    rest = score_matrix[1:].reshape(-1)
    keep = torch.zeros_like(rest, dtype=torch.bool)
    if select == "threshold":
        keep = rest > threshold
    elif select == "topk":
        order = torch.sort(rest, descending=True, stable=True).indices[: int(n)]
        keep[order] = True
    else:
        raise ValueError(f"select must be 'threshold' or 'topk', got {select!r}")
    out = torch.ones_like(score_matrix, dtype=torch.bool)
    out[1:] = keep.reshape(score_matrix.shape[0] - 1, score_matrix.shape[1])
    return out
