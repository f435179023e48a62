"""Torch reference for paged attention over a block-table KV cache (the CPU path).

Cache layout per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; a slot
is block_id * block_size + offset, so the cache viewed as [num_slots, KVH, D] is indexed by slot.

Algorithm. Once per step, `build_plan` turns the block tables into gather plans. Contexts are
gathered a whole block at a time (`index_select` over blocks: one contiguous copy each) and the
tail past a context's length is masked.
- single-token queries (decodes) are batched: sorted by context length and split into a few
  groups (`group_by_length`) so short contexts are not padded to the longest; each group is one
  SDPA call in which the GQA group of query heads sharing a KV head plays the role of the
  query-length axis;
- multi-token queries (prefill chunks) run one SDPA call each, over their own gathered context
  with a causal mask shifted by the context already cached (query i sits at position
  seq_len - q_len + i and sees keys 0..that position).
Every layer then reuses the plan, so per-layer work is gathers and SDPA only. Positions past a
context (the tail of its last block, and padding that points at block 0) are gathered and hidden by
an additive -inf mask, which needs them finite: inf or NaN there would give 0 * NaN. So `write_kv`
stores non-finite values as 0; a request whose keys overflowed has lost its own output
already, and its freed blocks can no longer poison the next owner or a padded neighbour.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodeGroup:
    rows: torch.Tensor  # int64 [Bd] rows of q holding single-token queries
    blocks: torch.Tensor  # int64 [Bd * nblocks] cache blocks of each context, row-major (0 where padded)
    mask: torch.Tensor  # float32 [Bd, 1, 1, nblocks * block_size]: 0 on the context, -inf past its end


@dataclass(frozen=True)
class ChunkPlan:
    q_start: int
    q_end: int
    blocks: torch.Tensor  # int64 [nblocks] cache blocks of the whole context
    mask: torch.Tensor  # float32 [heads_per_kv * q_len, L]: causal, shifted by the cached prefix


@dataclass(frozen=True)
class ReferencePlan:
    decodes: tuple[DecodeGroup, ...]
    chunks: tuple[ChunkPlan, ...]


# Padding a decode group costs gathered keys; starting another group costs a few calls per layer.
# A new group pays off when it saves more than this many padded key positions.
GROUP_COST_TOKENS = 2048


def group_by_length(lengths: list[int], group_cost: int = GROUP_COST_TOKENS) -> list[list[int]]:
    """Split indices, sorted by length, into contiguous groups minimising padded keys + group cost.

    Dynamic programming over the sorted order: best[j] = min_i best[i] + cost + (j - i) * len_(j-1).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sorted_lens = [lengths[i] for i in order]
    best, cut = [0] + [None] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        best[j], cut[j] = min((best[i] + group_cost + (j - i) * sorted_lens[j - 1], i) for i in range(j))
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _decode_group(rows: list[int], seqs: list[int], block_tables: torch.Tensor,
                  seq_lens: tuple[int, ...], block_size: int) -> DecodeGroup:
    device = block_tables.device
    max_len = max(seq_lens[b] for b in seqs)
    num_blocks = -(-max_len // block_size)
    lens = torch.tensor([seq_lens[b] for b in seqs], device=device)
    blocks = block_tables[torch.tensor(seqs, device=device), :num_blocks].to(torch.int64)
    # Padded table entries point at block 0; the mask hides them.
    valid = torch.arange(num_blocks * block_size, device=device)[None, :] < lens[:, None]
    return DecodeGroup(torch.tensor(rows, device=device), blocks.reshape(-1), _additive(valid)[:, None, None, :])


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """A float mask built once per step: SDPA would otherwise convert a bool mask in every layer."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def build_plan(block_tables: torch.Tensor, seq_lens: tuple[int, ...], query_start_loc: tuple[int, ...],
               block_size: int, heads_per_kv: int) -> ReferencePlan:
    """Gather indices and masks for one step; host-side lengths avoid device syncs."""
    decode_rows, decode_seqs, chunks = [], [], []
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = query_start_loc[b], query_start_loc[b + 1]
        q_len = q_end - q_start
        if q_len == 1:
            decode_rows.append(q_start)
            decode_seqs.append(b)
        elif q_len > 1:
            blocks = block_tables[b, :-(-seq_len // block_size)].to(torch.int64)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=block_tables.device)
            visible = torch.arange(seq_len, device=block_tables.device)[None, :] <= query_pos[:, None]
            chunks.append(ChunkPlan(q_start, q_end, blocks, _additive(visible.repeat(heads_per_kv, 1))))
    groups = group_by_length([seq_lens[b] for b in decode_seqs]) if decode_seqs else []
    decodes = tuple(_decode_group([decode_rows[i] for i in g], [decode_seqs[i] for i in g],
                                  block_tables, seq_lens, block_size) for g in groups)
    return ReferencePlan(decodes, tuple(chunks))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values [N, KVH, D] into their slots, in place; inf and NaN are stored
    as 0 (not as the largest finite value, whose product with a query overflows again)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for new, cache in ((k, k_cache), (v, v_cache)):
        finite = torch.nan_to_num(new.to(cache.dtype), nan=0.0, posinf=0.0, neginf=0.0)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, finite)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks [n * block_size, KVH, D]: one contiguous copy per block, not per token."""
    return cache.index_select(0, blocks).flatten(0, 1)


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    group: DecodeGroup, scale: float) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads_per_kv = q.shape[1] // num_kv_heads
    num_seqs = group.rows.shape[0]
    # Query head h uses KV head h // heads_per_kv, so [Bd, H, D] -> [Bd, KVH, heads_per_kv, D].
    queries = q[group.rows].view(num_seqs, num_kv_heads, heads_per_kv, head_dim)
    keys = _gather(k_cache, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = _gather(v_cache, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype),
                                         attn_mask=group.mask.to(q.dtype), scale=scale)
    return out.reshape(num_seqs, q.shape[1], head_dim)


