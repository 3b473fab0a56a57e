"""Plain-PyTorch reference of the fused QK-norm -> RoPE -> KV-cache write.

It follows the Hugging Face code path operation by operation, so it rounds exactly where
that code rounds: RMSNorm statistics in fp32, then the norm style's weight form and rounding
(``NORM_STYLES``), and each RoPE product and the sum rounded to the model dtype. It is the
oracle of the tests and the path the op takes on devices the Triton kernel does not serve.
"""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

#: How the fp32 normalized row ``n = x * rsqrt(mean(x^2) + eps)`` meets the weight, and where
#: it is rounded to the model dtype (the op's ``norm`` argument; the kernel's ``NORM_STYLE``):
#:
#: - ``"weight"``: ``weight * n.to(dtype)``, two roundings (Qwen3RMSNorm, LlamaRMSNorm);
#: - ``"fp32_weight"``: ``(n * weight).to(dtype)``, fp32 product, one rounding
#:   (``torch.nn.RMSNorm`` / ``F.rms_norm`` with a weight);
#: - ``"fp32_one_plus_weight"``: ``(n * (1 + weight.float())).to(dtype)``, one rounding
#:   (Gemma3RMSNorm, whose weight is stored as an offset from 1);
#: - ``"no_weight"``: ``n.to(dtype)`` (``nn.RMSNorm(elementwise_affine=False)``,
#:   ``NeoMMERMSNorm(with_scale=False)``).
NORM_STYLES = ("weight", "fp32_weight", "fp32_one_plus_weight", "no_weight")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3RMSNorm.forward``: x [..., D], weight [D] -> [..., D] in x's dtype."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Gemma3RMSNorm.forward`` (``_norm`` inlined): x [..., D], weight [D] -> [..., D] in x's dtype."""
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def torch_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm(D, eps)`` / ``F.rms_norm(x, (D,), weight, eps)``: x [..., D], weight [D] or None.

    Written as torch's decomposition of ``aten._fused_rms_norm`` (``torch/_decomp/decompositions.py``),
    which is what Inductor's post-grad graph holds: ``mean`` over the last dim by its index,
    ``aten.add.Scalar`` (eager's C++ composite adds in place, which tracing without
    functionalization would keep), the weight multiplied in fp32, one rounding, and a
    ``contiguous()`` copy of the fp32 result (a ``clone`` node when x is a transposed view).
    """
    upcasted_input = x.to(torch.float32)
    rqrst_input = torch.rsqrt(
        torch.ops.aten.add.Scalar(torch.pow(upcasted_input, 2).mean(dim=[x.dim() - 1], keepdim=True), eps)
    )
    upcasted_result = upcasted_input.mul(rqrst_input)
    if weight is not None:
        upcasted_result = upcasted_result.mul(weight)
    if suggest_memory_format(x) not in (torch.channels_last, torch.channels_last_3d):
        # A copy when x is dense but not contiguous (a transposed view); the fp32 upcast of a
        # sliced x (a fused QKV projection) is contiguous already.
        upcasted_result = upcasted_result.contiguous()
    return upcasted_result.type_as(x)


def gemma3n_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``Gemma3nRMSNorm`` / ``Gemma4RMSNorm`` (``NeoMMERMSNorm``): x [..., D], weight [D] (None:
    ``with_scale=False``) -> [..., D] in x's dtype; the fp32 weight product, one rounding.

    The model writes ``torch.pow(ms, -0.5)``, which PyTorch's pow kernel computes as
    ``rsqrt(ms)`` (same bits); written here with ``rsqrt``, as ``canonical_forms`` rewrites it.
    """
    hidden_states = x.float()
    output = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        output = output * weight.float()
    return output.type_as(x)


def weight_first_fp32_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``AfmoeRMSNorm.forward``: ``(weight * normed).to(dtype)`` with the fp32 normed value, so the
    product is taken in fp32 (the weight promoted) and rounded once: x [..., D], weight [D]."""
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return (weight * hidden_states).to(x.dtype)


def norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, norm: str = "weight") -> torch.Tensor:
    """Per-head RMSNorm of ``norm`` style (``NORM_STYLES``): x [..., D], weight [D] (None for
    ``"no_weight"``) -> [..., D] in x's dtype."""
    if norm == "weight":
        return rms_norm_reference(x, weight, eps)
    if norm == "fp32_weight":
        return torch_rms_norm_reference(x, weight, eps)
    if norm == "fp32_one_plus_weight":
        return gemma_rms_norm_reference(x, weight, eps)
    if norm == "no_weight":
        return torch_rms_norm_reference(x, None, eps)
    raise ValueError(f"norm: expected one of {NORM_STYLES}, got {norm!r}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim, written exactly as Hugging Face writes it: the
    training pattern traces it, and the order of the two slices fixes the operand order of
    the gradient sum in the joint graph."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` for one tensor: x [B, H, S, D], cos/sin [Bc, 1, S, D]."""
    return (x * cos) + (rotate_half(x) * sin)


def partial_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           rotate=rotate_half) -> torch.Tensor:
    """Partial rotary ``apply_rotary_pos_emb`` for one tensor, as transformers' ``Glm4MoeAttention``
    (GLM-4.5) writes it: x [B, H, S, D], cos/sin [Bc, 1, S, R] with R = rotary_dim <= D.

    The first R features are rotated as ``rope_reference`` rotates them (``rotate`` of the R-wide
    slice: ``rotate_half``, or GLM's ``rotate_half_interleaved``), the other D - R pass through
    unchanged::

        rotary_dim = cos.shape[-1]
        q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
        q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
        q_embed = torch.cat([q_embed, q_pass], dim=-1)
    """
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_embed = (x_rot * cos) + (rotate(x_rot) * sin)
    # ``.to``: cat's own type promotion (fp32 tables under autocast), written out as the
    # decomposed training graph has it; a no-op otherwise.
    return torch.cat([x_embed, x_pass.to(x_embed.dtype)], dim=-1)


