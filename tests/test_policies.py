"""Ordering policies: each one's order, aging against starvation, SRPT refinement and limited
preemption, goodput urgency, and tier preemption that keeps every token."""

from __future__ import annotations

import math
import random
import zlib

import pytest

from scheduler.config import SchedulerConfig
from scheduler.policies import (DEFAULT_LOG_SPREAD, Z90, GoodputPolicy, SJFPolicy, SRPTPolicy, make_policy,
                                ranking_length, refined_remaining)
from scheduler.request import Request, RequestStatus, SamplingParams, Tier
from scheduler.scheduler import Scheduler
from scheduler.testing import PagedTokenRunner, reference_output

CONFIG = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_model_len=256)


def req(request_id: str, arrival: float = 0.0, predicted: float | None = None, tier: Tier = Tier.STANDARD,
        priority: int = 0, true_len: int | None = None, prompt_len: int = 4, max_tokens: int = 200,
        **kwargs) -> Request:
    # Seeded by the whole id: two requests of one size must not share a prompt, or a mix-up of
    # their KV blocks would still give each the reference tokens.
    offset = zlib.crc32(request_id.encode())
    prompt = [1 + (i * 5 + offset) % 90 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, predicted_len=predicted, tier=tier, priority=priority,
                   true_len=true_len, **kwargs)


def order(policy_name: str, requests: list[Request], now: float = 0.0, **config) -> list[str]:
    policy = make_policy(policy_name, SchedulerConfig(num_gpu_blocks=64, **config))
    return [r.request_id for r in sorted(requests, key=lambda r: policy.sort_key(r, now))]


def test_fcfs_orders_by_tier_then_arrival() -> None:
    requests = [req("a", 0.0, tier=Tier.BATCH), req("b", 1.0), req("c", 2.0, tier=Tier.INTERACTIVE), req("d", 0.5)]
    assert order("fcfs", requests) == ["c", "d", "b", "a"]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf", "srpt", "oracle", "goodput"])
def test_every_policy_orders_by_tier_before_length(policy) -> None:
    requests = [req("batch", 0.0, predicted=1, true_len=1, tier=Tier.BATCH),
                req("standard", 0.0, predicted=5, true_len=5),
                req("interactive", 1.0, predicted=190, true_len=190, tier=Tier.INTERACTIVE, priority=1)]
    assert order(policy, requests, now=1.0) == ["interactive", "standard", "batch"]


def test_priority_lower_first_ties_by_arrival() -> None:
    requests = [req("a", 0.0, priority=2), req("b", 1.0, priority=0), req("c", 0.5, priority=0)]
    assert order("priority", requests) == ["c", "b", "a"]
    policy = make_policy("priority", CONFIG)
    assert policy.should_preempt_for(requests[1], requests[0], 0.0)
    assert not policy.should_preempt_for(requests[0], requests[1], 0.0)


def test_priorities_beyond_float_precision_order_as_they_preempt() -> None:
    # As floats, 2**60 and 2**60 + 1 were equal, so the order fell back to arrival while the
    # preemption rule compared the integers: a victim could rank ahead of its preemptor.
    low, high = req("low", 0.0, priority=2**60 + 1), req("high", 1.0, priority=2**60)
    policy = make_policy("priority", SchedulerConfig(num_gpu_blocks=4))
    assert policy.should_preempt_for(high, low, 1.0)
    assert policy.sort_key(high, 1.0) < policy.sort_key(low, 1.0)


def test_sjf_orders_by_predicted_length() -> None:
    requests = [req("long", 0.0, predicted=150), req("short", 1.0, predicted=10), req("mid", 0.5, predicted=60)]
    assert order("sjf", requests, now=1.0, aging_tokens_per_s=0.0) == ["short", "mid", "long"]


def test_oracle_never_ages_a_long_request_past_a_short_newcomer() -> None:
    from scheduler.config import SchedulerConfig
    from scheduler.policies import make_policy
    from scheduler.request import Request, SamplingParams

    config = SchedulerConfig(num_gpu_blocks=8, aging_tokens_per_s=20.0)
    oracle, sjf = make_policy("oracle", config), make_policy("sjf", config)
    params = SamplingParams(max_tokens=1000)
    old_long = Request("long", [1], params, arrival_time=0.0, true_len=900, predicted_len=900)
    new_short = Request("short", [1], params, arrival_time=999.0, true_len=10, predicted_len=10)
    now = 1000.0
    assert oracle.sort_key(new_short, now) < oracle.sort_key(old_long, now)
    assert sjf.sort_key(old_long, now) < sjf.sort_key(new_short, now)  # sjf ages, the oracle does not


def test_oracle_orders_by_true_length_not_prediction() -> None:
    requests = [req("a", predicted=10, true_len=100), req("b", predicted=100, true_len=10)]
    assert order("oracle", requests, aging_tokens_per_s=0.0) == ["b", "a"]
    assert order("sjf", requests, aging_tokens_per_s=0.0) == ["a", "b"]


def test_sjf_aging_promotes_a_long_waiting_request() -> None:
    long_one = req("long", arrival=0.0, predicted=100)
    fresh_short = req("short", arrival=20.0, predicted=5)
    # Score falls by 10 tokens per second waited: at t=20 the long one scores 100 - 200 < 5.
    assert order("sjf", [long_one, fresh_short], now=20.0, aging_tokens_per_s=10.0) == ["long", "short"]
    assert order("sjf", [long_one, fresh_short], now=20.0, aging_tokens_per_s=0.0) == ["short", "long"]
    policy = make_policy("sjf", SchedulerConfig(num_gpu_blocks=64, aging_tokens_per_s=10.0))
    assert isinstance(policy, SJFPolicy) and policy.aging_bound_s(long_one) == pytest.approx(10.0)


def starved_request_start(aging: float | None, measure_steps: bool = False, per_step: float = 1.0) -> float | None:
    """One seat; a long request at t=0 and a short one arriving every second; steps 0.5 s apart."""
    config = SchedulerConfig(num_gpu_blocks=256, block_size=4, max_num_seqs=1, max_model_len=256,
                             policy="sjf", aging_tokens_per_s=aging, aging_tokens_per_step=per_step)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(256, 4)
    scheduler.add_request(req("long", 0.0, predicted=100, max_tokens=200))
    for second in range(60):
        scheduler.add_request(req(f"s{second}", float(second), predicted=5, max_tokens=2))
        for tick in (0.0, 0.5):
            output = scheduler.schedule(second + tick)
            if any(c.request_id == "long" for c in output.chunks):
                return second + tick
            scheduler.update_from_output(output, runner.execute(output), second + tick)
            if measure_steps:
                scheduler.record_step(second + tick, output.num_batched_tokens, 0.5)
    return None


def test_aging_bounds_the_wait_of_a_starved_request() -> None:
    assert starved_request_start(aging=0.0) is None  # pure SJF starves it
    started = starved_request_start(aging=10.0)
    # Bound: no arrival later than 100 / 10 = 10 s overtakes it; the queue ahead drains in a few steps.
    assert started is not None and started <= 10.0 + 2.0


def test_srpt_refines_remaining_after_outgrowing_the_estimate() -> None:
    request = req("a", predicted=50, predicted_p50=50, predicted_p90=150)
    assert refined_remaining(request) == 50
    request.output_token_ids = [1] * 20
    assert refined_remaining(request) == 30
    request.output_token_ids = [1] * 80
    beyond = refined_remaining(request)
    assert beyond == pytest.approx(lognormal_tail_mean(50.0, 150.0, 80.0) - 80.0, rel=1e-3)
    narrow = req("b", predicted=50, predicted_p50=50, predicted_p90=60)
    narrow.output_token_ids = [1] * 80
    assert refined_remaining(narrow) < beyond  # a tighter spread expects the end sooner


