"""Ranking and calibration metrics of length predictions.

Kendall's tau-b between the ranking length (`rank_len`) and the true length is the primary
figure: the scheduler orders requests by it and uses only the order. The predictor's own `score`
(a lambdarank or ListMLE output, or the head chosen on validation) gets its tau too. Pairwise
accuracy is the share of random pairs with different true lengths that the ranking length orders
correctly (ties count half).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
from scipy import stats

from predictor.base import Prediction

PAIR_SAMPLE = 200_000


@dataclass(frozen=True)
class PredictionMetrics:
    kendall_tau: float  # of rank_len, the order the scheduler uses
    kendall_tau_score: float  # of the predictor's score
    spearman: float
    pairwise_accuracy: float
    # With replies cut at a cap (`censored` below): MAE over the uncut, coverage as bounds.
    mae_log: float  # mean |log1p(point) - log1p(true)| over uncensored rows
    # Share of true lengths <= p50 and p90 (ideal 0.5 and 0.9): with replies cut at a cap, a lower
    # bound (the rows known covered), `_max` the upper bound (the rows not known uncovered).
    p50_coverage: float
    p90_coverage: float
    p50_coverage_max: float
    p90_coverage_max: float
    num_examples: int
    num_censored: int  # rows whose reply was cut at a cap: their length is a lower bound

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {prefix + key: float(value) for key, value in asdict(self).items()}


def pairwise_accuracy(true: np.ndarray, score: np.ndarray, seed: int = 0) -> float:
    if len(true) < 2:  # no pair to order (and no index to draw from an empty set)
        return float("nan")
    rng = np.random.default_rng(seed)
    first = rng.integers(0, len(true), PAIR_SAMPLE)
    second = rng.integers(0, len(true), PAIR_SAMPLE)
    keep = true[first] != true[second]
    true_order = np.sign(true[first][keep] - true[second][keep])
    score_order = np.sign(score[first][keep] - score[second][keep])
    agree = (true_order == score_order) + 0.5 * (score_order == 0)
    return float(agree.mean()) if keep.any() else float("nan")


def tau_interval(true: Sequence[float], score: Sequence[float], num_resamples: int = 1000,
                 seed: int = 0) -> list[float] | None:
    """95% percentile bootstrap interval of Kendall's tau over the prompts (resampled with
    replacement): how far another test split of this size would move the figure. None for fewer
    than 3 prompts."""
    true, score = np.asarray(true, dtype=np.float64), np.asarray(score, dtype=np.float64)
    if len(true) < 3:
        return None
    rng = np.random.default_rng(seed)
    draws = [stats.kendalltau(score[rows], true[rows]).statistic
             for rows in (rng.integers(0, len(true), len(true)) for _ in range(num_resamples))]
    if np.isnan(draws).all():  # every resample constant: tau is undefined (JSON null, not NaN)
        return None
    low, high = np.nanpercentile(draws, [2.5, 97.5])
    return [float(low), float(high)]


def coverage(true: np.ndarray, quantile: np.ndarray, censored: np.ndarray) -> tuple[float, float]:
    """Bounds on the share of rows whose true length is at most `quantile`: (known covered, known
    or possibly covered), equal when every row's outcome is known.

    A censored row's reply was cut at a cap before it ended (the end token is checked before the
    cap): its true length is at least the recorded one plus one, so it is known uncovered when the
    quantile is below that, and unknown otherwise. Counting an unknown row covered, as a plain
    `true <= quantile` does, credited a quantile at the cap with every cut reply (306 of 499 on the
    trace's test split); leaving it out, as sessions 13-34 did, kept exactly the rows a quantile
    above the cap would have to cover, so that one at the cap plus one read 1.000 whatever it
    covered (an audit). Hence both bounds, over every row."""
    if len(true) == 0:
        return float("nan"), float("nan")
    unknown = censored & (quantile >= true + 1)
    covered = ~censored & (true <= quantile)  # a cut reply is known only where it is a miss
    return float(np.mean(covered)), float(np.mean(covered | unknown))


def prediction_metrics(true_lengths: Sequence[int], predictions: Sequence[Prediction],
                       censored: Sequence[bool] | None = None) -> PredictionMetrics:
    """Metrics of `predictions` against `true_lengths`; `censored` marks lengths that are only
    lower bounds (replies cut at a cap), which the ranking figures take as they are (ties at the
    cap) and the calibration figures treat as unknown where they cannot tell."""
    true = np.asarray(true_lengths, dtype=np.float64)
    censored = np.zeros(len(true), dtype=bool) if censored is None else np.asarray(censored, dtype=bool)
    score = np.asarray([p.score for p in predictions], dtype=np.float64)
    point = np.asarray([p.point for p in predictions], dtype=np.float64)
    p50 = np.asarray([p.p50 for p in predictions], dtype=np.float64)
    p90 = np.asarray([p.p90 for p in predictions], dtype=np.float64)
    rank_len = np.asarray([p.rank_len for p in predictions], dtype=np.float64)
    p50_bounds, p90_bounds = coverage(true, p50, censored), coverage(true, p90, censored)
    return PredictionMetrics(
        kendall_tau=float(stats.kendalltau(rank_len, true).statistic),
        kendall_tau_score=float(stats.kendalltau(score, true).statistic),
        spearman=float(stats.spearmanr(rank_len, true).statistic),
        pairwise_accuracy=pairwise_accuracy(true, rank_len),
        mae_log=float(np.mean(np.abs(np.log1p(np.maximum(point, 0.0)) - np.log1p(true))[~censored]))
        if (~censored).any() else float("nan"),
        p50_coverage=p50_bounds[0], p50_coverage_max=p50_bounds[1],
        p90_coverage=p90_bounds[0], p90_coverage_max=p90_bounds[1],
        num_examples=len(true),
        num_censored=int(censored.sum()),
    )


@dataclass(frozen=True)
class BucketTau:
    label: str
    kendall_tau: float
    num_examples: int


def tau_by_bucket(true: np.ndarray, score: np.ndarray, bucket_by: np.ndarray, num_buckets: int = 5) -> list[BucketTau]:
    """Kendall's tau within quantile buckets of `bucket_by` (e.g. prompt tokens)."""
    edges = np.unique(np.quantile(bucket_by, np.linspace(0, 1, num_buckets + 1)))
    buckets = []
    for low, high in zip(edges[:-1], edges[1:]):
        rows = (bucket_by >= low) & ((bucket_by < high) | (high == edges[-1]))
        if rows.sum() >= 10:
            tau = float(stats.kendalltau(score[rows], true[rows]).statistic)
            buckets.append(BucketTau(f"{low:.0f}-{high:.0f}", tau, int(rows.sum())))
    return buckets
