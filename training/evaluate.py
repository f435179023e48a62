"""`lengthwise eval-predictor`: a saved predictor on the test split, whole and deduplicated.

Reports Kendall's tau (primary), tau with the prompts that occur verbatim in the train split
removed (and, stricter, with every prompt whose last user message is some train prompt's last user
message removed), Spearman, pairwise order accuracy, MAE of log length, quantile coverage, and latency
per prompt at batch 1 and 32 (median over repeated calls on test prompts, after one warm-up).

With `--labels trace`, one sampled length per prompt is a noisy label (at temperature 1 two samples
of a prompt agree at tau 0.28). When a second sample of the test prompts exists (`--resample`,
by default the committed one), the report adds tau against that sample alone, an independent check
of the first, and against the mean of the two, a label with less chance in it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from engine.arg_types import check_output_location, named_path, positive_int, prepare_output_file
from engine.config import DEFAULT_PREDICTOR
from predictor.saved import SPEC_FILENAME
from training.labels import LABEL_SOURCES

LATENCY_CALLS = {1: 64, 32: 12}  # batch size -> timed calls


@dataclass(frozen=True)
class EvaluationReport:
    kendall_tau: float  # of rank_len, the order the scheduler uses
    kendall_tau_dedup: float
    kendall_tau_dedup_last_message: float  # also without prompts whose last user message is in train
    kendall_tau_score: float  # of the predictor's own score
    spearman: float
    pairwise_accuracy: float
    mae_log: float
    # Bounds with replies cut at a cap (training/metrics.py coverage): the share known covered,
    # and `_max`, the share not known uncovered; equal on ShareGPT's labels.
    p50_coverage: float
    p90_coverage: float
    p50_coverage_max: float
    p90_coverage_max: float
    num_censored: int  # trace replies cut at the cap
    latency_ms_p50_batch1: float | None  # None with --no-latency (JSON null; NaN is not JSON)
    latency_ms_p50_batch32: float | None
    num_examples: int
    num_examples_dedup: int
    num_examples_dedup_last_message: int
    kind: str
    predictor: str
    labels: str
    # Trace labels with a second sample of the test prompts (None otherwise).
    kendall_tau_second_sample: float | None = None
    kendall_tau_two_sample_mean: float | None = None
    num_examples_resampled: int | None = None
    resample: str | None = None
    # 95% bootstrap intervals over the test prompts (training/metrics.py tau_interval).
    kendall_tau_ci95: list[float] | None = None
    kendall_tau_dedup_ci95: list[float] | None = None


def latency_ms_per_prompt(model, prompts: Sequence[str], batch_size: int, calls: int) -> float:
    """Median over `calls` timed predict() calls of (call time / batch size), in milliseconds."""
    rng = np.random.default_rng(batch_size)
    model.predict(list(prompts[:batch_size]))  # warm-up: lazy inits, allocator
    per_prompt = []
    for _ in range(calls):
        size = min(batch_size, len(prompts))  # a --limit below the batch size times what there is
        batch = [prompts[i] for i in rng.choice(len(prompts), size=size, replace=False)]
        start = time.perf_counter()
        model.predict(batch)
        per_prompt.append((time.perf_counter() - start) * 1000.0 / size)
    return float(np.median(per_prompt))


def resolve_predictor(spec: str, store: Path | None) -> Path:
    """'champion' is the registered champion; with none registered in the repository's own store
    (a fresh clone), the committed default, as `serve` resolves it. A store named with --store
    must hold a champion: a typo there should not quietly evaluate another model."""
    if spec != "champion":
        if store is not None:  # a typo trap: "the champion of X" would quietly evaluate PATH
            raise ValueError(f"--store names where 'champion' is looked up; it has no effect with "
                             f"--predictor {spec}")
        return Path(spec)
    from training import tracking

    try:
        return tracking.download_champion(store=store)
    except LookupError as exc:  # a fresh clone: nothing trained and registered yet
        # A champion registered but missing is no fresh clone: evaluating the default in its place
        # would report another model's figures as the champion's.
        fresh = not isinstance(exc, tracking.ChampionFilesMissing)
        if fresh and store is None and (DEFAULT_PREDICTOR / SPEC_FILENAME).is_file():
            print(f"eval-predictor: no registered champion ({exc}); evaluating {DEFAULT_PREDICTOR}",
                  file=sys.stderr)
            return DEFAULT_PREDICTOR
        raise ValueError(f"--predictor champion: {exc}; train one with `lengthwise train` "
                         f"or pass --predictor PATH (e.g. data/predictors/default)") from None


def second_sample_figures(prompts: Sequence[str], first: np.ndarray, predictions: list,
                          resample: Path) -> dict:
    """Tau of rank_len against a second sample of the same prompts and against the two samples'
    mean, over the prompts the resample holds."""
    from training.metrics import prediction_metrics
    from training.trace import lengths_by_key, prompt_key

    second = lengths_by_key(resample)
    keys = [prompt_key(prompt) for prompt in prompts]
    rows = [i for i, key in enumerate(keys) if key in second]
    if len(rows) < 2:
        return {}
    again = np.asarray([second[keys[i]] for i in rows], dtype=np.float64)
    chosen = [predictions[i] for i in rows]
    return {"kendall_tau_second_sample": prediction_metrics(again, chosen).kendall_tau,
            "kendall_tau_two_sample_mean": prediction_metrics((first[rows] + again) / 2, chosen).kendall_tau,
            "num_examples_resampled": len(rows), "resample": str(resample)}


def evaluate(predictor_path: Path, labels: str = "sharegpt", limit: int | None = None,
             measure_latency: bool = True, resample: Path | None = None) -> EvaluationReport:
    import predictor
    from predictor.batching import predict_in_batches
    from training import labels as label_data
    from training.metrics import prediction_metrics, tau_interval

    model = predictor.load(predictor_path)  # first: a wrong path fails before the data loads
    test = label_data.subsample(label_data.load_split("test", labels), limit, seed=2)
    if not len(test):
        raise ValueError(f"the {labels} test split holds no rows (a turn table built with `data prepare --limit` "
                         "can leave it empty)")
    predictions = predict_in_batches(model, test.prompts, batch_size=32, progress=True)
    whole = prediction_metrics(test.lengths, predictions, test.censored)
    # Dedup drops the prompts of the train splits the predictor learned from, whichever labels it
    # is scored on: against ShareGPT's alone, a trace-trained one lost 29 trace prompts it never saw.
    keep = ~label_data.seen_in_training(test, model.spec)
    dedup = prediction_metrics(test.lengths[keep], [p for p, k in zip(predictions, keep) if k])
    strict = keep & ~label_data.last_message_seen_in_training(test, model.spec)
    dedup_strict = prediction_metrics(test.lengths[strict], [p for p, k in zip(predictions, strict) if k])
    latency = {size: latency_ms_per_prompt(model, test.prompts, size, calls) if measure_latency else None
               for size, calls in LATENCY_CALLS.items()}
    resampled = second_sample_figures(test.prompts, test.lengths, predictions, resample) if resample else {}
    rank_len = np.asarray([p.rank_len for p in predictions])
    return EvaluationReport(
        kendall_tau=whole.kendall_tau, kendall_tau_dedup=dedup.kendall_tau,
        kendall_tau_dedup_last_message=dedup_strict.kendall_tau,
        kendall_tau_score=whole.kendall_tau_score, spearman=whole.spearman,
        pairwise_accuracy=whole.pairwise_accuracy, mae_log=whole.mae_log, p50_coverage=whole.p50_coverage,
        p90_coverage=whole.p90_coverage, p50_coverage_max=whole.p50_coverage_max,
        p90_coverage_max=whole.p90_coverage_max, num_censored=whole.num_censored,
        latency_ms_p50_batch1=latency[1], latency_ms_p50_batch32=latency[32],
        num_examples=whole.num_examples, num_examples_dedup=dedup.num_examples,
        num_examples_dedup_last_message=dedup_strict.num_examples, kind=model.kind,
        predictor=str(predictor_path), labels=labels, **resampled,
        kendall_tau_ci95=tau_interval(test.lengths, rank_len),
        kendall_tau_dedup_ci95=tau_interval(test.lengths[keep], rank_len[keep]),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--predictor", default="champion",
                        help="saved predictor folder, or 'champion' (the registered one; with none in the "
                             "repository's store, data/predictors/default)")
    parser.add_argument("--labels", choices=LABEL_SOURCES, default="sharegpt")
    parser.add_argument("--limit", type=positive_int, default=None, help="evaluate on a seeded subsample of the test split")
    parser.add_argument("--store", type=named_path, default=None, help="MLflow store folder for 'champion'")
    parser.add_argument("--json", type=named_path, default=None, help="write the report here")
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--resample", default="default", metavar="PARQUET|none",
                        help="with --labels trace: a second sample of the test prompts to score against too "
                             "(default: the committed one)")


def resample_path(args: argparse.Namespace) -> Path | None:
    """The second sample to score against: only for trace labels; the committed one unless told."""
    from training.trace import DEFAULT_RESAMPLE, check_trace_table

    if args.resample == "none":
        return None
    if args.labels != "trace":
        if args.resample == "default":
            return None
        raise ValueError(f"--resample {args.resample}: a second sample of the trace needs --labels trace")
    if args.resample == "default":
        return DEFAULT_RESAMPLE if DEFAULT_RESAMPLE.exists() else None
    path = Path(args.resample)
    if not path.exists():
        raise ValueError(f"--resample {path}: no trace table there")
    check_trace_table(path, "--resample")
    return path


def run(args: argparse.Namespace) -> int:
    from predictor.saved import read_spec
    from training.train_models import limit_torch_threads

    limit_torch_threads()
    if args.json is not None:  # nothing made yet: a bad --json fails before the champion downloads
        check_output_location(args.json, "--json", folder=False)
    path = resolve_predictor(args.predictor, args.store)
    read_spec(path)  # a folder that is no predictor fails here
    resample = resample_path(args)
    if args.json is not None:  # before minutes of evaluation, not after
        prepare_output_file(args.json, "--json")
    report = evaluate(path, args.labels, args.limit, not args.no_latency, resample)
    # A metric undefined on a tiny subset (a constant ranking) is NaN, which JSON has no word for.
    fields = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(report).items()}
    text = json.dumps(fields, indent=2, allow_nan=False)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0
