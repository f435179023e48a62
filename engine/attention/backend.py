"""The attention backend, chosen once when the engine starts.

"torch" is the reference in engine/attention/reference.py (the CPU path); "triton" is the paged
attention kernel in engine/kernels (imported lazily, so the CPU path never needs Triton to
compile). "auto" picks Triton when CUDA is available or TRITON_INTERPRET=1 is set (the Triton
interpreter then runs the kernels on the CPU, slowly; tests use it), else the torch reference;
"triton" asked for without either is refused. The interpreter's bfloat16 arithmetic is wrong (its
fp32-to-bf16 store truncates instead of rounding), so there "auto" takes the reference for a
bf16 model and "triton" is refused.

A backend prepares a per-step plan once (`prepare`) and every layer calls `forward` with it.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from engine.attention import reference
from engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def prepare(self, metadata: AttentionMetadata) -> object: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata, plan: object,
                scale: float) -> torch.Tensor: ...


class TorchReferenceBackend:
    name = "torch"

    def __init__(self, heads_per_kv: int) -> None:
        self.heads_per_kv = heads_per_kv

    def prepare(self, metadata: AttentionMetadata) -> reference.ReferencePlan:
        return reference.build_plan(metadata.block_tables, metadata.seq_lens_host,
                                    metadata.query_start_loc_host, metadata.block_size, self.heads_per_kv)

    def forward(self, q, k, v, k_cache, v_cache, metadata, plan, scale):
        reference.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return reference.attend(q, k_cache, v_cache, plan, scale)


class TritonBackend:
    name = "triton"

    def __init__(self) -> None:
        from engine.kernels import paged_attention as kernels

        self._kernels = kernels

    def prepare(self, metadata: AttentionMetadata) -> dict[str, int]:
        # Host-side maxima once per step, so no layer pays a device-to-host sync for them.
        starts = metadata.query_start_loc_host
        max_query_len = max((end - start for start, end in zip(starts, starts[1:])), default=0)
        return {"max_query_len": max_query_len, "max_seq_len": max(metadata.seq_lens_host, default=0)}

    def forward(self, q, k, v, k_cache, v_cache, metadata, plan, scale):
        self._kernels.triton_write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self._kernels.triton_paged_attention(q, k_cache, v_cache, metadata.block_tables,
                                                    metadata.seq_lens, metadata.query_start_loc, scale,
                                                    **plan)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """"auto" made concrete; ValueError for "triton" where its kernels cannot run, or would run
    wrongly (the engine would start, then fail or corrupt every request)."""
    interpreted = device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1"
    runs_triton = device.type == "cuda" or (interpreted and dtype != torch.bfloat16)
    if name == "auto":
        return "triton" if runs_triton else "torch"
    if name == "triton" and not runs_triton:
        if interpreted:
            raise ValueError("the Triton interpreter computes bfloat16 wrongly: use --dtype float32 or "
                             "float16 with the triton backend, or --attention-backend torch")
        raise ValueError("the triton backend needs a CUDA GPU (or TRITON_INTERPRET=1); "
                         "use --attention-backend torch")
    return name


def create_backend(name: str, device: torch.device, heads_per_kv: int,
                   dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """`heads_per_kv`: query heads sharing one KV head (the GQA group size)."""
    resolved = resolve_backend_name(name, device, dtype)
    if resolved == "torch":
        return TorchReferenceBackend(heads_per_kv)
    if resolved == "triton":
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}")
