"""Logits processors (allowed_token_ids, min_tokens, logit_bias): each edits only the rows that
ask for it, as defined; the engine's greedy tokens under them equal HF's own processors, batched
beside unprocessed requests and after recompute preemption; stop strings wait for min_tokens;
bad values are refused; the server applies what it is sent."""

from __future__ import annotations

import math

import pytest
import torch

from engine.llm import LLM
from engine.logits_processors import (AllowedTokenIds, LogitBias, MinTokens, RequestTensors, default_processors,
                                      process_logits)
from hf_reference import hf_greedy, hf_greedy_processed, random_prompts
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.step import stop_status

EOS = 2
NUM_TOKENS = 8


def request_with(params: SamplingParams, output: list[int] = ()) -> Request:
    request = Request("r", [5, 6], params, arrival_time=0.0, eos_token_id=EOS)
    request.output_token_ids = list(output)
    return request


# ---- definitions, on a six-token vocabulary --------------------------------------------------
def test_each_processor_edits_its_rows_and_nothing_else() -> None:
    logits = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    plain = request_with(SamplingParams())
    assert process_logits(logits, [plain, plain]) is logits
    rows = [request_with(SamplingParams(allowed_token_ids=(1, 4))), plain]
    out = process_logits(logits, rows)
    assert out[0].tolist() == [-math.inf, 1.0, -math.inf, -math.inf, 4.0, -math.inf]
    assert out[1].tolist() == logits[1].tolist() and logits[0, 0] == 0.0  # the other row, and the input, untouched
    biased = request_with(SamplingParams(logit_bias={3: -2.5, 0: 250.0}))  # 250 is clamped to 100
    assert process_logits(logits, [plain, biased])[1].tolist() == [106.0, 7.0, 8.0, 6.5, 10.0, 11.0]


def test_a_requests_tensors_are_built_once_while_it_keeps_coming_back() -> None:
    built = []
    tensors = RequestTensors(lambda request, vocab, device: built.append(request.request_id) or (torch.zeros(1),))
    a, b = (Request(rid, [5, 6], SamplingParams(), arrival_time=0.0, eos_token_id=EOS) for rid in "ab")
    cpu = torch.device("cpu")
    for requests in ([a, b], [a], [b, a]):
        tensors.of(requests, 6, cpu)
    assert built == ["a", "b", "b"]  # b was dropped when a step went without it
    reused = Request("a", [5, 6], SamplingParams(max_tokens=3), arrival_time=0.0, eos_token_id=EOS)
    tensors.of([reused], 6, cpu)
    assert built[-1] == "a" and len(built) == 4  # the same id with other parameters is another request
    again = Request("a", [1, 2], reused.sampling_params, arrival_time=0.0, eos_token_id=EOS)
    tensors.of([again], 6, cpu)
    assert len(built) == 5  # and so is it with the same parameters object: its prompt may differ


def test_a_reused_id_with_the_same_parameters_is_penalized_by_its_own_prompt() -> None:
    processors = default_processors()
    params = SamplingParams(max_tokens=8, repetition_penalty=2.0)
    logits = torch.ones(1, 6)
    first = Request("r", [1, 2], params, arrival_time=0.0, eos_token_id=EOS)
    process_logits(logits, [first], processors)
    second = Request("r", [4, 5], params, arrival_time=0.0, eos_token_id=EOS)
    torch.testing.assert_close(process_logits(logits, [second], processors), process_logits(logits, [second]))
    assert process_logits(logits, [second], processors)[0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]


def test_kept_tensors_give_what_fresh_processors_give_over_steps() -> None:
    processors = default_processors()
    params = SamplingParams(max_tokens=8, allowed_token_ids=(1, 3, 4), logit_bias={4: -1.5}, repetition_penalty=1.5,
                            frequency_penalty=0.5)
    request = request_with(params)
    generator = torch.Generator().manual_seed(0)
    for output in ([], [3], [3, 4], [3, 4, 3]):
        request.output_token_ids = output
        logits = torch.randn(1, 6, generator=generator)
        torch.testing.assert_close(process_logits(logits, [request], processors), process_logits(logits, [request]))


