"""Logits processors: per-request edits of a step's logits before the sampler draws.

They run in vLLM's order: allowed token ids, min_tokens, logit bias, then the penalties
(penalties.py); temperature, min-p, top-k and top-p follow in the sampler. Each processor is a
policy object behind one seam: `wants(request)` picks its rows and `apply(logits, requests)`
returns those rows edited, batched in a few tensor operations, never a loop over the vocabulary.
The raw logits are never changed: logprobs are read from them, as vLLM's default reports them.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

import torch

from engine.penalties import apply_penalties
from scheduler.request import Request


class LogitsProcessor(Protocol):
    def wants(self, request: Request) -> bool:
        """Whether this step's logits row of `request` needs this processor."""

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """logits [R, vocab], one row per request this processor wants: the edited rows."""


def _flat_index(id_lists: Iterable[Sequence[int]], vocab: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors for each row's token ids, the ids outside the vocabulary left
    out (a stop token id the model cannot produce needs no masking)."""
    rows, ids = [], []
    for row, tokens in enumerate(id_lists):
        kept = [t for t in tokens if t < vocab]
        rows += [row] * len(kept)
        ids += kept
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(ids, dtype=torch.long, device=device))


class AllowedTokenIds:
    """vLLM's allowed_token_ids: every other token is ruled out."""

    def wants(self, request: Request) -> bool:
        return request.sampling_params.allowed_token_ids is not None

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        rows, ids = _flat_index((r.sampling_params.allowed_token_ids for r in requests), logits.shape[-1], logits.device)
        allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        allowed[rows, ids] = True
        return logits.masked_fill(~allowed, float("-inf"))


class MinTokens:
    """vLLM's min_tokens: until the output holds that many tokens, the end-of-sequence token
    (unless ignore_eos) and the stop token ids are ruled out."""

    def wants(self, request: Request) -> bool:
        return request.num_output_tokens < request.sampling_params.min_tokens

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        rows, ids = _flat_index((_stop_ids(r) for r in requests), logits.shape[-1], logits.device)
        return logits.index_put((rows, ids), torch.tensor(float("-inf"), device=logits.device))


def _stop_ids(request: Request) -> tuple[int, ...]:
    params = request.sampling_params
    eos = () if params.ignore_eos or request.eos_token_id is None else (request.eos_token_id,)
    return eos + params.stop_token_ids


class LogitBias:
    """OpenAI's logit_bias: a fixed amount added to the named tokens' logits."""

    def wants(self, request: Request) -> bool:
        return bool(request.sampling_params.logit_bias)

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        pairs = [r.sampling_params.logit_bias for r in requests]
        rows, ids = _flat_index(([token for token, _ in bias] for bias in pairs), logits.shape[-1], logits.device)
        # The engine refuses ids outside the vocabulary, so every pair has its place in `ids`.
        values = torch.tensor([value for bias in pairs for _, value in bias], dtype=logits.dtype, device=logits.device)
        return logits.index_put((rows, ids), values, accumulate=True)


class Penalties:
    """Presence, frequency and repetition penalties (penalties.py)."""

    def wants(self, request: Request) -> bool:
        return request.sampling_params.penalized

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        return apply_penalties(logits, [r.sampling_params for r in requests],
                               [(r.prompt_token_ids, r.output_token_ids) for r in requests])


DEFAULT_PROCESSORS: tuple[LogitsProcessor, ...] = (AllowedTokenIds(), MinTokens(), LogitBias(), Penalties())


def process_logits(logits: torch.Tensor, requests: Sequence[Request],
                   processors: Sequence[LogitsProcessor] = DEFAULT_PROCESSORS) -> torch.Tensor:
    """logits [R, vocab], row r the request requests[r]'s: the logits to sample from. `logits`
    itself when no processor wants any row, else a new tensor."""
    processed = logits
    for processor in processors:
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
