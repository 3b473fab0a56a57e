"""``torch.ops.fusion_pass.qkv_rope_qk_norm`` and its backward: QKV projection -> RoPE -> per-head RMSNorm.

unfused (Hugging Face ``HunYuanDenseV1Attention``; HunyuanImage-3 style with one fused weight)::

    qkv = qkv_proj(hidden)                                   # or q_proj / k_proj / v_proj
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # -> view heads -> transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)              # rotate_half RoPE, BEFORE the norm
    q = query_layernorm(q); k = key_layernorm(k)             # per-head RMSNorm

fused, as the training pass writes it into joint graphs (``QKVRopeQKNormFunction``, at the end
of this module: forward in plain torch ops that Inductor compiles, backward one op)::

    q, k, v = QKVRopeQKNormFunction.apply(hidden, q_norm_weight, k_norm_weight, cos, sin, Hq, Hkv,
                                          eps, eps, 1, qkv_weight)

fused, as one opaque op for direct calls (its forward runs the PyTorch reference)::

    q, k, v, q_rstd, k_rstd, saved = torch.ops.fusion_pass.qkv_rope_qk_norm(
        hidden, [qkv_weight], [], q_norm_weight, k_norm_weight, cos, sin, Hq, Hkv, eps, eps)

The forward op is differentiable (``register_autograd``); its backward is one call of
``torch.ops.fusion_pass.qkv_rope_qk_norm_backward``, which computes the elementwise pass (norm
and RoPE gradients, written straight into the [B*S, qkv_size] gradient of the projection output,
no transpose or cat), the norm-weight and cos/sin gradients, then the two projection GEMMs.

What the forward saves, and why: the *pre-RoPE* projection outputs q and k (views of the
projection output the GEMM wrote anyway: no extra write in the forward; for a fused weight the
whole [B, S, qkv_size] output is kept, its v columns included), the fp32 ``rstd`` per row
([B, H, S]: D times smaller than a row), cos, sin, the norm weights, hidden and the projection
weights. The backward recomputes ``x = rope(q)`` with the forward's roundings (a multiply-add per
element, in registers) rather than reading a saved ``x`` (``query_pre_norm``): the rotation is
then exactly the forward's, so grad_cos = sum(grad_x * q) and grad_sin = sum(grad_x *
rotate_half(q)) are exact for arbitrary tables. Saving x instead would need q recovered by an
inverse rotation, exact only when cos^2 + sin^2 == 1 (the published SOL-ExecBench reference even
applies a second forward rotation there, so its grad_cos / grad_sin differ from autograd's), and
would cost one more [B, S, H, D] tensor per q and k in memory.

The backward op runs the Triton elementwise pass of ``qkv_rope_qk_norm_backward_triton`` on CUDA (and
on CPU under ``TRITON_INTERPRET=1``), else its PyTorch reference (``qkv_rope_qk_norm_reference``,
same signatures), then the projection GEMMs in torch (``projection_backward``). In compiled CUDA
training graphs the region's backward is not this op: ``QKVRopeQKNormFunction`` traces the same
kernels into the graph as kernel nodes, and the GEMMs as ``aten.mm`` nodes (``_backward_in_graph``).
The forward runs the PyTorch reference on every device. For a fused weight its v output is a
copy of the v columns (outputs of a custom op may not alias each other or the saved output).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from .projection_backward import projection_gemms
from .qkv_rope_qk_norm_backward_triton import qk_norm_rope_backward_in_graph, qk_norm_rope_backward_triton
from .triton_device import kernels_in_graph, triton_applicable
from .qkv_rope_qk_norm_reference import qk_norm_rope_backward_reference, qkv_rope_qk_norm_forward_reference
from .argument_errors import check_q_k_heads, failure
from .rounding import SUPPORTED_DTYPES


def check_qkv_rope_qk_norm_args(
    hidden: Tensor,
    proj_weights: list[Tensor],
    proj_biases: list[Tensor],
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> None:
    """Raise ``ValueError`` naming the first argument of the forward op that breaks its contract."""

    fail = failure("qkv_rope_qk_norm")

    if hidden.dim() != 3:
        fail("hidden", "a 3-D tensor [B, S, K]", f"shape {tuple(hidden.shape)}")
    batch, seq, hidden_size = hidden.shape
    dtype = hidden.dtype
    if dtype not in SUPPORTED_DTYPES:
        fail("hidden", f"dtype in {SUPPORTED_DTYPES}", dtype)
    if q_norm_weight.dim() != 1:
        fail("q_norm_weight", "a 1-D tensor [D] (head_dim)", f"shape {tuple(q_norm_weight.shape)}")
    head_dim = q_norm_weight.shape[0]
    if (k_norm_weight.dim() == 1 and cos.dim() == 3 and k_norm_weight.shape[0] == cos.shape[2] != head_dim):
        # k's weight and cos agree on D: q's weight is the odd one out.
        fail("q_norm_weight", f"shape [{cos.shape[2]}] (head_dim, as k_norm_weight and cos have)",
             f"shape {tuple(q_norm_weight.shape)}")
    if head_dim % 2:
        fail("q_norm_weight", "an even head_dim (RoPE rotates halves)", head_dim)
    if tuple(k_norm_weight.shape) != (head_dim,):
        fail("k_norm_weight", f"shape [{head_dim}] (head_dim)", f"shape {tuple(k_norm_weight.shape)}")
    if num_q_heads <= 0:
        fail("num_q_heads", "a positive head count", num_q_heads)
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        fail("num_kv_heads", f"a positive head count dividing num_q_heads={num_q_heads} (GQA)", num_kv_heads)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if len(proj_weights) == 1:
        expected_shapes = [(q_size + 2 * kv_size, hidden_size)]
    elif len(proj_weights) == 3:
        expected_shapes = [(q_size, hidden_size), (kv_size, hidden_size), (kv_size, hidden_size)]
    else:
        fail("proj_weights", "1 fused QKV weight or 3 weights (q, k, v)", f"{len(proj_weights)} tensors")
    for i, (w, shape) in enumerate(zip(proj_weights, expected_shapes)):
        if tuple(w.shape) != shape:
            fail(f"proj_weights[{i}]", f"shape {list(shape)} (Hq={num_q_heads}, Hkv={num_kv_heads}, "
                 f"D={head_dim}, K={hidden_size})", f"shape {tuple(w.shape)}")
    if proj_biases and len(proj_biases) != len(proj_weights):
        fail("proj_biases", f"none or {len(proj_weights)} (one per weight)", f"{len(proj_biases)} tensors")
    for i, (b, shape) in enumerate(zip(proj_biases, expected_shapes)):
        if tuple(b.shape) != shape[:1]:
            fail(f"proj_biases[{i}]", f"shape [{shape[0]}]", f"shape {tuple(b.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq or t.shape[2] != head_dim:
            fail(name, f"shape [1 or B={batch}, S={seq}, D={head_dim}]", f"shape {tuple(t.shape)}")
    if tuple(sin.shape) != tuple(cos.shape):
        fail("sin", f"cos's shape {tuple(cos.shape)}", f"shape {tuple(sin.shape)}")
    named = [("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight), ("cos", cos), ("sin", sin)]
    named += [(f"proj_weights[{i}]", w) for i, w in enumerate(proj_weights)]
    named += [(f"proj_biases[{i}]", b) for i, b in enumerate(proj_biases)]
    for name, t in named:
        if t.dtype != dtype:
            fail(name, f"hidden's dtype {dtype}", t.dtype)
        if t.device != hidden.device:
            fail(name, f"hidden's device {hidden.device}", t.device)


def _proj_views(saved_proj: list[Tensor], batch, seq, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """The pre-RoPE q [B, S, Hq, D] and k [B, S, Hkv, D] as views of the saved projection output(s)."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if len(saved_proj) == 1:
        qkv = saved_proj[0]
        q = qkv[..., :q_size]
        k = qkv[..., q_size : q_size + kv_size]
    else:
        q, k = saved_proj
    return q.view(batch, seq, num_q_heads, head_dim), k.view(batch, seq, num_kv_heads, head_dim)


