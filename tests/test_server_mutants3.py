"""Behaviour of the request models, the prompt's checks and the logprobs' shapes that a third
hand-made mutation run (protocol.py, chat_protocol.py, prompt_input.py, limits.py, logprobs.py,
chat_template.py) found untested.

Mostly pure, as the parts are: every bound of a field at its edge (taken, as vLLM takes it) and
just past it (refused, naming the field, which errors.py turns into the 400's `param`), explicit
nulls as defaults, the batch bounds at the limit, the context's arithmetic at its edge, and the
byte-level alphabet against SmolLM2's tokenizer round trip. A validation error's first location
is the field the server's 400 names (test_server_protocol.py checks that mapping over HTTP).
"""

from __future__ import annotations

import asyncio
import copy

import pytest
from pydantic import ValidationError

from engine.server import errors
from engine.chat_messages import ChatMessage
from engine.server.chat_protocol import ChatCompletionRequest
from engine.server.chat_template import render_chat
from engine.server.logprobs import LogprobsFormatter, end_of_text_offset
from engine.server.prompt_input import PromptInput
from engine.server.protocol import MAX_BATCH_PROMPTS, MAX_BATCH_SEQUENCES, CompletionRequest
from scheduler.output import TokenLogprobs
from scheduler.request import MAX_LOGPROBS, PENALTY_LIMIT, PRIORITY_LIMIT, SEED_MAX, SEED_MIN

CHAT = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": CHAT, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hi", **fields})


def refused_field(make, **fields) -> str:
    """The field a request's validation error names first (the 400's `param`)."""
    with pytest.raises(ValidationError) as refused:
        make(**fields)
    return str(refused.value.errors()[0]["loc"][0])


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


# ---- each bound at its edge ---------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("min_p", 1.0), ("seed", SEED_MIN), ("seed", SEED_MAX),
    ("n", 16), ("presence_penalty", -PENALTY_LIMIT), ("presence_penalty", PENALTY_LIMIT),
    ("frequency_penalty", -PENALTY_LIMIT), ("frequency_penalty", PENALTY_LIMIT), ("repetition_penalty", 1e-3),
    ("truncate_prompt_tokens", -1), ("truncate_prompt_tokens", 1), ("priority", -PRIORITY_LIMIT),
    ("priority", PRIORITY_LIMIT - 1), ("top_k", -1), ("top_k", 0), ("stop_token_ids", [0]), ("min_tokens", 0),
    ("prompt_logprobs", 0), ("prompt_logprobs", MAX_LOGPROBS), ("allowed_token_ids", [0]),
    ("bad_words", ["x"] * 128), ("stop", ["x"] * 64), ("max_tokens", 1), ("max_completion_tokens", 1),
])
def test_a_chat_field_at_the_edge_of_its_bound_is_taken(field, value):
    assert getattr(chat(**{field: value}), field) == value


@pytest.mark.parametrize("top_logprobs", [0, MAX_LOGPROBS])
def test_chat_top_logprobs_at_the_edges_are_taken(top_logprobs):
    assert chat(logprobs=True, top_logprobs=top_logprobs).requested_logprobs() == top_logprobs


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("logprobs", 0), ("logprobs", MAX_LOGPROBS),
                                          ("top_logprobs", 0)])
def test_a_completions_field_at_the_edge_of_its_bound_is_taken(field, value):
    assert getattr(completion(**{field: value}), field) == value


@pytest.mark.parametrize("fields, field", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"stop": ["a", ""]}, "stop"),  # an empty one after others
    # JSON true is no count for any of them.
    ({"prompt_logprobs": True}, "prompt_logprobs"), ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ({"seed": True}, "seed"), ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"min_p": True}, "min_p"),
])
def test_a_chat_field_past_its_bound_is_refused_by_name(fields, field):
    assert refused_field(chat, **fields) == field


