"""Frozen MiniLM embeddings plus lexical features, LightGBM heads (lambdarank score + quantiles).

The encoder runs first (torch), then the boosters (single-threaded LightGBM): never both at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.base import Prediction
from predictor.encoder import EncoderConfig, MiniLMEncoder
from predictor.features import check_lexical_spec, lexical_matrix
from predictor.heads import LgbmHeads, to_predictions
from predictor.saved import PredictorSpec


def embed_lgbm_features(embeddings: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """The head's input: [embedding | lexical features], the same in training and serving."""
    return np.hstack([embeddings.astype(np.float32), lexical_matrix(prompts)])


class EmbedLgbmPredictor:
    kind = "embed_lgbm"

    def __init__(self, encoder: MiniLMEncoder, heads: LgbmHeads, spec: PredictorSpec) -> None:
        self.encoder = encoder
        self.heads = heads
        self.spec = spec

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        if not prompts:
            return []
        features = embed_lgbm_features(self.encoder.encode(prompts), prompts)
        return to_predictions(self.heads.predict(features))

    def save(self, folder: Path) -> None:
        self.heads.save(folder)

    @classmethod
    def load(cls, folder: Path, spec: PredictorSpec) -> "EmbedLgbmPredictor":
        check_lexical_spec(spec.feature_spec)
        encoder = MiniLMEncoder(EncoderConfig(**spec.feature_spec["encoder"]))
        return cls(encoder, LgbmHeads.load(folder), spec)
