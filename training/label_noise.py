"""How well could any predictor rank sampled output lengths? A ceiling from two samples per prompt.

At temperature 1 a prompt's output length is a random draw, so Kendall's tau against one sample
is capped even for a predictor that knows each prompt's expected length exactly. Two samples of
the same prompts measure that chance, and a latent-variable model turns it into the cap:

    sample_j = F(z + e_j),   z ~ N(0, 1) the prompt's latent length,   e_j ~ N(0, 1/rho - 1)

with F the pooled empirical quantile function of the samples (so the model keeps the observed
marginal, including the ties at the max_tokens cap). rho is chosen so the model's two-sample tau
matches the observed one; the ceiling is then tau(z, sample_1), what ranking by the latent length
itself scores against one sample (and tau(z, (sample_1 + sample_2) / 2) against the two
samples' mean, the label `eval-predictor --labels trace` also scores against). It is an
estimate under the model's assumptions (a Gaussian copula, noise that does not depend on the
prompt), not a bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats


def _tau(x: np.ndarray, y: np.ndarray) -> float:
    return float(stats.kendalltau(x, y).statistic)


class LatentModel:
    """Draws of (z, sample_1, sample_2) mapped onto an observed marginal, fixed noise for every rho."""

    def __init__(self, pooled: Sequence[float], num_draws: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.marginal = np.sort(np.asarray(pooled, dtype=float))
        self.z = rng.standard_normal(num_draws)
        self.noise = rng.standard_normal((2, num_draws))

    def _to_marginal(self, latent: np.ndarray) -> np.ndarray:
        ranks = latent.argsort().argsort() / (len(latent) - 1)
        return np.quantile(self.marginal, ranks, method="inverted_cdf")

    def samples(self, rho: float) -> tuple[np.ndarray, np.ndarray]:
        scale = np.sqrt(1.0 / rho - 1.0)
        return (self._to_marginal(self.z + scale * self.noise[0]),
                self._to_marginal(self.z + scale * self.noise[1]))


def ranking_ceiling(first: Sequence[float], second: Sequence[float], num_draws: int = 20_000,
                    seed: int = 0, iterations: int = 30) -> dict:
    """The model's rho and the estimated tau of the latent length against one sample, and against
    the mean of two."""
    if len(first) != len(second) or len(first) < 3:
        raise ValueError("need two samples of the same (at least 3) prompts")
    observed = _tau(np.asarray(first), np.asarray(second))
    model = LatentModel(list(first) + list(second), num_draws, seed)
    low, high = 1e-3, 1.0 - 1e-3
    for _ in range(iterations):  # the model's two-sample tau rises with rho: bisect
        rho = (low + high) / 2
        if _tau(*model.samples(rho)) < observed:
            low = rho
        else:
            high = rho
    rho = (low + high) / 2
    sample, other = model.samples(rho)
    return {"kendall_tau_two_samples": observed, "latent_share_rho": rho,
            "kendall_tau_ceiling_estimate": _tau(model.z, sample),
            "kendall_tau_ceiling_estimate_two_sample_mean": _tau(model.z, (sample + other) / 2)}
