"""Sampler filters (top-k, top-p, min-p, temperature) and draws against exact distributions."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, _filtered_probs
from scheduler.request import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_top_k_keeps_the_k_most_likely():
    probs = _filtered_probs(LOGITS, [SamplingParams(top_k=2)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_top_k_keeps_every_token_tied_with_the_kth():
    probs = _filtered_probs(torch.tensor([[1.0, 2.0, 3.0, 2.0]]), [SamplingParams(top_k=2)])
    assert (probs[0] > 0).tolist() == [False, True, True, True]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = _filtered_probs(LOGITS, [SamplingParams(top_p=0.8)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = _filtered_probs(LOGITS, [SamplingParams(top_p=0.81)])
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    # The most likely token always survives.
    probs = _filtered_probs(LOGITS, [SamplingParams(top_p=0.1)])
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    # 0.15 and 0.05 fall below 0.4 * 0.5 = 0.2; the rest is renormalized.
    probs = _filtered_probs(LOGITS, [SamplingParams(min_p=0.4)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # After temperature, as vLLM orders them: at temperature 2 the share is read from sqrt(p).
    probs = _filtered_probs(LOGITS, [SamplingParams(min_p=0.5, temperature=2.0)])
    assert (probs[0] > 0).tolist() == [True, True, True, False]  # sqrt(.15 / .5) = 0.55 > 0.5 > sqrt(.1)
    assert _filtered_probs(LOGITS, [SamplingParams(min_p=1.0)])[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p_is_bounded():
    for bad in (-0.1, 1.5, "0.1"):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)


def test_temperature_scales_logits():
    probs = _filtered_probs(LOGITS, [SamplingParams(temperature=0.5)])
    expected = torch.tensor([[0.5, 0.3, 0.15, 0.05]]) ** 2
    torch.testing.assert_close(probs, expected / expected.sum())


def test_rows_get_their_own_filters():
    logits = LOGITS.repeat(2, 1)
    probs = _filtered_probs(logits, [SamplingParams(top_k=1), SamplingParams()])
    torch.testing.assert_close(probs[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_draws_follow_the_distribution():
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = sampler.sample(LOGITS.repeat(4000, 1), [7] * 4000, params)
    frequencies = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)


def test_greedy_rows_take_the_argmax_and_seeded_draws_depend_only_on_seed_and_position():
    sampler = Sampler(seed=0)
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=3), SamplingParams(seed=4)]
    tokens = sampler.sample(logits, [5, 5, 5], params)
    assert tokens[0] == int(logits[0].argmax())
    # Another engine seed, draws in between, another batch: the same token at the same position.
    fresh = Sampler(seed=123)
    fresh.sample(logits, [9, 9, 9], [SamplingParams(), SamplingParams(seed=3), SamplingParams(seed=3)])
    assert fresh.sample(logits[1:2], [5], [SamplingParams(seed=3)]) == [tokens[1]]
    # Over positions, a seed's draws follow the distribution (they are not one number repeated).
    many = [Sampler(seed=0).sample(LOGITS, [p], [SamplingParams(seed=3)])[0] for p in range(2000)]
    frequencies = torch.bincount(torch.tensor(many), minlength=4).float() / 2000
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04, rtol=0)
    # ...and another seed draws another sequence (a sampler that ignored the seed passed the above).
    other = [Sampler(seed=0).sample(LOGITS, [p], [SamplingParams(seed=4)])[0] for p in range(50)]
    assert other != many[:50]


def test_position_seeds_differ_for_neighbouring_seeds_and_positions():
    from engine.sampler import position_seed

    seeds = {position_seed(seed, position) for seed in (-1, 0, 1, 2, 2**64 - 1) for position in range(50)}
    assert len(seeds) == 5 * 50 - 50  # -1 and 2**64 - 1 are the same 64-bit seed
    assert all(0 <= s < 2**32 for s in seeds)

def test_a_temperature_beyond_float32_keeps_the_masks_it_is_given():
    # 1e39 was inf in float32: a masked logit became -inf / inf = NaN and the draw the last token
    # id, outside what allowed_token_ids or min_tokens allowed. Now: uniform over the unmasked.
    logits = torch.tensor([[1.0, float("-inf"), 3.0, float("-inf")]])
    for temperature in (1e39, 1e300):
        probs = _filtered_probs(logits, [SamplingParams(temperature=temperature)])
        assert probs[0].tolist() == pytest.approx([0.5, 0.0, 0.5, 0.0])



@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-300, 0.004])
def test_a_vanishing_temperature_samples_at_vllms_floor(temperature, caplog):
    # float32 logits divided by a denormal temperature are inf and softmax NaN. vLLM raises such a
    # temperature to 0.01 and samples (0 alone is greedy); below 1e-5 it was greedy here, and
    # sampled as given up to 0.01, so a seeded draw differed from vLLM's.
    from scheduler import request

    request._warn_raised_temperature.cache_clear()
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.temperature == 0.01 and not params.greedy and SamplingParams(temperature=0.0).greedy
    # Said, as vLLM says it (it was raised without a word), and once: a batch's prompts each make one.
    SamplingParams(temperature=temperature, seed=2)
    assert [r.getMessage().endswith("sampled at 0.01") for r in caplog.records] == [True]
    # Two tokens 0.02 apart: at 0.01 the second is drawn about one time in eight.
    logits = torch.tensor([[10.0, 9.98, 0.0]]).repeat(400, 1)
    tokens = Sampler(seed=0).sample(logits, list(range(400)), [params] * 400)
    assert 0.06 < tokens.count(1) / 400 < 0.2 and all(t in (0, 1) for t in tokens)


def test_inverse_cdf_never_picks_a_zero_probability_token():
    from engine.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    for u in (0.0, 0.25, 0.4999, 0.5, 0.9999999):
        picked = inverse_cdf(probs, torch.tensor([u, u])).tolist()
        assert picked[0] == (1 if u < 0.5 else 3) and picked[1] == 2


def test_a_row_without_top_p_keeps_its_tail_when_sharing_the_sort_path():
    # A peaked row: float32 mass before its tail tokens rounds to 1.0. Batched with a top-k row
    # (which sends every row through the sort), it must keep the distribution it has alone.
    logits = torch.full((1, 1000), -30.0)
    logits[0, 0] = 30.0
    alone = _filtered_probs(logits, [SamplingParams()])
    shared = _filtered_probs(torch.cat([logits, logits]), [SamplingParams(), SamplingParams(top_k=5)])
    assert (alone[0] > 0).sum() == 1000
    torch.testing.assert_close(shared[0], alone[0], rtol=0, atol=0)


def test_a_draw_resolves_intervals_finer_than_float32(monkeypatch):
    # Two tokens of probability 0.5 and a uniform just below 0.5: the first token. A float32
    # anywhere on the path (a multiple of 2**-24) rounds the uniform to 0.5 and picks the second.
    sampler = Sampler(seed=0)
    monkeypatch.setattr(sampler, "_uniform", lambda params, position: torch.tensor(0.5 - 2**-30, dtype=torch.float64))
    assert sampler.sample(torch.zeros(1, 2), [0], [SamplingParams(temperature=1.0)]) == [0]
    assert sampler.sample(torch.zeros(1, 2), [0], [SamplingParams(seed=3)]) == [0]
    # And the generator itself draws at float64 resolution.
    draws = [float(Sampler(seed=s)._uniform(SamplingParams(temperature=1.0), 0)) for s in range(20)]
    assert all((u * 2**24) % 1 != 0 for u in draws)


def test_seed_zero_is_a_seed():
    # Seed 0 is falsy but a seed: its draw at a position is the same whatever the engine's own
    # generator is or has drawn before (it must not fall back to the engine generator).
    logits = torch.zeros(1, 1000)
    seeded = [SamplingParams(seed=0)]
    draws = set()
    for engine_seed in range(5):
        sampler = Sampler(seed=engine_seed)
        sampler.sample(logits.repeat(3, 1), [1, 2, 3], [SamplingParams()] * 3)  # the engine generator moves on
        draws.add(sampler.sample(logits, [5], seeded)[0])
        draws.add(sampler.sample(torch.cat([logits, logits]), [9, 5], [SamplingParams(), seeded[0]])[1])
    assert len(draws) == 1
    # And it is a seed of its own, not the same draws as seed 1.
    many = [Sampler(seed=0).sample(logits, [p], [SamplingParams(seed=s)])[0] for p in range(5) for s in (0, 1)]
    assert many[0::2] != many[1::2]


def test_top_p_reads_the_mass_after_top_k():
    # After top-k 2 the masses are 0.625 and 0.375: top-p 0.6 is reached by the first token alone
    # (before the renormalisation the first token's 0.5 would not reach it).
    probs = _filtered_probs(LOGITS, [SamplingParams(top_k=2, top_p=0.6)])
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_p_stops_at_the_token_whose_mass_reaches_p_exactly():
    # Four equal tokens, top-p 0.5: the first two reach 0.5 exactly; the third is not needed.
    probs = _filtered_probs(torch.zeros(1, 4), [SamplingParams(top_p=0.5)])
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.5, 0.0, 0.0]]))


def test_top_k_above_the_vocabulary_keeps_everything() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(_filtered_probs(logits, [SamplingParams(top_k=10)]), logits.softmax(-1))


def test_inverse_cdf_scales_by_the_row_total() -> None:
    # A row summing a hair under 1: a uniform draw above its total must not fall off the end
    # onto the zero-probability token.
    from engine.sampler import inverse_cdf

    probs = torch.tensor([[0.5, 0.4999999, 0.0]])
    assert inverse_cdf(probs, torch.tensor([0.99999999], dtype=torch.float64)).tolist() == [1]


def test_position_seeds_use_all_32_bits() -> None:
    from engine.sampler import position_seed

    assert max(position_seed(seed, position) for seed in range(20) for position in range(20)) >= 2**31


def _naive_kept(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The kept token ids of one row by the definition: ids by descending logit, ties by id; top-k
    keeps every token tied with the k-th; top-p keeps the shortest prefix of top-k's survivors
    (renormalized) whose mass reaches p, and always the first."""
    ranked = sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))
    if 0 < top_k < len(ranked):
        kth = float(logits[ranked[top_k - 1]])
        ranked = [i for i in ranked if float(logits[i]) >= kth]
    probs = torch.tensor([float(logits[i]) for i in ranked], dtype=torch.float64).softmax(dim=-1).tolist()
    kept, mass = [], 0.0
    for token, p in zip(ranked, probs):
        if kept and top_p < 1.0 and mass >= top_p:
            break
        kept.append(token)
        mass += p
    return set(kept)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.5), (0, 0.9), (0, 0.99), (10, 1.0), (64, 1.0), (100, 1.0),
                                          (500, 0.95), (40, 0.8), (3000, 0.9)])
