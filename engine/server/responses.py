"""Response bodies of the OpenAI-compatible API (whole replies, stream chunks, usage, models,
errors), as pydantic models in OpenAI's key order."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # found in the prefix cache, as OpenAI reports them


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prefix-caching

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class _ResponseHead(BaseModel):
    """What every response object and stream chunk carries, in OpenAI's key order (a subclass's
    override keeps its place). `created` is taken once per request, shared by every chunk of a
    stream (serving.py)."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: UsageInfo | None = None
    service_tier: str | None = None
    system_fingerprint: None = None  # as vLLM: no fingerprint of the backend configuration


class _TokenIds(BaseModel):
    """vLLM's `return_token_ids` fields, `prompt_token_ids` and `token_ids`: in a reply only when
    set (when asked for; a stream sends a choice's prompt ids in its first chunk alone), so a
    client that did not ask sees no new keys."""

    @model_serializer(mode="wrap")
    def _leave_out_unset_token_ids(self, handler):
        data = handler(self)
        for key in ("prompt_token_ids", "token_ids"):
            if key in data and data[key] is None:
                del data[key]
        return data


class CompletionChoice(_TokenIds):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None  # engine/server/logprobs.py gives its shape
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended a "stop" (none for end of sequence).
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (vLLM's), as the model read it
    token_ids: list[int] | None = None  # likewise: the choice's tokens (a stream chunk's new ones)


class CompletionReplyChoice(CompletionChoice):
    """A choice of a whole (not streamed) reply: vLLM's shape, with its prompt logprobs."""

    # logprobs.py gives its shape: list[dict[str, dict[str, Any]] | None]. Any, because pydantic
    # would validate every entry again for each choice (a 1,000-token prompt with 20
    # alternatives and n=4: about 0.2 s).
    prompt_logprobs: Any = None


class CompletionResponse(_ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionReply(CompletionResponse):
    """A whole (not streamed) reply. Its own class, because pydantic serializes a field by its
    declared type: CompletionReplyChoice's extra field would be dropped from a CompletionResponse."""

    choices: list[CompletionReplyChoice]


class ChatMessageOut(BaseModel):
    role: str = "assistant"  # the final message's, when it was continued (ChatTemplateFields.reply_role)
    content: str


class ChatChoice(_TokenIds):
    index: int = 0
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's, as in completions
    token_ids: list[int] | None = None  # with return_token_ids, as in completions


class ChatCompletionResponse(_ResponseHead, _TokenIds):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: Any = None  # vLLM's, as in completions
    prompt_token_ids: list[int] | None = None  # with return_token_ids: the templated prompt's, once


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_TokenIds):
    index: int = 0
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's, as in completions
    token_ids: list[int] | None = None  # with return_token_ids: the chunk's new tokens


class ChatCompletionChunk(_ResponseHead, _TokenIds):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in each choice's opening chunk


class ModelPermission(BaseModel):
    """vLLM's permission entry of a model card (OpenAI's legacy field), with vLLM's values: tools
    that read a card's fields find them."""

    id: str = Field(default_factory=lambda: new_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=now_s)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "lengthwise"
    root: str | None = None  # vLLM's: the model path the weights were loaded from
    parent: str | None = None  # vLLM's: the base model of an adapter (none here)
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
