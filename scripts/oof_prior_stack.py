"""Stacking trace-trained heads on out-of-fold prior outputs: does it beat the default predictor?

`lengthwise train --labels trace --prior PATH` needs a prior that never saw the trace's prompts,
or the stacked heads learn from its in-sample outputs. `--hold-out-trace` gives one by leaving
every trace conversation out of the ShareGPT train split, which drops 60% of the rows. This
experiment keeps them: the trace's train and validation conversations are split into K folds by a
hash, and each fold's prompts get the outputs of a prior fitted on the ShareGPT train split
without that fold's conversations (nor any copy of their prompts). The test prompts get the
outputs of the default predictor, which serving would use as the prior and which never saw them
(they are in ShareGPT's test split). Heads are then fitted on the trace's train split over
[embedding | lexical | prior outputs], stopped early on its validation split, and Kendall's tau of
their ranking length is measured on the trace's test split, next to the default's.

    python scripts/oof_prior_stack.py [--folds 5] [--json out/oof_prior_stack.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

from engine.arg_types import positive_int
from engine.config import DEFAULT_PREDICTOR, REPO_ROOT
from predictor.embed_lgbm import prior_outputs


def fold_of(conversation_id: str, folds: int) -> int:
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % folds


def embed_features(prompts: list[str], encoder) -> np.ndarray:
    """[embedding | lexical] as training builds them, the cache filled first as training fills it."""
    from training import embedding_cache, train_models

    embedding_cache.fill_cache(prompts, encoder.config, encoder=encoder)
    return train_models.embed_features(prompts, encoder.config)


def _chosen(tables: list, rows: list[np.ndarray], column: str) -> frozenset[str]:
    return frozenset(value for table, mask in zip(tables, rows) for value, keep in zip(table[column], mask) if keep)


def out_of_fold(trace_tables: list, trace_features: list[np.ndarray], folds: int, encoder) -> list[np.ndarray]:
    """Prior outputs for each given trace table's rows, each row's from the fold prior that never
    saw its conversation."""
    from training import dataset, fitters
    from training.labels import HeldOut

    share = {name: dataset.load_turns(name) for name in ("train", "validation")}
    features = {name: embed_features(list(table["prompt"]), encoder) for name, table in share.items()}
    outputs = [np.zeros((len(t), 4), dtype=np.float32) for t in trace_tables]
    for fold in range(folds):
        rows = [np.asarray([fold_of(c, folds) == fold for c in t["conversation_id"]]) for t in trace_tables]
        held = HeldOut(_chosen(trace_tables, rows, "conversation_id"), _chosen(trace_tables, rows, "key"))
        kept = {name: np.asarray([held.keeps(c, p) for c, p in zip(t["conversation_id"], t["prompt"])])
                for name, t in share.items()}
        lengths = {name: np.asarray(t["response_tokens"])[kept[name]] for name, t in share.items()}
        heads = fitters.fit_lgbm_heads(features["train"][kept["train"]], lengths["train"],
                                       features["validation"][kept["validation"]], lengths["validation"],
                                       fitters.LgbmConfig())
        print(f"fold {fold}: prior fitted on {kept['train'].sum()} of {len(kept['train'])} ShareGPT train rows",
              flush=True)
        for out, feats, r in zip(outputs, trace_features, rows):
            if r.any():
                out[r] = prior_outputs(feats[r], heads)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folds", type=positive_int, default=5)
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "out" / "oof_prior_stack.json")
    args = parser.parse_args()

    from scipy import stats

    import predictor
    from predictor.heads import LgbmHeads, to_predictions
    from training import fitters
    from training.trace import load_trace
    from training.train_models import limit_torch_threads

    limit_torch_threads()
    default = predictor.load(DEFAULT_PREDICTOR)
    tables = {name: load_trace(name) for name in ("train", "validation", "test")}
    features = {name: embed_features(list(t["prompt"]), default.encoder) for name, t in tables.items()}
    train_prior, valid_prior = out_of_fold([tables["train"], tables["validation"]],
                                           [features["train"], features["validation"]], args.folds, default.encoder)
    test_prior = prior_outputs(features["test"], LgbmHeads.load(DEFAULT_PREDICTOR))
    lengths = {name: np.asarray(t["output_tokens"]) for name, t in tables.items()}
    heads = fitters.fit_lgbm_heads(np.hstack([features["train"], train_prior]), lengths["train"],
                                   np.hstack([features["validation"], valid_prior]), lengths["validation"],
                                   fitters.LgbmConfig())
    stacked = to_predictions(heads.predict(np.hstack([features["test"], test_prior])))
    baseline = default.predict(list(tables["test"]["prompt"]))
    fresh = ~np.asarray(tables["test"]["in_train"], dtype=bool)

    def tau(predictions, rows) -> float:
        values = [p.rank_len for p, keep in zip(predictions, rows) if keep]
        return float(stats.kendalltau(values, lengths["test"][rows]).statistic)

    everything = np.ones(len(fresh), dtype=bool)
    report = {"folds": args.folds, "num_test": int(len(fresh)), "length_head": heads.length_head,
              "stacked_kendall_tau": tau(stacked, everything), "stacked_kendall_tau_dedup": tau(stacked, fresh),
              "default_kendall_tau": tau(baseline, everything), "default_kendall_tau_dedup": tau(baseline, fresh)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
