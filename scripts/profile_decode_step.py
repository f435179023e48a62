"""Time and profile decode steps of the real engine at a fixed shape: where a step's time goes.

24 requests of 400 prompt tokens at temperature 1 (add --seeded for per-request generators),
prefilled, then 20 decode steps under cProfile. Prints the mean prepare / forward / sample / whole
step times in ms and the functions with the most own time.

    python scripts/profile_decode_step.py [--seeded]
"""

from __future__ import annotations

import cProfile
import pstats
import sys


def main(argv: list[str]) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.request import SamplingParams

    seeded = "--seeded" in argv
    engine = LLMEngine(EngineConfig())
    for i in range(24):
        params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True, seed=i if seeded else None)
        engine.add_request(str(i), list(range(100 + i, 500 + i)), params)
    while any(not r.output_token_ids for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    for _ in range(3):
        engine.step()
    totals = {"prepare": 0.0, "forward": 0.0, "sample": 0.0, "step": 0.0}
    num_steps = 20
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(num_steps):
        engine.step()
        times = engine.runner.last_times
        totals["prepare"] += times.prepare_s
        totals["forward"] += times.forward_s
        totals["sample"] += times.sample_s
        totals["step"] += engine.last_step.step_time_s
    profile.disable()
    print({name: round(total / num_steps * 1e3, 1) for name, total in totals.items()},
          "ms per step;", engine.last_step.num_seqs, "sequences")
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main(sys.argv[1:])