def _heads_view(proj: Tensor, batch, seq, heads: int, head_dim: int) -> Tensor:
    """[B, S, H * D] (any row stride) -> the model's [B, H, S, D] transposed view."""
    return proj.view(batch, seq, heads, head_dim).transpose(1, 2)


@torch.library.custom_op("fusion_pass::qkv_rope_qk_norm", mutates_args=())
def qkv_rope_qk_norm(
    hidden: Tensor,
    proj_weights: list[Tensor],
    proj_biases: list[Tensor],
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_eps: float,
    k_eps: float,
    *,
    rope_first: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """QKV projection(s), split into heads, rotate_half RoPE, then per-head RMSNorm of q and k
    (``rope_first=False``: the norm, then RoPE, as Qwen3 orders them).

    Args:
        hidden: [B, S, K] projection input.
        proj_weights: ``[qkv_weight]`` ([Hq*D + 2*Hkv*D, K], rows ordered q, k, v) or
            ``[q_weight, k_weight, v_weight]`` ([Hq*D | Hkv*D | Hkv*D, K]).
        proj_biases: ``[]`` or one bias per weight.
        q_norm_weight, k_norm_weight: [D] RMSNorm weights.
        cos, sin: [Bc, S, D] rotary tables, Bc = 1 or B (as the rotary module returns them).
        num_q_heads, num_kv_heads: Hq and Hkv (Hq a multiple of Hkv).
        q_eps, k_eps: the two norms' epsilons.
        rope_first: HunYuanDenseV1's order (RoPE, then the norm); False: Qwen3's.

    Every tensor has hidden's dtype (bf16, fp16 or fp32) and device.

    Returns:
        ``(q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, D], q_rstd [B, Hq, S], k_rstd [B, Hkv, S],
        saved)``: q, k, v with the eager model's strides ([B, S, H, D] memory order); rstd fp32;
        ``saved`` = the projection output(s) the backward reads the pre-RoPE q and k from
        (``[qkv]`` for a fused weight, ``[q_proj, k_proj]`` for separate weights); not
        differentiable.
    """
    check_qkv_rope_qk_norm_args(
        hidden, proj_weights, proj_biases, q_norm_weight, k_norm_weight, cos, sin, num_q_heads, num_kv_heads
    )
    q_out, k_out, v, q_rstd, k_rstd, proj = qkv_rope_qk_norm_forward_reference(
        hidden, proj_weights, proj_biases, q_norm_weight, k_norm_weight, cos, sin,
        num_q_heads, num_kv_heads, q_eps, k_eps, rope_first,
    )
    if len(proj) == 1:
        saved = proj
        # v is a view of the fused projection output that ``saved`` returns: outputs may not
        # alias each other, so v gets its own buffer (the eager layout, [B, S, Hkv, D] order).
        v = torch.empty_like(v).copy_(v)
    else:
        saved = proj[:2]  # v is a view of v_proj, which nothing else returns
    return q_out, k_out, v, q_rstd.contiguous(), k_rstd.contiguous(), saved


@qkv_rope_qk_norm.register_fake
def _(hidden, proj_weights, proj_biases, q_norm_weight, k_norm_weight, cos, sin, num_q_heads, num_kv_heads,
      q_eps, k_eps, *, rope_first=True):
    check_qkv_rope_qk_norm_args(
        hidden, proj_weights, proj_biases, q_norm_weight, k_norm_weight, cos, sin, num_q_heads, num_kv_heads
    )
    batch, seq = hidden.shape[0], hidden.shape[1]
    head_dim = q_norm_weight.shape[0]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if len(proj_weights) == 1:
        qkv = hidden.new_empty(batch, seq, q_size + 2 * kv_size)
        saved = [qkv]
        q_proj, k_proj, v_proj = qkv.split([q_size, kv_size, kv_size], dim=-1)
    else:
        q_proj, k_proj, v_proj = (hidden.new_empty(batch, seq, n) for n in (q_size, kv_size, kv_size))
        saved = [q_proj, k_proj]
    q = _heads_view(q_proj, batch, seq, num_q_heads, head_dim)
    k = _heads_view(k_proj, batch, seq, num_kv_heads, head_dim)
    v = _heads_view(v_proj, batch, seq, num_kv_heads, head_dim)
    if len(proj_weights) == 1:
        v = torch.empty_like(v)
    rstd = functools.partial(hidden.new_empty, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), v, rstd(batch, num_q_heads, seq),
            rstd(batch, num_kv_heads, seq), saved)