def test_the_cut_among_the_likeliest_tokens_is_the_whole_rows(top_k, top_p, monkeypatch) -> None:
    # 3,000 tokens and 64 candidates: peaked rows settle among the candidates, flat ones and a
    # top-k past them go to the whole-row sort; rounded logits tie, as bf16 ones do. Every row
    # keeps the tokens the definition keeps, and the candidates settle some rows on their own.
    import engine.sampler as sampler

    generator = torch.Generator().manual_seed(top_k * 7 + int(top_p * 100))
    scales = torch.tensor([8.0, 4.0, 1.0, 0.1, 8.0, 2.0])[:, None]
    logits = torch.randn(6, 3000, generator=generator) * scales
    logits[4:] = (logits[4:] * 2).round() / 2  # ties, at the k-th and at the candidates' end
    widths = []
    real_likeliest = sampler._likeliest
    monkeypatch.setattr(sampler, "_likeliest", lambda rows, width: widths.append((len(rows), width))
                        or real_likeliest(rows, width))
    params = [SamplingParams(top_k=top_k, top_p=top_p)] * len(logits)
    probs = _filtered_probs(logits, params, candidates=64)
    for row in range(len(logits)):
        assert set((probs[row] > 0).nonzero().flatten().tolist()) == _naive_kept(logits[row], top_k, top_p), row
        kept = probs[row] > 0
        torch.testing.assert_close(probs[row][kept], logits[row][kept].softmax(dim=-1))
    assert widths[0] == (6, 64)
    resorted = widths[1][0] if len(widths) > 1 else 0
    assert widths[1:] in ([], [(resorted, 3000)])
    if 64 <= top_k < 3000:  # top-k's survivors reach past the candidates (at 64, ties with the last)
        assert resorted == 6
    else:  # the flat row's nucleus lies past them (top-k 3000 is none); the peaked rows settle
        assert (1 if top_k in (0, 3000) else 0) <= resorted < 6


