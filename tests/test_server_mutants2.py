"""More behaviour of the HTTP layer that a hand-made mutation run of engine/server found untested.

The second half of that run: how a stream ends (an abort's last text and usage, an engine
failure's one error event, a finish without new text, logprobs whose text waits), the metrics of
steps of several tokens or none, the stop signal and the serve CLI's flags reaching the app; and
the five that run had left alive (null logprobs on an abort, refusals at shutdown in the metrics,
the model path alias, sockets after a failed build, an engine failure during admission). The
event stream is fed real RequestStreams by hand (which output arrives when is then the test's,
not the machine's), the metrics hand-made outputs; the CLI's server runs on uvicorn on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
from dataclasses import replace

import pytest
from pydantic import BaseModel

from engine.async_engine import EngineDead, EngineShuttingDown
from engine.async_stream import RequestStream, StreamEnd
from engine.outputs import RequestOutput
from engine.server import serve_cli
from engine.server.metrics import ServerMetrics
from engine.server.responses import UsageInfo
from engine.server.streaming import ChunkContent, stream_events
from scheduler.admission import AdmissionRejected
from scheduler.output import TokenLogprobs
from scheduler.request import Tier
from test_server import MODEL, error_of, post, running_server, serving, tiny_engine
from test_server_metrics import samples_of, step_output, total
from test_server_lifecycle import start_draining_server


# ---- the event stream, fed by hand ---------------------------------------------------------------
class Chunk(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: list[int] | None = None  # the token ids of the entries it carries
    usage: UsageInfo | None = None


def chunk_of(content: ChunkContent) -> Chunk:
    entries = None if content.logprobs is None else [entry.token_id for entry in content.logprobs]
    return Chunk(index=content.index, text=content.text, finish_reason=content.finish_reason, logprobs=entries)


def output(text: str, finished: bool = False, num_tokens: int | None = None, logprobs: bool = False) -> RequestOutput:
    """An output of one token per character, unless `num_tokens` says otherwise."""
    tokens = tuple(range(len(text) if num_tokens is None else num_tokens))
    entries = tuple(TokenLogprobs(token, -1.0, ()) for token in tokens) if logprobs else None
    return RequestOutput("r", (1, 2), tokens, tokens[-1:], text, text[-1:], finished,
                         "length" if finished else None, 0.0, 0.0, 0.0, None, logprobs=entries)


def payloads(events: list[str]) -> list[dict | str]:
    """Each SSE event's JSON, or "[DONE]"."""
    assert all(event.startswith("data: ") and event.endswith("\n\n") for event in events)
    bodies = [event.removeprefix("data: ").removesuffix("\n\n") for event in events]
    return [body if body == "[DONE]" else json.loads(body) for body in bodies]


def one_choice_events(first: RequestOutput, *then: RequestOutput | StreamEnd,
                      continuous_usage_of: list[int] | None = None) -> list[dict | str]:
    """The payloads of one choice's stream: `first` is put and its chunk read, then `then` is put
    at once (a reader that fell behind), and the rest is read. With `continuous_usage_of`, usage
    is asked for and every chunk carries it."""
    async def scenario():
        stream = RequestStream("r", Tier.STANDARD)
        events = stream_events([stream], chunk_of, (), continuous_usage_of is not None,
                               lambda usage: Chunk(index=0, text="", usage=usage),
                               continuous_usage_of=continuous_usage_of)
        stream.put(first)
        sent = [await anext(events)]
        for item in then:
            stream.put(item)
        return sent + [event async for event in events]

    return payloads(asyncio.run(scenario()))


def test_an_abort_sends_the_text_generated_since_the_last_read():
    """A request aborted at shutdown after its reader fell behind: the abort replaced an unread
    output, and its last chunk still carries that output's new text before [DONE]."""
    first, last, done = one_choice_events(output("ab"), output("abcde"), StreamEnd("abort"))  # "abcde" unread
    assert first == {"index": 0, "text": "ab", "finish_reason": None, "logprobs": None}
    assert last == {"index": 0, "text": "cde", "finish_reason": "abort", "logprobs": None}
    assert done == "[DONE]"