def check_qkv_rope_qk_norm_backward_args(
    grad_q: Tensor,
    grad_k: Tensor,
    grad_v: Tensor,
    q: Tensor,
    k: Tensor,
    q_rstd: Tensor,
    k_rstd: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    hidden: Tensor,
    proj_weights: list[Tensor],
) -> None:
    """Raise ``ValueError`` naming the first argument of the backward op that breaks its contract."""

    fail = failure("qkv_rope_qk_norm_backward")
    # Runs on every backward (the GPU waits for it at small B*S): torch.Size compared with tuples
    # as is, argument names formatted only to fail.
    if q.dim() != 4:
        fail("q", "a 4-D tensor [B, S, Hq, D] (pre-RoPE projection view)", f"shape {tuple(q.shape)}")
    batch, seq, q_heads, kv_heads, head_dim = check_q_k_heads(fail, q, k, heads_first=False)
    dtype = q.dtype
    for name, t, shape in (
        ("grad_q", grad_q, (batch, q_heads, seq, head_dim)),
        ("grad_k", grad_k, (batch, kv_heads, seq, head_dim)),
        ("grad_v", grad_v, (batch, kv_heads, seq, head_dim)),
        ("q_rstd", q_rstd, (batch, q_heads, seq)),
        ("k_rstd", k_rstd, (batch, kv_heads, seq)),
        ("q_norm_weight", q_norm_weight, (head_dim,)),
        ("k_norm_weight", k_norm_weight, (head_dim,)),
    ):
        if t.shape != shape:
            fail(name, f"shape {list(shape)}", f"shape {tuple(t.shape)}")
    for name, t in (("q_rstd", q_rstd), ("k_rstd", k_rstd)):
        if t.dtype != torch.float32:
            fail(name, "dtype torch.float32", t.dtype)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq or t.shape[2] != head_dim:
            fail(name, f"shape [1 or B={batch}, S={seq}, D={head_dim}]", f"shape {tuple(t.shape)}")
    if hidden.dim() != 3 or hidden.shape[0] != batch or hidden.shape[1] != seq:
        fail("hidden", f"shape [B={batch}, S={seq}, K]", f"shape {tuple(hidden.shape)}")
    hidden_size = hidden.shape[2]
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    if len(proj_weights) == 1:
        expected_shapes = ((q_size + 2 * kv_size, hidden_size),)
    elif len(proj_weights) == 3:
        expected_shapes = ((q_size, hidden_size), (kv_size, hidden_size), (kv_size, hidden_size))
    else:
        fail("proj_weights", "1 fused QKV weight or 3 weights (q, k, v)", f"{len(proj_weights)} tensors")
    for i, (w, shape) in enumerate(zip(proj_weights, expected_shapes)):
        if w.shape != shape:
            fail(f"proj_weights[{i}]", f"shape {list(shape)}", f"shape {tuple(w.shape)}")
    device = q.device
    named = (("grad_q", grad_q), ("grad_k", grad_k), ("grad_v", grad_v), ("k", k), ("cos", cos), ("sin", sin),
             ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight), ("hidden", hidden))
    for name, t in named:
        if t.dtype != dtype:
            fail(name, f"q's dtype {dtype}", t.dtype)
        if t.device != device:
            fail(name, f"q's device {device}", t.device)
    for i, w in enumerate(proj_weights):
        if w.dtype != dtype:
            fail(f"proj_weights[{i}]", f"q's dtype {dtype}", w.dtype)
        if w.device != device:
            fail(f"proj_weights[{i}]", f"q's device {device}", w.device)
    for name, t in (("q_rstd", q_rstd), ("k_rstd", k_rstd)):
        if t.device != device:
            fail(name, f"q's device {device}", t.device)
    for name, t in (("grad_q", grad_q), ("grad_k", grad_k), ("grad_v", grad_v), ("q", q), ("k", k)):
        if t.stride(-1) != 1 and t.numel():
            fail(name, "a contiguous last dim (stride(-1) == 1)", f"strides {tuple(t.stride())}")


