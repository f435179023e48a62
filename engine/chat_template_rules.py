"""What a caller may pass to the tokenizer's chat template besides the conversation: shared by the
offline `LLM.chat` and the server's chat requests (engine/server/chat_protocol.py)."""

from __future__ import annotations

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
