"""``torch.ops.fusion_pass.qk_norm_rope_backward``: the backward of one tensor's per-head RMSNorm and RoPE.

unfused (what autograd derives, op by op, from e.g. Qwen3's ``rope(q_norm(q))`` or HunYuan's
``q_norm(rope(q))``): about twenty elementwise and reduction nodes per tensor, which Inductor
compiles into several kernels.

fused: one elementwise pass, the q part of ``qkv_rope_qk_norm_backward_triton``'s kernel (no k,
no v heads), writing the gradient of the region's input, the norm weight's and, when they are
required, cos/sin's gradients::

    grad_x, [grad_weight], [grad_cos, grad_sin] = torch.ops.fusion_pass.qk_norm_rope_backward(
        grad, x, rstd, cos, sin, weight, need_weight_grad, need_cos_sin_grad, rope_first)

    forward differentiated:  y = rope(w * R(x * rstd))        (rope_first=False, Qwen3's order)
                             y = w * R(rope(x) * rstd)        (rope_first=True, HunYuan's order)
    or, ``norm_style`` 1 / 2, with R(n * w) / R(n * (1 + w)) computed in fp32 for the norm
    (nn.RMSNorm, F.rms_norm, Gemma3n / Gemma3, Qwen3-Next, Qwen3.5)
    rstd = rsqrt(mean(x^2 or rope(x)^2) + eps) in fp32, R(.) rounding to x's dtype

The training pattern (``patterns/qk_norm_rope_backward.py``) puts the kernel nodes themselves into
CUDA graphs with static shapes (``backward_in_graph``); CPU graphs and symbolic shapes call this op,
which runs the Triton pass where Triton runs (CUDA, or the CPU under ``TRITON_INTERPRET=1``) and
its PyTorch reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .argument_errors import failure
from .qkv_rope_qk_norm_backward_triton import NORM_STYLES, qk_norm_rope_backward_in_graph
from .qkv_rope_qk_norm_op import elementwise_backward_implementation

_LIB = torch.library.Library("fusion_pass", "FRAGMENT")
_LIB.define(
    "qk_norm_rope_backward(Tensor grad, Tensor x, Tensor rstd, Tensor cos, Tensor sin, Tensor weight, "
    "bool need_weight_grad, bool need_cos_sin_grad, bool rope_first, int norm_style=0) -> (Tensor, Tensor[], Tensor[])",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _check(grad: Tensor, x: Tensor, rstd: Tensor, cos: Tensor, sin: Tensor, weight: Tensor, rope_first: bool,
           norm_style: int) -> None:
    fail = failure("qk_norm_rope_backward")
    if x.dim() != 4:
        fail("x", "[B, S, H, D]", tuple(x.shape))
    batch, seq, heads, head_dim = x.shape
    if tuple(grad.shape) != (batch, heads, seq, head_dim):
        fail("grad", f"[B, H, S, D] = {(batch, heads, seq, head_dim)}", tuple(grad.shape))
    if head_dim % 2:
        fail("x", "an even head_dim (RoPE rotates halves)", head_dim)
    if tuple(rstd.shape) not in ((batch, heads, seq), (batch, heads, seq, 1)):
        fail("rstd", f"[B, H, S] or [B, H, S, 1] = {(batch, heads, seq)}", tuple(rstd.shape))
    if (cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq or not 0 < cos.shape[2] <= head_dim
            or cos.shape[2] % 2):
        fail("cos", f"[1 or B, S, R] = [1 or {batch}, {seq}, R], R even and <= D = {head_dim}", tuple(cos.shape))
    if sin.shape != cos.shape:
        fail("sin", f"cos's shape {tuple(cos.shape)}", tuple(sin.shape))
    if tuple(weight.shape) != (head_dim,):
        fail("weight", f"[D] = [{head_dim}]", tuple(weight.shape))
    if norm_style not in NORM_STYLES.values():
        fail("norm_style", f"one of {NORM_STYLES}", norm_style)
    if grad.dtype != x.dtype and grad.dtype != torch.float32:
        fail("grad", f"x's dtype {x.dtype}, or fp32 with a low-precision x (autocast)", grad.dtype)
    for name, t in (("cos", cos), ("sin", sin), ("weight", weight)):
        if t.dtype != grad.dtype:
            fail(name, f"grad's dtype {grad.dtype}", t.dtype)
    for name, t in (("grad", grad), ("x", x)):
        if t.numel() and t.stride(-1) != 1:
            fail(name, "a contiguous last dim (stride(-1) == 1)", f"strides {tuple(t.stride())}")


def _empty_second_tensor(grad: Tensor, x: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's k operands with no heads: it then does x's heads only (and no v copy)."""
    return grad[:, :0], x[:, :, :0], rstd[:, :0]


