"""The forward fusion on equivalent spellings of the Qwen3 prologue (issue 16): the same norm and
RoPE written as people write them. Each must fuse exactly once per layer and equal eager bit for
bit on CPU; ``patterns/canonical_forms.py`` rewrites them to the form the patterns match."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compile_capture import assert_left_unfused, eager, fused_count, run_fused
from qwen3_style import make_inputs


def rms_norm_qwen3(x, weight, eps):
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_two_casts(x, weight, eps):
    """Two ``x.float()`` casts instead of one reused."""
    return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_mean_of_product(x, weight, eps):
    """``torch.mean(h * h, -1)`` instead of ``h.pow(2).mean(-1)``."""
    h = x.float()
    return weight * (h * torch.rsqrt(torch.mean(h * h, -1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_weight_after(x, weight, eps):
    """The weight multiplied on the other side."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rms_norm_reciprocal_sqrt(x, weight, eps):
    """``1 / torch.sqrt(var + eps)`` instead of ``torch.rsqrt``."""
    h = x.float()
    return weight * (h * (1 / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rotate_half_slices(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_split(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_unflatten(x):
    x1, x2 = x.unflatten(-1, (2, -1)).unbind(-2)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_select(x):
    halves = x.view(*x.shape[:-1], 2, x.shape[-1] // 2)
    return torch.cat((-halves[..., 1, :], halves[..., 0, :]), dim=-1)


NORMS = {"qwen3": rms_norm_qwen3, "two_casts": rms_norm_two_casts, "mean_of_product": rms_norm_mean_of_product,
         "weight_after": rms_norm_weight_after, "reciprocal_sqrt": rms_norm_reciprocal_sqrt}
ROTATIONS = {"slices": rotate_half_slices, "chunk": rotate_half_chunk, "split": rotate_half_split,
             "unflatten": rotate_half_unflatten, "select": rotate_half_select}


class SpelledPrologue(nn.Module):
    """Qwen3Attention up to ``StaticCache.update``, with the norm and ``rotate_half`` spelled by
    the given functions."""

    def __init__(self, norm, rotate_half, hidden=64, q_heads=4, kv_heads=2, head_dim=16, eps=1e-6):
        super().__init__()
        self.norm, self.rotate_half, self.head_dim, self.eps = norm, rotate_half, head_dim, eps
        self.q_proj = nn.Linear(hidden, q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.q_weight = nn.Parameter(1 + 0.1 * torch.randn(head_dim))
        self.k_weight = nn.Parameter(1 + 0.1 * torch.randn(head_dim))

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.norm(self.q_proj(hidden_states).view(shape), self.q_weight, self.eps).transpose(1, 2)
        k = self.norm(self.k_proj(hidden_states).view(shape), self.k_weight, self.eps).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v)
        return q, q.float().sum() + k_cache.float().sum() + v_cache.float().sum()


@pytest.mark.parametrize("norm,rotation", [(n, "slices") for n in NORMS] + [("qwen3", r) for r in ROTATIONS
                                                                             if r != "slices"])
def test_equivalent_spellings_fuse_and_equal_eager(norm, rotation):
    torch.manual_seed(0)
    model = SpelledPrologue(NORMS[norm], ROTATIONS[rotation]).to(torch.bfloat16)
    inputs = list(make_inputs())
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), _ = run_fused(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def rotate_by_a_quarter(x):
    """Not rotate_half: the same ops (two slices, a negation, a cat) at other bounds."""
    x1, x2 = x[..., : x.shape[-1] // 4], x[..., x.shape[-1] // 4:]
    return torch.cat((-x2, x1), dim=-1)


def test_a_rotation_that_differs_from_rotate_half_only_in_its_ints_is_left_unfused():
    """The patterns are loaded pre-traced with their ints left open; the match-time re-trace with
    the graph's shapes (``pattern_cache.retraced_check``) is what tells these slice bounds apart."""
    torch.manual_seed(0)
    assert_left_unfused(SpelledPrologue(rms_norm_qwen3, rotate_by_a_quarter).to(torch.bfloat16), list(make_inputs()))
