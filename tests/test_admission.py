"""Admission control in tokens: SLO rejections from the Little's-law delay estimate, batch shed
first from a bounded queue, the measured throughput, and the stability margin."""

from __future__ import annotations

import logging

import pytest

from scheduler.admission import AdmissionController, AdmissionRejected, QueuedSums
from scheduler.config import SchedulerConfig
from scheduler.request import ChoiceGroup, Request, SamplingParams, Tier
from scheduler.scheduler import Scheduler


def req(request_id: str, prompt_len: int, predicted: float, tier: Tier = Tier.STANDARD) -> Request:
    return Request(request_id, [1] * prompt_len, SamplingParams(max_tokens=1000), arrival_time=0.0,
                   predicted_len=predicted, tier=tier)


def controller(**kwargs) -> AdmissionController:
    ctl = AdmissionController(SchedulerConfig(**{"num_gpu_blocks": 64, **kwargs}, enable_admission=True))
    ctl.record_step(now=1.0, num_tokens=100, step_time_s=0.1)  # 1000 tokens/s
    return ctl


def test_throughput_is_an_ewma_of_tokens_over_time() -> None:
    ctl = controller(throughput_ewma_alpha=0.5)
    assert ctl.throughput_tokens_per_s == pytest.approx(1000.0)
    ctl.record_step(now=2.0, num_tokens=300, step_time_s=0.2)  # EWMAs: 200 tokens per 0.15 s
    # Tokens and seconds are each smoothed, then divided: not a mean of step rates (1250).
    assert ctl.throughput_tokens_per_s == pytest.approx(200 / 0.15)


def test_standard_rejected_when_predicted_e2e_exceeds_slo() -> None:
    ctl = controller(slo_e2e_standard_s=10.0)  # 1000 tokens/s, 0.1 s per step
    waiting = [req(f"w{i}", 500, 500) for i in range(9)]  # 9000 tokens of work: 9 s at 1000/s
    ctl.check(req("ok", 100, 5), waiting, [])  # 9.1 s + 5 tokens * 0.1 s = 9.6 s: admitted
    with pytest.raises(AdmissionRejected) as info:
        ctl.check(req("late", 100, 20), waiting, [])  # 9.1 s + 2.0 s
    assert "end-to-end" in info.value.reason and "11.10s" in info.value.reason
    assert info.value.retry_after_s == pytest.approx(1.1)  # when 1.1 s of the work ahead has drained


def test_own_decode_takes_a_step_per_token_however_fast_the_server() -> None:
    ctl = controller(slo_e2e_standard_s=10.0)  # 1000 tokens/s, but one request gains 10 tokens/s
    ahead = [req("w", 500, 500)]  # 1 s of work
    ctl.check(req("short", 100, 80), ahead, [])  # 1 s + 0.1 s + 8 s
    with pytest.raises(AdmissionRejected, match="end-to-end latency 10.10s") as info:
        ctl.check(req("tight", 100, 90), ahead, [])  # (100 + 90) / 1000 = 0.19 s by tokens alone
    assert info.value.retry_after_s == pytest.approx(1.0)  # 0.1 s of the work ahead: the 1 s floor
    # One that misses on its own decode alone (20.1 s) is admitted: the work ahead is not why it
    # misses, so refusing it would help no one, and no retry could succeed while there is traffic.
    ctl.check(req("long", 100, 200), ahead, [])
    assert ctl.num_rejected == 1
    # Unless the work ahead alone (15 s) misses the SLO, which would make any request miss: it
    # may retry once enough has drained to leave 10 s ahead. (Admitted, it left the queue of a
    # tier with an SLO unbounded.)
    with pytest.raises(AdmissionRejected, match="end-to-end latency 35.10s") as info:
        ctl.check(req("long", 100, 200), [req("w", 14000, 1000)], [])
    assert info.value.retry_after_s == pytest.approx(5.0)
    assert "send fewer" not in info.value.reason  # one sequence: the hint is for groups


def test_with_nothing_ahead_a_request_is_admitted_whatever_its_own_size() -> None:
    # Refusing it would help no other request, and no retry could succeed: an idle server serves it.
    ctl = controller(slo_e2e_standard_s=10.0, slo_ttft_interactive_s=0.5, max_queued_tokens=1000)
    ctl.check(req("long", 100, 900), [], [])  # 90 s of its own decode
    ctl.check(req("big prompt", 4000, 10, Tier.INTERACTIVE), [], [])  # 4 s to its first token
    ctl.check(req("big batch", 2000, 10, Tier.BATCH), [], [req("r", 100, 100)])  # the queue is empty
    assert ctl.num_rejected == 0


def test_retry_after_is_finite_and_capped_when_throughput_collapses() -> None:
    ctl = controller(max_queued_tokens=300)
    ctl.record_step(now=1e9, num_tokens=1, step_time_s=1e9)  # a stalled step: the rate all but vanishes
    assert ctl.capacity_tokens_per_s < 1e-3
    with pytest.raises(AdmissionRejected, match="queue full") as info:
        ctl.check(req("s", 100, 100), [req("w", 100, 100)], [])
    assert info.value.retry_after_s == 3600.0  # not the 1 s floor: the server really is stalled


def test_an_idle_server_is_judged_by_its_best_step_not_its_served_rate() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, enable_admission=True,
                                              slo_ttft_interactive_s=0.5))
    ctl.record_step(now=0.0, num_tokens=200, step_time_s=0.03)  # one request's prefill
    for k in range(1, 50):
        ctl.record_step(now=k * 0.015, num_tokens=1, step_time_s=0.015)  # then its lone decode
    ahead = [req("w", 200, 10, Tier.INTERACTIVE)]
    assert 500 / ctl.throughput_tokens_per_s > 0.5  # by the served rate (demand) it would be refused
    assert ctl.capacity_tokens_per_s == pytest.approx(200 / 0.03, rel=1e-3)  # decayed for 0.7 s
    ctl.check(req("i", 300, 50, Tier.INTERACTIVE), ahead, [])  # 75 ms at the best step's rate
    assert ctl.num_rejected == 0


def test_a_lone_decode_past_the_window_does_not_hide_the_capacity() -> None:
    # The best step is remembered beyond the 10 s window, halving every 600 s: after 60 s of a
    # lone decode a second request is still judged by the batch rate, not the demand.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, enable_admission=True))
    ctl.record_step(now=0.0, num_tokens=200, step_time_s=0.03)
    for k in range(1, 2001):
        ctl.record_step(now=k * 0.03, num_tokens=1, step_time_s=0.03)
    assert ctl.capacity_tokens_per_s == pytest.approx(200 / 0.03 * 0.5 ** (60 / 600))
    ctl.check(req("s", 100, 50), [], [req("r", 200, 100)])  # 9 s ahead at the demand rate, 0.06 s at this
    assert ctl.num_rejected == 0


def test_the_queue_bound_counts_only_work_a_request_would_queue_behind() -> None:
    ctl = controller(max_queued_tokens=10_000, slo_ttft_interactive_s=1e9, slo_e2e_standard_s=1e9)
    backlog = [req(f"b{i}", 4000, 2000, Tier.BATCH) for i in range(2)]  # 12,000 tokens of batch work
    ctl.check(req("i", 100, 10, Tier.INTERACTIVE), backlog, [])  # nothing of its tier queued
    ctl.check(req("s", 100, 10), backlog, [])
    with pytest.raises(AdmissionRejected, match="queue full"):
        ctl.check(req("b", 100, 10, Tier.BATCH), backlog, [])


def test_interactive_ttft_counts_only_interactive_prompts_ahead() -> None:
    ctl = controller(slo_ttft_interactive_s=0.5)
    standard_backlog = [req(f"s{i}", 1000, 1000) for i in range(20)]
    ctl.check(req("i", 300, 50, Tier.INTERACTIVE), standard_backlog, [])  # 0.3 s: tier goes first
    interactive_backlog = [req(f"i{i}", 100, 50, Tier.INTERACTIVE) for i in range(3)]
    with pytest.raises(AdmissionRejected, match="TTFT"):
        ctl.check(req("i9", 300, 50, Tier.INTERACTIVE), interactive_backlog, [])  # 0.6 s
    # Only their prompts: (2 * 100 + 250) / 1000 = 0.45 s admits; with their decodes it would be 0.55 s.
    ctl.check(req("i8", 250, 50, Tier.INTERACTIVE), interactive_backlog[:2], [])


