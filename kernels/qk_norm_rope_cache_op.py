"""``torch.ops.fusion_pass.qk_norm_rope_cache``: QK RMSNorm -> RoPE -> KV-cache write, one op.

unfused (Hugging Face Qwen3 attention)::

    q = q_norm(q); k = k_norm(k)                    # per-head RMSNorm
    q, k = apply_rotary_pos_emb(q, k, cos, sin)     # rotate_half RoPE
    k_cache.index_copy_(2, cache_position, k)       # StaticCache.update
    v_cache.index_copy_(2, cache_position, v)

fused::

    q, k = torch.ops.fusion_pass.qk_norm_rope_cache(q, k, v, q_w, k_w, cos, sin,
                                                    k_cache, v_cache, cache_position, eps, eps)

The op mutates ``k_cache`` and ``v_cache`` (``mutates_args``): under torch.compile it appears
as ``auto_functionalized`` and Inductor calls it directly on the cache buffers, so the caches
are updated in place with no copy. On CUDA (and on CPU under ``TRITON_INTERPRET=1``) it runs
the Triton kernel; elsewhere the PyTorch reference.
"""

from __future__ import annotations

import os

import torch

from .qk_norm_rope_cache_reference import qk_norm_rope_cache_reference

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_qk_norm_rope_cache_args(
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
) -> None:
    """Raise ``ValueError`` naming the first argument that breaks the op's contract."""

    def fail(name: str, expected: str, got: object) -> None:
        raise ValueError(f"fusion_pass.qk_norm_rope_cache: {name}: expected {expected}, got {got}")

    if q.dim() != 4:
        fail("q", "a 4-D tensor [B, Hq, S, D]", f"shape {tuple(q.shape)}")
    batch, q_heads, seq, head_dim = q.shape
    if q.dtype not in SUPPORTED_DTYPES:
        fail("q", f"dtype in {SUPPORTED_DTYPES}", q.dtype)
    if head_dim % 2:
        fail("q", "an even head_dim (RoPE rotates halves)", head_dim)
    if k.dim() != 4 or k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != head_dim:
        fail("k", f"shape [B={batch}, Hkv, S={seq}, D={head_dim}]", f"shape {tuple(k.shape)}")
    kv_heads = k.shape[1]
    if kv_heads == 0 or q_heads % kv_heads:
        fail("k", f"a head count dividing q's {q_heads} heads (GQA)", kv_heads)
    if tuple(v.shape) != tuple(k.shape):
        fail("v", f"k's shape {tuple(k.shape)}", f"shape {tuple(v.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            fail(name, f"q's dtype {q.dtype}", t.dtype)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (head_dim,):
            fail(name, f"shape [{head_dim}] (head_dim)", f"shape {tuple(w.shape)}")
        if w.dtype != q.dtype:
            fail(name, f"q's dtype {q.dtype}", w.dtype)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq or t.shape[2] != head_dim:
            fail(name, f"shape [1 or B={batch}, S={seq}, D={head_dim}]", f"shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            fail(name, f"q's dtype {q.dtype}", t.dtype)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[0] != batch or cache.shape[1] != kv_heads or cache.shape[3] != head_dim:
            fail(name, f"shape [B={batch}, Hkv={kv_heads}, L, D={head_dim}]", f"shape {tuple(cache.shape)}")
        if cache.shape[2] < seq:
            fail(name, f"a cache length L >= S={seq} (the cache is too short)", cache.shape[2])
        if cache.dtype != k.dtype:
            fail(name, f"k's dtype {k.dtype}", cache.dtype)
    if v_cache.shape[2] != k_cache.shape[2]:  # the kernel bounds both writes by one length
        fail("v_cache", f"k_cache's length L={k_cache.shape[2]}", v_cache.shape[2])
    if cache_position.dim() != 1 or cache_position.shape[0] != seq:
        fail("cache_position", f"shape [S={seq}]", f"shape {tuple(cache_position.shape)}")
    if cache_position.dtype not in (torch.int64, torch.int32):
        fail("cache_position", "dtype int64 or int32", cache_position.dtype)
    named = (("q", q), ("k", k), ("v", v), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos),
             ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache))
    for name, t in named:
        if t.numel() and t.stride(-1) != 1:
            fail(name, "a contiguous last dim (stride(-1) == 1)", f"strides {tuple(t.stride())}")
    for name, t in named + (("cache_position", cache_position),):
        if t.device != q.device:
            fail(name, f"q's device {q.device}", t.device)


