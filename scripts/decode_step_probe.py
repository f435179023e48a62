"""Time the engine's decode steps at fixed batch x context shapes (SmolLM2, CPU).

For each BATCHxCONTEXT shape: queue BATCH synthetic prompts of CONTEXT tokens, step until all of
them decode, then time --steps decode steps and print each step, the median, and the mean split
into prepare / forward / sample. With --no-retain-host-memory the engine leaves glibc's allocator
at its defaults (engine/host_memory.py); --temperature above 0 samples (seeded per request with
--seeded); --profile runs the timed steps under cProfile and prints the functions with the most
own time. Pick shapes whose KV fits the cache (32 x 600 fits the default 1 GiB; 32 x 1000 does not).

    python scripts/decode_step_probe.py 32x400 32x600 [--no-retain-host-memory]
    python scripts/decode_step_probe.py 24x400 --steps 20 --temperature 1 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import time


def shape(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", type=shape, metavar="BATCHxCONTEXT")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-retain-host-memory", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seeded", action="store_true", help="a seed per request (its own generator)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(retain_host_memory=not args.no_retain_host_memory))
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
