"""Size limits that refuse oversized input before it costs anything, and the vocabulary's bound
on token ids.

A text prompt longer than any tokenization of max_model_len tokens could spell is refused without
being tokenized (tokenizing megabytes would hold the one tokenizer thread, and every request behind
it), and a request body larger than any request that fits the context gets a 413 before it is read
whole.
"""

from __future__ import annotations

from typing import Any

from engine.server import errors


def longest_token_lengths(tokenizer: Any) -> tuple[int, int]:
    """The longest vocabulary entries, in characters and in UTF-8 bytes of their pieces (the
    vocabulary read once: tens of milliseconds at start-up for 49k entries).

    No token stands for more characters of text than its piece has: a byte-level BPE piece spells
    each byte it stands for as one character (and a character of text takes at least one byte), a
    SentencePiece piece spells a space as "▁" and a fallback byte as "<0xNN>", and an added token
    is its own text. So a text of more than max_model_len * longest characters cannot fit; nor,
    piece character by character, does one of more bytes than max_model_len * longest bytes. (Text
    the tokenizer drops makes a prompt's tokens fewer, so such a prompt may be refused though it
    would fit, never the other way round. SmolLM2's tokenizer drops six control characters it has
    no byte token for, U+0004, U+0006, U+0013, U+0014, U+0016 and U+001D, so only a text made
    mostly of them is refused wrongly; it has no normalizer that deletes characters and fuses no
    unknown characters into one <unk>.)"""
    pieces = [piece or "" for piece in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
    return max(len(piece) for piece in pieces), max(len(piece.encode("utf-8")) for piece in pieces)


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    """Refuses (400 naming `param`) token ids outside the vocabulary."""
    if any(not 0 <= i < vocab_size for i in ids):
        raise errors.invalid_field(param, f"{param}: token ids must lie in [0, {vocab_size})")


def check_text_length(text: str, param: str, max_model_len: int, max_token_chars: int) -> None:
    """Refuses (400 context_length_exceeded), without tokenizing it, a text too long to fit the
    context however it tokenizes."""
    limit = max_model_len * max_token_chars
    if len(text) > limit:
        raise errors.context_exceeded(param, f"This model's maximum context length is {max_model_len} "
                                      f"tokens; the {param} came to {len(text)} characters, more than "
                                      f"{max_model_len} tokens can hold ({limit}).")


def default_body_limit(max_model_len: int, max_token_bytes: int) -> int:
    """A request body size no request of one prompt that can fit the context reaches (a
    completions batch of many long prompts may: `serve --max-body-bytes` raises the limit).

    A prompt that fits has at most max_model_len * max_token_bytes bytes of UTF-8 text (see
    longest_token_lengths), and JSON spends at most 6 bytes on one byte of it (a control
    character as \\u0000); 8x leaves room for the rest of the body. The 1 MiB floor keeps tiny
    test contexts from refusing ordinary bodies."""
    return max(1 << 20, 8 * max_model_len * max_token_bytes)


class BodyLimitMiddleware:
    """Refuses a request body over `max_bytes` with a 413: by its Content-Length before anything
    reads it, or, for a body sent in chunks without one, as soon as the bytes read pass the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await errors.request_too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise errors.BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
