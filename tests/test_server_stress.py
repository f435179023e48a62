"""Many clients at once against a real server whose KV cache is too small for them (tiny model,
swap preemption, sjf): chat and completions, streaming and not, `n` = 2, all three service tiers,
and clients that hang up mid-stream or stop waiting for a whole reply. Every client that stays
gets the text and usage it gets when it is served alone (preempted equals never preempted, over
HTTP); every hang-up is aborted, at most once; and at the end the engine holds no request and no
block, and /metrics says so."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from test_server import (API_KEY, MODEL, aborted_count, chars_predictor, engine_idle_and_intact, metric,
                         openai_client, scrape, serving, wait_until)

MAX_MODEL_LEN = 256
NUM_CLIENTS = 28
TOPICS = ["colours", "rivers", "birds", "planets", "trees", "metals", "oceans", "insects"]


@dataclass(frozen=True)
class Call:
    index: int
    chat: bool
    stream: bool
    n: int
    tier: str
    topic: str
    max_tokens: int
    hang_up_after: int | None  # chunks read before a streaming client hangs up; None: it stays

    def body(self) -> dict:
        body = {"model": MODEL, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "n": self.n, "service_tier": self.tier}
        if self.chat:
            body["messages"] = [{"role": "user", "content": f"Name some {self.topic}."}]
        else:
            body["prompt"] = f"A list of {self.topic}:"
        return body


def random_calls(seed: int) -> list[Call]:
    rng = random.Random(seed)
    calls = []
    for i in range(NUM_CLIENTS):
        stream = rng.random() < 0.6
        calls.append(Call(i, rng.random() < 0.5, stream, rng.choice([1, 1, 2]),
                          rng.choice(["priority", "default", "flex"]), rng.choice(TOPICS),
                          rng.randint(8, 60), rng.randint(1, 4) if stream and rng.random() < 0.3 else None))
    return calls


USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def counts(usage: dict) -> dict[str, int]:
    return {name: usage[name] for name in USAGE_COUNTS}


def texts_of(response: dict, chat: bool) -> list[str]:
    ordered = sorted(response["choices"], key=lambda choice: choice["index"])
    return [choice["message"]["content"] if chat else choice["text"] for choice in ordered]


def call_whole(base_url: str, call: Call) -> tuple[list[str], dict]:
    route = "/v1/chat/completions" if call.chat else "/v1/completions"
    reply = httpx.post(base_url + route, json=call.body(), headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=300)
    reply.raise_for_status()
    body = reply.json()
    return texts_of(body, call.chat), counts(body["usage"])


def call_streaming(base_url: str, call: Call) -> tuple[list[str], dict] | None:
    """Reads the stream to its end (the choices' texts, the usage chunk), or hangs up after
    `hang_up_after` chunks (None)."""
    client = openai_client(base_url)
    create = client.chat.completions.create if call.chat else client.completions.create
    body = call.body()
    text_input = {"messages": body.pop("messages")} if call.chat else {"prompt": body.pop("prompt")}
    stream = create(model=body.pop("model"), stream=True, stream_options={"include_usage": True}, extra_body=body,
                    **text_input)
    texts, usage = [""] * call.n, None
    for count, chunk in enumerate(stream, start=1):
        if call.hang_up_after is not None and count >= call.hang_up_after:
            stream.close()
            return None
        if chunk.usage is not None:
            usage = counts(chunk.usage.model_dump())
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if call.chat else choice.text
    return texts, usage


def run_call(base_url: str, call: Call):
    return call_streaming(base_url, call) if call.stream else call_whole(base_url, call)


@pytest.fixture(scope="module")
def tight_server(tiny_model_dir):
    # 12 blocks of 16 tokens: a request needs up to 6, and six seats of them do not fit.
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), num_gpu_blocks=12, block_size=16, max_num_seqs=6, max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN, preemption_mode="swap", policy="sjf", attention_backend="torch",
        num_threads=1))
    with serving(engine, chars_predictor(), max_model_len=MAX_MODEL_LEN) as served:
        yield served


@pytest.mark.parametrize("seed", [0, 1])
def test_concurrent_clients_under_preemption_get_the_replies_of_a_quiet_server(tight_server, seed):
    base_url, async_engine = tight_server
    calls = random_calls(seed)
    staying = [call for call in calls if call.hang_up_after is None]
    # What each staying client gets from the server with nothing else running (never preempted).
    preemptions_before = async_engine.engine.scheduler.stats().num_preemptions
    alone = {call.index: call_whole(base_url, call) for call in staying}
    assert async_engine.engine.scheduler.stats().num_preemptions == preemptions_before
    aborted_before = aborted_count(base_url)

    # The engine thread is held until every request waits for admission, so they arrive at once
    # on any machine, and more of them are admitted than the cache can grow.
    gate = threading.Event()
    held = async_engine.call_in_engine(lambda engine: gate.wait(120))
    with ThreadPoolExecutor(max_workers=NUM_CLIENTS) as pool:
        replies = [pool.submit(run_call, base_url, call) for call in calls]
        wait_until(lambda: len(async_engine._pending) == sum(call.n for call in calls))
        gate.set()
        held.result(timeout=30)
        results = {call.index: reply.result() for call, reply in zip(calls, replies)}

    assert async_engine.engine.scheduler.stats().num_preemptions > preemptions_before  # the load preempted
    for call in staying:
        texts, usage = results[call.index]
        expected_texts, expected_usage = alone[call.index]
        assert texts == expected_texts, call
        assert usage == expected_usage, call
    hung_up = [call for call in calls if call.hang_up_after is not None]
    assert all(results[call.index] is None for call in hung_up)
    engine_idle_and_intact(async_engine)
    # Each hang-up aborts its request's choices, unless the reply was complete by then.
    aborted = aborted_count(base_url) - aborted_before
    assert 0 < aborted <= sum(call.n for call in hung_up)
    samples = scrape(base_url)
    assert metric(samples, "lengthwise:num_requests_running") == 0
    assert metric(samples, "lengthwise:num_requests_waiting") == 0
    assert metric(samples, "lengthwise:kv_cache_usage_perc") == 0
