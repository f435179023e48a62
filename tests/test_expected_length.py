"""The mean of a predicted length distribution, which admission adds up as token work."""

from __future__ import annotations

import math
import random

import pytest

from scheduler.admission import AdmissionController, AdmissionRejected, token_work
from scheduler.config import SchedulerConfig
from scheduler.expected_length import Z90, capped_lognormal_mean
from scheduler.request import Request, SamplingParams


def sampled_capped_mean(p50: float, p90: float, cap: float, draws: int = 200_000) -> float:
    rng = random.Random(0)
    mu, sigma = math.log(p50), math.log(p90 / p50) / Z90
    return sum(min(rng.lognormvariate(mu, sigma), cap) for _ in range(draws)) / draws


@pytest.mark.parametrize("p50, p90, cap", [(100.0, 300.0, 1000.0), (100.0, 300.0, 150.0),
                                           (250.0, 400.0, 1024.0), (40.0, 900.0, 512.0)])
def test_capped_mean_matches_sampling(p50: float, p90: float, cap: float) -> None:
    assert capped_lognormal_mean(p50, p90, cap) == pytest.approx(sampled_capped_mean(p50, p90, cap), rel=0.01)


def test_far_above_the_cap_the_mean_is_the_lognormal_mean_and_below_it_the_cap() -> None:
    sigma = math.log(3.0) / Z90
    assert capped_lognormal_mean(100.0, 300.0, 1e12) == pytest.approx(100.0 * math.exp(sigma * sigma / 2))
    assert capped_lognormal_mean(100.0, 300.0, 1.0) == pytest.approx(1.0, rel=1e-3)


def test_a_spread_whose_uncapped_mean_overflows_still_gives_a_mean_below_the_cap() -> None:
    mean = capped_lognormal_mean(100.0, 100.0 * math.exp(50.0), 4096.0)
    assert 0.0 < mean < 4096.0


@pytest.mark.parametrize("p50, p90, cap", [(0.0, 10.0, 100.0), (10.0, 10.0, 100.0), (10.0, 5.0, 100.0),
                                           (10.0, 20.0, 0.0)])
def test_no_spread_or_no_room_is_refused(p50: float, p90: float, cap: float) -> None:
    with pytest.raises(ValueError, match="p50 < p90"):
        capped_lognormal_mean(p50, p90, cap)


def request(point: float | None, p50: float | None = None, p90: float | None = None,
            max_tokens: int = 1000, min_tokens: int = 0, prompt_len: int = 10) -> Request:
    return Request("r", [1] * prompt_len, SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens),
                   arrival_time=0.0, predicted_len=point, predicted_p50=p50, predicted_p90=p90)


def test_the_predicted_mean_is_the_capped_lognormal_mean_above_the_point() -> None:
    r = request(point=90.0, p50=100.0, p90=300.0)
    assert r.predicted_mean == pytest.approx(capped_lognormal_mean(100.0, 300.0, 1000.0))
    assert r.predicted_mean > 120.0 > r.predicted_total == 90.0


def test_without_a_spread_the_predicted_mean_is_the_point() -> None:
    assert request(point=90.0).predicted_mean == 90.0
    assert request(point=90.0, p50=100.0, p90=100.0).predicted_mean == 90.0
    assert request(point=None, p50=100.0, p90=300.0).predicted_mean == 1000.0  # max_tokens, as ever


def test_the_predicted_mean_stays_within_the_requests_limits() -> None:
    assert request(point=90.0, p50=100.0, p90=300.0, max_tokens=50).predicted_mean <= 50.0
    assert request(point=2.0, p50=2.0, p90=3.0, min_tokens=20).predicted_mean == 20.0


def test_admission_counts_the_mean_as_token_work() -> None:
    queued = request(point=90.0, p50=100.0, p90=300.0, prompt_len=10)
    assert token_work([queued]) == pytest.approx(10 + capped_lognormal_mean(100.0, 300.0, 1000.0))
    queued.output_token_ids = [5] * 30  # 30 generated: the rest of the mean is to come
    queued.num_computed_tokens = 39
    assert token_work([queued]) == pytest.approx(capped_lognormal_mean(100.0, 300.0, 1000.0) - 30)


def test_a_queue_whose_points_fit_the_slo_but_whose_means_do_not_refuses() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, enable_admission=True, slo_e2e_standard_s=10.0))
    ctl.record_step(now=1.0, num_tokens=100, step_time_s=0.1)  # 1000 tokens/s
    # Nine queued requests of 500 prompt tokens, each predicted 450 at its point but with a mean
    # of about 618: 8.55 s of work ahead by points (9.15 s with its own), 10.06 s by means.
    waiting = [Request(f"w{i}", [1] * 500, SamplingParams(max_tokens=2000), arrival_time=0.0,
                       predicted_len=450.0, predicted_p50=500.0, predicted_p90=1200.0) for i in range(9)]
    mean = capped_lognormal_mean(500.0, 1200.0, 2000.0)
    assert 9 * (500 + mean) / 1000 > 10.0 > 9 * (500 + 450) / 1000 + 0.6
    newcomer = Request("new", [1] * 100, SamplingParams(max_tokens=1000), arrival_time=1.0, predicted_len=5.0)
    with pytest.raises(AdmissionRejected, match="end-to-end latency 10.66s"):
        ctl.check(newcomer, waiting, [])  # 10.06 s + 0.1 s + 5 tokens * 0.1 s
