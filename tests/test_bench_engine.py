"""A tiny end-to-end run of `lengthwise bench engine` (tiny model, three short ShareGPT prompts)."""

from __future__ import annotations

import json

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


def test_hf_baseline_gets_the_engines_kv_capacity(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from training.bench_engine import _kv_cache_tokens

    for options in ({"dtype": "float32"}, {"dtype": "float16"}, {"num_gpu_blocks": 7}):
        config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory_gib=0.001, device="cpu", **options)
        engine = LLMEngine(config)
        assert _kv_cache_tokens(config) == engine.kv_cache.num_gpu_blocks * config.block_size
