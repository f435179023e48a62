"""Replay a `lengthwise bench serve` workload through the engine alone, once per policy, step by step.

Same prompts, arrival offsets, max_tokens and temperature as `bench serve` uses (with --ignore-eos), fed
to `LLMEngine` in-process at their arrival times: no HTTP, no client on the same cores. Every step's
composition and wall time goes to a JSONL file per policy, so a throughput difference between
policies can be split into "different steps" and "the same steps, slower". Prints per policy:
output tokens/s, mean / p50 / p99 end-to-end latency, steps, and mean step time.

    python scripts/replay_engine.py --policies fcfs,sjf --out-dir out/replay_engine -- \
        --num-prompts 200 --request-rate 1 --seed 0 --ignore-eos --max-output-tokens 512 --max-model-len 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def replay(policy: str, items: list, starts: list[float], predictions: list, temperature: float,
           out: Path) -> dict:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.request import SamplingParams, Tier

    engine = LLMEngine(EngineConfig(policy=policy))
    pending = sorted(range(len(items)), key=lambda i: starts[i])
    arrival, finished = {}, {}
    steps = []
    origin = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - origin
        while pending and starts[pending[0]] <= now:
            i = pending.pop(0)
            item = items[i]
            params = SamplingParams(max_tokens=item.max_tokens, temperature=temperature, seed=i, ignore_eos=True)
            engine.add_request(str(i), item.prompt, params, tier=Tier[item.tier.upper()], prediction=predictions[i])
            arrival[i] = now
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, starts[pending[0]] - now))
            continue
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = (time.perf_counter() - origin, len(output.token_ids))
        steps.append({"t": time.perf_counter() - origin, **dataclasses.asdict(engine.last_step),
                      "waiting": engine.stats().scheduler.num_waiting})
    duration = time.perf_counter() - origin
    out.write_text("".join(json.dumps(s) + "\n" for s in steps))
    e2e = [finished[i][0] - arrival[i] for i in finished]
    p50, p99 = np.percentile(e2e, [50, 99])  # as bench serve's figures beside these are taken
    return {"policy": policy, "completed": len(finished), "duration_s": duration,
            "output_tokens_per_s": sum(n for _, n in finished.values()) / duration,
            "mean_e2e_s": statistics.fmean(e2e), "p50_e2e_s": float(p50), "p99_e2e_s": float(p99),
            "num_steps": len(steps), "mean_step_s": statistics.fmean(s["step_time_s"] for s in steps)}


def main(argv: list[str]) -> None:
    import predictor
    from engine.arg_types import policy_list, prepare_output_dir
    from engine.config import DEFAULT_PREDICTOR, REPO_ROOT
    from predictor.saved import read_spec
    from training import bench_serve

    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--policies", type=policy_list, default="fcfs,sjf")  # checked before any model loads
    parser.add_argument("--predictor", default=str(DEFAULT_PREDICTOR))
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "out" / "replay_engine")
    args = parser.parse_args(argv[:split])
    bench_parser = argparse.ArgumentParser()
    bench_serve.add_arguments(bench_parser)
    bench_args = bench_parser.parse_args(argv[split + 1:])
    # What the replay cannot reproduce is refused, not dropped: every reply runs to its max_tokens,
    # as bench serve's do only under --ignore-eos, and arrivals are never held back for a slot.
    if not bench_args.ignore_eos:
        parser.error("the replay runs each reply to its max_tokens, as bench serve does only with "
                     "--ignore-eos: pass it after --")
    if bench_args.max_concurrency is not None:
        parser.error("--max-concurrency: the replay feeds every request at its arrival time")
    try:  # bad input found once it runs: one line, before the predictions and the replays
        read_spec(args.predictor)
        items = bench_serve.sample_workload(bench_args)
        prepare_output_dir(args.out_dir, "--out-dir")
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    starts = bench_serve.arrival_offsets(len(items), bench_args.request_rate, bench_args.burstiness,
                                         bench_args.seed)
    predictions = predictor.load(args.predictor).predict([item.prompt for item in items])
    summaries = []
    for policy in args.policies:
        summary = replay(policy, items, starts, predictions, bench_args.temperature,
                         args.out_dir / f"{policy}_steps.jsonl")
        print(json.dumps(summary), flush=True)
        summaries.append(summary)
    (args.out_dir / "summary.json").write_text(json.dumps(summaries, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
