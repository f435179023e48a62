"""The stability margin against the offered load, in the simulator under FCFS.

Runs `lengthwise simulate`'s workload (ShareGPT test turns, the calibrated step cost, the same
scheduler defaults) at each load and samples the admission controller's margin every 64 steps while
requests still arrive (after the last arrival the window's rate decays and says nothing about the
load). A margin that tracks the load should read below 1 on a stable queue and above 1 on a growing
one. Writes the quantiles per load as JSON.

    python scripts/margin_vs_load.py [--loads 0.5,0.7,0.9,1.0,1.3] [--num-requests 1000]
        [--predictions noisy-oracle] [--json out/margin_vs_load.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.arg_types import positive_float_list  # noqa: E402
from scheduler.admission import AdmissionController  # noqa: E402
from scheduler.simulation import simulate  # noqa: E402
from training import simulate as sim_cli  # noqa: E402
from training.sim_workload import arrival_times  # noqa: E402


def margin_samples(config, workload, cost, last_arrival: float) -> list[float]:
    """The margins the simulator samples (every 64 steps) up to the last arrival."""
    samples: list[float] = []
    measure = AdmissionController.stability_margin

    def recording(controller: AdmissionController, now: float) -> float | None:
        value = measure(controller, now)
        if value is not None and now <= last_arrival:
            samples.append(value)
        return value

    AdmissionController.stability_margin = recording  # type: ignore[method-assign]
    try:
        simulate(replace(config, policy="fcfs"), workload, cost)
    finally:
        AdmissionController.stability_margin = measure  # type: ignore[method-assign]
    return samples


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sim_cli.add_arguments(parser)
    parser.add_argument("--loads", type=positive_float_list, default=[0.5, 0.7, 0.9, 1.0, 1.3])
    parser.set_defaults(predictions="noisy-oracle", num_requests=1000, json=Path("out/margin_vs_load.json"))
    args = parser.parse_args(argv)
    cost, cost_source, calibration = sim_cli.load_cost_model(args.step_cost)
    config = sim_cli.scheduler_config(args, calibration)
    base, source = sim_cli.build_base_workload(args)
    saturated = sim_cli.saturated_throughput(config, base, cost)
    report = {"predictions": source, "cost_model": cost_source, "num_requests": len(base), "loads": []}
    for load in args.loads:
        rate = load * saturated / statistics.mean(r.output_tokens for r in base)
        times = arrival_times(len(base), rate, args.arrival, args.arrival_cv, args.seed)
        workload = [replace(r, arrival_time=t) for r, t in zip(base, times)]
        samples = margin_samples(config, workload, cost, max(times))
        entry = {"load": load, "num_samples": len(samples), "median": statistics.median(samples),
                 "p10": quantile(samples, 0.1), "p90": quantile(samples, 0.9), "max": max(samples)}
        report["loads"].append(entry)
        print(json.dumps(entry))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
