"""Batched prompts in /v1/completions (a list of texts or of id lists, as lm-eval and OpenAI's
legacy clients send them), with the official openai client against a real uvicorn server (tiny
model, greedy): prompt i's choice j is choice i * n + j, each the reply its prompt gets alone,
streamed or not; usage counts each prompt once; lm-eval's loglikelihood form (echo, max_tokens
0, logprobs) scores each prompt as it is scored alone; a batch with a prompt that cannot be
served is refused whole, leaving nothing running."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from test_server import (MAX_MODEL_LEN, MODEL, aborted_count, engine_idle_and_intact, error_of, openai_client, post,
                         serving, slow_steps)
from test_server_logprobs import client, served, tokenizer  # noqa: F401 - the tiny model's server, as fixtures

GREEDY = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
ATOL = 1e-4


@pytest.fixture(scope="module")
def batch(tokenizer) -> list:
    """Texts and id lists of different lengths, one of them twice."""
    return ["Once upon a time", tokenizer.encode("It was the best of times", add_special_tokens=False),
            "Hello", "Once upon a time"]


def alone(client, prompt, **kwargs):
    return client.completions.create(prompt=prompt, **{**GREEDY, **kwargs})


def test_each_choice_of_a_batch_is_its_prompts_reply_alone(served, client, batch) -> None:
    singles = [alone(client, prompt) for prompt in batch]
    reply = client.completions.create(prompt=batch, n=2, **GREEDY)
    assert [choice.index for choice in reply.choices] == list(range(2 * len(batch)))
    assert [choice.text for choice in reply.choices] == [single.choices[0].text for single in singles for _ in range(2)]
    assert reply.usage.prompt_tokens == sum(single.usage.prompt_tokens for single in singles)
    assert reply.usage.completion_tokens == 2 * len(batch) * GREEDY["max_tokens"]
    engine_idle_and_intact(served[1])


def test_a_streamed_batch_gives_the_whole_replys_choices_and_usage(client, batch) -> None:
    whole = client.completions.create(prompt=batch, **GREEDY)
    texts, usage = [""] * len(batch), None
    for event in client.completions.create(prompt=batch, stream=True, stream_options={"include_usage": True},
                                           **GREEDY):
        for choice in event.choices:
            texts[choice.index] += choice.text
        usage = event.usage or usage
    assert texts == [choice.text for choice in whole.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_continuous_usage_counts_each_choices_own_prompt(client, batch) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    seen: dict[int, set[int]] = {}
    for event in client.completions.create(prompt=batch[:3], stream=True, stream_options=options, **GREEDY):
        for choice in event.choices:
            seen.setdefault(choice.index, set()).add(event.usage.prompt_tokens)
    assert seen == {index: {alone(client, batch[index]).usage.prompt_tokens} for index in range(3)}


def test_lm_eval_loglikelihood_scores_each_prompt_of_a_batch_as_alone(client, batch, tokenizer) -> None:
    ids = [tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in batch]
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    for index, prompt in enumerate(ids):
        single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1).choices[0]
        choice = scored.choices[index]
        assert choice.text == single.text == tokenizer.decode(prompt)
        assert choice.logprobs.tokens == single.logprobs.tokens
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(single.logprobs.token_logprobs[1:], abs=ATOL)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == sum(map(len, ids))


@pytest.mark.parametrize("prompt, n, words", [
    (["a", ""], 1, "prompt 1 of the batch is empty"),
    ([[1, 2], []], 1, "prompt 1 of the batch is empty"),
    (["a"] * 257, 1, "at most 256 prompts"),
    (["a"] * 20, 16, "more than 256 sequences"),
    (["a", [10 ** 6]], 1, "token ids must lie in"),
])
def test_a_bad_batch_is_a_400_naming_the_prompt(served, prompt, n, words) -> None:
    error = error_of(post(served[0], "/v1/completions", {"model": MODEL, "prompt": prompt, "n": n}), 400)
    assert error["param"] == "prompt" and words in error["message"]


def test_a_batch_with_a_prompt_too_long_for_the_context_runs_none(served, tokenizer) -> None:
    long = [7] * (MAX_MODEL_LEN - 2)
    body = {"model": MODEL, "prompt": [[1, 2, 3], long], "max_tokens": 8}
    assert error_of(post(served[0], "/v1/completions", body), 400)["code"] == "context_length_exceeded"
    engine_idle_and_intact(served[1])


def test_a_batch_the_engine_refuses_in_part_is_refused_whole(tiny_model_dir, monkeypatch) -> None:
    # Four KV blocks of 16: the first prompt (62 tokens at most) is admitted, the second can
    # never fit, and the first is aborted rather than left to run for nobody (its steps slowed,
    # so it is still running then).
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks=4, block_size=16, max_num_seqs=4,
                                    max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN, attention_backend="torch"))
    slow_steps(monkeypatch, engine, 0.05)
    with serving(engine) as (base_url, async_engine):
        before = aborted_count(base_url)
        body = {"model": MODEL, "prompt": [[1, 2, 3], [5] * 100], "max_tokens": 60, "ignore_eos": True}
        error = error_of(post(base_url, "/v1/completions", body), 400)
        assert "cannot fit" in error["message"]
        engine_idle_and_intact(async_engine)
        assert aborted_count(base_url) - before == 1
        reply = openai_client(base_url).completions.create(prompt=[[1, 2, 3], [4, 5]], **GREEDY)
        assert [choice.index for choice in reply.choices] == [0, 1]


@pytest.mark.parametrize("prompt", [[["Hello", "there"]], [[[504, 3458]]], [["a"]]])
def test_a_prompt_nested_too_deep_is_a_400(served, prompt) -> None:
    assert error_of(post(served[0], "/v1/completions", {"model": MODEL, "prompt": prompt}), 400)["param"] == "prompt"


def test_max_body_bytes_lets_a_larger_batch_body_in(tiny_model_dir) -> None:
    from test_server import tiny_engine

    # An ignored field pads the body past the default limit (1 MiB here); the batch itself is small.
    body = {"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "padding": "x" * (3 << 20)}
    with serving(tiny_engine(tiny_model_dir)) as (base_url, _):
        assert error_of(post(base_url, "/v1/completions", body), 413)["message"].endswith(
            "(serve --max-body-bytes sets it).")
    with serving(tiny_engine(tiny_model_dir), max_body_bytes=8 << 20) as (base_url, _):
        assert len(post(base_url, "/v1/completions", body).json()["choices"]) == 2