def test_a_tool_message_needs_its_content():
    # Only an assistant turn may leave it null: a tool result without text is a client's mistake.
    with pytest.raises(ValidationError, match="content is required in a tool message"):
        ChatMessage.model_validate({"role": "tool", "content": None, "tool_call_id": "call_1"})
    assert ChatMessage.model_validate({"role": "assistant", "content": None}).for_template()["content"] == ""


def test_a_text_part_without_a_text_string_is_refused_as_such():
    # Checked before the union is tried: else the 400 would say the content should be a string.
    for part in ({"type": "text"}, {"type": "text", "text": None}):
        with pytest.raises(ValidationError, match="content part 0 has no text string"):
            ChatMessage.model_validate({"role": "user", "content": [part]})


# ---- nulls ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", [
    "max_tokens", "temperature", "top_p", "n", "stream", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "priority", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "logprobs", "echo", "add_generation_prompt", "continue_final_message",
])
def test_an_explicit_null_is_the_chat_fields_default(field):
    assert getattr(chat(**{field: None}), field) == ChatCompletionRequest.model_fields[field].default


def test_null_echo_is_its_default_and_a_null_include_usage_asks_for_no_usage():
    assert completion(echo=None).echo is False
    # As vLLM reads it: include_usage defaults to true, and null (unlike an absent field) is false.
    options = completion(stream=True, stream_options={"include_usage": None, "continuous_usage_stats": None})
    assert options.usage_in_stream() == (False, False)


def test_stream_options_ask_for_usage_unless_they_say_no():
    # vLLM's (and SGLang's) include_usage is true unless set; continuous_usage_stats adds to it.
    assert chat(stream=True).usage_in_stream() == (False, False)
    assert chat(stream=True, stream_options={}).usage_in_stream() == (True, False)
    assert chat(stream=True, stream_options={"continuous_usage_stats": True}).usage_in_stream() == (True, True)
    refused = {"include_usage": False, "continuous_usage_stats": True}
    assert chat(stream=True, stream_options=refused).usage_in_stream() == (False, False)


# ---- what the fields ask for ----------------------------------------------------------------------
def test_chat_logprobs_without_top_logprobs_ask_for_the_sampled_tokens_alone():
    assert chat(logprobs=True).requested_logprobs() == 0
    assert chat().requested_logprobs() is None


def test_max_completion_tokens_is_the_limit_and_the_name_a_context_error_gives():
    assert chat(max_tokens=5, max_completion_tokens=3).requested_max_tokens() == ("max_completion_tokens", 3)
    assert chat(max_tokens=5).requested_max_tokens() == ("max_tokens", 5)


def test_only_max_tokens_0_scores_the_prompt_alone():
    assert completion(max_tokens=0).scores_prompt_only() and not completion(max_tokens=1).scores_prompt_only()


def test_explicit_prompt_logprobs_win_over_echos():
    # vLLM's rule: echoed with logprobs, the prompt gets as many alternatives, unless asked otherwise.
    assert completion(echo=True, logprobs=2).requested_prompt_logprobs() == 2
    assert completion(echo=True, logprobs=2, prompt_logprobs=5).requested_prompt_logprobs() == 5
    assert completion(logprobs=2).requested_prompt_logprobs() is None


def test_a_stream_scores_the_prompt_only_for_an_echo_with_logprobs():
    # vLLM takes prompt_logprobs 0 with a stream and sends none: scoring the prompt would be waste.
    assert completion(stream=True, prompt_logprobs=0).requested_prompt_logprobs() is None
    assert completion(stream=True, echo=True, prompt_logprobs=0).requested_prompt_logprobs() is None
    assert completion(stream=True, echo=True, logprobs=2).requested_prompt_logprobs() == 2
    assert completion(stream=True, echo=True, logprobs=2, prompt_logprobs=0).requested_prompt_logprobs() == 0
    assert chat(stream=True, prompt_logprobs=0).requested_prompt_logprobs() is None
    assert chat(prompt_logprobs=0).requested_prompt_logprobs() == 0


