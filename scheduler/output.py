"""What the scheduler hands the model runner each step, and what comes back.

Plain frozen dataclasses: the scheduler never touches tensors, the runner never decides who runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    # Tokens to feed this step: a prefill chunk (many) or the last sampled token (one).
    token_ids: tuple[int, ...]
    # Position of token_ids[0] in the sequence; equals the request's num_computed_tokens.
    start_position: int
    # The request's whole block table after this step's allocation (logical -> physical).
    block_ids: tuple[int, ...]
    # True when this chunk reaches the end of the known tokens, so a next token is sampled.
    sample: bool


@dataclass(frozen=True)
class SchedulerOutput:
    # In batch order; the runner returns one sampled token per chunk with sample=True.
    chunks: tuple[ScheduledChunk, ...]
    # Requests preempted this step (recompute or swap). The runner keeps no per-request state
    # (a seeded draw depends only on seed and position), so these and `finished_ids` are for
    # observers such as tests and logs.
    preempted_ids: tuple[str, ...]
    # Requests that finished or were aborted since the previous step.
    finished_ids: tuple[str, ...]
    # (device block, host block) pairs to copy out before the forward (swap preemption).
    swap_out: tuple[tuple[int, int], ...]
    # (host block, device block) pairs to copy in before the forward (swap resumption).
    swap_in: tuple[tuple[int, int], ...]
    # Sum of len(chunk.token_ids); never above max_num_batched_tokens.
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the likeliest alternatives at its position, under
    the model's own distribution (before temperature, top-k and top-p)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), likeliest first; as many as asked
    rank: int | None = None  # of token_id in the vocabulary, 1 the likeliest; ties share the worst, as in vLLM


@dataclass(frozen=True)
class PromptLogprobs:
    """A prefill chunk's share of a prompt's logprobs: entries[i] is the prompt token at position
    first_position + i, given the tokens before it."""

    first_position: int
    entries: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class ModelRunnerOutput:
    # One sampled token per request whose chunk had sample=True.
    sampled_token_ids: dict[str, int]
    # For the sampled requests that asked for logprobs; the scheduler ignores them.
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # For the prefill chunks of requests that asked for prompt logprobs (a recomputed prefill
    # repeats positions already sent); the scheduler ignores them.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
