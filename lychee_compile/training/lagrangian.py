"""The multiplier of  min_(α,β) max_λ  L_distill + λ·c + (ρ/2)·c²,  c = E‖z‖₀ − N_target.

λ takes a gradient *ascent* step on the objective: ∂/∂λ = c, so λ rises while the expected number of retrieval
heads exceeds the target and falls while it is below. `equality` (the default): λ may go negative, so the
constraint holds from both sides -- E‖z‖₀ = N_target, the head count the user asked for. With λ clamped at 0
(`equality=False`, an at-most budget) a λ that wound up over the target pushed E‖z‖₀ far below it and could not pull
it back (SmolLM2: 7 heads for a target of 16). ρ > 0 adds the augmented-Lagrangian term (ρ/2)·c², a restoring
force proportional to the miss from the first step, so short runs land near the target instead of oscillating
around it while λ catches up.
"""
from __future__ import annotations


class Lagrangian:
    def __init__(self, target: float, lr: float = 0.01, init: float = 0.0, equality: bool = True, rho: float = 0.0):
        self.target = float(target)
        self.lr = float(lr)
        self.value = float(init)
        self.equality = bool(equality)
        self.rho = float(rho)

    def term(self, expected_l0):
        """λ·c + (ρ/2)·c², λ a constant here (its update is step())."""
        c = expected_l0 - self.target
        return self.value * c + 0.5 * self.rho * c * c

    def step(self, expected_l0: float) -> float:
        value = self.value + self.lr * (float(expected_l0) - self.target)
        self.value = value if self.equality else max(0.0, value)
        return self.value

    def state_dict(self):
        return {"value": self.value, "target": self.target, "lr": self.lr, "equality": self.equality,
                "rho": self.rho}

    def load_state_dict(self, state):
        self.value = float(state["value"])
