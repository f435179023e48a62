"""`lengthwise simulate`: compare scheduling policies on a simulated server.

Drives the real scheduler (scheduler.simulation) with a step-cost model and a binding KV budget on
ShareGPT test-split turns. `--load` is the offered load as a share of the saturated output-token
throughput, which the simulator measures itself: the same requests all present at t=0 under FCFS.
The arrival rate is then load * saturated throughput / mean output tokens per request. Every policy
sees the same requests and arrival times. Writes JSON (load, policies, goals, KV budget, cost
model, optional load sweep) and plots next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import time
from dataclasses import replace
from pathlib import Path

from engine.arg_types import (non_negative_int, positive_float, positive_float_list, positive_int,
                              policy_list, power_of_two, prepare_output_file, tier_weights)
from engine.config import DEFAULT_PREDICTOR, REPO_ROOT, EngineConfig
from engine.scheduler_args import KNOBS, add_scheduler_arguments, scheduler_options
from scheduler.config import SchedulerConfig
from scheduler.eviction import needs_host_pool
from scheduler.policies import POLICIES, make_policy
from scheduler.request import is_int
from scheduler.simulation import SimRequest, StepCostModel, simulate
from training import strict_json
from training.sim_metrics import aging_bounds, goal_checks, mean, overtaken_beyond_bound, summarize
from training.sim_plots import plot_latency_cdf, plot_latency_vs_rate
from training.sim_workload import (NOISY_ORACLE, Turn, arrival_times, assign_tiers, build_workload,
                                   load_test_turns, noisy_oracle, predictor_predictions)

logger = logging.getLogger(__name__)

DEFAULT_STEP_COST = REPO_ROOT / "data" / "step_cost.json"
# Placeholder coefficients for the CPU engine where data/step_cost.json (the committed calibration,
# from `lengthwise bench engine --calibrate`) is missing: 30 ms per step, 0.8 ms per fed token, 1 us
# per attended context token.
DEFAULT_COST = StepCostModel(a_s=0.030, b_s_per_token=0.0008, c_s_per_context_token=1.0e-6)
DEFAULT_KV_BLOCKS = 1024  # 16k tokens of 16: binds at 32 seats of ShareGPT-sized requests
# The scheduler keeps a free list and a refcount per block (~80 bytes each): 4M blocks take a third
# of a GiB, and hold 64M tokens of 16, far more than a workload of ShareGPT turns can fill.
MAX_KV_BLOCKS = 2**22
KV_BYTES_PER_TOKEN_SMOLLM2_FP32 = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads, head dim 64
ARRIVAL_CV_RANGE = (0.01, 100.0)


DEFAULT_ARRIVAL_CV = 2.0


def arrival_cv_of(args: argparse.Namespace) -> float:
    """The gamma arrivals' CV: --arrival-cv, refused with any other arrival process (it read nothing)."""
    if args.arrival_cv is not None and args.arrival != "gamma":
        raise ValueError(f"--arrival-cv: only --arrival gamma reads it (--arrival {args.arrival})")
    return DEFAULT_ARRIVAL_CV if args.arrival_cv is None else args.arrival_cv


