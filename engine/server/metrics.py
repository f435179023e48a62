"""Prometheus metrics with vLLM-like names under a `lengthwise:` prefix.

Each app owns a private CollectorRegistry (no process-global state, so tests can start several
servers). Two sources feed it:
- events from the async engine (admitted, rejected, each request's outputs, prediction batches,
  finished requests), recorded into counters and per-tier histograms as they happen (ServerMetrics
  is the engine's EngineListener). As in vLLM, TTFT is observed when the first token comes, and
  the inter-token latency once per token after the first; the queue time is observed with the
  first token too (vLLM's code waits for the request to finish), so that an aborted request that
  had one counts and a scrape during a long run is not behind by whole requests. The end-to-end
  latency and a request's mean time per output token are observed when it finishes;
- the engine's latest stats snapshot (running, waiting, KV usage, preemptions, stability margin),
  read at scrape time by a custom collector, together with Kendall's tau of predicted against
  actual output length over the most recently finished requests.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from scipy.stats import kendalltau

from predictor.base import Prediction
from scheduler.admission import AdmissionRejected
from scheduler.request import Tier

if TYPE_CHECKING:
    from engine.outputs import RequestOutput

PREFIX = "lengthwise:"
TAU_WINDOW = 256  # finished requests kept for the rank correlation
# Up past the 1,800 s request timeout: on this CPU a third or more of a saturating benchmark's
# requests took over 160 s, the old top bucket, so every tail quantile read 160 s.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
                   1280.0, 2560.0, 7680.0)
# Up to vLLM's 80 s: a token after a recompute preemption's wait, or an engine step stalled by an
# inline predictor batch, must land below a finite bound too.
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
# A probe predictor scores a batch of 64 prompts in 2-5 s on a CPU: the top buckets hold it.
PREDICT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def kendall_tau(pairs: list[tuple[float, float]]) -> float | None:
    """Kendall's tau-b of the pairs, or None when it is undefined (too few, or a constant side)."""
    if len(pairs) < 2:
        return None
    tau = kendalltau([p for p, _ in pairs], [a for _, a in pairs]).statistic
    return None if math.isnan(tau) else float(tau)


def _stat(stats: Any, *names: str) -> float | None:
    """The first of `names` the stats snapshot carries, at its top level or in its `scheduler` part."""
    nested = getattr(stats, "scheduler", None)
    for name in names:
        if nested is not None and getattr(nested, name, None) is not None:
            return float(getattr(nested, name))
        value = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
        if value is not None:
            return float(value)
    return None


class _EngineStateCollector(Collector):
    """Reads the engine's latest stats snapshot and the tau window when Prometheus scrapes."""

    def __init__(self, model_name: str, stats: Callable[[], Any],
                 tau_pairs: deque[tuple[float, float]], pending: Callable[[], int | None]) -> None:
        self._model_name = model_name
        self._stats = stats
        self._tau_pairs = tau_pairs
        self._pending = pending

    def _gauge(self, name: str, doc: str, value: float | None) -> Iterator[Metric]:
        if value is not None:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family

    def _counter(self, name: str, doc: str, value: float | None) -> Iterator[Metric]:
        if value is not None:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is not None:
            yield from self._gauge("num_requests_running", "Requests in the running batch.",
                                   _stat(stats, "num_running"))
            yield from self._gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                                   _stat(stats, "num_waiting"))
            yield from self._gauge("num_requests_swapped", "Requests swapped out to the host pool.",
                                   _stat(stats, "num_swapped"))
        # Not the scheduler's: queued for the predictor and the engine thread. Their queue time
        # and TTFT count this wait, which num_requests_waiting alone leaves out.
        yield from self._gauge("num_requests_pending", "Requests accepted and not yet queued in the scheduler "
                               "(waiting for the length predictor or the engine thread).", self._pending())
        if stats is not None:
            yield from self._gauge("kv_cache_usage_perc", "Share of KV cache blocks in use (0-1).",
                                   _stat(stats, "kv_usage", "kv_cache_usage"))
            # vLLM's (v0) name; only a server that swaps (--preemption-mode swap) has the pool.
            yield from self._gauge("cpu_cache_usage_perc", "Share of the host swap pool's KV blocks in use (0-1).",
                                   _stat(stats, "host_kv_usage"))
            yield from self._gauge("stability_margin", "Offered load over capacity, in tokens, seats or KV "
                                   "cache, whichever binds; above 1 the queue cannot drain.",
                                   _stat(stats, "stability_margin"))
            yield from self._counter("num_preemptions", "Cumulative preemptions.", _stat(stats, "num_preemptions"))
            yield from self._counter("prefix_cache_queries", "Tokens looked up in the prefix cache on admission "
                                     "(with --enable-prefix-caching); a request resumed by recompute "
                                     "is not counted again, as in vLLM.", _stat(stats, "prefix_cache_queries"))
            yield from self._counter("prefix_cache_hits", "Of those, tokens found cached.",
                                     _stat(stats, "prefix_cache_hits"))
        yield from self._gauge("predictor_kendall_tau", "Kendall's tau of the predicted ranking length against "
                               f"actual output tokens over the last {TAU_WINDOW} finished requests.",
                               kendall_tau(list(self._tau_pairs)))


