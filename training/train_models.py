"""Building each kind of predictor from labelled splits, with its validation and test predictions.

The embedding predictor trains from cached embeddings (training.embedding_cache) passed through
the same `embed_lgbm_features` the served predictor uses, so cached and served features agree
(tests/test_predictor.py checks that parity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.base import Prediction
from predictor.batching import predict_in_batches
from predictor.features import lexical_matrix, lexical_spec
from predictor.heads import to_predictions
from predictor.saved import PredictorSpec
from training import fitters
from training.labels import LabelledSplit


@dataclass(frozen=True)
class TrainingData:
    train: LabelledSplit
    valid: LabelledSplit
    test: LabelledSplit
    labels: str
    data_hash: str
    prior: Path | None = None  # embed_lgbm only: a saved embed_lgbm folder whose outputs become features
    held_out: str = ""  # conversations left out of train and validation (PredictorSpec.held_out)


@dataclass
class TrainedModel:
    predictor: object  # has .spec, .predict, .save
    valid_predictions: list[Prediction]
    test_predictions: list[Prediction]
    params: dict = field(default_factory=dict)


def limit_torch_threads(threads: int = 2) -> None:
    """The machine's cores are shared: torch must not start a thread per core."""
    import torch

    torch.set_num_threads(threads)


def _spec(kind: str, data: TrainingData, feature_spec: dict) -> PredictorSpec:
    return PredictorSpec(kind=kind, feature_spec=feature_spec, data_hash=data.data_hash, labels=data.labels,
                         held_out=data.held_out)


def train_length(data: TrainingData, config: fitters.LgbmConfig) -> TrainedModel:
    model = fitters.fit_length(data.train, _spec("length", data, {"input": "log1p(prompt characters)"}))
    return TrainedModel(model, model.predict(data.valid.prompts), model.predict(data.test.prompts))


def train_lexical(data: TrainingData, config: fitters.LgbmConfig) -> TrainedModel:
    from predictor.lexical import LexicalPredictor

    heads = fitters.fit_lgbm_heads(lexical_matrix(data.train.prompts), data.train.lengths,
                                   lexical_matrix(data.valid.prompts), data.valid.lengths, config)
    model = LexicalPredictor(heads, _spec("lexical", data, lexical_spec()))
    return TrainedModel(model, predict_in_batches(model, data.valid.prompts),
                        predict_in_batches(model, data.test.prompts),
                        {"score_head": heads.score_head, "length_head": heads.length_head, **config.__dict__})


def embed_features(prompts: Sequence[str], encoder_config) -> np.ndarray:
    from predictor.embed_lgbm import embed_lgbm_features

    return embed_lgbm_features(filled_cache_vectors(prompts, encoder_config), prompts)


def filled_cache_vectors(prompts: Sequence[str], encoder_config) -> np.ndarray:
    """Every prompt's cached vector, after `fill_cache` stored them all (else a RuntimeError)."""
    from training import embedding_cache

    vectors, found = embedding_cache.cached_embeddings(prompts, encoder_config)
    if not found.all():
        raise RuntimeError(f"{int((~found).sum())} prompts' vectors missing from the cache after filling it")
    return vectors


