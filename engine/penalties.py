"""Presence, frequency and repetition penalties on a step's logits, as vLLM applies them.

For a row whose request asks for any: the repetition penalty first, over every token of the
prompt and the output (a positive logit divided by it, any other multiplied, as in HF), then the
frequency penalty times each token's count in the output and the presence penalty once for each
token the output holds, both subtracted. The sampler draws from the penalized logits; logprobs
stay those of the raw logits.

Only the logits of tokens a row has seen change, so they are gathered, penalized and written back
for all rows at once: the work grows with the tokens seen, not with rows times the vocabulary
(a dense [rows, vocab] version took longer than a loop over the rows on a CPU).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from scheduler.request import SamplingParams


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
    """logits [R, vocab]; histories[r]: (prompt ids, output ids) of row r's request. A new tensor
    when any row is penalized, else `logits` itself."""
    if not any(p.penalized for p in params):
        return logits
    penalized = logits.clone()
    vocab = logits.shape[-1]
    repeated = [(r, sorted({t for t in (*prompt, *output) if t < vocab}))
                for r, (p, (prompt, output)) in enumerate(zip(params, histories)) if p.repetition_penalty != 1.0]
    if repeated:
        rows, ids = _index(repeated, logits.device)
        factor = _per_pair([params[r].repetition_penalty for r, _ in repeated], repeated, logits)
        values = penalized[rows, ids]
        penalized[rows, ids] = torch.where(values > 0, values / factor, values * factor)
    counted = [(r, Counter(t for t in output if t < vocab)) for r, (p, (_, output)) in enumerate(zip(params, histories))
               if output and (p.frequency_penalty or p.presence_penalty)]
    if counted:
        rows, ids = _index([(r, list(counts)) for r, counts in counted], logits.device)
        counts = torch.tensor([n for _, row_counts in counted for n in row_counts.values()],
                              dtype=logits.dtype, device=logits.device)
        frequency = _per_pair([params[r].frequency_penalty for r, _ in counted], counted, logits)
        presence = _per_pair([params[r].presence_penalty for r, _ in counted], counted, logits)
        penalized[rows, ids] = penalized[rows, ids] - frequency * counts - presence
    return penalized


def _index(rows_and_ids: Sequence[tuple[int, Sequence[int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [r for r, ids in rows_and_ids for _ in ids]
    ids = [t for _, row_ids in rows_and_ids for t in row_ids]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(ids, dtype=torch.long, device=device)


def _per_pair(values: Sequence[float], rows_and_ids: Sequence[tuple[int, Sequence[int]]],
              logits: torch.Tensor) -> torch.Tensor:
    """values[i], one per row, repeated for each of that row's (row, token) pairs."""
    sizes = torch.tensor([len(ids) for _, ids in rows_and_ids], device=logits.device)
    return torch.tensor(values, dtype=logits.dtype, device=logits.device).repeat_interleave(sizes)
