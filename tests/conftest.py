"""Session fixtures shared by every test module.

- `real_model_dir`: the converted SmolLM2-135M-Instruct (`make model`); tests skip without it.
- `tiny_model_dir`: a tiny random Llama (2 layers, hidden 64, 4 heads over 2 KV heads, tied
  embeddings, SmolLM2's vocabulary) saved with `save_pretrained` next to SmolLM2's tokenizer
  files, so engine, kernel and server tests run a real checkpoint in milliseconds per step. Its
  weights are drawn ten times wider than HF's default (std 0.2, not 0.02): at the default, the
  attention is nearly uniform and greedy decoding repeats the prompt's last token whatever the
  context, so a test comparing tokens with HF could not see an attention or KV-cache bug
  (`test_model.py` checks that the outputs depend on the context).

Engine tests pass `num_threads=1`: on a shared two-core machine two torch threads per process
make small ops wait on each other, and tests measure tokens, not speed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from predictor.paths import SERVED_MODEL_REF

ROOT = Path(__file__).resolve().parent.parent
REAL_MODEL_DIR = ROOT / SERVED_MODEL_REF
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--stress-seeds", type=int, default=0, metavar="N",
                     help="also run the stress tests' random configurations for N seeds each "
                          "(test_engine_stress.py, test_server_stress.py; none by default)")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    if not (REAL_MODEL_DIR / "config.json").is_file():
        pytest.skip(f"{REAL_MODEL_DIR} missing: run `make model`")
    return REAL_MODEL_DIR


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2,
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (real_model_dir / name).is_file():
            shutil.copy(real_model_dir / name, out / name)
    return out
