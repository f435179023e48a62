"""A probe of the served model itself: its hidden state at the end of the prompt, a ridge head.

Why: at temperature 1 SmolLM2's reply length is mostly chance, and what can be known of it, the
model knows best. A ridge regression on the output of its 16th decoder layer at the prompt's last
token ranks the traced lengths well above the MiniLM predictor trained on ChatGPT's lengths
(README, issue 3). The first 16 of 30 layers over the prompt's last 64 tokens cost about four
times the MiniLM encoder (38 against 9 ms a prompt on two CPU cores).

Algorithm. The prompt is tokenized as the engine tokenizes it (the served tokenizer, no special
tokens added), cut to its last `max_tokens` ids, left-padded into a batch and run through the
model's first `layer` decoder layers (no final norm). The feature vector is that output at the
last token, rounded to float16 as the training cache stores it. Head: standardized features,
ridge regression of log1p(length); p50 and p90 are the point plus the validation residuals'
quantiles, so all three heads rank alike.

The model is referenced, not copied: `model_ref` is a folder (relative to the repository root when
relative), and `fingerprint` (its architecture, tokenizer and weights) must match at load, so a
probe never reads the states of another model than the one it was fitted on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from predictor.base import Prediction, checked_prompts
from predictor.heads import HeadOutputs, to_predictions
from predictor.paths import SERVED_MODEL_REF, digest_files, project_root
from predictor.saved import PredictorSpec

HEAD_FILENAME = "probe_head.npz"


# What in a config changes the states; other keys depend on the transformers release that wrote it.
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "hidden_act",
                     "tie_word_embeddings")


def model_fingerprint(model_dir: Path) -> str:
    """The model's identity: its architecture (ARCHITECTURE_KEYS and the RoPE base, however the
    config spells it), its tokenizer and the contents of its weight files (about a second for
    SmolLM2's 540 MB: two conversions of different GGUFs may have the same size)."""
    config = json.loads((model_dir / "config.json").read_text())
    architecture = {key: config.get(key) for key in ARCHITECTURE_KEYS}
    architecture["rope_theta"] = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    digest = hashlib.blake2b(json.dumps(architecture, sort_keys=True).encode(), digest_size=16)
    digest_files(digest, [model_dir / "tokenizer.json", *sorted(model_dir.glob("*.safetensors"))])
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ProbeConfig:
    model_ref: str = SERVED_MODEL_REF  # relative to the project root: the served model's folder
    fingerprint: str = ""  # model_fingerprint of model_ref; "" only before it is resolved
    layer: int = 16  # read the output of this decoder layer (1-based)
    max_tokens: int = 64  # the prompt's last ids the probe reads: bounds its cost
    batch_size: int = 32

    def __post_init__(self) -> None:
        if self.layer < 1 or self.max_tokens < 1 or self.batch_size < 1:
            raise ValueError("layer, max_tokens and batch_size must be >= 1")

    def as_dict(self) -> dict:
        return asdict(self)

    def cache_identity(self) -> dict:
        if not self.fingerprint:
            raise ValueError("a probe config names its model's fingerprint before its states are cached")
        # batch_size changes nothing in the vectors.
        return {"probe": {k: v for k, v in self.as_dict().items() if k != "batch_size"}}

    def key_text(self, prompt: str) -> str:
        return prompt  # the whole prompt: its ids are cut after tokenizing

    def model_dir(self) -> Path:
        path = Path(self.model_ref)
        return path if path.is_absolute() else project_root() / path

    def resolved(self) -> "ProbeConfig":
        """This config with the fingerprint of the model folder it names."""
        return dataclasses.replace(self, fingerprint=model_fingerprint(self.model_dir()))


class HiddenStateProbe:
    """The first `layer` decoder layers of the served model, as a prompt encoder."""

    def __init__(self, config: ProbeConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = config.model_dir()
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"probe model {model_dir} not found (make model converts it)")
        found = model_fingerprint(model_dir)
        if config.fingerprint and found != config.fingerprint:
            raise ValueError(f"probe model {model_dir} is not the model the probe was fitted on "
                             f"(fingerprint {found}, expected {config.fingerprint})")
        self.config = config if config.fingerprint else dataclasses.replace(config, fingerprint=found)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model
        if config.layer > len(model.layers):
            raise ValueError(f"layer {config.layer} > the model's {len(model.layers)} layers")
        model.layers = model.layers[: config.layer]
        model.config.num_hidden_layers = config.layer
        model.norm = torch.nn.Identity()  # the layer's own output, not the final norm's
        self.model = model.eval()

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def token_ids(self, prompt: str) -> list[int]:
        # A prompt longer than max_tokens is cut as text first, by a bound generous for any token,
        # so a pasted document is not tokenized whole only to keep its tail.
        tail = prompt[-self.config.max_tokens * 64:]
        ids = self.tokenizer.encode(tail, add_special_tokens=False)[-self.config.max_tokens:]
        return ids or [self.tokenizer.eos_token_id or 0]  # an empty prompt still gets a state

    def encode(self, prompts: Sequence[str]) -> np.ndarray:
        """[N, hidden] float32: layer `layer`'s output at each prompt's last token."""
        out = np.zeros((len(prompts), self.dim), dtype=np.float32)
        for start in range(0, len(prompts), self.config.batch_size):
            batch = prompts[start : start + self.config.batch_size]
            out[start : start + len(batch)] = self._encode_batch([self.token_ids(p) for p in batch])
        return out

    def _encode_batch(self, ids: list[list[int]]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            states = self.model(**left_padded(ids), use_cache=False).last_hidden_state
        return states[:, -1].float().numpy()


def left_padded(ids: list[list[int]]) -> dict:
    """input_ids and attention_mask of a batch padded on the left: every last token sits at -1."""
    import torch

    width = max(len(row) for row in ids)
    input_ids = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, row_ids in enumerate(ids):
        input_ids[row, width - len(row_ids):] = torch.tensor(row_ids)
        mask[row, width - len(row_ids):] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def probe_features(states: np.ndarray) -> np.ndarray:
    """What the head reads, in training and serving alike: states rounded to float16 as cached."""
    return states.astype(np.float16).astype(np.float32)


# A linear head extrapolates without bound: a one-token prompt is read at position 0, the served
# model's attention-sink state, whose features stand ~3,000 deviations out, and was predicted
# 1e11-1e14 tokens. No trace test prompt comes past 7.3, so clipping at 16 leaves them as they were.
MAX_ABS_Z = 16.0


@dataclass(frozen=True)
class RidgeHead:
    """log1p(length) ~ ((x - mean) / scale) @ coef + intercept; p50/p90 offsets from validation."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    p50_offset: float
    p90_offset: float

    def predict(self, features: np.ndarray) -> HeadOutputs:
        standardized = np.clip((features - self.mean) / self.scale, -MAX_ABS_Z, MAX_ABS_Z)
        log_point = standardized @ self.coef + self.intercept
        return HeadOutputs(score=log_point, log_point=log_point, log_p50=log_point + self.p50_offset,
                           log_p90=log_point + self.p90_offset, log_rank_len=log_point)

    def save(self, folder: Path) -> None:
        np.savez(folder / HEAD_FILENAME, mean=self.mean, scale=self.scale, coef=self.coef,
                 scalars=np.array([self.intercept, self.p50_offset, self.p90_offset]))

    @classmethod
    def load(cls, folder: Path) -> "RidgeHead":
        with np.load(folder / HEAD_FILENAME) as data:
            intercept, p50_offset, p90_offset = (float(v) for v in data["scalars"])
            return cls(data["mean"], data["scale"], data["coef"], intercept, p50_offset, p90_offset)


class ProbePredictor:
    kind = "probe"

    def __init__(self, encoder: HiddenStateProbe, head: RidgeHead, spec: PredictorSpec) -> None:
        self.encoder = encoder
        self.head = head
        self.spec = spec

    @property
    def probed_model_dir(self) -> Path:
        """The model whose states it reads (the server warns when it serves another)."""
        return self.encoder.config.model_dir()

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        prompts = checked_prompts(prompts)
        if not prompts:
            return []
        return to_predictions(self.head.predict(probe_features(self.encoder.encode(prompts))))

    def save(self, folder: Path) -> None:
        self.head.save(folder)

    @classmethod
    def load(cls, folder: Path, spec: PredictorSpec) -> "ProbePredictor":
        config = ProbeConfig(**spec.feature_spec["probe"])
        if not config.fingerprint:
            raise ValueError(f"{folder}: the probe's model fingerprint is missing")
        return cls(HiddenStateProbe(config), RidgeHead.load(folder), spec)
