"""Logits processors: per-request edits of a step's logits before the sampler draws.

They run in vLLM's order: allowed token ids, bad words, min_tokens, logit bias, then the penalties
(penalties.py); temperature, min-p, top-k and top-p follow in the sampler. Each processor is a
policy object behind one seam: `wants(request)` picks its rows and `apply(logits, requests)`
returns those rows edited, batched in a few tensor operations, never a loop over the vocabulary.
The raw logits are never changed: logprobs are read from them, as vLLM's default reports them.

What a processor derives from a request's fixed parameters (the allowed ids, the bias, the
prompt's distinct ids) is built once, as tensors, and kept while the request comes back step
after step (RequestTensors): rebuilding 40k allowed ids from Python every step cost 11 ms. Each
model runner owns its processors (`default_processors()`), so no state is shared between engines.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from engine.penalties import penalize, prompt_ids, token_ids
from scheduler.request import Request


class LogitsProcessor(Protocol):
    def wants(self, request: Request) -> bool:
        """Whether this step's logits row of `request` needs this processor."""

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """logits [R, vocab], one row per request this processor wants: the edited rows."""


class RequestTensors:
    """Tensors built from each request's fixed parameters by `build(request, vocab, device)`, kept
    for the requests of the last call only: a finished request's go with the step after its
    last, and one that skips a step (preempted, waiting) builds them again when it returns."""

    def __init__(self, build: Callable[[Request, int, torch.device], tuple[torch.Tensor, ...]]) -> None:
        self._build = build
        self._kept: dict[str, tuple[Request, tuple[torch.Tensor, ...]]] = {}

    def of(self, requests: Sequence[Request], vocab: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        kept = {}
        for request in requests:
            entry = self._kept.get(request.request_id)
            # A reused request id is another Request, even with the same parameters object: the
            # penalties' tensors come from its prompt, not from its parameters.
            if entry is None or entry[0] is not request:
                entry = (request, self._build(request, vocab, device))
            kept[request.request_id] = entry
        self._kept = kept
        return [kept[request.request_id][1] for request in requests]


def _flat_index(id_rows: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors over each row's ids."""
    sizes = torch.tensor([len(ids) for ids in id_rows], device=device)
    rows = torch.arange(len(id_rows), device=device).repeat_interleave(sizes)
    return rows, torch.cat(list(id_rows)) if id_rows else torch.empty(0, dtype=torch.long, device=device)


class AllowedTokenIds:
    """vLLM's allowed_token_ids: every other token is ruled out."""

    def __init__(self) -> None:
        self._allowed = RequestTensors(
            lambda request, vocab, device: (token_ids(request.sampling_params.allowed_token_ids, vocab, device),))

    def wants(self, request: Request) -> bool:
        return request.sampling_params.allowed_token_ids is not None

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        id_rows = [ids for (ids,) in self._allowed.of(requests, logits.shape[-1], logits.device)]
        rows, ids = _flat_index(id_rows, logits.device)
        allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        allowed[rows, ids] = True
        return logits.masked_fill(~allowed, float("-inf"))


class BadWords:
    """vLLM's bad words: the last token of each word (a token id sequence) is ruled out wherever
    the output ends with the word's other tokens, as vLLM matches them (the output alone)."""

    def wants(self, request: Request) -> bool:
        return bool(request.sampling_params.bad_words_token_ids)

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        vocab, device = logits.shape[-1], logits.device
        rows, ids = _flat_index([token_ids(_completing_tokens(r), vocab, device) for r in requests], device)
        return logits.index_put((rows, ids), torch.tensor(float("-inf"), device=device))


def _completing_tokens(request: Request) -> list[int]:
    """The tokens that would complete one of the request's bad words now."""
    output = request.output_token_ids
    found = []
    for word in request.sampling_params.bad_words_token_ids:
        before = len(word) - 1
        if before <= len(output) and tuple(output[len(output) - before:]) == word[:-1]:
            found.append(word[-1])
    return found


class MinTokens:
    """vLLM's min_tokens: until the output holds that many tokens, the end-of-sequence tokens and
    the stop token ids are ruled out (the end tokens under ignore_eos too, as vLLM rules them out:
    a fixed-length benchmark's reply holds none)."""

    def wants(self, request: Request) -> bool:
        return request.num_output_tokens < request.sampling_params.min_tokens

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        vocab, device = logits.shape[-1], logits.device
        rows, ids = _flat_index([token_ids(_stop_ids(r), vocab, device) for r in requests], device)
        return logits.index_put((rows, ids), torch.tensor(float("-inf"), device=device))


def _stop_ids(request: Request) -> tuple[int, ...]:
    eos = () if request.eos_token_id is None else (request.eos_token_id,)
    return eos + request.extra_eos_token_ids + request.sampling_params.stop_token_ids


class LogitBias:
    """OpenAI's logit_bias: a fixed amount added to the named tokens' logits."""

    def __init__(self) -> None:
        self._bias = RequestTensors(_bias_tensors)

    def wants(self, request: Request) -> bool:
        return bool(request.sampling_params.logit_bias)

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        pairs = self._bias.of(requests, logits.shape[-1], logits.device)
        rows, ids = _flat_index([ids for ids, _ in pairs], logits.device)
        values = torch.cat([values for _, values in pairs]).to(logits.dtype)
        return logits.index_put((rows, ids), values, accumulate=True)


def _bias_tensors(request: Request, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # The engine refuses ids outside the vocabulary, so every pair keeps its place.
    bias = [(token, value) for token, value in request.sampling_params.logit_bias if token < vocab]
    return (torch.tensor([t for t, _ in bias], dtype=torch.long, device=device),
            torch.tensor([v for _, v in bias], dtype=torch.float32, device=device))


class Penalties:
    """Presence, frequency and repetition penalties (penalties.py)."""

    def __init__(self) -> None:
        self._prompts = RequestTensors(lambda r, vocab, device: (prompt_ids(r.prompt_token_ids, vocab, device),))

    def wants(self, request: Request) -> bool:
        return request.sampling_params.penalized

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        prompts = [ids for (ids,) in self._prompts.of(requests, logits.shape[-1], logits.device)]
        return penalize(logits, [r.sampling_params for r in requests], prompts, [r.output_token_ids for r in requests])


def default_processors() -> tuple[LogitsProcessor, ...]:
    """A fresh set, in vLLM's order, for one model runner."""
    return (AllowedTokenIds(), BadWords(), MinTokens(), LogitBias(), Penalties())


def process_logits(logits: torch.Tensor, requests: Sequence[Request],
                   processors: Sequence[LogitsProcessor] | None = None) -> torch.Tensor:
    """logits [R, vocab], row r the request requests[r]'s: the logits to sample from. `logits`
    itself when no processor wants any row, else a new tensor. Without `processors`, a fresh
    default set (which keeps nothing between calls)."""
    processed = logits
    for processor in default_processors() if processors is None else processors:
        rows = [r for r, request in enumerate(requests) if processor.wants(request)]
        if not rows:
            continue
        if len(rows) == len(requests):
            processed = processor.apply(processed, requests)
        else:
            index = torch.tensor(rows, device=logits.device)
            edited = processor.apply(processed[index], [requests[r] for r in rows])
            processed = processed.index_copy(0, index, edited)
    return processed
