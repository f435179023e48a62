"""The scheduler's one frozen configuration, validated on construction.

Limits of a step (seats, token budget), the paged KV geometry, the preemption mode, the ordering
policy by name and its knobs (aging, SRPT preemption share, goodput), and admission control.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scheduler.eviction import EVICTIONS, needs_host_pool

PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    num_gpu_blocks: int  # KV blocks on the device; the binding memory budget
    max_num_seqs: int = 32  # seats: requests that may hold a place in one step's batch
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prefill chunks)
    block_size: int = 16  # tokens per KV block; a power of two
    num_cpu_blocks: int = 0  # host pool for swap preemption
    max_model_len: int = 2048  # prompt + output tokens of one request
    # When False a prefill is scheduled whole, so the budget must hold the longest request.
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    # vLLM's automatic prefix caching (prefix_cache.py): full KV blocks are found again by their
    # tokens, so a prompt that starts as an earlier one did skips that part of its prefill. Off by
    # default here, so the simulator and the measured benchmarks keep their figures.
    enable_prefix_caching: bool = False
    policy: str = "fcfs"
    # A new (or recompute-resumed) request is admitted only if this share of the device blocks
    # stays free after its whole prefill, so running requests can grow a while before anyone is
    # preempted: without it, a full cache admits a prefill that the next decode step preempts again.
    kv_watermark: float = 0.05

    # sjf / srpt anti-starvation: a waiting request's length score falls by `rate` tokens per second
    # waited, so its order equals arrival_time + length / rate (length: the predicted ranking
    # length) and a request is never overtaken by one arriving more than length / rate seconds
    # later (a bound on overtaking, not on the wait itself). None: the rate is
    # `aging_tokens_per_step` per measured step (a decoding seat gains one token per step), so the
    # bound is a multiple of the request's own predicted decode time however fast or slow the
    # hardware is. A fixed rate mis-scales: 20 tokens/s turned sjf back into FCFS once CPU queues
    # reached minutes.
    # 0.25 (a bound of four times the predicted decode time) kept the longest tenth's p99 within 2x
    # of FCFS's on Poisson and bursty simulated loads, capturing 88% of the oracle's gain at load
    # 1.0 and 35% under bursts; 1.0 captured 12% under bursts, 0 (pure SJF) made that p99 4-5x
    # (README, simulator).
    aging_tokens_per_s: float | None = None
    aging_tokens_per_step: float = 0.25
    # srpt: a running request past this share of its ranking length is never preempted for
    # a shorter waiting one (limited preemption; tier preemption still applies).
    srpt_max_preempt_share: float = 0.5
    # srpt: a waiting request must be this many times shorter than the running one to preempt it,
    # so near-equal requests do not thrash.
    srpt_preempt_ratio: float = 4.0
    # goodput: seconds per step, which turns the steps a request still needs into time (one per
    # predicted remaining token; for an interactive request, its prefill chunks to the first
    # token), and the slack (seconds) below which a request with a deadline is treated as urgent.
    # None: the measured mean step time (no cost before the first step), as aging reads it. A
    # fixed 0.05 s called a 100-token request 2 s from its deadline on a CPU whose steps take
    # 0.16 s, where it had already missed it.
    goodput_step_time_s: float | None = None
    goodput_urgent_slack_s: float = 2.0

    # Admission control (scheduler/admission.py); off unless enabled.
    enable_admission: bool = False
    slo_ttft_interactive_s: float = 0.5
    slo_e2e_standard_s: float = 10.0
    # Bound on the token work waiting (prompt + predicted output tokens), checked for every tier;
    # None: checked for batch requests only, at the KV cache's tokens times
    # `queue_bound_kv_multiple` (a batch request is admitted while the work queued in every tier
    # stays below `batch_shed_share` of it). Batch work has no latency SLO and is held back by
    # this bound alone, so it always has one: unbounded, a batch flood queued without limit while
    # standard requests got 429s.
    max_queued_tokens: int | None = None
    queue_bound_kv_multiple: float = 4.0
    batch_shed_share: float = 0.5  # batch work is admitted only below this share of the bound
    throughput_ewma_alpha: float = 0.1
    stability_window_s: float = 10.0
    # The best step's token rate stands for capacity, halving every this many seconds: a lone
    # decode running past the window must not make the server look as slow as its demand.
    capacity_half_life_s: float = 600.0

    def __post_init__(self) -> None:
        positive = ("num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "block_size",
                    "max_model_len")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # As vLLM refuses: every seat decodes one token a step, so seats past the budget stay empty.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs})")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len "
                             f"({self.max_num_batched_tokens} < {self.max_model_len})")
        if self.preemption_mode not in EVICTIONS:
            raise ValueError(f"preemption_mode must be one of {', '.join(EVICTIONS)}, got {self.preemption_mode!r}")
        if needs_host_pool(self.preemption_mode) and self.num_cpu_blocks == 0:
            raise ValueError(f"{self.preemption_mode} preemption needs num_cpu_blocks > 0")
        from scheduler.policies import POLICIES  # the registry imports this module

        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        self._validate_policy_knobs()

    def _validate_policy_knobs(self) -> None:
        if not self.goodput_urgent_slack_s >= 0:
            raise ValueError(f"goodput_urgent_slack_s must be >= 0, got {self.goodput_urgent_slack_s!r}")
        for name in ("slo_ttft_interactive_s", "slo_e2e_standard_s"):  # 0 s: a target no request meets
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.goodput_step_time_s is not None and not self.goodput_step_time_s >= 0:
            raise ValueError(f"goodput_step_time_s must be >= 0 or None, got {self.goodput_step_time_s!r}")
        if not self.queue_bound_kv_multiple > 0:
            raise ValueError(f"queue_bound_kv_multiple must be > 0, got {self.queue_bound_kv_multiple!r}")
        if not self.aging_tokens_per_step >= 0:
            raise ValueError(f"aging_tokens_per_step must be >= 0, got {self.aging_tokens_per_step!r}")
        if self.aging_tokens_per_s is not None and not self.aging_tokens_per_s >= 0:
            raise ValueError(f"aging_tokens_per_s must be >= 0 or None, got {self.aging_tokens_per_s!r}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if not 0.0 <= self.srpt_max_preempt_share <= 1.0:
            raise ValueError(f"srpt_max_preempt_share must be in [0, 1], got {self.srpt_max_preempt_share}")
        if self.srpt_preempt_ratio < 1.0:
            raise ValueError(f"srpt_preempt_ratio must be >= 1, got {self.srpt_preempt_ratio}")
        if not 0.0 < self.batch_shed_share <= 1.0:
            raise ValueError(f"batch_shed_share must be in (0, 1], got {self.batch_shed_share}")
        if not 0.0 < self.throughput_ewma_alpha <= 1.0:
            raise ValueError(f"throughput_ewma_alpha must be in (0, 1], got {self.throughput_ewma_alpha}")
        if self.stability_window_s <= 0:
            raise ValueError(f"stability_window_s must be > 0, got {self.stability_window_s}")
        if self.capacity_half_life_s <= 0:
            raise ValueError(f"capacity_half_life_s must be > 0, got {self.capacity_half_life_s}")
        if self.max_queued_tokens is not None and self.max_queued_tokens <= 0:
            raise ValueError(f"max_queued_tokens must be positive or None, got {self.max_queued_tokens}")

    @property
    def queued_token_bound(self) -> float:
        """The admission queue's bound in tokens: `max_queued_tokens`, else the KV cache's tokens
        times `queue_bound_kv_multiple`."""
        if self.max_queued_tokens is not None:
            return float(self.max_queued_tokens)
        return self.queue_bound_kv_multiple * self.num_gpu_blocks * self.block_size
