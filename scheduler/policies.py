"""The ordering policies behind the `SchedulingPolicy` seam, and the registry `make_policy`.

Every policy orders by tier first (interactive, standard, batch), then by its own score, then by
arrival: the sort key is `(tier, score, arrival_time, request_id)`, recomputed and re-sorted
every step, so a score may change with time. The victim when memory runs short is the running
request with the largest key (batch tier first, then the worst score). A waiting request may
preempt a running one of a less urgent tier (tier preemption); SRPT adds limited preemption
within a tier.

- fcfs: score 0, so arrival order within a tier.
- priority: vLLM's semantics, the integer `priority` (lower first), ties by arrival; a waiting
  request preempts running ones of a worse priority.
- sjf: the predicted ranking length (output tokens of the predictor's best-ranking head) minus
  the aging rate times the seconds waited. The order this gives equals the order of
  `arrival_time + length / rate`, which does not change while the rate holds, so a request is
  never overtaken by one arriving more than `length / rate` seconds after it: the aging bound.
  The rate is `aging_tokens_per_s`, or by default `aging_tokens_per_step` per measured step (a
  decoding seat gains one token per step), so the bound is a multiple of the request's own
  predicted decode time.
- oracle: exact SJF on the true length (benchmarks only), no aging.
- srpt: predicted remaining output (refined once the output outgrows the first estimate, see
  `refined_remaining`) minus the same aging. Output does not grow while a request waits, so the
  order again equals `arrival_time + remaining / rate` and the aging bound is the remaining
  length it waited with over the rate: above its ranking length only after it outgrew its
  estimate and was preempted, and never above `max_tokens / rate`. It preempts a running request
  of its tier only when the waiting one ranks before it in that aged order, is
  `srpt_preempt_ratio` times shorter, and the running one has produced less than
  `srpt_max_preempt_share` of its ranking length. Aging thus bounds preemption as it bounds
  overtaking: nothing arriving more than the bound after a request preempts it.
- goodput: within a tier, requests about to miss their SLO deadline (slack = deadline - now -
  predicted remaining cost, the steps still needed times the measured step time, between 0 and
  `goodput_urgent_slack_s`) go first by slack; requests
  that can wait follow in sjf order; requests already past saving come last, until their aged
  score reaches 0 (they have waited their aging bound): then they join those that can wait,
  ahead of any not aged as far, so arrivals that can wait never starve a late request. Urgent
  ones still go before it: while urgent arrivals keep coming, sjf's aging bound does not hold
  for it (the simulator's overtaken-beyond-bound count reports how often).
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from scheduler.config import SchedulerConfig
from scheduler.expected_length import Z90
from scheduler.policy import SchedulingPolicy
from scheduler.request import Request, Tier

DEFAULT_LOG_SPREAD = 0.8  # lognormal sigma when no p90 is known


class TieredPolicy(SchedulingPolicy):
    """Tier first, then `score`, then arrival; victims and tier preemption from the same key."""

    name = "fcfs"

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def score(self, request: Request, now: float) -> float:
        return 0.0

    def sort_key(self, request: Request, now: float) -> tuple:
        return (int(request.tier), self.score(request, now), request.arrival_time, request.request_id)

    def choose_victim(self, running: Sequence[Request], now: float) -> Request:
        return max(running, key=lambda r: self.sort_key(r, now))

    def should_preempt_for(self, waiting: Request, running: Request, now: float) -> bool:
        if waiting.tier != running.tier:
            return waiting.tier < running.tier
        return self.preempts_within_tier(waiting, running, now)

    def preempts_within_tier(self, waiting: Request, running: Request, now: float) -> bool:
        return False


class FCFSPolicy(TieredPolicy):
    name = "fcfs"


class PriorityPolicy(TieredPolicy):
    name = "priority"
    orders_by_priority = True

    def score(self, request: Request, now: float) -> int:
        return request.priority  # an int: as a float, priorities above 2**53 would merge

    def preempts_within_tier(self, waiting: Request, running: Request, now: float) -> bool:
        return waiting.priority < running.priority


def ranking_length(request: Request) -> float:
    """The length to order by: the predictor's ranking length when known (its best-ranking head in
    tokens; unlike a lambdarank score, aging can be added to it), else the point."""
    if request.predicted_rank_len is not None:
        return request.sampling_params.clamp_length(request.predicted_rank_len)
    return request.predicted_total


class SJFPolicy(TieredPolicy):
    name = "sjf"
    orders_by_prediction = True
    ages = True
    reads_knobs = frozenset({"aging_tokens_per_step", "aging_tokens_per_s"})
    # Whether to keep every step's aging rate, for per-request bounds after a run. The simulator
    # turns it on; a server, which runs without end and never asks, would only grow the lists.
    record_rate_history = False

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.aging_rate = config.aging_tokens_per_s or 0.0  # tokens per second waited
        self.slowest_rate_while_waiting: float | None = None  # what the aging bound holds at
        # (time, rate) of every step that ordered a waiting request, when recorded: a request's
        # own bound holds at the slowest rate of the steps it waited through.
        self._rate_times: list[float] = []
        self._rates: list[float] = []

    def on_step(self, waiting: Sequence[Request], running: Sequence[Request], now: float,
                step_time_s: float | None) -> None:
        if self.config.aging_tokens_per_s is None and step_time_s:
            self.aging_rate = self.config.aging_tokens_per_step / step_time_s
        if waiting and self.aging_rate > 0:
            slowest = self.slowest_rate_while_waiting
            self.slowest_rate_while_waiting = self.aging_rate if slowest is None else min(slowest, self.aging_rate)
            if self.record_rate_history:
                self._rate_times.append(now)
                self._rates.append(self.aging_rate)

    def length(self, request: Request) -> float:
        return ranking_length(request)

    def score(self, request: Request, now: float) -> float:
        waited = max(0.0, now - request.arrival_time)
        return self.length(request) - self.aging_rate * waited

    def aging_bound_s(self, request: Request, waited_until: float | None = None) -> float:
        """No request arriving more than this long after `request` is ordered before it.

        A later arrival B overtakes A at time t only while length_A - length_B > rate(t) * (arrival_B
        - arrival_A), so the bound is length_A over the slowest rate in force while A waited: the
        steps from its arrival to `waited_until` (its last seat, read from the recorded rates), or
        while anyone waited when not given or not recorded (the current rate before any did)."""
        rate = self.slowest_rate_while_waiting or self.aging_rate
        if waited_until is not None and self.record_rate_history:
            low = bisect.bisect_left(self._rate_times, request.arrival_time)
            high = bisect.bisect_right(self._rate_times, waited_until)
            rate = min(self._rates[low:high], default=self.aging_rate)
        return self.length(request) / rate if rate > 0 else math.inf


class OraclePolicy(SJFPolicy):
    """Exact shortest-job-first by true length: the ideal the predictors are measured against.

    No aging: aging trades mean latency for a starvation bound, and a reference that paid it
    would hide how much of the ideal gain a predictor captures (benchmarks only).
    """

    name = "oracle"
    needs_true_length = True
    orders_by_prediction = False  # true lengths; a server, which has none, does not offer it
    ages = False
    reads_knobs = frozenset()  # no aging

    def length(self, request: Request) -> float:
        return float(request.true_len) if request.true_len is not None else ranking_length(request)

    def score(self, request: Request, now: float) -> float:
        return self.length(request)

    def aging_bound_s(self, request: Request, waited_until: float | None = None) -> float:
        return math.inf


def _upper_tail_ratio(a: float, b: float) -> float:
    """Q(a) / Q(b) for the standard normal tail Q, a <= b, stable far in the tail."""
    if b < 30.0:
        return math.erfc(a / math.sqrt(2.0)) / math.erfc(b / math.sqrt(2.0))
    # Mills ratio: Q(x) ~ phi(x) / x for large x.
    return (b / a) * math.exp((b * b - a * a) / 2.0)


def refined_remaining(request: Request) -> float:
    """Predicted output tokens still to come, refined once generation outgrows the first estimate.

    Before the output reaches the ranking estimate: estimate minus tokens so far. After: a
    lognormal centred on the ranking estimate, its spread from the predicted p90 / p50 but never
    below the default's, and E[X | X > generated] - generated. Centring on p50 instead would give
    every overrunning request of a model whose median sits at the cap the same remaining length,
    the cap minus its output. The floor keeps the estimate growing as the request overruns: a
    lognormal's expected remaining falls past its median when its spread is under about 0.62, so
    with most predictions' spreads (p90 / p50 under 2.2) a request ran down toward 1 token left
    the further it overran, and ranked ahead of fresh short ones. A request this far has shown
    its prediction wrong, so the prediction's own confidence is not taken either.
    """
    generated = request.num_output_tokens
    estimate = ranking_length(request)
    if generated < estimate:
        return estimate - generated
    p50, p90 = request.predicted_p50, request.predicted_p90
    predicted_spread = math.log(p90 / p50) / Z90 if p50 and p90 and p90 > p50 else 0.0
    sigma = max(predicted_spread, DEFAULT_LOG_SPREAD)
    mu, log_g = math.log(estimate), math.log(max(generated, 1))
    b = (log_g - mu) / sigma
    expected = math.exp(mu + sigma * sigma / 2.0) * _upper_tail_ratio(b - sigma, b)
    return max(1.0, request.sampling_params.clamp_length(expected) - generated)


class SRPTPolicy(SJFPolicy):
    name = "srpt"
    reads_knobs = SJFPolicy.reads_knobs | {"srpt_max_preempt_share", "srpt_preempt_ratio"}

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        # request id -> the longest remaining length it waited with, when recorded: a request
        # preempted after outgrowing its estimate waits with a refined remaining length above its
        # ranking length, and its aging bound is that length over the rate.
        self._waited_remaining: dict[str, float] = {}

    def on_step(self, waiting: Sequence[Request], running: Sequence[Request], now: float,
                step_time_s: float | None) -> None:
        super().on_step(waiting, running, now, step_time_s)
        if self.record_rate_history:
            for request in waiting:
                longest = self._waited_remaining.get(request.request_id, 0.0)
                self._waited_remaining[request.request_id] = max(longest, refined_remaining(request))

    def length(self, request: Request) -> float:
        return max(ranking_length(request), self._waited_remaining.get(request.request_id, 0.0))

    def score(self, request: Request, now: float) -> float:
        waited = max(0.0, now - request.arrival_time)
        return refined_remaining(request) - self.aging_rate * waited

    def preempts_within_tier(self, waiting: Request, running: Request, now: float) -> bool:
        # The aged order first: without it a long request whose wait had put it first was preempted
        # by every newer short arrival, losing its prefill each time, for as long as they came.
        if self.score(waiting, now) >= self.score(running, now):
            return False
        # The share of the length srpt ranks it by: the point estimate could put the cut-off past
        # where refined_remaining already counts the request as outgrowing its estimate.
        if running.num_output_tokens >= self.config.srpt_max_preempt_share * ranking_length(running):
            return False
        return refined_remaining(waiting) * self.config.srpt_preempt_ratio < refined_remaining(running)


class GoodputPolicy(SJFPolicy):
    name = "goodput"
    queue_order_holds = False
    reads_knobs = SJFPolicy.reads_knobs | {"goodput_urgent_slack_s", "slo_ttft_interactive_s", "slo_e2e_standard_s"}

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        # Seconds one step takes: the configured cost, else the measured mean (0 before any step).
        self.step_time_s = config.goodput_step_time_s or 0.0

    def on_step(self, waiting: Sequence[Request], running: Sequence[Request], now: float,
                step_time_s: float | None) -> None:
        super().on_step(waiting, running, now, step_time_s)
        if self.config.goodput_step_time_s is None and step_time_s:
            self.step_time_s = step_time_s

    def deadline(self, request: Request) -> float | None:
        if request.tier == Tier.INTERACTIVE and request.first_token_time is None:
            return request.arrival_time + self.config.slo_ttft_interactive_s
        if request.tier == Tier.STANDARD:
            return request.arrival_time + self.config.slo_e2e_standard_s
        return None

    def sort_key(self, request: Request, now: float) -> tuple:
        deadline = self.deadline(request)
        if deadline is None:
            return (int(request.tier), 1, self.score(request, now), request.arrival_time, request.request_id)
        if request.tier == Tier.INTERACTIVE:
            cost_steps = self._steps_to_first_token(request)
        else:
            cost_steps = refined_remaining(request)  # one decode step per remaining token
        slack = deadline - now - cost_steps * self.step_time_s
        if 0.0 <= slack <= self.config.goodput_urgent_slack_s:
            group, value = 0, slack
        else:
            value = self.score(request, now)
            group = 1 if slack > 0 or value <= 0.0 else 2
        return (int(request.tier), group, value, request.arrival_time, request.request_id)

    def _steps_to_first_token(self, request: Request) -> float:
        # The prefill still to feed goes through in chunks of at most a step's token budget.
        return float(max(1, -(-request.num_tokens_to_feed // self.config.max_num_batched_tokens)))


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "sjf": SJFPolicy,
    "srpt": SRPTPolicy,
    "oracle": OraclePolicy,
    "goodput": GoodputPolicy,
}


def make_policy(name: str, config: SchedulerConfig) -> SchedulingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return factory(config)