def test_srpt_refines_around_the_ranking_length_when_the_median_sits_at_the_cap() -> None:
    # A trace-trained model: p50 = p90 = the 256-token cap for every prompt, the point head ranks.
    short = req("a", predicted=30, predicted_p50=256, predicted_p90=256, predicted_rank_len=30, max_tokens=256)
    long = req("b", predicted=60, predicted_p50=256, predicted_p90=256, predicted_rank_len=60, max_tokens=256)
    short.output_token_ids = [1] * 29
    assert refined_remaining(short) == 1
    short.output_token_ids = [1] * 35
    long.output_token_ids = [1] * 65
    # Overrunning its estimate, each keeps a remaining length on its own scale (default spread)
    # instead of the cap minus its output for both (221 and 191), so the shorter stays first.
    default_p90 = 30.0 * math.exp(Z90 * DEFAULT_LOG_SPREAD)
    assert refined_remaining(short) == pytest.approx(lognormal_tail_mean(30.0, default_p90, 35.0) - 35.0, rel=1e-3)
    assert refined_remaining(short) < refined_remaining(long) < 100


def lognormal_tail_mean(p50: float, p90: float, g: float, steps: int = 20_000) -> float:
    """E[X | X > g] by numerical integration over log x (reference for the closed form)."""
    mu, sigma = math.log(p50), math.log(p90 / p50) / 1.2815515655446004
    lo, hi = math.log(g), mu + 12 * sigma
    width = (hi - lo) / steps
    mass = weighted = 0.0
    for k in range(steps):
        y = lo + (k + 0.5) * width
        density = math.exp(-0.5 * ((y - mu) / sigma) ** 2)
        mass += density
        weighted += density * math.exp(y)
    return weighted / mass


def test_srpt_reranks_as_tokens_are_generated() -> None:
    a, b = req("a", predicted=40), req("b", predicted=30)
    assert order("srpt", [a, b], aging_tokens_per_s=0.0) == ["b", "a"]
    a.output_token_ids = [1] * 35  # 5 left against 30
    assert order("srpt", [a, b], aging_tokens_per_s=0.0) == ["a", "b"]


def test_srpt_limited_preemption() -> None:
    policy = SRPTPolicy(SchedulerConfig(num_gpu_blocks=64, srpt_max_preempt_share=0.5, srpt_preempt_ratio=4.0))
    running = req("run", predicted=200)
    short = req("short", predicted=10)
    assert policy.should_preempt_for(short, running, 0.0)
    assert not policy.should_preempt_for(req("similar", predicted=100), running, 0.0)  # not 4x shorter
    running.output_token_ids = [1] * 100  # past half of its predicted length
    assert not policy.should_preempt_for(short, running, 0.0)


def test_srpt_preemption_share_is_of_the_ranking_length() -> None:
    # Ranked by 40 tokens (point estimate 400): 30 generated is past half of what srpt orders it
    # by, so it is no longer preempted, though it is under half of the point estimate.
    policy = SRPTPolicy(SchedulerConfig(num_gpu_blocks=64, srpt_max_preempt_share=0.5, srpt_preempt_ratio=1.0,
                                        aging_tokens_per_s=0.0))
    running = req("run", predicted=400, predicted_rank_len=40)
    running.output_token_ids = [1] * 19
    assert policy.should_preempt_for(req("short", predicted=1, predicted_rank_len=1), running, 0.0)
    running.output_token_ids = [1] * 30
    assert not policy.should_preempt_for(req("short", predicted=1, predicted_rank_len=1), running, 0.0)


def test_srpt_bound_is_the_remaining_length_a_request_waited_with() -> None:
    # Predicted 40 tokens, preempted after 100: it waits with its refined remaining length, so a
    # later arrival may overtake it for longer than 40 / rate (what its first wait promised).
    policy = SRPTPolicy(SchedulerConfig(num_gpu_blocks=64, aging_tokens_per_s=2.0))
    policy.record_rate_history = True
    overrun = req("overrun", predicted=40, predicted_p50=40, predicted_p90=120)
    policy.on_step([overrun], [], 0.0, step_time_s=None)
    assert policy.aging_bound_s(overrun) == pytest.approx(20.0)
    overrun.output_token_ids = [1] * 100
    remaining = refined_remaining(overrun)
    assert remaining > 40
    policy.on_step([overrun], [], 50.0, step_time_s=None)
    assert policy.aging_bound_s(overrun) == pytest.approx(remaining / 2.0)
    # The order agrees: an arrival just inside that bound still overtakes it, one past it does not.
    inside = req("inside", arrival=remaining / 2.0 - 1.0, predicted=1)
    past = req("past", arrival=remaining / 2.0 + 1.0, predicted=1)
    now = remaining / 2.0 + 1.0
    assert policy.sort_key(inside, now) < policy.sort_key(overrun, now) < policy.sort_key(past, now)
    # Seen fresh (as the simulator rebuilds it to read bounds), it keeps the recorded length.
    fresh = req("overrun", predicted=40, predicted_p50=40, predicted_p90=120)
    assert policy.aging_bound_s(fresh) == pytest.approx(remaining / 2.0)


def test_goodput_puts_an_urgent_request_before_a_short_one_that_can_wait() -> None:
    config = SchedulerConfig(num_gpu_blocks=64, slo_e2e_standard_s=10.0, goodput_step_time_s=0.05,
                             goodput_urgent_slack_s=2.0, aging_tokens_per_s=0.0)
    policy = GoodputPolicy(config)
    urgent = req("urgent", arrival=0.0, predicted=40)  # at t=6: slack 10 - 6 - 2 = 2 s
    relaxed = req("relaxed", arrival=5.0, predicted=10)  # slack 15 - 6 - 0.5 = 8.5 s
    hopeless = req("hopeless", arrival=-10.0, predicted=5)  # deadline already past
    ranked = sorted([relaxed, hopeless, urgent], key=lambda r: policy.sort_key(r, 6.0))
    assert [r.request_id for r in ranked] == ["urgent", "relaxed", "hopeless"]
    assert order("sjf", [relaxed, urgent], now=6.0, aging_tokens_per_s=0.0) == ["relaxed", "urgent"]


def test_goodput_lets_a_late_request_past_savable_ones_once_it_has_waited_its_aging_bound() -> None:
    # Past saving, it yields to requests that can still make their SLO, but only for as long as
    # aging allows: after length / rate seconds (50 tokens at 10 tokens/s) it goes before them.
    config = SchedulerConfig(num_gpu_blocks=64, slo_e2e_standard_s=10.0, goodput_step_time_s=0.05,
                             goodput_urgent_slack_s=2.0, aging_tokens_per_s=10.0)
    policy = GoodputPolicy(config)
    late = req("late", arrival=0.0, predicted=50)  # deadline 10 s
    fresh = req("fresh", arrival=20.0, predicted=10)  # slack 10 - 0.5 = 9.5 s: can wait
    ranked = sorted([fresh, late], key=lambda r: policy.sort_key(r, 20.0))
    assert [r.request_id for r in ranked] == ["late", "fresh"]  # waited 20 s > its 5 s bound
    early = sorted([req("fresh", arrival=4.0, predicted=10), req("late2", arrival=-8.0, predicted=150)],
                   key=lambda r: policy.sort_key(r, 4.0))
    assert [r.request_id for r in early] == ["fresh", "late2"]  # 12 s of its 15 s bound: still last


def test_goodput_costs_an_interactive_request_its_prefill_steps() -> None:
    # TTFT SLO 0.5 s, 0.05 s per step, 64 tokens a step. A 640-token prompt needs 10 prefill steps
    # (0.5 s): at t=0.1 it can no longer make its deadline, while a 4-token prompt has 0.35 s of
    # slack and is urgent. Costing both as one token would call the long one urgent too.
    config = SchedulerConfig(num_gpu_blocks=64, max_num_batched_tokens=64, max_model_len=2048,
                             slo_ttft_interactive_s=0.5, goodput_step_time_s=0.05, goodput_urgent_slack_s=2.0)
    policy = GoodputPolicy(config)
    long_prompt = req("long", tier=Tier.INTERACTIVE, prompt_len=640, predicted=5)
    short_prompt = req("short", tier=Tier.INTERACTIVE, prompt_len=4, predicted=50)
    assert policy.sort_key(short_prompt, 0.1)[1] == 0  # urgent
    assert policy.sort_key(long_prompt, 0.1)[1] == 2  # past saving: ranked by length after the urgent


