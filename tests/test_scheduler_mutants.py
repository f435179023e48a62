"""Scheduler and preemption behaviours that the suite let through (mutation testing of
scheduler/scheduler.py and scheduler/preemption.py, session 36): each test kills a one-line
mutant that every other test passed, but the last, which found a self-preemption."""

from __future__ import annotations

import zlib

import pytest

from scheduler.config import SchedulerConfig
from scheduler.policies import FCFSPolicy
from scheduler.request import Request, SamplingParams, Tier
from scheduler.scheduler import Scheduler
from scheduler.testing import PagedTokenRunner, reference_output


def req(request_id: str, arrival: float = 0.0, predicted: float | None = None, tier: Tier = Tier.STANDARD,
        priority: int = 0, prompt_len: int = 4, max_tokens: int = 200) -> Request:
    offset = zlib.crc32(request_id.encode())
    prompt = [1 + (i * 5 + offset) % 90 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, predicted_len=predicted, tier=tier, priority=priority)


def swap_config(**sizes) -> SchedulerConfig:
    """A small swap-mode cache with room on the host for every victim and no watermark."""
    return SchedulerConfig(**sizes, max_model_len=64, kv_watermark=0.0, preemption_mode="swap", num_cpu_blocks=64)


def run(scheduler: Scheduler, arrivals: dict[int, list[Request]], on_step=None, steps: int = 500) -> None:
    """Step to the end with the paged reference runner; `on_step(step, output)` sees each step.
    Every request finishes with the reference tokens and every block comes back."""
    config = scheduler.config
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks)
    requests = [r for batch in arrivals.values() for r in batch]
    for step in range(steps):
        for request in arrivals.get(step, ()):
            scheduler.add_request(request)
        output = scheduler.schedule(float(step))
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert not set(output.preempted_ids) & {c.request_id for c in output.chunks}
        if on_step is not None:
            on_step(step, output)
        scheduler.update_from_output(output, runner.execute(output), float(step))
        scheduler.block_manager.check_integrity()
        if step > max(arrivals) and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == config.num_gpu_blocks
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids,
                                                            request.sampling_params.max_tokens)


def run_recording(scheduler: Scheduler, arrivals: dict[int, list[Request]]) -> dict[int, object]:
    """`run`, keeping each step's output by step."""
    seen: dict[int, object] = {}
    run(scheduler, arrivals, on_step=lambda step, output: seen.setdefault(step, output))
    return seen


def sjf_without_aging(mode: str) -> SchedulerConfig:
    """15 blocks of 4, 4 seats, an 8-token budget; `mode` preemption (swap: a 30-block host pool)."""
    return SchedulerConfig(num_gpu_blocks=15, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                           max_model_len=64, policy="sjf", aging_tokens_per_s=0.0, preemption_mode=mode,
                           num_cpu_blocks=30 if mode == "swap" else 0)


def grants(output) -> dict[str, int]:
    return {c.request_id: len(c.token_ids) for c in output.chunks}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_prefill_chunk_short_of_blocks_never_preempts_a_decode_of_its_tier_it_outranks(mode: str) -> None:
    # sjf: r's prefill ranks before d's decode, and fills the cache. d's last tokens fit the
    # slack of its last block, so it finishes without a new one. Decodes go first within a tier:
    # r's chunk takes what the free blocks hold (none for four steps) and preempts nobody. (Kills
    # ordering running requests by tier and policy key alone: r's chunk went first, found no
    # block and took d, its worst-ranked victim, losing d's computed tokens.)
    scheduler = Scheduler(sjf_without_aging(mode))
    d = req("d", 0.0, predicted=30, prompt_len=20, max_tokens=9)
    r = req("r", 1.0, predicted=2, prompt_len=35, max_tokens=2)
    preempted: list[str] = []
    run(scheduler, {0: [d], 1: [r]}, on_step=lambda step, output: preempted.extend(output.preempted_ids))
    assert preempted == [] and d.num_preemptions == 0 and r.num_preemptions == 0


