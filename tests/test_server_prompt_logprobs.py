"""Prompt logprobs over HTTP, with the official openai client against a real uvicorn server:
vLLM's `prompt_logprobs` field (completions per choice, chat at the top level) and completions'
`echo` with `logprobs`, each against the offline engine's prompt logprobs for the same ids (which
tests/test_prompt_logprobs.py checks against HF); the n choices of one whole reply share one
scoring; a streamed echo carries a whole reply's logprobs (the prompt's alone for max_tokens 0),
and streamed prompt_logprobs above 0 are a 400 naming the field, as in vLLM (which takes 0 and
sends none)."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.server.submission import _choice_params
from scheduler.request import SamplingParams
from test_server import MAX_MODEL_LEN, MODEL, engine_idle_and_intact, error_of, openai_client, post, serving, tiny_engine
from test_server_logprobs import CHAT, PROMPT_IDS, DecodeThreads, chat_prompt_ids, client, served  # noqa: F401 - fixtures

TOP = 2
NUM_TOKENS = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """The engine alone: greedy output with logprobs and prompt logprobs for prompt ids."""
    llm = LLM(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, num_threads=1)

    def generate(prompt_ids: list[int]):
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP,
                                prompt_logprobs=TOP)
        return llm.generate([prompt_ids], params)[0]

    return generate, llm.engine.tokenizer


def assert_vllm_prompt_logprobs(served_entries, expected, tokenizer) -> None:
    """vLLM's shape: None first, then {token id: {logprob, rank, decoded_token}} holding the
    prompt's token (with its rank) and the TOP likeliest (ranks 1..TOP)."""
    assert len(served_entries) == len(expected) and served_entries[0] is None
    for served_entry, entry in zip(served_entries[1:], expected[1:]):
        wanted = {entry.token_id: entry.rank, **{t: rank for rank, (t, _) in enumerate(entry.top, start=1)}}
        assert {int(key) for key in served_entry} == set(wanted)
        for key, item in served_entry.items():
            assert item["rank"] == wanted[int(key)] and item["decoded_token"] == tokenizer.decode([int(key)])
        assert served_entry[str(entry.token_id)]["logprob"] == pytest.approx(entry.logprob, abs=ATOL)
        for token_id, value in entry.top:
            assert served_entry[str(token_id)]["logprob"] == pytest.approx(value, abs=ATOL)


def test_completion_prompt_logprobs_are_the_engines_in_every_choice(served, client, offline) -> None:
    generate, tokenizer = offline
    expected = generate(PROMPT_IDS)
    reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, temperature=0, n=2,
                                      extra_body={"ignore_eos": True, "prompt_logprobs": TOP})
    assert [choice.logprobs for choice in reply.choices] == [None, None]  # logprobs were not asked for
    for choice in reply.choices:
        assert_vllm_prompt_logprobs(choice.prompt_logprobs, expected.prompt_logprobs, tokenizer)
    engine_idle_and_intact(served[1])


def test_chat_prompt_logprobs_are_the_engines(client, offline) -> None:
    generate, tokenizer = offline
    expected = generate(chat_prompt_ids(tokenizer))
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NUM_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True, "prompt_logprobs": TOP})
    assert len(reply.prompt_logprobs) == reply.usage.prompt_tokens
    assert_vllm_prompt_logprobs(reply.prompt_logprobs, expected.prompt_logprobs, tokenizer)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NUM_TOKENS, temperature=0)
    assert plain.model_extra.get("prompt_logprobs") is None


def test_echo_with_logprobs_puts_the_prompts_before_the_outputs(client, offline) -> None:
    generate, tokenizer = offline
    expected = generate(PROMPT_IDS)
    reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, temperature=0, echo=True,
                                      logprobs=TOP, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    logprobs = choice.logprobs
    # The prompt's are in logprobs, and in prompt_logprobs as well, as vLLM fills both.
    assert_vllm_prompt_logprobs(choice.prompt_logprobs, expected.prompt_logprobs, tokenizer)
    texts = [tokenizer.decode([token_id]) for token_id in PROMPT_IDS + [e.token_id for e in expected.logprobs]]
    assert logprobs.tokens == texts and choice.text == tokenizer.decode(PROMPT_IDS) + "".join(texts[len(PROMPT_IDS):])
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    entries = list(expected.prompt_logprobs[1:]) + list(expected.logprobs)
    assert logprobs.token_logprobs[1:] == pytest.approx([entry.logprob for entry in entries], abs=ATOL)
    for top, entry in zip(logprobs.top_logprobs[1:], entries):
        assert top.keys() == {tokenizer.decode([t]) for t, _ in entry.top} | {tokenizer.decode([entry.token_id])}
    offsets = [0]
    for token in texts[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    assert reply.usage.prompt_tokens == len(PROMPT_IDS) and reply.usage.completion_tokens == NUM_TOKENS


def test_a_streamed_echo_carries_the_logprobs_of_a_whole_reply(client) -> None:
    body = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, temperature=0, echo=True, logprobs=TOP,
                n=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**body).choices
    joined = {index: {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
              for index in range(2)}
    for event in client.completions.create(stream=True, **body):
        for choice in event.choices:
            joined[choice.index]["text"] += choice.text
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                joined[choice.index][key] += getattr(choice.logprobs, key) if choice.logprobs else []
    for index in range(2):  # each choice's first chunk leads with the prompt's tokens
        expected = whole[index].logprobs
        assert joined[index]["text"] == whole[index].text
        assert joined[index]["tokens"] == expected.tokens and joined[index]["text_offset"] == expected.text_offset
        assert joined[index]["token_logprobs"][0] is None and joined[index]["top_logprobs"][0] is None
        assert joined[index]["token_logprobs"][1:] == pytest.approx(expected.token_logprobs[1:], abs=ATOL)
        assert [top.keys() for top in joined[index]["top_logprobs"][1:]] == [
            top.keys() for top in expected.top_logprobs[1:]]
        assert len(expected.tokens) == len(PROMPT_IDS) + NUM_TOKENS


def test_only_the_first_choice_of_a_whole_reply_scores_the_shared_prompt() -> None:
    params = SamplingParams(max_tokens=4, seed=9, prompt_logprobs=1)
    assert _choice_params(params, 0, streamed=False) is params
    later = _choice_params(params, 2, streamed=False)
    assert later.prompt_logprobs is None and later.seed == 11
    assert _choice_params(SamplingParams(max_tokens=4, prompt_logprobs=1), 1, streamed=False).seed is None
    streamed = _choice_params(params, 2, streamed=True)  # each streamed choice echoes it first
    assert streamed.prompt_logprobs == 1 and streamed.seed == 11


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": True}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_400s_naming_the_field(served, path, body, field) -> None:
    error = error_of(post(served[0], path, {"model": MODEL, "max_tokens": 2, **body}), 400)
    assert error["param"] == field and error["message"].startswith(f"{field}: ")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})])