def elementwise_backward_implementation(t: Tensor) -> Callable:
    """The elementwise backward for tensors like ``t``: the Triton pass where Triton runs (CUDA,
    or the CPU interpreter), else its PyTorch reference (same signature)."""
    return qk_norm_rope_backward_triton if triton_applicable(t) else qk_norm_rope_backward_reference


# Defined with torch.library.Library rather than torch.library.custom_op (as the forward
# cache op, kernels/qk_norm_rope_cache_op.py): the custom_op wrapper (autograd shim, dynamo guard,
# alias checks) costs ~6 us per call on the CPU CI machine (9.2 vs 3.1 us for a trivial op), paid
# by every layer of every training step that is not replayed as a CUDA graph. This op has no
# autograd of its own either way; Inductor reads the same schema.
_LIB = torch.library.Library("fusion_pass", "FRAGMENT")
_LIB.define(
    "qkv_rope_qk_norm_backward(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor q, Tensor k, "
    "Tensor q_rstd, Tensor k_rstd, Tensor cos, Tensor sin, Tensor q_norm_weight, Tensor k_norm_weight, "
    "Tensor hidden, Tensor[] proj_weights, bool has_bias, bool need_hidden_grad, bool need_proj_grads, "
    "bool need_norm_weight_grads, bool need_cos_sin_grads, bool rope_first=True) "
    "-> (Tensor[], Tensor[], Tensor[], Tensor[], Tensor[])",
    tags=(torch.Tag.pt2_compliant_tag,),  # as custom_op tagged it
)