def test_a_prefill_chunk_leaves_tokens_for_later_decodes_only_not_later_prefill_chunks() -> None:
    # A standard prompt (s) is admitted as urgent beside a batch prompt (b) mid-prefill, which
    # gets one token that step. From the next step both are prefills: s, first by tier, takes the
    # whole budget; a prefill chunk is not a decode to leave a token for. (Kills counting every
    # request still to come in `_decodes_to_come`: s got 7 and b 1, every step.)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                                          max_model_len=64))
    b = req("b", 0.0, tier=Tier.BATCH, prompt_len=40, max_tokens=2)
    s = req("s", 1.0, tier=Tier.STANDARD, prompt_len=40, max_tokens=2)
    seen: dict[int, dict[str, int]] = {}
    run(scheduler, {0: [b], 1: [s]}, on_step=lambda step, output: seen.setdefault(step, grants(output)))
    assert seen[0] == {"b": 8} and seen[1] == {"s": 7, "b": 1}
    assert seen[2] == seen[3] == {"s": 8}


def test_a_decode_swapped_out_earlier_in_the_step_is_no_decode_to_come() -> None:
    # Swap mode. Standard s is mid-prefill beside batch decode b when interactive i arrives: i
    # is admitted as urgent (10 tokens) and s gets the token left. At step 4 i's last 7 prompt
    # tokens find the blocks short and swap b out; s's chunk then takes the token b left as
    # well (5). (Kills counting a swapped-out victim, which keeps its computed tokens and so has
    # one token to feed, as a decode still to come: s got 4 and the token went unused.)
    scheduler = Scheduler(swap_config(num_gpu_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=12))
    b = req("b", 0.0, tier=Tier.BATCH, prompt_len=2, max_tokens=12)
    s = req("s", 1.0, tier=Tier.STANDARD, prompt_len=28, max_tokens=2)
    i = req("i", 3.0, tier=Tier.INTERACTIVE, prompt_len=17, max_tokens=2)
    seen = run_recording(scheduler, {0: [b], 1: [s], 3: [i]})
    assert seen[3].preempted_ids == () and grants(seen[3]) == {"i": 10, "s": 1, "b": 1}
    assert seen[4].preempted_ids == ("b",) and grants(seen[4]) == {"i": 7, "s": 5}


def test_an_urgent_one_token_prompt_admitted_in_the_step_is_no_decode_to_come() -> None:
    # Interactive p is mid-prefill (14 tokens left) beside batch decode b when standard u
    # arrives with a one-token prompt: u may preempt b, so it is admitted as urgent, into the one
    # token p's next chunk and b's decode leave. p, first by tier, still takes its 14. (Kills
    # dropping `not in plan.scheduled_ids` from `_decodes_to_come`: u, one token to feed and
    # already granted, was counted again, and p got 13.)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                          max_model_len=64))
    b = req("b", 0.0, tier=Tier.BATCH, prompt_len=1, max_tokens=20)
    p = req("p", 1.0, tier=Tier.INTERACTIVE, prompt_len=29, max_tokens=2)
    u = req("u", 2.0, tier=Tier.STANDARD, prompt_len=1, max_tokens=2)
    seen: dict[int, dict[str, int]] = {}
    run(scheduler, {0: [b], 1: [p], 2: [u]}, on_step=lambda step, output: seen.setdefault(step, grants(output)))
    assert seen[1] == {"p": 15, "b": 1}
    assert seen[2] == {"u": 1, "p": 14, "b": 1}


