"""The torch paged-attention reference against dense causal attention on contiguous K/V."""

from __future__ import annotations

import torch

import pytest

from engine.attention.reference import group_by_length, paged_attention, write_kv


def _dense_causal(q, k, v, scale, num_cached):
    """q [q_len, H, D] over k, v [L, KVH, D]; query i sits at position num_cached + i."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    positions = torch.arange(num_cached, num_cached + q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# (cached tokens before the step, tokens this step): decodes and prefill chunks mixed; the second
# case has decodes of very different lengths, which the plan splits into several groups.
MIXED = [(0, 7), (9, 1), (5, 3), (0, 1), (13, 1), (2, 6)]
SPREAD = [(4, 1), (2600, 1), (6, 1), (2450, 1), (0, 5), (2, 1), (2500, 1)]


@pytest.mark.parametrize("shapes", [MIXED, SPREAD], ids=["mixed", "spread"])
def test_paged_attention_matches_dense(shapes):
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 6, 2, 8
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 5
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()  # scattered blocks, as a real allocator gives
    tables, full_k, full_v = [], [], []
    for cached, new in shapes:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(blocks)
        full_k.append(torch.randn(total, kv_heads, dim))
        full_v.append(torch.randn(total, kv_heads, dim))
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(total)])
        # The cached prefix is already in the cache; this step's tokens get written below.
        write_kv(full_k[-1][:cached], full_v[-1][:cached], k_cache, v_cache, slots[:cached])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [new for _, new in shapes]
    query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, dim)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    slot_mapping = torch.cat([
        torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(c, c + n)])
        for t, (c, n) in zip(tables, shapes)
    ])
    write_kv(new_k, new_v, k_cache, v_cache, slot_mapping)

    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=0.3)

    for b, (cached, new) in enumerate(shapes):
        rows = slice(int(query_start_loc[b]), int(query_start_loc[b + 1]))
        expected = _dense_causal(q[rows], full_k[b], full_v[b], 0.3, cached)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


def test_group_by_length_splits_only_when_padding_costs_more_than_a_group():
    assert group_by_length([10, 12, 11], group_cost=100) == [[0, 2, 1]]
    groups = group_by_length([3000, 5, 2900, 7], group_cost=100)
    assert groups == [[1, 3], [2, 0]]
    assert sorted(i for g in group_by_length(list(range(50, 0, -1)), 64) for i in g) == list(range(50))


def test_an_overflowed_request_cannot_poison_its_neighbours_through_the_cache():
    # Request a's keys and values overflowed and were written to block 0. b never uses block 0, but
    # its decode row is padded with it next to a longer context; a later owner of the block reads
    # its stale tail. Masked positions must contribute exactly nothing.
    block_size, kv_heads, head_dim, heads = 4, 2, 8, 4
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(6, block_size, kv_heads, head_dim), torch.randn(6, block_size, kv_heads, head_dim)
    overflow = torch.full((block_size, kv_heads, head_dim), float("inf"))
    write_kv(overflow, overflow * 0.0, k_cache, v_cache, torch.arange(block_size))  # inf keys, NaN values
    assert torch.isfinite(k_cache).all() and torch.isfinite(v_cache).all()
    q = torch.randn(2, heads, head_dim)
    together = paged_attention(q, k_cache, v_cache, torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                               torch.tensor([8, 3]), torch.tensor([0, 1, 2]), head_dim ** -0.5)
    alone = paged_attention(q[1:], k_cache, v_cache, torch.tensor([[3]], dtype=torch.int32),
                            torch.tensor([3]), torch.tensor([0, 1]), head_dim ** -0.5)
    torch.testing.assert_close(together[1:], alone)
