"""The chat completions request: messages, vLLM's chat-template switches, and chat's logprobs
and output-limit fields, on the fields both endpoints share (protocol.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from engine.chat_template_rules import TEMPLATE_SWITCHES, reserved_variables
from engine.server.protocol import BaseRequest, Count, not_a_bool, null_is_the_default
from engine.server.unsupported import ChatUnsupportedFields
from scheduler.request import MAX_LOGPROBS


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
