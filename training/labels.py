"""Prompts with output-length labels: ShareGPT's (ChatGPT's replies) or the served model's trace."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

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
    # bool [N]: the reply was cut at the trace's token cap, so its length is only a lower bound
    # (ShareGPT's replies are whole: all False).
    censored: np.ndarray

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, rows: np.ndarray) -> "LabelledSplit":
        return LabelledSplit([self.prompts[i] for i in rows], self.lengths[rows], self.in_train[rows],
                             self.prompt_tokens[rows], self.censored[rows])


@dataclass(frozen=True)
class HeldOut:
    """Rows a model must not train on: whole conversations (base ids) and, since ShareGPT repeats
    prompt texts across conversations ("hi", "continue"), every copy of some prompts (by
    `training.trace.prompt_key`)."""

    conversations: frozenset[str] = field(default_factory=frozenset)
    prompt_keys: frozenset[str] = field(default_factory=frozenset)

    def keeps(self, conversation_id: str, prompt: str) -> bool:
        from training.trace import prompt_key

        return conversation_id not in self.conversations and prompt_key(prompt) not in self.prompt_keys


def load_split(split: str, labels: LabelSource = "sharegpt", held_out: HeldOut | None = None) -> LabelledSplit:
    """One split's labelled prompts, less the rows `held_out` names."""
    if labels == "sharegpt":
        table, length_column = dataset.load_turns(split), "response_tokens"
    elif labels == "trace":
        from training import trace

        table, length_column = trace.load_trace(split), "output_tokens"
    else:
        raise ValueError(f"labels must be one of {LABEL_SOURCES}, got {labels!r}")
    if held_out is not None:
        table = table.filter(held_out.keeps, input_columns=["conversation_id", "prompt"])
    return LabelledSplit(
        prompts=list(table["prompt"]),
        lengths=np.asarray(table[length_column], dtype=np.int64),
        in_train=np.asarray(table["in_train"], dtype=bool),
        prompt_tokens=np.asarray(table["prompt_tokens"], dtype=np.int64),
        # A trace records why each reply ended; a ShareGPT reply ended on its own.
        censored=(np.asarray(table["finish_reason"]) == "length" if labels == "trace"
                  else np.zeros(len(table), dtype=bool)),
    )


def seen_in_training(split: LabelledSplit, spec) -> np.ndarray:
    """bool [N]: whether the prompt text occurs in a train split whose labels the predictor
    learned. `spec` is its PredictorSpec: its own labels' split, and a stacked prior's. ShareGPT's
    train split counts without the trace's prompts when that model held them out (`held_out`);
    the trace's train split holds none of its test prompts. (Against ShareGPT's alone, a
    trace-trained predictor lost 29 trace test prompts it never saw.)"""
    seen = np.zeros(len(split), dtype=bool)
    for labels, held_out in _learned_label_sets(spec):
        seen |= _prompts_seen(labels, split, held_out)
    return seen


def last_message_seen_in_training(split: LabelledSplit, spec) -> np.ndarray:
    """bool [N]: whether the prompt's last user message occurs as the last user message of a
    prompt in those train splits (`seen_in_training`). Stricter: "continue" after any history
    matches, and a predictor reading only the last message could have memorized it."""
    seen = np.zeros(len(split), dtype=bool)
    for labels, held_out in _learned_label_sets(spec):
        seen |= _last_message_in(split.prompts, _train_prompts(labels, held_out))
    return seen


def _learned_label_sets(spec) -> list[tuple[str, str]]:
    """(labels, held_out) of every model whose training went into the predictor."""
    learned = [(spec.labels, spec.held_out)]
    prior = spec.feature_spec.get("prior")
    if prior is not None:
        learned.append((prior["labels"], prior.get("held_out", "")))
    return learned


