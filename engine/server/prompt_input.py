"""How a request's prompt is read: tokenized on the one tokenizer thread (a plain prompt with the
tokenizer's special tokens, a chat through its template), bounded before it is tokenized,
truncated as vLLM truncates, and checked against the context. A mixin of `OpenAIServing`
(serving.py), whose attributes it reads.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from engine.server import errors
from engine.server.chat_protocol import ChatCompletionRequest
from engine.server.chat_template import render_chat
from engine.server.limits import check_text_length, check_token_ids
from engine.server.protocol import CompletionRequest


class PromptInput:
    """The prompt side of `OpenAIServing`: the attributes below are its."""

    tokenizer: Any
    max_model_len: int
    max_token_chars: int
    # Tokenizing a long prompt takes milliseconds of CPU; done on the event loop it would stall
    # every other stream. One thread, because a HF fast tokenizer shared between threads can
    # fail with "Already borrowed" while it sets its padding and truncation state.
    _tokenize_pool: ThreadPoolExecutor | None

    def close(self) -> None:
        """Stop the tokenizer thread; a later request (a new lifespan) starts another."""
        pool, self._tokenize_pool = self._tokenize_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, function: Callable, *args: Any) -> Any:
        """function(*args) on the tokenizer thread (the one thread that may touch the tokenizer)."""
        if self._tokenize_pool is None:
            self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lengthwise-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, function, *args)

    def _render_chat(self, body: ChatCompletionRequest, messages: list[dict[str, str]],
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        prompt_text = render_chat(self.tokenizer, messages, body, tools)
        self._check_untruncated_text(body, prompt_text, "messages")
        return prompt_text, self._encode(prompt_text, body.add_special_tokens)

    def _check_untruncated_text(self, body: CompletionRequest | ChatCompletionRequest, text: str, param: str) -> None:
        """A text too long for any tokenization to fit the context is refused before it is
        tokenized, unless it is to be truncated (then the body's size limit bounds the work)."""
        if body.truncate_prompt_tokens is None:
            check_text_length(text, param, self.max_model_len, self.max_token_chars)
        self._check_truncation(body)

    def _check_truncation(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """vLLM's answer to a truncation longer than the context: kept whole, such a prompt could
        never fit, and the text was tokenized first for nothing."""
        if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens > self.max_model_len:
            raise errors.invalid_field("truncate_prompt_tokens", f"truncate_prompt_tokens: "
                                       f"{body.truncate_prompt_tokens} is more than max_model_len "
                                       f"{self.max_model_len}; send a smaller truncation size, or -1")

    async def _truncated(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                         prompt_text: str | None, prompt_param: str) -> tuple[list[int], str]:
        """The prompt as the model will see it: vLLM's truncate_prompt_tokens keeps its last N
        tokens (-1: max_model_len), cut from the left as vLLM cuts by default, or its first N with
        truncation_side "right". Its text (for echo and the length predictor) is decoded from the
        ids when they were given as ids or cut; the context is checked before that decode."""
        self._check_truncation(body)  # prompts given as ids come here untokenized
        keep = body.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if len(prompt_ids) > keep:
                kept = prompt_ids[:keep] if body.truncation_side == "right" else prompt_ids[-keep:]
                prompt_ids, prompt_text = kept, None
        if prompt_text is None:
            self._check_context(len(prompt_ids), None, prompt_param, "max_tokens")
            prompt_text = await self.off_loop(self.tokenizer.decode, prompt_ids)
        return prompt_ids, prompt_text

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def _completion_prompt(self, body: CompletionRequest, prompt: str | list[int]) -> tuple[list[int], str]:
        """One prompt of a completion request as (ids, text), checked and truncated."""
        if isinstance(prompt, str):
            self._check_untruncated_text(body, prompt, "prompt")
            prompt_ids, prompt_text = await self.off_loop(self._encode, prompt, body.add_special_tokens), prompt
        else:
            check_token_ids(prompt, len(self.tokenizer), "prompt")
            prompt_ids, prompt_text = list(prompt), None
        return await self._truncated(body, prompt_ids, prompt_text, "prompt")

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, as vLLM tokenizes them: as the word would start the text,
        and also as it would follow a space where that gives other tokens of the same count (a
        word in the middle of the text)."""
        found = []
        for word in words:
            bare = self._encode(word.lstrip(), False)
            spaced = self._encode(" " + word.lstrip(), False)
            if bare:
                found.append(tuple(bare))
            if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                found.append(tuple(spaced))
        return tuple(found)

    def _check_context(self, num_prompt: int, max_tokens: int | None, prompt_param: str,
                       max_tokens_param: str) -> int:
        """The max_tokens to use; raises context_length_exceeded when prompt + output cannot fit."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise errors.context_exceeded(prompt_param, f"This model's maximum context length is {limit} "
                                          f"tokens; the {prompt_param} came to {num_prompt} tokens.")
        if max_tokens is None:
            return limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise errors.context_exceeded(max_tokens_param, f"This model's maximum context length is {limit} "
                                          f"tokens; you requested {num_prompt + max_tokens} ({num_prompt} "
                                          f"in the {prompt_param}, {max_tokens} for the completion).")
        return max_tokens
