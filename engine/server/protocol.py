"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests validate every field the server acts on, so a bad value fails as a 400 naming the field
(see errors.py). Unknown fields are ignored, as vLLM does, so newer clients keep working. Known
fields the server cannot honour (best_of, tools
and functions, JSON mode and guided decoding, beam search, a request's own chat template, non-text
content or output) are refused with a 400 unless they carry their neutral value, rather than
silently dropped: a client would otherwise get other output than it asked for, and no signal.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from engine.server.text_check import lone_surrogate_at
from engine.server.unsupported import ChatUnsupportedFields, CompletionUnsupportedFields
from scheduler.request import MAX_LOGPROBS, PENALTY_LIMIT, PRIORITY_LIMIT, SEED_MAX, SEED_MIN

MAX_STOP_STRINGS = 64
MAX_BAD_WORDS = 128  # vLLM's bound too
# Choices per request: each is an engine request of its own, so the bound keeps one request from
# filling the seats (OpenAI allows 128).
MAX_CHOICES = 16
# Prompts in one completions batch, and sequences (prompts x n) in all: each is an engine request.
MAX_BATCH_PROMPTS = 256
MAX_BATCH_SEQUENCES = 256

# apply_chat_template's own parameters, and the conversation's name inside the template: a
# template variable of these names would change how the prompt is rendered or returned (token
# ids, tensors, truncation) rather than what the template says, so a request may not set them
# through chat_template_kwargs (the request's own fields set the two switches; vLLM lets the
# kwargs override them and `tools`, which here is a 400 naming the field instead).
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})

# OpenAI's service_tier values and the scheduler tier names they map to (see app.py).
ServiceTier = Literal["auto", "default", "flex", "priority"]


def null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
    """A "before" validator: OpenAI's API (and its clients) take an explicit null as "not set"."""
    return cls.model_fields[info.field_name].default if value is None else value


def valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
    """A "before" validator: a lone UTF-16 surrogate (JSON allows "\\ud800") is no text a tokenizer takes."""
    where = lone_surrogate_at(value, info.field_name)
    if where is not None:
        raise ValueError(f"not valid Unicode text: a lone UTF-16 surrogate in {where}")
    return value


def not_a_bool(cls, value: Any, info: ValidationInfo) -> Any:
    """A "before" validator for a number: JSON true is not 1 (pydantic's lax mode would take it)."""
    if isinstance(value, bool):
        raise ValueError(f"{info.field_name} takes a number, not {str(value).lower()}")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens).
    continuous_usage_stats: bool = False

    _null_is_the_default = field_validator("include_usage", "continuous_usage_stats",
                                           mode="before")(classmethod(null_is_the_default))


