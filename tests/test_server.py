"""The HTTP server against the official openai client, on a real uvicorn server on loopback.

One tiny random Llama (SmolLM2's tokenizer) serves every test in the module; the reference for
generated text is a greedy loop over the same checkpoint in HF transformers. Error cases check
status and body, and a successful request after them shows the server kept serving.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.app import ServerSettings, create_app
from hf_reference import stop_string_past_the_middle
from predictor.length import LengthParams, LengthPredictor
from predictor.saved import PredictorSpec

API_KEY = "test-key"
MODEL = "tiny"
BROWSER_ORIGIN = "http://localhost:3000"  # a web UI the server lets call it (CORS)
MAX_MODEL_LEN = 1024
MAX_QUEUED_TOKENS = 600  # admission bound: a request owing more than this is refused with 429


def tiny_engine(model_dir: Path, **scheduler_options) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), num_gpu_blocks=128, block_size=16, max_num_seqs=8,
        max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN, attention_backend="torch",
        scheduler_options=scheduler_options))


def chars_predictor() -> LengthPredictor:
    """A real saved-predictor kind whose prediction is the prompt's character count."""
    return LengthPredictor(LengthParams(intercept=0.0, slope=1.0, residual_p50=0.0, residual_p90=0.5),
                           PredictorSpec(kind="length", feature_spec={}, data_hash=""))


@contextmanager
def running_server(app):
    """Serve `app` with uvicorn in a thread on a free loopback port; yields (base_url, server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during startup"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


@contextmanager
def serving(engine: LLMEngine, predictor=None, tokenizer=None, **settings):
    """`engine` behind a real server (the tiny model's settings, the test key); yields
    (base_url, async engine)."""
    async_engine = AsyncLLMEngine(engine, predictor)
    settings = ServerSettings(**{"model_name": MODEL, "max_model_len": MAX_MODEL_LEN, "api_key": API_KEY, **settings})
    with running_server(create_app(async_engine, tokenizer or engine.tokenizer, settings)) as (base_url, _):
        yield base_url, async_engine


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


class ThreadRecordingTokenizer:
    """The real tokenizer, noting which thread each encode or chat template ran on, and whether
    each encode asked for special tokens."""

    def __init__(self, tokenizer, threads: set[str], special_tokens: list | None = None) -> None:
        self._tokenizer = tokenizer
        self.threads = threads
        self.special_tokens = [] if special_tokens is None else special_tokens

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, *args, **kwargs):
        self.threads.add(threading.current_thread().name)
        self.special_tokens.append(kwargs.get("add_special_tokens"))
        return self._tokenizer.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.add(threading.current_thread().name)
        return self._tokenizer.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenize_threads() -> set[str]:
    return set()


@pytest.fixture(scope="module")
def special_tokens_asked() -> list:
    return []


@pytest.fixture(scope="module")
def served(tiny_model_dir, tokenize_threads, special_tokens_asked):
    engine = tiny_engine(tiny_model_dir, enable_admission=True, max_queued_tokens=MAX_QUEUED_TOKENS,
                         slo_ttft_interactive_s=1e9, slo_e2e_standard_s=1e9)
    tokenizer = ThreadRecordingTokenizer(engine.tokenizer, tokenize_threads, special_tokens_asked)
    with serving(engine, chars_predictor(), tokenizer, info=(("policy", "fcfs"),),
                 allowed_origins=(BROWSER_ORIGIN,)) as served:
        yield served


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai_client(served[0])


@pytest.fixture(scope="module")
def tokenizer(served):
    return served[1].engine.tokenizer


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir, tokenizer):
    """Greedy continuation of prompt ids by HF transformers (no eos stop), as text."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], num_tokens: int) -> str:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            for _ in range(num_tokens):
                next_id = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        return tokenizer.decode(ids[0, len(prompt_ids):].tolist(), skip_special_tokens=True)

    return generate


def engine_idle_and_intact(async_engine: AsyncLLMEngine, deadline_s: float = 60.0) -> None:
    """Wait until the engine holds no request, then check the block accounting on its thread."""
    def state(engine):
        manager = engine.scheduler.block_manager
        manager.check_integrity()
        return engine.has_unfinished_requests(), manager.num_free_blocks, manager.num_total_blocks

    deadline = time.monotonic() + deadline_s
    while True:
        busy, free, total = async_engine.call_in_engine(state).result(timeout=30)
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not busy, "the engine still runs a request"
    assert free == total, f"{total - free} KV blocks still held"


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}, parsed by prometheus_client."""
    text = httpx.get(base_url + "/metrics", timeout=60).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def wait_until(condition, deadline_s: float = 60.0) -> None:
    """Poll `condition` until it holds: what the test waits for, not a guess at how long it takes."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.02)


