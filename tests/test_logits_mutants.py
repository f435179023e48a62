"""Logits processors and penalties against a reference written here from vLLM's documented
semantics (not from the engine's code): random logits, histories and mixed batches, plus the
edge cases a mutation check (session 38: 86 one-line mutants of engine/penalties.py and
engine/logits_processors.py, 62 killed by their tests, 15 equivalent, 9 gaps, 2 of them killed
elsewhere in the suite) found unguarded: raw logits kept, the last vocabulary id, masked tokens
kept masked, bad words matched over the output only, the bias's precision."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.logits_processors import default_processors, process_logits
from engine.penalties import apply_penalties
from scheduler.request import Request, SamplingParams
from test_logits_processors import EOS, request_with

VOCAB = 6


def reference_row(logits: list[float], request: Request) -> list[float]:
    """One row through vLLM's processors, token by token, in float32 (torch scalars): allowed
    ids, bad words (over the output), min_tokens (EOS, extra EOS and stop ids), logit bias, then
    the repetition penalty over prompt and output, frequency and presence over the output."""
    p, prompt, output = request.sampling_params, request.prompt_token_ids, request.output_token_ids
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    row = [f32(v) for v in logits]
    n = len(row)
    ninf = f32(-math.inf)
    if p.allowed_token_ids is not None:
        row = [v if t in p.allowed_token_ids else ninf for t, v in enumerate(row)]
    for word in p.bad_words_token_ids:
        prefix = list(word[:-1])
        if len(output) >= len(prefix) and (not prefix or list(output[-len(prefix):]) == prefix) and word[-1] < n:
            row[word[-1]] = ninf
    if len(output) < p.min_tokens:
        for t in (request.eos_token_id, *request.extra_eos_token_ids, *p.stop_token_ids):
            if t is not None and t < n:
                row[t] = ninf
    for t, b in p.logit_bias:
        if t < n:
            row[t] = row[t] + f32(b)
    if p.repetition_penalty != 1.0:
        factor = f32(p.repetition_penalty)
        for t in set(prompt) | set(output):
            if t < n and not math.isinf(row[t].item()):
                row[t] = row[t] / factor if row[t] > 0 else row[t] * factor
    for t in set(output):
        if t < n:
            row[t] = row[t] - f32(p.frequency_penalty) * f32(output.count(t)) - f32(p.presence_penalty)
    return [v.item() for v in row]


def random_request(rng: random.Random, rid: str) -> Request:
    def ids(k):
        return tuple(rng.randrange(VOCAB) for _ in range(k))

    kwargs = {}
    if rng.random() < 0.4:
        kwargs["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if rng.random() < 0.4:
        kwargs["frequency_penalty"] = rng.choice([-1.0, 0.5, 1.25])
    if rng.random() < 0.4:
        kwargs["presence_penalty"] = rng.choice([-0.5, 0.75])
    if rng.random() < 0.3:
        kwargs["logit_bias"] = {t: rng.choice([-3.0, 0.1, 2.5]) for t in ids(rng.randint(1, 3))}
    if rng.random() < 0.3:
        kwargs["allowed_token_ids"] = tuple(sorted(set(ids(rng.randint(2, 4)))))
    if rng.random() < 0.3:
        kwargs["bad_words_token_ids"] = [ids(rng.randint(1, 3)) for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.3:
        kwargs["min_tokens"], kwargs["stop_token_ids"] = rng.randint(1, 4), ids(rng.randint(0, 2))
    request = Request(rid, list(ids(rng.randint(1, 5))), SamplingParams(max_tokens=8, **kwargs), arrival_time=0.0,
                      eos_token_id=EOS)
    request.output_token_ids = list(ids(rng.randint(0, 5)))
    if rng.random() < 0.2:
        request.extra_eos_token_ids = (rng.randrange(VOCAB),)
    return request


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_the_reference(seed) -> None:
    rng = random.Random(seed)
    processors = default_processors()
    for step in range(60):
        requests = [random_request(rng, f"{step}-{i}") for i in range(rng.randint(1, 5))]
        logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(seed * 1000 + step)) * 3
        raw = logits.clone()
        out = process_logits(logits, requests, processors)
        assert torch.equal(logits, raw)  # the raw logits (logprobs come from them) never change
        expected = torch.tensor([reference_row(raw[r].tolist(), q) for r, q in enumerate(requests)])
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6, equal_nan=False)


def test_penalties_of_a_mixed_batch_match_the_reference() -> None:
    # Unpenalized rows first and between, a frequency-only row, a repetition-only row: each
    # row's penalties land on its own row.
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -0.5, 2.0]] * 5)
    params = [SamplingParams(), SamplingParams(frequency_penalty=0.5), SamplingParams(),
              SamplingParams(repetition_penalty=2.0), SamplingParams(presence_penalty=1.0, repetition_penalty=0.5)]
    histories = [([0], [1]), ([5], [2, 2, 1]), ([3], [3]), ([0, 1], [2]), ([4], [0, 0])]
    out = apply_penalties(logits, params, histories)
    requests = []
    for p, (prompt, output) in zip(params, histories):
        request = Request("x", list(prompt), p, arrival_time=0.0, eos_token_id=None)
        request.output_token_ids = list(output)
        requests.append(request)
    expected = torch.tensor([reference_row(logits[r].tolist(), q) for r, q in enumerate(requests)])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("extra", [dict(logit_bias={3: 1.5}), dict(bad_words_token_ids=[[3]]),
                                   dict(min_tokens=2, stop_token_ids=(3,)), dict(allowed_token_ids=(1, 3)),
                                   dict(repetition_penalty=2.0)])
def test_a_processor_on_every_row_leaves_the_raw_logits_alone(extra) -> None:
    # The module's promise (logprobs are read from the raw logits): a batch where each row wants
    # the processor, so that no row selection copies the logits first.
    logits = torch.arange(12, dtype=torch.float32).reshape(2, VOCAB) - 4.0
    raw = logits.clone()
    params = SamplingParams(max_tokens=8, **extra)
    first, second = request_with(params, [5]), request_with(params, [5])
    second.request_id = "s"  # the engine refuses a request id in use: a batch's ids are distinct
    out = process_logits(logits, [first, second], default_processors())
    assert torch.equal(logits, raw) and not torch.equal(out, raw)


def test_a_bias_on_the_last_token_id_is_applied() -> None:
    logits = torch.zeros(1, VOCAB)
    out = process_logits(logits, [request_with(SamplingParams(logit_bias={VOCAB - 1: 2.0, 0: -1.0}))])
    assert out[0].tolist() == [-1.0, 0.0, 0.0, 0.0, 0.0, 2.0]


def test_a_bias_keeps_float32_precision() -> None:
    logits = torch.zeros(1, VOCAB)
    out = process_logits(logits, [request_with(SamplingParams(logit_bias={1: 0.1, 2: 33.3}))])
    assert out[0, 1].item() == torch.tensor(0.1).item() and out[0, 2].item() == torch.tensor(33.3).item()


def test_the_repetition_penalty_reaches_the_last_token_id_of_the_prompt() -> None:
    logits = torch.full((1, VOCAB), 2.0)
    request = Request("r", [VOCAB - 1, 0], SamplingParams(repetition_penalty=2.0), arrival_time=0.0, eos_token_id=EOS)
    out = process_logits(logits, [request], default_processors())
    assert out[0].tolist() == [1.0, 2.0, 2.0, 2.0, 2.0, 1.0]


@pytest.mark.parametrize("penalty", [0.5, 2.0, 1e39])
def test_a_seen_token_the_mask_ruled_out_stays_ruled_out_under_the_repetition_penalty(penalty) -> None:
    # Tokens 1 and 2 are in the prompt and outside allowed_token_ids: -inf before the penalty, -inf after.
    logits = torch.tensor([[1.0, 2.0, -3.0, 0.5, -1.0, 4.0]])
    params = SamplingParams(allowed_token_ids=(0, 3), repetition_penalty=penalty)
    request = Request("r", [1, 2, 0], params, arrival_time=0.0, eos_token_id=EOS)
    out = process_logits(logits, [request], default_processors())
    assert torch.isneginf(out[0, [1, 2, 4, 5]]).all() and torch.isfinite(out[0, [0, 3]]).all()


def test_bad_words_are_matched_over_the_output_not_the_prompt() -> None:
    # vLLM matches a word's prefix against the generated tokens only: a prompt ending with the
    # prefix (or a prefix spanning prompt and output) bans nothing.
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(bad_words_token_ids=[[3, 4], [2, 3, 5]])
    for prompt, output, masked in (([1, 3], [], []), ([1, 2], [3], [4]), ([1], [2, 3], [4, 5])):
        request = Request("r", prompt, params, arrival_time=0.0, eos_token_id=EOS)
        request.output_token_ids = output
        out = process_logits(logits, [request])
        assert [t for t in range(VOCAB) if out[0, t] == -math.inf] == masked, (prompt, output)


def test_half_precision_logits_keep_their_dtype_and_range() -> None:
    # The engine's logits are float32 today, but both modules are written for the logits' own
    # dtype: a bias is cast to it, and a penalty past float16's range is as strong as float16 allows
    # (a seen positive logit lowered yet still positive, a negative one at float16's lowest).
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]], dtype=torch.float16)
    out = process_logits(logits, [request_with(SamplingParams(logit_bias={1: 0.5, 5: -2.0}))])
    assert out.dtype == torch.float16 and out[0].tolist() == [2.0, -0.5, 0.5, 3.0, -2.0, -2.0]
    weakest = apply_penalties(logits, [SamplingParams(repetition_penalty=1e50)], [([0, 1], [3])])
    assert weakest.dtype == torch.float16 and torch.isfinite(weakest).all()
    assert 0 < weakest[0, 0] < 2.0 and 0 < weakest[0, 3] < 3.0 and weakest[0, 1] == -torch.finfo(torch.float16).max
    assert weakest[0, [2, 4, 5]].tolist() == [0.5, -2.0, 0.0]


def test_the_penalties_processor_counts_frequency_and_presence_over_the_output_only() -> None:
    # OpenAI's and vLLM's definition: the prompt's tokens (1, and 2 twice) count for neither.
    logits = torch.zeros(1, VOCAB)
    request = Request("r", [1, 2, 2], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), arrival_time=0.0,
                      eos_token_id=EOS)
    request.output_token_ids = [2, 3, 3]
    out = process_logits(logits, [request], default_processors())
    assert out[0].tolist() == [0.0, 0.0, -0.75, -1.25, 0.0, 0.0]