def qkv_rope_qk_norm_backward(
    grad_q: Tensor,
    grad_k: Tensor,
    grad_v: Tensor,
    q: Tensor,
    k: Tensor,
    q_rstd: Tensor,
    k_rstd: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    hidden: Tensor,
    proj_weights: list[Tensor],
    has_bias: bool,
    need_hidden_grad: bool,
    need_proj_grads: bool,
    need_norm_weight_grads: bool,
    need_cos_sin_grads: bool,
    rope_first: bool = True,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """Backward of ``fusion_pass::qkv_rope_qk_norm``.

    Args:
        grad_q [B, Hq, S, D], grad_k / grad_v [B, Hkv, S, D]: gradients of the forward's q, k, v
            (any strides with a contiguous last dim).
        q [B, S, Hq, D], k [B, S, Hkv, D]: the pre-RoPE projections (views of the saved output).
        q_rstd [B, Hq, S], k_rstd [B, Hkv, S]: fp32, saved by the forward.
        cos, sin [Bc, S, D]; q_norm_weight, k_norm_weight [D]; hidden [B, S, K];
        proj_weights: ``[qkv_weight]`` or ``[q_weight, k_weight, v_weight]``.
        has_bias: the projections have biases (their gradients are returned).
        need_*: which gradients to compute.
        rope_first: the forward's order (False: the norm, then RoPE).

    Returns:
        Five lists, each empty when not asked for: ``[grad_hidden]``, the projection weights'
        gradients, the biases' gradients, ``[grad_q_norm_weight, grad_k_norm_weight]`` and
        ``[grad_cos, grad_sin]`` (summed over the heads of q and k, and over the batch when
        Bc = 1). All deterministic (no atomics).
    """
    check_qkv_rope_qk_norm_backward_args(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_norm_weight, k_norm_weight, hidden, proj_weights
    )
    batch, seq, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    tokens = batch * seq
    # Gradient of the projection output(s), written by the elementwise pass: one [M, qkv_size]
    # buffer (the kernel writes its q, k and v column blocks), read by the GEMMs as is (fused
    # weight) or as its three column blocks (separate weights).
    grad_proj = q.new_empty(tokens, q_size + 2 * kv_size)
    parts = grad_proj.split_with_sizes([q_size, kv_size, kv_size], 1)  # the C++ method: no Python wrapper
    gq_proj, gk_proj, gv_proj = (p.view(batch, seq, p.shape[1]) for p in parts)
    grad_q_weight, grad_k_weight, grad_cos, grad_sin = elementwise_backward_implementation(q)(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos.contiguous(), sin.contiguous(),
        q_norm_weight, k_norm_weight, gq_proj, gk_proj, gv_proj, need_norm_weight_grads, need_cos_sin_grads,
        rope_first=rope_first,
    )
    return _with_projection_gemms(grad_proj, (q_size, kv_size), hidden, proj_weights, has_bias, need_hidden_grad,
                                  need_proj_grads, (grad_q_weight, grad_k_weight, grad_cos, grad_sin),
                                  need_norm_weight_grads, need_cos_sin_grads)


def _with_projection_gemms(grad_proj, sizes, hidden, proj_weights, has_bias, need_hidden_grad, need_proj_grads,
                           elementwise_grads, need_norm_weight_grads, need_cos_sin_grads):
    """The backward's five result lists from the elementwise pass's results: ``grad_proj``
    [B*S, q_size + 2 kv_size] (its column blocks for separate weights) through ``projection_gemms``,
    and ``elementwise_grads`` = (grad_q_weight, grad_k_weight, grad_cos, grad_sin)."""
    q_size, kv_size = sizes
    grads = [grad_proj] if len(proj_weights) == 1 else list(grad_proj.split([q_size, kv_size, kv_size], 1))
    need_bias_grads = has_bias and need_proj_grads
    grad_hidden, grad_weights, grad_biases = projection_gemms(
        grads, hidden.reshape(grad_proj.shape[0], hidden.shape[2]), list(proj_weights), need_hidden_grad,
        need_proj_grads, need_bias_grads)
    grad_q_weight, grad_k_weight, grad_cos, grad_sin = elementwise_grads
    return (
        [grad_hidden.view(hidden.shape)] if need_hidden_grad else [],
        list(grad_weights) if need_proj_grads else [],
        list(grad_biases) if need_bias_grads else [],
        [grad_q_weight, grad_k_weight] if need_norm_weight_grads else [],
        [grad_cos, grad_sin] if need_cos_sin_grads else [],
    )


_LIB.impl("qkv_rope_qk_norm_backward", qkv_rope_qk_norm_backward, "CompositeExplicitAutograd")


def _backward_fake(grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_norm_weight, k_norm_weight, hidden, proj_weights,
                   has_bias, need_hidden_grad, need_proj_grads, need_norm_weight_grads, need_cos_sin_grads,
                   rope_first=True):
    check_qkv_rope_qk_norm_backward_args(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_norm_weight, k_norm_weight, hidden, proj_weights
    )
    return (
        [hidden.new_empty(hidden.shape)] if need_hidden_grad else [],
        [torch.empty_like(w, memory_format=torch.contiguous_format) for w in proj_weights] if need_proj_grads else [],
        [w.new_empty(w.shape[0]) for w in proj_weights] if need_proj_grads and has_bias else [],
        [torch.empty_like(q_norm_weight), torch.empty_like(k_norm_weight)] if need_norm_weight_grads else [],
        [cos.new_empty(cos.shape), sin.new_empty(sin.shape)] if need_cos_sin_grads else [],
    )


torch.library.register_fake("fusion_pass::qkv_rope_qk_norm_backward", _backward_fake, lib=_LIB)


def _setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    (hidden, proj_weights, proj_biases, q_norm_weight, k_norm_weight, cos, sin,
     num_q_heads, num_kv_heads, _q_eps, _k_eps) = inputs
    _q, _k, _v, q_rstd, k_rstd, saved_proj = output
    ctx.mark_non_differentiable(q_rstd, k_rstd, *saved_proj)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, q_norm_weight, k_norm_weight, cos, sin, q_rstd, k_rstd, *proj_weights, *saved_proj)
    ctx.num_weights = len(proj_weights)
    ctx.has_bias = bool(proj_biases)
    ctx.heads = (num_q_heads, num_kv_heads)
    ctx.rope_first = keyword_only_inputs.get("rope_first", True)


