"""Token sampling: greedy, temperature, min-p, top-k, top-p, with per-request seeds.

Rows with temperature 0 take the argmax (a positive temperature below 0.01 is raised to 0.01, as
vLLM raises it: SamplingParams). The other rows are scaled by their temperature; min-p then drops
the tokens less likely than min_p times the likeliest (as vLLM orders them), and top-k and top-p
are applied together on one descending order, ties by token id (top-p keeps the smallest prefix
whose mass reaches p, and always the first token): among each row's 1,024 likeliest tokens (a
partial sort), and over the whole row sorted only where the cut may lie beyond them. A token is
drawn by inverse CDF: one uniform number per row, located in the row's cumulative probabilities.
(The exponential race, argmax of p / E with E ~ Exp(1), needs a random number per vocabulary entry:
about 1 ms a row on a CPU, a fifth of a decode step.)

A request that brings a seed draws the token at position p from a generator seeded with a hash of
(seed, p): a pure function of the request and the position, with no state kept between steps. So
its random numbers depend neither on the rest of the batch, nor on a preemption, nor on a step that
drew and then failed and was run again, and there is nothing to free when it finishes. Its tokens
can still differ between runs: the logits of a batched forward differ in their last bits with the
batch's shape, and a uniform number that falls at a boundary of the cumulative probabilities then
picks the neighbouring token (1-3 in 80 seeded requests at temperature 1 in a stress test; greedy
tokens matched). Under top-p, top-k or min-p that noise can also move the cut by one token, and
renormalising the row then shifts every boundary by that token's probability (1 of 17 such
differences in a later fuzz of 2,095 engine configurations). Requests without
a seed draw from the engine's one generator. Numbers are drawn on the CPU (a few a step) and sent
to the logits' device in one copy.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.logit_range import within_range
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
    ranks = (logprobs >= chosen).sum(dim=-1)  # as vLLM ranks: a tie takes the worse place
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


# Tokens a top-k / top-p cut is looked for among first: a partial sort of 1,024 of 49k logits
# takes an eighth of a full sort on a CPU, and on SmolLM2's own logits at temperature 1 the cut
# lies among them in 98.1% of rows for top-p 0.9 and 90.3% for 0.95 (scripts/sampler_cut_probe.py);
# the rows whose cut lies beyond are sorted whole.
CUT_CANDIDATES = 1024


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                    candidates: int = CUT_CANDIDATES) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p, [R, vocab]."""
    device = logits.device
    # A temperature past float32's range (any value >= 0 is valid, as in vLLM) would be inf, and a
    # masked logit then -inf / inf = NaN: sampled as the last token id whatever the mask allowed.
    largest = torch.finfo(logits.dtype).max
    temperature = torch.tensor([min(p.temperature, largest) for p in params], dtype=logits.dtype,
                               device=device)[:, None]
    logits = within_range(logits / temperature, logits)  # a logit at the float range stays finite
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        ratio = torch.tensor([p.min_p for p in params], device=device)[:, None]
        logits = logits.masked_fill(probs < ratio * probs.amax(dim=-1, keepdim=True), float("-inf"))
    probs = logits.softmax(dim=-1)
    vocab = logits.shape[-1]
    cut_rows = [r for r, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if not cut_rows:
        return probs
    cut = [params[r] for r in cut_rows]
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in cut], device=device)[:, None]
    # top_p 1 means no cut: in float32 the mass before the last tokens can round up to 1.0, so a
    # row without top-p must not be compared at all (it shares this path with top-k rows).
    thresholds = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in cut], device=device)[:, None]
    index = torch.tensor(cut_rows, device=device)
    cut_probs = probs[index]
    kept = _kept_tokens(logits[index], cut_probs, k, thresholds, min(candidates, vocab))
    cut_probs = cut_probs.masked_fill(~kept, 0.0)
    # Rows without a cut keep their softmax to the last bit, whatever shares their batch.
    return probs.index_copy(0, index, cut_probs / cut_probs.sum(dim=-1, keepdim=True))


def _kept_tokens(logits: torch.Tensor, probs: torch.Tensor, k: torch.Tensor, thresholds: torch.Tensor,
                 width: int) -> torch.Tensor:
    """bool [R, vocab]: the tokens top-k (k [R, 1], the vocabulary size for none) and then top-p
    (thresholds [R, 1], inf for none) keep; looked for among each row's `width` likeliest tokens,
    and on the whole row sorted where the cut may lie beyond them."""
    vocab = logits.shape[-1]
    values, order = _likeliest(logits, width)
    drop, settled = _cut_in_order(values, probs.gather(-1, order), k, thresholds, vocab)
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, ~drop)
    unsettled = (~settled).nonzero().flatten()
    if len(unsettled):
        values, order = _likeliest(logits[unsettled], vocab)
        drop, _ = _cut_in_order(values, probs[unsettled].gather(-1, order), k[unsettled], thresholds[unsettled], vocab)
        kept[unsettled] = torch.zeros_like(drop).scatter(-1, order, ~drop)
    return kept


def _likeliest(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` largest logits and their token ids, descending, ties by ascending id: an
    order that depends on the row alone, never on the sort's algorithm or the batch."""
    if width == logits.shape[-1]:
        return logits.sort(dim=-1, descending=True, stable=True)
    ids = logits.topk(width, dim=-1).indices.sort(dim=-1).values
    values, order = logits.gather(-1, ids).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _cut_in_order(values: torch.Tensor, probs: torch.Tensor, k: torch.Tensor, thresholds: torch.Tensor,
                  vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut over each row's W likeliest tokens in descending order (values [R, W], and their
    probabilities over the whole row): (drop [R, W], settled [R]). A row is settled when no token
    past these W can be kept, so that its cut is the whole row's."""
    width = values.shape[-1]
    kth = values.gather(-1, k.clamp(max=width) - 1)
    # Every token tied with the k-th logit stays, as in vLLM and HF: cutting at rank k would let
    # the sort's order pick among the tied ones (common in bf16).
    drop = values < kth
    survivors = probs.masked_fill(drop, 0.0)
    has_top_k = k < vocab
    # top-p reads the mass after top-k: over top-k's survivors, else over the whole row.
    mass = survivors / torch.where(has_top_k, survivors.sum(dim=-1, keepdim=True), torch.ones_like(kth))
    mass_before = mass.cumsum(dim=-1) - mass
    drop |= mass_before >= thresholds
    drop[:, 0] = False
    if width == vocab:
        return drop, torch.ones(len(values), dtype=torch.bool, device=values.device)
    # Settled: top-k's survivors all lie here (the last of these tokens is below the k-th; a tie
    # with it could go on past them), and the kept tokens end above the last of these, so a token
    # past them has at least the mass before it that the first dropped one has.
    top_k_inside = ~has_top_k | (values[:, -1:] < kth)
    last_kept = values.gather(-1, (~drop).sum(dim=-1, keepdim=True) - 1)
    return drop, (top_k_inside & (last_kept > values[:, -1:])).flatten()