def test_the_reply_extends_the_final_turn_without_a_generation_prompt():
    assert chat(add_generation_prompt=False).reply_role("user") == "user"
    assert chat().reply_role("user") == "assistant"


def test_a_tool_results_call_id_and_a_name_reach_the_template():
    message = ChatMessage.model_validate({"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"})
    assert message.for_template() == {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"}


@pytest.mark.parametrize("name", [
    "conversation", "conversations", "messages", "documents", "chat_template", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"])
def test_template_kwargs_may_not_set_apply_chat_templates_own_parameters(name):
    assert refused_field(chat, chat_template_kwargs={name: 1}) == "chat_template_kwargs"


# ---- completions batches --------------------------------------------------------------------------
def test_a_batch_may_reach_both_bounds_and_n_counts_against_the_second():
    assert len(completion(prompt=["a"] * MAX_BATCH_PROMPTS).prompts()) == MAX_BATCH_PROMPTS
    assert len(completion(prompt=["a"] * (MAX_BATCH_SEQUENCES // 16), n=16).prompts()) == MAX_BATCH_SEQUENCES // 16
    assert refused_field(completion, prompt=["a"] * (MAX_BATCH_SEQUENCES // 2 + 1), n=2) == "prompt"


def test_a_batch_of_one_unwraps_only_a_prompt():
    # [[[1]]] is no prompt (ids nest one deep), not the prompt [1].
    assert completion(prompt=[[1, 2]]).prompts() == [[1, 2]]
    assert refused_field(completion, prompt=[[[1]]]) == "prompt"


# ---- the context's arithmetic ---------------------------------------------------------------------
class Context(PromptInput):
    """PromptInput over a short context and SmolLM2's tokenizer."""

    def __init__(self, tokenizer=None, max_model_len: int = 10, max_token_chars: int = 2) -> None:
        self.tokenizer, self.max_model_len, self.max_token_chars = tokenizer, max_model_len, max_token_chars
        self._tokenize_pool = None


def context_error(call) -> tuple[str | None, str | None]:
    with pytest.raises(errors.APIError) as refused:
        call()
    return refused.value.info.code, refused.value.info.param


def test_a_prompt_and_output_that_fill_the_context_exactly_fit():
    context = Context()
    assert context._check_context(9, 1, "prompt", "max_tokens") == 1
    assert context._check_context(9, None, "prompt", "max_tokens") == 1  # the rest of the context
    assert context_error(lambda: context._check_context(10, None, "messages", "max_tokens")) == (
        "context_length_exceeded", "messages")
    assert context_error(lambda: context._check_context(9, 2, "messages", "max_completion_tokens")) == (
        "context_length_exceeded", "max_completion_tokens")


def test_a_text_to_be_truncated_is_not_bounded_by_its_length():
    context, text = Context(), "x" * 21  # past 10 tokens of at most 2 characters
    assert context_error(lambda: context._check_untruncated_text(completion(), text, "prompt")) == (
        "context_length_exceeded", "prompt")
    context._check_untruncated_text(completion(truncate_prompt_tokens=4), text, "prompt")
    # A truncation longer than the context could never fit: refused before tokenizing, as vLLM
    # refuses it (it skipped the length bound, and the text was tokenized for nothing).
    too_long = completion(truncate_prompt_tokens=11)
    assert context_error(lambda: context._check_untruncated_text(too_long, text, "prompt")) == (
        "invalid_value", "truncate_prompt_tokens")
    assert context_error(lambda: asyncio.run(context._truncated(too_long, [1] * 20, None, "prompt"))) == (
        "invalid_value", "truncate_prompt_tokens")
    context._check_untruncated_text(completion(truncate_prompt_tokens=10), text, "prompt")  # the whole context


def test_a_chat_cut_to_the_context_is_refused_naming_messages(tokenizer):
    context = Context(tokenizer, max_model_len=8)
    try:
        ids = list(range(100, 120))
        kept = asyncio.run(context._truncated(chat(truncate_prompt_tokens=5), ids, "text", "messages"))
        assert kept == (ids[-5:], tokenizer.decode(ids[-5:]))
        cut = context._truncated(chat(truncate_prompt_tokens=-1), ids, "text", "messages")
        assert context_error(lambda: asyncio.run(cut)) == ("context_length_exceeded", "messages")
    finally:
        context.close()


def test_truncation_side_right_keeps_the_prompts_first_tokens(tokenizer):
    context = Context(tokenizer, max_model_len=8)
    try:
        ids = list(range(100, 120))
        kept = asyncio.run(context._truncated(completion(truncate_prompt_tokens=5, truncation_side="right"), ids,
                                              "text", "prompt"))
        assert kept == (ids[:5], tokenizer.decode(ids[:5]))
        left = asyncio.run(context._truncated(completion(truncate_prompt_tokens=5, truncation_side="left"), ids,
                                              "text", "prompt"))
        assert left[0] == ids[-5:]
    finally:
        context.close()


class SpecialTokens:
    """A tokenizer whose special tokens are a BOS (id 1), and whose other ids are characters."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i != 1)

    def __len__(self) -> int:
        return 0x110000


@pytest.mark.parametrize("asked, expected", [({}, [1, 72, 105]), ({"add_special_tokens": False}, [72, 105]),
                                             ({"add_special_tokens": None}, [1, 72, 105])])
def test_a_completions_text_gets_special_tokens_unless_asked_not_to(asked, expected):
    context = Context(SpecialTokens(), max_model_len=100, max_token_chars=100)
    try:
        assert asyncio.run(context._completion_prompt(completion(**asked), "Hi"))[0] == expected
    finally:
        context.close()


def test_a_chats_templated_text_gets_special_tokens_only_when_asked(monkeypatch):
    from engine.server import prompt_input

    monkeypatch.setattr(prompt_input, "render_chat", lambda tokenizer, messages, body, tools: "Hi")
    context = Context(SpecialTokens(), max_model_len=100, max_token_chars=100)
    assert context._render_chat(chat(), CHAT) == ("Hi", [72, 105])
    assert context._render_chat(chat(add_special_tokens=True), CHAT) == ("Hi", [1, 72, 105])


@pytest.mark.parametrize("field, value", [("return_tokens_as_token_ids", True), ("logprob_token_ids", [3]),
                                          ("truncation_side", "middle"), ("logits_processors", ["my.Processor"]),
                                          ("repetition_detection", {"max_pattern_size": 4, "min_count": 2}),
                                          ("prompt_embeds", "AAAA")])
def test_vllm_fields_this_server_does_not_honour_are_refused_by_name(field, value):
    assert refused_field(completion, **{field: value}) == field
    assert refused_field(chat, **{field: value}) == field
    assert refused_field(chat, documents=[{"title": "t", "text": "x"}]) == "documents"
    completion(return_tokens_as_token_ids=False, logprob_token_ids=None, logits_processors=[])  # neutral values pass


def test_a_prompt_no_longer_than_the_truncation_keeps_its_own_text(tokenizer):
    # Nothing is cut, so echo shows the text sent, not the ids' decoding (which drops "\x04": SmolLM2's
    # vocabulary has no token for that byte).
    text = "a\x04b"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) != text
    context = Context(tokenizer)
    try:
        assert asyncio.run(context._truncated(completion(truncate_prompt_tokens=len(ids)), ids, text, "prompt")) == (
            ids, text)
    finally:
        context.close()


def test_a_chat_too_long_to_tokenize_is_refused_naming_messages(tokenizer):
    context = Context(tokenizer, max_model_len=4, max_token_chars=2)
    messages = [{"role": "user", "content": "Hi"}]
    assert context_error(lambda: context._render_chat(chat(), messages)) == ("context_length_exceeded", "messages")


# ---- the chat template ----------------------------------------------------------------------------
def test_the_switches_reach_the_template(tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Red, green"}]
    for switches in ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True},
                     {}):
        expected = tokenizer.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True,
                                                                              **switches})
        assert render_chat(tokenizer, messages, chat(**switches)) == expected


def test_the_tools_reach_the_template_unless_the_kwargs_replace_them(tokenizer):
    lists = copy.copy(tokenizer)
    lists.chat_template = "{{ tools | length }}"
    assert render_chat(lists, CHAT, chat(), tools=[{"a": 1}]) == "1"
    assert render_chat(lists, CHAT, chat(chat_template_kwargs={"tools": []}), tools=[{"a": 1}]) == "0"


# ---- logprobs -------------------------------------------------------------------------------------
def test_token_bytes_rebuild_every_latin_1_character(tokenizer):
    # Every byte-level piece maps back to its bytes: the two-byte characters use each of the 64
    # continuation bytes (and the printable ends of the alphabet's ranges, "~" and "\xac"). The
    # reference is the tokenizer's own decoding (SmolLM2's drops a few control characters).
    ids = tokenizer.encode("".join(chr(code) for code in range(1, 256)), add_special_tokens=False)
    formatter = LogprobsFormatter(tokenizer)
    assert bytes(b for token_id in ids for b in formatter.token_bytes(token_id)) == tokenizer.decode(ids).encode()


def test_an_added_token_outside_the_byte_alphabet_gives_its_texts_bytes(tokenizer):
    spaced = copy.deepcopy(tokenizer)
    spaced.add_tokens(["two words"])
    token_id = spaced.convert_tokens_to_ids("two words")
    assert LogprobsFormatter(spaced).token_bytes(token_id) == list(b"two words")


def test_completion_offsets_count_characters_from_the_start(tokenizer):
    ids = tokenizer.encode("Hi 你好", add_special_tokens=False)
    formatter = LogprobsFormatter(tokenizer)
    entries = [TokenLogprobs(i, -1.0, ()) for i in ids]
    texts = [tokenizer.decode([i]) for i in ids]
    logprobs = formatter.completion(entries, text_offset=3)
    assert logprobs["text_offset"] == [3 + sum(map(len, texts[:k])) for k in range(len(ids))]
    assert end_of_text_offset(logprobs, 3) == 3 + sum(map(len, texts))
    echoed = formatter.echoed_completion(ids[:2], [None, TokenLogprobs(ids[1], -2.0, ())], entries[2:])
    assert echoed["token_logprobs"][:2] == [None, -2.0]
    assert echoed["text_offset"] == [sum(map(len, texts[:k])) for k in range(len(ids))]


def test_prompt_logprobs_rank_the_alternatives_from_1_and_keep_the_tokens_own_rank(tokenizer):
    entry = TokenLogprobs(7, -3.0, ((5, -0.5), (6, -1.0)), rank=4)
    assert LogprobsFormatter(tokenizer).prompt([None, entry]) == [None, {
        "7": {"logprob": -3.0, "rank": 4, "decoded_token": tokenizer.decode([7])},
        "5": {"logprob": -0.5, "rank": 1, "decoded_token": tokenizer.decode([5])},
        "6": {"logprob": -1.0, "rank": 2, "decoded_token": tokenizer.decode([6])}}]


def test_completion_top_logprobs_hold_the_sampled_token_and_chats_every_alternative(tokenizer):
    formatter = LogprobsFormatter(tokenizer)
    entry = TokenLogprobs(7, -3.0, ((5, -0.5), (6, -1.0)))
    assert formatter.completion([entry])["top_logprobs"] == [
        {tokenizer.decode([5]): -0.5, tokenizer.decode([6]): -1.0, tokenizer.decode([7]): -3.0}]
    assert [top["logprob"] for top in formatter.chat([entry])["content"][0]["top_logprobs"]] == [-0.5, -1.0]
