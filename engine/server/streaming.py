"""Server-sent events for one response whose choices stream from one engine request each.

A request with `n` choices runs as `n` engine requests (a completions batch, `n` for each of its
prompts); their outputs interleave on one event stream, each chunk naming its choice by index, as
OpenAI sends them. Per choice the stream keeps what it has sent (text and logprobs), so a reader
that fell behind sends everything new in one chunk. The usage chunk, when asked for, follows the
last choice's end; an engine failure ends the whole stream with an error event. However sending
ends, every choice still running is aborted, which frees its KV blocks at the engine's next step
boundary.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engine.async_stream import RequestStream, StreamEnd
from engine.server import errors
from engine.server.responses import UsageInfo

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from scheduler.output import TokenLogprobs


@dataclass(frozen=True)
class ChunkContent:
    """What one stream chunk of one choice carries; the endpoint's chunk maker shapes it."""

    index: int  # the choice's
    text: str  # new since the choice's last chunk
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's, with finish_reason "stop" (RequestOutput)
    logprobs: Sequence[TokenLogprobs] | None = None  # the new tokens' (None: not asked for, or none new)
    # The prompt's (None: not asked for, or not known yet; the engine reports them whole from the
    # first token on).
    prompt_logprobs: Sequence[TokenLogprobs | None] | None = None
    token_ids: Sequence[int] = ()  # generated since the choice's last chunk


ChunkMaker = Callable[[ChunkContent], BaseModel]


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


def usage_of(finals: Sequence[RequestOutput], choices_per_prompt: int) -> UsageInfo:
    """Each prompt counted once (its choices are consecutive, `choices_per_prompt` of them) and
    every choice's generated tokens; with prefix caching, each prompt's first choice's cached
    prompt tokens."""
    firsts = finals[::choices_per_prompt]
    cached = [first.num_cached_tokens for first in firsts]
    return UsageInfo.of(sum(len(first.prompt_token_ids) for first in firsts),
                        sum(len(final.token_ids) for final in finals), None if None in cached else sum(cached))


@dataclass
class _Sent:
    """What one choice has sent so far."""

    text: int = 0  # characters
    logprobs: int = 0  # entries
    tokens: int = 0  # generated, as of the last output read

    def new_logprobs(self, logprobs: tuple[TokenLogprobs, ...] | None) -> Sequence[TokenLogprobs] | None:
        if logprobs is None:
            return None
        entries = logprobs[self.logprobs:]
        self.logprobs += len(entries)
        return entries or None


async def _interleave(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput | StreamEnd]]:
    """(choice index, item) from every stream as items arrive, until each has ended.

    At most one read is outstanding per stream, and a stream is read again only after its item
    went out: a stream keeps just its newest unread output, so a client that reads slowly costs
    one output per choice, as it does with one choice, not every step's output queued here."""
    if len(streams) == 1:  # the common case, without a task per stream
        async for item in streams[0]:
            yield 0, item
        return
    reads = {asyncio.ensure_future(stream.__anext__()): index for index, stream in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=reads.__getitem__):
                index = reads.pop(read)
                yield index, read.result()
                if not streams[index].finished:
                    reads[asyncio.ensure_future(streams[index].__anext__())] = index
    finally:
        for read in reads:
            read.cancel()  # an unread item stays in its stream


async def stream_events(streams: Sequence[RequestStream], chunk: ChunkMaker, openings: Sequence[BaseModel],
                        include_usage: bool, usage_chunk: Callable[[UsageInfo], BaseModel],
                        continuous_usage_of: Sequence[int] | None = None,
                        choices_per_prompt: int = 1,
                        shown: Callable[[RequestOutput], RequestOutput] | None = None) -> AsyncIterator[str]:
    """The response's events. With `continuous_usage_of` (each choice's prompt tokens, for vLLM's
    continuous_usage_stats) every chunk carries the usage so far: its choice's prompt and tokens
    (none yet in an opening). The usage chunk counts each prompt once (usage_of). `shown` maps
    each output to what the client sees of it (the prompt alone, for max_tokens 0)."""
    def with_usage(made: BaseModel, index: int, generated: int) -> BaseModel:
        if continuous_usage_of is not None:
            made.usage = UsageInfo.of(continuous_usage_of[index], generated)
        return made

    for opening in openings:
        yield chunk_event(with_usage(opening, opening.choices[0].index, 0), include_usage)
    sent = [_Sent() for _ in streams]
    finals: dict[int, RequestOutput] = {}
    async with aclosing(_interleave(streams)) as items:  # its reads end with the stream, however it ends
        async for index, item in items:
            cursor = sent[index]
            if isinstance(item, StreamEnd):
                if item.reason != "abort":
                    yield sse(errors.engine_failed(item.message).response_body())
                    break
                # With any text generated since the last read.
                entries = cursor.new_logprobs(item.logprobs)
                new_ids = ()
                if item.token_ids is not None:  # its usage counts those tokens too
                    new_ids, cursor.tokens = item.token_ids[cursor.tokens:], len(item.token_ids)
                made = chunk(ChunkContent(index, item.text[cursor.text:], "abort", logprobs=entries,
                                          token_ids=new_ids))
                yield chunk_event(with_usage(made, index, cursor.tokens), include_usage)
                continue
            if shown is not None:
                item = shown(item)
            delta, cursor.text = item.text[cursor.text:], max(cursor.text, len(item.text))
            # A token's logprobs go out with the step that made it, though its text may wait (an
            # unfinished character, or the start of a possible stop string); and, as vLLM sends
            # them, so does a chunk, empty then, so that a client timing tokens by chunks (a
            # benchmark's inter-token latency) sees every step.
            entries = cursor.new_logprobs(item.logprobs)
            new_ids, cursor.tokens = item.token_ids[cursor.tokens:], len(item.token_ids)
            if delta or item.finished or entries or new_ids:
                made = chunk(ChunkContent(index, delta, item.finish_reason if item.finished else None,
                                          item.stop_reason, entries, item.prompt_logprobs, new_ids))
                yield chunk_event(with_usage(made, index, cursor.tokens), include_usage)
            if item.finished:
                finals[index] = item
    if include_usage and len(finals) == len(streams):
        yield chunk_event(usage_chunk(usage_of([finals[i] for i in range(len(streams))], choices_per_prompt)),
                          include_usage)
    yield "data: [DONE]\n\n"


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
