"""Gaps a mutation run of the model, its loader and config reader, the attention backend and the
GGUF conversion found: each test here fails on a mutant the rest of the suite let live.

The tiny test checkpoint hides a class of bugs: HF initialises every RMSNorm weight to one, its
head_dim is hidden_size / heads, its eps is too small to matter and its weights fit one file. The
checkpoint below is unlike it in each of those ways, and its logits (not only greedy tokens, which
ignore a per-row scale such as a dropped final norm) are compared with HF's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama_config
from hf_reference import hf_model, random_prompts

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def our_logits(model, prompt: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    """Our float32 logits [len(prompt), vocab] for one sequence fed as consecutive chunks (size 1:
    a decode) through the paged cache, in scattered blocks; each chunk reads the earlier ones'
    keys and values from the cache."""
    from engine.attention.backend import create_backend
    from engine.model_runner import build_batch
    from scheduler.output import ScheduledChunk

    arch, dtype = model.arch, model.embed_tokens.weight.dtype
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(arch.num_layers)]
    backend = create_backend("torch", CPU, arch.num_heads // arch.num_kv_heads, dtype)
    block_ids = tuple(reversed(range(num_blocks)))
    logits, start = [], 0
    with torch.inference_mode():
        for size in chunk_sizes:
            chunk = ScheduledChunk("r", tuple(prompt[start:start + size]), start, block_ids, sample=True)
            batch = build_batch([chunk], BLOCK_SIZE, CPU)
            hidden = model(batch.input_ids, batch.positions, caches, batch.metadata, backend,
                           backend.prepare(batch.metadata))
            logits.append(model.compute_logits(hidden))
            start += size
    assert start == len(prompt)
    return torch.cat(logits)


def hf_logits(model_dir, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="module")
def unusual_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny random Llama with head_dim 32 (not hidden 64 / 4 heads), RMSNorm eps 0.1, random
    norm weights, an untied LM head its config.json leaves to the default, in several files."""
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("unusual-llama")
    config = tiny_llama_config()
    config.head_dim, config.rms_norm_eps, config.tie_word_embeddings = 32, 0.1, False
    torch.manual_seed(2)
    model = LlamaForCausalLM(config).to(torch.float32)
    for name, weight in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(weight, 0.25, 2.0)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="4MB")
    saved = json.loads((out / "config.json").read_text())
    del saved["tie_word_embeddings"]  # HF's default for Llama: untied
    (out / "config.json").write_text(json.dumps(saved))
    assert len(list(out.glob("*.safetensors"))) > 1
    return out


def test_logits_match_hf_for_a_checkpoint_unlike_the_tiny_default(unusual_model_dir):
    from engine.model.loader import load_model

    model = load_model(unusual_model_dir, "float32", CPU, max_positions=64)
    hf = hf_model(unusual_model_dir)
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    prompt = random_prompts([23], seed=3)[0]
    # Two prefill chunks, two decodes, a last chunk: chunked prefill and decode both read the cache.
    torch.testing.assert_close(our_logits(model, prompt, [9, 6, 1, 1, 6]), hf_logits(unusual_model_dir, prompt),
                               atol=1e-4, rtol=1e-4)


def test_a_bfloat16_model_keeps_bfloat16_weights_and_float32_logits_close_to_hf(tiny_model_dir):
    from engine.model.loader import load_model

    model = load_model(tiny_model_dir, "bfloat16", CPU, max_positions=64)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompt = random_prompts([13], seed=4)[0]
    logits = our_logits(model, prompt, [8, 5])
    assert logits.dtype == torch.float32
    reference = hf_logits(tiny_model_dir, prompt)
    # bf16 keeps ~3 significant digits: a loose bound, far below a wrong computation's error.
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
    assert {p.dtype for p in load_model(tiny_model_dir, "float16", CPU, 64).parameters()} == {torch.float16}


def test_the_rope_table_is_built_on_the_weights_device(tiny_model_dir):
    # On a GPU a table left on the CPU fails the first step; the meta device stands in for one.
    from engine.model.loader import load_model

    model = load_model(tiny_model_dir, "float32", torch.device("meta"), max_positions=64)
    assert model.rope_cos.device.type == model.rope_sin.device.type == "meta"


def test_rms_norm_equals_hf_in_bfloat16_for_small_and_large_rows():
    # Rows of mean square far below eps, and far above: eps counts, and bf16 rounding is HF's.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engine.model.llama import RMSNorm

    torch.manual_seed(0)
    ours, theirs = RMSNorm(64, 1e-5).to(torch.bfloat16), LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
        x = (torch.randn(8, 64) * torch.logspace(-4, 2, 8)[:, None]).to(torch.bfloat16)
        assert torch.equal(ours(x), theirs(x))


def test_rope_matches_hf_rotary_embedding_at_far_positions():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from engine.model.llama import apply_rope, rope_table

    config = tiny_llama_config()
    config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    positions = torch.tensor([0, 1, 7, 1000, 2047])
    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    table_cos, table_sin = rope_table(16, 500000.0, 2048)
    ours_cos, ours_sin = table_cos[positions][:, None, :], table_sin[positions][:, None, :]
    torch.testing.assert_close(apply_rope(q, ours_cos, ours_sin), expected_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, ours_cos, ours_sin), expected_k[0].transpose(0, 1))


