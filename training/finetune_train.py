"""Fine-tuning MiniLM end to end for ranking: ListMLE on the score plus pinball quantile losses.

Each mini-batch of LIST_SIZE prompts is one list. ListMLE (Xia et al., 2008) maximises the
likelihood of the true order under the Plackett-Luce model of the scores:
    loss = mean_i [ logsumexp(s_sorted[i:]) - s_sorted[i] ],  s sorted by true length, longest first,
so only the order of the labels matters (as for the scheduler). The quantile heads learn
log1p(length) with the pinball loss at 0.5 and 0.9. The encoder gets a small learning rate
(its adapters, with `lora_rank`, a larger one), the new head a larger one; all warm up linearly
over the first `warmup_share` of the steps and then decay linearly to zero (BERT's schedule): a
full rate at the first step lets the untrained head's gradients shake the pretrained encoder,
and a constant one leaves the weights moving when training stops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from predictor.batching import predict_in_batches
from predictor.encoder import EncoderConfig, MiniLMEncoder, encoder_feature_spec
from predictor.features import lexical_matrix, lexical_spec
from predictor.finetune import FinetunePredictor, RankingNetwork
from predictor.saved import PredictorSpec


@dataclass(frozen=True)
class FinetuneConfig:
    epochs: int = 1
    list_size: int = 32
    encoder_learning_rate: float = 3e-5
    # Adapters start at zero and move only within their rank: they take a larger rate, as in
    # LoRA's own recipes (measured: 5e-4 at rank 16 on the whole train split, one epoch).
    adapter_learning_rate: float = 5e-4
    head_learning_rate: float = 1e-3
    quantile_weight: float = 1.0
    max_grad_norm: float = 1.0
    warmup_share: float = 0.06
    # Train rank-r adapters on a frozen encoder (predictor.lora), or (None) the encoder itself.
    lora_rank: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.list_size < 2:
            raise ValueError("epochs >= 1 and list_size >= 2 required")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1 or None, got {self.lora_rank!r}")
        if not 0.0 <= self.warmup_share < 1.0:
            raise ValueError(f"warmup_share must be in [0, 1), got {self.warmup_share!r}")


def warmup_then_linear_decay(step: int, total_steps: int, warmup_share: float) -> float:
    """The learning-rate factor at `step` (0-based) of `total_steps`: rises linearly to 1 over the
    warm-up steps, then falls linearly to 0 at the end of training."""
    warmup = int(warmup_share * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup))


def listmle_loss(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    ordered = scores[torch.argsort(lengths, descending=True)]
    # log-sum-exp of each suffix: logcumsumexp over the reversed list, reversed back
    suffix_lse = torch.flip(torch.logcumsumexp(torch.flip(ordered, [0]), 0), [0])
    return (suffix_lse - ordered).mean()


def pinball_loss(predicted: torch.Tensor, target: torch.Tensor, quantile: float) -> torch.Tensor:
    diff = target - predicted
    return torch.maximum(quantile * diff, (quantile - 1.0) * diff).mean()


def fit_network(network: RankingNetwork, prompts: list[str], lengths: np.ndarray, config: FinetuneConfig,
                standardise: bool = True) -> None:
    """Train `network` on the prompts' lengths. `standardise`: first fit the lexical features'
    mean and spread to these prompts; False keeps a trained network's own (continued training,
    whose head learnt them)."""
    from tqdm import tqdm

    if len(prompts) < config.list_size:  # not one whole list: it would save the untrained network
        raise ValueError(f"the fine-tune trains on lists of {config.list_size} prompts, and {len(prompts)} "
                         "train rows make none (raise --max-train)")
    lexical = lexical_matrix(prompts)
    if standardise:
        network.lexical_mean.copy_(torch.from_numpy(lexical.mean(0)))
        network.lexical_std.copy_(torch.from_numpy(lexical.std(0) + 1e-3))
    trained_encoder = [parameter for parameter in network.encoder.parameters() if parameter.requires_grad]
    encoder_rate = config.adapter_learning_rate if network.adapted else config.encoder_learning_rate
    optimizer = torch.optim.AdamW([
        {"params": trained_encoder, "lr": encoder_rate},
        {"params": network.mlp.parameters(), "lr": config.head_learning_rate},
    ])
    target = torch.log1p(torch.from_numpy(lengths.astype(np.float32)))
    rng = np.random.default_rng(config.seed)
    starts = range(0, len(prompts) - config.list_size + 1, config.list_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_then_linear_decay(
        step, config.epochs * len(starts), config.warmup_share))
    network.train()
    for epoch in range(config.epochs):
        order = rng.permutation(len(prompts))
        progress = tqdm(starts, desc=f"finetune epoch {epoch + 1}", unit="list")
        for start in progress:
            rows = order[start : start + config.list_size]
            ids, mask = network.encoder.batch_inputs([prompts[i] for i in rows])
            score, log_p50, log_p90 = network(ids, mask, torch.from_numpy(lexical[rows]))
            y = target[rows]
            loss = listmle_loss(score, y) + config.quantile_weight * (
                pinball_loss(log_p50, y, 0.5) + pinball_loss(log_p90, y, 0.9))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), config.max_grad_norm)
            optimizer.step()
            schedule.step()
            progress.set_postfix(loss=f"{loss.item():.3f}")
    network.eval()


def train(data, spec: PredictorSpec, config: FinetuneConfig):
    from training.train_models import TrainedModel, limit_torch_threads

    limit_torch_threads()
    torch.manual_seed(config.seed)
    encoder_config = EncoderConfig()
    network = RankingNetwork(MiniLMEncoder(encoder_config), lora_rank=config.lora_rank)
    fit_network(network, data.train.prompts, data.train.lengths, config)
    spec = dataclasses.replace(spec, feature_spec={**lexical_spec(), **encoder_feature_spec(encoder_config),
                                                   "lora_rank": config.lora_rank})
    model = FinetunePredictor(network, spec)
    return TrainedModel(model, predict_in_batches(model, data.valid.prompts),
                        predict_in_batches(model, data.test.prompts),
                        {**dataclasses.asdict(config), **encoder_config.as_dict()})
