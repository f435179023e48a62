"""Admission behaviours that the suite let through (mutation testing of scheduler/admission.py,
expected_length.py, policies.py and Request.predicted_mean, session 37): each test kills a
one-line mutant that every other test passed. The last found a boundary bug, now fixed."""

from __future__ import annotations

import pytest

from scheduler.admission import AdmissionController, AdmissionRejected
from scheduler.config import SchedulerConfig
from scheduler.request import ChoiceGroup, Request, SamplingParams, Tier
from scheduler.scheduler import Scheduler
from test_admission import controller, decoding, req


def slow_controller(**kwargs) -> AdmissionController:
    """100 tokens/s, 1 s a step."""
    ctl = AdmissionController(SchedulerConfig(**{"num_gpu_blocks": 64, **kwargs}))
    ctl.record_step(0.0, 100, 1.0)
    return ctl


def test_an_overrun_request_does_not_offset_the_decodes_ahead() -> None:
    # Mutant: predicted_output_tokens without its max(0, ...). Running 4,990 tokens past its
    # prediction, it owes nothing, not -4,990 tokens that cancel the 1,000-token decode queued
    # ahead (10 s at 100 tokens/s). Its blocks do not fit, so the whole work ahead counts.
    ctl = slow_controller(slo_e2e_standard_s=10.0)
    overrun = req("o", 10, 10)
    overrun.output_token_ids = [1] * 5000
    overrun.num_computed_tokens = 10 + 5000 - 1
    with pytest.raises(AdmissionRejected, match="end-to-end latency 12.01s"):
        ctl.check(req("s", 100, 1), [req("w", 1, 1000)], [overrun])
    # Queued again after a recompute preemption, 390 tokens past its prediction: it owes its
    # 499 tokens to feed again, which with 1,500 queued and 200 of its own overflow 2,000.
    bound = controller(max_queued_tokens=2000, slo_e2e_standard_s=1e9)
    preempted = req("p", 100, 10)
    preempted.output_token_ids = [5] * 400
    with pytest.raises(AdmissionRejected, match="queue full: 1999 queued tokens"):
        bound.check(req("s", 100, 100), [req("w", 500, 1000), preempted], [])


def test_a_running_request_one_token_from_its_prediction_frees_its_seat_next_step() -> None:
    # Mutant: decode_steps_left's `left >= 1.0` made `>`. One predicted token left is one step,
    # not the ranking length's 151 (srpt's refinement is for requests past their prediction).
    ctl = controller(slo_ttft_interactive_s=0.5, max_num_seqs=1)
    running = Request("r", [1] * 50, SamplingParams(max_tokens=1000), arrival_time=0.0, predicted_len=50,
                      predicted_rank_len=200, tier=Tier.INTERACTIVE)
    running.output_token_ids = [5] * 49
    running.num_computed_tokens = 50 + 49 - 1  # decoding: nothing to feed but its last token
    ctl.check(req("i", 100, 10, Tier.INTERACTIVE), [], [running])  # 0.1 s for the seat + 0.1 s
    assert ctl.num_rejected == 0


def test_a_window_of_exactly_eight_arrivals_has_a_rate_of_its_own() -> None:
    # Mutant: `in_window >= MIN_ARRIVALS_FOR_A_WINDOW_RATE` made `>`. Eight arrivals in the last
    # 10 s are rated on their own (0.8/s), not diluted by one 280 s before them; seven are not.
    def margin(in_window: int) -> float:
        ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=16384, max_num_batched_tokens=500,
                                                  max_num_seqs=256, stability_window_s=10.0))
        ctl.record_arrival(10.0, req("old", 300, 200))
        for i in range(in_window):
            ctl.record_arrival(291.0 + i, req(f"r{i}", 300, 200))
        ctl.record_step(now=300.0, num_tokens=500, step_time_s=0.25)  # 2000 tokens/s
        return ctl.stability_margin(300.0)

    assert margin(8) == pytest.approx(8 / 10 * 500 / 2000)
    assert margin(7) == pytest.approx(8 / 290 * 500 / 2000)


def interactive_choice(index: int, prompt_len: int, group: ChoiceGroup) -> Request:
    return Request(f"{group.group_id}-{index}", [1] * prompt_len, SamplingParams(max_tokens=10), arrival_time=0.0,
                   predicted_len=1, tier=Tier.INTERACTIVE, group=group)


def test_the_send_fewer_hint_when_one_choice_alone_takes_exactly_the_slo() -> None:
    # Mutant: the hint's `slo.target_s >= slo.alone_s` made `>`. One choice's prefill takes the
    # 1 s TTFT exactly (it makes it), two take 2 s: the group, not the work ahead, misses.
    ctl = slow_controller(slo_ttft_interactive_s=1.0)
    member = interactive_choice(0, 100, ChoiceGroup("cmpl-h", 2))
    with pytest.raises(AdmissionRejected, match="its 2 sequences alone take 2.00s: send fewer"):
        ctl.check(member, [req("w", 10, 1, Tier.INTERACTIVE)], [])


