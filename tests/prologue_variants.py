"""Attention prologues as other real model code writes them: a paged KV cache written through
a slot mapping, a fused QKV projection, rotary tables shared by the batch as ``[S, D]``.

``PagedPrologue`` is the Qwen3 prologue (per-head ``q_norm``/``k_norm``, rotate_half RoPE) in
front of a paged cache ``[num_blocks, block_size, Hkv, D]`` whose rows are addressed by a flat
slot index (``slot = block * block_size + offset``), as vLLM's ``reshape_and_cache`` and
Hugging Face's continuous-batching ``PagedAttentionCache`` do. Two token layouts:

- ``"tokens"`` (vLLM): tokens flattened, ``q [T, Hq, D]``, ``cos/sin [T, D]``;
- ``"hf_batch1"`` (Hugging Face continuous batching): ``q [1, S, Hq, D]`` normed, transposed
  to ``[1, Hq, S, D]``, rotated with ``cos/sin [1, S, D]``, then written as
  ``k.squeeze(0).transpose(0, 1)`` (``PagedAttentionCache.update``).

Three spellings of the write: ``cache.view(-1, Hkv, D)[slot_mapping] = k`` (``"index_put"``),
``cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, k)`` (``"index_copy"``, what
``FullAttentionAllocator.update`` does) and a cache that is already flat ``[slots, Hkv, D]``
(``"flat"``: ``cache[slot_mapping] = k``).

``DensePrologue`` is the Qwen3 prologue with a ``StaticCache``-style write
(``index_copy_(2, cache_position, k)``), a choice of projection and of rotary-table form.

``fused_qkv=True`` (both) replaces the three projections by one ``nn.Linear`` producing
``[q | k | v]`` that is split, so that q, k and v are strided views of one buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from fusion_pass.demo import RMSNorm, apply_rotary_pos_emb

LAYOUTS = ("tokens", "hf_batch1")
PAGED_WRITES = ("index_put", "index_copy", "flat")
COS_FORMS = (
    "batch_unsqueeze",  # cos [B or 1, S, D], apply_rotary_pos_emb's cos.unsqueeze(1) (Hugging Face)
    "shared_broadcast",  # cos [S, D] multiplied as is, broadcast over batch and heads
    "shared_none_none",  # cos [S, D] as cos[None, None] (GPT-NeoX-style cached tables)
)


class QKVProjection(nn.Module):
    """q/k/v projections: three ``nn.Linear`` (Qwen3) or one fused ``[q | k | v]`` Linear + split.

    Forward: hidden [..., hidden] -> (q [..., Hq*D], k [..., Hkv*D], v [..., Hkv*D]).
    """

    def __init__(self, hidden, q_heads, kv_heads, head_dim, fused_qkv):
        super().__init__()
        self.sizes = (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv_proj = nn.Linear(hidden, sum(self.sizes), bias=False)
        else:
            self.q_proj = nn.Linear(hidden, self.sizes[0], bias=False)
            self.k_proj = nn.Linear(hidden, self.sizes[1], bias=False)
            self.v_proj = nn.Linear(hidden, self.sizes[2], bias=False)

    def forward(self, hidden_states):
        if self.fused_qkv:
            return self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)


class PagedPrologue(nn.Module):
    """Projections -> per-head q/k RMSNorm -> RoPE -> write of K/V rows at ``slot_mapping``.

    Args:
        hidden, q_heads, kv_heads, head_dim: geometry.
        layout: one of LAYOUTS (see the module docstring).
        cache_write: one of PAGED_WRITES.
        fused_qkv: one fused QKV Linear + split instead of three projections.
    Forward(hidden_states [T, hidden] ("tokens") or [1, S, hidden] ("hf_batch1"),
    cos/sin [T, D] or [1, S, D], key_cache/value_cache [num_blocks, block_size, Hkv, D]
    (``"flat"``: [slots, Hkv, D]), slot_mapping [T] int64) returns (q_rotated, a sum that
    reads the updated caches, as attention would).
    """

    def __init__(self, hidden=64, q_heads=4, kv_heads=2, head_dim=16, layout="tokens", cache_write="index_put",
                 fused_qkv=False, q_eps=1e-6, k_eps=1e-6):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if cache_write not in PAGED_WRITES:
            raise ValueError(f"cache_write: expected one of {PAGED_WRITES}, got {cache_write!r}")
        self.kv_heads, self.head_dim, self.layout, self.cache_write = kv_heads, head_dim, layout, cache_write
        self.proj = QKVProjection(hidden, q_heads, kv_heads, head_dim, fused_qkv)
        self.q_norm = RMSNorm(head_dim, eps=q_eps)
        self.k_norm = RMSNorm(head_dim, eps=k_eps)
        with torch.no_grad():
            for norm in (self.q_norm, self.k_norm):
                norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))

    def forward(self, hidden_states, cos, sin, key_cache, value_cache, slot_mapping):
        q, k, v = self.proj(hidden_states)
        head_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(q.view(head_shape))
        k = self.k_norm(k.view(head_shape))
        v = v.view(head_shape)
        if self.layout == "tokens":
            # [T, H, D] with cos/sin [T, D]: apply_rotary_pos_emb's unsqueeze(1) gives [T, 1, D].
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k_rows, v_rows = k, v
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            # PagedAttentionCache.update: [1, Hkv, S, D] -> [S, Hkv, D]
            k_rows, v_rows = (x.squeeze(0).transpose(0, 1) for x in (k, v))
        if self.cache_write == "flat":
            key_cache[slot_mapping] = k_rows
            value_cache[slot_mapping] = v_rows
        elif self.cache_write == "index_put":
            key_cache.view(-1, self.kv_heads, self.head_dim)[slot_mapping] = k_rows
            value_cache.view(-1, self.kv_heads, self.head_dim)[slot_mapping] = v_rows
        else:
            key_cache.view(-1, self.kv_heads, self.head_dim).index_copy_(0, slot_mapping, k_rows)
            value_cache.view(-1, self.kv_heads, self.head_dim).index_copy_(0, slot_mapping, v_rows)
        return q, q.float().sum() + key_cache.float().sum() + value_cache.float().sum()


def make_paged_inputs(tokens=5, hidden=64, kv_heads=2, head_dim=16, num_blocks=4, block_size=8, layout="tokens",
                      cache_write="index_put", slots=None, dtype=torch.bfloat16, seed=0):
    """Random inputs: hidden, cos, sin, key_cache, value_cache (random, so untouched rows can be
    checked), slot_mapping [T] (default: distinct slots scattered over the blocks)."""
    g = torch.Generator().manual_seed(seed)
    batch_shape = (tokens,) if layout == "tokens" else (1, tokens)
    hidden_states = torch.randn(*batch_shape, hidden, generator=g).to(dtype)
    angles = torch.rand(*batch_shape, head_dim // 2, generator=g) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    cache_shape = (num_blocks * block_size, kv_heads, head_dim) if cache_write == "flat" else (
        num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=g).to(dtype)
    value_cache = torch.randn(cache_shape, generator=g).to(dtype)
    if slots is None:
        slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    return hidden_states, cos, sin, key_cache, value_cache, torch.as_tensor(slots, dtype=torch.int64)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class DensePrologue(nn.Module):
    """Projections -> per-head q/k RMSNorm -> RoPE -> ``index_copy_(2, cache_position, .)``.

    Args:
        hidden, q_heads, kv_heads, head_dim: geometry.
        fused_qkv: one fused QKV Linear + split instead of three projections.
        cos_form: one of COS_FORMS: how the rotary tables reach the multiply.
    Forward(hidden_states [B, S, hidden], cos/sin ([B or 1, S, D], or [S, D] for the shared
    forms), k_cache/v_cache [B, Hkv, L, D], cache_position [S]) returns (q_rotated, a sum that
    reads the updated caches).
    """

    def __init__(self, hidden=64, q_heads=4, kv_heads=2, head_dim=16, fused_qkv=False, cos_form="batch_unsqueeze"):
        super().__init__()
        if cos_form not in COS_FORMS:
            raise ValueError(f"cos_form: expected one of {COS_FORMS}, got {cos_form!r}")
        self.head_dim, self.cos_form = head_dim, cos_form
        self.proj = QKVProjection(hidden, q_heads, kv_heads, head_dim, fused_qkv)
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)
        with torch.no_grad():
            for norm in (self.q_norm, self.k_norm):
                norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position):
        q, k, v = self.proj(hidden_states)
        head_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(q.view(head_shape)).transpose(1, 2)
        k = self.k_norm(k.view(head_shape)).transpose(1, 2)
        v = v.view(head_shape).transpose(1, 2)
        if self.cos_form == "batch_unsqueeze":
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        else:
            if self.cos_form == "shared_none_none":
                cos, sin = cos[None, None], sin[None, None]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v)
        return q, q.float().sum() + k_cache.float().sum() + v_cache.float().sum()
