"""The seam where an ordering policy plugs into the scheduler.

A policy answers two questions each step, from plain `Request` state and the current time:
which waiting request goes first, and which running request gives way when KV blocks or seats
run out. The waiting queue is re-sorted every step with `sort_key`, so a key may change with
time (aging) without breaking any heap invariant.
"""

from __future__ import annotations

from typing import Sequence

from scheduler.request import Request


class SchedulingPolicy:
    """Base policy: first come, first served; the newest running request gives way."""

    name = "fcfs"
    # Whether the order reads the request's integer priority (the HTTP layer refuses a nonzero one
    # otherwise, as vLLM does).
    orders_by_priority = False
    # Whether it needs each request's true output length, which only a benchmark knows (so a
    # server does not offer it).
    needs_true_length = False
    # Whether the order reads the predicted length: without a predictor such a policy orders by
    # each request's max_tokens alone, which `serve` warns about.
    orders_by_prediction = False
    # Whether waiting earns a request rank (anti-starvation aging), so that `aging_bound_s` bounds
    # how late an arrival may still overtake it: the simulator reports that bound for such policies.
    ages = False
    # Whether two queued requests keep their order while they wait (sjf's and srpt's hold while
    # the aging rate holds), so that admission may count as ahead of an arrival only the queued
    # requests ordered before it. Not so for goodput, whose requests move into the urgent group
    # as their deadlines near.
    queue_order_holds = True
    # The SchedulerConfig knobs its order reads among those only some policies read (aging, srpt,
    # goodput, the SLOs): `serve` refuses such a knob when its policy would accept it and do nothing.
    reads_knobs: frozenset[str] = frozenset()

    def sort_key(self, request: Request, now: float) -> tuple:
        """Smaller keys are admitted first. Recomputed every step."""
        return (request.arrival_time, request.request_id)

    def choose_victim(self, running: Sequence[Request], now: float) -> Request:
        """The running request to preempt when memory runs short. `running` is non-empty."""
        return max(running, key=lambda r: self.sort_key(r, now))

    def should_preempt_for(self, waiting: Request, running: Request, now: float) -> bool:
        """Whether `waiting` may take the seat (and blocks) of `running`. FCFS never preempts."""
        return False

    def on_step(self, waiting: Sequence[Request], running: Sequence[Request], now: float,
                step_time_s: float | None) -> None:
        """Hook called once per step before ordering, with every request waiting for a seat (queued,
        and swapped out) and the measured mean step time (None before the first step is measured):
        aging rates, refined predictions."""