class _Request(CompletionUnsupportedFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN: "not finite", not a bound's message

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)  # None: the rest of the context (chat)
    temperature: float = Field(default=1.0, ge=0.0)  # no upper bound, as vLLM (OpenAI stops at 2)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM's extra
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # 64 bits, signed or not
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # vLLM's extra, HF's definition
    service_tier: ServiceTier | None = None
    user: str | None = None
    # vLLM extras.
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) stays in the text
    skip_special_tokens: bool = True  # False: special tokens' names stay in the text
    # Keep only the prompt's last N tokens (-1: the last max_model_len), as vLLM truncates.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = Field(default=0, ge=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)  # lower is served first
    top_k: int = Field(default=-1, ge=-1)  # -1 (vLLM) or 0: disabled
    # Strict: JSON true is not token id 1. (Ids beyond the vocabulary can never be sampled, so they
    # never stop anything; the prompt's ids are checked against the vocabulary in serving.py.)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    min_tokens: int = Field(default=0, ge=0)  # no stop before this many tokens
    # Each prompt token's logprob with this many alternatives (not streamed, as in vLLM).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Token ids the model may generate (the engine checks them against the vocabulary).
    allowed_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(default=None, min_length=1)
    # vLLM's: words the output may not end with (the last token of each is ruled out after the rest).
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    # OpenAI's: token id (a string, as JSON keys are) -> a bias added to its logit, clamped to [-100, 100].
    logit_bias: dict[str, float] | None = None
    _null_is_the_default = field_validator("max_tokens", "temperature", "top_p", "n", "stream", "ignore_eos",
                                           "include_stop_str_in_output", "skip_special_tokens",
                                           "priority", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                           "repetition_penalty", "min_tokens",
                                           mode="before")(classmethod(null_is_the_default))
    _numbers_are_not_bools = field_validator("n", "min_p", "presence_penalty", "frequency_penalty",
                                             "repetition_penalty", "min_tokens", "prompt_logprobs",
                                             "truncate_prompt_tokens", mode="before")(classmethod(not_a_bool))

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_keeps_a_token(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1, or -1 for the model's context length")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_are_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available with stream: true")
        return value

    def requested_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs."""
        return self.prompt_logprobs

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _biases_are_numbers(cls, bias: Any) -> Any:
        if isinstance(bias, dict) and any(isinstance(value, bool) for value in bias.values()):
            raise ValueError("logit_bias maps token ids to numbers, not to true or false")
        return bias

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        return bias

    def token_logit_bias(self) -> dict[int, float]:
        """SamplingParams.logit_bias: the bias keyed by token id."""
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    _valid_unicode = field_validator("*", mode="before")(classmethod(valid_unicode))

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")  # as OpenAI and vLLM answer
        return options

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        values = [stop] if isinstance(stop, str) else (stop or [])
        if any(not value for value in values):
            raise ValueError("stop strings must not be empty")
        # OpenAI takes at most 4, vLLM any number, and evaluation harnesses send longer lists. Every
        # step searches each one, so there is a bound all the same.
        if len(values) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stop

    def usage_in_stream(self) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage on every chunk), as stream_options ask."""
        options = self.stream_options
        include = bool(options and options.include_usage)
        return include, include and options.continuous_usage_stats

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(the field the client set the output limit with, its value)."""
        return "max_tokens", self.max_tokens

    def requested_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None for none, else how many alternatives per token."""
        raise NotImplementedError

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Request):
    # A text, token ids, or a batch of them (a list of texts or of id lists, as lm-eval sends):
    # prompt i's choice j is choice i * n + j of the reply, as OpenAI and vLLM number them. A
    # one-prompt batch is that prompt.
    prompt: str | list[StrictInt] | list[str | list[StrictInt]] = Field(min_length=1)
    # OpenAI's legacy completions and vLLM's CompletionRequest default to 16 tokens, and clients
    # written against them (lm-eval, benchmarks) rely on it; chat's default is the rest of the context.
    # 0 scores the prompt alone: with echo (and logprobs), as vLLM and the legacy API serve it.
    max_tokens: int = Field(default=16, ge=0)
    suffix: Literal[""] | None = None
    # The legacy API's form: a count of alternatives per token (0: the sampled token's alone).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    top_logprobs: Any = None  # chat's field: refused here, so it is not silently ignored
    # The prompt's text before each choice's (decoded, for a prompt of token ids).
    echo: bool = False

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_a_count(cls, value: Any) -> Any:
        if value is False:
            return None  # clients send the chat form's "off" here too
        if value is True:
            raise ValueError(f"completions take logprobs as a count of alternatives, 0 to {MAX_LOGPROBS}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_is_chats(cls, value: Any) -> Any:
        if value not in (None, 0):
            raise ValueError("top_logprobs is a chat field; completions take logprobs: N")
        return value

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("echo", mode="before")
    @classmethod
    def _echo_is_a_bool(cls, value: Any) -> Any:
        return False if value is None else value

    def scores_prompt_only(self) -> bool:
        return self.max_tokens == 0

    def requested_prompt_logprobs(self) -> int | None:
        # Echoed with logprobs, the prompt's tokens get theirs too, as many alternatives (vLLM's rule).
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _a_batch_of_one_is_its_prompt(cls, prompt: Any) -> Any:
        # Only a text or a list of ids: anything nested deeper is no prompt, and fails as such.
        if isinstance(prompt, list) and len(prompt) == 1 and _is_text_or_ids(prompt[0]):
            return prompt[0]
        return prompt

    @field_validator("prompt")
    @classmethod
    def _batch_bounds(cls, prompt: str | list, info: ValidationInfo) -> str | list:
        batch = cls._batch_of(prompt)
        if len(batch) > 1:
            if len(batch) > MAX_BATCH_PROMPTS:
                raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in a batch, got {len(batch)}")
            n = info.data.get("n") or 1
            if len(batch) * n > MAX_BATCH_SEQUENCES:
                raise ValueError(f"{len(batch)} prompts x n={n} make more than {MAX_BATCH_SEQUENCES} sequences")
        empty = next((index for index, one in enumerate(batch) if not one), None)
        if empty is not None and len(batch) > 1:
            raise ValueError(f"prompt {empty} of the batch is empty")
        return prompt

    @staticmethod
    def _batch_of(prompt: str | list) -> list[str | list[int]]:
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: its one prompt, or a batch's in order."""
        return self._batch_of(self.prompt)


def _is_text_or_ids(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # Images, audio and files would be dropped by a text-only model: refused instead.
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    # Never None once validated: a null or absent content is read as "" in an assistant turn.
    content: str | list[ContentPart] = Field(default=None, validate_default=True)
    # A turn's tool calls would be dropped, leaving the model a tool result with no call before it.
    tool_calls: list[Any] | None = None
    # Passed to the chat template, as vLLM passes them (a template that knows them uses them).
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, calls: list[Any] | None) -> list[Any] | None:
        if calls:
            raise ValueError("tool calls are not supported by this server (send tool_calls unset or [])")
        return calls

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None:
            # OpenAI sends an assistant turn that made tool calls with a null content, and vLLM
            # takes it; any other turn without text is a client's mistake.
            role = info.data.get("role")
            if role != "assistant":
                raise ValueError(f"content is required{f' in a {role} message' if role else ''}; "
                                 "only an assistant message may leave it null or out")
            return ""
        # Checked before the union is tried, so the 400 says what is wrong with the part.
        for index, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part {index} is of type {kind!r}; only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {index} has no text string")
        return content

    def for_template(self) -> dict[str, str]:
        """The message as the chat template reads it."""
        message = {"role": self.template_role(), "content": self.text()}
        message.update({key: value for key in ("name", "tool_call_id") if (value := getattr(self, key))})
        return message

    def template_role(self) -> str:
        """The role the chat template sees: OpenAI treats `developer` as `system` for models that
        predate it, and chat templates such as SmolLM2's know no `developer` turn."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        """The message's text: its text parts joined with newlines, as vLLM joins them."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatTemplateFields(BaseModel):
    """vLLM's switches over how the chat template renders a conversation."""

    # The template's opening of the reply's turn; false renders the conversation as it stands.
    add_generation_prompt: bool = True
    # The reply continues the final message (an assistant's prefill, say) instead of a new turn.
    continue_final_message: bool = False
    # Further variables for the template (e.g. enable_thinking); a template ignores unknown ones.
    chat_template_kwargs: dict[str, Any] | None = None

    # Named apart from _Request's validators: a subclass of both would keep only one of the two.
    _null_switches_are_defaults = field_validator("add_generation_prompt", "continue_final_message",
                                                  mode="before")(classmethod(null_is_the_default))

    @field_validator("continue_final_message")
    @classmethod
    def _a_new_turn_or_the_last_one(cls, value: bool, info: ValidationInfo) -> bool:
        # Checked here, after add_generation_prompt (declared first), so the 400 names a field.
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(send add_generation_prompt: false to continue the final message)")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} "
                             "(the request's own fields set how the conversation is rendered)")
        return kwargs

    def reply_role(self, last_role: str) -> str:
        """The role of the reply, as vLLM names it: the assistant after a generation prompt, else
        the final message's role, whose turn the reply extends."""
        return "assistant" if self.add_generation_prompt else last_role


class ChatCompletionRequest(_Request, ChatUnsupportedFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    # vLLM's: the final message's text before the reply, when the reply continues its role.
    echo: bool = False
    _null_is_false = field_validator("logprobs", "echo", mode="before")(classmethod(null_is_the_default))
    _top_logprobs_is_a_count = field_validator("top_logprobs", mode="before")(classmethod(not_a_bool))

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # as OpenAI and vLLM answer
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None  # engine/server/logprobs.py gives its shape
    finish_reason: str | None = None


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


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: Any = None  # vLLM's, as in completions


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "lengthwise"
    max_model_len: int | None = None


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
