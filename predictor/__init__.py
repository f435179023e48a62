"""Output-length prediction: prompt -> a distribution of output length. Never imports mlflow."""

from __future__ import annotations


def load(path):
    """Load a saved predictor folder; the kind's heavy imports (lightgbm, torch) happen here, not at import."""
    from predictor.saved import load as load_saved

    return load_saved(path)