def test_with_continuous_usage_an_aborted_choice_last_chunk_carries_its_usage():
    """vLLM's continuous_usage_stats: every chunk has the usage so far, the abort's last one too."""
    first, last, done = one_choice_events(output("ab"), StreamEnd("abort"), continuous_usage_of=[2])
    usage = {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4, "prompt_tokens_details": None}
    assert first["usage"] == usage
    assert last["finish_reason"] == "abort" and last["usage"] == usage
    assert done == "[DONE]"  # and no usage chunk: the aborted choice has no final output to count


def test_an_engine_failure_ends_a_stream_of_choices_with_one_error_and_nothing_after():
    """One choice's stream reports the failure: the response ends there (an error event, then
    [DONE]); another choice's output that was waiting is not sent after the error."""
    async def scenario():
        streams = [RequestStream(f"r-{i}", Tier.STANDARD) for i in range(2)]
        streams[0].put(StreamEnd("error", "device lost"))
        streams[1].put(output("xyz", finished=True))
        return [event async for event in stream_events(streams, chunk_of, (), True,
                                                       lambda usage: Chunk(index=0, text="", usage=usage))]

    error, done = payloads(asyncio.run(scenario()))
    assert "device lost" in error["error"]["message"] and error["error"]["code"] == "engine_error"
    assert done == "[DONE]"


