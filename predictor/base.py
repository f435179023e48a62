"""The predictor contract shared by training and serving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from predictor.saved import PredictorSpec


@dataclass(frozen=True)
class Prediction:
    point: float  # predicted output tokens
    p50: float
    p90: float
    # The predictor's own ranking output (lower means shorter): a lambdarank or ListMLE score, or
    # the head that ranked validation best. Not in tokens, so the scheduler cannot add aging to it.
    score: float
    # What the scheduler orders by: the output tokens of the predictor's best-ranking head among
    # those in tokens (point, p50 or p90, chosen on validation). Not always p50: a head trained on
    # labels piled at a max_tokens cap can predict the cap for every prompt at p50 while its point
    # head still ranks.
    rank_len: float


def checked_prompts(prompts: Sequence[str]) -> Sequence[str]:
    """`prompts` when it is a sequence of texts; else a TypeError that says so. A bare string is a
    sequence too: it was scored as one prompt per character, without a word, and a None among the
    prompts failed deep in a tokenizer."""
    if isinstance(prompts, str):
        raise TypeError("predict takes a list of prompt texts, got one string (pass [text])")
    bad = [type(prompt).__name__ for prompt in prompts if not isinstance(prompt, str)]
    if bad:
        raise TypeError(f"predict takes a list of prompt texts, got a {bad[0]} among them")
    return prompts


class Predictor(Protocol):
    kind: str
    spec: PredictorSpec  # what it was trained on, as its folder records it

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        """`prompts` are the chat-templated prompt texts exactly as the served model sees them
        (checked_prompts: a TypeError for anything else)."""
        ...