def test_interactive_ttft_counts_the_unfed_prompt_of_running_interactive_requests() -> None:
    # A long prompt given its first chunk moves to running, but its other chunks are still served
    # before anything waiting: it was counted while waiting and forgotten once running.
    ctl = controller(slo_ttft_interactive_s=0.5)
    long_prompt = req("long", 1000, 50, Tier.INTERACTIVE)
    long_prompt.num_computed_tokens = 256  # 744 tokens still to feed: 0.74 s at 1000 tokens/s
    with pytest.raises(AdmissionRejected, match="TTFT"):
        ctl.check(req("i", 100, 50, Tier.INTERACTIVE), [], [long_prompt])
    long_prompt.num_computed_tokens = 1000  # decoding: nothing of its prompt is ahead any more
    ctl.check(req("i", 100, 50, Tier.INTERACTIVE), [], [long_prompt])


def test_a_recompute_preempted_request_owes_its_generated_tokens_again() -> None:
    from scheduler.admission import token_work

    preempted = req("p", 100, 600)
    preempted.output_token_ids = [5] * 500
    # Decoding, it owes the 100 tokens still to generate (each the feed of the one before).
    preempted.num_computed_tokens = 599
    assert token_work([preempted]) == 100
    # Recomputed, it feeds its 600 tokens again, the last of which is its next decode.
    preempted.num_computed_tokens = 0
    assert token_work([preempted]) == 599 + 100
    # Ahead of an interactive request, that re-prefill delays its first token too: 0.6 s.
    preempted.tier = Tier.INTERACTIVE
    with pytest.raises(AdmissionRejected, match="TTFT"):
        controller(slo_ttft_interactive_s=0.5).check(req("i", 10, 50, Tier.INTERACTIVE), [preempted], [])


def test_a_request_larger_than_the_queue_bound_is_refused_only_while_the_queue_is_full() -> None:
    # On its own it overflows any queue: refused whenever anything was queued, it never got in
    # under steady traffic, and every retry its 429 invited was refused again.
    ctl = controller(max_queued_tokens=1000, batch_shed_share=0.5)
    big = req("big", 480, 40, Tier.BATCH)  # 520 tokens against the batch bound of 500
    ctl.check(big, [req("small", 4, 2, Tier.BATCH)], [])
    with pytest.raises(AdmissionRejected, match="queue full"):
        ctl.check(big, [req(f"q{i}", 200, 50, Tier.BATCH) for i in range(2)], [])  # 500 queued: full


def test_a_request_larger_than_the_bound_retries_when_the_queue_is_below_it_not_empty() -> None:
    ctl = controller(max_queued_tokens=10_000)  # 1000 tokens/s
    queued = [req(f"q{i}", 1000, 500) for i in range(10)]  # 15,000 tokens queued
    with pytest.raises(AdmissionRejected, match="queue full") as info:
        ctl.check(req("big", 11_000, 1000), queued, [])  # 12,000 tokens on its own
    assert info.value.retry_after_s == pytest.approx(5.0)  # 5,000 tokens drained, not all 15,000


def test_with_every_seat_taken_the_work_ahead_drains_at_the_served_rate() -> None:
    # Full prefill chunks ran at 2,048 tokens/s; then 32 seats decode a token each per 0.25 s step,
    # 128 tokens/s: queued decodes drain at that, not at a prefill chunk's rate.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, enable_admission=True, max_num_seqs=32,
                                              slo_e2e_standard_s=10.0))
    ctl.record_step(now=0.0, num_tokens=512, step_time_s=0.25)
    for k in range(1, 200):
        ctl.record_step(now=0.25 * k, num_tokens=32, step_time_s=0.25)
    ahead = [req("w", 100, 900)]  # 1,000 tokens: 0.5 s at the best step's rate, 7.8 s at the served
    running = [req(f"run{i}", 10, 1) for i in range(32)]
    newcomer = req("new", 10, 1)  # its own 0.25 s decode and a short prefill
    ctl.check(newcomer, ahead, running[:31])  # a seat free: judged by capacity, admitted
    with pytest.raises(AdmissionRejected, match="end-to-end"):
        ctl.check(newcomer, ahead + [req("w2", 100, 900)], running)  # 2,000 tokens: 15.6 s
    ctl.check(newcomer, ahead + [req("w2", 100, 900)], running[:31])  # 1 s at capacity
    # Its own prompt is fed at the capacity's rate even then: priced at the served 128 tokens/s, a
    # 1,400-token prompt alone (10.9 s) would miss the SLO on its own, and so be let in whatever
    # waited ahead of it.
    with pytest.raises(AdmissionRejected, match="end-to-end"):
        ctl.check(req("long-prompt", 1400, 1), ahead * 6, running)


def test_seats_held_by_a_lower_tier_do_not_slow_the_work_ahead_of_a_more_urgent_request() -> None:
    # Every seat taken by standard decodes read as saturated for an interactive request too, whose
    # prompt ahead then drained at the decode-bound served rate: servable ones were refused. It
    # takes a lower tier's seat by preemption, so its work ahead is fed at the capacity's rate.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, enable_admission=True, max_num_seqs=32,
                                              slo_ttft_interactive_s=1.0))
    ctl.record_step(now=0.0, num_tokens=512, step_time_s=0.25)  # 2,048 tokens/s at best
    for k in range(1, 200):
        ctl.record_step(now=0.25 * k, num_tokens=32, step_time_s=0.25)  # 128 tokens/s served
    ahead = [req("i-ahead", 300, 1, Tier.INTERACTIVE)]  # 0.15 s at capacity, 2.3 s at the served rate
    newcomer = req("i-new", 100, 1, Tier.INTERACTIVE)
    ctl.check(newcomer, ahead, [req(f"s{i}", 10, 500) for i in range(32)])
    with pytest.raises(AdmissionRejected, match="TTFT"):  # every seat its own tier's: it waits for them
        ctl.check(newcomer, ahead, [req(f"i{i}", 10, 500, Tier.INTERACTIVE) for i in range(32)])


def test_batch_is_never_rejected_for_latency_but_is_shed_first() -> None:
    ctl = controller(max_queued_tokens=10_000, batch_shed_share=0.5, slo_e2e_standard_s=1e9)  # the bound alone
    waiting = [req(f"w{i}", 2000, 1000) for i in range(2)]  # 6000 queued tokens
    ctl.check(req("s", 500, 500), waiting, [])  # 7000 <= 10000: standard admitted
    with pytest.raises(AdmissionRejected, match="queue full"):
        ctl.check(req("b", 500, 500, Tier.BATCH), waiting, [])  # 7000 > 5000: batch shed
    ctl.check(req("b2", 500, 500, Tier.BATCH), [], [req("r", 10**5, 10**5)])  # running work: no SLO


def test_batch_has_no_latency_slo_and_its_work_does_not_delay_standard_requests() -> None:
    ctl = controller()  # the default 10 s end-to-end SLO, 1000 tokens/s, 0.1 s per step
    running = [req("r", 10**5, 10**5)]  # 200 s of work
    ctl.check(req("b", 500, 500, Tier.BATCH), [], running)  # batch: admitted
    with pytest.raises(AdmissionRejected, match="end-to-end"):
        ctl.check(req("s", 500, 50), [], running)  # standard (5.5 s of its own): the same work rejects it
    # 12 s of batch work waiting is not ahead of a standard request; the same as standard work is.
    backlog = [req(f"w{i}", 2000, 1000, Tier.BATCH) for i in range(4)]
    ctl.check(req("s1", 100, 5), backlog, [])
    with pytest.raises(AdmissionRejected, match="end-to-end"):
        ctl.check(req("s2", 100, 5), [req(f"w{i}", 2000, 1000) for i in range(4)], [])


# Enough KV (262k tokens) that the margin tests below exercise the token and seat terms alone.
ROOMY_KV_BLOCKS = 16384


