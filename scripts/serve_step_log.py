"""`lengthwise serve` with every engine step logged, for diagnosing served throughput.

Each line of $STEP_LOG: the step's start and end (perf_counter), the process CPU seconds it took
(all threads, so above 1 means the event loop or torch's second thread ran alongside), the
engine's StepRecord (batched tokens, sequences, summed context, step and forward seconds) and the
waiting-queue length. Arguments are those of `lengthwise serve`.

    STEP_LOG=out/bench_serve/sjf_steps.jsonl python scripts/serve_step_log.py serve --policy sjf --port 8010

(scripts/step_log_fit.py reads DIR/POLICY_steps.jsonl.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path


def install_step_log(path: str) -> None:
    import engine.llm_engine as llm_engine
    from engine.arg_types import check_output_location

    # A bad path fails at once; an existing log is replaced only once the server steps, not by a
    # command that never starts (a taken port, a missing model).
    check_output_location(Path(path), "STEP_LOG", folder=False)
    log = None
    step = llm_engine.LLMEngine.step

    def logged_step(self):
        nonlocal log
        if log is None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            log = open(path, "w", buffering=1)
        started, cpu = time.perf_counter(), time.process_time()
        outputs = step(self)
        log.write(json.dumps({"t0": started, "t1": time.perf_counter(), "cpu": time.process_time() - cpu,
                              **dataclasses.asdict(self.last_step), "waiting": len(self.scheduler.waiting)}) + "\n")
        return outputs

    llm_engine.LLMEngine.step = logged_step


def main(argv: list[str]) -> int:
    path = os.environ.get("STEP_LOG")
    try:
        if not path:
            raise ValueError("set STEP_LOG=FILE, the file each engine step is logged to")
        install_step_log(path)
    except (ValueError, OSError) as exc:
        print(f"serve_step_log.py: error: {exc}", file=sys.stderr)
        return 2
    from training.cli import main as lengthwise

    return lengthwise(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
