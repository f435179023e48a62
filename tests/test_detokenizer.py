"""Incremental detokenization against a full decode, with SmolLM2's byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import DetokenizerState, advance


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def incremental_text(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    state = DetokenizerState.for_prompt(prompt_ids)
    for index, token in enumerate(output_ids):
        advance(tokenizer, state, [token], (), final=index == len(output_ids) - 1)
    return state.text


def test_a_reply_ending_inside_a_character_keeps_its_text(tokenizer):
    # The emoji spans several tokens; cut before its last one, the reply ends mid-character.
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    cut = ids[:-1]
    full = tokenizer.decode(cut, skip_special_tokens=True)
    assert full.startswith("ok ") and full.endswith("\ufffd")
    assert incremental_text(tokenizer, tokenizer.encode("Say:", add_special_tokens=False), cut) == full


def test_a_prompt_ending_inside_a_character_gives_the_reply_that_character(tokenizer):
    # Token-id prompts may stop inside a character; the reply's first token completes it. That
    # character ends in the reply, so the reply shows it, as a decode of prompt + reply does.
    ids = tokenizer.encode("Say: ok 🎉 hi", add_special_tokens=False)
    emoji_end = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("🎉"))
    prompt, reply = ids[:emoji_end - 1], ids[emoji_end - 1:]
    assert tokenizer.decode(prompt).endswith("\ufffd")
    assert incremental_text(tokenizer, prompt, reply) == "🎉 hi"


def test_a_prompt_ending_in_a_stray_byte_keeps_it_out_of_the_reply(tokenizer):
    stray = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    prompt = tokenizer.encode("Say:", add_special_tokens=False) + [stray]
    reply = tokenizer.encode(" hello there", add_special_tokens=False)
    assert incremental_text(tokenizer, prompt, reply) == " hello there"
    # A stray byte, then a character the reply completes: only that character is the reply's.
    emoji = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(emoji) > 1 and tokenizer.decode(emoji[:-1]).endswith("\ufffd")
    prompt = tokenizer.encode("Say:", add_special_tokens=False) + [stray] + emoji[:-1]
    reply = emoji[-1:] + tokenizer.encode(" hi", add_special_tokens=False)
    assert incremental_text(tokenizer, prompt, reply) == "🎉 hi"


def test_random_token_streams_decode_to_the_full_text(tokenizer):
    rng = random.Random(0)
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    for _ in range(100):
        # Multi-byte characters come from emoji and accented words; random ids add the odd ones.
        text = "".join(rng.choice(["ok ", "é", "🎉", " naïve", "数据", " a", "\n"]) for _ in range(8))
        ids = tokenizer.encode(text, add_special_tokens=False)[: rng.randint(1, 12)]
        ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 2))]
        expected = tokenizer.decode(prompt[-5:] + ids, skip_special_tokens=True)
        expected = expected[len(tokenizer.decode(prompt[-5:], skip_special_tokens=True)):]
        assert incremental_text(tokenizer, prompt, ids) == expected, ids


def test_a_stop_string_across_tokens_cuts_the_text_and_is_never_shown(tokenizer):
    from engine.detokenizer import release

    rng = random.Random(1)
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    checked = 0
    for _ in range(200):
        text = "".join(rng.choice(["ok ", "é", " naïve", "数据", " a", "\n", " the", "end."]) for _ in range(10))
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        length = rng.randint(2, 6)
        start = rng.randint(0, max(0, len(full) - length))
        stop = full[start:start + length]
        if len(stop) < length or full.count(stop) != 1:
            continue  # only stops found once: the cut is then unambiguous
        expected = full[:start]
        state, shown, matched = DetokenizerState.for_prompt(prompt), "", False
        for index, token in enumerate(ids):
            matched = advance(tokenizer, state, [token], (stop,), final=index == len(ids) - 1)
            shown += release(state, (stop,), finished=matched or index == len(ids) - 1)
            assert expected.startswith(shown), (text, stop, shown)  # no piece of the stop ever shown
            if matched:
                break
        assert matched and shown == expected, (text, stop)
        checked += 1
    assert checked > 50


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    # " wor" begins before "foo" in the text: the cut is at " wor", whatever the order of the stops.
    ids = tokenizer.encode("hello world and more foo bar", add_special_tokens=False)
    for stops in (("foo", " wor"), (" wor", "foo")):
        state = DetokenizerState.for_prompt(tokenizer.encode("Say:", add_special_tokens=False))
        assert advance(tokenizer, state, ids, stops)
        assert state.text == "hello"


def test_a_short_stop_string_does_not_shorten_the_hold_back_of_a_long_one(tokenizer):
    # The hold-back is the longest stop's length - 1: a 1-character stop that never occurs next to
    # a long one must not let the long one's beginning out before it completes.
    from engine.detokenizer import release

    stops = ("\x07", "three four")
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    state, shown, matched = DetokenizerState.for_prompt(tokenizer.encode("Say:", add_special_tokens=False)), "", False
    for index, token in enumerate(ids):
        matched = advance(tokenizer, state, [token], stops, final=index == len(ids) - 1)
        shown += release(state, stops, finished=matched or index == len(ids) - 1)
        assert "one two ".startswith(shown), shown
        if matched:
            break
    assert matched and shown == "one two "


class LeadingSpaceDroppingTokenizer:
    """A SentencePiece-style tokenizer (as Llama's): "▁" spells a space, and a decode drops the
    space a text starts with."""

    PIECES = ("▁Hello", "▁world", "▁how", "▁are", "▁you", "!", ",")

    def decode(self, ids, skip_special_tokens=True) -> str:
        text = "".join(self.PIECES[i] for i in ids).replace("▁", " ")
        return text.removeprefix(" ")


def test_the_first_words_of_a_reply_keep_the_space_before_them():
    # Decoded alone, the reply's first token would lose its space; after a few prompt tokens it
    # shows it, as a decode of the prompt and the reply does.
    tokenizer = LeadingSpaceDroppingTokenizer()
    for prompt in ([0], [0, 6, 0, 6, 0, 6, 0]):
        full = tokenizer.decode(prompt + [1, 2, 3, 4, 5])
        assert incremental_text(tokenizer, prompt, [1, 2, 3, 4, 5]) == full[len(tokenizer.decode(prompt)):]
        assert incremental_text(tokenizer, prompt, [1, 2, 3, 4, 5]) == " world how are you!"


def test_a_long_prompt_ending_inside_a_character_gives_the_reply_that_character(tokenizer):
    # The window's context is the prompt's last tokens, those the reply's first character continues.
    ids = tokenizer.encode("A preamble of several words before it. Say: ok 🎉 hi", add_special_tokens=False)
    emoji_end = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("🎉"))
    prompt, reply = ids[:emoji_end - 1], ids[emoji_end - 1:]
    assert len(prompt) > 10 and tokenizer.decode(prompt).endswith("\ufffd")
    assert incremental_text(tokenizer, prompt, reply) == "🎉 hi"


def test_of_stop_strings_beginning_at_one_place_the_shortest_matches(tokenizer):
    # " wor" completes before " world" in any stream, so it is the match however the text came.
    ids = tokenizer.encode("hello world and more", add_special_tokens=False)
    for stops in ((" world", " wor"), (" wor", " world")):
        state = DetokenizerState.for_prompt(tokenizer.encode("Say:", add_special_tokens=False))
        assert advance(tokenizer, state, ids, stops, keep_stop=True) == " wor"
        assert state.text == "hello wor"


def test_a_kept_stop_string_holds_nothing_back(tokenizer):
    # With include_stop_str_in_output the text up to a stop's end is shown anyway: a stream
    # releases each piece as soon as it is decoded.
    from engine.detokenizer import release

    stops = ("three four",)
    state = DetokenizerState.for_prompt(tokenizer.encode("Say:", add_special_tokens=False))
    for token in tokenizer.encode("one two three", add_special_tokens=False):
        advance(tokenizer, state, [token], stops, keep_stop=True)
        release(state, stops, finished=False, keep_stop=True)
        assert state.released == len(state.text)
    assert state.text == "one two three"
