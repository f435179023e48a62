"""Presence, frequency and repetition penalties: the engine's greedy tokens under them equal a
reference loop over HF transformers (its own repetition-penalty processor), alone, batched and
after preemption; logprobs stay the raw model's; bad values are refused."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.logits_processors import default_processors, process_logits
from engine.penalties import apply_penalties
from engine.sampler import Sampler
from hf_reference import hf_greedy_penalized, hf_logprobs, random_prompts
from scheduler.request import Request, SamplingParams

NUM_TOKENS = 10
LENGTHS = [30, 45, 3, 60]
# A random model rarely repeats a token within ten, so a penalty against repeats barely moves its
# greedy path; a repetition penalty below 1 and negative ones favour repeats, and do.
PENALTIES = [dict(repetition=0.3), dict(frequency=-2.0), dict(presence=-1.5),
             dict(repetition=1.6, frequency=0.7, presence=0.4)]


def params_for(penalties: dict, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                          repetition_penalty=penalties.get("repetition", 1.0),
                          frequency_penalty=penalties.get("frequency", 0.0),
                          presence_penalty=penalties.get("presence", 0.0), **extra)


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    plain = SamplingParams()
    penalized = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [penalized, plain], [([0], [1, 3, 3]), ([0], [1])])
    # token 0: in the prompt only; 1: output once (negative: multiplied); 3: output twice; 2, 4: unseen
    assert out[0].tolist() == pytest.approx([1.0, -2.0 - 0.5 - 0.25, 0.5, 1.5 - 1.0 - 0.25, -2.0])
    assert out[1].tolist() == logits[1].tolist() and logits[0, 0] == 2.0  # other rows, and the input, untouched
    assert apply_penalties(logits, [plain, plain], [([], []), ([], [])]) is logits


def test_a_repetition_penalty_beyond_float32_is_as_strong_as_can_be_not_nan() -> None:
    # 1e-50 is 0 in float32 and 1e50 inf: the division gave inf, the sampler's softmax NaN, and
    # every draw the last token id. Now the seen positive logits lead (or fall behind) together.
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    history = [([0, 1], [3])]
    strongest = apply_penalties(logits, [SamplingParams(repetition_penalty=1e-50)], history)
    weakest = apply_penalties(logits, [SamplingParams(repetition_penalty=1e50)], history)
    assert torch.isfinite(strongest).all() and torch.isfinite(weakest).all()
    assert strongest[0, 0] > 1e38 and strongest[0, 3] > 1e38 and strongest[0, 1] > -1e-37  # seen: raised
    assert weakest[0, 1] < -1e38 and 0 < weakest[0, 3] < 1e-37  # seen: lowered
    assert strongest[0, [2, 4]].tolist() == weakest[0, [2, 4]].tolist() == [0.5, -2.0]  # unseen: as they were
    assert strongest.softmax(dim=-1)[0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_a_huge_repetition_penalty_keeps_the_allowed_tokens_finite_and_the_masked_masked() -> None:
    # A negative logit times 1e39 was -inf: with every allowed token seen and negative, the row
    # was all -inf, and the sampler drew token 0 (greedy) or the last id, outside the allowed set.
    logits = torch.full((1, 100), -3.0)
    logits[0, 50] = 5.0
    for temperature in (0.0, 1.0, 0.5):
        params = SamplingParams(temperature=temperature, repetition_penalty=1e39, allowed_token_ids=(7, 8, 9))
        request = Request("r", [7, 8, 9, 1], params, 0.0, eos_token_id=2)
        processed = process_logits(logits, [request], default_processors())
        assert torch.isfinite(processed[0, 7:10]).all() and torch.isneginf(processed[0, 50])
        assert Sampler(seed=0).sample(processed, [4], [params])[0] in (7, 8, 9)


def test_an_out_of_range_stop_token_id_under_min_tokens_is_left_alone(tiny_model_dir) -> None:
    # Any integer >= 0 is a stop token id; one past 2**63 overflowed int64 in min_tokens' mask,
    # which raised in the engine thread and took the server down for every client.
    llm = LLM(str(tiny_model_dir), max_model_len=64, num_gpu_blocks=16, num_threads=1)
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True, min_tokens=2)
    plain = llm.generate([[5, 6, 7]], SamplingParams(**params))[0]
    huge = llm.generate([[5, 6, 7]], SamplingParams(**params, stop_token_ids=(2**64 + 3, 10**30)))[0]
    assert huge.token_ids == plain.token_ids and huge.finish_reason == "length"


def test_sampling_params_bound_the_penalties() -> None:
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-2.1), dict(repetition_penalty=0.0),
                dict(repetition_penalty=float("inf")), dict(presence_penalty=float("nan")), dict(frequency_penalty="1")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=-2.0).penalized


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=5)


@pytest.mark.parametrize("setting", ["batched", "recompute"])
def test_penalized_greedy_tokens_match_hf(tiny_model_dir, prompts, setting) -> None:
    tight = {"num_gpu_blocks": 7, "preemption_mode": "recompute"} if setting == "recompute" else {}
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1, max_num_batched_tokens=64, **tight)
    # One request per penalty setting, all in one batch, with an unpenalized twin of each.
    params = [params_for(p) for p in PENALTIES] + [params_for({})] * len(PENALTIES)
    outputs = llm.generate(prompts + prompts, params)
    assert (llm.engine.stats().scheduler.num_preemptions > 0) == (setting == "recompute")
    changed = 0
    for prompt, penalties, output, twin in zip(prompts, PENALTIES, outputs, outputs[len(prompts):]):
        assert list(output.token_ids) == hf_greedy_penalized(tiny_model_dir, prompt, NUM_TOKENS, **penalties)
        changed += output.token_ids != twin.token_ids
    assert changed >= 2  # the penalties moved the greedy path: the comparison means something


def test_logprobs_stay_the_raw_models_under_penalties(tiny_model_dir, prompts) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1)
    (output,) = llm.generate(prompts[:1], params_for(PENALTIES[0], logprobs=1))
    reference = hf_logprobs(tiny_model_dir, prompts[0], list(output.token_ids))
    for row, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert entry.logprob == pytest.approx(float(reference[row, token]), abs=1e-4)


def test_the_server_applies_the_penalties_and_min_p_it_is_sent(tiny_model_dir) -> None:
    from test_server import MAX_MODEL_LEN, MODEL, error_of, openai_client, post, serving, tiny_engine

    engine = tiny_engine(tiny_model_dir)
    chat = [{"role": "user", "content": "Name three colours."}]
    text = engine.apply_chat_template(chat)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    penalties = dict(repetition=0.3, frequency=-1.0, presence=0.5)
    offline = LLM(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, num_threads=1)
    (expected,) = offline.generate([ids], params_for(penalties))
    (plain,) = offline.generate([ids], params_for({}))
    assert expected.text != plain.text
    with serving(engine) as (base_url, _):
        client = openai_client(base_url)
        reply = client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=NUM_TOKENS, temperature=0, frequency_penalty=-1.0,
            presence_penalty=0.5, extra_body={"repetition_penalty": 0.3, "ignore_eos": True})
        assert reply.choices[0].message.content == expected.text
        # min_p 1 keeps only the likeliest token: sampling at temperature 1 gives the greedy reply.
        kwargs = dict(model=MODEL, messages=chat, max_tokens=NUM_TOKENS, extra_body={"ignore_eos": True})
        greedy = client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content
        kwargs["extra_body"]["min_p"] = 1.0
        assert client.chat.completions.create(temperature=1.0, seed=3, **kwargs).choices[0].message.content == greedy
        for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
            body = {"model": MODEL, "messages": chat, "max_tokens": 2, field: value}
            assert error_of(post(base_url, "/v1/chat/completions", body), 400)["param"] == field


def test_token_ids_keep_exactly_those_inside_the_vocabulary() -> None:
    from engine.penalties import token_ids

    ids = token_ids([0, 4, 5, 6, 2**64 + 3], vocab=5, device=torch.device("cpu"))
    assert ids.tolist() == [0, 4] and ids.dtype == torch.long
    # A stop id equal to the vocabulary size is no token either: penalizing it would index past the row.
    logits = torch.zeros(1, 5)
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)], [([5], [5, 1])])
    assert out[0].tolist() == [0.0, -1.0, 0.0, 0.0, 0.0]


def test_presence_alone_is_subtracted_once_per_seen_token() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_penalties(logits, [SamplingParams(presence_penalty=0.75)], [([2], [1, 3, 3])])
    assert out[0].tolist() == [2.0, -1.75, 0.5, 2.25]  # the prompt's token 2 is no output: untouched
    out = apply_penalties(logits, [SamplingParams(frequency_penalty=0.5)], [([2], [1, 3, 3])])
    assert out[0].tolist() == [2.0, -1.5, 0.5, 2.0]


def test_a_logit_divided_past_float32_stays_finite() -> None:
    # 5 / float32's smallest normal is past its range: the logit keeps to the largest float.
    logits = torch.tensor([[5.0, 1.0]])
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=1e-50)], [([0], [])])
    assert out[0].tolist() == [torch.finfo(torch.float32).max, 1.0]
