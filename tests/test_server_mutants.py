"""Behaviour of the HTTP layer that a hand-made mutation run of engine/server found untested.

Each test pins one answer a vLLM client relies on, against a real uvicorn server on loopback with
the tiny random Llama (or, for a pure function of the layer, that function itself): the server's
settings checks, neutral values of unsupported fields, the `created` time, negative priorities,
the tokenizer routes' special tokens, Retry-After's rounding and the metrics' small cases.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from engine.server import errors
from engine.server.app import ServerSettings
from test_server import (CHAT, MODEL, ThreadRecordingTokenizer, error_of, metric, openai_client, post,
                         scrape, serving, tiny_engine)
from test_server_protocol import stream_payloads


@pytest.fixture(scope="module")
def special_tokens_asked() -> list:
    return []


@pytest.fixture(scope="module")
def served(tiny_model_dir, special_tokens_asked):
    """(base_url, async engine) of a fcfs server whose tokenizer notes each encode's special-tokens flag."""
    engine = tiny_engine(tiny_model_dir)
    tokenizer = ThreadRecordingTokenizer(engine.tokenizer, set(), special_tokens_asked)
    with serving(engine, tokenizer=tokenizer) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[0])


# ---- settings ------------------------------------------------------------------------------------
def test_settings_refuse_an_empty_context_and_take_a_zero_grace():
    with pytest.raises(ValueError, match="max_model_len must be positive"):
        ServerSettings(model_name=MODEL, max_model_len=0)
    # `serve --shutdown-grace 0` (aborting in-flight requests at once) is a valid choice.
    assert ServerSettings(model_name=MODEL, max_model_len=8, shutdown_grace_s=0.0).shutdown_grace_s == 0.0


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("retry_after_s, header", [(1.0, "1"), (1.2, "2"), (2.5, "3"), (3600.0, "3600")])
def test_retry_after_rounds_up_to_whole_seconds(retry_after_s, header):
    # Rounded down, a client that obeys it would come back too early and be refused again.
    response = errors.rate_limited("queue full", retry_after_s).response()
    assert response.status_code == 429 and response.headers["Retry-After"] == header
    error = json.loads(response.body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")


# ---- requests ------------------------------------------------------------------------------------
def test_a_negative_priority_is_400_without_priority_scheduling(served):
    for path, body in (("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": CHAT})):
        error = error_of(post(served[0], path, {"model": MODEL, "max_tokens": 2, "priority": -1, **body}), 400)
        assert error["param"] == "priority", path


def test_created_is_the_time_of_the_request(client):
    before = int(time.time())
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    after = int(time.time())
    assert before <= reply.created <= after and before <= chat.created <= after


def test_neutral_values_of_the_fields_both_endpoints_refuse_otherwise_are_served(served):
    neutral = {"best_of": 1, "use_beam_search": False, "length_penalty": 1, "spaces_between_special_tokens": True,
               "tool_choice": "auto", "response_format": {"type": "text"}, "tools": []}
    for path, body in (("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": CHAT})):
        for field, value in neutral.items():
            response = post(served[0], path, {"model": MODEL, "max_tokens": 2, **body, field: value})
            assert response.status_code == 200, (path, field, response.text)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "modalities": ["text"]}
    assert post(served[0], "/v1/chat/completions", body).status_code == 200


# ---- tokenizer routes ------------------------------------------------------------------------
def test_both_tokenizer_routes_refuse_an_unknown_model(served):
    for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [1, 2]})):
        assert error_of(post(served[0], path, {"model": "gpt-9", **body}), 404)["param"] == "model", path


def test_tokenize_adds_special_tokens_to_a_prompt_and_not_to_a_templated_chat(served, special_tokens_asked):
    # As /v1 encodes them (a model whose tokenizer adds a BOS gets it once), unless the body says.
    for body, asked in (({"prompt": "Hello"}, True), ({"messages": CHAT}, False),
                        ({"prompt": "Hello", "add_special_tokens": False}, False),
                        ({"messages": CHAT, "add_special_tokens": True}, True)):
        special_tokens_asked.clear()
        response = post(served[0], "/tokenize", {"model": MODEL, **body})
        assert response.status_code == 200 and special_tokens_asked == [asked], body


# ---- metrics ---------------------------------------------------------------------------------
def test_a_server_that_refused_nothing_shows_zero_rejections_per_tier(served):
    # rate() and dashboards see 0, not missing data, before the first refusal.
    samples = scrape(served[0])
    rejections = {dict(labels)["tier"]: value for (name, labels), value in samples.items()
                  if name == "lengthwise:admission_rejections_total"}
    assert rejections == {"interactive": 0.0, "standard": 0.0, "batch": 0.0}


def test_prompt_tokens_count_every_prefilled_prompt_token(served, client):
    before = metric(scrape(served[0]), "lengthwise:prompt_tokens_total")
    client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=1)
    assert metric(scrape(served[0]), "lengthwise:prompt_tokens_total") - before == 5


def test_kendall_tau_of_two_pairs_is_defined():
    from engine.server.metrics import kendall_tau

    assert kendall_tau([(1, 10), (2, 20)]) == pytest.approx(1.0)
    assert kendall_tau([(1, 20), (2, 10)]) == pytest.approx(-1.0)


# ---- serve ---------------------------------------------------------------------------------------
def test_the_predictor_none_is_taken_in_any_case():
    from engine.server import serve_cli

    assert [serve_cli.predictor_folder(spec) for spec in ("none", "None", "NONE", None)] == [None] * 4


def test_a_folder_without_a_spec_is_refused_naming_the_flag(tmp_path):
    from engine.server import serve_cli

    expected = re.escape(f"--predictor {tmp_path}: not a saved predictor folder")
    with pytest.raises(FileNotFoundError, match="^" + expected):
        serve_cli.predictor_folder(str(tmp_path))


# ---- streams ---------------------------------------------------------------------------------
def test_a_chat_delta_carries_only_the_keys_it_sets(served):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "ignore_eos": True}
    events = stream_payloads(served[0], "/v1/chat/completions", body)
    deltas = [event["choices"][0]["delta"] for event in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(delta) == {"content"} for delta in deltas[1:]), deltas


def test_a_streamed_batch_echoes_each_choice_its_own_prompt(served):
    prompts = ["Alpha beta", "Gamma delta"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "echo": True, "max_tokens": 2, "ignore_eos": True}
    events = stream_payloads(served[0], "/v1/completions", body)
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    # Prompt i's choice j is index i * n + j.
    assert sorted(texts) == [0, 1, 2, 3]
    assert all(texts[index].startswith(prompts[index // 2]) for index in texts), texts


def test_a_streamed_completion_with_choices_counts_its_prompt_once(client):
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], n=2, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 4, 7)


def test_a_batch_with_choices_gives_each_choice_its_own_prompts_logprobs(served):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 1, "prompt_logprobs": 0}
    response = post(served[0], "/v1/completions", body)
    assert response.status_code == 200, response.text
    # One entry per prompt token, the first None (nothing precedes it); prompt i's choices are 2i, 2i + 1.
    lengths = [len(choice["prompt_logprobs"]) for choice in response.json()["choices"]]
    assert lengths == [3, 3, 5, 5]