def test_make_policy_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lottery", CONFIG)
    assert req("x", max_tokens=30).predicted_total == 30


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_interactive_preempts_batch_and_batch_resumes_with_every_token(mode: str) -> None:
    config = SchedulerConfig(num_gpu_blocks=12, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                             max_model_len=64, policy="sjf", preemption_mode=mode,
                             num_cpu_blocks=32 if mode == "swap" else 0)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(12, 4, 32)
    batch = [req(f"b{i}", float(i), predicted=20, tier=Tier.BATCH, prompt_len=6, max_tokens=20) for i in range(2)]
    for request in batch:
        scheduler.add_request(request)
    interactive = req("i0", 5.0, predicted=5, tier=Tier.INTERACTIVE, prompt_len=5, max_tokens=6)
    resumed_at = None
    for step in range(200):
        if step == 5:
            scheduler.add_request(interactive)
        output = scheduler.schedule(float(step))
        if step == 5:  # both seats held by batch work: the newer batch request gives way at once
            assert "b1" in output.preempted_ids and "i0" in {c.request_id for c in output.chunks}
        if step > 5 and resumed_at is None and "b1" in {c.request_id for c in output.chunks}:
            resumed_at = step
        scheduler.update_from_output(output, runner.execute(output), float(step))
        if not scheduler.has_unfinished_requests():
            break
    for request in batch + [interactive]:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == reference_output(request.prompt_token_ids,
                                                            request.sampling_params.max_tokens)
    assert batch[1].num_preemptions >= 1 and interactive.num_preemptions == 0
    assert interactive.finish_time < batch[1].finish_time
    # Preempted once: its second wait runs from the preempting step to its return.
    assert batch[1].num_preemptions == 1
    assert batch[1].requeued_wait_s == pytest.approx(resumed_at - 5) and resumed_at > 6


def test_measured_aging_rate_is_tokens_per_step_over_step_time() -> None:
    # By default the rate is measured (aging_tokens_per_s None). Unmeasured it is 0 (pure SJF);
    # measured 0.5 s steps at one token per step give 2 tokens/s, so the long request (100
    # tokens) is overtaken by no arrival later than 50 s after it.
    assert SchedulerConfig(num_gpu_blocks=8).aging_tokens_per_s is None
    assert starved_request_start(aging=None) is None
    started = starved_request_start(aging=None, measure_steps=True)
    assert started is not None and 40.0 <= started <= 50.0 + 2.0
    policy = make_policy("sjf", SchedulerConfig(num_gpu_blocks=64, aging_tokens_per_step=1.0))
    policy.record_rate_history = True
    policy.on_step([], [], 0.0, step_time_s=0.25)
    waiting = req("x", predicted=100, predicted_p50=100)
    assert policy.aging_bound_s(waiting) == pytest.approx(25.0)
    # The bound holds at the slowest rate in force while anyone waited: 1 s steps, then faster ones.
    policy.on_step([waiting], [], 1.0, step_time_s=1.0)
    policy.on_step([waiting], [], 2.0, step_time_s=0.1)
    assert policy.aging_rate == pytest.approx(10.0) and policy.aging_bound_s(waiting) == pytest.approx(100.0)
    # Its own bound reads only the steps it waited through: seated at 1.5 s it saw only the 1 s
    # steps' rate (1 token/s); one that arrived at 1.5 s saw only the 10 tokens/s of the next.
    assert policy.aging_bound_s(waiting, waited_until=1.5) == pytest.approx(100.0)
    later = req("y", arrival=1.5, predicted=100, predicted_p50=100)
    assert policy.aging_bound_s(later, waited_until=2.5) == pytest.approx(10.0)
    # A server keeps no history (it would grow without end): the whole run's slowest rate.
    policy.record_rate_history = False
    policy.on_step([later], [], 3.0, step_time_s=0.1)
    assert len(policy._rates) == 2 and policy.aging_bound_s(later, waited_until=2.5) == pytest.approx(100.0)


def test_sjf_ranks_by_the_ranking_length_not_point_or_median() -> None:
    # The ranking length is the head that ranked validation best; a median at the max_tokens cap
    # for every prompt must not stop the order, and the point estimate only feeds token budgets.
    a = req("a", predicted=10, predicted_p50=256, predicted_rank_len=120)
    b = req("b", predicted=100, predicted_p50=256, predicted_rank_len=30)
    assert order("sjf", [a, b], aging_tokens_per_s=0.0) == ["b", "a"]
    assert order("srpt", [a, b], aging_tokens_per_s=0.0) == ["b", "a"]
    assert order("sjf", [req("c", predicted=10), req("d", predicted=100)], aging_tokens_per_s=0.0) == ["c", "d"]


def config_with_preemption(mode: str, num_gpu_blocks: int, **kwargs) -> SchedulerConfig:
    """Blocks of 4, a 64-token context, and a host pool twice the cache when `mode` is swap."""
    return SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=4, max_model_len=64, preemption_mode=mode,
                           num_cpu_blocks=2 * num_gpu_blocks if mode == "swap" else 0, **kwargs)


def assert_every_token(requests: list[Request]) -> None:
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.sampling_params.max_tokens)


def assert_within_step_limits(scheduler: Scheduler, output) -> None:
    """The token budget and the seat limit hold on every path (urgent admission, swap-in included)."""
    config = scheduler.config
    assert output.num_batched_tokens == sum(len(c.token_ids) for c in output.chunks) <= config.max_num_batched_tokens
    assert len(output.chunks) <= config.max_num_seqs and len(scheduler.running) <= config.max_num_seqs
    assert not (output.preempted_ids and output.swap_in)  # a step that preempted swaps nothing in


def random_arrivals(rng: random.Random) -> tuple[list[Request], dict[int, list[Request]]]:
    """Twelve requests of random tiers, priorities, predictions and sizes, arriving at random steps,
    some steps bringing several (so one step can admit two urgent requests)."""
    steps = sorted(rng.randrange(24) for _ in range(12))
    requests = [req(f"r{i}", float(step), predicted=rng.randint(2, 30), tier=rng.choice(list(Tier)),
                    priority=rng.randint(0, 3), prompt_len=rng.randint(2, 20), max_tokens=rng.randint(2, 30))
                for i, step in enumerate(steps)]
    arrivals: dict[int, list[Request]] = {}
    for step, request in zip(steps, requests):
        arrivals.setdefault(step, []).append(request)
    return requests, arrivals


def add_arrivals(scheduler: Scheduler, arrivals: dict[int, list[Request]], step: int) -> None:
    for request in arrivals.get(step, ()):
        scheduler.add_request(request)


def run_with_arrivals(scheduler: Scheduler, arrivals: dict[int, list[Request]], steps: int = 300,
                      on_step=None) -> None:
    """Step to the end with the paged reference runner; `on_step(step, output)` sees each step."""
    config = scheduler.config
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks)
    for step in range(steps):
        add_arrivals(scheduler, arrivals, step)
        output = scheduler.schedule(float(step))
        assert_within_step_limits(scheduler, output)
        if on_step is not None:
            on_step(step, output)
        scheduler.update_from_output(output, runner.execute(output), float(step))
        scheduler.block_manager.check_integrity()
        if step > max(arrivals) and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == config.num_gpu_blocks


