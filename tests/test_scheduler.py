"""Scheduler core: token accounting, budget filling, chunking, preemption, stop rules.

Outputs are checked against `reference_output` (what a request produces when nothing goes wrong),
computed by `PagedTokenRunner`, which reads every context back through the block tables: a wrong
table, chunk, start position or swap copy changes the tokens.
"""

from __future__ import annotations

import logging

import pytest

from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput
from scheduler.request import Request, RequestStatus, SamplingParams, Tier
from scheduler.scheduler import Scheduler
from scheduler.testing import PagedTokenRunner, reference_output


def make_request(request_id: str, prompt_len: int, max_tokens: int, arrival: float = 0.0, **kwargs) -> Request:
    prompt = [(7 * int(request_id.strip("r") or 0) + 3 * i) % 500 + 1 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, arrival_time=arrival, **kwargs)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000,
                      swapped_out: list[int] | None = None) -> dict[str, list[int]]:
    """Outputs by request id; `swapped_out`, when given, gets each step's number of blocks swapped out."""
    config = scheduler.config
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks)
    outputs: dict[str, list[int]] = {}
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule(now=float(step))
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.chunks) <= config.max_num_seqs
        check_step_contract(output)
        if swapped_out is not None:
            swapped_out.append(len(output.swap_out))
        for request in scheduler.update_from_output(output, runner.execute(output), now=float(step)):
            if request.is_finished:
                outputs[request.request_id] = list(request.output_token_ids)
        scheduler.block_manager.check_integrity()
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == config.num_gpu_blocks
    return outputs


def check_step_contract(output) -> None:
    """What every step promises the runner, beyond the budget and seats."""
    assert all(chunk.token_ids for chunk in output.chunks), "a chunk with no tokens"
    # A request preempted in a step waits for the next one (preemption.py, `_resume_limit`).
    assert not set(output.preempted_ids) & {chunk.request_id for chunk in output.chunks}
    # A step that preempted swaps nothing in (scheduler.py, `_fill`), so no block is copied out
    # and in at once, and room just made for one request is not taken by another.
    assert not (output.preempted_ids and output.swap_in)
    assert not (output.swap_out and output.swap_in)


WORKLOAD = [(f"r{i}", 5 + (i * 13) % 40, 4 + (i * 7) % 30) for i in range(12)]


def add_workload(scheduler: Scheduler) -> None:
    for index, (request_id, prompt_len, max_tokens) in enumerate(WORKLOAD):
        scheduler.add_request(make_request(request_id, prompt_len, max_tokens, arrival=index * 1e-3))


def expected_outputs() -> dict[str, list[int]]:
    return {rid: reference_output(make_request(rid, p, m).prompt_token_ids, m) for rid, p, m in WORKLOAD}


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("chunked", [True, False])
def test_outputs_match_reference_with_ample_memory(block_size: int, chunked: bool) -> None:
    config = SchedulerConfig(num_gpu_blocks=256, block_size=block_size, max_num_seqs=8,
                             max_num_batched_tokens=64 if chunked else 128, max_model_len=128,
                             enable_chunked_prefill=chunked)
    scheduler = Scheduler(config)
    add_workload(scheduler)
    assert run_to_completion(scheduler) == expected_outputs()
    assert scheduler.stats().num_preemptions == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_preemption_keeps_every_token(mode: str, block_size: int) -> None:
    config = SchedulerConfig(num_gpu_blocks=96 // block_size, block_size=block_size, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=80, preemption_mode=mode,
                             num_cpu_blocks=256 // block_size if mode == "swap" else 0)
    scheduler = Scheduler(config)
    add_workload(scheduler)
    swapped_out: list[int] = []
    assert run_to_completion(scheduler, swapped_out=swapped_out) == expected_outputs()
    assert scheduler.stats().num_preemptions > 0
    # Swap mode really swaps (it falls back to recompute when the host pool is short), and
    # recompute never does.
    assert (sum(swapped_out) > 0) == (mode == "swap")


def test_a_full_swap_pool_falls_back_to_recompute_warned_once_and_its_usage_is_reported(caplog) -> None:
    # An eight-block host pool takes some victims and not others, which are recomputed, every
    # token kept. The pool's usage is the cpu_cache_usage_perc gauge's; the fallback was silent.
    block_size = 4
    config = SchedulerConfig(num_gpu_blocks=96 // block_size, block_size=block_size, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=80, preemption_mode="swap", num_cpu_blocks=8)
    scheduler = Scheduler(config)
    add_workload(scheduler)
    usages = []
    original = scheduler.update_from_output

    def recording(*args, **kwargs):
        usages.append(scheduler.stats().host_kv_usage)
        return original(*args, **kwargs)

    scheduler.update_from_output = recording
    with caplog.at_level(logging.WARNING, logger="scheduler.eviction"):
        assert run_to_completion(scheduler) == expected_outputs()
    assert caplog.text.count("the host swap pool is full: preempting by recompute instead") == 1
    assert max(usages) > 0 and all(0 <= usage <= 1 for usage in usages)
    assert scheduler.stats().host_kv_usage == 0.0  # all swapped back in
    assert Scheduler(SchedulerConfig(num_gpu_blocks=8)).stats().host_kv_usage is None  # no pool


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_failed_model_step_strands_no_request_and_leaks_no_block(mode: str) -> None:
    # Every fifth step's model call "raises": half the time before anything is written, half
    # after the KV (and swap copies) were written but before the sampled tokens come back.
    # No watermark, and a cache that preempts (a prompt is admitted only once all of it fits).
    config = SchedulerConfig(num_gpu_blocks=22, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                             max_model_len=80, kv_watermark=0.0, preemption_mode=mode,
                             num_cpu_blocks=64 if mode == "swap" else 0)
    scheduler = Scheduler(config)
    add_workload(scheduler)
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks)
    outputs: dict[str, list[int]] = {}
    failures = 0
    for step in range(5000):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule(now=float(step))
        if step % 5 == 3:
            if step % 10 == 3:
                runner.execute(output)
            scheduler.restart_failed_step(output, now=float(step))
            failures += 1
            assert all(scheduler.get_request(c.request_id).requeued_at == float(step) for c in output.chunks
                       if not scheduler.get_request(c.request_id).is_finished)
        else:
            for request in scheduler.update_from_output(output, runner.execute(output), now=float(step)):
                if request.is_finished:
                    outputs[request.request_id] = list(request.output_token_ids)
        scheduler.block_manager.check_integrity()
    assert failures > 10 and scheduler.stats().num_preemptions > 0
    assert outputs == expected_outputs()
    assert scheduler.block_manager.num_free_blocks == config.num_gpu_blocks
    assert scheduler.block_manager.num_requests_holding() == 0


def drive(scheduler: Scheduler, check=None, retry_failed: bool = False) -> dict[str, list[int]]:
    """Run the workload to the end with the paged reference runner, calling `check` every step;
    with `retry_failed`, a schedule() that raises RuntimeError is retried the next step."""
    config = scheduler.config
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks)
    outputs = {}
    for step in range(5000):
        if not scheduler.has_unfinished_requests():
            break
        try:
            output = scheduler.schedule(now=float(step))
        except RuntimeError:
            if not retry_failed:
                raise
            scheduler.block_manager.check_integrity()
            continue
        if check is not None:
            check(scheduler, output)
        for r in scheduler.update_from_output(output, runner.execute(output), now=float(step)):
            if r.is_finished:
                outputs[r.request_id] = list(r.output_token_ids)
        scheduler.block_manager.check_integrity()
    return outputs


