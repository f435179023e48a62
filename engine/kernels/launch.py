"""Launch parameters of the paged attention kernel and how the wrapper picks them.

The kernel is memory bound on decode: every program streams the K/V of one (sequence, KV head).
Two knobs decide how well a GPU is filled:

- the query tile (BLOCK_M rows = BLOCK_Q tokens x the padded GQA group): at least 16 rows so
  `tl.dot` maps onto tensor cores; 64 rows when prefill chunks are present so a chunk is
  covered by few programs;
- the KV split (flash decoding): when (sequences x KV heads x query tiles) is small next to the
  number of SMs, each program covers only 1/NUM_SPLITS of the keys and a merge kernel combines
  the partial softmax states. Each split keeps at least MIN_ITERS_PER_SPLIT loop iterations so
  the merge stays cheap next to the streaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_ITERS_PER_SPLIT = 4
MAX_SPLITS = 16
# The split heuristic doubles the splits while the grid has fewer than PROGRAMS_PER_SM programs
# per SM. On an H200 (132 SMs; `lengthwise bench attention --batch B`, 32/8 heads, d128, context
# 2048; data/gpu_check/h200) unsplit launches matched or beat split ones from 256 programs up:
# best unsplit against best split in two, runs 2-4, batch 32: 77/79/84 vs 82/101/83 us; batch 48:
# 108/110/110 vs 135/115/116 us; batch 64: 137 vs 150 us. At batch 8 (64 programs) the timings
# are mostly the host's launch cost (0.063 ms, 0.036 from a CUDA graph) and do not rank splits;
# there the flash-decoding rule stays: split a grid that leaves SMs without a program.
PROGRAMS_PER_SM = 1


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and GPU launch options; None fields are chosen per call by `resolve`."""

    block_n: int = 64  # keys per loop iteration (may span several cache blocks or part of one)
    block_m: int | None = None  # query rows per program (tokens x padded GQA group)
    num_splits: int | None = None  # KV splits per (sequence, KV head, query tile)
    num_warps: int | None = None  # 4 for 16-row tiles, 8 for larger (keeps fp32 tiles unspilled)
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m", "num_splits", "num_warps"):
            value = getattr(self, name)
            if value is not None and not _is_power_of_2(value):
                raise ValueError(f"LaunchConfig.{name} must be a power of two, got {value}")
        if self.num_splits is not None and self.num_splits > MAX_SPLITS:
            raise ValueError(f"LaunchConfig.num_splits must be <= {MAX_SPLITS}")
        if self.num_stages < 1:
            raise ValueError("LaunchConfig.num_stages must be >= 1")


@dataclass(frozen=True)
class ResolvedLaunch:
    """Concrete launch of one call: every size known."""

    block_q: int  # query tokens per program
    group_pad: int  # query heads per KV head, padded to a power of two
    block_n: int
    num_splits: int
    num_q_blocks: int
    num_warps: int
    num_stages: int


def _count_sms(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def resolve(
    config: LaunchConfig,
    *,
    device: torch.device,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    max_query_len: int,
    max_seq_len: int,
) -> ResolvedLaunch:
    if device.type == "cuda" and min(config.block_n, config.block_m or 16) < 16:
        raise ValueError("LaunchConfig.block_n and block_m must be >= 16 on a GPU (tl.dot minimum)")
    group_pad = next_power_of_2(group)
    block_m = config.block_m
    if block_m is None:
        block_m = 16 if max_query_len * group_pad <= 16 else 64
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    num_q_blocks = -(-max_query_len // block_q)
    num_splits = config.num_splits
    if num_splits is None:
        num_splits = _auto_splits(
            programs=num_seqs * num_kv_heads * num_q_blocks,
            sms=_count_sms(device),
            iterations=-(-max_seq_len // config.block_n),
        )
    return ResolvedLaunch(
        block_q=block_q,
        group_pad=group_pad,
        block_n=config.block_n,
        num_splits=num_splits,
        num_q_blocks=num_q_blocks,
        num_warps=config.num_warps or (4 if block_m <= 16 else 8),
        num_stages=config.num_stages,
    )


def _auto_splits(*, programs: int, sms: int | None, iterations: int) -> int:
    """Double the splits while the GPU is under-filled and each split keeps enough work."""
    if sms is None:  # the CPU interpreter runs programs one after another: splitting only costs
        return 1
    splits = 1
    while (
        splits < MAX_SPLITS
        and programs * splits < PROGRAMS_PER_SM * sms
        and iterations // (2 * splits) >= MIN_ITERS_PER_SPLIT
    ):
        splits *= 2
    return splits
