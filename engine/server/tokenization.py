"""vLLM's /tokenize and /detokenize: a prompt (text, or a conversation through the chat template,
as chat completions render it) to its token ids, and token ids back to text, with the served
model's tokenizer. Clients use them to count tokens or to build prompts of ids. As in vLLM they
live outside /v1, so an API key does not guard them; unlike vLLM's, a text that cannot fit the
context is refused.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from engine.server.chat_template import render_chat
from engine.server.limits import check_text_length, check_token_ids
from engine.chat_messages import ChatMessage
from engine.server.chat_protocol import ChatTemplateFields
from engine.server.protocol import null_is_the_default, valid_unicode
from engine.server.unsupported import ChatUnsupportedFields


class _TokenizeFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    return_token_strs: bool = False  # also each token's piece, as the vocabulary spells it
    _null_is_false = field_validator("return_token_strs", mode="before")(classmethod(null_is_the_default))
    _valid_unicode = field_validator("*", mode="before")(classmethod(valid_unicode))


class TokenizeCompletionRequest(_TokenizeFields):
    prompt: str
    add_special_tokens: bool = True  # as a completion's plain prompt gets them


class TokenizeChatRequest(_TokenizeFields, ChatUnsupportedFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False  # a chat's come from its template
    tools: list[dict[str, Any]] | None = None  # given to the template, as chat passes them


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]
    _valid_unicode = field_validator("model", mode="before")(classmethod(valid_unicode))


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_request(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as one of the two forms, told apart by `messages` as vLLM's union is; a body that
    fits neither is a 400 naming the field, as any other request's."""
    form = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return form.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


class OpenAIServingTokenization:
    """The routes' handlers. A text too long to fit the context however it tokenizes is refused
    untokenized (400 context_length_exceeded), as on /v1: these routes need no key, and they
    share the one tokenizer thread with /v1, which a multi-megabyte text would hold for seconds."""

    def __init__(self, tokenizer: Any, max_model_len: int, max_token_chars: int, off_loop) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_token_chars = max_token_chars  # limits.longest_token_lengths
        self.off_loop = off_loop  # runs a function on the tokenizer thread (OpenAIServing.off_loop)

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        if isinstance(request, TokenizeCompletionRequest):  # a chat's text is checked once rendered
            self._check_length(request.prompt, "prompt")
        ids = await self.off_loop(self._token_ids, request)
        pieces = await self.off_loop(self.tokenizer.convert_ids_to_tokens, ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=pieces)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        check_token_ids(request.tokens, len(self.tokenizer), "tokens")
        return DetokenizeResponse(prompt=await self.off_loop(self.tokenizer.decode, request.tokens))

    def _token_ids(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        if isinstance(request, TokenizeChatRequest):
            text = render_chat(self.tokenizer, [m.for_template() for m in request.messages], request,
                               request.tools or None)
            self._check_length(text, "messages")
        else:
            text = request.prompt
        return list(self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens))

    def _check_length(self, text: str, param: str) -> None:
        check_text_length(text, param, self.max_model_len, self.max_token_chars)
