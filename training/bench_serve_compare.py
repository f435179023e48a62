"""A serving benchmark run against a baseline run (`lengthwise bench serve --baseline RUN.json`).

The issue's figure compares one server build run with `--policy fcfs` and with `--policy sjf`; the
server is external, so the two runs are two commands, and the second reads the first's JSON. Two
runs compare only if they offered the same work (the workload flags below) and if the same
requests got full answers: a policy that turns more requests away with 429, or loses some, would
otherwise look faster by serving less. Such a pair still gets its ratios, marked not comparable,
with every reason.

Ratios read "how many times better than the baseline": baseline / this for latencies, this /
baseline for throughputs, so above 1 means this run did better. FCFS as the baseline and sjf as
this run gives the issue's FCFS / sjf.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from training.bench_serve_report import parse_goodput, parse_tier_mix

# The flags that choose the prompts, their arrival times, their caps and how they are sampled,
# and the SLOs that goodput counts against.
WORKLOAD_KEYS = ("model", "num_prompts", "request_rate", "burstiness", "seed", "split", "tier_mix",
                 "ignore_eos", "max_output_tokens", "max_model_len", "temperature", "max_concurrency", "goodput")
LATENCY_KEYS = ("mean_e2e_s", "p50_e2e_s", "p99_e2e_s", "mean_ttft_s", "p99_ttft_s")
THROUGHPUT_KEYS = ("output_tokens_per_s", "goodput_rps")


def load_baseline(path: Path) -> dict[str, Any]:
    """An earlier run's JSON; ValueError (a one-line reason) unless it is one."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--baseline {path}: not a readable bench serve JSON ({exc})") from None
    if not isinstance(payload, dict) or not {"config", "requests"} <= payload.keys():
        raise ValueError(f"--baseline {path}: not a bench serve result (no config or requests)")
    problem = _malformed(payload)
    if problem:  # found now, not in the comparison after a load of many minutes
        raise ValueError(f"--baseline {path}: not a bench serve result ({problem})")
    return payload


def _malformed(payload: dict[str, Any]) -> str | None:
    """What in a result the comparison could not read, or None."""
    if not isinstance(payload["config"], dict):
        return "its config is not an object"
    requests = payload["requests"]
    if not isinstance(requests, list) or not all(
            isinstance(r, dict) and _is_int(r.get("index")) and isinstance(r.get("success"), bool)
            and (r.get("output_tokens") is None or _is_int(r["output_tokens"])) for r in requests):
        return "its requests are not a list of {index, success, output_tokens}"
    for key in LATENCY_KEYS + THROUGHPUT_KEYS:
        value = payload.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{key} is {value!r}, not a number"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def answered(requests: list[dict]) -> set[int]:
    return {request["index"] for request in requests if request.get("success")}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def mismatches(baseline: dict[str, Any], summary: dict[str, Any], config: dict[str, Any],
               requests: list[dict]) -> list[str]:
    """Why the two runs are not the same experiment; empty when they are."""
    base_config = baseline["config"]
    reasons = [f"{key}: baseline {base_config.get(key)!r}, this run {config.get(key)!r}" for key in WORKLOAD_KEYS
               if as_compared(key, base_config.get(key)) != as_compared(key, config.get(key))]
    reasons += [f"{key}: baseline {baseline.get(key)}, this run {summary.get(key)}"
                for key in ("rejected_429", "failed") if baseline.get(key) != summary.get(key)]
    base_answered, this_answered = answered(baseline["requests"]), answered(requests)
    if base_answered != this_answered:
        reasons.append(f"answered requests differ: {len(base_answered - this_answered)} only in the baseline, "
                       f"{len(this_answered - base_answered)} only in this run")
    # With ignore_eos every full answer is its max_tokens long, so a length that differs is a
    # short answer in one run: not the same work. Replies that stop on their own may end
    # elsewhere in each run (a batch's float sums change a near tie), which says nothing of that.
    if config.get("ignore_eos") and base_config.get("ignore_eos"):
        differ = _output_tokens_differ(baseline["requests"], requests, base_answered & this_answered)
        if differ:
            reasons.append(f"output tokens differ on {differ} requests answered in both")
    return reasons


def _output_tokens_differ(baseline: list[dict], this: list[dict], both: set[int]) -> int:
    """Requests answered in both runs whose replies have another length (a baseline written
    before its requests recorded their lengths has none to compare)."""
    base_tokens = {r["index"]: r.get("output_tokens") for r in baseline}
    return sum(1 for r in this if r["index"] in both and None not in (base_tokens[r["index"]], r.get("output_tokens"))
               and base_tokens[r["index"]] != r["output_tokens"])


def as_compared(key: str, value: Any) -> Any:
    """A workload flag as two runs compare it: the SLOs as parsed, whatever their order or spelling
    (ttft:2000 e2el:30000 is e2el:30000 ttft:2000.0), and an unbounded rate however its JSON wrote
    it (vLLM's "inf", or the Infinity of runs before session 32), an unbounded burstiness too, and a
    tier mix as parsed."""
    if key == "goodput":
        try:
            return parse_goodput(value)
        except ValueError:
            return value
    if key in ("request_rate", "burstiness") and value in ("inf", math.inf):
        return math.inf
    if key == "tier_mix":  # unset is standard:1; the order stays (it decides each request's tier)
        try:
            return list(parse_tier_mix(value).items())
        except ValueError:
            return value
    return value


def compare(summary: dict[str, Any], config: dict[str, Any], requests: list[dict],
            baseline: dict[str, Any], baseline_path: Path) -> dict[str, Any]:
    """The `comparison` entry of this run's JSON."""
    reasons = mismatches(baseline, summary, config, requests)
    ratios = {f"{key}_baseline_over_this": _ratio(baseline.get(key), summary.get(key)) for key in LATENCY_KEYS}
    ratios.update({f"{key}_this_over_baseline": _ratio(summary.get(key), baseline.get(key))
                   for key in THROUGHPUT_KEYS})
    return {"baseline": str(baseline_path), "baseline_label": baseline["config"].get("label"),
            "comparable": not reasons, "not_comparable_reasons": reasons, "ratios": ratios}


def print_comparison(comparison: dict[str, Any]) -> None:
    print(f"==== against the baseline {comparison['baseline_label'] or comparison['baseline']} ====")
    for key, value in comparison["ratios"].items():
        print(f"{key:>40}: {value:.4g}" if value is not None else f"{key:>40}: -")
    if comparison["comparable"]:
        print(f"{'comparable':>40}: yes (same workload, same requests answered)")
    for reason in comparison["not_comparable_reasons"]:
        print(f"{'NOT COMPARABLE':>40}: {reason}")
