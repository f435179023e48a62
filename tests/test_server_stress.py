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
import openai
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

    @property
    def route(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

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
    reply = httpx.post(base_url + call.route, json=call.body(), headers={"Authorization": f"Bearer {API_KEY}"},
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


@dataclass(frozen=True)
class Refused:
    status: int
    retry_after: str | None


def run_call(base_url: str, call: Call):
    """The call's texts and usage, None after a hang-up, or Refused (admission control's 429)."""
    try:
        return call_streaming(base_url, call) if call.stream else call_whole(base_url, call)
    except (httpx.HTTPStatusError, openai.APIStatusError) as error:
        return Refused(error.response.status_code, error.response.headers.get("retry-after"))


@pytest.fixture(scope="module")
def tight_server(tiny_model_dir):
    # 12 blocks of 16 tokens: a request needs up to 6, and six seats of them do not fit.
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), num_gpu_blocks=12, block_size=16, max_num_seqs=6, max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN, preemption_mode="swap", policy="sjf", attention_backend="torch",
        num_threads=1))
    with serving(engine, chars_predictor(), max_model_len=MAX_MODEL_LEN) as served:
        yield served


def check_concurrent_clients(base_url: str, async_engine, calls: list[Call], admission: bool = False) -> int:
    """All `calls` at once: each staying client gets what it gets alone (or, with admission control,
    a 429 with Retry-After), hang-ups are aborted, and nothing is left held. Returns the
    preemptions the load caused."""
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
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        replies = [pool.submit(run_call, base_url, call) for call in calls]
        wait_until(lambda: len(async_engine._pending) == sum(call.n for call in calls))
        gate.set()
        held.result(timeout=30)
        results = {call.index: reply.result() for call, reply in zip(calls, replies)}

    for call in staying:
        result = results[call.index]
        if admission and isinstance(result, Refused):
            assert result.status == 429 and result.retry_after, call
            continue
        assert result == alone[call.index], call
    hung_up = [call for call in calls if call.hang_up_after is not None]
    assert all(results[call.index] is None or isinstance(results[call.index], Refused) for call in hung_up)
    engine_idle_and_intact(async_engine)
    # Each hang-up aborts its request's choices, unless the reply was complete by then.
    assert aborted_count(base_url) - aborted_before <= sum(call.n for call in hung_up)
    samples = scrape(base_url)
    assert metric(samples, "lengthwise:num_requests_running") == 0
    assert metric(samples, "lengthwise:num_requests_waiting") == 0
    assert metric(samples, "lengthwise:kv_cache_usage_perc") == 0
    return async_engine.engine.scheduler.stats().num_preemptions - preemptions_before


@pytest.mark.parametrize("seed", [0, 1])
def test_concurrent_clients_under_preemption_get_the_replies_of_a_quiet_server(tight_server, seed):
    base_url, async_engine = tight_server
    aborted_before = aborted_count(base_url)
    assert check_concurrent_clients(base_url, async_engine, random_calls(seed)) > 0  # the load preempted
    assert aborted_count(base_url) > aborted_before  # the hang-ups were aborted

def stream_to_the_end(base_url: str, call: Call) -> tuple[list[str], list[str | None], bool]:
    """A streaming client that reads every event: the choices' texts, their finish reasons, and
    whether the stream ended with [DONE]."""
    texts, reasons, done = [""] * call.n, [None] * call.n, False
    with httpx.stream("POST", base_url + call.route, json={**call.body(), "stream": True}, timeout=300) as response:
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
    return httpx.post(base_url + call.route, json=call.body(), timeout=300)


