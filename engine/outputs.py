"""What the engine reports for a request after a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scheduler.output import TokenLogprobs

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's view of one generated sequence, as `RequestOutput.outputs` lists it, so vLLM's idiom
    `output.outputs[0].text` reads here too. An engine request is one sequence; the offline API
    gathers a prompt's n choices into one RequestOutput."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    # The sum of the sampled tokens' logprobs, when the request asked for logprobs (None else, as
    # in vLLM).
    cumulative_logprob: float | None
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # every generated token so far
    new_token_ids: tuple[int, ...]  # generated this step
    text: str  # detokenized output so far (a matched stop string and what follows are cut)
    new_text: str  # text added this step
    finished: bool
    finish_reason: FinishReason | None
    arrival_time: float
    first_scheduled_time: float | None  # when it first got a seat; minus arrival = queue time
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0
    # Prompt tokens its first admission found in the prefix cache (None: prefix caching is off).
    num_cached_tokens: int | None = None
    report_time: float | None = None  # engine clock at the end of the step that produced this output
    # One per generated token (token_ids), when the request's SamplingParams asked for logprobs.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # One per prompt token, None for the first, when the SamplingParams asked for prompt logprobs.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # vLLM's: what stopped a request that finished with "stop": the stop string, or the stop
    # token id of stop_token_ids; None for the end-of-sequence token, or any other finish.
    stop_reason: int | str | None = None
    # Choices 1..n-1 of an offline prompt generated with SamplingParams(n > 1); this output's own
    # fields, times included, are its first choice's.
    more_outputs: tuple[CompletionOutput, ...] = ()
    # vLLM's: the prompt's text as the offline API was given it (a chat's, rendered by the template);
    # None for token ids, and in the engine's own outputs, which have no use for it.
    prompt: str | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape of this request's result: its sequence, then any further choices."""
        return [self.as_completion(0), *self.more_outputs]

    def as_completion(self, index: int) -> CompletionOutput:
        """This request's own sequence, as choice `index` of a prompt."""
        cumulative = None if self.logprobs is None else sum(entry.logprob for entry in self.logprobs)
        return CompletionOutput(index, self.text, self.token_ids, cumulative, self.logprobs, self.finish_reason,
                                self.stop_reason)
