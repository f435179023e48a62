"""What admission control costs the engine thread when a burst arrives: N requests added to one
Scheduler at once (no step between them, as an engine thread applies a round of commands), timed
with admission on and off, for each policy and tier. Writes JSON.

    python scripts/admission_burst.py --num-requests 3000 --json out/admission_burst.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.admission import AdmissionRejected  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.request import Request, SamplingParams, Tier  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402


def burst_seconds(num_requests: int, policy: str, tier: Tier, admission: bool) -> tuple[float, int]:
    """(seconds to add the burst, requests refused) on a scheduler that measured 2,048 tokens/s."""
    config = SchedulerConfig(num_gpu_blocks=100_000, enable_admission=admission, policy=policy, max_model_len=4096,
                             slo_e2e_standard_s=1e9, slo_ttft_interactive_s=1e9)  # every request admitted
    scheduler = Scheduler(config)
    scheduler.admission.record_step(0.0, 512, 0.25)
    refused = 0
    started = time.perf_counter()
    for index in range(num_requests):
        request = Request(f"r{index}", [1 + index % 50] * 50, SamplingParams(max_tokens=100), arrival_time=index * 1e-4,
                          predicted_len=20 + index % 80, tier=tier)
        try:
            scheduler.add_request(request, now=index * 1e-4)
        except AdmissionRejected:
            refused += 1
    return time.perf_counter() - started, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    rows = []
    for policy in ("fcfs", "sjf"):
        for tier in (Tier.BATCH, Tier.STANDARD):
            on, refused = burst_seconds(args.num_requests, policy, tier, admission=True)
            off, _ = burst_seconds(args.num_requests, policy, tier, admission=False)
            rows.append({"policy": policy, "tier": tier.name.lower(), "admission_s": on, "no_admission_s": off,
                         "refused": refused})
            print(f"{policy} {tier.name.lower()}: {args.num_requests} adds {on:.2f} s with admission, "
                  f"{off:.2f} s without ({refused} refused)")
    if args.json is not None:
        args.json.write_text(json.dumps({"num_requests": args.num_requests, "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
