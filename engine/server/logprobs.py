"""Logprobs in OpenAI's two response shapes, from the engine's TokenLogprobs.

Completions (the legacy API) give parallel lists: each token's text, its logprob, a dict of the
likeliest alternatives (the sampled token included, as vLLM includes it) and where the token's text
starts in the completion. Chat gives one object per token with its UTF-8 bytes and a list of the
`top_logprobs` likeliest alternatives. Every generated token gets an entry, the one that stopped
the request included (it counts in usage, as vLLM counts it), so a token's text is its own
decoding, which may be a replacement character where a token holds part of a UTF-8 character.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel

from scheduler.output import TokenLogprobs


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # the alternatives and the sampled token
    text_offset: list[int]  # where each token's text starts in the completion's text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class LogprobsFormatter:
    """Turns TokenLogprobs into response objects; token texts are decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # bounded by the vocabulary

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def completion(self, entries: Sequence[TokenLogprobs], text_offset: int = 0) -> CompletionLogprobs:
        """`text_offset`: where the first entry's text starts (a stream's later chunks continue)."""
        tokens = [self.text(entry.token_id) for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[entry.logprob for entry in entries], text_offset=offsets,
            top_logprobs=[{**{self.text(t): v for t, v in entry.top}, self.text(entry.token_id): entry.logprob}
                          for entry in entries])

    def chat(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            TokenLogprob(**self._top(entry.token_id, entry.logprob).model_dump(),
                         top_logprobs=[self._top(token, value) for token, value in entry.top])
            for entry in entries])

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def end_of_text_offset(logprobs: CompletionLogprobs | None, start: int) -> int:
    """Where the text after these entries starts: the next stream chunk's first offset."""
    if logprobs is None or not logprobs.tokens:
        return start
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
