"""Tests that kill mutants of the simulator, its figures and the ranking metrics that a mutation
check (session 37) found surviving the rest of the suite."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.simulation import StepCostModel
from test_simulator import COST, synthetic_workload


def test_a_step_cost_with_neither_a_fixed_nor_a_per_token_cost_is_refused() -> None:
    # A step feeds at least one token: a + b > 0 keeps its time positive. a = b = 0 with only a
    # context cost would give a prefill-free decode of an empty context zero time.
    with pytest.raises(ValueError):
        StepCostModel(a_s=0.0, b_s_per_token=0.0, c_s_per_context_token=1e-5)
    assert StepCostModel(a_s=0.0, b_s_per_token=1e-3, c_s_per_context_token=0.0).a_s == 0.0


def test_tau_by_bucket_leaves_out_a_bucket_of_fewer_than_ten_rows() -> None:
    from training import metrics

    true = np.arange(30, dtype=float)
    # Three quantile buckets of 5 rows each: each too small for a tau worth reporting.
    assert metrics.tau_by_bucket(true[:15], true[:15], np.arange(15.0), num_buckets=3) == []
    # Three of exactly 10 rows each: all kept, each perfectly ordered.
    buckets = metrics.tau_by_bucket(true, true, np.arange(30.0), num_buckets=3)
    assert [b.num_examples for b in buckets] == [10, 10, 10]
    assert all(b.kendall_tau == pytest.approx(1.0) for b in buckets)


def test_the_peak_kv_usage_is_the_highest_of_any_step_not_the_last(monkeypatch) -> None:
    from scheduler.config import SchedulerConfig
    from scheduler.scheduler import Scheduler
    from scheduler.simulation import simulate

    seen: list[float] = []
    schedule = Scheduler.schedule

    def recording_schedule(self, now):
        output = schedule(self, now)
        if not output.is_empty:
            seen.append(self.block_manager.usage)
        return output

    monkeypatch.setattr(Scheduler, "schedule", recording_schedule)
    config = SchedulerConfig(num_gpu_blocks=40, block_size=8, max_num_seqs=8, max_num_batched_tokens=96,
                             max_model_len=288, policy="fcfs")
    result = simulate(config, synthetic_workload(40, rate=4.0), COST)
    assert len(seen) == result.num_steps
    assert result.peak_kv_usage == max(seen) and max(seen) > seen[-1]


def test_the_stability_margin_is_sampled_every_64_steps(monkeypatch) -> None:
    from dataclasses import replace

    from scheduler.config import SchedulerConfig
    from scheduler.request import Tier
    from scheduler.scheduler import Scheduler
    from scheduler.simulation import simulate

    step_ends: list[float] = []
    record_step = Scheduler.record_step

    def recording(self, now, *args, **kwargs):
        step_ends.append(now)
        return record_step(self, now, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "record_step", recording)
    config = SchedulerConfig(num_gpu_blocks=400, block_size=8, max_num_seqs=8, max_num_batched_tokens=96,
                             max_model_len=288)
    workload = [replace(r, tier=Tier.STANDARD) for r in synthetic_workload(300, rate=16.0)]
    result = simulate(config, workload, COST)
    assert len(step_ends) == result.num_steps
    every_64th = {step_ends[i] for i in range(63, len(step_ends), 64)}
    times = [time for time, _ in result.stability_margins]
    assert len(times) > 2 and set(times) <= every_64th


def _rejecting(monkeypatch, reject) -> None:
    """Make the scheduler refuse the requests `reject(request)` names, as admission control would."""
    from scheduler.admission import AdmissionRejected
    from scheduler.scheduler import Scheduler

    add_request = Scheduler.add_request

    def add(self, request, *args, **kwargs):
        if reject(request):
            raise AdmissionRejected("test", 1.0)
        return add_request(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "add_request", add)


def test_the_makespan_starts_at_the_first_arrival_even_one_that_was_rejected(monkeypatch) -> None:
    from scheduler.config import SchedulerConfig
    from scheduler.simulation import simulate

    _rejecting(monkeypatch, lambda request: request.request_id == "r0")
    workload = synthetic_workload(20, rate=4.0)
    config = SchedulerConfig(num_gpu_blocks=400, block_size=8, max_num_seqs=8, max_num_batched_tokens=96,
                             max_model_len=288)
    result = simulate(config, workload, COST)
    assert [r.request_id for r in result.records if r.rejected] == ["r0"]
    first_arrival = min(r.arrival_time for r in workload)
    assert first_arrival == workload[0].arrival_time < workload[1].arrival_time
    last_finish = max(r.finish_time for r in result.records if not r.rejected)
    assert result.makespan_s == pytest.approx(last_finish - first_arrival)


def test_a_run_that_rejects_every_request_has_a_zero_makespan(monkeypatch) -> None:
    from scheduler.config import SchedulerConfig
    from scheduler.simulation import simulate

    _rejecting(monkeypatch, lambda request: True)
    config = SchedulerConfig(num_gpu_blocks=400, block_size=8, max_num_seqs=8, max_num_batched_tokens=96,
                             max_model_len=288)
    result = simulate(config, synthetic_workload(5, rate=4.0), COST)
    assert len(result.records) == 5 and all(r.rejected for r in result.records)
    assert result.makespan_s == 0.0 and result.num_steps == 0


def test_standard_slo_attainment_counts_an_end_to_end_exactly_on_the_target() -> None:
    from scheduler.request import Tier
    from scheduler.simulation import RequestRecord
    from training.sim_metrics import tier_figures

    on_target = RequestRecord("a", Tier.STANDARD, 1.0, 10, False, first_scheduled_time=1.0,
                              first_token_time=1.25, finish_time=11.0)  # 10 s end to end: 11.0 - 1.0 is exact
    assert on_target.e2e_s == 10.0
    assert tier_figures([on_target], slo_ttft_s=0.5, slo_e2e_s=10.0)["standard"]["slo_attainment"] == 1.0


def test_an_all_rejected_run_has_no_throughput_figure(monkeypatch) -> None:
    from scheduler.config import SchedulerConfig
    from scheduler.simulation import simulate
    from training.sim_metrics import summarize

    _rejecting(monkeypatch, lambda request: True)
    config = SchedulerConfig(num_gpu_blocks=400, block_size=8, max_num_seqs=8, max_num_batched_tokens=96,
                             max_model_len=288)
    summary = summarize(simulate(config, synthetic_workload(5, rate=4.0), COST))
    assert summary["num_served"] == 0 and summary["num_rejected"] == 5
    assert np.isnan(summary["output_tokens_per_s"])  # no makespan to divide by


def test_a_block_still_held_in_the_host_pool_counts_as_leaked(monkeypatch) -> None:
    from scheduler.block_manager import BlockManager
    from scheduler.config import SchedulerConfig
    from scheduler.simulation import simulate

    init = BlockManager.__init__

    def leaking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.host.allocate(1)  # a swapped-out block nobody releases

    monkeypatch.setattr(BlockManager, "__init__", leaking_init)
    config = SchedulerConfig(num_gpu_blocks=40, block_size=8, max_num_seqs=8, max_num_batched_tokens=96,
                             max_model_len=288, preemption_mode="swap", num_cpu_blocks=200)
    result = simulate(config, synthetic_workload(40, rate=4.0), COST)
    assert result.leaked_blocks == 1


def test_an_oracle_no_faster_than_fcfs_gives_no_share_of_its_gain() -> None:
    from training.sim_metrics import goal_checks

    fcfs = {"mean_e2e_s": 9.0, "p99_e2e_longest10pct_s": 20.0, "output_tokens_per_s": 100.0, "max_wait_s": 5.0,
            "num_rejected": 0}
    sjf = {**fcfs, "mean_e2e_s": 3.0}
    checks = goal_checks({"fcfs": fcfs, "sjf": sjf, "oracle": dict(fcfs)}, aging_bound_s=10.0)
    # A gain of exactly 0 (log 1): no share to divide out, and no goal claimed.
    assert checks["sjf_share_of_oracle_gain"] is None and checks["fcfs_over_oracle_mean_e2e"] == 1.0
    assert checks["meets_oracle_share_60pct"] is None


def test_simultaneous_arrivals_reach_admission_in_request_id_order() -> None:
    # Same arrival time: "a" is offered first (by id, not by size), fills the queue budget, and
    # the later-offered "b" is shed; offering the smaller "b" first would shed "a" instead.
    from scheduler.config import SchedulerConfig
    from scheduler.simulation import SimRequest, simulate

    config = SchedulerConfig(num_gpu_blocks=40, block_size=8, max_num_seqs=4, max_num_batched_tokens=96,
                             max_model_len=288, enable_admission=True, max_queued_tokens=100)
    workload = [SimRequest("b", 0.0, prompt_tokens=10, output_tokens=10, predicted_len=10.0, max_tokens=20),
                SimRequest("a", 0.0, prompt_tokens=100, output_tokens=10, predicted_len=10.0, max_tokens=20)]
    result = simulate(config, workload, COST)
    assert [r.request_id for r in result.records if r.rejected] == ["b"]


def test_an_oracle_gain_exactly_at_the_floor_is_judged() -> None:
    import math

    from training.sim_metrics import ORACLE_GAIN_FLOOR, goal_checks

    fcfs = {"mean_e2e_s": 10.2, "p99_e2e_longest10pct_s": 20.0, "output_tokens_per_s": 100.0, "max_wait_s": 5.0,
            "num_rejected": 0}
    sjf = {**fcfs, "mean_e2e_s": 10.2 / 1.015}
    checks = goal_checks({"fcfs": fcfs, "sjf": sjf, "oracle": {**fcfs, "mean_e2e_s": 10.0}}, aging_bound_s=10.0)
    assert checks["fcfs_over_oracle_mean_e2e"] == ORACLE_GAIN_FLOOR  # 1.02 exactly: "below the floor" is not
    assert "oracle_share_note" not in checks
    assert checks["sjf_share_of_oracle_gain"] == pytest.approx(math.log(1.015) / math.log(1.02))
    assert checks["meets_oracle_share_60pct"] is True