@pytest.mark.parametrize("first_prompt", [26, 27])
def test_an_urgent_arrival_preempts_nobody_when_an_earlier_urgent_prefill_takes_the_budget(first_prompt: int) -> None:
    # Three batch decodes; interactive i1 is mid-prefill with 13 or 14 prompt tokens left, which
    # with the decodes take the whole 16-token budget, when interactive i2 arrives. Ranked after
    # i1, i2 has nothing to make room for: it waits a step, and no batch request is preempted.
    # (Kills entering the victims-for-the-smallest-chunk path when the requests ranked ahead,
    # not the decodes, took the budget: dropping `(available > 0 or not ahead_tokens)` preempted
    # one or two batch requests for i2's one-token chunk; `available >= 0` one, at 13 left.)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                                          max_model_len=64))
    batch = [req(f"b{k}", 0.0, tier=Tier.BATCH, prompt_len=1, max_tokens=30) for k in range(3)]
    i1 = req("i1", 1.0, tier=Tier.INTERACTIVE, prompt_len=first_prompt, max_tokens=2)
    i2 = req("i2", 2.0, tier=Tier.INTERACTIVE, prompt_len=8, max_tokens=2)
    seen = run_recording(scheduler, {0: batch, 1: [i1], 2: [i2]})
    assert grants(seen[1]) == {"i1": 13, "b0": 1, "b1": 1, "b2": 1}
    assert seen[2].preempted_ids == () and grants(seen[2]) == {"i1": 13, "b0": 1, "b1": 1, "b2": 1}
    assert all(b.num_preemptions == 0 for b in batch)


def test_without_chunking_an_urgent_prompt_may_need_every_candidate_as_a_victim() -> None:
    # No chunking, a 32-token budget: an interactive decode (no candidate) and two batch decodes
    # leave 29 tokens; a 31-token interactive prompt needs both batch decodes' tokens, every
    # candidate there is. It is admitted whole at once. (Kills `min_victims >= len(candidates)`:
    # it waited until a batch request finished.)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                          max_model_len=32, enable_chunked_prefill=False))
    x = req("x", 0.0, tier=Tier.INTERACTIVE, prompt_len=1, max_tokens=20)
    batch = [req(f"b{k}", 0.0, tier=Tier.BATCH, prompt_len=1, max_tokens=20) for k in range(2)]
    u = req("u", 1.0, tier=Tier.INTERACTIVE, prompt_len=31, max_tokens=1)
    seen = run_recording(scheduler, {0: [x, *batch], 1: [u]})
    assert sorted(seen[1].preempted_ids) == ["b0", "b1"] and grants(seen[1]) == {"u": 31, "x": 1}


def test_a_second_urgent_arrival_gets_the_decode_tokens_the_first_ones_victims_gave_back() -> None:
    # Two seats, both batch decodes; two 16-token interactive prompts arrive together. Each
    # takes one victim's seat, and the two victims' decode tokens go to them: 16 + 16 fill the
    # 32-token budget. (Kills not adding the first admission's victims back to the budget the
    # second reads: it got 15, and its prompt took a second step.)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                                          max_model_len=64))
    batch = [req(f"b{k}", float(k), tier=Tier.BATCH, prompt_len=6, max_tokens=20) for k in range(2)]
    urgent = [req(f"i{k}", 3.0, tier=Tier.INTERACTIVE, prompt_len=16, max_tokens=2) for k in range(2)]
    seen = run_recording(scheduler, {0: batch, 3: urgent})
    assert sorted(seen[3].preempted_ids) == ["b0", "b1"] and grants(seen[3]) == {"i0": 16, "i1": 16}


