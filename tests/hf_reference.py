"""Reference tokens from HF transformers for the engine tests, and shared helpers (not a test
module)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=2)
def hf_model(model_dir):
    """The checkpoint in HF transformers, eager attention, float32: loaded once per folder (the
    references only read it)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(model_dir, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Reference tokens: HF eager attention, one prompt at a time, eos ignored."""
    model = hf_model(model_dir)
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            for _ in range(num_tokens - 1):
                out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            results.append(tokens)
    return results


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in lengths]


def stop_string_past_the_middle(text: str, length: int) -> str:
    """A visible substring of `text` whose first occurrence starts in its second half, so cutting
    at it keeps a real prefix (a stop found at the start would leave an empty text to compare)."""
    for start in range(len(text) // 2, len(text) - length + 1):
        candidate = text[start:start + length]
        if candidate.strip() and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no stop string of {length} characters first occurs past the middle of {text!r}")


def hf_logprobs(model_dir, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Reference log-probabilities [len(generated), vocab]: HF eager attention over prompt and
    generated tokens at once (teacher forcing); row i is the distribution generated[i] came from."""
    model = hf_model(model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]
    return logits.float().log_softmax(dim=-1)


def hf_greedy_penalized(model_dir, prompt: list[int], num_tokens: int, *, repetition: float = 1.0,
                        frequency: float = 0.0, presence: float = 0.0) -> list[int]:
    """Reference greedy tokens under penalties: HF's own repetition-penalty processor over prompt
    and output, then OpenAI's frequency and presence penalties over the output, counted here."""
    from transformers import RepetitionPenaltyLogitsProcessor

    model = hf_model(model_dir)
    repeat = RepetitionPenaltyLogitsProcessor(repetition) if repetition != 1.0 else None
    ids, output = list(prompt), []
    with torch.inference_mode():
        for _ in range(num_tokens):
            scores = model(torch.tensor([ids])).logits[:, -1].float()
            if repeat is not None:
                scores = repeat(torch.tensor([ids]), scores)
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=scores.shape[-1]).float()
            scores = scores - frequency * counts - presence * (counts > 0).float()
            output.append(int(scores[0].argmax()))
            ids.append(output[-1])
    return output


def hf_greedy_processed(model_dir, prompt: list[int], num_tokens: int, *, stop_ids: list[int],
                        min_tokens: int = 0, logit_bias: dict[int, float] | None = None,
                        allowed: list[int] | None = None, bad_words: list[list[int]] | None = None) -> list[int]:
    """Reference greedy tokens through HF's own logits processors: allowed tokens (prefix
    constrained), bad words (HF matches them over prompt and output: a test keeps the prompt's end
    out of them), the minimum new tokens before any of `stop_ids`, a per-token bias; the output
    ends at the first stop id generated (kept, as the engine keeps it) or after num_tokens."""
    from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                              PrefixConstrainedLogitsProcessor, SequenceBiasLogitsProcessor)

    processors = LogitsProcessorList()
    if allowed is not None:
        processors.append(PrefixConstrainedLogitsProcessor(lambda batch_id, ids: allowed, num_beams=1))
    if bad_words:
        processors.append(NoBadWordsLogitsProcessor(bad_words))
    if min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, stop_ids))
    if logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[token], bias] for token, bias in logit_bias.items()]))
    model = hf_model(model_dir)
    ids, output = list(prompt), []
    with torch.inference_mode():
        while len(output) < num_tokens and not (output and output[-1] in stop_ids):
            scores = processors(torch.tensor([ids]), model(torch.tensor([ids])).logits[:, -1].float())
            output.append(int(scores[0].argmax()))
            ids.append(output[-1])
    return output
