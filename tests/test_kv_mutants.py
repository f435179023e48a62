"""KV block accounting behaviours that the suite let through (mutation testing of
scheduler/block_manager.py, scheduler/prefix_cache.py and scheduler/eviction.py, session 37):
each test kills a one-line mutant that every other test passed."""

from __future__ import annotations

import pytest

from scheduler.block_manager import NO_PREFIX, BlockManager
from scheduler.config import SchedulerConfig
from scheduler.prefix_cache import PrefixCache
from scheduler.request import Request, SamplingParams, Tier
from scheduler.testing import reference_output
from test_prefix_cache import computed, manager, request, run


def swapping_manager(num_blocks: int) -> BlockManager:
    return BlockManager(num_gpu_blocks=num_blocks, block_size=4, num_cpu_blocks=8, prefix_cache=PrefixCache(4))


def test_a_resumed_request_keeps_the_cached_tokens_of_its_first_lookup() -> None:
    # B finds nothing on admission, is preempted by recompute and comes back onto its own blocks:
    # its cached tokens (the usage a client is shown) stay those of its first lookup, as the hit
    # rate does; overwritten on resumption they claimed 8 prompt tokens served from the cache.
    config = SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=16,
                             max_model_len=64, enable_prefix_caching=True)
    b = Request("B", list(range(1, 10)), SamplingParams(max_tokens=10, ignore_eos=True), 0.0, tier=Tier.BATCH)
    i = Request("I", list(range(50, 55)), SamplingParams(max_tokens=2, ignore_eos=True), 0.0, tier=Tier.INTERACTIVE)
    outputs, scheduler = run(config, [(0, b), (3, i)])
    assert outputs["B"] == reference_output(b.prompt_token_ids, 10)
    assert b.num_preemptions == 1 and scheduler.block_manager.prefix_cache.num_requery_hit_tokens >= 8
    assert b.num_cached_tokens == 0


def test_a_request_swapped_back_in_registers_its_copied_blocks_again() -> None:
    # Swapped out, its blocks on the free list are evicted: it comes back in fresh copies, which
    # are registered from its first block, so a later request with its prompt finds them.
    m = BlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=4, prefix_cache=PrefixCache(4))
    a = computed(m, request("a", range(1, 10)))  # two full blocks and one token
    m.swap_out(a)
    assert a.block_ids == []  # its device blocks are other requests' now
    x = request("x", [70] * 16)
    m.allocate_slots(x, 16)  # every device block, a's cached ones evicted
    m.free(x)
    assert m.resident_prefix(a).blocks == ()
    assert len(m.swap_in(a)) == 3
    m.allocate_slots(a, 1)  # its next token: registered with the step's grant
    m.commit_cached_blocks()
    assert m.cached_prefix(request("b", range(1, 10))).blocks == tuple(a.block_ids[:2])
    m.check_integrity()


def test_a_request_swapped_out_mid_prefill_takes_back_only_its_full_blocks() -> None:
    # B was swapped out after 10 of its 30 prompt tokens; A then computed the whole prompt on B's
    # two cached blocks. B takes back those two, not A's third (whose tokens B has only in part,
    # on the host) nor the four after it (more than its host table holds): its partial block is
    # copied back into a block of its own.
    m = swapping_manager(16)
    prompt = list(range(1, 31))
    b = request("b", prompt)
    assert m.allocate_slots(b, 10, m.cached_prefix(b)) is not None
    b.num_computed_tokens = 10
    m.commit_cached_blocks()
    m.swap_out(b)
    a = computed(m, request("a", prompt))
    assert len(m.prefix_cache.lookup(b)) == 7
    resident = m.resident_prefix(b)
    assert resident.blocks == tuple(a.block_ids[:2])
    assert m.blocks_to_swap_in(b, 0, resident) == 1
    copies = m.swap_in(b, resident)
    assert len(copies) == 1 and b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    m.check_integrity()
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == 16 and m.host.num_free == 8


def test_a_resident_prefix_evicted_before_the_swap_in_is_refused() -> None:
    # As a cached prefix evicted before its allocation allocates nothing: a resident prefix taken
    # back after its blocks were handed out for other tokens would read their KV as its own.
    m = swapping_manager(4)
    a = computed(m, request("a", range(1, 10)))
    m.swap_out(a)
    resident = m.resident_prefix(a)
    assert len(resident.blocks) == 2  # cached on the free list
    x = request("x", [70] * 16)
    m.allocate_slots(x, 16)  # evicts them
    m.free(x)
    with pytest.raises(RuntimeError, match="evicted since"):
        m.swap_in(a, resident)
    m.check_integrity()  # refused before anything moved: a is still on the host
    assert m.resident_prefix(a).blocks == () and len(m.swap_in(a)) == 3
    m.check_integrity()


def test_a_request_holding_blocks_or_computed_tokens_has_no_cached_prefix() -> None:
    # cached_prefix is for a request that starts afresh; resident_prefix for one on the host.
    m = swapping_manager(8)
    a = computed(m, request("a", range(1, 10)))
    granted = request("granted", [5] * 9)
    m.allocate_slots(granted, 9, m.cached_prefix(granted))  # its step has not run yet
    assert m.cached_prefix(granted) is NO_PREFIX  # would find its own blocks, registered with the grant
    swapped = computed(m, request("swapped", list(range(1, 9)) + [30, 31]))
    m.swap_out(swapped)
    assert m.cached_prefix(swapped) is NO_PREFIX  # its KV is on the host: swap_in brings it back
    assert m.resident_prefix(a) is NO_PREFIX  # on the device: nothing to take back
    assert m.resident_prefix(swapped).blocks == tuple(a.block_ids[:2])


def test_check_integrity_catches_a_count_or_a_registration_that_disagrees() -> None:
    # The invariant check every property test relies on: a reference no table makes, and a block
    # whose key no longer names it, are caught.
    m = manager()
    a = computed(m, request("a", range(1, 10)))
    m.device.share(a.block_ids[0])  # a second reference, in no table
    with pytest.raises(AssertionError, match="refcount 2 != 1 tables"):
        m.check_integrity()
    m = manager()
    a = computed(m, request("a", range(1, 10)))
    del m.prefix_cache._key_of[a.block_ids[0]]  # its key still names it
    with pytest.raises(AssertionError, match="prefix cache"):
        m.check_integrity()
