"""Token sampling: greedy, temperature, min-p, top-k, top-p, with per-request seeds.

Rows with a temperature below 1e-5 take the argmax. The other rows are scaled by their
temperature; min-p then drops the tokens less likely than min_p times the likeliest (as vLLM
orders them), and top-k and top-p are applied together on one descending sort (top-p keeps the
smallest prefix whose mass reaches p, and always the first token). A token is drawn by inverse
CDF: one uniform number per row, located in the row's cumulative probabilities. (The exponential
race, argmax of p / E with E ~ Exp(1), needs a random number per vocabulary entry: about 1 ms a
row on a CPU, a fifth of a decode step.)

A request that brings a seed draws the token at position p from a generator seeded with a hash of
(seed, p): a pure function of the request and the position, with no state kept between steps. So
its random numbers depend neither on the rest of the batch, nor on a preemption, nor on a step that
drew and then failed and was run again, and there is nothing to free when it finishes. Its tokens
can still differ between runs: the logits of a batched forward differ in their last bits with the
batch's shape, and a uniform number that falls at a boundary of the cumulative probabilities then
picks the neighbouring token (1-3 in 80 seeded requests at temperature 1 in a stress test; greedy
tokens matched). Requests without
a seed draw from the engine's one generator. Numbers are drawn on the CPU (a few a step) and sent
to the logits' device in one copy.
"""

from __future__ import annotations

from typing import Sequence

import torch

from scheduler.output import TokenLogprobs
from scheduler.request import SamplingParams

# JSON has no -inf; vLLM reports a token the model rules out at this value too.
LOGPROB_FLOOR = -9999.0


_MASK64 = 2**64 - 1


def _splitmix64(value: int) -> int:
    """A 64-bit mixing function: nearby inputs give unrelated outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at `position`: 32 bits, all that torch's
    CPU generator (mt19937) keeps of a seed."""
    return _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64) & 0xFFFFFFFF


class Sampler:
    def __init__(self, seed: int) -> None:
        self._engine_generator = torch.Generator().manual_seed(seed)
        self._position_generator = torch.Generator()  # reseeded for every seeded draw

    def _uniform(self, params: SamplingParams, position: int) -> torch.Tensor:
        # float64: a float32 uniform is a multiple of 2**-24, so tokens whose cumulative interval
        # is narrower than that (most of a 49k vocabulary at temperature 1) would be drawn with
        # probability 0 or 2**-24 instead of their own.
        generator = self._engine_generator
        if params.seed is not None:
            generator = self._position_generator
            generator.manual_seed(position_seed(params.seed, position))
        return torch.rand((), dtype=torch.float64, generator=generator)

    def sample(self, logits: torch.Tensor, positions: Sequence[int], params: Sequence[SamplingParams]) -> list[int]:
        """logits float32 [R, vocab], one row per request; `positions` [R]: where each row's new
        token goes in its sequence (prompt and output tokens before it). One token id per row."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            chosen = [params[i] for i in random_rows]
            probs = _filtered_probs(logits[random_rows], chosen)
            uniforms = torch.stack([self._uniform(params[row], positions[row]) for row in random_rows])
            tokens[random_rows] = inverse_cdf(probs, uniforms.to(logits.device))
        return tokens.tolist()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   counts: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Per row of logits [R, vocab]: the log-probability and rank of tokens[r] and the counts[r]
    likeliest tokens, or None where counts[r] is None. Read from the raw logits, as vLLM's default reports
    them and whatever the row's temperature or top-p: the model's distribution, not the sampler's."""
    rows = [r for r, count in enumerate(counts) if count is not None]
    results: list[TokenLogprobs | None] = [None] * len(counts)
    if not rows:
        return results
    logprobs = logits[rows].float().log_softmax(dim=-1).clamp(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(-1, torch.tensor([[tokens[r]] for r in rows], device=logits.device))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    widest = max(counts[r] for r in rows)
    top_values, top_ids = logprobs.topk(widest, dim=-1) if widest else (logprobs[:, :0], logprobs[:, :0].long())
    # One copy to the host per tensor (on a GPU, one sync each), then plain lists.
    chosen_list, rank_list = chosen.squeeze(-1).tolist(), ranks.tolist()
    value_rows, id_rows = top_values.tolist(), top_ids.tolist()
    for index, row in enumerate(rows):
        top = tuple(zip(id_rows[index][:counts[row]], value_rows[index][:counts[row]]))
        results[row] = TokenLogprobs(tokens[row], chosen_list[index], top, rank_list[index])
    return results


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of probs [R, V], the token whose cumulative interval holds uniforms[r] in [0, 1).

    The first index whose cumulative probability exceeds the target, so a token of probability 0
    is never picked. Cumulated in float64: 49k float32 additions would shift the interval ends.
    """
    cdf = probs.double().cumsum(dim=-1)
    targets = uniforms.double()[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    return picked.clamp(max=probs.shape[-1] - 1)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p, [R, vocab]."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temperature
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        ratio = torch.tensor([p.min_p for p in params], device=device)[:, None]
        logits = logits.masked_fill(probs < ratio * probs.amax(dim=-1, keepdim=True), float("-inf"))
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if all(k == 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits.softmax(dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([min(k, logits.shape[-1]) if k > 0 else logits.shape[-1] for k in top_k],
                     device=device)[:, None]
    # Every token tied with the k-th logit stays, as in vLLM and HF: cutting at rank k would let
    # the sort's order pick among the tied ones (common in bf16).
    drop = sorted_logits < sorted_logits.gather(-1, k - 1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p 1 means no cut: in float32 the mass before the last tokens can round up to 1.0, so a
    # row without top-p must not be compared at all (it shares this path with top-k rows).
    thresholds = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=device)[:, None]
    drop |= mass_before >= thresholds
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)