def test_two_quick_first_arrivals_are_not_an_overload() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=512))
    ctl.record_arrival(0.0, req("a", 500, 500))
    ctl.record_step(now=0.02, num_tokens=512, step_time_s=0.02)
    ctl.record_arrival(0.02, req("b", 500, 500))
    assert ctl.stability_margin(0.02) < 1.0  # 2 arrivals in the 10 s window, not 100 per second


def test_nothing_measured_means_no_latency_rejection() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, enable_admission=True))
    ctl.check(req("s", 100, 100), [req(f"w{i}", 10**4, 10**4) for i in range(10)], [])


def test_scheduler_rejects_without_queueing() -> None:
    config = SchedulerConfig(num_gpu_blocks=256, max_model_len=4096, enable_admission=True, max_queued_tokens=1000)
    scheduler = Scheduler(config)
    scheduler.add_request(req("a", 600, 300))
    with pytest.raises(AdmissionRejected):
        scheduler.add_request(req("b", 600, 300))
    assert scheduler.get_request("b") is None and scheduler.stats().num_waiting == 1
    assert scheduler.stats().num_rejected == 1


def test_stability_margin_matches_hand_computation(caplog: pytest.LogCaptureFixture) -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=500, max_num_seqs=256,
                                              stability_window_s=10.0))
    for second in range(10):
        ctl.record_step(now=float(second), num_tokens=500, step_time_s=0.25)  # capacity 2000 tokens/s
        ctl.record_arrival(float(second), req(f"r{second}", 300, 200))
    # lambda = 10 arrivals / the 10 s window, 500 tokens each: 500 tokens/s against 2000.
    assert ctl.stability_margin(9.0) == pytest.approx(1.0 * 500 / 2000)
    for second in range(10, 20):
        for k in range(5):
            ctl.record_arrival(float(second), req(f"x{second}_{k}", 300, 200))
    with caplog.at_level(logging.WARNING, logger="scheduler.admission"):
        margin = ctl.stability_margin(19.0)
    # Window [9, 19]: 50 arrivals plus the one at t=9, over 10 s; only the step at t=9 is left.
    assert margin == pytest.approx(51 / 10 * 500 / 2000)
    assert margin > 1 and "stability margin" in caplog.text
    # It names the capacity that binds (the margin beside it read "1.00 > 1" just above 1).
    assert f"the offered load exceeds the capacity in token throughput (stability margin {margin:.3f})" in caplog.text


def test_stability_margin_counts_seats_which_bind_decode_first() -> None:
    # One 300 + 200-token request a second, a step every 0.25 s: tokens need 500 of 2,000 a second,
    # but each request holds one of 8 seats for 200 decode steps plus a prefill chunk, 50 s of a
    # seat every second against 8 seats. Before, the margin read 0.25 for this queue without end.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=500, max_num_seqs=8,
                                              stability_window_s=10.0))
    for second in range(10):
        ctl.record_step(now=float(second), num_tokens=500, step_time_s=0.25)
        ctl.record_arrival(float(second), req(f"r{second}", 300, 200))
    assert ctl.stability_margin(9.0) == pytest.approx(1.0 * (200 + 300 / 500) * 0.25 / 8)


def test_stability_margin_takes_the_rate_over_at_least_32_arrivals() -> None:
    # One arrival every 3 s: a 10 s window alone holds 3 or 4 of them, a rate that jumps with
    # every arrival; the last 32 span 93 s and give 32 / 93 per second.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=500, max_num_seqs=256,
                                              stability_window_s=10.0))
    for i in range(40):
        ctl.record_step(now=3.0 * i, num_tokens=500, step_time_s=0.25)
        ctl.record_arrival(3.0 * i, req(f"r{i}", 300, 200))
    now = 3.0 * 39
    assert ctl.stability_margin(now) == pytest.approx(32 / (now - 3.0 * 8) * 500 * 0.25 / 500)


def test_a_burst_after_an_idle_hour_is_not_diluted_by_the_arrivals_before_it() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=500, max_num_seqs=256,
                                              stability_window_s=10.0))
    ctl.record_arrival(0.0, req("old", 300, 200))
    for i in range(31):  # 31 arrivals in the last second of an hour
        ctl.record_arrival(3599.0 + i / 31, req(f"r{i}", 300, 200))
    ctl.record_step(now=3600.0, num_tokens=500, step_time_s=0.25)
    # The one from an hour ago is older than 30 windows: the rate is 31 over the 10 s window
    # (it read 32 per hour before).
    assert ctl.stability_margin(3600.0) == pytest.approx(31 / 10 * 500 * 0.25 / 500)


def test_a_burst_is_not_diluted_by_an_arrival_minutes_before_it() -> None:
    # Within 30 windows, so kept: it stretched the span to 290 s and read a 20x overload as 0.69.
    def margin(with_old_arrival: bool) -> float:
        ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=500,
                                                  max_num_seqs=256, stability_window_s=10.0))
        if with_old_arrival:
            ctl.record_arrival(10.0, req("old", 300, 200))
        for i in range(31):
            ctl.record_arrival(295.0 + i * 5 / 31, req(f"r{i}", 300, 200))
        ctl.record_step(now=300.0, num_tokens=500, step_time_s=0.25)
        return ctl.stability_margin(300.0)

    assert margin(True) == pytest.approx(margin(False)) == pytest.approx(31 / 10 * 500 * 0.25 / 500)


def test_stability_margin_counts_kv_which_binds_when_the_cache_fills() -> None:
    # One 300 + 200-token request a second, a step every 0.25 s: each holds 300 + 100 KV tokens on
    # average for 50 s, 20,000 tokens in use against a cache of 1,024 * 16 = 16,384. Tokens (500
    # of 2,000 a second) and seats (50 of 256 seat-seconds a second) both read well below 1.
    config = SchedulerConfig(num_gpu_blocks=1024, max_num_batched_tokens=500, max_num_seqs=256,
                             stability_window_s=10.0)
    ctl = AdmissionController(config)
    for second in range(10):
        ctl.record_step(now=float(second), num_tokens=500, step_time_s=0.25)
        ctl.record_arrival(float(second), req(f"r{second}", 300, 200))
    assert ctl.stability_margin(9.0) == pytest.approx(1.0 * 200 * (300 + 200 / 2) * 0.25 / (1024 * 16))


def test_the_token_term_measures_capacity_by_full_steps_not_the_mean_step() -> None:
    # Mostly 32-token decode steps of 0.25 s and a few full 512-token steps of 0.88 s: capacity is
    # 512 / 0.88 tokens/s, not 512 over the mean step.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=512,
                                              max_num_seqs=512, stability_window_s=10.0))
    for i in range(40):
        full = i % 10 == 0
        ctl.record_step(now=i * 0.25, num_tokens=512 if full else 32, step_time_s=0.88 if full else 0.25)
    for i in range(40):
        ctl.record_arrival(i * 0.25, req(f"r{i}", 100, 37.5))  # 40 arrivals over 10 s: 550 tokens/s
    assert ctl.stability_margin(9.75) == pytest.approx(4.0 * 137.5 / (512 / 0.88))


def test_shed_arrivals_count_in_the_offered_load() -> None:
    config = SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=500, max_num_seqs=500,
                             max_queued_tokens=1000,
                             enable_admission=True, stability_window_s=10.0)
    scheduler = Scheduler(config)
    for i in range(40):
        try:
            scheduler.add_request(req(f"r{i}", 300, 200), now=i * 0.25)
        except AdmissionRejected:
            pass
    scheduler.record_step(10.0, 500, 0.25)
    assert scheduler.stats().num_rejected > 30
    assert scheduler.admission.stability_margin(10.0) == pytest.approx(40 / 10.0 * 500 / 2000)


def test_small_steps_alone_do_not_stand_for_the_token_capacity() -> None:
    # A server just started: two 20-token steps. Their rate (80 tokens/s) is demand, not capacity;
    # 100 tokens/s offered against it would read 1.25. No step filled half the budget, so the
    # budget has not bound and the token term stays out.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=512,
                                              max_num_seqs=512, stability_window_s=10.0))
    ctl.record_step(now=0.25, num_tokens=20, step_time_s=0.25)
    ctl.record_step(now=0.5, num_tokens=20, step_time_s=0.25)
    for i in range(10):
        ctl.record_arrival(i * 1.0, req(f"r{i}", 50, 50))
    seats = 1.0 * (50 + 50 / 512) * 0.25 / 512
    kv = 1.0 * 50 * (50 + 25) * 0.25 / (ROOMY_KV_BLOCKS * 16)
    assert ctl.stability_margin(9.0) == pytest.approx(max(seats, kv))


