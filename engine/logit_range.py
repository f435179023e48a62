"""Scaled logits kept within the float range, with every masked token still masked."""

from __future__ import annotations

import torch


def within_range(scaled: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """`scaled` (computed from `original`) with each value kept to its dtype's finite range, but
    where `original` is -inf, a token a mask ruled out, which stays -inf. A finite logit scaled past
    the range (by a huge repetition penalty, or a temperature below 1) was inf or -inf: a row whose
    allowed tokens all went to -inf softmaxes to NaN, and the sampler then drew a token the mask
    had ruled out (the argmax token 0, or the last token id)."""
    largest = torch.finfo(scaled.dtype).max
    return torch.where(torch.isneginf(original), original, scaled.clamp(min=-largest, max=largest))
