"""MiniLM fine-tuned end to end: a ranking score and monotone quantile heads in one network.

Network. pooled MiniLM embedding [B, 384] * sqrt(384) ++ standardised lexical features [B, F] ->
MLP -> (score, log_p50, log_p90 = log_p50 + softplus(gap)). The embedding is unit-length, so
each of its components is about 1/sqrt(384); scaled by sqrt(384) they are about as large as the
standardised lexical features beside them, and the MLP hears both from its first step.
The score is trained with a listwise ranking loss, the quantiles with the pinball loss
(training.finetune_train); the softplus gap keeps p90 >= p50 by construction.

`lora_rank` = r trains low-rank adapters on every encoder layer (predictor.lora) instead of
the encoder itself: the pretrained weights stay as the installed package has them, so a saved
predictor holds only the adapters and the head (2.9 MB at r = 16, fp32 safetensors) and takes the
rest from the package, whose files' fingerprint it checks at load. None trains and saves the
whole network (91 MB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from predictor.base import Prediction, checked_prompts
from predictor.encoder import EncoderConfig, MiniLMEncoder, check_encoder_weights
from predictor.features import FEATURE_NAMES, check_lexical_spec, lexical_matrix
from predictor.lora import add_adapters, is_adapter
from predictor.saved import PredictorSpec

WEIGHTS_FILENAME = "finetune.safetensors"
HIDDEN = 128


class RankingNetwork(torch.nn.Module):
    def __init__(self, encoder: MiniLMEncoder, num_lexical: int = len(FEATURE_NAMES),
                 lora_rank: int | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.adapted = lora_rank is not None
        if self.adapted:  # into `encoder` itself, whose pretrained weights it freezes
            add_adapters(encoder.model, lora_rank)
        self.register_buffer("lexical_mean", torch.zeros(num_lexical))
        self.register_buffer("lexical_std", torch.ones(num_lexical))
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(encoder.dim + num_lexical, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, 3)
        )

    def is_trained(self, name: str) -> bool:
        """Whether the parameter or buffer `name` (of this module's state) is trained and saved:
        with adapters, everything but the pretrained encoder's own weights."""
        return not (self.adapted and name.startswith("encoder.") and not is_adapter(name))

    def forward(self, input_ids, mask, lexical) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(score [B], log_p50 [B], log_p90 [B])."""
        pooled = self.encoder.pooled(input_ids, mask) * self.encoder.dim ** 0.5
        scaled = (lexical - self.lexical_mean) / self.lexical_std
        out = self.mlp(torch.cat([pooled, scaled], dim=-1))
        log_p50 = out[:, 1]
        return out[:, 0], log_p50, log_p50 + torch.nn.functional.softplus(out[:, 2])

    def inputs(self, prompts: Sequence[str]):
        ids, mask = self.encoder.batch_inputs(prompts)
        return ids, mask, torch.from_numpy(lexical_matrix(prompts))

    def trained_state(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().contiguous() for name, tensor in self.state_dict().items()
                if self.is_trained(name)}

    def load_trained_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load what `trained_state` saved; the frozen encoder weights stay the package's."""
        expected = {name for name in self.state_dict() if self.is_trained(name)}
        if set(state) != expected:
            missing, stray = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"fine-tuned weights do not fit the network: missing {missing[:3]}, "
                             f"stray {stray[:3]}")
        self.load_state_dict(state, strict=False)


class FinetunePredictor:
    kind = "finetune"

    def __init__(self, network: RankingNetwork, spec: PredictorSpec) -> None:
        self.network = network.eval()
        self.spec = spec

    @torch.inference_mode()
    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        prompts = checked_prompts(prompts)
        if not prompts:
            return []
        score, log_p50, log_p90 = (t.float().numpy() for t in self.network(*self.network.inputs(prompts)))
        p50 = np.expm1(np.maximum(log_p50, 0.0))
        p90 = np.maximum(np.expm1(np.maximum(log_p90, 0.0)), p50)
        # Its only head in tokens is the quantile head, so the scheduler ranks by p50.
        return [Prediction(float(b), float(b), float(c), float(s), float(b)) for b, c, s in zip(p50, p90, score)]

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        # In the dtype it was trained and evaluated in: fp16 weights would serve a network other
        # than the one the logged metrics describe.
        save_file(self.network.trained_state(), str(folder / WEIGHTS_FILENAME))

    @classmethod
    def load(cls, folder: Path, spec: PredictorSpec) -> "FinetunePredictor":
        from safetensors.torch import load_file

        check_lexical_spec(spec.feature_spec)
        check_encoder_weights(spec.feature_spec)  # its tokenizer (and frozen weights) come from there
        network = RankingNetwork(MiniLMEncoder(EncoderConfig(**spec.feature_spec["encoder"])),
                                 lora_rank=spec.feature_spec.get("lora_rank"))
        state = {name: tensor.float() for name, tensor in load_file(str(folder / WEIGHTS_FILENAME)).items()}
        network.load_trained_state(state)
        return cls(network, spec)
