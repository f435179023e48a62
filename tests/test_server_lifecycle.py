"""The async engine's life: batched predictions at admission, draining (503), graceful shutdown
that finishes or aborts in-flight requests, engine failure ending every stream, and the serve
CLI's predictor resolution. Real tiny engine throughout; the predictors are real saved kinds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import threading
import time
import weakref

import httpx
import openai
import pytest

from engine.arrival_predictor import ArrivalPredictor
from engine.async_engine import AsyncLLMEngine, EngineDead, EngineShuttingDown, RequestAborted, StreamEnd
from engine.async_stream import EngineState, NullListener
from engine.engine_commands import Stop, Submission
from engine.server import serve_cli
from engine.server.app import ServerSettings, create_app
from predictor.saved import load, save
from scheduler.request import SamplingParams, Tier
from test_server import MODEL, chars_predictor, running_server, slow_steps, tiny_engine
from test_server_protocol import EncodeRecordingTokenizer


class BatchRecorder:
    """Wraps a real predictor; the first call waits until the test lets it go, so later arrivals
    pile up and must be scored together."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches: list[list[str]] = []
        self.release = threading.Event()

    def predict(self, prompts):
        self.batches.append(list(prompts))
        self.release.wait(timeout=60)
        return self.inner.predict(prompts)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return tiny_engine(tiny_model_dir)


def prompt_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def free_and_total(engine) -> tuple[int, int]:
    manager = engine.scheduler.block_manager
    manager.check_integrity()
    return manager.num_free_blocks, manager.num_total_blocks


async def drain(stream) -> list:
    return [item async for item in stream]


@pytest.mark.parametrize("overlap", [False, True], ids=["between-steps", "predictor-thread"])
def test_arrivals_are_scored_in_one_batch_and_reach_the_scheduler(engine, overlap):
    recorder = BatchRecorder(chars_predictor())
    texts = [f"prompt number {i} " * (i + 1) for i in range(5)]

    async def scenario():
        async_engine = AsyncLLMEngine(engine, recorder, overlap_prediction=overlap)
        await async_engine.start()
        params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)

        def submit(i: int):
            return asyncio.ensure_future(async_engine.submit(f"{overlap}-r{i}", prompt_ids(engine, texts[i]),
                                                             texts[i], params))

        submits = [submit(0)]
        deadline = time.monotonic() + 60
        while not recorder.batches:  # the predictor now holds r0 alone
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        submits += [submit(i) for i in range(1, len(texts))]
        await asyncio.sleep(0)  # r1-r4 are queued behind it
        recorder.release.set()
        streams = await asyncio.gather(*submits)
        # Commands run before each step, so r4 is still live when this call runs.
        predicted = await asyncio.wrap_future(async_engine.call_in_engine(
            lambda e: e.scheduler.get_request(f"{overlap}-r4").predicted_len))
        outputs = await asyncio.gather(*(drain(s) for s in streams))
        await async_engine.shutdown()
        return streams, predicted, outputs

    streams, predicted, outputs = asyncio.run(scenario())
    assert sorted(p for batch in recorder.batches for p in batch) == sorted(texts)
    assert recorder.batches == [texts[:1], texts[1:]]  # those that arrived while it worked, in one batch
    expected = chars_predictor().predict(texts)
    assert [s.prediction for s in streams] == expected
    assert predicted == pytest.approx(expected[4].point)
    assert all(out[-1].finished and len(out[-1].token_ids) == 40 for out in outputs)
    free, total = free_and_total(engine)
    assert free == total


def test_a_batch_scores_each_distinct_prompt_once():
    # The n choices of one request arrive together with one prompt: scored once, shared by all.
    calls, latencies = [], []

    class Recording:
        def predict(self, prompts):
            calls.append(list(prompts))
            return chars_predictor().predict(prompts)

    params = SamplingParams(max_tokens=4)
    texts = ["same prompt", "other", "same prompt", "same prompt"]
    batch = [Submission(f"r{i}", [1], text, params, Tier.STANDARD, 0, 0.0) for i, text in enumerate(texts)]
    ArrivalPredictor(Recording(), lambda *latency: latencies.append(latency)).predict_batch(batch)
    assert calls == [["same prompt", "other"]] and latencies[0][1] == 2
    expected = dict(zip(calls[0], chars_predictor().predict(calls[0])))
    assert [s.prediction for s in batch] == [expected[text] for text in texts]
    # A prompt scored alone (no text: nothing to predict) is left out, and a batch of only such
    # prompts makes no predictor call and no latency sample at all.
    calls.clear()
    alone = [Submission("s0", [1], None, params, Tier.STANDARD, 0, 0.0),
             Submission("s1", [1], "other", params, Tier.STANDARD, 0, 0.0)]
    ArrivalPredictor(Recording(), lambda *latency: latencies.append(latency)).predict_batch(alone)
    assert calls == [["other"]] and alone[0].prediction is None and alone[1].prediction is not None
    ArrivalPredictor(Recording(), lambda *latency: latencies.append(latency)).predict_batch(alone[:1])
    assert calls == [["other"]] and len(latencies) == 2


def test_a_predictor_answering_fewer_prompts_leaves_the_rest_unpredicted():
    # A broken predictor must not take the engine thread down with a KeyError.
    class Short:
        def predict(self, prompts):
            return chars_predictor().predict(prompts[:1])

    params = SamplingParams(max_tokens=4)
    batch = [Submission(f"r{i}", [1], text, params, Tier.STANDARD, 0, 0.0) for i, text in enumerate(["a", "bb"])]
    ArrivalPredictor(Short(), lambda *latency: None).predict_batch(batch)
    assert batch[0].prediction == chars_predictor().predict(["a"])[0] and batch[1].prediction is None


