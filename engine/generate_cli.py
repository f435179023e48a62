"""`lengthwise generate`: run a few prompts through the offline API and print the completions.

Prompts are user messages wrapped in the model's chat template unless `--raw` is given.
"""

from __future__ import annotations

import argparse
import json
import logging

from engine.arg_types import (non_negative_float, positive_float, positive_int, sampling_seed, stop_string, top_k,
                              top_p)
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.outputs import CompletionOutput
from scheduler.request import has_utf8_form


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+",
                        help="one or more user messages, each wrapped in the model's chat template (see --raw)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="converted model folder (default: %(default)s)")
    parser.add_argument("--raw", action="store_true", help="feed the prompts as they are, no chat template")
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="default %(default)s")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="default %(default)s: greedy (vLLM's default is 1.0)")
    parser.add_argument("--top-p", type=top_p, default=1.0, help="default %(default)s (off)")
    parser.add_argument("--top-k", type=top_k, default=0, help="default %(default)s (off; -1 too)")
    parser.add_argument("--seed", type=sampling_seed, default=None, help="default: none")
    parser.add_argument("--n", type=positive_int, default=1,
                        help="completions per prompt, choice i seeded --seed + i (default %(default)s; "
                             "at the default greedy temperature the choices are alike)")
    parser.add_argument("--stop", type=stop_string, action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    parser.add_argument("--kv-cache-memory", type=positive_float, default=1.0, metavar="GIB",
                        help="GiB for the KV cache (default %(default)s)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048,
                        help="the longest prompt plus output (default %(default)s)")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                        help="default %(default)s: Triton on a GPU, else the torch reference")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")


def run(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from scheduler.request import SamplingParams

    if args.raw and not all(args.prompts):  # templated, an empty message still has tokens; raw, none
        raise ValueError("--raw: a prompt must not be empty")
    bad = [index for index, prompt in enumerate(args.prompts, 1) if not has_utf8_form(prompt)]
    if bad:  # argv's bytes that are not UTF-8 come as lone surrogates, which the tokenizer refuses
        raise ValueError(f"prompt {bad[0]} is not valid UTF-8 text")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.n > 1 and args.temperature == 0:
        logging.getLogger(__name__).warning("--n %d at temperature 0: greedy choices are all alike "
                                            "(--temperature above 0 draws distinct ones)", args.n)
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    llm = LLM(config=EngineConfig(model=args.model, kv_cache_memory_gib=args.kv_cache_memory,
                                  max_model_len=args.max_model_len, attention_backend=args.attention_backend))
    prompts = args.prompts if args.raw else [
        llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompts]
    for prompt, output in zip(args.prompts, llm.generate(prompts, params, use_tqdm=False)):
        for choice in output.outputs:
            _print_completion(prompt, choice, args.n, args.json)
    return 0


def _print_completion(prompt: str, choice: CompletionOutput, n: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"prompt": prompt, "index": choice.index, "text": choice.text,
                          "num_tokens": len(choice.token_ids), "finish_reason": choice.finish_reason}))
    else:
        heading = prompt if n == 1 else f"{prompt} (choice {choice.index})"
        print(f"### {heading}\n{choice.text}\n[{len(choice.token_ids)} tokens, {choice.finish_reason}]\n")
