"""Automatic prefix caching (scheduler/prefix_cache.py) with no tensors: the paged reference runner
reads every context through the block tables, so a request served a block that does not hold its
tokens, or one never written, gives other tokens than the reference (or fails on an unwritten
slot). Requests that share prefixes, arrive while others run or after they finished, under
recompute and swap preemption, chunked or whole, all give the reference's tokens, find their
prefixes, and leave every block free; the block manager's rules are checked one by one."""

from __future__ import annotations

import random

import pytest

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.prefix_cache import PrefixCache
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import PagedTokenRunner, reference_output

SYSTEM = [random.Random(1).randrange(1, 900) for _ in range(37)]  # a shared system prompt


def request(request_id: str, prompt: list[int], max_tokens: int = 6, **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   arrival_time=0.0)


def workload(seed: int) -> list[tuple[int, Request]]:
    """(step to add it at, request): a shared system prompt with other questions, repeats of one
    prompt, and second turns that extend a first turn's prompt and reply."""
    rng = random.Random(seed)
    arrivals = []
    for index in range(14):
        question = [rng.randrange(1, 900) for _ in range(rng.randrange(1, 30))]
        arrivals.append((rng.randrange(0, 40), request(f"q{index}", SYSTEM + question, rng.randrange(2, 12))))
    repeated = SYSTEM + [5, 6, 7]
    arrivals += [(step, request(f"same{step}", repeated, 5)) for step in (0, 1, 30)]
    first = SYSTEM + [11, 12, 13, 14]
    arrivals.append((0, request("turn1", first, 8)))
    second = first + reference_output(first, 8) + [21, 22]
    arrivals.append((60, request("turn2", second, 4)))
    return arrivals


def run(config: SchedulerConfig, arrivals: list[tuple[int, Request]]) -> tuple[dict[str, list[int]], Scheduler]:
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks)
    pending = sorted(arrivals, key=lambda item: item[0])
    outputs = {}
    for step in range(5000):
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1])
        if not pending and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule(now=float(step))
        for done in scheduler.update_from_output(output, runner.execute(output), now=float(step)):
            if done.is_finished:
                outputs[done.request_id] = list(done.output_token_ids)
        scheduler.block_manager.check_integrity()
    assert scheduler.block_manager.num_free_blocks == config.num_gpu_blocks  # no block leaks
    return outputs, scheduler


@pytest.mark.parametrize("mode, num_gpu_blocks, chunked, block_size", [
    ("recompute", 400, True, 16), ("recompute", 400, False, 8), ("recompute", 10, True, 8),
    ("swap", 10, True, 8), ("recompute", 22, True, 4)])
