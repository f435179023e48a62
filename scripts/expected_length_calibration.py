"""How well a predictor's lengths add up: the mean over test prompts of its point estimate, its p50
and the capped lognormal mean through p50 and p90 (what admission counts as token work), against
the mean true length, each capped at max_tokens. Token work is a sum, so the estimate whose mean
is nearest the true mean counts it best. Uses the simulator's workload and prediction cache.

    python scripts/expected_length_calibration.py [--predictor data/predictors/default]
        [--num-requests 2000] [--caps 256,512,1024] [--json out/expected_length.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.arg_types import positive_int, prepare_output_file_or_exit  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402
from training.sim_workload import Predicted, load_test_turns, predictor_predictions  # noqa: E402


def positive_ints(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",")]


def as_request(prediction: Predicted, cap: int) -> Request:
    """A request carrying the prediction as the simulator builds one (`build_workload`), so the
    estimates below are the ones admission reads."""
    return Request("r", [0], SamplingParams(max_tokens=cap), arrival_time=0.0,
                   predicted_len=max(1.0, prediction.point), predicted_p50=max(1.0, prediction.p50),
                   predicted_p90=max(1.0, prediction.p90))


def calibration(predictor: Path, num_requests: int, caps: list[int], seed: int) -> dict:
    turns = load_test_turns(num_requests, seed, max_prompt_tokens=1024, max_output_tokens=max(caps))
    predictions = predictor_predictions(turns, predictor)
    by_cap = {}
    for cap in caps:
        true_mean = statistics.fmean(min(t.output_tokens, cap) for t in turns)
        requests = [as_request(p, cap) for p in predictions]
        estimates = {
            "point": statistics.fmean(r.predicted_total for r in requests),
            "p50": statistics.fmean(r.sampling_params.clamp_length(r.predicted_p50) for r in requests),
            "capped_lognormal_mean": statistics.fmean(r.predicted_mean for r in requests),
        }
        by_cap[str(cap)] = {"true_mean": true_mean,
                            "mean": estimates,
                            "ratio_to_true": {name: value / true_mean for name, value in estimates.items()}}
    return {"predictor": str(predictor), "num_requests": len(turns), "seed": seed, "by_max_tokens": by_cap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predictor", type=Path, default=Path("data/predictors/default"))
    parser.add_argument("--num-requests", type=positive_int, default=2000)
    parser.add_argument("--caps", type=positive_ints, default=[256, 512, 1024])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not args.predictor.is_dir():
        parser.error(f"--predictor {args.predictor}: no such predictor folder")
    prepare_output_file_or_exit(parser, args.json, "--json")
    result = calibration(args.predictor, args.num_requests, args.caps, args.seed)
    for cap, row in result["by_max_tokens"].items():
        ratios = ", ".join(f"{name} {ratio:.3f}" for name, ratio in row["ratio_to_true"].items())
        print(f"max_tokens {cap}: true mean {row['true_mean']:.1f}; estimate / true: {ratios}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