def test_bad_words_rule_out_the_token_that_would_complete_them() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(bad_words_token_ids=[[1], [3, 4], [2, 3, 5]])
    for output, masked in (([], [1]), ([3], [1, 4]), ([2, 3], [1, 4, 5]), ([3, 2], [1]), ([0, 2, 2], [1])):
        out = process_logits(logits, [request_with(params, output)])
        assert [t for t in range(6) if out[0, t] == -math.inf] == masked, output
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[]])


def test_min_tokens_rules_out_the_stop_tokens_until_the_output_reaches_it() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(4, 99))  # 99: beyond the vocabulary
    for output, masked in (([], [EOS, 4]), ([3], [EOS, 4]), ([3, 3], [])):
        out = process_logits(logits, [request_with(params, output)])
        assert [t for t in range(6) if out[0, t] == -math.inf] == masked, output
    # Under ignore_eos the end token is ruled out too (vLLM's rule; it was left free), and so are
    # the model's other end tokens.
    no_eos = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(4,), ignore_eos=True)
    out = process_logits(logits, [request_with(no_eos)])
    assert [t for t in range(6) if out[0, t] == -math.inf] == [EOS, 4]
    other_ends = request_with(no_eos)
    other_ends.extra_eos_token_ids = (1,)
    out = process_logits(logits, [other_ends])
    assert [t for t in range(6) if out[0, t] == -math.inf] == [1, EOS, 4]
    # And a stop token that slips through (every allowed token a stop) does not stop it early.
    early = request_with(params, [EOS])
    assert stop_status(early, EOS, max_model_len=100) is None
    assert stop_status(request_with(params, [3, 3, EOS]), EOS, max_model_len=100) is RequestStatus.FINISHED_STOPPED


def test_an_end_or_stop_token_sampled_last_finishes_as_a_stop() -> None:
    # vLLM v0's order, which the README states (v1 checks the length first): the model did stop.
    params = SamplingParams(max_tokens=3, stop_token_ids=(4,))
    for token in (EOS, 4):
        status = stop_status(request_with(params, [3, 3, token]), token, max_model_len=100)
        assert status is RequestStatus.FINISHED_STOPPED
    assert stop_status(request_with(params, [3, 3, 3]), 3, max_model_len=100) is RequestStatus.FINISHED_LENGTH
    # At the end of the context too.
    assert stop_status(request_with(params, [3, EOS]), EOS, max_model_len=4) is RequestStatus.FINISHED_STOPPED


def test_the_processors_run_in_vllms_order() -> None:
    order = [type(p).__name__ for p in default_processors()]
    assert order == [AllowedTokenIds.__name__, "BadWords", MinTokens.__name__, LogitBias.__name__, "Penalties"]


def test_sampling_params_check_the_new_fields() -> None:
    for bad, field in ((dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=True), "min_tokens"),
                       (dict(max_tokens=4, min_tokens=5), "min_tokens"), (dict(logit_bias={1: math.nan}), "logit_bias"),
                       (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={1: "x"}), "logit_bias"),
                       (dict(logit_bias=[(1,)]), "logit_bias"), (dict(allowed_token_ids=()), "allowed_token_ids"),
                       (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
                       # An int too large for a float is a ValueError too, not an OverflowError.
                       (dict(logit_bias={1: 10**400}), "logit_bias"), (dict(temperature=10**400), "temperature"),
                       (dict(repetition_penalty=10**400), "repetition_penalty")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    params = SamplingParams(logit_bias={7: -300, 2: 1}, allowed_token_ids=[3, 1])
    assert params.logit_bias == ((2, 1.0), (7, -100.0)) and params.allowed_token_ids == (3, 1)
    assert SamplingParams(logit_bias=[[2, 1.0], [7, -300]]) == params.__class__(logit_bias={2: 1, 7: -100})


def test_min_tokens_floors_the_length_the_policies_rank_by() -> None:
    request = request_with(SamplingParams(max_tokens=50, min_tokens=20))
    request.predicted_len = 3.0
    assert request.predicted_total == 20.0
    request.predicted_len = 80.0
    assert request.predicted_total == 50.0


# ---- against HF's processors on the tiny model -------------------------------------------------
@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([30, 46, 14], seed=11)  # each two tokens short of a block boundary


@pytest.fixture(scope="module")
def plain_greedy(tiny_model_dir, prompts) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, NUM_TOKENS)


