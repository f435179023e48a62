"""The engine's one frozen configuration, validated on construction.

It names the model folder, the numeric type, the KV cache budget (GiB on the device plus a host
pool for swap preemption), the step limits handed to the scheduler, the attention backend and the
scheduling policy. `num_gpu_blocks` may pin the cache size directly (tests use it to force
preemption); otherwise the block count follows from `kv_cache_memory_gib`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from predictor.paths import SERVED_MODEL_REF, project_root

DType = Literal["float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "triton"]
PreemptionMode = Literal["recompute", "swap"]
DeviceName = Literal["auto", "cpu", "cuda"]


# training/ and scripts/ import it from here.
REPO_ROOT = project_root()
DEFAULT_MODEL = str(REPO_ROOT / SERVED_MODEL_REF)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # folder with config.json, safetensors and tokenizer files
    dtype: DType = "float32"
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
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}")
        if not self.swap_space_gib >= 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib!r}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive or None, got {self.num_gpu_blocks!r}")
        if self.preemption_mode == "swap" and self.swap_space_gib == 0:
            raise ValueError("swap preemption needs swap_space_gib > 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len")
        choices = {
            "dtype": ("float32", "bfloat16", "float16"),
            "device": ("auto", "cpu", "cuda"),
            "attention_backend": ("auto", "torch", "triton"),
            "preemption_mode": ("recompute", "swap"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        reserved = {"num_gpu_blocks", "num_cpu_blocks", "max_num_seqs", "max_num_batched_tokens", "block_size",
                    "max_model_len", "enable_chunked_prefill", "preemption_mode", "policy"}
        if reserved & set(self.scheduler_options):
            raise ValueError(f"set {sorted(reserved & set(self.scheduler_options))} through EngineConfig fields")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive or None, got {self.num_threads!r}")
