"""How the HTTP server reads requests: validation, OpenAI/vLLM defaults and fields, error shapes.

A second tiny server, with a short context (so a request without max_tokens ends quickly) and the
priority policy, serves this module; its tokenizer notes every text it encodes.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.app import ServerSettings, create_app
from test_server import API_KEY, CHAT, MODEL, error_of, post, running_server

SHORT_MODEL_LEN = 128
ALIAS = "tiny-by-its-path"  # another name of the same model, as serve accepts the model folder


class EncodeRecordingTokenizer:
    """The real tokenizer, noting the length of every text it encodes and the tools every chat
    template was given."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.encoded: list[int] = []
        self.template_tools: list = []

    def apply_chat_template(self, *args, **kwargs):
        self.template_tools.append(kwargs.get("tools"))
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text, *args, **kwargs):
        self.encoded.append(len(text))
        return self._tokenizer.encode(text, *args, **kwargs)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """(base_url, async engine, recording tokenizer) of a server with a short context."""
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), num_gpu_blocks=64, block_size=16, max_num_seqs=8,
        max_num_batched_tokens=256, max_model_len=SHORT_MODEL_LEN, attention_backend="torch",
        policy="priority"))
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(model_name=MODEL, max_model_len=SHORT_MODEL_LEN, api_key=API_KEY,
                              model_aliases=(ALIAS,), model_root=ALIAS)
    tokenizer = EncodeRecordingTokenizer(engine.tokenizer)
    with running_server(create_app(async_engine, tokenizer, settings)) as (base_url, _):
        yield base_url, async_engine, tokenizer


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