def _rows(rstd: Tensor) -> Tensor:
    """rstd as [B, H, S] (a view)."""
    return rstd.squeeze(-1) if rstd.dim() == 4 else rstd


def qk_norm_rope_backward(
    grad: Tensor,
    x: Tensor,
    rstd: Tensor,
    cos: Tensor,
    sin: Tensor,
    weight: Tensor,
    need_weight_grad: bool,
    need_cos_sin_grad: bool,
    rope_first: bool,
    norm_style: int = 0,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Backward of one tensor's per-head RMSNorm and RoPE (module docstring).

    Args:
        grad: [B, H, S, D] gradient of the region's output (contiguous last dim).
        x: [B, S, H, D] the region's input (a strided view is fine; contiguous last dim).
        rstd: [B, H, S] or [B, H, S, 1], the forward norm's fp32 ``rsqrt(mean(.^2) + eps)``.
        cos, sin: [Bc, S, R], Bc in {1, B}, R = D or, for partial rotary, the rotated features' count
            (the first R; the rest pass through); weight: [D]. All in grad's dtype, which is x's, or fp32
            with a bf16/fp16 x (autocast over an fp32 model).
        need_weight_grad, need_cos_sin_grad: which optional gradients to return.
        rope_first: the forward's order (True: RoPE, then the norm).
        norm_style: the norm form, ``NORM_STYLES`` (0: ``w * R(n)``, Qwen3's and weight-free ones
            with w = 1; 1: ``R(n * w)``; 2: ``R(n * (1 + w))``).

    Returns:
        (grad_x [B, S, H * D] contiguous, ``[grad_weight]`` or ``[]``, ``[grad_cos, grad_sin]``
        ([Bc, S, R]) or ``[]``).
    """
    _check(grad, x, rstd, cos, sin, weight, rope_first, norm_style)
    batch, seq, heads, head_dim = x.shape
    grad_x = x.new_empty(batch, seq, heads * head_dim)
    rstd = _rows(rstd)
    grad_k, k, k_rstd = _empty_second_tensor(grad, x, rstd)
    no_columns = grad_x[:, :, :0]
    grad_weight, _, grad_cos, grad_sin = elementwise_backward_implementation(x)(
        grad, grad_k, grad_k, x, k, rstd, k_rstd, cos.contiguous(), sin.contiguous(), weight, weight,
        grad_x, no_columns, no_columns, need_weight_grad, need_cos_sin_grad, rope_first=rope_first,
        norm_style=norm_style)
    return grad_x, [grad_weight] if need_weight_grad else [], [grad_cos, grad_sin] if need_cos_sin_grad else []


_LIB.impl("qk_norm_rope_backward", qk_norm_rope_backward, "CompositeExplicitAutograd")


def _fake(grad, x, rstd, cos, sin, weight, need_weight_grad, need_cos_sin_grad, rope_first, norm_style=0):
    _check(grad, x, rstd, cos, sin, weight, rope_first, norm_style)
    batch, seq, heads, head_dim = x.shape
    return (x.new_empty(batch, seq, heads * head_dim),
            [torch.empty_like(weight)] if need_weight_grad else [],
            [cos.new_empty(cos.shape), sin.new_empty(sin.shape)] if need_cos_sin_grad else [])


torch.library.register_fake("fusion_pass::qk_norm_rope_backward", _fake, lib=_LIB)


def backward_in_graph(grad: Tensor, x: Tensor, rstd: Tensor, cos: Tensor, sin: Tensor, weight: Tensor,
                      need_weight_grad: bool, need_cos_sin_grad: bool, rope_first: bool, norm_style: int = 0
                      ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """``qk_norm_rope_backward`` (same arguments and results) traced as Triton kernel nodes that
    Inductor launches itself: call while tracing, on CUDA tensors of static shapes, with the
    arguments checked by the pattern when it matched."""
    rstd = _rows(rstd)
    grad_k, k, k_rstd = _empty_second_tensor(grad, x, rstd)
    grad_proj, grad_weight, _, grad_cos, grad_sin = qk_norm_rope_backward_in_graph(
        grad, grad_k, grad_k, x, k, rstd, k_rstd, cos.contiguous(), sin.contiguous(), weight, weight,
        need_weight_grad, need_cos_sin_grad, rope_first, norm_style)
    batch, seq = x.shape[0], x.shape[1]
    return (grad_proj.view(batch, seq, grad_proj.shape[1]), [grad_weight] if need_weight_grad else [],
            [grad_cos, grad_sin] if need_cos_sin_grad else [])