def _attend_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  chunk: ChunkPlan, scale: float) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_heads = q.shape[1]
    heads_per_kv = num_heads // num_kv_heads
    q_len, seq_len = chunk.q_end - chunk.q_start, chunk.mask.shape[1]
    # [q_len, H, D] -> [1, KVH, heads_per_kv * q_len, D]: the group's queries share one KV head.
    # (4-D inputs: SDPA's fused CPU kernel takes only those; 3-D falls back to the slow math path.)
    queries = q[chunk.q_start:chunk.q_end].view(q_len, num_kv_heads, heads_per_kv, head_dim)
    queries = queries.permute(1, 2, 0, 3).reshape(1, num_kv_heads, heads_per_kv * q_len, head_dim)
    keys = _gather(k_cache, chunk.blocks)[:seq_len].transpose(0, 1).to(q.dtype)[None]  # [1, KVH, L, D]
    values = _gather(v_cache, chunk.blocks)[:seq_len].transpose(0, 1).to(q.dtype)[None]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask.to(q.dtype), scale=scale)
    out = out.view(num_kv_heads, heads_per_kv, q_len, head_dim).permute(2, 0, 1, 3)
    return out.reshape(q_len, num_heads, head_dim)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           plan: ReferencePlan, scale: float) -> torch.Tensor:
    """Attention of q [N, H, D] over the cache, following a prepared plan."""
    out = torch.empty_like(q)
    for group in plan.decodes:
        out[group.rows] = _attend_decodes(q, k_cache, v_cache, group, scale)
    for chunk in plan.chunks:
        out[chunk.q_start:chunk.q_end] = _attend_chunk(q, k_cache, v_cache, chunk, scale)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [N, H, D] attends causally over its sequence's cached context; returns [N, H, D]."""
    plan = build_plan(block_tables, tuple(seq_lens.tolist()), tuple(query_start_loc.tolist()),
                      k_cache.shape[1], q.shape[1] // k_cache.shape[2])
    return attend(q, k_cache, v_cache, plan, scale)
