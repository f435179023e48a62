"""Does the fine-tuned predictor help on the served model's own lengths, trained on them or beside the probe?

The fine-tuned predictor (`data/predictors/finetune`) ranks ChatGPT's lengths best of all, but
the served model's trace (`data/traces/smollm2_sharegpt.parquet`) is ranked best by the probe
on SmolLM2's own states (`data/predictors/probe_trace_k128`). Two experiments, each scored by
Kendall's tau on the trace's validation and test splits:
- transfer: continue the fine-tuned predictor's trained weights (adapters and head) on the
  trace's train split, at small learning rates, and score it before and after;
- rank average: w * rank(probe) + (1 - w) * rank(fine-tuned, as saved) for w = 0, 0.1, ..., 1;
  a w is chosen on validation, never on test.

    python scripts/trace_transfer.py [--finetune data/predictors/finetune] [--probe data/predictors/probe_trace_k128] [--epochs 1] [--adapter-lr 5e-5] [--head-lr 3e-4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from engine.arg_types import positive_float, positive_int

SPLITS = ("validation", "test")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from predictor.saved import read_spec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finetune", type=Path, default=Path("data/predictors/finetune"))
    parser.add_argument("--probe", type=Path, default=Path("data/predictors/probe_trace_k128"))
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument("--adapter-lr", type=positive_float, default=5e-5)
    parser.add_argument("--head-lr", type=positive_float, default=3e-4)
    args = parser.parse_args(argv)
    for flag, path, kind in (("--finetune", args.finetune, "finetune"), ("--probe", args.probe, "probe")):
        try:
            found = read_spec(path).kind
        except (OSError, ValueError) as error:
            parser.error(f"{flag}: {error}")
        if found != kind:
            parser.error(f"{flag} {path}: a {found} predictor, not a {kind} one")
    return args


def rank_lengths(model, split) -> np.ndarray:
    """What the scheduler orders by, for each prompt of `split`."""
    from predictor.batching import predict_in_batches

    return np.asarray([p.rank_len for p in predict_in_batches(model, split.prompts)])


def taus(ranks: dict[str, np.ndarray], splits: dict) -> str:
    from scipy import stats

    return "  ".join(f"{name} {stats.kendalltau(ranks[name], splits[name].lengths).statistic:.3f}"
                     for name in SPLITS)


def transfer(args: argparse.Namespace, splits: dict) -> dict[str, np.ndarray]:
    """The saved fine-tuned predictor's ranks before training on the trace (returned), after it
    (printed)."""
    from predictor import saved
    from training.finetune_train import FinetuneConfig, fit_network

    model = saved.load(args.finetune)
    before = {name: rank_lengths(model, splits[name]) for name in SPLITS}
    print(f"fine-tuned, as saved:          {taus(before, splits)}", flush=True)
    # fit_network reads from the network whether it trains adapters or the whole encoder.
    config = FinetuneConfig(epochs=args.epochs, adapter_learning_rate=args.adapter_lr,
                            encoder_learning_rate=args.adapter_lr, head_learning_rate=args.head_lr)
    train = splits["train"]
    # The saved standardisation stays: the head learnt it, and refitting it to the trace's prompts
    # alone moved the test tau from 0.292 to 0.259 before any training step.
    fit_network(model.network, train.prompts, train.lengths, config, standardise=False)
    after = {name: rank_lengths(model, splits[name]) for name in SPLITS}
    print(f"fine-tuned, then on the trace: {taus(after, splits)}  ({len(train)} train prompts, "
          f"{args.epochs} epoch(s), rates {args.adapter_lr:g} / {args.head_lr:g})", flush=True)
    return before


def rank_average(args: argparse.Namespace, splits: dict, finetuned: dict[str, np.ndarray]) -> None:
    from scipy import stats

    from predictor import saved

    probe = saved.load(args.probe)
    probed = {name: rank_lengths(probe, splits[name]) for name in SPLITS}
    print(f"probe:                         {taus(probed, splits)}")
    for weight in np.linspace(0.0, 1.0, 11):
        mixed = {name: weight * stats.rankdata(probed[name]) + (1 - weight) * stats.rankdata(finetuned[name])
                 for name in SPLITS}
        print(f"w(probe) = {weight:.1f}:                {taus(mixed, splits)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from training import labels
    from training.train_models import limit_torch_threads

    limit_torch_threads()
    import torch

    torch.manual_seed(0)
    splits = {name: labels.load_split(name, "trace") for name in ("train", *SPLITS)}
    finetuned = transfer(args, splits)
    rank_average(args, splits, finetuned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
