"""Random paged-attention batches shared by the kernel tests and the GPU bench.

A batch lays each sequence's context over physical blocks drawn in shuffled order (so logical
and physical order differ), leaves the last block partial when the length says so, fills the
rest of the cache with garbage the kernel must never read, and pads block tables with 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionCase:
    """Shapes of one test batch; `seqs` holds (context length after the step, query tokens)."""

    name: str
    seqs: tuple[tuple[int, int], ...]
    block_size: int = 16
    num_kv_heads: int = 2
    group: int = 1  # query heads per KV head
    head_dim: int = 32
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class AttentionBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def make_batch(case: AttentionCase, device: str | torch.device = "cpu", seed: int = 0,
               spare_blocks: int = 3) -> AttentionBatch:
    """Build a random batch for `case`; deterministic for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // case.block_size) for seq_len, _ in case.seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 1  # one spare column so padding entries are exercised
    block_tables = torch.zeros(len(case.seqs), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = physical[used:used + n].to(torch.int32)
        used += n
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen)
    v_cache = torch.randn(cache_shape, generator=gen)
    q_lens = [q_len for _, q_len in case.seqs]
    num_heads = case.num_kv_heads * case.group
    q = torch.randn(sum(q_lens), num_heads, case.head_dim, generator=gen)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len for seq_len, _ in case.seqs], dtype=torch.int32)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=case.dtype if t.is_floating_point() else t.dtype)

    return AttentionBatch(put(q), put(k_cache), put(v_cache), put(block_tables), put(seq_lens),
                          put(query_start_loc), case.head_dim ** -0.5)


# Ragged contexts with partial last blocks; query lengths mix decode (1) and prefill chunks.
DECODE_SEQS = ((1, 1), (17, 1), (40, 1), (70, 1))
MIXED_SEQS = ((23, 23), (9, 1), (50, 12), (33, 1))

CASES: tuple[AttentionCase, ...] = tuple(
    AttentionCase(f"{kind}-bs{block_size}-g{group}-{str(dtype).removeprefix('torch.')}",
                  seqs, block_size=block_size, group=group, dtype=dtype)
    for kind, seqs in (("decode", DECODE_SEQS), ("mixed", MIXED_SEQS))
    for block_size in (16, 32)
    for group in (1, 3)
    for dtype in (torch.float32, torch.float16)
)

# Max abs error allowed against the torch reference, by load dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
