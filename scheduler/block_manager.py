"""KV block accounting: which physical blocks each request holds, on the device and on the host.

Allocation is lazy: a request receives blocks only when a step grants it tokens that do not fit
in the blocks it already holds (`allocate_slots`), and `None` comes back when the free list is
too short, so the scheduler decides whom to preempt. Every block carries a reference count equal
to the number of block tables that list it; a block returns to the free list when that count
reaches zero. Swap preemption moves a request's table to a host pool (`swap_out` returns the
(device, host) copies to make) and back (`swap_in` returns (host, device) copies).

Invariants (`check_integrity`): free + referenced == total on each pool, no block is both free
and referenced, no block is on a free list twice, and each reference count equals the number of
tables holding the block.
"""

from __future__ import annotations

from collections import Counter, deque

from scheduler.request import Request


class BlockPool:
    """A free list and reference counts over `num_blocks` physical blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"double free of block {block}")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def check(self, tables: list[list[int]], label: str) -> None:
        held = Counter(block for table in tables for block in table)
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError(f"{label}: a block is on the free list twice")
        if set(free) & set(held):
            raise AssertionError(f"{label}: a block is both free and held")
        if len(free) + len(held) != self.num_blocks:
            raise AssertionError(f"{label}: free {len(free)} + used {len(held)} != total {self.num_blocks}")
        for block in range(self.num_blocks):
            if self._ref_counts[block] != held.get(block, 0):
                raise AssertionError(f"{label}: block {block} refcount {self._ref_counts[block]} "
                                     f"!= {held.get(block, 0)} tables")


class BlockManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_gpu_blocks)
        self.host = BlockPool(num_cpu_blocks)
        self._device_tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}

    # ---- sizes -------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def usage(self) -> float:
        """Share of device blocks held by requests, in [0, 1]."""
        return 1.0 - self.device.num_free / self.device.num_blocks

    def num_new_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        held = len(self._device_tables.get(request.request_id, ()))
        return max(0, self.blocks_for(request.num_computed_tokens + num_new_tokens) - held)

    # ---- device allocation -------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_new_tokens` more computed tokens.

        Returns the whole new table, or None (allocating nothing) when the free list is short.
        """
        needed = self.num_new_blocks_needed(request, num_new_tokens)
        if needed > self.device.num_free:
            return None
        table = self._device_tables.setdefault(request.request_id, [])
        table.extend(self.device.allocate(needed))
        request.block_ids = list(table)
        return request.block_ids

    def free(self, request: Request) -> None:
        """Release everything the request holds, on the device and on the host."""
        self.device.release(self._device_tables.pop(request.request_id, []))
        self.host.release(self._host_tables.pop(request.request_id, []))
        request.block_ids = []

    # ---- swap --------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(self._device_tables.get(request.request_id, ())) <= self.host.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's device blocks to the host pool; returns (device, host) copies."""
        device_table = self._device_tables.pop(request.request_id, [])
        host_table = self.host.allocate(len(device_table))
        self._host_tables[request.request_id] = host_table
        self.device.release(device_table)
        request.block_ids = []
        return list(zip(device_table, host_table))

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Whether the host table, grown to hold `num_new_tokens` more, fits on the device."""
        held = len(self._host_tables.get(request.request_id, ()))
        needed = max(held, self.blocks_for(request.num_computed_tokens + num_new_tokens))
        return needed <= self.device.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's host blocks back to fresh device blocks; returns (host, device) copies."""
        host_table = self._host_tables.pop(request.request_id, [])
        device_table = self.device.allocate(len(host_table))
        self._device_tables[request.request_id] = device_table
        self.host.release(host_table)
        request.block_ids = list(device_table)
        return list(zip(host_table, device_table))

    # ---- checks ------------------------------------------------------------------------------
    def num_requests_holding(self) -> int:
        return len(self._device_tables) + len(self._host_tables)

    def check_integrity(self) -> None:
        """Raise AssertionError when any accounting invariant is broken."""
        self.device.check(list(self._device_tables.values()), "device")
        self.host.check(list(self._host_tables.values()), "host")
