"""A random stream of arrivals, aborts, tiers and priorities through the engine (tiny model), with a
KV cache too small for the requests it holds, for every servable policy, both preemption modes,
with and without prefix caching: every request not aborted ends once, with the greedy tokens of a
run that had room to spare; an aborted one never reports again; and at the end the block manager,
the host pool, the prefix cache and the detokenizers hold nothing.

The same stream with random sampling settings (penalties, logit bias, bad words, allowed ids,
min_tokens, stop strings and tokens, logprobs, prompt logprobs, seeded draws) ends each request
as it ends when run alone.

The unit tests check each of these mechanisms alone; this one checks that they compose, in the
interleavings a server sees (an abort while a request is swapped out, an interactive arrival that
preempts a batch request whose prefix another request shares, and so on)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from engine.llm import LLM
from hf_reference import random_prompts
from scheduler.request import SamplingParams, Tier

MAX_TOKENS = 20
NUM_REQUESTS = 24
BLOCKS = 10  # of 16 tokens: the longest request (100 tokens) fits alone, a few of them do not


@dataclass(frozen=True)
class Arrival:
    request_id: str
    step: int  # the engine step before which it is added
    prompt: tuple[int, ...]
    params: SamplingParams
    tier: Tier
    priority: int


@pytest.fixture(scope="module")
def prompt_pool() -> list[list[int]]:
    """Prompts of 3-80 tokens, half of them after one of two shared 32-token prefixes (two full
    blocks, which the prefix cache can find)."""
    prefixes = random_prompts([32, 32], seed=11)
    tails = random_prompts([3, 9, 17, 25, 40, 48, 1, 13, 30, 44, 6, 21], seed=12)
    return tails[:6] + [prefixes[i % 2] + tail for i, tail in enumerate(tails[6:])]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompt_pool) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's first MAX_TOKENS greedy tokens, from an engine with room for everything at once
    (never preempted); a request with fewer max_tokens gets their prefix."""
    ample = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = ample.generate(prompt_pool, params)
    assert ample.engine.stats().scheduler.num_preemptions == 0
    return {tuple(prompt): list(out.token_ids) for prompt, out in zip(prompt_pool, outputs)}


