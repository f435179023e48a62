"""Incremental detokenization and stop strings.

Decoding a single new token is not enough: byte-level BPE may split a character over several
tokens, and some tokenizers drop a leading space at the start of a decode. So each step decodes a
short window (a few tokens before the unread ones plus the new ones) and keeps only the text beyond
the window's already-emitted prefix; a trailing U+FFFD means an unfinished character, and the
tokens wait for the next step (after the last token it is kept, as a full decode shows it). The
window starts with a few prompt tokens for the same reason.

A stop string is searched only where it could newly end: in the text from len(stop) - 1
characters before this step's new text. The text is cut where a stop string begins (or, with
vLLM's include_stop_str_in_output, where it ends). While a request with stop strings runs, its last
(longest stop - 1) characters are held back from the released text, so a stream never shows the
start of a stop string that later completes; a request that keeps its stop string in the text
needs no hold-back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PROMPT_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerState:
    token_ids: list[int]  # a few prompt tokens, then every output token
    prefix_offset: int  # start of the decode window
    read_offset: int  # tokens before this one are already in `text`
    text: str = ""
    released: int = 0  # characters of `text` already handed out
    skip_special_tokens: bool = True  # as vLLM's SamplingParams: special tokens' names left out

    @classmethod
    def for_prompt(cls, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> "DetokenizerState":
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        return cls(token_ids=context, prefix_offset=0, read_offset=len(context),
                   skip_special_tokens=skip_special_tokens)


def emitted_length(prefix: str, full: str) -> int:
    """Characters of `full` that the window's read tokens already account for.

    Normally all of `prefix`. A prompt given as token ids may end inside a character: its window
    then decodes to a trailing U+FFFD that the first output tokens turn into a real character. That
    character ends in the output, so it is the output's text (the prompt's bytes alone were never
    shown), and it is counted from where the U+FFFD began."""
    if full.startswith(prefix):
        return len(prefix)
    common = len(os.path.commonprefix([prefix, full]))
    return common if set(prefix[common:]) == {"\ufffd"} else len(prefix)


def append_tokens(tokenizer, state: DetokenizerState, new_token_ids: list[int], final: bool = False) -> str:
    """Add tokens; returns the text they complete (possibly empty). With `final` (the request has
    ended) an unfinished character is taken as decoded, U+FFFD included, as a full decode shows it,
    so the text that came with it is not lost."""
    state.token_ids.extend(new_token_ids)
    skip = state.skip_special_tokens
    prefix = tokenizer.decode(state.token_ids[state.prefix_offset:state.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(state.token_ids[state.prefix_offset:], skip_special_tokens=skip)
    start = emitted_length(prefix, full)
    if len(full) <= start or (full.endswith("\ufffd") and not final):
        return ""
    new_text = full[start:]
    state.prefix_offset, state.read_offset = state.read_offset, len(state.token_ids)
    state.text += new_text
    return new_text


def find_stop(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[int, int] | None:
    """(begin, end) of the earliest stop string newly found in `text` (the shortest of those
    beginning there), or None. Earliest, not first in the list as vLLM takes them: the text
    returned must hold no stop string, and a later-listed one may begin before the first."""
    found = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index >= 0 and (found is None or (index, index + len(stop)) < found):
            found = (index, index + len(stop))
    return found


def advance(tokenizer, state: DetokenizerState, new_token_ids: list[int], stops: tuple[str, ...],
            final: bool = False, keep_stop: bool = False) -> str | None:
    """Decode new tokens into `state.text`; the stop string that matched, if one did (the text
    cut before it, or after it with `keep_stop`)."""
    new_text = append_tokens(tokenizer, state, new_token_ids, final)
    if stops and new_text:
        found = find_stop(state.text, len(new_text), stops)
        if found is not None:
            matched = state.text[found[0]:found[1]]
            state.text = state.text[:found[1] if keep_stop else found[0]]
            return matched
    return None


def release(state: DetokenizerState, stops: tuple[str, ...], finished: bool, keep_stop: bool = False) -> str:
    """Text that may be shown now and was not shown before."""
    hold = 0 if finished or not stops or keep_stop else max(len(stop) for stop in stops) - 1
    visible = len(state.text) - hold
    if visible <= state.released:
        return ""
    new_text = state.text[state.released:visible]
    state.released = visible
    return new_text
