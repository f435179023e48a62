"""The stability margin against the offered load, in the simulator under FCFS.

Runs `lengthwise simulate`'s workload (ShareGPT test turns, the calibrated step cost, the same
scheduler defaults) at each load and takes the margins the simulator samples every 64 steps while
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

from engine.arg_types import positive_float_list, prepare_output_file  # noqa: E402
from engine.config import REPO_ROOT  # noqa: E402
from scheduler.simulation import simulate  # noqa: E402
from training import simulate as sim_cli  # noqa: E402
from training.sim_workload import arrival_times  # noqa: E402

# simulate's flags this script decides itself: it runs FCFS at --loads and reports no latencies,
# so the knobs of the length policies (aging, srpt, goodput) would change nothing.
NOT_HONOURED = ("--policies", "--load", "--sweep-loads", "--no-plots", "--aging-tokens-per-step",
                "--aging-tokens-per-s", "--srpt-max-preempt-share", "--goodput-urgent-slack")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def margin_summary(load: float, samples: list[float]) -> dict:
    if not samples:  # a run too short for a sample (one every 64 steps) before its last arrival
        return {"load": load, "num_samples": 0}
    return {"load": load, "num_samples": len(samples), "median": statistics.median(samples),
            "p10": quantile(samples, 0.1), "p90": quantile(samples, 0.9), "max": max(samples)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sim_cli.add_arguments(parser)
    parser.add_argument("--loads", type=positive_float_list, default=[0.5, 0.7, 0.9, 1.0, 1.3])
    parser.set_defaults(predictions="noisy-oracle", num_requests=1000, json=REPO_ROOT / "out" / "margin_vs_load.json")
    ignored = [flag for flag in NOT_HONOURED if any(a == flag or a.startswith(flag + "=") for a in argv)]
    if ignored:
        parser.error(f"{', '.join(ignored)}: not used here (FCFS at each of --loads)")
    args = parser.parse_args(argv)
    try:  # bad input found once it runs (no step-cost file, no predictor there): one line
        cost, cost_source, calibration = sim_cli.load_cost_model(args.step_cost)
        config = replace(sim_cli.scheduler_config(args, calibration), policy="fcfs")
        sim_cli.arrival_cv_of(args)
        prepare_output_file(args.json, "--json")
        base, source = sim_cli.build_base_workload(args, sim_cli.load_workload_turns(args))
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    saturated = sim_cli.saturated_throughput(config, base, cost)
    report = {"predictions": source, "cost_model": cost_source, "num_requests": len(base), "loads": []}
    for load in args.loads:
        rate = load * saturated / statistics.mean(r.output_tokens for r in base)
        times = arrival_times(len(base), rate, args.arrival, sim_cli.arrival_cv_of(args), args.seed)
        result = simulate(config, [replace(r, arrival_time=t) for r, t in zip(base, times)], cost)
        # While requests still arrive: afterwards the window's rate decays and says nothing.
        samples = [margin for now, margin in result.stability_margins if now <= max(times)]
        report["loads"].append(margin_summary(load, samples))
        print(json.dumps(report["loads"][-1]))
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