def rotate_half_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])``, as transformers' GLM writes
    ``rotate_half`` (``models/glm/modeling_glm.py``; GPT-J's ``rotate_every_two`` is the same)."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def interleaved_rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM's interleaved tables from Hugging Face's ``cat(freqs, freqs)`` ones: entry i of the
    first half, repeated for both features of pair i: cos/sin [..., D] -> [..., D]."""
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return cos, sin


def partial_interleaved_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary on interleaved pairs, as transformers' GLM ``apply_rotary_pos_emb`` computes
    it (``partial_rotary_factor < 1``): ``partial_rope_reference`` with ``rotate_half_interleaved``;
    cos/sin [Bc, 1, S, R], one entry per rotated feature."""
    return partial_rope_reference(x, cos, sin, rotate_half_interleaved)


def interleaved_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J style) RoPE of one tensor, as transformers' GLM ``apply_rotary_pos_emb``
    computes it with all features rotated, from its tables: x [B, H, S, D], cos/sin [Bc, 1, S, D]
    with one entry per feature (GLM repeats each pair's entry: ``interleaved_rope_tables``)::

        q_embed = (q * cos) + (rotate_half(q) * sin)     # rotate_half on interleaved pairs
    """
    return (x * cos) + (rotate_half_interleaved(x) * sin)


def write_cache_rows_reference(cache: torch.Tensor, cache_position: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[:, :, cache_position[s]] = rows[:, :, s]``.

    Negative positions count from the end (Python indexing, as ``cache[:, :, pos] = x`` does);
    positions outside [-L, L) are skipped, as the kernel skips them where device asserts are off
    (the op raises before it gets here). cache [B, H, L, D], cache_position [S] int64,
    rows [B, H, S, D].
    """
    length = cache.shape[2]
    cache_position = torch.where(cache_position < 0, cache_position + length, cache_position)
    valid = (cache_position >= 0) & (cache_position < length)
    if bool(valid.all()):
        cache.index_copy_(2, cache_position.long(), rows)
    else:
        cache.index_copy_(2, cache_position[valid].long(), rows[:, :, valid])


def qk_norm_rope_cache_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_position: torch.Tensor,
    q_eps: float,
    k_eps: float,
    norm: str = "weight",
    rope_first: bool = False,
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``torch.ops.fusion_pass.qk_norm_rope_cache`` (same arguments and shapes).

    ``rope_first``: RoPE, then the norm of the rotated rows (``HunYuanDenseV1Attention``).
    ``rotary_dim``: only the first ``rotary_dim`` features are rotated (cos/sin [Bc, S, rotary_dim],
    ``partial_rope_reference``); None: all of them. ``interleaved``: pairs ``(x[2i], x[2i+1])``
    rotated by tables with one entry per feature (``interleaved_rope_reference``; with
    ``rotary_dim``, ``partial_interleaved_rope_reference``).
    Returns (q_rotated, k_rotated) and writes k_rotated and v into the caches in place.
    """
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
    partial = rotary_dim is not None and rotary_dim != q.shape[-1]
    if interleaved:
        rope = partial_interleaved_rope_reference if partial else interleaved_rope_reference
    elif partial:
        rope = partial_rope_reference
    else:
        rope = rope_reference
    if rope_first:
        q_rot = norm_reference(rope(q, cos4, sin4), q_weight, q_eps, norm)
        k_rot = norm_reference(rope(k, cos4, sin4), k_weight, k_eps, norm)
    else:
        q_rot = rope(norm_reference(q, q_weight, q_eps, norm), cos4, sin4)
        k_rot = rope(norm_reference(k, k_weight, k_eps, norm), cos4, sin4)
    write_cache_rows_reference(k_cache, cache_position, k_rot)
    write_cache_rows_reference(v_cache, cache_position, v)
    return q_rot, k_rot


# Rotary tables from positions, and the error metric the kernel's tests and benchmarks read.


def rope_cos_sin_reference(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face rotary embedding: position_ids [B, S], inv_freq [D/2] -> cos, sin [B, S, D].

    ``freqs = pos.float() * inv_freq; emb = cat(freqs, freqs); cos = (emb.cos() * scaling).to(dtype)``.
    """
    freqs = position_ids[..., None].to(torch.float32) * inv_freq.to(torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def qk_norm_rope_cache_from_positions_reference(
    q, k, v, q_weight, k_weight, position_ids, inv_freq, attention_scaling, k_cache, v_cache, cache_position,
    q_eps, k_eps,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``qk_norm_rope_cache_from_positions_triton``: returns (q_rot, k_rot), writes the caches."""
    cos, sin = rope_cos_sin_reference(position_ids, inv_freq, attention_scaling, q.dtype)
    return qk_norm_rope_cache_reference(
        q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps
    )


def rope_ulp_error(
    out: torch.Tensor, ref: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> float:
    """Largest ``|out - ref|`` in ulps of the RoPE terms' scale, over all elements.

    ``out = round(x*cos) + round(rotate_half(x)*sin)`` can cancel, so a one-ulp difference in
    a term is many ulps of a small result; the fair unit is the ulp of
    ``max(|ref|, |x*cos| + |rotate_half(x)*sin|)``.

    Args:
        out, ref: [B, H, S, D] kernel and reference outputs (same dtype).
        normed: [B, H, S, D] the reference's normalized input of RoPE (``rms_norm_reference``).
        cos, sin: [Bc, S, D] the tables used.
    """
    if out.numel() == 0:
        return 0.0
    finfo = torch.finfo(ref.dtype)
    x = normed.to(torch.float32)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    terms = (x * cos.unsqueeze(1).float()).abs() + (rotated * sin.unsqueeze(1).float()).abs()
    scale = torch.maximum(ref.to(torch.float32).abs(), terms).clamp_min(finfo.tiny)
    ulp = torch.exp2(torch.floor(torch.log2(scale))) * finfo.eps  # eps: one ulp at 1.0
    return float(((out.to(torch.float32) - ref.to(torch.float32)).abs() / ulp).max())