def aborted_count(base_url: str) -> float:
    return metric(scrape(base_url), "lengthwise:request_success_total", finished_reason="abort")


CHAT = [{"role": "user", "content": "Name three colours."}]


# ---- successful requests ---------------------------------------------------------------------
def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served[0] + "/health", timeout=60).status_code == 200
    # vLLM's probes: /ping (GET or POST) answers as /health, /version names the installed build.
    assert [httpx.request(m, served[0] + "/ping", timeout=60).status_code for m in ("GET", "POST")] == [200, 200]
    assert httpx.get(served[0] + "/version", timeout=60).json() == {"version": importlib.metadata.version("lengthwise")}


def test_chat_matches_hf_greedy_with_usage(client, tokenizer, hf_greedy):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == hf_greedy(prompt_ids, 6)
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 6)
    assert reply.usage.total_tokens == len(prompt_ids) + 6


def test_chat_stream_equals_non_stream_and_reports_usage(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_non_stream_and_stream(client, tokenizer, hf_greedy):
    prompt = "The quick brown fox"
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == hf_greedy(prompt_ids, 5)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 5)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage, no usage in the stream


def test_sse_ends_with_done(served):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", served[0] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_priority_and_service_tiers_reach_the_scheduler_tiers(served, client, monkeypatch):
    engine = served[1].engine
    scheduled_tiers = []
    add_request = engine.add_request

    def recording(request_id, *args, **kwargs):  # the real call, then the tier the scheduler holds
        add_request(request_id, *args, **kwargs)
        scheduled_tiers.append(engine.scheduler.get_request(request_id).tier.name.lower())

    monkeypatch.setattr(engine, "add_request", recording)
    before = scrape(served[0])
    for service_tier in ("priority", "flex", "default", "auto", "scale"):
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, service_tier=service_tier,
                                               extra_body={"priority": 0})
        assert reply.choices[0].finish_reason in ("stop", "length")
    assert scheduled_tiers == ["interactive", "batch", "standard", "standard", "standard"]
    after = scrape(served[0])
    name = "lengthwise:e2e_request_latency_seconds_count"
    counts = {tier: metric(after, name, tier=tier) - metric(before, name, tier=tier)
              for tier in ("interactive", "batch", "standard")}
    assert counts == {"interactive": 1, "batch": 1, "standard": 3}
    queued = "lengthwise:request_queue_time_seconds_count"
    assert metric(after, queued) - metric(before, queued) == 5


def test_completion_stream_reports_usage_only_in_its_last_chunk(client):
    stream = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 4)


def test_a_request_id_of_the_clients_names_its_response_and_may_repeat(served, client):
    # vLLM's body request_id was dropped: replies carried random ids, unmatched to the requests.
    base_url = served[0]
    asked = {"request_id": "trace-7"}
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=asked)
    again = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=asked)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, stream=True, extra_body=asked))
    assert reply.id == again.id == "cmpl-trace-7" and {chunk.id for chunk in chunks} == {"chatcmpl-trace-7"}
    # Two at once: in the engine each has an id of its own (one id was refused while in use).
    with client.completions.create(model=MODEL, prompt="Hi", max_tokens=900, stream=True,
                                   extra_body={"ignore_eos": True, **asked}) as running:
        next(iter(running))
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=asked).id == reply.id
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).id != reply.id
    assert error_of(post(base_url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "request_id": "a\nb"}),
                    400)["param"] == "request_id"


def test_an_x_request_id_header_names_the_response_before_the_bodys_id(served, client):
    # vLLM reads the header first, so a gateway's id reaches the reply; it was ignored.
    base_url = served[0]
    header = {"X-Request-Id": "gw-42"}
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_headers=header,
                                      extra_body={"request_id": "body-1"})
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, stream=True, extra_headers=header))
    assert reply.id == "cmpl-gw-42" and {chunk.id for chunk in chunks} == {"chatcmpl-gw-42"}
    # An empty header is no id; one that would forge a log line is refused, naming the header.
    unnamed = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": ""})
    assert unnamed.id.startswith("cmpl-") and len(unnamed.id) > len("cmpl-")
    refused = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                         headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "a\x85b".encode("latin-1")},
                         timeout=60)
    assert error_of(refused, 400)["param"] == "X-Request-Id"


