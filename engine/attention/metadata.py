"""Per-step attention metadata, built once by the model runner and passed to every layer.

Layout of a step's flat batch: the query tokens of sequence b occupy rows
query_start_loc[b] .. query_start_loc[b+1] of every [N, ...] tensor. Sequence b has seq_lens[b]
tokens of context after this step (its new tokens included), stored in the cache blocks
block_tables[b, :ceil(seq_lens[b] / block_size)]. Token row i is written to slot_mapping[i]
(= block_id * block_size + offset) before attention reads the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]; entries past a sequence's blocks are 0
    slot_mapping: torch.Tensor  # int64 [N]
    block_size: int
    # Host copies of the two small index vectors, so building a plan never syncs the device.
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]