def _dense_last_dim(grad: Tensor | None, like: Tensor, shape) -> Tensor:
    """An output's gradient as the backward op takes it: zeros when unused (materialize_grads is
    off, so unused outputs arrive as None), copied when its last dim is strided."""
    if grad is None:
        return like.new_zeros(shape)
    if grad.stride(-1) != 1:
        return grad.contiguous()
    return grad


def _region_backward(ctx, grad_q, grad_k, grad_v, need_hidden: bool, need_weights, need_biases,
                     need_q_w: bool, need_k_w: bool, need_cos: bool, need_sin: bool, in_graph: bool = False):
    """The backward on what ``ctx`` saved; returns (grad_hidden, grad_weights, grad_biases,
    grad_q_weight, grad_k_weight, grad_cos, grad_sin), None (or lists of None) where not needed.

    ``in_graph`` (the training pattern's replacement, traced into the joint graph): on CUDA with
    static, non-zero B*S the elementwise pass becomes Triton kernel nodes and the GEMMs ``aten.mm`` nodes
    (``_backward_in_graph``), which Inductor launches itself; otherwise, and for eager callers, one
    call of the ``qkv_rope_qk_norm_backward`` op."""
    if torch.is_grad_enabled():
        # backward(create_graph=True): the op has no derivative of its own (custom_op raised
        # here too; a Library op would only warn and silently drop the second-order terms).
        raise RuntimeError("fusion_pass.qkv_rope_qk_norm: double backward (create_graph=True) is not supported")
    hidden, q_norm_weight, k_norm_weight, cos, sin, q_rstd, k_rstd, *rest = ctx.saved_tensors
    proj_weights, saved_proj = rest[: ctx.num_weights], rest[ctx.num_weights :]
    num_q_heads, num_kv_heads = ctx.heads
    batch, seq = hidden.shape[0], hidden.shape[1]
    head_dim = q_norm_weight.shape[0]
    q, k = _proj_views(saved_proj, batch, seq, num_q_heads, num_kv_heads, head_dim)
    grad_q = _dense_last_dim(grad_q, q, (batch, num_q_heads, seq, head_dim))
    grad_k = _dense_last_dim(grad_k, k, (batch, num_kv_heads, seq, head_dim))
    grad_v = _dense_last_dim(grad_v, k, (batch, num_kv_heads, seq, head_dim))
    need_proj = any(need_weights) or any(need_biases)
    need_norm = need_q_w or need_k_w
    need_cos_sin = need_cos or need_sin
    backward = torch.ops.fusion_pass.qkv_rope_qk_norm_backward
    if in_graph and kernels_in_graph(q) and isinstance(batch, int) and isinstance(seq, int) and batch * seq:
        backward = _backward_in_graph
    grad_hidden, grad_weights, grad_biases, grad_norm, grad_cos_sin = backward(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_norm_weight, k_norm_weight, hidden,
        list(proj_weights), ctx.has_bias, need_hidden, need_proj, need_norm, need_cos_sin, ctx.rope_first,
    )
    return (
        grad_hidden[0] if need_hidden else None,
        list(grad_weights) if need_proj else [None] * ctx.num_weights,
        list(grad_biases) if need_proj and ctx.has_bias else [None] * len(need_biases),
        grad_norm[0] if need_q_w else None,
        grad_norm[1] if need_k_w else None,
        grad_cos_sin[0] if need_cos else None,
        grad_cos_sin[1] if need_sin else None,
    )


