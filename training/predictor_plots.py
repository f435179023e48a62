"""Plots of a predictor run: predicted vs true length, and Kendall's tau by prompt-length bucket."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.base import Prediction
from training.metrics import tau_by_bucket


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return path


def predicted_vs_true(true: np.ndarray, predictions: Sequence[Prediction], path: Path, title: str) -> Path:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(5, 4.5))
    point = np.asarray([p.point for p in predictions])
    axis.hexbin(np.log10(true + 1), np.log10(point + 1), gridsize=40, bins="log", cmap="viridis")
    axis.plot([0, 4], [0, 4], color="white", linewidth=1)
    axis.set_xlabel("true output tokens (log10)")
    axis.set_ylabel("predicted output tokens (log10)")
    axis.set_title(title)
    return _save(plt, figure, path)


def tau_by_prompt_bucket(true: np.ndarray, predictions: Sequence[Prediction], prompt_tokens: np.ndarray,
                         path: Path, title: str) -> Path:
    plt = _pyplot()
    rank_len = np.asarray([p.rank_len for p in predictions])  # the order the scheduler uses
    buckets = tau_by_bucket(true, rank_len, prompt_tokens)
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.bar([b.label for b in buckets], [b.kendall_tau for b in buckets], color="tab:blue")
    axis.set_xlabel("prompt tokens (quintile bucket)")
    axis.set_ylabel("Kendall's tau")
    axis.set_title(title)
    return _save(plt, figure, path)