def test_a_tied_token_ranks_in_the_worse_place_as_vllm_ranks_it() -> None:
    from engine.sampler import token_logprobs

    (entry,) = token_logprobs(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), [1], [0])
    assert entry.rank == 2
    (entry,) = token_logprobs(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), [3], [0])
    assert entry.rank == 4


def test_unseeded_draws_follow_the_engine_seed_whatever_seeded_rows_draw() -> None:
    # The engine's generator is seeded by the engine's seed (`--seed`): two seeds, two sequences,
    # one seed, one sequence. A seeded row draws from a generator of its own, so it neither reseeds
    # nor advances the engine's: the unseeded rows draw the same with or without it in the batch.
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(), SamplingParams(seed=7)]

    def unseeded_draws(engine_seed: int, with_seeded_row: bool) -> list[int]:
        sampler = Sampler(seed=engine_seed)
        if with_seeded_row:
            return [sampler.sample(logits, [p, p], params)[0] for p in range(20)]
        return [sampler.sample(logits[:1], [p], params[:1])[0] for p in range(20)]

    assert unseeded_draws(1, False) == unseeded_draws(1, False)
    assert unseeded_draws(1, False) != unseeded_draws(2, False)
    assert unseeded_draws(1, True) == unseeded_draws(1, False)


def test_a_logit_past_float32_after_temperature_stays_finite() -> None:
    # 1e37 / 0.001 is past float32's range: an inf logit makes softmax NaN. Clamped to the
    # largest float, the likeliest token keeps all the mass, and two such tokens share it.
    probs = _filtered_probs(torch.tensor([[1e37, 0.0, -1e37]]), [SamplingParams(temperature=1e-3)])
    assert probs[0].tolist() == [1.0, 0.0, 0.0]
    probs = _filtered_probs(torch.tensor([[1e37, 1e37, 0.0]]), [SamplingParams(temperature=1e-3)])
    assert probs[0].tolist() == [0.5, 0.5, 0.0]


