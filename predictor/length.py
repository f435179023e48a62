"""Baseline: output length from prompt length alone (the "prompt-length weighted" proxy).

log1p(output) = a + b * log1p(prompt characters), fitted by least squares; p50 and p90 add the
median and 90th percentile of the training residuals. The score is the fitted log length, so
the ranking is by prompt length (reversed when b < 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.base import Prediction, checked_prompts
from predictor.saved import PredictorSpec

PARAMS_FILENAME = "length_params.json"


@dataclass(frozen=True)
class LengthParams:
    intercept: float
    slope: float
    residual_p50: float
    residual_p90: float

    def __post_init__(self) -> None:
        # Read back from JSON: a null or a string loaded, and failed at the first prediction.
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{PARAMS_FILENAME}: {name} must be a finite number, got {value!r}")


def prompt_length_feature(prompts: Sequence[str]) -> np.ndarray:
    return np.log1p(np.asarray([len(prompt) for prompt in prompts], dtype=np.float64))


class LengthPredictor:
    kind = "length"

    def __init__(self, params: LengthParams, spec: PredictorSpec) -> None:
        self.params = params
        self.spec = spec

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        prompts = checked_prompts(prompts)
        log_point = self.params.intercept + self.params.slope * prompt_length_feature(prompts)
        return [
            Prediction(
                point=math.expm1(max(value, 0.0)),
                p50=math.expm1(max(value + self.params.residual_p50, 0.0)),
                p90=math.expm1(max(value + max(self.params.residual_p90, self.params.residual_p50), 0.0)),
                score=float(value),
                rank_len=math.expm1(max(value, 0.0)),
            )
            for value in log_point
        ]

    def save(self, folder: Path) -> None:
        (folder / PARAMS_FILENAME).write_text(json.dumps(self.params.__dict__, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path, spec: PredictorSpec) -> "LengthPredictor":
        return cls(LengthParams(**json.loads((folder / PARAMS_FILENAME).read_text())), spec)