def test_cached_prefixes_give_the_reference_tokens(mode, num_gpu_blocks, chunked, block_size) -> None:
    # Under 100 blocks, six seats outgrow the cache: requests are preempted (no watermark).
    config = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size, max_num_seqs=6,
                             max_num_batched_tokens=64 if chunked else 256, enable_chunked_prefill=chunked,
                             preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0, max_model_len=256,
                             enable_prefix_caching=True, kv_watermark=0.0)
    for seed in range(3):
        arrivals = workload(seed)
        outputs, scheduler = run(config, arrivals)
        assert outputs == {r.request_id: reference_output(r.prompt_token_ids, r.sampling_params.max_tokens)
                           for _, r in arrivals}
        cache = scheduler.block_manager.prefix_cache
        assert cache.num_hit_tokens >= 2 * (len(SYSTEM) // block_size) * block_size
        turn2 = next(r for _, r in arrivals if r.request_id == "turn2")
        if num_gpu_blocks > 100:  # nothing evicted: the second turn finds the whole first turn
            assert turn2.num_cached_tokens == (len(SYSTEM) + 4 + 8 - 1) // block_size * block_size
        if num_gpu_blocks < 100:
            assert scheduler.stats().num_preemptions > 0


def test_without_prefix_caching_nothing_is_found() -> None:
    config = SchedulerConfig(num_gpu_blocks=400, block_size=8, max_num_seqs=4, max_model_len=256)
    arrivals = workload(0)
    outputs, scheduler = run(config, arrivals)
    requests = [r for _, r in arrivals]  # the scheduler forgets each once it has reported it
    assert outputs == {r.request_id: reference_output(r.prompt_token_ids, r.sampling_params.max_tokens)
                       for r in requests}
    assert all(r.num_cached_tokens is None for r in requests)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (None, None)


# ---- the block manager's rules, on blocks of 4 tokens --------------------------------------------
def manager(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_gpu_blocks=num_blocks, block_size=4, prefix_cache=PrefixCache(4))


def computed(manager: BlockManager, r: Request) -> Request:
    """Allocate and compute r's whole prompt, as a step would, registering its blocks."""
    cached = manager.cached_prefix(r)
    assert manager.allocate_slots(r, r.num_tokens - cached.num_tokens, cached) is not None
    r.num_computed_tokens = r.num_tokens
    manager.commit_cached_blocks()
    return r


def test_a_prefix_is_shared_while_held_and_kept_after_it_is_freed() -> None:
    m = manager()
    first = computed(m, request("a", range(1, 11)))  # blocks [1-4] [5-8] [9-10]
    second = request("b", list(range(1, 9)) + [50, 51, 52])
    assert m.cached_prefix(second).num_tokens == 8
    assert m.allocate_slots(second, 3, m.cached_prefix(second))[:2] == first.block_ids[:2]
    assert second.num_computed_tokens == 8
    assert m.device.ref_count(first.block_ids[0]) == 2
    m.free(first)
    m.free(second)
    m.check_integrity()
    assert m.num_free_blocks == 8
    assert m.cached_prefix(request("c", range(1, 10))).num_tokens == 8  # found on the free list
    assert m.cached_prefix(request("d", [99] + list(range(2, 10)))).num_tokens == 0  # another first token


def test_at_least_one_token_is_fed_from_a_block_of_its_own() -> None:
    m = manager()
    computed(m, request("a", range(1, 9)))  # two full blocks
    assert m.cached_prefix(request("same", range(1, 9))).num_tokens == 4  # (8 - 1) // 4 blocks
    assert m.cached_prefix(request("longer", range(1, 10))).num_tokens == 8


def test_the_least_recently_freed_blocks_are_evicted_first_a_tables_tail_before_its_head() -> None:
    m = manager(num_blocks=4)
    old = computed(m, request("old", range(1, 9)))
    m.free(old)
    # The two never used blocks go first, then the old table's tail, then its head.
    m.allocate_slots(request("x", [70] * 12), 12)
    assert m.cached_prefix(request("again", range(1, 10))).num_tokens == 4
    m.allocate_slots(request("y", [80] * 4), 4)
    assert m.cached_prefix(request("again2", range(1, 10))).num_tokens == 0
    m.check_integrity()


def test_a_prefix_evicted_before_its_allocation_allocates_nothing() -> None:
    m = manager(num_blocks=3)
    m.free(computed(m, request("a", range(1, 9))))
    late = request("late", range(1, 10))
    cached = m.cached_prefix(late)
    assert cached.num_tokens == 8
    x = request("x", [70] * 12)
    m.allocate_slots(x, 12)  # evicts every free block
    assert m.allocate_slots(late, 1, cached) is None and late.num_computed_tokens == 0
    # Freed again, the blocks are free but hold x's tokens: the stale prefix must not take them.
    m.free(x)
    assert m.allocate_slots(late, 1, cached) is None and late.num_computed_tokens == 0
    m.check_integrity()


def test_a_request_asking_for_prompt_logprobs_finds_nothing_and_is_no_query() -> None:
    m = manager()
    computed(m, request("a", range(1, 11)))
    queried = m.prefix_cache.num_query_tokens
    asking = request("b", range(1, 11), prompt_logprobs=0)
    assert m.cached_prefix(asking).num_tokens == 0
    m.allocate_slots(asking, 10)
    # vLLM skips the cache for it before counting a query: counted, it read as a 10-token miss.
    assert m.prefix_cache.num_query_tokens == queried and m.prefix_cache.num_hit_tokens == 0


def test_a_salted_request_finds_only_blocks_of_its_own_salt() -> None:
    m = manager()
    computed(m, request("a", range(1, 11), cache_salt="x"))
    assert m.cached_prefix(request("plain", range(1, 11))).num_tokens == 0
    assert m.cached_prefix(request("other", range(1, 11), cache_salt="y")).num_tokens == 0
    assert m.cached_prefix(request("same", range(1, 11), cache_salt="x")).num_tokens == 8
    computed(m, request("b", range(1, 11)))
    assert m.cached_prefix(request("plain2", range(1, 11))).num_tokens == 8
    for bad in ("", "\ud800", 5):  # a lone surrogate has no UTF-8 form to hash
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)


