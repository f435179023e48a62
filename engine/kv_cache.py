"""The paged KV cache: device blocks for every layer plus a host pool for swap preemption.

One tensor [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim] holds the whole
device cache, so each layer's K and V are contiguous [num_blocks, block_size, KVH, D] views and a
swap moves a block of every layer with one indexed copy. The block count follows from a memory
budget: bytes per block = layers * 2 * block_size * KVH * head_dim * element size. Both pools start
zeroed, and the torch path never writes inf or NaN (`reference.write_kv`): masked-out positions of a
context must stay finite, since 0 * NaN would leak into outputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for(self, gib: float) -> int:
        return int(gib * GIB) // self.bytes_per_block


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_pools(device: torch.device, num_cpu_blocks: int, device_setting: str = "kv_cache_memory_gib") -> str:
    """The settings behind the KV memory taken from the host, in the config's words: naming a swap
    pool that recompute preemption never allocates sent a user looking for it. `device_setting`
    sized the device pool: kv_cache_memory_gib, or num_gpu_blocks where that pins it."""
    pools = ([f"{device_setting} on a CPU"] if device.type == "cpu" else []) + (
        ["swap_space_gib for swap preemption"] if num_cpu_blocks else [])
    return " plus ".join(pools)


def check_cache_fits(geometry: CacheGeometry, num_gpu_blocks: int, num_cpu_blocks: int,
                     device: torch.device, device_setting: str = "kv_cache_memory_gib") -> None:
    """ValueError when the pools would not fit the memory free now, before they are allocated: a
    CPU allocation too large fails with an allocator traceback, and one that only just fits
    overcommitted memory is killed later, at the first steps that touch it."""
    block = geometry.bytes_per_block
    host = num_cpu_blocks * block + (num_gpu_blocks * block if device.type == "cpu" else 0)
    free_host = available_host_bytes()
    if free_host is not None and host > free_host:
        raise ValueError(f"the KV cache needs {host / GIB:.1f} GiB of host memory "
                         f"({host_pools(device, num_cpu_blocks, device_setting)}), "
                         f"more than the {free_host / GIB:.1f} GiB available")
    if device.type == "cuda":
        # What torch has reserved but not handed out is free to it, though the driver counts it used
        # (a second engine in one process reuses the first one's freed cache).
        free_device = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                       - torch.cuda.memory_allocated(device))
        if num_gpu_blocks * block > free_device:
            raise ValueError(f"{device_setting}: the KV cache needs {num_gpu_blocks * block / GIB:.1f} GiB, "
                             f"more than the {free_device / GIB:.1f} GiB free on {device}")


class KVCache:
    def __init__(self, geometry: CacheGeometry, num_gpu_blocks: int, num_cpu_blocks: int,
                 device: torch.device, device_setting: str = "kv_cache_memory_gib") -> None:
        check_cache_fits(geometry, num_gpu_blocks, num_cpu_blocks, device, device_setting)
        self.geometry = geometry
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        shape = (geometry.num_layers, 2, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        self.device_cache = torch.zeros(shape[:2] + (num_gpu_blocks,) + shape[2:], dtype=geometry.dtype, device=device)
        self.host_cache = torch.zeros(shape[:2] + (num_cpu_blocks,) + shape[2:], dtype=geometry.dtype,
                                      pin_memory=device.type == "cuda")
        self.layers = [(self.device_cache[i, 0], self.device_cache[i, 1]) for i in range(geometry.num_layers)]

    def log_capacity(self, max_model_len: int) -> None:
        tokens = self.num_gpu_blocks * self.geometry.block_size
        per_seq = -(-max_model_len // self.geometry.block_size)
        log.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB); %d sequences of %d tokens fit; "
                 "host pool %d blocks", self.num_gpu_blocks, self.geometry.block_size, tokens,
                 self.num_gpu_blocks * self.geometry.bytes_per_block / GIB, self.num_gpu_blocks // per_seq,
                 max_model_len, self.num_cpu_blocks)

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy (device block, host block) pairs to the host pool, every layer at once."""
        if pairs:
            device_ids = torch.tensor([d for d, _ in pairs], device=self.device_cache.device)
            host_ids = torch.tensor([h for _, h in pairs])
            self.host_cache[:, :, host_ids] = self.device_cache[:, :, device_ids].to("cpu")

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy (host block, device block) pairs back into the device cache."""
        if pairs:
            host_ids = torch.tensor([h for h, _ in pairs])
            device_ids = torch.tensor([d for _, d in pairs], device=self.device_cache.device)
            self.device_cache[:, :, device_ids] = self.host_cache[:, :, host_ids].to(self.device_cache.device)
