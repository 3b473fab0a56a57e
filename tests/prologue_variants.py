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

``norm`` (both) picks the per-head RMSNorm module, the model code itself where transformers
has it (``NORMS``): Qwen3's, transformers' ``Gemma3RMSNorm``, ``torch.nn.RMSNorm`` with and
without a weight, transformers' ``Gemma3nRMSNorm(with_scale=False)`` (the code of
``NeoMMERMSNorm``, whose q_norm/k_norm are weight-free, in every transformers the tests
support), or a look-alike
(``NORM_LOOK_ALIKES``) that must not be fused. ``rope_first=True`` (both) applies RoPE before
the norm, as ``HunYuanDenseV1Attention`` does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.afmoe.modeling_afmoe import AfmoeRMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm
from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb as glm4_moe_apply_rotary_pos_emb
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as qwen3_next_apply_rotary_pos_emb

from fusion_pass.demo import RMSNorm, apply_rotary_pos_emb

LAYOUTS = ("tokens", "hf_batch1")
PAGED_WRITES = ("index_put", "index_copy", "flat")
NORMS = ("qwen3", "gemma3", "torch_rms_norm", "torch_rms_norm_no_weight", "gemma3n", "afmoe", "pow_no_weight")
NORM_LOOK_ALIKES = (
    "torch_rms_norm_heads_and_dim",  # nn.RMSNorm((H, D)): one statistic over all heads of a token
    "no_weight_times_scale",     # a weight-free norm whose output is scaled before RoPE
)


class GemmaTwoPlusWeight(Gemma3RMSNorm):
    """Gemma3RMSNorm with the weight offset by 2 instead of 1: not Gemma3's form, but ``nn.RMSNorm``'s
    ``(n * w).to(dtype)`` with the computed ``w = 2 + weight``."""

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (2.0 + self.weight.float())
        return output.type_as(x)


class RMSNormOverHeads(nn.RMSNorm):
    """``nn.RMSNorm((H, D))`` on ``[..., H, D]``: the statistic spans all heads of a token."""

    def __init__(self, heads, head_dim, eps):
        super().__init__((heads, head_dim), eps=eps)


class ScaledNoWeightNorm(nn.Module):
    """A weight-free norm followed by a fixed scale (``Gemma3nRMSNorm(with_scale=False) * 0.5``)."""

    def __init__(self, head_dim, eps):
        super().__init__()
        self.norm = Gemma3nRMSNorm(head_dim, eps, with_scale=False)

    def forward(self, x):
        return self.norm(x) * 0.5


