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


def extra(model, key: str):
    return (model.model_extra or {}).get(key)


def test_return_token_ids_gives_the_prompt_and_each_choices_tokens_whole_and_streamed(client) -> None:
    # vLLM's return_token_ids (>= 0.10.2) was dropped unread: no ids in the reply, and a client
    # collecting tokens (RL rollouts) had to tokenize the text again.
    asked = {"ignore_eos": True, "return_token_ids": True}
    kwargs = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0, n=2)
    whole = client.completions.create(extra_body=asked, **kwargs)
    plain = client.completions.create(extra_body={"ignore_eos": True}, **kwargs)
    assert all(extra(choice, "prompt_token_ids") == PROMPT_IDS for choice in whole.choices)
    tokens = [extra(choice, "token_ids") for choice in whole.choices]
    assert [len(ids) for ids in tokens] == [6, 6] and tokens[0] == tokens[1]
    assert not any(extra(choice, key) for choice in plain.choices for key in ("prompt_token_ids", "token_ids"))
    streamed, prompt_ids = defaultdict(list), defaultdict(list)
    for chunk in client.completions.create(stream=True, extra_body=asked, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += extra(choice, "token_ids")
            prompt_ids[choice.index] += [extra(choice, "prompt_token_ids")] if extra(choice, "prompt_token_ids") else []
    assert dict(streamed) == {0: tokens[0], 1: tokens[1]}
    assert dict(prompt_ids) == {0: [PROMPT_IDS], 1: [PROMPT_IDS]}  # each choice's first chunk alone

    chat = dict(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, n=2)
    reply = client.chat.completions.create(extra_body=asked, **chat)
    chat_prompt = extra(reply, "prompt_token_ids")
    assert len(chat_prompt) == reply.usage.prompt_tokens
    chat_tokens = [extra(choice, "token_ids") for choice in reply.choices]
    assert [len(ids) for ids in chat_tokens] == [5, 5]
    streamed, openings = defaultdict(list), defaultdict(list)
    for chunk in client.chat.completions.create(stream=True, extra_body=asked, **chat):
        for choice in chunk.choices:
            if choice.delta.role:
                openings[choice.index].append(extra(chunk, "prompt_token_ids"))
            else:
                assert extra(chunk, "prompt_token_ids") is None
            streamed[choice.index] += extra(choice, "token_ids") or []
    assert dict(openings) == {0: [chat_prompt], 1: [chat_prompt]}
    assert dict(streamed) == {0: chat_tokens[0], 1: chat_tokens[1]}


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
    # Nor is a batch's prompt refused for the one before it (each was judged alone: an idle server
    # refused this batch on every try), and a batch of prompts and choices is one unit too.
    batch = client.completions.create(model=MODEL, prompt=[[5] * 250, [6] * 200], max_tokens=100, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [choice.finish_reason for choice in batch.choices] == ["length", "length"]
    both = client.completions.create(model=MODEL, prompt=[[5] * 100, [6] * 100], max_tokens=100, n=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [choice.finish_reason for choice in both.choices] == ["length"] * 4
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


class RecordingEngine:
    """Admits every submission at once and notes what reached it."""

    def __init__(self) -> None:
        self.submitted: list[dict] = []

    async def submit(self, request_id, prompt_ids, prompt_text, params, *, tier, priority, group):
        from types import SimpleNamespace

        self.submitted.append(dict(id=request_id, prompt=prompt_ids, params=params, tier=tier, priority=priority,
                                   group=group))
        return SimpleNamespace(request_id=request_id, finished=False)

    def abort(self, request_id: str) -> None:
        raise AssertionError(f"{request_id} aborted: every submission was admitted")


def submitted_for(tokenizer, body, prompts: list[list[int]]) -> list[dict]:
    import asyncio

    from engine.server.serving import OpenAIServing

    engine = RecordingEngine()
    handlers = OpenAIServing(engine, tokenizer, MODEL, MAX_MODEL_LEN)
    asyncio.run(handlers._submit("cmpl-x", body, [(ids, "x") for ids in prompts], "prompt"))
    return engine.submitted


def test_each_choice_reaches_the_engine_under_its_id_seed_tier_and_group(tiny_model_dir) -> None:
    # Ids as OpenAIServing numbers them (request_id, -j for choice j, -i-j in a batch), choice j's
    # seed is seed + j within 64 bits, as vLLM's parallel sampling seeds them, and only the first
    # choice of a whole reply scores the prompt the choices share.
    from transformers import AutoTokenizer

    from engine.server.protocol import CompletionRequest
    from scheduler.request import ChoiceGroup, Tier

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    one = submitted_for(tokenizer, CompletionRequest(prompt=[1, 2], max_tokens=3), [[1, 2]])
    assert [(s["id"], s["group"], s["tier"], s["priority"]) for s in one] == [("cmpl-x", None, Tier.STANDARD, 0)]
    body = CompletionRequest(prompt=[[1, 2], [3, 4]], max_tokens=3, n=2, seed=2**64 - 1, prompt_logprobs=1,
                             service_tier="flex", priority=5, min_tokens=2, include_stop_str_in_output=True,
                             skip_special_tokens=False)
    batch = submitted_for(tokenizer, body, [[1, 2], [3, 4]])
    assert [s["id"] for s in batch] == ["cmpl-x-0-0", "cmpl-x-0-1", "cmpl-x-1-0", "cmpl-x-1-1"]
    assert [s["prompt"] for s in batch] == [[1, 2], [1, 2], [3, 4], [3, 4]]
    # One unit for admission, every prompt's choices in it (each prompt's group before: the first
    # prompt was work ahead of the second, and an idle server refused the batch).
    assert [s["group"] for s in batch] == [ChoiceGroup("cmpl-x", 4, prompt_tokens=8)] * 4
    assert [s["params"].seed for s in batch] == [2**64 - 1, 0, 2**64 - 1, 0]
    assert [s["params"].prompt_logprobs for s in batch] == [1, None, 1, None]
    assert {(s["tier"], s["priority"]) for s in batch} == {(Tier.BATCH, 5)}
    assert {(p.min_tokens, p.include_stop_str_in_output, p.skip_special_tokens) for p in
            (s["params"] for s in batch)} == {(2, True, False)}
    # A stream sends each choice's echo in that choice's first chunk: each scores the prompt.
    streamed = CompletionRequest(prompt=[1, 2], max_tokens=3, n=2, stream=True, echo=True, logprobs=1,
                                 service_tier="priority")
    choices = submitted_for(tokenizer, streamed, [[1, 2]])
    assert [(s["id"], s["params"].prompt_logprobs, s["tier"]) for s in choices] == [
        ("cmpl-x-0", 1, Tier.INTERACTIVE), ("cmpl-x-1", 1, Tier.INTERACTIVE)]
    assert [s["group"] for s in choices] == [ChoiceGroup("cmpl-x", 2, prompt_tokens=4)] * 2


class GatedEngine(RecordingEngine):
    """Admits choice 0 at once; choice 1 is refused as bad input, or never admitted (`hold`)."""

    def __init__(self, hold: bool) -> None:
        super().__init__()
        self.hold, self.aborted, self.cancelled = hold, [], []

    async def submit(self, request_id, *args, **kwargs):
        import asyncio

        if request_id.endswith("-0"):
            return await super().submit(request_id, *args, **kwargs)
        if not self.hold:
            raise ValueError("choice 1 is refused")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_refused_or_abandoned_choice_leaves_none_of_its_siblings_running(tiny_model_dir) -> None:
    import asyncio

    from transformers import AutoTokenizer

    from engine.server.errors import APIError
    from engine.server.protocol import CompletionRequest
    from engine.server.serving import OpenAIServing

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = CompletionRequest(prompt=[1, 2], max_tokens=3, n=2)

    async def refused() -> GatedEngine:
        engine = GatedEngine(hold=False)
        with pytest.raises(APIError) as raised:  # the engine's ValueError is the client's 400
            await OpenAIServing(engine, tokenizer, MODEL, MAX_MODEL_LEN)._submit("c", body, [([1, 2], "x")], "prompt")
        assert raised.value.status == 400 and "choice 1 is refused" in str(raised.value)
        return engine

    async def abandoned() -> GatedEngine:
        engine = GatedEngine(hold=True)
        handlers = OpenAIServing(engine, tokenizer, MODEL, MAX_MODEL_LEN)
        submit = asyncio.ensure_future(handlers._submit("c", body, [([1, 2], "x")], "prompt"))
        while not engine.submitted:  # choice 0 admitted, choice 1 waiting
            await asyncio.sleep(0)
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
        await asyncio.sleep(0)  # the handler's cancel reaches the waiting submission (asyncio.run's would later)
        assert engine.cancelled == ["c-1"]
        return engine

    engine = asyncio.run(refused())
    assert engine.aborted == ["c-0"]
    engine = asyncio.run(abandoned())
    assert engine.aborted == ["c-0"]


def test_an_integer_priority_is_refused_unless_the_policy_reads_it(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from engine.server.errors import APIError
    from engine.server.protocol import CompletionRequest
    from engine.server.serving import OpenAIServing
    from scheduler.policy import SchedulingPolicy

    handlers = OpenAIServing(RecordingEngine(), AutoTokenizer.from_pretrained(tiny_model_dir), MODEL, MAX_MODEL_LEN,
                             policy=SchedulingPolicy())
    assert not handlers.policy.orders_by_priority
    handlers._check_priority(CompletionRequest(prompt="x"))
    for priority in (-1, 1):
        with pytest.raises(APIError) as raised:
            handlers._check_priority(CompletionRequest(prompt="x", priority=priority))
        assert raised.value.status == 400 and raised.value.info.param == "priority"
