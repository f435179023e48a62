"""KV block accounting: which physical blocks each request holds, on the device and on the host.

Allocation is lazy: a request receives blocks only when a step grants it tokens that do not fit
in the blocks it already holds (`allocate_slots`), and `None` comes back when the free list is
too short, so the scheduler decides whom to preempt. Every block carries a reference count equal
to the number of block tables that list it; a block returns to the free list when that count
reaches zero. Swap preemption moves a request's table to a host pool (`swap_out` returns the
(device, host) copies to make) and back (`swap_in` returns (host, device) copies).

With a prefix cache (prefix_cache.py), a request without blocks may start on blocks that hold
its first tokens already: held by other requests (shared, their count raised) or waiting on the
free list (taken back from it). A freed table goes to the free list tail first, so the blocks
deepest in a sequence are evicted before its first ones.

Invariants (`check_integrity`): free + referenced == total on each pool, no block is both free
and referenced, each reference count equals the number of tables holding the block, and the
prefix cache's two maps agree (a free list is a dict's keys: no block is on it twice).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from scheduler.prefix_cache import PrefixCache
from scheduler.request import Request


@dataclass(frozen=True)
class CachedPrefix:
    """The cached blocks a request without blocks would start on (`cached_prefix`), found once
    and passed on to the watermark check and the allocation, with the prefix cache's eviction
    count when they were found: an allocation takes them only if no block was evicted since."""

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    evictions: int = 0


NO_PREFIX = CachedPrefix()


class BlockPool:
    """A free list, in release order, and reference counts over `num_blocks` physical blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered: the oldest first
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, count: int) -> list[int]:
        if count < 0 or count > len(self._free):  # a negative count took the whole free list
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        blocks = []
        for block in self._free:
            if len(blocks) == count:
                break
            blocks.append(block)
        for block in blocks:
            del self._free[block]
            self._ref_counts[block] = 1
        return blocks

    def share(self, block: int) -> None:
        """One more table holds `block`: taken off the free list, or its count raised."""
        if block in self._free:
            del self._free[block]
            self._ref_counts[block] = 1
        elif self._ref_counts[block] > 0:
            self._ref_counts[block] += 1
        else:
            raise RuntimeError(f"block {block} is neither free nor held")

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"double free of block {block}")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def check(self, tables: list[list[int]], label: str) -> None:
        held = Counter(block for table in tables for block in table)
        free = list(self._free)  # a dict's keys: no block is on it twice
        if set(free) & set(held):
            raise AssertionError(f"{label}: a block is both free and held")
        if len(free) + len(held) != self.num_blocks:
            raise AssertionError(f"{label}: free {len(free)} + used {len(held)} != total {self.num_blocks}")
        for block in range(self.num_blocks):
            if self._ref_counts[block] != held.get(block, 0):
                raise AssertionError(f"{label}: block {block} refcount {self._ref_counts[block]} "
                                     f"!= {held.get(block, 0)} tables")


class BlockManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_gpu_blocks)
        self.host = BlockPool(num_cpu_blocks)
        self.prefix_cache = prefix_cache
        self._device_tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}

    def device_table_holders(self) -> list[str]:
        """The ids of the requests that hold device blocks."""
        return list(self._device_tables)

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

    @property
    def host_usage(self) -> float | None:
        """Share of the host (swap) pool's blocks held by swapped-out requests; None without a pool."""
        return 1.0 - self.host.num_free / self.host.num_blocks if self.host.num_blocks else None

    def num_new_blocks_needed(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> int:
        """Free blocks that granting `num_new_tokens` more takes, the request starting on its
        cached `prefix` (those of its blocks that wait on the free list count)."""
        if prefix.blocks:
            num_tokens = prefix.num_tokens + num_new_tokens
            return self.blocks_for(num_tokens) - len(prefix.blocks) + sum(map(self.device.is_free, prefix.blocks))
        held = len(self._device_tables.get(request.request_id, ()))
        return max(0, self.blocks_for(request.num_computed_tokens + num_new_tokens) - held)

    def num_tokens_that_fit(self, request: Request, reserved_blocks: int = 0) -> int:
        """More computed tokens a request holding blocks can take from its table and the free
        list, leaving `reserved_blocks` of it to others."""
        held = len(self._device_tables.get(request.request_id, ()))
        free = max(0, self.device.num_free - reserved_blocks)
        return max(0, (held + free) * self.block_size - request.num_computed_tokens)

    # ---- prefix cache ------------------------------------------------------------------------
    def cached_prefix(self, request: Request) -> CachedPrefix:
        """The cached blocks a request without blocks or computed tokens would start on; none
        without a prefix cache."""
        if self.prefix_cache is None or request.num_computed_tokens or request.request_id in self._device_tables:
            return NO_PREFIX
        blocks = tuple(self.prefix_cache.lookup(request))
        return CachedPrefix(blocks, len(blocks) * self.block_size, self.prefix_cache.num_evictions)

    def commit_cached_blocks(self) -> None:
        """After a step ran: the blocks its grants filled hold their KV (prefix_cache.py)."""
        if self.prefix_cache is not None:
            self.prefix_cache.commit()

    def discard_uncommitted_blocks(self) -> None:
        """After a step failed: nothing finds the blocks its grants filled."""
        if self.prefix_cache is not None:
            self.prefix_cache.discard_uncommitted()

    # ---- device allocation -------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix: CachedPrefix = NO_PREFIX) -> list[int] | None:
        """Grow the request's table to hold `num_new_tokens` more computed tokens; a request
        without blocks starts on its cached `prefix` (cached_prefix), and its computed tokens
        jump to them.

        Returns the whole new table, or None (allocating nothing) when the free list is short or
        a cached block may be gone since cached_prefix (one was evicted in between).
        """
        if prefix.blocks and prefix.evictions != self.prefix_cache.num_evictions:
            return None
        if self.num_new_blocks_needed(request, num_new_tokens, prefix) > self.device.num_free:
            return None
        table = self._device_tables.setdefault(request.request_id, [])
        if prefix.blocks or (self.prefix_cache is not None and not table and not request.num_computed_tokens):
            self._start_on(request, prefix.num_tokens)
        for block in prefix.blocks:
            self.device.share(block)
        table.extend(prefix.blocks)
        num_tokens = request.num_computed_tokens + num_new_tokens
        table.extend(self._allocate(self.blocks_for(num_tokens) - len(table)))
        if self.prefix_cache is not None:  # findable by requests granted later in this step too
            self.prefix_cache.register(request, table, num_tokens)
        request.block_ids = list(table)
        return request.block_ids

    def _start_on(self, request: Request, cached: int) -> None:
        self.prefix_cache.record_lookup(request, cached, again=request.num_cached_tokens is not None)
        request.num_computed_tokens = cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = min(cached, request.num_prompt_tokens)

    def _allocate(self, count: int) -> list[int]:
        blocks = self.device.allocate(count)
        if self.prefix_cache is not None:
            for block in blocks:  # evicted: they will hold other tokens
                self.prefix_cache.forget(block)
        return blocks

    def free(self, request: Request) -> None:
        """Release everything the request holds, on the device and on the host (a table's last
        blocks first, so they are evicted first)."""
        self.device.release(reversed(self._device_tables.pop(request.request_id, [])))
        self.host.release(self._host_tables.pop(request.request_id, []))
        request.block_ids = []
        if self.prefix_cache is not None:
            self.prefix_cache.drop_request(request.request_id)

    # ---- swap --------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(self._device_tables.get(request.request_id, ())) <= self.host.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's device blocks to the host pool; returns (device, host) copies."""
        device_table = self._device_tables.pop(request.request_id, [])
        host_table = self.host.allocate(len(device_table))
        self._host_tables[request.request_id] = host_table
        self.device.release(reversed(device_table))
        request.block_ids = []
        if self.prefix_cache is not None:  # it comes back in other blocks, registered again
            self.prefix_cache.drop_request(request.request_id)
        return list(zip(device_table, host_table))

    def resident_prefix(self, request: Request) -> CachedPrefix:
        """A swapped-out request's first full blocks whose KV the device still holds under their
        keys (shared with another request, or cached on the free list): `swap_in` takes those
        back instead of copying them into new blocks. Without it, a prompt shared with others
        came back as private copies nothing could find, and needed its whole table free."""
        if self.prefix_cache is None or request.request_id not in self._host_tables:
            return NO_PREFIX
        full = request.num_computed_tokens // self.block_size  # the host table holds these
        blocks = tuple(self.prefix_cache.lookup(request)[:full])
        return CachedPrefix(blocks, len(blocks) * self.block_size, self.prefix_cache.num_evictions)

    def blocks_to_swap_in(self, request: Request, num_new_tokens: int = 0, resident: CachedPrefix = NO_PREFIX) -> int:
        """Free device blocks the host table takes back, grown to hold `num_new_tokens` more,
        its `resident` prefix (resident_prefix) taken back where it lies."""
        held = len(self._host_tables.get(request.request_id, ()))
        total = max(held, self.blocks_for(request.num_computed_tokens + num_new_tokens))
        return total - len(resident.blocks) + sum(map(self.device.is_free, resident.blocks))

    def can_swap_in(self, request: Request, num_new_tokens: int = 0, resident: CachedPrefix = NO_PREFIX) -> bool:
        """Whether the host table, grown to hold `num_new_tokens` more, fits on the device."""
        return self.blocks_to_swap_in(request, num_new_tokens, resident) <= self.device.num_free

    def swap_in(self, request: Request, resident: CachedPrefix = NO_PREFIX) -> list[tuple[int, int]]:
        """Move the request's host blocks back to the device: its `resident` prefix (found by
        resident_prefix, nothing allocated since) shared where it lies, the rest copied into fresh
        blocks; returns the (host, device) copies."""
        if request.request_id in self._device_tables:  # a second table would leak the first
            raise RuntimeError(f"{request.request_id} holds device blocks already")
        if resident.blocks and resident.evictions != self.prefix_cache.num_evictions:
            raise RuntimeError("a resident block may have been evicted since it was found")
        host_table = self._host_tables.pop(request.request_id, [])
        for block in resident.blocks:  # first: off the free list before _allocate hands blocks out
            self.device.share(block)
        kept = len(resident.blocks)
        fresh = self._allocate(len(host_table) - kept)
        device_table = list(resident.blocks) + fresh
        self._device_tables[request.request_id] = device_table
        self.host.release(host_table)
        request.block_ids = list(device_table)
        return list(zip(host_table[kept:], fresh))

    def blocks_freed_by(self, requests: list[Request]) -> set[int]:
        """Device blocks that freeing all of `requests` returns to the free list: those no other
        table holds (with a prefix cache, a victim's shared blocks stay with their other holders)."""
        listed = Counter(block for request in requests for block in self._device_tables.get(request.request_id, ()))
        return {block for block, count in listed.items() if self.device.ref_count(block) == count}

    # ---- checks ------------------------------------------------------------------------------
    def num_requests_holding(self) -> int:
        return len(self._device_tables) + len(self._host_tables)

    def check_integrity(self) -> None:
        """Raise AssertionError when any accounting invariant is broken."""
        self.device.check(list(self._device_tables.values()), "device")
        self.host.check(list(self._host_tables.values()), "host")
        if self.prefix_cache is not None:
            self.prefix_cache.check()
