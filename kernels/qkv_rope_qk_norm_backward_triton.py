"""Backward of QKV projection -> RoPE -> per-head RMSNorm (HunYuanDenseV1 / HunyuanImage-3 order),
and of the norm-then-RoPE order (Qwen3).

The forward being differentiated (eager bf16, RoPE *before* the norm)::

    qkv = hidden @ W.T (+ bias)                       # [M = B*S, (Hq + 2*Hkv) * D]
    q, k, v = split(qkv) -> view [B, S, H, D] -> transpose [B, H, S, D]
    x = q * cos + rotate_half(q) * sin                # each product and the sum rounded to dtype
    y = w * (x.float() * rstd).to(dtype)              # rstd = rsqrt(mean(x.float()**2) + eps), fp32

Two pieces, launched one after the other by the training-side op (kernels/qkv_rope_qk_norm_op.py):

1. ``qk_norm_rope_backward_triton`` -- ONE memory pass (tiled by token rows or head tiles, see below). It reads the grad
   rows of all q/k/v heads, the pre-RoPE q/k rows (strided views of the forward's qkv), rstd and
   cos/sin, does all math in fp32 and writes d(qkv) once, directly into the caller's
   ``[M, qkv_size]`` GEMM layout (no transpose, no cat). Per head row (g = grad of y, R(.) = round
   to the model dtype)::

       x   = R(R(q*cos) + R(rotate_half(q)*sin))          # recomputed RoPE, eager rounding
       gw += R(g * R(x*rstd))                             # norm-weight grad (fp32 partial)
       gn  = R(g * w)                                      # mul backward, in dtype (as autograd)
       dx  = R(rstd*gn - x * rstd^3 * sum(gn*x)/D)         # fp32 RMSNorm backward, then .to(dtype)
       dq1 = R(R(dx1*c1) + R(dx2*s2));  dq2 = R(R(dx2*c2) - R(dx1*s1))   # RoPE^T
       grad_cos += R(dx*q);  grad_sin += R(dx*rotate_half(q))  (summed over heads of q and k)

   Qwen3's order, ``rope_first=False`` (constexpr ``NORM_FIRST``), differentiates
   ``y = rope(n)``, ``n = R(w * R(q*rstd))``, rstd over q itself: RoPE's backward comes first,
   on the incoming grad (``gy = R(R(g*c1) + R(g2*s2))``, ... as dq above), then the same norm
   backward with gy for g and q for x, whose dx is d(proj); grad_cos += R(g*n), grad_sin +=
   R(g*rotate_half(n)), with n recomputed. The RoPE-first expressions are untouched.

   Each R(.) mirrors one rounding that autograd performs on the eager bf16 graph, so d(qkv) equals
   autograd's up to the fp32 summation order of sum(gn*x) (measured in the tests: within 1 bf16
   ulp). Sums over heads / tokens are done in fp32 and rounded once (autograd rounds the q and
   k parts separately: a sub-ulp difference).

   Each R(.) is ``rounding.round_to`` (native ``mul.rn.bf16`` / ``cvt.rn`` on the GPU, integer RNE under
   the interpreter); the RoPE sums go through ``rounding.round_sum``, which FMA contraction cannot fuse.

   Tiling ``"token_rows"`` (``ELEMENTWISE_TILING = "auto"``, the default, from ``ROWS_MIN_M`` tokens on). Program (token tile, head
   slice) owns ``ROWS_TOKENS`` (BT = 16) consecutive tokens (flattened t = b*S + s) and one of NS
   slices of the q, k and v heads. It loads the tokens' cos/sin rows once, as four [BT, D/2]
   fp32 tiles, then walks its heads one at a time (``_qk_head_rows``: [BT, D/2] halves, the loop
   software-pipelined ``ROWS_STAGES`` deep by async copies) and adds each head's norm-weight and
   cos/sin terms to per-thread [BT, D/2] accumulators. Nothing crosses threads inside the loop
   but the per-row dot product (lanes of one warp). At the end the weight accumulators are summed over tokens once per program (one
   partial row per program and q/k, finished as below), and the cos/sin sums are complete when
   NS = 1 and Bc = B: the kernel rounds and writes grad_cos / grad_sin itself (no workspace, no
   finishing pass for them); otherwise fp32 rows go to an [NS, M, 2*RW] workspace (RW: the tables' width) that the
   finishing launch sums over slices and batch. NS: doubled (up to Hq) until the grid reaches
   ``ROWS_PROGRAMS_PER_SM * SMs`` programs, so large M keeps all 48 heads of a token in one
   program and small M splits them to fill the GPU (M = 128: 8 token tiles x 32 slices).

   Tiling ``"head_tiles"`` (below ``ROWS_MIN_M`` tokens): a 1-D grid of q, k and v programs, each a tile
   of heads x tokens of one tensor (~4096 elements) held as two ``[BH, BT, D/2]`` half tiles, walking
   the token tiles of its head block (``_elementwise_plan``).

   Deterministic reductions, no atomics. Norm-weight grads: each q / k program writes one [D]
   fp32 partial row (its tiles, summed over heads and tokens) to ``[PQ + PK, D]``;
   ``_finish_partials_kernel`` sums rows [0, PQ) and [PQ, PQ + PK) in a fixed order.
   grad_cos/sin: each tile writes its per-token sums over its heads to an fp32 workspace
   ``[q head blocks + k head blocks, M, 2*RW]``; the same ``_finish_partials_kernel`` launch sums over head blocks
   (outer) and, for a broadcast ``Bc == 1 < B``, over b (inner), rounding once. Neither workspace
   is touched when its grads are not requested. The partials do not depend on the program count,
   so grad_qkv and grad_cos/sin bits do not either (weight grads: within 1 ulp).

2. The two projection GEMMs ``grad_hidden = grad_qkv @ W`` and ``grad_W = grad_qkv.T @ hidden``
   (+ optional bias grad): ``kernels/projection_backward.py``, torch matrix products (in a
   compiled graph ``aten.mm`` nodes that Inductor lowers).

Every launch is described once (``kernels/triton_call.py``): eager callers run it
(``qk_norm_rope_backward_triton``), compiled training graphs get it as kernel nodes
(``qk_norm_rope_backward_in_graph``): the k and v column blocks of grad_qkv are addressed as
element offsets from the q block's pointer, so that one node writes the whole [M, qkv_size]
buffer.

Norm forms (constexpr ``NORM_STYLE``, ``NORM_STYLES``): 0 is the one above, ``y = w * R(x*rstd)`` (Qwen3,
HunYuan; weight-free norms with w = 1); 1 and 2 the fp32 forms ``y = R(x*rstd*w)`` and ``R(x*rstd*(1 + w))``
(``nn.RMSNorm``, ``F.rms_norm``, Gemma3n; Gemma3, Qwen3-Next, Qwen3.5): there ``gn = g*w`` and the weight
term ``g*(x*rstd)`` are fp32, unrounded, as autograd has them. Autocast (constexpr ``ROUND_Y``, the
rounding of the region output's dtype): the grads, tables and weights may be fp32 while q/k are
bf16/fp16 (bf16 autocast over an fp32 model). Each rounding then follows the dtype autograd computes
it in: the norm's in its input's (q's when the norm is first, RoPE's fp32 output when RoPE is first:
``ROUND_N``), RoPE's in the dtype of what it multiplies (fp32 when RoPE is first or follows Qwen3's
``w_fp32 * n.to(bf16)``, q's after a norm that ends in ``type_as(x)``: ``ROUND_ROPE``), the sums for
the weight and table grads in fp32, the gradient of the projection in q's dtype.

Partial rotary (constexpr ``ROT_HALF``, half the tables' width R < D; GLM-4.5, Qwen3-Next, Qwen3.5): RoPE
rotates features [0, R) in pairs (i, i + R/2) and passes [R, D) through. Lane d of the half tiles then
holds the pair (d, d + R/2) for d < R/2 and two pass-through features otherwise, whose cos and sin
are loaded as 1 and 0 (``_pair_columns``, ``_table_halves``): the formulas above are unchanged, and a
RoPE with cos 1 and sin 0 is exact in every rounding (x*1 + y*0 = x). cos/sin grads have width R.

Supported: q/k/grads/cos/sin/norm weights all in one dtype (bf16, fp16, fp32; or the autocast case above), rstd any float dtype,
any strides with a contiguous last dim, D even, R even and <= D, Bc in {1, B}, Hq and Hkv any (GQA). CUDA, or CPU under
``TRITON_INTERPRET=1``. Callers handle other cases with their PyTorch reference.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .projection_backward import projection_gemms
from .rounding import SUPPORTED_DTYPES, round_sum, round_to
from .triton_device import sm_count, triton_applicable
from .triton_call import TritonCall, named_args

# ----------------------------------------------------------------------------------------------
# Tunables (explicit, documented above; the lead sets them from benchmarks/bench_backward.py).
# ----------------------------------------------------------------------------------------------
# Which elementwise kernel: "token_rows" (a program owns the heads of its tokens),
# "head_tiles" (tiles of heads x tokens, one reduction over heads per tile), or "auto":
# head tiles below ROWS_MIN_M tokens, token rows from there (H200, graph replay, both optional
# grads: M = 128 head tiles 11.2 vs token rows 31.0 us; M = 512 21.2 vs 17.1; M = 8192 234.1 vs 99.0).
ELEMENTWISE_TILING = "auto"
ROWS_MIN_M = 512
ROWS_TOKENS = 16  # token rows: tokens per program (BT)
ROWS_NUM_WARPS = 4
# token rows: software-pipelining depth of the loop over heads (async copies). Measured at M = 8192:
# 1 stage 128.9 us, 2: 138.3, 3: 102.0, 4: 99.0 (4 also best at M = 512, 2048, 4096).
ROWS_STAGES = 4
ROWS_PROGRAMS_PER_SM = 1  # token rows: head slices are added until the grid has round(this * SMs) programs
ELEMENTWISE_PROGRAMS_PER_SM = 12  # program-count target of the elementwise pass, per SM (~4 waves)
ELEMENTWISE_MAX_TILES_PER_PROGRAM = 4  # cap on the token tiles one elementwise program walks
ELEMENTWISE_TILE_ELEMENTS = 4096  # elements (heads x tokens x D) per elementwise tile
ELEMENTWISE_NUM_WARPS = 4

_ROUND_NONE, _ROUND_BF16, _ROUND_FP16 = 0, 1, 2
_ROUND_MODE = {torch.float32: _ROUND_NONE, torch.bfloat16: _ROUND_BF16, torch.float16: _ROUND_FP16}
#: The norm forms the elementwise pass differentiates (constexpr ``NORM_STYLE``): Qwen3's / HunYuan's
#: ``w * R(x * rstd)`` (weight-free norms: w = 1), and the fp32 forms ``R(x * rstd * w)`` (``nn.RMSNorm``,
#: ``F.rms_norm``, Gemma3n) and ``R(x * rstd * (1 + w))`` (Gemma3, Qwen3-Next, Qwen3.5).
NORM_STYLES = {"weight": 0, "fp32_weight": 1, "fp32_one_plus_weight": 2}


# ----------------------------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _sum(x, axis: tl.constexpr):
    """``tl.sum(x, axis)`` spelled as ``tl.reduce``: these kernels call no ``@triton.jit`` function
    of triton.language itself (tl.sum, tl.zeros), which stay compiled-mode functions when triton
    was imported before ``TRITON_INTERPRET=1`` was set (a conftest importing torch first); the
    interpreter patches tl.reduce and never calls the combine function."""
    return tl.reduce(x, axis, _add)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add4(a0, b0, c0, d0, a1, b1, c1, d1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1


@triton.jit
def _add6(a0, b0, c0, d0, e0, f0, a1, b1, c1, d1, e1, f1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1, e0 + e1, f0 + f1


@triton.jit
def _round(x, ROUND: tl.constexpr):
    """Round fp32 ``x`` to the model dtype's precision (nearest even) and return it as fp32.

    bf16: integer RNE on the fp32 bits (identical on GPU and in the interpreter, whose fp32->bf16
    cast truncates); NaN passes through. fp16: a cast there and back. fp32: identity.
    """
    if ROUND == 1:
        u = x.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, u.to(tl.float32, bitcast=True))
    elif ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


# ----------------------------------------------------------------------------------------------
# 1. Elementwise pass: RMSNorm backward + RoPE backward for q and k, copy of v
# ----------------------------------------------------------------------------------------------
@triton.jit
def _round_native(x, ROUND: tl.constexpr, INTERP: tl.constexpr):
    """``_round`` for the hot loop: native half-precision rounding on the GPU, bit arithmetic in
    the interpreter. A rounded product that feeds an add goes through ``_round_sum_native``."""
    if ROUND == 1:
        return round_to(x, tl.bfloat16, INTERP)
    elif ROUND == 2:
        return round_to(x, tl.float16, INTERP)
    else:
        return x


@triton.jit
def _round_sum_native(a, b, ROUND: tl.constexpr, INTERP: tl.constexpr):
    """``_round_native(a + b)`` of two rounded products, the add never contracted into an FMA with them
    (``rounding.round_sum``): the RoPE forward and its transpose round as autograd does."""
    if ROUND == 1:
        return round_sum(a, b, tl.bfloat16, INTERP)
    elif ROUND == 2:
        return round_sum(a, b, tl.float16, INTERP)
    else:
        return a + b


@triton.jit
def _rope_backward(u1, u2, c1, c2, s1, s2, ROUND: tl.constexpr, INTERP: tl.constexpr):
    """RoPE's backward on the halves of a gradient u, with autograd's roundings:
    u*cos + rotate_half^T(u*sin), rotate_half^T(y) = cat(y2, -y1)."""
    d1 = _round_sum_native(_round_native(u1 * c1, ROUND, INTERP), _round_native(u2 * s2, ROUND, INTERP), ROUND, INTERP)
    d2 = _round_sum_native(_round_native(u2 * c2, ROUND, INTERP), -_round_native(u1 * s1, ROUND, INTERP), ROUND, INTERP)
    return d1, d2


@triton.jit
def _norm_input_and_grad(q1, q2, g1, g2, c1, c2, s1, s2, ROUND_ROPE: tl.constexpr, INTERP: tl.constexpr,
                         NORM_FIRST: tl.constexpr):
    """The halves of the norm's input x and of the gradient reaching the norm's output, from
    the pre-RoPE q and the incoming grad g: (rope(q) recomputed with eager's roundings, g), or
    NORM_FIRST (q, RoPE's backward of g). ``ROUND_ROPE``: the rounding of RoPE's output dtype
    (RoPE first) or of its input's (NORM_FIRST): see ``_qk_tile``."""
    if NORM_FIRST:
        x1 = q1
        x2 = q2
        gy1, gy2 = _rope_backward(g1, g2, c1, c2, s1, s2, ROUND_ROPE, INTERP)
    else:  # x = R(R(q*cos) + R(rotate_half(q)*sin))
        x1 = _round_sum_native(_round_native(q1 * c1, ROUND_ROPE, INTERP), -_round_native(q2 * s1, ROUND_ROPE, INTERP),
                               ROUND_ROPE, INTERP)
        x2 = _round_sum_native(_round_native(q2 * c2, ROUND_ROPE, INTERP), _round_native(q1 * s2, ROUND_ROPE, INTERP),
                               ROUND_ROPE, INTERP)
        gy1 = g1
        gy2 = g2
    return x1, x2, gy1, gy2


@triton.jit
def _cos_sin_factors(g1, g2, dx1, dx2, q1, q2, xr1, xr2, w1, w2, ROUND: tl.constexpr, ROUND_Y: tl.constexpr,
                     INTERP: tl.constexpr, NORM_FIRST: tl.constexpr, NORM_STYLE: tl.constexpr):
    """The halves of (u, p) whose products give the cos/sin grads, R(u * p) and
    R(u * rotate_half(p)): u the gradient of RoPE's output, p its input. (dx, q) when RoPE comes
    first; NORM_FIRST (g, the norm's output n = R(w * R(x*r))), from xr = x*r unrounded and w
    broadcast to the tile."""
    if NORM_FIRST:
        u1 = g1
        u2 = g2
        p1 = _normed(xr1, w1, ROUND, ROUND_Y, INTERP, NORM_STYLE)
        p2 = _normed(xr2, w2, ROUND, ROUND_Y, INTERP, NORM_STYLE)
    else:
        u1 = dx1
        u2 = dx2
        p1 = q1
        p2 = q2
    return u1, u2, p1, p2


@triton.jit
def _effective_weight(w, NORM_STYLE: tl.constexpr):
    """The factor the normalized row is multiplied by: ``1 + w`` for Gemma's form (fp32)."""
    if NORM_STYLE == 2:
        return w + 1.0
    else:
        return w


@triton.jit
def _normed(xr, w, ROUND: tl.constexpr, ROUND_Y: tl.constexpr, INTERP: tl.constexpr, NORM_STYLE: tl.constexpr):
    """The norm's output from xr = x * rstd (fp32) and the effective weight: ``R_y(w * R(xr))`` for
    Qwen3's form (the weight multiplies the row cast to x's dtype, in the output dtype y), ``R(xr * w)``
    for the fp32 forms (one rounding)."""
    if NORM_STYLE == 0:
        return _round_native(_round_native(xr, ROUND, INTERP) * w, ROUND_Y, INTERP)
    else:
        return _round_native(xr * w, ROUND, INTERP)


@triton.jit
def _grad_normed(g, w, ROUND: tl.constexpr, INTERP: tl.constexpr, NORM_STYLE: tl.constexpr):
    """Gradient reaching the normalized fp32 row: ``R(g * w)`` for Qwen3's form (the mul's backward
    for the row cast to x's dtype), ``g * w`` for the fp32 forms."""
    if NORM_STYLE == 0:
        return _round_native(g * w, ROUND, INTERP)
    else:
        return g * w


@triton.jit
def _weight_grad_term(g, xr, ROUND: tl.constexpr, ROUND_Y: tl.constexpr, INTERP: tl.constexpr,
                      NORM_STYLE: tl.constexpr):
    """One element's term of the norm weight's gradient: ``R_y(g * R(xr))`` for Qwen3's form, ``g * xr``
    for the fp32 forms (the gradient of ``1 + w`` is the gradient of w)."""
    if NORM_STYLE == 0:
        return _round_native(g * _round_native(xr, ROUND, INTERP), ROUND_Y, INTERP)
    else:
        return g * xr


@triton.jit
def _proj_grad(dx1, dx2, c1, c2, s1, s2, ROUND: tl.constexpr, INTERP: tl.constexpr, NORM_FIRST: tl.constexpr):
    """d(proj) from the norm's input grad dx: RoPE's backward of it, or dx itself NORM_FIRST."""
    if NORM_FIRST:
        d1 = dx1
        d2 = dx2
    else:
        d1, d2 = _rope_backward(dx1, dx2, c1, c2, s1, s2, ROUND, INTERP)
    return d1, d2


@triton.jit
def _pair_columns(d, HALF: tl.constexpr, ROT_HALF: tl.constexpr):
    """The head-dim columns of lane d's two RoPE partners: (d, d + D/2) with full rotary. With
    partial rotary (the first 2 * ROT_HALF features rotated) lanes d < ROT_HALF hold (d,
    d + ROT_HALF) and the others two pass-through features, which ``_table_halves`` gives cos 1
    and sin 0 so that the same formulas leave them unrotated."""
    if ROT_HALF == HALF:
        return d, d + HALF
    else:
        rot = d < ROT_HALF
        return tl.where(rot, d, d + ROT_HALF), tl.where(rot, d + ROT_HALF, d + HALF)


@triton.jit
def _table_halves(ptr, mask, d, other, HALF: tl.constexpr, ROT_HALF: tl.constexpr):
    """fp32 halves (columns d and ROT_HALF + d of a table row at ``ptr``, i.e. ptr already offset by d) of
    cos or sin; ``other`` (1 for cos, 0 for sin) on the pass-through lanes of partial rotary."""
    if ROT_HALF == HALF:
        m = mask
    else:
        m = mask & (d < ROT_HALF)
    a = tl.load(ptr, mask=m, other=other).to(tl.float32)
    b = tl.load(ptr + ROT_HALF, mask=m, other=other).to(tl.float32)
    return a, b


@triton.jit
def _rotary_mask(mask, d, HALF: tl.constexpr, ROT_HALF: tl.constexpr):
    """``mask`` restricted to the rotated lanes (the cos/sin grads' columns)."""
    if ROT_HALF == HALF:
        return mask
    else:
        return mask & (d < ROT_HALF)


@triton.jit
def _qk_tile(
    g, x, r, tables,
    w1, w2,  # [BLOCK_HALF] fp32 norm-weight halves
    o,
    cs_ptr,  # fp32 cos/sin partial rows of this head block: [M, 2*RW], RW the tables' width (NEED_CS)
    h0, t0, M, S,
    H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BH: tl.constexpr, BT: tl.constexpr, FORM,
):
    """Backward of w * rmsnorm(rope(x)) (NORM_FIRST: of rope(w * rmsnorm(x))) on one [BH heads,
    BT tokens] tile, held as two [BH, BT, D/2] fp32 half tiles (rotate_half is free). Stores
    d(proj), the cos/sin partial rows (sums over this tile's heads) and returns the tile's
    norm-weight grad halves [BLOCK_HALF].

    ``g`` (the grad of the normed rows [B, H, S, D]), ``x`` (the pre-RoPE rows [B, S, H, D]), ``r``
    (rstd [B, H, S]): views ``(ptr, stride_b, stride_h, stride_s)``; ``o``: d(proj) [B, S, H*D] as
    ``(ptr, stride_b, stride_s)``, heads D apart; ``tables``: ``(cos_ptr, cos_sb, cos_ss, sin_ptr, sin_sb,
    sin_ss)`` of cos/sin [Bc, S, RW]; ``FORM``: the kernels' constexprs ``(ROUND, INTERP, NEED_W, NEED_CS,
    NORM_FIRST, ROUND_Y, NORM_STYLE, ROT_HALF)``."""
    g_ptr, g_sb, g_sh, g_ss = g
    x_ptr, x_sb, x_sh, x_ss = x
    r_ptr, r_sb, r_sh, r_ss = r
    cos_ptr, cos_sb, cos_ss, sin_ptr, sin_sb, sin_ss = tables
    o_ptr, o_sb, o_ss = o
    ROUND: tl.constexpr = FORM[0]
    INTERP: tl.constexpr = FORM[1]
    NEED_W: tl.constexpr = FORM[2]
    NEED_CS: tl.constexpr = FORM[3]
    NORM_FIRST: tl.constexpr = FORM[4]
    ROUND_Y: tl.constexpr = FORM[5]
    NORM_STYLE: tl.constexpr = FORM[6]
    ROT_HALF: tl.constexpr = FORM[7]
    h = h0 + tl.arange(0, BH).to(tl.int64)
    t = t0 + tl.arange(0, BT).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    hm = h < H
    tm = t < M
    if BLOCK_HALF == HALF:
        dm = d < BLOCK_HALF  # all true, folded
    else:
        dm = d < HALF
    b = t // S
    s = t - b * S
    m2 = tm[:, None] & dm[None, :]  # [BT, BLOCK_HALF]
    m3 = hm[:, None, None] & m2[None, :, :]
    d3 = d[None, None, :]
    col1, col2 = _pair_columns(d, HALF, ROT_HALF)
    col1 = col1[None, None, :]
    col2 = col2[None, None, :]

    g_off = (h * g_sh)[:, None, None] + (b * g_sb + s * g_ss)[None, :, None]
    x_off = (h * x_sh)[:, None, None] + (b * x_sb + s * x_ss)[None, :, None]
    g1 = tl.load(g_ptr + g_off + col1, mask=m3, other=0.0, eviction_policy="evict_first")
    g2 = tl.load(g_ptr + g_off + col2, mask=m3, other=0.0, eviction_policy="evict_first")
    q1 = tl.load(x_ptr + x_off + col1, mask=m3, other=0.0, eviction_policy="evict_first")
    q2 = tl.load(x_ptr + x_off + col2, mask=m3, other=0.0, eviction_policy="evict_first")
    r = tl.load(r_ptr + h[:, None] * r_sh + (b * r_sb + s * r_ss)[None, :],
                mask=hm[:, None] & tm[None, :], other=0.0)
    # cos/sin loaded straight into the [BH, BT, D/2] layout of the head tiles (zero head stride:
    # each head re-reads its token's row from L1). A [BT, D/2] load needs a shared-memory layout
    # conversion per table, and the compiler serializes those (load, barrier, convert, next load).
    zero_h = (h * 0)[:, None, None]
    c_row = cos_ptr + zero_h + (b * cos_sb + s * cos_ss)[None, :, None] + d3
    s_row = sin_ptr + zero_h + (b * sin_sb + s * sin_ss)[None, :, None] + d3
    c1, c2 = _table_halves(c_row, m3, d3, 1.0, HALF, ROT_HALF)
    s1, s2 = _table_halves(s_row, m3, d3, 0.0, HALF, ROT_HALF)
    g1 = g1.to(tl.float32)
    g2 = g2.to(tl.float32)
    q1 = q1.to(tl.float32)
    q2 = q2.to(tl.float32)
    r = r.to(tl.float32)[:, :, None]

    g0_1 = g1
    g0_2 = g2
    # Autocast (ROUND_Y fp32, x bf16/fp16): the norm rounds to its input's dtype (q's, or RoPE's
    # fp32 output when RoPE is first); RoPE rounds to the dtype of what it multiplies: the region's
    # output dtype when RoPE is first or follows Qwen3's ``w_fp32 * n``, q's dtype when it follows a norm
    # whose output is cast back to x's dtype (the fp32 forms' ``type_as(x)``, weight-free forms).
    ROUND_N: tl.constexpr = ROUND if NORM_FIRST else ROUND_Y
    ROUND_ROPE: tl.constexpr = (ROUND_Y if NORM_STYLE == 0 else ROUND) if NORM_FIRST else ROUND_Y
    x1, x2, g1, g2 = _norm_input_and_grad(q1, q2, g0_1, g0_2, c1, c2, s1, s2, ROUND_ROPE, INTERP, NORM_FIRST)

    gn1 = _grad_normed(g1, w1[None, None, :], ROUND_N, INTERP, NORM_STYLE)
    gn2 = _grad_normed(g2, w2[None, None, :], ROUND_N, INTERP, NORM_STYLE)

    # RMSNorm backward in fp32, rounded once (the x.float() cast's backward).
    dot = _sum(gn1 * x1, 2) + _sum(gn2 * x2, 2)  # [BH, BT]
    coef = r * r * r * (dot / D)[:, :, None]
    dx1 = _round_native(gn1 * r - x1 * coef, ROUND_N, INTERP)
    dx2 = _round_native(gn2 * r - x2 * coef, ROUND_N, INTERP)
    u1, u2, p1, p2 = _cos_sin_factors(g0_1, g0_2, dx1, dx2, q1, q2, x1 * r, x2 * r, w1[None, None, :],
                                      w2[None, None, :], ROUND, ROUND_Y, INTERP, NORM_FIRST, NORM_STYLE)

    # Sums over this tile's heads, all in ONE multi-operand reduction (six separate
    # reductions over heads, which cross warps, cost ~5 % more).
    # Weight grad of y = w * R(x*r), each term rounded like autograd's mul backward; cos/sin grads:
    # t1 = q*cos -> dcos += R(dx*q); t2 = rotate_half(q)*sin -> dsin += R(dx*cat(-q2, q1)).
    # (v4 summed these terms unrounded: no faster on the H200, and further from eager autograd.)
    gw1 = tl.full([BLOCK_HALF], 0.0, tl.float32)
    gw2 = tl.full([BLOCK_HALF], 0.0, tl.float32)
    if NEED_W and NEED_CS:
        pw1, pw2, gc1, gc2, gs1, gs2 = tl.reduce(
            (_weight_grad_term(g1, x1 * r, ROUND_N, ROUND_Y, INTERP, NORM_STYLE),
             _weight_grad_term(g2, x2 * r, ROUND_N, ROUND_Y, INTERP, NORM_STYLE),
             _round_native(u1 * p1, ROUND_Y, INTERP), _round_native(u2 * p2, ROUND_Y, INTERP),
             _round_native(u1 * p2, ROUND_Y, INTERP), _round_native(u2 * p1, ROUND_Y, INTERP)),
            0, _add6)  # each [BT, BLOCK_HALF]
        gw1, gw2 = tl.reduce((pw1, pw2), 0, _add2)
    elif NEED_W:
        pw1, pw2 = tl.reduce(
            (_weight_grad_term(g1, x1 * r, ROUND_N, ROUND_Y, INTERP, NORM_STYLE),
             _weight_grad_term(g2, x2 * r, ROUND_N, ROUND_Y, INTERP, NORM_STYLE)), 0, _add2)
        gw1, gw2 = tl.reduce((pw1, pw2), 0, _add2)
    elif NEED_CS:
        gc1, gc2, gs1, gs2 = tl.reduce(
            (_round_native(u1 * p1, ROUND_Y, INTERP), _round_native(u2 * p2, ROUND_Y, INTERP),
             _round_native(u1 * p2, ROUND_Y, INTERP), _round_native(u2 * p1, ROUND_Y, INTERP)), 0, _add4)
    if NEED_CS:  # rows of 2 * RW (RW = 2 * ROT_HALF, the tables' width): cos's, then sin's
        cs_row = cs_ptr + t[:, None] * (4 * ROT_HALF) + d[None, :]
        mr = _rotary_mask(m2, d[None, :], HALF, ROT_HALF)
        tl.store(cs_row, gc1, mask=mr)
        tl.store(cs_row + ROT_HALF, gc2, mask=mr)
        tl.store(cs_row + 2 * ROT_HALF, -gs1, mask=mr)
        tl.store(cs_row + 3 * ROT_HALF, gs2, mask=mr)

    dq1, dq2 = _proj_grad(dx1, dx2, c1, c2, s1, s2, ROUND, INTERP, NORM_FIRST)
    o_off = (h * D)[:, None, None] + (b * o_sb + s * o_ss)[None, :, None]
    tl.store(o_ptr + o_off + col1, dq1, mask=m3)
    tl.store(o_ptr + o_off + col2, dq2, mask=m3)
    return gw1, gw2


@triton.jit
def _qk_norm_rope_bwd_kernel(
    gq_ptr, gq_sb, gq_sh, gq_ss,  # grad_q [B, Hq, S, D]
    gk_ptr, gk_sb, gk_sh, gk_ss,  # grad_k [B, Hkv, S, D]
    gv_ptr, gv_sb, gv_sh, gv_ss,  # grad_v [B, Hkv, S, D]
    q_ptr, q_sb, q_ss, q_sh,  # q [B, S, Hq, D] (pre-RoPE, strided view of qkv)
    k_ptr, k_sb, k_ss, k_sh,  # k [B, S, Hkv, D]
    rq_ptr, rq_sb, rq_sh, rq_ss,  # q_rstd [B, Hq, S]
    rk_ptr, rk_sb, rk_sh, rk_ss,  # k_rstd [B, Hkv, S]
    cos_ptr, cos_sb, cos_ss,  # cos [Bc, S, RW] (cos_sb = 0 when Bc == 1)
    sin_ptr, sin_sb, sin_ss,
    wq_ptr, wk_ptr,  # norm weights [D], contiguous
    dq_ptr, dq_sb, dq_ss,  # output: d(q_proj) [B, S, Hq*D], heads contiguous
    dk_off, dk_sb, dk_ss,  # d(k_proj) at dq_ptr + dk_off (one buffer: see _elementwise)
    dv_off, dv_sb, dv_ss,
    gw_ws_ptr,  # [PQ + PK, D] fp32 norm-weight partials, one row per q / k program (NEED_W)
    cs_ws_ptr,  # [NQB + NKB, M, 2*RW] fp32 cos/sin partials per (head block, token) (NEED_CS)
    M, S,
    GQ, GK, GV,  # programs per head block (token groups) of q, k, v
    NTT_Q, NTT_KV,  # token tiles of q, of k/v
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BHQ: tl.constexpr, BTQ: tl.constexpr, BHK: tl.constexpr, BTK: tl.constexpr,
    BHV: tl.constexpr, BTV: tl.constexpr,
    ROUND: tl.constexpr, INTERP: tl.constexpr, NEED_W: tl.constexpr, NEED_CS: tl.constexpr,
    NORM_FIRST: tl.constexpr, ROUND_Y: tl.constexpr, NORM_STYLE: tl.constexpr, ROT_HALF: tl.constexpr,
):
    """1-D grid: [q programs | k programs | v programs]. Program (kind, head block hb, group g)
    handles the token tiles g, g + G, g + 2G, ... of that head block (tiles of BH x BT rows)."""
    pid = tl.program_id(0)
    dk_ptr = dq_ptr + dk_off
    dv_ptr = dq_ptr + dv_off
    FORM: tl.constexpr = (ROUND, INTERP, NEED_W, NEED_CS, NORM_FIRST, ROUND_Y, NORM_STYLE, ROT_HALF)
    tables = (cos_ptr, cos_sb, cos_ss, sin_ptr, sin_sb, sin_ss)
    NQB: tl.constexpr = (HQ + BHQ - 1) // BHQ
    NKB: tl.constexpr = (HKV + BHK - 1) // BHK
    PQ = NQB * GQ
    PK = NKB * GK
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    col1, col2 = _pair_columns(d, HALF, ROT_HALF)
    if pid < PQ:
        hb = pid // GQ
        grp = pid - hb * GQ
        w1 = _effective_weight(tl.load(wq_ptr + col1, mask=dmask, other=0.0).to(tl.float32), NORM_STYLE)
        w2 = _effective_weight(tl.load(wq_ptr + col2, mask=dmask, other=0.0).to(tl.float32), NORM_STYLE)
        acc1 = tl.full([BLOCK_HALF], 0.0, tl.float32)
        acc2 = tl.full([BLOCK_HALF], 0.0, tl.float32)
        cs_blk = cs_ws_ptr + hb.to(tl.int64) * M * (4 * ROT_HALF)
        for tt in range(grp, NTT_Q, GQ):
            gw1, gw2 = _qk_tile(
                (gq_ptr, gq_sb, gq_sh, gq_ss), (q_ptr, q_sb, q_sh, q_ss), (rq_ptr, rq_sb, rq_sh, rq_ss), tables,
                w1, w2, (dq_ptr, dq_sb, dq_ss), cs_blk, hb * BHQ, tt * BTQ, M, S, HQ, D, HALF, BLOCK_HALF, BHQ, BTQ,
                FORM,
            )
            acc1 += gw1
            acc2 += gw2
        if NEED_W:
            row = gw_ws_ptr + pid.to(tl.int64) * D
            tl.store(row + col1, acc1, mask=dmask)
            tl.store(row + col2, acc2, mask=dmask)
    elif pid < PQ + PK:
        p = pid - PQ
        hb = p // GK
        grp = p - hb * GK
        w1 = _effective_weight(tl.load(wk_ptr + col1, mask=dmask, other=0.0).to(tl.float32), NORM_STYLE)
        w2 = _effective_weight(tl.load(wk_ptr + col2, mask=dmask, other=0.0).to(tl.float32), NORM_STYLE)
        acc1 = tl.full([BLOCK_HALF], 0.0, tl.float32)
        acc2 = tl.full([BLOCK_HALF], 0.0, tl.float32)
        cs_blk = cs_ws_ptr + (NQB + hb).to(tl.int64) * M * (4 * ROT_HALF)
        for tt in range(grp, NTT_KV, GK):
            gw1, gw2 = _qk_tile(
                (gk_ptr, gk_sb, gk_sh, gk_ss), (k_ptr, k_sb, k_sh, k_ss), (rk_ptr, rk_sb, rk_sh, rk_ss), tables,
                w1, w2, (dk_ptr, dk_sb, dk_ss), cs_blk, hb * BHK, tt * BTK, M, S, HKV, D, HALF, BLOCK_HALF, BHK, BTK,
                FORM,
            )
            acc1 += gw1
            acc2 += gw2
        if NEED_W:
            row = gw_ws_ptr + pid.to(tl.int64) * D
            tl.store(row + col1, acc1, mask=dmask)
            tl.store(row + col2, acc2, mask=dmask)
    else:
        # v: a plain copy from [B, Hkv, S, D] into the projection layout (no upcast).
        p = pid - PQ - PK
        hb = p // GV
        grp = p - hb * GV
        h = hb * BHV + tl.arange(0, BHV).to(tl.int64)
        dv = tl.arange(0, BLOCK_D)
        hdm = (h < HKV)[:, None, None] & (dv < D)[None, None, :]
        for tt in range(grp, NTT_KV, GV):
            t = tt * BTV + tl.arange(0, BTV).to(tl.int64)
            b = t // S
            s = t - b * S
            m3 = hdm & (t < M)[None, :, None]
            src = gv_ptr + (h * gv_sh)[:, None, None] + (b * gv_sb + s * gv_ss)[None, :, None] + dv[None, None, :]
            val = tl.load(src, mask=m3, eviction_policy="evict_first")
            dst = dv_ptr + (h * D)[:, None, None] + (b * dv_sb + s * dv_ss)[None, :, None] + dv[None, None, :]
            tl.store(dst, val, mask=m3)


@triton.jit
def _qk_head_rows(
    pointers,  # (grad, pre-RoPE x, rstd, d(proj)): this head's rows
    rows,  # [BT] int64 row offsets of the tile's tokens, one per pointer
    d, m2, tm,
    table_halves,  # (c1, c2, s1, s2): [BT, BLOCK_HALF] fp32
    weight_halves,  # (w1, w2): [BLOCK_HALF] fp32
    sums,  # (pw1, pw2, gc1, gc2, gs1, gs2): [BT, BLOCK_HALF] fp32 accumulators, returned updated
    D: tl.constexpr, HALF: tl.constexpr, FORM,
):
    """Backward of ``w * rmsnorm(rope(x))`` (NORM_FIRST: of ``rope(w * rmsnorm(x))``) for one
    head on a tile of BT tokens (two [BT, D/2] halves): stores d(proj) and adds this head's terms
    of the norm-weight and cos/sin grads to the accumulators, per token and feature (no reduction
    across threads). The same formulas as ``_qk_tile``."""
    g_ptr, x_ptr, r_ptr, o_ptr = pointers
    g_rows, x_rows, r_rows, o_rows = rows
    c1, c2, s1, s2 = table_halves
    w1, w2 = weight_halves
    pw1, pw2, gc1, gc2, gs1, gs2 = sums
    ROUND: tl.constexpr = FORM[0]
    INTERP: tl.constexpr = FORM[1]
    NEED_W: tl.constexpr = FORM[2]
    NEED_CS: tl.constexpr = FORM[3]
    NORM_FIRST: tl.constexpr = FORM[4]
    ROUND_Y: tl.constexpr = FORM[5]
    NORM_STYLE: tl.constexpr = FORM[6]
    ROT_HALF: tl.constexpr = FORM[7]
    col1, col2 = _pair_columns(d, HALF, ROT_HALF)
    col1 = col1[None, :]
    col2 = col2[None, :]
    g_off = g_rows[:, None]
    x_off = x_rows[:, None]
    g1 = tl.load(g_ptr + g_off + col1, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
    g2 = tl.load(g_ptr + g_off + col2, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
    q1 = tl.load(x_ptr + x_off + col1, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
    q2 = tl.load(x_ptr + x_off + col2, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
    r = tl.load(r_ptr + r_rows, mask=tm, other=0.0).to(tl.float32)[:, None]

    g0_1 = g1
    g0_2 = g2
    ROUND_N: tl.constexpr = ROUND if NORM_FIRST else ROUND_Y  # autocast's roundings: see _qk_tile
    ROUND_ROPE: tl.constexpr = (ROUND_Y if NORM_STYLE == 0 else ROUND) if NORM_FIRST else ROUND_Y
    x1, x2, g1, g2 = _norm_input_and_grad(q1, q2, g0_1, g0_2, c1, c2, s1, s2, ROUND_ROPE, INTERP, NORM_FIRST)
    gn1 = _grad_normed(g1, w1[None, :], ROUND_N, INTERP, NORM_STYLE)
    gn2 = _grad_normed(g2, w2[None, :], ROUND_N, INTERP, NORM_STYLE)
    dot = _sum(gn1 * x1, 1) + _sum(gn2 * x2, 1)  # [BT]: across the lanes of one warp
    coef = r * r * r * (dot / D)[:, None]
    dx1 = _round_native(gn1 * r - x1 * coef, ROUND_N, INTERP)
    dx2 = _round_native(gn2 * r - x2 * coef, ROUND_N, INTERP)
    if NEED_W:
        pw1 += _weight_grad_term(g1, x1 * r, ROUND_N, ROUND_Y, INTERP, NORM_STYLE)
        pw2 += _weight_grad_term(g2, x2 * r, ROUND_N, ROUND_Y, INTERP, NORM_STYLE)
    if NEED_CS:
        u1, u2, p1, p2 = _cos_sin_factors(g0_1, g0_2, dx1, dx2, q1, q2, x1 * r, x2 * r, w1[None, :], w2[None, :],
                                          ROUND, ROUND_Y, INTERP, NORM_FIRST, NORM_STYLE)
        gc1 += _round_native(u1 * p1, ROUND_Y, INTERP)
        gc2 += _round_native(u2 * p2, ROUND_Y, INTERP)
        gs1 += _round_native(u1 * p2, ROUND_Y, INTERP)
        gs2 += _round_native(u2 * p1, ROUND_Y, INTERP)
    dq1, dq2 = _proj_grad(dx1, dx2, c1, c2, s1, s2, ROUND, INTERP, NORM_FIRST)
    o_off = o_rows[:, None]
    tl.store(o_ptr + o_off + col1, dq1, mask=m2)
    tl.store(o_ptr + o_off + col2, dq2, mask=m2)
    return pw1, pw2, gc1, gc2, gs1, gs2


@triton.jit
def _heads_of_slice(
    g, x, r, o,
    w_ptr, gw_row_ptr,  # norm weight [D]; this program's fp32 weight-grad partial row [D]
    h_lo, h_hi,
    tokens,  # (b, s, tm): [BT] batch and sequence index of each token, in range
    features,  # (d, dm, m2): [BLOCK_HALF] lanes, in range; [BT, BLOCK_HALF] both
    table_halves, cos_sin_sums,  # (c1, c2, s1, s2); (gc1, gc2, gs1, gs2): [BT, BLOCK_HALF] fp32
    D: tl.constexpr, HALF: tl.constexpr, BT: tl.constexpr, BLOCK_HALF: tl.constexpr, STAGES: tl.constexpr, FORM,
):
    """Heads [h_lo, h_hi) of one tensor (q or k) on the program's tokens: the loop over heads,
    software-pipelined STAGES deep, then the weight-grad partial row (summed over the tokens).
    Returns the cos/sin accumulators with these heads' terms added. ``g``, ``x``, ``r``, ``o``:
    views as ``_qk_tile``'s."""
    g_ptr, g_sb, g_sh, g_ss = g
    x_ptr, x_sb, x_sh, x_ss = x
    r_ptr, r_sb, r_sh, r_ss = r
    o_ptr, o_sb, o_ss = o
    b, s, tm = tokens
    d, dm, m2 = features
    gc1, gc2, gs1, gs2 = cos_sin_sums
    NEED_W: tl.constexpr = FORM[2]
    NORM_STYLE: tl.constexpr = FORM[6]
    ROT_HALF: tl.constexpr = FORM[7]
    col1, col2 = _pair_columns(d, HALF, ROT_HALF)
    w1 = _effective_weight(tl.load(w_ptr + col1, mask=dm, other=0.0).to(tl.float32), NORM_STYLE)
    w2 = _effective_weight(tl.load(w_ptr + col2, mask=dm, other=0.0).to(tl.float32), NORM_STYLE)
    pw1 = tl.full([BT, BLOCK_HALF], 0.0, tl.float32)
    pw2 = tl.full([BT, BLOCK_HALF], 0.0, tl.float32)
    g_tok = b * g_sb + s * g_ss
    x_tok = b * x_sb + s * x_ss
    r_tok = b * r_sb + s * r_ss
    o_tok = b * o_sb + s * o_ss
    for h in tl.range(h_lo, h_hi, num_stages=STAGES):
        hh = tl.cast(h, tl.int64)
        pw1, pw2, gc1, gc2, gs1, gs2 = _qk_head_rows(
            (g_ptr, x_ptr, r_ptr, o_ptr), (g_tok + hh * g_sh, x_tok + hh * x_sh, r_tok + hh * r_sh, o_tok + hh * D),
            d, m2, tm, table_halves, (w1, w2), (pw1, pw2, gc1, gc2, gs1, gs2), D, HALF, FORM)
    if NEED_W:
        tl.store(gw_row_ptr + col1, _sum(pw1, 0), mask=dm)
        tl.store(gw_row_ptr + col2, _sum(pw2, 0), mask=dm)
    return gc1, gc2, gs1, gs2


@triton.jit
def _qk_norm_rope_bwd_rows_kernel(
    gq_ptr, gq_sb, gq_sh, gq_ss,  # grad_q [B, Hq, S, D]
    gk_ptr, gk_sb, gk_sh, gk_ss,  # grad_k [B, Hkv, S, D]
    gv_ptr, gv_sb, gv_sh, gv_ss,  # grad_v [B, Hkv, S, D]
    q_ptr, q_sb, q_ss, q_sh,  # q [B, S, Hq, D] (pre-RoPE, strided view of qkv)
    k_ptr, k_sb, k_ss, k_sh,  # k [B, S, Hkv, D]
    rq_ptr, rq_sb, rq_sh, rq_ss,  # q_rstd [B, Hq, S]
    rk_ptr, rk_sb, rk_sh, rk_ss,  # k_rstd [B, Hkv, S]
    cos_ptr, cos_sb, cos_ss,  # cos [Bc, S, RW] (cos_sb = 0 when Bc == 1)
    sin_ptr, sin_sb, sin_ss,
    wq_ptr, wk_ptr,  # norm weights [D], contiguous
    dq_ptr, dq_sb, dq_ss,  # output: d(q_proj) [B, S, Hq*D], heads contiguous
    dk_off, dk_sb, dk_ss,  # d(k_proj) at dq_ptr + dk_off (one buffer: see _elementwise)
    dv_off, dv_sb, dv_ss,
    gw_ws_ptr,  # [2 * P, D] fp32 norm-weight partials: q rows [0, P), k rows [P, 2P) (NEED_W)
    cs_ws_ptr,  # [NS, M, 2*RW] fp32 cos/sin partials per (head slice, token) (NEED_CS, not CS_DIRECT)
    gc_ptr, gs_ptr,  # grad_cos / grad_sin [B, S, RW] contiguous (NEED_CS and CS_DIRECT)
    M, S, P,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, NS: tl.constexpr,
    ROUND: tl.constexpr, CS_ROUND: tl.constexpr, INTERP: tl.constexpr,
    NEED_W: tl.constexpr, NEED_CS: tl.constexpr, CS_DIRECT: tl.constexpr, STAGES: tl.constexpr,
    NORM_FIRST: tl.constexpr, ROUND_Y: tl.constexpr, NORM_STYLE: tl.constexpr, ROT_HALF: tl.constexpr,
):
    """Token-rows tiling. Program (token tile, head slice) owns BT tokens and slice ``NS``-th
    of the q, k and v heads; it loads the tokens' cos/sin rows once, walks its heads one by one
    and keeps the norm-weight and cos/sin grads as per-thread sums over heads, so nothing crosses
    threads but the per-row dot product (within a warp) and one final reduction over tokens."""
    pid = tl.program_id(0)
    dk_ptr = dq_ptr + dk_off
    dv_ptr = dq_ptr + dv_off
    tile = pid // NS
    slice_ = pid - tile * NS
    t = tile.to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    tm = t < M
    if BLOCK_HALF == HALF:
        dm = d < BLOCK_HALF  # all true, folded
    else:
        dm = d < HALF
    m2 = tm[:, None] & dm[None, :]
    b = t // S
    s = t - b * S

    c_row = (b * cos_sb + s * cos_ss)[:, None] + d[None, :]
    s_row = (b * sin_sb + s * sin_ss)[:, None] + d[None, :]
    c1, c2 = _table_halves(cos_ptr + c_row, m2, d[None, :], 1.0, HALF, ROT_HALF)
    s1, s2 = _table_halves(sin_ptr + s_row, m2, d[None, :], 0.0, HALF, ROT_HALF)
    zero = tl.full([BT, BLOCK_HALF], 0.0, tl.float32)
    gc1 = zero
    gc2 = zero
    gs1 = zero
    gs2 = zero

    # q heads of this slice, then k's (each writes its norm-weight partial row)
    CQ: tl.constexpr = (HQ + NS - 1) // NS
    FORM: tl.constexpr = (ROUND, INTERP, NEED_W, NEED_CS, NORM_FIRST, ROUND_Y, NORM_STYLE, ROT_HALF)
    tokens = (b, s, tm)
    features = (d, dm, m2)
    table_halves = (c1, c2, s1, s2)
    gc1, gc2, gs1, gs2 = _heads_of_slice(
        (gq_ptr, gq_sb, gq_sh, gq_ss), (q_ptr, q_sb, q_sh, q_ss), (rq_ptr, rq_sb, rq_sh, rq_ss), (dq_ptr, dq_sb, dq_ss),
        wq_ptr, gw_ws_ptr + pid.to(tl.int64) * D, slice_ * CQ, tl.minimum(slice_ * CQ + CQ, HQ),
        tokens, features, table_halves, (gc1, gc2, gs1, gs2), D, HALF, BT, BLOCK_HALF, STAGES, FORM)
    CK: tl.constexpr = (HKV + NS - 1) // NS
    gc1, gc2, gs1, gs2 = _heads_of_slice(
        (gk_ptr, gk_sb, gk_sh, gk_ss), (k_ptr, k_sb, k_sh, k_ss), (rk_ptr, rk_sb, rk_sh, rk_ss), (dk_ptr, dk_sb, dk_ss),
        wk_ptr, gw_ws_ptr + (P + pid).to(tl.int64) * D, slice_ * CK, tl.minimum(slice_ * CK + CK, HKV),
        tokens, features, table_halves, (gc1, gc2, gs1, gs2), D, HALF, BT, BLOCK_HALF, STAGES, FORM)

    if NEED_CS:
        # grad_cos = sum of R(dx*q); grad_sin = sum of R(dx*rotate_half(q)) = [-gs1, gs2].
        # Table rows are RW = 2 * ROT_HALF wide (D with full rotary).
        mr = _rotary_mask(m2, d[None, :], HALF, ROT_HALF)
        if CS_DIRECT:  # one slice, one cos row per token: the sums are complete, round once
            out = t[:, None] * (2 * ROT_HALF) + d[None, :]
            tl.store(gc_ptr + out, _round(gc1, CS_ROUND), mask=mr)
            tl.store(gc_ptr + out + ROT_HALF, _round(gc2, CS_ROUND), mask=mr)
            tl.store(gs_ptr + out, _round(-gs1, CS_ROUND), mask=mr)
            tl.store(gs_ptr + out + ROT_HALF, _round(gs2, CS_ROUND), mask=mr)
        else:
            cs_row = cs_ws_ptr + (slice_.to(tl.int64) * M + t)[:, None] * (4 * ROT_HALF) + d[None, :]
            tl.store(cs_row, gc1, mask=mr)
            tl.store(cs_row + ROT_HALF, gc2, mask=mr)
            tl.store(cs_row + 2 * ROT_HALF, -gs1, mask=mr)
            tl.store(cs_row + 3 * ROT_HALF, gs2, mask=mr)

    # v heads of this slice: a plain copy from [B, Hkv, S, D] into the projection layout.
    dv = tl.arange(0, BLOCK_D)
    mv = tm[:, None] & (dv < D)[None, :]
    v_tok = b * gv_sb + s * gv_ss
    ov_tok = b * dv_sb + s * dv_ss
    for h in tl.range(slice_ * CK, tl.minimum(slice_ * CK + CK, HKV), num_stages=STAGES):
        hh = tl.cast(h, tl.int64)
        val = tl.load(gv_ptr + (v_tok + hh * gv_sh)[:, None] + dv[None, :], mask=mv, eviction_policy="evict_first")
        tl.store(dv_ptr + (ov_tok + hh * D)[:, None] + dv[None, :], val, mask=mv)


@triton.jit
def _finish_partials_kernel(
    gw_ws_ptr,  # [PA + PB, D] fp32 norm-weight partial rows (NEED_W)
    gqw_ptr, gkw_ptr,  # rows [0, PA) -> grad_q_weight, rows [PA, PA + PB) -> grad_k_weight
    cs_ws_ptr,  # [NHB, M, 2*RW] fp32 cos/sin partial rows (NEED_CS)
    gc_ptr, gs_ptr,  # grad_cos / grad_sin [Bc, S, RW], contiguous (RW: the tables' width, rotary_dim)
    PA, PB, R, M, S, NHB, NB,  # R = Bc * S output rows; NB = B when Bc == 1 < B (sum over b), else 1
    CS_PROGRAMS,  # programs [0, CS_PROGRAMS) do cos/sin, the next 2 * cdiv(D, BLOCK_L) the weights
    D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_2D: tl.constexpr, W_ROUND: tl.constexpr, CS_ROUND: tl.constexpr,
    NEED_W: tl.constexpr, NEED_CS: tl.constexpr, RW: tl.constexpr,
):
    """Both fixed-order sums of the elementwise pass's partials, in one launch (one launch less
    of host time per backward). cos/sin: grad[r] = sum over head blocks (outer) and b (inner) of
    ws[hb, b*S + r]. Weights: sum of a row range in chunks of BLOCK_P rows, tree within a chunk."""
    pid = tl.program_id(0)
    if pid < CS_PROGRAMS:
        if NEED_CS:
            r = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
            c = tl.arange(0, BLOCK_2D)
            mask = (r < R)[:, None] & (c < 2 * RW)[None, :]
            # (Names differ between the branches: Triton unifies same-named variables of an if/else.)
            cs_acc = tl.full([BLOCK_T, BLOCK_2D], 0.0, tl.float32)
            row_hb = r  # int64 row of (hb, b = 0)
            for hb in range(0, NHB):
                row = row_hb
                for bb in range(0, NB):
                    cs_acc += tl.load(cs_ws_ptr + row[:, None] * (2 * RW) + c[None, :], mask=mask, other=0.0)
                    row += S
                row_hb += M
            cs_acc = _round(cs_acc, CS_ROUND)
            tl.store(gc_ptr + r[:, None] * RW + c[None, :], cs_acc, mask=mask & (c < RW)[None, :])
            tl.store(gs_ptr + r[:, None] * RW + (c - RW)[None, :], cs_acc, mask=mask & (c >= RW)[None, :])
    else:
        if NEED_W:
            col_blocks = (D + BLOCK_L - 1) // BLOCK_L
            p = pid - CS_PROGRAMS
            which = p // col_blocks
            cols = (p - which * col_blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
            cmask = cols < D
            r0 = tl.where(which == 0, 0, PA)
            P = tl.where(which == 0, PA, PB)
            rows = tl.arange(0, BLOCK_P)
            w_acc = tl.full([BLOCK_L], 0.0, tl.float32)
            for p0 in range(0, P, BLOCK_P):
                rr = p0 + rows
                tile = tl.load(gw_ws_ptr + (r0 + rr).to(tl.int64)[:, None] * D + cols[None, :],
                               mask=(rr < P)[:, None] & cmask[None, :], other=0.0)
                w_acc += _sum(tile, 0)
            w_acc = _round(w_acc, W_ROUND)
            if which == 0:
                tl.store(gqw_ptr + cols, w_acc, mask=cmask)
            else:
                tl.store(gkw_ptr + cols, w_acc, mask=cmask)


_FINISH_NUM_WARPS = 4


@triton.jit
def _qk_norm_rope_bwd_graph_kernel(
    gq_ptr, gq_sb: tl.constexpr, gq_sh: tl.constexpr, gq_ss: tl.constexpr, gk_ptr, gk_sb: tl.constexpr,
    gk_sh: tl.constexpr, gk_ss: tl.constexpr, gv_ptr, gv_sb: tl.constexpr, gv_sh: tl.constexpr,
    gv_ss: tl.constexpr, q_ptr, q_sb: tl.constexpr, q_ss: tl.constexpr, q_sh: tl.constexpr, k_ptr,
    k_sb: tl.constexpr, k_ss: tl.constexpr, k_sh: tl.constexpr, rq_ptr, rq_sb: tl.constexpr,
    rq_sh: tl.constexpr, rq_ss: tl.constexpr, rk_ptr, rk_sb: tl.constexpr, rk_sh: tl.constexpr,
    rk_ss: tl.constexpr, cos_ptr, cos_sb: tl.constexpr, cos_ss: tl.constexpr, sin_ptr, sin_sb: tl.constexpr,
    sin_ss: tl.constexpr, wq_ptr, wk_ptr, dq_ptr, dq_sb: tl.constexpr, dq_ss: tl.constexpr,
    dk_off: tl.constexpr, dk_sb: tl.constexpr, dk_ss: tl.constexpr, dv_off: tl.constexpr, dv_sb: tl.constexpr,
    dv_ss: tl.constexpr, gw_ws_ptr, cs_ws_ptr, M: tl.constexpr, S: tl.constexpr, GQ: tl.constexpr,
    GK: tl.constexpr, GV: tl.constexpr, NTT_Q: tl.constexpr, NTT_KV: tl.constexpr, HQ: tl.constexpr,
    HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BHQ: tl.constexpr, BTQ: tl.constexpr, BHK: tl.constexpr, BTK: tl.constexpr, BHV: tl.constexpr,
    BTV: tl.constexpr, ROUND: tl.constexpr, INTERP: tl.constexpr, NEED_W: tl.constexpr, NEED_CS: tl.constexpr,
    NORM_FIRST: tl.constexpr, ROUND_Y: tl.constexpr, NORM_STYLE: tl.constexpr, ROT_HALF: tl.constexpr,
):
    """``_qk_norm_rope_bwd_kernel`` (the head-tile elementwise kernel) in a
    compiled graph, whose shapes are static: every size and stride a constexpr, so that only the
    tensors are passed at launch (a launch costs the host ~0.12 us per int argument,
    ``benchmarks/diagnostics/bench_launch_host.py``)."""
    _qk_norm_rope_bwd_kernel(
        gq_ptr, gq_sb, gq_sh, gq_ss, gk_ptr, gk_sb, gk_sh, gk_ss, gv_ptr, gv_sb, gv_sh, gv_ss, q_ptr, q_sb,
        q_ss, q_sh, k_ptr, k_sb, k_ss, k_sh, rq_ptr, rq_sb, rq_sh, rq_ss, rk_ptr, rk_sb, rk_sh, rk_ss, cos_ptr,
        cos_sb, cos_ss, sin_ptr, sin_sb, sin_ss, wq_ptr, wk_ptr, dq_ptr, dq_sb, dq_ss, dk_off, dk_sb, dk_ss,
        dv_off, dv_sb, dv_ss, gw_ws_ptr, cs_ws_ptr, M, S, GQ, GK, GV, NTT_Q, NTT_KV, HQ, HKV, D, HALF,
        BLOCK_HALF, BLOCK_D, BHQ, BTQ, BHK, BTK, BHV, BTV, ROUND, INTERP, NEED_W, NEED_CS, NORM_FIRST, ROUND_Y,
        NORM_STYLE, ROT_HALF,
    )


@triton.jit
def _qk_norm_rope_bwd_rows_graph_kernel(
    gq_ptr, gq_sb: tl.constexpr, gq_sh: tl.constexpr, gq_ss: tl.constexpr, gk_ptr, gk_sb: tl.constexpr,
    gk_sh: tl.constexpr, gk_ss: tl.constexpr, gv_ptr, gv_sb: tl.constexpr, gv_sh: tl.constexpr,
    gv_ss: tl.constexpr, q_ptr, q_sb: tl.constexpr, q_ss: tl.constexpr, q_sh: tl.constexpr, k_ptr,
    k_sb: tl.constexpr, k_ss: tl.constexpr, k_sh: tl.constexpr, rq_ptr, rq_sb: tl.constexpr,
    rq_sh: tl.constexpr, rq_ss: tl.constexpr, rk_ptr, rk_sb: tl.constexpr, rk_sh: tl.constexpr,
    rk_ss: tl.constexpr, cos_ptr, cos_sb: tl.constexpr, cos_ss: tl.constexpr, sin_ptr, sin_sb: tl.constexpr,
    sin_ss: tl.constexpr, wq_ptr, wk_ptr, dq_ptr, dq_sb: tl.constexpr, dq_ss: tl.constexpr,
    dk_off: tl.constexpr, dk_sb: tl.constexpr, dk_ss: tl.constexpr, dv_off: tl.constexpr, dv_sb: tl.constexpr,
    dv_ss: tl.constexpr, gw_ws_ptr, cs_ws_ptr, gc_ptr, gs_ptr, M: tl.constexpr, S: tl.constexpr,
    P: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, NS: tl.constexpr, ROUND: tl.constexpr,
    CS_ROUND: tl.constexpr, INTERP: tl.constexpr, NEED_W: tl.constexpr, NEED_CS: tl.constexpr,
    CS_DIRECT: tl.constexpr, STAGES: tl.constexpr, NORM_FIRST: tl.constexpr, ROUND_Y: tl.constexpr,
    NORM_STYLE: tl.constexpr, ROT_HALF: tl.constexpr,
):
    """``_qk_norm_rope_bwd_rows_kernel`` (the token-row elementwise kernel) in a
    compiled graph, whose shapes are static: every size and stride a constexpr, so that only the
    tensors are passed at launch (a launch costs the host ~0.12 us per int argument,
    ``benchmarks/diagnostics/bench_launch_host.py``)."""
    _qk_norm_rope_bwd_rows_kernel(
        gq_ptr, gq_sb, gq_sh, gq_ss, gk_ptr, gk_sb, gk_sh, gk_ss, gv_ptr, gv_sb, gv_sh, gv_ss, q_ptr, q_sb,
        q_ss, q_sh, k_ptr, k_sb, k_ss, k_sh, rq_ptr, rq_sb, rq_sh, rq_ss, rk_ptr, rk_sb, rk_sh, rk_ss, cos_ptr,
        cos_sb, cos_ss, sin_ptr, sin_sb, sin_ss, wq_ptr, wk_ptr, dq_ptr, dq_sb, dq_ss, dk_off, dk_sb, dk_ss,
        dv_off, dv_sb, dv_ss, gw_ws_ptr, cs_ws_ptr, gc_ptr, gs_ptr, M, S, P, HQ, HKV, D, HALF, BLOCK_HALF,
        BLOCK_D, BT, NS, ROUND, CS_ROUND, INTERP, NEED_W, NEED_CS, CS_DIRECT, STAGES, NORM_FIRST, ROUND_Y,
        NORM_STYLE, ROT_HALF,
    )


@triton.jit
def _finish_partials_graph_kernel(
    gw_ws_ptr, gqw_ptr, gkw_ptr, cs_ws_ptr, gc_ptr, gs_ptr, PA: tl.constexpr, PB: tl.constexpr,
    R: tl.constexpr, M: tl.constexpr, S: tl.constexpr, NHB: tl.constexpr, NB: tl.constexpr,
    CS_PROGRAMS: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_2D: tl.constexpr, W_ROUND: tl.constexpr, CS_ROUND: tl.constexpr,
    NEED_W: tl.constexpr, NEED_CS: tl.constexpr, RW: tl.constexpr,
):
    """``_finish_partials_kernel`` (the finishing sums) in a
    compiled graph, whose shapes are static: every size and stride a constexpr, so that only the
    tensors are passed at launch (a launch costs the host ~0.12 us per int argument,
    ``benchmarks/diagnostics/bench_launch_host.py``)."""
    _finish_partials_kernel(
        gw_ws_ptr, gqw_ptr, gkw_ptr, cs_ws_ptr, gc_ptr, gs_ptr, PA, PB, R, M, S, NHB, NB, CS_PROGRAMS, D,
        BLOCK_P, BLOCK_L, BLOCK_T, BLOCK_2D, W_ROUND, CS_ROUND, NEED_W, NEED_CS, RW,
    )


#: The entry each kernel has in a compiled graph (``_run``): the same program, scalars as constexprs.
GRAPH_KERNELS = {
    _qk_norm_rope_bwd_kernel: _qk_norm_rope_bwd_graph_kernel,
    _qk_norm_rope_bwd_rows_kernel: _qk_norm_rope_bwd_rows_graph_kernel,
    _finish_partials_kernel: _finish_partials_graph_kernel,
}


def elementwise_supported(grad_q, grad_k, grad_v, q, k, cos, sin, q_weight, k_weight) -> bool:
    """True when ``qk_norm_rope_backward_triton`` handles these tensors (else it raises ValueError):
    a device Triton runs on, one dtype in SUPPORTED_DTYPES for all of them, an even head_dim and
    contiguous last dims. Callers use their PyTorch reference otherwise (e.g. fp32 cos with bf16 q)."""
    tensors = (grad_q, grad_k, grad_v, q, k, cos, sin, q_weight, k_weight)
    return (
        triton_applicable(q)
        and q.dtype in SUPPORTED_DTYPES
        and all(t.dtype == q.dtype and t.device == q.device for t in tensors)
        and q.shape[-1] % 2 == 0
        and all(t.numel() == 0 or t.stride(-1) == 1 for t in tensors)
    )


def _bsn_strides(t: torch.Tensor, st: tuple[int, ...], B: int, S: int, N: int, name: str) -> tuple[int, int]:
    """(stride over b, stride over s) of a [B, S, N] / [B*S, N] / [B, S, H, D] tensor ``t`` with
    strides ``st`` whose trailing N elements per token are contiguous."""
    shape = t.shape
    if len(shape) == 2 and shape == (B * S, N) and st[1] == 1:
        return S * st[0], st[0]
    if len(shape) == 3 and shape == (B, S, N) and st[2] == 1:
        return st[0], st[1]
    if len(shape) == 4 and shape[:2] == (B, S) and shape[2] * shape[3] == N:
        if st[3] == 1 and st[2] == shape[3]:
            return st[0], st[1]
    raise ValueError(
        f"qk_norm_rope_backward_triton: {name}: expected [B*S, {N}] or [B, S, {N}] with contiguous "
        f"rows, got shape {tuple(shape)} strides {tuple(st)}"
    )


def _rstd_strides(r: torch.Tensor, B: int, H: int, S: int, name: str) -> tuple[int, int, int]:
    shape, st = r.shape, r.stride()
    if len(shape) == 4 and shape[3] == 1:
        shape, st = shape[:3], st[:3]
    if shape != (B, H, S):
        raise ValueError(f"qk_norm_rope_backward_triton: {name}: expected [B, H, S] (or [B, H, S, 1]), "
                         f"got {tuple(r.shape)}")
    return st


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _ElementwisePlan:
    """Tiles and grids of one elementwise backward launch (module docstring, "Tiling")."""

    BLOCK_HALF: int
    BLOCK_D: int
    BHQ: int
    BTQ: int
    BHK: int  # v tiles are k's (BLOCK_D == 2 * BLOCK_HALF for even D)
    BTK: int
    nqb: int
    nkb: int
    ntt_q: int
    ntt_k: int
    GQ: int
    GK: int
    PQ: int
    PK: int
    programs: int
    # the finishing launch
    BLOCK_P: int
    BLOCK_L: int
    w_programs: int
    BLOCK_2D: int
    BLOCK_T: int
    cs_programs: int


# A pure function of a few ints, called on every backward: cached, the host pays one dict lookup
# (triton.cdiv / next_power_of_2 cost ~3 us each as Python calls: ~60 us per backward uncached).
@functools.lru_cache(maxsize=4096)
def _elementwise_plan(B: int, S: int, HQ: int, HKV: int, D: int, Bc: int, need_w: bool, need_cs: bool,
                      target_programs: int, num_programs: int | None, tile_elements: int,
                      max_tiles_per_program: int) -> _ElementwisePlan:
    M = B * S
    block_half, block_d, m_pow2 = _next_pow2(D // 2), _next_pow2(D), _next_pow2(M)

    def tile(H: int) -> tuple[int, int]:
        # heads: all heads of the kind up to TILE / width rows; tokens: the rest of the tile.
        bh = min(_next_pow2(H), max(1, tile_elements // block_d))
        return bh, min(m_pow2, max(1, tile_elements // (bh * block_d)))

    bhq, btq = tile(HQ)
    bhk, btk = tile(HKV)
    nqb, nkb = _cdiv(HQ, bhq), _cdiv(HKV, bhk)
    ntt_q, ntt_k = _cdiv(M, btq), _cdiv(M, btk)
    total_tiles = nqb * ntt_q + 2 * nkb * ntt_k
    if num_programs is None:
        tiles_per_program = min(max_tiles_per_program, _cdiv(total_tiles, target_programs))
    else:  # tests: about num_programs programs, however many tiles each
        tiles_per_program = _cdiv(total_tiles, max(1, num_programs))
    tiles_per_program = max(1, tiles_per_program)
    gq, gk = _cdiv(ntt_q, tiles_per_program), _cdiv(ntt_k, tiles_per_program)
    pq, pk = nqb * gq, nkb * gk
    block_p = min(1024, _next_pow2(max(pq, pk)))
    block_l = max(8, min(block_d, 8192 // block_p))
    block_2d = _next_pow2(2 * D)
    block_t = max(1, min(_next_pow2(Bc * S), 4096 // block_2d))
    return _ElementwisePlan(
        BLOCK_HALF=block_half, BLOCK_D=block_d, BHQ=bhq, BTQ=btq, BHK=bhk, BTK=btk, nqb=nqb, nkb=nkb,
        ntt_q=ntt_q, ntt_k=ntt_k, GQ=gq, GK=gk, PQ=pq, PK=pk, programs=pq + 2 * pk,
        BLOCK_P=block_p, BLOCK_L=block_l, w_programs=2 * _cdiv(D, block_l) if need_w else 0,
        BLOCK_2D=block_2d, BLOCK_T=block_t, cs_programs=_cdiv(Bc * S, block_t) if need_cs else 0,
    )


@dataclasses.dataclass(frozen=True)
class _RowsPlan:
    """Grid of one token-rows elementwise launch and its finishing launch."""

    BLOCK_HALF: int
    BLOCK_D: int
    BT: int  # tokens per program
    NS: int  # head slices: programs per token tile
    programs: int
    cs_direct: bool  # grad_cos / grad_sin written by the elementwise kernel itself
    BLOCK_P: int
    BLOCK_L: int
    w_programs: int
    BLOCK_2D: int
    BLOCK_T: int
    cs_programs: int


@functools.lru_cache(maxsize=4096)
def _rows_plan(B: int, S: int, HQ: int, HKV: int, D: int, Bc: int, need_w: bool, need_cs: bool,
               target_programs: int, tokens: int) -> _RowsPlan:
    """BT = ``tokens`` (fewer for tiny M); head slices doubled (at most Hq) until the grid reaches
    ``target_programs``: large M keeps every head of a token in one program (cos/sin grads
    complete in-program), small M splits the heads to fill the GPU. The finishing launch's
    cos/sin tile (BLOCK_T tokens) gives it about 2 * target_programs programs."""
    if tokens < 1 or tokens & (tokens - 1):
        raise ValueError(f"ROWS_TOKENS: expected a power of two (a tl.arange length), got {tokens}")
    M = B * S
    bt = max(1, min(tokens, _next_pow2(M)))
    tiles = _cdiv(M, bt)
    ns = 1
    while tiles * ns < target_programs and 2 * ns <= HQ:  # every slice keeps >= 1 q head
        ns *= 2
    programs = tiles * ns
    cs_direct = ns == 1 and Bc == B
    block_d = _next_pow2(D)
    block_p = min(1024, _next_pow2(programs))
    block_2d = _next_pow2(2 * D)
    # Finishing cos/sin sums: NS * NB partial rows per output row; tokens per program chosen for
    # about 2 programs per target slot (a fixed 16 left M = 512 with 32 programs of 128 KB).
    block_t = max(1, min(_next_pow2(_cdiv(Bc * S, 2 * target_programs)), 4096 // block_2d))
    block_l = max(8, min(block_d, 8192 // block_p))
    return _RowsPlan(
        BLOCK_HALF=_next_pow2(D // 2), BLOCK_D=block_d, BT=bt, NS=ns, programs=programs, cs_direct=cs_direct,
        BLOCK_P=block_p, BLOCK_L=block_l, w_programs=2 * _cdiv(D, block_l) if need_w else 0,
        BLOCK_2D=block_2d, BLOCK_T=block_t, cs_programs=_cdiv(Bc * S, block_t) if need_cs and not cs_direct else 0,
    )


def qk_norm_rope_backward_triton(
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
    num_programs: int | None = None,
    rope_first: bool = True,
    norm_style: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of ``w * rmsnorm(rope(q))`` (``rope_first=False``: of ``rope(w * rmsnorm(q))``,
    the Qwen3 order) for q and k (and the layout copy of v), one pass.

    Args:
        grad_q: [B, Hq, S, D] grad of the normed q; grad_k, grad_v: [B, Hkv, S, D]. Any strides,
            contiguous last dim.
        q: [B, S, Hq, D], k: [B, S, Hkv, D] pre-RoPE projections (strided views, contiguous last dim).
        q_rstd, k_rstd: [B, H, S] (or [B, H, S, 1]) rstd of the forward norms; any float dtype.
        cos, sin: [Bc, S, R], Bc in {1, B}; R = D, or an even rotary_dim < D for partial rotary (RoPE on
            the first R features, the rest passed through, as transformers' GLM-4.5 / Qwen3-Next write it).
        q_weight, k_weight: [D] norm weights.
        grad_q_proj: [B, S, Hq*D] (or [B*S, Hq*D]); grad_k_proj, grad_v_proj: [B, S, Hkv*D]:
            preallocated outputs, written in full (typically views of one [M, qkv_size] buffer).
        need_weight_grad, need_cos_sin_grad: compute (and return) those grads.
        num_programs: tests: the program-count target. Head tiles: about that many
            programs, however many tiles each (default ``ELEMENTWISE_PROGRAMS_PER_SM * SMs``
            with at most ``ELEMENTWISE_MAX_TILES_PER_PROGRAM`` tiles per program). Token rows
            head slices are added until the grid reaches it (default
            ``ROWS_PROGRAMS_PER_SM * SMs``); the grid can be larger.
        rope_first: the forward's order (False: the norm, then RoPE).
        norm_style: the norm form differentiated, a ``NORM_STYLES`` value.

    Returns:
        (grad_q_weight [D], grad_k_weight [D], grad_cos [Bc, S, R], grad_sin [Bc, S, R]) in the
        weights' / cos' dtype, None where not requested.
    """
    B, HQ, S, D = grad_q.shape
    HKV = grad_k.shape[1]
    dtype = q.dtype
    if D % 2:
        raise ValueError(f"qk_norm_rope_backward_triton: head_dim must be even, got {D}")
    if tuple(q.shape) != (B, S, HQ, D) or tuple(k.shape) != (B, S, HKV, D):
        raise ValueError(f"qk_norm_rope_backward_triton: q/k shapes {tuple(q.shape)}/{tuple(k.shape)} "
                         f"do not match grads {tuple(grad_q.shape)}/{tuple(grad_k.shape)}")
    if tuple(grad_k.shape) != (B, HKV, S, D) or tuple(grad_v.shape) != (B, HKV, S, D):
        raise ValueError("qk_norm_rope_backward_triton: grad_k / grad_v must be [B, Hkv, S, D]")
    Bc = cos.shape[0]
    if (cos.dim() != 3 or Bc not in (1, B) or cos.shape[1] != S or not 0 < cos.shape[2] <= D
            or cos.shape[2] % 2 or sin.shape != cos.shape):
        raise ValueError(f"qk_norm_rope_backward_triton: cos/sin must be [1 or B, S, rotary_dim] with an even "
                         f"rotary_dim <= D = {D}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"qk_norm_rope_backward_triton: dtype {dtype} not in {SUPPORTED_DTYPES}")
    # Each tensor's strides are read once: this function runs on every backward, and at small M
    # the GPU waits for the host (each Tensor.stride() call is a Python -> C++ round trip).
    named = (("grad_q", grad_q), ("grad_k", grad_k), ("grad_v", grad_v), ("q", q), ("k", k),
             ("cos", cos), ("sin", sin), ("q_weight", q_weight), ("k_weight", k_weight),
             ("grad_q_proj", grad_q_proj), ("grad_k_proj", grad_k_proj), ("grad_v_proj", grad_v_proj))
    strides = [t.stride() for _, t in named]
    # q, k and the projection grads in x's dtype; the incoming grads, tables and weights in the
    # region output's (y: x's own, or fp32 under autocast for Qwen3's form in Qwen3's order).
    y_dtype = grad_q.dtype
    if y_dtype != dtype and y_dtype != torch.float32:
        raise ValueError(f"qk_norm_rope_backward_triton: grad_q has dtype {y_dtype}, expected q's {dtype} "
                         "or fp32 (autocast)")
    for (name, t), st in zip(named, strides):
        expected = dtype if name in ("q", "k") or name.endswith("_proj") else y_dtype
        if t.dtype != expected:
            raise ValueError(f"qk_norm_rope_backward_triton: {name} has dtype {t.dtype}, expected {expected}")
        if st[-1] != 1 and t.numel():
            raise ValueError(f"qk_norm_rope_backward_triton: {name} needs a contiguous last dim, "
                             f"got strides {tuple(st)}")
    gq_s, gk_s, gv_s, q_s, k_s, cos_s, sin_s, _, _, dq_st, dk_st, dv_st = strides

    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"qk_norm_rope_backward_triton: q_weight / k_weight must be [D={D}], got "
                         f"{tuple(q_weight.shape)} / {tuple(k_weight.shape)}")
    q_weight = q_weight.contiguous()
    k_weight = k_weight.contiguous()
    dq_sb, dq_ss = _bsn_strides(grad_q_proj, dq_st, B, S, HQ * D, "grad_q_proj")
    dk_sb, dk_ss = _bsn_strides(grad_k_proj, dk_st, B, S, HKV * D, "grad_k_proj")
    dv_sb, dv_ss = _bsn_strides(grad_v_proj, dv_st, B, S, HKV * D, "grad_v_proj")
    offsets = []
    for name, part in (("grad_k_proj", grad_k_proj), ("grad_v_proj", grad_v_proj)):
        if part.untyped_storage().data_ptr() != grad_q_proj.untyped_storage().data_ptr():
            raise ValueError(f"qk_norm_rope_backward_triton: {name}: expected a view of grad_q_proj's buffer "
                             "(the three parts are column slices of one [M, qkv_size] gradient)")
        offsets.append(part.storage_offset() - grad_q_proj.storage_offset())
    rstd_strides = (_rstd_strides(q_rstd, B, HQ, S, "q_rstd"), _rstd_strides(k_rstd, B, HKV, S, "k_rstd"))
    M = B * S
    if M == 0:
        gw = (torch.zeros_like(q_weight), torch.zeros_like(k_weight)) if need_weight_grad else (None, None)
        gcs = (torch.zeros_like(cos), torch.zeros_like(sin)) if need_cos_sin_grad else (None, None)
        return gw[0], gw[1], gcs[0], gcs[1]
    _, gqw, gkw, gcos, gsin = _elementwise(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_weight.contiguous(), k_weight.contiguous(),
        grad_q_proj, ((dq_sb, dq_ss), (offsets[0], dk_sb, dk_ss), (offsets[1], dv_sb, dv_ss)), rstd_strides,
        need_weight_grad, need_cos_sin_grad, num_programs, in_graph=False, rope_first=rope_first,
        norm_style=norm_style)
    return gqw, gkw, gcos, gsin


def qk_norm_rope_backward_in_graph(
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
    need_weight_grad: bool,
    need_cos_sin_grad: bool,
    rope_first: bool = True,
    norm_style: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``qk_norm_rope_backward_triton`` traced into a graph: its launches become Triton kernel
    nodes (``TritonCall.in_graph``) that Inductor launches itself.

    Called while tracing (FakeTensors with static sizes; the training pattern's replacement), with
    the arguments of ``qk_norm_rope_backward_triton`` already checked by the pattern. Allocates the
    gradient of the projection output itself.

    Returns:
        (grad_proj [B*S, (Hq + 2*Hkv) * D] with q's dtype, columns ordered q | k | v;
        grad_q_weight, grad_k_weight [D]; grad_cos, grad_sin [Bc, S, RW], RW the tables' width), None where not requested.
    """
    B, HQ, S, D = grad_q.shape
    HKV = grad_k.shape[1]
    nq, nk = HQ * D, HKV * D
    grad_proj = q.new_empty((B * S, nq + 2 * nk))
    row = grad_proj.stride(0)
    grad_proj, gqw, gkw, gcos, gsin = _elementwise(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_weight.contiguous(), k_weight.contiguous(),
        grad_proj, ((S * row, row), (nq, S * row, row), (nq + nk, S * row, row)),
        (_rstd_strides(q_rstd, B, HQ, S, "q_rstd"), _rstd_strides(k_rstd, B, HKV, S, "k_rstd")), need_weight_grad,
        need_cos_sin_grad, None, in_graph=True, rope_first=rope_first, norm_style=norm_style)
    return grad_proj, gqw, gkw, gcos, gsin


def _run(call: TritonCall, written: tuple[str, ...], in_graph: bool) -> dict[str, torch.Tensor]:
    """Launch now, or record the launch in the graph; the written tensors by argument name (in a
    graph: their new values, which the next launch must read)."""
    if in_graph:
        return dataclasses.replace(call, kernel=GRAPH_KERNELS[call.kernel]).in_graph(written)
    call.run()
    return {name: call.kwargs[name] for name in written}


def _elementwise(grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_weight, k_weight, grad_proj,
                 grad_proj_layout, rstd_strides, need_w, need_cs, num_programs, in_graph, rope_first, norm_style=0):
    """The elementwise kernel (head tiles or token rows, by M), then the finishing sums; returns (grad_proj, gqw,
    gkw, gcos, gsin). ``grad_proj`` is the q part's view; ``grad_proj_layout`` = ``((q_sb, q_ss), (k_offset,
    k_sb, k_ss), (v_offset, v_sb, v_ss))``: the k and v parts lie at element offsets from it (one buffer: a
    graph node writes whole tensors); ``rstd_strides``: (q_rstd's, k_rstd's) (b, h, s) strides, checked by
    ``_rstd_strides``."""
    B, HQ, S, D = grad_q.shape
    HKV = grad_k.shape[1]
    dq_strides, dk_layout, dv_layout = grad_proj_layout
    rq_s, rk_s = rstd_strides
    M, Bc, dev = B * S, cos.shape[0], q.device
    gq_s, gk_s, gv_s, q_s, k_s = (t.stride() for t in (grad_q, grad_k, grad_v, q, k))
    cos_s, sin_s = cos.stride(), sin.stride()
    leading = (
        grad_q, gq_s[0], gq_s[1], gq_s[2],
        grad_k, gk_s[0], gk_s[1], gk_s[2],
        grad_v, gv_s[0], gv_s[1], gv_s[2],
        q, q_s[0], q_s[1], q_s[2],
        k, k_s[0], k_s[1], k_s[2],
        q_rstd, *rq_s,
        k_rstd, *rk_s,
        cos, cos_s[0] if Bc > 1 else 0, cos_s[1],
        sin, sin_s[0] if Bc > 1 else 0, sin_s[1],
        q_weight, k_weight,
        grad_proj, *dq_strides, *dk_layout, *dv_layout,
    )
    unused = torch.empty((1,), device=dev, dtype=torch.float32)  # pointer of a constexpr-disabled argument
    grad_cos = grad_sin = None
    RW = cos.shape[-1]  # rotary_dim: D, or fewer features with partial rotary
    common = dict(HQ=HQ, HKV=HKV, D=D, HALF=D // 2, ROUND=_ROUND_MODE[q.dtype], INTERP=not q.is_cuda,
                  NEED_W=need_w, NEED_CS=need_cs, NORM_FIRST=not rope_first, ROUND_Y=_ROUND_MODE[grad_q.dtype],
                  NORM_STYLE=norm_style, ROT_HALF=RW // 2)
    if elementwise_tiling(M) == "token_rows":
        plan = _rows_plan(B, S, HQ, HKV, D, Bc, need_w, need_cs,
                          max(1, round(ROWS_PROGRAMS_PER_SM * sm_count(q))) if num_programs is None else num_programs,
                          ROWS_TOKENS)
        gw_ws = torch.empty((2 * plan.programs, D), device=dev, dtype=torch.float32) if need_w else unused
        cs_ws = unused
        if need_cs and not plan.cs_direct:
            cs_ws = torch.empty((plan.NS, M, 2 * RW), device=dev, dtype=torch.float32)
        gc = gs = unused
        if need_cs and plan.cs_direct:
            gc = torch.empty((Bc, S, RW), device=dev, dtype=cos.dtype)
            gs = torch.empty((Bc, S, RW), device=dev, dtype=sin.dtype)
        call = TritonCall(_qk_norm_rope_bwd_rows_kernel, (plan.programs,), named_args(
            _qk_norm_rope_bwd_rows_kernel, *leading, gw_ws, cs_ws, gc, gs, M, S, plan.programs,
            BLOCK_HALF=plan.BLOCK_HALF, BLOCK_D=plan.BLOCK_D, BT=plan.BT, NS=plan.NS,
            CS_ROUND=_ROUND_MODE[cos.dtype], CS_DIRECT=plan.cs_direct, STAGES=ROWS_STAGES, **common), ROWS_NUM_WARPS)
        written = ["dq_ptr"] + ["gw_ws_ptr"] * need_w
        written += (["gc_ptr", "gs_ptr"] if plan.cs_direct else ["cs_ws_ptr"]) if need_cs else []
        out = _run(call, tuple(written), in_graph)
        if need_cs and plan.cs_direct:
            grad_cos, grad_sin = out["gc_ptr"], out["gs_ptr"]
        PA = PB = plan.programs
        NHB = plan.NS
    else:
        plan = _elementwise_plan(B, S, HQ, HKV, D, Bc, need_w, need_cs,
                                 ELEMENTWISE_PROGRAMS_PER_SM * sm_count(q), num_programs,
                                 ELEMENTWISE_TILE_ELEMENTS, ELEMENTWISE_MAX_TILES_PER_PROGRAM)
        gw_ws = torch.empty((plan.PQ + plan.PK, D), device=dev, dtype=torch.float32) if need_w else unused
        cs_ws = torch.empty((plan.nqb + plan.nkb, M, 2 * RW), device=dev, dtype=torch.float32) if need_cs else unused
        call = TritonCall(_qk_norm_rope_bwd_kernel, (plan.programs,), named_args(
            _qk_norm_rope_bwd_kernel, *leading, gw_ws, cs_ws, M, S, plan.GQ, plan.GK, plan.GK, plan.ntt_q,
            plan.ntt_k, BLOCK_HALF=plan.BLOCK_HALF, BLOCK_D=plan.BLOCK_D, BHQ=plan.BHQ, BTQ=plan.BTQ,
            BHK=plan.BHK, BTK=plan.BTK, BHV=plan.BHK, BTV=plan.BTK, **common), ELEMENTWISE_NUM_WARPS)
        out = _run(call, ("dq_ptr",) + ("gw_ws_ptr",) * need_w + ("cs_ws_ptr",) * need_cs, in_graph)
        PA, PB = plan.PQ, plan.PK
        NHB = plan.nqb + plan.nkb
    grad_proj = out["dq_ptr"]
    gw_ws = out.get("gw_ws_ptr", gw_ws)
    cs_ws = out.get("cs_ws_ptr", cs_ws)
    gqw, gkw, grad_cos, grad_sin = _finish(plan, gw_ws, cs_ws, PA, PB, NHB, need_w, need_cs, q_weight, k_weight,
                                           cos, sin, B, S, D, grad_cos, grad_sin, unused, in_graph)
    return grad_proj, gqw, gkw, grad_cos, grad_sin


def elementwise_tiling(M: int) -> str:
    """The elementwise kernel used for M = B*S tokens: ``ELEMENTWISE_TILING``, "auto" resolved."""
    if ELEMENTWISE_TILING == "auto":
        return "token_rows" if M >= ROWS_MIN_M else "head_tiles"
    if ELEMENTWISE_TILING in ("token_rows", "head_tiles"):
        return ELEMENTWISE_TILING
    raise ValueError(f"ELEMENTWISE_TILING: expected 'auto', 'token_rows' or 'head_tiles', got {ELEMENTWISE_TILING!r}")


def _finish(plan, gw_ws, cs_ws, PA, PB, NHB, need_w, need_cs, q_weight, k_weight, cos, sin, B, S, D,
            grad_cos, grad_sin, unused, in_graph):
    """Allocate the requested grads and run the finishing sums of ``plan`` (an _ElementwisePlan or
    _RowsPlan: one launch, none when nothing is left to sum). grad_cos / grad_sin passed in:
    already written by the elementwise kernel. Returns (grad_q_weight, grad_k_weight, grad_cos,
    grad_sin), None where not requested."""
    dev, Bc = cos.device, cos.shape[0]
    grad_qw = grad_kw = unused
    if need_w:
        grad_qw = torch.empty((D,), device=dev, dtype=q_weight.dtype)
        grad_kw = torch.empty((D,), device=dev, dtype=k_weight.dtype)
    sums_cs = need_cs and plan.cs_programs > 0
    gc = gs = unused
    RW = cos.shape[-1]
    if sums_cs:
        gc = torch.empty((Bc, S, RW), device=dev, dtype=cos.dtype)
        gs = torch.empty((Bc, S, RW), device=dev, dtype=sin.dtype)
    if plan.cs_programs + plan.w_programs:
        call = TritonCall(_finish_partials_kernel, (plan.cs_programs + plan.w_programs,), named_args(
            _finish_partials_kernel, gw_ws, grad_qw, grad_kw, cs_ws, gc, gs,
            PA, PB, Bc * S, B * S, S, NHB, B if Bc == 1 else 1, plan.cs_programs,
            D=D, BLOCK_P=plan.BLOCK_P, BLOCK_L=plan.BLOCK_L, BLOCK_T=plan.BLOCK_T, BLOCK_2D=plan.BLOCK_2D,
            W_ROUND=_ROUND_MODE[q_weight.dtype], CS_ROUND=_ROUND_MODE[cos.dtype], NEED_W=need_w, NEED_CS=sums_cs,
            RW=RW),
            _FINISH_NUM_WARPS)
        out = _run(call, ("gqw_ptr", "gkw_ptr") * need_w + ("gc_ptr", "gs_ptr") * sums_cs, in_graph)
        grad_qw, grad_kw = out.get("gqw_ptr", grad_qw), out.get("gkw_ptr", grad_kw)
        if sums_cs:
            grad_cos, grad_sin = out["gc_ptr"], out["gs_ptr"]
    return (grad_qw if need_w else None, grad_kw if need_w else None,
            grad_cos if need_cs else None, grad_sin if need_cs else None)


def full_backward_triton(
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
    hidden: torch.Tensor,
    weight: torch.Tensor,
    need_norm_weight_grad: bool = True,
    need_cos_sin_grad: bool = True,
    need_bias_grad: bool = False,
) -> dict[str, torch.Tensor | None]:
    """The whole backward for a fused QKV weight: elementwise pass into one [M, qkv_size] buffer,
    then the projection GEMMs (cuBLAS through torch). ``hidden`` is [M, K], ``weight``
    [qkv_size, K]. Returns a dict with grad_hidden, grad_weight, grad_bias, grad_q_weight,
    grad_k_weight, grad_cos, grad_sin, grad_qkv."""
    B, HQ, S, D = grad_q.shape
    HKV = grad_k.shape[1]
    nq, nk = HQ * D, HKV * D
    grad_qkv = torch.empty((B * S, nq + 2 * nk), device=q.device, dtype=q.dtype)
    gqw, gkw, gcos, gsin = qk_norm_rope_backward_triton(
        grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, cos, sin, q_weight, k_weight,
        grad_qkv[:, :nq], grad_qkv[:, nq: nq + nk], grad_qkv[:, nq + nk:],
        need_weight_grad=need_norm_weight_grad, need_cos_sin_grad=need_cos_sin_grad,
    )
    gh, gw, gb = projection_gemms([grad_qkv], hidden, [weight], True, True, need_bias_grad)
    return dict(grad_hidden=gh, grad_weight=gw[0], grad_bias=gb[0] if need_bias_grad else None,
                grad_q_weight=gqw, grad_k_weight=gkw, grad_cos=gcos, grad_sin=gsin, grad_qkv=grad_qkv)