def _use_triton(q: torch.Tensor) -> bool:
    return q.is_cuda or (q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


# Defined with torch.library.Library rather than torch.library.custom_op: the custom_op wrapper
# costs ~40 us of host time per call for an op with mutated arguments (measured on the CPU CI
# machine: 40.9 us vs 4.4 us for the same schema), which is paid by every layer of every step
# that is not replayed as a CUDA graph. Functionalization (auto_functionalized) and Inductor
# treat both the same: the schema's (a!)/(b!) annotations are what they read.
_LIB = torch.library.Library("fusion_pass", "FRAGMENT")
_LIB.define(
    "qk_norm_rope_cache(Tensor q, Tensor k, Tensor v, Tensor q_weight, Tensor k_weight, Tensor cos, "
    "Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_position, float q_eps, float k_eps) "
    "-> (Tensor, Tensor)"
)
_LIB.define(
    "qk_norm_rope_cache_eps_tensor(Tensor q, Tensor k, Tensor v, Tensor q_weight, Tensor k_weight, "
    "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_position, Tensor q_eps, "
    "Tensor k_eps) -> (Tensor, Tensor)"
)


def qk_norm_rope_cache(
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
    """Per-head RMSNorm of q and k, rotate_half RoPE, and the K/V cache write, fused.

    Args:
        q: [B, Hq, S, D] queries before the norm (any strides with a contiguous last dim).
        k, v: [B, Hkv, S, D] keys before the norm, values; Hq is a multiple of Hkv.
        q_weight, k_weight: [D] RMSNorm weights, q's dtype.
        cos, sin: [B or 1, S, D] rotary tables in q's dtype (as the rotary module returns them).
        k_cache, v_cache: [B, Hkv, L, D] caches, updated in place at ``cache_position``.
        cache_position: [S] int64 cache rows to write. Negative positions count from the end
            (Python indexing, like ``cache[:, :, pos] = x``); positions outside [-L, L) are
            skipped, never written out of bounds (``index_copy_`` would raise instead).
        q_eps, k_eps: the two norms' epsilons.

    Returns:
        (q_rotated [B, Hq, S, D], k_rotated [B, Hkv, S, D]) with q's and k's strides.
    """
    check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position)
    if _use_triton(q):
        from .qk_norm_rope_cache_triton import qk_norm_rope_cache_triton

        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        qk_norm_rope_cache_triton(
            q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps, q_out, k_out
        )
        return q_out, k_out
    q_rot, k_rot = qk_norm_rope_cache_reference(
        q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps
    )
    # Outputs must not alias inputs and must carry the eager layout of q and k.
    return _with_layout_of(q, q_rot), _with_layout_of(k, k_rot)


def qk_norm_rope_cache_eps_tensor(
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
    q_eps: torch.Tensor,
    k_eps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope_cache`` with the epsilons as 0-d tensors.

    ``torch.compile(dynamic=True)`` lifts a Python float such as ``variance_epsilon`` into a
    0-d CPU tensor graph input; reading it here costs no device synchronization.
    """
    for name, eps in (("q_eps", q_eps), ("k_eps", k_eps)):
        if eps.numel() != 1:
            raise ValueError(f"fusion_pass.qk_norm_rope_cache: {name}: expected a 0-d tensor, got shape {tuple(eps.shape)}")
    return qk_norm_rope_cache(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position,
                              float(q_eps), float(k_eps))


def _with_layout_of(template: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if value.stride() == template.stride():
        return value
    out = torch.empty_like(template)
    out.copy_(value)
    return out


def _fake(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps):
    """Shapes for tracing (both overloads): the checks run at compile time too."""
    check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position)
    return torch.empty_like(q), torch.empty_like(k)


torch.library.register_fake("fusion_pass::qk_norm_rope_cache", _fake, lib=_LIB)
torch.library.register_fake("fusion_pass::qk_norm_rope_cache_eps_tensor", _fake, lib=_LIB)


def unsupported_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the fused op would not serve this geometry, or None when it does.

    The pattern's check asks this before rewriting, and the report shows the reason.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the fusion serves bf16 and fp16 models)"
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two in [16, 256]"
    return None


_LIB.impl("qk_norm_rope_cache", qk_norm_rope_cache, "CompositeExplicitAutograd")
_LIB.impl("qk_norm_rope_cache_eps_tensor", qk_norm_rope_cache_eps_tensor, "CompositeExplicitAutograd")