def test_a_block_is_found_only_after_the_same_blocks_before_it() -> None:
    m = manager()
    computed(m, request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # The same second block after another first one: a different prefix, nothing found.
    assert m.cached_prefix(request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])).num_tokens == 0
    assert m.cached_prefix(request("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])).num_tokens == 4


def test_a_first_block_that_collides_under_pythons_hash_is_not_taken_for_another() -> None:
    # CPython hashes an int modulo 2**61 - 1, so these two first blocks have one hash() and so
    # would one chain hash: the second block, computed after (0, 0, 0, 0), was served after them.
    collider = 2**61 - 1
    assert hash((None, (0, 0, 0, 0))) == hash((None, (collider, 0, 0, 0)))
    m = manager()
    computed(m, request("a", [0, 0, 0, 0, 5, 6, 7, 8, 9]))
    computed(m, request("own", [collider, 0, 0, 0, 1]))  # its first block, cached by itself
    # Its own first block is found, a's second is not: another context computed its KV.
    assert m.cached_prefix(request("b", [collider, 0, 0, 0, 5, 6, 7, 8, 9])).num_tokens == 4


def one_arrival_a_step(num_blocks: int, arrivals: dict[int, Request]):
    """Step s adds arrivals[s] and runs (prefix caching on, no watermark, block integrity checked
    after each step); the last step's output."""
    config = SchedulerConfig(num_gpu_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, kv_watermark=0.0, enable_prefix_caching=True)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(num_blocks, 4)
    for step in range(len(arrivals)):
        scheduler.add_request(arrivals[step], float(step))
        output = scheduler.schedule(float(step))
        scheduler.update_from_output(output, runner.execute(output), float(step))
        scheduler.block_manager.check_integrity()
    return output


def test_an_urgent_request_preempts_as_many_as_free_its_room_though_they_share_blocks() -> None:
    # Two batch requests share two blocks; an interactive one needs six of eight. Preempting one
    # of them frees only its own block: both go, in the same step, and it is admitted at once.
    from scheduler.request import Tier

    shared = list(range(100, 108))
    arrivals = {0: Request("A", shared + [1], SamplingParams(max_tokens=12, ignore_eos=True), 0.0, tier=Tier.BATCH),
                1: Request("B", shared + [2], SamplingParams(max_tokens=12, ignore_eos=True), 1.0, tier=Tier.BATCH),
                2: Request("I", list(range(200, 224)), SamplingParams(max_tokens=1, ignore_eos=True), 2.0,
                           tier=Tier.INTERACTIVE)}
    output = one_arrival_a_step(8, arrivals)
    assert [c.request_id for c in output.chunks] == ["I"] and sorted(output.preempted_ids) == ["A", "B"]


def test_requests_admitted_in_one_step_share_the_blocks_the_first_fills() -> None:
    # The n choices of one prompt: the second starts after the first's three full blocks in the
    # same step, and reads them as the first writes them.
    config = SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, enable_prefix_caching=True)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(16, 4)
    prompt = list(range(300, 313))
    first, second = request("c0", prompt), request("c1", prompt)
    scheduler.add_request(first)
    scheduler.add_request(second)
    output = scheduler.schedule(0.0)
    chunks = {chunk.request_id: chunk for chunk in output.chunks}
    assert chunks["c1"].start_position == 12 and chunks["c1"].block_ids[:3] == chunks["c0"].block_ids[:3]
    assert second.num_cached_tokens == 12 and output.num_batched_tokens == 13 + 1
    outputs = {}
    for step in range(1, 20):
        for done in scheduler.update_from_output(output, runner.execute(output), now=float(step)):
            if done.is_finished:
                outputs[done.request_id] = list(done.output_token_ids)
        scheduler.block_manager.check_integrity()
        output = scheduler.schedule(float(step))
    assert outputs == {"c0": reference_output(prompt, 6), "c1": reference_output(prompt, 6)}
    assert scheduler.block_manager.num_free_blocks == 16


def test_a_failed_steps_blocks_are_not_found() -> None:
    config = SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, enable_prefix_caching=True)
    scheduler = Scheduler(config)
    prompt = list(range(300, 313))
    scheduler.add_request(request("a", prompt))
    output = scheduler.schedule(0.0)
    assert scheduler.block_manager.cached_prefix(request("probe", prompt)).num_tokens == 12  # found in the step
    scheduler.restart_failed_step(output, 0.0)  # the model step raised: its KV may be half written
    assert scheduler.block_manager.cached_prefix(request("probe", prompt)).num_tokens == 0
    scheduler.block_manager.check_integrity()
    runner = PagedTokenRunner(16, 4)
    for step in range(1, 20):  # it starts over, registering its blocks again
        output = scheduler.schedule(float(step))
        scheduler.update_from_output(output, runner.execute(output), float(step))
    assert scheduler.block_manager.cached_prefix(request("later", prompt)).num_tokens == 12


