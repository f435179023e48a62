"""The scheduler's preemption: room for urgent requests, KV victims, and keeping a preempted
request's place. A mixin of `Scheduler` (scheduler.py), which owns the queues it reads.

- `_make_room_for_urgent` (step part 1): a waiting request the policy lets preempt (an interactive
  request before batch work, or SRPT's limited preemption) takes seats and blocks from the
  fewest running victims that let it in this step (`_victims_for`), and is admitted at once
  (`_admit_now`).
- `_allocate_or_preempt` (step part 2): when blocks run out for a running request, the policy's
  victim among those not yet scheduled this step gives way, possibly the request itself: a
  decode always, a prefill chunk only for a queued request (waiting or swapped out) ranked
  before it; otherwise the chunk takes what the free blocks hold, none at all if they hold no
  token, and keeps its blocks for the next step.
- `_preempt`: the configured eviction (eviction.py) takes the victim's blocks: swapped to host
  memory, or freed for recompute (the tokens are kept either way).
- `_resume_limit`: nothing ranked after a request preempted and not yet back is admitted first.

Only waiting requests make room for themselves: a swapped-out one, of any tier, comes back as
blocks free beyond the watermark's reserve (scheduler.py, step part 3), holding back whatever
ranks after it until then.
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager, CachedPrefix
from scheduler.config import SchedulerConfig
from scheduler.eviction import Eviction
from scheduler.policy import SchedulingPolicy
from scheduler.request import Request, RequestStatus
from scheduler.step import StepPlan


class Preemption:
    """Preemption for `Scheduler`: the attributes below are the scheduler's, and so are the
    methods it calls, `_num_new_tokens`, `_start_running` and `_allocate_what_fits`."""

    config: SchedulerConfig
    policy: SchedulingPolicy
    eviction: Eviction
    block_manager: BlockManager
    waiting: list[Request]
    running: list[Request]
    swapped: list[Request]
    _num_preemptions: int

    def _make_room_for_urgent(self, plan: StepPlan, now: float) -> None:
        free_seats = self.config.max_num_seqs - len(self.running)
        free_blocks = self.block_manager.num_free_blocks
        budget = self.config.max_num_batched_tokens - len(self.running)
        limit = self._resume_limit(plan, now)
        for request in list(self.waiting):
            if not self.running or (budget <= 0 and plan.urgent_key is not None):
                # An urgent request admitted in this step took the budget: the next waits a step
                # (a victim for a one-token chunk would cost its recompute or swap for nothing).
                return
            key = self.policy.sort_key(request, now)  # its rank while waiting (goodput's changes on admission)
            if limit is not None and key >= limit:
                return  # a preempted request not back yet ranks first and keeps its place
            # Not a request admitted earlier in this loop: its grant is already in the plan.
            candidates = [r for r in self.running if r.request_id not in plan.scheduled_ids
                          and self.policy.should_preempt_for(request, r, now)]
            if not candidates:
                return  # it may preempt nobody, so it keeps its turn, and nothing after it jumps it
            # Running requests ranked ahead of it keep their whole next chunk: an urgent request
            # goes before those it may preempt, never before an earlier one of its own tier.
            ahead_tokens, ahead_blocks = self._next_chunks_ranked_ahead(key, plan, now)
            prefix = self.block_manager.cached_prefix(request)
            available = budget - ahead_tokens
            num_new = self._num_new_tokens(request, available, prefix)
            min_victims = 0
            if num_new <= 0 and (available > 0 or not ahead_tokens):
                # No room left by the running decodes (without chunking, a whole prefill gets all
                # of it or nothing; with it, a budget of max_num_seqs tokens is all theirs once
                # every seat is taken). Each victim's decode gives its token back, so enough
                # victims let in its smallest first chunk; otherwise it waited behind batch
                # decodes until one finished.
                smallest = 1 if self.config.enable_chunked_prefill else self.config.max_num_batched_tokens
                first = self._num_new_tokens(request, smallest, prefix)
                min_victims = first - available
                if first <= 0 or min_victims > len(candidates):
                    return
                num_new = first
            if num_new <= 0:
                return  # the requests ranked ahead take the whole budget: nothing to make room for
            need = self.block_manager.num_new_blocks_needed(request, num_new, prefix) + ahead_blocks
            victims = self._victims_for(need, free_seats, free_blocks, candidates, now, set(prefix.blocks),
                                        min_victims)
            if victims is None:
                return
            for victim in victims:
                self._preempt(victim, plan)
            num_new = self._widened_by_victims(request, num_new, len(victims), available, prefix)
            if not self._admit_now(request, num_new, plan, prefix):
                return
            if plan.urgent_key is None:  # the first admitted ranks best: the waiting queue is sorted
                plan.urgent_key = key
            # Nobody ranked after a victim just preempted is let in later in this loop either.
            limit = self._resume_limit(plan, now)
            free_seats += len(victims) - 1
            # Counted again, not less `need`: that held the next chunks of those ranked ahead,
            # which the next urgent request reserves again (they were reserved once per request,
            # and victims preempted for blocks nobody took).
            free_blocks = self.block_manager.num_free_blocks
            budget += len(victims) - num_new

    def _widened_by_victims(self, request: Request, num_new: int, num_victims: int, available: int,
                            prefix: CachedPrefix) -> int:
        """The urgent chunk with the decode tokens its victims gave back, as far as the blocks it
        was counted for hold them (more blocks could be a survivor's). Sized before the victims
        were chosen, a lone urgent chunk was a token short per victim: a 32-token prompt took
        three steps where two fed it."""
        if not num_victims or not self.config.enable_chunked_prefill:
            return num_new  # a whole prefill already counted its victims' tokens
        needed = self.block_manager.num_new_blocks_needed
        widened = self._num_new_tokens(request, available + num_victims, prefix)
        while widened > num_new and needed(request, widened, prefix) > needed(request, num_new, prefix):
            widened -= 1
        return max(num_new, widened)

    def _next_chunks_ranked_ahead(self, key: tuple, plan: StepPlan, now: float) -> tuple[int, int]:
        """Tokens and blocks that running requests ranked ahead of `key` (a waiting request's, not
        yet scheduled in this step) need for their next chunk beyond the one token and block of
        growth every running request is already counted for."""
        tokens = blocks = 0
        for running in self.running:
            if running.request_id in plan.scheduled_ids or self.policy.sort_key(running, now) >= key:
                continue
            chunk = self._num_new_tokens(running, self.config.max_num_batched_tokens)
            tokens += max(0, chunk - 1)
            blocks += max(0, self.block_manager.num_new_blocks_needed(running, chunk)
                          - self.block_manager.num_new_blocks_needed(running, 1))
        return tokens, blocks

    def _admit_now(self, request: Request, num_new: int, plan: StepPlan, prefix: CachedPrefix) -> bool:
        """Admit an urgent request before anything else takes the room made for it: the watermark
        and the running requests' prefill chunks would otherwise leave it waiting while its victims
        were already preempted."""
        if self.block_manager.allocate_slots(request, num_new, prefix) is None:
            return False  # not reached: the room was counted; but never admit without blocks
        self.waiting.remove(request)
        self._start_running(request, num_new, plan)
        return True

    def _victims_for(self, need: int, free_seats: int, free_blocks: int, candidates: list[Request],
                     now: float, prefix: set[int], min_victims: int = 0) -> list[Request] | None:
        """The fewest of `candidates` (at least `min_victims`, whose decode tokens a whole prefill
        needs), in victim order, that give a request a seat and its `need` blocks this step with
        the survivors' decodes still fed; [] when it fits already, None when even every candidate
        would not do (then nobody is preempted for nothing). With a prefix cache, a victim frees
        only the blocks no survivor shares, and those among the request's own cached `prefix`
        blocks make no room: the request takes them back."""
        candidates = list(candidates)
        growth = sum(self.block_manager.num_new_blocks_needed(r, 1) for r in self.running)
        victims: list[Request] = []
        room = 0
        while (len(victims) < min_victims or free_seats + len(victims) < 1
               or free_blocks + room < need + growth):
            if not candidates:
                return None
            victim = self.policy.choose_victim(candidates, now)
            candidates.remove(victim)
            victims.append(victim)
            room = len(self.block_manager.blocks_freed_by(victims) - prefix)
            growth -= self.block_manager.num_new_blocks_needed(victim, 1)
        return victims

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan, now: float) -> int:
        """Allocate, preempting policy victims until it fits: the tokens granted, 0 if the request
        itself gave way. Its victim is itself when every request ranked after it is a decode
        already granted (decodes go first). Giving way then frees its blocks for a waiting (or
        swapped-out) request ranked before it; with none, it would give its prefill up for
        nothing, so a prefill chunk takes what the free blocks hold instead, none at all when
        they hold no token: it keeps its blocks and its seat for the next step. (Preempted, its
        blocks served nobody in the step, then fed the growth of the decodes ranked after it,
        and it was admitted again into the same shortage: a 35-token prompt was fed 168 tokens
        over six self-preemptions.)"""
        while self.block_manager.allocate_slots(request, num_new) is None:
            candidates = [r for r in self.running if r.request_id not in plan.scheduled_ids]
            victim = self.policy.choose_victim(candidates, now)
            if victim is request and request.feeds_a_prefill_chunk and not self._queued_ranks_before(request, now):
                return self._allocate_what_fits(request, num_new, plan)
            self._preempt(victim, plan)
            if victim is request:
                return 0
        return num_new

    def _queued_ranks_before(self, request: Request, now: float) -> bool:
        key = self.policy.sort_key(request, now)
        return any(self.policy.sort_key(other, now) < key for other in self.waiting + self.swapped)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        self._num_preemptions += 1
        plan.preempted_ids.append(request.request_id)
        request.status = self.eviction.evict(request, self.block_manager, plan)
        (self.swapped if request.status is RequestStatus.SWAPPED else self.waiting).append(request)

    def _resume_limit(self, plan: StepPlan, now: float) -> tuple | None:
        """The best key among preempted requests not back yet: those swapped out, and those preempted
        by recompute in this step (appended after the sort, they wait for the next step). Nothing
        ranked after one of them is admitted (here or as urgent) before it comes back, so a
        preempted request keeps its place."""
        preempted = set(plan.preempted_ids)
        held = [r for r in self.waiting if r.request_id in preempted] + self.swapped
        return min((self.policy.sort_key(r, now) for r in held), default=None)
