"""Prefix caching in the engine (tiny model): prompts that share a prefix, and a second turn that
extends a first turn's prompt and reply, get the same greedy tokens with the cache as without it
(whose tokens equal HF's, tests/test_engine.py), chunked and under recompute and swap preemption,
and so does one prompt admitted twice in a step, which shares the blocks its first copy fills;
the cache serves their shared blocks, and every block is free at the end."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from hf_reference import random_prompts
from scheduler.request import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    shared = random_prompts([48], seed=3)[0]
    tails = random_prompts([5, 17, 1, 30, 9, 22], seed=4)
    return [shared + tail for tail in tails] + [shared + tails[1]]  # the last repeats the second


def generate(model_dir, prompts, **options):
    llm = LLM(str(model_dir), max_model_len=256, num_threads=1, **{"max_num_seqs": 2, **options})
    outputs = [list(o.token_ids) for o in llm.generate(prompts, GREEDY)]
    return outputs, llm


@pytest.mark.parametrize("setting", [{}, {"max_num_batched_tokens": 16},
                                     {"num_gpu_blocks": 6, "max_num_seqs": 4, "preemption_mode": "recompute"},
                                     {"num_gpu_blocks": 6, "max_num_seqs": 4, "preemption_mode": "swap"}])
def test_cached_prefixes_give_the_tokens_of_no_cache(tiny_model_dir, prompts, setting) -> None:
    plain, _ = generate(tiny_model_dir, prompts, **setting)
    # No watermark: four seats outgrow six blocks, and requests are preempted.
    options = {"enable_prefix_caching": True, "kv_watermark": 0.0}
    cached, llm = generate(tiny_model_dir, prompts, scheduler_options=options, **setting)
    assert cached == plain
    scheduler = llm.engine.scheduler
    # Few seats: the later prompts start after the first ones ran, and find their 48 tokens.
    assert scheduler.block_manager.prefix_cache.num_hit_tokens >= 3 * 48
    if "num_gpu_blocks" in setting:
        assert scheduler.stats().num_preemptions > 0
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks


def test_a_second_turn_finds_the_first_turns_prompt_and_reply(tiny_model_dir, prompts) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1, scheduler_options={"enable_prefix_caching": True})
    first = llm.generate([prompts[0]], GREEDY)[0]
    second_prompt = prompts[0] + list(first.token_ids) + [17, 18, 19]
    second = llm.generate([second_prompt], GREEDY)[0]
    fresh = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1).generate([second_prompt], GREEDY)[0]
    assert second.token_ids == fresh.token_ids
    # The first turn's prompt and all but its last reply token were fed: its full blocks are kept.
    fed = len(prompts[0]) + len(first.token_ids) - 1
    assert llm.engine.scheduler.block_manager.prefix_cache.num_hit_tokens == fed // 16 * 16


def test_one_prompt_admitted_twice_in_a_step_shares_its_blocks(tiny_model_dir, prompts) -> None:
    # As the n choices of one request are: the second reads the blocks the first writes in the
    # same forward, and both give the tokens of a run without the cache.
    prompt = prompts[3]
    fresh = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1).generate([prompt], GREEDY)[0]
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1, scheduler_options={"enable_prefix_caching": True})
    both = llm.generate([prompt, prompt], GREEDY)
    assert [o.token_ids for o in both] == [fresh.token_ids] * 2
    assert [o.num_cached_tokens for o in both] == [0, (len(prompt) - 1) // 16 * 16]
    assert llm.engine.scheduler.stats().num_steps == GREEDY.max_tokens  # admitted together, prefilled at once


def test_the_server_reports_cached_prompt_tokens_and_counts_them(tiny_model_dir) -> None:
    from test_server import MODEL, openai_client, scrape, serving, tiny_engine

    with serving(tiny_engine(tiny_model_dir, enable_prefix_caching=True)) as (base_url, _):
        client = openai_client(base_url)
        messages = [{"role": "system", "content": "You answer in one word. " * 8},
                    {"role": "user", "content": "Name a colour."}]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        again = client.chat.completions.create(model=MODEL, messages=messages[:1] + [
            {"role": "user", "content": "Name a fruit."}], max_tokens=2)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens
        samples = scrape(base_url)
        hits = sum(v for (name, _), v in samples.items() if name == "lengthwise:prefix_cache_hits_total")
        queries = sum(v for (name, _), v in samples.items() if name == "lengthwise:prefix_cache_queries_total")
    assert hits == cached and queries == first.usage.prompt_tokens + again.usage.prompt_tokens


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(tiny_model_dir) -> None:
    from test_server import MODEL, openai_client, serving, tiny_engine

    messages = [{"role": "system", "content": "You answer in one word. " * 8},
                {"role": "user", "content": "Name a colour."}]
    with serving(tiny_engine(tiny_model_dir, enable_prefix_caching=True)) as (base_url, _):
        client = openai_client(base_url)

        def cached(salt: str | None) -> int:
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                   extra_body={} if salt is None else {"cache_salt": salt})
            return reply.usage.prompt_tokens_details.cached_tokens

        assert [cached("tenant-a"), cached(None), cached("tenant-b")] == [0, 0, 0]
        assert cached("tenant-a") > 0 and cached(None) > 0


def test_without_the_flag_usage_has_no_cached_tokens(tiny_model_dir) -> None:
    from test_server import MODEL, openai_client, serving, tiny_engine

    with serving(tiny_engine(tiny_model_dir)) as (base_url, _):
        reply = openai_client(base_url).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert reply.usage.prompt_tokens_details is None


def test_serve_passes_the_flag_to_the_scheduler() -> None:
    import argparse

    from engine.server import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--enable-prefix-caching"])
    assert serve_cli.build_engine_config(args).scheduler_config(8, 0).enable_prefix_caching
    assert not serve_cli.build_engine_config(parser.parse_args([])).scheduler_config(8, 0).enable_prefix_caching
    # vLLM's --scheduling-policy names --policy (it was an unrecognized argument).
    assert serve_cli.build_engine_config(parser.parse_args(["--scheduling-policy", "priority"])).policy == "priority"