def tokens_fed_to(scheduler: Scheduler, arrivals: dict[int, list[Request]], request_id: str) -> int:
    """Run to the end (run_with_arrivals); the tokens fed to one request over the run."""
    fed = []
    run_with_arrivals(scheduler, arrivals, on_step=lambda step, output: fed.extend(
        len(c.token_ids) for c in output.chunks if c.request_id == request_id))
    return sum(fed)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_interactive_prefill_short_of_blocks_preempts_batch_decodes_not_itself(mode: str) -> None:
    # 8 blocks of 4. The batch request decodes in 5 blocks; the interactive one is admitted with
    # a first chunk of 7 tokens, and its second chunk needs 2 more blocks when 1 is free. Batch
    # decodes are scheduled before prefill chunks within a tier, but a tier orders first: the
    # interactive chunk comes first and takes its blocks from the batch request.
    scheduler = Scheduler(config_with_preemption(mode, 8, max_num_seqs=2, max_num_batched_tokens=8, kv_watermark=0.0))
    batch = req("b", 0.0, predicted=20, tier=Tier.BATCH, prompt_len=16, max_tokens=12)
    interactive = req("i", 3.0, predicted=4, tier=Tier.INTERACTIVE, prompt_len=20, max_tokens=4)
    run_with_arrivals(scheduler, {0: [batch], 3: [interactive]})
    assert interactive.num_preemptions == 0 and batch.num_preemptions >= 1
    assert_every_token([batch, interactive])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tier_preemption_frees_enough_for_the_watermark_or_preempts_nobody(mode: str) -> None:
    # New work is admitted only while a quarter of the cache (5 of 20 blocks) stays free. Room
    # made for an interactive request must count that reserve and the survivors' next decode
    # blocks; otherwise a batch request is preempted and the interactive one still waits.
    scheduler = Scheduler(config_with_preemption(mode, 20, max_num_seqs=8, max_num_batched_tokens=64,
                                                 kv_watermark=0.25))
    runner = PagedTokenRunner(20, 4, 40)
    batch = [req(f"b{i}", float(i), predicted=30, tier=Tier.BATCH, prompt_len=12, max_tokens=14) for i in range(4)]
    for request in batch:
        scheduler.add_request(request)
    interactive = req("i", 100.0, predicted=4, tier=Tier.INTERACTIVE, prompt_len=4, max_tokens=4)
    added = False
    for step in range(300):
        if not added and scheduler.block_manager.num_free_blocks <= 1:  # the cache is full
            scheduler.add_request(interactive)
            added = True
        output = scheduler.schedule(float(step))
        if output.preempted_ids and interactive.first_scheduled_time is None:
            assert "i" in {c.request_id for c in output.chunks}, f"step {step}: preempted {output.preempted_ids} for nothing"
        scheduler.update_from_output(output, runner.execute(output), float(step))
        if not scheduler.has_unfinished_requests():
            break
    assert interactive.num_preemptions == 0 and sum(b.num_preemptions for b in batch) >= 1
    assert_every_token(batch + [interactive])
    assert scheduler.block_manager.num_free_blocks == 20


def test_a_swapped_batch_request_does_not_come_back_ahead_of_a_waiting_interactive_one() -> None:
    # One seat. i1 swaps b0 out; i2 arrives while i1 runs. When i1 ends, i2 ranks before b0 and
    # takes the seat; b0 swapping back in first would only be swapped out again.
    scheduler = Scheduler(config_with_preemption("swap", 16, max_num_seqs=1, max_num_batched_tokens=32))
    b0 = req("b0", 0.0, tier=Tier.BATCH, prompt_len=8, max_tokens=10)
    i1 = req("i1", 2.0, tier=Tier.INTERACTIVE, prompt_len=4, max_tokens=5)
    i2 = req("i2", 3.0, tier=Tier.INTERACTIVE, prompt_len=4, max_tokens=5)
    run_with_arrivals(scheduler, {0: [b0], 2: [i1], 3: [i2]})
    assert b0.num_preemptions == 1 and i1.num_preemptions == 0 and i2.num_preemptions == 0
    assert i2.finish_time < b0.finish_time
    assert_every_token([b0, i1, i2])


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf", "srpt", "goodput"])
def test_a_swapped_request_keeps_its_place_and_never_waits_behind_lower_tier_work(policy: str) -> None:
    # Victims are taken lowest tier first, and nothing ranked after a swapped request is admitted
    # (not even as urgent) or swapped in before it, so a swapped request never needs tier
    # preemption on its behalf:
    # every running request is of its tier or a more urgent one. Random tiers, lengths and arrivals
    # on a cache a third the size of the work.
    steps_with_both = 0
    for seed in range(40):
        rng = random.Random(seed)
        scheduler = Scheduler(config_with_preemption("swap", 24, max_num_seqs=6, max_num_batched_tokens=16,
                                                     kv_watermark=0.0, policy=policy,
                                                     aging_tokens_per_s=rng.choice([None, 5.0])))
        runner = PagedTokenRunner(24, 4, 48)
        requests, arrivals = random_arrivals(rng)
        for step in range(2000):
            add_arrivals(scheduler, arrivals, step)
            waiting_before, swapped_before = {r.request_id for r in scheduler.waiting}, list(scheduler.swapped)
            output = scheduler.schedule(float(step))
            assert_within_step_limits(scheduler, output)
            keys_out = [scheduler.policy.sort_key(r, float(step)) for r in swapped_before if r in scheduler.swapped]
            for chunk in output.chunks:  # nobody ranked after a request still swapped out is admitted
                if chunk.request_id in waiting_before and keys_out:
                    admitted = scheduler.get_request(chunk.request_id)
                    assert scheduler.policy.sort_key(admitted, float(step)) < min(keys_out), (seed, step)
            scheduler.update_from_output(output, runner.execute(output), float(step))
            least_urgent_running = max((r.tier for r in scheduler.running), default=Tier.INTERACTIVE)
            assert all(least_urgent_running <= s.tier for s in scheduler.swapped), (seed, step)
            steps_with_both += bool(scheduler.swapped and scheduler.running)
            if step > max(arrivals) and not scheduler.has_unfinished_requests():
                break
        assert_every_token(requests)
    assert steps_with_both > 100  # the property was exercised, not vacuous


def test_a_recompute_victim_is_not_overtaken_in_the_step_that_preempted_it() -> None:
    # Batch b1 gives its blocks to interactive i; batch b2, which arrived after b1, must not take
    # the room left over in that step (before, it did: b1 was appended behind it to the queue).
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                          kv_watermark=0.0, max_model_len=256))
    b1 = req("b1", 0.0, tier=Tier.BATCH, prompt_len=40, max_tokens=20)
    i = req("i", 1.0, tier=Tier.INTERACTIVE, prompt_len=44, max_tokens=4)
    b2 = req("b2", 1.5, tier=Tier.BATCH, prompt_len=4, max_tokens=20)
    runner = PagedTokenRunner(20, 4, 0)
    scheduler.add_request(b1)
    scheduler.update_from_output(output := scheduler.schedule(0.0), runner.execute(output), 0.0)
    scheduler.add_request(i)
    scheduler.add_request(b2)
    output = scheduler.schedule(1.0)
    assert output.preempted_ids == ("b1",) and [c.request_id for c in output.chunks] == ["i"]


def test_an_urgent_admission_does_not_let_in_a_request_ranked_after_its_victim() -> None:
    # srpt: u1 preempts v; u2, ranked after v, must not then be admitted as urgent in that step
    # (before, the limit was taken once, before any victim was preempted).
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_model_len=256, max_num_seqs=8,
                                          max_num_batched_tokens=256, kv_watermark=0.0, policy="srpt",
                                          aging_tokens_per_s=1.0))
    runner = PagedTokenRunner(64, 4, 0)
    v = req("v", 50.0, predicted=90.0, prompt_len=160, max_tokens=95)
    r = req("r", 180.0, predicted=62.0, prompt_len=40, max_tokens=100)
    for now, request in ((150.0, v), (180.0, r)):
        scheduler.add_request(request, now=now)
        scheduler.update_from_output(output := scheduler.schedule(now), runner.execute(output), now)
    u1, u2 = req("u1", 100.0, predicted=20.0, prompt_len=60, max_tokens=20), req("u2", 200.0, predicted=10.0,
                                                                                     prompt_len=4, max_tokens=10)
    scheduler.add_request(u1, now=199.0)
    scheduler.add_request(u2, now=200.0)
    key = scheduler.policy.sort_key
    assert key(u1, 200.0) < key(v, 200.0) < key(u2, 200.0)
    output = scheduler.schedule(200.0)
    assert output.preempted_ids == ("v",) and "u2" not in [c.request_id for c in output.chunks]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf", "srpt", "goodput"])
