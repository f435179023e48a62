"""LightGBM heads over a feature matrix, shared by the lexical and the embedding predictors.

Targets live in log space (log1p of output tokens): lengths span four orders of magnitude and
the scheduler cares about order, not absolute error. Heads: `point` (L2 regression), `p50` and
`p90` (pinball loss), and optionally `rank` (lambdarank over length buckets). The ranking score
is the head that ranked the validation split best (chosen at fit time, stored in heads.json);
p90 is never below p50.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.base import Prediction

HEAD_NAMES = ("point", "p50", "p90", "rank")
HEADS_FILENAME = "heads.json"


@dataclass(frozen=True)
class HeadOutputs:
    score: np.ndarray
    log_point: np.ndarray
    log_p50: np.ndarray
    log_p90: np.ndarray


def to_predictions(outputs: HeadOutputs) -> list[Prediction]:
    point = np.expm1(np.maximum(outputs.log_point, 0.0))
    p50 = np.expm1(np.maximum(outputs.log_p50, 0.0))
    p90 = np.maximum(np.expm1(np.maximum(outputs.log_p90, 0.0)), p50)
    return [Prediction(float(a), float(b), float(c), float(s))
            for a, b, c, s in zip(point, p50, p90, outputs.score)]


class LgbmHeads:
    """Boosters by head name (`rank` is optional) and the name of the head that gives the score."""

    def __init__(self, boosters: dict, score_head: str = "point") -> None:
        missing = {"point", "p50", "p90"} - set(boosters)
        if missing:
            raise ValueError(f"missing heads: {sorted(missing)}")
        if score_head not in boosters:
            raise ValueError(f"score head {score_head!r} is not among {sorted(boosters)}")
        self.boosters = boosters
        self.score_head = score_head

    def predict(self, features: np.ndarray) -> HeadOutputs:
        outputs = {name: booster.predict(features, num_threads=1) for name, booster in self.boosters.items()}
        return HeadOutputs(outputs[self.score_head], outputs["point"], outputs["p50"], outputs["p90"])

    def save(self, folder: Path) -> None:
        for name, booster in self.boosters.items():
            booster.save_model(str(folder / f"{name}.lgb.txt"))
        (folder / HEADS_FILENAME).write_text(json.dumps({"score_head": self.score_head}) + "\n")

    @classmethod
    def load(cls, folder: Path, names: Sequence[str] = HEAD_NAMES) -> "LgbmHeads":
        import lightgbm

        boosters = {}
        for name in names:
            path = folder / f"{name}.lgb.txt"
            if path.exists():
                boosters[name] = lightgbm.Booster(model_file=str(path))
        return cls(boosters, json.loads((folder / HEADS_FILENAME).read_text())["score_head"])