def make_norm(norm: str, heads: int, head_dim: int, eps: float) -> nn.Module:
    """The per-head norm ``norm`` (one of NORMS or NORM_LOOK_ALIKES) over ``[..., heads, head_dim]``
    inputs; weights, where it has them, random around their neutral value."""
    modules = {
        "qwen3": lambda: RMSNorm(head_dim, eps=eps),
        "gemma3": lambda: Gemma3RMSNorm(head_dim, eps=eps),
        "torch_rms_norm": lambda: nn.RMSNorm(head_dim, eps=eps),
        "torch_rms_norm_no_weight": lambda: nn.RMSNorm(head_dim, eps=eps, elementwise_affine=False),
        "gemma3n": lambda: Gemma3nRMSNorm(head_dim, eps),
        "afmoe": lambda: AfmoeRMSNorm(head_dim, eps),
        "pow_no_weight": lambda: Gemma3nRMSNorm(head_dim, eps, with_scale=False),
        "gemma_two_plus_weight": lambda: GemmaTwoPlusWeight(head_dim, eps=eps),
        "torch_rms_norm_heads_and_dim": lambda: RMSNormOverHeads(heads, head_dim, eps),
        "no_weight_times_scale": lambda: ScaledNoWeightNorm(head_dim, eps),
    }
    if norm not in modules:
        raise ValueError(f"norm: expected one of {NORMS + NORM_LOOK_ALIKES}, got {norm!r}")
    module = modules[norm]()
    weight = getattr(module, "weight", None)
    if weight is not None:
        with torch.no_grad():
            # Gemma stores the weight as an offset from 1 (its init is zeros).
            neutral = 0.0 if isinstance(module, Gemma3RMSNorm) else 1.0
            weight.copy_(neutral + 0.1 * torch.randn_like(weight))
    return module


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
        norm: one of NORMS or NORM_LOOK_ALIKES (``make_norm``).
        rope_first: RoPE, then the norm (HunYuan's order; "tokens" layout only).
        rope: the ``apply_rotary_pos_emb`` called (Hugging Face's, or GLM-4.5's partial one, whose
            tables are ``rotary_dim`` wide: ``make_paged_inputs(rotary_dim=...)``).
    Forward(hidden_states [T, hidden] ("tokens") or [1, S, hidden] ("hf_batch1"),
    cos/sin [T, D] or [1, S, D], key_cache/value_cache [num_blocks, block_size, Hkv, D]
    (``"flat"``: [slots, Hkv, D]), slot_mapping [T] int64) returns (q_rotated, a sum that
    reads the updated caches, as attention would).
    """

    def __init__(self, hidden=64, q_heads=4, kv_heads=2, head_dim=16, layout="tokens", cache_write="index_put",
                 fused_qkv=False, q_eps=1e-6, k_eps=1e-6, norm="qwen3", rope_first=False, rope=None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if cache_write not in PAGED_WRITES:
            raise ValueError(f"cache_write: expected one of {PAGED_WRITES}, got {cache_write!r}")
        if rope_first and layout != "tokens":
            raise ValueError(f"rope_first: supported with layout 'tokens', got layout {layout!r}")
        self.kv_heads, self.head_dim, self.layout, self.cache_write = kv_heads, head_dim, layout, cache_write
        self.rope_first, self.rope = rope_first, rope or apply_rotary_pos_emb
        self.proj = QKVProjection(hidden, q_heads, kv_heads, head_dim, fused_qkv)
        self.q_norm = make_norm(norm, q_heads, head_dim, q_eps)
        self.k_norm = make_norm(norm, kv_heads, head_dim, k_eps)

    def forward(self, hidden_states, cos, sin, key_cache, value_cache, slot_mapping):
        q, k, v = self.proj(hidden_states)
        head_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        if self.rope_first:
            q, k = apply_rotary_pos_emb(q.view(head_shape), k.view(head_shape), cos, sin)
            q, k, v = self.q_norm(q), self.k_norm(k), v.view(head_shape)
            return self._write(q, k, v, key_cache, value_cache, slot_mapping)
        q = self.q_norm(q.view(head_shape))
        k = self.k_norm(k.view(head_shape))
        v = v.view(head_shape)
        if self.layout == "tokens":
            # [T, H, D] with cos/sin [T, D]: apply_rotary_pos_emb's unsqueeze(1) gives [T, 1, D].
            q, k = self.rope(q, k, cos, sin)
            k_rows, v_rows = k, v
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            # PagedAttentionCache.update: [1, Hkv, S, D] -> [S, Hkv, D]
            k_rows, v_rows = (x.squeeze(0).transpose(0, 1) for x in (k, v))
        return self._write(q, k_rows, v_rows, key_cache, value_cache, slot_mapping)

    def _write(self, q, k_rows, v_rows, key_cache, value_cache, slot_mapping):
        """Write the [T, Hkv, D] rows at ``slot_mapping``; return (q, a sum reading the caches)."""
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
                      cache_write="index_put", slots=None, dtype=torch.bfloat16, seed=0, rotary_dim=None):
    """Random inputs: hidden, cos, sin (``rotary_dim`` wide, default head_dim), key_cache,
    value_cache (random, so untouched rows can be checked), slot_mapping [T] (default: distinct
    slots scattered over the blocks)."""
    g = torch.Generator().manual_seed(seed)
    batch_shape = (tokens,) if layout == "tokens" else (1, tokens)
    hidden_states = torch.randn(*batch_shape, hidden, generator=g).to(dtype)
    angles = torch.rand(*batch_shape, (rotary_dim or head_dim) // 2, generator=g) * 6.28
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
        norm: one of NORMS or NORM_LOOK_ALIKES (``make_norm``).
        norm_after_transpose: norm the ``[B, H, S, D]`` views (Gemma3, NeoMME) instead of
            ``[B, S, H, D]`` before the transpose (Qwen3).
        rope_first: RoPE on the ``[B, H, S, D]`` views, then the norm (HunYuan), by ``rope``: an
            ``apply_rotary_pos_emb`` (default Qwen3's; GLM-4.5's partial or GLM's interleaved one).
    Forward(hidden_states [B, S, hidden], cos/sin ([B or 1, S, D], or [S, D] for the shared
    forms), k_cache/v_cache [B, Hkv, L, D], cache_position [S]) returns (q_rotated, a sum that
    reads the updated caches).
    """

    def __init__(self, hidden=64, q_heads=4, kv_heads=2, head_dim=16, fused_qkv=False, cos_form="batch_unsqueeze",
                 norm="qwen3", norm_after_transpose=False, q_eps=1e-6, k_eps=1e-6, rope_first=False,
                 rope=apply_rotary_pos_emb):
        super().__init__()
        if cos_form not in COS_FORMS:
            raise ValueError(f"cos_form: expected one of {COS_FORMS}, got {cos_form!r}")
        if rope_first and cos_form != "batch_unsqueeze":
            raise ValueError(f"rope_first: supported with cos_form 'batch_unsqueeze', got {cos_form!r}")
        self.head_dim, self.cos_form, self.norm_after_transpose = head_dim, cos_form, norm_after_transpose
        self.rope_first, self.rope = rope_first, rope
        self.proj = QKVProjection(hidden, q_heads, kv_heads, head_dim, fused_qkv)
        self.q_norm = make_norm(norm, q_heads, head_dim, q_eps)
        self.k_norm = make_norm(norm, kv_heads, head_dim, k_eps)

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position):
        q, k, v = self.proj(hidden_states)
        head_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        if self.rope_first:
            # HunYuanDenseV1Attention: transpose, RoPE, then query_layernorm / key_layernorm.
            q, k = self.rope(q.view(head_shape).transpose(1, 2), k.view(head_shape).transpose(1, 2), cos, sin)
            q, k, v = self.q_norm(q), self.k_norm(k), v.view(head_shape).transpose(1, 2)
            k_cache.index_copy_(2, cache_position, k)
            v_cache.index_copy_(2, cache_position, v)
            return q, q.float().sum() + k_cache.float().sum() + v_cache.float().sum()
        if self.norm_after_transpose:
            # Gemma3Attention / NeoMMEAttention: transpose, then norm.
            q = self.q_norm(q.view(head_shape).transpose(1, 2))
            k = self.k_norm(k.view(head_shape).transpose(1, 2))
        else:
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


