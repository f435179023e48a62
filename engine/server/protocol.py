"""Request bodies of the OpenAI-compatible API, as pydantic models: the fields both endpoints
share and the completions request (chat's are in chat_protocol.py, responses in responses.py).

Requests validate every field the server acts on, so a bad value fails as a 400 naming the field
(see errors.py). Unknown fields are ignored, as vLLM does, so newer clients keep working. Known
fields the server cannot honour (best_of, tools
and functions, JSON mode and guided decoding, beam search, a request's own chat template, non-text
content or output) are refused with a 400 unless they carry their neutral value, rather than
silently dropped: a client would otherwise get other output than it asked for, and no signal.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from engine.server.text_check import KEY_SUFFIX, LoneSurrogate, lone_surrogate_at
from engine.server.unsupported import CompletionUnsupportedFields
from scheduler.request import MAX_LOGPROBS, PENALTY_LIMIT, PRIORITY_LIMIT, SEED_MAX, SEED_MIN

MAX_STOP_STRINGS = 64
MAX_BAD_WORDS = 128  # vLLM's bound too
# Choices per request: each is an engine request of its own, so the bound keeps one request from
# filling the seats (OpenAI allows 128).
MAX_CHOICES = 16
# Prompts in one completions batch, and sequences (prompts x n) in all: each is an engine request.
MAX_BATCH_PROMPTS = 256
MAX_BATCH_SEQUENCES = 256
MAX_REQUEST_ID_CHARS = 256
# A client's request id: no control characters or line separators (they would forge log lines).
REQUEST_ID_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]+$"
# The largest count or token id a field takes: what an int64 holds. Far past any context or
# vocabulary, it keeps numbers short enough to print: Python refuses to turn an int of over 4,300
# digits into text, and the message naming it was a 500.
MAX_INT = 2**63 - 1
Count = Annotated[int, Field(le=MAX_INT)]
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_INT)]

# OpenAI's service_tier values (submission.SERVICE_TIERS maps them to the scheduler's tiers;
# "scale", OpenAI's reserved capacity, is served as the standard tier, as "default" is).
ServiceTier = Literal["auto", "default", "flex", "priority", "scale"]


def null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
    """A "before" validator: OpenAI's API (and its clients) take an explicit null as "not set"."""
    return cls.model_fields[info.field_name].default if value is None else value


def valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
    """A "before" validator: a lone UTF-16 surrogate (JSON allows "\\ud800") is no text a tokenizer takes.
    The error carries the nested path to it (`param`), which its field's location alone would not."""
    where = lone_surrogate_at(value, info.field_name)
    if where is not None:
        path = where.removesuffix(KEY_SUFFIX)
        raise LoneSurrogate(path, in_key=path != where)
    return value


def not_a_bool(cls, value: Any, info: ValidationInfo) -> Any:
    """A "before" validator for a number: JSON true is not 1 (pydantic's lax mode would take it)."""
    if isinstance(value, bool):
        raise ValueError(f"{info.field_name} takes a number, not {str(value).lower()}")
    return value


class StreamOptions(BaseModel):
    # As vLLM and SGLang take it: a stream_options object asks for the usage chunk unless it says
    # include_usage false (or null); a stream without stream_options gets none, as from OpenAI.
    include_usage: bool | None = True
    # vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens).
    continuous_usage_stats: bool = False

    _null_is_the_default = field_validator("continuous_usage_stats",
                                           mode="before")(classmethod(null_is_the_default))


