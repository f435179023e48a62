"""The pieces of one scheduling step that are not decisions: the plan being filled, turning it into
the runner's chunks, the stop rules, and the statistics record."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.output import ScheduledChunk, SchedulerOutput
from scheduler.request import Request, RequestStatus


@dataclass
class StepPlan:
    """What one step has granted so far; mutated while `schedule` fills it."""

    budget: int  # tokens still free in this step
    grants: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The best policy key among requests admitted as urgent this step: running prefill chunks
    # ranked after it yield to it (they take what the free blocks hold, and preempt nobody).
    urgent_key: tuple | None = None

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.grants.append((request, num_new_tokens))
        self.scheduled_ids.add(request.request_id)
        self.budget -= num_new_tokens


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float  # share of device KV blocks in use
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # cumulative
    num_steps: int
    num_finished: int
    num_rejected: int  # by admission control, cumulative
    throughput_tokens_per_s: float | None  # EWMA of served tokens per second
    stability_margin: float | None  # offered load over capacity: tokens, seats or KV (admission.py)
    # Prefix caching, cumulative, in tokens: looked up on admission, and found cached (None: off).
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    host_kv_usage: float | None = None  # share of the swap pool's blocks in use (None: no pool)


def token_slice(request: Request, start: int, end: int) -> tuple[int, ...]:
    """request.all_token_ids[start:end] without concatenating the whole sequence."""
    prompt, num_prompt = request.prompt_token_ids, request.num_prompt_tokens
    if end <= num_prompt:
        return tuple(prompt[start:end])
    output = request.output_token_ids
    if start >= num_prompt:
        return tuple(output[start - num_prompt:end - num_prompt])
    return tuple(prompt[start:]) + tuple(output[:end - num_prompt])


def build_chunks(plan: StepPlan, finished_ids: tuple[str, ...], now: float) -> SchedulerOutput:
    """Turn the grants into chunks and advance each request's num_computed_tokens."""
    chunks = []
    for request, num_new in plan.grants:
        start = request.num_computed_tokens
        tokens = token_slice(request, start, start + num_new)
        request.num_computed_tokens = start + num_new
        chunks.append(ScheduledChunk(
            request_id=request.request_id, token_ids=tokens, start_position=start,
            block_ids=tuple(request.block_ids), sample=request.num_tokens_to_feed == 0))
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if request.requeued_at is not None:
            request.requeued_waits.append((request.requeued_at, now))
            request.requeued_at = None
    return SchedulerOutput(
        chunks=tuple(chunks), preempted_ids=tuple(plan.preempted_ids), finished_ids=finished_ids,
        swap_out=tuple(plan.swap_out), swap_in=tuple(plan.swap_in),
        num_batched_tokens=sum(len(c.token_ids) for c in chunks))


def ends_sequence(request: Request, token: int) -> bool:
    """Whether `token` is the end of sequence, which stops the request unless it ignores it."""
    return token == request.eos_token_id and not request.sampling_params.ignore_eos


def stop_status(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The finished status a just-sampled token puts the request in, if any."""
    params = request.sampling_params
    # Before min_tokens the sampler rules stop tokens out; one it could not (every allowed token
    # a stop token) does not stop the request either, as in vLLM.
    may_stop = request.num_output_tokens > params.min_tokens
    if may_stop and ends_sequence(request, token):
        return RequestStatus.FINISHED_STOPPED
    if may_stop and token in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
