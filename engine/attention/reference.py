"""Torch reference for paged attention over a block-table KV cache (the CPU path).

Cache layout per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; a slot
is block_id * block_size + offset, so the cache viewed as [num_slots, KVH, D] is indexed by slot.

Algorithm. Once per step, `build_plan` turns the block tables into flat slot indices:
- single-token queries (decodes) are batched: their contexts are gathered into one padded
  [B_dec, L_max] slot matrix with a validity mask, and attention runs as one SDPA call in which
  the GQA group of query heads sharing a KV head plays the role of the query-length axis;
- multi-token queries (prefill chunks) run one SDPA call each, over their own gathered context
  with a causal mask shifted by the context already cached (query i sits at position
  seq_len - q_len + i and sees keys 0..that position).
Every layer then reuses the plan, so per-layer work is gathers and SDPA only. Each sequence
reads only its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodePlan:
    rows: torch.Tensor  # int64 [Bd] rows of q holding single-token queries
    slots: torch.Tensor  # int64 [Bd, L_max] cache slots of each context (0 where padded)
    mask: torch.Tensor  # bool [Bd, 1, 1, L_max] True where the key belongs to the context


@dataclass(frozen=True)
class ChunkPlan:
    q_start: int
    q_end: int
    slots: torch.Tensor  # int64 [L] cache slots of the whole context
    mask: torch.Tensor  # bool [q_len, L] causal mask shifted by the cached prefix


@dataclass(frozen=True)
class ReferencePlan:
    decode: DecodePlan | None
    chunks: tuple[ChunkPlan, ...]


def _context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(length, device=block_table.device)
    blocks = block_table[positions // block_size].to(torch.int64)
    return blocks * block_size + positions % block_size


def _decode_plan(rows: list[int], seqs: list[int], block_tables: torch.Tensor,
                 seq_lens: tuple[int, ...], block_size: int) -> DecodePlan:
    device = block_tables.device
    max_len = max(seq_lens[b] for b in seqs)
    seq_index = torch.tensor(seqs, device=device)
    lens = torch.tensor([seq_lens[b] for b in seqs], device=device)
    positions = torch.arange(max_len, device=device)
    valid = positions[None, :] < lens[:, None]
    # Padded positions may point past a table's real blocks; clamp, then mask them out.
    block_cols = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables[seq_index][:, block_cols].to(torch.int64)
    slots = torch.where(valid, blocks * block_size + positions % block_size, 0)
    return DecodePlan(torch.tensor(rows, device=device), slots, valid[:, None, None, :])


def build_plan(block_tables: torch.Tensor, seq_lens: tuple[int, ...],
               query_start_loc: tuple[int, ...], block_size: int) -> ReferencePlan:
    """Gather indices and masks for one step; host-side lengths avoid device syncs."""
    decode_rows, decode_seqs, chunks = [], [], []
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = query_start_loc[b], query_start_loc[b + 1]
        q_len = q_end - q_start
        if q_len == 1:
            decode_rows.append(q_start)
            decode_seqs.append(b)
        elif q_len > 1:
            slots = _context_slots(block_tables[b], seq_len, block_size)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=block_tables.device)
            mask = torch.arange(seq_len, device=block_tables.device)[None, :] <= query_pos[:, None]
            chunks.append(ChunkPlan(q_start, q_end, slots, mask))
    decode = None
    if decode_rows:
        decode = _decode_plan(decode_rows, decode_seqs, block_tables, seq_lens, block_size)
    return ReferencePlan(decode, tuple(chunks))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values [N, KVH, D] into their slots, in place."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _attend_decodes(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                    plan: DecodePlan, scale: float) -> torch.Tensor:
    num_kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
    group = q.shape[1] // num_kv_heads
    # Query head h uses KV head h // group, so [Bd, H, D] -> [Bd, KVH, group, D].
    queries = q[plan.rows].view(-1, num_kv_heads, group, head_dim)
    keys = k_flat[plan.slots].transpose(1, 2)  # [Bd, KVH, L_max, D]
    values = v_flat[plan.slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype),
                                         attn_mask=plan.mask, scale=scale)
    return out.reshape(-1, q.shape[1], head_dim)


def _attend_chunk(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                  chunk: ChunkPlan, scale: float) -> torch.Tensor:
    num_kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    q_len = chunk.q_end - chunk.q_start
    # [q_len, H, D] -> [KVH, group * q_len, D]: the group's queries share one KV head.
    queries = q[chunk.q_start:chunk.q_end].view(q_len, num_kv_heads, group, head_dim)
    queries = queries.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
    keys = k_flat[chunk.slots].transpose(0, 1).to(q.dtype)  # [KVH, L, D]
    values = v_flat[chunk.slots].transpose(0, 1).to(q.dtype)
    mask = chunk.mask.repeat(group, 1)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           plan: ReferencePlan, scale: float) -> torch.Tensor:
    """Attention of q [N, H, D] over the cache, following a prepared plan."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    if plan.decode is not None:
        out[plan.decode.rows] = _attend_decodes(q, k_flat, v_flat, plan.decode, scale)
    for chunk in plan.chunks:
        out[chunk.q_start:chunk.q_end] = _attend_chunk(q, k_flat, v_flat, chunk, scale)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [N, H, D] attends causally over its sequence's cached context; returns [N, H, D]."""
    plan = build_plan(block_tables, tuple(seq_lens.tolist()), tuple(query_start_loc.tolist()),
                      k_cache.shape[1])
    return attend(q, k_cache, v_cache, plan, scale)
