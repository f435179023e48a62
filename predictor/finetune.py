"""MiniLM fine-tuned end to end: a ranking score and monotone quantile heads in one network.

Network. pooled MiniLM embedding [B, 384] * sqrt(384) ++ standardised lexical features [B, F] ->
MLP -> (score, log_p50, log_p90 = log_p50 + softplus(gap)). The embedding is unit-length, so
each of its components is about 1/sqrt(384); scaled by sqrt(384) they are about as large as the
standardised lexical features beside them, and the MLP hears both from its first step.
The score is trained with a listwise ranking loss, the quantiles with the pinball loss
(training.finetune_train); the softplus gap keeps p90 >= p50 by construction.

`trained_layers` = N trains only the encoder's top N transformer layers: the word embeddings
(most of MiniLM's 90 MB) and the layers below stay as the installed package has them, so a
saved predictor holds only what training changed (fp32 safetensors) and takes the rest from the
package, whose files' fingerprint it checks at load. None trains and saves the whole network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from predictor.base import Prediction
from predictor.encoder import EncoderConfig, MiniLMEncoder, check_encoder_weights
from predictor.features import FEATURE_NAMES, check_lexical_spec, lexical_matrix
from predictor.saved import PredictorSpec

WEIGHTS_FILENAME = "finetune.safetensors"
HIDDEN = 128
LAYER_PREFIX = "encoder.model.encoder.layer."  # + index: one of the encoder's transformer layers


class RankingNetwork(torch.nn.Module):
    def __init__(self, encoder: MiniLMEncoder, num_lexical: int = len(FEATURE_NAMES),
                 trained_layers: int | None = None) -> None:
        super().__init__()
        num_layers = int(encoder.model.config.num_hidden_layers)
        if trained_layers is not None and not 1 <= trained_layers <= num_layers:
            raise ValueError(f"trained_layers must be in [1, {num_layers}] or None (all), got {trained_layers!r}")
        self.encoder = encoder
        # Encoder layers from this index up are trained (0: the whole encoder, embeddings too).
        self.first_trained_layer = 0 if trained_layers is None else num_layers - trained_layers
        self.trains_whole_encoder = trained_layers is None
        self.register_buffer("lexical_mean", torch.zeros(num_lexical))
        self.register_buffer("lexical_std", torch.ones(num_lexical))
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(encoder.dim + num_lexical, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, 3)
        )
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(self.is_trained(name))

    def is_trained(self, name: str) -> bool:
        """Whether the parameter or buffer `name` (of this module's state) is trained and saved."""
        if not name.startswith("encoder.") or self.trains_whole_encoder:
            return True
        if not name.startswith(LAYER_PREFIX):
            return False  # embeddings, pooler
        return int(name[len(LAYER_PREFIX):].split(".")[0]) >= self.first_trained_layer

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
        expected = set(self.trained_state())
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
        check_encoder_weights(spec.feature_spec)  # its tokenizer (and frozen layers) come from there
        network = RankingNetwork(MiniLMEncoder(EncoderConfig(**spec.feature_spec["encoder"])),
                                 trained_layers=spec.feature_spec.get("trained_layers"))
        state = {name: tensor.float() for name, tensor in load_file(str(folder / WEIGHTS_FILENAME)).items()}
        network.load_trained_state(state)
        return cls(network, spec)
