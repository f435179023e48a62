"""KV cache sizing, swap copies, the engine config's validation and the runner's batch layout."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache import GIB, CacheGeometry, KVCache
from engine.model_runner import build_batch
from scheduler.output import ScheduledChunk

GEOMETRY = CacheGeometry(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)


def test_block_count_follows_the_memory_budget():
    # SmolLM2-135M: 30 layers * (K, V) * 16 tokens * 3 KV heads * 64 dims * 4 bytes = 720 KiB per block.
    assert GEOMETRY.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 4
    assert GEOMETRY.blocks_for(1.0) == GIB // GEOMETRY.bytes_per_block == 1456


def test_swap_out_and_in_restore_every_layer():
    geometry = CacheGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    cache = KVCache(geometry, num_gpu_blocks=6, num_cpu_blocks=4, device=torch.device("cpu"))
    cache.device_cache.copy_(torch.randn_like(cache.device_cache))
    original = cache.device_cache.clone()
    cache.swap_out(((1, 3), (4, 0)))
    cache.device_cache.zero_()
    cache.swap_in(((3, 5), (0, 2)))  # back into different device blocks
    torch.testing.assert_close(cache.device_cache[:, :, 5], original[:, :, 1])
    torch.testing.assert_close(cache.device_cache[:, :, 2], original[:, :, 4])
    assert cache.layers[1][0].shape == (6, 4, 2, 3)
    assert cache.layers[1][0].data_ptr() == cache.device_cache[1, 0].data_ptr()  # views, not copies


@pytest.mark.parametrize("fields", [
    {"block_size": 12}, {"max_num_seqs": 0}, {"kv_cache_memory_gib": 0}, {"attention_backend": "cuda"},
    {"preemption_mode": "swap", "swap_space_gib": 0}, {"dtype": "int8"},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 2048},
    {"scheduler_options": {"max_num_seqs": 4}},
])
def test_engine_config_rejects_bad_values(fields):
    with pytest.raises(ValueError):
        EngineConfig(**fields)


# These had passed and failed inside torch (TypeError, OverflowError, RuntimeError), the seeds only
# after the weights had loaded; at the CLI, a traceback.
@pytest.mark.parametrize("field, value", [
    ("kv_cache_memory_gib", float("inf")), ("kv_cache_memory_gib", "1"), ("num_gpu_blocks", 10.5),
    ("swap_space_gib", float("inf")), ("seed", 1.5), ("seed", 2**70), ("num_threads", 1.5),
])
def test_engine_config_refuses_by_name_what_torch_would_fail_on(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("fields, message", [
    ({"policy": "shortest"}, "unknown policy 'shortest'"),
    ({"scheduler_options": {"aging_per_step": 1.0}}, "scheduler_options: .*'aging_per_step'"),
    ({"scheduler_options": {"kv_watermark": 1.5}}, "kv_watermark must be in"),
])
def test_engine_config_refuses_what_the_scheduler_would_refuse_before_any_weights_load(fields, message):
    # Checked on construction: before, these failed only after the weights loaded, a misspelt
    # option with a TypeError that the CLI reported as a traceback.
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_build_batch_lays_out_tokens_slots_and_sampled_rows():
    chunks = (ScheduledChunk("a", (5, 6, 7), start_position=0, block_ids=(3,), sample=True),
              ScheduledChunk("b", (9,), start_position=5, block_ids=(0, 2), sample=True),
              ScheduledChunk("c", (1, 2), start_position=2, block_ids=(1,), sample=False))
    batch = build_batch(chunks, block_size=4, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [5, 6, 7, 9, 1, 2]
    assert batch.positions.tolist() == [0, 1, 2, 5, 2, 3]
    # slot = block_ids[position // 4] * 4 + position % 4
    assert batch.metadata.slot_mapping.tolist() == [12, 13, 14, 9, 6, 7]
    assert batch.metadata.query_start_loc.tolist() == [0, 3, 4, 6]
    assert batch.metadata.seq_lens.tolist() == [3, 6, 4]
    assert batch.metadata.block_tables.tolist() == [[3, 0], [0, 2], [1, 0]]
    assert batch.sample_rows.tolist() == [2, 3]
    assert batch.sample_request_ids == ("a", "b")
    assert batch.sample_positions == (3, 6)  # where each sampled token goes: tokens before it


def test_the_cache_is_sized_against_the_memory_the_weights_left(tiny_model_dir, monkeypatch):
    # As vLLM sizes it: checked before the weights, a cache that fit only then passed the check
    # and ran the weights' load out of memory (an allocator traceback, on a GPU).
    import engine.kv_cache
    import engine.llm_engine
    from engine.llm_engine import LLMEngine

    events = []
    load_model = engine.llm_engine.load_model
    monkeypatch.setattr(engine.llm_engine, "load_model",
                        lambda *a, **k: events.append("weights") or load_model(*a, **k))
    monkeypatch.setattr(engine.kv_cache, "available_host_bytes", lambda: events.append("memory read") or None)
    LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=64, num_threads=1))
    assert events == ["weights", "memory read"]
