"""Clock-free discrete-event core of the scheduling simulator.

It drives the real `Scheduler` (policy, block manager, admission control) with a step-cost model
instead of a model: each step's duration is `a + b * batched_tokens + c * sum of context lengths
+ d * blocks swapped` (the context of a chunk is its end position, which its attention reads; a
swap-preemption step copies each block out or in once). The stand-in model emits an end-of-sequence
token as a request's last token, so it finishes at its true length; its `max_tokens` is the
workload's cap, as a client would send it, so policies and admission, which clamp predictions to
`max_tokens`, see only the predicted length (the oracle policy reads `true_len`). A workload that
replays a benchmark sending each request's true length as `max_tokens` (`bench serve
--ignore-eos`) says so with `max_tokens=None`. Time advances step by step; when
nothing is in the system it jumps to the next arrival. Arrivals during a step join before the next.

`lengthwise bench engine --calibrate` writes the coefficients (keys a, b, c, d; a file without d
charges nothing for swaps) to out/step_cost.json; the simulator reads data/step_cost.json.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from scheduler.admission import AdmissionRejected
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.policy import SchedulingPolicy
from scheduler.request import Request, SamplingParams, Tier, total_requeued_wait_s
from scheduler.scheduler import Scheduler

SIMULATED_TOKEN = 1  # what the stand-in model emits before a request's last token
SIMULATED_EOS = 2  # the stand-in model's end-of-sequence token: a request's last


@dataclass(frozen=True)
class StepCostModel:
    a_s: float  # fixed cost of a step (launch, scheduling, sampling)
    b_s_per_token: float  # per token fed (prefill chunk tokens and decode tokens)
    c_s_per_context_token: float  # per context token attended to, summed over the batch
    d_s_per_swapped_block: float = 0.0  # per KV block copied to or from the host pool

    def __post_init__(self) -> None:
        coefficients = (self.a_s, self.b_s_per_token, self.c_s_per_context_token, self.d_s_per_swapped_block)
        # inf (JSON's Infinity) made every step last forever: a division by zero in the arrival draws.
        # A step feeds at least one token, so a + b > 0 keeps every step's time positive. (a = 0 is
        # what a non-negative fit gives when step time is near proportional to the tokens fed:
        # requiring a > 0 refused the file --calibrate had just written.)
        if (not all(math.isfinite(c) for c in coefficients) or min(coefficients) < 0
                or self.a_s + self.b_s_per_token <= 0):
            raise ValueError(f"step cost coefficients must be finite and >= 0 with a_s + b_s_per_token > 0, "
                             f"got {self}")

    @classmethod
    def from_dict(cls, data: Mapping[str, float]) -> StepCostModel:
        """Reads either these field names or the calibration's short keys a, b, c, d (d optional). A
        least-squares fit may give a slightly negative b or c; those are clamped to 0 (a cost cannot
        be negative)."""
        def coefficient(long: str, short: str, default: float | None = None, clamp: bool = False) -> float:
            value = data.get(long, data.get(short, default))
            if value is None:
                raise KeyError(f"step cost needs {long!r} (or {short!r})")
            # JSON's true read as 1 s a step, and a string as its number.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"step cost {long!r} must be a number, got {value!r}")
            value = float(value)
            # Only where a fit can undershoot: a negative a or d is refused, not read as 0.
            return max(0.0, value) if clamp and not math.isnan(value) else value

        return cls(coefficient("a_s", "a"), coefficient("b_s_per_token", "b", clamp=True),
                   coefficient("c_s_per_context_token", "c", clamp=True),
                   coefficient("d_s_per_swapped_block", "d", 0.0))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def step_time(self, output: SchedulerOutput) -> float:
        context = sum(chunk.start_position + len(chunk.token_ids) for chunk in output.chunks)
        swapped = len(output.swap_out) + len(output.swap_in)
        return (self.a_s + self.b_s_per_token * output.num_batched_tokens + self.c_s_per_context_token * context
                + self.d_s_per_swapped_block * swapped)


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int  # the true length
    predicted_len: float
    # The client's cap on output tokens, at least the true length; None (asked for explicitly) sends
    # the true length itself, as a benchmark with ignore_eos does: the policies' clamp then reads it.
    max_tokens: int | None
    predicted_p50: float | None = None
    predicted_p90: float | None = None
    tier: Tier = Tier.STANDARD
    predicted_rank_len: float | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < self.output_tokens:
            raise ValueError(f"max_tokens {self.max_tokens} is below the true length {self.output_tokens}")

    def to_request(self) -> Request:
        max_tokens = self.output_tokens if self.max_tokens is None else self.max_tokens
        return Request(
            request_id=self.request_id, prompt_token_ids=[SIMULATED_TOKEN] * self.prompt_tokens,
            sampling_params=SamplingParams(max_tokens=max_tokens), eos_token_id=SIMULATED_EOS,
            arrival_time=self.arrival_time, tier=self.tier, predicted_len=self.predicted_len,
            predicted_p50=self.predicted_p50, predicted_p90=self.predicted_p90,
            predicted_rank_len=self.predicted_rank_len, true_len=self.output_tokens)


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    tier: Tier
    arrival_time: float
    output_tokens: int
    rejected: bool
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    requeued_waits: tuple[tuple[float, float], ...] = ()  # (requeued, scheduled again) per requeue

    @property
    def e2e_s(self) -> float:
        return (self.finish_time or 0.0) - self.arrival_time

    @property
    def first_wait_s(self) -> float:
        """Queueing delay before the first scheduled chunk."""
        return (self.first_scheduled_time or 0.0) - self.arrival_time

    @property
    def wait_s(self) -> float:
        """All queueing delay: before the first scheduled chunk, and again after each preemption
        until the request is scheduled once more."""
        return self.first_wait_s + total_requeued_wait_s(self.requeued_waits)

    @property
    def admission_times(self) -> tuple[float, ...]:
        """When it was given a seat: first, then again after each preemption."""
        first = () if self.first_scheduled_time is None else (self.first_scheduled_time,)
        return first + tuple(end for _, end in self.requeued_waits)

    @property
    def ttft_s(self) -> float:
        return (self.first_token_time or 0.0) - self.arrival_time


@dataclass(frozen=True)
class SimulationResult:
    records: tuple[RequestRecord, ...]
    makespan_s: float  # from the first arrival to the last finish
    num_steps: int
    num_preemptions: int
    peak_kv_usage: float
    stability_margins: tuple[tuple[float, float], ...]  # (time, margin) every 64 steps
    leaked_blocks: int  # device and host blocks still held when everything finished; must be 0
    num_swapped_out_blocks: int = 0  # KV blocks copied to the host pool by swap preemption

    @property
    def max_stability_margin(self) -> float | None:
        return max((margin for _, margin in self.stability_margins), default=None)


def _record(request: Request, rejected: bool = False) -> RequestRecord:
    return RequestRecord(
        request_id=request.request_id, tier=request.tier, arrival_time=request.arrival_time,
        output_tokens=request.num_output_tokens, rejected=rejected,
        first_scheduled_time=request.first_scheduled_time, first_token_time=request.first_token_time,
        finish_time=request.finish_time, num_preemptions=request.num_preemptions,
        requeued_waits=tuple(request.requeued_waits))


def _next_token(request: Request) -> int:
    """End of sequence when this token reaches the request's true length."""
    return SIMULATED_EOS if request.num_output_tokens + 1 >= request.true_len else SIMULATED_TOKEN


