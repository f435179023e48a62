"""Time one step of the logits processors (engine/logits_processors.py) on SmolLM2's vocabulary:
a model runner's own processors, which keep each request's tensors between steps, against a
fresh set per step, which rebuilds them (allowed ids, logit bias, the prompt's distinct ids).
Synthetic requests and logits; the median of --repeats steps.

    python scripts/logits_processors_probe.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.arg_types import positive_int

VOCAB = 49152


def requests(count: int, prompt_len: int = 200, output_len: int = 0, tag: str = "", **params):
    from scheduler.request import Request, SamplingParams

    made = []
    for index in range(count):
        request = Request(f"{tag}{index}", [random.randrange(VOCAB) for _ in range(prompt_len)],
                          SamplingParams(max_tokens=2000, **params), arrival_time=0.0, eos_token_id=2)
        request.output_token_ids = [random.randrange(VOCAB) for _ in range(output_len)]
        made.append(request)
    return made


def median_step_ms(batch, processors, repeats: int) -> float:
    import torch

    from engine.logits_processors import process_logits

    logits = torch.randn(len(batch), VOCAB)
    process_logits(logits, batch, processors)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        process_logits(logits, batch, processors)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=20)
    args = parser.parse_args()
    import torch

    from engine.logits_processors import default_processors

    torch.set_num_threads(1)
    random.seed(0)
    allowed = tuple(range(100, 40100))
    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.5)
    cases = {
        "64 plain rows": requests(64),
        "1 row with 40k allowed ids beside 63 plain": requests(1, tag="a", allowed_token_ids=allowed) + requests(63),
        "8 rows with 40k allowed ids": requests(8, allowed_token_ids=allowed),
        "8 rows with a 300-token logit bias": requests(8, logit_bias={i: 1.0 for i in range(300)}),
        "8 penalized rows, 4,000 + 200 tokens": requests(8, 4000, 200, **penalties),
        "64 penalized rows, 500 + 100 tokens": requests(64, 500, 100, **penalties),
        "1 penalized row, 8,000 + 1,000 tokens": requests(1, 8000, 1000, **penalties),
    }
    for name, batch in cases.items():
        kept = median_step_ms(batch, default_processors(), args.repeats)
        fresh = median_step_ms(batch, None, args.repeats)
        print(f"{name}: {kept:.2f} ms a step with kept tensors, {fresh:.2f} ms rebuilt each step")


if __name__ == "__main__":
    main()
