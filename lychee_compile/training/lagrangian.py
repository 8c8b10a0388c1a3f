"""The Lagrange multiplier of  min_(α,β) max_(λ≥0)  L_distill + λ·(E‖z‖₀ − N_target).

λ takes a gradient *ascent* step on the objective: ∂/∂λ = E‖z‖₀ − N_target, so λ rises while the expected number
of retrieval heads exceeds the budget and falls (never below 0) otherwise.
"""
from __future__ import annotations


class Lagrangian:
    def __init__(self, target: float, lr: float = 0.01, init: float = 0.0):
        self.target = float(target)
        self.lr = float(lr)
        self.value = float(init)

    def term(self, expected_l0):
        """λ·(E‖z‖₀ − N_target), λ a constant here (its update is step())."""
        return self.value * (expected_l0 - self.target)

    def step(self, expected_l0: float) -> float:
        self.value = max(0.0, self.value + self.lr * (float(expected_l0) - self.target))
        return self.value

    def state_dict(self):
        return {"value": self.value, "target": self.target, "lr": self.lr}

    def load_state_dict(self, state):
        self.value = float(state["value"])