def test_arrivals_without_a_prediction_stay_out_of_the_decode_terms() -> None:
    # Served without a predictor, a chat request's decode falls back to max_tokens (the rest of a
    # 2k context); squared in the KV term, ten 100-token requests in 36 s read as 1.5, an overload,
    # and in the seat term 3.9 at 1 request/s. Their prompts still count.
    config = SchedulerConfig(num_gpu_blocks=1456, max_num_batched_tokens=512, max_num_seqs=256,
                             max_model_len=2048, stability_window_s=10.0)

    def margin(predicted: float | None) -> float:
        ctl = AdmissionController(config)
        for i in range(10):
            request = Request(f"r{i}", [1] * 100, SamplingParams(max_tokens=1948), arrival_time=4.0 * i,
                              predicted_len=predicted)
            ctl.record_arrival(4.0 * i, request)
            ctl.record_step(now=4.0 * i, num_tokens=3, step_time_s=0.06)
        return ctl.stability_margin(36.0)

    rate = 10 / 36.0
    assert margin(None) == pytest.approx(rate * (100 / 512) * 0.06 / 256)  # the seat term, prompts only
    assert margin(250.0) == pytest.approx(rate * 250 * (100 + 125) * 0.06 / (1456 * 16))  # KV binds


# Admission at its boundaries (each test kills a mutant of scheduler/admission.py that the
# tests above let through).


def test_a_zero_length_step_is_ignored() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64))
    ctl.record_step(1.0, 10, 0.0)
    assert ctl.throughput_tokens_per_s is None


def test_a_request_that_fills_the_queue_exactly_is_admitted() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, max_queued_tokens=100))
    ctl.check(req("b", 20, 20), [req("a", 30, 30)], [])  # 60 + 40 == 100


def make_ctl(**kw) -> AdmissionController:
    """A controller that has measured 100 tokens/s."""
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, **kw))
    ctl.record_step(0.0, 100, 1.0)  # 100 tokens/s
    return ctl


def test_own_work_exactly_at_the_slo_is_still_shed_for_the_work_ahead() -> None:
    ctl = make_ctl(slo_ttft_interactive_s=1.0)
    with pytest.raises(AdmissionRejected):
        ctl.check(req("i", 100, 1, tier=Tier.INTERACTIVE), [req("w", 50, 1, tier=Tier.INTERACTIVE)], [])


def test_an_estimate_exactly_at_the_slo_is_admitted() -> None:
    ctl = make_ctl(slo_ttft_interactive_s=1.0)
    ctl.check(req("i", 50, 1, tier=Tier.INTERACTIVE), [req("w", 50, 1, tier=Tier.INTERACTIVE)], [])


def test_a_half_budget_step_measures_token_capacity() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=100000, max_num_batched_tokens=512, max_num_seqs=256,
                                              stability_window_s=10.0))
    for second in range(10):
        ctl.record_step(float(second), 256, 0.1)  # 2560 tokens/s
        ctl.record_arrival(float(second), req(f"r{second}", 300, 200))
    assert ctl.stability_margin(9.0) == pytest.approx(1.0 * 500 / 2560)


def test_an_overrun_running_request_owes_no_negative_work() -> None:
    ctl = make_ctl(slo_e2e_standard_s=10.0)
    overrun = req("o", 10, 10)
    overrun.output_token_ids = [1] * 5000
    # All but its last token fed, as the scheduler leaves a decoding request: it has nothing to
    # prefill, so only its negative predicted output (10 - 5000) could offset the work ahead.
    overrun.num_computed_tokens = 10 + 5000 - 1
    ahead = [req("w", 1000, 1)]
    with pytest.raises(AdmissionRejected):
        ctl.check(req("s", 100, 1), ahead, [overrun])  # 1001 tokens ahead = 10 s at 100 tok/s


def test_nothing_measured_means_no_latency_rejection_for_a_small_request() -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, enable_admission=True))
    ctl.check(req("s", 1, 1), [req(f"w{i}", 10**4, 10**4) for i in range(10)], [])


def test_the_overload_is_logged_once_per_crossing(caplog) -> None:
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=100000, max_num_batched_tokens=500, max_num_seqs=256,
                                              stability_window_s=10.0))
    ctl.record_step(0.0, 500, 0.25)
    for k in range(100):
        ctl.record_arrival(0.0, req(f"x{k}", 300, 200))
    with caplog.at_level(logging.WARNING, logger="scheduler.admission"):
        assert ctl.stability_margin(0.0) > 1 and ctl.stability_margin(0.0) > 1
    assert caplog.text.count("stability margin") == 1
    # An idle hour ends the overload (no load is offered), so the next one is logged too.
    with caplog.at_level(logging.WARNING, logger="scheduler.admission"):
        assert ctl.stability_margin(3600.0) == 0.0
        ctl.record_step(3600.0, 500, 0.25)
        for k in range(100):
            ctl.record_arrival(3600.0, req(f"y{k}", 300, 200))
        assert ctl.stability_margin(3600.0) > 1
    assert caplog.text.count("stability margin") == 2


def test_without_a_set_bound_batch_work_is_still_bounded_and_shed_first() -> None:
    # 64 blocks of 16: a default bound of 4 caches (4096 tokens), batch admitted below half of it.
    ctl = controller(slo_e2e_standard_s=1e9)
    assert ctl.config.max_queued_tokens is None and ctl.config.queued_token_bound == 4096
    flood = [req(f"b{i}", 400, 100, Tier.BATCH) for i in range(4)]  # 2000 queued tokens
    ctl.check(req("fits", 20, 28, Tier.BATCH), flood, [])  # 2048: admitted
    with pytest.raises(AdmissionRejected, match="queue full: 2000 queued tokens \\+ 100 exceed the batch bound 2048"):
        ctl.check(req("over", 50, 50, Tier.BATCH), flood, [])
    # A request with an SLO is refused by its SLO alone: ten times the bound queued ahead of it.
    ctl.check(req("s", 100, 5), [req(f"w{i}", 3000, 1000, Tier.BATCH) for i in range(10)], [])
    ctl.check(req("s2", 100, 5), [req(f"w{i}", 3000, 1000) for i in range(10)], [])


def test_the_default_bound_scales_with_the_kv_cache() -> None:
    config = SchedulerConfig(num_gpu_blocks=100, block_size=32, queue_bound_kv_multiple=2.5)
    assert config.queued_token_bound == 8000
    assert SchedulerConfig(num_gpu_blocks=100, max_queued_tokens=7).queued_token_bound == 7
    with pytest.raises(ValueError, match="queue_bound_kv_multiple"):
        SchedulerConfig(num_gpu_blocks=100, queue_bound_kv_multiple=0)


def choice(index: int, predicted: float, group: ChoiceGroup) -> Request:
    return Request(f"{group.group_id}-{index}", [1] * 200, SamplingParams(max_tokens=1000), arrival_time=0.0,
                   predicted_len=predicted, group=group)


def test_the_choices_of_one_request_share_one_queue_bound_decision() -> None:
    ctl = controller(max_queued_tokens=1000)
    group = ChoiceGroup("cmpl-1", 3)
    first, second = choice(0, 100, group), choice(1, 100, group)
    # Its siblings are not work ahead of it: with only them queued it is judged as on an empty
    # queue, and admitted whatever the group's size.
    ctl.check(second, [first], [])
    # With 200 tokens queued outside the group, the group's 3 x 300 overflow the bound of 1000,
    # so every choice is refused alike, where one alone would be admitted.
    outside = req("w", 100, 100)
    for member in (first, second):
        with pytest.raises(AdmissionRejected, match="200 queued tokens \\+ 900 exceed"):
            ctl.check(member, [outside, first], [])
    ctl.check(req("alone", 200, 100), [outside], [])


