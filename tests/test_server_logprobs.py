"""Logprobs over HTTP, with the official openai client against a real uvicorn server: both
endpoints, streamed and not, carry one entry per generated token with the values the offline
engine reports for the same prompt (which tests/test_logprobs.py checks against HF), and bad
logprobs fields are 400s naming the field."""

from __future__ import annotations

import openai
import pytest

from engine.llm import LLM
from engine.server.logprobs import LogprobsFormatter
from scheduler.output import TokenLogprobs
from scheduler.request import SamplingParams
from test_server import MAX_MODEL_LEN, MODEL, engine_idle_and_intact, error_of, openai_client, post, serving, tiny_engine

TOP = 2
NUM_TOKENS = 8
PROMPT_IDS = [1, 504, 3458, 314, 253, 1345, 28, 2071, 30]
CHAT = [{"role": "user", "content": "Name three colours."}]
ATOL = 1e-4


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serving(tiny_engine(tiny_model_dir)) as served:
        yield served


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai_client(served[0])


@pytest.fixture(scope="module")
def tokenizer(served):
    return served[1].engine.tokenizer


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """The engine alone on the same checkpoint: greedy tokens with their logprobs for prompt ids."""
    llm = LLM(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, num_threads=1)

    def generate(prompt_ids: list[int]):
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
        return llm.generate([prompt_ids], params)[0]

    return generate, llm.engine.tokenizer


def test_completion_logprobs_are_the_engines(served, client, offline) -> None:
    generate, tokenizer = offline
    expected = generate(PROMPT_IDS)
    reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, temperature=0,
                                      logprobs=TOP, extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert reply.usage.completion_tokens == len(logprobs.tokens) == NUM_TOKENS
    assert logprobs.tokens == [tokenizer.decode([entry.token_id]) for entry in expected.logprobs]
    assert logprobs.token_logprobs == pytest.approx([entry.logprob for entry in expected.logprobs], abs=ATOL)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    for token, value, top, entry in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                        expected.logprobs):
        assert top[token] == value  # the sampled token is among them, as vLLM lists it
        alternatives = {tokenizer.decode([t]): v for t, v in entry.top}
        assert top.keys() == alternatives.keys() | {token}
        assert [top[t] for t in alternatives] == pytest.approx(list(alternatives.values()), abs=ATOL)
    engine_idle_and_intact(served[1])


def test_logprobs_0_gives_each_sampled_tokens_alone(client) -> None:
    reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, temperature=1.0,
                                      seed=3, logprobs=0, extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == NUM_TOKENS
    assert logprobs.top_logprobs == [{t: v} for t, v in zip(logprobs.tokens, logprobs.token_logprobs)]


def test_a_streamed_completion_carries_the_same_logprobs(client) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, temperature=0, logprobs=TOP,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, values, offsets = [], [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            part = chunk.choices[0].logprobs
            tokens += part.tokens
            values += part.token_logprobs
            offsets += part.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert values == pytest.approx(whole.token_logprobs, abs=ATOL)


def chat_prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_logprobs_are_the_engines(client, offline) -> None:
    generate, tokenizer = offline
    expected = generate(chat_prompt_ids(tokenizer))
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NUM_TOKENS, temperature=0,
                                           logprobs=True, top_logprobs=TOP, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == NUM_TOKENS
    for item, entry in zip(content, expected.logprobs):
        assert item.token == tokenizer.decode([entry.token_id])
        assert bytes(item.bytes) == item.token.encode("utf-8")
        assert item.logprob == pytest.approx(entry.logprob, abs=ATOL)
        assert [top.token for top in item.top_logprobs] == [tokenizer.decode([t]) for t, _ in entry.top]
        assert [top.logprob for top in item.top_logprobs] == pytest.approx([v for _, v in entry.top], abs=ATOL)


def test_a_streamed_chat_carries_the_same_logprobs(client) -> None:
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=NUM_TOKENS, temperature=0, logprobs=True,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert all(item.top_logprobs == [] for item in whole)  # top_logprobs unset: the sampled token alone
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [item.token for item in streamed] == [item.token for item in whole]
    assert [item.logprob for item in streamed] == pytest.approx([item.logprob for item in whole], abs=ATOL)


def test_no_logprobs_unless_asked(client) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=False)
    assert chat.choices[0].logprobs is None
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].logprobs is None


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "top_logprobs", 2),  # without logprobs: true
    ("/v1/chat/completions", "top_logprobs", 21), ("/v1/chat/completions", "top_logprobs", True),
    ("/v1/completions", "n", True),
    ("/v1/completions", "logprobs", 21), ("/v1/completions", "logprobs", -1),
    ("/v1/completions", "logprobs", True), ("/v1/completions", "top_logprobs", 2),
])
def test_bad_logprobs_fields_are_400s_naming_them(served, path, field, value) -> None:
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"messages": CHAT, "logprobs": value is True or value > 20} if "chat" in path else {"prompt": "Hi"})
    error = error_of(post(served[0], path, body), 400)
    assert error["param"] == field and error["message"].startswith(f"{field}: ")


def test_bytes_rebuild_a_character_split_over_tokens(tokenizer) -> None:
    text = "Hi 你好 there<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    entries = [TokenLogprobs(i, -1.0, ((i, -1.0),)) for i in ids]
    content = LogprobsFormatter(tokenizer).chat(entries)["content"]
    assert "\ufffd" in [item["token"] for item in content]  # a token holding part of a character
    assert bytes(b for item in content for b in item["bytes"]).decode("utf-8") == text
    assert [top["bytes"] for item in content for top in item["top_logprobs"]] == [item["bytes"] for item in content]


def test_completion_top_logprobs_keep_the_likelier_of_two_tokens_with_one_text(tokenizer) -> None:
    first, second = tokenizer.encode("你", add_special_tokens=False)[:2]  # both decode to U+FFFD alone
    top = LogprobsFormatter(tokenizer).completion([TokenLogprobs(second, -3.0, ((first, -1.0),))])["top_logprobs"]
    assert top == [{"\ufffd": -1.0}]


class DecodeThreads:
    """The real tokenizer, noting the thread of every decode the server makes."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.threads = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def decode(self, *args, **kwargs):
        import threading

        self.threads.append(threading.current_thread().name)
        return self._tokenizer.decode(*args, **kwargs)


def test_a_whole_reply_with_logprobs_is_built_off_the_event_loop(tiny_model_dir) -> None:
    # Thousands of tokens with their alternatives take seconds to format and encode: on the event
    # loop they would stall every other stream. asyncio.to_thread's workers are "asyncio_N".
    engine = tiny_engine(tiny_model_dir)
    tokenizer = DecodeThreads(engine.tokenizer)
    with serving(engine, tokenizer=tokenizer) as (base_url, _):
        openai_client(base_url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NUM_TOKENS, logprobs=True,
                                       top_logprobs=TOP, extra_body={"ignore_eos": True})
    assert tokenizer.threads and all(name.startswith("asyncio") for name in tokenizer.threads)