def test_seeded_sampling_repeats_and_top_k_one_is_greedy(client):
    kwargs = dict(model=MODEL, prompt="Pick a word:", max_tokens=6, extra_body={"ignore_eos": True})
    first = client.completions.create(temperature=1.0, seed=7, **kwargs).choices[0].text
    again = client.completions.create(temperature=1.0, seed=7, **kwargs).choices[0].text
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    top_one = client.completions.create(temperature=1.0, extra_body={"ignore_eos": True, "top_k": 1},
                                        **{k: v for k, v in kwargs.items() if k != "extra_body"})
    other_seed = client.completions.create(temperature=1.0, seed=8, **kwargs).choices[0].text
    assert first == again and first != other_seed
    assert first != greedy  # the temperature reached the sampler
    assert top_one.choices[0].text == greedy


def test_stop_string_cuts_the_text(client):
    free = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = stop_string_past_the_middle(free, 3)
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free[:free.index(stop)]
    # More than OpenAI's 4, as evaluation harnesses send to vLLM: the real one among them still cuts.
    many = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                     stop=[f"never{i}" for i in range(7)] + [stop],
                                     extra_body={"ignore_eos": True}).choices[0]
    assert (many.finish_reason, many.text) == ("stop", cut.text)


# ---- errors --------------------------------------------------------------------------------------
def post(base_url: str, path: str, body, key: str | None = API_KEY, origin: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if origin is not None:
        headers["Origin"] = origin
    if isinstance(body, str):
        return httpx.post(base_url + path, content=body, timeout=60,
                          headers={**headers, "content-type": "application/json"})
    return httpx.post(base_url + path, json=body, headers=headers, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_prompt_beyond_the_context_is_400_context_length_exceeded(served, tokenizer):
    long_prompt = " ".join(["word"] * (MAX_MODEL_LEN + 10))
    assert len(tokenizer.encode(long_prompt, add_special_tokens=False)) >= MAX_MODEL_LEN
    error = error_of(post(served[0], "/v1/completions", {"model": MODEL, "prompt": long_prompt}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN}
    error = error_of(post(served[0], "/v1/completions", body), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    # The field the client used is the one named.
    body = {"model": MODEL, "messages": CHAT, "max_completion_tokens": MAX_MODEL_LEN}
    error = error_of(post(served[0], "/v1/chat/completions", body), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_completion_tokens")


def test_wrong_or_missing_api_key_is_401(served):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for key in ("wrong", None):
        assert error_of(post(served[0], "/v1/completions", body, key=key), 401)["code"] == "invalid_api_key"
    assert httpx.get(served[0] + "/v1/models", timeout=60).status_code == 401
    # The key is checked before the body is read: a malformed body does not turn a 401 into a 400.
    error = error_of(post(served[0], "/v1/completions", "{not json", key="wrong"), 401)
    assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served[0] + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_cors_preflight_is_answered_without_the_key_for_allowed_origins_only(served):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(served[0] + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})

    allowed = preflight(BROWSER_ORIGIN)  # browsers send no credentials on a preflight
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == BROWSER_ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = preflight("http://elsewhere.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # The call itself still needs the key, and its answer names the origin so the page may read it.
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    response = post(served[0], "/v1/completions", body, origin=BROWSER_ORIGIN)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == BROWSER_ORIGIN
    assert post(served[0], "/v1/completions", body, key=None, origin=BROWSER_ORIGIN).status_code == 401


def test_unknown_model_is_404_and_an_empty_one_is_the_served_model(served):
    body = {"model": "gpt-9", "prompt": "Hello", "max_tokens": 2}
    assert error_of(post(served[0], "/v1/completions", body), 404)["code"] == "model_not_found"
    # As vLLM takes it: clients send "" when no model is chosen.
    reply = post(served[0], "/v1/completions", {**body, "model": ""})
    assert reply.status_code == 200 and reply.json()["model"] == MODEL


def test_a_wrong_method_is_405_with_allow(served):
    response = httpx.put(served[0] + "/v1/chat/completions", json={}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert "POST" in response.headers.get("allow", "")
    assert error_of(response, 405)["type"] == "invalid_request_error"


def test_a_nonzero_priority_is_400_without_priority_scheduling(served):
    # As vLLM answers: under fcfs an integer priority would be silently ignored.
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    error = error_of(post(served[0], "/v1/completions", {**body, "priority": 1}), 400)
    assert error["param"] == "priority" and "--policy priority" in error["message"]
    assert post(served[0], "/v1/completions", {**body, "priority": 0}).status_code == 200


def fill_every_seat_and_queue_one(async_engine, prompt_ids: list[int],
                                  queued_ids: list[int] | None = None) -> list[str]:
    """Nine long requests, added on the engine thread: eight take the seats, one waits (with the
    prompt `queued_ids`, when given). Each is predicted one token long."""
    from predictor.base import Prediction
    from scheduler.request import SamplingParams

    ids = [f"filler{i}" for i in range(9)]
    short = Prediction(point=1.0, p50=1.0, p90=1.0, score=0.0, rank_len=1.0)

    def add(engine):
        for request_id in ids:
            prompt = queued_ids if queued_ids is not None and request_id == ids[-1] else prompt_ids
            params = SamplingParams(max_tokens=MAX_MODEL_LEN - len(prompt), temperature=0.0, ignore_eos=True)
            engine.add_request(request_id, prompt, params, prediction=short)

    async_engine.call_in_engine(add).result(timeout=60)
    return ids


def test_admission_rejection_is_429_with_retry_after(served, client, tokenizer):
    # A request whose prompt alone exceeds the bound is refused while the queue is full (a request
    # of the bound's size waits), and admitted once it is not: refused whenever anything at all
    # was queued, it would never get in under steady traffic.
    prompt = " ".join(["word"] * (MAX_QUEUED_TOKENS + 20))
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert MAX_QUEUED_TOKENS < len(prompt_ids) < MAX_MODEL_LEN - 10
    before = metric(scrape(served[0]), "lengthwise:admission_rejections_total")
    fillers = fill_every_seat_and_queue_one(served[1], tokenizer.encode("Hello there", add_special_tokens=False),
                                            queued_ids=prompt_ids)
    try:
        response = post(served[0], "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                       "service_tier": "flex"})
        error = error_of(response, 429)
        assert error["code"] == "rate_limit_exceeded" and "queue full" in error["message"]
        assert 1 <= int(response.headers["Retry-After"]) <= 3600
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    finally:
        served[1].call_in_engine(lambda engine: [engine.abort_request(i) for i in fillers]).result(timeout=60)
    after = scrape(served[0])
    assert metric(after, "lengthwise:admission_rejections_total") - before == 2
    assert metric(after, "lengthwise:admission_rejections_total", tier="batch") >= 1
    # The queue empty again, the same request is admitted and served.
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=4).choices[0].finish_reason


def test_a_json_body_sent_without_its_content_type_is_told_so(served):
    # FastAPI reads no JSON without the header, and the 400 said "Input should be a valid dictionary".
    base_url = served[0]
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    for headers in ({}, {"content-type": "text/plain"}):
        response = httpx.post(base_url + "/v1/completions", content=body, timeout=60,
                              headers={"Authorization": f"Bearer {API_KEY}", **headers})
        assert "Content-Type: application/json" in error_of(response, 400)["message"]
    # A JSON body that is no object is still named as such.
    assert "Content-Type" not in error_of(post(base_url, "/v1/completions", "[1, 2]"), 400)["message"]


def test_server_keeps_serving_after_bad_requests(served, client):
    for body in ({"prompt": "x", "max_tokens": 0}, {"prompt": []}, {"prompt": [10**9]}, {}):
        assert post(served[0], "/v1/completions", {"model": MODEL, **body}).status_code == 400
    reply = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == 3 and reply.usage.completion_tokens == 3


def test_extreme_values_that_torch_cannot_take_do_not_kill_the_engine(served, client):
    # A 64-bit seed at the edge, and a top_k beyond the vocabulary (and beyond int64), sample.
    for extra in ({"seed": 2**64 - 1}, {"seed": -(2**63)}, {"top_k": 2**70}):
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=1.0,
                                          extra_body={"ignore_eos": True, **extra})
        assert reply.usage.completion_tokens == 2, extra
    assert httpx.get(served[0] + "/health", timeout=60).status_code == 200


# ---- disconnects and metrics -----------------------------------------------------------------
def test_disconnect_before_the_first_event_aborts(served):
    """A client that hangs up while its request waits for admission: the response starts after it
    left, and the request must still be aborted."""
    base_url, async_engine = served
    aborted_before = aborted_count(base_url)
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900,
                       "ignore_eos": True, "stream": True}).encode()
    host, port = base_url.removeprefix("http://").split(":")
    # Hold the engine thread so admission waits: the hang-up lands before the response starts.
    gate = threading.Event()
    busy = async_engine.call_in_engine(lambda engine: gate.wait(60))
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(lambda: async_engine._pending)  # submitted after the hang-up, waiting for admission
    gate.set()
    busy.result(timeout=30)
    wait_until(lambda: aborted_count(base_url) > aborted_before)
    engine_idle_and_intact(async_engine)
    assert aborted_count(base_url) - aborted_before == 1


def test_disconnect_mid_stream_aborts_and_frees_every_block(served, client):
    base_url, async_engine = served
    aborted_before = aborted_count(base_url)
    stream = client.completions.create(model=MODEL, prompt="Tell me a long story", max_tokens=500,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    stream.close()  # hangs up mid-stream
    wait_until(lambda: aborted_count(base_url) > aborted_before)
    engine_idle_and_intact(async_engine)
    assert aborted_count(base_url) - aborted_before == 1
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def slow_steps(monkeypatch, engine, seconds: float) -> None:
    """Make every engine step take at least `seconds`, so a request's duration does not hang on
    the machine's speed (the engine thread looks `step` up anew each time)."""
    real_step = engine.step

    def slowed():
        time.sleep(seconds)
        return real_step()

    monkeypatch.setattr(engine, "step", slowed)


def test_disconnect_while_waiting_for_a_whole_reply_aborts_it(served, monkeypatch, caplog):
    base_url, async_engine = served
    slow_steps(monkeypatch, async_engine.engine, 0.005)  # 900 steps outlast the 0.5 s read anywhere
    aborted_before = aborted_count(base_url)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900, "ignore_eos": True}
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            httpx.post(base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=httpx.Timeout(60, read=0.5))
        # On a slow machine the request may reach the engine only after the hang-up: wait for the abort.
        wait_until(lambda: aborted_count(base_url) > aborted_before)
        engine_idle_and_intact(async_engine)
        gc.collect()  # asyncio reports an exception nobody read when its future is collected
    assert aborted_count(base_url) - aborted_before == 1
    # The abandoned gather's CancelledError had been logged, an ERROR traceback per hang-up.
    assert "never retrieved" not in caplog.text


def test_prompts_are_tokenized_off_the_event_loop(client, tokenize_threads):
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=1)
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert tokenize_threads and all(name.startswith("lengthwise-tokenize") for name in tokenize_threads)


def test_a_plain_prompt_gets_special_tokens_and_a_templated_chat_none(client, special_tokens_asked):
    # As vLLM: the tokenizer's BOS (for a model that adds one) starts a completion's prompt, while
    # a chat's template already wrote its special tokens (a second BOS would change the input).
    special_tokens_asked.clear()
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=1)
    assert special_tokens_asked == [True]
    special_tokens_asked.clear()
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert special_tokens_asked == [False]


def test_metrics_parse_with_vllm_like_names(served, client):
    for length in (2, 4):  # finished requests of different lengths, with predictions, give tau a value
        client.completions.create(model=MODEL, prompt="A short one" * length, max_tokens=length,
                                  extra_body={"ignore_eos": True})
    samples = scrape(served[0])
    names = {name for name, _ in samples}
    for expected in ("lengthwise:num_requests_running", "lengthwise:num_requests_waiting",
                     "lengthwise:num_requests_pending",
                     "lengthwise:kv_cache_usage_perc", "lengthwise:num_preemptions_total",
                     "lengthwise:prompt_tokens_total", "lengthwise:generation_tokens_total",
                     "lengthwise:time_to_first_token_seconds_bucket", "lengthwise:time_per_output_token_seconds_bucket",
                     "lengthwise:e2e_request_latency_seconds_bucket", "lengthwise:admission_rejections_total",
                     "lengthwise:request_time_per_output_token_seconds_bucket",
                     "lengthwise:predictor_latency_seconds_count", "lengthwise:predictor_prompts_total",
                     "lengthwise:predictor_kendall_tau"):
        assert expected in names, expected
    assert metric(samples, "lengthwise:server_info", policy="fcfs", model_name=MODEL) == 1
    assert metric(samples, "lengthwise:num_requests_running") == 0
    assert metric(samples, "lengthwise:prompt_tokens_total") > 0
    assert metric(samples, "lengthwise:predictor_latency_seconds_count") >= 1
    tau = [v for (n, _), v in samples.items() if n == "lengthwise:predictor_kendall_tau"]
    assert len(tau) == 1 and -1.0 <= tau[0] <= 1.0


def test_a_request_finished_before_its_submit_resumes_still_reports_its_prediction(tiny_model_dir):
    # The engine thread admits, steps and posts a one-token request while the loop is busy; the
    # loop then delivers its end before submit() resumes. The prediction, copied onto the stream
    # only when submit() resumed, was None then, and the tau metric lost the shortest requests.
    import asyncio
    import time

    from engine.async_engine import AsyncLLMEngine
    from scheduler.request import SamplingParams

    engine = tiny_engine(tiny_model_dir)
    reported = []

    class Listener:
        def __getattr__(self, name):  # every other callback: nothing to record
            return lambda *args, **kwargs: None

        def on_finished(self, output, tier, prediction):
            reported.append(prediction)

    async def main():
        served = AsyncLLMEngine(engine, chars_predictor())
        served.attach_listener(Listener())
        await served.start()

        async def one_token():
            stream = await served.submit("r", engine.tokenizer.encode("x" * 40), "x" * 40,
                                         SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
            async for _ in stream:
                pass

        task = asyncio.ensure_future(one_token())
        await asyncio.sleep(0)  # submit() queues its request
        time.sleep(1.0)  # the loop busy elsewhere while the engine thread serves it whole
        await task
        await served.shutdown(1)

    asyncio.run(main())
    assert len(reported) == 1 and reported[0] is not None and reported[0].point == pytest.approx(40.0)


def test_a_prompt_scored_alone_is_not_predicted_nor_paired_for_tau(tiny_model_dir):
    # max_tokens 0 scores the prompt (its one hidden token is known): a prediction there is of no
    # reply, and its pair (prediction, 1 token) filled the tau window with ties at 1.
    scored = []
    predictor = chars_predictor()
    predict = predictor.predict

    def counting(prompts):
        scored.extend(prompts)
        return predict(prompts)

    predictor.predict = counting
    with serving(tiny_engine(tiny_model_dir), predictor) as (base_url, _):
        for prompt in ("a short prompt", "a longer prompt than that one"):
            answer = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0,
                                                        "echo": True})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 0
        assert scored == [] and metric(scrape(base_url), "lengthwise:predictor_prompts_total") == 0
        # Two predicted in the order of their lengths: tau 1 over them alone. The scored prompts'
        # pairs (14, 1) and (29, 1), longer predictions for a shorter reply, would pull it below.
        for prompt, length in (("ab", 2), ("abcd", 4)):
            post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": length,
                                               "ignore_eos": True})
        samples = scrape(base_url)
        assert scored == ["ab", "abcd"] and metric(samples, "lengthwise:predictor_prompts_total") == 2
        assert metric(samples, "lengthwise:predictor_kendall_tau") == pytest.approx(1.0)


