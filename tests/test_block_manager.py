"""Block manager invariants: free + used == total, no double free, nothing leaked.

Property-based: hypothesis drives random sequences of add / grow / swap / abort / finish, directly
on the block manager and through the whole scheduler with the paged token runner.
"""

from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, example, given, settings, target
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import PagedTokenRunner, reference_output


def request(request_id: str, prompt_len: int = 4, max_tokens: int = 8) -> Request:
    # Seeded by the id: requests of one size must differ, or swapping their KV would go unseen.
    offset = zlib.crc32(request_id.encode())
    return Request(request_id, [1 + (i + offset) % 50 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)


def test_lazy_allocation_and_free() -> None:
    manager = BlockManager(num_gpu_blocks=4, block_size=4)
    a = request("a")
    assert manager.allocate_slots(a, 5) == a.block_ids and len(a.block_ids) == 2
    a.num_computed_tokens = 5
    assert len(manager.allocate_slots(a, 3)) == 2  # 8 tokens still fit in two blocks
    assert len(manager.allocate_slots(a, 4)) == 3
    b = request("b")
    assert manager.allocate_slots(b, 8) is None  # needs 2, one free: nothing allocated
    assert manager.num_free_blocks == 1
    manager.free(a)
    assert manager.num_free_blocks == 4 and a.block_ids == []
    manager.check_integrity()


def test_double_free_is_caught() -> None:
    manager = BlockManager(num_gpu_blocks=2, block_size=4)
    with pytest.raises(RuntimeError, match="double free"):
        manager.device.release([0])


def test_swap_round_trip_pairs() -> None:
    manager = BlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=4)
    a = request("a")
    device_table = list(manager.allocate_slots(a, 7))
    a.num_computed_tokens = 7
    out_pairs = manager.swap_out(a)
    assert [d for d, _ in out_pairs] == device_table and manager.num_free_blocks == 4
    assert manager.host.num_free == 2
    in_pairs = manager.swap_in(a)
    assert [h for h, _ in in_pairs] == [h for _, h in out_pairs]
    assert a.block_ids == [d for _, d in in_pairs] and manager.host.num_free == 4
    manager.check_integrity()


operations = st.lists(st.tuples(st.sampled_from(["grow", "swap_out", "swap_in", "free"]),
                                st.integers(0, 5), st.integers(1, 20)), max_size=60)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_block_manager_invariants_under_random_operations(ops: list[tuple[str, int, int]]) -> None:
    manager = BlockManager(num_gpu_blocks=12, block_size=4, num_cpu_blocks=8)
    requests = [request(f"r{i}") for i in range(6)]
    on_host: set[int] = set()
    for op, index, tokens in ops:
        req = requests[index]
        if op == "grow" and index not in on_host:
            if manager.allocate_slots(req, tokens) is not None:
                req.num_computed_tokens += tokens
        elif op == "swap_out" and index not in on_host and manager.can_swap_out(req):
            manager.swap_out(req)
            on_host.add(index)
        elif op == "swap_in" and index in on_host and manager.can_swap_in(req):
            manager.swap_in(req)
            on_host.discard(index)
        elif op == "free":
            manager.free(req)
            req.num_computed_tokens = 0
            on_host.discard(index)
        manager.check_integrity()
    for req in requests:
        manager.free(req)
    manager.check_integrity()
    assert manager.num_free_blocks == 12 and manager.host.num_free == 8
    assert manager.num_requests_holding() == 0


scheduler_events = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "abort", "finish"]),
                                      st.integers(1, 30), st.integers(1, 12)), max_size=60)
