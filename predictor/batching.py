"""Predictions for many prompts in fixed-size batches: the call evaluation, training and the
simulator use (the server scores each group of arrivals in one call, engine/arrival_predictor.py)."""

from __future__ import annotations

from typing import Iterable, Sequence

from predictor.base import Prediction, Predictor


def predict_in_batches(predictor: Predictor, prompts: Sequence[str], batch_size: int = 32,
                       progress: bool = False) -> list[Prediction]:
    """`predictor.predict` over `prompts` in batches of `batch_size`, in input order."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    starts: Iterable[int] = range(0, len(prompts), batch_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="predict", unit="batch")
    predictions: list[Prediction] = []
    for start in starts:
        predictions.extend(predictor.predict(list(prompts[start : start + batch_size])))
    return predictions
