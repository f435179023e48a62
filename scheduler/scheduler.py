"""The step scheduler: who runs, with how many tokens, and who gives way.

One step (`schedule`) runs these parts in order, all under the seat limit (`max_num_seqs`) and
the token budget (`max_num_batched_tokens`); the preemption they use is in preemption.py:

1. `_make_room_for_urgent`: a waiting request the policy lets preempt (an interactive request
   before batch work, or SRPT's limited preemption) takes seats and blocks from running victims,
   only as many as let it in this step, and is admitted at once, past the KV watermark and ahead
   of the prefill chunks of the running requests ranked after it (which would otherwise take the
   room made for it); those ranked ahead of it keep their next chunk. Never one ranked after a
   request still swapped out or preempted in this step, or after a waiting request that may
   preempt nobody: those keep their place.
2. `_schedule_running`: running requests first, by tier, then decodes before unfinished prefill
   chunks, each group in policy order. When blocks run out, `_preempt` takes the policy's victim among the
   running requests not yet scheduled this step (possibly the request itself, though a prefill
   chunk that no queued request, waiting or swapped out, outranks takes what the free blocks
   hold, none if they hold no token, and keeps its blocks); a prefill chunk ranked after a
   request admitted as urgent takes only what the free blocks hold instead.
3. `_schedule_swapped`: swap-preempted requests come back before new work they rank ahead of,
   when blocks allow, leaving the KV watermark's reserve free while others run (not in a step
   that preempted, so a block is never copied out and in at once); with a prefix cache, onto
   the blocks of their prefix still cached, the rest copied in.
4. `_schedule_waiting`: waiting and recompute-preempted requests in policy order, each granted a
   prefill chunk (or the whole prefill without chunking) once its whole prefill leaves the
   watermark's reserve, stopping at the first that does not. Parts 3 and 4 repeat while they
   make progress (`_schedule_queued`), so a swapped-out request that stopped at a waiting one
   ranked before it is tried again once that one is in. The whole-prefill gate trades latency
   for work: a prompt that does not fit whole waits, and so does everything ranked after it,
   while the cache is partly idle (in small random workloads, 2-3% more steps per request),
   where judged by its first chunk it was admitted, preempted at the next block boundary of a
   decode and admitted again (fewer preemptions and a net gain in the calibrated simulator).

Recompute preemption frees the blocks and sets `num_computed_tokens = 0`; the request keeps its
arrival time and tokens, so the policy puts it back in its place, and on resumption it re-feeds
prompt and generated tokens, sampling only when it reaches the end (`ScheduledChunk.sample`).
`num_computed_tokens` advances when a chunk is scheduled; `update_from_output` appends the sampled
tokens and finishes requests.
"""

from __future__ import annotations

from typing import Callable

from scheduler.admission import AdmissionController, QueuedWork
from scheduler.block_manager import NO_PREFIX, BlockManager, CachedPrefix
from scheduler.config import SchedulerConfig
from scheduler.eviction import free_for_recompute, make_eviction
from scheduler.group_verdicts import GroupVerdicts
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.policies import make_policy
from scheduler.policy import SchedulingPolicy
from scheduler.prefix_cache import PrefixCache
from scheduler.preemption import Preemption
from scheduler.request import Request, RequestStatus
from scheduler.step import SchedulerStats, StepPlan, build_chunks, stop_status