def test_an_urgent_arrival_reserves_a_prefill_ranked_ahead_its_chunk_beyond_the_growth_already_counted() -> None:
    # Seven blocks of 4, a 13-token budget. Interactive p has 12 of its 20 prompt tokens in (3
    # blocks, at a block boundary) beside batch decode b (1 block) when interactive u arrives.
    # Every running request is already counted one token and one block of growth; p, ranked
    # ahead of u, keeps its whole next chunk on top: 7 more tokens and 1 more block. That leaves
    # u 4 tokens in the 3 free blocks, with no victim. (Kills counting p's chunk whole, not less
    # the token of growth: u got 3; and counting its blocks whole, not less the growth block:
    # b was preempted for a block nobody needed.)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=13,
                                          max_model_len=64, kv_watermark=0.0))
    b = req("b", 0.0, tier=Tier.BATCH, prompt_len=1, max_tokens=20)
    p = req("p", 1.0, tier=Tier.INTERACTIVE, prompt_len=20, max_tokens=2)
    u = req("u", 2.0, tier=Tier.INTERACTIVE, prompt_len=10, max_tokens=2)
    seen = run_recording(scheduler, {0: [b], 1: [p], 2: [u]})
    assert grants(seen[1]) == {"p": 12, "b": 1}
    assert seen[2].preempted_ids == () and grants(seen[2]) == {"u": 4, "p": 8, "b": 1}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_prefill_chunk_short_of_blocks_gives_way_to_a_waiting_request_ranked_before_it(mode: str) -> None:
    # sjf: decode d and prefill r fill the cache; at step 7 r's last 3 prompt tokens find no
    # block, and r is its own only victim (d's decode went first). Short w (predicted 2) has just
    # arrived and ranks before r: r gives way, and w is admitted in the blocks r freed. (Kills
    # dropping `_queued_ranks_before`, or reading only the swapped-out queue: r kept its blocks
    # and took nothing for four steps, w waited, and d was preempted at step 11.)
    scheduler = Scheduler(sjf_without_aging(mode))
    d = req("d", 0.0, predicted=30, prompt_len=20, max_tokens=30)
    r = req("r", 1.0, predicted=10, prompt_len=35, max_tokens=10)
    w = req("w", 7.0, predicted=2, prompt_len=4, max_tokens=2)
    seen = run_recording(scheduler, {0: [d], 1: [r], 7: [w]})
    assert grants(seen[6]) == {"d": 1, "r": 7}
    assert seen[7].preempted_ids == ("r",) and grants(seen[7]) == {"d": 1, "w": 4}
    assert d.num_preemptions == 0 and w.first_token_time == 7.0


class Reranked(FCFSPolicy):
    """fcfs with a rank per request id that a test may change between steps (goodput's order
    moves while requests wait, as deadlines near)."""

    def __init__(self, config: SchedulerConfig, ranks: dict[str, float]) -> None:
        super().__init__(config)
        self.ranks = ranks

    def score(self, request: Request, now: float) -> float:
        return self.ranks.get(request.request_id, 0.0)


def test_a_prefill_chunk_short_of_blocks_gives_way_to_a_swapped_out_request_ranked_before_it() -> None:
    # Swap mode, ranks a < r < s. At step 12 a's decode swaps s out, and r is admitted; then s's
    # rank rises above r's. At step 14 r's chunk finds no block, and r is its own only victim
    # (a's decode went first): s, swapped out and now ranked before r, is a queued request r
    # gives way to, as to a waiting one. (Kills reading only the waiting queue in
    # `_queued_ranks_before`: r kept its blocks and took the 2 tokens they held.)
    config = swap_config(num_gpu_blocks=11, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    ranks = {"a": 1.0, "r": 2.0, "s": 3.0}
    scheduler = Scheduler(config, Reranked(config, ranks))
    a = req("a", 0.0, prompt_len=12, max_tokens=30)
    s = req("s", 0.0, prompt_len=12, max_tokens=30)
    r = req("r", 2.0, prompt_len=19, max_tokens=4)
    seen: dict[int, object] = {}

    def on_step(step, output):
        seen[step] = output
        if "s" in output.preempted_ids:
            ranks["s"] = 0.0

    run(scheduler, {0: [a, s], 2: [r]}, on_step=on_step)
    assert seen[12].preempted_ids == ("s",) and grants(seen[12]) == {"a": 1, "r": 7}
    assert grants(seen[13]) == {"a": 1, "r": 7}
    assert seen[14].preempted_ids == ("r",) and grants(seen[14]) == {"a": 1}


class PreemptsAnyone(FCFSPolicy):
    """fcfs order, but any waiting request may preempt any running one: a policy whose
    preemption rule does not follow its order, which the scheduler must not rely on."""

    def should_preempt_for(self, waiting: Request, running: Request, now: float) -> bool:
        return True


def test_a_request_admitted_as_urgent_is_no_victim_for_a_later_one_in_its_step_whatever_the_policy() -> None:
    # Two seats, b running. u1 and u2 arrive together; u1 takes the free seat, and u2, which may
    # preempt anyone, needs a victim's seat. The newest running request is u1, admitted in this
    # very step: it is not a candidate (its grant is in the plan), so b gives way. (Kills
    # dropping `not in plan.scheduled_ids` from the urgent candidates: u1 was preempted in the
    # step that granted it its chunk.)
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                             max_model_len=64)
    scheduler = Scheduler(config, PreemptsAnyone(config))
    b = req("b", 0.0, prompt_len=4, max_tokens=10)
    u1 = req("u1", 1.0, prompt_len=4, max_tokens=4)
    u2 = req("u2", 1.5, prompt_len=4, max_tokens=4)
    seen = run_recording(scheduler, {0: [b], 1: [u1, u2]})
    assert seen[1].preempted_ids == ("b",) and grants(seen[1]) == {"u1": 4, "u2": 4}