def greedy_params(rng: random.Random, prompt: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(max_tokens=rng.randint(1, MAX_TOKENS), temperature=0.0, ignore_eos=True)


def random_arrivals(rng: random.Random, prompt_pool: list[list[int]], with_priority: bool,
                    make_params=greedy_params) -> list[Arrival]:
    """NUM_REQUESTS arrivals in bursts and gaps, each of a random prompt, tier and priority, with
    `make_params`' sampling settings."""
    arrivals, step = [], 0
    for i in range(NUM_REQUESTS):
        step += rng.choice([0, 0, 1, 2, 4])  # bursts and gaps
        prompt = tuple(rng.choice(prompt_pool))
        arrivals.append(Arrival(f"r{i}", step, prompt, make_params(rng, prompt), rng.choice(list(Tier)),
                                rng.randint(0, 3) if with_priority else 0))
    return arrivals


def drive(llm: LLM, arrivals: list[Arrival], rng: random.Random, abort_chance: float):
    """Steps the engine through the arrivals, aborting a random live request now and then; returns
    each request's final output and the ids aborted while live. Checks the block accounting after
    every step and that nothing reports after it finished or was aborted."""
    engine, block_manager = llm.engine, llm.engine.scheduler.block_manager
    pending, live, aborted, final = list(arrivals), set(), set(), {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, pending[0].step)  # an idle engine waits for the next arrival
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            engine.add_request(arrival.request_id, list(arrival.prompt), arrival.params, tier=arrival.tier,
                               priority=arrival.priority)
            live.add(arrival.request_id)
        if live and rng.random() < abort_chance:
            victim = rng.choice(sorted(live))
            assert engine.abort_request(victim)
            live.discard(victim)
            aborted.add(victim)
        for output in engine.step():
            assert output.request_id in live, f"{output.request_id} reported after it ended"
            if output.finished:
                live.discard(output.request_id)
                final[output.request_id] = output
        block_manager.check_integrity()
        step += 1
    return final, aborted


def nothing_held(llm: LLM):
    """Checks that no device block, host block, request table or detokenizer is left; returns the
    scheduler's stats."""
    stats = llm.engine.stats().scheduler
    block_manager = llm.engine.scheduler.block_manager
    assert stats.num_free_blocks == stats.num_total_blocks and block_manager.num_requests_holding() == 0
    assert block_manager.host.num_free == block_manager.host.num_blocks
    assert llm.engine.output_processor.num_tracked() == 0
    return stats


SETTINGS = [
    # (seed, policy, preemption mode, prefix caching, step budget, chunked prefill)
    (0, "fcfs", "recompute", False, 32, True),
    (1, "fcfs", "swap", True, 64, True),
    (2, "priority", "swap", False, 48, True),
    (3, "priority", "recompute", True, 32, True),
    (4, "sjf", "recompute", True, 64, True),
    (5, "sjf", "swap", False, 128, False),
    (6, "srpt", "swap", True, 32, True),
    (7, "srpt", "recompute", False, 128, False),
    (8, "goodput", "recompute", True, 48, True),
    (9, "goodput", "swap", True, 128, False),
]


@pytest.mark.parametrize("seed, policy, mode, prefix_caching, budget, chunked", SETTINGS)
def test_random_arrivals_and_aborts_keep_every_token_and_leak_no_block(
        tiny_model_dir, prompt_pool, reference, seed, policy, mode, prefix_caching, budget, chunked):
    rng = random.Random(seed)
    arrivals = random_arrivals(rng, prompt_pool, with_priority=policy == "priority")
    # No watermark with prefix caching: the tight cache must preempt, which is what is under test.
    options = {"enable_prefix_caching": True, "kv_watermark": 0.0} if prefix_caching else {}
    llm = LLM(str(tiny_model_dir), max_model_len=128, num_threads=1, num_gpu_blocks=BLOCKS, max_num_seqs=6,
              max_num_batched_tokens=budget, enable_chunked_prefill=chunked, preemption_mode=mode,
              policy=policy, scheduler_options=options)
    final, aborted = drive(llm, arrivals, rng, abort_chance=0.04)

    assert aborted and set(final) | aborted == {a.request_id for a in arrivals}
    assert not set(final) & aborted
    for arrival in arrivals:
        if arrival.request_id in final:
            output = final[arrival.request_id]
            assert output.finish_reason == "length"
            assert list(output.token_ids) == reference[arrival.prompt][:arrival.params.max_tokens], arrival.request_id
    assert nothing_held(llm).num_preemptions > 0  # the cache was too small, as meant
    if prefix_caching:
        assert llm.engine.scheduler.block_manager.prefix_cache.num_hit_tokens > 0


def featured_params(reference: dict[tuple[int, ...], list[int]], decode):
    """A maker of random sampling settings that bite on the prompt's own greedy reply: penalties,
    a logit bias and a bad word on tokens it would generate, an allowed set holding some of them,
    min_tokens, a stop string or stop token from its text, logprobs, prompt logprobs, and seeded
    sampling among the top 5 (a seeded draw is a function of seed and position alone)."""

    def make(rng: random.Random, prompt: tuple[int, ...]) -> SamplingParams:
        reply = reference[prompt]
        options = {"max_tokens": rng.randint(1, MAX_TOKENS), "temperature": 0.0, "ignore_eos": rng.random() < 0.8}
        if rng.random() < 0.2:
            options.update(temperature=1.0, top_k=5, seed=rng.randrange(2**32))
        if rng.random() < 0.3:
            options.update(repetition_penalty=rng.choice([1.3, 0.8]), frequency_penalty=rng.choice([0.0, 0.5]),
                           presence_penalty=rng.choice([-0.5, 1.0]))
        if rng.random() < 0.2:
            options["logit_bias"] = tuple((token, rng.choice([-100.0, 5.0])) for token in rng.sample(reply, 2))
        if rng.random() < 0.2:
            start = rng.randrange(len(reply) - 1)
            options["bad_words_token_ids"] = (tuple(reply[start:start + 2]),)
        if rng.random() < 0.15:
            options["allowed_token_ids"] = tuple(sorted(set(reply[:5]) | set(rng.sample(range(3, 49152), 20))))
        if rng.random() < 0.2:
            options["min_tokens"] = rng.randint(0, options["max_tokens"])
        if rng.random() < 0.2:
            text = decode(reply)
            start = rng.randrange(1, len(text) - 3)
            options.update(stop=(text[start:start + 3],), include_stop_str_in_output=rng.random() < 0.5)
        if rng.random() < 0.1:
            options["stop_token_ids"] = (rng.choice(reply),)
        if rng.random() < 0.3:
            options["logprobs"] = rng.choice([0, 3])
        if rng.random() < 0.2:
            options["prompt_logprobs"] = rng.choice([0, 2])
        return SamplingParams(**options)

    return make


def assert_logprobs_close(got, expected, label: str) -> None:
    """The same tokens and alternatives, with logprobs equal up to float noise (batches differ)."""
    assert (got is None) == (expected is None), label
    if expected is None:
        return
    assert len(got) == len(expected), label
    for mine, theirs in zip(got, expected):
        assert (mine is None) == (theirs is None), label
        if theirs is not None:
            assert mine.token_id == theirs.token_id, label
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3), label
            assert [p for _, p in mine.top] == pytest.approx([p for _, p in theirs.top], abs=1e-3), label


@pytest.fixture(scope="module")
def ample(tiny_model_dir) -> LLM:
    """An engine with room for every request at once: what each request gets alone."""
    return LLM(str(tiny_model_dir), max_model_len=128, num_threads=1)


