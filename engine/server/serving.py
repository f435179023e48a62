"""The completion and chat handlers: request -> engine submission -> JSON or server-sent events.

Per request: refuse a text too long to fit the context however it tokenizes, tokenize the rest
on a worker thread (chat template for chat), check the context length, build SamplingParams and
the tier, submit to the async engine (admission answers here: 429, 503, 400), then either collect
the final output while watching for a client disconnect, or stream one SSE chunk per engine step
ending in `data: [DONE]`. Every object of one response shares its id, `created`, model name and
service tier. A request whose client leaves is aborted, which frees its KV blocks at the engine's
next step boundary.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engine.async_engine import (AsyncLLMEngine, EngineDead, EngineShuttingDown, RequestStream,
                                 StreamEnd)
from engine.server import errors
from engine.server.limits import check_text_length, longest_token_lengths
from engine.server.logprobs import LogprobsFormatter, end_of_text_offset
from engine.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                    ChatMessageOut, CompletionChoice, CompletionRequest,
                                    CompletionResponse, UsageInfo, new_id, now_s)
from scheduler.admission import AdmissionRejected
from scheduler.policy import SchedulingPolicy
from scheduler.request import SamplingParams, Tier

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from scheduler.output import TokenLogprobs

    # A stream chunk from its new text, finish reason and new tokens' logprobs (None: not asked).
    ChunkMaker = Callable[[str, "str | None", "Sequence[TokenLogprobs] | None"], BaseModel]

SERVICE_TIERS = {None: Tier.STANDARD, "auto": Tier.STANDARD, "default": Tier.STANDARD,
                 "priority": Tier.INTERACTIVE, "flex": Tier.BATCH}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def chunk_event(chunk: BaseModel, include_usage: bool) -> str:
    """One SSE event for a stream chunk, shaped as OpenAI sends them.

    "usage" appears (null until the last chunk) only when stream_options.include_usage is on;
    a chat delta carries only the keys that changed.
    """
    payload = chunk.model_dump(mode="json")
    if not include_usage:
        payload.pop("usage", None)
    if payload.get("service_tier", "") is None:
        payload.pop("service_tier")
    for choice in payload.get("choices", ()):
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return sse(payload)


class OpenAIServing:
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
        # Tokenizing a long prompt takes milliseconds of CPU; done on the event loop it would stall
        # every other stream. One thread, because a HF fast tokenizer shared between threads can
        # fail with "Already borrowed" while it sets its padding and truncation state.
        self._tokenize_pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the tokenizer thread; a later request (a new lifespan) starts another."""
        pool, self._tokenize_pool = self._tokenize_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- endpoints ---------------------------------------------------------------------------
    async def completion(self, body: CompletionRequest, raw: Request):
        self._check_accepting()
        self._check_priority(body)
        if isinstance(body.prompt, str):
            check_text_length(body.prompt, "prompt", self.max_model_len, self.max_token_chars)
            # As vLLM: a plain prompt gets the tokenizer's special tokens (a BOS, for models that
            # add one); a chat's come from its template.
            prompt_ids = await self._off_loop(self._encode, body.prompt, True)
            prompt_text = body.prompt
        else:
            self._check_token_ids(body.prompt)
            self._check_context(len(body.prompt), None, "prompt", "max_tokens")  # before decoding them
            prompt_ids = list(body.prompt)
            prompt_text = await self._off_loop(self.tokenizer.decode, body.prompt)
        head = self._head("cmpl", body)
        stream = await self._submit(head["id"], body, prompt_ids, prompt_text, "prompt")
        text_offset = 0  # where the next stream chunk's first token starts in the completion

        def chunk(text: str, finish: str | None, entries: Sequence[TokenLogprobs] | None) -> CompletionResponse:
            nonlocal text_offset
            logprobs = None if entries is None else self.logprobs.completion(entries, text_offset)
            text_offset = end_of_text_offset(logprobs, text_offset)
            return CompletionResponse(**head, choices=[CompletionChoice(text=text, logprobs=logprobs,
                                                                        finish_reason=finish)])

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._events(stream, chunk, None, include_usage,
                                  lambda usage: CompletionResponse(**head, choices=[], usage=usage))
            return self._streaming(stream, events)
        final = await self._collect(stream, raw)
        logprobs = None if final.logprobs is None else await asyncio.to_thread(self.logprobs.completion, final.logprobs)
        return CompletionResponse(**head, usage=_usage(final), choices=[
            CompletionChoice(text=final.text, logprobs=logprobs, finish_reason=final.finish_reason)])

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        self._check_accepting()
        self._check_priority(body)
        messages = [m.for_template() for m in body.messages]
        prompt_text, prompt_ids = await self._off_loop(self._render_chat, messages, body.tools or None)
        head = self._head("chatcmpl", body)
        stream = await self._submit(head["id"], body, prompt_ids, prompt_text, "messages")

        def chunk(text: str, finish: str | None, entries: Sequence[TokenLogprobs] | None) -> ChatCompletionChunk:
            logprobs = None if entries is None else self.logprobs.chat(entries)
            return ChatCompletionChunk(**head, choices=[
                ChatChunkChoice(delta=ChatDelta(content=text), logprobs=logprobs, finish_reason=finish)])

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            opening = ChatCompletionChunk(**head, choices=[
                ChatChunkChoice(delta=ChatDelta(role="assistant", content=""), finish_reason=None)])
            events = self._events(stream, chunk, opening, include_usage,
                                  lambda usage: ChatCompletionChunk(**head, choices=[], usage=usage))
            return self._streaming(stream, events)
        final = await self._collect(stream, raw)
        logprobs = None if final.logprobs is None else await asyncio.to_thread(self.logprobs.chat, final.logprobs)
        return ChatCompletionResponse(**head, usage=_usage(final), choices=[
            ChatChoice(message=ChatMessageOut(content=final.text), logprobs=logprobs,
                       finish_reason=final.finish_reason)])

    def _head(self, id_prefix: str, body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """The fields every object of one response shares: a stream's chunks carry the same id and
        the same `created`, taken once, as OpenAI's do (a time read per chunk drifts across them).
        `model` is the name the client asked for (app.py has checked it names this model; it may
        be an alias such as the model's path), as vLLM echoes it, else the served name."""
        return {"id": new_id(id_prefix), "created": now_s(), "model": body.model or self.model_name,
                "service_tier": _tier_name(body)}

    # ---- admission ---------------------------------------------------------------------------
    async def _off_loop(self, function: Callable, *args: Any) -> Any:
        if self._tokenize_pool is None:
            self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lengthwise-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, function, *args)

    def _render_chat(self, messages: list[dict[str, str]],
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        try:  # tools (with tool_choice "none") go to the template, as vLLM passes them
            prompt_text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                             add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
            raise errors.invalid_field("messages", f"messages: {exc}") from exc
        check_text_length(prompt_text, "messages", self.max_model_len, self.max_token_chars)
        return prompt_text, self._encode(prompt_text, False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _check_priority(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        # As vLLM answers: under any other policy the priority would be silently ignored.
        if body.priority != 0 and not self.policy.orders_by_priority:
            raise errors.invalid_field("priority", f"priority: this server schedules by {self.policy.name}, not "
                                       "by priority (--policy priority); send priority 0 or leave it out")

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = len(self.tokenizer)
        if any(not 0 <= i < vocab for i in ids):
            raise errors.invalid_field("prompt", f"prompt: token ids must lie in [0, {vocab})")

    def _check_context(self, num_prompt: int, max_tokens: int | None, prompt_param: str,
                       max_tokens_param: str) -> int:
        """The max_tokens to use; raises context_length_exceeded when prompt + output cannot fit."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise errors.context_exceeded(prompt_param, f"This model's maximum context length is {limit} "
                                          f"tokens; the {prompt_param} came to {num_prompt} tokens.")
        if max_tokens is None:
            return limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise errors.context_exceeded(max_tokens_param, f"This model's maximum context length is {limit} "
                                          f"tokens; you requested {num_prompt + max_tokens} ({num_prompt} "
                                          f"in the {prompt_param}, {max_tokens} for the completion).")
        return max_tokens

    async def _submit(self, request_id: str, body: CompletionRequest | ChatCompletionRequest,
                      prompt_ids: list[int], prompt_text: str, prompt_param: str) -> RequestStream:
        if not prompt_ids:
            raise errors.invalid_field(prompt_param, f"{prompt_param}: the prompt is empty")
        max_tokens_param, max_tokens = body.requested_max_tokens()
        max_tokens = self._check_context(len(prompt_ids), max_tokens, prompt_param, max_tokens_param)
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                    top_k=body.top_k, seed=body.seed, stop=body.stop_strings(),
                                    stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                                    logprobs=body.requested_logprobs())
        except ValueError as exc:
            raise errors.invalid_field(None, str(exc)) from exc
        tier = SERVICE_TIERS[body.service_tier]
        try:
            return await self.engine.submit(request_id, prompt_ids, prompt_text, params, tier=tier,
                                            priority=body.priority)
        except AdmissionRejected as exc:
            raise errors.rate_limited(exc.reason, exc.retry_after_s) from exc
        except (EngineShuttingDown, EngineDead) as exc:
            raise errors.engine_state_error(exc) from exc
        except ValueError as exc:
            raise errors.invalid_field(None, str(exc)) from exc

    def _check_accepting(self) -> None:
        """503 while draining, 500 after an engine failure, before the prompt is tokenized: the
        one tokenizer thread serves requests in order, and a refusal queued behind a long prompt
        could outlast the server's last seconds and go unanswered."""
        try:
            self.engine.check_accepting()
        except (EngineShuttingDown, EngineDead) as exc:
            raise errors.engine_state_error(exc) from exc

    # ---- results -----------------------------------------------------------------------------
    async def _collect(self, stream: RequestStream, raw: Request) -> RequestOutput:
        """The finished output; aborts the request if the client disconnects first."""
        consume = asyncio.ensure_future(_last(stream))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({consume, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not consume.done():
                consume.cancel()
                self.engine.abort(stream.request_id)
        if not consume.done() or consume.cancelled():
            raise errors.APIError(499, "client disconnected")  # nobody is listening any more
        final = consume.result()
        if isinstance(final, StreamEnd):
            if final.reason == "abort":
                raise errors.aborted_at_shutdown()
            raise errors.engine_failed(final.message)
        return final

    async def _events(self, stream: RequestStream, chunk: ChunkMaker, opening: BaseModel | None,
                      include_usage: bool, usage_chunk: Callable[[UsageInfo], BaseModel]) -> AsyncIterator[str]:
        if opening is not None:
            yield chunk_event(opening, include_usage)
        sent = sent_logprobs = 0
        async for item in stream:
            if isinstance(item, StreamEnd):
                if item.reason == "abort":  # with any text generated since the last read
                    entries = None if item.logprobs is None else item.logprobs[sent_logprobs:]
                    yield chunk_event(chunk(item.text[sent:], "abort", entries), include_usage)
                else:
                    yield sse(errors.engine_failed(item.message).response_body())
                break
            delta, sent = item.text[sent:], max(sent, len(item.text))
            # A token's logprobs go out with the step that made it, though its text may wait (an
            # unfinished character, or the start of a possible stop string).
            entries = None if item.logprobs is None else item.logprobs[sent_logprobs:]
            sent_logprobs += len(entries or ())
            if delta or item.finished or entries:
                finish = item.finish_reason if item.finished else None
                yield chunk_event(chunk(delta, finish, entries or None), include_usage)
            if item.finished and include_usage:
                yield chunk_event(usage_chunk(_usage(item)), include_usage)
        yield "data: [DONE]\n\n"

    def _streaming(self, stream: RequestStream, events: AsyncIterator[str]) -> StreamingResponse:
        def abort_unless_finished() -> None:
            if not stream.finished:
                self.engine.abort(stream.request_id)

        return AbortingStreamingResponse(events, abort_unless_finished, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})


class AbortingStreamingResponse(StreamingResponse):
    """A streaming response that runs `on_close` however sending ends: the last event, an error,
    or a client that left. The abort lives here, not in the event generator's `finally`: a
    generator that never started runs no `finally`, and whether it starts after an early hang-up
    depends on the ASGI server (uvicorn's ASGI 2.3 send returns quietly once disconnected, so the
    generator starts and meets the cancellation; under ASGI 2.4 Starlette's first send raises
    before it starts)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _usage(output: RequestOutput) -> UsageInfo:
    return UsageInfo.of(len(output.prompt_token_ids), len(output.token_ids))


def _tier_name(body: CompletionRequest | ChatCompletionRequest) -> str:
    return body.service_tier if body.service_tier in ("priority", "flex") else "default"


async def _last(stream: RequestStream) -> RequestOutput | StreamEnd:
    last = None
    async for item in stream:
        last = item
    return last


async def _wait_for_disconnect(raw: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (or nothing).
    while (await raw.receive())["type"] != "http.disconnect":
        pass
