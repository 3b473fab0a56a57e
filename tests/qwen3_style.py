"""A Qwen3-style attention prologue written the way Hugging Face writes it, plus look-alikes.

``Qwen3StylePrologue`` reproduces ``Qwen3Attention.forward`` up to the cache update
(``q_norm``/``k_norm`` per head, ``apply_rotary_pos_emb``, ``StaticCache.update``), with the
cache write spelled three ways. The look-alike variants change one thing each, so that a
pattern which matches them would compute something else than the model.
"""

from __future__ import annotations

import torch
from torch import nn

# The Hugging Face building blocks, as the demo model writes them.
from fusion_pass.demo import RMSNorm, apply_rotary_pos_emb  # noqa: F401


CACHE_WRITES = ("index_copy", "index_put", "slice")
LOOK_ALIKES = (
    "full_width_norm",      # RMSNorm over the whole projection before the head reshape
    "cache_unnormed_key",   # the cache receives k before norm/RoPE, not the rotated key
    "k_other_positions",    # k rotated with other cos/sin than q (different positions)
    "no_cache_write",       # norm -> RoPE only: a near-miss, nothing to fuse
)


class Qwen3StylePrologue(nn.Module):
    """q/k/v projections -> per-head q/k RMSNorm -> RoPE -> K/V cache write.

    Args:
        hidden, q_heads, kv_heads, head_dim: geometry (GQA when q_heads > kv_heads).
        cache_write: "index_copy" (StaticCache), "index_put" (``cache[:, :, pos] = k``) or
            "slice" (``cache[:, :, start:start + S] = k``; then ``cache_position`` is the int start).
        variant: None for the real structure, or one of LOOK_ALIKES.
        extra_use_of_normed_q: also return the normed (pre-RoPE) q, a second user of it.
    Forward returns (q_rotated, attention-like output reading the updated caches).
    """

    def __init__(self, hidden=64, q_heads=4, kv_heads=2, head_dim=16, cache_write="index_copy",
                 variant=None, extra_use_of_normed_q=False, q_eps=1e-6, k_eps=1e-6):
        super().__init__()
        self.head_dim = head_dim
        self.cache_write = cache_write
        self.variant = variant
        self.extra_use_of_normed_q = extra_use_of_normed_q
        self.q_proj = nn.Linear(hidden, q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        norm_width = q_heads * head_dim if variant == "full_width_norm" else head_dim
        self.q_norm = RMSNorm(norm_width, eps=q_eps)
        self.k_norm = RMSNorm(kv_heads * head_dim if variant == "full_width_norm" else head_dim, eps=k_eps)
        with torch.no_grad():
            for norm in (self.q_norm, self.k_norm):
                norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position, cos_k=None, sin_k=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        if self.variant == "full_width_norm":
            q = self.q_norm(self.q_proj(hidden_states)).view(hidden_shape).transpose(1, 2)
            k = self.k_norm(self.k_proj(hidden_states)).view(hidden_shape).transpose(1, 2)
        else:
            q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        normed_q, raw_k = q, self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.variant == "k_other_positions":
            q, _ = apply_rotary_pos_emb(q, k, cos, sin)
            _, k = apply_rotary_pos_emb(q, k, cos_k, sin_k)
        else:
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.variant == "no_cache_write":
            return q, k
        written_k = raw_k if self.variant == "cache_unnormed_key" else k
        if self.cache_write == "index_copy":
            k_cache.index_copy_(2, cache_position, written_k)
            v_cache.index_copy_(2, cache_position, v)
        elif self.cache_write == "index_put":
            k_cache[:, :, cache_position] = written_k
            v_cache[:, :, cache_position] = v
        elif self.cache_write == "slice":
            start = cache_position
            k_cache[:, :, start:start + written_k.shape[2]] = written_k
            v_cache[:, :, start:start + v.shape[2]] = v
        else:
            raise ValueError(f"cache_write: unknown {self.cache_write!r}")
        # Something that reads the updated caches, as attention would.
        out = (q.float().sum() + k_cache.float().sum() + v_cache.float().sum())
        if self.extra_use_of_normed_q:
            return q, out, normed_q
        return q, out


def make_inputs(batch=2, seq=5, past=3, hidden=64, kv_heads=2, head_dim=16, cache_len=32,
                dtype=torch.bfloat16, cos_batch=None, seed=0):
    """Random inputs (never zeros): hidden [B,S,hidden], cos/sin [Bc,S,D], caches [B,Hkv,L,D]
    filled with random data so untouched rows can be checked, cache_position [S]."""
    g = torch.Generator().manual_seed(seed)
    cos_batch = batch if cos_batch is None else cos_batch
    hidden_states = torch.randn(batch, seq, hidden, generator=g).to(dtype)
    angles = torch.rand(cos_batch, seq, head_dim // 2, generator=g) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    k_cache = torch.randn(batch, kv_heads, cache_len, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(batch, kv_heads, cache_len, head_dim, generator=g).to(dtype)
    cache_position = torch.arange(past, past + seq)
    return hidden_states, cos, sin, k_cache, v_cache, cache_position