class ServerMetrics:
    """The app's metrics; implements the async engine's EngineListener."""

    def __init__(self, model_name: str, stats: Callable[[], Any], info: dict[str, str] | None = None,
                 pending: Callable[[], int | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # How the server runs (policy, predictor, backend), so a benchmark can record it.
        Info(PREFIX + "server", "Server configuration.", registry=self.registry).info(
            {"model_name": model_name, **(info or {})})
        self._model_name = model_name
        self._tau_pairs: deque[tuple[float, float]] = deque(maxlen=TAU_WINDOW)
        self._last_token_time: dict[str, float] = {}  # live requests that have their first token
        self.registry.register(_EngineStateCollector(model_name, stats, self._tau_pairs, pending))
        labels = ["model_name"]
        tiered = ["model_name", "tier"]
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled (a request's, when its "
                                     "first token is out, as vLLM counts them).", labels, registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels, registry=reg)
        self.rejections = Counter(PREFIX + "admission_rejections",
                                  "Engine requests refused by admission control (a request for n choices counts n).",
                                  tiered, registry=reg)
        self.finished = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["model_name", "tier", "finished_reason"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              tiered, buckets=LATENCY_BUCKETS, registry=reg)
        # vLLM's names: the first is observed per token (its older name for the inter-token
        # latency), the second per request.
        self.itl = Histogram(PREFIX + "time_per_output_token_seconds", "Time between consecutive output "
                             "tokens, one observation per token after the first.", tiered,
                             buckets=TOKEN_BUCKETS, registry=reg)
        self.request_tpot = Histogram(PREFIX + "request_time_per_output_token_seconds", "A finished request's "
                                      "mean time per output token after the first.", tiered,
                                      buckets=TOKEN_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             tiered, buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.",
                                    tiered, buckets=LATENCY_BUCKETS, registry=reg)
        self.predictor_latency = Histogram(PREFIX + "predictor_latency_seconds", "Time to score one "
                                           "batch of prompts.", labels, buckets=PREDICT_BUCKETS, registry=reg)
        # With it, seconds per prompt = predictor_latency_seconds_sum / predictor_prompts_total.
        self.predictor_prompts = Counter(PREFIX + "predictor_prompts", "Prompts scored by the predictor.",
                                         labels, registry=reg)
        # Zero-valued series exist from the start, so dashboards and rate() see a refusal-free
        # server as 0 rather than as missing data, and increase() counts a series' first event.
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)
        for tier in Tier:
            self.rejections.labels(model_name, tier.name.lower())
            for reason in ("stop", "length", "abort"):  # vLLM's three; "error" only after a failure
                self.finished.labels(model_name, tier.name.lower(), reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- EngineListener --------------------------------------------------------------------------
    def on_admitted(self, tier: Tier, num_prompt_tokens: int) -> None:
        """Nothing is counted yet: a request may leave, or be drained, before its prefill (its
        prompt tokens count with its first token)."""

    def on_rejected(self, tier: Tier, error: Exception) -> None:
        if isinstance(error, AdmissionRejected):
            self.rejections.labels(self._model_name, tier.name.lower()).inc()

    def on_output(self, output: RequestOutput, tier: Tier) -> None:
        num_new = len(output.new_token_ids)
        if num_new == 0:
            return
        self.generation_tokens.labels(self._model_name).inc(num_new)
        labels = (self._model_name, tier.name.lower())
        now = output.report_time if output.report_time is not None else output.first_token_time
        previous = self._last_token_time.get(output.request_id)
        if output.finished:
            self._last_token_time.pop(output.request_id, None)
        elif now is not None:
            self._last_token_time[output.request_id] = now
        if previous is None:  # this output holds the first token
            self._observe_first_token(output, labels)
            num_new -= 1
        if previous is not None and now is not None and num_new > 0:
            gap = max(0.0, now - previous) / num_new
            for _ in range(num_new):
                self.itl.labels(*labels).observe(gap)

    def _observe_first_token(self, output: RequestOutput, labels: tuple[str, str]) -> None:
        self.prompt_tokens.labels(self._model_name).inc(len(output.prompt_token_ids))
        arrival = output.arrival_time
        if output.first_token_time is not None:
            self.ttft.labels(*labels).observe(max(0.0, output.first_token_time - arrival))
        if output.first_scheduled_time is not None:
            self.queue_time.labels(*labels).observe(max(0.0, output.first_scheduled_time - arrival))

    def on_aborted(self, request_id: str, tier: Tier, reason: str = "abort") -> None:
        """A request ended without a finished output: aborted, or failed with the engine ("error")."""
        self._last_token_time.pop(request_id, None)
        self.finished.labels(self._model_name, tier.name.lower(), reason).inc()

    def on_prediction(self, latency_s: float, batch_size: int) -> None:
        self.predictor_latency.labels(self._model_name).observe(latency_s)
        self.predictor_prompts.labels(self._model_name).inc(batch_size)

    def on_finished(self, output: RequestOutput, tier: Tier, prediction: Prediction | None) -> None:
        labels = (self._model_name, tier.name.lower())
        self.finished.labels(*labels, output.finish_reason or "unknown").inc()
        if output.finish_reason == "abort":
            return
        first, finish = output.first_token_time, output.finish_time
        if first is not None and finish is not None and len(output.token_ids) > 1:
            self.request_tpot.labels(*labels).observe(max(0.0, finish - first) / (len(output.token_ids) - 1))
        if finish is not None:
            self.e2e.labels(*labels).observe(max(0.0, finish - output.arrival_time))
        if prediction is not None:
            # The predicted ranking length, the order the scheduler uses, but not clamped to max_tokens as
            # the scheduler's key is: in a benchmark with ignore_eos, max_tokens is the true
            # length, and with clamping a served sjf run reported 0.75 where unclamped gave 0.39.
            self._tau_pairs.append((prediction.rank_len, float(len(output.token_ids))))