class Glm4MoePrologue(nn.Module):
    """``Glm4MoeAttention.forward`` up to the cache write, with a ``StaticCache``-style write:
    projections, per-head ``Glm4MoeRMSNorm`` on ``[B, S, H, D]``, transpose, ``rope``, then
    ``index_copy_(2, cache_position, .)``.

    Forward(hidden_states [B, S, hidden], cos/sin [B, S, rotary width], k_cache/v_cache
    [B, Hkv, L, D], cache_position [S]) returns (q_rotated [B, Hq, S, D], a sum that reads the
    updated caches, as attention would). ``rope``: transformers' ``apply_rotary_pos_emb`` of
    GLM-4.5 (partial rotary, the default), GLM's interleaved one, or a look-alike with the same
    signature. ``norm``: a ``make_norm`` form instead of ``Glm4MoeRMSNorm`` (Qwen3's form).
    """

    def __init__(self, hidden=64, q_heads=4, kv_heads=2, head_dim=64, eps=1e-6, rope=glm4_moe_apply_rotary_pos_emb,
                 norm=None):
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self.q_proj = nn.Linear(hidden, q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        if norm is not None:  # another form of the per-head norm (``make_norm``) in GLM's place
            self.q_norm, self.k_norm = make_norm(norm, q_heads, head_dim, eps), make_norm(norm, kv_heads, head_dim, eps)
            return
        self.q_norm = Glm4MoeRMSNorm(head_dim, eps=eps)
        self.k_norm = Glm4MoeRMSNorm(head_dim, eps=eps)
        with torch.no_grad():  # neutral weights would hide a weight applied twice or not at all
            for norm in (self.q_norm, self.k_norm):
                norm.weight.copy_(1.0 + 0.1 * torch.randn_like(norm.weight))

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        query_states = self.q_norm(query_states)  # use_qk_norm
        key_states = self.k_norm(key_states)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        query_states, key_states = self.rope(query_states, key_states, cos, sin)
        k_cache.index_copy_(2, cache_position, key_states)  # StaticCache.update
        v_cache.index_copy_(2, cache_position, value_states)
        return query_states, query_states.float().sum() + k_cache.float().sum() + v_cache.float().sum()


class Qwen3NextPrologue(nn.Module):
    """``Qwen3NextAttention.forward`` (Qwen3-Next, Qwen3.5) up to the cache write, with a
    ``StaticCache``-style write: the gated query (``torch.chunk`` of a projection twice as wide),
    per-head ``Qwen3NextRMSNorm`` (``(1 + weight)`` in fp32), transpose, the partial-rotary
    ``apply_rotary_pos_emb``, then ``index_copy_(2, cache_position, .)``. Inputs and outputs as
    ``Glm4MoePrologue``'s."""

    def __init__(self, hidden=64, q_heads=4, kv_heads=2, head_dim=64, eps=1e-6):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, q_heads * head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.q_norm = Qwen3NextRMSNorm(head_dim, eps=eps)
        self.k_norm = Qwen3NextRMSNorm(head_dim, eps=eps)
        with torch.no_grad():  # its weights start at zero: (1 + 0) would hide a weight not applied
            for norm in (self.q_norm, self.k_norm):
                norm.weight.copy_(0.1 * torch.randn_like(norm.weight))

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2,
                                         dim=-1)
        query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states, key_states = qwen3_next_apply_rotary_pos_emb(query_states, key_states, cos, sin)
        k_cache.index_copy_(2, cache_position, key_states)  # StaticCache.update
        v_cache.index_copy_(2, cache_position, value_states)
        return query_states, (query_states.float().sum() + gate.float().sum() + k_cache.float().sum()
                              + v_cache.float().sum())


def make_glm_inputs(batch=2, seq=5, past=3, hidden=64, kv_heads=2, head_dim=64, rotary_dim=None, cache_len=24,
                    dtype=torch.bfloat16, halves_differ=False, seed=0):
    """Inputs of ``Glm4MoePrologue``: hidden [B, S, hidden], cos/sin [B, S, rotary_dim] (default
    head_dim; Hugging Face's ``cat(freqs, freqs)``, or with ``halves_differ`` two different
    halves), random caches [B, Hkv, L, head_dim] (untouched rows checkable), cache_position [S]."""
    rotary_dim = rotary_dim or head_dim
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(batch, seq, hidden, generator=g).to(dtype)
    angles = torch.rand(batch, seq, rotary_dim // 2, generator=g) * 6.28
    second = torch.rand(batch, seq, rotary_dim // 2, generator=g) * 6.28 if halves_differ else angles
    emb = torch.cat((angles, second), dim=-1)
    k_cache = torch.randn(batch, kv_heads, cache_len, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(batch, kv_heads, cache_len, head_dim, generator=g).to(dtype)
    return [hidden_states, emb.cos().to(dtype), emb.sin().to(dtype), k_cache, v_cache, torch.arange(past, past + seq)]