def arrival_cv(text: str) -> float:
    """A gamma CV whose shape (1/CV^2) and gaps stay finite floats; past these bounds the draws
    divide by zero or collapse onto one instant."""
    value = positive_float(text)
    if not ARRIVAL_CV_RANGE[0] <= value <= ARRIVAL_CV_RANGE[1]:
        raise argparse.ArgumentTypeError(f"must be between {ARRIVAL_CV_RANGE[0]:g} and {ARRIVAL_CV_RANGE[1]:g}, "
                                         f"got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", type=policy_list, default="fcfs,sjf,srpt,oracle",
                        help="comma-separated: " + ",".join(POLICIES))
    parser.add_argument("--num-requests", type=positive_int, default=2000)
    parser.add_argument("--load", type=positive_float, default=0.9,
                        help="offered load, share of saturated throughput")
    parser.add_argument("--sweep-loads", type=positive_float_list, default=[0.7, 1.0],
                        help="extra loads, reported beside --load and plotted against the arrival rate "
                             "(default 0.7,1.0; '' for none)")
    parser.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    parser.add_argument("--arrival-cv", type=arrival_cv, default=None,
                        help=f"gamma arrivals: coefficient of variation (default {DEFAULT_ARRIVAL_CV:g})")
    parser.add_argument("--tier-mix", type=tier_weights, default="0,1,0", help="weights of interactive,standard,batch")
    parser.add_argument("--predictions", default="predictor", choices=["predictor", NOISY_ORACLE])
    parser.add_argument("--predictor", type=Path, default=DEFAULT_PREDICTOR)
    parser.add_argument("--exclude-train-prompts", action="store_true",
                        help="leave out test prompts that also occur in the train split (the dedup workload)")
    parser.add_argument("--step-cost", type=Path, default=None,
                        help=f"calibrated step-cost JSON (default {DEFAULT_STEP_COST}, or placeholder "
                             f"coefficients with a warning when that file is missing)")
    parser.add_argument("--kv-blocks", type=positive_int, default=None,
                        help=f"device KV blocks (the binding budget); default: the calibrated engine's "
                             f"num_gpu_blocks from --step-cost, else {DEFAULT_KV_BLOCKS}")
    parser.add_argument("--block-size", type=power_of_two, default=16)
    parser.add_argument("--max-num-seqs", type=positive_int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=1024)
    parser.add_argument("--max-output-tokens", type=positive_int, default=1024)
    parser.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    add_scheduler_arguments(parser)  # aging, srpt, SLOs, admission: the flags `serve` takes
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "out" / "simulate.json")
    parser.add_argument("--no-plots", action="store_true")


def load_cost_model(path: Path | None) -> tuple[StepCostModel, str, dict]:
    """The cost model, where it came from, and the calibration file's content ({} without one).

    `path` None reads DEFAULT_STEP_COST, or falls back to placeholder coefficients, with a warning,
    when that file is missing (a checkout without data); a path given explicitly must exist."""
    if path is None:
        if not DEFAULT_STEP_COST.exists():
            note = (f"default placeholder coefficients ({DEFAULT_STEP_COST} not found; "
                    f"run `lengthwise bench engine --calibrate --step-cost-out {DEFAULT_STEP_COST}`)")
            logger.warning("step cost: %s", note)
            return DEFAULT_COST, note, {}
        path = DEFAULT_STEP_COST
    elif not path.is_file():
        raise FileNotFoundError(f"--step-cost {path}: no such file")
    try:
        data = json.loads(path.read_text())
        check_kv_budget_fields(data)
        return StepCostModel.from_dict(data), f"calibrated ({path})", data
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, or not a cost model
        raise ValueError(f"--step-cost {path}: not a step-cost file (JSON with a, b, c): {exc}") from None


