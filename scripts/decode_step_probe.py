"""Time the engine's decode steps at fixed batch x context shapes (SmolLM2, CPU).

For each BATCHxCONTEXT shape: queue BATCH synthetic prompts of CONTEXT tokens, step until all of
them decode, then time --steps decode steps and print each step and the median. With
--no-retain-host-memory the engine leaves glibc's allocator at its defaults (engine/host_memory.py).
Pick shapes whose KV fits the cache (32 x 600 fits the default 1 GiB; 32 x 1000 does not).

    python scripts/decode_step_probe.py 32x400 32x600 [--no-retain-host-memory]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time


def shape(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


def decode_step_times(engine, batch: int, context: int, steps: int) -> list[float]:
    from scheduler.request import SamplingParams

    ids = [f"probe-{batch}x{context}-{i}" for i in range(batch)]
    # Chunked prefill lets early prompts decode while later ones prefill: leave room to keep going.
    params = SamplingParams(max_tokens=engine.config.max_model_len - context, temperature=0.0, ignore_eos=True)
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [100 + (i * 7 + j) % 40000 for j in range(context)], params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    for request_id in ids:
        engine.abort_request(request_id)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", type=shape, metavar="BATCHxCONTEXT")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-retain-host-memory", action="store_true")
    args = parser.parse_args()
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(retain_host_memory=not args.no_retain_host_memory))
    for batch, context in args.shapes:
        system_before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        times = decode_step_times(engine, batch, context, args.steps)
        system_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - system_before
        print(f"{batch}x{context}: median {1000 * statistics.median(times):.0f} ms "
              f"(steps {[round(1000 * t) for t in times]}; system time {system_s:.1f} s incl. prefill)")


if __name__ == "__main__":
    main()
