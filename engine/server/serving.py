"""The completion and chat handlers: request -> engine submission -> JSON or server-sent events.

Per request: refuse a text too long to fit the context however it tokenizes, tokenize the rest
on a worker thread (chat template for chat), check the context length, build SamplingParams and
the tier, submit to the async engine (admission answers here: 429, 503, 400), then either collect
the final outputs while watching for a client disconnect, or stream SSE chunks (streaming.py)
ending in `data: [DONE]`. Every object of one response shares its id, `created`, model name and
service tier. A request whose client leaves is aborted, which frees its KV blocks at the engine's
next step boundary.

A request for `n` choices is `n` engine requests with one prompt, submitted at once as one
ChoiceGroup, which admission judges as a unit (their work together, behind what is queued outside
the group); should one choice still be refused (the queue moved between them), the admitted ones
are aborted. With a seed, choice i draws with seed + i (as vLLM's parallel sampling does), so the
choices differ and each repeats.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.async_engine import (AsyncLLMEngine, EngineDead, EngineShuttingDown, RequestStream,
                                 StreamEnd)
from engine.server import errors
from engine.server.chat_template import render_chat
from engine.server.limits import check_text_length, longest_token_lengths
from engine.server.logprobs import LogprobsFormatter, end_of_text_offset
from engine.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                    ChatMessageOut, CompletionChoice, CompletionReply,
                                    CompletionReplyChoice, CompletionRequest, CompletionResponse,
                                    new_id, now_s)
from engine.server.streaming import AbortingStreamingResponse, stream_events, usage_of
from scheduler.admission import AdmissionRejected
from scheduler.policy import SchedulingPolicy
from scheduler.request import SEED_MAX, ChoiceGroup, SamplingParams, Tier

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from scheduler.output import TokenLogprobs

SERVICE_TIERS = {None: Tier.STANDARD, "auto": Tier.STANDARD, "default": Tier.STANDARD,
                 "priority": Tier.INTERACTIVE, "flex": Tier.BATCH}


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
        if body.scores_prompt_only() and (not body.echo or body.stream):
            raise errors.invalid_field("max_tokens", "max_tokens: 0 scores the prompt alone, which needs echo: true "
                                       "and no stream")
        prompts = [await self._completion_prompt(body, prompt) for prompt in body.prompts()]
        head = self._head("cmpl", body)
        streams = await self._submit(head["id"], body, prompts, "prompt")
        n = body.n  # prompt i's choice j is stream i * n + j
        echoes = [text if body.echo else "" for _, text in prompts]
        text_offsets = [0] * len(streams)  # where each choice's next stream chunk starts in its text
        echo_due = [body.echo] * len(streams)  # each choice's first chunk carries the echo

        def chunk(index: int, text: str, finish: str | None, entries: Sequence[TokenLogprobs] | None,
                  prompt_entries: Sequence[TokenLogprobs | None] | None = None) -> CompletionResponse:
            echoed, echo_due[index] = echo_due[index], False
            prompt_ids, echo = prompts[index // n][0], echoes[index // n]
            if entries is None:
                logprobs = None
            elif echoed and prompt_entries is not None:  # the prompt's tokens lead, as in a whole reply
                logprobs = self.logprobs.echoed_completion(prompt_ids, prompt_entries, entries)
            else:
                logprobs = self.logprobs.completion(entries, text_offsets[index])
            text_offsets[index] = end_of_text_offset(logprobs, text_offsets[index])
            return CompletionResponse(**head, choices=[CompletionChoice(
                index=index, text=echo + text if echoed else text, logprobs=logprobs, finish_reason=finish)])

        if body.stream:
            include_usage, continuous = body.usage_in_stream()
            events = stream_events(streams, chunk, (), include_usage,
                                   lambda usage: CompletionResponse(**head, choices=[], usage=usage),
                                   [len(prompts[i // n][0]) for i in range(len(streams))] if continuous else None,
                                   choices_per_prompt=n)
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
                logprobs=self._completion_logprobs(final, firsts[index // n].prompt_logprobs,
                                                   prompts[index // n][0], body.echo),
                prompt_logprobs=prompt_logprobs[index // n])
                for index, final in enumerate(finals)])

        return await _json_reply(reply, finals)

    async def _completion_prompt(self, body: CompletionRequest, prompt: str | list[int]) -> tuple[list[int], str]:
        """One prompt of a completion request as (ids, text), checked and truncated."""
        if isinstance(prompt, str):
            self._check_untruncated_text(body, prompt, "prompt")
            # As vLLM: a plain prompt gets the tokenizer's special tokens (a BOS, for models that
            # add one); a chat's come from its template.
            prompt_ids, prompt_text = await self.off_loop(self._encode, prompt, True), prompt
        else:
            self._check_token_ids(prompt)
            prompt_ids, prompt_text = list(prompt), None
        return await self._truncated(body, prompt_ids, prompt_text, "prompt")

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        self._check_accepting()
        self._check_priority(body)
        messages = [m.for_template() for m in body.messages]
        prompt_text, prompt_ids = await self.off_loop(self._render_chat, body, messages, body.tools or None)
        prompt_ids, prompt_text = await self._truncated(body, prompt_ids, prompt_text, "messages")
        head = self._head("chatcmpl", body)
        streams = await self._submit(head["id"], body, [(prompt_ids, prompt_text)], "messages")
        final_message = body.messages[-1]
        role = body.reply_role(final_message.role)
        echo = final_message.text() if body.echo and final_message.role == role else ""  # as vLLM echoes

        def chunk(index: int, text: str, finish: str | None, entries: Sequence[TokenLogprobs] | None,
                  prompt_entries: object = None) -> ChatCompletionChunk:  # chat streams no prompt logprobs
            logprobs = None if entries is None else self.logprobs.chat(entries)
            return ChatCompletionChunk(**head, choices=[ChatChunkChoice(
                index=index, delta=ChatDelta(content=text), logprobs=logprobs, finish_reason=finish)])

        if body.stream:
            include_usage, continuous = body.usage_in_stream()
            # Each choice's role, then (as vLLM sends it) each choice's echo in a chunk of its own.
            deltas = [ChatDelta(role=role, content="")] + ([ChatDelta(content=echo)] if echo else [])
            openings = [ChatCompletionChunk(**head, choices=[ChatChunkChoice(index=index, delta=delta)])
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
                finish_reason=final.finish_reason,
                logprobs=None if final.logprobs is None else self.logprobs.chat(final.logprobs))
                for index, final in enumerate(finals)],
                prompt_logprobs=self._prompt_logprobs(finals[0], body.prompt_logprobs))

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
        be an alias such as the model's path), as vLLM echoes it, else the served name."""
        return {"id": new_id(id_prefix), "created": now_s(), "model": body.model or self.model_name,
                "service_tier": _tier_name(body)}

    # ---- admission ---------------------------------------------------------------------------
    async def off_loop(self, function: Callable, *args: Any) -> Any:
        """function(*args) on the tokenizer thread (the one thread that may touch the tokenizer)."""
        if self._tokenize_pool is None:
            self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lengthwise-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, function, *args)

    def _render_chat(self, body: ChatCompletionRequest, messages: list[dict[str, str]],
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        prompt_text = render_chat(self.tokenizer, messages, body, tools)
        self._check_untruncated_text(body, prompt_text, "messages")
        return prompt_text, self._encode(prompt_text, False)

    def _check_untruncated_text(self, body: CompletionRequest | ChatCompletionRequest, text: str, param: str) -> None:
        """A text too long for any tokenization to fit the context is refused before it is
        tokenized, unless it is to be truncated (then the body's size limit bounds the work)."""
        if body.truncate_prompt_tokens is None:
            check_text_length(text, param, self.max_model_len, self.max_token_chars)

    async def _truncated(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                         prompt_text: str | None, prompt_param: str) -> tuple[list[int], str]:
        """The prompt as the model will see it: vLLM's truncate_prompt_tokens keeps its last N
        tokens (-1: max_model_len), from the left as vLLM cuts. Its text (for echo and the length
        predictor) is decoded from the ids when they were given as ids or cut; the context is
        checked before that decode."""
        keep = body.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if len(prompt_ids) > keep:
                prompt_ids, prompt_text = prompt_ids[-keep:], None
        if prompt_text is None:
            self._check_context(len(prompt_ids), None, prompt_param, "max_tokens")
            prompt_text = await self.off_loop(self.tokenizer.decode, prompt_ids)
        return prompt_ids, prompt_text

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _check_priority(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        # As vLLM answers: under any other policy the priority would be silently ignored.
        if body.priority != 0 and not self.policy.orders_by_priority:
            raise errors.invalid_field("priority", f"priority: this server schedules by {self.policy.name}, not "
                                       "by priority (--policy priority); send priority 0 or leave it out")

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, as vLLM tokenizes them: as the word would start the text,
        and also as it would follow a space where that gives other tokens of the same count (a
        word in the middle of the text)."""
        found = []
        for word in words:
            bare = self._encode(word.lstrip(), False)
            spaced = self._encode(" " + word.lstrip(), False)
            if bare:
                found.append(tuple(bare))
            if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                found.append(tuple(spaced))
        return tuple(found)

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = len(self.tokenizer)
        if any(not 0 <= i < vocab for i in ids):
            raise errors.invalid_field("prompt", f"prompt: token ids must lie in [0, {vocab})")

    def _check_sampler_fields(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                              max_tokens_param: str) -> None:
        """The checks that need the output limit or the vocabulary, each naming its field."""
        if body.min_tokens > max_tokens:
            raise errors.invalid_field("min_tokens", f"min_tokens: {body.min_tokens} is more than the "
                                       f"{max_tokens} tokens {max_tokens_param} allows")
        vocab = len(self.tokenizer)
        for field, ids in (("logit_bias", body.token_logit_bias()), ("allowed_token_ids", body.allowed_token_ids or ())):
            if any(i >= vocab for i in ids):
                raise errors.invalid_field(field, f"{field}: token ids must lie in [0, {vocab})")

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
                      prompts: list[tuple[list[int], str]], prompt_param: str) -> list[RequestStream]:
        """One stream per choice of each prompt, prompt i's choice j at i * n + j. Their ids:
        request_id itself for one, request_id-j for choice j of one prompt, request_id-i-j in a
        batch. Every prompt is checked before any is submitted."""
        bad_words = await self.off_loop(self._bad_words_token_ids, body.bad_words) if body.bad_words else ()
        params = [self._sampling_params(body, prompt_ids, prompt_param, bad_words) for prompt_ids, _ in prompts]
        tier = SERVICE_TIERS[body.service_tier]
        submissions = []
        for index, ((prompt_ids, prompt_text), prompt_params) in enumerate(zip(prompts, params)):
            prompt_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            group = None if body.n == 1 else ChoiceGroup(prompt_id, body.n)
            for choice in range(body.n):
                submissions.append(self._submit_one(
                    prompt_id if body.n == 1 else f"{prompt_id}-{choice}", prompt_ids, prompt_text,
                    _choice_params(prompt_params, choice, body.stream), tier, body.priority, group))
        if len(submissions) == 1:
            return [await submissions[0]]
        return await self._all_admitted(submissions)

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                         prompt_param: str, bad_words: tuple[tuple[int, ...], ...]) -> SamplingParams:
        """A prompt's sampling parameters, or a 400 naming the field that makes them invalid."""
        if not prompt_ids:
            raise errors.invalid_field(prompt_param, f"{prompt_param}: the prompt is empty")
        max_tokens_param, max_tokens = body.requested_max_tokens()
        # A prompt scored alone still has its first token sampled (the engine samples where a
        # prefill ends, at no extra cost); the handler drops it (_prompt_alone).
        max_tokens = self._check_context(len(prompt_ids), 1 if max_tokens == 0 else max_tokens,
                                         prompt_param, max_tokens_param)
        self._check_sampler_fields(body, max_tokens, max_tokens_param)
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop_strings(),
                                  stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                                  include_stop_str_in_output=body.include_stop_str_in_output,
                                  skip_special_tokens=body.skip_special_tokens,
                                  logprobs=body.requested_logprobs(), presence_penalty=body.presence_penalty,
                                  prompt_logprobs=body.requested_prompt_logprobs(),
                                  frequency_penalty=body.frequency_penalty,
                                  repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                                  logit_bias=body.token_logit_bias(),
                                  allowed_token_ids=None if body.allowed_token_ids is None
                                  else tuple(body.allowed_token_ids),
                                  bad_words_token_ids=bad_words)
        except ValueError as exc:
            raise errors.invalid_field(None, str(exc)) from exc

    async def _all_admitted(self, submissions: list[Awaitable[RequestStream]]) -> list[RequestStream]:
        """The streams of submissions made at once, so they reach the engine (and the predictor)
        in one batch; should one be refused, or this handler be cancelled, none runs for nobody."""
        tasks = [asyncio.ensure_future(submission) for submission in submissions]
        try:
            await asyncio.wait(tasks)
        except BaseException:  # this handler cancelled, before or after the last admission
            self._roll_back(tasks)
            raise
        failed = next((task for task in tasks if task.cancelled() or task.exception() is not None), None)
        if failed is not None:
            self._roll_back(tasks)
            raise asyncio.CancelledError() if failed.cancelled() else failed.exception()
        return [task.result() for task in tasks]

    def _roll_back(self, submissions: Sequence[asyncio.Future]) -> None:
        """No choice of a refused or abandoned request runs for nobody: the pending submissions are
        cancelled (AsyncLLMEngine.submit aborts each), the admitted ones aborted."""
        for submission in submissions:
            submission.cancel()
        self._abort_unfinished([submission.result() for submission in submissions if submission.done()
                                and not submission.cancelled() and submission.exception() is None])

    async def _submit_one(self, request_id: str, prompt_ids: list[int], prompt_text: str, params: SamplingParams,
                          tier: Tier, priority: int, group: ChoiceGroup | None = None) -> RequestStream:
        try:
            return await self.engine.submit(request_id, prompt_ids, prompt_text, params, tier=tier, priority=priority,
                                            group=group)
        except AdmissionRejected as exc:
            raise errors.rate_limited(exc.reason, exc.retry_after_s) from exc
        except (EngineShuttingDown, EngineDead) as exc:
            raise errors.engine_state_error(exc) from exc
        except ValueError as exc:
            raise errors.invalid_field(None, str(exc)) from exc

    def _abort_unfinished(self, streams: Sequence[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    def _check_accepting(self) -> None:
        """503 while draining, 500 after an engine failure, before the prompt is tokenized: the
        one tokenizer thread serves requests in order, and a refusal queued behind a long prompt
        could outlast the server's last seconds and go unanswered."""
        try:
            self.engine.check_accepting()
        except (EngineShuttingDown, EngineDead) as exc:
            raise errors.engine_state_error(exc) from exc

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


def _prompt_alone(final: RequestOutput) -> RequestOutput:
    """A finished output without its generated token: what a request for max_tokens 0 (a prompt
    scored alone) gets back, as vLLM answers it (finish_reason "length", no completion tokens)."""
    return replace(final, token_ids=(), new_token_ids=(), text="", new_text="", finish_reason="length",
                   logprobs=None if final.logprobs is None else ())


def _choice_params(params: SamplingParams, index: int, streamed: bool) -> SamplingParams:
    """Choice i's parameters: seed + i (wrapped within a seed's 64 bits). A whole reply takes the
    prompt logprobs the choices share from the first choice, so the others score none; a stream
    sends each choice's echo in that choice's first chunk, which may come before the first
    choice's, so there each scores the prompt."""
    if index == 0:
        return params
    seed = None if params.seed is None else (params.seed + index) & SEED_MAX
    return replace(params, seed=seed, prompt_logprobs=params.prompt_logprobs if streamed else None)


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