def arch_of(folder: Path, config_changes: dict, generation_config: dict | None = None):
    """LlamaArch read from a folder holding the tiny config.json with `config_changes` (None
    deletes a key) and, if given, a generation_config.json."""
    from engine.model.arch import LlamaArch

    folder.mkdir(exist_ok=True)
    config = tiny_llama_config().to_dict()
    for key, value in config_changes.items():
        config.pop(key, None) if value is None else config.update({key: value})
    (folder / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return LlamaArch.from_model_dir(folder)


@pytest.mark.parametrize("changes, message", [
    ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads 3"),
    ({"model_type": "mistral"}, "only Llama-family"),
    # rope_parameters may say default while the older key asks for scaling this code does not do.
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"rope_type": "yarn"}},
     "rope type 'yarn'"),
    ({"rope_parameters": None, "rope_scaling": "linear"}, "not a Llama config \\(AttributeError"),
    ({"num_attention_heads": "4"}, "num_attention_heads must be a positive integer, got '4'"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),  # not a ZeroDivisionError
    ({"num_key_value_heads": 0}, "num_kv_heads must be a positive integer, got 0"),
    ({"num_hidden_layers": 0}, "num_layers must be a positive integer"),
    ({"head_dim": 16.0}, "head_dim must be a positive integer, got 16.0"),
])
def test_configs_it_cannot_serve_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        arch_of(tmp_path, changes)


def test_config_defaults_and_rope_theta_follow_hf(tmp_path):
    # rope_theta lives in rope_parameters (transformers 5) or at the top (older configs); 10000 by default.
    both = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {"rope_type": "default"}}
    assert arch_of(tmp_path / "a", {**both, "rope_theta": 1e4}).rope_theta == 5e5
    assert arch_of(tmp_path / "b", {"rope_parameters": None, "rope_theta": 2e5}).rope_theta == 2e5
    default = arch_of(tmp_path / "c", {"rope_parameters": None, "rope_theta": None, "tie_word_embeddings": None})
    assert default.rope_theta == 10000.0 and default.tie_word_embeddings is False


def test_a_null_kv_head_count_means_one_per_query_head_as_in_hf(tmp_path):
    from transformers import LlamaConfig

    from engine.model.arch import LlamaArch

    config = {**tiny_llama_config().to_dict(), "num_key_value_heads": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_heads = LlamaConfig.from_pretrained(tmp_path).num_key_value_heads
    assert LlamaArch.from_model_dir(tmp_path).num_kv_heads == hf_heads == config["num_attention_heads"]


def test_end_ids_join_both_configs_in_order_without_repeats(tmp_path):
    assert arch_of(tmp_path / "a", {"eos_token_id": 2}, {"eos_token_id": [2, 5, 2, 7]}).eos_token_ids == (2, 5, 7)
    assert arch_of(tmp_path / "b", {"eos_token_id": [4, 2]}, {"eos_token_id": 2}).eos_token_ids == (4, 2)


def test_an_unknown_attention_backend_is_refused():
    from engine.attention.backend import create_backend

    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        create_backend("flash", CPU, heads_per_kv=2)


def test_metadata_counts_sequences_and_tokens():
    from engine.model_runner import build_batch
    from scheduler.output import ScheduledChunk

    chunks = (ScheduledChunk("a", (5, 6, 7), 0, (3,), True), ScheduledChunk("b", (9,), 5, (0, 2), True))
    metadata = build_batch(chunks, block_size=4, device=CPU).metadata
    assert (metadata.num_seqs, metadata.num_tokens) == (2, 4)


def test_plain_copy_keeps_the_weights_and_generation_config_and_drops_the_quantizer(tiny_model_dir):
    from transformers import LlamaForCausalLM

    from engine.convert import _plain_copy

    loaded = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded.generation_config.eos_token_id = [2, 7]  # a GGUF's end ids, which the engine stops at
    loaded.config.quantization_config = {"quant_method": "gguf"}
    copy = _plain_copy(loaded)
    assert getattr(copy.config, "quantization_config", None) is None
    assert copy.generation_config.eos_token_id == [2, 7]
    theirs = loaded.state_dict()
    assert all(torch.equal(weight, theirs[name]) for name, weight in copy.state_dict().items())
    del loaded.model.layers[1]  # a loader that lost weights: refused, not saved half random
    with pytest.raises(RuntimeError, match="missing=.*layers.1"):
        _plain_copy(loaded)


def test_find_gguf_names_a_file_the_package_lacks():
    from engine.convert import find_gguf

    with pytest.raises(FileNotFoundError, match="nosuch.gguf not found in package"):
        find_gguf(name="nosuch.gguf")


def test_a_conversion_killed_before_removing_the_old_folder_is_redone(tmp_path, monkeypatch):
    # The new folder was in place, the old one not yet removed: the next run moves the folder aside
    # again, and a directory cannot be renamed over that non-empty leftover.
    from engine.convert import convert
    from test_convert import _fake_transformers

    out = tmp_path / "models" / "smollm2"
    for folder in (out, out.parent / ".smollm2.old"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    _fake_transformers(monkeypatch, fail_after_config=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (tmp_path / "model.gguf").write_bytes(b"")
    assert convert(out, tmp_path / "model.gguf") == out
    assert [p.name for p in out.parent.iterdir()] == ["smollm2"] and (out / "model.safetensors").exists()
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # the conversion never reaches the hub
