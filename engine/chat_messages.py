"""A chat's messages as the tokenizer's chat template reads them, and what else a caller may pass
the template: shared by the offline `LLM.chat` and the server's chat requests
(engine/server/chat_protocol.py), so both take the same messages the same way."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# apply_chat_template's own parameters, and the conversation's name inside the template: a
# template variable of these names would change how the prompt is rendered or returned (token
# ids, tensors, truncation) rather than what the template says, so a caller may not set them
# through chat_template_kwargs. The two switches and `tools` it may set, as vLLM merges the kwargs
# over them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "conversation", "conversations", "messages", "documents", "chat_template",
    "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})
TEMPLATE_SWITCHES = ("add_generation_prompt", "continue_final_message")


def reserved_variables(variables: dict | None) -> list[str]:
    """The names among `variables` a caller may not set (RESERVED_TEMPLATE_VARIABLES), sorted."""
    return sorted(RESERVED_TEMPLATE_VARIABLES.intersection(variables or {}))


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