def check_each_ends_as_alone(llm: LLM, ample: LLM, arrivals: list[Arrival], rng: random.Random,
                             abort_chance: float):
    """Drives the arrivals through `llm`: each request not aborted ends as it ends alone in `ample`
    (tokens, text, finish and stop reason, logprobs), and nothing is left held. Returns the stats."""
    alone = {a.request_id: ample.generate([list(a.prompt)], a.params)[0] for a in arrivals}
    final, aborted = drive(llm, arrivals, rng, abort_chance)
    assert set(final) | aborted == {a.request_id for a in arrivals}
    for request_id, output in final.items():
        expected = alone[request_id]
        assert output.token_ids == expected.token_ids, request_id
        assert (output.text, output.finish_reason, output.stop_reason) == (
            expected.text, expected.finish_reason, expected.stop_reason), request_id
        assert_logprobs_close(output.logprobs, expected.logprobs, request_id)
        assert_logprobs_close(output.prompt_logprobs, expected.prompt_logprobs, request_id)
    return nothing_held(llm)


@pytest.mark.parametrize("seed, policy, mode, prefix_caching, budget, chunked", [
    (20, "fcfs", "swap", True, 32, True),
    (21, "priority", "recompute", False, 16, True),
    (22, "sjf", "swap", False, 128, False),
    (23, "srpt", "recompute", True, 64, True),
])
def test_sampling_features_survive_preemption_aborts_and_batching(
        tiny_model_dir, prompt_pool, reference, ample, seed, policy, mode, prefix_caching, budget, chunked):
    """Penalties, biases, bad words, allowed ids, min_tokens, stops, logprobs and seeded draws keep
    per-request state across steps; under a tight cache each request must still end exactly as it
    ends alone."""
    rng = random.Random(seed)
    arrivals = random_arrivals(rng, prompt_pool, with_priority=policy == "priority",
                               make_params=featured_params(reference, ample.engine.tokenizer.decode))
    options = {"enable_prefix_caching": True, "kv_watermark": 0.0} if prefix_caching else {}
    llm = LLM(str(tiny_model_dir), max_model_len=128, num_threads=1, num_gpu_blocks=BLOCKS, max_num_seqs=6,
              max_num_batched_tokens=budget, enable_chunked_prefill=chunked, preemption_mode=mode,
              policy=policy, scheduler_options=options)
    assert check_each_ends_as_alone(llm, ample, arrivals, rng, abort_chance=0.03).num_preemptions > 0


# ---- random configurations: `pytest tests/test_engine_stress.py --stress-seeds N` ---------------

STRESS_SEED_BASE = 1000  # apart from the fixed cases' seeds
SERVABLE_POLICIES = ("fcfs", "priority", "sjf", "srpt", "goodput")


def pytest_generate_tests(metafunc) -> None:
    """`stress_seed` takes --stress-seeds values (none by default: the fixed cases above run in
    every suite; a sweep of many configurations is a longer, deliberate run)."""
    if "stress_seed" in metafunc.fixturenames:
        count = metafunc.config.getoption("stress_seeds")
        metafunc.parametrize("stress_seed", range(STRESS_SEED_BASE, STRESS_SEED_BASE + count))


def random_engine_options(rng: random.Random, longest: int) -> dict:
    """Engine settings drawn at random, with a cache from just enough for the `longest` request
    alone to twice that."""
    block_size, chunked, seats = rng.choice([8, 16]), rng.random() < 0.7, rng.choice([2, 4, 6, 8])
    needed = -(-longest // block_size)
    options = {"block_size": block_size, "num_gpu_blocks": rng.randint(needed, 2 * needed), "max_num_seqs": seats,
               "enable_chunked_prefill": chunked, "preemption_mode": rng.choice(["recompute", "swap"]),
               "policy": rng.choice(SERVABLE_POLICIES),
               "max_num_batched_tokens": max(seats, rng.choice([16, 32, 64, 128])) if chunked else 128}
    if rng.random() < 0.5:
        options["scheduler_options"] = {"enable_prefix_caching": True, "kv_watermark": rng.choice([0.0, 0.01])}
    return options


def test_random_configurations_end_each_request_as_alone(tiny_model_dir, prompt_pool, reference, ample,
                                                         stress_seed):
    rng = random.Random(stress_seed)
    options = random_engine_options(rng, max(map(len, prompt_pool)) + MAX_TOKENS)
    make_params = featured_params(reference, ample.engine.tokenizer.decode) if rng.random() < 0.5 else greedy_params
    arrivals = random_arrivals(rng, prompt_pool, with_priority=options["policy"] == "priority",
                               make_params=make_params)
    llm = LLM(str(tiny_model_dir), max_model_len=128, num_threads=1, **options)
    check_each_ends_as_alone(llm, ample, arrivals, rng, abort_chance=rng.choice([0.0, 0.03, 0.1]))
