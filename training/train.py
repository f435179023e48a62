"""`lengthwise train`: fit one kind of predictor, log the run to MLflow, crown the champion.

Flow: load labelled train/validation/test splits (subsampled for the encoder models, which cost
tens of milliseconds a prompt on CPU) -> fit -> save the predictor folder with its spec and
validation metrics -> log config, data hash, git sha, metrics (val_* and test_*), plots and the
folder -> alias `champion` to the best run by validation Kendall's tau.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from engine.arg_types import check_output_location, named_path, non_negative_int, positive_int, ranked_rows
from predictor.saved import KINDS
from training import fitters
from training.labels import LABEL_SOURCES

# Validation rows every champion candidate is scored on, whatever it validated on itself: the
# encoders' default validation subsample (seed 1). Not held out: every default run early-stops on
# these rows or on a superset of them (embed_lgbm on exactly these), so the figure is a little
# optimistic for every candidate, most for embed_lgbm; but all are scored on the same rows.
SELECTION_ROWS = 2000

# Rows used per split by default: everything for the cheap models, subsamples for the encoders.
DEFAULT_LIMITS = {
    "length": (None, None, None),
    "lexical": (None, None, None),
    "embed_lgbm": (8000, 2000, 2000),
    "finetune": (3000, 1000, 1000),
    "probe": (8000, 2000, 2000),
}
# Kinds whose fit draws nothing at random: a prompt-length regression, and the probe's ridge head.
SEEDLESS_KINDS = ("length", "probe")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The committed default predictor's kind, so `lengthwise train [--labels trace]` runs as the docs
    # and issue 3 write it.
    parser.add_argument("--model", choices=sorted(KINDS), default="embed_lgbm",
                        help="the predictor kind (default embed_lgbm, the committed default's)")
    parser.add_argument("--labels", choices=LABEL_SOURCES, default="sharegpt",
                        help="sharegpt: ChatGPT's reply lengths; trace: the served model's")
    parser.add_argument("--max-train", type=ranked_rows, default=None, help="train rows (default per model)")
    parser.add_argument("--max-eval", type=ranked_rows, default=None,
                        help="validation and test rows (default per model); a run on ShareGPT labels also scores "
                             f"the same {SELECTION_ROWS:,} validation rows for the champion, whatever this says "
                             "(unless --no-register)")
    parser.add_argument("--store", type=named_path, default=None, help="MLflow store folder (default mlruns/)")
    parser.add_argument("--save", type=named_path, default=None, help="also copy the predictor folder here")
    parser.add_argument("--no-register", action="store_true",
                        help="log the run but leave the champion alone (and skip the champion's scoring of the "
                             f"{SELECTION_ROWS:,} fixed validation rows: such a run never competes)")
    parser.add_argument("--prior", type=named_path, default=None,
                        help="embed_lgbm with --labels trace: stack on this saved embed_lgbm predictor, trained "
                             "with --hold-out-trace (its outputs become features)")
    parser.add_argument("--hold-out-trace", action="store_true",
                        help="leave the trace's conversations out of train and validation, so the model "
                             "can be a --prior of a trace-trained one")
    # None, not the probe's 64, so that a --probe-tokens given to another kind is refused, not ignored.
    parser.add_argument("--probe-tokens", type=positive_int, default=None, metavar="N",
                        help="probe: the prompt's last N tokens it reads (default 64; its cost grows with N)")
    parser.add_argument("--lora-rank", type=positive_int, default=None, metavar="R",
                        help="finetune: train rank-R adapters on a frozen MiniLM (default: MiniLM itself); "
                             "the saved folder then holds only the adapters and the head")
    # None, not 0, so that a --seed given to a kind whose fit draws nothing is refused, not ignored.
    parser.add_argument("--seed", type=non_negative_int, default=None,
                        help=f"lexical, embed_lgbm and finetune: the fit's seed (default 0); "
                             f"{' and '.join(SEEDLESS_KINDS)} fit deterministically")


def load_data(labels: str, model: str, max_train: int | None, max_eval: int | None, prior: Path | None = None,
              hold_out_trace: bool = False):
    from training import dataset, labels as label_data
    from training.train_models import TrainingData

    train_limit, valid_limit, test_limit = DEFAULT_LIMITS[model]
    train_limit = max_train if max_train is not None else train_limit
    valid_limit = max_eval if max_eval is not None else valid_limit
    test_limit = max_eval if max_eval is not None else test_limit
    held_out = label_data.trace_held_out() if hold_out_trace else None
    # Fixed seeds per split so every model sees the same subsamples (and the embedding cache hits).
    # The test split keeps every row: held-out conversations only matter to what the fit sees.
    splits = {
        "train": label_data.subsample(label_data.load_split("train", labels, held_out), train_limit, seed=0),
        "validation": label_data.subsample(label_data.load_split("validation", labels, held_out), valid_limit,
                                           seed=1),
        "test": label_data.subsample(label_data.load_split("test", labels), test_limit, seed=2),
    }
    for name, split in splits.items():  # before any embedding or fit, not as LightGBM's traceback in one
        if len(split) < 2:
            raise ValueError(f"the {labels} {name} split holds {len(split)} rows; training needs at least 2 in "
                             "each (a turn table built with `data prepare --limit` can leave one empty)")
    return TrainingData(
        train=splits["train"], valid=splits["validation"], test=splits["test"],
        labels=labels,
        data_hash=dataset.table_hash() if labels == "sharegpt" else label_data.trace_hash(),
        prior=prior,
        held_out=label_data.trace_held_out_tag() if hold_out_trace else "",
    )


def evaluate_trained(data, trained) -> dict[str, float]:
    from training import labels as label_data
    from training.metrics import prediction_metrics

    metrics = {}
    for prefix, split, predictions in (("val_", data.valid, trained.valid_predictions),
                                       ("test_", data.test, trained.test_predictions)):
        metrics.update(prediction_metrics(split.lengths, predictions, split.censored).as_dict(prefix))
    dedup = ~label_data.seen_in_training(data.test, trained.predictor.spec)
    dedup_predictions = [p for p, keep in zip(trained.test_predictions, dedup) if keep]
    metrics["test_kendall_tau_dedup"] = prediction_metrics(data.test.lengths[dedup], dedup_predictions).kendall_tau
    return metrics


def selection_tau(predictor, data, trained) -> float:
    """Kendall's tau on the fixed selection rows (ShareGPT labels, nothing held out); a run that
    validated on exactly those rows reuses its validation predictions instead of predicting again."""
    from predictor.batching import predict_in_batches
    from training import labels as label_data
    from training.metrics import prediction_metrics

    rows = label_data.subsample(label_data.load_split("validation", "sharegpt"), SELECTION_ROWS, seed=1)
    same = rows.prompts == data.valid.prompts
    predictions = trained.valid_predictions if same else predict_in_batches(predictor, rows.prompts)
    return prediction_metrics(rows.lengths, predictions).kendall_tau


def _plots(data, trained, folder: Path, kind: str) -> list[Path]:
    from training import predictor_plots

    return [
        predictor_plots.predicted_vs_true(data.valid.lengths, trained.valid_predictions,
                                          folder / "predicted_vs_true.png", f"{kind}: validation"),
        predictor_plots.tau_by_prompt_bucket(data.valid.lengths, trained.valid_predictions,
                                             data.valid.prompt_tokens, folder / "tau_by_prompt_length.png",
                                             f"{kind}: validation tau by prompt length"),
    ]


def check_save_target(path: Path | None) -> None:
    """--save replaces a predictor folder whole (a stale `prior/` left in it would make it load as a
    stacked model); anything else already there is refused, never deleted."""
    if path is None:
        return
    # Before the training: the folder is staged beside `path`, so its parent must take a new one.
    check_output_location(path.parent if path.exists() else path, "--save", folder=True)
    if not path.exists():
        return
    if path.is_file() or (any(path.iterdir()) and not (path / "predictor.json").exists()):
        raise ValueError(f"--save {path}: exists and is not a predictor folder; choose another path")


def replace_folder(source: Path, target: Path) -> None:
    """Copy `source` beside `target`, then swap it in: a failed copy leaves `target` as it was, and a
    symlink at `target` is replaced, not followed."""
    import os
    import shutil

    staged = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(source, staged)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    os.replace(staged, target)


def trainer_config(args: argparse.Namespace):
    """The probe reads the served model's states, the fine-tune trains MiniLM (or adapters on it);
    every other kind fits LightGBM-style heads."""
    if args.model == "probe":
        from predictor.probe import ProbeConfig

        return ProbeConfig() if args.probe_tokens is None else ProbeConfig(max_tokens=args.probe_tokens)
    if args.model == "finetune":
        from training.finetune_train import FinetuneConfig

        return FinetuneConfig(seed=args.seed or 0, lora_rank=args.lora_rank)
    return fitters.LgbmConfig(seed=args.seed or 0)


def train_and_log(args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    from predictor import saved
    from training import tracking
    from training.train_models import TRAINERS

    if args.prior is not None and (args.model != "embed_lgbm" or args.labels != "trace"):
        raise ValueError("--prior applies to --model embed_lgbm --labels trace only")
    if args.lora_rank is not None and args.model != "finetune":
        raise ValueError("--lora-rank applies to --model finetune only")
    if args.probe_tokens is not None and args.model != "probe":
        raise ValueError("--probe-tokens applies to --model probe only")
    if args.seed is not None and args.model in SEEDLESS_KINDS:
        raise ValueError(f"--seed: --model {args.model} fits deterministically, with no seed to set")
    if args.hold_out_trace and args.labels != "sharegpt":
        raise ValueError("--hold-out-trace applies to --labels sharegpt only")
    check_save_target(args.save)
    data = load_data(args.labels, args.model, args.max_train, args.max_eval, args.prior, args.hold_out_trace)
    trained = TRAINERS[args.model](data, trainer_config(args))
    metrics = evaluate_trained(data, trained)
    predictor = trained.predictor
    # The only runs that compete for champion. An unregistered one never competes (it is tagged so),
    # and the scoring of the fixed rows was most of a small run's time.
    if args.labels == "sharegpt" and not data.held_out and not args.no_register:
        metrics[tracking.SELECTION_METRIC] = selection_tau(predictor, data, trained)
    predictor.spec = dataclasses.replace(
        predictor.spec, metrics={k: round(v, 4) for k, v in metrics.items() if k.startswith(("val_", "test_"))})
    with tempfile.TemporaryDirectory() as scratch:
        folder = saved.save(predictor, Path(scratch) / "predictor")
        if args.save is not None:
            replace_folder(folder, args.save)
        plots = _plots(data, trained, Path(scratch), args.model)
        params = {"model": args.model, "labels": args.labels, "num_train": len(data.train),
                  "num_valid": len(data.valid), "num_test": len(data.test), **trained.params}
        with tracking.tracking_session(args.store):
            run_id = tracking.log_run(f"{args.model}-{args.labels}", params, metrics, folder, plots,
                                      {"data_hash": data.data_hash, "kind": args.model,
                                       **tracking.comparison_tags(args.labels, data.held_out,
                                                                  candidate=not args.no_register)})
            if not args.no_register:
                tracking.update_champion(data.data_hash)
    return run_id, metrics


def run(args: argparse.Namespace) -> int:
    run_id, metrics = train_and_log(args)
    print(f"run {run_id}: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())
                                        if k.endswith(("kendall_tau", "kendall_tau_dedup"))))
    return 0
