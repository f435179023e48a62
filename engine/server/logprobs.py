"""Logprobs in OpenAI's two response shapes, from the engine's TokenLogprobs.

Completions (the legacy API): {"tokens", "token_logprobs", "top_logprobs", "text_offset"},
parallel lists with one entry per generated token (after one per prompt token when the prompt
is echoed, the first with null values); each top_logprobs entry is a dict of token text
to logprob holding the likeliest alternatives and the sampled token (as vLLM lists it; where two
of them decode to one text, the likelier value stays). Chat: {"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}.

Every generated token gets an entry, the one that stopped the request included (it counts in
usage, as vLLM counts it). A token's text is its own decoding: a token holding part of a UTF-8
character reads as U+FFFD, and a special token as its name. So text_offset, the running sum of
those texts' lengths (as vLLM computes it), indexes the completion's text only until such a token.
`bytes` are the token's own bytes (byte-level BPE pieces mapped back to bytes), so a client can
rebuild a character split over tokens, as OpenAI intends them. vLLM's prompt_logprobs: per prompt
token, null for the first, else {token id: {"logprob", "rank", "decoded_token"}}.

Plain dicts, not pydantic models: a reply of thousands of tokens with twenty alternatives each
would spend seconds validating objects.
"""

from __future__ import annotations

from typing import Any, Sequence

from scheduler.output import TokenLogprobs


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's), character -> byte: printable bytes stand for
    themselves, and the other 68 (controls, space, ...) for the code points from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    alphabet = {chr(byte): byte for byte in printable}
    others = [byte for byte in range(256) if chr(byte) not in alphabet]
    alphabet.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return alphabet


def _is_byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class LogprobsFormatter:
    """Turns TokenLogprobs into response dicts; each id's text and bytes are worked out once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._alphabet = byte_level_alphabet() if _is_byte_level(tokenizer) else None
        self._texts: dict[int, str] = {}  # bounded by the vocabulary
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id) if self._alphabet else None
            if piece and all(char in self._alphabet for char in piece):
                raw = [self._alphabet[char] for char in piece]
            else:  # not byte-level, or an added token written as plain text
                raw = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = raw
        return raw

    def completion(self, entries: Sequence[TokenLogprobs], text_offset: int = 0) -> dict[str, Any]:
        """`text_offset`: where the first entry's text starts (a stream's later chunks continue)."""
        tokens = [self.text(entry.token_id) for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries],
                "top_logprobs": [self._top_dict(entry) for entry in entries], "text_offset": offsets}

    def echoed_completion(self, prompt_ids: Sequence[int], prompt_entries: Sequence[TokenLogprobs | None],
                          entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """Completions' logprobs with the prompt's tokens first (echo), the first of them with a
        null logprob and null alternatives, as vLLM gives them."""
        tokens = [self.text(token_id) for token_id in prompt_ids]
        offsets = []
        text_offset = 0
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        generated = self.completion(entries, text_offset)
        prompt_values = [None if e is None else e.logprob for e in prompt_entries]
        prompt_tops = [None if e is None else self._top_dict(e) for e in prompt_entries]
        return {"tokens": tokens + generated["tokens"], "token_logprobs": prompt_values + generated["token_logprobs"],
                "top_logprobs": prompt_tops + generated["top_logprobs"],
                "text_offset": offsets + generated["text_offset"]}

    def prompt(self, entries: Sequence[TokenLogprobs | None]) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob,
        rank, decoded_token}} for the prompt's token and the likeliest alternatives."""
        return [None if entry is None else self._ranked(entry) for entry in entries]

    def _ranked(self, entry: TokenLogprobs) -> dict[str, dict[str, Any]]:
        ranked = {str(entry.token_id): self._vllm_logprob(entry.token_id, entry.logprob, entry.rank)}
        for index, (token_id, logprob) in enumerate(entry.top):
            ranked.setdefault(str(token_id), self._vllm_logprob(token_id, logprob, index + 1))
        return ranked

    def _vllm_logprob(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.text(token_id)}

    def _top_dict(self, entry: TokenLogprobs) -> dict[str, float]:
        top: dict[str, float] = {}
        for token_id, logprob in sorted([*entry.top, (entry.token_id, entry.logprob)], key=lambda t: -t[1]):
            top.setdefault(self.text(token_id), logprob)
        return top

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return {"content": [{**self._top(entry.token_id, entry.logprob),
                             "top_logprobs": [self._top(token, value) for token, value in entry.top]}
                            for entry in entries], "refusal": None}

    def _top(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token_id), "logprob": logprob, "bytes": self.token_bytes(token_id)}


def end_of_text_offset(logprobs: dict[str, Any] | None, start: int) -> int:
    """Where the text after these entries starts: the next stream chunk's first offset."""
    if logprobs is None or not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
