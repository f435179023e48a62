"""Our Llama forward and engine against HF transformers' LlamaForCausalLM on the same weights.

Greedy decoding must give identical tokens for >= 32 steps on several prompts of different lengths
served together in one continuous batch (prefill chunks and decodes mixed in the same steps).
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from hf_reference import hf_greedy, random_prompts
from scheduler.request import SamplingParams

NUM_TOKENS = 32


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def test_the_tiny_models_greedy_tokens_depend_on_the_whole_context(tiny_model_dir):
    # Otherwise every token comparison below would pass with attention or the KV cache broken.
    prompts = random_prompts([17, 40])
    reference = hf_greedy(tiny_model_dir, prompts, NUM_TOKENS)
    assert all(len(set(tokens)) > 4 for tokens in reference)
    first_changed = [[(prompt[0] + 1000) % 49152] + prompt[1:] for prompt in prompts]
    changed = hf_greedy(tiny_model_dir, first_changed, NUM_TOKENS)
    assert all(new != old for new, old in zip(changed, reference))  # each prompt, not only one


def test_tiny_model_greedy_matches_hf_in_one_batch(tiny_model_dir):
    prompts = random_prompts([1, 5, 17, 40, 90])
    expected = hf_greedy(tiny_model_dir, prompts, NUM_TOKENS)
    # A small token budget so long prompts arrive in several chunks next to others' decodes.
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=64, max_model_len=256, num_gpu_blocks=64,
              num_threads=1)
    outputs = llm.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)


@pytest.mark.integration
def test_smollm2_greedy_matches_hf_in_one_batch(real_model_dir):
    llm = LLM(str(real_model_dir), max_model_len=512, kv_cache_memory_gib=0.25, max_num_batched_tokens=128,
              num_threads=1)
    questions = ["What is the capital of France?", "Write a haiku about autumn leaves.",
                 "Explain in detail how a paged KV cache lets an inference server batch many requests "
                 "of different lengths without wasting memory, and why chunked prefill helps latency."]
    prompts = [llm.tokenizer.encode(llm.engine.apply_chat_template([{"role": "user", "content": q}]))
               for q in questions]
    prompts.append(prompts[0][:7])  # a short raw prefix as well
    expected = hf_greedy(real_model_dir, prompts, NUM_TOKENS)
    outputs = llm.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in outputs] == expected
    # Both sides read the same converted weights, so a bad conversion would cancel out above.
    assert "Paris" in outputs[0].text


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": None, "rope_theta": 1e5, "rope_scaling": {"type": "linear", "factor": 4.0}},
     "rope type 'linear'"),  # an older config's key
    ({"attention_bias": True}, "biases"), ({"mlp_bias": True}, "biases"), ({"hidden_act": "gelu"}, "gelu")])
def test_llama_variants_it_would_compute_wrongly_are_refused(tiny_model_dir, tmp_path, change, message):
    # Each of these loaded before and gave other tokens than HF, with no error.
    import json
    import shutil

    from engine.model.arch import LlamaArch

    variant = tmp_path / "variant"
    shutil.copytree(tiny_model_dir, variant)
    config = json.loads((variant / "config.json").read_text())
    (variant / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        LlamaArch.from_model_dir(variant)


def test_an_untied_lm_head_and_another_rope_theta_match_hf(tiny_model_dir, tmp_path):
    # The tiny model and SmolLM2 both tie the LM head to the embeddings and keep RoPE's default
    # theta: a checkpoint that does neither (Llama 3: untied, theta 500,000) must still match HF.
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    from conftest import tiny_llama_config

    config = tiny_llama_config()
    config.tie_word_embeddings = False
    config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).to(torch.float32)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path, safe_serialization=True)
    for name in tiny_model_dir.iterdir():
        if "token" in name.name:
            shutil.copy(name, tmp_path / name.name)
    prompts = random_prompts([3, 30])
    llm = LLM(str(tmp_path), max_num_batched_tokens=64, max_model_len=256, num_gpu_blocks=32, num_threads=1)
    assert [list(o.token_ids) for o in llm.generate(prompts, GREEDY)] == hf_greedy(tmp_path, prompts, NUM_TOKENS)
