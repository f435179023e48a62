"""The chat completions request: messages, vLLM's chat-template switches, and chat's logprobs
and output-limit fields, on the fields both endpoints share (protocol.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from engine.chat_messages import TEMPLATE_SWITCHES, ChatMessage, reserved_variables
from engine.server.protocol import BaseRequest, Count, not_a_bool, null_is_the_default
from engine.server.unsupported import ChatUnsupportedFields
from scheduler.request import MAX_LOGPROBS


class ChatTemplateFields(BaseModel):
    """vLLM's switches over how the chat template renders a conversation."""

    # The template's opening of the reply's turn; false renders the conversation as it stands.
    add_generation_prompt: bool = True
    # The reply continues the final message (an assistant's prefill, say) instead of a new turn.
    continue_final_message: bool = False
    # Further variables for the template (e.g. enable_thinking); a template ignores unknown ones.
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _switches_from_template_kwargs(cls, data: Any) -> Any:
        # vLLM renders with chat_template_kwargs merged over the switches, the kwargs winning; here
        # they become the switches themselves, so the reply's role and echo follow the prompt as
        # rendered, and the checks below read them.
        kwargs = data.get("chat_template_kwargs") if isinstance(data, dict) else None
        if not isinstance(kwargs, dict) or not any(switch in kwargs for switch in TEMPLATE_SWITCHES):
            return data
        rest = {key: value for key, value in kwargs.items() if key not in TEMPLATE_SWITCHES}
        return {**data, **{switch: kwargs[switch] for switch in TEMPLATE_SWITCHES if switch in kwargs},
                "chat_template_kwargs": rest}

    # Named apart from BaseRequest's validators: a subclass of both would keep only one of the two.
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
        reserved = reserved_variables(kwargs)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} "
                             "(the request's own fields set how the conversation is rendered)")
        return kwargs

    def reply_role(self, last_role: str) -> str:
        """The role of the reply, as vLLM names it: the assistant after a generation prompt, else
        the final message's role, whose turn the reply extends."""
        return "assistant" if self.add_generation_prompt else last_role


class ChatCompletionRequest(BaseRequest, ChatUnsupportedFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    # vLLM's: the final message's text before the reply, when the reply continues its role.
    echo: bool = False
    # vLLM's: the tokenizer's special tokens on the templated text (off: the template has its own).
    add_special_tokens: bool = False
    _null_is_false = field_validator("logprobs", "echo", "add_special_tokens",
                                     mode="before")(classmethod(null_is_the_default))
    _counts_are_not_bools = field_validator("top_logprobs", "max_completion_tokens",
                                            mode="before")(classmethod(not_a_bool))

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
