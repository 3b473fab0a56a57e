"""Plain-PyTorch reference of QKV projection -> RoPE -> per-head RMSNorm, forward and backward.

The forward follows the eager model code operation by operation (Hugging Face
``HunYuanDenseV1Attention`` and HunyuanImage-3-style fused-QKV attention), so it rounds exactly
where that code rounds: each RoPE product and their sum in the model dtype, the RMSNorm
statistics in fp32, the normalized row cast back to the model dtype, the weight multiply in the
model dtype.

The backward is written out explicitly (no autograd: a custom op's backward runs below the
Autograd dispatch key). Its elementwise part computes in fp32 and rounds to the model dtype only
where eager's backward crosses the norm's cast and at its outputs (autograd, and the Triton
kernel that mirrors it, also round after each bf16 product: the results agree within bf16
ulps); the projection GEMMs run in the model dtype like eager's. Its functions have the same
signatures as the Triton paths (``qkv_rope_qk_norm_backward_triton`` for the elementwise part,
``projection_backward`` for the GEMMs), so the op switches between the two with one line. float64 inputs (gradcheck) are computed in float64 throughout.

Shapes (``M = B * S``; ``Nq = Hq * D``; ``Nkv = Hkv * D``)::

    hidden [B, S, K]       fused weight [Nq + 2 Nkv, K]   or   q/k/v weights [Nq|Nkv|Nkv, K]
    cos, sin [Bc, S, D]    (Bc = 1 or B; broadcast over heads)
    q_out [B, Hq, S, D], k_out / v_out [B, Hkv, S, D];  q_rstd [B, Hq, S], k_rstd [B, Hkv, S] fp32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .projection_backward import projection_gemms
from .qk_norm_rope_cache_reference import partial_rope_reference, rope_reference, rotate_half


def rotate_half_transposed(u: torch.Tensor) -> torch.Tensor:
    """The adjoint of ``rotate_half``: [u1, u2] -> [u2, -u1] (gradient through rotate_half)."""
    half = u.shape[-1] // 2
    return torch.cat((u[..., half:], -u[..., :half]), dim=-1)


def rope_transposed(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's backward (``partial_rope_reference``'s adjoint in x) of a gradient u [..., D], tables
    [..., R], R <= D: u*cos + rotate_half^T(u*sin) on the first R features, the rest passed through."""
    rotary_dim = cos.shape[-1]
    u_rot = u[..., :rotary_dim]
    return torch.cat((u_rot * cos + rotate_half_transposed(u_rot * sin), u[..., rotary_dim:]), dim=-1)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the norm's statistics are computed in: fp32 (float64 inputs, for gradcheck, stay float64)."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm_with_rstd_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunYuanDenseV1RMSNorm.forward`` over the last dim, plus its fp32 ``rstd`` (last dim dropped)."""
    x32 = x.to(stats_dtype(x.dtype))
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd.squeeze(-1)


