"""Many clients at once against a real server whose KV cache is too small for them (tiny model,
swap preemption, sjf): chat and completions, streaming and not, `n` = 2, all three service tiers,
and clients that hang up mid-stream. Every client that stays gets the text and usage it gets when
it is served alone (preempted equals never preempted, over HTTP); every hang-up is aborted, at
most once; and at the end the engine holds no request and no block, and /metrics says so. A
shutdown under the same load ends every accepted request with its whole reply or an explicit
abort."""

from __future__ import annotations

import collections
import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from test_server import (API_KEY, MODEL, aborted_count, chars_predictor, engine_idle_and_intact, metric,
                         openai_client, scrape, serving, wait_until)
from test_server_lifecycle import start_draining_server

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


def stream_to_the_end(base_url: str, call: Call) -> tuple[list[str], list[str | None], bool]:
    """A streaming client that reads every event: the choices' texts, their finish reasons, and
    whether the stream ended with [DONE]."""
    route = "/v1/chat/completions" if call.chat else "/v1/completions"
    texts, reasons, done = [""] * call.n, [None] * call.n, False
    with httpx.stream("POST", base_url + route, json={**call.body(), "stream": True}, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    texts[choice["index"]] += (choice["delta"].get("content") or "") if call.chat else choice["text"]
                    reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    return texts, reasons, done


def whole_reply(base_url: str, call: Call) -> httpx.Response:
    route = "/v1/chat/completions" if call.chat else "/v1/completions"
    return httpx.post(base_url + route, json=call.body(), timeout=300)


def test_a_shutdown_under_load_ends_every_accepted_request_with_its_reply_or_an_abort(tiny_model_dir, monkeypatch):
    """SIGINT while the tight cache holds requests running, swapped out and waiting, with a grace too
    short for them: each client still gets a whole reply, or its text so far and finish_reason
    "abort" followed by [DONE] (a 503 aborted_at_shutdown without a stream); none is cut off or
    left waiting, and no block is held at the end."""
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), num_gpu_blocks=12, block_size=16, max_num_seqs=6, max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN, preemption_mode="swap", policy="sjf", attention_backend="torch",
        num_threads=1))
    steps = [0]
    real_step = engine.step

    def counted_slow_step():
        steps[0] += 1
        time.sleep(0.01)  # 28 requests of up to 60 tokens in six seats outlast the grace on any machine
        return real_step()

    async_engine, server, thread, sock = start_draining_server(engine, grace_s=0.5)
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    calls = [replace(call, hang_up_after=None) for call in random_calls(2)]
    alone = {call.index: texts_of(whole_reply(base_url, call).json(), call.chat) for call in calls}
    monkeypatch.setattr(engine, "step", counted_slow_step)
    gate = threading.Event()
    held = async_engine.call_in_engine(lambda engine: gate.wait(120))
    with ThreadPoolExecutor(max_workers=NUM_CLIENTS) as pool:
        replies = [pool.submit(stream_to_the_end if call.stream else whole_reply, base_url, call) for call in calls]
        wait_until(lambda: len(async_engine._pending) == sum(call.n for call in calls))
        gate.set()
        held.result(timeout=30)
        start = steps[0]
        wait_until(lambda: steps[0] > start + 20)  # some replies under way, none near the end
        server.handle_exit(signal.SIGINT, None)
        results = [reply.result(timeout=120) for reply in replies]
    thread.join(timeout=60)
    sock.close()
    assert not thread.is_alive()

    endings = collections.Counter()
    for call, result in zip(calls, results):
        expected = alone[call.index]
        if call.stream:
            texts, reasons, done = result
            assert done and set(reasons) <= {"length", "abort"}, (call, reasons)
            for text, reason, whole in zip(texts, reasons, expected):
                assert text == whole if reason == "length" else whole.startswith(text), call
                endings[reason] += 1
        elif result.status_code == 200:
            assert texts_of(result.json(), call.chat) == expected, call
            endings["length"] += call.n
        else:
            assert result.status_code == 503 and result.json()["error"]["code"] == "aborted_at_shutdown", call
            endings["abort"] += call.n
    assert endings["length"] > 0 and endings["abort"] > 0  # the grace ended some requests, not all
    manager = engine.scheduler.block_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_total_blocks and manager.num_requests_holding() == 0
