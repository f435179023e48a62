"""Time the sampler's top-k / top-p cut on SmolLM2's own logits: the cut among each row's likeliest
tokens (engine/sampler.py's CUT_CANDIDATES) against the whole row sorted (candidates = the
vocabulary), in one run, for a few settings.

The logits are the served model's (HF transformers over the converted folder) while it samples
at temperature 1 from the first --prompts prompts of the committed trace. Each setting times
--repeats draws of --rows random rows and prints the medians, their ratio, and the share of rows
whose cut settled among the candidates.

    python scripts/sampler_cut_probe.py [--prompts 16] [--tokens 40] [--rows 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from engine.arg_types import positive_int, prepare_output_file_or_exit

SETTINGS = ((0.9, 0), (0.95, 0), (1.0, 50), (0.95, 50))


def served_logits(num_prompts: int, num_tokens: int):
    """[N, vocab] float32 logits of the tokens SmolLM2 samples after trace prompts."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from predictor.paths import SERVED_MODEL_REF

    tokenizer = AutoTokenizer.from_pretrained(SERVED_MODEL_REF)
    model = AutoModelForCausalLM.from_pretrained(SERVED_MODEL_REF, dtype=torch.float32)
    prompts = pq.read_table("data/traces/smollm2_sharegpt.parquet", columns=["prompt"]).column("prompt").to_pylist()
    rows = []
    torch.manual_seed(0)
    for text in prompts[:num_prompts]:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, -384:]
        out = model.generate(ids, do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=num_tokens,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
        rows += [logits[0].float() for logits in out.logits]
    return torch.stack(rows)


def time_cut(logits, params, candidates: int, rows: int, repeats: int) -> float:
    import torch

    from engine.sampler import _filtered_probs

    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(repeats):
        batch = logits[torch.randint(len(logits), (rows,), generator=generator)]
        start = time.perf_counter()
        _filtered_probs(batch, params, candidates=candidates)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def settled_share(logits, top_p: float, top_k: int, candidates: int) -> float:
    import torch

    from engine.sampler import _cut_in_order, _likeliest

    vocab = logits.shape[-1]
    values, order = _likeliest(logits, candidates)
    k = torch.full((len(logits), 1), top_k if 0 < top_k < vocab else vocab)
    thresholds = torch.full((len(logits), 1), top_p if top_p < 1.0 else float("inf"))
    _, settled = _cut_in_order(values, logits.softmax(dim=-1).gather(-1, order), k, thresholds, vocab)
    return float(settled.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--tokens", type=positive_int, default=40)
    parser.add_argument("--rows", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=12)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prepare_output_file_or_exit(parser, args.json, "--json")  # before the model loads, not after the timings
    import torch

    from engine.sampler import CUT_CANDIDATES
    from scheduler.request import SamplingParams

    torch.set_num_threads(2)
    logits = served_logits(args.prompts, args.tokens)
    vocab = logits.shape[-1]
    results = []
    for top_p, top_k in SETTINGS:
        params = [SamplingParams(top_p=top_p, top_k=top_k)] * args.rows
        cut = time_cut(logits, params, CUT_CANDIDATES, args.rows, args.repeats)
        whole = time_cut(logits, params, vocab, args.rows, args.repeats)
        share = settled_share(logits, top_p, top_k, CUT_CANDIDATES)
        results.append({"top_p": top_p, "top_k": top_k, "candidates_ms": cut * 1e3, "whole_sort_ms": whole * 1e3,
                        "settled_share": share})
        print(f"top_p {top_p} top_k {top_k}: {cut * 1e3:.1f} ms among {CUT_CANDIDATES} candidates, "
              f"{whole * 1e3:.1f} ms sorting whole rows ({whole / cut:.2f}x); {share:.1%} of rows settled")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": args.rows, "num_logit_rows": len(logits), "settings": results},
                                        indent=2))


if __name__ == "__main__":
    main()
