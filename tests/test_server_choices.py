"""`n` choices over HTTP, with the official openai client against a real uvicorn server: each
choice is an engine request of its own, greedy choices equal the one-choice answer, seeded choice
i draws as a one-choice request with seed + i would, usage counts the prompt once, streams
interleave the choices by index, and admission judges the choices as one unit, refusing them
together or admitting them together.
"""

from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest

from predictor.base import Prediction
from scheduler.request import SamplingParams
from test_server import (API_KEY, MAX_MODEL_LEN, MODEL, aborted_count, engine_idle_and_intact, error_of, openai_client,
                         post, serving, slow_steps, tiny_engine, wait_until)

MAX_QUEUED_TOKENS = 600
PROMPT_IDS = [1, 504, 3458, 314, 253, 1345, 28, 2071, 30]
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, enable_admission=True, max_queued_tokens=MAX_QUEUED_TOKENS,
                         slo_ttft_interactive_s=1e9, slo_e2e_standard_s=1e9)
    with serving(engine) as served:
        yield served


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai_client(served[0])


def test_greedy_choices_equal_the_one_choice_answer(served, client) -> None:
    one = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    three = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0, n=3,
                                      extra_body={"ignore_eos": True})
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    assert [choice.text for choice in three.choices] == [one.choices[0].text] * 3
    assert three.usage.prompt_tokens == len(PROMPT_IDS) and three.usage.completion_tokens == 18
    engine_idle_and_intact(served[1])


def test_seeded_choice_i_draws_with_seed_plus_i(client) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    texts = [choice.text for choice in client.completions.create(n=3, seed=41, **kwargs).choices]
    assert len(set(texts)) == 3  # a random model at temperature 1: three different draws
    assert texts == [client.completions.create(seed=41 + i, **kwargs).choices[0].text for i in range(3)]
    assert [choice.text for choice in client.completions.create(n=3, seed=41, **kwargs).choices] == texts


def test_a_streamed_chat_interleaves_its_choices_by_index(client) -> None:
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, n=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    texts, roles, finishes, usage = defaultdict(str), defaultdict(list), {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles[choice.index] += [choice.delta.role] if choice.delta.role else []
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0: ["assistant"], 1: ["assistant"]}  # each choice opens once
    assert dict(texts) == {choice.index: choice.message.content for choice in whole.choices}
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == whole.usage.completion_tokens == 10
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def fill_every_seat_and_queue(async_engine, queued_prompt: list[int]) -> list[str]:
    """Eight long requests take the eight seats and a ninth waits with `queued_prompt`, all added
    on the engine thread. Each is predicted one token long, so the queue bound counts the ninth
    as its prompt plus one token."""
    ids = [f"seat{i}" for i in range(9)]
    short = Prediction(point=1.0, p50=1.0, p90=1.0, score=0.0, rank_len=1.0)

    def add(engine):
        for request_id in ids:
            prompt = queued_prompt if request_id == ids[-1] else [1, 2, 3, 4, 5, 6, 7, 8]
            params = SamplingParams(max_tokens=MAX_MODEL_LEN - len(prompt), temperature=0.0, ignore_eos=True)
            engine.add_request(request_id, prompt, params, prediction=short)

    async_engine.call_in_engine(add).result(timeout=60)
    return ids


def waiting_ids(async_engine) -> list[str]:
    return async_engine.call_in_engine(lambda e: [r.request_id for r in e.scheduler.waiting]).result(timeout=60)


