"""Scatter this step's K/V into the paged cache through `slot_mapping`, in Triton.

Layout
    k, v            [num_tokens, num_kv_heads, head_dim]   (views allowed: strides are passed)
    k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping    [num_tokens] int64   slot = block_id * block_size + offset; < 0 means skip
Algorithm
    One program per BLOCK_T tokens (BLOCK_T x heads x dims ~ ELEMENTS_PER_PROGRAM). Each token's
    (kv head, dim) plane is one row of KV_HEADS_PAD * HEAD_DIM_PAD lanes; the slot gives the
    destination block and offset. Values are converted to the cache dtype on store.

Reference: `reference_write_kv` (engine/attention/reference.py, re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.reference import write_kv as reference_write_kv
from engine.kernels.launch import next_power_of_2
from engine.kernels.validate import check_write_inputs

__all__ = ["triton_write_kv", "reference_write_kv"]

# Elements one program moves: enough to amortise a program under the interpreter, few enough
# per thread on a GPU (BLOCK_T tokens x heads x dims).
ELEMENTS_PER_PROGRAM = 2048
MAX_BLOCK_T = 16


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    num_tokens,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_blk, stride_kc_tok, stride_kc_head,
    stride_vc_blk, stride_vc_tok, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_hd = tl.arange(0, KV_HEADS_PAD * HEAD_DIM_PAD)
    offs_h = offs_hd // HEAD_DIM_PAD
    offs_d = offs_hd % HEAD_DIM_PAD
    lane_ok = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    slots = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    token_ok = slots >= 0  # padding tokens carry slot -1
    mask = token_ok[:, None] & lane_ok[None, :]
    block_ids = tl.where(token_ok, slots, 0) // BLOCK_SIZE
    offs_slot = tl.where(token_ok, slots, 0) % BLOCK_SIZE

    src_t = offs_t.to(tl.int64)
    k = tl.load(k_ptr + src_t[:, None] * stride_k_tok + offs_h[None, :] * stride_k_head
                + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + src_t[:, None] * stride_v_tok + offs_h[None, :] * stride_v_head
                + offs_d[None, :], mask=mask)
    # inf and NaN (after the cast to the cache's type, as the reference checks) are stored as 0: a
    # later key's NaN value would otherwise reach earlier rows of a prefill chunk through p @ V
    # with p = 0 (0 * NaN).
    k = k.to(k_cache_ptr.dtype.element_ty)
    v = v.to(v_cache_ptr.dtype.element_ty)
    # A literal 0.0, cast back: a jitted helper (tl.zeros_like included) fails in the test suite,
    # which re-imports this module under the interpreter after it was loaded compiled.
    k = tl.where((k == k) & (tl.abs(k) < float("inf")), k, 0.0).to(k_cache_ptr.dtype.element_ty)
    v = tl.where((v == v) & (tl.abs(v) < float("inf")), v, 0.0).to(v_cache_ptr.dtype.element_ty)
    k_dst = block_ids * stride_kc_blk + offs_slot * stride_kc_tok
    v_dst = block_ids * stride_vc_blk + offs_slot * stride_vc_tok
    tl.store(k_cache_ptr + k_dst[:, None] + offs_h[None, :] * stride_kc_head + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + v_dst[:, None] + offs_h[None, :] * stride_vc_head + offs_d[None, :], v, mask=mask)


def triton_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[i], v[i] into cache slot slot_mapping[i] (in place); negative slots are skipped.

    Same semantics as `reference_write_kv` for slots >= 0, inf and NaN stored as 0 included.
    Raises ValueError on bad inputs.
    """
    check_write_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    lanes = next_power_of_2(num_kv_heads) * next_power_of_2(head_dim)
    block_t = max(1, min(MAX_BLOCK_T, ELEMENTS_PER_PROGRAM // lanes))
    grid = (triton.cdiv(num_tokens, block_t),)
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim), KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_T=block_t,
    )
