"""Plain-PyTorch reference of the fused QK-norm -> RoPE -> KV-cache write.

It follows the Hugging Face Qwen3 code path operation by operation, so it rounds exactly
where that code rounds: RMSNorm statistics in fp32, the normalized row cast back to the
model dtype, the weight multiply in the model dtype, and each RoPE product and the sum
rounded to the model dtype. It is the oracle of the tests and the path the op takes on
devices the Triton kernel does not serve.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3RMSNorm.forward``: x [..., D], weight [D] -> [..., D] in x's dtype."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


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


def write_cache_rows_reference(cache: torch.Tensor, cache_position: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[:, :, cache_position[s]] = rows[:, :, s]``.

    Negative positions count from the end (Python indexing, as ``cache[:, :, pos] = x`` does);
    positions outside [-L, L) are skipped. cache [B, H, L, D], cache_position [S] int64,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``torch.ops.fusion_pass.qk_norm_rope_cache`` (same arguments and shapes).

    Returns (q_rotated, k_rotated) and writes k_rotated and v into the caches in place.
    """
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot = rope_reference(rms_norm_reference(q, q_weight, q_eps), cos4, sin4)
    k_rot = rope_reference(rms_norm_reference(k, k_weight, k_eps), cos4, sin4)
    write_cache_rows_reference(k_cache, cache_position, k_rot)
    write_cache_rows_reference(v_cache, cache_position, v)
    return q_rot, k_rot
