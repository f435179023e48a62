"""Presence, frequency and repetition penalties on a step's logits, as vLLM applies them.

For a row whose request asks for any: the repetition penalty first, over every token of the
prompt and the output (a positive logit divided by it, any other multiplied, as in HF), then the
frequency penalty times each token's count in the output and the presence penalty once for each
token the output holds, both subtracted. The sampler draws from the penalized logits; logprobs
stay those of the raw logits.

Only the logits of tokens a row has seen change, so they are gathered, penalized and written back
for all rows at once: the work grows with the tokens seen, not with rows times the vocabulary
(a dense [rows, vocab] version took longer than a loop over the rows on a CPU). A prompt's distinct
ids never change, so the engine's processor computes them once per request (`prompt_ids`); each
step adds only the output's.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.logit_range import within_range
from scheduler.request import SamplingParams


def token_ids(tokens: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Token ids as int64 [n], those outside the vocabulary left out (a stop token id the model
    cannot produce needs no masking, nor a penalty). Left out before the tensor is built: a stop
    token id past 2**63 (any integer is one) does not fit int64, and raised in the engine thread."""
    return torch.tensor([t for t in tokens if t < vocab], dtype=torch.long, device=device)


def prompt_ids(prompt: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """The prompt's distinct token ids within the vocabulary, int64 [n]."""
    return torch.unique(token_ids(prompt, vocab, device))


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
    """logits [R, vocab]; histories[r]: (prompt ids, output ids) of row r's request. A new tensor
    when any row is penalized, else `logits` itself."""
    if not any(p.penalized for p in params):
        return logits
    vocab = logits.shape[-1]
    return penalize(logits, params, [prompt_ids(prompt, vocab, logits.device) for prompt, _ in histories],
                    [output for _, output in histories])


def penalize(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[torch.Tensor],
             outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """apply_penalties with each row's prompt as its distinct ids (prompt_ids)."""
    if not any(p.penalized for p in params):
        return logits
    penalized = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    output_ids = [token_ids(output, vocab, device) for output in outputs]
    repeated = [(r, torch.unique(torch.cat([prompts[r], output_ids[r]])))
                for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeated:
        rows, ids, factor = _pairs(repeated, [params[r].repetition_penalty for r, _ in repeated], logits)
        # Any penalty > 0 is valid, but in float32 one below ~1e-38 is 0 (or above ~3e38 inf), and
        # the division then gives inf and the sampler's softmax NaN: the factor keeps to normal
        # floats and a logit to finite ones (a masked one stays masked), so such a penalty means
        # "as strong as can be".
        limits = torch.finfo(logits.dtype)
        factor = factor.clamp(min=limits.tiny, max=limits.max)
        values = penalized[rows, ids]
        penalized[rows, ids] = within_range(torch.where(values > 0, values / factor, values * factor), values)
    counted = [(r, torch.unique(output_ids[r], return_counts=True)) for r, p in enumerate(params)
               if len(output_ids[r]) and (p.frequency_penalty or p.presence_penalty)]
    if counted:
        pairs = [(r, ids) for r, (ids, _) in counted]
        rows, ids, frequency = _pairs(pairs, [params[r].frequency_penalty for r, _ in counted], logits)
        _, _, presence = _pairs(pairs, [params[r].presence_penalty for r, _ in counted], logits)
        counts = torch.cat([row_counts for _, (_, row_counts) in counted]).to(logits.dtype)
        penalized[rows, ids] = penalized[rows, ids] - frequency * counts - presence
    return penalized


def _pairs(rows_and_ids: Sequence[tuple[int, torch.Tensor]], values: Sequence[float],
           logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token id, value) index tensors over each row's ids, values[i] repeated over row i's."""
    sizes = torch.tensor([len(ids) for _, ids in rows_and_ids], device=logits.device)
    rows = torch.tensor([r for r, _ in rows_and_ids], device=logits.device).repeat_interleave(sizes)
    per_pair = torch.tensor(values, dtype=logits.dtype, device=logits.device).repeat_interleave(sizes)
    return rows, torch.cat([ids for _, ids in rows_and_ids]), per_pair