# ---- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("temperature", -1.0), ("top_p", 1.5), ("n", 0), ("n", 17), ("stop", [""]), ("stop", ["x"] * 65),
    ("service_tier", "gold"), ("priority", "high"), ("messages", []), ("top_k", -2),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("priority", 10**400),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("min_p", 1.5),
    ("min_p", True), ("presence_penalty", True), ("repetition_penalty", False),
    # JSON true is no number for any of them (top_k true had been a silent greedy top_k 1).
    ("max_tokens", True), ("max_completion_tokens", True), ("temperature", True), ("top_p", True),
    ("seed", True), ("priority", False), ("top_k", True), ("n", True),
    # Fields that would change the output in ways this server does not implement: refused, not ignored.
    ("min_tokens", -1), ("min_tokens", True), ("min_tokens", 3), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"1": True}), ("logit_bias", {"49152": 1}), ("logit_bias", [1]),
    ("allowed_token_ids", []), ("allowed_token_ids", [49152]),
    ("best_of", 2), ("top_logprobs", 2),
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"),
    # vLLM's and OpenAI's newer output-changing fields, refused rather than silently ignored.
    ("continue_final_message", True),  # with add_generation_prompt's default, true
    ("use_beam_search", True), ("guided_json", {"type": "object"}),
    ("guided_regex", "a+"), ("guided_choice", ["a", "b"]), ("guided_grammar", "root ::= 'a'"),
    ("structured_outputs", {"regex": "a+"}), ("functions", [{"name": "f"}]),
    ("function_call", {"name": "f"}), ("prediction", {"type": "content", "content": "x"}),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("length_penalty", 0.5),
    ("spaces_between_special_tokens", False), ("chat_template", "{{ messages }}"),
    # Each bound at its other end, and the open ends of the intervals.
    ("top_p", 0.0), ("presence_penalty", -2.5), ("frequency_penalty", 2.5), ("priority", 2**63),
    ("priority", -(2**63) - 1), ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("bad_words", ["x"] * 129),
    ("min_p", -0.1),
    # Digits beyond ASCII: int() reads "\u0661" as 1 and fails on "\u00b2"; neither is a token id.
    ("logit_bias", {"\u0661": 1}), ("logit_bias", {"\u00b2": 1}),
])
def test_invalid_field_is_a_400_naming_it(served, field, value):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, field: value}
    error = error_of(post(served[0], "/v1/chat/completions", body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: ") and "Value error," not in error["message"]


def test_completions_max_tokens_takes_no_bool(served):
    # Its own field (default 16, 0 allowed) must keep the base's refusal of true.
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": True}
    error = error_of(post(served[0], "/v1/completions", body), 400)
    assert error["param"] == "max_tokens" and "takes a number, not true" in error["message"]


def test_completions_max_tokens_is_not_negative(served):
    # Its own field's bound: 0 scores the prompt alone, below that is no limit at all.
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": -1}
    error = error_of(post(served[0], "/v1/completions", body), 400)
    assert error["param"] == "max_tokens" and error["message"].startswith("max_tokens: ")


def test_completions_logprobs_is_a_count_and_false_is_off(served):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    error = error_of(post(served[0], "/v1/completions", {**body, "logprobs": True}), 400)
    assert error["param"] == "logprobs" and "count of alternatives" in error["message"]
    off = post(served[0], "/v1/completions", {**body, "logprobs": False})
    assert off.status_code == 200 and off.json()["choices"][0]["logprobs"] is None


def test_min_tokens_may_equal_the_output_limit(served):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "min_tokens": 2}
    reply = post(served[0], "/v1/chat/completions", body)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_a_nan_number_is_refused_as_not_finite(served):
    body = '{"model": "%s", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}' % MODEL
    response = httpx.post(served[0] + "/v1/completions", content=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    error = error_of(response, 400)
    assert error["param"] == "temperature" and "finite number" in error["message"]


def test_a_lone_surrogate_is_a_400_naming_its_field_and_the_connection_keeps_serving(served):
    # Valid JSON ("\ud800" escaped), but not Unicode text: it was a 500 from the tokenizer, or a
    # crash in the error handler when the model name echoed it, and the connection was dropped.
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    lone = "\\ud800"
    cases = [("/v1/completions", '{"model": "%s", "prompt": "hi %s", "max_tokens": 2}' % (MODEL, lone), "prompt"),
             ("/v1/completions", '{"model": "%s", "prompt": "hi %s", "stream": true}' % (MODEL, lone), "prompt"),
             ("/v1/completions", '{"model": "%s", "prompt": "hi"}' % lone, "model"),
             ("/v1/completions", '{"model": "%s", "prompt": "hi", "stop": ["a", "%s"]}' % (MODEL, lone), "stop.1"),
             ("/v1/chat/completions",
              '{"model": "%s", "messages": [{"role": "user", "content": "a%s"}]}' % (MODEL, lone),
              "messages.0.content"),
             ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a"}], '
              '"chat_template_kwargs": {"%s": 1}}' % (MODEL, lone), "chat_template_kwargs"),
             ("/detokenize", '{"model": "%s", "tokens": [1]}' % lone, "model"),  # was a 500
             ("/tokenize", '{"model": "%s", "prompt": "hi"}' % lone, "model")]
    with httpx.Client(base_url=served[0], headers=headers, timeout=60) as http:  # one kept-alive connection
        for path, body, field in cases:
            error = error_of(http.post(path, content=body), 400)
            assert error["param"] == field and "lone UTF-16 surrogate" in error["message"], body
            assert error["message"].startswith(f"{field}: "), error["message"]  # the nested path, not its field
        assert "in a key" in error_of(http.post(cases[5][0], content=cases[5][1]), 400)["message"]
        pair = '{"model": "%s", "prompt": "hi \\ud83d\\ude00", "max_tokens": 2}' % MODEL  # a valid pair
        answer = http.post("/v1/completions", content=pair)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "stop_token_ids", [-1]), ("/v1/chat/completions", "stop_token_ids", [True]),
    ("/v1/chat/completions", "allowed_token_ids", [-1]), ("/v1/completions", "allowed_token_ids", [True]),
    ("/v1/completions", "logit_bias", {"1": "big"}),
    ("/v1/completions", "prompt", [True, 5]),
    # A prompt's ids are no field bound: the vocabulary's check refuses one below it too.
    ("/v1/completions", "prompt", [5, -1]), ("/v1/completions", "prompt", [5, 49152])])
def test_token_ids_are_strict_integers(served, path, field, value):
    # Before, a negative stop id got a 400 naming no field, and JSON true was taken as token id 1.
    body = {"model": MODEL, "max_tokens": 2, **({"messages": CHAT} if "chat" in path else {"prompt": "Hi"}), field: value}
    error = error_of(post(served[0], path, body), 400)
    assert error["param"].split(".")[0] == field