def test_the_slo_counts_every_choices_prefill_and_one_decode() -> None:
    ctl = controller(slo_e2e_standard_s=10.0)  # 1000 tokens/s, 0.1 s a step
    outside = req("w", 100, 400)  # 0.5 s of work ahead
    # Three prefills of 200 (0.6 s) and 90 steps side by side (9 s): 10.1 s with the work ahead.
    with pytest.raises(AdmissionRejected, match="end-to-end latency 10.10s"):
        ctl.check(choice(0, 90, ChoiceGroup("cmpl-2", 3)), [outside], [])
    ctl.check(choice(0, 90, ChoiceGroup("cmpl-3", 1)), [outside], [])  # one choice: 9.7 s


def test_a_batchs_prompts_are_one_unit_counted_at_their_own_sizes() -> None:
    # A completions batch's prompts were judged one by one: the first was work ahead of the
    # second, and an idle server refused the batch on every try. As one group, the prompt
    # tokens of all of them count, not the member's own times the group's size.
    ctl = make_ctl(slo_ttft_interactive_s=1.0)  # 100 tokens/s
    group = ChoiceGroup("cmpl-batch", 2, prompt_tokens=30 + 60)
    short, long = interactive_choice(0, 30, group), interactive_choice(1, 60, group)
    ctl.check(long, [short], [])  # the sibling is not ahead: 0.9 s of its own on an empty queue
    ahead = [req("w", 20, 1, tier=Tier.INTERACTIVE)]  # 0.2 s of work ahead
    for member in (short, long):  # each judged on the group's 0.9 s (0.6 s, or 1.2 s, by its own size)
        with pytest.raises(AdmissionRejected, match="TTFT 1.10s"):
            ctl.check(member, [ahead[0], short], [])
    bound = controller(max_queued_tokens=700)
    members = [Request(f"b-{i}", [1] * size, SamplingParams(max_tokens=1000), arrival_time=0.0, predicted_len=100,
                       group=ChoiceGroup("b", 2, prompt_tokens=500)) for i, size in enumerate((100, 400))]
    with pytest.raises(AdmissionRejected, match="100 queued tokens \\+ 700 exceed"):  # 500 prompt + 2 x 100
        bound.check(members[0], [req("w", 50, 50), members[1]], [])


def refused(ctl: AdmissionController, request: Request, waiting: list[Request]) -> bool:
    try:
        ctl.check(request, waiting, [])
    except AdmissionRejected:
        return True
    return False


def test_more_choices_never_make_admission_easier() -> None:
    # A group larger than the queue bound, or slower than the SLO, is not "one request too large
    # to refuse": that exemption is read from one choice, so refusals only grow with n.
    bound = controller(max_queued_tokens=1000)
    by_bound = [refused(bound, choice(0, 100, ChoiceGroup(f"b{n}", n)), [req("w", 100, 100)]) for n in range(1, 17)]
    assert by_bound == [False, False] + [True] * 14  # 200 queued + n x 300 against 1000
    slo = controller(slo_e2e_standard_s=10.0)
    by_slo = [refused(slo, choice(0, 90, ChoiceGroup(f"s{n}", n)), [req("w", 100, 400)]) for n in range(1, 17)]
    assert by_slo == [False, False] + [True] * 14  # 0.5 s ahead + n x 0.2 s of prefill + 9 s of decode


def test_the_ewmas_weigh_a_new_step_by_alpha() -> None:
    ctl = controller(throughput_ewma_alpha=0.1)  # 100 tokens in 0.1 s
    ctl.record_step(now=2.0, num_tokens=300, step_time_s=0.2)
    assert ctl.mean_step_time_s == pytest.approx(0.1 + 0.1 * (0.2 - 0.1))
    assert ctl.throughput_tokens_per_s == pytest.approx((100 + 0.1 * 200) / 0.11)


def test_a_faster_step_raises_the_best_step_rate() -> None:
    ctl = controller()  # 1000 tokens/s
    ctl.record_step(now=1.0, num_tokens=300, step_time_s=0.1)  # 3000 tokens/s, the served EWMA 1200
    assert ctl.capacity_tokens_per_s == pytest.approx(3000.0)


def test_steps_older_than_the_window_leave_the_stability_margin() -> None:
    def margin(with_old_step: bool) -> float | None:
        ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, stability_window_s=10.0))
        if with_old_step:
            ctl.record_step(0.0, 256, 10.0)  # a slow step 100 s ago
        ctl.record_step(100.0, 256, 0.1)
        for k in range(5):
            ctl.record_arrival(100.0, req(f"r{k}", 300, 200))
        return ctl.stability_margin(100.0)

    assert margin(True) == pytest.approx(margin(False))


def test_a_standard_request_waits_behind_interactive_work() -> None:
    ctl = controller(slo_e2e_standard_s=10.0)  # 1000 tokens/s, 0.1 s per step
    waiting = [req(f"w{i}", 500, 500, Tier.INTERACTIVE) for i in range(9)]  # 9 s of work served first
    with pytest.raises(AdmissionRejected, match="end-to-end latency 11.10s"):
        ctl.check(req("late", 100, 20), waiting, [])


def interactive_choice(index: int, prompt_len: int, group: ChoiceGroup) -> Request:
    return Request(f"{group.group_id}-{index}", [1] * prompt_len, SamplingParams(max_tokens=10), arrival_time=0.0,
                   predicted_len=1, tier=Tier.INTERACTIVE, group=group)


def test_interactive_choices_are_refused_when_the_work_ahead_makes_the_last_one_late() -> None:
    # One choice alone (0.4 s) makes the 1 s TTFT, so its own size is no reason to admit the group:
    # three prefills (1.2 s) behind 0.1 s of work ahead miss it.
    ctl = make_ctl(slo_ttft_interactive_s=1.0)  # 100 tokens/s
    ahead = [req("w", 10, 1, tier=Tier.INTERACTIVE)]
    with pytest.raises(AdmissionRejected, match="TTFT 1.30s"):
        ctl.check(interactive_choice(0, 40, ChoiceGroup("cmpl-i", 3)), ahead, [])


def test_a_running_choice_is_not_work_ahead_of_its_siblings() -> None:
    ctl = make_ctl(slo_ttft_interactive_s=1.0)  # 100 tokens/s
    group = ChoiceGroup("cmpl-r", 2)
    running = interactive_choice(0, 100, group)
    running.num_computed_tokens = 10  # 90 prompt tokens still to feed: 0.9 s, were it another request's
    ctl.check(interactive_choice(1, 100, group), [], [running])
    assert ctl.num_rejected == 0


def test_a_group_larger_than_the_bound_is_admitted_on_an_empty_queue() -> None:
    ctl = controller(max_queued_tokens=1000)
    group = ChoiceGroup("cmpl-big", 4)  # 4 x 300 tokens, over the bound, but nothing outside it queued
    ctl.check(choice(1, 100, group), [choice(0, 100, group)], [])
    assert ctl.num_rejected == 0


def test_a_group_with_nothing_ahead_is_admitted_and_its_retry_waits_only_for_the_work_ahead() -> None:
    ctl = controller(slo_e2e_standard_s=10.0)  # 1000 tokens/s, 0.1 s a step
    # Six prefills of 200 (1.2 s) and 90 decode steps (9 s): 10.2 s, one choice alone 9.2 s.
    ctl.check(choice(0, 90, ChoiceGroup("cmpl-a", 6)), [], [])
    assert ctl.num_rejected == 0
    ahead = [req("w", 2000, 1000)]  # 3 s of work
    with pytest.raises(AdmissionRejected, match="end-to-end latency 13.20s") as info:
        ctl.check(choice(0, 90, ChoiceGroup("cmpl-b", 6)), ahead, [])
    # Past the 3 s ahead the group would still miss (its own 10.2 s): waiting longer helps no more.
    assert info.value.retry_after_s == pytest.approx(3.0)


def decoding(request_id: str, prompt_len: int, remaining: float, tier: Tier = Tier.STANDARD) -> Request:
    """A running request with its prompt fed, `remaining` predicted tokens still to generate."""
    running = req(request_id, prompt_len, remaining, tier)
    running.num_computed_tokens = prompt_len
    return running


