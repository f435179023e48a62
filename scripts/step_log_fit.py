"""Compare the engine steps two served runs logged (scripts/serve_step_log.py): the work each did,
and the step cost fitted to each run's own steps.

For each POLICY it reads DIR/POLICY_steps.jsonl and prints the steps, the wall and process CPU
seconds inside them, the time between them, the batched and summed-context tokens, and a least
squares fit of step seconds = a + b * batched tokens + c * summed context tokens. It reads the
logs of scripts/replay_engine.py too, which time each step (step_time_s) but record neither its
bounds nor its CPU time: those figures are then left out. With the same
work under both policies, a difference in duration comes either from the number of steps (which
the order changes) or from the cost per step (which it should not).

    python scripts/step_log_fit.py out/bench_serve_s8 [--policies fcfs,sjf]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def fit_steps(path: Path) -> dict:
    """ValueError when `path` holds no steps or a line that is not one of serve_step_log.py's."""
    try:
        steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        bounded = bool(steps) and "t0" in steps[0]  # serve_step_log.py's; replay_engine.py's time steps alone
        keys = ("t0", "t1", "cpu") if bounded else ("step_time_s",)
        column = {key: np.array([step[key] for step in steps], dtype=float)
                  for key in (*keys, "num_batched_tokens", "sum_context_tokens")}
    except (ValueError, LookupError, TypeError) as exc:  # not JSON, or a step without a field
        raise ValueError(f"{path}: not a step log of scripts/serve_step_log.py or replay_engine.py "
                         f"({exc!r})") from None
    if not steps:
        raise ValueError(f"{path} holds no steps")
    wall = column["t1"] - column["t0"] if bounded else column["step_time_s"]
    design = np.c_[np.ones_like(wall), column["num_batched_tokens"], column["sum_context_tokens"]]
    a, b, c = np.linalg.lstsq(design, wall, rcond=None)[0]
    return {"steps": len(steps), "wall_s": wall.sum(), "cpu_s": column["cpu"].sum() if bounded else None,
            "gaps_s": (column["t0"][1:] - column["t1"][:-1]).sum() if bounded else None,
            "batched_tokens": int(column["num_batched_tokens"].sum()),
            "context_tokens": int(column["sum_context_tokens"].sum()),
            "a_ms": a * 1e3, "b_ms_per_token": b * 1e3, "c_us_per_context_token": c * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--policies", default="fcfs,sjf")
    args = parser.parse_args(argv)
    for policy in args.policies.split(","):
        path = args.run_dir / f"{policy}_steps.jsonl"
        if not path.is_file():
            parser.error(f"no step log {path}")
        try:
            fit = fit_steps(path)
        except ValueError as exc:
            parser.error(str(exc))
        print(policy, json.dumps({key: round(value, 3) if isinstance(value, float) else value
                                  for key, value in fit.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
