"""Frozen MiniLM embeddings plus lexical features, LightGBM heads (lambdarank score + quantiles).

The encoder runs first (torch), then the boosters (single-threaded LightGBM): never both at once.

Optionally stacked on a prior: the heads of another embed_lgbm predictor over the same features
(in practice one trained on ChatGPT reply lengths without the trace's conversations), whose four
outputs become extra features. A trace of the served model has a few thousand labels; the prior
brings what the large table taught about which prompts ask for long answers. The prior's heads
live in `prior/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.base import Prediction, checked_prompts
from predictor.encoder import EncoderConfig, MiniLMEncoder, check_encoder_weights
from predictor.features import check_lexical_spec, lexical_matrix
from predictor.heads import LgbmHeads, to_predictions
from predictor.saved import PredictorSpec


PRIOR_FOLDER = "prior"


def embed_lgbm_features(embeddings: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """The head's input: [embedding | lexical features], the same in training and serving.

    Embeddings are rounded to float16, as the training cache stores them, so a served prompt gets
    the features its copy in training had, but where the padding of a different batch moved an
    fp32 value across a rounding boundary (one fp16 step in a few elements; unrounded fp32 differs
    in the fourth digit of every element, enough to move a tree split)."""
    return np.hstack([embeddings.astype(np.float16).astype(np.float32), lexical_matrix(prompts)])


def prior_outputs(features: np.ndarray, prior: LgbmHeads) -> np.ndarray:
    """The prior's score, log point, log p50 and log p90 per row [N, 4]: the stacked columns."""
    out = prior.predict(features)
    return np.column_stack([out.score, out.log_point, out.log_p50, out.log_p90]).astype(np.float32)


def with_prior(features: np.ndarray, prior: LgbmHeads | None) -> np.ndarray:
    """[features | prior_outputs] (unchanged without a prior)."""
    if prior is None:
        return features
    return np.hstack([features, prior_outputs(features, prior)])


class EmbedLgbmPredictor:
    kind = "embed_lgbm"

    def __init__(self, encoder: MiniLMEncoder, heads: LgbmHeads, spec: PredictorSpec,
                 prior: LgbmHeads | None = None) -> None:
        self.encoder = encoder
        self.heads = heads
        self.spec = spec
        self.prior = prior

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        prompts = checked_prompts(prompts)
        if not prompts:
            return []
        features = embed_lgbm_features(self.encoder.encode(prompts), prompts)
        return to_predictions(self.heads.predict(with_prior(features, self.prior)))

    def save(self, folder: Path) -> None:
        self.heads.save(folder)
        if self.prior is not None:
            (folder / PRIOR_FOLDER).mkdir(exist_ok=True)
            self.prior.save(folder / PRIOR_FOLDER)

    @classmethod
    def load(cls, folder: Path, spec: PredictorSpec) -> "EmbedLgbmPredictor":
        check_lexical_spec(spec.feature_spec)
        check_encoder_weights(spec.feature_spec)
        encoder = MiniLMEncoder(EncoderConfig(**spec.feature_spec["encoder"]))
        stacked, has_prior = "prior" in spec.feature_spec, (folder / PRIOR_FOLDER).is_dir()
        if stacked != has_prior:  # else every prediction would fail on the heads' feature count
            raise ValueError(f"{folder}: the spec {'names' if stacked else 'has no'} prior, but "
                             f"{PRIOR_FOLDER}/ is {'missing' if stacked else 'there'}")
        prior = LgbmHeads.load(folder / PRIOR_FOLDER) if stacked else None
        return cls(encoder, LgbmHeads.load(folder), spec, prior)