def test_a_logit_below_float32_after_temperature_stays_finite_and_a_mask_stays() -> None:
    # -3e38 / 0.5 is past float32's range: with the allowed tokens all there, the row was all -inf,
    # softmax NaN, and the draw the last token id, which the mask had ruled out.
    largest = torch.finfo(torch.float32).max
    row = torch.full((1, 100), float("-inf"))
    row[0, 7:10] = -largest
    probs = _filtered_probs(row, [SamplingParams(temperature=0.5)])
    assert probs[0, 7:10].tolist() == pytest.approx([1 / 3] * 3) and probs[0].sum() == pytest.approx(1.0)
    assert Sampler(seed=0).sample(row, [4], [SamplingParams(temperature=0.5)])[0] in (7, 8, 9)


def test_a_top_k_row_without_top_p_keeps_its_tail() -> None:
    # A peaked row: in float32 the mass before its tail tokens rounds to 1.0, so a top-p of 1.0
    # compared at all would drop them. Top-k 999 of 1,000 keeps 999 tokens.
    logits = torch.full((1, 1000), -30.0)
    logits[0, 0] = 30.0
    logits[0, 999] = -31.0
    probs = _filtered_probs(logits, [SamplingParams(top_k=999)])
    assert (probs[0] > 0).sum() == 999 and probs[0, 999] == 0


def test_position_seeds_mix_splitmix64_and_every_bit_of_the_seed() -> None:
    from engine.sampler import _splitmix64, position_seed

    # SplitMix64's published outputs from state 0 (Vigna's splitmix64.c): the first and, past a
    # 64-bit wrap of the state, the second.
    assert _splitmix64(0) == 0xE220A8397B1DCDAF
    assert _splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    # Seeds that differ only above their low 32 bits are other seeds.
    seeds = (1, 2**32 + 1, 2**40 + 1, 2**63 + 1)
    assert len({position_seed(seed, position) for seed in seeds for position in range(10)}) == 40