# Three short prompts whose replies outgrow the 10 blocks together, stepped together: preemption
# (and swap) for sure. (Long prompts no longer crowd them: a prompt waits until all of it fits.)
CROWDED = [("add", 8, 28), ("add", 9, 26), ("add", 10, 24)] + [("step", 1, 1)] * 12


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scheduler_events, st.sampled_from(["recompute", "swap"]))
@example(CROWDED, "swap")
@example(CROWDED, "recompute")
def test_scheduler_never_leaks_blocks(events: list[tuple[str, int, int]], mode: str) -> None:
    config = SchedulerConfig(num_gpu_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                             max_model_len=40, preemption_mode=mode, num_cpu_blocks=12 if mode == "swap" else 0)
    scheduler = Scheduler(config)
    runner = PagedTokenRunner(10, 4, 12)
    live: list[str] = []
    done: dict[str, list[int]] = {}
    now = 0.0
    swapped_out = 0

    def step() -> None:
        nonlocal swapped_out
        output = scheduler.schedule(now)
        swapped_out += len(output.swap_out)
        for req in scheduler.update_from_output(output, runner.execute(output), now):
            if req.status is RequestStatus.FINISHED_LENGTH:
                done[req.request_id] = list(req.output_token_ids)
        scheduler.block_manager.check_integrity()

    for index, (event, size, tokens) in enumerate(events):
        now += 1.0
        if event == "add":
            scheduler.add_request(request(f"q{index}", size, tokens))
            live.append(f"q{index}")
        elif event == "step":
            step()
        elif live:
            victim = live[size % len(live)]
            status = RequestStatus.FINISHED_ABORTED if event == "abort" else RequestStatus.FINISHED_STOPPED
            scheduler.finish_request(victim, status, now)
            scheduler.block_manager.check_integrity()
    for _ in range(10_000):  # a stalled scheduler fails here rather than hanging the suite
        if not scheduler.has_unfinished_requests():
            break
        now += 1.0
        step()
    else:
        pytest.fail("requests left unfinished after 10,000 steps")
    target(float(scheduler.stats().num_preemptions))  # steer the search toward crowded caches
    if events == CROWDED:
        assert scheduler.stats().num_preemptions > 0
        assert (swapped_out > 0) == (mode == "swap")  # no quiet fallback to recompute
    manager = scheduler.block_manager
    assert manager.num_free_blocks == 10 and manager.host.num_free == config.num_cpu_blocks
    for request_id, tokens in done.items():  # every completed output equals the reference
        index = int(request_id[1:])
        _, size, max_tokens = events[index]
        expected_len = min(max_tokens, config.max_model_len - size)  # max_model_len also ends a request
        assert tokens == reference_output(request(request_id, size, max_tokens).prompt_token_ids, expected_len)


def test_swap_out_and_in_fit_exactly_the_free_blocks() -> None:
    manager = BlockManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=2)
    a = request("a", prompt_len=8)
    manager.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    assert manager.can_swap_out(a)  # two blocks, two free on the host
    manager.swap_out(a)
    manager.allocate_slots(request("b", prompt_len=8), 8)  # two of the four device blocks
    assert manager.can_swap_in(a)  # its two blocks into the two free
    assert not manager.can_swap_in(a, 1)  # a ninth token needs a third
    manager.check_integrity()


def test_usage_is_the_share_of_device_blocks_held() -> None:
    manager = BlockManager(num_gpu_blocks=4, block_size=4)
    assert manager.usage == 0.0
    manager.allocate_slots(request("a"), 3)
    assert manager.usage == 0.25


def test_tokens_that_fit_leave_the_reserved_blocks_to_others() -> None:
    manager = BlockManager(num_gpu_blocks=4, block_size=4)
    a = request("a", prompt_len=5)
    manager.allocate_slots(a, 5)  # two blocks, three slots left in them
    a.num_computed_tokens = 5
    assert manager.num_tokens_that_fit(a) == 3 + 2 * 4
    assert manager.num_tokens_that_fit(a, reserved_blocks=1) == 3 + 4
    assert manager.num_tokens_that_fit(a, reserved_blocks=3) == 3  # more reserved than free: its own slots


def test_a_negative_block_count_is_refused_not_the_whole_free_list() -> None:
    from scheduler.block_manager import BlockPool

    pool = BlockPool(4)
    with pytest.raises(RuntimeError, match="asked for -1 blocks"):
        pool.allocate(-1)
    assert pool.num_free == 4
