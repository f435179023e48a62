"""Logprobs: each generated token's log-probability and its likeliest alternatives equal HF
transformers' log-softmax over the same tokens (teacher forcing), alone, batched and after
preemption by recompute or swap, greedy or sampled."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampler import LOGPROB_FLOOR, token_logprobs
from hf_reference import hf_logprobs, random_prompts
from scheduler.request import MAX_LOGPROBS, SamplingParams

NUM_TOKENS = 12
TOP = 3
LENGTHS = [30, 45, 60, 3, 70, 18]
ATOL = 1e-4  # a batched forward differs from HF's in the last bits


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    reference = logits.log_softmax(dim=-1)
    entries = token_logprobs(logits, [7, 8, 9], [2, None, 0])
    assert entries[1] is None
    assert entries[2].top == () and entries[2].token_id == 9
    assert entries[2].logprob == pytest.approx(float(reference[2, 9]), abs=1e-6)
    first = entries[0]
    assert first.token_id == 7 and first.logprob == pytest.approx(float(reference[0, 7]), abs=1e-6)
    assert first.rank == 1 + int((reference[0] > reference[0, 7]).sum())
    assert token_logprobs(logits, [int(logits[0].argmax())], [0])[0].rank == 1
    best = reference[0].argsort(descending=True)[:2].tolist()
    assert [token for token, _ in first.top] == best
    assert [value for _, value in first.top] == pytest.approx(reference[0, best].tolist(), abs=1e-6)


def test_a_token_the_model_rules_out_gets_the_floor_not_minus_infinity() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    (entry,) = token_logprobs(logits, [1], [2])
    assert entry.logprob == LOGPROB_FLOOR


def test_sampling_params_bound_logprobs() -> None:
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS
    for bad in (-1, MAX_LOGPROBS + 1, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=3)


def check_against_hf(model_dir, prompt: list[int], output) -> None:
    assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
    reference = hf_logprobs(model_dir, prompt, list(output.token_ids))
    for row, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(reference[row, token]), abs=ATOL)
        assert len(entry.top) == TOP
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(reference[row].topk(TOP).values.tolist(), abs=ATOL)
        for alternative, value in entry.top:
            assert value == pytest.approx(float(reference[row, alternative]), abs=ATOL)


@pytest.mark.parametrize("setting", ["alone", "recompute", "swap"])
def test_greedy_logprobs_match_hf_under_batching_and_preemption(tiny_model_dir, prompts, setting) -> None:
    tight = {} if setting == "alone" else {"num_gpu_blocks": 10, "preemption_mode": setting}
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1, max_num_batched_tokens=64, **tight)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(prompts, params)
    assert (llm.engine.stats().scheduler.num_preemptions > 0) == (setting != "alone")
    for prompt, output in zip(prompts, outputs):
        check_against_hf(tiny_model_dir, prompt, output)
        # Greedy draws the likeliest token: its logprob heads the alternatives.
        assert all(entry.top[0] == (entry.token_id, entry.logprob) for entry in output.logprobs)


def test_sampled_tokens_report_the_models_distribution_not_the_samplers(tiny_model_dir, prompts) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1)
    sampled = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.7, top_p=0.5, seed=5, ignore_eos=True,
                             logprobs=TOP)
    plain = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts[:2], [sampled, plain])
    check_against_hf(tiny_model_dir, prompts[0], outputs[0])
    assert outputs[1].logprobs is None  # not asked for


def test_a_token_without_its_logprobs_drops_the_requests_logprobs_not_the_engine(tiny_model_dir, caplog) -> None:
    # No legal path gets here (one token a step, kept through preemption); should one, the
    # request goes on without logprobs and every other request is untouched.
    from scheduler.output import TokenLogprobs

    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1)
    engine = llm.engine
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, logprobs=1))
    assert engine.output_processor.add_logprobs("r", [5], {"r": TokenLogprobs(6, -1.0, ())}) is None
    assert "without their logprobs" in caplog.text
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].logprobs is None