class FailingAfterSwapOut(Scheduler):
    """Raises in the last part of every other step that booked a swap-out: the plan, with its
    host blocks allocated but never copied, never reaches the runner."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.failures = self.swap_outs = 0

    def _schedule_waiting(self, plan, now: float) -> None:
        if plan.swap_out:
            self.swap_outs += 1
            if self.swap_outs % 2:
                self.failures += 1
                raise RuntimeError("scheduling failed after a swap-out was booked")
        super()._schedule_waiting(plan, now)


def test_a_failed_schedule_after_a_swap_out_loses_no_token_and_leaks_no_block() -> None:
    config = SchedulerConfig(num_gpu_blocks=22, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                             max_model_len=80, kv_watermark=0.0, preemption_mode="swap", num_cpu_blocks=64)
    scheduler = FailingAfterSwapOut(config)
    add_workload(scheduler)
    reported_finished: list[str] = []
    outputs = drive(scheduler, lambda _, output: reported_finished.extend(output.finished_ids), retry_failed=True)
    reported_finished += scheduler.schedule(now=5000.0).finished_ids
    assert scheduler.failures >= 3 and scheduler.swap_outs > scheduler.failures
    assert outputs == expected_outputs()
    assert sorted(reported_finished) == sorted(outputs)  # each finished id reaches the runner once
    assert scheduler.block_manager.num_requests_holding() == 0
    scheduler.block_manager.check_integrity()


class FailingOnDemand(Scheduler):
    """Raises in the last part of the next step after `fail_next` is set."""

    fail_next = False

    def _schedule_waiting(self, plan, now: float) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("scheduling failed")
        super()._schedule_waiting(plan, now)


def test_a_failed_schedule_holds_finished_ids_and_requeues_new_work_as_waiting() -> None:
    scheduler = FailingOnDemand(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_model_len=64))
    scheduler.add_request(make_request("r1", 6, 4))
    scheduler.abort_request("r1", now=0.0)
    scheduler.add_request(make_request("r2", 6, 4, arrival=0.0))
    scheduler.fail_next = True
    with pytest.raises(RuntimeError):
        scheduler.schedule(now=10.0)
    r2 = scheduler.get_request("r2")
    assert r2.status is RequestStatus.WAITING and r2.requeued_at is None and not r2.block_ids
    output = scheduler.schedule(now=20.0)
    assert output.finished_ids == ("r1",) and [c.request_id for c in output.chunks] == ["r2"]
    assert r2.first_scheduled_time == 20.0 and r2.requeued_waits == []  # waited 20 s, counted once
    scheduler.add_request(make_request("r1", 6, 4))  # reported: the id is free again
    assert scheduler.schedule(now=21.0).finished_ids == ()
    scheduler.block_manager.check_integrity()


def test_swap_preemption_moves_blocks_to_host_and_back() -> None:
    config = SchedulerConfig(num_gpu_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                             max_model_len=24, preemption_mode="swap", num_cpu_blocks=16)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(6, 4, 16)
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", 8, 8, arrival=float(i)))
    swapped_out = swapped_in = False
    for step in range(40):
        output = scheduler.schedule(float(step))
        swapped_out |= bool(output.swap_out)
        swapped_in |= bool(output.swap_in)
        if output.swap_out:
            assert scheduler.get_request("r1").status is RequestStatus.SWAPPED
        scheduler.update_from_output(output, runner.execute(output), float(step))
    assert swapped_out and swapped_in
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == 6 and scheduler.block_manager.host.num_free == 16


def test_decodes_fill_the_budget_before_prefill_chunks() -> None:
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=10, max_model_len=64,
                             max_num_seqs=8)
    scheduler = Scheduler(config)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 3, 20, arrival=float(i)))
    first = scheduler.schedule(0.0)  # three prefills of 3 tokens
    runner = PagedTokenRunner(64, 4)
    scheduler.update_from_output(first, runner.execute(first), 0.0)
    scheduler.add_request(make_request("r9", 30, 5, arrival=1.0))
    second = scheduler.schedule(1.0)
    sizes = {c.request_id: len(c.token_ids) for c in second.chunks}
    assert sizes == {"r0": 1, "r1": 1, "r2": 1, "r9": 7}
    assert [c.request_id for c in second.chunks][:3] == ["r0", "r1", "r2"]
    chunk = second.chunks[3]
    assert chunk.start_position == 0 and not chunk.sample
    assert scheduler.get_request("r9").num_computed_tokens == 7


@pytest.mark.parametrize("chunked", [True, False])
def test_whole_prefill_waits_for_room_without_chunking(chunked: bool) -> None:
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=40, max_model_len=40,
                             enable_chunked_prefill=chunked)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(64, 4)
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", 3, 20, arrival=float(i)))
    first = scheduler.schedule(0.0)
    scheduler.update_from_output(first, runner.execute(first), 0.0)
    scheduler.add_request(make_request("r2", 39, 1, arrival=2.0))
    second = scheduler.schedule(1.0)  # two decodes leave 38 tokens for a 39-token prompt
    sizes = {c.request_id: len(c.token_ids) for c in second.chunks}
    assert sizes == ({"r0": 1, "r1": 1, "r2": 38} if chunked else {"r0": 1, "r1": 1})


def test_max_num_seqs_limits_seats() -> None:
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=100,
                             max_model_len=64)
    scheduler = Scheduler(config)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 4, 3, arrival=float(i)))
    output = scheduler.schedule(0.0)
    assert [c.request_id for c in output.chunks] == ["r0", "r1"]
    assert scheduler.stats().num_waiting == 3


def step_once(scheduler: Scheduler, token: int, now: float) -> list[Request]:
    output = scheduler.schedule(now)
    sampled = {c.request_id: token for c in output.chunks if c.sample}
    return scheduler.update_from_output(output, ModelRunnerOutput(sampled), now)


@pytest.mark.parametrize(("params", "token", "status"), [
    (SamplingParams(max_tokens=5), 2, RequestStatus.FINISHED_STOPPED),  # eos
    (SamplingParams(max_tokens=5, ignore_eos=True), 2, None),
    (SamplingParams(max_tokens=5, stop_token_ids=(9,)), 9, RequestStatus.FINISHED_STOPPED),
    (SamplingParams(max_tokens=1), 4, RequestStatus.FINISHED_LENGTH),
    # Before min_tokens, an eos or stop token the sampler could not rule out does not stop it.
    (SamplingParams(max_tokens=5, min_tokens=1), 2, None),
    (SamplingParams(max_tokens=5, min_tokens=1, stop_token_ids=(9,)), 9, None),
])
def test_stop_rules(params: SamplingParams, token: int, status: RequestStatus | None) -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_model_len=32))
    request = Request("a", [1, 2, 3], params, arrival_time=0.0, eos_token_id=2)
    scheduler.add_request(request)
    progressed = step_once(scheduler, token, 1.5)
    assert progressed == [request] and request.output_token_ids == [token]
    assert request.first_token_time == 1.5
    if status is None:
        assert request.status is RequestStatus.RUNNING
    else:
        assert request.status is status and request.finish_time == 1.5
        assert scheduler.block_manager.num_free_blocks == 16
        assert scheduler.schedule(2.0).finished_ids == ("a",)


def test_max_model_len_finishes_with_length() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_model_len=6))
    request = make_request("r1", 4, 100)
    scheduler.add_request(request)
    step_once(scheduler, 5, 0.0)
    step_once(scheduler, 5, 1.0)
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 6


def test_abort_frees_blocks_and_reports_once() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_model_len=32))
    scheduler.add_request(make_request("r1", 9, 10))
    scheduler.add_request(make_request("r2", 4, 10))
    step_once(scheduler, 5, 0.0)
    assert scheduler.abort_request("r1") is True
    assert scheduler.abort_request("r1") is False
    assert scheduler.block_manager.num_free_blocks == 16 - 1  # r2: 4 computed tokens, one block (lazy)
    assert scheduler.schedule(1.0).finished_ids == ("r1",)
    assert scheduler.schedule(2.0).finished_ids == ()


def test_a_finished_requests_id_is_free_at_once_though_not_yet_reported() -> None:
    # An idle scheduler takes no step that would report r1 finished; its id is free all the same,
    # and the step that reports the old r1 keeps the new one, even if that step fails.
    scheduler = FailingOnDemand(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_model_len=64))
    scheduler.add_request(make_request("r1", 6, 4))
    scheduler.abort_request("r1", now=0.0)
    assert not scheduler.has_unfinished_requests()
    again = make_request("r1", 6, 4)
    scheduler.add_request(again)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r1", 6, 4))  # now live
    scheduler.fail_next = True
    with pytest.raises(RuntimeError):
        scheduler.schedule(now=1.0)
    output = scheduler.schedule(now=2.0)
    assert output.finished_ids == ("r1",) and [c.request_id for c in output.chunks] == ["r1"]
    assert scheduler.get_request("r1") is again and not again.is_finished
    assert scheduler.schedule(now=3.0).finished_ids == ()


def test_bad_input_raises_value_error() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=4, block_size=4, max_model_len=32))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("r1", 32, 1))
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request(make_request("r2", 10, 10))
    scheduler.add_request(make_request("r3", 3, 2))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r3", 3, 2))
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(stop=("end", ""))


def test_a_request_whose_fed_tokens_fill_the_cache_exactly_is_served() -> None:
    # 48 prompt + 17 output = 65 tokens, but the last output token is never fed: 64 slots = 4 blocks.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=4, block_size=16, max_model_len=128))
    scheduler.add_request(make_request("r1", 48, 17))
    assert run_to_completion(scheduler) == {"r1": reference_output(make_request("r1", 48, 17).prompt_token_ids, 17)}
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request(make_request("r2", 48, 18))


@pytest.mark.parametrize("kwargs", [
    {"num_gpu_blocks": 0}, {"num_gpu_blocks": 4, "block_size": 12},
    {"num_gpu_blocks": 4, "enable_chunked_prefill": False, "max_num_batched_tokens": 100},
    {"num_gpu_blocks": 4, "preemption_mode": "swap"}, {"num_gpu_blocks": 4, "preemption_mode": "drop"},
    {"num_gpu_blocks": 4, "policy": "shortest"},
])
def test_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


# Each knob just past its bound, naming itself in the error, and (below) at the bound, accepted.
@pytest.mark.parametrize("kwargs", [
    {"num_cpu_blocks": -1}, {"kv_watermark": 1.0}, {"kv_watermark": -0.01}, {"srpt_max_preempt_share": 1.01},
    {"srpt_preempt_ratio": 0.99}, {"batch_shed_share": 0.0}, {"throughput_ewma_alpha": 1.01},
    {"throughput_ewma_alpha": 0.0}, {"stability_window_s": 0.0}, {"capacity_half_life_s": 0.0},
    {"max_queued_tokens": 0}, {"aging_tokens_per_step": -0.01}, {"aging_tokens_per_s": -0.01},
    {"goodput_urgent_slack_s": -0.01}, {"slo_ttft_interactive_s": -0.01}, {"slo_e2e_standard_s": -0.01},
    {"aging_tokens_per_step": float("nan")},
])
def test_config_rejects_each_knob_past_its_bound(kwargs: dict) -> None:
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(num_gpu_blocks=4, **kwargs)


@pytest.mark.parametrize("kwargs", [
    {"num_cpu_blocks": 0}, {"kv_watermark": 0.0}, {"srpt_max_preempt_share": 0.0}, {"srpt_max_preempt_share": 1.0},
    {"srpt_preempt_ratio": 1.0}, {"batch_shed_share": 1.0}, {"throughput_ewma_alpha": 1.0},
    {"max_queued_tokens": 1}, {"aging_tokens_per_step": 0.0}, {"aging_tokens_per_s": 0.0},
    {"goodput_urgent_slack_s": 0.0}, {"goodput_step_time_s": 0.0}, {"slo_ttft_interactive_s": 1e-6},
    {"max_num_batched_tokens": 2048, "max_model_len": 2048, "enable_chunked_prefill": False},
])
def test_config_accepts_each_knob_at_its_bound(kwargs: dict) -> None:
    config = SchedulerConfig(num_gpu_blocks=4, **kwargs)
    assert all(getattr(config, name) == value for name, value in kwargs.items())


def test_config_refuses_more_seats_than_the_token_budget_can_feed() -> None:
    # Each seat decodes a token a step: past the budget, seats would stay empty (vLLM refuses too).
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_num_seqs \(17\)"):
        SchedulerConfig(num_gpu_blocks=4, max_num_batched_tokens=16, max_num_seqs=17)
    assert SchedulerConfig(num_gpu_blocks=4, max_num_batched_tokens=16, max_num_seqs=16).max_num_seqs == 16


def test_new_work_waits_above_the_kv_watermark() -> None:
    config = SchedulerConfig(num_gpu_blocks=20, block_size=4, max_model_len=64, kv_watermark=0.25)
    scheduler = Scheduler(config)
    scheduler.add_request(make_request("r0", 40, 10))  # 10 blocks, admitted into an empty cache
    step_once(scheduler, 5, 0.0)
    scheduler.add_request(make_request("r1", 24, 4, arrival=1.0))  # 6 blocks would leave 4 < 5 free
    assert [r.request_id for r in step_once(scheduler, 5, 1.0)] == ["r0"]
    scheduler.add_request(make_request("r2", 20, 4, arrival=2.0))  # ranked after r1 (FCFS): waits too
    assert [r.request_id for r in step_once(scheduler, 5, 2.0)] == ["r0"]
    scheduler.abort_request("r0")
    assert {r.request_id for r in step_once(scheduler, 5, 3.0)} == {"r1", "r2"}


# Preemption modes and the restart after a failed schedule(), edge by edge (each test kills a
# mutant of scheduler/eviction.py or scheduler/scheduler.py that the tests above let through).


def queues_agree(scheduler: Scheduler, output) -> None:
    """Each queue holds requests in its own state: swapped ones hold host blocks, waiting ones none."""
    bm = scheduler.block_manager
    for r in scheduler.swapped:
        assert r.status is RequestStatus.SWAPPED and r.request_id in bm._host_tables
    for r in scheduler.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.request_id not in bm._host_tables and not r.block_ids


@pytest.mark.parametrize("cpu", [0, 64])
def test_recompute_never_swaps(cpu):
    config = SchedulerConfig(num_gpu_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                             max_model_len=80, preemption_mode="recompute", num_cpu_blocks=cpu)
    s = Scheduler(config)
    add_workload(s)

    def check(s, out):
        queues_agree(s, out)
        assert not out.swap_out and not s.swapped

    assert drive(s, check) == expected_outputs()
    assert s.stats().num_preemptions > 0


def test_swap_falls_back_to_recompute_when_the_host_pool_is_short():
    config = SchedulerConfig(num_gpu_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                             max_model_len=80, preemption_mode="swap", num_cpu_blocks=2)
    s = Scheduler(config)
    add_workload(s)
    fallbacks = []

    def check(s, out):
        queues_agree(s, out)
        fallbacks.extend(rid for rid in out.preempted_ids if s.get_request(rid).status is RequestStatus.PREEMPTED)

    assert drive(s, check) == expected_outputs()
    assert fallbacks
    assert s.block_manager.num_free_blocks == config.num_gpu_blocks and s.block_manager.num_requests_holding() == 0


def run_one_step(s: Scheduler, now: float) -> None:
    c = s.config
    out = s.schedule(now=now)
    s.update_from_output(out, PagedTokenRunner(c.num_gpu_blocks, c.block_size, c.num_cpu_blocks).execute(out), now=now)


class Interrupted(FailingOnDemand):
    def _schedule_waiting(self, plan, now):
        if self.fail_next:
            self.fail_next = False
            raise KeyboardInterrupt
        super()._schedule_waiting(plan, now)


def test_an_interrupt_inside_schedule_is_undone_too():
    s = Interrupted(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_model_len=64))
    s.add_request(make_request("r1", 6, 8))
    run_one_step(s, 0.0)  # r1 running, prefilled
    s.fail_next = True
    with pytest.raises(KeyboardInterrupt):
        s.schedule(now=1.0)  # r1 granted its decode in _schedule_running, then interrupted
    r1 = s.get_request("r1")
    assert r1.status is RequestStatus.PREEMPTED and r1 in s.waiting and not r1.block_ids


def test_an_interrupt_between_allocating_a_choices_blocks_and_recording_them_is_undone():
    # Two choices of one prompt; the interrupt comes right after the second's blocks (its
    # sibling's, found in the prefix cache) are allocated, before the plan records its grant:
    # left holding them, unwritten, it resumed at 12 computed tokens and read KV nobody wrote.
    config = SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, enable_prefix_caching=True, kv_watermark=0.0)
    s = Scheduler(config)
    prompt = list(range(300, 313))
    first, second = (Request(name, prompt, SamplingParams(max_tokens=4, ignore_eos=True), 0.0)
                     for name in ("c0", "c1"))
    s.add_request(first)
    s.add_request(second)
    allocate = s.block_manager.allocate_slots

    def allocate_then_interrupt(request, *args):
        table = allocate(request, *args)
        if request is second:
            s.block_manager.allocate_slots = allocate
            raise KeyboardInterrupt
        return table

    s.block_manager.allocate_slots = allocate_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        s.schedule(0.0)
    assert s.block_manager.num_requests_holding() == 0 and second.num_computed_tokens == 0
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size)  # checks every slot it reads
    for step in range(1, 12):
        out = s.schedule(float(step))
        s.update_from_output(out, runner.execute(out), float(step))
    assert first.is_finished and second.is_finished and first.output_token_ids == second.output_token_ids
    assert s.block_manager.num_free_blocks == config.num_gpu_blocks


class FailAfterWaiting(Scheduler):
    fail_next = False

    def _schedule_waiting(self, plan, now):
        super()._schedule_waiting(plan, now)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("late failure")


def test_new_work_granted_in_a_failed_schedule_goes_back_waiting():
    s = FailAfterWaiting(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_model_len=64))
    s.add_request(make_request("r2", 6, 4))
    s.fail_next = True
    with pytest.raises(RuntimeError):
        s.schedule(now=5.0)
    r2 = s.get_request("r2")
    assert r2.status is RequestStatus.WAITING and r2.requeued_at is None and r2 in s.waiting
    assert not r2.block_ids and r2.num_computed_tokens == 0 and not s.running


def test_a_failed_schedule_keeps_the_requeue_time_of_a_request_preempted_earlier():
    s = FailAfterWaiting(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_model_len=64))
    s.add_request(make_request("r1", 6, 8))
    run_one_step(s, 0.0)
    out = s.schedule(now=1.0)
    s.restart_failed_step(out, now=1.0)  # r1 preempted at 1.0, waiting again
    r1 = s.get_request("r1")
    assert r1.requeued_at == 1.0
    s.fail_next = True
    with pytest.raises(RuntimeError):
        s.schedule(now=5.0)  # r1 granted again, then the schedule fails
    assert r1.requeued_at == 1.0 and r1.status is RequestStatus.PREEMPTED


def test_restart_leaves_a_request_finished_since_the_step_alone():
    s = Scheduler(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_model_len=64))
    s.add_request(make_request("r1", 6, 8))
    out = s.schedule(now=0.0)
    s.abort_request("r1", now=0.5)
    s.restart_failed_step(out, now=1.0)
    assert s.get_request("r1").status is RequestStatus.FINISHED_ABORTED and not s.has_unfinished_requests()


def test_a_request_that_ran_restarts_as_preempted():
    s = Scheduler(SchedulerConfig(num_gpu_blocks=32, block_size=4, max_model_len=64))
    s.add_request(make_request("r1", 6, 8))
    out = s.schedule(now=0.0)
    s.restart_failed_step(out, now=1.0)
    assert s.get_request("r1").status is RequestStatus.PREEMPTED


def test_a_failed_schedule_after_a_swap_in_restarts_the_swapped_request():
    class FailOnSwapIn(Scheduler):
        fails = 0

        def _schedule_waiting(self, plan, now):
            if plan.swap_in and self.fails < 3:
                self.fails += 1
                raise RuntimeError("failed after a swap-in was booked")
            super()._schedule_waiting(plan, now)

    config = SchedulerConfig(num_gpu_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                             max_model_len=80, preemption_mode="swap", num_cpu_blocks=64)
    s = FailOnSwapIn(config)
    add_workload(s)
    assert drive(s, retry_failed=True) == expected_outputs() and s.fails >= 1


def step(scheduler: Scheduler, runner: PagedTokenRunner, now: float):
    """One scheduled and executed step; returns the output, checked against the step contract."""
    output = scheduler.schedule(now=now)
    check_step_contract(output)
    scheduler.update_from_output(output, runner.execute(output), now=now)
    return output


def batch_decoding(config: SchedulerConfig, indices, prompt_len: int, max_tokens: int, steps: int):
    """A scheduler and its runner after `steps` steps of batch requests r{i} (i in `indices`); and
    those requests."""
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size)
    batch = [make_request(f"r{index}", prompt_len, max_tokens, tier=Tier.BATCH) for index in indices]
    for request in batch:
        scheduler.add_request(request)
    for now in range(steps):
        step(scheduler, runner, float(now))
    return scheduler, runner, batch


def chunk_sizes(output) -> dict[str, int]:
    return {c.request_id: len(c.token_ids) for c in output.chunks}


def finish_with_reference_tokens(scheduler: Scheduler, runner: PagedTokenRunner, requests: list[Request],
                                 start: int) -> None:
    """Step from `start` until every request has finished; each has the tokens of a run never
    preempted."""
    for now in range(start, start + 200):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner, float(now))
    for request in requests:
        expected = reference_output(request.prompt_token_ids, request.sampling_params.max_tokens)
        assert request.output_token_ids == expected


def test_the_watermark_never_keeps_a_request_out_of_an_empty_cache() -> None:
    # 6 of 8 blocks would leave less than the 50% watermark free, but nothing else can use them.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=8, block_size=4, max_model_len=64, kv_watermark=0.5))
    scheduler.add_request(make_request("r1", 20, 4))
    expected = reference_output(make_request("r1", 20, 4).prompt_token_ids, 4)
    assert run_to_completion(scheduler, max_steps=50) == {"r1": expected}


def test_without_chunking_prefills_that_fill_the_budget_exactly_share_a_step() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64, enable_chunked_prefill=False))
    scheduler.add_request(make_request("r1", 32, 2))
    scheduler.add_request(make_request("r2", 32, 2))
    output = scheduler.schedule(now=0.0)
    assert [(c.request_id, len(c.token_ids)) for c in output.chunks] == [("r1", 32), ("r2", 32)]


def test_a_decode_goes_before_a_prefill_chunk_ranked_ahead_of_it() -> None:
    # sjf without aging ranks the newer short request first, but its prefill chunk must not take
    # the decoding request's token: decodes are served before prefill chunks of their tier.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
                                          max_model_len=128, policy="sjf", aging_tokens_per_s=0.0))
    runner = PagedTokenRunner(64, 4)
    scheduler.add_request(make_request("r1", 4, 100, predicted_len=100.0))
    step(scheduler, runner, 0.0)
    scheduler.add_request(make_request("r2", 40, 5, arrival=1.0, predicted_len=5.0))
    for now in (1.0, 2.0, 3.0):
        grants = {c.request_id: len(c.token_ids) for c in step(scheduler, runner, now).chunks}
        assert grants == {"r1": 1, "r2": 7}


def test_first_schedule_and_first_token_times_are_kept() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=4,
                                          max_model_len=64))
    runner = PagedTokenRunner(16, 4)
    request = make_request("r1", 8, 3)
    scheduler.add_request(request)
    for now in (0.0, 1.0, 2.0, 3.0):  # two prefill chunks, then the second and third tokens
        step(scheduler, runner, now)
    assert request.is_finished and request.num_output_tokens == 3
    assert (request.first_scheduled_time, request.first_token_time, request.finish_time) == (0.0, 1.0, 3.0)


def test_a_request_aborted_after_its_step_was_scheduled_gets_no_token() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_model_len=64))
    runner = PagedTokenRunner(16, 4)
    request = make_request("r1", 4, 4)
    scheduler.add_request(request)
    output = scheduler.schedule(now=0.0)
    assert scheduler.abort_request("r1", now=0.0)
    assert scheduler.update_from_output(output, runner.execute(output), now=0.0) == []
    assert request.output_token_ids == [] and request.status is RequestStatus.FINISHED_ABORTED


def test_without_chunking_an_urgent_prompt_longer_than_the_budget_left_preempts_batch_decodes() -> None:
    # A 31-token interactive prompt does not fit the 30 tokens two batch decodes leave of 32, and
    # without chunking it gets its whole prompt or nothing: it had waited 27 steps, until a batch
    # request finished. One batch victim gives its decode token back and lets it in whole.
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                             max_model_len=32, enable_chunked_prefill=False)
    scheduler, runner, batch = batch_decoding(config, (1, 2), prompt_len=4, max_tokens=20, steps=1)
    urgent = make_request("r3", 31, 1, arrival=1.0, tier=Tier.INTERACTIVE)
    scheduler.add_request(urgent)
    output = step(scheduler, runner, 1.0)
    assert chunk_sizes(output).get("r3") == 31
    assert len(output.preempted_ids) == 1 and output.num_batched_tokens == 32
    finish_with_reference_tokens(scheduler, runner, [*batch, urgent], start=2)  # as if never preempted


@pytest.mark.parametrize("chunked", [True, False])
def test_an_urgent_request_preempts_batch_decodes_that_hold_a_budget_of_one_token_a_seat(chunked: bool) -> None:
    # A budget of max_num_seqs tokens is all the running decodes' once every seat is taken: the
    # interactive request returned before looking for a victim, and waited until a batch request
    # finished. Each victim's decode gives its token back: one lets in a first chunk of one token,
    # and without chunking two let in the whole 2-token prompt.
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=8,
                             max_model_len=8, enable_chunked_prefill=chunked)
    scheduler, runner, batch = batch_decoding(config, range(8), prompt_len=1, max_tokens=6, steps=3)
    urgent = make_request("r9", 2, 3, arrival=3.0, tier=Tier.INTERACTIVE)
    scheduler.add_request(urgent)
    output = step(scheduler, runner, 3.0)
    assert chunk_sizes(output).get("r9") == len(output.preempted_ids) == (1 if chunked else 2)
    assert output.num_batched_tokens == 8
    finish_with_reference_tokens(scheduler, runner, [*batch, urgent], start=4)  # as if never preempted


def test_an_urgent_request_finding_the_budget_taken_by_another_in_its_step_preempts_nobody() -> None:
    # The first interactive arrival's chunk takes the 6 tokens the two batch decodes leave; the
    # second would preempt a batch request (its recompute) for a one-token chunk: it waits a step.
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                             max_model_len=64)
    scheduler, runner, _ = batch_decoding(config, range(2), prompt_len=1, max_tokens=20, steps=1)
    urgent = [make_request(f"r{index}", 20, 2, arrival=1.0, tier=Tier.INTERACTIVE) for index in (7, 8)]
    for request in urgent:
        scheduler.add_request(request)
    output = step(scheduler, runner, 1.0)
    assert chunk_sizes(output) == {"r7": 6, "r0": 1, "r1": 1}
    assert output.preempted_ids == ()


def test_a_higher_tier_prefill_leaves_a_token_for_each_lower_tier_decode() -> None:
    # Decodes first, then prefill chunks, across tiers too: the interactive prompt's chunks took
    # the whole budget ahead of the batch decodes (tier order, kept so that its victims are
    # chosen among requests not yet scheduled), which then got no token for five steps.
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                             max_model_len=64)
    scheduler, runner, batch = batch_decoding(config, range(3), prompt_len=1, max_tokens=30, steps=3)
    urgent = make_request("r9", 40, 4, arrival=3.0, tier=Tier.INTERACTIVE)
    scheduler.add_request(urgent)
    for now in range(3, 100):
        if urgent.num_computed_tokens >= 40:  # its prompt is in
            break
        output = step(scheduler, runner, float(now))
        granted = chunk_sizes(output)
        assert all(granted.get(r.request_id) == 1 for r in batch), (now, granted)
        assert granted["r9"] == 5, (now, granted)  # and it takes the rest
    finish_with_reference_tokens(scheduler, runner, [*batch, urgent], start=now)


def test_an_urgent_request_that_cannot_get_room_keeps_its_turn() -> None:
    # r3 needs 10 blocks; preempting the batch request frees 2 of the 6 it would need beyond
    # the 4 free, so nobody is preempted, and r4, behind it in its tier, does not jump it.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64))
    runner = PagedTokenRunner(16, 4)
    scheduler.add_request(make_request("r1", 38, 10, tier=Tier.INTERACTIVE))
    scheduler.add_request(make_request("r2", 6, 10, arrival=0.1, tier=Tier.BATCH))
    step(scheduler, runner, 0.0)
    scheduler.add_request(make_request("r3", 40, 4, arrival=1.0, tier=Tier.INTERACTIVE))
    scheduler.add_request(make_request("r4", 4, 4, arrival=1.1, tier=Tier.INTERACTIVE))
    output = step(scheduler, runner, 1.0)
    assert {c.request_id for c in output.chunks} == {"r1", "r2"} and output.preempted_ids == ()


def test_request_fields_are_validated_at_their_bounds() -> None:
    params = SamplingParams(max_tokens=10)
    with pytest.raises(ValueError, match="prompt"):
        Request("r", [], params, arrival_time=0.0)
    for priority in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="priority"):
            Request("r", [1], params, arrival_time=0.0, priority=priority)
    assert Request("r", [1], params, arrival_time=0.0, priority=2**63 - 1).priority == 2**63 - 1
    for arrival in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="arrival_time"):
            Request("r", [1], params, arrival_time=arrival)
    # The predicted length is clamped to [max(1, min_tokens), max_tokens].
    assert Request("r", [1], params, arrival_time=0.0, predicted_len=0.0).predicted_total == 1.0
    floor = SamplingParams(max_tokens=10, min_tokens=10)
    assert Request("r", [1], floor, arrival_time=0.0, predicted_len=2.0).predicted_total == 10.0
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=10, min_tokens=11)


def test_a_request_preempted_for_a_block_is_not_readmitted_in_the_same_step() -> None:
    # r2's decode finds no free block and r2 gives way to itself: its two freed blocks would hold
    # a 7-token chunk of its recompute, but it waits for the next step (check_step_contract).
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
                                          max_model_len=64, kv_watermark=0.0))
    scheduler.add_request(make_request("r1", 8, 10))
    scheduler.add_request(make_request("r2", 8, 4, arrival=0.1))
    expected = {rid: reference_output(make_request(rid, 8, n).prompt_token_ids, n)
                for rid, n in (("r1", 10), ("r2", 4))}
    assert run_to_completion(scheduler) == expected
    assert scheduler.stats().num_preemptions >= 1


def test_a_failed_step_forgets_only_its_own_blocks_and_a_resumed_lookup_is_counted_apart() -> None:
    config = SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, enable_prefix_caching=True)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(16, 4)
    prompt = make_request("r1", 13, 4).prompt_token_ids
    scheduler.add_request(make_request("r1", 13, 4))
    output = scheduler.schedule(0.0)
    scheduler.update_from_output(output, runner.execute(output), 0.0)  # its three full blocks committed
    scheduler.restart_failed_step(scheduler.schedule(1.0), 1.0)  # a later step fails
    probe = Request("probe", prompt, SamplingParams(max_tokens=1), arrival_time=0.0)
    assert scheduler.block_manager.cached_prefix(probe).num_tokens == 12
    scheduler.schedule(2.0)  # it resumes with 14 tokens (13 + 1 generated), 12 of them cached
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13, 0)  # its own blocks: no hit
    cache = scheduler.block_manager.prefix_cache
    assert (cache.num_requery_tokens, cache.num_requery_hit_tokens) == (14, 12)


def test_a_swapped_out_request_counts_as_waiting_for_its_aging_bound() -> None:
    # The bound holds at the slowest rate in force while a request waits, swapped out included:
    # its steps here are slow (10 s), every other step fast.
    config = SchedulerConfig(num_gpu_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
                             max_model_len=64, kv_watermark=0.0, policy="sjf", preemption_mode="swap",
                             num_cpu_blocks=16)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(5, 4, 16)
    scheduler.add_request(make_request("r1", 8, 10))
    swapped = make_request("r2", 8, 4, arrival=0.1)
    scheduler.add_request(swapped)
    slow_mean = None
    for now in range(30):
        output = step(scheduler, runner, float(now))
        slow = swapped.status is RequestStatus.SWAPPED and slow_mean is None
        scheduler.record_step(float(now), output.num_batched_tokens, 10.0 if slow else 0.001)
        if slow:
            slow_mean = scheduler.admission.mean_step_time_s
    assert slow_mean is not None and not scheduler.has_unfinished_requests()
    slowest_rate = config.aging_tokens_per_step / slow_mean
    assert scheduler.policy.aging_bound_s(swapped) == pytest.approx(swapped.predicted_total / slowest_rate)


@pytest.mark.parametrize("seed", range(6))
def test_a_swapped_request_comes_back_only_above_the_watermark_while_others_run(seed) -> None:
    # Swapped back into the last free blocks, it was the victim again at the next block boundary
    # of anything running: its whole KV copied out and in for a token or so.
    import random

    rng = random.Random(seed)
    config = SchedulerConfig(num_gpu_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                             max_model_len=64, preemption_mode="swap", num_cpu_blocks=64, kv_watermark=0.2)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(24, 4, 64)
    workload = [(f"r{i}", rng.randint(3, 20), rng.randint(8, 40)) for i in range(10)]
    for i, (request_id, prompt_len, max_tokens) in enumerate(workload):
        scheduler.add_request(make_request(request_id, prompt_len, max_tokens, arrival=float(i)))
    reserve = config.kv_watermark * config.num_gpu_blocks
    outputs, swap_ins = {}, 0
    for step in range(2_000):
        if not scheduler.has_unfinished_requests():
            break
        running_before = {r.request_id for r in scheduler.running}
        output = scheduler.schedule(float(step))
        if output.swap_in and running_before - set(output.preempted_ids):  # others ran beside it
            swap_ins += 1
            assert scheduler.block_manager.num_free_blocks >= reserve, step
        for request in scheduler.update_from_output(output, runner.execute(output), float(step)):
            if request.is_finished:
                outputs[request.request_id] = list(request.output_token_ids)
        scheduler.block_manager.check_integrity()
    assert swap_ins > 0  # the rule was exercised
    assert outputs == {request_id: reference_output(make_request(request_id, p, m).prompt_token_ids, m)
                       for request_id, p, m in workload}
    assert scheduler.block_manager.num_free_blocks == config.num_gpu_blocks


def test_a_swapped_request_too_large_for_the_reserve_comes_back_once_the_cache_empties() -> None:
    # 15 of 16 blocks at its end: beside anything running it can never leave the reserve free, so
    # it comes back once the other is done, and finishes with the reference tokens.
    config = SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, preemption_mode="swap", num_cpu_blocks=32, kv_watermark=0.05)
    scheduler = Scheduler(config)
    workload = {"r1": (6, 30, 0.0), "r0": (40, 20, 1.0)}  # r0, the newer, is fcfs's victim
    for request_id, (prompt_len, max_tokens, arrival) in workload.items():
        scheduler.add_request(make_request(request_id, prompt_len, max_tokens, arrival=arrival))
    runner = PagedTokenRunner(16, 4, 32)
    outputs, swapped_while_r1_ran = {}, False
    for step in range(500):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule(float(step))
        swapped_while_r1_ran |= any(r.request_id == "r0" for r in scheduler.swapped) and "r1" not in outputs
        for request in scheduler.update_from_output(output, runner.execute(output), float(step)):
            if request.is_finished:
                outputs[request.request_id] = list(request.output_token_ids)
    assert swapped_while_r1_ran
    assert outputs == {request_id: reference_output(make_request(request_id, p, m).prompt_token_ids, m)
                       for request_id, (p, m, _) in workload.items()}
    assert scheduler.block_manager.num_free_blocks == 16