def test_nobody_ranked_after_a_request_preempted_in_a_step_is_admitted_in_it(policy: str) -> None:
    preempting_steps = 0
    for seed in range(30):
        rng = random.Random(seed)
        scheduler = Scheduler(config_with_preemption("recompute", 20, max_num_seqs=6, max_num_batched_tokens=24,
                                                     kv_watermark=0.0, policy=policy))
        runner = PagedTokenRunner(20, 4, 0)
        requests, arrivals = random_arrivals(rng)
        for step in range(2000):
            add_arrivals(scheduler, arrivals, step)
            waiting_before = {r.request_id for r in scheduler.waiting}
            output = scheduler.schedule(float(step))
            victims = [scheduler.get_request(r) for r in output.preempted_ids]
            if victims:
                preempting_steps += 1
                worst_admissible = min(scheduler.policy.sort_key(v, float(step)) for v in victims)
                for chunk in output.chunks:
                    if chunk.request_id in waiting_before:
                        admitted = scheduler.get_request(chunk.request_id)
                        assert scheduler.policy.sort_key(admitted, float(step)) < worst_admissible, (seed, step)
            scheduler.update_from_output(output, runner.execute(output), float(step))
            if step > max(arrivals) and not scheduler.has_unfinished_requests():
                break
        assert_every_token(requests)
    assert preempting_steps > 20  # the property was exercised, not vacuous


@pytest.mark.parametrize("num_gpu_blocks", [10, 14])
def test_an_urgent_request_is_admitted_before_running_batch_prefill_chunks(num_gpu_blocks: int) -> None:
    # Two batch requests hold the cache, one still in a long prefill. The interactive arrival is
    # admitted in its first step: the batch prefill chunk must not take the budget and blocks
    # first (before, it waited three steps, and with 10 blocks a batch request was preempted
    # for it and the other batch request's prefill took the room).
    config = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=16, max_num_batched_tokens=32,
                             max_model_len=512, max_num_seqs=8, policy="priority")
    scheduler = Scheduler(config)
    b2 = req("b2", 0.0, tier=Tier.BATCH, priority=5, prompt_len=57, max_tokens=100)
    b1 = req("b1", 2.0, tier=Tier.BATCH, priority=0, prompt_len=137, max_tokens=20)
    urgent = req("i", 4.0, tier=Tier.INTERACTIVE, prompt_len=37, max_tokens=5)
    runner = PagedTokenRunner(num_gpu_blocks, 16)
    arrivals = {0: b2, 2: b1, 4: urgent}
    for step in range(400):
        if step in arrivals:
            scheduler.add_request(arrivals[step])
        output = scheduler.schedule(float(step))
        if step == 4:
            assert "i" in {c.request_id for c in output.chunks}
        scheduler.update_from_output(output, runner.execute(output), float(step))
        scheduler.block_manager.check_integrity()
        if not scheduler.has_unfinished_requests():
            break
    assert urgent.num_preemptions == 0
    assert_every_token([b1, b2, urgent])
    assert scheduler.block_manager.num_free_blocks == num_gpu_blocks


@pytest.mark.parametrize("seats, arrivals", [
    (3, [(0, 1, 11, 17), (2, 10, 9, 16), (7, 40, 11, 26), (8, 20, 12, 32), (10, 40, 7, 25), (13, 5, 6, 36),
         (14, 5, 2, 40), (16, 1, 3, 26)]),
    (2, [(3, 5, 7, 31), (6, 40, 2, 39), (11, 1, 8, 21), (13, 5, 7, 20), (15, 1, 7, 8), (18, 40, 4, 40),
         (19, 40, 3, 18)]),
])
def test_srpt_never_preempts_a_request_admitted_in_the_same_step(seats: int, arrivals: list) -> None:
    # (step, predicted, prompt, max_tokens). With strong aging a long-waiting request ranks first
    # and is admitted by preempting running work; a shorter waiting request after it may preempt
    # too, but not the request whose grant is already in this step's plan: its chunk had no blocks
    # (these two workloads hit that before the fix).
    scheduler = Scheduler(config_with_preemption("recompute", 32, max_num_seqs=seats, max_num_batched_tokens=32,
                                                 kv_watermark=0.0, policy="srpt", aging_tokens_per_s=5.0))
    requests = {step: req(f"r{i}", float(step), predicted=predicted, prompt_len=prompt, max_tokens=max_tokens)
                for i, (step, predicted, prompt, max_tokens) in enumerate(arrivals)}
    run_with_arrivals(scheduler, {step: [request] for step, request in requests.items()}, steps=2000)
    assert_every_token(list(requests.values()))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seats, blocks, victims, chunks", [
    (2, 16, ["b0", "b1"], ["i0", "i1"]),  # seats bind: each urgent request takes one victim's seat
    (4, 11, ["b1"], ["b0", "i0", "i1"]),  # blocks bind: 7 free fit the first (4), not both (8)
])
def test_two_urgent_arrivals_in_one_step_are_admitted_with_the_room_left_by_the_first(
        mode: str, seats: int, blocks: int, victims: list[str], chunks: list[str]) -> None:
    # Two batch requests decode; two interactive requests arrive in the same step. The second
    # urgent admission relies on the seats, blocks and budget left after the first: it must
    # neither overfill the step nor be left waiting for room it was counted.
    scheduler = Scheduler(config_with_preemption(mode, blocks, max_num_seqs=seats, max_num_batched_tokens=32,
                                                 kv_watermark=0.0, policy="sjf"))
    runner = PagedTokenRunner(blocks, 4, scheduler.config.num_cpu_blocks)
    batch = [req(f"b{i}", float(i), predicted=20, tier=Tier.BATCH, prompt_len=6, max_tokens=20) for i in range(2)]
    urgent = [req(f"i{i}", 3.0, predicted=4, tier=Tier.INTERACTIVE, prompt_len=14, max_tokens=4) for i in range(2)]
    for step in range(200):
        add_arrivals(scheduler, {0: batch, 3: urgent}, step)
        output = scheduler.schedule(float(step))
        assert_within_step_limits(scheduler, output)
        if step == 3:
            assert sorted(output.preempted_ids) == victims
            assert sorted(c.request_id for c in output.chunks) == chunks
        scheduler.update_from_output(output, runner.execute(output), float(step))
        scheduler.block_manager.check_integrity()
        if not scheduler.has_unfinished_requests():
            break
    assert_every_token(batch + urgent)
    assert scheduler.block_manager.num_free_blocks == blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_urgent_arrivals_reserve_the_next_chunk_of_a_prefill_ranked_ahead_once_not_once_each(mode: str) -> None:
    # Four batch decodes hold 5 blocks each, an interactive prompt (i0) is mid-prefill with 15
    # and needs 9 more for its next chunk; 3 are free when two 8-token interactive requests come.
    # They need 2 + 2 blocks beside i0's 9: three victims make room. Reserving i0's chunk again
    # for the second newcomer preempted the fourth for blocks nobody took.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=38, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                          max_model_len=256, kv_watermark=0.0, preemption_mode=mode,
                                          num_cpu_blocks=64 if mode == "swap" else 0))
    batch = [req(f"b{i}", 0.0, tier=Tier.BATCH, prompt_len=16, max_tokens=20) for i in range(4)]
    first = req("i0", 1.0, tier=Tier.INTERACTIVE, prompt_len=100, max_tokens=4)
    urgent = [req(f"w{i}", 2.0, tier=Tier.INTERACTIVE, prompt_len=8, max_tokens=20) for i in range(2)]

    def at_step_2(step, output):
        if step == 2:
            assert len(output.preempted_ids) == 3 and scheduler.block_manager.num_free_blocks < 5
            assert {"w0", "w1", "i0"} <= {c.request_id for c in output.chunks}

    run_with_arrivals(scheduler, {0: batch, 1: [first], 2: urgent}, on_step=at_step_2)
    assert_every_token(batch + [first] + urgent)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("num_gpu_blocks, prompt_len", [(15, 35), (16, 38), (18, 47)])
