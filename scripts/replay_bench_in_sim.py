"""Replay a `lengthwise bench serve` run in the simulator: same prompts, arrival times and max_tokens.

It checks the simulator against the real server. Pass the bench arguments the run used; the
arrival times come from the fcfs run's JSON (every policy's run used the same seed). Prints
simulated and measured mean / p50 / p99 end-to-end latency per policy. Without a measured fcfs
run in --result-dir, arrivals are drawn as `bench serve` draws them, to try a workload before
spending server time on it; extra simulator flags (e.g. --max-num-seqs 16) go in --sim-args.

    python scripts/replay_bench_in_sim.py --result-dir out/bench_serve -- --num-prompts 200 \
        --request-rate 1 --seed 0 --ignore-eos --max-output-tokens 512 --max-model-len 1024
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path


def main(argv: list[str]) -> None:
    from scheduler.request import Tier
    from scheduler.simulation import simulate
    from training import bench_serve, simulate as sim
    from training.sim_metrics import summarize
    from training.sim_workload import REPO_ROOT, Turn, build_workload, predictor_predictions

    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--result-dir", type=Path, default=REPO_ROOT / "out" / "bench_serve")
    parser.add_argument("--predictor", type=Path, default=sim.DEFAULT_PREDICTOR)
    parser.add_argument("--sim-args", default="", help="simulator flags, one quoted string")
    args = parser.parse_args(argv[:split])
    bench_parser = argparse.ArgumentParser()
    bench_serve.add_arguments(bench_parser)
    bench_args = bench_parser.parse_args(argv[split + 1:])
    items = bench_serve.sample_workload(bench_args)
    real = {p.stem: json.loads(p.read_text()) for p in args.result_dir.glob("*.json")}
    starts = ({r["index"]: r["start_s"] for r in real["fcfs"]["requests"]} if "fcfs" in real else
              dict(enumerate(bench_serve.arrival_offsets(len(items), bench_args.request_rate,
                                                         bench_args.burstiness, bench_args.seed))))
    # The true length is max_tokens: the bench runs with --ignore-eos, and sends it as the cap.
    turns = [Turn(item.prompt, item.prompt_tokens, item.max_tokens) for item in items]
    workload = build_workload(turns, predictor_predictions(turns, args.predictor),
                              [starts[item.index] for item in items], [Tier.STANDARD] * len(items),
                              max_tokens=None)
    sim_parser = argparse.ArgumentParser()
    sim.add_arguments(sim_parser)
    sim_args = sim_parser.parse_args(args.sim_args.split())
    cost, _, calibration = sim.load_cost_model(sim_args.step_cost)
    config = replace(sim.scheduler_config(sim_args, calibration), max_model_len=bench_args.max_model_len)
    print(f"{len(items)} requests, {sum(item.max_tokens for item in items)} output tokens")
    for name in ("fcfs", "sjf", "oracle"):
        s = summarize(simulate(replace(config, policy=name), workload, cost))
        line = (f"{name:7s} sim mean {s['mean_e2e_s']:.1f} p50 {s['p50_e2e_s']:.1f} p99 {s['p99_e2e_s']:.1f}"
                f" tok/s {s['output_tokens_per_s']:.1f}")
        if name in real:
            r = real[name]
            line += f" | real mean {r['mean_e2e_s']:.1f} p50 {r['p50_e2e_s']:.1f} p99 {r['p99_e2e_s']:.1f}"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