def cases(prompts, plain_greedy) -> list[tuple[list[int], dict, dict]]:
    """(prompt, SamplingParams extras, hf_greedy_processed extras): each aimed at tokens the plain
    greedy path takes, so that it must change that path."""
    (g0, g1, g2) = plain_greedy
    assert prompts[0][-1] != g0[0]  # HF matches bad words over the prompt too; vLLM, as here, does not
    allowed = sorted({*range(100, 160)} - set(g0))
    return [
        # The second greedy token is a stop token: min_tokens 4 keeps it out of the first four.
        (prompts[1], dict(stop_token_ids=(g1[1],), min_tokens=4), dict(stop_ids=[g1[1]], min_tokens=4)),
        (prompts[0], dict(allowed_token_ids=allowed), dict(stop_ids=[], allowed=allowed)),
        (prompts[2], dict(logit_bias={g2[0]: -100.0, g2[3]: 3.0}), dict(stop_ids=[], logit_bias={g2[0]: -100.0, g2[3]: 3.0})),
        # A two-token word that the greedy path's first two tokens spell, and a one-token word.
        (prompts[0], dict(bad_words_token_ids=((g0[0], g0[1]), (g0[3],))),
         dict(stop_ids=[], bad_words=[[g0[0], g0[1]], [g0[3]]])),
    ]


@pytest.mark.parametrize("setting", ["batched", "recompute"])
def test_processed_greedy_tokens_match_hf(tiny_model_dir, prompts, plain_greedy, setting) -> None:
    tight = {"num_gpu_blocks": 7, "preemption_mode": "recompute"} if setting == "recompute" else {}
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1, max_num_batched_tokens=64, **tight)
    chosen = cases(prompts, plain_greedy)
    base = dict(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    # The processed requests share their batches with unprocessed twins.
    params = [SamplingParams(**base, **extra) for _, extra, _ in chosen] + [SamplingParams(**base)] * len(chosen)
    outputs = llm.generate([p for p, _, _ in chosen] * 2, params)
    assert (llm.engine.stats().scheduler.num_preemptions > 0) == (setting == "recompute")
    for (prompt, _, reference), output, twin in zip(chosen, outputs, outputs[len(chosen):]):
        expected = hf_greedy_processed(tiny_model_dir, prompt, NUM_TOKENS, **reference)
        assert list(output.token_ids) == expected
        assert list(twin.token_ids) == plain_greedy[prompts.index(prompt)]
        assert expected != list(twin.token_ids)  # the processor changed the path: the comparison means something
    min_tokens_output = outputs[0]
    assert len(min_tokens_output.token_ids) > 4 and min_tokens_output.finish_reason in ("stop", "length")


def test_stop_strings_are_searched_only_past_min_tokens(tiny_model_dir, prompts) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1)
    base = dict(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    (plain,) = llm.generate([prompts[0]], SamplingParams(**base))
    stop = llm.engine.tokenizer.decode(plain.token_ids[1:2]).strip()
    assert stop and plain.text.count(stop) == 1
    (early,) = llm.generate([prompts[0]], SamplingParams(**base, stop=(stop,)))
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    (late,) = llm.generate([prompts[0]], SamplingParams(**base, stop=(stop,), min_tokens=3))
    # Its logits are untouched (no stop token ids): the plain path, the stop string kept in the text.
    assert late.token_ids == plain.token_ids and late.text == plain.text and late.finish_reason == "length"


def test_the_engine_refuses_token_ids_it_cannot_honour(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1)
    for params, message in ((SamplingParams(logit_bias={49152: 1.0}), "logit_bias names token ids outside"),
                            (SamplingParams(allowed_token_ids=(3, 49999)), "allowed_token_ids names token ids outside"),
                            (SamplingParams(allowed_token_ids=(EOS,), min_tokens=2), "only stop tokens")):
        with pytest.raises(ValueError, match=message):
            llm.engine.add_request("x", [5, 6, 7], params)
    assert not llm.engine.has_unfinished_requests()


# ---- through the server ------------------------------------------------------------------------
def test_the_server_applies_bias_allowed_ids_and_min_tokens(tiny_model_dir) -> None:
    from test_server import MODEL, error_of, openai_client, post, serving, tiny_engine

    engine = tiny_engine(tiny_model_dir)
    tokenizer = engine.tokenizer
    favourite = tokenizer.encode(" blue", add_special_tokens=False)[0]
    with serving(engine) as (base_url, _):
        client = openai_client(base_url)
        kwargs = dict(model=MODEL, prompt="Colours:", max_tokens=3, temperature=0)
        biased = client.completions.create(logit_bias={str(favourite): 100}, extra_body={"ignore_eos": True}, **kwargs)
        assert biased.choices[0].text == tokenizer.decode([favourite] * 3)
        allowed = client.completions.create(extra_body={"allowed_token_ids": [favourite], "ignore_eos": True}, **kwargs)
        assert allowed.choices[0].text == biased.choices[0].text
        # The favoured token is a stop token: it ends the reply at once, or after min_tokens others.
        stopping = {"stop_token_ids": [favourite], "ignore_eos": True}
        kwargs["max_tokens"] = 8
        at_once = client.completions.create(logit_bias={str(favourite): 100}, extra_body=stopping, **kwargs)
        assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
        later = client.completions.create(logit_bias={str(favourite): 100}, extra_body={**stopping, "min_tokens": 3}, **kwargs)
        assert later.usage.completion_tokens == 4 and later.choices[0].finish_reason == "stop"
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "min_tokens": 3}
        assert error_of(post(base_url, "/v1/completions", body), 400)["param"] == "min_tokens"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2, "min_tokens": 5}
        assert "max_completion_tokens allows" in error_of(post(base_url, "/v1/chat/completions", chat), 400)["message"]