def test_a_prefill_that_nothing_fits_keeps_its_blocks_when_nobody_queued_ranks_before_it(
        mode: str, num_gpu_blocks: int, prompt_len: int) -> None:
    # sjf: a long decode (d) runs, a short reply with a long prompt (r) ranks first. Decodes go
    # first, so r's chunk finds its blocks short, and r is its own only victim with nobody queued
    # before it. Giving way, it threw its prefill away for nothing (4 times, 104 tokens fed for a
    # 30-token prompt, until a chunk took what the free blocks held); with none free it still
    # did: the blocks fed d, ranked after it, and r was admitted again into the same shortage
    # (six times, 168 tokens fed for 35).
    scheduler = Scheduler(config_with_preemption(mode, num_gpu_blocks, max_num_seqs=4, max_num_batched_tokens=8,
                                                 policy="sjf", aging_tokens_per_s=0.0))
    d = req("d", 0.0, predicted=30, prompt_len=20, max_tokens=30)
    r = req("r", 1.0, predicted=2, prompt_len=prompt_len, max_tokens=2)
    fed = tokens_fed_to(scheduler, {0: [d], 1: [r]}, "r")
    assert_every_token([d, r])
    assert r.num_preemptions == 0 and fed == prompt_len + 1  # its prompt once, and its second token's feed
    assert r.finish_time < d.finish_time  # ranked first, it finishes first


@pytest.mark.parametrize("num_gpu_blocks, prompt_len", [(13, 40), (15, 48), (18, 56)])
def test_a_recompute_victim_comes_back_only_when_its_whole_prefill_leaves_the_reserve(
        num_gpu_blocks: int, prompt_len: int) -> None:
    # fcfs: d decodes, p's long prompt is admitted on its first chunk, its later chunks take the
    # reserve, and d's next block preempts it. Readmitted on its first chunk again, it was
    # preempted again at each of d's block boundaries (a 48-token prompt was fed 217 tokens over
    # four preemptions). Now it waits until its whole prefill leaves the reserve.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=4, max_num_seqs=4,
                                          max_num_batched_tokens=16, max_model_len=128))
    d = req("d", 0.0, prompt_len=8, max_tokens=20)
    p = req("p", 1.0, prompt_len=prompt_len, max_tokens=2)
    fed = tokens_fed_to(scheduler, {0: [d], 1: [p]}, "p")
    assert_every_token([d, p])
    assert p.num_preemptions <= 1 and fed <= 2 * prompt_len + 2  # 3-4 preemptions before


def test_a_swapped_request_comes_back_beside_a_better_ranked_arrival_when_room_is_left() -> None:
    # Swap, four seats: batch s is swapped out for interactive i. From step 3 a one-token
    # standard request arrives every step: it ranks before s and is admitted, and s, which fits
    # beside it, lost the whole step to it (out for all ten steps with a seat, 58 of 64 tokens
    # and 55 blocks left each time). Now it comes back at once, after the arrival.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=128, preemption_mode="swap", num_cpu_blocks=64))
    s = req("s", 0.0, tier=Tier.BATCH, prompt_len=8, max_tokens=30)
    running = [req("x1", 0.1, tier=Tier.INTERACTIVE, max_tokens=3), req("x2", 0.2, tier=Tier.INTERACTIVE, max_tokens=40),
               req("x3", 0.3, tier=Tier.INTERACTIVE, max_tokens=3)]
    i = req("i", 1.0, tier=Tier.INTERACTIVE, max_tokens=40)
    arrivals = [req(f"w{k}", float(k), max_tokens=1) for k in range(3, 13)]
    schedule = {0: [s, *running], 1: [i], **{w_step: [w] for w_step, w in zip(range(3, 13), arrivals)}}
    back_at = []

    def note_its_return(step, output):
        if s.num_preemptions and "s" in {c.request_id for c in output.chunks}:
            back_at.append(step)

    run_with_arrivals(scheduler, schedule, on_step=note_its_return)
    assert s.num_preemptions == 1 and back_at[0] == 3  # in the first step that left it room
    assert_every_token([s, *running, i, *arrivals])
    assert scheduler.block_manager.host.num_free == 64


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_urgent_chunk_takes_the_decode_token_its_victim_gives_back(mode: str) -> None:
    # One seat: interactive i preempts batch b for it. Sized before b was chosen, i's chunk left
    # b's decode token unused (15 of 16), and its 32-token prompt took three steps.
    scheduler = Scheduler(config_with_preemption(mode, 64, max_num_seqs=1, max_num_batched_tokens=16))
    b = req("b", 0.0, tier=Tier.BATCH, prompt_len=4, max_tokens=20)
    i = req("i", 1.0, tier=Tier.INTERACTIVE, prompt_len=32, max_tokens=2)

    def at_step_1(step, output):
        if step == 1:
            assert list(output.preempted_ids) == ["b"]
            assert [(c.request_id, len(c.token_ids)) for c in output.chunks] == [("i", 16)]

    run_with_arrivals(scheduler, {0: [b], 1: [i]}, on_step=at_step_1)
    assert i.first_token_time == 2.0  # two steps of 16 for its prompt
    assert_every_token([b, i])


@pytest.mark.parametrize("num_gpu_blocks, batch_prompt, batch_out, first_prompt, later_prompt, later_steps", [
    (200, 10, 500, 300, 200, range(2, 6)),  # room enough: each newcomer took i1's budget
    (16, 60, 100, 200, 60, [4]),  # blocks short: a newcomer's room made i1 preempt itself
])
def test_an_urgent_arrival_never_takes_the_chunk_of_an_earlier_running_request_of_its_tier(
        num_gpu_blocks: int, batch_prompt: int, batch_out: int, first_prompt: int, later_prompt: int,
        later_steps) -> None:
    # A batch request decodes while an interactive one (i1) is mid-prefill, and more interactive
    # requests arrive. Each may preempt the batch request, but not push i1 aside: before, each
    # newcomer was admitted first and i1 got 2-5 tokens a step (200 blocks), or lost its 191
    # computed tokens to a self-preemption (16 blocks).
    config = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=16, max_num_batched_tokens=64,
                             max_model_len=1024 if num_gpu_blocks == 200 else 256, max_num_seqs=8,
                             kv_watermark=0.0)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(num_gpu_blocks, 16)
    batch = req("b", 0.0, tier=Tier.BATCH, prompt_len=batch_prompt, max_tokens=batch_out)
    first = req("i1", 1.0, tier=Tier.INTERACTIVE, prompt_len=first_prompt, max_tokens=5)
    later = [req(f"i{k}", float(k), tier=Tier.INTERACTIVE, prompt_len=later_prompt, max_tokens=5) for k in later_steps]
    arrivals = {0: [batch], 1: [first], **{k: [r] for k, r in zip(later_steps, later)}}
    for step in range(2000):
        add_arrivals(scheduler, arrivals, step)
        computed_before = first.num_computed_tokens
        output = scheduler.schedule(float(step))
        chunks = {c.request_id: len(c.token_ids) for c in output.chunks}
        if step > 1 and computed_before < first.num_prompt_tokens:
            # Its prefill keeps a whole step's budget but at most the batch decode's token.
            assert chunks.get("i1", 0) >= min(63, first.num_prompt_tokens - computed_before), (step, chunks)
        scheduler.update_from_output(output, runner.execute(output), float(step))
        scheduler.block_manager.check_integrity()
        if step > max(arrivals) and not scheduler.has_unfinished_requests():
            break
    assert first.num_preemptions == 0
    assert_every_token([batch, first, *later])
    assert scheduler.block_manager.num_free_blocks == num_gpu_blocks