def test_a_queued_sibling_is_not_counted_against_the_queue_bound_by_the_schedulers_sums() -> None:
    # Mutant: the scheduler's kept QueuedWork sums used for a grouped request too. They hold the
    # siblings already admitted (400 tokens), which are not work ahead of it: the second choice
    # must get the first's answer (150 queued + 800 of the group's own fit 1,000).
    config = SchedulerConfig(num_gpu_blocks=256, max_model_len=4096, enable_admission=True, max_queued_tokens=1000)
    scheduler = Scheduler(config)
    scheduler.add_request(req("w", 100, 50))
    group = ChoiceGroup("cmpl-q", 2)
    for index in range(2):
        scheduler.add_request(Request(f"cmpl-q-{index}", [1] * 300, SamplingParams(max_tokens=1000),
                                      arrival_time=0.0, predicted_len=100, group=group))
    assert scheduler.stats().num_waiting == 3 and scheduler.stats().num_rejected == 0


def test_a_prompt_still_to_feed_takes_a_step_before_its_seat_frees() -> None:
    # Mutant: the prefill steps of _seat_wait_s rounded down. The one seat's holder has 100
    # prompt tokens to feed (one step, under the 512 budget) and 10 decodes: 11 steps, 1.1 s,
    # after its 0.1 s of prefill ahead, then 0.1 s of its own (1.2 s with the floor).
    ctl = controller(slo_ttft_interactive_s=0.5, max_num_seqs=1)
    running = req("r", 100, 10, Tier.INTERACTIVE)
    with pytest.raises(AdmissionRejected, match="TTFT 1.30s"):
        ctl.check(req("i", 100, 10, Tier.INTERACTIVE), [], [running])


def test_a_standard_queue_of_exactly_one_turn_of_the_seats_waits_for_a_seat_not_the_whole_work() -> None:
    # Mutant: _standard_delay_s's `short <= len(running)` made `<`. One seat running (2 steps left)
    # and one queued ahead with a 1,000-token reply: the arrival runs beside that reply once the
    # running one ends (0.05 s of prompt ahead + 0.2 s + its own 2.05 s = 2.3 s), it is not
    # queued behind it (3.1 s).
    ctl = controller(num_gpu_blocks=2048, slo_e2e_standard_s=3.0, max_num_seqs=2)
    ctl.check(req("new", 50, 20), [req("q", 50, 1000)], [decoding("r", 50, 2)])
    assert ctl.num_rejected == 0


def test_blocks_that_exactly_fill_the_cache_less_the_reserve_fit_and_a_partial_block_counts() -> None:
    # Mutants: `blocks <= ...` made `<`, and _blocks_to_finish rounding down. The running request
    # ends at 656 tokens (41 blocks of 16) and the arrival at 104 (7): 48 blocks, exactly 64 less
    # the 25% watermark, so it runs beside it. One token more takes a 42nd block: no room, and the
    # 557 decode tokens ahead count (0.557 s + its own 0.5 s > 1 s).
    ctl = controller(num_gpu_blocks=64, kv_watermark=0.25, slo_e2e_standard_s=1.0)
    ctl.check(req("s", 100, 4), [], [decoding("r", 100, 556)])
    assert ctl.num_rejected == 0
    with pytest.raises(AdmissionRejected, match="end-to-end latency 1.06s"):
        ctl.check(req("s", 100, 4), [], [decoding("r", 100, 557)])


def test_work_ahead_exactly_at_the_slo_does_not_refuse_a_request_that_misses_on_its_own() -> None:
    # Mutant: _refusal's `ahead_s > slo.target_s` made `>=`. Its own 21 s miss the 10 s SLO
    # whatever is ahead; 10 s ahead would not make another request miss, so refusing it helps no
    # one. 10.01 s ahead would: then it is refused.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=2048, slo_e2e_standard_s=10.0))
    ctl.record_step(0.0, 100, 1.0)  # 100 tokens/s, 1 s a step
    ctl.check(req("long", 100, 20), [req("w", 1000, 1)], [])  # 1,000 prompt tokens ahead: 10 s
    assert ctl.num_rejected == 0
    with pytest.raises(AdmissionRejected, match="end-to-end latency 31.01s"):
        ctl.check(req("long", 100, 20), [req("w", 1001, 1)], [])


def test_a_request_exactly_the_size_of_the_bound_is_refused_only_while_the_queue_is_full() -> None:
    # Like one larger than the limit, a request of exactly the limit fits only an empty queue:
    # it was refused behind any queued work (every retry, under steady traffic), while one a
    # token larger was admitted behind the same 6 queued tokens.
    ctl = controller(max_queued_tokens=1000, batch_shed_share=0.5)  # the batch bound: 500
    small = req("small", 4, 2, Tier.BATCH)
    ctl.check(req("bigger", 461, 40, Tier.BATCH), [small], [])  # 501 tokens: admitted
    ctl.check(req("big", 460, 40, Tier.BATCH), [small], [])  # 500 tokens: admitted too
    assert ctl.num_rejected == 0
    with pytest.raises(AdmissionRejected, match="queue full"):  # but not behind a full queue
        ctl.check(req("big", 460, 40, Tier.BATCH), [req("full", 400, 100, Tier.BATCH)], [])
