"""Load a HF Llama checkpoint (safetensors) into our fused-projection model.

HF names each projection separately; our layers fuse q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`, so the loader concatenates those weights along the output dimension (in the order
the forward splits them). The model is built on the meta device and the loaded tensors are
assigned, so no time is spent on random initialisation.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.model.arch import LlamaArch
from engine.model.llama import LlamaModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (run `make model`)")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            weights.update(load_file(str(path)))
        except SafetensorError as exc:  # cut short or not safetensors: no OSError, so it was a traceback
            raise ValueError(f"{path}: not a whole safetensors file ({exc}; run `make model`)") from None
    return weights


def _fuse(hf: dict[str, torch.Tensor], arch: LlamaArch) -> dict[str, torch.Tensor]:
    """HF parameter names -> our state dict."""
    state = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(arch.num_layers):
        prefix = f"model.layers.{i}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        state[f"layers.{i}.input_norm.weight"] = hf[prefix + "input_layernorm.weight"]
        state[f"layers.{i}.post_attention_norm.weight"] = hf[prefix + "post_attention_layernorm.weight"]
        state[f"layers.{i}.qkv_proj.weight"] = torch.cat(
            [hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]])
        state[f"layers.{i}.o_proj.weight"] = hf[attn + "o_proj.weight"]
        state[f"layers.{i}.gate_up_proj.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
        state[f"layers.{i}.down_proj.weight"] = hf[mlp + "down_proj.weight"]
    return state


def load_model(model_dir: str | Path, dtype: str, device: torch.device, max_positions: int) -> LlamaModel:
    model_dir = Path(model_dir)
    arch = LlamaArch.from_model_dir(model_dir)
    with torch.device("meta"):
        model = LlamaModel(arch, max_positions)
    try:
        state = _fuse(_read_safetensors(model_dir), arch)
    except KeyError as exc:  # weights of another architecture, or a file of them missing
        raise ValueError(f"{model_dir}: no weight {exc} among its safetensors (run `make model`)") from None
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device=device, dtype=_DTYPES[dtype]).eval()
    model.requires_grad_(False)
    model.init_rope()
    return model
