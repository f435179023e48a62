"""vLLM's include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens and stop_reason,
with the official openai client against a real uvicorn server (tiny model, greedy): a kept stop
string ends the text exactly where it ends in the free-running text, streamed or not, and a stop
token's text is kept; special tokens' names stay when not skipped; a truncated prompt gives the
tokens of its last N ids sent alone, for completions and chat; stop_reason names the stop string
or stop token that ended a request, and is null for the end of sequence or a length finish."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from hf_reference import stop_string_past_the_middle
from scheduler.request import SamplingParams
from test_server import MAX_MODEL_LEN, MODEL, engine_idle_and_intact, error_of, post
from test_server_logprobs import client, served, tokenizer  # noqa: F401 - the tiny model's server, as fixtures

PROMPT = "Once upon a time"
GREEDY = dict(model=MODEL, max_tokens=12, temperature=0)


def free_text(client) -> str:
    return client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **GREEDY).choices[0].text


def test_a_kept_stop_string_ends_the_text_where_it_ends(client) -> None:
    free = free_text(client)
    stop = stop_string_past_the_middle(free, 3)
    kept = free[:free.index(stop) + len(stop)]
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    whole = client.completions.create(prompt=PROMPT, stop=[stop], extra_body=extra, **GREEDY).choices[0]
    assert (whole.text, whole.finish_reason) == (kept, "stop")
    streamed = "".join(event.choices[0].text for event in client.completions.create(
        prompt=PROMPT, stop=[stop], stream=True, extra_body=extra, **GREEDY) if event.choices)
    assert streamed == kept
    cut = client.completions.create(prompt=PROMPT, stop=[stop], extra_body={"ignore_eos": True}, **GREEDY)
    assert cut.choices[0].text == free[:free.index(stop)]  # unchanged without the field


def test_a_kept_stop_token_leaves_its_text(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, num_threads=1)
    prompt = [1, 504, 3458, 314, 253]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    at = next(i for i in range(3, len(free)) if free[i] not in free[:i])  # a token's first occurrence
    tokenizer = llm.engine.tokenizer
    for keep, shown in ((False, free[:at]), (True, free[:at + 1])):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(free[at],),
                                include_stop_str_in_output=keep)
        out = llm.generate([prompt], params)[0]
        assert (out.text, out.finish_reason, out.token_ids) == (tokenizer.decode(shown), "stop", free[:at + 1])


def stop_across_a_token_boundary(text: str, boundaries: list[int]) -> str:
    """A substring first found where it starts two characters before a token's text ends and
    ends two after, in the second half of the text (a token or more is left to cut)."""
    for boundary in boundaries:
        stop = text[boundary - 2:boundary + 2]
        if boundary - 2 >= len(text) // 2 and len(stop) == 4 and text.index(stop) == boundary - 2:
            return stop
    raise AssertionError(f"no stop string spans a token boundary of {text!r}")


def test_the_engine_keeps_a_stop_string_across_a_chunk_boundary(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, num_threads=1)
    prompt = [1, 504, 3458, 314, 253]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    tokenizer = llm.engine.tokenizer
    boundaries = [len(tokenizer.decode(free.token_ids[:i])) for i in range(1, len(free.token_ids))]
    stop = stop_across_a_token_boundary(free.text, boundaries)  # no one token's text holds it
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True)
    out = llm.generate([prompt], params)[0]
    assert out.text == free.text[:free.text.index(stop) + len(stop)] and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=1)


def test_a_truncated_prompt_is_its_last_tokens(served, client, tokenizer) -> None:
    ids = tokenizer.encode("It was the best of times, it was the worst of times, it was the age of wisdom",
                           add_special_tokens=False)
    last = ids[-6:]
    alone = client.completions.create(prompt=last, extra_body={"ignore_eos": True}, **GREEDY)
    cut = client.completions.create(prompt=ids, echo=True, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 6},
                                    **GREEDY)
    assert cut.usage.prompt_tokens == 6
    assert cut.choices[0].text == tokenizer.decode(last) + alone.choices[0].text  # echo shows what the model read
    longer = client.completions.create(prompt=last, extra_body={"truncate_prompt_tokens": 50}, **GREEDY)
    assert longer.usage.prompt_tokens == 6  # nothing to cut
    # A text prompt, cut, echoes the text of the tokens kept, not the text sent.
    text = tokenizer.decode(ids)
    cut_text = client.completions.create(prompt=text, echo=True, extra_body={"ignore_eos": True,
                                         "truncate_prompt_tokens": 6}, **GREEDY)
    assert cut_text.choices[0].text == cut.choices[0].text
    engine_idle_and_intact(served[1])


def test_truncation_to_the_context_length_still_leaves_room_for_the_output(served, client) -> None:
    # -1 keeps the last max_model_len tokens, as vLLM reads it: a prompt that long leaves no room
    # for a token and is refused, one a token shorter is served whole.
    def completion(length: int):
        body = {"model": MODEL, "prompt": [7] * length, "max_tokens": 1, "truncate_prompt_tokens": -1}
        return post(served[0], "/v1/completions", body)

    assert error_of(completion(MAX_MODEL_LEN), 400)["code"] == "context_length_exceeded"
    assert completion(MAX_MODEL_LEN - 1).json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1


def test_a_truncated_chat_fits_a_text_too_long_to_tokenize(served, client) -> None:
    huge = "word " * (MAX_MODEL_LEN * 100)  # refused untokenized without truncation
    messages = [{"role": "user", "content": huge}]
    too_long = post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert error_of(too_long, 400)["code"] == "context_length_exceeded"
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body={"truncate_prompt_tokens": 32})
    assert reply.usage.prompt_tokens == 32


@pytest.mark.parametrize("field, value", [("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
                                          ("truncate_prompt_tokens", True), ("include_stop_str_in_output", "maybe")])
def test_bad_values_are_400s_naming_the_field(served, field, value) -> None:
    error = error_of(post(served[0], "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value}), 400)
    assert error["param"] == field and error["message"].startswith(f"{field}: ")


def test_special_tokens_stay_in_the_text_when_not_skipped(client, tokenizer) -> None:
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    kwargs = dict(prompt=PROMPT, model=MODEL, max_tokens=3, temperature=0)
    extra = {"allowed_token_ids": [special], "ignore_eos": True}
    skipped = client.completions.create(extra_body=extra, **kwargs).choices[0].text
    kept = client.completions.create(extra_body={**extra, "skip_special_tokens": False}, **kwargs).choices[0].text
    assert (skipped, kept) == ("", "<|im_start|>" * 3)
    streamed = "".join(event.choices[0].text for event in client.completions.create(
        stream=True, extra_body={**extra, "skip_special_tokens": False}, **kwargs) if event.choices)
    assert streamed == kept


def test_stop_reason_names_the_stop_string_or_token_as_vllm_does(served, client, tiny_model_dir) -> None:
    free = free_text(client)
    stop = stop_string_past_the_middle(free, 3)
    whole = client.completions.create(prompt=PROMPT, stop=[stop, "\x07"], extra_body={"ignore_eos": True}, **GREEDY)
    assert (whole.choices[0].finish_reason, whole.choices[0].stop_reason) == ("stop", stop)
    last = [event.choices[0] for event in client.completions.create(
        prompt=PROMPT, stop=[stop], stream=True, extra_body={"ignore_eos": True}, **GREEDY) if event.choices][-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    messages = [{"role": "user", "content": PROMPT}]
    chat_free = client.chat.completions.create(messages=messages, extra_body={"ignore_eos": True},
                                               **GREEDY).choices[0].message.content
    chat_stop = stop_string_past_the_middle(chat_free, 3)
    chat = client.chat.completions.create(messages=messages, stop=[chat_stop], extra_body={"ignore_eos": True},
                                          **GREEDY).choices[0]
    assert (chat.finish_reason, chat.stop_reason) == ("stop", chat_stop)
    assert client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **GREEDY).choices[0].stop_reason \
        is None  # a length finish has none
    # A stop token gives its id; the end of sequence, checked first, none (also when listed).
    llm = LLM(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, num_threads=1)
    prompt = [1, 504, 3458, 314, 253]
    ids = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    by_token = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=(ids[at],)))[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", ids[at])
    eos = llm.engine.tokenizer.eos_token_id
    by_eos = llm.generate([prompt], SamplingParams(max_tokens=4, allowed_token_ids=(eos,), stop_token_ids=(eos,)))[0]
    assert (by_eos.token_ids, by_eos.finish_reason, by_eos.stop_reason) == ((eos,), "stop", None)
