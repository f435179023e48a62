"""Gaps a mutation run over the output path left open (output_processor, detokenizer, sampler,
logit_range): each test checks the behaviour against a hand-computed or full-decode reference and
names the one-line change it catches.

- OutputProcessor's contract where a report does not carry exactly one new token (the engine
  never does that today; the processor says it copes): counts, stop reason, logprobs, prompt
  logprobs reported only whole.
- The detokenizer's window stays put over a token that decodes to nothing, and the stream holds
  back exactly the longest stop string less one character (none with include_stop_str_in_output).
- A stop string finishes the scheduler's request as stopped.
- The sampler: a top-p that is 0 in float32 still keeps the likeliest token; a logit that overflowed
  to +inf (a float16 model) is the one drawn, not NaN; a row without any cut keeps its softmax.
"""

from __future__ import annotations

import pytest
import torch

from engine.detokenizer import DetokenizerState, advance, release
from engine.output_processor import OutputProcessor
from engine.sampler import Sampler, _filtered_probs
from hf_reference import stop_string_past_the_middle
from scheduler.output import PromptLogprobs, TokenLogprobs
from scheduler.request import Request, RequestStatus, SamplingParams
from test_detokenizer import LeadingSpaceDroppingTokenizer, incremental_text, tokenizer  # noqa: F401 - fixture
from test_engine_api import PROMPT, greedy, llm  # noqa: F401 - fixture
from test_sampler import LOGITS

EOS = 2


# ---- OutputProcessor on its own: reports that carry other than one token ---------------------
def processor_with(tokenizer, request_id: str, prompt: list[int], params: SamplingParams):
    finished = []
    processor = OutputProcessor(tokenizer, lambda rid, status, now: finished.append((rid, status)))
    processor.add(request_id, prompt, params)
    request = Request(request_id, prompt, params, arrival_time=0.0, eos_token_id=EOS)
    request.status = RequestStatus.RUNNING
    return processor, request, finished


def test_a_report_of_two_tokens_counts_both_and_names_the_last_as_the_stop_token(tokenizer):
    # Kills: num_generated_tokens += 1 (O5); stop_reason from new_ids[0] (O18).
    word, stop = tokenizer.encode(" hello world", add_special_tokens=False)[:2]
    assert EOS not in (word, stop) and word != stop
    params = SamplingParams(max_tokens=8, stop_token_ids=(stop,))
    processor, request, _ = processor_with(tokenizer, "r", [5, 6, 7], params)
    request.output_token_ids = [word, stop]
    request.status = RequestStatus.FINISHED_STOPPED
    out = processor.report(request, 1.0, {})
    assert processor.num_generated_tokens == 2
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == tokenizer.decode([word]) == " hello"  # the stop token's text left out
    assert processor.num_tracked() == 0


def test_a_report_without_a_new_token_keeps_the_requests_logprobs(tokenizer):
    # Kills: add_logprobs called with no new ids, which drops the request's logprobs (O3).
    params = SamplingParams(max_tokens=8, logprobs=1)
    processor, request, _ = processor_with(tokenizer, "r", [5, 6, 7], params)
    assert processor.report(request, 0.0, {}).logprobs == ()
    request.output_token_ids.append(9)
    entry = TokenLogprobs(9, -0.5, ((9, -0.5),), 1)
    assert processor.report(request, 1.0, {"r": entry}).logprobs == (entry,)


def test_two_new_tokens_with_one_entry_drop_the_logprobs_rather_than_misalign_them(tokenizer):
    # Kills: len(new_ids) >= 1 in add_logprobs (O27): the entry of the first token would stand for
    # both, and every later entry sit one place early.
    params = SamplingParams(max_tokens=8, logprobs=1)
    processor, _, _ = processor_with(tokenizer, "r", [5, 6, 7], params)
    assert processor.add_logprobs("r", [9, 10], {"r": TokenLogprobs(9, -0.5, ())}) is None


def test_prompt_logprobs_are_reported_only_once_every_position_has_them(tokenizer):
    # Kills: len(known) >= num_prompt_tokens - 1 (O24), which reported a prompt one position short.
    params = SamplingParams(max_tokens=8, prompt_logprobs=0)
    processor, request, _ = processor_with(tokenizer, "r", [5, 6, 7, 8], params)
    entries = [TokenLogprobs(t, -float(t), ()) for t in (6, 7, 8)]
    processor.add_prompt_logprobs({"r": PromptLogprobs(1, tuple(entries[:2]))})
    assert processor.report(request, 0.0, {}).prompt_logprobs is None
    processor.add_prompt_logprobs({"r": PromptLogprobs(3, tuple(entries[2:]))})
    assert processor.report(request, 1.0, {}).prompt_logprobs == (None, *entries)


