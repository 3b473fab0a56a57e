"""The modules ``bench_compiled.py`` compiles, written as Hugging Face writes them: suite F's Qwen3
attention prologue (per-head RMSNorm, the rotary embedding from ``inv_freq``, ``apply_rotary_pos_emb``,
the cache writes) and suite B's HunYuan block (fused QKV projection, RoPE, then the per-head norms),
at the workloads' geometry."""

from __future__ import annotations

import torch
from torch import nn

DTYPE = torch.bfloat16
F_HQ, F_HKV, F_D, F_L, F_THETA, EPS = 96, 8, 128, 262144, 10_000_000.0, 1e-6
B_HQ, B_HKV, B_D, B_HIDDEN = 32, 8, 128, 4096


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class RMSNorm(nn.Module):
    """``Qwen3RMSNorm`` / ``HunYuanDenseV1RMSNorm``."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """``Qwen3RotaryEmbedding`` (default rope type), its forward as transformers writes it."""

    def __init__(self, head_dim, theta):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Qwen3Prologue(nn.Module):
    """Qwen3Attention up to the cache write; q/k/v arrive as projection outputs [B, S, H * D]."""

    def __init__(self):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(F_D, F_THETA)
        self.q_norm, self.k_norm = RMSNorm(F_D, EPS), RMSNorm(F_D, EPS)

    def forward(self, q_proj, k_proj, v_proj, position_ids, key_cache, value_cache, cache_position):
        hidden_shape = (*q_proj.shape[:-1], -1, F_D)
        cos, sin = self.rotary_emb(q_proj, position_ids)
        query_states = self.q_norm(q_proj.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(k_proj.view(hidden_shape)).transpose(1, 2)
        value_states = v_proj.view(hidden_shape).transpose(1, 2)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_cache.index_copy_(2, cache_position, key_states)  # StaticLayer.update
        value_cache.index_copy_(2, cache_position, value_states)
        return query_states, key_states


class FusedQKVBlock(nn.Module):
    """HunyuanImage-3-style attention prologue: fused QKV projection -> RoPE -> per-head RMSNorm."""

    def __init__(self):
        super().__init__()
        self.q_size, self.kv_size = B_HQ * B_D, B_HKV * B_D
        self.qkv_proj = nn.Linear(B_HIDDEN, self.q_size + 2 * self.kv_size, bias=False)
        self.query_layernorm, self.key_layernorm = RMSNorm(B_D, EPS), RMSNorm(B_D, EPS)

    def forward(self, hidden_states, cos, sin):
        bsz, q_len, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = q.view(bsz, q_len, -1, B_D).transpose(1, 2)
        key = k.view(bsz, q_len, -1, B_D).transpose(1, 2)
        value = v.view(bsz, q_len, -1, B_D).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return self.query_layernorm(query), self.key_layernorm(key), value