def test_a_request_that_runs_beside_the_running_decodes_is_not_queued_behind_them() -> None:
    # 14 decodes with 600 tokens left each (8,400 tokens: 8.4 s at 1000 tokens/s) and 18 seats free:
    # the newcomer is seated at the next step and shares their steps, ~2.1 s, so it is admitted.
    # Serialised behind their decodes its estimate was 10.5 s, a 429 for a request that met its SLO.
    ctl = controller(num_gpu_blocks=2048, slo_e2e_standard_s=10.0)  # 2,048 blocks hold them all
    running = [decoding(f"r{i}", 100, 600) for i in range(14)]
    ctl.check(req("short", 100, 20), [], running)
    # What still delays it is what is fed before it: a running prompt's unfed chunks.
    running[0].num_computed_tokens = 0
    running[0].prompt_token_ids = [1] * 8000
    with pytest.raises(AdmissionRejected, match="end-to-end"):
        ctl.check(req("short", 100, 20), [], running)  # 8 s of prefill ahead + 2.1 s
    assert ctl.num_rejected == 1


def test_with_no_seat_it_waits_for_the_first_running_request_to_end() -> None:
    running = [decoding(f"r{i}", 100, 600) for i in range(14)]
    no_seat = controller(num_gpu_blocks=2048, slo_e2e_standard_s=10.0, max_num_seqs=14,
                         max_num_batched_tokens=512)
    # A seat frees after 600 decode steps of 0.1 s: 60 s, then 0.1 s of prompt and 2 s of decode.
    with pytest.raises(AdmissionRejected, match="62.10s"):
        no_seat.check(req("short", 100, 20), [], running)
    # One of them 10 steps from its end: seated after 1 s, 3.2 s in all, where the whole work of
    # the fourteen (7,810 tokens: 7.8 s at 1000 tokens/s, 10.01 s with its own) refused it.
    running[0] = decoding("r0", 100, 10)
    no_seat.check(req("short", 100, 21), [], running)
    assert no_seat.num_rejected == 1
    # One queued ahead takes the first seat that frees: it waits for the second (600 steps).
    with pytest.raises(AdmissionRejected, match="62.10s"):
        no_seat.check(req("short", 100, 20), [req("q0", 1, 1)], running)


def test_with_no_room_for_it_the_whole_work_ahead_counts() -> None:
    running = [decoding(f"r{i}", 100, 600) for i in range(14)]
    # Choices need a seat each: 4 fit the 18 seats left, 5 do not.
    seats = controller(num_gpu_blocks=2048, slo_e2e_standard_s=10.0, max_num_seqs=18, max_num_batched_tokens=512)

    def choices(n: int) -> Request:
        choice = req("short", 100, 20)
        choice.group = ChoiceGroup(f"cmpl-{n}", n)
        return choice

    seats.check(choices(4), [], running)
    with pytest.raises(AdmissionRejected, match="end-to-end"):
        seats.check(choices(5), [], running)
    # At their predicted ends the 14 hold 44 blocks each and it 8: 624 blocks, which must fit the
    # cache less the watermark's 5% reserve (no request starts into it).
    for blocks, fits in ((657, True), (640, False), (64, False)):
        ctl = controller(num_gpu_blocks=blocks, slo_e2e_standard_s=10.0)
        if fits:
            ctl.check(req("short", 100, 20), [], running)
        else:
            with pytest.raises(AdmissionRejected, match="10.50s"):
                ctl.check(req("short", 100, 20), [], running)


def test_an_interactive_request_waits_for_a_seat_held_by_interactive_decodes() -> None:
    # Every seat held by interactive decodes (no lower tier to preempt), nothing left to feed:
    # its first token waits for a seat, 380 steps of 0.1 s. It was priced at no wait and admitted.
    ctl = controller(num_gpu_blocks=2048, slo_ttft_interactive_s=0.5, max_num_seqs=4)
    running = [decoding(f"i{k}", 50, 380) for k in range(4)]
    for each in running:
        each.tier = Tier.INTERACTIVE
    with pytest.raises(AdmissionRejected, match="TTFT 38.05s"):
        ctl.check(req("new", 50, 20, Tier.INTERACTIVE), [], running)
    running[2] = decoding("i2", 50, 3)
    running[2].tier = Tier.INTERACTIVE
    ctl.check(req("new", 50, 20, Tier.INTERACTIVE), [], running)  # 0.3 s + 0.05 s
    # Standard decodes hold seats it takes by preemption: no wait.
    ctl.check(req("new", 50, 20, Tier.INTERACTIVE), [], [decoding(f"s{k}", 50, 380) for k in range(4)])
    assert ctl.num_rejected == 1


def test_an_interactive_request_without_room_for_its_prompt_waits_for_the_interactive_work_ahead() -> None:
    # A free seat, but two interactive requests that end at 69 blocks of 16 tokens each leave no
    # room for its 4-block prompt in 140 blocks less the 1% watermark: they are no one's victims,
    # so it waits for their decodes, 2 x 1,000 tokens at 1,000 tokens/s. It was priced at their
    # prompts still to feed (none) and admitted.
    ctl = controller(num_gpu_blocks=140, kv_watermark=0.01, slo_ttft_interactive_s=0.5, max_num_seqs=4)
    running = [decoding(f"i{k}", 100, 1000, Tier.INTERACTIVE) for k in range(2)]
    with pytest.raises(AdmissionRejected, match="TTFT 2.05s"):
        ctl.check(req("new", 50, 20, Tier.INTERACTIVE), [], running)
    # With room for it (and beside batch decodes, whose blocks it takes by preemption): no wait.
    ctl.check(req("new", 50, 20, Tier.INTERACTIVE), [], running[:1])
    batch = [decoding(f"b{k}", 100, 1000, Tier.BATCH) for k in range(2)]
    ctl.check(req("new", 50, 20, Tier.INTERACTIVE), [], batch)
    assert ctl.num_rejected == 1


def test_an_interactive_queue_longer_than_a_turn_of_the_seats_counts_its_whole_work() -> None:
    running = [decoding(f"i{k}", 50, 2) for k in range(2)]
    for each in running:
        each.tier = Tier.INTERACTIVE
    queued = [req(f"q{k}", 50, 100, Tier.INTERACTIVE) for k in range(2)]
    # Two queued ahead take both seats the running two free in 0.2 s, so it waits past a turn of
    # the seats: Little's law in tokens, the 300 queued and 4 running at 1000 tokens/s, then its
    # own 50-token prompt.
    with pytest.raises(AdmissionRejected, match="TTFT 0.35s"):
        controller(slo_ttft_interactive_s=0.3, max_num_seqs=2).check(
            req("new", 50, 20, Tier.INTERACTIVE), queued, running)
    # Their decodes never take less than until the last running request ends, 40 steps of 0.1 s:
    # 0.1 s of queued prompts, 4 s, and its own prompt.
    running[1] = decoding("i1", 50, 40)
    running[1].tier = Tier.INTERACTIVE
    with pytest.raises(AdmissionRejected, match="TTFT 4.15s"):
        controller(slo_ttft_interactive_s=0.5, max_num_seqs=2).check(
            req("new", 50, 20, Tier.INTERACTIVE), queued, running)


def test_a_queued_interactive_request_the_policy_serves_later_does_not_delay_a_first_token() -> None:
    ctl = controller(slo_ttft_interactive_s=0.5)
    queued = [req(f"i{i}", 300, 50, Tier.INTERACTIVE) for i in range(2)]  # 0.6 s of prompts
    with pytest.raises(AdmissionRejected, match="TTFT"):
        ctl.check(req("i", 100, 5, Tier.INTERACTIVE), queued, [])
    ctl.check(req("i", 100, 5, Tier.INTERACTIVE), queued, [], ranks_before=lambda other: False)