def test_admission_refuses_the_choices_as_one_unit(served) -> None:
    # 300 tokens queued ahead: one choice of 200 (150 prompt + 50 output) fits under the bound of
    # 600, two do not, so both are refused, neither left waiting, and one choice alone is admitted.
    fillers = fill_every_seat_and_queue(served[1], [5] * 300)
    try:
        body = {"model": MODEL, "prompt": [5] * 150, "max_tokens": 50, "n": 2}
        error = error_of(post(served[0], "/v1/completions", body), 429)
        assert "queue full" in error["message"] and "+ 400 exceed" in error["message"]  # the group's work
        assert not [i for i in waiting_ids(served[1]) if i.startswith("cmpl-")]  # no choice left waiting
        with httpx.stream("POST", served[0] + "/v1/completions", json={**body, "n": 1, "stream": True},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as one:
            assert one.status_code == 200  # admitted; it waits for a seat, and leaving aborts it
    finally:
        served[1].call_in_engine(lambda engine: [engine.abort_request(i) for i in fillers]).result(timeout=60)
    engine_idle_and_intact(served[1])


def test_a_choice_is_never_refused_for_its_siblings(served, client) -> None:
    # Two choices of 350 tokens each exceed the bound of 600 together, but nothing is queued
    # ahead of them: admitted, as one request of 700 tokens would be, and both served.
    reply = client.completions.create(model=MODEL, prompt=[5] * 250, max_tokens=100, n=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [choice.finish_reason for choice in reply.choices] == ["length", "length"]
    engine_idle_and_intact(served[1])


def test_a_disconnect_mid_stream_aborts_every_choice(served, client) -> None:
    base_url, async_engine = served
    before = aborted_count(base_url)
    stream = client.completions.create(model=MODEL, prompt="Tell me a long story", max_tokens=500, n=3,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # hangs up mid-stream
    wait_until(lambda: aborted_count(base_url) - before == 3)
    engine_idle_and_intact(async_engine)


def test_a_disconnect_while_waiting_for_whole_replies_aborts_every_choice(served, monkeypatch) -> None:
    base_url, async_engine = served
    slow_steps(monkeypatch, async_engine.engine, 0.005)  # 900 steps outlast the 0.5 s read anywhere
    before = aborted_count(base_url)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
        httpx.post(base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(60, read=0.5))
    wait_until(lambda: aborted_count(base_url) - before == 2)
    engine_idle_and_intact(async_engine)


def test_a_slow_reader_of_several_choices_gets_each_ones_newest_output() -> None:
    # The stream keeps only the newest unread output per choice, as for one choice: a reader that
    # falls 200 steps behind gets a handful of items, not 200 per choice held in memory.
    import asyncio

    from engine.async_stream import RequestStream
    from engine.outputs import RequestOutput
    from engine.server.streaming import _interleave
    from scheduler.request import Tier

    def output(n: int) -> RequestOutput:
        return RequestOutput("r", (1,), tuple(range(n)), (n - 1,), "x" * n, "x", n == 200,
                             "length" if n == 200 else None, 0.0, 0.0, 0.0, None)

    async def scenario():
        streams = [RequestStream(f"r{i}", Tier.STANDARD) for i in range(2)]
        items = _interleave(streams)
        streams[0].put(output(1))
        first = await items.__anext__()
        for n in range(2, 201):
            for stream in streams:
                stream.put(output(n))
            await asyncio.sleep(0)  # the engine's outputs arrive while the reader is stalled
        rest = [item async for item in items]
        return first, rest

    first, rest = asyncio.run(scenario())
    assert first[0] == 0 and first[1].text == "x"
    assert len(rest) <= 4
    last = {index: item for index, item in rest}
    assert last.keys() == {0, 1} and all(item.finished and item.text == "x" * 200 for item in last.values())


def test_a_handler_cancelled_as_its_last_choice_is_admitted_leaves_none_running(tiny_model_dir) -> None:
    # Uvicorn cancels handlers at the end of a graceful shutdown: one cancelled after every choice
    # was admitted, before it could return their streams, must abort them all.
    import asyncio

    from engine.async_engine import AsyncLLMEngine
    from engine.server.protocol import CompletionRequest
    from engine.server.serving import OpenAIServing

    engine = tiny_engine(tiny_model_dir)

    async def scenario() -> list[str]:
        async_engine = AsyncLLMEngine(engine)
        await async_engine.start()
        handlers = OpenAIServing(async_engine, engine.tokenizer, MODEL, MAX_MODEL_LEN)
        admit, admitted = handlers._submit_one, []

        async def admit_then_cancel_on_the_last(*args, **kwargs):
            admitted.append(await admit(*args, **kwargs))
            if len(admitted) == 3:
                submit.cancel()
            return admitted[-1]

        handlers._submit_one = admit_then_cancel_on_the_last
        body = CompletionRequest(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=900, n=3, ignore_eos=True)
        submit = asyncio.ensure_future(handlers._submit("cmpl-x", body, [([1, 2, 3, 4], "x")], "prompt"))
        with pytest.raises(asyncio.CancelledError):
            await submit
        live = lambda e: [r.request_id for r in e.scheduler.running + e.scheduler.waiting]  # noqa: E731
        remaining = await asyncio.wrap_future(async_engine.call_in_engine(live))
        await async_engine.shutdown(1.0)
        return remaining

    assert asyncio.run(scenario()) == []
