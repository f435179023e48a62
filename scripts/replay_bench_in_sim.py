"""Replay a `lengthwise bench serve` run in the simulator: same prompts, arrival times and max_tokens.

It checks the simulator against the real server. Pass the bench arguments the run used; the
arrival times come from the fcfs run's JSON (every policy's run used the same seed). Prints
simulated and measured mean / p50 / p99 end-to-end latency per policy. Without a measured fcfs
run in the default --result-dir, arrivals are drawn as `bench serve` draws them, to try a workload
before spending server time on it (a --result-dir given must be a folder); the first line says which
arrivals were replayed; simulator flags for the server (e.g. --max-num-seqs 16) go in --sim-args.
It always replays fcfs, sjf and oracle on the bench's workload, so --sim-args refuses the
simulator's workload, policy and report flags (--policies, --load, --num-requests, ...).

    python scripts/replay_bench_in_sim.py --result-dir out/bench_serve -- --num-prompts 200 \
        --request-rate 1 --seed 0 --ignore-eos --max-output-tokens 512 --max-model-len 1024
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path


# The simulator flags a replay honours: the server's configuration. The rest describe simulate's
# own workload (requests, arrivals, tiers, predictions), policies or report, which a replay takes
# from the bench run or fixes, and --max-prompt-tokens/--max-output-tokens, whose sum the bench's
# --max-model-len replaces.
# The scheduler's knobs (engine/scheduler_args.py) are all server configuration.
SERVER_FLAGS = frozenset({"step_cost", "kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                          "preemption_mode", "admission"})
# bench_serve_compare's WORKLOAD_KEYS that no replay depends on; every other one (a key added
# there too) is a bench argument the replayed prompts, caps and arrival times come from, which a
# measured run's JSON must record as given.
NOT_REPLAYED = frozenset({"model", "ignore_eos", "temperature", "max_concurrency", "goodput"})


def parse_sim_args(text: str) -> argparse.Namespace:
    """The simulator's arguments from one string; exit 2 with one line naming any flag the replay
    would otherwise ignore."""
    from training import simulate as sim

    parser = argparse.ArgumentParser(prog="replay_bench_in_sim.py --sim-args", allow_abbrev=False)
    sim.add_arguments(parser)
    tokens = shlex.split(text)
    args = parser.parse_args(tokens)
    names = {token.split("=", 1)[0] for token in tokens if token.startswith("-")}
    from engine.scheduler_args import KNOBS, scheduler_options

    honoured = SERVER_FLAGS | {knob.field for knob in KNOBS}
    ignored = sorted(option for action in parser._actions if action.dest not in honoured
                     for option in action.option_strings if option in names)
    if ignored:
        print(f"replay_bench_in_sim.py: error: --sim-args {' '.join(ignored)}: not honoured by a replay "
              f"(it replays fcfs, sjf and oracle on the bench's workload; --predictor is the script's own)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        scheduler_options(args)  # an admission knob without --admission: refused before the workload
    except ValueError as exc:
        print(f"replay_bench_in_sim.py: error: --sim-args {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return args


def main(argv: list[str]) -> None:
    from scheduler.request import Tier
    from scheduler.simulation import simulate
    from training import bench_serve, simulate as sim
    from training.sim_metrics import summarize
    from engine.config import REPO_ROOT
    from training.sim_workload import Turn, build_workload, predictor_predictions

    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--result-dir", type=Path, default=None,
                        help="bench serve's --result-dir (default out/bench_serve, where one may be missing)")
    parser.add_argument("--predictor", type=Path, default=sim.DEFAULT_PREDICTOR)
    parser.add_argument("--sim-args", default="", help="simulator flags, one quoted string")
    args = parser.parse_args(argv[:split])
    sim_args = parse_sim_args(args.sim_args)  # before the workload loads
    cost, _, calibration = sim.load_cost_model(sim_args.step_cost)
    bench_parser = argparse.ArgumentParser()
    bench_serve.add_arguments(bench_parser)
    bench_args = bench_parser.parse_args(argv[split + 1:])
    if not bench_args.ignore_eos:
        raise ValueError("the replay takes each reply's length to be its max_tokens, which holds only "
                         "for a bench run with --ignore-eos: pass it after --")
    result_dir = measured_runs_folder(args.result_dir, REPO_ROOT / "out" / "bench_serve")
    real = {p.stem: json.loads(p.read_text()) for p in result_dir.glob("*.json")}
    check_same_workload(real, bench_args)  # before the workload loads
    items = bench_serve.sample_workload(bench_args)
    starts = ({r["index"]: r["start_s"] for r in real["fcfs"]["requests"]} if "fcfs" in real else
              dict(enumerate(bench_serve.arrival_offsets(len(items), bench_args.request_rate,
                                                         bench_args.burstiness, bench_args.seed))))
    # The true length is max_tokens: the bench runs with --ignore-eos, and sends it as the cap.
    turns = [Turn(item.prompt, item.prompt_tokens, item.max_tokens) for item in items]
    workload = build_workload(turns, predictor_predictions(turns, args.predictor),
                              [starts[item.index] for item in items], [Tier[item.tier.upper()] for item in items],
                              max_tokens=None)
    config = replace(sim.scheduler_config(sim_args, calibration), max_model_len=bench_args.max_model_len)
    print(f"{len(items)} requests, {sum(item.max_tokens for item in items)} output tokens, arrivals "
          + (f"measured in {result_dir / 'fcfs.json'}" if "fcfs" in real else
             f"drawn as bench serve draws them (no fcfs.json in {result_dir})"))
    print(ranking_taus(workload))
    # sjf once more with every request capped at --max-output-tokens, as a client that does not
    # know its reply's length sends it: the order then comes from the prediction alone.
    # Without --max-output-tokens such a client can ask at most for the rest of the context.
    capped = [replace(r, max_tokens=bench_args.max_output_tokens or bench_args.max_model_len - r.prompt_tokens)
              for r in workload]
    runs = (("fcfs", "fcfs", workload), ("sjf", "sjf", workload), ("oracle", "oracle", workload),
            ("sjf, prediction alone", "sjf", capped))
    for label, name, requests in runs:
        s = summarize(simulate(replace(config, policy=name), requests, cost))
        line = (f"{label:21s} sim mean {s['mean_e2e_s']:.1f} p50 {s['p50_e2e_s']:.1f} p99 {s['p99_e2e_s']:.1f}"
                f" tok/s {s['output_tokens_per_s']:.1f}")
        if label in real:
            r = real[label]
            line += f" | real mean {r['mean_e2e_s']:.1f} p50 {r['p50_e2e_s']:.1f} p99 {r['p99_e2e_s']:.1f}"
        print(line)


def measured_runs_folder(given: Path | None, default: Path) -> Path:
    """The folder of measured runs. One given must exist: a mistyped path would otherwise replay
    drawn arrivals as if no run had been measured, and print no measured figures beside them."""
    if given is not None and not given.is_dir():
        raise ValueError(f"--result-dir {given}: no such folder")
    return default if given is None else given


def check_same_workload(real: dict, bench_args: argparse.Namespace) -> None:
    """The measured runs must have been made with the bench arguments given: else the replay would
    print their figures beside another workload's (or miss an index of theirs)."""
    from training.bench_serve_compare import WORKLOAD_KEYS, as_compared

    replayed = [key for key in WORKLOAD_KEYS if key not in NOT_REPLAYED]
    for label, run in real.items():
        config = run.get("config", {})
        differ = [f"--{k.replace('_', '-')} {config[k]} (given {getattr(bench_args, k)})" for k in replayed
                  if k in config and as_compared(k, config[k]) != as_compared(k, getattr(bench_args, k))]
        if differ:
            raise ValueError(f"{label}.json was measured with {', '.join(differ)}: "
                             "pass its bench arguments after --")


def ranking_taus(workload) -> str:
    """Kendall's tau against the true lengths of sjf's key and of the prediction alone. With
    --ignore-eos each max_tokens is the true length, and the key, the prediction clamped to it,
    carries that knowledge: the replay then measures the ordering near its best, not the predictor."""
    from scipy import stats

    from scheduler.policies import ranking_length

    true = [r.output_tokens for r in workload]
    key = [ranking_length(r.to_request()) for r in workload]
    alone = [r.predicted_rank_len if r.predicted_rank_len is not None else r.predicted_len for r in workload]
    return (f"Kendall's tau against the true lengths: sjf's key (prediction clamped to max_tokens) "
            f"{stats.kendalltau(key, true).statistic:.3f}, the prediction alone "
            f"{stats.kendalltau(alone, true).statistic:.3f}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError) as exc:  # a bad path or file: one line, as the lengthwise CLI does
        print(f"replay_bench_in_sim.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