def test_kendall_tau_of_the_metrics_window():
    from engine.server.metrics import kendall_tau

    assert kendall_tau([(1, 10), (2, 20), (3, 30)]) == pytest.approx(1.0)
    assert kendall_tau([(1, 30), (2, 20), (3, 10)]) == pytest.approx(-1.0)
    assert kendall_tau([(1, 5), (2, 5)]) is None and kendall_tau([(1, 5)]) is None


def test_the_served_tau_metric_reads_the_ranking_length():
    from engine.outputs import RequestOutput
    from engine.server.metrics import ServerMetrics
    from predictor.base import Prediction
    from scheduler.request import Tier

    metrics = ServerMetrics(MODEL, lambda: None)
    for length in (3, 6, 9):
        # The ranking length orders the lengths; the point estimate, median and score do not.
        prediction = Prediction(point=100.0 - length, p50=256.0, p90=256.0, score=-float(length),
                                rank_len=float(length))
        output = RequestOutput(f"r{length}", (1,), (5,) * length, (5,), "", "", True, "length", 0.0, 0.0, 0.1, 1.0)
        metrics.on_finished(output, Tier.STANDARD, prediction)
    samples = {(f.name, s.name): s.value for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples}
    assert samples[("lengthwise:predictor_kendall_tau", "lengthwise:predictor_kendall_tau")] == pytest.approx(1.0)


def test_the_tokenizer_thread_comes_back_after_close(tokenizer):
    import asyncio

    from engine.server.serving import OpenAIServing

    serving = OpenAIServing(None, tokenizer, MODEL, MAX_MODEL_LEN)  # no engine: tokenizing only
    first = asyncio.run(serving.off_loop(serving._encode, "Hello there", True))
    serving.close()  # the app's lifespan ended; a second lifespan serves again
    assert asyncio.run(serving.off_loop(serving._encode, "Hello there", True)) == first
    serving.close()