def test_a_prefix_stops_at_its_first_evicted_block() -> None:
    # Block 1 and 2 stay registered after block 0 is evicted, but their KV was computed after
    # block 0's tokens: without it they are no prefix of anything.
    m = manager()
    first = computed(m, request("a", range(1, 14)))  # three full blocks and one token
    m.prefix_cache.forget(first.block_ids[0])
    assert m.cached_prefix(request("b", range(1, 14))).blocks == ()


def test_a_lookup_that_finds_nothing_is_counted_as_queried() -> None:
    config = SchedulerConfig(num_gpu_blocks=16, block_size=4, max_model_len=64, enable_prefix_caching=True)
    scheduler = Scheduler(config)
    miss = request("a", range(1, 11))
    scheduler.add_request(miss)
    scheduler.schedule(now=0.0)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10, 0)
    assert miss.num_cached_tokens == 0


def test_a_victims_blocks_that_hold_the_urgent_requests_prefix_make_it_no_room() -> None:
    # B holds three blocks, the first two of them I's cached prefix: preempting B alone frees
    # them, but I takes those two back, so B leaves one block of room where I needs two new
    # ones. Both batch requests go, in the same step, and I is admitted at once.
    from scheduler.request import Tier

    shared = list(range(100, 108))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    arrivals = {0: Request("B2", list(range(300, 305)), params, 0.0, tier=Tier.BATCH),
                1: Request("B", shared + [1], params, 1.0, tier=Tier.BATCH),
                2: Request("I", shared + list(range(200, 208)), SamplingParams(max_tokens=1, ignore_eos=True), 2.0,
                           tier=Tier.INTERACTIVE)}
    output = one_arrival_a_step(5, arrivals)
    assert [c.request_id for c in output.chunks] == ["I"] and sorted(output.preempted_ids) == ["B", "B2"]
    assert output.chunks[0].start_position == 8  # on its cached prefix


def test_a_swapped_out_table_is_evicted_tail_first_too() -> None:
    m = BlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=4, prefix_cache=PrefixCache(4))
    old = computed(m, request("old", range(1, 9)))
    m.swap_out(old)  # its device blocks stay findable on the free list, tail first to go
    m.allocate_slots(request("x", [70] * 12), 12)  # the two never used blocks and old's tail
    assert m.cached_prefix(request("again", range(1, 10))).num_tokens == 4
    m.check_integrity()