class Scheduler(Preemption):
    def __init__(self, config: SchedulerConfig, policy: SchedulingPolicy | None = None) -> None:
        self.config = config
        self.policy = policy if policy is not None else make_policy(config.policy, config)
        self.eviction = make_eviction(config.preemption_mode)
        prefix_cache = PrefixCache(config.block_size) if config.enable_prefix_caching else None
        self.block_manager = BlockManager(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks, prefix_cache)
        self.admission = AdmissionController(config)
        self._group_verdicts = GroupVerdicts()  # one admission verdict for a request's choices
        self._queued_work = QueuedWork()  # kept between arrivals; invalidated by any other queue change
        self.waiting: list[Request] = []  # new and recompute-preempted requests
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # since the previous step
        self._num_preemptions = 0
        self._num_steps = 0
        self._num_finished = 0

    # ---- requests in and out -----------------------------------------------------------------
    def add_request(self, request: Request, now: float | None = None) -> None:
        """Queue a request; raises ValueError on bad input, AdmissionRejected when shed."""
        self._validate(request)
        now = request.arrival_time if now is None else now
        # Offered load counts every valid arrival, shed or not: the margin says what the server
        # is asked to do, and shedding is the answer to it.
        self.admission.record_arrival(now, request)
        if self.config.enable_admission:
            self._group_verdicts.judge(request, lambda: self._check_admission(request, now),
                                       self.admission.refuse_again)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)
        self._queued_work.added(request)

    def _check_admission(self, request: Request, now: float) -> None:
        self.admission.check(request, self.waiting + self.swapped, self.running, self._served_before(request, now),
                             self._queued_work, lambda running: self.policy.should_preempt_for(request, running, now))

    def _served_before(self, request: Request, now: float) -> Callable[[Request], bool] | None:
        """Whether the policy serves a queued request before `request`; None (every queued one
        counts as ahead) where the order moves while they wait."""
        if not self.policy.queue_order_holds:
            return None
        key = self.policy.sort_key(request, now)
        return lambda other: self.policy.sort_key(other, now) < key

    def _validate(self, request: Request) -> None:
        # A finished request's id is free at once, though the next step still reports it finished:
        # an idle engine takes no next step, and its caller may send the id again.
        known = self._requests.get(request.request_id)
        if known is not None and not known.is_finished:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens leaves no room for output "
                             f"within max_model_len {self.config.max_model_len}")
        longest = min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.config.max_model_len)
        # The last sampled token ends the request before it is ever fed, so it needs no KV slot.
        if self.block_manager.blocks_for(longest - 1) > self.config.num_gpu_blocks:
            raise ValueError(f"a request of up to {longest} tokens cannot fit in "
                             f"{self.config.num_gpu_blocks} KV blocks of {self.config.block_size}")

    def abort_request(self, request_id: str, now: float | None = None) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED, now)

    def finish_request(self, request_id: str, status: RequestStatus, now: float | None = None) -> bool:
        """Finish a live request (stop string, abort); False when unknown or already finished."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._remove_from_queues(request)
        self._finish(request, status, now)
        return True

    def _remove_from_queues(self, request: Request) -> None:
        self._queued_work.invalidate()
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)

    def _finish(self, request: Request, status: RequestStatus, now: float | None) -> None:
        self.block_manager.free(request)
        request.status = status
        if now is not None:
            request.finish_time = now
        self._finished_ids.append(request.request_id)
        self._num_finished += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self._num_steps += 1
        self._queued_work.invalidate()  # a step moves requests between the queues
        finished_ids = tuple(self._finished_ids)
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        try:
            self._fill(plan, now)
            output = build_chunks(plan, finished_ids, now)
        except BaseException:
            # Nothing of this plan reaches the runner: a swap-out it booked is never copied (the
            # host blocks hold nothing), so every request it touched starts over by recompute;
            # the finished ids stay held (their ids not reusable) and go with the next step.
            # A queued request holding device blocks had them allocated when the interrupt came,
            # before the plan recorded it (a waiting or urgent admission): unwritten, a choice
            # sharing a sibling's blocks would read KV nobody computed. (An interrupt inside one
            # of _fill's statements, between a queue removal and the re-queue, is not covered.)
            touched = [request.request_id for request, _ in plan.grants] + plan.preempted_ids
            touched += [request_id for request_id in self.block_manager.device_table_holders()
                        if self._requests[request_id].status is not RequestStatus.RUNNING]
            self._restart_by_recompute(touched, now)
            raise
        for request_id in finished_ids:  # reported to the runner: forgotten, unless sent again since
            if (known := self._requests.get(request_id)) is not None and known.is_finished:
                del self._requests[request_id]
        del self._finished_ids[:len(finished_ids)]
        return output

    def _fill(self, plan: StepPlan, now: float) -> None:
        """The four parts of a step (module docstring), granting tokens into `plan`."""
        # Swapped requests wait for a seat too: their aging bound must see the steps they wait through.
        self.policy.on_step(self.waiting + self.swapped, self.running, now, self.admission.mean_step_time_s)
        self.waiting.sort(key=lambda r: self.policy.sort_key(r, now))
        self._make_room_for_urgent(plan, now)
        self._schedule_running(plan, now)
        self._schedule_queued(plan, now)
        for request_id in plan.preempted_ids:  # queued again from now: more queueing delay
            self._requests[request_id].requeued_at = now

    def _num_new_tokens(self, request: Request, budget: int, prefix: CachedPrefix = NO_PREFIX) -> int:
        """Tokens to grant `request` within `budget`, after its computed tokens (or, for a request
        about to start on its cached prefix, after those)."""
        remaining = request.num_tokens_to_feed - prefix.num_tokens
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _start_running(self, request: Request, num_new: int, plan: StepPlan) -> None:
        """A request that holds its blocks for this step's chunk joins the running batch."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.add(request, num_new)

    def _schedule_running(self, plan: StepPlan, now: float) -> None:
        # By tier, then decodes (one token left to feed) before unfinished prefills, in policy
        # order. Tier first: when blocks run out, victims come from requests not yet scheduled, so
        # an interactive prefill chunk placed after batch decodes could only preempt itself. But
        # decodes first in the budget: a prefill chunk leaves a token for each decode after it.
        order = sorted(self.running, key=lambda r: (int(r.tier), r.feeds_a_prefill_chunk,
                                                    self.policy.sort_key(r, now)))
        for index, request in enumerate(order):
            if plan.budget <= 0:
                return
            if request.status is not RequestStatus.RUNNING or request.request_id in plan.scheduled_ids:
                continue  # preempted as a victim earlier in this loop, or admitted as urgent
            budget = plan.budget
            if request.feeds_a_prefill_chunk:
                budget -= self._decodes_to_come(order[index + 1:], plan)
            num_new = self._num_new_tokens(request, budget)
            if num_new > 1 and plan.urgent_key is not None and self.policy.sort_key(request, now) > plan.urgent_key:
                # The room an urgent request was let into counted one token of this one's growth
                # (preemption.py): its chunk takes what the free blocks hold, and preempts nobody.
                granted = self._allocate_what_fits(request, num_new, plan)
            else:
                granted = self._allocate_or_preempt(request, num_new, plan, now) if num_new > 0 else 0
            if granted:
                plan.add(request, granted)

    @staticmethod
    def _decodes_to_come(later: list[Request], plan: StepPlan) -> int:
        """Decodes of a lower tier still to be scheduled in this step. A higher tier's prefill
        chunk that took the whole budget stalled them for as many steps as its prompt took."""
        return sum(1 for r in later if not r.feeds_a_prefill_chunk and r.status is RequestStatus.RUNNING
                   and r.request_id not in plan.scheduled_ids)

    def _allocate_what_fits(self, request: Request, num_new: int, plan: StepPlan) -> int:
        """Blocks for as much of `num_new` as the free blocks hold (all of it or none without
        chunked prefill); the tokens allocated."""
        # Each running request still to come in this loop needs a token of growth: its blocks are
        # not this chunk's to take.
        reserved = sum(self.block_manager.num_new_blocks_needed(other, 1) for other in self.running
                       if other is not request and other.request_id not in plan.scheduled_ids)
        fit = min(num_new, self.block_manager.num_tokens_that_fit(request, reserved))
        if fit < num_new and not self.config.enable_chunked_prefill:
            return 0  # a whole prefill or none
        if fit > 0 and self.block_manager.allocate_slots(request, fit) is not None:
            return fit
        return 0

    def _schedule_queued(self, plan: StepPlan, now: float) -> None:
        """Swapped-out and waiting requests, in the policy's order across the two queues: a
        swapped-out one stops at the first waiting request ranked before it, so it is tried again
        once those are in. It lost the whole step to them, though seats, budget and blocks were
        left: a better-ranked arrival every step held it out for as long as they came. (A step
        that preempted swaps nothing in.)"""
        while True:
            before = (len(self.running), plan.budget)
            if not plan.preempted_ids:
                self._schedule_swapped(plan, now)
            self._schedule_waiting(plan, now)
            if (len(self.running), plan.budget) == before or not self.swapped:
                return

    def _schedule_swapped(self, plan: StepPlan, now: float) -> None:
        self.swapped.sort(key=lambda r: self.policy.sort_key(r, now))
        while self.swapped and len(self.running) < self.config.max_num_seqs and plan.budget > 0:
            request = self.swapped[0]
            if self.waiting and self.policy.sort_key(self.waiting[0], now) < self.policy.sort_key(request, now):
                return  # a waiting request ranks first (a more urgent tier): it gets the blocks
            num_new = self._num_new_tokens(request, plan.budget)
            resident = self.block_manager.resident_prefix(request)
            if num_new == 0 or not self.block_manager.can_swap_in(request, num_new, resident):
                return
            # The watermark too: swapped back into the last free blocks, it was the victim again
            # at the next block boundary of anything running, its whole KV copied out and in for
            # a token or so (vLLM's swap-in kept the same reserve).
            if not self._leaves_reserve(self.block_manager.blocks_to_swap_in(request, num_new, resident)):
                return
            # In the plan before its blocks move: an interrupt from here on is undone by recompute
            # (schedule), where one after the swap-in left it swapped out with device blocks.
            self.swapped.pop(0)
            self._start_running(request, num_new, plan)
            plan.swap_in.extend(self.block_manager.swap_in(request, resident))
            if self.block_manager.allocate_slots(request, num_new) is None:
                raise RuntimeError(f"{request.request_id}: swapped in without room to grow")  # checked above

    def _schedule_waiting(self, plan: StepPlan, now: float) -> None:
        limit = self._resume_limit(plan, now)
        admitted = 0
        for request in self.waiting:
            if len(self.running) >= self.config.max_num_seqs or plan.budget <= 0:
                break
            if limit is not None and self.policy.sort_key(request, now) >= limit:
                break
            prefix = self.block_manager.cached_prefix(request)
            num_new = self._num_new_tokens(request, plan.budget, prefix)
            if num_new == 0 or not self._whole_prefill_above_watermark(request, prefix):
                break
            if self.block_manager.allocate_slots(request, num_new, prefix) is None:
                break
            self._start_running(request, num_new, plan)
            admitted += 1
        del self.waiting[:admitted]

    def _whole_prefill_above_watermark(self, request: Request, prefix: CachedPrefix) -> bool:
        """Whether the request's whole prefill still to feed, not only its first chunk, leaves the
        watermark's reserve (as vLLM v0 judged a whole prompt). Judged by its first chunk, a
        request was admitted at the reserve's edge, its later chunks took the reserve, and the
        next decode block preempted it; readmitted at once, it went round again: a 48-token
        prompt was fed 217 tokens over four preemptions. In the simulator at load 1.0 the whole
        prefill cut preemptions by 44-72% (fcfs 36 to 15) and moved mean latencies by 1.3% at
        most (srpt's 4% lower); judging only preempted requests so cut fcfs's by none."""
        to_feed = request.num_tokens_to_feed - prefix.num_tokens
        return self._leaves_reserve(self.block_manager.num_new_blocks_needed(request, to_feed, prefix))

    def _leaves_reserve(self, needed_blocks: int) -> bool:
        """Whether taking `needed_blocks` leaves the watermark's reserve free for the running
        requests' growth; an empty cache always takes a request (it fits: checked on add)."""
        if not self.running:
            return True
        reserve = self.config.kv_watermark * self.config.num_gpu_blocks
        return self.block_manager.num_free_blocks - needed_blocks >= reserve

    def restart_failed_step(self, output: SchedulerOutput, now: float) -> None:
        """After the model step for `output` raised: the requests it touched start over by recompute.

        Scheduling already advanced their computed tokens, and their KV (and any swap copy) may be
        half written; left as they were, a request whose sampling chunk was lost would hold its
        blocks with nothing left to schedule, never finishing. Recompute keeps every token
        already generated.
        """
        self._restart_by_recompute([chunk.request_id for chunk in output.chunks] + list(output.preempted_ids), now)

    def _restart_by_recompute(self, request_ids: list[str], now: float) -> None:
        self.block_manager.discard_uncommitted_blocks()  # their KV may be half written
        for request_id in dict.fromkeys(request_ids):
            request = self._requests.get(request_id)
            if request is None or request.is_finished:
                continue
            self._remove_from_queues(request)
            free_for_recompute(request, self.block_manager)
            if request.first_scheduled_time is None:  # never ran (a failed schedule): waiting since arrival
                request.status = RequestStatus.WAITING
            else:
                request.status = RequestStatus.PREEMPTED
                if request.requeued_at is None:  # else already queued again, since then
                    request.requeued_at = now  # queued again: its wait counts from here
            self.waiting.append(request)
        self._queued_work.invalidate()

    # ---- results -----------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput,
                           now: float) -> list[Request]:
        """Append sampled tokens; finish requests that stop. Returns the requests that progressed."""
        progressed: list[Request] = []
        self.block_manager.commit_cached_blocks()  # the KV of the blocks found this step is written
        for chunk in output.chunks:
            request = self._requests.get(chunk.request_id)
            if not chunk.sample or request is None or request.status is not RequestStatus.RUNNING:
                continue  # mid-prefill chunk, or finished/aborted since it was scheduled
            token = runner_output.sampled_token_ids[chunk.request_id]
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            status = stop_status(request, token, self.config.max_model_len)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status, now)
            progressed.append(request)
        return progressed

    def record_step(self, now: float, num_batched_tokens: int, step_time_s: float) -> None:
        """Feed the measured step time to admission control (throughput, stability margin)."""
        self.admission.record_step(now, num_batched_tokens, step_time_s)

    def stats(self, now: float | None = None) -> SchedulerStats:
        cache = self.block_manager.prefix_cache
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            kv_usage=self.block_manager.usage, num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_total_blocks, num_preemptions=self._num_preemptions,
            num_steps=self._num_steps, num_finished=self._num_finished,
            num_rejected=self.admission.num_rejected,
            throughput_tokens_per_s=self.admission.throughput_tokens_per_s,
            stability_margin=self.admission.stability_margin(now) if now is not None else None,
            prefix_cache_queries=None if cache is None else cache.num_query_tokens,
            prefix_cache_hits=None if cache is None else cache.num_hit_tokens,
            host_kv_usage=self.block_manager.host_usage,
        )