@pytest.mark.parametrize("how, error", [("drain", EngineShuttingDown), ("abort", RequestAborted)])
def test_a_request_aborted_while_the_predictor_holds_it_never_runs(engine, how, error):
    # With overlap the submission waits with the predictor while the abort goes straight to the
    # engine thread, where it finds nothing; the submission arriving after must be refused.
    recorder = BatchRecorder(chars_predictor())
    reports = []

    class Recording(NullListener):
        def on_rejected(self, tier, error):
            reports.append(("rejected", type(error)))

        def on_aborted(self, request_id, tier, reason="abort"):
            reports.append(("aborted", request_id))

    async def scenario():
        async_engine = AsyncLLMEngine(engine, recorder, overlap_prediction=True, listener=Recording())
        await async_engine.start()
        text = "Tell a story"
        waiting = asyncio.ensure_future(async_engine.submit(
            "held", prompt_ids(engine, text), text, SamplingParams(max_tokens=500, ignore_eos=True)))
        for _ in range(6000):  # until the predictor thread holds it
            if recorder.batches:
                break
            await asyncio.sleep(0.01)
        assert recorder.batches, "the predictor never received the request"
        if how == "drain":
            await async_engine.drain(grace_s=0)
        else:
            async_engine.abort("held")
        # Answered at once, not when the predictor lets it go: at a shutdown that could outlast
        # the server's flush, and the client got a plain 500.
        with pytest.raises(error):
            await asyncio.wait_for(waiting, 30)
        recorder.release.set()
        running = await asyncio.wrap_future(async_engine.call_in_engine(lambda e: e.has_unfinished_requests()))
        await async_engine.shutdown(grace_s=0)
        return running

    assert asyncio.run(scenario()) is False
    free, total = free_and_total(engine)
    assert free == total
    if how == "drain":  # never admitted: counted once, as refused, not also as an abort
        assert reports == [("rejected", EngineShuttingDown)]


def test_an_engine_failure_counts_a_request_the_predictor_holds_once_as_refused(engine):
    # It was counted as a request finished with an error too, though the engine never held it.
    recorder, reports = BatchRecorder(chars_predictor()), []

    class Recording(NullListener):
        def on_rejected(self, tier, error):
            reports.append(("rejected", type(error)))

        def on_aborted(self, request_id, tier, reason="abort"):
            reports.append(("aborted", request_id, reason))

    def engine_thread_dies(_):
        raise SystemExit("the engine thread dies")

    async def scenario():
        async_engine = AsyncLLMEngine(engine, recorder, overlap_prediction=True, listener=Recording())
        await async_engine.start()
        waiting = asyncio.ensure_future(async_engine.submit(
            "held", prompt_ids(engine, "Hello"), "Hello", SamplingParams(max_tokens=5)))
        for _ in range(6000):  # until the predictor thread holds it
            if recorder.batches:
                break
            await asyncio.sleep(0.01)
        assert recorder.batches, "the predictor never received the request"
        with pytest.raises(BaseException):
            await asyncio.wrap_future(async_engine.call_in_engine(engine_thread_dies))
        while async_engine.state is not EngineState.FAILED:
            await asyncio.sleep(0.01)
        recorder.release.set()
        with pytest.raises(EngineDead):
            await asyncio.wait_for(waiting, 60)
        await async_engine.shutdown(grace_s=0)

    asyncio.run(scenario())
    assert reports == [("rejected", EngineDead)]


def test_an_engine_started_a_second_time_says_so(engine):
    async def scenario():
        async_engine = AsyncLLMEngine(engine)
        await async_engine.start()
        await async_engine.shutdown(grace_s=0)
        with pytest.raises(RuntimeError, match="starts once"):
            await async_engine.start()

    asyncio.run(scenario())


def test_shutdown_without_grace_aborts_in_flight_and_frees_blocks(engine):
    async def scenario():
        async_engine = AsyncLLMEngine(engine)
        await async_engine.start()
        stream = await async_engine.submit("long", prompt_ids(engine, "Tell a story"), "Tell a story",
                                           SamplingParams(max_tokens=900, ignore_eos=True))
        first = await stream.__anext__()
        await async_engine.shutdown(grace_s=0)
        rest = await drain(stream)
        with pytest.raises(EngineShuttingDown):
            await async_engine.submit("late", [1, 2], "x", SamplingParams(max_tokens=2))
        return first, rest

    first, rest = asyncio.run(scenario())
    assert not first.finished
    assert isinstance(rest[-1], StreamEnd) and rest[-1].reason == "abort"
    assert not engine.has_unfinished_requests()
    free, total = free_and_total(engine)
    assert free == total