def _backward_in_graph(grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_norm_weight, k_norm_weight, hidden,
                       proj_weights, has_bias, need_hidden_grad, need_proj_grads, need_norm_weight_grads,
                       need_cos_sin_grads, rope_first=True):
    """``qkv_rope_qk_norm_backward`` (same arguments and results) as traced graph nodes: the
    elementwise Triton pass as kernel nodes, then the GEMMs as torch ops. The training pattern
    checked the arguments when it matched; nothing is checked per call."""
    _, _, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    grad_proj, grad_q_weight, grad_k_weight, grad_cos, grad_sin = qk_norm_rope_backward_in_graph(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos.contiguous(), sin.contiguous(), q_norm_weight,
        k_norm_weight, need_norm_weight_grads, need_cos_sin_grads, rope_first)
    return _with_projection_gemms(grad_proj, (q_size, kv_size), hidden, proj_weights, has_bias, need_hidden_grad,
                                  need_proj_grads, (grad_q_weight, grad_k_weight, grad_cos, grad_sin),
                                  need_norm_weight_grads, need_cos_sin_grads)


def _backward(ctx, grad_q, grad_k, grad_v, _grad_q_rstd, _grad_k_rstd, _grad_saved):
    (need_hidden, need_weights, need_biases, need_q_w, need_k_w, need_cos, need_sin,
     *_) = ctx.needs_input_grad
    grads = _region_backward(ctx, grad_q, grad_k, grad_v, need_hidden, need_weights, need_biases,
                             need_q_w, need_k_w, need_cos, need_sin)
    return (*grads, None, None, None, None)  # keyword-only rope_first gets no gradient slot


