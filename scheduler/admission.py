"""Token-level admission control and the stability margin.

Work is counted in tokens, not requests: a request in the system owes its prompt tokens not yet
computed (after a recompute preemption, its generated tokens too, fed again) plus its predicted
output tokens not yet generated, from the mean of its predicted length distribution (sums of
lengths go by their means; `expected_length.py`). The controller learns the served token
throughput as an EWMA (the engine or the simulator reports each step with `record_step`), and
estimates a new request's delay by Little's law in tokens: the work that will be served before or
alongside it divided by the throughput.

- interactive: predicted TTFT = (prompt tokens still to feed of the interactive requests ahead,
  running or queued before it in the policy's order, + its own prompt) / throughput, plus the
  wait for a seat when interactive requests hold them all (until as many of the running ones end,
  by their predicted steps left, as the queue ahead and it need; a queue ahead longer than that,
  or one whose KV blocks at their predicted ends leave no room for its prompt, counts its whole
  token work, as standard requests do); rejected above
  `slo_ttft_interactive_s`. A fluid estimate: it leaves out the rest of the step in flight
  and the other tiers' decodes that share each step, work that tier order cannot move and a
  refusal would not shorten, so where steps are slow it reads low (on the CPU a step of 32 seats
  takes about 0.2-0.7 s, and most interactive requests miss 500 ms).
- standard: predicted end-to-end = (token work ahead + its own prompt) / throughput + its
  predicted output tokens * the mean step time, since one request gains one token per step however
  fast the server is; rejected above `slo_e2e_standard_s`. Ahead are the running interactive and
  standard requests (but those the policy lets it preempt: under priority a worse priority, under
  srpt a long one early in its run) and the queued ones the policy orders before it (under sjf, a short request
  queues behind shorter ones only; under goodput, whose order moves, all of them). When it can
  run beside all of them (a seat each, now or once as many running requests end as it lacks, and
  their KV blocks at their predicted ends fit the cache less the watermark's reserve), only
  their prompts still to feed and that wait for a seat delay it: their decodes share its steps,
  which the mean step time already prices. Otherwise (more queued ahead than one turn of the
  seats, or no room for their blocks) their whole token work counts, as if served before its
  own decode starts (conservative), and never less than the wait for its seat.

The throughput is the served rate (an EWMA of tokens per step over seconds per step), or the best
step's rate when that is higher and a seat is free (or held by a lower tier, whose seat the
request takes by preemption): at light load the served rate measures demand, not capacity (a
lone decode feeds one token a step), and would refuse an idle server's first request, while with
every seat taken by its tier or a more urgent one it is what the work ahead drains at. The best
step's rate halves every `capacity_half_life_s` (600 s) unless a step matches it again, so a
lone decode that outlasts any window does not make the server look slow, while a machine that
really slowed down is believed within minutes.
- batch: no latency SLO; it is shed first when the bounded queue fills, being admitted only while
  queued work (of every tier) stays below `batch_shed_share` of the bound. Without
  `max_queued_tokens` the bound is checked for batch requests alone, at four KV caches' worth of
  tokens (`SchedulerConfig.queued_token_bound`): a batch flood must not queue without limit,
  while a request with an SLO is refused only when it would miss it.

Admission sheds load, so for its SLO only work ahead of a request can get it rejected, and only
when that work is what makes it miss: a request is admitted when nothing is ahead of it, or when
its own work alone misses its SLO while the work ahead alone would not, since refusing it would
help no other request and no retry could ever succeed while the server has traffic. Once the work
ahead alone exceeds the SLO, which would make any request miss, every request of the tier is
refused until it drains back to the SLO (Retry-After): without that, the requests too large to
meet it were admitted whatever was queued, and the SLO tiers' queues had no bound. The queue
bound counts the queued work of the request's tier or a more urgent one in any order, since it
bounds what is queued, with the request's own (a full batch queue never refuses an interactive
request).
Rejections raise `AdmissionRejected(reason, retry_after_s)`, the HTTP layer turns them into a 429
with Retry-After: the time for enough of the work ahead to drain (at most all of it), between
1 s and an hour.

The stability margin is offered load over capacity in a sliding window, the largest of three
utilizations: tokens, lambda * (m_prefill + m_decode) against the step budget B over the time of a
full step (the window's best step rate); seats, lambda * (m_decode + m_prefill / B) against
max_num_seqs over the mean step time (a request holds a seat for each decode step and each
prefill chunk); and KV, lambda * t_step * mean(d * (p + d / 2)) against the KV cache's tokens
(Little's law: a request holds p + d / 2 KV slots on average over its d decode steps), from the
arrivals that came with a prediction. The window holds the last `stability_window_s` seconds, and
at least the last MIN_ARRIVALS_IN_WINDOW arrivals, back to MAX_ARRIVAL_AGE_WINDOWS windows: two
arrivals in ten seconds say little about a rate, but one from before an idle hour says nothing
about a burst now; and a window that holds MIN_ARRIVALS_FOR_A_WINDOW_RATE arrivals or more is
rated on its own too, so that the older ones kept beside a burst cannot dilute it. Above 1 the
queue cannot drain; it is logged when it crosses 1.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from scheduler.config import SchedulerConfig
from scheduler.policies import refined_remaining
from scheduler.request import Request, Tier

logger = logging.getLogger(__name__)

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 3600.0  # a measured throughput near zero must not promise a day's wait
# The capacities the stability margin weighs the offered load against, as its warning names them.
CAPACITY_NAMES = {"tokens": "token throughput", "seats": "seats (max_num_seqs)", "KV": "KV cache"}
# The stability margin's arrival rate is taken over at least this many arrivals, none older than
# this many windows.
MIN_ARRIVALS_IN_WINDOW = 32
MAX_ARRIVAL_AGE_WINDOWS = 30
# A window holding this many arrivals has a rate of its own, which older arrivals kept beside it
# must not dilute (a burst after a quiet spell); fewer are too few to say.
MIN_ARRIVALS_FOR_A_WINDOW_RATE = 8


class _Step(NamedTuple):
    at: float
    seconds: float
    tokens: int


class _Arrival(NamedTuple):
    at: float
    prompt_tokens: int
    predicted_decode: float  # output tokens still to come (the max_tokens cap without a prediction)
    kv_token_steps: float | None  # None without a prediction: it stays out of the decode and KV terms


class _SloTerms(NamedTuple):
    target_s: float  # the tier's SLO
    what: str  # what it bounds, for the refusal's reason
    alone_s: float  # one choice's own time, with nothing ahead
    own_s: float  # its whole group's


class AdmissionRejected(Exception):
    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


def predicted_output_tokens(request: Request) -> float:
    """Predicted output tokens still to come, never above what max_tokens allows: the predicted
    distribution's mean (`Request.predicted_mean`), since admission adds them up over requests.
    The point estimate, fitted in log space, undercounted the work by about a sixth."""
    return max(0.0, request.predicted_mean - request.num_output_tokens)


def tokens_to_prefill(request: Request) -> int:
    """Known tokens still to feed before the request decodes again: its prompt's uncomputed part,
    and after a recompute preemption its generated tokens too (all but the last, whose feed is the
    next decode step, counted in the predicted output)."""
    pending_decode = 1 if request.num_output_tokens else 0
    return max(0, request.num_tokens_to_feed - pending_decode)


def decode_steps_left(request: Request) -> float:
    """Predicted decode steps before a running request ends: its predicted output tokens still to
    come, or, once it has outgrown the prediction, srpt's refined remaining length (a lognormal
    tail past what it produced; at least one). Read as none left, an overrunning request's seat
    was priced free at once."""
    left = predicted_output_tokens(request)
    return left if left >= 1.0 else refined_remaining(request)


def token_work(requests: Iterable[Request]) -> float:
    return sum(tokens_to_prefill(r) + predicted_output_tokens(r) for r in requests)


@dataclass
class QueuedSums:
    """Requests queued (waiting or swapped out) of some tiers: how many, their token work, and
    their prompt tokens still to feed."""

    count: int = 0
    work: float = 0.0
    prefill: float = 0.0

    @classmethod
    def of(cls, requests: Iterable[Request]) -> QueuedSums:
        sums = cls()
        for request in requests:
            sums.add(request)
        return sums

    def add(self, request: Request) -> None:
        prefill = tokens_to_prefill(request)
        self.count += 1
        self.prefill += prefill
        self.work += prefill + predicted_output_tokens(request)


class QueuedWork:
    """The queue's sums per tier, kept from one arrival to the next: each arrival's check walked
    the whole queue (a burst of 3,000 arrivals took 6-11 s of the engine thread). The scheduler
    adds each admitted arrival and calls `invalidate` whenever anything else changes its queues;
    the sums are then taken afresh."""

    def __init__(self) -> None:
        self._by_tier: dict[Tier, QueuedSums] | None = None

    def invalidate(self) -> None:
        self._by_tier = None

    def up_to(self, tier: Tier, queued: Iterable[Request]) -> QueuedSums:
        """The sums over `tier` and the more urgent ones; `queued` is every queued request, summed
        when nothing is kept."""
        if self._by_tier is None:
            queued = list(queued)
            self._by_tier = {each: QueuedSums.of(r for r in queued if r.tier == each) for each in Tier}
        kept = [sums for each, sums in self._by_tier.items() if each <= tier]
        return QueuedSums(sum(s.count for s in kept), sum(s.work for s in kept), sum(s.prefill for s in kept))

    def added(self, request: Request) -> None:
        if self._by_tier is not None:
            self._by_tier[request.tier].add(request)


class AdmissionController:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._ewma_tokens: float | None = None  # tokens per step
        self._ewma_time: float | None = None  # seconds per step
        self._steps: deque[_Step] = deque()
        self._best_step: tuple[float, float] | None = None  # (time, tokens per second), decaying
        self._last_step_at = 0.0
        self._arrivals: deque[_Arrival] = deque()
        self._overloaded = False
        self.num_rejected = 0

    # ---- measurements ------------------------------------------------------------------------
    def record_step(self, now: float, num_tokens: int, step_time_s: float) -> None:
        if step_time_s <= 0:
            return
        alpha = self.config.throughput_ewma_alpha
        if self._ewma_tokens is None or self._ewma_time is None:
            self._ewma_tokens, self._ewma_time = float(num_tokens), step_time_s
        else:
            self._ewma_tokens += alpha * (num_tokens - self._ewma_tokens)
            self._ewma_time += alpha * (step_time_s - self._ewma_time)
        self._steps.append(_Step(now, step_time_s, num_tokens))
        self._last_step_at = now
        rate = num_tokens / step_time_s
        if self._best_step is None or rate >= self._best_rate_at(now):
            self._best_step = (now, rate)
        self._prune(now)

    def _best_rate_at(self, now: float) -> float:
        if self._best_step is None:
            return 0.0
        measured_at, rate = self._best_step
        return rate * 0.5 ** (max(0.0, now - measured_at) / self.config.capacity_half_life_s)

    def record_arrival(self, now: float, request: Request) -> None:
        prompt, decode = request.num_prompt_tokens, predicted_output_tokens(request)
        # Without a prediction the decode falls back to max_tokens (the rest of the context for a
        # chat request), which the KV term, quadratic in it, would turn into a phantom overload.
        # A length the request's own limits fix (a prompt scored alone: one token) is known: left
        # out, such requests still counted in the arrival rate, times the others' mean decode.
        params = request.sampling_params
        known = request.predicted_len is not None or params.max_tokens <= max(1, params.min_tokens)
        kv_steps = decode * (prompt + decode / 2) if known else None
        self._arrivals.append(_Arrival(now, prompt, decode, kv_steps))
        self._prune(now)

    def _prune(self, now: float) -> None:
        horizon = now - self.config.stability_window_s
        while self._steps and self._steps[0].at < horizon:
            self._steps.popleft()
        while len(self._arrivals) > MIN_ARRIVALS_IN_WINDOW and self._arrivals[0].at < horizon:
            self._arrivals.popleft()
        oldest = now - MAX_ARRIVAL_AGE_WINDOWS * self.config.stability_window_s
        while self._arrivals and self._arrivals[0].at < oldest:
            self._arrivals.popleft()

    @property
    def throughput_tokens_per_s(self) -> float | None:
        if not self._ewma_tokens or not self._ewma_time:
            return None
        return self._ewma_tokens / self._ewma_time

    @property
    def capacity_tokens_per_s(self) -> float | None:
        """The token rate delays are estimated with: the served rate, or the best step's (decayed
        to the latest step)."""
        served = self.throughput_tokens_per_s
        if served is None:
            return None
        return max(served, self._best_rate_at(self._last_step_at))

    def _drain_rate(self, saturated: bool) -> float | None:
        """The token rate the work ahead of a request drains at. With every seat taken, the served
        rate: what the server serves is then all it can, and the best step's rate (a full prefill
        chunk's) overstates how fast queued decodes drain, one token per seat per step (2x, under
        a simulated overload). Otherwise the capacity, since a lightly loaded server's served
        rate measures its demand. (The request's own prompt is priced at the capacity: pricing
        it at a decode-bound rate would make most requests miss on their own, which admits them.)"""
        return self.throughput_tokens_per_s if saturated else self.capacity_tokens_per_s

    @property
    def mean_step_time_s(self) -> float | None:
        """EWMA of measured step seconds; a decoding seat gains one token per step."""
        return self._ewma_time

    def stability_margin(self, now: float) -> float | None:
        """Offered load over capacity in the sliding window (above 1: the queue grows): 0 with no
        arrival in it, None with arrivals in it but no step to measure capacity by.

        The largest of three utilizations: tokens, lambda * (m_prefill + m_decode) against
        B / t_step of a full step; seats, lambda * (m_decode + m_prefill / B) against
        max_num_seqs / t_step, since a request holds a seat for every decode step (one token each)
        and every prefill chunk; and KV, lambda * t_step * mean(d * (p + d / 2)) against the
        cache's tokens, the mean over arrivals that came with a prediction (none: no KV term). With
        32 seats and a 512-token budget the seats bind for chat-length replies: the token term
        alone read 0.1-0.3 while the simulated queue grew without bound. With the cache full, fewer
        seats are filled and steps get faster, so the seat term too read a median 0.8-0.9 under a
        load of 1.3 (a probe with placeholder step costs and 16k KV tokens). With all three terms,
        `scripts/margin_vs_load.py` (calibrated costs, 23k KV tokens) reads a median 0.43 at load
        0.9, 0.87 at 1.0 and 1.35 at 1.3."""
        self._prune(now)
        window = self.config.stability_window_s
        if not self._steps or not self._arrivals:
            self._overloaded = False  # idle: the next crossing of 1 is logged again
            # No arrival in the window is an offered load of 0, whatever the capacity: a gauge of
            # 0, not a gap (a fresh server's exported none, which dashboards read as no data, as
            # for 300 s after a burst, while older arrivals are kept for the rate). Arrivals in
            # the window before any step in it have no capacity to be measured against.
            return None if any(a.at >= now - window for a in self._arrivals) else 0.0
        # Arrivals per second over the whole window (or the span of the arrivals kept, when longer),
        # even before a window has passed: dividing by the time since the first arrival alone would
        # call two requests 20 ms apart 50 per second.
        span = max(window, now - self._arrivals[0].at)
        in_window = sum(1 for a in self._arrivals if a.at >= now - window)
        window_rate = in_window / window if in_window >= MIN_ARRIVALS_FOR_A_WINDOW_RATE else 0.0
        arrival_rate = max(len(self._arrivals) / span, window_rate)
        mean_prompt = sum(a.prompt_tokens for a in self._arrivals) / len(self._arrivals)
        # The mean over arrivals with a prediction (none: the prompt terms alone), as for KV: the
        # max_tokens fallback made a server without a predictor report an overload not there.
        predicted = [a for a in self._arrivals if a.kv_token_steps is not None]
        mean_decode = sum(a.predicted_decode for a in predicted) / len(predicted) if predicted else 0.0
        mean_kv_steps = sum(a.kv_token_steps for a in predicted) / len(predicted) if predicted else 0.0
        mean_step = sum(s.seconds for s in self._steps) / len(self._steps)
        # B / t_step of a full step: the best rate among steps that used at least half the budget.
        # B over the mean step, mostly short decodes, overstated the served engine's capacity
        # threefold (1,937 against 581 tokens/s in a logged run). Without such a step the budget
        # has not bound in the window, and a small step's rate would understate capacity.
        token_capacity = max((s.tokens / s.seconds for s in self._steps
                              if 2 * s.tokens >= self.config.max_num_batched_tokens), default=0.0)
        loads = {
            "tokens": arrival_rate * (mean_prompt + mean_decode) / token_capacity if token_capacity else 0.0,
            "seats": arrival_rate * (mean_decode + mean_prompt / self.config.max_num_batched_tokens) * mean_step
            / self.config.max_num_seqs,
            "KV": arrival_rate * mean_kv_steps * mean_step / (self.config.num_gpu_blocks * self.config.block_size),
        }
        binding = max(loads, key=loads.__getitem__)
        margin = loads[binding]
        if margin > 1.0 and not self._overloaded:
            logger.warning("the offered load exceeds the capacity in %s (stability margin %.3f)",
                           CAPACITY_NAMES[binding], margin)
        self._overloaded = margin > 1.0
        return margin

    # ---- the decision ------------------------------------------------------------------------
    def check(self, request: Request, waiting: Iterable[Request], running: Iterable[Request],
              ranks_before: Callable[[Request], bool] | None = None,
              queued_work: QueuedWork | None = None,
              preempts: Callable[[Request], bool] | None = None) -> None:
        """Raise AdmissionRejected when the request's tier SLO cannot be met or the queue is full.

        `waiting`: every queued request (waiting or swapped out), which the queue bound counts;
        `ranks_before(other)`: whether the policy serves a queued request before this one (None:
        every queued one is ahead), which the delay estimates count; `queued_work`: the scheduler's
        running sums of `waiting`'s work (None: summed here); `preempts(other)`: whether the policy
        lets this request take a running one's seat (None: those of a lower tier). The sequences of one API
        request (its choices, and a batch's prompts) are judged as one unit, the same for each:
        their work together, behind what is queued outside the group. Whether a request is too
        large to refuse (see the module docstring) is read from one member, so that asking for
        more choices never makes admission easier."""
        waiting = list(waiting)
        # Running requests it may not preempt: a lower tier's seat it would take by preemption
        # (or, under priority and srpt, one of its own tier's that the policy lets it take), and
        # their decodes are not ahead of it.
        if preempts is None:
            preempts = lambda other: other.tier > request.tier  # noqa: E731
        running = [r for r in running if not preempts(r)]
        if request.group is not None:  # its siblings are not ahead of it
            waiting = [r for r in waiting if not request.shares_group_with(r)]
            running = [r for r in running if not request.shares_group_with(r)]
        one_work = request.num_prompt_tokens + predicted_output_tokens(request)
        # The work ahead drains at the served rate while every seat is taken by its tier or a more
        # urgent one; its own prompt, once its turn comes, is fed at the capacity's.
        drain = self._drain_rate(saturated=len(running) >= self.config.max_num_seqs)
        queued = self._queued_through_tier(request, waiting, queued_work)
        self._check_queue_bound(request, one_work, queued.work, drain)
        throughput = self.capacity_tokens_per_s
        if throughput is None or drain is None or request.tier == Tier.BATCH:
            return  # nothing measured yet (no basis for a delay estimate), or no SLO to estimate for
        slo = self._slo_terms(request, throughput)
        # Interactive requests wait for the interactive ones ahead; standard ones for those too.
        tier_queued = [r for r in waiting if r.tier <= request.tier]
        if ranks_before is not None:
            # Every one of them counted ahead bounds the delay from above: when even that meets
            # the SLO, the policy's order, the costly part of a check over a long queue (a burst
            # of 3,000 took 6-8 s under sjf), cannot change the answer.
            if self._refusal(self._delay_s(request, tier_queued, queued, running, drain), slo) is None:
                return
            queued_ahead = [r for r in tier_queued if ranks_before(r)]
        else:
            queued_ahead = tier_queued
        # Every such queued request ahead (a request arriving last in FCFS order): the sums above.
        sums = queued if queued.count == len(queued_ahead) else QueuedSums.of(queued_ahead)
        ahead_s = self._delay_s(request, queued_ahead, sums, running, drain)
        retry_s = self._refusal(ahead_s, slo)
        if retry_s is not None:
            estimate = ahead_s + slo.own_s
            # A group that misses on its own work waits in vain for the work ahead to drain.
            hint = (f" (its {request.group_size} sequences alone take {slo.own_s:.2f}s: send fewer per request)"
                    if slo.own_s > slo.target_s >= slo.alone_s else "")
            self._reject(f"predicted {slo.what} {estimate:.2f}s exceeds the {request.tier.name.lower()} "
                         f"SLO of {slo.target_s:.2f}s{hint}", retry_s)

    def _slo_terms(self, request: Request, throughput: float) -> _SloTerms:
        """The request's tier SLO and its own time against it. The last member's first token waits
        for every member's prefill; a standard request then decodes a token a step, the members
        side by side."""
        one_s, group_s = request.num_prompt_tokens / throughput, request.group_prompt_tokens / throughput
        if request.tier == Tier.INTERACTIVE:
            return _SloTerms(self.config.slo_ttft_interactive_s, "TTFT", one_s, group_s)
        decode_s = predicted_output_tokens(request) * (self.mean_step_time_s or 0.0)
        return _SloTerms(self.config.slo_e2e_standard_s, "end-to-end latency", one_s + decode_s, group_s + decode_s)

    def _delay_s(self, request: Request, queued_ahead: list[Request], queued: QueuedSums,
                 running: list[Request], drain: float) -> float:
        if request.tier == Tier.INTERACTIVE:
            return self._interactive_delay_s(request, queued_ahead, queued, running, drain)
        return self._standard_delay_s(request, queued_ahead, queued, running, drain)

    @staticmethod
    def _queued_through_tier(request: Request, waiting: list[Request],
                             queued_work: QueuedWork | None) -> QueuedSums:
        """The sums over the queued requests of the request's tier or a more urgent one (`waiting`,
        its group's other members left out): the scheduler's kept sums, or summed here."""
        if queued_work is not None and request.group is None:
            return queued_work.up_to(request.tier, waiting)
        return QueuedSums.of(r for r in waiting if r.tier <= request.tier)

    def _seats_short(self, request: Request, queued_ahead: list[Request], running: list[Request]) -> int:
        """How many of `running` must end before the request's group has a seat each, after the
        queued requests ahead took theirs (0 or less: seats are free now)."""
        return len(queued_ahead) + len(running) + request.group_size - self.config.max_num_seqs

    def _seat_wait_s(self, short: int, running: list[Request]) -> float:
        """Seconds until `short` of the running requests have ended, by their predicted steps
        left (0 when none must); when more must end than run, until the last does, a lower bound.
        Without it a request found every seat taken by decodes of its tier or a more urgent one
        and priced no wait at all (an interactive one), or the whole work of every running
        request when one ended in a few steps (a standard one)."""
        if short <= 0 or not running:
            return 0.0
        budget = self.config.max_num_batched_tokens
        steps_left = sorted(-(-tokens_to_prefill(r) // budget) + decode_steps_left(r) for r in running)
        return steps_left[min(short, len(running)) - 1] * (self.mean_step_time_s or 0.0)

    def _whole_work_s(self, queued: QueuedSums, running: list[Request], drain: float, seat_s: float) -> float:
        """Little's law in tokens when the request cannot run beside those ahead: their whole token
        work drains first, the prompts still to feed and then their decodes, which take no less
        than the wait for its seat. (Never less than the prompts and the seat alone, so that a
        longer queue never reads as a shorter delay.)"""
        decode = queued.work - queued.prefill + sum(predicted_output_tokens(r) for r in running)
        return self._prefill_ahead_s(queued, running, drain) + max(seat_s, decode / drain)

    @staticmethod
    def _prefill_ahead_s(queued: QueuedSums, running: list[Request], drain: float) -> float:
        """Seconds to feed the prompts still to feed of the queued requests ahead and the running."""
        return (queued.prefill + sum(tokens_to_prefill(r) for r in running)) / drain

    def _interactive_delay_s(self, request: Request, queued_ahead: list[Request], queued: QueuedSums,
                             running: list[Request], drain: float) -> float:
        """Seconds before an interactive request's own prefill: the prompts still to feed of the
        interactive requests ahead (running ones too: a long prompt given its first chunk still
        has its other chunks served before anything waiting), after a seat frees for it; when the
        queue ahead outlasts one turn of the running requests' seats, their whole work."""
        short = self._seats_short(request, queued_ahead, running)
        seat_s = self._seat_wait_s(short, running)
        # Its prompt's blocks beside theirs at their predicted ends: interactive requests ahead are
        # no one's victims, so without room it waits for them to end, as without a seat.
        prompt_blocks = request.group_size * self._blocks_for(request.num_prompt_tokens)
        if short > len(running) or not self._fits_beside(queued_ahead + running, prompt_blocks):
            return self._whole_work_s(queued, running, drain, seat_s)
        return self._prefill_ahead_s(queued, running, drain) + seat_s

    def _standard_delay_s(self, request: Request, queued_ahead: list[Request], queued: QueuedSums,
                          running: list[Request], drain: float) -> float:
        """Seconds of work served before a standard request's own (module docstring): the prompts
        still to feed of those ahead (`queued_ahead`, whose sums are `queued`, and `running`) and
        the wait for a seat, when it then runs beside them all, else their whole token work.
        Batch requests are not ahead: a standard one preempts them for a seat or blocks."""
        short = self._seats_short(request, queued_ahead, running)
        seat_s = self._seat_wait_s(short, running)
        # A few: their blocks are summed only when seats allow.
        if short <= len(running) and self._fits_beside(queued_ahead + running,
                                                       request.group_size * self._blocks_to_finish(request)):
            return self._prefill_ahead_s(queued, running, drain) + seat_s
        return self._whole_work_s(queued, running, drain, seat_s)

    def _fits_beside(self, ahead: list[Request], own_blocks: int) -> bool:
        """Whether `own_blocks` fit beside the blocks of the requests `ahead` at their predicted
        ends, in the cache less the watermark's reserve, which a request (or a swapped-out one)
        leaves free to start."""
        blocks = sum(self._blocks_to_finish(r) for r in ahead) + own_blocks
        return blocks <= self.config.num_gpu_blocks * (1.0 - self.config.kv_watermark)

    def _blocks_to_finish(self, request: Request) -> int:
        """KV blocks the request holds at its predicted end."""
        return self._blocks_for(request.num_tokens + predicted_output_tokens(request))

    def _blocks_for(self, tokens: float) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _check_queue_bound(self, request: Request, one_work: float, queued: float,
                           throughput: float | None) -> None:
        """`queued`: the token work queued in the request's tier and the more urgent ones, what
        it would queue behind."""
        if self.config.max_queued_tokens is None and request.tier != Tier.BATCH:
            return  # no bound set: the tiers with an SLO are bounded by it, batch by the default
        bound = self.config.queued_token_bound
        share = self.config.batch_shed_share if request.tier == Tier.BATCH else 1.0
        limit = bound * share
        own_work = request.group_prompt_tokens + predicted_output_tokens(request) * request.group_size
        # A request as large as the limit on its own would fit only an empty queue, which steady
        # traffic never leaves (every retry refused): it is refused only while the queue is full.
        if one_work >= limit:  # it waits for the queue to drain below the limit, not to empty
            overflows, excess = queued >= limit, queued - limit
        else:
            overflows, excess = queued + own_work > limit, queued + min(own_work, limit) - limit
        if queued > 0 and overflows:  # an empty queue is never full
            retry = min(excess, queued) / throughput if throughput else MIN_RETRY_AFTER_S
            self._reject(f"queue full: {queued:.0f} queued tokens + {own_work:.0f} exceed the "
                         f"{request.tier.name.lower()} bound {bound * share:.0f}", retry)

    @staticmethod
    def _refusal(ahead_s: float, slo: _SloTerms) -> float | None:
        """The Retry-After of a request that `ahead_s` of work ahead makes miss its SLO, or None
        when it is admitted. `alone_s`, one choice's own time, decides whether the work ahead is
        why it misses; `own_s`, the group's, is in the estimate. Whatever delay it admits, it
        admits any shorter one too, so a bound from above that admits may stand in for the
        estimate."""
        estimate = ahead_s + slo.own_s
        if ahead_s <= 0 or estimate <= slo.target_s:
            return None
        if slo.alone_s <= slo.target_s:  # the work ahead, not its own, makes it miss: retry once enough drains
            return min(estimate - slo.target_s, ahead_s)
        if ahead_s > slo.target_s:  # it misses anyway, but the queue alone would make anyone miss
            return ahead_s - slo.target_s
        return None  # its own work makes it miss, the work ahead alone would not: refusing helps no one

    def refuse_again(self, rejection: AdmissionRejected) -> None:
        """Refuse another member of a group refused as a unit (group_verdicts.py), counted."""
        self.num_rejected += 1
        raise AdmissionRejected(rejection.reason, rejection.retry_after_s)

    def _reject(self, reason: str, retry_after_s: float) -> None:
        self.num_rejected += 1
        retry = retry_after_s if math.isfinite(retry_after_s) else MAX_RETRY_AFTER_S
        raise AdmissionRejected(reason, min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, retry)))