def test_under_goodput_every_queued_request_counts_since_its_order_moves() -> None:
    # A queued request nearing its deadline joins the urgent group and overtakes an arrival that
    # ranked ahead of it at arrival: counted out then, its work would have been missed.
    def scheduler_of(policy: str) -> Scheduler:
        scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=128, enable_admission=True, policy=policy,
                                              slo_e2e_standard_s=10.0, aging_tokens_per_s=0.0))
        scheduler.admission.record_step(now=0.0, num_tokens=100, step_time_s=0.1)  # 1000 tokens/s
        for i in range(20):
            scheduler.add_request(req(f"w{i}", 10, 790), now=0.0)
        return scheduler

    short = req("short", 100, 5)
    short.arrival_time = 1.0
    scheduler_of("sjf").add_request(short, now=1.0)
    with pytest.raises(AdmissionRejected, match="end-to-end"):
        scheduler_of("goodput").add_request(req("short", 100, 5), now=1.0)


def test_only_queued_work_the_policy_serves_first_delays_a_request() -> None:
    # 16,000 tokens of long replies queued: 16 s ahead under fcfs, nothing under sjf for a 5-token
    # reply, which it seats first.
    ctl = controller(slo_e2e_standard_s=10.0)
    queued = [req(f"w{i}", 10, 790) for i in range(20)]
    with pytest.raises(AdmissionRejected, match="end-to-end"):
        ctl.check(req("short", 100, 5), queued, [])
    ctl.check(req("short", 100, 5), queued, [], ranks_before=lambda other: False)
    with pytest.raises(AdmissionRejected, match="end-to-end"):  # ahead of it, they count again
        ctl.check(req("short", 100, 5), queued, [], ranks_before=lambda other: True)
    # The queue bound still counts them all: they are queued, whoever goes first.
    bounded = controller(slo_e2e_standard_s=1e9, max_queued_tokens=10_000)
    with pytest.raises(AdmissionRejected, match="queue full"):
        bounded.check(req("short", 100, 5), queued, [], ranks_before=lambda other: False)


@pytest.mark.parametrize("policy, admitted", [("fcfs", False), ("sjf", True)])
def test_the_scheduler_judges_a_request_by_the_work_its_policy_puts_ahead(policy, admitted) -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=128, enable_admission=True, policy=policy,
                                          slo_e2e_standard_s=10.0, aging_tokens_per_s=0.0))
    scheduler.admission.record_step(now=0.0, num_tokens=100, step_time_s=0.1)  # 1000 tokens/s
    for i in range(20):
        scheduler.add_request(req(f"w{i}", 10, 790), now=0.0)
    short = req("short", 100, 5)
    short.arrival_time = 1.0  # after them (at one arrival time its id, "short" < "w0", would put it first)
    if admitted:
        scheduler.add_request(short, now=1.0)
        assert short in scheduler.waiting
    else:
        with pytest.raises(AdmissionRejected, match="end-to-end"):
            scheduler.add_request(short, now=1.0)


def test_the_queued_work_kept_between_arrivals_equals_the_queue_summed_afresh() -> None:
    # The queue bound walked the whole queue for every arrival (3,000 batch requests: 6 s); the
    # scheduler now keeps the sums, which every step, abort and failed step must leave true.
    import random

    from scheduler.admission import token_work, tokens_to_prefill
    from scheduler.testing import PagedTokenRunner

    config = SchedulerConfig(num_gpu_blocks=40, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                             enable_admission=True, max_queued_tokens=3000, max_model_len=256,
                             preemption_mode="swap", num_cpu_blocks=64)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks)
    rng = random.Random(0)
    refused = checked = 0
    for step in range(300):
        for _ in range(rng.randrange(0, 4)):
            if scheduler.waiting and rng.random() < 0.2:  # between two arrivals
                scheduler.abort_request(rng.choice(scheduler.waiting).request_id)
            request = Request(f"r{step}-{rng.random()}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 60))],
                              SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True), arrival_time=float(step),
                              predicted_len=rng.randrange(1, 40), tier=rng.choice(list(Tier)))
            try:
                scheduler.add_request(request, now=float(step))
            except AdmissionRejected:
                refused += 1
            queued = scheduler.waiting + scheduler.swapped
            for tier in Tier:
                kept, mine = scheduler._queued_work.up_to(tier, queued), [r for r in queued if r.tier <= tier]
                assert (kept.count, kept.work, kept.prefill) == (
                    len(mine), pytest.approx(token_work(mine)), pytest.approx(sum(tokens_to_prefill(r) for r in mine)))
                checked += 1
        output = scheduler.schedule(now=float(step))
        scheduler.update_from_output(output, runner.execute(output), now=float(step))
    assert refused > 0 and checked > 300  # the bound was reached, and kept sums were read


def test_everything_queued_counted_ahead_bounds_the_delay_so_an_admission_needs_no_ranking() -> None:
    # check() admits without reading the policy's order when the bound admits; that is sound only
    # if no subset of the queue reads a longer delay, and no longer delay admits what a shorter
    # refuses. Random queues, running sets, seat counts and cache sizes, both tiers.
    import random

    rng = random.Random(7)
    for trial in range(3000):
        tier = rng.choice([Tier.INTERACTIVE, Tier.STANDARD])
        ctl = controller(num_gpu_blocks=rng.choice([16, 64, 400]), max_num_seqs=rng.randint(1, 6),
                         slo_ttft_interactive_s=0.5, slo_e2e_standard_s=10.0)
        running = [decoding(f"r{k}", rng.randint(1, 200), rng.randint(1, 300)) for k in range(rng.randint(0, 6))]
        for each in running:
            each.tier = rng.choice([Tier.INTERACTIVE, tier])
            if rng.random() < 0.3:
                each.num_computed_tokens = rng.randint(0, each.num_prompt_tokens)  # still prefilling
            elif rng.random() < 0.3:
                each.output_token_ids = [7] * rng.randint(1, 400)  # some past their prediction
                each.num_computed_tokens = each.num_tokens - 1
        queued = [req(f"q{k}", rng.randint(1, 400), rng.randint(1, 300), rng.choice([Tier.INTERACTIVE, tier]))
                  for k in range(rng.randint(0, 8))]
        for each in queued:
            if rng.random() < 0.3:  # preempted by recompute: its outputs are fed again
                each.output_token_ids = [7] * rng.randint(1, 100)
        subset = [r for r in queued if rng.random() < 0.5]
        request = req("new", rng.randint(1, 300), rng.randint(1, 150), tier)
        if rng.random() < 0.3:
            request.group = ChoiceGroup("g", rng.randint(2, 4))
        drain = rng.choice([100.0, 1000.0])
        whole = ctl._delay_s(request, queued, QueuedSums.of(queued), running, drain)
        part = ctl._delay_s(request, subset, QueuedSums.of(subset), running, drain)
        assert part <= whole + 1e-9, trial
        slo = ctl._slo_terms(request, 1000.0)
        if ctl._refusal(whole, slo) is None:
            assert ctl._refusal(part, slo) is None, trial


def test_a_request_the_bound_admits_is_admitted_without_ranking_the_queue() -> None:
    ctl = controller(slo_e2e_standard_s=10.0)
    queued = [req(f"w{i}", 100, 100) for i in range(5)]  # 1 s of work in all
    calls = []

    def ranks_before(other: Request) -> bool:
        calls.append(other.request_id)
        return other.request_id == "w0"

    ctl.check(req("new", 100, 20), queued, [], ranks_before)
    assert calls == []  # even all of it ahead meets the SLO
    long_queue = [req(f"w{i}", 900, 100) for i in range(10)]  # 10 s of work, 1 s of it ranked ahead
    ctl.check(req("new", 100, 20), long_queue, [], ranks_before)
    assert len(calls) == 10 and ctl.num_rejected == 0
    with pytest.raises(AdmissionRejected, match="end-to-end latency 12.10s"):
        ctl.check(req("new", 100, 20), long_queue, [], None)  # every one ahead


