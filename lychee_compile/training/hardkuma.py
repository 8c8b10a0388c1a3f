"""HardKuma: a stretched and rectified Kumaraswamy(α, β) variable z ∈ [0, 1] with point masses at 0 and 1.

    u ~ U(0, 1);  s = (1 − u^(1/β))^(1/α)            (Kumaraswamy inverse CDF)
    s' = p + (q − p)·s,  (p, q) = (−0.1, 1.1);  z = min(1, max(0, s'))
    F(x; α, β) = 1 − (1 − x^α)^β                      (Kumaraswamy CDF)
    P(z = 0) = F(−p / (q − p)),  P(z = 1) = 1 − F((1 − p) / (q − p))
    E‖z‖₀ = Σ_heads (1 − P(z = 0)),  E[z] = ∫₀¹ P(z > t) dt = ∫₀¹ 1 − F((t − p)/(q − p)) dt

α and β are kept positive by storing log α, log β. α = β = 1 (log 0) is the uniform start.
All functions broadcast over any shape of α, β.
"""
from __future__ import annotations

import torch

STRETCH = (-0.1, 1.1)
_EPS = 1e-6


def kuma_cdf(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """F(x; a, b) = 1 − (1 − x^a)^b for x in [0, 1] (clamped), computed in log space for stability."""
    x = torch.as_tensor(x, dtype=a.dtype, device=a.device).clamp(_EPS, 1 - _EPS)
    # (1 - x^a)^b = exp(b * log1p(-exp(a log x)))
    return 1.0 - torch.exp(b * torch.log1p(-torch.exp(a * torch.log(x))))


def kuma_icdf(u: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """s = (1 − u^(1/b))^(1/a): the Kumaraswamy inverse CDF (reparameterized sample for uniform u)."""
    u = u.clamp(_EPS, 1 - _EPS)
    return torch.exp(torch.log1p(-torch.exp(torch.log(u) / b)) / a)


def sample(log_a: torch.Tensor, log_b: torch.Tensor, u: torch.Tensor | None = None,
           generator: torch.Generator | None = None, stretch=STRETCH) -> torch.Tensor:
    """A reparameterized HardKuma sample, differentiable w.r.t. (log α, log β) wherever 0 < s' < 1."""
    a, b = log_a.exp(), log_b.exp()
    if u is None:
        u = torch.rand(log_a.shape, generator=generator, dtype=log_a.dtype, device=log_a.device)
    p, q = stretch
    s = kuma_icdf(u, a, b)
    return (p + (q - p) * s).clamp(0.0, 1.0)


def prob_zero(log_a, log_b, stretch=STRETCH) -> torch.Tensor:
    p, q = stretch
    return kuma_cdf(torch.tensor(-p / (q - p)), log_a.exp(), log_b.exp())


def prob_one(log_a, log_b, stretch=STRETCH) -> torch.Tensor:
    p, q = stretch
    return 1.0 - kuma_cdf(torch.tensor((1 - p) / (q - p)), log_a.exp(), log_b.exp())


def expected_l0(log_a, log_b, stretch=STRETCH) -> torch.Tensor:
    """E‖z‖₀ = Σ P(z ≠ 0) over all given heads (a differentiable scalar)."""
    return (1.0 - prob_zero(log_a, log_b, stretch)).sum()


def expected_z(log_a, log_b, stretch=STRETCH, points: int = 512) -> torch.Tensor:
    """E[z] per head, by the midpoint rule on ∫₀¹ P(z > t) dt (exact up to quadrature error ~1e-5)."""
    p, q = stretch
    t = (torch.arange(points, dtype=log_a.dtype, device=log_a.device) + 0.5) / points
    x = (t - p) / (q - p)                                               # [points]
    a = log_a.exp().unsqueeze(-1)
    b = log_b.exp().unsqueeze(-1)
    return (1.0 - kuma_cdf(x, a, b)).mean(dim=-1)