def test_a_listener_attached_before_start_hears_every_finish_and_one_attached_after_is_refused(engine):
    class Finishes(NullListener):
        def __init__(self):
            self.finished = []

        def on_finished(self, output, tier, prediction):
            self.finished.append(output.request_id)

    async def scenario():
        async_engine, finishes = AsyncLLMEngine(engine), Finishes()
        async_engine.attach_listener(finishes)
        await async_engine.start()
        with pytest.raises(RuntimeError, match="before the engine starts"):
            async_engine.attach_listener(NullListener())
        stream = await async_engine.submit("heard", prompt_ids(engine, "Hello"), "Hello",
                                           SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
        await asyncio.wait_for(drain(stream), timeout=60)
        await async_engine.shutdown()
        return async_engine, finishes

    async_engine, finishes = asyncio.run(scenario())
    assert finishes.finished == ["heard"] and async_engine.listener is finishes
    assert async_engine.policy is engine.scheduler.policy


def test_a_second_submit_with_a_live_id_is_refused_and_the_first_request_finishes(engine):
    async def scenario():
        async_engine = AsyncLLMEngine(engine)
        await async_engine.start()
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
        stream = await async_engine.submit("same", prompt_ids(engine, "Hello"), "Hello", params)
        with pytest.raises(ValueError, match="already in use"):
            await async_engine.submit("same", prompt_ids(engine, "Other"), "Other", params)
        outputs = await asyncio.wait_for(drain(stream), timeout=60)
        await async_engine.shutdown()
        return outputs

    outputs = asyncio.run(scenario())
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 12
    free, total = free_and_total(engine)
    assert free == total


async def resubmit_and_drain(async_engine, prompt: list[int], release: threading.Event) -> list:
    """Submit a 12-token request under the id "x" the last one held, let the engine go on
    (`release`) once its stream holds the id, and return its outputs."""
    twelve = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    new = asyncio.ensure_future(async_engine.submit("x", prompt, "Something else entirely", twelve))
    await asyncio.sleep(0.05)  # the new stream holds the id
    release.set()
    outputs = await asyncio.wait_for(drain(await new), timeout=60)
    await async_engine.shutdown()
    return outputs


def assert_only_the_new_reply(outputs: list, async_engine, prompt: list[int]) -> None:
    assert outputs[-1].finished and list(outputs[-1].prompt_token_ids) == prompt
    assert len(outputs[-1].token_ids) == 12
    assert not async_engine._aborts_in_flight


def test_an_id_reused_while_its_abort_is_in_flight_gets_only_its_own_outputs(tiny_model_dir, monkeypatch):
    # The engine thread is inside a step with the old request when it is aborted and its id taken
    # again: that step's outputs are the old request's and must not end the new stream.
    engine = tiny_engine(tiny_model_dir)
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.step

    def gated_step():
        in_step.set()
        release.wait(30)
        return real_step()

    monkeypatch.setattr(engine, "step", gated_step)
    async_engine = AsyncLLMEngine(engine)
    old_prompt, new_prompt = prompt_ids(engine, "Hello there"), prompt_ids(engine, "Something else entirely")

    async def scenario():
        await async_engine.start()
        await async_engine.submit("x", old_prompt, "Hello there",
                                  SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        assert await asyncio.to_thread(in_step.wait, 30)
        async_engine.abort("x")
        await asyncio.sleep(0)  # the old stream is dropped: the id is free
        # release: the step with the old request ends; every later step runs at once
        return await resubmit_and_drain(async_engine, new_prompt, release)

    assert_only_the_new_reply(asyncio.run(scenario()), async_engine, new_prompt)
    free, total = free_and_total(engine)
    assert free == total


def test_draining_server_answers_503_and_finishes_in_flight_requests(engine):
    async_engine = AsyncLLMEngine(engine)
    tokenizer = EncodeRecordingTokenizer(engine.tokenizer)
    app = create_app(async_engine, tokenizer, ServerSettings(model_name=MODEL, max_model_len=1024))
    body = {"model": MODEL, "prompt": "Count to ten", "max_tokens": 60, "ignore_eos": True, "stream": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with running_server(app) as (base_url, _):
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            async_engine.begin_drain()
            encoded_before = len(tokenizer.encoded)
            refused = httpx.post(base_url + "/v1/completions", json={**body, "stream": False}, timeout=60)
            refused_chat = httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60)
            sdk = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)
            with pytest.raises(openai.APIStatusError) as refused_sdk:  # what an OpenAI client sees
                sdk.chat.completions.create(model=MODEL, messages=chat["messages"], max_tokens=4)
            health = httpx.get(base_url + "/health", timeout=60)
            rest = [line for line in lines if line]
    assert refused_sdk.value.status_code == 503 and refused_sdk.value.code == "shutting_down"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert refused_chat.status_code == 503 and refused_chat.json()["error"]["code"] == "shutting_down"
    assert len(tokenizer.encoded) == encoded_before  # refused before the tokenizer thread queued them
    assert health.status_code == 503
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    free, total = free_and_total(engine)
    assert free == total


def serve_every_route_once(engine) -> weakref.ref:
    """A server over `engine` that answers one call of each route, then stops; returns a weak
    reference to its async engine."""
    async_engine = AsyncLLMEngine(engine)
    app = create_app(async_engine, engine.tokenizer, ServerSettings(model_name=MODEL, max_model_len=1024))
    with running_server(app) as (base_url, _):
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for route, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}), ("/v1/chat/completions", chat),
                            ("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})]:
            assert httpx.post(base_url + route, json={"model": MODEL, **body}, timeout=60).status_code == 200
        for route in ["/v1/models", "/health", "/ping", "/version", "/metrics"]:
            assert httpx.get(base_url + route, timeout=60).status_code == 200
    return weakref.ref(async_engine)


def test_a_stopped_server_lets_go_of_its_engine(engine):
    """Nothing process-wide keeps a stopped app's engine alive (FastAPI caches every route function
    it has seen, so routes must not close over one app's engine): a process, or a test suite, that
    starts server after server holds one engine's KV cache and swap pool, not all of them."""
    gone = serve_every_route_once(engine)
    gc.collect()
    assert gone() is None


def start_draining_server(engine, grace_s: float):
    """The serve CLI's server over `engine` on a free loopback port, started in a thread; returns
    (async engine, server, thread, socket)."""
    import socket

    import uvicorn

    async_engine = AsyncLLMEngine(engine)
    app = create_app(async_engine, engine.tokenizer, ServerSettings(model_name=MODEL, max_model_len=1024))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = serve_cli.DrainingServer(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=5),
                                      async_engine, grace_s=grace_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    return async_engine, server, thread, sock


def test_a_stop_signal_ends_a_stream_past_the_grace_period_with_abort_and_done(engine, monkeypatch):
    """Through the serve CLI's server: SIGINT, then a request that cannot finish within the grace
    period gets its last chunk (finish_reason "abort") and [DONE], not a cut connection."""
    import signal

    slow_steps(monkeypatch, engine, 0.005)  # 900 steps outlast the 0.3 s grace on any machine
    async_engine, server, thread, sock = start_draining_server(engine, grace_s=0.3)
    body = {"model": MODEL, "prompt": "Count to ten", "max_tokens": 900, "ignore_eos": True, "stream": True}
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    answers = {}
    plain = threading.Thread(target=lambda: answers.update(
        plain=httpx.post(url, json={**body, "stream": False}, timeout=60)))
    plain.start()
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 30
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 2:  # both admitted
            assert time.monotonic() < deadline
            time.sleep(0.02)
        server.handle_exit(signal.SIGINT, None)
        rest = [line for line in lines if line]
    thread.join(timeout=60)
    plain.join(timeout=60)
    sock.close()
    assert not thread.is_alive()
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"abort"' in rest[-2]
    # Without a stream, the cut-off request is told that it ran and was cut, not that it was refused.
    assert answers["plain"].status_code == 503
    assert answers["plain"].json()["error"]["code"] == "aborted_at_shutdown"
    free, total = free_and_total(engine)
    assert free == total


def test_a_second_stop_signal_ends_running_requests_at_once_not_at_the_grace(tiny_model_dir, monkeypatch):
    """As uvicorn's force exit: a second Ctrl-C must not leave the server waiting out the grace."""
    import signal

    engine = tiny_engine(tiny_model_dir)
    slow_steps(monkeypatch, engine, 0.2)  # 900 steps: three minutes, past the join below
    async_engine, server, thread, sock = start_draining_server(engine, grace_s=3600)
    body = {"model": MODEL, "prompt": "Count to ten", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions", json=body,
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        server.handle_exit(signal.SIGINT, None)
        server.handle_exit(signal.SIGINT, None)
        thread.join(timeout=60)
    sock.close()
    assert not thread.is_alive()
    # uvicorn's force exit skips the app's lifespan shutdown: the server stopped the engine itself.
    assert not async_engine._threads[0].is_alive()
    free, total = free_and_total(engine)
    assert free == total


def test_engine_failure_ends_streams_with_an_error_and_health_says_so(tiny_model_dir, monkeypatch):
    broken = tiny_engine(tiny_model_dir)
    steps = {"n": 0}
    real_step = broken.step

    def failing_step():
        steps["n"] += 1
        if steps["n"] > 3:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(broken, "step", failing_step)
    async_engine = AsyncLLMEngine(broken)
    app = create_app(async_engine, broken.tokenizer, ServerSettings(model_name=MODEL, max_model_len=1024))
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 50, "ignore_eos": True}
    with running_server(app) as (base_url, _):
        with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        after = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
        health = httpx.get(base_url + "/health", timeout=60)
        failed = httpx.get(base_url + "/metrics", timeout=60).text
    assert "device lost" in lines[-2] and '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert after.status_code == 500 and after.json()["error"]["code"] == "engine_error"
    assert health.status_code == 500
    # The failed request is counted, and the metrics keep nothing of it; nor a dead engine's state.
    assert 'finished_reason="error"' in failed and not app.state.served.metrics._last_token_time
    assert "lengthwise:num_requests_running" not in failed and "lengthwise:kv_cache_usage_perc" not in failed


def test_a_request_aborted_while_the_engine_adds_it_is_refused_not_left_streaming(tiny_model_dir, monkeypatch):
    # The abort lands after the engine thread checked for one and before it answered: the request
    # is admitted, then freed by the abort queued behind it; submit must not hand back a stream
    # that nothing will end.
    engine = tiny_engine(tiny_model_dir)
    async_engine = AsyncLLMEngine(engine)
    entered, release = threading.Event(), threading.Event()
    real_add = engine.add_request

    def slow_add(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real_add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", slow_add)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def scenario():
        await async_engine.start()
        submitted = asyncio.ensure_future(async_engine.submit("r", prompt_ids(engine, "Hello"), "Hello", params))
        assert await asyncio.to_thread(entered.wait, 30)
        async_engine.abort("r")
        release.set()
        with pytest.raises(RequestAborted):
            await asyncio.wait_for(submitted, 60)
        while await asyncio.wrap_future(async_engine.call_in_engine(lambda e: e.has_unfinished_requests())):
            await asyncio.sleep(0.01)
        await async_engine.shutdown(grace_s=0)

    asyncio.run(scenario())
    free, total = free_and_total(engine)
    assert free == total and not async_engine._streams


def test_a_failure_after_the_stop_is_taken_still_ends_the_engine_thread(tiny_model_dir, monkeypatch):
    engine = tiny_engine(tiny_model_dir)
    async_engine = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    def broken_abort(request_id):
        raise RuntimeError("abort bookkeeping broke")

    async def scenario():
        await async_engine.start()
        await async_engine.submit("a", prompt_ids(engine, "Hello"), "Hello", params)
        monkeypatch.setattr(engine, "abort_request", broken_abort)
        async_engine._commands.put(Stop())  # the stop aborts the live request, which raises
        await asyncio.to_thread(async_engine._threads[0].join, 60)

    asyncio.run(scenario())
    assert not async_engine._threads[0].is_alive()  # it waited for a second Stop before
    assert async_engine.state is EngineState.FAILED


def test_a_command_that_fails_leaves_no_other_command_of_its_batch_unanswered(tiny_model_dir, monkeypatch):
    engine = tiny_engine(tiny_model_dir)

    def broken_abort(request_id):
        raise RuntimeError("abort bookkeeping broke")

    monkeypatch.setattr(engine, "abort_request", broken_abort)
    async_engine = AsyncLLMEngine(engine)
    ids = prompt_ids(engine, "Hello there")
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def scenario():
        await async_engine.start()
        await async_engine.submit("a", ids, "Hello there", params)
        gate = threading.Event()
        async_engine.call_in_engine(lambda _: gate.wait(30))  # holds the engine thread between steps
        async_engine.abort("a")  # the abort that raises, and after it in the same batch ...
        waiting = asyncio.ensure_future(async_engine.submit("b", ids, "Hello there", params))
        while "b" not in async_engine._pending:  # ... the submission of b, queued behind it
            await asyncio.sleep(0)
        gate.set()
        with pytest.raises(EngineDead, match="abort bookkeeping broke"):
            await asyncio.wait_for(waiting, 60)  # refused, not left waiting forever
        await async_engine.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_predictor_resolution(tmp_path, monkeypatch):
    from training.serve_predictor import champion_or_default

    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    store, fallback = tmp_path / "mlruns", tmp_path / "data" / "predictors" / "default"
    assert serve_cli.predictor_folder("none") is None
    assert champion_or_default(store, fallback) == "none"
    with pytest.raises(FileNotFoundError, match="not a saved predictor folder"):
        serve_cli.predictor_folder(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a saved predictor folder"):
        serve_cli.predictor_folder("champion")  # resolved by the CLI before the server runs
    folder = save(chars_predictor(), fallback)
    assert champion_or_default(store, fallback) == str(fallback)
    assert serve_cli.predictor_folder(str(folder)) == str(folder)


def test_the_cli_hands_serve_the_champions_folder(monkeypatch):
    import argparse

    from training import cli, serve_predictor

    monkeypatch.setattr(serve_predictor, "champion_or_default", lambda: "/some/folder")
    args = argparse.Namespace(_command="serve", predictor="champion", log_level="info", store=None)
    cli._resolve_arguments(args)
    assert args.predictor == "/some/folder"
    args = argparse.Namespace(_command="serve", predictor="data/x", log_level="info", store=None)
    cli._resolve_arguments(args)
    assert args.predictor == "data/x"  # a folder is checked by the server itself


def test_serve_arguments_build_the_engine_config():
    import argparse

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--policy", "goodput", "--max-num-seqs", "7",
                              "--kv-cache-memory", "0.25", "--admission", "--max-queued-tokens", "5000",
                              "--attention-backend", "torch", "--aging-tokens-per-step", "0.5",
                              "--slo-ttft-interactive", "0.2", "--slo-e2e-standard", "20", "--batch-shed-share",
                              "0.25", "--goodput-urgent-slack", "3"])
    config = serve_cli.build_engine_config(args)
    assert (config.model, config.policy, config.max_num_seqs, config.kv_cache_memory_gib) == ("m", "goodput", 7, 0.25)
    assert config.attention_backend == "torch" and config.predictor is None
    assert config.scheduler_options == {"enable_admission": True, "max_queued_tokens": 5000,
                                        "aging_tokens_per_step": 0.5, "slo_ttft_interactive_s": 0.2,
                                        "slo_e2e_standard_s": 20.0, "batch_shed_share": 0.25,
                                        "goodput_urgent_slack_s": 3.0}
    scheduler = config.scheduler_config(num_gpu_blocks=8, num_cpu_blocks=0)
    assert scheduler.slo_e2e_standard_s == 20.0
    # The product's policy by default: make serve ran FCFS, with the predictor scoring for nothing.
    # Without a predictor, FCFS still: sjf would order by max_tokens, the rest of the context for
    # a chat that sends none, and serve the shortest prompts last.
    assert serve_cli.build_engine_config(parser.parse_args([])).policy == "sjf"
    assert serve_cli.build_engine_config(parser.parse_args(["--predictor", "none"])).policy == "fcfs"
    assert serve_cli.build_engine_config(parser.parse_args(["--predictor", "None", "--policy", "sjf"])).policy == "sjf"
    srpt = serve_cli.build_engine_config(parser.parse_args(["--model", "m", "--policy", "srpt",
                                                            "--srpt-max-preempt-share", "0.3"]))
    assert srpt.scheduler_config(num_gpu_blocks=8, num_cpu_blocks=0).srpt_max_preempt_share == 0.3
    # An SLO is read by admission whatever the policy; without it, only by goodput.
    with_admission = parser.parse_args(["--model", "m", "--policy", "fcfs", "--admission", "--slo-e2e-standard", "5"])
    assert serve_cli.build_engine_config(with_admission).scheduler_options["slo_e2e_standard_s"] == 5.0
    # A knob the served policy never reads is refused, as an admission knob is without --admission.
    for policy, knob in (("fcfs", "--aging-tokens-per-step"), ("sjf", "--srpt-max-preempt-share"),
                         ("srpt", "--goodput-urgent-slack"), ("fcfs", "--slo-e2e-standard"),
                         ("priority", "--aging-tokens-per-s")):
        with pytest.raises(ValueError, match=f"{knob}: --policy {policy} does not read it"):
            serve_cli.build_engine_config(parser.parse_args(["--model", "m", "--policy", policy, knob, "0.5"]))
    # Unset knobs keep the scheduler's own defaults.
    plain = serve_cli.build_engine_config(parser.parse_args(["--model", "m"]))
    assert plain.scheduler_options == {"enable_admission": False}
    assert args.host == "127.0.0.1" and args.port == 8000


def test_a_length_policy_without_a_predictor_says_it_orders_by_max_tokens(caplog):
    with caplog.at_level("WARNING", logger=serve_cli.logger.name):
        for policy, predictor_path in (("fcfs", None), ("priority", None), ("sjf", "p"), ("srpt", "p")):
            serve_cli.warn_if_ordering_without_predictor(policy, predictor_path)
        assert not caplog.records
        for policy in ("sjf", "srpt", "goodput"):
            serve_cli.warn_if_ordering_without_predictor(policy, None)
    assert [r.getMessage().split(" with")[0] for r in caplog.records] == ["--policy sjf", "--policy srpt",
                                                                         "--policy goodput"]
    assert "orders requests by max_tokens" in caplog.records[0].getMessage()


def test_a_length_policy_outside_the_sjf_family_warns_too(caplog, monkeypatch):
    """The warning asks the policy whether it reads predictions, not whether it derives from SJF."""
    from scheduler.policies import POLICIES, TieredPolicy

    class PredictedLengthFirst(TieredPolicy):
        name = "predicted-first"
        orders_by_prediction = True

        def score(self, request, now):
            return request.predicted_total

    monkeypatch.setitem(POLICIES, PredictedLengthFirst.name, PredictedLengthFirst)
    with caplog.at_level("WARNING", logger=serve_cli.logger.name):
        serve_cli.warn_if_ordering_without_predictor(PredictedLengthFirst.name, None)
    assert [r.getMessage().split(" with")[0] for r in caplog.records] == ["--policy predicted-first"]


def test_serve_offers_every_policy_but_the_oracle_which_needs_true_lengths(capsys):
    import argparse

    from scheduler.policies import POLICIES

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    for name in sorted(set(POLICIES) - {"oracle"}):  # goodput was missing from a fixed list
        assert serve_cli.build_engine_config(parser.parse_args(["--policy", name])).policy == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--policy", "oracle"])
    assert "invalid choice: 'oracle'" in capsys.readouterr().err


def test_the_champion_training_registers_is_the_predictor_serve_loads(tmp_path):
    # Registered and resolved by training's code from one store: the registered champion wins
    # over the committed default.
    from training import tracking
    from training.serve_predictor import champion_or_default

    fallback = save(chars_predictor(), tmp_path / "default")
    folder = save(chars_predictor(), tmp_path / "saved")
    with tracking.tracking_session(tmp_path / "mlruns"):
        run_id = tracking.log_run("chars", {"model": "length"}, {tracking.SELECTION_METRIC: 0.5}, folder, [],
                                  tracking.comparison_tags("sharegpt", ""))
        assert tracking.update_champion() == run_id
    resolved = champion_or_default(tmp_path / "mlruns", fallback)
    assert resolved != str(fallback)
    assert load(resolved).predict(["abc"]) == chars_predictor().predict(["abc"])


def test_serve_store_names_the_store_whose_champion_it_serves(tmp_path, capsys):
    # serve read mlruns/ alone: a champion trained into another store could not be served.
    import argparse

    from training import cli, tracking

    folder = save(chars_predictor(), tmp_path / "saved")
    with tracking.tracking_session(tmp_path / "mlruns"):
        tracking.log_run("chars", {"model": "length"}, {tracking.SELECTION_METRIC: 0.5}, folder, [],
                         tracking.comparison_tags("sharegpt", ""))
        tracking.update_champion()
    args = cli._build_parser(["serve"]).parse_args(["serve", "--store", str(tmp_path / "mlruns")])
    cli._resolve_arguments(args)
    assert load(args.predictor).predict(["abc"]) == chars_predictor().predict(["abc"])
    # A store named without a champion is refused, not quietly swapped for the default, and a
    # store beside a predictor folder would be read by nothing.
    (tmp_path / "empty").mkdir()
    empty = argparse.Namespace(**{**vars(args), "predictor": "champion", "store": tmp_path / "empty"})
    with pytest.raises(ValueError, match=f"--store {tmp_path / 'empty'}: "):
        cli._resolve_arguments(empty)
    with pytest.raises(ValueError, match="it has no effect with --predictor data/x"):
        cli._resolve_arguments(argparse.Namespace(**{**vars(args), "predictor": "data/x"}))


def test_a_slow_reader_gets_the_newest_output_and_never_loses_the_end():
    from engine.async_stream import RequestStream
    from engine.outputs import RequestOutput
    from scheduler.output import TokenLogprobs
    from scheduler.request import Tier

    def output(n: int, finished: bool = False) -> RequestOutput:
        logprobs = tuple(TokenLogprobs(i, -1.0, ()) for i in range(n))
        return RequestOutput("r", (1,), tuple(range(n)), (n - 1,), "x" * n, "x", finished,
                             "length" if finished else None, 0.0, 0.0, 0.0, None, logprobs=logprobs)

    async def scenario():
        stream = RequestStream("r", Tier.STANDARD)
        for n in (1, 2, 3):
            stream.put(output(n))
        newest = await stream.__anext__()
        stream.put(output(4, finished=True))
        stream.put(StreamEnd("abort"))  # arrives after the end: must not replace it
        return newest, [item async for item in stream]

    newest, rest = asyncio.run(scenario())
    assert newest.token_ids == (0, 1, 2)
    assert len(rest) == 1 and rest[0].finished and rest[0].text == "xxxx"

    async def aborted_before_the_last_read():
        stream = RequestStream("r", Tier.STANDARD)
        stream.put(output(2))
        await stream.__anext__()
        stream.put(output(5))
        stream.put(StreamEnd("abort"))  # replaces the unread output, but keeps its text and logprobs
        return [item async for item in stream]

    (end,) = asyncio.run(aborted_before_the_last_read())
    assert isinstance(end, StreamEnd) and end.reason == "abort" and end.text == "xxxxx"
    assert [entry.token_id for entry in end.logprobs] == [0, 1, 2, 3, 4]


def test_a_call_queued_behind_the_stop_command_is_refused_not_left_waiting(engine):
    from engine.engine_commands import refuse_until_stopped

    async_engine = AsyncLLMEngine(engine)
    async_engine._commands.put(Stop())
    late = async_engine.call_in_engine(lambda e: "ran")  # in the same batch as the stop
    assert async_engine._worker.run_commands(block=False) is False
    refuse_until_stopped(async_engine._commands, EngineShuttingDown(), block=False)
    with pytest.raises(EngineShuttingDown):
        late.result(timeout=1)


def test_serve_refuses_a_kv_cache_smaller_than_one_full_context():
    # As vLLM does: otherwise every chat request without max_tokens (defaulting to the rest of the
    # context) was refused as too large for the cache, with a 400 that did not say why.
    from scheduler.config import SchedulerConfig

    small = SchedulerConfig(num_gpu_blocks=32, block_size=16, max_model_len=1024)
    assert "holds 512 tokens, fewer than max_model_len 1024" in serve_cli.kv_shortfall(small)
    assert serve_cli.kv_shortfall(SchedulerConfig(num_gpu_blocks=64, block_size=16, max_model_len=1024)) is None


def test_the_model_answers_to_its_path_as_given_absolute_and_repository_relative(monkeypatch):
    from engine.config import DEFAULT_MODEL, REPO_ROOT

    aliases = serve_cli.model_aliases(DEFAULT_MODEL)
    assert DEFAULT_MODEL in aliases and "data/models/smollm2-135m-instruct" in aliases
    monkeypatch.chdir(REPO_ROOT / "data")
    assert set(serve_cli.model_aliases("models/x")) == {"models/x", str(REPO_ROOT / "data/models/x"), "data/models/x"}


def test_the_served_models_hub_id_names_its_converted_folder(tmp_path, monkeypatch):
    # vLLM's users write `serve HuggingFaceTB/SmolLM2-135M-Instruct` and send that name: it was
    # "no converted model at HuggingFaceTB/...", and an unknown model name from a client.
    from engine.config import DEFAULT_MODEL, SERVED_MODEL_HUB_ID, EngineConfig

    assert EngineConfig(model=SERVED_MODEL_HUB_ID).model == DEFAULT_MODEL
    assert SERVED_MODEL_HUB_ID in serve_cli.model_aliases(DEFAULT_MODEL)
    assert SERVED_MODEL_HUB_ID not in serve_cli.model_aliases(str(tmp_path))  # another model's folder
    # Named by its hub id, it is listed by it, as vLLM lists what it was given; a folder by its name.
    assert serve_cli.served_name(SERVED_MODEL_HUB_ID, DEFAULT_MODEL) == SERVED_MODEL_HUB_ID
    assert serve_cli.served_name(None, DEFAULT_MODEL) == "smollm2-135m-instruct"
    # The hub id and the folder it names are one model, not a model named twice.
    both = argparse.Namespace(model_tag=SERVED_MODEL_HUB_ID, model=DEFAULT_MODEL)
    assert serve_cli.model_folder(both) == SERVED_MODEL_HUB_ID
    with pytest.raises(ValueError, match="named twice"):
        serve_cli.model_folder(argparse.Namespace(model_tag=SERVED_MODEL_HUB_ID, model=str(tmp_path)))
    monkeypatch.chdir(tmp_path)
    (tmp_path / SERVED_MODEL_HUB_ID).mkdir(parents=True)  # a folder of that name is what it names
    assert EngineConfig(model=SERVED_MODEL_HUB_ID).model == SERVED_MODEL_HUB_ID


def test_serve_falls_back_when_the_champion_cannot_be_served(tmp_path, monkeypatch) -> None:
    from predictor.saved import SPEC_FILENAME
    from training import serve_predictor, tracking

    (tmp_path / "default").mkdir()  # a fallback folder with no predictor in it
    assert serve_predictor.champion_or_default(tmp_path / "mlruns", tmp_path / "default") == "none"

    def broken(dst=None, store=None):
        raise RuntimeError("corrupt store")

    monkeypatch.setattr(tracking, "download_champion", broken)
    assert serve_predictor.champion_or_default(tmp_path / "mlruns", tmp_path / "none") == "none"
    champion = tmp_path / "champion"
    champion.mkdir()
    monkeypatch.setattr(tracking, "download_champion", lambda dst=None, store=None: champion)
    assert serve_predictor.champion_or_default(tmp_path / "mlruns", tmp_path / "none") == "none"  # no spec
    (champion / SPEC_FILENAME).write_text("{}")
    assert serve_predictor.champion_or_default(tmp_path / "mlruns", tmp_path / "none") == str(champion)


def test_a_registered_champion_whose_files_are_gone_is_a_warning_not_a_fresh_clone(tmp_path, monkeypatch,
                                                                                    caplog) -> None:
    # download_champion said LookupError both for no champion and for a champion whose run's files
    # were deleted: serve then logged, at INFO, that none was registered, and served the default.
    import logging

    from predictor.saved import SPEC_FILENAME
    from training import serve_predictor, tracking

    def gone(dst=None, store=None):
        raise tracking.ChampionFilesMissing("the champion's files are missing (file:///gone)")

    monkeypatch.setattr(tracking, "download_champion", gone)
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / SPEC_FILENAME).write_text("{}")
    with caplog.at_level(logging.INFO, logger="lengthwise.serve"):
        assert serve_predictor.champion_or_default(tmp_path / "mlruns", tmp_path / "default") == \
            str(tmp_path / "default")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "registered but not available" in warnings[0] and "file:///gone" in warnings[0]
    assert "not in the registry" not in caplog.text and "no registered champion" not in caplog.text