class BaseRequest(CompletionUnsupportedFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN: "not finite", not a bound's message

    model: str | None = None
    max_tokens: Count | None = Field(default=None, ge=1)  # None: the rest of the context (chat)
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
    # Keep only the prompt's last N tokens (-1: the last max_model_len), as vLLM truncates; its
    # first N with vLLM's truncation_side "right".
    truncate_prompt_tokens: Count | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: with prefix caching, KV blocks are shared only among requests of the same salt.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    priority: int = Field(default=0, ge=-PRIORITY_LIMIT, lt=PRIORITY_LIMIT)  # lower is served first
    top_k: int = Field(default=-1, ge=-1)  # -1 (vLLM) or 0: disabled; any size beyond the vocabulary
    # Strict: JSON true is not token id 1. (Ids beyond the vocabulary can never be sampled, so they
    # never stop anything; the prompt's ids are checked against the vocabulary in prompt_input.py.)
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Count = Field(default=0, ge=0)  # no stop before this many tokens
    # Each prompt token's logprob with this many alternatives. As in vLLM, a stream takes only 0,
    # and carries none (but in a streamed completion's echo with logprobs).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Token ids the model may generate (the engine checks them against the vocabulary).
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    # vLLM's: words the output may not end with (the last token of each is ruled out after the rest).
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    # OpenAI's: token id (a string, as JSON keys are) -> a bias added to its logit, clamped to [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's: the reply carries the prompt's token ids and each choice's (a stream: the prompt's in
    # a choice's first chunk, each chunk's new ones), so a client never tokenizes the text again.
    return_token_ids: bool = False
    # vLLM's: the response's id carries it ("cmpl-" + request_id), so a client can match its
    # requests to replies and to the server's logs (no control characters or line separators:
    # they would forge log lines).
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS,
                                     pattern=REQUEST_ID_PATTERN)] | None = None
    _null_is_the_default = field_validator("max_tokens", "temperature", "top_p", "n", "stream", "ignore_eos",
                                           "include_stop_str_in_output", "skip_special_tokens", "return_token_ids",
                                           "priority", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                           "repetition_penalty", "min_tokens",
                                           mode="before")(classmethod(null_is_the_default))
    _numbers_are_not_bools = field_validator("max_tokens", "temperature", "top_p", "seed", "n", "min_p",
                                             "presence_penalty", "frequency_penalty", "repetition_penalty",
                                             "priority", "top_k", "min_tokens", "prompt_logprobs",
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
        if value and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available with stream: true (only 0, as in vLLM)")
        return value

    def requested_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: none for a stream, which would not carry them (a long
        prompt's scores cost a vocabulary-wide row of logits per token)."""
        return None if self.stream else self.prompt_logprobs

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
            if len(key.lstrip("0")) > len(str(MAX_INT)):  # int() refuses over 4,300 digits: a 500
                raise ValueError(f"key {key[:24]}... is no token id: above {MAX_INT}")
        return bias

    def token_logit_bias(self) -> dict[int, float]:
        """SamplingParams.logit_bias: the bias keyed by token id."""
        # Leading zeros stripped first: int() counts them against its 4,300-digit limit.
        return {int(key.lstrip("0") or "0"): value for key, value in (self.logit_bias or {}).items()}

    _valid_unicode = field_validator("*", mode="before")(classmethod(valid_unicode))

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # An empty object asks for nothing, and vLLM takes it without a stream (typed clients send it).
        if options is not None and options.model_fields_set and not info.data.get("stream"):
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

    def scores_prompt_only(self) -> bool:
        """Whether the reply is the prompt's scoring alone (completions' max_tokens 0)."""
        return False

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


class CompletionRequest(BaseRequest):
    # A text, token ids, or a batch of them (a list of texts or of id lists, as lm-eval sends):
    # prompt i's choice j is choice i * n + j of the reply, as OpenAI and vLLM number them. A
    # one-prompt batch is that prompt.
    prompt: str | list[StrictInt] | list[str | list[StrictInt]] = Field(min_length=1)
    # OpenAI's legacy completions and vLLM's CompletionRequest default to 16 tokens, and clients
    # written against them (lm-eval, benchmarks) rely on it; chat's default is the rest of the context.
    # 0 scores the prompt alone: with echo (and logprobs), as vLLM and the legacy API serve it.
    max_tokens: Count = Field(default=16, ge=0)
    suffix: Literal[""] | None = None
    # The legacy API's form: a count of alternatives per token (0: the sampled token's alone).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    top_logprobs: Any = None  # chat's field: refused here, so it is not silently ignored
    # The prompt's text before each choice's (decoded, for a prompt of token ids).
    echo: bool = False
    # vLLM's: a text prompt gets the tokenizer's special tokens (a BOS, for models that add one).
    add_special_tokens: bool = True
    _null_is_true = field_validator("add_special_tokens", mode="before")(classmethod(null_is_the_default))

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
        # Echoed with logprobs, the prompt's tokens get theirs too, as many alternatives (vLLM's rule;
        # an explicit prompt_logprobs wins). Only such an echo carries them in a stream.
        if self.echo and self.logprobs is not None:
            return self.logprobs if self.prompt_logprobs is None else self.prompt_logprobs
        return super().requested_prompt_logprobs()

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_unwrapped_and_not_empty(cls, prompt: Any) -> Any:
        # A batch of one is its prompt. Only a text or a list of ids: anything nested deeper is no
        # prompt, and fails as such.
        if isinstance(prompt, list) and len(prompt) == 1 and _is_text_or_ids(prompt[0]):
            prompt = prompt[0]
        # Said before the union's members are tried: pydantic named "" (and [""]) by a list's
        # bound ("at least 1 item"), where a batch's empty prompt is named as a prompt.
        if isinstance(prompt, (str, list)) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _batch_bounds(cls, prompt: str | list, info: ValidationInfo) -> str | list:
        batch = cls._batch_of(prompt)
        if len(batch) == 1:
            return prompt  # one prompt: an empty one is refused where it is read (the prompt is empty)
        if len(batch) > MAX_BATCH_PROMPTS:
            raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in a batch, got {len(batch)}")
        n = info.data.get("n") or 1
        if len(batch) * n > MAX_BATCH_SEQUENCES:
            raise ValueError(f"{len(batch)} prompts x n={n} make more than {MAX_BATCH_SEQUENCES} sequences")
        empty = next((index for index, one in enumerate(batch) if not one), None)
        if empty is not None:
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