def check_shutdown_under_load(engine: LLMEngine, calls: list[Call], monkeypatch) -> collections.Counter:
    """SIGINT 20 steps into `calls` sent at once (no hang-ups), with a 0.5 s grace: each client
    gets a whole reply, or its text so far and finish_reason "abort" followed by [DONE] (a 503
    aborted_at_shutdown without a stream); none is cut off or left waiting, and no block is held
    at the end. Returns how many choices ended each way."""
    steps = [0]
    real_step = engine.step

    def counted_slow_step():
        steps[0] += 1
        time.sleep(0.01)  # at most 50 steps fit in the grace, on any machine
        return real_step()

    async_engine, server, thread, sock = start_draining_server(engine, grace_s=0.5)
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    alone = {call.index: texts_of(whole_reply(base_url, call).json(), call.chat) for call in calls}
    monkeypatch.setattr(engine, "step", counted_slow_step)
    gate = threading.Event()
    held = async_engine.call_in_engine(lambda engine: gate.wait(120))
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        replies = [pool.submit(stream_to_the_end if call.stream else whole_reply, base_url, call) for call in calls]
        wait_until(lambda: len(async_engine._pending) == sum(call.n for call in calls))
        gate.set()
        held.result(timeout=30)
        start = steps[0]
        wait_until(lambda: steps[0] > start + 20)  # some replies under way
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
    manager = engine.scheduler.block_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_total_blocks and manager.num_requests_holding() == 0
    return endings


def test_a_shutdown_under_load_ends_every_accepted_request_with_its_reply_or_an_abort(tiny_model_dir, monkeypatch):
    """SIGINT while the tight cache holds requests running, swapped out and waiting, with a grace too
    short for them."""
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), num_gpu_blocks=12, block_size=16, max_num_seqs=6, max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN, preemption_mode="swap", policy="sjf", attention_backend="torch",
        num_threads=1))
    calls = [replace(call, hang_up_after=None) for call in random_calls(2)]
    endings = check_shutdown_under_load(engine, calls, monkeypatch)
    # 28 requests of up to 60 tokens in six seats outlast the grace; the shortest finish in it.
    assert endings["length"] > 0 and endings["abort"] > 0


# ---- random configurations: `pytest tests/test_server_stress.py --stress-seeds N` ---------------

STRESS_SEED_BASE = 1000
SERVABLE_POLICIES = ("fcfs", "priority", "sjf", "srpt", "goodput")


def pytest_generate_tests(metafunc) -> None:
    """`stress_seed` takes --stress-seeds values (none by default), as in test_engine_stress."""
    if "stress_seed" in metafunc.fixturenames:
        count = metafunc.config.getoption("stress_seeds")
        metafunc.parametrize("stress_seed", range(STRESS_SEED_BASE, STRESS_SEED_BASE + count))


def random_server_engine(model_dir, rng: random.Random) -> tuple[LLMEngine, bool]:
    """A tight engine of random settings, admission control on for some; (engine, admission)."""
    options = {}
    if rng.random() < 0.4:
        options.update(enable_prefix_caching=True, kv_watermark=0.0)
    admission = rng.random() < 0.3
    if admission:
        options.update(enable_admission=True, max_queued_tokens=rng.choice([300, 1000, 3000]))
    seats = rng.choice([2, 4, 6, 8])
    # At least 12 blocks: a call of n = 2 alone (two choices of up to 6) fits, so the reply it is
    # compared with was never preempted.
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), num_gpu_blocks=rng.randint(12, 16), block_size=16, max_num_seqs=seats,
        max_num_batched_tokens=max(seats, rng.choice([16, 32, 64, 128])), max_model_len=MAX_MODEL_LEN,
        preemption_mode=rng.choice(["recompute", "swap"]), policy=rng.choice(SERVABLE_POLICIES),
        attention_backend="torch", num_threads=1, scheduler_options=options))
    return engine, admission


def test_random_configurations_serve_every_client(tiny_model_dir, monkeypatch, stress_seed):
    """Random settings; the concurrent clients of the first test, or, for one seed in three (without
    admission control), the shutdown under load."""
    rng = random.Random(stress_seed)
    engine, admission = random_server_engine(tiny_model_dir, rng)
    calls = random_calls(stress_seed)
    if not admission and rng.random() < 1 / 3:
        check_shutdown_under_load(engine, [replace(call, hang_up_after=None) for call in calls], monkeypatch)
        return
    with serving(engine, chars_predictor(), max_model_len=MAX_MODEL_LEN) as (base_url, async_engine):
        check_concurrent_clients(base_url, async_engine, calls, admission)