def test_tools_are_served_with_tool_choice_none_as_vllm_serves_them(served, client):
    # The tools reach the chat template (SmolLM2's ignores them) and no call is parsed, so the reply
    # is the one without tools; "auto", or tool_choice unset, would need a tool-call parser.
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    with_tools = client.chat.completions.create(tools=tools, tool_choice="none", **kwargs)
    assert served[2].template_tools[-1] == tools
    without = client.chat.completions.create(**kwargs)
    assert served[2].template_tools[-1] is None
    assert with_tools.choices[0].message.content == without.choices[0].message.content
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens
    for choice in ({}, {"tool_choice": "auto"}):
        refused = post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": tools, **choice})
        assert 'only with tool_choice "none"' in error_of(refused, 400)["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(served, client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, presence_penalty=0,
                                           frequency_penalty=0.0, logit_bias={}, logprobs=False,
                                           response_format={"type": "text"}, tool_choice="none")
    assert reply.usage.completion_tokens >= 1
    # A typed client's dump of the text format, its unset members null, asks for text all the same.
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                           response_format={"type": "text", "json_schema": None})
    assert reply.usage.completion_tokens >= 1
    neutral = {"include_stop_str_in_output": False, "add_generation_prompt": True, "continue_final_message": False,
               "skip_special_tokens": True, "echo": False, "use_beam_search": False, "guided_json": None,
               "guided_regex": None, "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
               "functions": [], "function_call": "none", "prediction": None,
               "audio": None, "modalities": ["text"], "bad_words": [], "truncate_prompt_tokens": None,
               "prompt_logprobs": None, "length_penalty": 1.0, "spaces_between_special_tokens": True,
               "chat_template": None, "chat_template_kwargs": {}}
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    for value_of in (lambda field, value: value, lambda field, value: None):
        sent = {field: value_of(field, value) for field, value in neutral.items()}
        assert post(served[0], "/v1/chat/completions", {**body, **sent}).status_code == 200, sent
    for echo in (False, None):
        assert post(served[0], "/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": echo}).status_code == 200
    one = client.completions.create(model=MODEL, prompt=["Hello"], max_tokens=2, temperature=0, suffix="")
    assert one.choices[0].text == client.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                                            temperature=0).choices[0].text
    for top_logprobs in (0, None):  # chat's field at its neutral value
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "top_logprobs": top_logprobs}
        assert post(served[0], "/v1/completions", body).status_code == 200
    # An empty stream_options asks for nothing: vLLM takes it without a stream, as typed clients send it.
    assert post(served[0], "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                               "stream_options": {}}).status_code == 200
    for field, value in (("logprobs", 21), ("suffix", " end"), ("top_logprobs", 2),
                         ("stream_options", {"include_usage": True})):
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, field: value}
        assert error_of(post(served[0], "/v1/completions", body), 400)["param"] == field


def test_stream_options_ask_for_usage_unless_include_usage_is_false_or_null(served):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stream": True, "ignore_eos": True}

    def usages(options) -> list[dict | None]:
        reply = post(served[0], "/v1/completions", {**body, "stream_options": options})
        assert reply.status_code == 200
        return [json.loads(line[6:]).get("usage") for line in reply.text.splitlines()
                if line.startswith("data: {")]

    for unasked in ({"include_usage": None}, {"include_usage": False, "continuous_usage_stats": True}):
        assert not any(usages(unasked))
    # As vLLM gives it: an empty object asks for the last chunk's usage, and continuous usage
    # alone for every chunk's.
    final_only = usages({})
    assert not any(final_only[:-1]) and final_only[-1]["completion_tokens"] == 2
    assert all(usages({"continuous_usage_stats": True}))
    refused = post(served[0], "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": "x"}})
    assert error_of(refused, 400)["param"].startswith("stream_options")


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_counts_each_chunks_tokens_so_far(client, chat):
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL, max_tokens=5, temperature=0, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True})
    events = list(client.chat.completions.create(messages=CHAT, **kwargs) if chat
                  else client.completions.create(prompt="Once upon", **kwargs))
    counted = [event.usage.completion_tokens for event in events if event.choices]
    assert counted == sorted(counted) and counted[-1] == 5 and (counted[0] == 0) == chat  # chat opens with its role
    prompt_tokens = {event.usage.prompt_tokens for event in events}
    assert len(prompt_tokens) == 1 and not events[-1].choices and events[-1].usage.completion_tokens == 5


def test_a_temperature_above_openais_2_is_served_as_vllm_serves_it(served):
    hot = post(served[0], "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 5.0,
                                              "seed": 3, "ignore_eos": True})
    assert hot.status_code == 200 and hot.json()["usage"]["completion_tokens"] == 3


