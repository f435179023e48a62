"""Prompt logprobs: each prompt token's log-probability, rank and likeliest alternatives equal HF
transformers' log-softmax over the prompt, whether the prompt is prefilled whole or in chunks,
beside requests that ask for none, and after a recompute preemption re-prefills it (each
position scored and reported once)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from hf_reference import hf_model, random_prompts
from scheduler.request import MAX_LOGPROBS, SamplingParams

TOP = 3
LENGTHS = [30, 46, 14, 30]  # each two tokens short of a block boundary, so decodes need blocks
ATOL = 1e-4  # a batched forward differs from HF's in the last bits


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the distribution prompt[p + 1] came from."""
    with torch.inference_mode():
        return hf_model(model_dir)(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)


def assert_matches_hf(model_dir, prompt: list[int], entries) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    reference = hf_prompt_logprobs(model_dir, prompt)
    for position, entry in enumerate(entries[1:], start=1):
        row = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=ATOL)
        value = row[entry.token_id]
        # Tokens within ATOL of it may rank either side of it.
        assert 1 + int((row > value + ATOL).sum()) <= entry.rank <= 1 + int((row > value - ATOL).sum())
        assert [value for _, value in entry.top] == pytest.approx(row.topk(TOP).values.tolist(), abs=ATOL)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=21)


@pytest.mark.parametrize("setting", ["whole", "chunked", "recompute"])
def test_prompt_logprobs_match_hf(tiny_model_dir, prompts, setting) -> None:
    options = {"whole": {}, "chunked": {"max_num_batched_tokens": 16, "max_num_seqs": 16},
               "recompute": {"num_gpu_blocks": 9, "preemption_mode": "recompute", "max_num_batched_tokens": 32}}
    llm = LLM(str(tiny_model_dir), max_model_len=256, num_threads=1, **options[setting])
    scored: dict[str, int] = {}  # prompt positions the runner scored, per request
    add = llm.engine.output_processor.add_prompt_logprobs

    def counting(found):
        for request_id, chunk in found.items():
            scored[request_id] = scored.get(request_id, 0) + len(chunk.entries)
        add(found)

    llm.engine.output_processor.add_prompt_logprobs = counting
    asking = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # All but the second ask, so rows that do and rows that do not share steps.
    outputs = llm.generate(prompts, [plain if i == 1 else asking for i in range(len(prompts))])
    # Under recompute, a request that asks is preempted and re-prefilled: its positions come twice.
    assert any(out.num_preemptions for i, out in enumerate(outputs) if i != 1) == (setting == "recompute")
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        if index == 1:
            assert output.prompt_logprobs is None
        else:
            assert_matches_hf(tiny_model_dir, prompt, output.prompt_logprobs)
    # Each position is scored once, a re-prefill included: it skips the positions held.
    assert sorted(scored.values()) == sorted(len(p) - 1 for i, p in enumerate(prompts) if i != 1)
    free = llm.engine.scheduler.block_manager
    assert free.num_free_blocks == free.num_total_blocks and llm.engine.output_processor.num_tracked() == 0


def test_a_one_token_prompt_has_one_entry_and_the_count_is_bounded(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=64, num_threads=1)
    (output,) = llm.generate([[7]], SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert output.prompt_logprobs == (None,)
    for bad in (-1, MAX_LOGPROBS + 1, True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_a_position_scored_again_keeps_its_first_score() -> None:
    from engine.output_processor import OutputProcessor
    from scheduler.output import PromptLogprobs, TokenLogprobs

    from scheduler.request import Request

    processor = OutputProcessor(tokenizer=None, finish_request=lambda *args: None)
    request = Request("r", [4, 5, 6, 7], SamplingParams(prompt_logprobs=0), arrival_time=0.0, eos_token_id=2)
    processor.add("r", request.prompt_token_ids, request.sampling_params)
    first = [TokenLogprobs(token, -1.0, ()) for token in (5, 6)]
    processor.add_prompt_logprobs({"r": PromptLogprobs(1, tuple(first))})
    again = [TokenLogprobs(token, -2.0, ()) for token in (6, 7)]  # position 2 once more, then 3
    processor.add_prompt_logprobs({"r": PromptLogprobs(2, tuple(again))})
    assert processor.prompt_logprobs_held("r") == 4
    assert processor._reported_prompt_logprobs(request) == (None, first[0], first[1], again[1])