def test_a_two_token_prefill_chunk_ranked_after_an_urgent_admission_takes_what_is_free() -> None:
    # priority, three blocks of 4, a 4-token budget. Interactive p (priority 1) has 3 prompt
    # tokens in, in one block, beside batch decode b, when interactive u (priority 0, a
    # one-token prompt) arrives and is admitted as urgent into the last free block. p's chunk,
    # 2 tokens of budget, ranks after u: it takes the one token its block still holds and
    # preempts nobody. (Kills `num_new > 2` for the chunks that yield to an urgent admission: a
    # chunk of 2 preempted b for its second token.)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=3, block_size=4, max_num_seqs=3, max_num_batched_tokens=4,
                                          max_model_len=64, kv_watermark=0.0, policy="priority"))
    b = req("b", 0.0, tier=Tier.BATCH, prompt_len=1, max_tokens=8)
    p = req("p", 1.0, tier=Tier.INTERACTIVE, priority=1, prompt_len=8, max_tokens=2)
    u = req("u", 2.0, tier=Tier.INTERACTIVE, priority=0, prompt_len=1, max_tokens=2)
    seen = run_recording(scheduler, {0: [b], 1: [p], 2: [u]})
    assert grants(seen[1]) == {"p": 3, "b": 1}
    assert seen[2].preempted_ids == () and grants(seen[2]) == {"u": 1, "p": 1, "b": 1}


def test_a_one_token_prefill_chunk_short_of_blocks_keeps_its_blocks_when_nobody_queued_ranks_before_it() -> None:
    # Swap mode, blocks of 2. At step 4 interactive x's 11-token chunk swaps batch decode b out;
    # standard s, mid-prefill (12 of 16 in), gets the one token left of the budget, finds no
    # block, and is its own only victim. Nobody queued ranks before it (b, swapped out, is
    # batch): by `_allocate_or_preempt`'s rule it should take what the free blocks hold (none)
    # and keep its blocks. It gave way instead, a decode's rule, since its chunk was one token
    # (told apart by num_new > 1, not by the tokens it has to feed); with 2 tokens of budget it
    # kept them. (Here x's decode takes s as its victim two steps later anyway; the test pins
    # the step's decision.)
    scheduler = Scheduler(swap_config(num_gpu_blocks=17, block_size=2, max_num_seqs=3, max_num_batched_tokens=12))
    b = req("b", 0.0, tier=Tier.BATCH, prompt_len=2, max_tokens=12)
    s = req("s", 2.0, tier=Tier.STANDARD, prompt_len=16, max_tokens=2)
    x = req("x", 3.0, tier=Tier.INTERACTIVE, prompt_len=22, max_tokens=2)
    seen = run_recording(scheduler, {0: [b], 2: [s], 3: [x]})
    assert grants(seen[3]) == {"x": 10, "s": 1, "b": 1}
    assert grants(seen[4]) == {"x": 11} and seen[4].preempted_ids == ("b",)
