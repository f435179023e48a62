"""A tiny end-to-end run of `lengthwise bench engine` (tiny model, three short ShareGPT prompts)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from training.bench_engine import fit_step_cost
from training.cli import main
from engine.llm_engine import StepRecord


def test_bench_engine_smoke(tiny_model_dir, tmp_path):
    pytest.importorskip("datasets")
    from training.dataset import DEFAULT_TABLE_DIR

    if not (DEFAULT_TABLE_DIR / "test.parquet").exists():
        pytest.skip("ShareGPT turn table missing: run `lengthwise data prepare`")
    out = tmp_path / "bench.json"
    step_cost = tmp_path / "step_cost.json"
    code = main(["bench", "engine", "--model", str(tiny_model_dir), "--num-prompts", "3",
                 "--max-prompt-tokens", "300", "--max-output-tokens", "5", "--max-num-seqs", "2", "--threads", "1",
                 "--json", str(out), "--calibrate", "--step-cost-out", str(step_cost)])
    assert code == 0
    summary = json.loads(out.read_text())
    assert set(summary["tokens_per_s"]) == {"engine", "hf_static", "hf_continuous"}
    assert all(v > 0 for v in summary["tokens_per_s"].values())
    # Same workload, same useful tokens: 3 requests of at most 5 tokens each, eos ignored.
    useful = summary["useful_tokens"]
    assert useful["engine"] == useful["hf_static"] == useful["hf_continuous"] <= 15
    assert summary["ratio_vs_hf_static"] == pytest.approx(
        summary["tokens_per_s"]["engine"] / summary["tokens_per_s"]["hf_static"])
    assert summary["ratio_vs_hf_continuous"] == pytest.approx(
        summary["tokens_per_s"]["engine"] / summary["tokens_per_s"]["hf_continuous"])
    assert 0.0 <= summary["overhead_share"] < 1.0
    assert out.with_suffix(".png").stat().st_size > 0
    assert {"a", "b", "c", "d", "kv_cache_memory_gib"} <= set(json.loads(step_cost.read_text()))


def test_step_cost_fit_recovers_known_coefficients():
    steps = [StepRecord(tokens, 1, context, 0.01 + 2e-4 * tokens + 3e-6 * context, 0.0)
             for tokens, context in [(1, 100), (32, 900), (512, 512), (300, 4000), (64, 20000), (8, 50)]]
    fit = fit_step_cost(steps)
    assert fit["a"] == pytest.approx(0.01)
    assert fit["b"] == pytest.approx(2e-4)
    assert fit["c"] == pytest.approx(3e-6)
    assert fit["r2"] == pytest.approx(1.0)


def test_step_cost_fit_keeps_every_coefficient_non_negative():
    # Steps whose time falls as the batch grows (noise, a warm-up at the start): a free fit gives
    # a negative per-token cost; the fit instead holds it at 0 and fits the rest without it.
    steps = [StepRecord(tokens, 1, context, 0.05 - 1e-5 * tokens, 0.0)
             for tokens, context in ((1, 100), (64, 2000), (256, 500), (512, 8000))]
    free = np.linalg.lstsq(np.array([[1.0, s.num_batched_tokens, s.sum_context_tokens] for s in steps]),
                           np.array([s.step_time_s for s in steps]), rcond=None)[0]
    assert free[1] == pytest.approx(-1e-5)  # what an unconstrained fit says
    fit = fit_step_cost(steps)
    assert fit["b"] == 0.0 and fit["a"] > 0 and fit["c"] >= 0


@pytest.mark.parametrize("sizes", [[(4, 40)], [(4, 40), (9, 300)], [(4, 40)] * 6, [(n, 10 * n) for n in (1, 5, 50)]])
def test_steps_that_cannot_separate_the_costs_are_refused(sizes):
    # One or two steps, or steps all of one size, or context in step with tokens: every second
    # went to the intercept, and R^2 1 called it a perfect fit.
    steps = [StepRecord(tokens, 1, context, 0.01 + 1e-4 * tokens + i * 1e-4, 0.0)
             for i, (tokens, context) in enumerate(sizes)]
    with pytest.raises(ValueError, match="cannot separate"):
        fit_step_cost(steps)


def test_a_fit_with_neither_a_fixed_nor_a_per_token_cost_is_refused():
    # Every second on the context: a = b = 0, which the simulator refuses (a step could take no time).
    steps = [StepRecord(tokens, 1, context, 3e-6 * context, 0.0)
             for tokens, context in ((1, 100), (32, 900), (512, 512), (300, 4000))]
    with pytest.raises(ValueError, match="no step cost the simulator can use"):
        fit_step_cost(steps)


def test_hf_baseline_gets_the_engines_kv_capacity(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from training.bench_engine import _kv_cache_tokens

    for options in ({"dtype": "float32"}, {"dtype": "float16"}, {"num_gpu_blocks": 7}):
        config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory_gib=0.001, device="cpu", **options)
        engine = LLMEngine(config)
        assert _kv_cache_tokens(config) == engine.kv_cache.num_gpu_blocks * config.block_size


def test_step_cost_r2_is_the_centred_share_of_explained_variance():
    # With noise the fit is not exact, so R^2 must be 1 - SSres / SStot about the mean; the
    # uncentred 1 - SSres / sum(t^2) is close to 1 whenever the intercept dominates the times.
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 512, size=200)
    context = rng.integers(0, 20000, size=200)
    times = 0.01 + 2e-4 * tokens + 3e-6 * context + rng.normal(0.0, 0.02, size=200)
    steps = [StepRecord(int(n), 1, int(c), float(t), 0.0) for n, c, t in zip(tokens, context, times)]
    fit = fit_step_cost(steps)
    design = np.column_stack([np.ones(200), tokens, context])
    predicted = design @ np.linalg.lstsq(design, times, rcond=None)[0]
    expected = 1.0 - ((times - predicted) ** 2).sum() / ((times - times.mean()) ** 2).sum()
    assert fit["r2"] == pytest.approx(expected, rel=1e-9)
    assert 0.3 < fit["r2"] < 0.95  # the noise is large enough to matter
    assert fit["num_steps"] == 200


def test_summarise_ratios_divide_by_their_own_baseline():
    from engine.config import EngineConfig
    from training.bench_engine import summarise
    from training.engine_baselines import RunResult

    results = {"engine": RunResult("engine", 120, 2.0, overhead_share=0.1),  # 60 tokens/s
               "hf_static": RunResult("hf_static", 120, 6.0),  # 20 tokens/s
               "hf_continuous": RunResult("hf_continuous", 120, 4.0)}  # 30 tokens/s
    summary = summarise(results, EngineConfig(), num_prompts=3)
    assert summary["tokens_per_s"] == {"engine": 60.0, "hf_static": 20.0, "hf_continuous": 30.0}
    assert summary["ratio_vs_hf_static"] == pytest.approx(3.0)
    assert summary["ratio_vs_hf_continuous"] == pytest.approx(2.0)
    skipped = summarise({"engine": results["engine"]}, EngineConfig(), num_prompts=3)
    assert skipped["ratio_vs_hf_static"] is None and skipped["ratio_vs_hf_continuous"] is None


def test_swap_time_is_per_block_copied_each_way(tiny_model_dir, monkeypatch):
    # A swap round copies every block out and back in: 2 * num_blocks block copies. A fake clock
    # charges 1 ms per block copied out and 3 ms per block copied in, so the answer is 2 ms exactly.
    import time

    from engine import kv_cache
    from engine.config import EngineConfig
    from training.bench_engine import swap_seconds_per_block

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    class TimedKVCache(kv_cache.KVCache):
        def swap_out(self, pairs):
            super().swap_out(pairs)
            clock[0] += 1e-3 * len(pairs)

        def swap_in(self, pairs):
            super().swap_in(pairs)
            clock[0] += 3e-3 * len(pairs)

    monkeypatch.setattr(kv_cache, "KVCache", TimedKVCache)
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_memory_gib=0.001)
    assert swap_seconds_per_block(config, num_blocks=8, rounds=3) == pytest.approx(2e-3)


def test_load_workload_takes_first_turns_under_the_prompt_cap_and_caps_replies(monkeypatch):
    import datasets

    from training import dataset
    from training.bench_engine import load_workload
    from training.engine_baselines import WorkItem

    table = datasets.Dataset.from_dict({
        "prompt": ["a b", "later turn", "c d e", "too long prompt", "f", "g h", "i"],
        "turn_index": [0, 1, 0, 0, 0, 0, 0],
        "prompt_tokens": [2, 2, 3, 50, 1, 10, 1],  # row 5 sits exactly at the cap and is kept
        "response_tokens": [4, 4, 100, 4, 0, 10, 4],
    })
    asked = []

    def fake_load_turns(split):
        asked.append(split)
        return table

    class WordTokenizer:
        def encode(self, text, add_special_tokens):
            assert add_special_tokens is False
            return [len(word) * 100 + ord(word[0]) for word in text.split()]

    monkeypatch.setattr(dataset, "load_turns", fake_load_turns)
    items = load_workload(WordTokenizer(), "validation", num_prompts=4, max_prompt_tokens=10, max_output_tokens=10)
    assert asked == ["validation"]
    # Rows 1 (not a first turn) and 3 (over the prompt cap) are left out; replies are capped at 10
    # and at least 1; only the first four kept rows are taken.
    assert items == [WorkItem((197, 198), 4), WorkItem((199, 200, 201), 10), WorkItem((202,), 1),
                     WorkItem((203, 204), 10)]
    assert len(load_workload(WordTokenizer(), "test", 99, 10, 10)) == 5


def test_a_calibration_with_no_fixed_cost_is_a_usable_step_cost(tmp_path) -> None:
    # Step time proportional to the tokens fed: the non-negative fit puts the intercept at 0, and
    # simulate refused the file --calibrate had just written ("not a step-cost file").
    from training.simulate import load_cost_model

    # (Contexts not in step with the tokens fed, or the costs could not be told apart.)
    steps = [StepRecord(n, 4, 4 * (n + 100) + n * n // 64, 0.0015 * n - 0.002 + 1e-6 * (4 * (n + 100) + n * n // 64),
                        0.0) for n in (32, 64, 128, 256, 512)]
    fit = fit_step_cost(steps)
    assert fit["a"] == 0.0 and fit["b"] > 0
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(fit))
    cost, _, _ = load_cost_model(path)
    assert cost.a_s == 0.0 and cost.b_s_per_token == pytest.approx(fit["b"])
