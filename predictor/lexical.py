"""LightGBM on the lexical features of `predictor.features`: sub-millisecond per prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from predictor.base import Prediction, checked_prompts
from predictor.features import FEATURE_NAMES, check_lexical_spec, lexical_matrix
from predictor.heads import LgbmHeads, to_predictions
from predictor.saved import PredictorSpec


class LexicalPredictor:
    kind = "lexical"

    def __init__(self, heads: LgbmHeads, spec: PredictorSpec) -> None:
        self.heads = heads
        self.spec = spec

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        prompts = checked_prompts(prompts)
        if not prompts:
            return []
        return to_predictions(self.heads.predict(lexical_matrix(prompts)))

    def save(self, folder: Path) -> None:
        self.heads.save(folder)

    @classmethod
    def load(cls, folder: Path, spec: PredictorSpec) -> "LexicalPredictor":
        check_lexical_spec(spec.feature_spec)
        heads = LgbmHeads.load(folder)
        heads.check_num_features(len(FEATURE_NAMES), "the lexical features")
        return cls(heads, spec)