@pytest.mark.parametrize("policy, blocks, running, urgent_step, urgent, spared, chunk", [
    # A standard prefill 32 of 40 tokens in; an interactive arrival fits the 3 free blocks with
    # no victim. The prefill took its whole 8-token chunk after it, found no block and preempted
    # itself, losing its 32 computed tokens.
    ("fcfs", 11, [(0, "a", Tier.STANDARD, 0, 40, 3)], 2, ("b", Tier.INTERACTIVE, 0, 8), "a", ("a", 4)),
    # An interactive prefill (priority 5) ranked after the arrival (priority 0) took the block
    # left to a standard decode, which it then preempted. (Its chunks before leave the decode its
    # token: 30 of its 40 tokens are in, and its 8 blocks and the one free hold 6 more.)
    ("priority", 13, [(0, "d", Tier.STANDARD, 0, 4, 20), (1, "p", Tier.INTERACTIVE, 5, 40, 1)], 3,
     ("u", Tier.INTERACTIVE, 0, 8), "d", ("p", 6)),
    # The same, with the standard decode due a new block in the urgent step: the prefill leaves it
    # that block (and so the budget for its token) rather than take 8 tokens and drop the decode.
    ("priority", 10, [(0, "d", Tier.STANDARD, 0, 7, 20), (1, "p", Tier.INTERACTIVE, 5, 40, 1)], 2,
     ("u", Tier.INTERACTIVE, 0, 8), "d", ("p", 5)),
])
def test_a_running_prefill_ranked_after_an_urgent_admission_takes_what_is_free_and_preempts_nobody(
        policy, blocks, running, urgent_step, urgent, spared, chunk) -> None:
    # The urgent admission counts one token of growth for each running request ranked after it.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=blocks, block_size=4, max_num_seqs=4,
                                          max_num_batched_tokens=16, max_model_len=64, kv_watermark=0.0,
                                          policy=policy))
    runner = PagedTokenRunner(blocks, 4)
    requests = [req(name, float(step), tier=tier, priority=priority, prompt_len=prompt, max_tokens=out)
                for step, name, tier, priority, prompt, out in running]
    name, tier, priority, prompt = urgent
    requests.append(req(name, float(urgent_step), tier=tier, priority=priority, prompt_len=prompt, max_tokens=2))
    arrivals = {int(r.arrival_time): [r] for r in requests}
    for step in range(200):
        add_arrivals(scheduler, arrivals, step)
        computed_before = scheduler.get_request(spared).num_computed_tokens if step == urgent_step else None
        output = scheduler.schedule(float(step))
        if step == urgent_step:
            chunks = {c.request_id: len(c.token_ids) for c in output.chunks}
            assert output.preempted_ids == () and chunks[name] == prompt and chunks[chunk[0]] == chunk[1], chunks
            assert scheduler.get_request(spared).num_computed_tokens >= computed_before > 0
        scheduler.update_from_output(output, runner.execute(output), float(step))
        scheduler.block_manager.check_integrity()
        if step > urgent_step and not scheduler.has_unfinished_requests():
            break
    assert_every_token(requests)  # later steps may preempt (the cache is tight): every token still right
    assert scheduler.block_manager.num_free_blocks == blocks


# SRPT's refinement and goodput's groups at their edges (each test kills a mutant of
# scheduler/policies.py that the tests above let through).


def test_refined_at_the_estimate_switches_to_the_tail():
    r = req("a", predicted=50, predicted_p50=50, predicted_p90=150, max_tokens=1000)
    r.output_token_ids = [1] * 50
    assert refined_remaining(r) == pytest.approx(lognormal_tail_mean(50.0, 150.0, 50.0) - 50.0, rel=1e-3)


def test_refined_is_capped_by_max_tokens():
    r = req("a", predicted=50, predicted_p50=50, predicted_p90=150, max_tokens=100)
    r.output_token_ids = [1] * 80
    assert refined_remaining(r) == 20


def test_refined_is_at_least_one_token():
    r = req("a", predicted=50, predicted_p50=50, predicted_p90=150, max_tokens=80)
    r.output_token_ids = [1] * 80  # the cap reached: nothing left but the token that ends it
    assert refined_remaining(r) == 1.0


@pytest.mark.parametrize("p90_over_p50", [1.0, 1.001, 1.13, 1.35, 1.78, 2.2, 4.0])
def test_refined_grows_as_a_request_overruns_its_estimate_whatever_its_predicted_spread(p90_over_p50):
    # A lognormal's expected remaining falls just past its median when its spread is narrow: a
    # request predicted at 200 with p90 / p50 1.35 read 31 tokens left at 800 generated, ahead
    # of a fresh 60-token request, and p90 just above p50 pinned it at 1 token for good.
    r = req("a", predicted=200, predicted_p50=200, predicted_p90=200 * p90_over_p50, max_tokens=100000)
    remaining = []
    for generated in range(200, 5000, 50):
        r.output_token_ids = [1] * generated
        remaining.append(refined_remaining(r))
    assert all(later >= earlier for earlier, later in zip(remaining, remaining[1:]))
    # At least the default spread's, which p90 == p50 (no spread predicted) gets.
    default = lognormal_tail_mean(200.0, 200.0 * math.exp(DEFAULT_LOG_SPREAD * Z90), 200.0) - 200.0
    assert remaining[0] >= default * (1 - 1e-4)


def test_refined_far_in_the_tail_matches_integration():
    r = req("a", predicted=50, predicted_p50=50, predicted_p90=150, max_tokens=100000)
    r.output_token_ids = [1] * 4000  # b ~ 5.1
    assert refined_remaining(r) == pytest.approx(lognormal_tail_mean(50.0, 150.0, 4000.0) - 4000.0, rel=1e-3)


def test_the_tail_ratio_far_out_takes_mills_ratio_and_agrees_with_erfc_where_both_hold():
    from scheduler.policies import _upper_tail_ratio

    exact = math.erfc(29.2 / math.sqrt(2.0)) / math.erfc(30.0 / math.sqrt(2.0))  # erfc still representable
    assert _upper_tail_ratio(29.2, 30.0) == pytest.approx(exact, rel=2e-3)
    assert math.isfinite(_upper_tail_ratio(59.2, 60.0))  # where erfc underflows to 0


def test_refined_centres_on_the_ranking_length_not_the_point():
    a = req("a", predicted=100, predicted_rank_len=30, max_tokens=256)
    a.output_token_ids = [1] * 35
    b = req("b", predicted=30, predicted_rank_len=30, max_tokens=256)
    b.output_token_ids = [1] * 35
    assert refined_remaining(a) == pytest.approx(refined_remaining(b))


def test_ranking_length_is_capped_by_max_tokens():
    assert ranking_length(req("a", predicted_rank_len=500, max_tokens=100)) == 100


def srpt(aging: float) -> SRPTPolicy:
    return SRPTPolicy(SchedulerConfig(num_gpu_blocks=64, srpt_max_preempt_share=0.5, srpt_preempt_ratio=4.0,
                                      aging_tokens_per_s=aging))


def test_srpt_does_not_preempt_a_request_its_wait_ranks_level_or_first():
    running = req("run", arrival=0.0, predicted=50)
    assert not srpt(10.0).should_preempt_for(req("w", arrival=4.0, predicted=10), running, 4.0)  # 10 vs 10
    assert not srpt(10.0).should_preempt_for(req("w", arrival=5.0, predicted=10), running, 5.0)  # 10 vs 0


def test_srpt_needs_strictly_ratio_times_shorter():
    assert not srpt(0.0).should_preempt_for(req("w", predicted=10), req("run", predicted=40), 0.0)


def goodput(**kw) -> GoodputPolicy:
    base = dict(num_gpu_blocks=64, slo_e2e_standard_s=10.0, goodput_step_time_s=0.05, goodput_urgent_slack_s=2.0,
                aging_tokens_per_s=0.0)
    base.update(kw)
    return GoodputPolicy(SchedulerConfig(**base))


