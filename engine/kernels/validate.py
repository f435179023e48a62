"""Input checks shared by the Triton wrappers: a clear ValueError instead of a wrong answer.

The kernels compute addresses from strides, so they accept views (e.g. q, k, v sliced out of a
fused qkv projection) as long as the innermost dimension is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttentionShape:
    num_tokens: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    block_size: int
    num_seqs: int


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_float(name: str, tensor: torch.Tensor) -> None:
    _require(tensor.dtype in FLOAT_DTYPES,
             f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
    _require(tensor.stride(-1) == 1, f"{name} must be contiguous in its last dim (head_dim)")


def _check_index(name: str, tensor: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    _require(tensor.dtype == dtype, f"{name} must be {dtype}, got {tensor.dtype}")
    _require(tensor.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    _require(tensor.stride(-1) == 1, f"{name} must be contiguous in its last dim")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Return (num_blocks, block_size, num_kv_heads, head_dim) of a K/V cache pair."""
    _require(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, "
             f"head_dim], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape,
             f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    _require(v_cache.dtype == k_cache.dtype,
             f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    _check_float("k_cache", k_cache)
    _check_float("v_cache", v_cache)
    block_size = k_cache.shape[1]
    _require(block_size > 0 and block_size & (block_size - 1) == 0,
             f"block_size must be a power of two, got {block_size}")
    return tuple(k_cache.shape)  # type: ignore[return-value]


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> AttentionShape:
    _require(q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    _check_float("q", q)
    _, block_size, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    _require(q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    _require(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _require(q.shape[1] % num_kv_heads == 0,
             f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    _check_index("block_tables", block_tables, torch.int32, 2)
    _check_index("seq_lens", seq_lens, torch.int32, 1)
    _check_index("query_start_loc", query_start_loc, torch.int32, 1)
    num_seqs = seq_lens.shape[0]
    _require(block_tables.shape[0] == num_seqs,
             f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    _require(query_start_loc.shape[0] == num_seqs + 1,
             f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
             f"got {query_start_loc.shape[0]}")
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                         ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        _require(tensor.device == q.device, f"{name} is on {tensor.device} but q is on {q.device}")
    return AttentionShape(q.shape[0], q.shape[1], head_dim, num_kv_heads, block_size, num_seqs)


def check_write_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    _require(k.dim() == 3, f"k must be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)}")
    _require(v.shape == k.shape, f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    _check_float("k", k)
    _check_float("v", v)
    _require(k.shape[1:] == (num_kv_heads, head_dim),
             f"k is {tuple(k.shape)} but the cache holds {num_kv_heads} heads of {head_dim}")
    _check_index("slot_mapping", slot_mapping, torch.int64, 1)
    _require(slot_mapping.shape[0] == k.shape[0],
             f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    for name, tensor in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache),
                         ("slot_mapping", slot_mapping)):
        _require(tensor.device == k.device, f"{name} is on {tensor.device} but k is on {k.device}")
