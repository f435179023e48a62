"""vLLM's chat-template switches (add_generation_prompt, continue_final_message,
chat_template_kwargs), chat echo, and the /tokenize and /detokenize routes, with the official
openai client (or httpx, for routes it lacks) against a real uvicorn server (tiny model, greedy).

The reference for a chat is a completion of the prompt the template renders, sent as token ids:
a chat that continues its final message must give the tokens of that prompt, the reply's role
and echo follow vLLM's rules, and /tokenize must give the ids the chat endpoint reads.
"""

from __future__ import annotations

import copy

import httpx
import pytest

from engine.server import errors
from engine.server.chat_template import render_chat
from engine.server.chat_protocol import ChatCompletionRequest
from test_server import MAX_MODEL_LEN, MODEL, error_of, post
from test_server_logprobs import client, served, tokenizer  # noqa: F401 - the tiny model's server, as fixtures

PREFILL = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green"}]
GREEDY = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def template_ids(tokenizer, messages, **switches) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **switches)
    return tokenizer.encode(text, add_special_tokens=False)


def completion_of(client, prompt_ids: list[int]) -> str:
    return client.completions.create(prompt=prompt_ids, **GREEDY).choices[0].text


def chat(client, messages, stream: bool = False, **body):
    extra = {**GREEDY["extra_body"], **body}
    return client.chat.completions.create(messages=messages, stream=stream, extra_body=extra,
                                          **{k: v for k, v in GREEDY.items() if k != "extra_body"})


def streamed(events) -> tuple[list[str | None], str]:
    """(every role the stream's deltas carry, its text joined)."""
    roles, text = [], ""
    for event in events:
        for choice in event.choices:
            if choice.delta.role is not None:
                roles.append(choice.delta.role)
            text += choice.delta.content or ""
    return roles, text


def test_a_continued_final_message_gives_the_tokens_of_its_rendered_prompt(client, tokenizer) -> None:
    reference = completion_of(client, template_ids(tokenizer, PREFILL, continue_final_message=True))
    assert reference != completion_of(client, template_ids(tokenizer, PREFILL, add_generation_prompt=True))
    reply = chat(client, PREFILL, **CONTINUE)
    assert reply.usage.prompt_tokens == len(template_ids(tokenizer, PREFILL, continue_final_message=True))
    message = reply.choices[0].message
    assert (message.role, message.content) == ("assistant", reference)
    assert streamed(chat(client, PREFILL, stream=True, **CONTINUE)) == (["assistant"], reference)


def test_echo_puts_the_continued_message_before_the_reply(client, tokenizer) -> None:
    reference = completion_of(client, template_ids(tokenizer, PREFILL, continue_final_message=True))
    echoed = chat(client, PREFILL, echo=True, **CONTINUE).choices[0].message.content
    assert echoed == "Red, green" + reference
    events = list(chat(client, PREFILL, stream=True, echo=True, **CONTINUE))
    assert events[1].choices[0].delta.content == "Red, green"  # its own chunk, after the role's
    assert streamed(events) == (["assistant"], "Red, green" + reference)
    # A user's final message is not the reply's role: nothing to echo, as vLLM answers.
    question = PREFILL[:1]
    unechoed = chat(client, question).choices[0].message.content
    assert chat(client, question, echo=True).choices[0].message.content == unechoed


def test_without_a_generation_prompt_the_reply_extends_the_final_turn(client, tokenizer) -> None:
    reply = chat(client, PREFILL[:1], add_generation_prompt=False)
    assert reply.choices[0].message.role == "user"  # vLLM names the final message's role
    ids = template_ids(tokenizer, PREFILL[:1], add_generation_prompt=False)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == completion_of(client, ids)
    roles, _ = streamed(chat(client, PREFILL[:1], stream=True, add_generation_prompt=False))
    assert roles == ["user"]


def test_chat_template_kwargs_reach_the_template(tokenizer) -> None:
    greeting = copy.copy(tokenizer)
    greeting.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = ChatCompletionRequest(messages=PREFILL[:1], chat_template_kwargs={"greeting": "Ahoy! "})
    assert render_chat(greeting, [m.for_template() for m in body.messages], body) == "Ahoy! Name three colours."
    unknown = ChatCompletionRequest(messages=PREFILL[:1], chat_template_kwargs={"enable_thinking": False})
    plain = ChatCompletionRequest(messages=PREFILL[:1])
    messages = [m.for_template() for m in plain.messages]
    assert render_chat(tokenizer, messages, unknown) == render_chat(tokenizer, messages, plain)  # unused: ignored


def test_template_kwargs_set_the_switches_and_tools_as_vllm_merges_them(client, tokenizer) -> None:
    # vLLM renders with the kwargs over the switches; here they are the switches, role and echo too.
    by_kwargs = chat(client, PREFILL, echo=True, chat_template_kwargs=CONTINUE)
    by_fields = chat(client, PREFILL, echo=True, **CONTINUE)
    assert by_kwargs.usage.prompt_tokens == len(template_ids(tokenizer, PREFILL, continue_final_message=True))
    assert by_kwargs.choices[0].message == by_fields.choices[0].message
    assert by_kwargs.choices[0].message.content.startswith("Red, green")
    lists = copy.copy(tokenizer)
    lists.chat_template = "{{ tools | length }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = ChatCompletionRequest(messages=PREFILL[:1], chat_template_kwargs={"tools": [{"a": 1}, {"b": 2}]})
    assert render_chat(lists, [m.for_template() for m in body.messages], body, tools=[{"c": 3}]) == \
        "2:Name three colours."


