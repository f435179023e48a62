"""Would a head trained on the served model's own lengths rank them better than the default predictor?

One split of the trace is a few hundred prompts (with 200, a tau has a standard error near 0.045):
too coarse to choose between predictors. This script pools the train and validation prompts of
`data/traces/smollm2_sharegpt.parquet` and compares, by 5-fold cross-validated Kendall's tau
against the traced lengths:
- the default predictor's p50 as it is (trained on ChatGPT's lengths);
- a ridge regression of log length on [MiniLM embedding | lexical features] (the default's inputs);
- the same with the default's log p50, p90 and point added (a stacked head);
- a ridge on those three outputs alone (a recalibration).
Embeddings come from the training cache, filled first as training fills it.

Caveat: the default predictor was trained on ShareGPT's train split, which holds the trace's train
prompts (with ChatGPT's lengths), so on most pooled prompts its outputs are in-sample; the
figures for it and for the heads built on its outputs lean optimistic. Only the ridge on the
embedding and lexical features is free of that.

    python scripts/trace_head_cv.py [--predictor data/predictors/default] [--folds 5]
"""

from __future__ import annotations

import argparse

import numpy as np

from engine.arg_types import positive_int
from engine.config import DEFAULT_PREDICTOR


def features(model, split) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[embedding | lexical] as training builds them, the predictor's log outputs, and the log true
    lengths."""
    from training import embedding_cache
    from training.train_models import embed_features

    embedding_cache.fill_cache(split.prompts, model.encoder.config, encoder=model.encoder)
    outputs = np.log1p([[p.p50, p.p90, p.point] for p in model.predict(split.prompts)])
    return embed_features(split.prompts, model.encoder.config), outputs, np.log1p(split.lengths.astype(float))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predictor", default=str(DEFAULT_PREDICTOR))
    parser.add_argument("--folds", type=positive_int, default=5)
    args = parser.parse_args()

    from scipy import stats
    from sklearn.linear_model import RidgeCV

    import predictor
    from training import labels
    from training.train_models import limit_torch_threads

    limit_torch_threads()
    model = predictor.load(args.predictor)
    splits = [labels.load_split(name, "trace") for name in ("train", "validation")]
    parts = [features(model, split) for split in splits]
    x, outputs, y = (np.concatenate([part[i] for part in parts]) for i in range(3))
    folds = labels.trace_cv_folds([p for split in splits for p in split.prompts], args.folds)

    def tau(score: np.ndarray, rows: np.ndarray) -> float:
        return float(stats.kendalltau(score, y[rows]).statistic)

    def ridge(inputs: np.ndarray) -> list[float]:
        return [tau(RidgeCV(alphas=(1, 10, 100, 1000)).fit(inputs[train], y[train]).predict(inputs[test]), test)
                for train, test in folds]

    candidates = {
        "default p50": [tau(outputs[test, 0], test) for _, test in folds],
        "ridge on embedding + lexical": ridge(x),
        "ridge on embedding + lexical + default outputs": ridge(np.hstack([x, outputs])),
        "ridge on default outputs": ridge(outputs),
    }
    print(f"{len(y)} traced prompts, {args.folds}-fold cross-validated Kendall's tau (mean, standard error):")
    for name, taus in candidates.items():
        print(f"  {name:48s} {np.mean(taus):.3f}  {np.std(taus, ddof=1) / np.sqrt(len(taus)):.3f}")
    base = np.asarray(candidates["default p50"])
    for name, taus in list(candidates.items())[1:]:
        gain = np.asarray(taus) - base
        print(f"  paired gain over default p50, {name}: {gain.mean():+.3f} "
              f"(standard error {gain.std(ddof=1) / np.sqrt(len(gain)):.3f})")


if __name__ == "__main__":
    main()