def train_embed_lgbm(data: TrainingData, config: fitters.LgbmConfig) -> TrainedModel:
    from predictor.embed_lgbm import EmbedLgbmPredictor, with_prior
    from predictor.encoder import EncoderConfig, MiniLMEncoder, encoder_feature_spec
    from training import embedding_cache

    limit_torch_threads()
    encoder_config = EncoderConfig()
    feature_spec = {**lexical_spec(), **encoder_feature_spec(encoder_config)}
    prior, prior_spec = _load_prior(data.prior, feature_spec, data.labels)  # before any encoding
    encoder = MiniLMEncoder(encoder_config)
    # torch finishes all encoding before LightGBM starts: the two never share the cores.
    embedding_cache.fill_cache(data.valid.prompts + data.test.prompts + data.train.prompts,
                               encoder_config, encoder=encoder)
    features = {name: with_prior(embed_features(getattr(data, name).prompts, encoder_config), prior)
                for name in ("train", "valid", "test")}
    heads = fitters.fit_lgbm_heads(features["train"], data.train.lengths, features["valid"],
                                   data.valid.lengths, config)
    if prior_spec is not None:
        feature_spec["prior"] = {"labels": prior_spec.labels, "data_hash": prior_spec.data_hash,
                                 "held_out": prior_spec.held_out}
    model = EmbedLgbmPredictor(encoder, heads, _spec("embed_lgbm", data, feature_spec), prior)
    return TrainedModel(model, to_predictions(heads.predict(features["valid"])),
                        to_predictions(heads.predict(features["test"])),
                        {"score_head": heads.score_head, "length_head": heads.length_head, "prior": str(data.prior),
                         **config.__dict__, **encoder_config.as_dict()})


def _load_prior(folder: Path | None, feature_spec: dict, labels: str):
    """(heads, spec) of the prior predictor folder, or (None, None); it must share our features and
    must not have trained on the trace's prompts.

    A prior that saw a train prompt's ChatGPT label gives it an in-sample output, better than its
    outputs on new prompts, and heads stacked on it learn to trust it more than they should (the
    default, trained on the whole ShareGPT train split, ranks those prompts at tau 0.69 against
    0.47 on test). Only the heads are loaded: the features come from the encoder this training
    already runs."""
    from predictor.embed_lgbm import PRIOR_FOLDER
    from predictor.heads import LgbmHeads
    from predictor.saved import read_spec
    from training.labels import trace_held_out_tag

    if folder is None:
        return None, None
    spec = read_spec(folder)
    if spec.kind != "embed_lgbm" or (Path(folder) / PRIOR_FOLDER).is_dir():
        raise ValueError(f"--prior {folder}: must be an embed_lgbm predictor without a prior of its own")
    if spec.feature_spec != feature_spec:
        raise ValueError(f"--prior {folder}: its features differ from this code's")
    if labels != "trace" or spec.held_out != trace_held_out_tag():
        raise ValueError(f"--prior {folder}: stack only trace-trained heads, on a prior trained without the "
                         "trace's conversations (lengthwise train --model embed_lgbm --hold-out-trace ...)")
    try:
        return LgbmHeads.load(Path(folder)), spec
    except Exception as exc:  # noqa: BLE001 - LightGBMError is no ValueError: a traceback naming neither
        raise ValueError(f"--prior {folder}: its heads do not load ({type(exc).__name__}: {exc})") from exc


def train_probe(data: TrainingData, config) -> TrainedModel:
    """The served model's own states at the prompt's end (`config`: a ProbeConfig), a ridge head."""
    from predictor.probe import HiddenStateProbe, ProbePredictor, probe_features
    from training import embedding_cache

    limit_torch_threads()
    encoder = HiddenStateProbe(config)
    embedding_cache.fill_cache(data.valid.prompts + data.test.prompts + data.train.prompts,
                               encoder.config, encoder=encoder)

    features = {name: probe_features(filled_cache_vectors(getattr(data, name).prompts, encoder.config))
                for name in ("train", "valid", "test")}
    head, alpha = fitters.fit_ridge_head(features["train"], data.train.lengths, features["valid"],
                                         data.valid.lengths)
    model = ProbePredictor(encoder, head, _spec("probe", data, {"probe": encoder.config.as_dict()}))
    return TrainedModel(model, to_predictions(head.predict(features["valid"])),
                        to_predictions(head.predict(features["test"])),
                        {"ridge_alpha": alpha, **encoder.config.as_dict()})


def train_finetune(data: TrainingData, config) -> TrainedModel:
    """MiniLM trained end to end (`config`: a FinetuneConfig)."""
    from training import finetune_train

    return finetune_train.train(data, _spec("finetune", data, {}), config)


TRAINERS = {"length": train_length, "lexical": train_lexical, "embed_lgbm": train_embed_lgbm,
            "finetune": train_finetune, "probe": train_probe}
