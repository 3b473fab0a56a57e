"""The forward fusion on equivalent spellings of the Qwen3 prologue (issue 16): the same norm and
RoPE written as people write them. Each must fuse exactly once per layer and equal eager bit for
bit on CPU; ``patterns/canonical_forms.py`` rewrites them (and the patterns' reference code) to
one form. Spellings of other values, or ones no rewrite covers, are left alone and reported."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusion_pass
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


def rms_norm_sum_over_size(x, weight, eps):
    """``sum / D`` instead of ``mean``."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps)).to(x.dtype)


def rms_norm_mean_then_unsqueeze(x, weight, eps):
    """``mean(-1)[..., None]`` instead of ``keepdim=True``."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.square().mean(-1)[..., None] + eps)).to(x.dtype)


def rms_norm_statistic_first(x, weight, eps):
    """``rsqrt(var + eps) * h``, eps first, ``** 2``."""
    h = x.to(torch.float32)
    return weight * (torch.rsqrt(eps + (h ** 2).mean(dim=3, keepdim=True)) * h).to(x.dtype)


def rms_norm_functional_then_weight(x, weight, eps):
    """``F.rms_norm`` without a weight, then Qwen3's weight product."""
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


NORMS = {"qwen3": rms_norm_qwen3, "two_casts": rms_norm_two_casts, "mean_of_product": rms_norm_mean_of_product,
         "weight_after": rms_norm_weight_after, "reciprocal_sqrt": rms_norm_reciprocal_sqrt,
         "sum_over_size": rms_norm_sum_over_size, "mean_then_unsqueeze": rms_norm_mean_then_unsqueeze,
         "statistic_first": rms_norm_statistic_first, "functional_then_weight": rms_norm_functional_then_weight}
def rotate_half_narrow(x):
    d = x.shape[-1] // 2
    return torch.cat((-x.narrow(-1, d, d), x.narrow(-1, 0, d)), dim=-1)


def rotate_half_explicit_bounds(x):
    """Both bounds written out, a negative start, the cat's dim counted from the front."""
    d = x.shape[-1] // 2
    return torch.cat((-x[..., -d:x.shape[-1]], x[..., 0:d]), dim=x.dim() - 1)


def rotate_half_tensor_split(x):
    x1, x2 = torch.tensor_split(x, 2, dim=-1)
    return torch.cat((x2 * -1, x1), dim=-1)


