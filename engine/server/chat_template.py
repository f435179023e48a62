"""How a chat request becomes the prompt text: the tokenizer's chat template with vLLM's switches
over it (protocol.ChatTemplateFields), shared by chat completions and /tokenize."""

from __future__ import annotations

from typing import Any

from engine.server import errors
from engine.server.chat_protocol import ChatTemplateFields


def render_chat(tokenizer: Any, messages: list[dict[str, str]], fields: ChatTemplateFields,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text, or a 400 naming `messages` when the template rejects the conversation
    (a template that raises, or a final message to continue that it does not render)."""
    # tools (with tool_choice "none") go to the template, as vLLM passes them, and, as there,
    # chat_template_kwargs may replace them (the switches it sets are the fields by now).
    variables = {"tools": tools, **(fields.chat_template_kwargs or {})}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=fields.add_generation_prompt,
                                             continue_final_message=fields.continue_final_message, **variables)
    except Exception as exc:  # noqa: BLE001 - the conversation's fault, answered as such
        raise errors.invalid_field("messages", f"messages: {exc}") from exc

