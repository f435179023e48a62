"""The predictor contract shared by training and serving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Prediction:
    point: float  # predicted output tokens
    p50: float
    p90: float
    score: float  # what the scheduler ranks by; lower means shorter


class Predictor(Protocol):
    kind: str

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        """`prompts` are the chat-templated prompt texts exactly as the served model sees them."""
        ...
