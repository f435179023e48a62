"""Summaries of a serving benchmark: latency statistics, goodput, a plot and the MLflow record.

Per request the load generator measures TTFT (send to the first chunk with choices, empty text
included, as `vllm bench serve` counts it: an end-of-sequence token streams as one), the gaps between
such chunks (inter-token latency, ITL), end-to-end latency (send to the last such chunk, just before
`[DONE]`) and the output tokens reported by the server's `usage`. TPOT of a request is
(e2e - ttft) / (output tokens - 1), as in `vllm bench serve`. Goodput counts completed requests per
second that meet every SLO given with `--goodput` (ttft, tpot, e2el; milliseconds).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training import strict_json

EXPERIMENT = "lengthwise-bench-serve"
SLO_KEYS = ("ttft", "tpot", "e2el")
TIER_TO_SERVICE_TIER = {"interactive": "priority", "standard": "default", "batch": "flex"}


@dataclass
class RequestResult:
    index: int
    tier: str
    prompt_tokens: int
    max_tokens: int
    start_s: float  # send time since the benchmark began
    success: bool = False
    status: int | None = None  # HTTP status; None when no response came
    error: str = ""
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def parse_tier_mix(text: str | None) -> dict[str, float]:
    if not text:
        return {"standard": 1.0}
    mix = {}
    for part in text.split(","):
        tier, _, share = part.partition(":")
        try:
            value = float(share)
        except ValueError:
            value = math.nan
        if tier not in TIER_TO_SERVICE_TIER or math.isnan(value):
            raise ValueError(f"a tier mix is TIER:SHARE,... with TIER one of {', '.join(TIER_TO_SERVICE_TIER)} "
                             f"and SHARE a number, got {part!r}")
        mix[tier] = value
    if not all(math.isfinite(v) and v >= 0 for v in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"tier shares must be >= 0 with a positive sum, got {text!r}")
    return mix


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:2000', 'e2el:30000'] -> {'ttft': 2.0, 'e2el': 30.0} in seconds."""
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        try:
            limit_ms = float(value)
        except ValueError:
            limit_ms = math.nan
        if key not in SLO_KEYS or not (math.isfinite(limit_ms) and limit_ms > 0):
            raise ValueError(f"an SLO is KEY:MS with KEY one of {', '.join(SLO_KEYS)} and MS a positive number "
                             f"of milliseconds, got {item!r}")
        if key in slos:
            raise ValueError(f"--goodput gives {key} twice")
        slos[key] = limit_ms / 1000.0
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2e_s}
    for key, limit in slos.items():
        value = measured[key]
        # A one-token reply has no TPOT; it cannot break a TPOT target.
        if value is None and key == "tpot":
            continue
        if value is None or value > limit:
            return False
    return result.success


def _stats(prefix: str, values: list[float]) -> dict[str, float | None]:
    keys = ("mean", "p50", "p90", "p99")
    if not values:
        return {f"{k}_{prefix}_s": None for k in keys}
    array = np.asarray(values, dtype=float)
    numbers = (array.mean(), *np.percentile(array, [50, 90, 99]))
    return {f"{k}_{prefix}_s": float(v) for k, v in zip(keys, numbers)}


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float]) -> dict[str, Any]:
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    span = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "rejected_429": sum(r.status == 429 for r in results),
        "no_response": sum(r.status is None and not r.success for r in results),
        "duration_s": duration_s,
        "request_throughput_rps": len(done) / span,
        "output_tokens_per_s": output_tokens / span,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / span,
        "total_output_tokens": output_tokens,
        "goodput_rps": sum(meets_slos(r, slos) for r in done) / span if slos else None,
        "goodput_slos_ms": {k: v * 1000.0 for k, v in slos.items()},
    }
    summary.update(_stats("e2e", [r.e2e_s for r in done]))
    summary.update(_stats("ttft", [r.ttft_s for r in done if r.ttft_s is not None]))
    summary.update(_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None]))
    summary.update(_stats("itl", [gap for r in done for gap in r.itl_s]))
    tiers = sorted({r.tier for r in results})
    if len(tiers) > 1:
        summary["per_tier"] = {tier: summarize([r for r in results if r.tier == tier], duration_s, slos)
                               for tier in tiers}
    errors = sorted({r.error for r in results if r.error})
    summary["errors"] = errors[:20]
    return summary


def print_summary(summary: dict[str, Any], label: str) -> None:
    print(f"==== serving benchmark: {label} ====")
    for key in ("completed", "failed", "rejected_429", "no_response", "short_outputs", "server_preemptions",
                "duration_s", "offered_request_rate_rps", "request_throughput_rps",
                "output_tokens_per_s", "goodput_rps", "mean_e2e_s", "p50_e2e_s", "p99_e2e_s",
                "mean_ttft_s", "p99_ttft_s", "mean_tpot_s", "p99_tpot_s", "mean_itl_s", "p99_itl_s"):
        if key not in summary:
            continue  # short_outputs only with --ignore-eos, server_preemptions only from this server
        value = summary.get(key)
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")
    for error in summary.get("errors", []):
        print(f"{'error':>24}: {error}")


def write_json(path: Path, summary: dict[str, Any], config: dict[str, Any],
               results: list[RequestResult]) -> None:
    # An unbounded rate (or burstiness) as vLLM writes it, "inf": strict JSON has no Infinity.
    config = {**config, **{key: "inf" for key in ("request_rate", "burstiness") if config.get(key) == math.inf}}
    payload = {**summary, "config": config, "requests": [asdict(r) for r in results]}
    path.write_text(strict_json.dumps(payload, indent=2) + "\n")


def plot(path: Path, results: list[RequestResult], label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    fig, (ax_cdf, ax_scatter) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in (("end-to-end", [r.e2e_s for r in done]),
                         ("TTFT", [r.ttft_s for r in done if r.ttft_s is not None])):
        if values:
            ordered = np.sort(values)
            ax_cdf.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=name)
    ax_cdf.set(xlabel="latency (s)", ylabel="share of requests", title=f"latency CDF: {label}")
    if done:  # no request answered: an empty plot, without a legend of nothing
        ax_cdf.legend()
    for tier in sorted({r.tier for r in done}):
        points = [(r.output_tokens, r.e2e_s) for r in done if r.tier == tier]
        ax_scatter.scatter(*zip(*points), s=8, label=tier)
    ax_scatter.set(xlabel="output tokens", ylabel="end-to-end latency (s)", title="latency by length")
    if done:
        ax_scatter.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def log_to_mlflow(summary: dict[str, Any], config: dict[str, Any], artifacts: list[Path], label: str) -> str:
    """Record the run under the bench-serve experiment; returns the run id."""
    import mlflow

    from training.tracking import tracking_session

    # The shared session puts the artifacts under mlruns/artifacts, as the training runs' are.
    with tracking_session(experiment=EXPERIMENT), mlflow.start_run(run_name=label) as run:
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})
        numbers = {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and v is not None}
        ratios = summary.get("comparison", {}).get("ratios", {})
        numbers.update({f"vs_baseline_{k}": float(v) for k, v in ratios.items() if v is not None})
        mlflow.log_metrics(numbers)
        for path in artifacts:
            mlflow.log_artifact(str(path))
        return run.info.run_id