def rotate_half_stack(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.stack((-x2, x1), dim=-2).flatten(-2)


ROTATIONS = {"slices": rotate_half_slices, "chunk": rotate_half_chunk, "split": rotate_half_split,
             "unflatten": rotate_half_unflatten, "select": rotate_half_select, "narrow": rotate_half_narrow,
             "explicit_bounds": rotate_half_explicit_bounds, "tensor_split": rotate_half_tensor_split,
             "stack": rotate_half_stack}


def rope_hf(x, cos, sin, rotate_half):
    return x * cos + rotate_half(x) * sin


def rope_commuted(x, cos, sin, rotate_half):
    """Both products and the sum in the other order."""
    return sin * rotate_half(x) + cos * x


def rope_methods(x, cos, sin, rotate_half):
    return x.mul(cos).add(torch.mul(rotate_half(x), sin))


def rope_half_tables(x, cos, sin, rotate_half):
    """Half-width tables, each half rotated by hand (vLLM's ``forward_native``, flash-attn's reference)."""
    d = x.shape[-1] // 2
    c, s = cos[..., :d], sin[..., :d]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_half_tables_commuted(x, cos, sin, rotate_half):
    d = x.shape[-1] // 2
    c, s = cos[..., :d], sin[..., :d]
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((c * x1 - s * x2, s * x1 + c * x2), dim=-1)


ROPES = {"hf": rope_hf, "commuted": rope_commuted, "methods": rope_methods, "half_tables": rope_half_tables,
         "half_tables_commuted": rope_half_tables_commuted}


class SpelledPrologue(nn.Module):
    """Qwen3Attention up to ``StaticCache.update``, with the norm and ``rotate_half`` spelled by
    the given functions."""

    def __init__(self, norm, rotate_half, rope=rope_hf, hidden=64, q_heads=4, kv_heads=2, head_dim=16, eps=1e-6):
        super().__init__()
        self.norm, self.rotate_half, self.rope, self.head_dim, self.eps = norm, rotate_half, rope, head_dim, eps
        self.q_proj = nn.Linear(hidden, q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.q_weight = nn.Parameter(1 + 0.1 * torch.randn(head_dim))
        self.k_weight = nn.Parameter(1 + 0.1 * torch.randn(head_dim))

    def heads_first(self, x):
        """[B, S, H, D] -> [B, H, S, D]."""
        return x.transpose(1, 2)

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.heads_first(self.norm(self.q_proj(hidden_states).view(shape), self.q_weight, self.eps))
        k = self.heads_first(self.norm(self.k_proj(hidden_states).view(shape), self.k_weight, self.eps))
        v = self.heads_first(self.v_proj(hidden_states).view(shape))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = self.rope(q, cos, sin, self.rotate_half)
        k = self.rope(k, cos, sin, self.rotate_half)
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v)
        return q, q.float().sum() + k_cache.float().sum() + v_cache.float().sum()


SPELLINGS = ([(n, "slices", "hf") for n in NORMS] + [("qwen3", r, "hf") for r in ROTATIONS if r != "slices"]
             + [("qwen3", "slices", r) for r in ROPES if r != "hf"] + [("statistic_first", "stack", "commuted")])


@pytest.mark.parametrize("norm,rotation,rope", SPELLINGS, ids=["-".join(s) for s in SPELLINGS])
def test_equivalent_spellings_fuse_and_equal_eager(norm, rotation, rope):
    torch.manual_seed(0)
    model = SpelledPrologue(NORMS[norm], ROTATIONS[rotation], ROPES[rope]).to(torch.bfloat16)
    inputs = list(make_inputs())
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), _ = run_fused(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


class ContiguousAfterTranspose(SpelledPrologue):
    """``norm(q).transpose(1, 2).contiguous()`` (and k's, v's) before the RoPE."""

    def heads_first(self, x):
        return x.transpose(1, 2).contiguous()


def test_a_contiguous_copy_after_the_transpose_fuses_with_eagers_strides():
    """The copy only changes the layout the RoPE reads (``canonical_forms.contiguous_copies_dropped``);
    the returned q keeps eager's (contiguous) strides, which Inductor's code gives the graph's output."""
    torch.manual_seed(0)
    model = ContiguousAfterTranspose(rms_norm_qwen3, rotate_half_slices).to(torch.bfloat16)
    inputs = list(make_inputs())
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), _ = run_fused(model, inputs, inductor=True)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref) and q_out.stride() == q_ref.stride()
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


