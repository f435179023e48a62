"""The predictor contract shared by training and serving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Prediction:
    point: float  # predicted output tokens
    p50: float
    p90: float
    # The predictor's own ranking output (lower means shorter): a lambdarank or ListMLE score, or
    # the head that ranked validation best. The scheduler orders by p50 instead, which is in
    # tokens so that aging can be added to it; evaluation reports the tau of both.
    score: float


class Predictor(Protocol):
    kind: str

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        """`prompts` are the chat-templated prompt texts exactly as the served model sees them."""
        ...
