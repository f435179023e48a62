"""Paged attention over a varlen batch of decode tokens and prefill chunks, in Triton.

Layout (the engine's attention contract)
    q               [num_tokens, num_heads, head_dim]   the step's tokens, sequences concatenated
    k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]   one layer's paged cache
    block_tables    [num_seqs, max_blocks] int32   logical block -> physical block
    seq_lens        [num_seqs] int32   context length after this step's tokens
    query_start_loc [num_seqs + 1] int32   sequence b owns q[query_start_loc[b]:query_start_loc[b+1]]
    out             [num_tokens, num_heads, head_dim]
Query i of sequence b (q_len_b tokens) sits at position seq_lens[b] - q_len_b + i and attends
causally to keys 0..position; this step's K/V are already in the cache (see write_kv.py).

Algorithm
    One program per (sequence, KV head, query tile, KV split). The tile's BLOCK_M rows are
    BLOCK_Q query tokens x the GROUP query heads that share the KV head (GQA packing, padded to
    GROUP_PAD), so each K/V tile is read once for the whole group: on decode the kernel streams
    every byte of K/V once. The program walks its keys BLOCK_N at a time; each key's address comes
    through the block table (slot = block_id * block_size + offset), so BLOCK_N may span several
    cache blocks or part of one and the last block may be partial. Online softmax in base 2:
    m_i the running row max, l_i the running sum of exp2(s - m_i), acc the unnormalised output;
    both are rescaled by exp2(m_old - m_new) when the max grows. Masking by absolute position
    gives causality inside a prefill chunk. With NUM_SPLITS > 1 (flash decoding, for batches too
    small to fill the GPU) each program covers a slice of the keys, stores (m_i, l_i, acc), and
    `_merge_splits_kernel` combines the slices.
    Softmax statistics and accumulation are fp32. The two matmuls run in fp32 for fp32 caches and
    under the interpreter (which is wrong for bf16 arithmetic); on a GPU with fp16/bf16 caches
    they take the cache dtype on tensor cores with fp32 accumulation, as flash attention does.

Reference: `reference_paged_attention` (engine/attention/reference.py, re-exported here) is the
torch implementation this kernel is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from engine.attention.reference import paged_attention as reference_paged_attention
from engine.kernels.launch import LaunchConfig, next_power_of_2, resolve
from engine.kernels.validate import check_attention_inputs
from engine.kernels.write_kv import triton_write_kv

# triton_write_kv is re-exported so the backend finds both kernels in one module.
__all__ = ["triton_paged_attention", "triton_write_kv", "reference_paged_attention", "LaunchConfig"]

LOG2_E = 1.4426950408889634

# Kernels call only Triton builtins plus these two standard combine functions through tl.reduce:
# tl.max, tl.sum, tl.zeros and tl.cdiv are themselves @jit functions, and they break under the
# interpreter whenever triton.language was imported before TRITON_INTERPRET=1 was set (importing
# HF transformers' Llama does that), while the interpreter runs tl.reduce with these combine
# functions through numpy, whatever the import order.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


@triton.jit
def _mma(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 operands in full precision (no TF32)."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]; written when NUM_SPLITS == 1
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32; NUM_SPLITS > 1
    part_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] fp32 (m_i, l_i); NUM_SPLITS > 1
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    qk_scale,  # softmax scale * log2(e)
    stride_q_tok, stride_q_head,
    stride_o_tok, stride_o_head,
    stride_k_blk, stride_k_tok, stride_k_head,
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_bt_seq,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of both matmuls: fp32, or the cache's 16-bit dtype
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid covers the longest chunk; shorter ones stop here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_q = q_block * BLOCK_Q + offs_m // GROUP_PAD  # query index inside the sequence
    offs_g = offs_m % GROUP_PAD  # query head inside the GQA group
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = (offs_q < q_len) & (offs_g < GROUP)
    dim_ok = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_g
    q_pos = context_len + offs_q

    q_rows = (q_start + offs_q).to(tl.int64) * stride_q_tok + q_heads * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32).to(DOT_DTYPE)

    # Keys this tile can see end after its last query; splits take equal BLOCK_N-aligned slices.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    split_len = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_kv = start + offs_n  # absolute key positions
        kv_ok = offs_kv < kv_hi
        block_ids = tl.load(block_tables_ptr + seq * stride_bt_seq + offs_kv // BLOCK_SIZE,
                            mask=kv_ok, other=0).to(tl.int64)
        offs_slot = offs_kv % BLOCK_SIZE
        k_rows = block_ids * stride_k_blk + offs_slot * stride_k_tok + kv_head * stride_k_head
        v_rows = block_ids * stride_v_blk + offs_slot * stride_v_tok + kv_head * stride_v_head
        k = tl.load(k_cache_ptr + k_rows[None, :] + offs_d[:, None],  # [HEAD_DIM_PAD, BLOCK_N]
                    mask=dim_ok[:, None] & kv_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :],  # [BLOCK_N, HEAD_DIM_PAD]
                    mask=kv_ok[:, None] & dim_ok[None, :], other=0.0)
        k = k.to(tl.float32).to(DOT_DTYPE)
        v = v.to(tl.float32).to(DOT_DTYPE)

        s = _mma(q, k, DOT_DTYPE) * qk_scale
        visible = (offs_kv[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + _mma(p.to(DOT_DTYPE), v, DOT_DTYPE)
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q_start + offs_q).to(tl.int64) * stride_o_tok + q_heads * stride_o_head
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partial buffers are contiguous: [num_tokens, num_heads, NUM_SPLITS, ...].
        part_rows = ((q_start + offs_q).to(tl.int64) * (GROUP * tl.num_programs(1))
                     + q_heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part_rows[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=out_mask)
        tl.store(part_ml_ptr + part_rows * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_rows * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32
    part_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] fp32 (m_i, l_i)
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row = (token.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    m_s = tl.load(part_ml_ptr + (row + offs_s) * 2)
    l_s = tl.load(part_ml_ptr + (row + offs_s) * 2 + 1)
    acc_s = tl.load(part_acc_ptr + (row + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    # Split 0 always holds key 0, so m_max is finite; empty splits (m = -inf) weigh 0.
    m_max = tl.reduce(m_s, 0, _MAX)
    weight = tl.exp2(m_s - m_max)
    out = tl.reduce(acc_s * weight[:, None], 0, _SUM) / tl.reduce(l_s * weight, 0, _SUM)
    o_row = token.to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_row + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def kernels_interpreted() -> bool:
    """True when this module was imported under TRITON_INTERPRET=1: the kernels run on the CPU."""
    return isinstance(_paged_attention_kernel, InterpretedFunction)


def _dot_dtype(cache_dtype: torch.dtype) -> tl.dtype:
    if cache_dtype == torch.float32 or kernels_interpreted():
        return tl.float32
    return tl.float16 if cache_dtype == torch.float16 else tl.bfloat16


def _max_lengths(seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 num_tokens: int) -> tuple[int, int]:
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_query_len, max_seq_len, total = (
        int(x) for x in torch.stack([q_lens.max(), seq_lens.max(), query_start_loc[-1]]).tolist()
    )
    if total != num_tokens:
        raise ValueError(f"query_start_loc[-1] = {total} but q has {num_tokens} tokens")
    return max_query_len, max_seq_len


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    launch: LaunchConfig | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of `q` over the paged cache; returns out [num_tokens, num_heads, head_dim].

    Same semantics as `reference_paged_attention`. Raises ValueError on bad shapes, strides,
    dtypes or devices. The grid is sized by the longest chunk and context: pass `max_query_len`
    and `max_seq_len` from host-side copies to avoid the one device->host sync that finds them.
    """
    shape = check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if shape.num_seqs == 0 or shape.num_tokens == 0:
        return out
    if max_query_len is None or max_seq_len is None:
        max_query_len, max_seq_len = _max_lengths(seq_lens, query_start_loc, shape.num_tokens)
    group = shape.num_heads // shape.num_kv_heads
    plan = resolve(launch or LaunchConfig(), device=q.device, num_seqs=shape.num_seqs,
                   num_kv_heads=shape.num_kv_heads, group=group,
                   max_query_len=max_query_len, max_seq_len=max_seq_len)
    head_dim_pad = max(16, next_power_of_2(shape.head_dim))
    splits = plan.num_splits
    part_acc = part_ml = out  # unused placeholders when there is one split
    if splits > 1:
        rows = (shape.num_tokens, shape.num_heads, splits)
        part_acc = torch.empty(*rows, head_dim_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(*rows, 2, dtype=torch.float32, device=q.device)
    grid = (shape.num_seqs, shape.num_kv_heads, plan.num_q_blocks * splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_ml, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        float(scale) * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=shape.head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group,
        GROUP_PAD=plan.group_pad, BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n,
        BLOCK_SIZE=shape.block_size, NUM_SPLITS=splits,
        DOT_DTYPE=_dot_dtype(k_cache.dtype),
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(shape.num_tokens, shape.num_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1),
            HEAD_DIM=shape.head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=splits,
        )
    return out
