"""Llama forward over a flat token batch and the paged KV cache.

Every step feeds one flat [num_tokens, hidden] batch (prefill chunks and decode tokens mixed)
through every matmul; only attention knows which rows belong to which sequence, via the
AttentionMetadata and the backend's per-step plan. Q, K and V share one fused projection and
gate/up another, so each layer runs four matmuls. RoPE uses HF Llama's half-rotation convention
with cos/sin looked up once per step from a precomputed table. The final norm and the LM head
(tied to the embeddings when the checkpoint says so) run only on the rows that sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.model.arch import LlamaArch


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Variance in float32 as HF does, so bf16 runs normalise the same way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_table(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim // 2] in float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos, sin [N, 1, D/2]. Rotates the two halves (HF `rotate_half`)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaLayer(nn.Module):
    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.scale = arch.head_dim ** -0.5
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.qkv_proj = nn.Linear(arch.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=False)
        self.post_attention_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata, backend: AttentionBackend, plan: object) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(self.input_norm(x)).split(self.split_sizes, dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, plan, self.scale)
        x = x + self.o_proj(attn.reshape(num_tokens, -1))
        gate, up = self.gate_up_proj(self.post_attention_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.max_positions = max_positions
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def init_rope(self) -> None:
        """Build the cos/sin table on the weights' device (after loading and moving them)."""
        cos, sin = rope_table(self.arch.head_dim, self.arch.rope_theta, self.max_positions)
        device = self.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
                backend: AttentionBackend, plan: object) -> torch.Tensor:
        """Hidden states [N, hidden] before the final norm, for a flat batch of N tokens.

        `plan` is `backend.prepare(metadata)`, built once per step by the caller.
        """
        dtype = self.embed_tokens.weight.dtype
        cos = self.rope_cos[positions].to(dtype)[:, None, :]
        sin = self.rope_sin[positions].to(dtype)[:, None, :]
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, metadata, backend, plan)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab] for the given rows only."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(hidden), weight).float()
