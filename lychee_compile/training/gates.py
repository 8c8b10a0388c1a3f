"""Gate families over the trainable heads (every KV head of every global layer after the first).

Each family holds its parameters as one tensor per name (so the trainer can save / resume them) and exposes:
    sample(n, generator) -> z [n, H]   gates used in a training forward (one row per sequence)
    constraint()         -> scalar     E‖z‖₀ for the Lagrangian families (HardKuma, HardConcrete), else None
    penalty()            -> scalar     the Duo family's L1 term (Σ α), else 0
    score()              -> [H]        what the inference map thresholds / ranks: E[z] (Duo: α itself)
"""
from __future__ import annotations

import math

import torch

from . import hardkuma


class GateFamily:
    name = "?"
    lagrangian = True

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.params: dict[str, torch.Tensor] = {}

    def parameters(self):
        return list(self.params.values())

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        raise NotImplementedError

    def constraint(self):
        return None

    def penalty(self):
        return torch.zeros(())

    def score(self) -> torch.Tensor:
        raise NotImplementedError

    def after_step(self) -> None:
        pass

    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.params.items()}

    def load_state_dict(self, state):
        with torch.no_grad():
            for k, v in state.items():
                self.params[k].copy_(v)


class HardKumaGates(GateFamily):
    """LycheeDecode: z ~ HardKuma(α, β) per head, log-space parameters, α = β = 1 at start."""
    name = "hardkuma"

    def __init__(self, num_heads: int):
        super().__init__(num_heads)
        self.params = {"log_a": torch.zeros(num_heads, requires_grad=True),
                       "log_b": torch.zeros(num_heads, requires_grad=True)}

    def sample(self, n, generator=None):
        u = torch.rand(n, self.num_heads, generator=generator)
        return hardkuma.sample(self.params["log_a"], self.params["log_b"], u=u)

    def constraint(self):
        return hardkuma.expected_l0(self.params["log_a"], self.params["log_b"])

    def score(self):
        with torch.no_grad():
            return hardkuma.expected_z(self.params["log_a"], self.params["log_b"])


class HardConcreteGates(GateFamily):
    """Louizos et al. (2018) L0 gates: s = σ((log u − log(1−u) + log α)/β), stretched to (γ, ζ) = (−0.1, 1.1), clamped.

    P(z ≠ 0) = σ(log α − β·log(−γ/ζ)); β = 2/3 (their default). log α = 0 at start.
    """
    name = "hardconcrete"
    BETA = 2.0 / 3.0
    GAMMA, ZETA = -0.1, 1.1

    def __init__(self, num_heads: int):
        super().__init__(num_heads)
        self.params = {"log_alpha": torch.zeros(num_heads, requires_grad=True)}

    def _z(self, u):
        la = self.params["log_alpha"]
        u = u.clamp(1e-6, 1 - 1e-6)
        s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + la) / self.BETA)
        return (self.GAMMA + (self.ZETA - self.GAMMA) * s).clamp(0.0, 1.0)

    def sample(self, n, generator=None):
        return self._z(torch.rand(n, self.num_heads, generator=generator))

    def constraint(self):
        la = self.params["log_alpha"]
        return torch.sigmoid(la - self.BETA * math.log(-self.GAMMA / self.ZETA)).sum()

    def score(self):
        # E[z] by Monte Carlo with a fixed generator (deterministic), 4096 samples per head.
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            return self._z(torch.rand(4096, self.num_heads, generator=g)).mean(dim=0)


class DuoGates(GateFamily):
    """DuoAttention-style direct optimization: a deterministic gate α ∈ [0, 1] per head (start 1), L1 penalty Σ α."""
    name = "duo"
    lagrangian = False

    def __init__(self, num_heads: int, l1: float = 0.05):
        super().__init__(num_heads)
        self.l1 = l1
        self.params = {"alpha": torch.ones(num_heads, requires_grad=True)}

    def sample(self, n, generator=None):
        return self.params["alpha"].unsqueeze(0).expand(n, -1)

    def penalty(self):
        return self.l1 * self.params["alpha"].sum()

    def after_step(self):
        with torch.no_grad():
            self.params["alpha"].clamp_(0.0, 1.0)

    def score(self):
        return self.params["alpha"].detach().clone()


FAMILIES = {"hardkuma": HardKumaGates, "hardconcrete": HardConcreteGates, "duo": DuoGates}