def project_reference(
    hidden: torch.Tensor, proj_weights: list[torch.Tensor], proj_biases: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The projection(s): ``[qkv [B, S, Nq + 2 Nkv]]`` for a fused weight, else ``[q, k, v]``."""
    biases = proj_biases if proj_biases else [None] * len(proj_weights)
    return [F.linear(hidden, w, b) for w, b in zip(proj_weights, biases)]


def split_projections(
    proj: list[torch.Tensor], num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-RoPE q [B, S, Nq], k, v [B, S, Nkv] (views of the fused output when there is one)."""
    if len(proj) == 3:
        return proj[0], proj[1], proj[2]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, k, v = proj[0].split([q_size, kv_size, kv_size], dim=-1)
    return q, k, v


def qkv_rope_qk_norm_forward_reference(
    hidden: torch.Tensor,
    proj_weights: list[torch.Tensor],
    proj_biases: list[torch.Tensor],
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_eps: float,
    k_eps: float,
    rope_first: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Reference forward: returns (q_out, k_out, v, q_rstd, k_rstd, proj). ``rope_first``:
    norm(rope(x)) as HunYuanDenseV1 writes it; False: rope(norm(x)), Qwen3's order.

    ``q_out``/``k_out``/``v`` are what the model's attention consumes ([B, H, S, D], the eager
    strides; ``v`` is a view of the projection output); ``proj`` is the list of projection
    outputs (``[qkv]`` or ``[q, k, v]``, [B, S, N]) that holds the pre-RoPE q and k.
    """
    batch, seq = hidden.shape[0], hidden.shape[1]
    head_dim = q_norm_weight.shape[0]
    proj = project_reference(hidden, proj_weights, proj_biases)
    q_proj, k_proj, v_proj = split_projections(proj, num_q_heads, num_kv_heads, head_dim)
    q = q_proj.view(batch, seq, num_q_heads, head_dim).transpose(1, 2)
    k = k_proj.view(batch, seq, num_kv_heads, head_dim).transpose(1, 2)
    v = v_proj.view(batch, seq, num_kv_heads, head_dim).transpose(1, 2)
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
    if rope_first:
        q_out, q_rstd = rms_norm_with_rstd_reference(rope_reference(q, cos4, sin4), q_norm_weight, q_eps)
        k_out, k_rstd = rms_norm_with_rstd_reference(rope_reference(k, cos4, sin4), k_norm_weight, k_eps)
    else:
        q_normed, q_rstd = rms_norm_with_rstd_reference(q, q_norm_weight, q_eps)
        k_normed, k_rstd = rms_norm_with_rstd_reference(k, k_norm_weight, k_eps)
        q_out, k_out = rope_reference(q_normed, cos4, sin4), rope_reference(k_normed, cos4, sin4)
    return q_out, k_out, v, q_rstd, k_rstd, proj


def _norm_rope_backward_one(
    grad_out: torch.Tensor,
    x_pre: torch.Tensor,
    rstd: torch.Tensor,
    cos4: torch.Tensor,
    sin4: torch.Tensor,
    weight: torch.Tensor,
    rope_first: bool = True,
    norm_style: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``norm(rope(p))`` (``rope_first=False``: of ``rope(norm(p))``) for one of q / k.
    ``norm_style``: 0 ``w * R(n)`` (Qwen3), 1 ``R(n * w)``, 2 ``R(n * (1 + w))`` (fp32 forms).

    Args:
        grad_out: [B, H, S, D] gradient of the normalized output.
        x_pre: [B, H, S, D] the pre-RoPE projection (any strides).
        rstd: [B, H, S] fp32.
        cos4, sin4: [Bc, 1, S, R], R = D or the rotary_dim < D of partial rotary.
        weight: [D] norm weight.

    Returns (in fp32, float64 for float64 inputs): grad_p [B, H, S, D], grad_weight [D], the
    per-element products [B, H, S, R] for grad_cos (u * r) and grad_sin (u * rotate_half(r)), u the
    gradient of RoPE's output and r its input (their rotated features).
    """
    dtype = x_pre.dtype
    acc = stats_dtype(dtype)
    cos_a, sin_a = cos4.to(acc), sin4.to(acc)
    # The norm's input x (rope(p) recomputed with the forward's roundings, or p), its normalized row.
    rotary_dim = cos4.shape[-1]
    x = partial_rope_reference(x_pre, cos4, sin4) if rope_first else x_pre
    norm_dtype = x.dtype  # the norm's input: x_pre's, or RoPE's fp32 output over bf16 x_pre under autocast
    rstd = rstd.to(acc).unsqueeze(-1)
    n = x.to(acc) * rstd
    n_rounded = n.to(norm_dtype).to(acc)  # eager multiplies the weight by the rounded row
    g = grad_out.to(acc)
    if not rope_first:  # the gradient reaching the norm's output: RoPE's backward of grad_out
        g = rope_transposed(g, cos_a, sin_a)
    grad_weight = (g * (n_rounded if norm_style == 0 else n)).sum(dim=(0, 1, 2))
    weight_eff = weight.to(acc) + 1 if norm_style == 2 else weight.to(acc)
    g_n = g * weight_eff
    # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g_n - n * mean(g_n * n)).
    grad_x = rstd * (g_n - n * (g_n * n).mean(-1, keepdim=True))
    grad_x = grad_x.to(norm_dtype).to(acc)  # eager rounds at the norm's input cast (no-op in fp32)
    if not rope_first:
        if norm_style == 0:  # the norm's output, RoPE's input
            normed = (weight * n_rounded.to(dtype)).to(acc)
        else:
            normed = (n * weight_eff).to(dtype).to(acc)
        u, normed = grad_out.to(acc)[..., :rotary_dim], normed[..., :rotary_dim]
        return grad_x, grad_weight, u * normed, u * rotate_half(normed)
    p = x_pre.to(acc)[..., :rotary_dim]
    grad_p = rope_transposed(grad_x, cos_a, sin_a)
    u = grad_x[..., :rotary_dim]
    return grad_p, grad_weight, u * p, u * rotate_half(p)


def _sum_to_rope_table(products: torch.Tensor, batch_cos: int) -> torch.Tensor:
    """Sum [B, H, S, D] over heads (and over the batch when the table is shared): -> [Bc, S, D]."""
    total = products.sum(dim=1)
    if batch_cos == 1 and total.shape[0] != 1:
        total = total.sum(dim=0, keepdim=True)
    return total


def qk_norm_rope_backward_reference(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    grad_v: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_rstd: torch.Tensor,
    k_rstd: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    grad_q_proj: torch.Tensor,
    grad_k_proj: torch.Tensor,
    grad_v_proj: torch.Tensor,
    need_weight_grad: bool,
    need_cos_sin_grad: bool,
    rope_first: bool = True,
    norm_style: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Elementwise backward of RoPE -> per-head RMSNorm (``rope_first=False``: RMSNorm -> RoPE)
    for q and k (same signature as the Triton one).

    Args:
        grad_q [B, Hq, S, D], grad_k / grad_v [B, Hkv, S, D]: gradients of the op's outputs (any
            strides, contiguous last dim).
        q [B, S, Hq, D], k [B, S, Hkv, D]: the pre-RoPE projections (strided views).
        q_rstd [B, Hq, S], k_rstd [B, Hkv, S]: fp32 reciprocal RMS saved by the forward.
        cos, sin [Bc, S, R] (R = D, or rotary_dim < D: partial rotary); q_weight, k_weight [D].
        grad_q_proj [B, S, Hq * D], grad_k_proj / grad_v_proj [B, S, Hkv * D]: preallocated
            outputs (views of one [M, qkv_size] buffer, or three buffers), written here.
        need_weight_grad: compute the norm weights' gradients.
        need_cos_sin_grad: compute grad_cos / grad_sin (summed over the heads of q and k).

    Returns:
        (grad_q_weight, grad_k_weight, grad_cos, grad_sin), each None when not asked for; in the
        dtypes of q_weight, k_weight, cos and sin.
    """
    batch, seq, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
    gq_p, gq_w, q_cos, q_sin = _norm_rope_backward_one(grad_q, q.transpose(1, 2), q_rstd, cos4, sin4, q_weight,
                                                       rope_first, norm_style)
    gk_p, gk_w, k_cos, k_sin = _norm_rope_backward_one(grad_k, k.transpose(1, 2), k_rstd, cos4, sin4, k_weight,
                                                       rope_first, norm_style)
    grad_q_proj.copy_(gq_p.transpose(1, 2).reshape(batch, seq, q_heads * head_dim))
    grad_k_proj.copy_(gk_p.transpose(1, 2).reshape(batch, seq, kv_heads * head_dim))
    grad_v_proj.copy_(grad_v.transpose(1, 2).reshape(batch, seq, kv_heads * head_dim))
    grad_q_weight = grad_k_weight = grad_cos = grad_sin = None
    if need_weight_grad:
        grad_q_weight, grad_k_weight = gq_w.to(q_weight.dtype), gk_w.to(k_weight.dtype)
    if need_cos_sin_grad:
        batch_cos = cos.shape[0]
        grad_cos = (_sum_to_rope_table(q_cos, batch_cos) + _sum_to_rope_table(k_cos, batch_cos)).to(cos.dtype)
        grad_sin = (_sum_to_rope_table(q_sin, batch_cos) + _sum_to_rope_table(k_sin, batch_cos)).to(sin.dtype)
    return grad_q_weight, grad_k_weight, grad_cos, grad_sin


def qkv_rope_qk_norm_backward_reference(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    grad_v: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_rstd: torch.Tensor,
    k_rstd: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    hidden: torch.Tensor,
    proj_weights: list[torch.Tensor],
    has_bias: bool,
    need_norm_weight_grads: bool = True,
    need_cos_sin_grads: bool = False,
    rope_first: bool = True,
) -> dict[str, torch.Tensor | list[torch.Tensor] | None]:
    """The whole backward in plain PyTorch (no output buffers to pass in): the test oracle.

    Returns a dict with ``grad_hidden``, ``grad_proj_weights`` (list), ``grad_proj_biases``
    (list, empty without bias), ``grad_q_norm_weight``, ``grad_k_norm_weight``, ``grad_cos``,
    ``grad_sin`` (None when not asked for).
    """
    batch, seq, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    tokens = batch * seq
    grad_qkv = q.new_empty(tokens, q_size + 2 * kv_size)
    views = grad_qkv.split([q_size, kv_size, kv_size], dim=1)
    gq_proj, gk_proj, gv_proj = (t.view(batch, seq, -1) for t in views)
    gq_w, gk_w, g_cos, g_sin = qk_norm_rope_backward_reference(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_norm_weight, k_norm_weight,
        gq_proj, gk_proj, gv_proj, need_norm_weight_grads, need_cos_sin_grads, rope_first,
    )
    grads = [grad_qkv] if len(proj_weights) == 1 else list(views)
    grad_hidden, grad_ws, grad_bs = projection_gemms(grads, hidden.reshape(tokens, hidden.shape[-1]), proj_weights,
                                                     need_bias_grad=has_bias)
    grad_bs = grad_bs if has_bias else []
    return {
        "grad_hidden": grad_hidden.view(hidden.shape),
        "grad_proj_weights": grad_ws,
        "grad_proj_biases": grad_bs,
        "grad_q_norm_weight": gq_w,
        "grad_k_norm_weight": gk_w,
        "grad_cos": g_cos,
        "grad_sin": g_sin,
    }