def test_resolving_the_champion_logs_in_the_servers_format_first(monkeypatch) -> None:
    import argparse

    from training import serve_predictor

    calls = []
    monkeypatch.setattr(serve_predictor, "configure_serve_logging", calls.append)
    monkeypatch.setattr(serve_predictor, "champion_or_default", lambda: "none")
    serve_predictor.resolve_args(argparse.Namespace(predictor="champion", log_level="debug", store=None))
    assert calls == ["debug"]


class RecordingListener:
    """Every listener event, in order, by name."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, name: str):
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.events.append(name)


@pytest.mark.parametrize("how, error", [("drain", EngineShuttingDown), ("abort", RequestAborted)])
def test_a_request_ended_while_the_engine_adds_it_counts_as_admitted_and_aborted(engine, monkeypatch, how, error):
    # The abort or the drain lands while the engine thread is inside add_request: the engine admits
    # the request and then aborts it, so the listener (the metrics) must count it so too. A drain
    # counted it nowhere: not admitted, not aborted, and not an admission rejection.
    adding, release = threading.Event(), threading.Event()
    add_request = engine.add_request

    def slow_add(*args, **kwargs):
        adding.set()
        assert release.wait(timeout=60)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", slow_add)
    listener = RecordingListener()
    async_engine = AsyncLLMEngine(engine, listener=listener)

    async def scenario():
        await async_engine.start()
        submitted = asyncio.ensure_future(async_engine.submit(
            f"raced-{how}", prompt_ids(engine, "Hello"), "Hello", SamplingParams(max_tokens=4)))
        assert await asyncio.to_thread(adding.wait, 60)
        ending = asyncio.ensure_future(async_engine.drain(0.0)) if how == "drain" else None
        if ending is None:
            async_engine.abort(f"raced-{how}")
        await asyncio.sleep(0.1)  # the drain's abort is sent while the add still runs
        release.set()
        with pytest.raises(error):
            await submitted
        if ending is not None:
            await ending
        await async_engine.shutdown()

    asyncio.run(scenario())
    assert sorted(e for e in listener.events if e != "on_prediction") == ["on_aborted", "on_admitted"]
    assert not engine.has_unfinished_requests()
    free, total = free_and_total(engine)
    assert free == total


def test_a_submission_cancelled_while_the_engine_adds_it_keeps_its_outputs_from_a_reused_id(
        tiny_model_dir, monkeypatch):
    # The client leaves while the engine thread is adding its request: the Abort queued on the way
    # out is in flight, and the step that runs the old request must not end a new stream under the id.
    engine = tiny_engine(tiny_model_dir)
    in_add, release = threading.Event(), threading.Event()
    real_add = engine.add_request

    def gated_add(request_id, *args, **kwargs):
        if not in_add.is_set():
            in_add.set()
            release.wait(30)
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", gated_add)
    async_engine = AsyncLLMEngine(engine)
    old_prompt, new_prompt = prompt_ids(engine, "Hello there"), prompt_ids(engine, "Something else entirely")

    async def scenario():
        await async_engine.start()
        old = asyncio.ensure_future(async_engine.submit(
            "x", old_prompt, "Hello there", SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
        assert await asyncio.to_thread(in_add.wait, 30)  # past the cancellation check: it will run
        old.cancel()
        with pytest.raises(asyncio.CancelledError):
            await old
        # release: the old request is added and runs a step; then its Abort, then the new one
        return await resubmit_and_drain(async_engine, new_prompt, release)

    assert_only_the_new_reply(asyncio.run(scenario()), async_engine, new_prompt)


def test_an_id_aborted_twice_before_the_first_abort_is_applied_stays_closed_until_both_are(
        tiny_model_dir, monkeypatch):
    # A's abort is applied and B added on the engine thread while the loop has not yet read the
    # word; B is aborted then. Until B's abort is applied too, the outputs under the id are B's.
    engine = tiny_engine(tiny_model_dir)
    permits, in_step = threading.Semaphore(0), threading.Event()
    in_add, release_add = threading.Event(), threading.Event()
    real_step, real_add = engine.step, engine.add_request
    adds = []

    def gated_step():
        in_step.set()
        permits.acquire(timeout=30)
        return real_step()

    def gated_add(request_id, *args, **kwargs):
        adds.append(request_id)
        if len(adds) == 2:  # B: A's Abort was applied just before
            in_add.set()
            release_add.wait(30)
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "step", gated_step)
    monkeypatch.setattr(engine, "add_request", gated_add)
    async_engine = AsyncLLMEngine(engine)
    texts = ["Hello there", "A second prompt", "Something else entirely"]
    prompts = [prompt_ids(engine, text) for text in texts]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def scenario():
        await async_engine.start()
        await async_engine.submit("x", prompts[0], texts[0], one)  # A, held in its step
        assert await asyncio.to_thread(in_step.wait, 30)
        async_engine.abort("x")
        await asyncio.sleep(0)  # A's stream is dropped
        second = asyncio.ensure_future(async_engine.submit("x", prompts[1], texts[1], one))  # B
        await asyncio.sleep(0.05)
        permits.release()  # A's step ends; A's Abort is applied and B is being added
        assert in_add.wait(30)  # on the loop thread: the word of A's Abort is not read yet
        async_engine.abort("x")  # B's
        assert async_engine._aborts_in_flight == {"x": 2}
        release_add.set()  # B runs a step (held), its Abort still queued
        with pytest.raises(RequestAborted):
            await asyncio.wait_for(second, 60)
        twelve = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        third = asyncio.ensure_future(async_engine.submit("x", prompts[2], texts[2], twelve))  # C
        await asyncio.sleep(0.05)  # C's stream holds the id
        permits.release(1000)  # B's step reports B; then B's Abort, C, and every later step
        outputs = await asyncio.wait_for(drain(await third), timeout=60)
        await async_engine.shutdown()
        return outputs

    outputs = asyncio.run(scenario())
    assert outputs[-1].finished and list(outputs[-1].prompt_token_ids) == prompts[2]
    assert len(outputs[-1].token_ids) == 12
    assert not async_engine._aborts_in_flight
