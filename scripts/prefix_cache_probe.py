"""Multi-turn chats through the engine with and without prefix caching, in one run (SmolLM2, CPU).

The first --conversations ShareGPT test conversations with --turns turns whose prompts (the chat
template over the conversation so far, as the turn table holds them) stay within
--max-prompt-tokens are replayed in waves, as chat clients send them: wave k is every
conversation's turn k, sent once wave k - 1 has finished, each request greedy with --max-tokens
output tokens (ignore_eos). Turn k's prompt starts with turn k - 1's, so with the cache it finds
that prefix; every prompt also shares the template's system prompt. Prints each configuration's
time per wave and prefill tokens fed, checks that both give the same tokens, and writes JSON and a
plot of the waves' times.

    python scripts/prefix_cache_probe.py [--conversations 16] [--turns 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from engine.arg_types import positive_int, prepare_output_file_or_exit


def conversations(count: int, turns: int, max_prompt_tokens: int) -> list[list[str]]:
    """Prompts of turns 0..turns-1 of the first `count` test conversations that have them all."""
    import pyarrow.parquet as pq

    rows = pq.read_table("data/sharegpt_turns/test.parquet",
                         columns=["conversation_id", "turn_index", "prompt", "prompt_tokens"]).to_pylist()
    by_conversation: dict[str, dict[int, dict]] = defaultdict(dict)
    for row in rows:
        by_conversation[row["conversation_id"]][row["turn_index"]] = row
    chosen = []
    for turns_of in by_conversation.values():
        wanted = [turns_of.get(index) for index in range(turns)]
        if all(row is not None and row["prompt_tokens"] <= max_prompt_tokens for row in wanted):
            chosen.append([row["prompt"] for row in wanted])
        if len(chosen) == count:
            break
    return chosen


def replay(waves: list[list[list[int]]], max_tokens: int, enable_prefix_caching: bool) -> dict:
    from engine.llm import LLM
    from scheduler.request import SamplingParams

    llm = LLM(scheduler_options={"enable_prefix_caching": enable_prefix_caching})
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    times, tokens = [], []
    for wave in waves:
        start = time.perf_counter()
        outputs = llm.generate(wave, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens.append([list(output.token_ids) for output in outputs])
    stats = llm.engine.stats().scheduler
    prompt_tokens = sum(len(prompt) for wave in waves for prompt in wave)
    cached = stats.prefix_cache_hits or 0
    return {"enable_prefix_caching": enable_prefix_caching, "wave_times_s": times, "total_s": sum(times),
            "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached, "prefill_tokens_fed": prompt_tokens - cached,
            "tokens": tokens}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    for offset, run in zip((-width / 2, width / 2), runs):
        waves = range(len(run["wave_times_s"]))
        label = "prefix caching" if run["enable_prefix_caching"] else "no cache"
        axis.bar([w + offset for w in waves], run["wave_times_s"], width, label=label)
    axis.set_xlabel("wave (turn of every conversation)")
    axis.set_ylabel("seconds")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=positive_int, default=16)
    parser.add_argument("--turns", type=positive_int, default=3)
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=768)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prepare_output_file_or_exit(parser, args.json, "--json")  # before minutes of replay, not after them
    from transformers import AutoTokenizer

    from predictor.paths import SERVED_MODEL_REF

    tokenizer = AutoTokenizer.from_pretrained(SERVED_MODEL_REF)
    chats = conversations(args.conversations, args.turns, args.max_prompt_tokens)
    if not chats:
        parser.error("no test conversation has that many turns within --max-prompt-tokens")
    waves = [[tokenizer.encode(chat[turn], add_special_tokens=False) for chat in chats] for turn in range(args.turns)]
    runs = [replay(waves, args.max_tokens, enabled) for enabled in (False, True)]
    same = runs[0]["tokens"] == runs[1]["tokens"]
    for run in runs:
        name = "prefix caching" if run["enable_prefix_caching"] else "no cache"
        waves_text = ", ".join(f"{t:.1f}" for t in run["wave_times_s"])
        print(f"{name}: {run['total_s']:.1f} s (waves {waves_text} s), prefill fed {run['prefill_tokens_fed']:,} "
              f"of {run['prompt_tokens']:,} prompt tokens")
    print(f"{len(chats)} conversations x {args.turns} turns: no cache / prefix caching "
          f"{runs[0]['total_s'] / runs[1]['total_s']:.2f}x; same tokens: {same}")
    if args.json is not None:
        summary = {"conversations": len(chats), "turns": args.turns, "max_tokens": args.max_tokens, "same_tokens": same,
                   "runs": [{k: v for k, v in run.items() if k != "tokens"} for run in runs]}
        args.json.write_text(json.dumps(summary, indent=2))
        plot(runs, args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
