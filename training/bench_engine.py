"""`lengthwise bench engine`: the engine against HF static and HF continuous batching.

Workload: the first N first-turn ShareGPT prompts of the chosen split with at most
`--max-prompt-tokens` tokens; each request's `max_tokens` is its ShareGPT response length in SmolLM2
tokens (capped at `--max-output-tokens`, at least 1) with eos ignored, so all three systems produce
exactly the same number of useful tokens. The three runs share one process, one model and one
concurrency (`--max-num-seqs`). The JSON holds useful tokens/s per system, the ratios, the engine's
overhead share (step time outside the model forward) and the peak RSS; a bar chart goes next to it.

`--calibrate` also fits the engine's step time as a + b * batched_tokens + c * sum_context_tokens by
least squares over its steps, times a swap copy of the engine's KV blocks (d, seconds per block
copied out or in), and writes the coefficients (plus the KV budget used) to `--step-cost-out`
(out/step_cost.json); `lengthwise simulate --step-cost FILE` reads it, and by default the committed
data/step_cost.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
from pathlib import Path

import numpy as np

from engine.arg_types import cpu_threads, positive_float, positive_int, power_of_two, prepare_output_file
from engine.config import DEFAULT_MODEL, REPO_ROOT, EngineConfig
from engine.llm_engine import StepRecord
from scheduler.simulation import StepCostModel
from training.engine_baselines import RunResult, WorkItem, run_engine, run_hf_continuous, run_hf_static

BASELINES = ("hf_static", "hf_continuous")
# Not data/step_cost.json, what `simulate` reads: that file is committed and kept fixed so
# simulator figures stay comparable; replacing it is a deliberate --step-cost-out.
DEFAULT_STEP_COST_OUT = REPO_ROOT / "out" / "step_cost.json"
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=positive_int, default=64)
    parser.add_argument("--split", default="test", choices=("train", "validation", "test"))
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=1024)
    parser.add_argument("--max-output-tokens", type=positive_int, default=512)
    parser.add_argument("--max-num-seqs", type=positive_int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    parser.add_argument("--max-model-len", type=positive_int, default=2048)
    parser.add_argument("--block-size", type=power_of_two, default=16)
    parser.add_argument("--kv-cache-memory", type=positive_float, default=1.0, help="GiB for the KV cache")
    parser.add_argument("--threads", type=cpu_threads, default=2)
    parser.add_argument("--no-retain-host-memory", action="store_true",
                        help="leave glibc's allocator at its defaults (engine/host_memory.py), for an A/B")
    parser.add_argument("--skip", type=baseline_names, default=frozenset(),
                        help=f"comma-separated baselines to leave out: {','.join(BASELINES)}")
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "out" / "bench_engine.json")
    parser.add_argument("--calibrate", action="store_true", help="fit the step-cost model and write it")
    parser.add_argument("--step-cost-out", type=Path, default=None,
                        help=f"where --calibrate writes the fit (default {DEFAULT_STEP_COST_OUT}; simulate "
                             "reads data/step_cost.json)")


def baseline_names(text: str) -> frozenset[str]:
    """--skip: comma-separated names from BASELINES (checked when parsed, before any model loads)."""
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(names - set(BASELINES))
    if unknown:
        raise argparse.ArgumentTypeError(f"takes names from {','.join(BASELINES)}, got {','.join(unknown)}")
    return names


def load_workload(tokenizer, split: str, num_prompts: int, max_prompt_tokens: int,
                  max_output_tokens: int) -> list[WorkItem]:
    from training.dataset import load_turns

    turns = load_turns(split)
    fits = [i for i, (turn, length) in enumerate(zip(turns["turn_index"], turns["prompt_tokens"]))
            if turn == 0 and length <= max_prompt_tokens]
    if not fits:
        raise ValueError(f"--max-prompt-tokens {max_prompt_tokens}: no first turn of the {split} split fits")
    rows = turns.select(fits[:num_prompts])
    return [WorkItem(tuple(tokenizer.encode(row["prompt"], add_special_tokens=False)),
                     max(1, min(row["response_tokens"], max_output_tokens))) for row in rows]


def fit_step_cost(steps: list[StepRecord]) -> dict[str, float]:
    """Least squares of step time on [1, batched tokens, summed context], every coefficient at
    least 0 (a cost cannot fall with more work; clamping a negative one after an unconstrained
    fit would leave the others fitted for it); also its R^2."""
    from scipy.optimize import nnls

    times = np.array([s.step_time_s for s in steps])
    design = np.array([[1.0, s.num_batched_tokens, s.sum_context_tokens] for s in steps]).reshape(-1, 3)
    scale = np.maximum(np.abs(design).max(axis=0, initial=0.0), 1e-12)  # columns of one size for the solver
    if np.linalg.matrix_rank(design / scale) < 3:
        # Steps all of one size (or too few of them) cannot tell the fixed cost from the per-token
        # ones: every second went to a, and an R^2 of 1 said the fit was perfect.
        raise ValueError(f"--calibrate: the engine's {len(steps)} steps cannot separate the fixed, per-token "
                         "and per-context costs (too few, or all of one size): run more prompts")
    coef = nnls(design / scale, times)[0] / scale
    residual = times - design @ coef
    total = float(((times - times.mean()) ** 2).sum())
    # Step times all but equal leave a spread of rounding noise, whose ratio means nothing.
    r2 = 1.0 - float((residual ** 2).sum()) / total if total > 1e-12 * float((times ** 2).sum()) else 1.0
    fit = {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2]), "r2": r2, "num_steps": len(steps)}
    try:  # what simulate will read: a fit may put every second on the context (a = b = 0)
        StepCostModel.from_dict(fit)
    except ValueError as exc:
        raise ValueError(f"--calibrate: the fit is no step cost the simulator can use ({exc})") from None
    return fit


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _ratio(engine: RunResult, other: RunResult | None) -> float | None:
    if other is None or other.tokens_per_s == 0:
        return None
    return engine.tokens_per_s / other.tokens_per_s


def summarise(results: dict[str, RunResult], config: EngineConfig, num_prompts: int) -> dict:
    engine = results["engine"]
    return {
        "tokens_per_s": {name: (results[name].tokens_per_s if name in results else None)
                         for name in ("engine",) + BASELINES},
        "ratio_vs_hf_static": _ratio(engine, results.get("hf_static")),
        "ratio_vs_hf_continuous": _ratio(engine, results.get("hf_continuous")),
        "overhead_share": engine.overhead_share,
        "peak_rss_mb": _peak_rss_mb(),
        "useful_tokens": {name: r.useful_tokens for name, r in results.items()},
        "seconds": {name: r.seconds for name, r in results.items()},
        "engine_steps": len(engine.steps),
        "num_prompts": num_prompts,
        "config": {"model": config.model, "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens, "block_size": config.block_size,
                   "kv_cache_memory_gib": config.kv_cache_memory_gib, "threads": config.num_threads,
                   "retain_host_memory": config.retain_host_memory,
                   "dtype": config.dtype},
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, v in summary["tokens_per_s"].items() if v is not None]
    values = [summary["tokens_per_s"][n] for n in names]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    bars = ax.bar(names, values, color=["tab:green", "tab:gray", "tab:blue"][:len(names)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("useful output tokens / s")
    ax.set_title(f"{summary['num_prompts']} ShareGPT prompts, {summary['config']['max_num_seqs']} seats")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_output_paths(args: argparse.Namespace) -> None:
    """The plot goes beside --json, as its .png: no two outputs may be one file, or one would
    overwrite the other after the whole run."""
    json_path = Path(args.json)
    if json_path.suffix == ".png":
        raise ValueError(f"--json {json_path}: the plot is written to the .png beside it")
    step_cost_out = step_cost_path(args)
    if args.calibrate and step_cost_out.resolve() in (json_path.resolve(), json_path.with_suffix(".png").resolve()):
        raise ValueError(f"--step-cost-out {step_cost_out}: the same file as --json or its plot")


def step_cost_path(args: argparse.Namespace) -> Path:
    """Where --calibrate writes its fit. Given without --calibrate, the path is refused: nothing is
    fitted, and the file the user asked for would never be written."""
    if args.step_cost_out is not None and not args.calibrate:
        raise ValueError("--step-cost-out is written only with --calibrate")
    return Path(args.step_cost_out or DEFAULT_STEP_COST_OUT)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    check_output_paths(args)
    if args.max_prompt_tokens + args.max_output_tokens > args.max_model_len:
        # The engine ends a reply at max_model_len; the HF baselines would run it to max_tokens.
        raise ValueError(f"--max-prompt-tokens {args.max_prompt_tokens} + --max-output-tokens "
                         f"{args.max_output_tokens} exceed --max-model-len {args.max_model_len}: the engine "
                         f"would cut replies the HF baselines run to the end")
    config = EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          kv_cache_memory_gib=args.kv_cache_memory, num_threads=args.threads,
                          retain_host_memory=not args.no_retain_host_memory)
    from engine.llm_engine import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    items = load_workload(tokenizer, args.split, args.num_prompts, args.max_prompt_tokens, args.max_output_tokens)
    prepare_output_file(args.json, "--json")  # before the runs, not after them
    if args.calibrate:
        prepare_output_file(step_cost_path(args), "--step-cost-out")
    # The allocator setting is process-wide: the HF baselines, run after the engine, share it.
    results = {"engine": run_engine(items, config)}
    log.info("engine: %.1f tokens/s", results["engine"].tokens_per_s)
    if "hf_static" not in args.skip:
        results["hf_static"] = run_hf_static(items, args.model, args.max_num_seqs, tokenizer.pad_token_id)
        log.info("hf_static: %.1f tokens/s", results["hf_static"].tokens_per_s)
    if "hf_continuous" not in args.skip:
        # The same KV memory as the engine, but never more than every seat at full length needs
        # (a tiny test model would otherwise ask HF for an enormous cache).
        kv_tokens = min(_kv_cache_tokens(config), args.max_num_seqs * args.max_model_len)
        results["hf_continuous"] = run_hf_continuous(items, args.model, args.max_num_seqs,
                                                     args.max_num_batched_tokens, kv_tokens)
        log.info("hf_continuous: %.1f tokens/s", results["hf_continuous"].tokens_per_s)
    summary = summarise(results, config, len(items))
    refused = None
    if args.calibrate:
        try:
            summary["step_cost"] = write_step_cost(results["engine"].steps, config, step_cost_path(args))
        except ValueError as exc:  # the throughput figures are still written
            refused = exc
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, args.json.with_suffix(".png"))
    if refused is not None:
        raise refused
    print(json.dumps({k: summary[k] for k in ("tokens_per_s", "ratio_vs_hf_static", "ratio_vs_hf_continuous",
                                              "overhead_share", "peak_rss_mb")}, indent=2))
    return 0


def _cache_geometry(config: EngineConfig):
    """The KV block geometry of the engine `config` describes, in its dtype."""
    from engine.llm_engine import cache_geometry, config_dtype
    from engine.model.arch import LlamaArch

    return cache_geometry(config, LlamaArch.from_model_dir(config.model), config_dtype(config))


def _kv_cache_tokens(config: EngineConfig) -> int:
    """The engine's KV capacity in tokens (its dtype, or its fixed block count), so HF's continuous
    batching gets the same memory."""
    from engine.llm_engine import gpu_block_count

    return gpu_block_count(config, _cache_geometry(config)) * config.block_size


def swap_seconds_per_block(config: EngineConfig, num_blocks: int = 64, rounds: int = 5) -> float:
    """Median time to copy one KV block of the engine's geometry (layers, heads, dtype, device) out
    to the host pool or back in."""
    import time

    import torch

    from engine.kv_cache import KVCache
    from engine.llm_engine import resolve_device

    device = resolve_device(config.device)
    cache = KVCache(_cache_geometry(config), num_blocks, num_blocks, device)
    pairs = tuple((i, num_blocks - 1 - i) for i in range(num_blocks))
    per_block = []
    for _ in range(rounds):
        start = time.perf_counter()
        cache.swap_out(pairs)
        cache.swap_in(pairs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        per_block.append((time.perf_counter() - start) / (2 * num_blocks))
    return float(np.median(per_block))


def write_step_cost(steps: list[StepRecord], config: EngineConfig, path: Path) -> dict:
    fit = fit_step_cost(steps)
    fit["d"] = swap_seconds_per_block(config)
    fit.update(kv_cache_memory_gib=config.kv_cache_memory_gib, num_gpu_blocks=_kv_cache_tokens(config) // config.block_size,
               block_size=config.block_size, max_num_seqs=config.max_num_seqs,
               max_num_batched_tokens=config.max_num_batched_tokens, threads=config.num_threads, model=config.model)
    prepare_output_file(path, "--step-cost-out")
    path.write_text(json.dumps(fit, indent=2) + "\n")
    log.info("step cost: %.4f + %.2e * tokens + %.2e * context + %.2e * swapped blocks (R^2 %.3f) -> %s",
             fit["a"], fit["b"], fit["c"], fit["d"], fit["r2"], path)
    return fit
