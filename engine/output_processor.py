"""Turns the scheduler's per-step token gains into `RequestOutput`s: text, stop strings, logprobs.

The engine's step leaves each progressed request with its new output token ids. For every request
it tracks, the output processor keeps the incremental detokenizer, how many tokens were already
reported, and the logprobs (per generated token, and per prompt position) of the requests that ask
for them. A stop string found in the text finishes the request through `finish_request`, since the
scheduler owns request state. State is released once a request has finished or is aborted, so a
request's entries never outlive it.
"""

from __future__ import annotations

import logging
from typing import Callable

from engine.detokenizer import DetokenizerState, advance, release
from engine.outputs import RequestOutput
from scheduler.output import PromptLogprobs, TokenLogprobs
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.step import ends_sequence

log = logging.getLogger(__name__)

FinishRequest = Callable[[str, RequestStatus, float], None]


class OutputProcessor:
    def __init__(self, tokenizer, finish_request: FinishRequest) -> None:
        self.tokenizer = tokenizer
        self._finish_request = finish_request
        self._detokenizers: dict[str, DetokenizerState] = {}
        self._num_reported: dict[str, int] = {}
        self._logprobs: dict[str, list[TokenLogprobs]] = {}  # requests that asked for them
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}  # likewise, by prompt position
        self.num_generated_tokens = 0

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._detokenizers[request_id] = DetokenizerState.for_prompt(prompt_token_ids, params.skip_special_tokens)
        self._num_reported[request_id] = 0
        if params.logprobs is not None:
            self._logprobs[request_id] = []
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None]  # the first token has nothing before it

    def release(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._num_reported.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def num_tracked(self) -> int:
        """How many requests hold any state here (zero once every request has ended)."""
        return len(set(self._detokenizers) | set(self._num_reported) | set(self._logprobs)
                   | set(self._prompt_logprobs))

    def report(self, request: Request, now: float, step_logprobs: dict[str, TokenLogprobs]) -> RequestOutput:
        request_id = request.request_id
        state = self._detokenizers[request_id]
        new_ids = request.output_token_ids[self._num_reported[request_id]:]
        logprobs = self._logprobs.get(request_id)
        if logprobs is not None and new_ids:
            logprobs = self.add_logprobs(request_id, new_ids, step_logprobs)
        self._num_reported[request_id] = request.num_output_tokens
        self.num_generated_tokens += len(new_ids)
        stops, keep_stop = request.sampling_params.stop, request.sampling_params.include_stop_str_in_output
        # As in vLLM, a token that stopped the request (end of sequence, or one of stop_token_ids)
        # counts in token_ids and usage but not in the text, unless include_stop_str_in_output.
        # Stop strings are found below, so FINISHED_STOPPED here means a stop token.
        token_stop = request.status is RequestStatus.FINISHED_STOPPED and bool(new_ids)
        text_ids = new_ids[:-1] if token_stop and not keep_stop else new_ids
        # As in vLLM, stop strings are searched for only once the output is past min_tokens (the
        # held-back tail below still counts every stop string).
        searched = stops if request.num_output_tokens > request.sampling_params.min_tokens else ()
        stop_string = advance(self.tokenizer, state, text_ids, searched, final=request.is_finished,
                              keep_stop=keep_stop)
        if stop_string is not None and not request.is_finished:
            self._finish_request(request_id, RequestStatus.FINISHED_STOPPED, now)
        # A stop string that came with the last allowed token cut the text as one found earlier
        # does, so the reason is "stop" there too (the scheduler, which owns the request, had
        # already finished it by length).
        finish_reason = "stop" if stop_string is not None else request.status.finish_reason
        # A stop string found in the text is the reason even when a stop token came with it (kept
        # in the text by include_stop_str_in_output), as vLLM's output processor overrides the
        # token's reason with the string its detokenizer finds.
        stop_reason = stop_string if stop_string is not None else (
            _token_stop_reason(request, new_ids[-1]) if token_stop else None)
        new_text = release(state, stops, request.is_finished, keep_stop)
        prompt_logprobs = self._reported_prompt_logprobs(request)
        if request.is_finished:
            self.release(request_id)
        return RequestOutput(
            request_id=request_id, prompt_token_ids=tuple(request.prompt_token_ids),
            token_ids=tuple(request.output_token_ids), new_token_ids=tuple(new_ids), text=state.text[:state.released],
            new_text=new_text, finished=request.is_finished, finish_reason=finish_reason,
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time, num_preemptions=request.num_preemptions, report_time=now,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=None if logprobs is None else tuple(logprobs),
            prompt_logprobs=prompt_logprobs, stop_reason=stop_reason)

    def _reported_prompt_logprobs(self, request: Request) -> tuple[TokenLogprobs | None, ...] | None:
        """A request's prompt logprobs once every position has them (its first token is sampled
        only after the whole prompt is prefilled, so every output carries them whole)."""
        known = self._prompt_logprobs.get(request.request_id)
        return tuple(known) if known is not None and len(known) == request.num_prompt_tokens else None

    def prompt_logprobs_held(self, request_id: str) -> int:
        return len(self._prompt_logprobs.get(request_id, ()))

    def add_prompt_logprobs(self, found: dict[str, PromptLogprobs]) -> None:
        """Extend each request's prompt logprobs with the positions it did not have. The runner
        scores only those (a prefill recomputed after a preemption skips the held ones); should a
        position come again, the first score is kept."""
        for request_id, chunk in found.items():
            known = self._prompt_logprobs.get(request_id)
            if known is None:
                continue  # finished or aborted meanwhile
            if chunk.first_position > len(known):  # chunks come in order, so never: a gap would misplace them
                log.error("request %s: prompt logprobs from position %d, after only %d; it reports none",
                          request_id, chunk.first_position, len(known))
                del self._prompt_logprobs[request_id]
                continue
            known.extend(chunk.entries[len(known) - chunk.first_position:])

    def add_logprobs(self, request_id: str, new_ids: list[int],
                     step_logprobs: dict[str, TokenLogprobs]) -> list[TokenLogprobs] | None:
        """The request's logprobs with those of the one token it gained this step (a request samples
        at most one token a step, and a recomputed request keeps its tokens and so their logprobs).
        Should that ever not hold, the request goes on without logprobs, not the engine down."""
        logprobs = self._logprobs[request_id]
        entry = step_logprobs.get(request_id)
        if len(new_ids) == 1 and entry is not None and entry.token_id == new_ids[0]:
            logprobs.append(entry)
            return logprobs
        log.error("request %s gained tokens %s without their logprobs; it reports none from now on",
                  request_id, new_ids)
        del self._logprobs[request_id]
        return None


def _token_stop_reason(request: Request, token: int) -> int | None:
    """vLLM's stop_reason for a request a token stopped: none for the end-of-sequence token (which
    stop_status checks first), else the token of stop_token_ids itself."""
    return None if ends_sequence(request, token) else token