def rms_norm_divided_by_root(x, weight, eps):
    """``h / sqrt(var + eps)``: not ``h * rsqrt(var + eps)`` bit for bit (about 1 in 2e5 bf16 outputs
    differ), so not the op's computation."""
    h = x.float()
    return weight * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half_by_roll(x):
    """rotate_half as a roll and a sign: the same values, a spelling no rewrite covers."""
    sign = torch.cat((-torch.ones(x.shape[-1] // 2), torch.ones(x.shape[-1] // 2))).to(x.dtype)
    return x.roll(x.shape[-1] // 2, -1) * sign


def rope_addcmul(x, cos, sin, rotate_half):
    """One rounding of ``a + b * c`` (``addcmul``), where Hugging Face rounds the product first."""
    return torch.addcmul(x * cos, rotate_half(x), sin)


def rope_half_tables_swapped(x, cos, sin, rotate_half):
    """The second half's terms with the tables swapped: no rotation."""
    d = x.shape[-1] // 2
    c, s = cos[..., :d], sin[..., :d]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * s + x1 * c), dim=-1)


UNRECOGNIZED = {"divided_by_root": (rms_norm_divided_by_root, rotate_half_slices, rope_hf),
                "half_tables_swapped": (rms_norm_qwen3, rotate_half_slices, rope_half_tables_swapped),
                "roll": (rms_norm_qwen3, rotate_half_by_roll, rope_hf),
                "addcmul": (rms_norm_qwen3, rotate_half_slices, rope_addcmul)}


@pytest.mark.parametrize("name", list(UNRECOGNIZED))
def test_other_values_and_unrecognized_spellings_stay_unfused_and_are_reported(name):
    """Left alone, and never silently: the norm beside its RoPE is reported (q's and k's)."""
    torch.manual_seed(0)
    assert_left_unfused(SpelledPrologue(*UNRECOGNIZED[name]).to(torch.bfloat16), list(make_inputs()))
    assert [(m.reason.split(":")[0], n) for m, n in fusion_pass.near_misses().items()] == [
        ("per-head RMSNorm -> RoPE left unfused", 2)]


def shift_and_scale(x, cos, sin, rotate_half):
    """No RoPE: a zero point subtracted and a scale applied, as a quantizer does."""
    return (x - sin) * cos


def test_a_norm_beside_other_arithmetic_is_no_near_miss():
    """A subtraction is no rotation: without the halves put back together nothing is reported."""
    torch.manual_seed(0)
    assert_left_unfused(SpelledPrologue(rms_norm_qwen3, rotate_half_slices, shift_and_scale).to(torch.bfloat16),
                        list(make_inputs()))
    assert fusion_pass.near_misses() == {}


def test_graphs_of_a_device_the_pass_skips_are_not_reported():
    torch.manual_seed(0)
    model = SpelledPrologue(rms_norm_qwen3, rotate_half_by_roll).to(torch.bfloat16)
    _, capture = run_fused(model, list(make_inputs()), devices=("cuda",))
    assert "fusion_pass.qk_norm_rope" not in capture.after[0]
    assert fused_count() == 0 and fusion_pass.near_misses() == {}


class RopeFirstPrologue(SpelledPrologue):
    """HunYuan's order (RoPE on [B, H, S, D], then the per-head norm), with the given spellings."""

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = self.norm(self.rope(q, cos, sin, self.rotate_half), self.q_weight, self.eps)
        k = self.norm(self.rope(k, cos, sin, self.rotate_half), self.k_weight, self.eps)
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v)
        return q, q.float().sum() + k_cache.float().sum() + v_cache.float().sum()


def test_an_unrecognized_rope_before_the_norm_is_reported_with_its_order():
    torch.manual_seed(0)
    assert_left_unfused(RopeFirstPrologue(rms_norm_qwen3, rotate_half_by_roll).to(torch.bfloat16), list(make_inputs()))
    assert [(m.reason.split(":")[0], n) for m, n in fusion_pass.near_misses().items()] == [
        ("per-head RMSNorm after a RoPE left unfused", 2)]


_STRIDES_SEEN: list = []


@torch.library.custom_op("fusion_pass_test::memory_order", mutates_args=(), tags=(torch.Tag.needs_fixed_stride_order,))
def memory_order(t: torch.Tensor) -> torch.Tensor:
    """A stride-sensitive op (it reads memory in storage order), as a custom attention kernel is."""
    _STRIDES_SEEN.append(t.stride())
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).clone()


@memory_order.register_fake
def _(t):
    return t.new_empty(t.numel())


def unfused_half_table_rope(h, w, cos, sin):
    """A half-table RoPE with no norm before it (nothing to fuse), read by a stride-sensitive op."""
    q = (h @ w).view(*h.shape[:2], -1, 16).transpose(1, 2)
    c, s = cos[:, None], sin[:, None]
    x1, x2 = q[..., :8], q[..., 8:]
    return memory_order(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1))


def unfused_contiguous_copy(h, w, cos, sin):
    """A ``.contiguous()`` read by arithmetic, then a stride-sensitive op (no prologue to fuse)."""
    return memory_order((h @ w).view(*h.shape[:2], -1, 16).transpose(1, 2).contiguous() * cos[:, None].repeat(1, 1, 1, 2))


@pytest.mark.parametrize("fn", [unfused_half_table_rope, unfused_contiguous_copy], ids=["half_tables", "contiguous"])
def test_rewrites_no_fusion_used_leave_eagers_layout(fn):
    """Where nothing fuses, the layout-changing rewrites are undone: a stride-sensitive op further on
    sees the strides (and so the values) it sees without the pass (a copy dropped for good handed it
    the transposed layout: other values)."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 7, 64, generator=g), torch.randn(64, 64, generator=g),
            torch.randn(2, 7, 8, generator=g), torch.randn(2, 7, 8, generator=g)]
    _STRIDES_SEEN.clear()
    want = torch.compile(fn)(*args)
    stock_strides = list(_STRIDES_SEEN)
    torch._dynamo.reset()
    fusion_pass.install(devices="cpu")
    _STRIDES_SEEN.clear()
    got = torch.compile(fn)(*args)
    assert _STRIDES_SEEN == stock_strides and torch.equal(got, want)
