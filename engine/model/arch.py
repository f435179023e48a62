"""The architecture numbers of a Llama-family checkpoint, read from its config.json (and the end
ids of generation_config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from scheduler.request import is_int


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            _check_count(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "LlamaArch":
        path = Path(model_dir) / "config.json"
        raw = read_json_object(path)
        try:
            return cls._from_config(Path(model_dir), raw)
        except (KeyError, TypeError, AttributeError) as exc:  # a field missing or of another type: a traceback
            raise ValueError(f"{path}: not a Llama config ({type(exc).__name__}: {exc}; run `make model`)") from None

    @classmethod
    def _from_config(cls, model_dir: Path, raw: dict) -> "LlamaArch":
        if raw.get("model_type") != "llama":
            raise ValueError(f"only Llama-family models are supported, got {raw.get('model_type')!r}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        for entry in (raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}):
            rope_type = entry.get("rope_type", entry.get("type", "default"))  # "type": older configs' key
            if rope_type != "default":
                raise ValueError(f"rope type {rope_type!r} is not supported")
        # Variants this implementation would load while silently dropping their biases or activation.
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ValueError("Llama variants with attention or MLP biases are not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {raw['hidden_act']!r} is not supported (only silu)")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = raw["num_attention_heads"]
        _check_count("num_attention_heads", heads)  # before it divides
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            # Absent or null: one per head, as in HF.
            num_kv_heads=heads if raw.get("num_key_value_heads") is None else raw["num_key_value_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=float(theta),
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=_end_ids(model_dir, raw),
        )


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; ValueError naming the file when it holds none (json's own message
    names neither the file nor what was expected)."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc}; run `make model`)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON object is expected, got {type(data).__name__}")
    return data


def _check_count(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _ids(value) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


def _end_ids(model_dir: Path, config: dict) -> tuple[int, ...]:
    """Every id that ends a reply: config.json's eos_token_id and generation_config.json's, which
    is where checkpoints such as Llama 3 Instruct list the end-of-turn ids HF's generate stops at."""
    ids = _ids(config.get("eos_token_id"))
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        ids += _ids(read_json_object(generation_config).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))  # in order, without repeats