def test_null_means_unset_and_developer_is_system(served, client):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": None, "top_p": None, "n": None,
            "stream": None, "top_k": None, "priority": None, "ignore_eos": True}
    nulls = post(served[0], "/v1/completions", body)
    assert nulls.status_code == 200, nulls.text
    unset = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, seed=1,
                                      extra_body={"ignore_eos": True})
    assert post(served[0], "/v1/completions", {**body, "seed": 1}).json()["choices"][0]["text"] == unset.choices[0].text
    as_developer, as_system = (
        client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                       messages=[{"role": role, "content": "Be brief."}, *CHAT])
        for role in ("developer", "system"))
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content


def test_missing_field_and_bad_json_are_400(served):
    assert error_of(post(served[0], "/v1/completions", {"model": MODEL}), 400)["param"] == "prompt"
    assert error_of(post(served[0], "/v1/completions", "{not json"), 400)["param"] is None


def test_an_engine_side_parameter_error_names_its_field(served):
    # Only the engine knows the stop tokens, so it finds this one, after the body's own checks.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "allowed_token_ids": [2], "min_tokens": 2}
    error = error_of(post(served[0], "/v1/completions", body), 400)
    assert error["param"] == "allowed_token_ids" and "min_tokens rules out" in error["message"]


def test_a_body_not_in_utf8_is_answered_as_bad_json(served):
    response = httpx.post(served[0] + "/v1/completions", content=b'{"prompt": "\xff\xfe", "max_tokens": 1}',
                          headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    error = error_of(response, 400)
    assert error["code"] == "invalid_value" and "JSON in UTF-8" in error["message"]


def test_an_empty_body_a_body_nested_too_deep_and_an_empty_prompt_are_named_as_such(served):
    # pydantic's and FastAPI's words named none of these: "Field required" with no field, "the
    # body must be JSON in UTF-8" for valid JSON, and a list's "at least 1 item" for a text.
    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    empty = error_of(httpx.post(served[0] + "/v1/completions", content=b"", headers=headers), 400)
    assert empty["message"] == "the request body is empty: send a JSON object"
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = error_of(httpx.post(served[0] + "/v1/completions", content=deep, headers=headers, timeout=60), 400)
    assert nested["message"].endswith("the body nests too deeply")
    for prompt in ("", [], [""], [[]]):
        error = error_of(post(served[0], "/v1/completions", {"model": MODEL, "prompt": prompt}), 400)
        assert (error["param"], error["message"]) == ("prompt", "prompt: the prompt is empty")


def test_openai_client_raises_bad_request_with_the_param(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=-3)
    assert raised.value.status_code == 400 and raised.value.param == "max_tokens"

def test_chat_content_parts_are_joined_and_bad_parts_are_400(served, client):
    # Joined with a newline, as vLLM joins them.
    parts = [{"type": "text", "text": "Name three colours."}, {"type": "text", "text": "Be brief."}]
    as_parts = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                              max_tokens=3, temperature=0)
    joined = [{"role": "user", "content": "Name three colours.\nBe brief."}]
    as_text = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=3, temperature=0)
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    bad = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert error_of(post(served[0], "/v1/chat/completions", bad), 400)["param"].startswith("messages")
    # An image the text-only model would never see is refused, not dropped.
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": image}]}
    error = error_of(post(served[0], "/v1/chat/completions", body), 400)
    assert error["param"] == "messages.0.content" and "image_url" in error["message"]


# ---- defaults --------------------------------------------------------------------------------
def test_completions_default_to_16_tokens_and_chat_to_the_rest_of_the_context(served, client):
    # As OpenAI's legacy completions and vLLM's CompletionRequest; an explicit null is the default too.
    body = {"model": MODEL, "prompt": "Hello", "temperature": 0, "ignore_eos": True}
    for extra in ({}, {"max_tokens": None}):
        response = post(served[0], "/v1/completions", {**body, **extra})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 16
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == SHORT_MODEL_LEN - chat.usage.prompt_tokens > 16


