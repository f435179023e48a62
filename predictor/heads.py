"""LightGBM heads over a feature matrix, shared by the lexical and the embedding predictors.

Targets live in log space (log1p of output tokens): lengths span four orders of magnitude and
the scheduler cares about order, not absolute error. Heads: `point` (L2 regression), `p50` and
`p90` (pinball loss), and optionally `rank` (lambdarank over length buckets). The ranking score
is the head that ranked the validation split best; the ranking length, which the scheduler orders
by, is the best of the heads in tokens (both chosen at fit time, stored in heads.json). p90 is
never below p50.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.base import Prediction

HEAD_NAMES = ("point", "p50", "p90", "rank")
TOKEN_HEADS = ("point", "p50", "p90")  # heads whose output is a log length, unlike lambdarank's
HEADS_FILENAME = "heads.json"


def legacy_length_head(score_head: str) -> str:
    """The length head of a folder saved before heads.json named one. Its score head was the best
    of all heads on validation, so when that is a head in tokens it is also the best of those, the
    head a fit now picks; after a lambdarank score, p50 (what the scheduler then ordered by)."""
    return score_head if score_head in TOKEN_HEADS else "p50"


@dataclass(frozen=True)
class HeadOutputs:
    score: np.ndarray
    log_point: np.ndarray
    log_p50: np.ndarray
    log_p90: np.ndarray
    log_rank_len: np.ndarray


def _tokens(log_length: np.ndarray) -> np.ndarray:
    return np.expm1(np.maximum(log_length, 0.0))


def to_predictions(outputs: HeadOutputs) -> list[Prediction]:
    point = _tokens(outputs.log_point)
    p50 = _tokens(outputs.log_p50)
    p90 = np.maximum(_tokens(outputs.log_p90), p50)
    rank_len = _tokens(outputs.log_rank_len)
    return [Prediction(float(a), float(b), float(c), float(s), float(r))
            for a, b, c, s, r in zip(point, p50, p90, outputs.score, rank_len)]


class LgbmHeads:
    """Boosters by head name (`rank` is optional), the head that gives the score and the head in
    tokens that gives the ranking length."""

    def __init__(self, boosters: dict, score_head: str, length_head: str) -> None:
        missing = set(TOKEN_HEADS) - set(boosters)
        if missing:
            raise ValueError(f"missing heads: {sorted(missing)}")
        if score_head not in boosters:
            raise ValueError(f"score head {score_head!r} is not among {sorted(boosters)}")
        if length_head not in TOKEN_HEADS:
            raise ValueError(f"length head {length_head!r} is not one of {TOKEN_HEADS}")
        self.boosters = boosters
        self.score_head = score_head
        self.length_head = length_head

    def predict(self, features: np.ndarray) -> HeadOutputs:
        outputs = {name: booster.predict(features, num_threads=1) for name, booster in self.boosters.items()}
        return HeadOutputs(outputs[self.score_head], outputs["point"], outputs["p50"], outputs["p90"],
                           outputs[self.length_head])

    def save(self, folder: Path) -> None:
        for name, booster in self.boosters.items():
            booster.save_model(str(folder / f"{name}.lgb.txt"))
        chosen = {"score_head": self.score_head, "length_head": self.length_head}
        (folder / HEADS_FILENAME).write_text(json.dumps(chosen) + "\n")

    @classmethod
    def load(cls, folder: Path, names: Sequence[str] = HEAD_NAMES) -> "LgbmHeads":
        import lightgbm

        boosters = {}
        for name in names:
            path = folder / f"{name}.lgb.txt"
            if path.exists():
                boosters[name] = lightgbm.Booster(model_file=str(path))
        chosen = json.loads((folder / HEADS_FILENAME).read_text())
        score_head = chosen["score_head"]
        return cls(boosters, score_head, chosen.get("length_head", legacy_length_head(score_head)))

    def check_num_features(self, expected: int, what: str) -> None:
        """Refuse boosters trained on another width than the `expected` features (`what` they
        are): LightGBM would refuse only at the first prediction, with its own error."""
        for name, booster in self.boosters.items():
            if booster.num_feature() != expected:
                raise ValueError(f"its {name} head reads {booster.num_feature()} features, "
                                 f"and {what} are {expected}")