def check_kv_budget_fields(data: dict) -> None:
    """The calibration's KV budget, read as the default --kv-blocks: a count of 0 or below had become
    one block, and text an int() error that named no file."""
    for name in ("num_gpu_blocks", "block_size"):
        value = data.get(name)
        if value is not None and not (is_int(value) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def engine_host_blocks(kv_blocks: int) -> int:
    """The swap pool the engine would have beside `kv_blocks` device blocks with its default
    memory settings (0.5 GiB of host memory to 1 GiB of KV cache: half as many blocks)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    return max(1, round(kv_blocks * defaults["swap_space_gib"] / defaults["kv_cache_memory_gib"]))


def calibrated_kv_blocks(calibration: dict, block_size: int) -> int:
    """The calibrated engine's KV cache in blocks of `block_size`: the same tokens, however the
    engine's own blocks were sized."""
    if "num_gpu_blocks" not in calibration:
        return DEFAULT_KV_BLOCKS
    tokens = int(calibration["num_gpu_blocks"]) * int(calibration.get("block_size", block_size))
    return max(1, tokens // block_size)


def scheduler_config(args: argparse.Namespace, calibration: dict | None = None) -> SchedulerConfig:
    kv_blocks = args.kv_blocks or calibrated_kv_blocks(calibration or {}, args.block_size)
    if kv_blocks > MAX_KV_BLOCKS:  # the block manager lists every block: 10**12 of them was an OOM kill
        source = "--kv-blocks" if args.kv_blocks else "the --step-cost calibration's num_gpu_blocks"
        raise ValueError(f"{source}: {kv_blocks} KV blocks of {args.block_size} is more than the simulator "
                         f"keeps (at most {MAX_KV_BLOCKS}, {MAX_KV_BLOCKS * args.block_size} tokens)")
    return SchedulerConfig(
        num_gpu_blocks=kv_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_prompt_tokens + args.max_output_tokens, preemption_mode=args.preemption_mode,
        num_cpu_blocks=engine_host_blocks(kv_blocks) if needs_host_pool(args.preemption_mode) else 0,
        **scheduler_options(args, args.policies, "--policies"))


def scheduler_report(config: SchedulerConfig) -> dict:
    """The scheduler settings a run used: the step's limits and every knob the flags can set."""
    report = {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
              "max_model_len": config.max_model_len, "preemption_mode": config.preemption_mode,
              "admission": config.enable_admission,
              "queued_token_bound": config.queued_token_bound if config.enable_admission else None}
    report.update({knob.field: getattr(config, knob.field) for knob in KNOBS})
    return report


def saturated_throughput(config: SchedulerConfig, workload: list[SimRequest], cost: StepCostModel,
                         policy: str = "fcfs") -> float:
    """Output tokens per second with every request present at t=0 (FCFS's defines the load)."""
    at_once = [replace(r, arrival_time=0.0) for r in workload]
    policy_config = replace(config, policy=policy, enable_admission=False)
    with quiet_overload_warnings():
        result = simulate(policy_config, at_once, cost, make_policy(policy, policy_config))
    throughput = sum(r.output_tokens for r in result.records) / result.makespan_s
    if not 0 < throughput < math.inf:  # steps so long their sum overflows: the arrival rate would be 0
        raise ValueError(f"the step-cost model gives a saturated throughput of {throughput:g} tokens/s "
                         f"({cost}): not a usable cost model")
    return throughput


@contextlib.contextmanager
def quiet_overload_warnings():
    """A saturated run overloads on purpose (every request at t=0): its stability-margin warnings
    printed after the measured loads' results read as theirs."""
    admission_log = logging.getLogger("scheduler.admission")
    level = admission_log.level
    admission_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        admission_log.setLevel(level)


def run_load(config: SchedulerConfig, base: list[SimRequest], cost: StepCostModel, policies: list[str],
             load: float, saturated: float, args: argparse.Namespace) -> tuple[dict, dict]:
    """Summaries per policy at one load, and the e2e latencies for the CDF plot."""
    rate = load * saturated / mean([r.output_tokens for r in base])
    times = arrival_times(len(base), rate, args.arrival, arrival_cv_of(args), args.seed)
    workload = [replace(r, arrival_time=t) for r, t in zip(base, times)]
    summaries, latencies = {}, {}
    for name in policies:
        started = time.perf_counter()
        policy_config = replace(config, policy=name)
        policy = make_policy(name, policy_config)
        policy.record_rate_history = True  # for each request's own aging bound below
        result = simulate(policy_config, workload, cost, policy)
        summaries[name] = summarize(result, config.slo_ttft_interactive_s, config.slo_e2e_standard_s)
        if policy.ages:
            # the slowest rate in force while requests waited (measured from step times by default)
            summaries[name]["aging_tokens_per_s"] = policy.slowest_rate_while_waiting or policy.aging_rate
            bounds = aging_bounds(policy, workload, result.records)
            summaries[name]["aging_bound_s"] = max(bounds.values())
            summaries[name]["overtaken_beyond_aging_bound"] = overtaken_beyond_bound(result.records, bounds)
        latencies[name] = [r.e2e_s for r in result.records if not r.rejected]
        logger.info("load %.2f %-8s mean %.2fs p99 %.2fs (%.1fs wall)", load, name,
                    summaries[name]["mean_e2e_s"], summaries[name]["p99_e2e_s"], time.perf_counter() - started)
    # One draw of the arrivals offers more or less than asked (2,000 gamma arrivals at CV 4 and
    # seed 0 came 10% fast): the load this draw offered is reported beside the one asked for.
    offered_rate = len(times) / times[-1] if times and times[-1] > 0 else None
    offered = None if offered_rate is None else load * offered_rate / rate
    return {"load": load, "arrival_rate_per_s": rate, "offered_load": offered, "policies": summaries}, latencies


def load_workload_turns(args: argparse.Namespace) -> list[Turn]:
    return load_test_turns(args.num_requests, args.seed, args.max_prompt_tokens, args.max_output_tokens,
                           args.exclude_train_prompts)


def build_base_workload(args: argparse.Namespace, turns: list[Turn]) -> tuple[list[SimRequest], str]:
    if args.predictions == NOISY_ORACLE:
        predictions, source = noisy_oracle(turns, args.seed), "noisy oracle (development only)"
    else:
        predictions, source = predictor_predictions(turns, args.predictor), f"predictor {args.predictor}"
    tiers = assign_tiers(len(turns), args.tier_mix, args.seed)
    return build_workload(turns, predictions, [0.0] * len(turns), tiers,
                          max_tokens=args.max_output_tokens), source


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    policies = args.policies
    if args.predictions == "predictor":
        from predictor.saved import read_spec

        read_spec(args.predictor)  # a folder that is no predictor fails here, before the workload loads
    cost, cost_source, calibration = load_cost_model(args.step_cost)
    config = scheduler_config(args, calibration)
    arrival_cv_of(args)  # a CV without gamma arrivals fails here, before the workload loads
    turns = load_workload_turns(args)
    prepare_output_file(args.json, "--json")  # before the predictions and the simulation, not after them
    base, prediction_source = build_base_workload(args, turns)
    saturated = saturated_throughput(config, base, cost)
    logger.info("saturated output throughput %.1f tokens/s", saturated)
    main, latencies = run_load(config, base, cost, policies, args.load, saturated, args)
    # Below saturation an open queue serves what arrives, so every policy's throughput at the
    # issue's load equals the arrival rate and the throughput goal could not fail: each policy is
    # also measured saturated, every request present at once.
    for name, summary in main["policies"].items():
        summary["saturated_output_tokens_per_s"] = (
            saturated if name == "fcfs" else saturated_throughput(config, base, cost, name))
    aging_bound = main["policies"].get("sjf", {}).get("aging_bound_s")
    sweep = [main]
    for load in sorted(set(args.sweep_loads) - {args.load}):  # --load 0.7 is not run twice
        sweep.append(run_load(config, base, cost, policies, load, saturated, args)[0])
    sweep.sort(key=lambda entry: entry["load"])
    report = {
        "load": args.load, "offered_load": main["offered_load"], "arrival_rate_per_s": main["arrival_rate_per_s"],
        "arrival": args.arrival,
        "arrival_cv": arrival_cv_of(args) if args.arrival == "gamma" else 1.0, "seed": args.seed,
        "max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens,
        "num_requests": len(base), "saturated_output_tokens_per_s": saturated,
        "predictions": prediction_source, "exclude_train_prompts": args.exclude_train_prompts,
        "policies": main["policies"],
        "goals": goal_checks(main["policies"], aging_bound),
        "kv_budget": {"num_gpu_blocks": config.num_gpu_blocks, "block_size": config.block_size,
                      "tokens": config.num_gpu_blocks * config.block_size,
                      "num_cpu_blocks": config.num_cpu_blocks,
                      "smollm2_fp32_gib": config.num_gpu_blocks * config.block_size
                      * KV_BYTES_PER_TOKEN_SMOLLM2_FP32 / 2**30},
        "cost_model": {**cost.to_dict(), "source": cost_source},
        "scheduler": scheduler_report(config),
        "tier_mix": dict(zip(("interactive", "standard", "batch"), args.tier_mix)),
        "sweep": sweep if len(sweep) > 1 else [],
    }
    args.json.write_text(strict_json.dumps(report, indent=2) + "\n")
    if not args.no_plots:
        plot_latency_cdf(latencies, args.load, args.json.with_name(args.json.stem + "_cdf.png"))
        if len(sweep) > 1:
            plot_latency_vs_rate(sweep, args.json.with_name(args.json.stem + "_vs_rate.png"))
    print(strict_json.dumps({"goals": report["goals"], "saturated_output_tokens_per_s": saturated}, indent=2))
    return 0