def test_the_server_rules_out_bad_words(tiny_model_dir) -> None:
    from test_server import MODEL, error_of, openai_client, post, serving, tiny_engine

    engine = tiny_engine(tiny_model_dir)
    with serving(engine) as (base_url, _):
        client = openai_client(base_url)
        kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=0)
        free = client.completions.create(extra_body={"ignore_eos": True}, **kwargs).choices[0].logprobs.tokens
        encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731

        def one_token_either_way(token: str) -> bool:
            # vLLM's rule bans a word's spaced form only where it has as many tokens as the bare one.
            return token.startswith(" ") and token[1:].isalpha() and len(encode(token[1:])) == len(encode(token)) == 1

        at = next(i for i, token in enumerate(free) if one_token_either_way(token))
        word = free[at].strip()  # mid-text, so its spaced form is the token generated
        banned = client.completions.create(extra_body={"ignore_eos": True, "bad_words": [word]}, **kwargs)
        tokens = banned.choices[0].logprobs.tokens
        assert tokens[:at] == free[:at] and tokens[at] != free[at] and free[at] not in tokens
        for bad in ([""], ["x"] * 129, "word"):
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "bad_words": bad}
            assert error_of(post(base_url, "/v1/completions", body), 400)["param"].startswith("bad_words")


def test_a_processor_for_some_rows_edits_what_the_earlier_ones_left() -> None:
    # Row 0's bias runs on its row alone (row 1 asks for none) and must keep the mask that
    # allowed_token_ids put there before it, as a batch of that row alone gets.
    logits = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    masked = request_with(SamplingParams(allowed_token_ids=(1, 4), logit_bias={4: 1.0, 0: 1.0}))
    out = process_logits(logits, [masked, request_with(SamplingParams())])
    assert out[0].tolist() == [-math.inf, 1.0, -math.inf, -math.inf, 5.0, -math.inf]
    assert out[1].tolist() == logits[1].tolist()
    assert out[0].tolist() == process_logits(logits[:1], [masked])[0].tolist()


def test_a_stop_string_in_the_min_tokens_th_token_is_not_searched_as_in_vllm(tiny_model_dir, prompts) -> None:
    # vLLM searches stop strings once the output holds more than min_tokens tokens: a stop string
    # that the third token completes stops a request of min_tokens 2, not one of min_tokens 3.
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1)
    base = dict(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    (plain,) = llm.generate([prompts[0]], SamplingParams(**base))
    stop = llm.engine.tokenizer.decode(plain.token_ids[2:3]).strip()
    assert stop and plain.text.count(stop) == 1 and stop not in llm.engine.tokenizer.decode(plain.token_ids[:2])
    (stopped,) = llm.generate([prompts[0]], SamplingParams(**base, stop=(stop,), min_tokens=2))
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 3
    (late,) = llm.generate([prompts[0]], SamplingParams(**base, stop=(stop,), min_tokens=3))
    assert late.finish_reason == "length" and late.text == plain.text