def test_an_assistant_message_may_have_null_content_but_others_may_not(served):
    # OpenAI leaves an assistant turn's content null (or out) when it carries tool calls.
    def conversation(assistant: dict) -> list[dict]:
        return [{"role": "user", "content": "Hi"}, {"role": "assistant", **assistant}, *CHAT]

    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    replies = [post(served[0], "/v1/chat/completions", {**body, "messages": conversation(assistant)})
               for assistant in ({"content": ""}, {"content": None}, {})]
    assert [reply.status_code for reply in replies] == [200] * 3, replies[-1].text
    assert len({reply.json()["usage"]["prompt_tokens"] for reply in replies}) == 1
    for role in ("user", "system"):
        error = error_of(post(served[0], "/v1/chat/completions",
                              {**body, "messages": [{"role": role, "content": None}, *CHAT]}), 400)
        assert error["param"] == "messages.0.content" and "assistant" in error["message"]
    # The tool calls themselves would be dropped, leaving a tool result with no call before it.
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    error = error_of(post(served[0], "/v1/chat/completions", {**body, "messages": conversation(
        {"content": None, "tool_calls": [call]})}), 400)
    assert error["param"] == "messages.1.tool_calls" and "tool calls are not supported" in error["message"]
    assert post(served[0], "/v1/chat/completions",
                {**body, "messages": conversation({"content": None, "tool_calls": []})}).status_code == 200


def test_a_one_prompt_batch_of_token_ids_is_that_prompt_and_params_carry_no_union_tags(served, client):
    # lm-eval sends token prompts as [[ids]].
    ids = [9906, 1010, 260]
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    nested = client.completions.create(prompt=[ids], **kwargs)
    assert nested.choices[0].text == client.completions.create(prompt=ids, **kwargs).choices[0].text
    assert nested.usage.prompt_tokens == len(ids)
    # pydantic names the union member it tried ("str", "list[int]"); a client has no such field.
    bad = {"model": MODEL, "messages": [{"role": "user", "content": 5}]}
    param = error_of(post(served[0], "/v1/chat/completions", bad), 400)["param"]
    assert param == "messages.0.content"
    assert error_of(post(served[0], "/v1/completions", {"model": MODEL, "prompt": [1, "a"]}), 400)["param"] == "prompt"


# ---- response fields -----------------------------------------------------------------------
def test_every_chunk_of_a_stream_carries_the_one_created_time(client, monkeypatch):
    import itertools
    import time

    ticks, real_time = itertools.count(), time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + next(ticks))  # each reading a second later
    kwargs = dict(model=MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True},
                  extra_body={"ignore_eos": True})
    streams = (client.chat.completions.create(messages=CHAT, **kwargs),
               client.completions.create(prompt="Hello", **kwargs))
    for stream in streams:
        chunks = list(stream)
        # The stream may merge tokens when the reader lags (it keeps the newest output), so only
        # two chunks are sure: the text and the usage.
        assert len(chunks) >= 2 and len({chunk.created for chunk in chunks}) == 1


def stream_payloads(base_url: str, path: str, body: dict) -> list[dict]:
    """Every JSON event of a streamed response, before [DONE]."""

    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert lines.pop() == "[DONE]"
    return [json.loads(line) for line in lines]


def test_a_model_card_has_vllms_fields(client):
    # Tools that read a card's root (the model's path) found only id, created and owned_by.
    card = client.models.list().data[0].model_dump()
    assert (card["id"], card["root"], card["parent"], card["max_model_len"]) == (MODEL, ALIAS, None, SHORT_MODEL_LEN)
    permission = card["permission"][0]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert (permission["allow_sampling"], permission["allow_logprobs"], permission["organization"]) == (True, True, "*")


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": CHAT}),
                                        ("/v1/completions", {"prompt": "Hello"})])
def test_responses_name_the_model_asked_for_and_chunks_carry_the_service_tier(served, path, body):
    body = {**body, "max_tokens": 3, "ignore_eos": True}
    for asked, named in ((ALIAS, ALIAS), (MODEL, MODEL), (None, MODEL)):
        sent = {**body, "model": asked} if asked else body
        reply = post(served[0], path, sent)
        assert reply.status_code == 200 and reply.json()["model"] == named, reply.text
        assert {chunk["model"] for chunk in stream_payloads(served[0], path, sent)} == {named}
    for tier, named in (("flex", "flex"), ("priority", "priority"), ("auto", "default"), ("scale", "default"),
                        (None, "default")):
        sent = {**body, "service_tier": tier, "stream_options": {"include_usage": True}}
        assert post(served[0], path, {**sent, "stream_options": None}).json()["service_tier"] == named
        chunks = stream_payloads(served[0], path, sent)  # the usage chunk among them
        assert chunks and [chunk.get("service_tier") for chunk in chunks] == [named] * len(chunks)
    # OpenAI's keys, in its order, on the whole response and on every chunk (vLLM sends a null
    # system_fingerprint too; a client may read it without a default).
    objects = [post(served[0], path, body).json(), *stream_payloads(served[0], path, body)]
    for payload in objects:
        assert list(payload)[:5] == ["id", "object", "created", "model", "choices"]
        assert "system_fingerprint" in payload and payload["system_fingerprint"] is None


