"""Time the engine's decode steps at fixed batch x context shapes (SmolLM2, CPU).

For each BATCHxCONTEXT shape: queue BATCH synthetic prompts of CONTEXT tokens, step until all of
them decode, then time --steps decode steps and print each step, the median, and the mean split
into prepare / forward / sample. With --no-retain-host-memory the engine leaves glibc's allocator
at its defaults (engine/host_memory.py); --temperature above 0 samples (seeded per request with
--seeded); --profile runs the timed steps under cProfile and prints the functions with the most
own time. Shapes are checked before the model loads: each needs a seat per request, room in
max_model_len for the decode steps, and KV blocks in the cache (32 x 600 fits the default 1 GiB;
32 x 1000 does not).

    python scripts/decode_step_probe.py 32x400 32x600 [--no-retain-host-memory]
    python scripts/decode_step_probe.py 24x400 --steps 20 --temperature 1 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import resource
import statistics
import time

from engine.arg_types import non_negative_float, positive_int


def shape(text: str) -> tuple[int, int]:
    try:
        batch, context = (positive_int(part) for part in text.lower().split("x"))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"a shape is BATCHxCONTEXT, two positive integers, got {text!r}") from None
    return batch, context


def shape_problem(batch: int, context: int, steps: int, config, kv_blocks: int | None = None) -> str | None:
    """Why BATCH x CONTEXT cannot be probed for `steps` decode steps under `config` (and a cache of
    `kv_blocks`, when given), or None. Every request must hold a seat and its KV blocks and still be
    decoding when the timed steps end: early prompts decode while later ones prefill (at most one
    token a step), then `steps` more; else the steps timed would not be of that shape."""
    if batch > config.max_num_seqs:
        return f"{batch}x{context}: a batch above max_num_seqs {config.max_num_seqs} would not run at once"
    prefill_steps = math.ceil(batch * context / config.max_num_batched_tokens)
    longest = context + prefill_steps + steps
    if longest >= config.max_model_len:
        return (f"{batch}x{context}: a context of {context} tokens leaves no room for {steps} decode steps "
                f"(after up to {prefill_steps} prefill steps) within max_model_len {config.max_model_len}")
    needed = batch * math.ceil(longest / config.block_size)
    if kv_blocks is not None and needed > kv_blocks:
        return f"{batch}x{context}: needs up to {needed} KV blocks, the cache holds {kv_blocks}"
    return None


def cache_blocks(config) -> int:
    """The KV blocks the engine will have, from the model's config.json (no weights loaded)."""
    from engine.llm_engine import cache_geometry, check_model_dir, config_dtype, gpu_block_count
    from engine.model.arch import LlamaArch

    check_model_dir(config.model)
    arch = LlamaArch.from_model_dir(config.model)
    return gpu_block_count(config, cache_geometry(config, arch, config_dtype(config)))


def decode_steps(engine, batch: int, context: int, steps: int, temperature: float, seeded: bool,
                 profile: cProfile.Profile | None) -> list[tuple[float, object]]:
    """(wall seconds, the runner's StepTimes) of `steps` decode steps at BATCH x CONTEXT."""
    from scheduler.request import SamplingParams

    ids = [f"probe-{batch}x{context}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        # Chunked prefill lets early prompts decode while later ones prefill: leave room to keep going.
        params = SamplingParams(max_tokens=engine.config.max_model_len - context, temperature=temperature,
                                seed=i if seeded else None, ignore_eos=True)
        engine.add_request(request_id, [100 + (i * 7 + j) % 40000 for j in range(context)], params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    records = []
    for _ in range(steps):
        if profile is not None:
            profile.enable()
        started = time.perf_counter()
        engine.step()
        records.append((time.perf_counter() - started, engine.runner.last_times))
        if profile is not None:
            profile.disable()
    for request_id in ids:
        engine.abort_request(request_id)
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", type=shape, metavar="BATCHxCONTEXT")
    parser.add_argument("--steps", type=positive_int, default=12)
    parser.add_argument("--no-retain-host-memory", action="store_true")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0)
    parser.add_argument("--seeded", action="store_true",
                        help="a seed per request (each position's draw seeded by a hash of (seed, position), "
                             "as engine/sampler.py does for any seeded request)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(retain_host_memory=not args.no_retain_host_memory)
    for batch, context in args.shapes:  # before the model loads
        problem = shape_problem(batch, context, args.steps, config)
        if problem:
            parser.error(problem)
    try:
        kv_blocks = cache_blocks(config)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    for batch, context in args.shapes:
        problem = shape_problem(batch, context, args.steps, config, kv_blocks)
        if problem:
            parser.error(problem)
    engine = LLMEngine(config)
    for batch, context in args.shapes:
        profile = cProfile.Profile() if args.profile else None
        system_before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        records = decode_steps(engine, batch, context, args.steps, args.temperature, args.seeded, profile)
        system_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - system_before
        times = [wall for wall, _ in records]
        split = {part: 1000 * statistics.fmean(getattr(t, f"{part}_s") for _, t in records)
                 for part in ("prepare", "forward", "sample")}
        print(f"{batch}x{context}: median {1000 * statistics.median(times):.0f} ms, mean "
              f"{1000 * statistics.fmean(times):.1f} ms = " + " + ".join(f"{k} {v:.1f}" for k, v in split.items())
              + f" + rest (steps {[round(1000 * t) for t in times]}; system time {system_s:.1f} s incl. prefill)")
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