# ---- the detokenizer ---------------------------------------------------------------------------
class SkippedTokenTokenizer(LeadingSpaceDroppingTokenizer):
    """Llama-style pieces and one that decodes to nothing (a special token, skipped): id 7."""

    PIECES = LeadingSpaceDroppingTokenizer.PIECES + ("",)


def test_a_token_that_decodes_to_nothing_does_not_move_the_window():
    # Kills: len(full) < start (D4): the window then slid past the last word, and the next word,
    # decoded at the start of a window, lost its space ("worldhow").
    tok = SkippedTokenTokenizer()
    prompt, reply = [0], [1, 7, 2, 7, 7, 3]
    full = tok.decode(prompt + reply)
    assert incremental_text(tok, prompt, reply) == full[len(tok.decode(prompt)):] == " world how are"


def test_a_stream_holds_back_the_longest_stop_string_less_one_character():
    # Kills: a hold-back of the whole longest stop (D14). Hand count: "never here" is 10
    # characters, so all but the last 9 of the text are out after every step.
    tok = LeadingSpaceDroppingTokenizer()
    stops = ("zz", "never here")
    state = DetokenizerState.for_prompt([0])
    shown = ""
    for token in [1, 2, 3, 4, 5]:
        assert advance(tok, state, [token], stops) is None
        shown += release(state, stops, finished=False)
        assert shown == state.text[:max(0, len(state.text) - 9)]
    assert state.text == " world how are you!" and shown == " world how"
    assert shown + release(state, stops, finished=True) == state.text


# ---- the engine ---------------------------------------------------------------------------------
def test_a_kept_stop_string_streams_each_piece_as_it_is_decoded(llm):
    # Kills: release(..., keep_stop=False) in the output processor (O21), which held back the
    # longest stop string less one character although include_stop_str_in_output shows it anyway.
    full = llm.generate(PROMPT, greedy())[0]
    engine = llm.engine
    engine.add_request("kept-stream", PROMPT, greedy(stop=("\x07never\x07",), include_stop_str_in_output=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            decoded = llm.tokenizer.decode(list(output.token_ids), skip_special_tokens=True)
            if not decoded.endswith("\ufffd"):
                assert output.text == decoded, len(output.token_ids)
    assert output.text == full.text and output.finish_reason == "length"


def test_a_stop_string_finishes_the_schedulers_request_as_stopped(llm):
    # Kills: finish_request(..., FINISHED_LENGTH) for a stop string (O15): the output said "stop"
    # while the scheduler's request, which owns the state, said it ran out of length.
    full = llm.generate(PROMPT, greedy())[0]
    stop = stop_string_past_the_middle(full.text, 3)
    engine = llm.engine
    engine.add_request("stopped-by-string", PROMPT, greedy(stop=(stop,)))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop
    assert len(outputs[-1].token_ids) < len(full.token_ids)
    assert engine.scheduler.get_request("stopped-by-string").status is RequestStatus.FINISHED_STOPPED


# ---- the sampler -------------------------------------------------------------------------------
@pytest.mark.parametrize("top_p", [1e-300, 1e-46])
def test_a_top_p_below_float32s_range_keeps_the_likeliest_token(top_p):
    # Kills: dropping `drop[:, 0] = False` (S20). A valid top_p (> 0) this small is 0 in float32:
    # every token's mass before it reaches it, and without the first token kept the row was all
    # zeros, 0 / 0 NaN, and the draw the last token id.
    probs = _filtered_probs(LOGITS, [SamplingParams(top_p=top_p)])
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert Sampler(seed=0).sample(LOGITS, [3], [SamplingParams(top_p=top_p, seed=1)]) == [0]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1e39])
def test_a_logit_that_overflowed_to_inf_is_the_one_drawn(temperature):
    # A float16 model's logit past 65504 is +inf. Kills: isinf for isneginf in within_range (R1),
    # which left it +inf and the softmax NaN; and an unclamped temperature (S9): inf / inf is NaN.
    logits = torch.tensor([[0.0, float("inf"), 1.0, float("-inf")]])
    params = SamplingParams(temperature=temperature, seed=1)
    assert _filtered_probs(logits, [params])[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert Sampler(seed=0).sample(logits, [3], [params]) == [1]


def test_a_row_without_a_cut_keeps_its_softmax_to_the_last_bit():
    # Kills: top_p <= 1.0 choosing the cut rows (S12): every row went through the sort and was
    # renormalised by a sum that is not exactly 1 in float32.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49152, generator=generator) * 3
    probs = _filtered_probs(logits, [SamplingParams()] * 8)
    assert torch.equal(probs, logits.softmax(dim=-1))