def test_a_seat_the_policy_lets_it_take_within_its_tier_is_no_wait() -> None:
    # Under priority, a request of a better priority takes a running one's seat by preemption at
    # the next step, as a lower tier's: its seat wait was priced as for fcfs and it was refused.
    def scheduler_with_two_running(policy: str) -> Scheduler:
        scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=512, enable_admission=True, policy=policy,
                                              max_num_seqs=2, slo_e2e_standard_s=10.0))
        for k in range(2):
            running = req(f"r{k}", 20, 600)
            running.priority = 5
            scheduler.add_request(running, now=0.0)
        scheduler.schedule(0.0)  # both prompts fed whole: two decodes of 600 predicted tokens
        scheduler.admission.record_step(now=0.1, num_tokens=100, step_time_s=0.1)  # 1000 tokens/s
        return scheduler

    def urgent() -> Request:
        request = req("urgent", 20, 20)
        request.priority = 0
        return request

    with pytest.raises(AdmissionRejected, match="end-to-end latency 62"):  # 600 steps for a seat
        scheduler_with_two_running("fcfs").add_request(req("urgent", 20, 20), now=0.1)
    scheduler_with_two_running("priority").add_request(urgent(), now=0.1)  # 2 s of its own decode
    ctl = controller(max_num_seqs=2, slo_e2e_standard_s=10.0)
    running = [decoding(f"r{k}", 20, 600) for k in range(2)]
    with pytest.raises(AdmissionRejected):
        ctl.check(urgent(), [], running, preempts=lambda other: False)
    ctl.check(urgent(), [], running, preempts=lambda other: other is running[0])


def test_a_running_request_past_its_prediction_is_not_a_free_seat() -> None:
    # Four interactive decodes that produced 30 tokens against a prediction of 20: read as no
    # tokens left, their seats were priced free now. Their refined remaining length (a lognormal
    # tail past 30 tokens, here about 25) is what a seat waits for.
    ctl = controller(slo_ttft_interactive_s=0.5, max_num_seqs=4)
    running = []
    for k in range(4):
        overrun = decoding(f"i{k}", 50, 20)
        overrun.tier = Tier.INTERACTIVE
        overrun.output_token_ids = [7] * 30
        overrun.num_computed_tokens = overrun.num_tokens - 1
        running.append(overrun)
    with pytest.raises(AdmissionRejected, match="TTFT"):
        ctl.check(req("new", 50, 20, Tier.INTERACTIVE), [], running)


def test_a_prompt_scored_alone_counts_in_the_margin_with_its_one_token() -> None:
    # A prompt scored alone (max_tokens 1, no prediction: nothing to predict) was left out of the
    # mean decode but counted in the arrival rate, so 90 of them beside 10 generating requests
    # read as ten times the load: a logged overload that was not there.
    def margin(scored_carry_a_prediction: bool) -> float:
        ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=ROOMY_KV_BLOCKS, max_num_batched_tokens=512,
                                                  stability_window_s=10.0))
        ctl.record_step(now=0.0, num_tokens=512, step_time_s=0.1)
        for k in range(100):
            if k % 10:
                scored = Request(f"s{k}", [1] * 200, SamplingParams(max_tokens=1), arrival_time=0.0,
                                 predicted_len=1.0 if scored_carry_a_prediction else None)
                ctl.record_arrival(0.1 * k, scored)
            else:
                ctl.record_arrival(0.1 * k, req(f"g{k}", 200, 200))
        return ctl.stability_margin(10.0)

    assert margin(False) == pytest.approx(margin(True)) and margin(False) < 1.0


def test_a_running_prompt_still_to_feed_holds_its_seat_for_its_chunks_too() -> None:
    # Two seats, each held by a 160-token prompt not fed yet: ten 16-token chunks, then a decode,
    # 1.1 s before a seat frees; with their 0.32 s of prompts ahead and its own 0.11 s, 1.53 s.
    ctl = controller(slo_e2e_standard_s=1.0, max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks=2048)
    with pytest.raises(AdmissionRejected, match="1.53s"):
        ctl.check(req("new", 10, 1), [], [req(f"r{k}", 160, 1) for k in range(2)])


def test_a_queue_of_exactly_one_turn_of_the_seats_waits_for_a_seat_not_the_whole_work() -> None:
    # One seat running (2 steps left) and one queued ahead of it with a 1,000-token reply: the
    # queued one takes the free seat, the arrival the next, 0.2 s on; the queued reply's 1,000
    # tokens are decoded beside it, not before it.
    ctl = controller(num_gpu_blocks=2048, slo_ttft_interactive_s=0.5, max_num_seqs=2)
    running = decoding("r", 50, 2)
    running.tier = Tier.INTERACTIVE
    ctl.check(req("new", 50, 20, Tier.INTERACTIVE), [req("q", 50, 1000, Tier.INTERACTIVE)], [running])
    assert ctl.num_rejected == 0


def test_a_groups_later_members_get_its_first_members_verdict_whatever_the_queue_did() -> None:
    # Members reach the scheduler one by one, not always between the same two steps. Judged
    # afresh, a later member could be refused after its siblings were admitted (the server then
    # aborted them: one 429 counted as a refusal and n - 1 aborts), or admitted after they were
    # refused (and aborted again at once).
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=128, enable_admission=True, max_queued_tokens=1000))
    admitted = ChoiceGroup("cmpl-in", 2)  # 2 x 300 tokens
    scheduler.add_request(choice(0, 100, admitted))
    scheduler.add_request(req("outside", 550, 100))  # 300 + 650 queued: within the bound
    # Judged afresh: 650 outside its group + its 600 exceed 1000.
    with pytest.raises(AdmissionRejected, match="650 queued tokens"):
        scheduler.admission.check(choice(1, 100, admitted), scheduler.waiting, [])
    scheduler.add_request(choice(1, 100, admitted))
    refused = ChoiceGroup("cmpl-out", 2)
    with pytest.raises(AdmissionRejected, match="exceed") as first:
        scheduler.add_request(choice(0, 100, refused))
    for request_id in ("cmpl-in-0", "cmpl-in-1", "outside"):
        scheduler.abort_request(request_id)
    assert not scheduler.waiting  # an empty queue would admit it afresh
    with pytest.raises(AdmissionRejected) as second:
        scheduler.add_request(choice(1, 100, refused))
    assert (second.value.reason, second.value.retry_after_s) == (first.value.reason, first.value.retry_after_s)
    assert scheduler.admission.num_rejected == 3  # the probe and both refused members
    assert len(scheduler._group_verdicts) == 0  # every member came: nothing kept


def test_the_group_verdicts_kept_are_bounded_and_a_single_choice_keeps_none() -> None:
    from scheduler.group_verdicts import GroupVerdicts

    verdicts = GroupVerdicts(max_open_groups=2)
    calls = []
    for name in ("a", "b", "c"):
        verdicts.judge(choice(0, 100, ChoiceGroup(name, 3)), lambda: calls.append(name), pytest.fail)
    assert len(verdicts) == 2
    verdicts.judge(choice(1, 100, ChoiceGroup("a", 3)), lambda: calls.append("a again"), pytest.fail)
    assert calls == ["a", "b", "c", "a again"]  # "a" was let go, oldest first, so judged afresh
    verdicts.judge(choice(0, 100, ChoiceGroup("alone", 1)), lambda: calls.append("alone"), pytest.fail)
    assert len(verdicts) == 2 and calls[-1] == "alone"


def test_the_margin_reads_0_once_a_burst_has_left_the_window() -> None:
    # Older arrivals are kept for the rate (the last 32, 30 windows); with the steps gone, the
    # margin read None, and /metrics dropped its gauge, for about 300 s after every burst.
    ctl = AdmissionController(SchedulerConfig(num_gpu_blocks=64, stability_window_s=10.0))
    for t in range(5):
        ctl.record_step(float(t), 256, 0.1)
        ctl.record_arrival(float(t), req(f"r{t}", 300, 200))
    assert ctl.stability_margin(5.0) > 0
    assert [ctl.stability_margin(at) for at in (25.0, 200.0, 299.0)] == [0.0, 0.0, 0.0]
    ctl.record_arrival(300.0, req("late", 300, 200))  # in the window, no step yet to measure it by
    assert ctl.stability_margin(300.0) is None


@pytest.mark.parametrize("field", ["slo_ttft_interactive_s", "slo_e2e_standard_s"])
def test_a_zero_slo_is_refused_as_a_target_no_request_meets(field) -> None:
    with pytest.raises(ValueError, match=f"{field} must be > 0, got 0"):
        SchedulerConfig(num_gpu_blocks=8, **{field: 0})
