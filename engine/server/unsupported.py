"""Request fields of OpenAI's and vLLM's APIs that change the output in ways this server does not
implement: accepted only with a value that changes nothing (clients often send the defaults
explicitly), refused otherwise with a 400 naming the field. Dropping them silently would give a
client other output than it asked for, and no signal.

The request models in protocol.py and chat_protocol.py inherit these declarations; one validator
checks them all.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# Field -> the values that change nothing. A field is checked on every endpoint whose request
# model declares it.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "use_beam_search": (None, False), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,),
    "length_penalty": (None, 1), "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False), "logprob_token_ids": (None,),
    # vLLM's: a request's own logits processors (its default server refuses them too), an n-gram
    # repetition stop, and a prompt given as embeddings.
    "logits_processors": (None, []), "repetition_detection": (None,), "prompt_embeds": (None,),
}
# Chat only. Without functions, "none" and "auto" call none, as tool_choice's do without tools.
CHAT_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none", "auto"), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "documents": (None,),
    # A template of the request's own: vLLM too refuses it unless told to trust requests' templates.
    "chat_template": (None,),
}


class CompletionUnsupportedFields(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(extra="ignore")

    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # before tools: chat's tools check it
    tools: list[dict[str, Any]] | None = None
    spaces_between_special_tokens: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    return_tokens_as_token_ids: bool | None = None
    # Refused whatever their value unless null, so their shape is not checked.
    logprob_token_ids: Any = None
    logits_processors: Any = None
    repetition_detection: Any = None
    prompt_embeds: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator(*NEUTRAL_VALUES)
    @classmethod
    def _only_neutral(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "tools" and issubclass(cls, ChatUnsupportedFields):
            return _chat_tools(value, info.data.get("tool_choice"))
        return _neutral_or_refused(value, info.field_name, NEUTRAL_VALUES[info.field_name])


def _neutral_or_refused(value: Any, field: str, neutral: tuple[Any, ...]) -> Any:
    # An object's null members are unset ({"type": "text", "json_schema": null} asks for text, as
    # a typed client writes it).
    compared = {key: item for key, item in value.items() if item is not None} if isinstance(value, dict) else value
    if value is not None and compared not in neutral:
        usable = " or ".join(json.dumps(v) for v in neutral if v is not None)
        raise ValueError(f"{field} is not supported by this server (send it unset{' or ' + usable if usable else ''})")
    return value


def _chat_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """Chat's tools, as vLLM takes them: with tool_choice "none" they reach the chat template and
    no call is parsed from the reply. Any other choice needs a tool-call parser, which this server
    lacks (vLLM refuses "auto" without one too); unset with tools means "auto"."""
    if tools and tool_choice != "none":
        raise ValueError('tools are served only with tool_choice "none" (this server parses no tool calls)')
    return tools


class ChatUnsupportedFields(BaseModel):
    """The fields only chat takes. (Chat's `tools`, declared above, pass with `tool_choice:
    "none"`: `_chat_tools`.)"""

    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    prediction: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    chat_template: Any = None
    documents: Any = None  # vLLM hands them to the chat template; this server does not

    @field_validator(*CHAT_NEUTRAL_VALUES)
    @classmethod
    def _only_neutral_in_chat(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral_or_refused(value, info.field_name, CHAT_NEUTRAL_VALUES[info.field_name])