def simulate(config: SchedulerConfig, workload: Sequence[SimRequest], cost: StepCostModel,
             policy: SchedulingPolicy | None = None, max_steps: int = 10_000_000) -> SimulationResult:
    """Run the workload to completion under `config` (and `policy`, else config.policy)."""
    scheduler = Scheduler(config, policy)
    pending = sorted(workload, key=lambda r: (r.arrival_time, r.request_id))
    records: list[RequestRecord] = []
    now, next_arrival, steps, peak_usage, swapped_out = 0.0, 0, 0, 0.0, 0
    margins: list[tuple[float, float]] = []
    while next_arrival < len(pending) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            now = max(now, pending[next_arrival].arrival_time)
        while next_arrival < len(pending) and pending[next_arrival].arrival_time <= now:
            request = pending[next_arrival].to_request()
            next_arrival += 1
            try:
                scheduler.add_request(request, now)
            except AdmissionRejected:
                records.append(_record(request, rejected=True))
        output = scheduler.schedule(now)
        if output.is_empty:
            if next_arrival >= len(pending) and scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests left and no arrivals")
            if next_arrival < len(pending):
                now = max(now, pending[next_arrival].arrival_time)
            continue
        step_time = cost.step_time(output)
        now += step_time
        swapped_out += len(output.swap_out)
        sampled = {chunk.request_id: _next_token(scheduler.get_request(chunk.request_id))
                   for chunk in output.chunks if chunk.sample}
        peak_usage = max(peak_usage, scheduler.block_manager.usage)
        for request in scheduler.update_from_output(output, ModelRunnerOutput(sampled), now):
            if request.is_finished:
                records.append(_record(request))
        scheduler.record_step(now, output.num_batched_tokens, step_time)
        steps += 1
        if steps % 64 == 0 and (value := scheduler.admission.stability_margin(now)) is not None:
            margins.append((now, value))
        if steps >= max_steps and (next_arrival < len(pending) or scheduler.has_unfinished_requests()):
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
    served = [r for r in records if not r.rejected]
    start = min((r.arrival_time for r in records), default=0.0)
    end = max((r.finish_time or 0.0 for r in served), default=start)
    stats = scheduler.stats()
    host = scheduler.block_manager.host
    return SimulationResult(
        records=tuple(sorted(records, key=lambda r: r.arrival_time)), makespan_s=end - start,
        num_steps=steps, num_preemptions=stats.num_preemptions, peak_kv_usage=peak_usage,
        stability_margins=tuple(margins), num_swapped_out_blocks=swapped_out,
        leaked_blocks=stats.num_total_blocks - stats.num_free_blocks + host.num_blocks - host.num_free)
