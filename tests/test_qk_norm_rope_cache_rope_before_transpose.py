"""The forward fusion with RoPE applied before the head transpose, as transformers' Gemma3n and
Gemma4 attention write it: per-head ``Gemma3nRMSNorm`` / ``Gemma4RMSNorm`` on ``[B, S, H, D]``
(``x * torch.pow(ms, -0.5)`` times the fp32 weight), ``apply_rotary_pos_emb(..., unsqueeze_dim=2)``
on ``[B, S, H, D]``, then ``transpose(1, 2)`` and a ``StaticCache``-style write; v through the
weight-free ``v_norm``. Exact match counts and bit-exact numerics against eager (issue 16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma3n import modeling_gemma3n
from transformers.models.gemma4 import modeling_gemma4

from compile_capture import assert_left_unfused, fused_once_and_bit_exact
from prologue_variants import make_glm_inputs

FAMILIES = {"gemma3n": (modeling_gemma3n.Gemma3nRMSNorm, modeling_gemma3n.apply_rotary_pos_emb),
            "gemma4": (modeling_gemma4.Gemma4RMSNorm, modeling_gemma4.apply_rotary_pos_emb)}


class RopeBeforeTransposePrologue(nn.Module):
    """``Gemma3nTextAttention.forward`` (``Gemma4TextAttention``'s is the same) up to the cache
    write, for a layer that writes its own cache (not a KV-shared one)."""

    def __init__(self, family, hidden=64, q_heads=4, kv_heads=2, head_dim=32, eps=1e-6):
        super().__init__()
        norm, self.rope = FAMILIES[family]
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.q_norm, self.k_norm = norm(head_dim, eps=eps), norm(head_dim, eps=eps)
        self.v_norm = norm(head_dim, eps=eps, with_scale=False)
        with torch.no_grad():  # neutral weights would hide a weight applied twice or not at all
            for n in (self.q_norm, self.k_norm):
                n.weight.copy_(1.0 + 0.1 * torch.randn_like(n.weight))

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
        query_states = self.rope(query_states, cos, sin, unsqueeze_dim=2).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))
        key_states = self.rope(key_states, cos, sin, unsqueeze_dim=2).transpose(1, 2)
        value_states = self.v_norm(self.v_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k_cache.index_copy_(2, cache_position, key_states)  # StaticCache.update
        v_cache.index_copy_(2, cache_position, value_states)
        return query_states, query_states.float().sum() + k_cache.float().sum() + v_cache.float().sum()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("seq", [5, 1], ids=["prefill", "decode"])
def test_rope_before_transpose_fuses_once_and_is_bit_exact(family, seq):
    torch.manual_seed(0)
    model = RopeBeforeTransposePrologue(family).to(torch.bfloat16)
    inputs = make_glm_inputs(batch=2, seq=seq, kv_heads=2, head_dim=32)
    assert "norm='fp32_weight'" in fused_once_and_bit_exact(model, inputs)


def test_rope_on_the_wrong_axis_is_not_fused():
    """cos/sin broadcast over the tokens (``unsqueeze_dim=1`` on ``[B, S, H, D]``: a table per
    head) is not RoPE as the kernel applies it: left unfused."""
    torch.manual_seed(0)
    model = RopeBeforeTransposePrologue("gemma3n").to(torch.bfloat16)
    gemma_rope = model.rope
    model.rope = lambda x, cos, sin, unsqueeze_dim: gemma_rope(x, cos[:, :1].expand(-1, x.shape[2], -1),
                                                               sin[:, :1].expand(-1, x.shape[2], -1),
                                                               unsqueeze_dim=1)
    assert_left_unfused(model, make_glm_inputs(batch=2, seq=4, kv_heads=2, head_dim=32))