def test_a_swapped_out_request_takes_back_the_prefix_blocks_still_resident_instead_of_copying_them() -> None:
    # Its prompt's blocks, shared with another request, came back as private copies nothing could
    # find (their keys held by the originals), and it needed its whole table free to return.
    m = BlockManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=8, prefix_cache=PrefixCache(4))
    a = computed(m, request("a", range(1, 14)))  # blocks [1-4] [5-8] [9-12] [13]
    b = computed(m, request("b", list(range(1, 13)) + [40, 41]))  # shares a's first three
    assert m.device.num_free == 8 - 5
    m.swap_out(b)
    resident = m.resident_prefix(b)
    assert resident.blocks == tuple(a.block_ids[:3])
    assert m.blocks_to_swap_in(b, 1, resident) == 1  # its own last block only
    copies = m.swap_in(b, resident)
    assert [device for _, device in copies] == b.block_ids[3:] and len(copies) == 1
    assert b.block_ids[:3] == a.block_ids[:3] and m.device.ref_count(a.block_ids[0]) == 2
    m.free(a)  # the shared blocks stay b's, still findable
    assert m.cached_prefix(request("c", range(1, 14))).num_tokens == 12
    # Cached on the free list counts as resident too: taken back, off the free list.
    m.free(b)
    d = computed(m, request("d", list(range(1, 13)) + [60]))
    m.swap_out(d)
    m.free(computed(m, request("e", list(range(1, 9)) + [70, 71])))  # holds the first two for a while
    resident = m.resident_prefix(d)
    assert len(resident.blocks) == 3 and all(m.device.is_free(block) for block in resident.blocks)
    assert m.blocks_to_swap_in(d, 0, resident) == 4
    m.swap_in(d, resident)
    m.check_integrity()
    with pytest.raises(RuntimeError, match="holds device blocks already"):
        m.swap_in(d)
    m.free(d)
    m.check_integrity()
    assert m.num_free_blocks == 8 and m.host.num_free == 8


def test_an_interrupt_while_a_request_swaps_in_restarts_it_without_a_leak(monkeypatch) -> None:
    # Swapped in, then interrupted before it was in the plan: it stayed in the swapped queue holding
    # device blocks and no host copy, never to run, its blocks never freed.
    config = SchedulerConfig(num_gpu_blocks=10, block_size=8, max_num_seqs=6, max_num_batched_tokens=64,
                             preemption_mode="swap", num_cpu_blocks=64, max_model_len=256,
                             enable_prefix_caching=True, kv_watermark=0.0)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks)
    arrivals = workload(0)
    pending = sorted(arrivals, key=lambda item: item[0])
    outputs, interrupted = {}, []
    real_swap_in = scheduler.block_manager.swap_in

    def swap_in_then_interrupt(request, *args):
        copies = real_swap_in(request, *args)
        if not interrupted:  # Ctrl-C, once, right after the blocks moved
            interrupted.append(request.request_id)
            raise KeyboardInterrupt
        return copies

    monkeypatch.setattr(scheduler.block_manager, "swap_in", swap_in_then_interrupt)
    for step in range(5000):
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1])
        if not pending and not scheduler.has_unfinished_requests():
            break
        try:
            output = scheduler.schedule(now=float(step))
        except KeyboardInterrupt:
            scheduler.block_manager.check_integrity()
            continue
        for done in scheduler.update_from_output(output, runner.execute(output), now=float(step)):
            if done.is_finished:
                outputs[done.request_id] = list(done.output_token_ids)
    assert interrupted
    assert outputs == {r.request_id: reference_output(r.prompt_token_ids, r.sampling_params.max_tokens)
                       for _, r in arrivals}
    assert scheduler.block_manager.num_free_blocks == config.num_gpu_blocks


def test_a_request_resumed_after_preemption_by_recompute_is_counted_apart_from_first_lookups() -> None:
    # B gives its only seat to I and comes back onto its own blocks, cached on the free list
    # meanwhile: the hit rate /metrics reports counts first lookups only, as vLLM's does.
    from scheduler.request import Tier

    config = SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=16,
                             max_model_len=64, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    b = Request("B", list(range(1, 10)), params, 0.0, tier=Tier.BATCH)
    i = Request("I", list(range(50, 55)), SamplingParams(max_tokens=2, ignore_eos=True), 0.0,
                tier=Tier.INTERACTIVE)
    outputs, scheduler = run(config, [(0, b), (3, i)])
    assert outputs == {r.request_id: reference_output(r.prompt_token_ids, r.sampling_params.max_tokens)
                       for r in (b, i)}
    assert b.num_preemptions == 1
    stats, cache = scheduler.stats(), scheduler.block_manager.prefix_cache
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9 + 5, 0)
    assert cache.num_requery_hit_tokens >= 8 and cache.num_requery_tokens == 9 + 3
