"""The ranking ceiling recovers a known latent-length model from two samples."""

import numpy as np
import pytest
from scipy import stats

from training.label_noise import LatentModel, ranking_ceiling


def two_samples(rho: float, n: int, seed: int, cap: float | None = None):
    """Lengths from the model the estimator assumes: exp of latent + noise, optionally capped."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n)
    noise = rng.standard_normal((2, n)) * np.sqrt(1 / rho - 1)
    first, second = np.exp(4 + z + noise[0]), np.exp(4 + z + noise[1])
    if cap is not None:
        first, second = np.minimum(first, cap), np.minimum(second, cap)
    return z, np.round(first), np.round(second)


@pytest.mark.parametrize("rho,cap", [(0.3, None), (0.6, None), (0.5, 150.0)])
def test_ceiling_matches_the_latent_lengths_tau_against_one_sample(rho, cap):
    z, first, second = two_samples(rho, 3000, seed=1, cap=cap)
    estimate = ranking_ceiling(first, second, num_draws=5000)
    truth = stats.kendalltau(z, first).statistic
    assert estimate["kendall_tau_ceiling_estimate"] == pytest.approx(truth, abs=0.04)
    truth_mean = stats.kendalltau(z, (first + second) / 2).statistic
    assert estimate["kendall_tau_ceiling_estimate_two_sample_mean"] == pytest.approx(truth_mean, abs=0.04)
    assert truth_mean > truth  # a check of the test's own data: the mean of two holds less chance
    assert estimate["latent_share_rho"] == pytest.approx(rho, abs=0.08)


def test_ceiling_lies_above_two_sample_agreement_and_rises_with_it():
    _, noisy_a, noisy_b = two_samples(0.3, 2000, seed=2)
    _, clean_a, clean_b = two_samples(0.8, 2000, seed=2)
    noisy, clean = ranking_ceiling(noisy_a, noisy_b, 4000), ranking_ceiling(clean_a, clean_b, 4000)
    assert noisy["kendall_tau_ceiling_estimate"] > noisy["kendall_tau_two_samples"]
    assert clean["kendall_tau_ceiling_estimate"] > noisy["kendall_tau_ceiling_estimate"]


def test_ceiling_needs_paired_samples():
    with pytest.raises(ValueError):
        ranking_ceiling([1, 2, 3], [1, 2])
    with pytest.raises(ValueError):
        ranking_ceiling([1, 2], [2, 1])  # two prompts: one pair, no estimate


@pytest.mark.parametrize("rho", [0.05, 0.95])
def test_ceiling_recovers_nearly_pure_noise_and_nearly_no_noise(rho):
    # Far outside the middle values above: a search for rho over a narrowed range would miss these.
    z, first, second = two_samples(rho, 3000, seed=1)
    estimate = ranking_ceiling(first, second, num_draws=5000)
    assert estimate["latent_share_rho"] == pytest.approx(rho, abs=0.02)
    assert estimate["kendall_tau_ceiling_estimate"] == pytest.approx(stats.kendalltau(z, first).statistic, abs=0.04)


def test_the_fitted_model_reproduces_the_observed_two_sample_tau():
    # What rho is chosen for: the model's own two samples agree as much as the observed ones do.
    _, first, second = two_samples(0.3, 3000, seed=1)
    estimate = ranking_ceiling(first, second, num_draws=5000, seed=0)
    model = LatentModel(list(first) + list(second), 5000, seed=0)
    modelled = stats.kendalltau(*model.samples(estimate["latent_share_rho"])).statistic
    assert estimate["kendall_tau_two_samples"] == pytest.approx(stats.kendalltau(first, second).statistic)
    assert modelled == pytest.approx(estimate["kendall_tau_two_samples"], abs=1e-3)