def test_a_stream_takes_prompt_logprobs_0_and_sends_none(served, path, body) -> None:
    reply = post(served[0], path, {"model": MODEL, "max_tokens": 2, "stream": True, "prompt_logprobs": 0,
                                   "ignore_eos": True, **body})
    assert reply.status_code == 200
    events = [line[len("data: "):] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2]
    assert all("prompt_logprobs" not in event for event in events)


def test_a_reply_with_prompt_logprobs_alone_is_built_off_the_event_loop(tiny_model_dir) -> None:
    engine = tiny_engine(tiny_model_dir)
    tokenizer = DecodeThreads(engine.tokenizer)
    with serving(engine, tokenizer=tokenizer) as (base_url, _):
        reply = openai_client(base_url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                                extra_body={"prompt_logprobs": TOP})
    assert len(reply.prompt_logprobs) == reply.usage.prompt_tokens
    assert tokenizer.threads and all(name.startswith("asyncio") for name in tokenizer.threads)


def test_max_tokens_0_with_echo_scores_the_prompt_alone(served, client, offline) -> None:
    # As lm-eval's loglikelihood asks vLLM: the prompt back with its logprobs, nothing generated.
    generate, tokenizer = offline
    expected = generate(PROMPT_IDS)
    reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=TOP)
    choice = reply.choices[0]
    assert choice.text == tokenizer.decode(PROMPT_IDS) and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(PROMPT_IDS)
    assert choice.logprobs.tokens == [tokenizer.decode([token_id]) for token_id in PROMPT_IDS]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:]],
                                                               abs=ATOL)
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Hello there" and plain.choices[0].logprobs is None
    for body in ({"prompt": "Hi", "max_tokens": 0}, {"prompt": "Hi", "max_tokens": 0, "stream": True},
                 {"messages": CHAT, "max_tokens": 0}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        error = error_of(post(served[0], path, {"model": MODEL, **body}), 400)
        assert error["param"] == "max_tokens"
    engine_idle_and_intact(served[1])


def test_max_tokens_0_with_echo_streams_the_prompt_alone(served, client, offline) -> None:
    # As vLLM streams it: the prompt (with its logprobs when asked) in one chunk that finishes
    # with "length", the token generated to score the prompt's last position never shown.
    generate, tokenizer = offline
    expected = generate(PROMPT_IDS)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=TOP,
                                            stream=True, stream_options={"include_usage": True}))
    *choices, usage = chunks
    assert "".join(chunk.choices[0].text for chunk in choices) == tokenizer.decode(PROMPT_IDS)
    assert [chunk.choices[0].finish_reason for chunk in choices][-1] == "length"
    logprobs = [chunk.choices[0].logprobs for chunk in choices if chunk.choices[0].logprobs is not None]
    assert len(logprobs) == 1
    assert logprobs[0].tokens == [tokenizer.decode([token_id]) for token_id in PROMPT_IDS]
    assert logprobs[0].token_logprobs[0] is None
    assert logprobs[0].token_logprobs[1:] == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:]],
                                                           abs=ATOL)
    assert usage.usage.completion_tokens == 0 and usage.usage.prompt_tokens == len(PROMPT_IDS)
    plain = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True, stream=True))
    assert "".join(chunk.choices[0].text for chunk in plain) == "Hello there"
    assert all(chunk.choices[0].logprobs is None for chunk in plain)
    # The token generated to score the prompt is never shown, nor any stop it made (vLLM: null).
    stop = {"stop_token_ids": [expected.token_ids[0]]}
    whole = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=0, echo=True, temperature=0,
                                      extra_body=stop).choices[0]
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=0, echo=True,
                                              temperature=0, stream=True, extra_body=stop))[-1].choices[0]
    for choice in (whole, streamed):
        assert (choice.finish_reason, choice.stop_reason) == ("length", None)
    engine_idle_and_intact(served[1])