# ---- scheduling inputs -----------------------------------------------------------------------
def test_integer_priority_reaches_the_engine_under_priority_scheduling(served, client, monkeypatch):
    engine = served[1].engine
    seen = []
    add_request = engine.add_request

    def recording(*args, **kwargs):  # the real engine call, with its priority noted on the way
        seen.append(kwargs.get("priority"))
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"priority": -5})
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert seen == [-5, 0]


# ---- sizes -----------------------------------------------------------------------------------
def test_a_text_too_long_for_any_tokenization_is_refused_unencoded(served):
    from engine.server.limits import longest_token_lengths

    base_url, _, tokenizer = served
    bound = SHORT_MODEL_LEN * longest_token_lengths(tokenizer)[0]
    huge = "a" * (bound + 1)
    tokenizer.encoded.clear()
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages")):
        error = error_of(post(base_url, path, {"model": MODEL, **body}), 400)
        assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert all(length <= bound for length in tokenizer.encoded), "a text past the bound was tokenized"
    # Token ids past the context are refused before they are decoded.
    error = error_of(post(base_url, "/v1/completions", {"model": MODEL, "prompt": [1] * SHORT_MODEL_LEN}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")


def test_no_text_holds_more_characters_per_token_than_the_bound_allows(served):
    # The bound refuses only texts that cannot fit: whatever the text, its tokens never average
    # more characters than the longest piece, nor more UTF-8 bytes than the longest piece's.
    import random

    from engine.server.limits import longest_token_lengths

    tokenizer = served[2]
    chars, bytes_ = longest_token_lengths(tokenizer)
    assert chars < bytes_  # SmolLM2's longest piece spells a newline and spaces in 2-byte characters
    rng = random.Random(0)
    alphabet = [" ", "\n", "\t", "a", "é", "中", "😀", "\u200b", "<|im_start|>", "\x00", "ﬁ"]
    texts = ["\n" + " " * n for n in (1, 79, 80, 81, 200)] + [" " * 5000, "😀" * 50, "中文" * 40]
    texts += ["".join(rng.choice(alphabet) * rng.randint(1, 90) for _ in range(40)) for _ in range(200)]
    for text in texts:
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert len(text) <= num_tokens * chars and len(text.encode()) <= num_tokens * bytes_, repr(text[:40])


def test_a_body_over_the_size_limit_is_413(served, client):

    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * (2 << 20) + b'"}'
    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    declared = httpx.post(served[0] + "/v1/completions", content=body, headers=headers, timeout=60)
    # Sent in chunks with no Content-Length, the body is cut off once it passes the limit.
    chunked = httpx.post(served[0] + "/v1/completions", headers=headers, timeout=60,
                         content=(body[i:i + 65536] for i in range(0, len(body), 65536)))
    assert "content-length" not in chunked.request.headers
    for response in (declared, chunked):
        error = error_of(response, 413)
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_without_allowed_origins_a_preflight_is_405_not_401_and_grants_no_origin(served):

    response = httpx.options(served[0] + "/v1/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert error_of(response, 405)["type"] == "invalid_request_error"  # not refused for the key it never sends
    assert "access-control-allow-origin" not in response.headers


def test_a_message_name_and_tool_call_id_reach_the_chat_template():
    from engine.server.chat_protocol import ChatMessage

    named = ChatMessage(role="user", content="hi", name="ann")
    assert named.for_template() == {"role": "user", "content": "hi", "name": "ann"}
    result = ChatMessage(role="tool", content="42", tool_call_id="call_1")
    assert result.for_template() == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert ChatMessage(role="developer", content="be brief").for_template() == {"role": "system", "content": "be brief"}


def test_a_text_of_exactly_the_bound_passes() -> None:
    from engine.server.limits import check_text_length

    from engine.server.errors import APIError

    check_text_length("a" * 10, "prompt", 5, 2)
    with pytest.raises(APIError) as refused:
        check_text_length("a" * 11, "prompt", 5, 2)
    info = refused.value.info
    assert (refused.value.status, info.param, info.code) == (400, "prompt", "context_length_exceeded")


def test_the_body_limit_has_a_floor_and_room_for_json_escapes() -> None:
    from engine.server.limits import default_body_limit

    assert default_body_limit(16, 10) == 1 << 20
    worst = json.dumps({"model": "m", "prompt": "\x00" * (4096 * 162)})  # 6 bytes per character
    assert len(worst) <= default_body_limit(4096, 162)


class AddedTokenTokenizer:
    """A vocabulary whose longest piece is an added token, past `vocab_size`."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.pieces)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces) - 1

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.pieces[i] for i in ids]


def test_added_tokens_count_for_the_longest_piece() -> None:
    from engine.server.limits import longest_token_lengths

    assert longest_token_lengths(AddedTokenTokenizer(["a", "bb", "<|a_very_long_added_token|>"])) == (27, 27)


def run_body_limit(max_bytes: int, body: bytes, declared: bool) -> tuple[int, int]:
    """(reads of the body, response status) of BodyLimitMiddleware over an app that answers 200."""
    import asyncio

    from engine.server.limits import BodyLimitMiddleware

    reads, sent = [], []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    headers = [(b"content-length", str(len(body)).encode())] if declared else []
    asyncio.run(BodyLimitMiddleware(app, max_bytes)({"type": "http", "headers": headers, "method": "POST",
                                                     "path": "/"}, receive, send))
    return len(reads), sent[0]["status"]


def test_a_body_of_exactly_the_limit_passes_and_a_declared_larger_one_is_not_read() -> None:
    assert run_body_limit(10, b"x" * 10, declared=True)[1] == 200
    assert run_body_limit(10, b"x" * 10, declared=False)[1] == 200
    assert run_body_limit(10, b"x" * 11, declared=True) == (0, 413)


def test_a_lone_surrogate_is_found_in_keys_and_nested_values_but_not_in_pairs_or_ids() -> None:
    from engine.server.text_check import lone_surrogate_at

    lone = "\ud800"
    assert lone_surrogate_at({"properties": {lone: {}}}, "tools.0") == "tools.0.properties (a key)"
    assert lone_surrogate_at([{"content": [{"type": "text", "text": "a" + lone}]}], "messages") == \
        "messages.0.content.0.text"
    assert lone_surrogate_at([[1, 2, 3], ["x", lone]], "prompt") == "prompt.1.1"
    assert lone_surrogate_at("\U0001F600 a pair in JSON", "prompt") is None  # JSON's pair decodes to this
    assert lone_surrogate_at(list(range(10)), "prompt") is None and lone_surrogate_at(7, "seed") is None
    assert lone_surrogate_at([1, lone], "prompt") == "prompt.1"  # not all ids: every item is read
    # Nested past Python's recursion limit, as a JSON body may be (about 960 deep passed the
    # parser): a recursive walk raised RecursionError, a 500.
    deep: list = ["x" + lone]
    for _ in range(5000):
        deep = [deep]
    assert lone_surrogate_at(deep, "prompt") == "prompt" + ".0" * 5001
    assert lone_surrogate_at([{"a": ["b", {"c": "ok"}]}, {"d": lone}], "tools") == "tools.1.d"
    # Several: the first in the body's order, a key before its own value and after the earlier ones'.
    assert lone_surrogate_at([lone, lone], "p") == "p.0"
    assert lone_surrogate_at({"a": {"x": lone}, lone: 1}, "body") == "body.a.x"
    assert lone_surrogate_at({"a": 1, lone: {"x": lone}}, "body") == "body (a key)"


def test_numbers_too_long_to_print_are_a_400_naming_their_field(served) -> None:
    # Python refuses to turn an int of over 4,300 digits into text: the message that named such a
    # max_tokens (in the context check), or a logit_bias key turned into a token id, was a 500.
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    huge = "9" * 4300
    cases = [("/v1/completions", '{"prompt": "hi", "max_tokens": %s}' % huge, "max_tokens"),
             ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
              '"max_completion_tokens": %s}' % huge, "max_completion_tokens"),
             ("/v1/completions", '{"prompt": "hi", "min_tokens": %s}' % huge, "min_tokens"),
             ("/v1/completions", '{"prompt": "hi", "allowed_token_ids": [%s]}' % huge, "allowed_token_ids.0"),
             ("/v1/completions", '{"prompt": "hi", "logit_bias": {"%s": 1}}' % ("1" * 4301), "logit_bias")]
    with httpx.Client(base_url=served[0], headers=headers, timeout=60) as http:
        for path, body, field in cases:
            assert error_of(http.post(path, content=body), 400)["param"] == field, field
        # Leading zeros are no digits of the id: token 5, as a short key would name it.
        answer = http.post("/v1/completions", content='{"prompt": "hi", "max_tokens": 2, "temperature": 0, '
                           '"return_token_ids": true, "logit_bias": {"%s123": 100}}' % ("0" * 5000))
        assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == [123, 123]


def test_echo_puts_the_prompt_before_each_choice(served, client):
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="Once upon", **kwargs).choices[0].text
    echoed = client.completions.create(prompt="Once upon", echo=True, n=2, **kwargs)
    assert [c.text for c in echoed.choices] == ["Once upon" + plain] * 2
    assert echoed.usage.completion_tokens == 8  # the echo is not counted as output
    streamed = ["", ""]
    for event in client.completions.create(prompt="Once upon", echo=True, n=2, stream=True, **kwargs):
        for choice in event.choices:
            streamed[choice.index] += choice.text
    assert streamed == ["Once upon" + plain] * 2
    ids = served[2].encode("Once upon", add_special_tokens=False)
    by_ids = client.completions.create(prompt=ids, echo=True, **kwargs).choices[0].text
    assert by_ids.startswith(served[2].decode(ids)) and len(by_ids) > len(served[2].decode(ids))


def test_an_error_renders_though_its_message_echoes_text_that_is_not_unicode() -> None:
    from engine.server.errors import APIError

    body = APIError(404, "The model `\ud800` does not exist.").response().body
    assert json.loads(body)["error"]["message"] == "The model `\ud800` does not exist."
    assert APIError(400, "caf\u00e9").response().body.decode().count("caf\u00e9") == 1  # UTF-8 as before


def test_stop_is_one_string_or_a_list_of_them() -> None:
    from engine.server.protocol import CompletionRequest

    # OpenAI's stop: a string is one stop string, not its characters.
    assert CompletionRequest(prompt="x", stop="ab").stop_strings() == ("ab",)
    assert CompletionRequest(prompt="x", stop=["ab", "c"]).stop_strings() == ("ab", "c")
    assert CompletionRequest(prompt="x").stop_strings() == ()


class BosAddingTokenizer:
    """The tiny model's tokenizer, adding a BOS (id 1) where asked for special tokens, as Llama's
    tokenizers do (SmolLM2's adds none, so a dropped or doubled BOS would not show with it)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text, add_special_tokens=True):
        return [1] * add_special_tokens + self._tokenizer.encode(text, add_special_tokens=False)


def test_a_plain_prompt_gets_the_special_tokens_and_a_chat_only_its_templates(tiny_model_dir) -> None:
    import asyncio

    from transformers import AutoTokenizer

    from engine.server.chat_protocol import ChatCompletionRequest
    from engine.server.protocol import CompletionRequest
    from engine.server.serving import OpenAIServing

    real = AutoTokenizer.from_pretrained(tiny_model_dir)
    handlers = OpenAIServing(None, BosAddingTokenizer(real), MODEL, SHORT_MODEL_LEN)
    try:
        ids, text = asyncio.run(handlers._completion_prompt(CompletionRequest(prompt="Hello there"), "Hello there"))
    finally:
        handlers.close()
    assert ids == [1] + real.encode("Hello there", add_special_tokens=False) and text == "Hello there"
    text, ids = handlers._render_chat(ChatCompletionRequest(messages=CHAT), CHAT)
    assert ids == real.encode(text, add_special_tokens=False)  # the template wrote its own


def test_bad_words_are_tokenized_as_vllm_tokenizes_them(tiny_model_dir) -> None:
    # vLLM's: the word with its leading spaces stripped, and after a space where that gives other
    # tokens of the same count (a word inside the text).
    from transformers import AutoTokenizer

    from engine.server.serving import OpenAIServing

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    handlers = OpenAIServing(None, tokenizer, MODEL, SHORT_MODEL_LEN)
    hello, spaced_hello = encode("hello there"), encode(" hello there")
    assert len(hello) == len(spaced_hello) and hello[0] != spaced_hello[0]
    assert handlers._bad_words_token_ids(["hello there"]) == (hello, spaced_hello)
    assert handlers._bad_words_token_ids(["  hello there"]) == (hello, spaced_hello)
    assert len(encode(" ß")) != len(encode("ß"))  # after a space it is another word: the bare form alone
    assert handlers._bad_words_token_ids(["ß", "hello there"]) == (encode("ß"), hello, spaced_hello)