def test_a_template_that_rejects_the_conversation_is_a_400_naming_messages(tokenizer) -> None:
    strict = copy.copy(tokenizer)
    strict.chat_template = "{{ raise_exception('no assistant turns here') }}"
    body = ChatCompletionRequest(messages=PREFILL)
    with pytest.raises(errors.APIError) as refused:
        render_chat(strict, [m.for_template() for m in body.messages], body)
    assert (refused.value.status, refused.value.info.param) == (400, "messages")
    assert "no assistant turns here" in str(refused.value)


@pytest.mark.parametrize("body, field, words", [
    ({"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set tokenize"),
    ({"chat_template_kwargs": {"conversations": []}}, "chat_template_kwargs", "may not set conversations"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, "continue_final_message", "cannot both be true"),
    ({"chat_template_kwargs": {"documents": []}}, "chat_template_kwargs", "may not set documents"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "dictionary"),
    ({"add_generation_prompt": "maybe"}, "add_generation_prompt", "boolean"),
    ({"echo": 3}, "echo", "boolean"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "not supported"),
])
def test_bad_template_fields_are_400s_naming_them(served, body, field, words) -> None:
    error = error_of(post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": PREFILL, **body}), 400)
    assert error["param"] == field and words in error["message"]


def test_null_template_switches_are_their_defaults(served) -> None:
    body = {"model": MODEL, "messages": PREFILL[:1], "max_tokens": 2, "add_generation_prompt": None,
            "continue_final_message": None, "echo": None, "chat_template_kwargs": None}
    assert post(served[0], "/v1/chat/completions", body).json()["choices"][0]["message"]["role"] == "assistant"


# ---- /tokenize and /detokenize ---------------------------------------------------------------------
def test_tokenize_gives_the_ids_the_model_reads(served, client, tokenizer) -> None:
    text = "It was the best of times"
    got = post(served[0], "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert got == {"count": len(tokenizer.encode(text)), "max_model_len": MAX_MODEL_LEN,
                   "tokens": tokenizer.encode(text), "token_strs": None}
    bare = post(served[0], "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    for switches in ({}, CONTINUE):
        counted = post(served[0], "/tokenize", {"messages": PREFILL, **switches}).json()
        assert counted["tokens"] == template_ids(tokenizer, PREFILL, **{
            "add_generation_prompt": True, **switches})
        assert counted["count"] == chat(client, PREFILL, **switches).usage.prompt_tokens


def test_detokenize_is_tokenizes_inverse(served, tokenizer) -> None:
    ids = tokenizer.encode("Once upon a time, 你好", add_special_tokens=False)
    assert post(served[0], "/detokenize", {"model": MODEL, "tokens": ids}).json() == {
        "prompt": "Once upon a time, 你好"}
    assert post(served[0], "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, field", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": PREFILL, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "Hi", "model": "other"}, 404, "model"),
    ("/tokenize", [1, 2], 400, None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
])
def test_bad_tokenizer_requests_are_errors_naming_the_field(served, path, body, status, field) -> None:
    assert error_of(post(served[0], path, body), status)["param"] == field


def test_tokenize_refuses_untokenized_a_text_too_long_for_the_context(served, tokenizer) -> None:
    # These routes need no key and share the tokenizer thread with /v1: a huge text must not hold it.
    huge = "word " * (MAX_MODEL_LEN * 100)
    for body, field in (({"prompt": huge}, "prompt"), ({"messages": [{"role": "user", "content": huge}]}, "messages")):
        error = error_of(post(served[0], "/tokenize", body, key=None), 400)
        assert (error["param"], error["code"]) == (field, "context_length_exceeded")
    fits = "word " * 50
    assert post(served[0], "/tokenize", {"prompt": fits}).json()["count"] == len(tokenizer.encode(fits))


def test_the_tokenizer_routes_need_no_api_key_as_in_vllm(served) -> None:
    assert post(served[0], "/tokenize", {"prompt": "Hi"}, key=None).status_code == 200
    assert httpx.post(served[0] + "/v1/completions", json={"prompt": "Hi"}, timeout=60).status_code == 401
    assert post(served[0], "/detokenize", {"tokens": [1]}, key="wrong").status_code == 200


def test_template_kwargs_win_over_switches_the_request_also_sets() -> None:
    # vLLM merges chat_template_kwargs over the request's own switches: the kwargs' values render.
    body = ChatCompletionRequest(messages=PREFILL, add_generation_prompt=True, continue_final_message=False,
                                 chat_template_kwargs={**CONTINUE, "enable_thinking": False})
    assert (body.add_generation_prompt, body.continue_final_message) == (False, True)
    assert body.chat_template_kwargs == {"enable_thinking": False}
