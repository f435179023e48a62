"""The engine's one frozen configuration, validated on construction.

It names the model folder, the numeric type, the KV cache budget (GiB on the device plus a host
pool for swap preemption), the step limits handed to the scheduler, the attention backend and the
scheduling policy. `num_gpu_blocks` may pin the cache size directly (tests use it to force
preemption); otherwise the block count follows from `kv_cache_memory_gib`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from predictor.paths import SERVED_MODEL_REF, project_root
from scheduler.config import PreemptionMode, SchedulerConfig
from scheduler.eviction import needs_host_pool
from scheduler.request import SEED_MAX, SEED_MIN, is_int, is_real

DType = Literal["float32", "bfloat16", "float16", "auto"]
AttentionBackendName = Literal["auto", "torch", "triton"]
DeviceName = Literal["auto", "cpu", "cuda"]


# training/ and scripts/ import it from here.
REPO_ROOT = project_root()
DEFAULT_MODEL = str(REPO_ROOT / SERVED_MODEL_REF)
# The served model's hub id, as vLLM users name it (`vllm serve HuggingFaceTB/SmolLM2-135M-Instruct`).
# Nothing is downloaded here: it names the folder `make model` converts the model into.
SERVED_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def model_path(model: str) -> str:
    """The folder a model name names: the served model's hub id names its converted folder (a
    folder of that name, where one exists, wins); any other name is a folder already."""
    return DEFAULT_MODEL if model == SERVED_MODEL_HUB_ID and not Path(model).exists() else model


# The committed default predictor: what serve falls back to without a registered champion, and
# what the simulator and the trace scripts predict with unless told otherwise.
DEFAULT_PREDICTOR = REPO_ROOT / "data" / "predictors" / "default"


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # folder with config.json, safetensors and tokenizer files
    dtype: DType = "float32"  # "auto": the engine picks by device (llm_engine.resolve_dtype)
    device: DeviceName = "auto"
    block_size: int = 16
    kv_cache_memory_gib: float = 1.0  # device memory for the paged KV cache
    swap_space_gib: float = 0.5  # host pool for swap preemption
    num_gpu_blocks: int | None = None  # overrides kv_cache_memory_gib when set
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    policy: str = "fcfs"
    attention_backend: AttentionBackendName = "auto"
    predictor: str | None = None  # path of a saved length predictor, or None
    seed: int = 0  # seeds the generator of requests that bring no seed of their own
    num_threads: int | None = 2  # torch CPU threads; None leaves torch's default
    # Keep freed host memory for reuse (glibc mallopt, process-wide): see engine/host_memory.py.
    retain_host_memory: bool = True
    # Extra SchedulerConfig fields (aging, admission control, ...) passed through unchanged.
    scheduler_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", model_path(self.model))
        # Types too: a float block count, an infinite budget or a float seed passed here and failed
        # inside torch (TypeError, OverflowError, RuntimeError), some after the weights had loaded.
        if not (is_real(self.kv_cache_memory_gib) and math.isfinite(self.kv_cache_memory_gib)
                and self.kv_cache_memory_gib > 0):
            raise ValueError(f"kv_cache_memory_gib must be a finite number > 0, got {self.kv_cache_memory_gib!r}")
        if not (is_real(self.swap_space_gib) and math.isfinite(self.swap_space_gib) and self.swap_space_gib >= 0):
            raise ValueError(f"swap_space_gib must be a finite number >= 0, got {self.swap_space_gib!r}")
        if self.num_gpu_blocks is not None and not (is_int(self.num_gpu_blocks) and self.num_gpu_blocks > 0):
            raise ValueError(f"num_gpu_blocks must be a positive integer or None, got {self.num_gpu_blocks!r}")
        if not (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        choices = {
            "dtype": ("float32", "bfloat16", "float16", "auto"),
            "device": ("auto", "cpu", "cuda"),
            "attention_backend": ("auto", "torch", "triton"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        reserved = {"num_gpu_blocks", "num_cpu_blocks", "max_num_seqs", "max_num_batched_tokens", "block_size",
                    "max_model_len", "enable_chunked_prefill", "preemption_mode", "policy"}
        if reserved & set(self.scheduler_options):
            raise ValueError(f"set {sorted(reserved & set(self.scheduler_options))} through EngineConfig fields")
        self.scheduler_config(num_gpu_blocks=1, num_cpu_blocks=1)  # its own checks, before any weights load
        if needs_host_pool(self.preemption_mode) and self.swap_space_gib == 0:
            raise ValueError(f"{self.preemption_mode} preemption needs swap_space_gib > 0")
        if self.num_threads is not None and not (is_int(self.num_threads) and self.num_threads > 0):
            raise ValueError(f"num_threads must be a positive integer or None, got {self.num_threads!r}")

    def scheduler_config(self, num_gpu_blocks: int, num_cpu_blocks: int) -> SchedulerConfig:
        """The scheduler's configuration for a KV cache of this many device and host blocks."""
        try:
            return SchedulerConfig(
                num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens, block_size=self.block_size,
                max_model_len=self.max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                preemption_mode=self.preemption_mode, policy=self.policy, **self.scheduler_options)
        except TypeError as exc:  # a key SchedulerConfig has no field for
            raise ValueError(f"scheduler_options: {exc}") from None