def _held_out(held_out: str) -> HeldOut | None:
    """What a model trained without: the trace's conversations and every copy of its prompts for
    "trace:HASH", else nothing. HASH must be the trace's now: a trace extended since would count
    prompts the model learned (their ShareGPT train copies) as held out, and flatter its dedup
    figures."""
    if not held_out.startswith("trace:"):
        return None
    if held_out != trace_held_out_tag():
        raise ValueError(f"the predictor held out the trace {held_out.removeprefix('trace:')}, and the "
                         f"trace is now {trace_hash()}: which prompts it learned is unknown, so its dedup "
                         "is too; retrain it with --hold-out-trace")
    return trace_held_out()


def _train_prompts(labels: str, held_out: str) -> list[str]:
    """The prompts of the train split of `labels` that the model learned."""
    from training import trace

    if labels == "trace":
        return list(trace.load_trace("train")["prompt"])
    return _sharegpt_train_prompts(_held_out(held_out))


def _sharegpt_train_prompts(held: HeldOut | None) -> list[str]:
    """ShareGPT's train prompts less `held`: with the trace held out, those `load_split` keeps,
    outside the trace's conversations as well as its prompts."""
    table = dataset.load_turns("train")
    if held is None:
        return list(table["prompt"])
    return [p for c, p in zip(table["conversation_id"], table["prompt"]) if held.keeps(c, p)]


def _prompts_seen(labels: str, split: LabelledSplit, held_out: str) -> np.ndarray:
    """Whether each of `split`'s prompts is in the train split of `labels`, as the model learned it.
    A prompt whose only train copies lie in a held-out conversation (another turn of one the trace
    drew from) was not learned: checking the trace's prompts alone counted 305 of 6,768 test
    prompts seen that such a model never trained on."""
    from training import trace

    if labels == "trace":
        keys = set(trace.load_trace("train")["key"])
        return np.asarray([trace.prompt_key(p) in keys for p in split.prompts], dtype=bool)
    held = _held_out(held_out)
    if held is None:
        return split.in_train.copy()  # both tables flag prompts against ShareGPT's train split
    learned = set(_sharegpt_train_prompts(held))
    return np.asarray([p in learned for p in split.prompts], dtype=bool)


def last_message_in_train(prompts: list[str]) -> np.ndarray:
    """bool [N]: the prompt's last user message occurs verbatim as the last user message of a
    ShareGPT train split prompt."""
    return _last_message_in(prompts, _train_prompts("sharegpt", ""))


def _last_message_in(prompts: Sequence[str], train_prompts: Sequence[str]) -> np.ndarray:
    from predictor.features import parse_prompt

    seen = {parse_prompt(prompt).request for prompt in train_prompts}
    return np.asarray([parse_prompt(prompt).request in seen for prompt in prompts], dtype=bool)


def subsample(split: LabelledSplit, limit: int | None, seed: int = 0) -> LabelledSplit:
    """A seeded random subset of at most `limit` rows (the whole split when limit is None)."""
    if limit is None or limit >= len(split):
        return split
    rows = np.sort(np.random.default_rng(seed).choice(len(split), size=limit, replace=False))
    return split.subset(rows)


def trace_hash() -> str:
    from training import trace

    return trace.trace_hash()


def trace_held_out() -> HeldOut:
    """Every conversation the trace took a prompt from, and every copy of its prompts (all splits)."""
    from training import trace

    table = trace.load_trace()
    return HeldOut(frozenset(table["conversation_id"]), frozenset(table["key"]))


def trace_held_out_tag() -> str:
    """What a predictor trained without the trace's conversations records as `held_out`."""
    return f"trace:{trace_hash()}"


def trace_cv_folds(prompts: Sequence[str], num_folds: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train rows, held rows) folds over trace prompts (the scripts pool train and validation), the
    one definition the trace scripts share. Whole conversations go to one fold: a later turn's
    prompt holds the earlier turns word for word, so row folds let a model recognise a
    conversation it trained on (rows folds had scored 1,531 of 4,201 pooled prompts that way)."""
    from sklearn.model_selection import GroupKFold

    from training import trace

    table = trace.load_trace()
    conversation_of = dict(zip(table["key"], table["conversation_id"]))
    groups = [conversation_of[trace.prompt_key(prompt)] for prompt in prompts]
    return list(GroupKFold(num_folds).split(np.arange(len(prompts)), groups=groups))
