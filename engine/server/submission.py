"""How a request reaches the engine: the checks that need the output limit or the scheduler's
policy, each prompt's sampling parameters, and the submission of every choice of every prompt at
once, refused or admitted as a whole. A mixin of `OpenAIServing` (serving.py), whose attributes
it reads.

A request for `n` choices is `n` engine requests with one prompt, submitted at once as one
ChoiceGroup, which admission judges as a unit (their work together, behind what is queued outside
the group); should one choice still be refused (the queue moved between them), the admitted ones
are aborted. A completions batch is that for each of its prompts. With a seed, choice i draws
with seed + i (as vLLM's parallel sampling does), so the choices differ and each repeats.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Awaitable, Sequence

from engine.async_engine import AsyncLLMEngine, EngineDead, EngineShuttingDown, RequestStream
from engine.server import errors
from engine.server.chat_protocol import ChatCompletionRequest
from engine.server.limits import check_token_ids
from engine.server.protocol import CompletionRequest
from scheduler.admission import AdmissionRejected
from scheduler.policy import SchedulingPolicy
from scheduler.request import ChoiceGroup, SamplingParams, Tier, member_ids

# The body fields an engine-side ValueError can be about: its messages begin with the field's name.
REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)

SERVICE_TIERS = {None: Tier.STANDARD, "auto": Tier.STANDARD, "default": Tier.STANDARD, "scale": Tier.STANDARD,
                 "priority": Tier.INTERACTIVE, "flex": Tier.BATCH}


class EngineSubmission:
    """The engine side of `OpenAIServing`: the attributes below are its, and so are the prompt
    methods it calls (PromptInput's `off_loop`, `_bad_words_token_ids`, `_check_context`)."""

    engine: AsyncLLMEngine
    tokenizer: Any
    policy: SchedulingPolicy

    def _check_priority(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        # As vLLM answers: under any other policy the priority would be silently ignored.
        if body.priority != 0 and not self.policy.orders_by_priority:
            raise errors.invalid_field("priority", f"priority: this server schedules by {self.policy.name}, not "
                                       "by priority (--policy priority); send priority 0 or leave it out")

    def _check_sampler_fields(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                              max_tokens_param: str) -> None:
        """The checks that need the output limit or the vocabulary, each naming its field."""
        if body.min_tokens > max_tokens:
            raise errors.invalid_field("min_tokens", f"min_tokens: {body.min_tokens} is more than the "
                                       f"{max_tokens} tokens {max_tokens_param} allows")
        check_token_ids(body.token_logit_bias(), len(self.tokenizer), "logit_bias")
        check_token_ids(body.allowed_token_ids or (), len(self.tokenizer), "allowed_token_ids")

    async def _submit(self, request_id: str, body: CompletionRequest | ChatCompletionRequest,
                      prompts: list[tuple[list[int], str]], prompt_param: str) -> list[RequestStream]:
        """One stream per choice of each prompt, prompt i's choice j at i * n + j. Their ids:
        request_id itself for one, request_id-j for choice j of one prompt, request_id-i-j in a
        batch. Every prompt is checked before any is submitted."""
        bad_words = await self.off_loop(self._bad_words_token_ids, body.bad_words) if body.bad_words else ()
        params = [self._sampling_params(body, prompt_ids, prompt_param, bad_words) for prompt_ids, _ in prompts]
        tier = SERVICE_TIERS[body.service_tier]
        # Every sequence of the request, each prompt's choices and a batch's prompts, is judged by
        # admission as one unit: judged one by one, a batch's first prompt was work ahead of its
        # second, and an idle server refused the batch on every try.
        size = len(prompts) * body.n
        group = None if size == 1 else ChoiceGroup(
            request_id, size, prompt_tokens=body.n * sum(len(prompt_ids) for prompt_ids, _ in prompts))
        submissions = []
        # A prompt scored alone (max_tokens 0) has no reply to predict: its hidden token is known.
        predicted = not body.scores_prompt_only()
        for prompt_id, (prompt_ids, prompt_text), prompt_params in zip(member_ids(request_id, len(prompts)),
                                                                       prompts, params):
            for choice, choice_id in enumerate(member_ids(prompt_id, body.n)):
                submissions.append(self._submit_one(
                    choice_id, prompt_ids, prompt_text if predicted else None,
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
                                  bad_words_token_ids=bad_words, cache_salt=body.cache_salt)
        except ValueError as exc:
            raise errors.invalid_field(field_named(str(exc)), str(exc)) from exc

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
            raise errors.invalid_field(field_named(str(exc)), str(exc)) from exc

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


def _choice_params(params: SamplingParams, index: int, streamed: bool) -> SamplingParams:
    """Choice i's parameters (SamplingParams.choice: seed + i). A whole reply takes the prompt
    logprobs the choices share from the first choice, so the others score none; a stream sends
    each choice's echo in that choice's first chunk, which may come before the first choice's, so
    there each scores the prompt."""
    choice = params.choice(index)
    return replace(choice, prompt_logprobs=params.prompt_logprobs) if streamed else choice


def field_named(message: str) -> str | None:
    """The request field a sampling-parameter error names (`min_tokens must be ...`, `allowed_token_ids
    holds only ...`), for the 400's `param`; None when it names none."""
    word = message.split(" ", 1)[0].rstrip(":")
    return word if word in REQUEST_FIELDS else None
