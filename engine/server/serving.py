"""The completion and chat handlers: request -> engine submission -> JSON or server-sent events.

Per request: read the prompt (prompt_input.py: bounded, tokenized on the tokenizer thread, chat
template for chat, truncated, checked against the context), submit every choice to the async
engine (submission.py; admission answers there: 429, 503, 400), then either collect the final
outputs while watching for a client disconnect, or stream SSE chunks (streaming.py) ending in
`data: [DONE]`. Every object of one response shares its id, `created`, model name and service
tier. A request whose client leaves is aborted, which frees its KV blocks at the engine's next
step boundary.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.async_engine import AsyncLLMEngine, RequestStream, StreamEnd
from engine.server import errors
from engine.server.chat_protocol import ChatCompletionRequest
from engine.server.limits import longest_token_lengths
from engine.server.logprobs import LogprobsFormatter, end_of_text_offset
from engine.server.prompt_input import PromptInput
from engine.server.protocol import MAX_REQUEST_ID_CHARS, REQUEST_ID_PATTERN, CompletionRequest
from engine.server.responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                     ChatDelta, ChatMessageOut, CompletionChoice, CompletionReply,
                                     CompletionReplyChoice, CompletionResponse, new_id, now_s)
from engine.server.streaming import AbortingStreamingResponse, ChunkContent, stream_events, usage_of
from engine.server.submission import EngineSubmission
from scheduler.policy import SchedulingPolicy

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from scheduler.output import TokenLogprobs

BodyT = TypeVar("BodyT", CompletionRequest, ChatCompletionRequest)


class OpenAIServing(PromptInput, EngineSubmission):
    def __init__(self, engine: AsyncLLMEngine, tokenizer: Any, model_name: str, max_model_len: int, *,
                 policy: SchedulingPolicy | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.policy = policy or SchedulingPolicy()  # the scheduler's: does it read the integer priority?
        # Characters bound a text before it is tokenized; bytes bound the request body.
        self.max_token_chars, self.max_token_bytes = longest_token_lengths(tokenizer)
        self.logprobs = LogprobsFormatter(tokenizer)
        self._tokenize_pool = None  # PromptInput's tokenizer thread, started by the first request

    # ---- endpoints ---------------------------------------------------------------------------
    async def completion(self, body: CompletionRequest, raw: Request):
        self._check_accepting()
        self._check_priority(body)
        if body.scores_prompt_only() and not body.echo:
            raise errors.invalid_field("max_tokens", "max_tokens: 0 scores the prompt alone, which needs echo: true")
        prompts = [await self._completion_prompt(body, prompt) for prompt in body.prompts()]
        body = with_header_request_id(body, raw)
        head = self._head("cmpl", body)
        streams = await self._submit(_engine_id(head["id"], body), body, prompts, "prompt")
        n = body.n  # prompt i's choice j is stream i * n + j
        echoes = [text if body.echo else "" for _, text in prompts]
        text_offsets = [0] * len(streams)  # where each choice's next stream chunk starts in its text
        first_chunk = [True] * len(streams)  # each choice's first chunk carries the echo and prompt ids

        def chunk(content: ChunkContent) -> CompletionResponse:
            index = content.index
            first, first_chunk[index] = first_chunk[index], False
            echoed = first and body.echo
            prompt_ids, echo = prompts[index // n][0], echoes[index // n]
            if echoed and content.prompt_logprobs is not None:  # the prompt's tokens lead, as in a whole reply
                # (alone for max_tokens 0; an echo streams prompt logprobs only with logprobs asked)
                logprobs = self.logprobs.echoed_completion(prompt_ids, content.prompt_logprobs, content.logprobs or ())
            elif content.logprobs is None:
                logprobs = None
            else:
                logprobs = self.logprobs.completion(content.logprobs, text_offsets[index])
            text_offsets[index] = end_of_text_offset(logprobs, text_offsets[index])
            return CompletionResponse(**head, choices=[CompletionChoice(
                index=index, text=echo + content.text if echoed else content.text, logprobs=logprobs,
                finish_reason=content.finish_reason, stop_reason=content.stop_reason,
                **_token_ids(body, prompt_ids if first else None, content.token_ids))])

        if body.stream:
            include_usage, continuous = body.usage_in_stream()
            events = stream_events(streams, chunk, (), include_usage,
                                   lambda usage: CompletionResponse(**head, choices=[], usage=usage),
                                   [len(prompts[i // n][0]) for i in range(len(streams))] if continuous else None,
                                   choices_per_prompt=n,
                                   shown=_prompt_alone if body.scores_prompt_only() else None)
            return self._streaming(streams, events)
        finals = await self._collect(streams, raw)
        if body.scores_prompt_only():
            finals = [_prompt_alone(final) for final in finals]

        def reply() -> CompletionReply:
            # Each prompt's first choice scored it for them all (_choice_params).
            firsts = finals[::n]
            asked = body.requested_prompt_logprobs()
            prompt_logprobs = [self._prompt_logprobs(first, asked) for first in firsts]
            return CompletionReply(**head, usage=usage_of(finals, n), choices=[CompletionReplyChoice(
                index=index, text=echoes[index // n] + final.text, finish_reason=final.finish_reason,
                stop_reason=final.stop_reason,
                logprobs=self._completion_logprobs(final, firsts[index // n].prompt_logprobs,
                                                   prompts[index // n][0], body.echo),
                prompt_logprobs=prompt_logprobs[index // n],
                **_token_ids(body, prompts[index // n][0], final.token_ids))
                for index, final in enumerate(finals)])

        return await _json_reply(reply, finals)

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        self._check_accepting()
        self._check_priority(body)
        messages = [m.for_template() for m in body.messages]
        prompt_text, prompt_ids = await self.off_loop(self._render_chat, body, messages, body.tools or None)
        prompt_ids, prompt_text = await self._truncated(body, prompt_ids, prompt_text, "messages")
        body = with_header_request_id(body, raw)
        head = self._head("chatcmpl", body)
        streams = await self._submit(_engine_id(head["id"], body), body, [(prompt_ids, prompt_text)], "messages")
        final_message = body.messages[-1]
        role = body.reply_role(final_message.role)
        echo = final_message.text() if body.echo and final_message.role == role else ""  # as vLLM echoes

        def chunk(content: ChunkContent) -> ChatCompletionChunk:  # chat streams no prompt logprobs
            logprobs = None if content.logprobs is None else self.logprobs.chat(content.logprobs)
            return ChatCompletionChunk(**head, choices=[ChatChunkChoice(
                index=content.index, delta=ChatDelta(content=content.text), logprobs=logprobs,
                finish_reason=content.finish_reason, stop_reason=content.stop_reason,
                **_token_ids(body, None, content.token_ids))])

        if body.stream:
            include_usage, continuous = body.usage_in_stream()
            # Each choice's role, then (as vLLM sends it) each choice's echo in a chunk of its own.
            deltas = [ChatDelta(role=role, content="")] + ([ChatDelta(content=echo)] if echo else [])
            # The prompt's ids, when asked for, in each choice's first chunk (its role's), as vLLM sends them.
            openings = [ChatCompletionChunk(**head, choices=[ChatChunkChoice(index=index, delta=delta)],
                                            **_token_ids(body, prompt_ids if delta.role else None, None))
                        for delta in deltas for index in range(len(streams))]
            events = stream_events(streams, chunk, openings, include_usage,
                                   lambda usage: ChatCompletionChunk(**head, choices=[], usage=usage),
                                   [len(prompt_ids)] * len(streams) if continuous else None,
                                   choices_per_prompt=len(streams))
            return self._streaming(streams, events)
        finals = await self._collect(streams, raw)

        def reply() -> ChatCompletionResponse:
            return ChatCompletionResponse(**head, usage=usage_of(finals, len(finals)), choices=[ChatChoice(
                index=index, message=ChatMessageOut(role=role, content=echo + final.text),
                finish_reason=final.finish_reason, stop_reason=final.stop_reason,
                logprobs=None if final.logprobs is None else self.logprobs.chat(final.logprobs),
                **_token_ids(body, None, final.token_ids))
                for index, final in enumerate(finals)],
                prompt_logprobs=self._prompt_logprobs(finals[0], body.prompt_logprobs),
                **_token_ids(body, prompt_ids, None))

        return await _json_reply(reply, finals)

    def _completion_logprobs(self, final: RequestOutput, prompt_entries: Sequence[TokenLogprobs | None] | None,
                             prompt_ids: list[int], echo: bool) -> dict[str, Any] | None:
        if final.logprobs is None:
            return None
        if echo and prompt_entries is not None:
            return self.logprobs.echoed_completion(prompt_ids, prompt_entries, final.logprobs)
        return self.logprobs.completion(final.logprobs)

    def _prompt_logprobs(self, first: RequestOutput, asked: int | None) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs field, when they were computed (asked for, or for echo with
        logprobs, as vLLM fills it then too), from a prompt's first choice, which scores the
        prompt its choices share (_choice_params)."""
        if asked is None or first.prompt_logprobs is None:
            return None
        return self.logprobs.prompt(first.prompt_logprobs)

    def _head(self, id_prefix: str, body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """The fields every object of one response shares: a stream's chunks carry the same id and
        the same `created`, taken once, as OpenAI's do (a time read per chunk drifts across them).
        `model` is the name the client asked for (app.py has checked it names this model; it may
        be an alias such as the model's path), as vLLM echoes it, else the served name. The id
        carries the request's own `request_id` when it gave one, as vLLM's does."""
        response_id = new_id(id_prefix) if body.request_id is None else f"{id_prefix}-{body.request_id}"
        return {"id": response_id, "created": now_s(), "model": body.model or self.model_name,
                "service_tier": _tier_name(body)}

    # ---- results -----------------------------------------------------------------------------
    async def _collect(self, streams: Sequence[RequestStream], raw: Request) -> list[RequestOutput]:
        """Every choice's finished output; aborts them all if the client disconnects first."""
        consume = asyncio.ensure_future(asyncio.gather(*(_last(stream) for stream in streams)))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({consume, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not consume.done():
                consume.cancel()
                # Its CancelledError is read here: unread, asyncio logged an ERROR traceback
                # ("exception was never retrieved") for every request its client gave up on.
                consume.add_done_callback(_read_outcome)
                self._abort_unfinished(streams)
        if not consume.done() or consume.cancelled():
            raise errors.APIError(499, "client disconnected")  # nobody is listening any more
        finals = consume.result()
        for final in finals:
            if isinstance(final, StreamEnd):
                if final.reason == "abort":
                    raise errors.aborted_at_shutdown()
                raise errors.engine_failed(final.message)
        return finals

    def _streaming(self, streams: Sequence[RequestStream], events: AsyncIterator[str]) -> AbortingStreamingResponse:
        return AbortingStreamingResponse(events, lambda: self._abort_unfinished(streams),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _json_reply(reply: Callable[[], BaseModel], finals: Sequence[RequestOutput]) -> Response:
    """The reply as JSON. One with logprobs is built and serialized on a worker thread: thousands of
    tokens with their alternatives take a while, and on the event loop they would stall every
    other stream (FastAPI would also encode the object in Python there, slower still)."""
    def render() -> Response:
        return Response(reply().model_dump_json(), media_type="application/json")

    if all(final.logprobs is None and final.prompt_logprobs is None for final in finals):
        return render()
    return await asyncio.to_thread(render)


def with_header_request_id(body: BodyT, raw: Request) -> BodyT:
    """vLLM's: an X-Request-Id header names the request before the body's request_id does, so a
    gateway's id reaches the response's id and the logs (an empty header is no id)."""
    header = raw.headers.get("x-request-id")
    if not header:
        return body
    if len(header) > MAX_REQUEST_ID_CHARS or not re.fullmatch(REQUEST_ID_PATTERN, header):
        raise errors.invalid_field("X-Request-Id", f"X-Request-Id: at most {MAX_REQUEST_ID_CHARS} characters, "
                                   "none of them control characters")
    return body.model_copy(update={"request_id": header})


def _engine_id(response_id: str, body: CompletionRequest | ChatCompletionRequest) -> str:
    """The engine's id for a request: its response id, made unique when the client chose it (two
    requests may send the same request_id; in the engine an id names one request at a time)."""
    return response_id if body.request_id is None else f"{response_id}-{uuid.uuid4().hex[:8]}"


def _token_ids(body: CompletionRequest | ChatCompletionRequest, prompt_ids: Sequence[int] | None,
               token_ids: Sequence[int] | None) -> dict[str, list[int]]:
    """vLLM's return_token_ids fields, those given, when the request asked for them ({} else)."""
    if not body.return_token_ids:
        return {}
    given = {"prompt_token_ids": prompt_ids, "token_ids": token_ids}
    return {key: list(ids) for key, ids in given.items() if ids is not None}


def _prompt_alone(final: RequestOutput) -> RequestOutput:
    """A finished output without its generated token: what a request for max_tokens 0 (a prompt
    scored alone) gets back, as vLLM answers it (finish_reason "length", no completion tokens)."""
    return replace(final, token_ids=(), new_token_ids=(), text="", new_text="", finish_reason="length",
                   stop_reason=None, logprobs=None if final.logprobs is None else ())


def _tier_name(body: CompletionRequest | ChatCompletionRequest) -> str:
    return body.service_tier if body.service_tier in ("priority", "flex") else "default"


def _read_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _last(stream: RequestStream) -> RequestOutput | StreamEnd:
    last = None
    async for item in stream:
        last = item
    return last


async def _wait_for_disconnect(raw: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (or nothing).
    while (await raw.receive())["type"] != "http.disconnect":
        pass