qkv_rope_qk_norm.register_autograd(_backward, setup_context=_setup_context)


class QKVRopeQKNormFunction(torch.autograd.Function):
    """The region with autograd, as the training pattern puts it into joint graphs.

    unfused: the model's projection -> RoPE -> RMSNorm, differentiated by autograd op by op.
    fused:   forward = the same computation in plain torch ops (``qkv_rope_qk_norm_forward_reference``,
             plus the fp32 rstd it saves), which Inductor compiles into its own fused kernels as it
             does the model's code; backward = ONE ``torch.ops.fusion_pass.qkv_rope_qk_norm_backward``.

    Why not the ``qkv_rope_qk_norm`` custom op in the graph: a custom op is opaque to Inductor, so
    its forward ran as eager PyTorch ops, slower than Inductor's fused forward (H200, HunYuanDenseV1
    training step B2 S2048: 0.993x stock compile with the custom op). Here only the
    backward is ours. Same saved tensors as the op (pre-RoPE projections, fp32 rstd).

    ``apply(hidden, q_norm_weight, k_norm_weight, cos, sin, num_q_heads, num_kv_heads, q_eps, k_eps,
    rope_first, num_weights, *proj_weights, *proj_biases)`` with the shapes of ``qkv_rope_qk_norm``; returns
    (q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, D]) with the eager model's strides.
    """

    @staticmethod
    def forward(ctx, hidden, q_norm_weight, k_norm_weight, cos, sin, num_q_heads, num_kv_heads, q_eps, k_eps,
                rope_first, num_weights, *weights_and_biases):
        proj_weights = list(weights_and_biases[:num_weights])
        proj_biases = list(weights_and_biases[num_weights:])
        q_out, k_out, v, q_rstd, k_rstd, proj = qkv_rope_qk_norm_forward_reference(
            hidden, proj_weights, proj_biases, q_norm_weight, k_norm_weight, cos, sin,
            num_q_heads, num_kv_heads, q_eps, k_eps, rope_first,
        )
        saved_proj = proj if len(proj) == 1 else proj[:2]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, q_norm_weight, k_norm_weight, cos, sin, q_rstd, k_rstd, *proj_weights,
                              *saved_proj)
        ctx.num_weights = num_weights
        ctx.has_bias = bool(proj_biases)
        ctx.heads = (num_q_heads, num_kv_heads)
        ctx.rope_first = rope_first
        return q_out, k_out, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        need = ctx.needs_input_grad
        n = ctx.num_weights
        need_weights, need_biases = list(need[11:11 + n]), list(need[11 + n:])
        grad_hidden, grad_weights, grad_biases, grad_q_w, grad_k_w, grad_cos, grad_sin = _region_backward(
            ctx, grad_q, grad_k, grad_v, need[0], need_weights, need_biases, need[1], need[2], need[3], need[4],
            in_graph=True)
        return (grad_hidden, grad_q_w, grad_k_w, grad_cos, grad_sin, None, None, None, None, None, None,
                *grad_weights, *grad_biases)

