"""Presence, frequency and repetition penalties on a step's logits, as vLLM applies them.

For a row whose request asks for any: the repetition penalty first, over every token of the
prompt and the output (a positive logit divided by it, any other multiplied, as in HF), then the
frequency penalty times each token's count in the output and the presence penalty once for each
token the output holds, both subtracted. The sampler draws from the penalized logits; logprobs
stay those of the raw logits. Rows are penalized one at a time: few requests ask, and each costs a
few vocabulary-long vector operations.
"""

from __future__ import annotations

from typing import Sequence

import torch

from scheduler.request import SamplingParams


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
    """logits [R, vocab]; histories[r]: (prompt ids, output ids) of row r's request. A new tensor
    when any row is penalized, else `logits` itself."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    penalized = logits.clone()
    for r in rows:
        prompt, output = histories[r]
        penalized[r] = _penalize(penalized[r], params[r], prompt, output)
    return penalized


def _penalize(row: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    vocab = row.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[torch.tensor([*prompt, *output], dtype=torch.long, device=row.device)] = True
        scaled = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row = torch.where(seen, scaled, row)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=row.device), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(row.dtype)
    return row
