"""The server's Prometheus metrics, fed by hand-made engine outputs: what is observed, and when."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import RequestOutput
from engine.server.metrics import ServerMetrics
from scheduler.request import Tier

MODEL = "tiny"


def samples_of(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def total(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def step_output(request_id: str, num_tokens: int, report_time: float, finished: bool = False,
                arrival: float = 0.0) -> RequestOutput:
    """The output after the step at `report_time`, which produced token number `num_tokens`; the
    first token came at arrival + 1 s, the first seat at arrival + 0.5 s."""
    return RequestOutput(request_id, (1, 2), (7,) * num_tokens, (7,), "", "", finished,
                         "length" if finished else None, arrival, arrival + 0.5, arrival + 1.0,
                         report_time if finished else None, report_time=report_time)


def test_first_token_inter_token_and_end_to_end_are_observed_when_they_happen():
    metrics = ServerMetrics(MODEL, lambda: None)
    times = [1.0, 1.25, 1.5, 2.0, 3.0]  # five tokens, gaps 0.25, 0.25, 0.5, 1.0
    for n, t in enumerate(times[:-1], start=1):
        metrics.on_output(step_output("a", n, t), Tier.STANDARD)
        if n == 1:  # TTFT and queue time as soon as the first token is out, before the request ends
            early = samples_of(metrics)
            assert total(early, "lengthwise:time_to_first_token_seconds_count") == 1
            assert total(early, "lengthwise:time_to_first_token_seconds_sum") == pytest.approx(1.0)
            assert total(early, "lengthwise:request_queue_time_seconds_sum") == pytest.approx(0.5)
    final = step_output("a", 5, times[-1], finished=True)
    metrics.on_output(final, Tier.STANDARD)
    metrics.on_finished(final, Tier.STANDARD, None)
    samples = samples_of(metrics)
    assert total(samples, "lengthwise:time_per_output_token_seconds_count") == 4
    assert total(samples, "lengthwise:time_per_output_token_seconds_sum") == pytest.approx(2.0)
    assert total(samples, "lengthwise:request_time_per_output_token_seconds_count") == 1
    assert total(samples, "lengthwise:request_time_per_output_token_seconds_sum") == pytest.approx(0.5)
    assert total(samples, "lengthwise:time_to_first_token_seconds_count") == 1
    assert total(samples, "lengthwise:e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    assert total(samples, "lengthwise:generation_tokens_total") == 5
    assert total(samples, "lengthwise:prompt_tokens_total") == 2  # once, with the first token
    assert not metrics._last_token_time  # nothing kept for a finished request


def test_every_tier_and_finish_reason_has_a_zero_series_from_the_start():
    # A series born at 1 hides its first event from Prometheus' increase() and rate().
    samples = samples_of(ServerMetrics(MODEL, lambda: None))
    for tier in ("interactive", "standard", "batch"):
        for reason in ("stop", "length", "abort"):
            key = ("lengthwise:request_success_total",
                   (("finished_reason", reason), ("model_name", MODEL), ("tier", tier)))
            assert samples[key] == 0
        assert total(samples, "lengthwise:admission_rejections_total", tier=tier) == 0


def test_prompt_tokens_count_when_the_prefill_is_done_not_at_admission():
    # As vLLM counts them: a request that leaves before its first token was never prefilled.
    metrics = ServerMetrics(MODEL, lambda: None)
    metrics.on_admitted(Tier.STANDARD, 2)
    metrics.on_aborted("gone", Tier.STANDARD)
    assert total(samples_of(metrics), "lengthwise:prompt_tokens_total") == 0
    metrics.on_admitted(Tier.STANDARD, 2)
    metrics.on_output(step_output("a", 1, 1.0), Tier.STANDARD)
    assert total(samples_of(metrics), "lengthwise:prompt_tokens_total") == 2


def test_an_aborted_request_keeps_its_first_token_and_leaves_nothing_behind():
    metrics = ServerMetrics(MODEL, lambda: None)
    metrics.on_output(step_output("a", 1, 1.0), Tier.INTERACTIVE)
    metrics.on_output(step_output("a", 2, 1.5), Tier.INTERACTIVE)
    metrics.on_aborted("a", Tier.INTERACTIVE)
    samples = samples_of(metrics)
    assert total(samples, "lengthwise:time_to_first_token_seconds_count", tier="interactive") == 1
    assert total(samples, "lengthwise:request_success_total", finished_reason="abort") == 1
    assert total(samples, "lengthwise:e2e_request_latency_seconds_count") == 0
    assert not metrics._last_token_time


def test_long_latencies_land_in_finite_buckets():
    # A saturated CPU server has requests of several minutes; the top bucket must not flatten them.
    metrics = ServerMetrics(MODEL, lambda: None)
    for arrival, finish in ((0.0, 300.0), (0.0, 1500.0)):
        final = step_output(f"r{finish}", 3, finish, finished=True, arrival=arrival)
        metrics.on_finished(final, Tier.STANDARD, None)
    counts = {float(dict(ls)["le"]): v for (n, ls), v in samples_of(metrics).items()
              if n == "lengthwise:e2e_request_latency_seconds_bucket"}
    finite = {le: v for le, v in counts.items() if le != float("inf")}
    assert 1 in finite.values() and 2 in finite.values()  # each request below a finite bound
    assert all(v == 0 for le, v in finite.items() if le < 300.0)
    # A token 60 s after the one before it (a wait after a preemption) too.
    metrics.on_output(step_output("slow", 1, 1.0), Tier.STANDARD)
    metrics.on_output(step_output("slow", 2, 61.0), Tier.STANDARD)
    token_counts = {float(dict(ls)["le"]): v for (n, ls), v in samples_of(metrics).items()
                    if n == "lengthwise:time_per_output_token_seconds_bucket"}
    assert token_counts[80.0] == 1 and token_counts[40.0] == 0


def test_prompts_scored_are_counted_beside_the_batch_latency():
    metrics = ServerMetrics(MODEL, lambda: None)
    metrics.on_prediction(0.032, 32)
    metrics.on_prediction(0.010, 1)
    metrics.on_prediction(2.4, 64)  # a probe's batch: it had landed in +Inf, past a 1 s top bucket
    samples = samples_of(metrics)
    assert total(samples, "lengthwise:predictor_prompts_total") == 97
    assert total(samples, "lengthwise:predictor_latency_seconds_count") == 3
    counts = {float(dict(ls)["le"]): v for (n, ls), v in samples.items()
              if n == "lengthwise:predictor_latency_seconds_bucket"}
    assert counts[2.5] == 3 and counts[1.0] == 2


def test_the_engine_state_gauges_read_the_schedulers_snapshot_stability_margin_included():
    from engine.llm_engine import EngineStats
    from scheduler.config import SchedulerConfig
    from scheduler.request import Request, SamplingParams
    from scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_num_seqs=2, max_num_batched_tokens=64))
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [1] * 20, SamplingParams(max_tokens=50), arrival_time=0.1 * i,
                                      predicted_len=40.0), now=0.1 * i)
    scheduler.schedule(0.3)
    scheduler.record_step(0.5, 64, 0.2)
    snapshot = scheduler.stats(0.5)
    assert snapshot.stability_margin is not None and snapshot.stability_margin > 0
    stats = EngineStats(snapshot, num_steps=1, step_time_s=0.2, forward_time_s=0.1, num_generated_tokens=0)
    samples = samples_of(ServerMetrics(MODEL, lambda: stats))
    expected = {"stability_margin": snapshot.stability_margin, "num_requests_running": snapshot.num_running,
                "num_requests_waiting": snapshot.num_waiting, "num_requests_swapped": 0,
                "kv_cache_usage_perc": snapshot.kv_usage, "num_preemptions_total": 0}
    for name, value in expected.items():
        assert total(samples, "lengthwise:" + name, model_name=MODEL) == pytest.approx(value), name
    assert (snapshot.num_running, snapshot.num_waiting) == (2, 1) and 0 < snapshot.kv_usage < 1
    # No arrival yet: no load is offered, and the gauge reads 0 (a fresh server exported none,
    # which dashboards read as no data).
    idle = Scheduler(SchedulerConfig(num_gpu_blocks=8)).stats(0.0)
    assert idle.stability_margin == 0.0
    idle_samples = samples_of(ServerMetrics(MODEL, lambda: EngineStats(idle, 0, 0.0, 0.0, 0)))
    assert [value for (name, _), value in idle_samples.items() if name == "lengthwise:stability_margin"] == [0.0]
    # Arrivals before any step: no capacity measured to compare them with, so no gauge.
    arrived = Scheduler(SchedulerConfig(num_gpu_blocks=8))
    arrived.add_request(Request("a", [1] * 20, SamplingParams(max_tokens=50), arrival_time=0.0, predicted_len=40.0),
                        now=0.0)
    assert arrived.stats(0.0).stability_margin is None
    assert total(idle_samples, "lengthwise:num_requests_waiting") == 0
    # The host swap pool's usage only where there is a pool (vLLM v0's cpu_cache_usage_perc).
    assert not any(name == "lengthwise:cpu_cache_usage_perc" for name, _ in idle_samples)
    swapping = Scheduler(SchedulerConfig(num_gpu_blocks=8, num_cpu_blocks=4, preemption_mode="swap")).stats(0.0)
    swap_samples = samples_of(ServerMetrics(MODEL, lambda: EngineStats(swapping, 0, 0.0, 0.0, 0)))
    assert total(swap_samples, "lengthwise:cpu_cache_usage_perc", model_name=MODEL) == 0.0


def test_an_idle_engine_thread_renews_the_stats_the_gauges_read(monkeypatch):
    # The stability margin is over a window of time: an idle thread that waited for a command
    # before renewing its snapshot kept the last margin under load on /metrics for good.
    import queue
    import threading
    import time

    from engine import engine_worker
    from engine.engine_commands import Stop

    class IdleEngine:
        renewals = 0

        def stats(self):
            self.renewals += 1
            return self.renewals

        def has_unfinished_requests(self):
            return False

    monkeypatch.setattr(engine_worker, "IDLE_STATS_REFRESH_S", 0.01)
    commands = queue.SimpleQueue()
    worker = engine_worker.EngineWorker(IdleEngine(), commands, None, on_outputs=lambda outputs: None,
                                        on_failure=lambda message: None)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while worker.stats < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    renewed = worker.stats
    commands.put(Stop())
    thread.join(timeout=30)
    assert renewed >= 3 and not thread.is_alive()  # renewed with no command queued, and still stops


def test_requests_not_yet_in_the_scheduler_are_exported_as_pending():
    # Queued for the predictor or the engine thread, they waited unseen: num_requests_waiting reads
    # the scheduler's queue only, while their queue time and TTFT count the wait.
    metrics = ServerMetrics(MODEL, lambda: None, pending=lambda: 3)
    assert total(samples_of(metrics), "lengthwise:num_requests_pending") == 3
    unknown = samples_of(ServerMetrics(MODEL, lambda: None))  # no engine to ask: no series, not a made-up 0
    assert not any(name == "lengthwise:num_requests_pending" for name, _ in unknown)
