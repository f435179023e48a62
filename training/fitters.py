"""Fitting the predictors of `predictor/` (serving code stays free of training code).

LightGBM heads learn log1p(output tokens): `point` with L2, `p50`/`p90` with the pinball loss,
and `rank` with lambdarank. Lambdarank needs queries and graded relevance: training rows are
shuffled into queries of QUERY_SIZE prompts (a stand-in for the batch of waiting requests the
scheduler orders), and relevance is the length's bucket among RELEVANCE_LEVELS train quantiles.
Every head stops early on the validation split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from predictor.heads import TOKEN_HEADS, LgbmHeads
from predictor.length import LengthParams, LengthPredictor, prompt_length_feature
from predictor.saved import PredictorSpec
from training.labels import LabelledSplit

QUERY_SIZE = 64
RELEVANCE_LEVELS = 16


@dataclass(frozen=True)
class LgbmConfig:
    num_leaves: int = 63
    learning_rate: float = 0.1
    max_rounds: int = 600
    early_stopping_rounds: int = 40
    min_data_in_leaf: int = 40
    feature_fraction: float = 0.8
    num_threads: int = 2
    with_rank_head: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_leaves < 2 or self.max_rounds < 1 or not 0 < self.learning_rate <= 1:
            raise ValueError("num_leaves >= 2, max_rounds >= 1 and 0 < learning_rate <= 1 required")


def fit_length(train: LabelledSplit, spec: PredictorSpec) -> LengthPredictor:
    x = prompt_length_feature(train.prompts)
    y = np.log1p(train.lengths)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (intercept + slope * x)
    params = LengthParams(float(intercept), float(slope), float(np.quantile(residual, 0.5)),
                          float(np.quantile(residual, 0.9)))
    return LengthPredictor(params, spec)


def _base_params(config: LgbmConfig) -> dict:
    return {
        "num_leaves": config.num_leaves, "learning_rate": config.learning_rate,
        "min_data_in_leaf": config.min_data_in_leaf, "feature_fraction": config.feature_fraction,
        "bagging_fraction": 0.8, "bagging_freq": 1, "num_threads": config.num_threads,
        "seed": config.seed, "verbose": -1,
    }


def relevance_and_groups(y_log: np.ndarray, edges: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row order, relevance labels in that order, query sizes) for lambdarank."""
    order = np.random.default_rng(seed).permutation(len(y_log))
    relevance = np.searchsorted(edges, y_log[order], side="right").astype(np.int32)
    sizes = [QUERY_SIZE] * (len(order) // QUERY_SIZE)
    if len(order) % QUERY_SIZE:
        sizes.append(len(order) % QUERY_SIZE)
    return order, relevance, np.asarray(sizes)


def _train_head(params: dict, config: LgbmConfig, train_set, valid_set):
    import lightgbm

    return lightgbm.train(
        params, train_set, num_boost_round=config.max_rounds, valid_sets=[valid_set],
        callbacks=[lightgbm.early_stopping(config.early_stopping_rounds, verbose=False)],
    )


def fit_lgbm_heads(x_train: np.ndarray, y_train: np.ndarray, x_valid: np.ndarray, y_valid: np.ndarray,
                   config: LgbmConfig) -> LgbmHeads:
    """Heads on log1p lengths; `y_*` are raw token counts."""
    import lightgbm

    log_train, log_valid = np.log1p(y_train), np.log1p(y_valid)
    base = _base_params(config)
    boosters = {}
    objectives = {"point": {"objective": "regression"},
                  "p50": {"objective": "quantile", "alpha": 0.5},
                  "p90": {"objective": "quantile", "alpha": 0.9}}
    for name, objective in objectives.items():
        params = {**base, **objective, "metric": objective["objective"]}
        boosters[name] = _train_head(params, config, lightgbm.Dataset(x_train, log_train),
                                     lightgbm.Dataset(x_valid, log_valid))
    if config.with_rank_head:
        edges = np.quantile(log_train, np.linspace(0, 1, RELEVANCE_LEVELS + 1)[1:-1])
        train_order, train_rel, train_groups = relevance_and_groups(log_train, edges, config.seed)
        valid_order, valid_rel, valid_groups = relevance_and_groups(log_valid, edges, config.seed + 1)
        params = {**base, "objective": "lambdarank", "metric": "ndcg", "eval_at": [QUERY_SIZE],
                  "label_gain": list(range(RELEVANCE_LEVELS)), "lambdarank_truncation_level": QUERY_SIZE}
        boosters["rank"] = _train_head(
            params, config,
            lightgbm.Dataset(x_train[train_order], train_rel, group=train_groups),
            lightgbm.Dataset(x_valid[valid_order], valid_rel, group=valid_groups),
        )
    taus = validation_taus(boosters, x_valid, y_valid)
    return LgbmHeads(boosters, score_head=best_head(taus, boosters), length_head=best_head(taus, TOKEN_HEADS))


def validation_taus(boosters: dict, x_valid: np.ndarray, y_valid: np.ndarray) -> dict[str, float]:
    """Kendall's tau of each head's output on the validation split; -inf where it is undefined
    (a head that predicts one value for every prompt, as p50 does when most labels sit at a cap)."""
    from scipy import stats

    taus = {name: stats.kendalltau(booster.predict(x_valid), y_valid).statistic
            for name, booster in boosters.items()}
    return {name: float(tau) if np.isfinite(tau) else -np.inf for name, tau in taus.items()}


def best_head(taus: dict[str, float], candidates) -> str:
    """The candidate head that orders the validation split best (the first one on a tie)."""
    return max(candidates, key=lambda name: taus[name])


RIDGE_ALPHAS = (1.0, 10.0, 100.0, 1000.0, 10000.0)


def fit_ridge_head(x_train: np.ndarray, y_train: np.ndarray, x_valid: np.ndarray, y_valid: np.ndarray,
                   alphas=RIDGE_ALPHAS):
    """A ridge regression of log1p(length) on standardized features, its penalty chosen by Kendall's
    tau on validation; p50 and p90 offsets are the validation residuals' quantiles."""
    from scipy import stats

    from predictor.probe import RidgeHead

    mean = x_train.mean(axis=0)
    scale = np.maximum(x_train.std(axis=0), 1e-6)  # a constant feature must not divide by zero
    z_train, z_valid = (x_train - mean) / scale, (x_valid - mean) / scale
    target_train, target_valid = np.log1p(y_train.astype(np.float64)), np.log1p(y_valid.astype(np.float64))
    intercept = float(target_train.mean())
    # One SVD serves every penalty: coef = V diag(s / (s^2 + alpha)) U^T (y - mean y).
    u, s, vt = np.linalg.svd(z_train, full_matrices=False)
    projected = u.T @ (target_train - intercept)
    best = None
    for alpha in alphas:
        coef = vt.T @ (s / (s ** 2 + alpha) * projected)
        tau = stats.kendalltau(z_valid @ coef, target_valid).statistic
        tau = float(tau) if np.isfinite(tau) else -np.inf
        if best is None or tau > best[0]:
            best = (tau, alpha, coef)
    _, alpha, coef = best
    residuals = target_valid - (z_valid @ coef + intercept)
    head = RidgeHead(mean.astype(np.float32), scale.astype(np.float32), coef.astype(np.float32), intercept,
                     float(np.quantile(residuals, 0.5)), float(np.quantile(residuals, 0.9)))
    return head, alpha