def test_a_choice_that_ends_without_new_text_still_sends_its_finish_reason():
    """The last token adds no text (an end-of-sequence token, skipped as special): the last chunk
    is empty but says why the choice ended, as OpenAI clients wait for it."""
    first, last, done = one_choice_events(output("ab"), output("ab", finished=True, num_tokens=3))
    assert first == {"index": 0, "text": "ab", "finish_reason": None, "logprobs": None}
    assert last == {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
    assert done == "[DONE]"


def test_a_tokens_logprobs_go_out_with_its_step_though_its_text_waits():
    """A token that adds no text yet (half a character, or the start of a possible stop string):
    its logprobs still go out at once, in a chunk of no text, as the docstring of stream_events
    promises; the next chunk carries the text and only the next token's entry."""
    async def scenario():
        stream = RequestStream("r", Tier.STANDARD)
        events = stream_events([stream], chunk_of, (), False, lambda usage: Chunk(index=0, text=""))
        stream.put(output("ab", logprobs=True))
        sent = [await anext(events)]
        stream.put(output("ab", num_tokens=3, logprobs=True))  # the third token's text waits
        sent.append(await asyncio.wait_for(anext(events), 60))  # a deadline, not a speed: it is due now
        stream.put(output("abcd", finished=True, num_tokens=4, logprobs=True))
        return sent + [event async for event in events]

    first, waiting, last, done = payloads(asyncio.run(scenario()))
    assert (first["text"], first["logprobs"]) == ("ab", [0, 1])
    assert (waiting["text"], waiting["logprobs"], waiting["finish_reason"]) == ("", [2], None)
    assert (last["text"], last["logprobs"], last["finish_reason"]) == ("cd", [3], "length")
    assert done == "[DONE]"


def test_a_token_whose_text_waits_still_sends_a_chunk_as_vllm_does():
    """Without logprobs too: a client timing tokens by chunks (a benchmark's inter-token latency)
    must see the step that made it; the text follows in a later chunk."""
    async def scenario():
        stream = RequestStream("r", Tier.STANDARD)
        events = stream_events([stream], chunk_of, (), False, lambda usage: Chunk(index=0, text=""))
        stream.put(output("ab"))
        sent = [await anext(events)]
        stream.put(output("ab", num_tokens=3))  # half a character, or a special token skipped
        sent.append(await asyncio.wait_for(anext(events), 60))  # a deadline, not a speed: it is due now
        stream.put(output("abcd", finished=True, num_tokens=4))
        return sent + [event async for event in events]

    first, waiting, last, done = payloads(asyncio.run(scenario()))
    assert [c["text"] for c in (first, waiting, last)] == ["ab", "", "cd"]
    assert waiting["finish_reason"] is None and last["finish_reason"] == "length" and done == "[DONE]"


def test_with_continuous_usage_an_abort_that_replaced_an_unread_output_counts_its_tokens():
    """The abort's last chunk sends the unread output's text ("cde"), so its usage counts that
    output's tokens too: five, not the two of the last output read."""
    first, last, done = one_choice_events(output("ab"), output("abcde"), StreamEnd("abort"),  # "abcde" unread
                                          continuous_usage_of=[2])
    assert first["usage"]["completion_tokens"] == 2
    assert (last["text"], last["finish_reason"]) == ("cde", "abort")
    assert (last["usage"]["completion_tokens"], last["usage"]["total_tokens"]) == (5, 7)


def test_an_abort_that_releases_waiting_text_but_no_new_token_sends_null_logprobs():
    """With logprobs asked: the second token's text waited, and its entry went out already; the
    abort's last chunk carries that text with no new entry, so it says null, as every chunk
    without a new token does, not an empty list."""
    held = output("a", num_tokens=2, logprobs=True)  # the second token's text waits
    end = StreamEnd("abort", text="ab", logprobs=held.logprobs, token_ids=held.token_ids)  # it replaced an unread copy
    first, last, done = one_choice_events(held, end)
    assert (first["text"], first["logprobs"]) == ("a", [0, 1])
    assert last == {"index": 0, "text": "b", "finish_reason": "abort", "logprobs": None}
    assert done == "[DONE]"


# ---- metrics, fed by hand-made engine outputs ----------------------------------------------------
def test_a_step_of_several_tokens_shares_its_gap_among_them():
    """A step that produced three tokens 1.5 s after the last one: three inter-token observations
    of 0.5 s (vLLM's per-token histogram), not three of 1.5 s."""
    metrics = ServerMetrics("tiny", lambda: None)
    metrics.on_output(step_output("a", 1, 1.0), Tier.STANDARD)
    several = replace(step_output("a", 4, 2.5), new_token_ids=(7, 7, 7))
    metrics.on_output(several, Tier.STANDARD)
    samples = samples_of(metrics)
    assert total(samples, "lengthwise:time_per_output_token_seconds_count") == 3
    assert total(samples, "lengthwise:time_per_output_token_seconds_sum") == pytest.approx(1.5)
    assert total(samples, "lengthwise:generation_tokens_total") == 4


def test_an_output_without_new_tokens_is_not_the_first_token():
    """An output of no token (a prefill chunk) observes nothing: the first token, a step later,
    is the one that counts for TTFT, and no inter-token gap is made up before it."""
    metrics = ServerMetrics("tiny", lambda: None)
    metrics.on_output(replace(step_output("a", 0, 0.8), new_token_ids=(), first_token_time=None), Tier.STANDARD)
    metrics.on_output(step_output("a", 1, 1.0), Tier.STANDARD)
    samples = samples_of(metrics)
    assert total(samples, "lengthwise:time_to_first_token_seconds_count") == 1
    assert total(samples, "lengthwise:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert total(samples, "lengthwise:request_queue_time_seconds_count") == 1
    assert total(samples, "lengthwise:time_per_output_token_seconds_count") == 0


def test_finished_requests_are_counted_by_their_own_reason_and_an_abort_observes_no_latency():
    metrics = ServerMetrics("tiny", lambda: None)
    length = step_output("a", 3, 2.0, finished=True)
    metrics.on_finished(length, Tier.STANDARD, None)
    metrics.on_finished(replace(length, request_id="b", finish_reason="stop"), Tier.STANDARD, None)
    metrics.on_finished(replace(length, request_id="c", finish_reason="abort"), Tier.STANDARD, None)
    samples = samples_of(metrics)
    assert {reason: total(samples, "lengthwise:request_success_total", finished_reason=reason)
            for reason in ("length", "stop", "abort")} == {"length": 1, "stop": 1, "abort": 1}
    # The aborted one ran to no end of its own: its latency is not a request's latency.
    assert total(samples, "lengthwise:e2e_request_latency_seconds_count") == 2
    assert total(samples, "lengthwise:request_time_per_output_token_seconds_count") == 2


def test_the_preemption_counter_and_the_swapped_gauge_read_the_schedulers_counts():
    # The state test reads counts of 0, which a series left out, or read from the other, also gives.
    from engine.llm_engine import EngineStats
    from scheduler.config import SchedulerConfig
    from scheduler.scheduler import Scheduler

    snapshot = replace(Scheduler(SchedulerConfig(num_gpu_blocks=8)).stats(0.0), num_preemptions=3, num_swapped=2)
    samples = samples_of(ServerMetrics("tiny", lambda: EngineStats(snapshot, 0, 0.0, 0.0, 0)))
    assert total(samples, "lengthwise:num_preemptions_total") == 3
    assert total(samples, "lengthwise:num_requests_swapped") == 2


def test_a_refusal_at_shutdown_or_failure_is_no_admission_rejection():
    """lengthwise:admission_rejections_total counts admission control's refusals (the 429s), not a
    request the engine turned away because it was draining or had failed: those say nothing of
    load, and an alert on rejections would fire at every restart."""
    metrics = ServerMetrics(MODEL, lambda: None)
    metrics.on_rejected(Tier.BATCH, EngineShuttingDown())
    metrics.on_rejected(Tier.BATCH, EngineDead("device lost"))
    metrics.on_rejected(Tier.BATCH, ValueError("bad input"))
    assert total(samples_of(metrics), "lengthwise:admission_rejections_total") == 0
    metrics.on_rejected(Tier.BATCH, AdmissionRejected("queue full", 1.0))
    assert total(samples_of(metrics), "lengthwise:admission_rejections_total", tier="batch") == 1


def test_the_predictor_tau_is_of_the_prediction_against_the_actual_length():
    # Three finished requests whose predictions order them backwards: tau -1, not the 1 of the
    # predictions against themselves.
    from predictor.base import Prediction

    metrics = ServerMetrics("tiny", lambda: None)
    for name, predicted, tokens in (("a", 10.0, 30), ("b", 20.0, 20), ("c", 30.0, 10)):
        guess = Prediction(point=predicted, p50=predicted, p90=2 * predicted, score=predicted, rank_len=predicted)
        metrics.on_finished(step_output(name, tokens, 2.0, finished=True), Tier.STANDARD, guess)
    assert total(samples_of(metrics), "lengthwise:predictor_kendall_tau") == pytest.approx(-1.0)


# ---- shutdown, through the serve CLI's server ----------------------------------------------------
def test_a_stop_signal_stops_admission_at_once(tiny_model_dir):
    """The serve CLI's server refuses new requests from the signal on, not from whenever uvicorn's
    loop next notices it: a request arriving in between would start after the drain began."""
    async_engine, server, thread, sock = start_draining_server(tiny_engine(tiny_model_dir), grace_s=0)
    try:
        async_engine.check_accepting()
        server.handle_exit(signal.SIGINT, None)
        with pytest.raises(EngineShuttingDown):
            async_engine.check_accepting()
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
    assert not thread.is_alive()


def test_serve_hands_its_api_key_body_limit_and_served_name_to_the_app(tiny_model_dir):
    """The serve CLI's flags reach the server it builds: without the key a call is refused (401),
    a body over --max-body-bytes is a 413, and replies name the model --served-model-name gives,
    asked by that name or by the --model path."""
    import httpx

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--attention-backend", "torch", "--max-model-len",
                              "256", "--api-key", "k", "--max-body-bytes", "5000", "--served-model-name", "named"])
    server, name = serve_cli.build_server(args, serve_cli.build_engine_config(args), None)
    body = {"model": "named", "prompt": "Hello", "max_tokens": 2}
    with running_server(server.config.app) as (base_url, _):
        refused = post(base_url, "/v1/completions", body, key=None)
        too_large = post(base_url, "/v1/completions", {**body, "prompt": "x" * 6000}, key="k")
        reply = post(base_url, "/v1/completions", body, key="k")
        by_path = post(base_url, "/v1/completions", {**body, "model": str(tiny_model_dir)}, key="k")
        card = httpx.get(base_url + "/v1/models", headers={"Authorization": "Bearer k"}, timeout=60).json()["data"][0]
    assert name == "named" and (card["id"], card["root"]) == ("named", str(tiny_model_dir))  # vLLM's root
    assert error_of(refused, 401)["code"] == "invalid_api_key"
    assert error_of(too_large, 413)["code"] == "request_too_large"
    assert reply.status_code == 200 and reply.json()["model"] == "named"
    # The --model path as given stays a name the server answers to (and echoes, as vLLM does).
    assert by_path.status_code == 200 and by_path.json()["model"] == str(tiny_model_dir)


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN])
def test_serve_exits_130_after_ctrl_c(tiny_model_dir, inherited):
    """As a shell expects of a program stopped by SIGINT (128 + 2), once the drain is done: a
    script or supervisor that reads 0 would take the stop for a clean finish. Also when started
    with SIGINT ignored, as a non-interactive shell starts a background job (`make serve &`): it
    read 0 then, since uvicorn's re-raised SIGINT was ignored on the way out."""
    import subprocess
    import sys

    import httpx

    from engine.config import REPO_ROOT

    command = [sys.executable, "-m", "training.cli", "serve", "--model", str(tiny_model_dir), "--predictor", "none",
               "--attention-backend", "torch", "--max-model-len", "256", "--port", "0"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    try:
        for line in process.stderr:  # the log line that names the port it bound
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if found:
                break
        assert found, "serve ended before it listened"
        assert httpx.get(f"http://127.0.0.1:{found.group(1)}/health", timeout=60).status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 130
    finally:
        process.kill()
        process.stderr.close()


def test_serve_closes_its_listening_sockets_when_the_server_cannot_be_built(tiny_model_dir, monkeypatch):
    """The port is bound before the model loads (a taken port fails at once); a build that fails
    after that must let it go, or a supervisor's restart, or a test's next server, finds it taken."""
    opened = []

    def recording_listen(host, port):
        opened.extend(real_listen(host, port))
        return list(opened)

    def failing_build(*args):
        raise ValueError("the KV cache cannot hold one request")

    real_listen = serve_cli.listen_sockets
    monkeypatch.setattr(serve_cli, "listen_sockets", recording_listen)
    monkeypatch.setattr(serve_cli, "build_server", failing_build)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--predictor", "none", "--port", "0"])
    with pytest.raises(ValueError, match="cannot hold"):
        serve_cli.run(args)
    assert opened and all(sock.fileno() == -1 for sock in opened)


def test_an_engine_that_fails_while_adding_a_request_answers_it_500_not_503(tiny_model_dir, monkeypatch):
    """The engine was accepting when the request came and failed while adding it: the client gets
    the failure (500, engine_error), not "shutting down, retry" (503), which a client would retry
    against a dead engine; later requests get the same 500."""
    engine = tiny_engine(tiny_model_dir)

    def dying_add(*args, **kwargs):
        raise SystemExit("adder gone")  # no Exception: the engine thread fails its loop on it

    monkeypatch.setattr(engine, "add_request", dying_add)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    with serving(engine) as (base_url, _):
        during = post(base_url, "/v1/completions", body)
        after = post(base_url, "/v1/completions", body)
    assert error_of(during, 500)["code"] == "engine_error" and "adder gone" in during.json()["error"]["message"]
    assert error_of(after, 500)["code"] == "engine_error"