def test_goodput_zero_slack_is_urgent():
    assert goodput().sort_key(req("a", arrival=0.0, predicted=40), 8.0)[1] == 0


def test_goodput_a_late_request_joins_at_aged_score_zero():
    p = goodput(slo_e2e_standard_s=1.0, aging_tokens_per_s=10.0)
    assert p.sort_key(req("late", arrival=0.0, predicted=50), 5.0)[1] == 1


def test_goodput_an_interactive_request_past_its_first_token_has_no_deadline():
    p = goodput(slo_ttft_interactive_s=0.5)
    r = req("i", tier=Tier.INTERACTIVE, predicted=50)
    r.first_token_time = 0.2
    assert p.sort_key(r, 10.0)[1] == 1


def test_goodput_rounds_prefill_steps_up():
    p = goodput(max_num_batched_tokens=64, max_model_len=2048, slo_ttft_interactive_s=0.5,
                goodput_urgent_slack_s=0.2)
    r = req("i", tier=Tier.INTERACTIVE, prompt_len=100, predicted=5)
    assert p.sort_key(r, 0.225)[1] == 0


def test_goodput_costs_a_standard_request_its_remaining_tokens():
    r = req("s", arrival=0.0, predicted=40)
    r.output_token_ids = [1] * 30
    assert goodput().sort_key(r, 7.0)[1] == 1


def test_goodput_orders_urgent_requests_by_slack():
    p = goodput()
    tight = req("tight", arrival=0.0, predicted=40)   # at 7.5: slack 0.5, score 40
    loose = req("loose", arrival=0.0, predicted=10)   # at 7.5: slack 2.0, score 10
    assert p.sort_key(tight, 7.5) < p.sort_key(loose, 7.5)


def test_goodput_urgent_interactive_before_one_past_its_first_token():
    p = goodput(slo_ttft_interactive_s=1.6, max_num_batched_tokens=64, max_model_len=2048)
    urgent = req("u", tier=Tier.INTERACTIVE, prompt_len=4, predicted=50)   # slack 1.6-0-0.05 = 1.55
    served = req("s", tier=Tier.INTERACTIVE, predicted=1)
    served.first_token_time = 0.0
    assert p.sort_key(urgent, 0.0) < p.sort_key(served, 0.0)


def test_goodput_prices_steps_at_the_measured_step_time_by_default():
    # 100 tokens to go with 7 s to its deadline: at 0.16 s a step (this CPU) it can no longer make
    # it; a fixed 0.05 s a step called it urgent with 2 s of slack.
    p = GoodputPolicy(SchedulerConfig(num_gpu_blocks=64, slo_e2e_standard_s=10.0, goodput_urgent_slack_s=2.0,
                                      aging_tokens_per_s=0.0))
    r = req("s", arrival=0.0, predicted=100)
    assert p.sort_key(r, 3.0)[1] == 1  # before any step: no cost known, 7 s of slack, can wait
    p.on_step([r], [], 3.0, 0.16)
    assert p.sort_key(r, 3.0)[1] == 2  # 7 - 16 s: past saving
    p.on_step([r], [], 3.0, 0.05)
    assert p.sort_key(r, 3.0)[:3] == (int(Tier.STANDARD), 0, pytest.approx(2.0))  # urgent again
    fixed = goodput()  # a configured cost is kept whatever the steps measure
    fixed.on_step([r], [], 3.0, 0.16)
    assert fixed.sort_key(r, 3.0)[1] == 0


def test_goodput_takes_a_zero_step_cost_refuses_a_negative_one_and_still_ages():
    assert SchedulerConfig(num_gpu_blocks=64, goodput_step_time_s=0.0).goodput_step_time_s == 0.0
    with pytest.raises(ValueError, match="goodput_step_time_s"):
        SchedulerConfig(num_gpu_blocks=64, goodput_step_time_s=-1.0)
    policy = GoodputPolicy(SchedulerConfig(num_gpu_blocks=64, aging_tokens_per_step=0.25))
    policy.on_step([req("w")], [], 0.0, 0.1)
    assert policy.aging_rate == pytest.approx(2.5) and policy.step_time_s == pytest.approx(0.1)  # sjf's aging too


def test_srpt_a_waiting_request_that_may_preempt_nobody_keeps_its_turn() -> None:
    # At t=50 "old" ranks first by its aged score (30 - 50) but is not 4x shorter than the running
    # request (99 left); "fresh" (5 - 5) would be. It may not preempt past "old": nobody is.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=256, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                                          max_model_len=256, kv_watermark=0.0, policy="srpt", aging_tokens_per_s=1.0))
    runner = PagedTokenRunner(256, 4)
    scheduler.add_request(req("running", 40.0, predicted=100))
    output = scheduler.schedule(40.0)
    scheduler.update_from_output(output, runner.execute(output), 40.0)
    scheduler.add_request(req("old", 0.0, predicted=30))
    scheduler.add_request(req("fresh", 45.0, predicted=5))
    output = scheduler.schedule(50.0)
    assert output.preempted_ids == () and [c.request_id for c in output.chunks] == ["running"]


def test_a_configured_aging_rate_is_not_replaced_by_the_measured_one() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_model_len=256, policy="sjf",
                                          aging_tokens_per_s=10.0))
    waiting = req("w", 0.0, predicted=100)
    scheduler.add_request(waiting)
    scheduler.record_step(0.0, 10, 0.5)  # measured: 0.25 tokens per 0.5 s step, 0.5 tokens/s
    scheduler.schedule(1.0)
    assert scheduler.policy.aging_bound_s(waiting) == pytest.approx(100 / 10.0)


def test_a_requests_aging_bound_reads_only_the_rates_while_it_waited() -> None:
    policy = SJFPolicy(SchedulerConfig(num_gpu_blocks=64))
    policy.record_rate_history = True
    late = req("late", 10.0, predicted=100)
    for now, step_time in ((0.0, 1.0), (10.0, 0.5), (20.0, 0.25), (30.0, 2.0)):  # 0.25, 0.5, 1, 0.125 tokens/s
        policy.on_step([late], [], now, step_time)
    # Waiting from 10 s to its seat at 20 s, the slowest rate was 0.5 tokens/s (not 0.25, before it
    # arrived, nor 0.125, after it was seated).
    assert policy.aging_bound_s(late, waited_until=20.0) == pytest.approx(100 / 0.5)


def test_urgent_admissions_share_exactly_the_budget_their_victims_and_the_decodes_leave() -> None:
    # Three seats: an interactive decode (e) and two batch decodes. Two interactive requests
    # arrive; each takes a batch victim's seat. Of the 32-token budget, e's decode keeps one
    # token (its chunk, ranked ahead), i0 takes 14, and i1 the 16 left, counting the decode
    # token each victim gives back.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=3, max_num_batched_tokens=32,
                                          max_model_len=64, kv_watermark=0.0))
    runner = PagedTokenRunner(16, 4)
    running = [req("e", 0.0, tier=Tier.INTERACTIVE, prompt_len=6, max_tokens=20)]
    running += [req(f"b{i}", 0.1 * (i + 1), tier=Tier.BATCH, prompt_len=6, max_tokens=20) for i in range(2)]
    urgent = [req("i0", 3.0, tier=Tier.INTERACTIVE, prompt_len=14, max_tokens=2),
              req("i1", 3.0, tier=Tier.INTERACTIVE, prompt_len=16, max_tokens=2)]
    for step in range(100):
        add_arrivals(scheduler, {0: running, 3: urgent}, step)
        output = scheduler.schedule(float(step))
        if step == 3:
            assert {c.request_id: len(c.token_ids) for c in output.chunks} == {"e": 1, "i0": 14, "i1": 16}
            assert sorted(output.preempted_ids) == ["b0", "b1"]
        scheduler.update_from_output(output, runner.execute(output), float(step))
        scheduler.block_manager.check_integrity()
        if not scheduler.has_unfinished_requests():
            break
    assert_every_token(running + urgent)
