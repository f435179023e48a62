"""Prompts with output-length labels: ShareGPT's (ChatGPT's replies) or the served model's trace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from training import dataset

LabelSource = Literal["sharegpt", "trace"]
LABEL_SOURCES: tuple[LabelSource, ...] = ("sharegpt", "trace")


@dataclass(frozen=True)
class LabelledSplit:
    prompts: list[str]
    lengths: np.ndarray  # output tokens, int64 [N]
    in_train: np.ndarray  # bool [N]: the prompt text also occurs in the train split
    prompt_tokens: np.ndarray  # int64 [N]

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, rows: np.ndarray) -> "LabelledSplit":
        return LabelledSplit([self.prompts[i] for i in rows], self.lengths[rows], self.in_train[rows],
                             self.prompt_tokens[rows])


def load_split(split: str, labels: LabelSource = "sharegpt",
               without_conversations: frozenset[str] = frozenset()) -> LabelledSplit:
    """One split's labelled prompts, less the turns of `without_conversations` (base ids)."""
    if labels == "sharegpt":
        table, length_column = dataset.load_turns(split), "response_tokens"
    elif labels == "trace":
        from training import trace

        table, length_column = trace.load_trace(split), "output_tokens"
    else:
        raise ValueError(f"labels must be one of {LABEL_SOURCES}, got {labels!r}")
    if without_conversations:
        table = table.filter(lambda c: c not in without_conversations, input_columns="conversation_id")
    return LabelledSplit(
        prompts=list(table["prompt"]),
        lengths=np.asarray(table[length_column], dtype=np.int64),
        in_train=np.asarray(table["in_train"], dtype=bool),
        prompt_tokens=np.asarray(table["prompt_tokens"], dtype=np.int64),
    )


def subsample(split: LabelledSplit, limit: int | None, seed: int = 0) -> LabelledSplit:
    """A seeded random subset of at most `limit` rows (the whole split when limit is None)."""
    if limit is None or limit >= len(split):
        return split
    rows = np.sort(np.random.default_rng(seed).choice(len(split), size=limit, replace=False))
    return split.subset(rows)


def trace_hash() -> str:
    from training import trace

    return trace.trace_hash()


def trace_conversations() -> frozenset[str]:
    """Base ids of every conversation the trace took a prompt from (all its splits)."""
    from training import trace

    return frozenset(trace.load_trace()["conversation_id"])


def trace_hold_out() -> str:
    """What a predictor trained without the trace's conversations records as `held_out`."""
    return f"trace:{trace_hash()}"
