"""Triton kernel behind ``torch.ops.fusion_pass.qk_norm_rope_cache``, and its launcher.

One launch does, for every (batch b, head h, token s), q/k/v ``[B, H, S, D]`` (any strides with
a contiguous last dim), caches ``[B, Hkv, L, D]``, cos/sin ``[B or 1, S, R]``::

    q_out[b, h, s]  = rope(rms_norm(q[b, h, s], q_weight), cos[b, s], sin[b, s])
    k_out[b, h, s]  = rope(rms_norm(k[b, h, s], k_weight), cos[b, s], sin[b, s])
    k_cache[b, h, cache_position[s]] = k_out[b, h, s]      # negative positions count from the
    v_cache[b, h, cache_position[s]] = v[b, h, s]          # end; outside [-L, L): device assert

with Hugging Face's rounding (``qk_norm_rope_cache_reference.py``): statistics in fp32, the
normalized row rounded to the model dtype, the weight product rounded, each RoPE product rounded
and their sum rounded. All math is fp32; every intermediate rounding is an explicit round to the
model dtype and back (``rounding.round_to``), and the sum of two rounded products goes through
``rounding.round_sum``, which FMA contraction (on, as Inductor compiles user kernels) cannot fuse.
So the outputs equal eager's bit for bit but where the fp32 statistic, summed in another order
than torch's ``mean``, flips a rounding near a tie (measured: 2.8e-6 of the normalized values).

Variants, each a constexpr (its own specialization, no runtime branch; the default build is
unchanged by the others):

* ``NORM_STYLE`` (``NORM_STYLES``): 0 Qwen3's ``weight * n.to(dtype)``; 1 ``torch.nn.RMSNorm``'s
  ``(n * weight).to(dtype)``; 2 Gemma3's ``(n * (1 + weight)).to(dtype)``; 3 weight-free.
* ``ROPE_FIRST``: RoPE, then the norm of the rotated rows (HunYuan's order).
* ``ROTARY_DIM`` R < D: the first R features rotated in pairs ``(d, d + R/2)``, the rest passed
  through (``_feature_offsets``, ``_partial_rope``); R and D multiples of 16.
* ``INTERLEAVED``: GPT-J's pairs ``(x[2i], x[2i+1])``, rotated by tables with one entry per
  feature (``x * cos + rotate_half_interleaved(x) * sin``; with ``ROTARY_DIM`` < D the first R
  features); whole rows, each pair's partner swapped in registers
  (``_norm_rope_interleaved_blocks``).
* ``ROPE_FROM_POSITIONS``: cos/sin computed from ``position_ids`` [B, S] and ``inv_freq`` [D/2]
  (Hugging Face's ``cos = (cat(freqs, freqs).cos() * scaling).to(dtype)``) by ``sin_cos``, within
  2 fp32 ulps, instead of read from tables.
* ``INTERPRETED``: under ``TRITON_INTERPRET=1`` (CPU tests), where an fp32 -> bf16 cast truncates,
  ``round_to`` emulates round-to-nearest-even with integer bit arithmetic.

Layout of the work (``launch_config``): one grid covers q, k and v programs (q: norm + RoPE;
k: also the cache rows; v: the cache copy), each holding ``[heads, tokens, D/2]`` fp32 half tiles
(``rotate_half`` is then free); from 256 tokens a streaming tile (one head x 16 tokens per block,
4 blocks per program sharing cos/sin), below it a small tile (up to 8 heads x a few tokens).
Indices are widened to int64 before they meet a stride; head, token and feature tails are
masked; a position outside the cache is never written. head_dim: any even D (the op serves powers
of two in [16, 512]). The design, the tile sweeps and every version's time:
``benchmarks/NOTES-forward.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from triton.language.extra import libdevice

from .qk_norm_rope_cache_reference import NORM_STYLES
from .rounding import round_sum
from .rounding import round_to
from .rounding import select_rounded
from .sin_cos import sin_cos
from .triton_device import interpreting
from .triton_call import TritonCall, named_args

#: Small launches: elements (one tensor, both halves) per program, one head block per program.
#: 4096 with 4 warps = 32 elements per thread.
TILE_ELEMENTS = 4096
#: Warps per program.
NUM_WARPS = 4
#: Launches of at least this many tokens (B x S, concrete, rows of at least the tile's tokens) take
#: the streaming tile: one head per block, each of ``NUM_WARPS`` warps' lanes one 16-byte vector per
#: half row (16 tokens for D = 128 bf16), ``STREAM_BLOCKS`` blocks of one tensor per program sharing
#: their cos/sin, a token block's programs consecutive. From 256 tokens on it beats the 8 heads x 4
#: tokens tile on every case swept on the H200 (S293: 5.1 vs 6.2 us with cos/sin computed, S128 B2:
#: 4.9 vs 5.7; ``benchmarks/NOTES-forward.md``).
STREAM_FROM_TOKENS = 256
STREAM_BLOCKS = 4


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_pointers(view, batch, heads, rows, offs_d):
    """Pointers ``[heads, rows, D/2]`` to the first halves of the given rows of ``view``, a strided
    ``[B, H, rows, D]`` tensor given as ``(ptr, stride_b, stride_h, stride_row)`` (int64 offsets)."""
    ptr, stride_b, stride_h, stride_row = view
    row = batch * stride_b + heads[:, None] * stride_h + rows[None, :] * stride_row
    return ptr + (row[:, :, None] + offs_d[None, None, :])


@triton.jit
def _pair_pointers(view, batch, heads, rows, offs_1, offs_2, HALF: tl.constexpr, PARTIAL: tl.constexpr):
    """Pointers ``[heads, rows, D/2]`` to the features of the two half tiles: ``offs_1`` and
    ``offs_1 + HALF`` (the RoPE halves), or (``PARTIAL``: partial rotary, ``_feature_offsets``)
    ``offs_1`` and ``offs_2``."""
    first = _tile_pointers(view, batch, heads, rows, offs_1)
    if PARTIAL:
        second = _tile_pointers(view, batch, heads, rows, offs_2)
    else:
        second = first + HALF
    return first, second


@triton.jit
def _load_pair_tiles(view, batch, heads, rows, offs_1, offs_2, ht_mask, d_mask3, HALF: tl.constexpr,
                     PARTIAL: tl.constexpr):
    """The two ``[heads, rows, D/2]`` tiles of the RoPE pairs, in fp32 (``ht_mask`` [heads, rows])."""
    mask = ht_mask[:, :, None] & d_mask3
    src, src2 = _pair_pointers(view, batch, heads, rows, offs_1, offs_2, HALF, PARTIAL)
    x1 = tl.load(src, mask=mask, other=0.0, eviction_policy="evict_first")
    x2 = tl.load(src2, mask=mask, other=0.0, eviction_policy="evict_first")
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _store_pair_tiles(view, batch, heads, rows, offs_1, offs_2, ht_mask, d_mask3, out1, out2, HALF: tl.constexpr,
                      PARTIAL: tl.constexpr):
    """Store the two tiles where ``_load_pair_tiles`` loads them from."""
    mask = ht_mask[:, :, None] & d_mask3
    dst, dst2 = _pair_pointers(view, batch, heads, rows, offs_1, offs_2, HALF, PARTIAL)
    tl.store(dst, out1, mask=mask)
    tl.store(dst2, out2, mask=mask)


@triton.jit
def _rotate_pairs(x, HEADS: tl.constexpr, TOKENS: tl.constexpr, HALF_BLOCK: tl.constexpr):
    """``rotate_half_interleaved`` of a ``[heads, tokens, D]`` row tile: each interleaved pair
    ``(x[2i], x[2i+1])`` becomes ``(-x[2i+1], x[2i])``. A lane holds whole 16-byte runs of a row,
    so the split and join stay in its registers (no shared memory); exact."""
    even, odd = tl.split(tl.reshape(x, [HEADS, TOKENS, HALF_BLOCK, 2]))
    return tl.reshape(tl.join(-odd, even), [HEADS, TOKENS, 2 * HALF_BLOCK])


@triton.jit
def _weight_rows(weight_ptr, feats, f_mask, HEADS: tl.constexpr, TOKENS: tl.constexpr):
    """The norm's weight ``[D]`` as fp32 ``[heads, tokens, D]`` rows. Addressed per row (L1 hits), so
    the load takes the rows' layout: a ``[D]`` load would be converted into it through shared memory."""
    per_row = tl.zeros([HEADS, TOKENS, 1], tl.int32)
    return tl.load(weight_ptr + (per_row + feats[None, None, :]), mask=(per_row == 0) & f_mask[None, None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _norm_rope_interleaved(
    x, w, weight_ptr, feats, f_mask, eps, cos, sin,
    in_dtype: tl.constexpr, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr,
    TOKENS: tl.constexpr, HALF_BLOCK: tl.constexpr, INTERPRETED: tl.constexpr, NORM_STYLE: tl.constexpr,
    ROPE_FIRST: tl.constexpr, ROTARY_DIM: tl.constexpr, WEIGHT_HOISTED: tl.constexpr,
):
    """``_norm_rope`` of interleaved (GPT-J) pairs on whole ``[heads, tokens, D]`` rows (fp32,
    values of the model dtype): ``cos[..., d]``/``sin[..., d]`` are feature d's table entries (the
    tables' dtype), ``rope(y) = y * cos + rotate_half_interleaved(y) * sin``, each product
    rounded, then the sum; with ``ROTARY_DIM < HEAD_DIM`` only the first ``ROTARY_DIM`` features
    (whole pairs), the others passed through. ``WEIGHT_HOISTED`` (norm first, full rotary): ``w`` is
    the weight's rows, loaded once per program; otherwise they are loaded here, per block:
    RoPE first after the RoPE, partial rotary before the norm. Held through the blocks they cost
    resident programs: RoPE first 108-115 registers instead of 90, partial rotary (beside its
    select mask) 89 instead of 80 on sm_90 (``benchmarks/NOTES-forward.md``).
    Returns the rows rounded to ``dtype`` (held in fp32)."""
    if ROPE_FIRST:
        y = x
    else:
        if NORM_STYLE != 3 and not WEIGHT_HOISTED:
            w = _weight_rows(weight_ptr, feats, f_mask, HEADS, TOKENS)
        y = _weighted(x * _rstd(x, eps, HEAD_DIM, INTERPRETED)[:, :, None], w, in_dtype, dtype, NORM_STYLE,
                      INTERPRETED)
    # The tables stay in their dtype until here: half the registers.
    r = round_sum(round_to(y * cos.to(tl.float32), dtype, INTERPRETED),
                  round_to(_rotate_pairs(y, HEADS, TOKENS, HALF_BLOCK) * sin.to(tl.float32), dtype, INTERPRETED),
                  dtype, INTERPRETED)
    if ROTARY_DIM != HEAD_DIM:
        r = select_rounded((feats < ROTARY_DIM)[None, None, :], r, y, dtype, INTERPRETED)
    if ROPE_FIRST:
        if NORM_STYLE != 3:  # never hoisted in this order
            w = _weight_rows(weight_ptr, feats, f_mask, HEADS, TOKENS)
        r = _weighted(r * _rstd(r, eps, HEAD_DIM, INTERPRETED)[:, :, None], w, dtype, dtype, NORM_STYLE, INTERPRETED)
    return r


@triton.jit
def _load_cos_sin(rotary, batch, offs_h, offs_s64, token_mask, offs_d, d_mask, dtype: tl.constexpr,
                  HALF: tl.constexpr, ROPE_FROM_POSITIONS: tl.constexpr, INTERPRETED: tl.constexpr):
    """cos/sin of this program's tokens as four fp32 tiles (first/second half), broadcast over heads.

    Tensor cos/sin are loaded straight into the ``[heads, tokens, D/2]`` layout of the head tiles,
    each head re-reading its token's row (L1 hits): a ``[tokens, D/2]`` load would need one
    shared-memory layout conversion per table, and the compiler serialized those (load, barrier,
    convert, next load: four L2 round trips per program before any math). Computed cos/sin
    stay ``[tokens, D/2]`` (computing them per head would repeat the transcendentals).
    ``rotary``: the kernel's record of that name (pointers and strides of cos/sin or of position_ids and
    inv_freq, and attention_scaling).
    """
    (cos_ptr, sin_ptr, position_ids_ptr, inv_freq_ptr, stride_cos_b, stride_cos_s, stride_sin_b, stride_sin_s,
     stride_pos_b, stride_pos_s, attention_scaling) = rotary
    if ROPE_FROM_POSITIONS:
        positions = tl.load(position_ids_ptr + batch * stride_pos_b + offs_s64 * stride_pos_s, mask=token_mask, other=0)
        inv_freq = tl.load(inv_freq_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        # int32 first: positions are far below 2**31, and int64 -> fp32 compiles through fp64.
        freqs = positions.to(tl.int32).to(tl.float32)[:, None] * inv_freq[None, :]
        sin, cos = sin_cos(freqs)
        cos = round_to(cos * attention_scaling, dtype, INTERPRETED)[None, :, :]
        sin = round_to(sin * attention_scaling, dtype, INTERPRETED)[None, :, :]
        # emb = cat(freqs, freqs): both halves share one table.
        return cos, cos, sin, sin
    else:
        mask = ((offs_h >= 0)[:, None] & token_mask[None, :])[:, :, None] & d_mask[None, None, :]
        row = (offs_h * 0)[:, None, None] + offs_s64[None, :, None]  # same row for every head
        cos_row = cos_ptr + batch * stride_cos_b + row * stride_cos_s + offs_d[None, None, :]
        sin_row = sin_ptr + batch * stride_sin_b + row * stride_sin_s + offs_d[None, None, :]
        cos1 = tl.load(cos_row, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_row + HALF, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_row, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_row + HALF, mask=mask, other=0.0).to(tl.float32)
        return cos1, cos2, sin1, sin2


@triton.jit
def _weighted(normed, w, in_dtype: tl.constexpr, dtype: tl.constexpr, NORM_STYLE: tl.constexpr,
              INTERPRETED: tl.constexpr):
    """The fp32 normalized half tile times its weight half, rounded where the model rounds
    (``NORM_STYLES[NORM_STYLE]``, see ``qk_norm_rope_cache_reference``); ``in_dtype``: the input's,
    ``dtype``: the output's (they differ under autocast over an fp32 model: ``output_dtype``).
    Style 0's product promotes to the weight's dtype; the other forms end in the input's."""
    if NORM_STYLE == 0:
        # "weight" (Qwen3RMSNorm): ``weight * n.to(input dtype)``: the row rounded, then the product.
        return round_to(w * round_to(normed, in_dtype, INTERPRETED), dtype, INTERPRETED)
    elif NORM_STYLE == 1:
        # "fp32_weight" (torch.nn.RMSNorm): ``(n * weight).to(dtype)``: fp32 product, one rounding.
        return round_to(normed * w, in_dtype, INTERPRETED)
    elif NORM_STYLE == 2:
        # "fp32_one_plus_weight" (Gemma3RMSNorm): ``(n * (1.0 + weight.float())).type_as(x)``.
        return round_to(normed * (1.0 + w), in_dtype, INTERPRETED)
    else:
        # "no_weight": ``n.to(dtype)``.
        return round_to(normed, in_dtype, INTERPRETED)


@triton.jit
def _rsqrt(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return tl.rsqrt(x)
    else:
        return libdevice.rsqrt(x)


@triton.jit
def _rstd(x, eps, HEAD_DIM: tl.constexpr, INTERPRETED: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` over the rows of a ``[heads, tokens, D]`` fp32 tile."""
    return _rsqrt(tl.sum(x * x, axis=2) * (1.0 / HEAD_DIM) + eps, INTERPRETED)


@triton.jit
def _rms_norm(
    x1, x2, weight_ptr, offs_d, offs_2, d_mask, eps,
    in_dtype: tl.constexpr, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, INTERPRETED: tl.constexpr,
    NORM_STYLE: tl.constexpr, PARTIAL: tl.constexpr,
):
    """RMSNorm of a ``[heads, tokens, D/2]`` pair of fp32 half tiles (values of the model dtype).

    ``NORM_STYLE`` is the index of the norm's form in ``NORM_STYLES`` (0: Qwen3's); the
    weight-free style (3) never reads ``weight_ptr``. The tiles hold features ``offs_d`` and
    ``offs_d + HALF``, or (``PARTIAL``) ``offs_d`` and ``offs_2`` (``_feature_offsets``): the
    weights are read at the same features. Returns the two halves rounded to ``dtype`` (held
    in fp32).
    """
    if NORM_STYLE != 3:
        # Weights first: their load then overlaps the statistic's reduction.
        w1 = tl.load(weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, None, :]
        if PARTIAL:
            w2 = tl.load(weight_ptr + offs_2, mask=d_mask, other=0.0).to(tl.float32)[None, None, :]
        else:
            w2 = tl.load(weight_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, None, :]
    else:
        w1 = 1.0  # unused by the weight-free form; defined so both branches bind the names
        w2 = 1.0
    # Every style: fp32 statistics, ``n = x * rsqrt(mean(x^2) + eps)`` in fp32.
    mean_square = (tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) * (1.0 / HEAD_DIM)
    rstd = _rsqrt(mean_square + eps, INTERPRETED)
    y1 = _weighted(x1 * rstd[:, :, None], w1, in_dtype, dtype, NORM_STYLE, INTERPRETED)
    y2 = _weighted(x2 * rstd[:, :, None], w2, in_dtype, dtype, NORM_STYLE, INTERPRETED)
    return y1, y2


@triton.jit
def _rope(y1, y2, cos1, cos2, sin1, sin2, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """rotate_half RoPE of a ``[heads, tokens, D/2]`` pair of fp32 half tiles (values of the
    model dtype); returns the two halves rounded to ``dtype`` (held in fp32)."""
    # apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1];
    # each product is rounded, then the sum. round(-a) == -round(a) under nearest-even.
    c1 = cos1
    c2 = cos2
    s1 = sin1
    s2 = sin2
    # round_sum: contracted with a product into an FMA, the add would round once.
    out1 = round_sum(round_to(y1 * c1, dtype, INTERPRETED), -round_to(y2 * s1, dtype, INTERPRETED), dtype, INTERPRETED)
    out2 = round_sum(round_to(y2 * c2, dtype, INTERPRETED), round_to(y1 * s2, dtype, INTERPRETED), dtype, INTERPRETED)
    return out1, out2


@triton.jit
def _partial_rope(y1, y2, cos1, cos2, sin1, sin2, rotated, dtype: tl.constexpr, INTERPRETED: tl.constexpr,
                  PARTIAL: tl.constexpr):
    """``_rope``, or (``PARTIAL``) ``_rope`` on the lanes that hold a rotated pair and the values
    unchanged on the pass-through lanes (``rotated`` [D/2] is False there)."""
    r1, r2 = _rope(y1, y2, cos1, cos2, sin1, sin2, dtype, INTERPRETED)
    if PARTIAL:
        # cat([rope(x[..., :rotary_dim]), x[..., rotary_dim:]]): the pass-through features are
        # the input's values, no rounding added.
        r1 = select_rounded(rotated[None, None, :], r1, y1, dtype, INTERPRETED)
        r2 = select_rounded(rotated[None, None, :], r2, y2, dtype, INTERPRETED)
    return r1, r2


@triton.jit
def _norm_rope(
    x1, x2, weight_ptr, offs_d, offs_2, d_mask, rotated, eps, cos1, cos2, sin1, sin2,
    in_dtype: tl.constexpr, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, INTERPRETED: tl.constexpr,
    NORM_STYLE: tl.constexpr, ROPE_FIRST: tl.constexpr, PARTIAL: tl.constexpr,
):
    """RMSNorm then rotate_half RoPE (``ROPE_FIRST``: RoPE, then the norm of the rotated rows,
    HunYuan's order) of a ``[heads, tokens, D/2]`` pair of fp32 half tiles (the tiles hold the
    features ``offs_d``/``offs_d + HALF``, or (``PARTIAL``) ``offs_d``/``offs_2``, of which only
    the lanes where ``rotated`` holds are rotated (``_feature_offsets``).

    Returns the two halves of the result, rounded to ``dtype`` (held in fp32).
    """
    if ROPE_FIRST:
        r1, r2 = _partial_rope(x1, x2, cos1, cos2, sin1, sin2, rotated, dtype, INTERPRETED, PARTIAL)
        out1, out2 = _rms_norm(r1, r2, weight_ptr, offs_d, offs_2, d_mask, eps, dtype, dtype, HEAD_DIM, HALF,
                               INTERPRETED, NORM_STYLE, PARTIAL)
    else:
        y1, y2 = _rms_norm(x1, x2, weight_ptr, offs_d, offs_2, d_mask, eps, in_dtype, dtype, HEAD_DIM, HALF,
                           INTERPRETED, NORM_STYLE, PARTIAL)
        out1, out2 = _partial_rope(y1, y2, cos1, cos2, sin1, sin2, rotated, dtype, INTERPRETED, PARTIAL)
    return out1, out2


@triton.jit
def _feature_offsets(offs_d, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr):
    """Partial rotary: the features held by lane ``d`` of the two half tiles, and whether the
    lane holds a rotated pair.

    ``apply_rotary_pos_emb`` with ``rotary_dim = R < D`` rotates the pairs ``(x[i], x[i + R/2])``,
    ``i < R/2``, and passes ``x[R:]`` through. Lanes ``d < R/2`` hold such a pair (features
    ``d`` and ``d + R/2``); the other lanes hold the pass-through features, split in two runs
    (``d + R/2`` and ``d + D/2``), so the norm's statistic still sees every feature once and
    the RoPE math stays lane-wise. Each run is contiguous and starts at a multiple of 8
    (``R`` and ``D`` multiples of 16, checked by the op): the hints keep 16-byte accesses.
    """
    ROT_HALF: tl.constexpr = ROTARY_DIM // 2
    rotated = offs_d < ROT_HALF
    offs_1 = tl.where(rotated, offs_d, offs_d + ROT_HALF)
    offs_2 = tl.where(rotated, offs_d + ROT_HALF, offs_d + HEAD_DIM // 2)
    offs_1 = tl.max_contiguous(tl.multiple_of(offs_1, 8), 8)
    offs_2 = tl.max_contiguous(tl.multiple_of(offs_2, 8), 8)
    return offs_1, offs_2, rotated


@triton.jit
def _cache_rows(cache_position_ptr, offs_s64, token_mask, stride_cache_position, cache_len):
    """(cache row of each token, whether it is written). Python indexing, as ``cache[:, :, pos] = k``
    does: a negative position counts from the end. ``index_copy_`` raises on a position outside
    [-L, L), and Inductor asserts its own indirect indexing: a device assert, compiled in when the
    launch asks for asserts (Inductor's ``assert_indirect_indexing``, on by default; the eager op).
    Without them the row is skipped, never written out of bounds (its row is clamped to 0)."""
    positions = tl.load(cache_position_ptr + offs_s64 * stride_cache_position, mask=token_mask, other=0)
    positions = positions.to(tl.int64)
    positions = tl.where(positions < 0, positions + cache_len, positions)
    in_range = (positions >= 0) & (positions < cache_len)
    tl.device_assert(in_range | ~token_mask, "cache_position out of range [-L, L)")
    position_ok = token_mask & in_range
    return tl.where(position_ok, positions, 0), position_ok


@triton.jit
def _norm_rope_blocks(first_block, x, weight_ptr, out, cache, heads_total, batch, tokens, slots, rotary, features, eps,
                      dtype: tl.constexpr, TILE, FORM, WRITE_CACHE: tl.constexpr):
    """Norm + RoPE of ``BLOCKS_PER_PROGRAM`` head blocks of q (or k: ``WRITE_CACHE``, which also
    writes the cache rows), from head block ``first_block`` on, of this program's tokens. Every
    block's loads are issued before the first store: no load can be moved above a store (the
    pointers may alias), so loading, computing and storing each block in turn keeps one block per
    program in flight. cos/sin are read or computed once, after those loads (their latency, or the
    angles' arithmetic, overlaps them), and serve every block (the same tokens).

    ``x``, ``out``, ``cache``: views ``(ptr, stride_b, stride_h, stride_row)``; ``tokens``, ``slots``,
    ``rotary``, ``features``, ``TILE``, ``FORM``: the kernel's records of those names."""
    HEAD_DIM: tl.constexpr = TILE[0]
    HALF: tl.constexpr = TILE[1]
    HALF_BLOCK: tl.constexpr = TILE[2]
    HEADS_PER_PROGRAM: tl.constexpr = TILE[3]
    TOKENS_PER_PROGRAM: tl.constexpr = TILE[4]
    BLOCKS_PER_PROGRAM: tl.constexpr = TILE[5]
    ROPE_FROM_POSITIONS: tl.constexpr = FORM[0]
    INTERPRETED: tl.constexpr = FORM[1]
    NORM_STYLE: tl.constexpr = FORM[2]
    ROPE_FIRST: tl.constexpr = FORM[3]
    PARTIAL: tl.constexpr = FORM[4]
    INTERLEAVED: tl.constexpr = FORM[5]
    ROT_HALF: tl.constexpr = FORM[6]
    offs_s64, token_mask = tokens
    positions, position_ok = slots
    offs_d, d_mask, d_mask3, offs_1, offs_2, rotated, rot_mask = features
    heads = tl.arange(0, HEADS_PER_PROGRAM)
    if INTERLEAVED:
        # No launcher computes interleaved cos/sin from positions (the pass reads the model's tables).
        tl.static_assert(not ROPE_FROM_POSITIONS)
        _norm_rope_interleaved_blocks(first_block, x, weight_ptr, out, cache, heads_total, batch, tokens, slots, rotary,
                                      eps, dtype, TILE, FORM, WRITE_CACHE)
    else:
        tiles = ()
        for i in tl.static_range(BLOCKS_PER_PROGRAM):
            offs_h = ((first_block + i) * HEADS_PER_PROGRAM + heads).to(tl.int64)
            ht_mask = (offs_h < heads_total)[:, None] & token_mask[None, :]
            tiles = tiles + _load_pair_tiles(x, batch, offs_h, offs_s64, offs_1, offs_2, ht_mask, d_mask3, HALF,
                                             PARTIAL)
        cos1, cos2, sin1, sin2 = _load_cos_sin(
            rotary, batch, (first_block * HEADS_PER_PROGRAM + heads).to(tl.int64), offs_s64, token_mask, offs_d,
            rot_mask, dtype, ROT_HALF, ROPE_FROM_POSITIONS, INTERPRETED,
        )
        for i in tl.static_range(BLOCKS_PER_PROGRAM):
            offs_h = ((first_block + i) * HEADS_PER_PROGRAM + heads).to(tl.int64)
            head_ok = offs_h < heads_total
            ht_mask = head_ok[:, None] & token_mask[None, :]
            out1, out2 = _norm_rope(
                tiles[2 * i], tiles[2 * i + 1], weight_ptr, offs_1, offs_2, d_mask, rotated, eps, cos1, cos2, sin1,
                sin2, x[0].dtype.element_ty, dtype, HEAD_DIM, HALF, INTERPRETED, NORM_STYLE, ROPE_FIRST, PARTIAL,
            )
            out1 = out1.to(dtype)
            out2 = out2.to(dtype)
            _store_pair_tiles(out, batch, offs_h, offs_s64, offs_1, offs_2, ht_mask, d_mask3, out1, out2, HALF, PARTIAL)
            if WRITE_CACHE:
                _store_pair_tiles(cache, batch, offs_h, positions, offs_1, offs_2,
                                  head_ok[:, None] & position_ok[None, :], d_mask3, out1, out2, HALF, PARTIAL)


@triton.jit
def _norm_rope_interleaved_blocks(first_block, x, weight_ptr, out, cache, heads_total, batch, tokens, slots, rotary,
                                  eps, dtype: tl.constexpr, TILE, FORM, WRITE_CACHE: tl.constexpr):
    """``_norm_rope_blocks`` for interleaved (GPT-J) pairs ``(x[2i], x[2i+1])``: whole
    ``[heads, tokens, D]`` rows, loaded and stored as contiguous 16-byte runs, each pair's partner
    taken in registers (``_rotate_pairs``); cos/sin ``[B or 1, S, ROTARY_DIM]`` hold one entry per
    rotated feature, loaded in the rows' layout."""
    HEAD_DIM: tl.constexpr = TILE[0]
    HALF_BLOCK: tl.constexpr = TILE[2]
    HEADS_PER_PROGRAM: tl.constexpr = TILE[3]
    TOKENS_PER_PROGRAM: tl.constexpr = TILE[4]
    BLOCKS_PER_PROGRAM: tl.constexpr = TILE[5]
    INTERPRETED: tl.constexpr = FORM[1]
    NORM_STYLE: tl.constexpr = FORM[2]
    ROPE_FIRST: tl.constexpr = FORM[3]
    ROTARY_DIM: tl.constexpr = 2 * FORM[6]
    offs_s64, token_mask = tokens
    positions, position_ok = slots
    cos_ptr, sin_ptr, _, _, stride_cos_b, stride_cos_s, stride_sin_b, stride_sin_s, _, _, _ = rotary
    heads = tl.arange(0, HEADS_PER_PROGRAM)
    feats = tl.arange(0, 2 * HALF_BLOCK)
    f_mask = feats < HEAD_DIM
    rows = ()
    for i in tl.static_range(BLOCKS_PER_PROGRAM):
        offs_h = ((first_block + i) * HEADS_PER_PROGRAM + heads).to(tl.int64)
        ht_mask = (offs_h < heads_total)[:, None] & token_mask[None, :]
        src = _tile_pointers(x, batch, offs_h, offs_s64, feats)
        rows = rows + (tl.load(src, mask=ht_mask[:, :, None] & f_mask[None, None, :], other=0.0,
                               eviction_policy="evict_first").to(tl.float32),)
    # The tables hold one entry per feature (the model's, already repeated per pair), so they load
    # per row in the rows' own layout: each head re-reads its token's row (L1 hits), and nothing
    # is converted through shared memory.
    table_row = (heads * 0)[:, None, None] + offs_s64[None, :, None]
    t_mask = (((heads >= 0)[:, None] & token_mask[None, :])[:, :, None]) & (feats < ROTARY_DIM)[None, None, :]
    cos = tl.load(cos_ptr + batch * stride_cos_b + table_row * stride_cos_s + feats[None, None, :], mask=t_mask,
                  other=0.0)
    sin = tl.load(sin_ptr + batch * stride_sin_b + table_row * stride_sin_s + feats[None, None, :], mask=t_mask,
                  other=0.0)
    WEIGHT_HOISTED: tl.constexpr = NORM_STYLE != 3 and not ROPE_FIRST and ROTARY_DIM == HEAD_DIM
    if WEIGHT_HOISTED:
        w = _weight_rows(weight_ptr, feats, f_mask, HEADS_PER_PROGRAM, TOKENS_PER_PROGRAM)  # every block's first use
    else:
        w = 1.0  # loaded per block (RoPE first, partial rotary), or unused (the weight-free form)
    for i in tl.static_range(BLOCKS_PER_PROGRAM):
        offs_h = ((first_block + i) * HEADS_PER_PROGRAM + heads).to(tl.int64)
        head_ok = offs_h < heads_total
        result = _norm_rope_interleaved(
            rows[i], w, weight_ptr, feats, f_mask, eps, cos, sin, x[0].dtype.element_ty, dtype, HEAD_DIM,
            HEADS_PER_PROGRAM, TOKENS_PER_PROGRAM, HALF_BLOCK, INTERPRETED, NORM_STYLE, ROPE_FIRST, ROTARY_DIM,
            WEIGHT_HOISTED,
        ).to(dtype)
        dst = _tile_pointers(out, batch, offs_h, offs_s64, feats)
        tl.store(dst, result, mask=(head_ok[:, None] & token_mask[None, :])[:, :, None] & f_mask[None, None, :])
        if WRITE_CACHE:
            dst = _tile_pointers(cache, batch, offs_h, positions, feats)
            tl.store(dst, result, mask=(head_ok[:, None] & position_ok[None, :])[:, :, None] & f_mask[None, None, :])


@triton.jit
def _copy_blocks(first_block, v, v_cache, kv_heads, batch, offs_s64, slots, offs_d, d_mask3, HALF: tl.constexpr,
                 HEADS_PER_PROGRAM: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
    """v rows of ``BLOCKS_PER_PROGRAM`` head blocks from ``first_block`` on, copied into the v cache
    (raw values, no math); rows of skipped positions are not read. Every block is loaded before
    the first store (see ``_norm_rope_blocks``)."""
    positions, position_ok = slots
    heads = tl.arange(0, HEADS_PER_PROGRAM)
    tiles = ()
    for i in tl.static_range(BLOCKS_PER_PROGRAM):
        offs_h = ((first_block + i) * HEADS_PER_PROGRAM + heads).to(tl.int64)
        cache_mask = ((offs_h < kv_heads)[:, None] & position_ok[None, :])[:, :, None] & d_mask3
        src = _tile_pointers(v, batch, offs_h, offs_s64, offs_d)
        tiles = tiles + (tl.load(src, mask=cache_mask, other=0.0, eviction_policy="evict_first"),
                         tl.load(src + HALF, mask=cache_mask, other=0.0, eviction_policy="evict_first"))
    for i in tl.static_range(BLOCKS_PER_PROGRAM):
        offs_h = ((first_block + i) * HEADS_PER_PROGRAM + heads).to(tl.int64)
        cache_mask = ((offs_h < kv_heads)[:, None] & position_ok[None, :])[:, :, None] & d_mask3
        v1 = tiles[2 * i]
        v2 = tiles[2 * i + 1]
        dst = _tile_pointers(v_cache, batch, offs_h, positions, offs_d)
        tl.store(dst, v1, mask=cache_mask)
        tl.store(dst + HALF, v2, mask=cache_mask)


@triton.jit(do_not_specialize=["seq_len"])
def _qk_norm_rope_cache_kernel(
    # tensors
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr,
    cos_ptr, sin_ptr, position_ids_ptr, inv_freq_ptr,
    k_cache_ptr, v_cache_ptr, cache_position_ptr, q_out_ptr, k_out_ptr,
    # sizes
    seq_len, q_heads, kv_heads, cache_len,
    # strides (batch, head, token) of the [B, H, S, D] tensors and (batch, head, row) of the caches
    stride_q_b, stride_q_h, stride_q_s,
    stride_k_b, stride_k_h, stride_k_s,
    stride_v_b, stride_v_h, stride_v_s,
    stride_qo_b, stride_qo_h, stride_qo_s,
    stride_ko_b, stride_ko_h, stride_ko_s,
    stride_kc_b, stride_kc_h, stride_kc_l,
    stride_vc_b, stride_vc_h, stride_vc_l,
    stride_cos_b, stride_cos_s, stride_sin_b, stride_sin_s,
    stride_pos_b, stride_pos_s, stride_cache_position,
    # scalars
    q_eps, k_eps, attention_scaling,
    # compile-time configuration
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    GROUP_MAJOR: tl.constexpr,
    ROPE_FROM_POSITIONS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    NORM_STYLE: tl.constexpr,
    ROPE_FIRST: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    # Partial rotary (``rotary_dim < head_dim``): cos/sin rows hold ROTARY_DIM values.
    PARTIAL: tl.constexpr = ROTARY_DIM != HEAD_DIM
    ROT_HALF: tl.constexpr = ROTARY_DIM // 2
    dtype: tl.constexpr = q_out_ptr.dtype.element_ty
    if not INTERPRETED:
        # Inductor passes Python floats as fp64 scalars; eager adds eps to the fp32 statistic.
        q_eps = tl.cast(q_eps, tl.float32)
        k_eps = tl.cast(k_eps, tl.float32)
        attention_scaling = tl.cast(attention_scaling, tl.float32)

    # Programs do one kind of work each: q groups, then k groups, then v groups, each group
    # BLOCKS_PER_PROGRAM head blocks of HEADS_PER_PROGRAM heads (tails masked).
    q_groups = (q_heads + HEADS_PER_PROGRAM * BLOCKS_PER_PROGRAM - 1) // (HEADS_PER_PROGRAM * BLOCKS_PER_PROGRAM)
    kv_groups = (kv_heads + HEADS_PER_PROGRAM * BLOCKS_PER_PROGRAM - 1) // (HEADS_PER_PROGRAM * BLOCKS_PER_PROGRAM)
    if GROUP_MAJOR:
        # One grid axis, the groups of a token block consecutive: programs running at the same
        # time cover whole token rows.
        groups = q_groups + 2 * kv_groups
        token_block = tl.program_id(0) // groups
        group = tl.program_id(0) % groups
    else:
        token_block = tl.program_id(0)
        group = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)

    offs_s = token_block * TOKENS_PER_PROGRAM + tl.arange(0, TOKENS_PER_PROGRAM)
    token_mask = offs_s < seq_len
    offs_s64 = offs_s.to(tl.int64)
    offs_d = tl.arange(0, HALF_BLOCK)
    if HALF_BLOCK == HALF:
        d_mask = offs_d < HALF_BLOCK  # all true; folded by the compiler
    else:
        d_mask = offs_d < HALF
    d_mask3 = d_mask[None, None, :]
    if PARTIAL:
        offs_1, offs_2, rotated = _feature_offsets(offs_d, HEAD_DIM, ROTARY_DIM)
        rot_mask = d_mask & rotated  # the lanes whose cos/sin exist
    else:
        offs_1 = offs_d
        offs_2 = offs_d  # unused (the second half is offs_1 + HALF)
        rotated = d_mask  # unused
        rot_mask = d_mask

    # The records the helpers take (Triton tuples; the entry points themselves stay flat: the
    # functional Triton HOP names every argument, and torch.compile passes no tuple to a kernel).
    # A tensor is a view (ptr, stride_b, stride_h, stride_row); the others:
    tokens = (offs_s64, token_mask)  # this program's tokens (int64), in range
    # the lanes of a half row (_feature_offsets)
    features = (offs_d, d_mask, d_mask3, offs_1, offs_2, rotated, rot_mask)
    rotary = (cos_ptr, sin_ptr, position_ids_ptr, inv_freq_ptr, stride_cos_b, stride_cos_s, stride_sin_b, stride_sin_s,
              stride_pos_b, stride_pos_s, attention_scaling)  # where cos/sin come from (_load_cos_sin)
    TILE: tl.constexpr = (HEAD_DIM, HALF, HALF_BLOCK, HEADS_PER_PROGRAM, TOKENS_PER_PROGRAM, BLOCKS_PER_PROGRAM)
    FORM: tl.constexpr = (ROPE_FROM_POSITIONS, INTERPRETED, NORM_STYLE, ROPE_FIRST, PARTIAL, INTERLEAVED, ROT_HALF)
    k_cache = (k_cache_ptr, stride_kc_b, stride_kc_h, stride_kc_l)
    if group < q_groups:
        # ---- q: norm + rope -> q_out (no cache row: ``slots`` is unused, the tokens stand in)
        _norm_rope_blocks(group * BLOCKS_PER_PROGRAM, (q_ptr, stride_q_b, stride_q_h, stride_q_s), q_weight_ptr,
                          (q_out_ptr, stride_qo_b, stride_qo_h, stride_qo_s), k_cache, q_heads, batch, tokens, tokens,
                          rotary, features, q_eps, dtype, TILE, FORM, False)
    else:
        # The cache rows of this program's tokens (k and v programs write them), in one place: every
        # tl.device_assert site ends with a barrier. slots = (cache row of each token, written).
        slots = _cache_rows(cache_position_ptr, offs_s64, token_mask, stride_cache_position, cache_len)
        if group < q_groups + kv_groups:
            # ---- k: norm + rope -> k_out and the k cache rows
            _norm_rope_blocks((group - q_groups) * BLOCKS_PER_PROGRAM, (k_ptr, stride_k_b, stride_k_h, stride_k_s),
                              k_weight_ptr, (k_out_ptr, stride_ko_b, stride_ko_h, stride_ko_s), k_cache, kv_heads,
                              batch, tokens, slots, rotary, features, k_eps, dtype, TILE, FORM, True)
        else:
            # ---- v: copied into the v cache rows
            v_cache = (v_cache_ptr, stride_vc_b, stride_vc_h, stride_vc_l)
            v = (v_ptr, stride_v_b, stride_v_h, stride_v_s)
            _copy_blocks((group - q_groups - kv_groups) * BLOCKS_PER_PROGRAM, v, v_cache, kv_heads, batch, offs_s64,
                         slots, offs_d, d_mask3, HALF, HEADS_PER_PROGRAM, BLOCKS_PER_PROGRAM)


@triton.jit(do_not_specialize=["seq_len"])
def _qk_norm_rope_cache_graph_kernel(
    # tensors (None where the variant reads none: cos/sin or positions/inv_freq, weights)
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr,
    cos_ptr, sin_ptr, position_ids_ptr, inv_freq_ptr,
    k_cache_ptr, v_cache_ptr, cache_position_ptr, q_out_ptr, k_out_ptr,
    # what scales with the batch or the sequence: may be symbolic in a compiled graph
    seq_len,
    stride_q_b, stride_k_b, stride_v_b, stride_qo_b, stride_ko_b, stride_cos_b, stride_sin_b, stride_pos_b,
    # everything else is fixed by the model and its cache: compile-time constants
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, CACHE_LEN: tl.constexpr,
    STRIDE_Q_H: tl.constexpr, STRIDE_Q_S: tl.constexpr,
    STRIDE_K_H: tl.constexpr, STRIDE_K_S: tl.constexpr,
    STRIDE_V_H: tl.constexpr, STRIDE_V_S: tl.constexpr,
    STRIDE_QO_H: tl.constexpr, STRIDE_QO_S: tl.constexpr,
    STRIDE_KO_H: tl.constexpr, STRIDE_KO_S: tl.constexpr,
    STRIDE_KC_B: tl.constexpr, STRIDE_KC_H: tl.constexpr, STRIDE_KC_L: tl.constexpr,
    STRIDE_VC_B: tl.constexpr, STRIDE_VC_H: tl.constexpr, STRIDE_VC_L: tl.constexpr,
    STRIDE_COS_S: tl.constexpr, STRIDE_SIN_S: tl.constexpr, STRIDE_POS_S: tl.constexpr,
    STRIDE_CACHE_POSITION: tl.constexpr,
    Q_EPS: tl.constexpr, K_EPS: tl.constexpr, ATTENTION_SCALING: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    GROUP_MAJOR: tl.constexpr,
    ROPE_FROM_POSITIONS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    NORM_STYLE: tl.constexpr,
    ROPE_FIRST: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """``_qk_norm_rope_cache_kernel`` as a node of a compiled graph: the same program, with only
    the values that scale with B or S passed at launch (9 ints, unused pointers None), because
    the host time of a launch grows with its arguments (~0.5 us per tensor, ~0.12 us per int on
    the H200's host: ``benchmarks/diagnostics/bench_launch_host.py``)."""
    _qk_norm_rope_cache_kernel(
        q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, position_ids_ptr, inv_freq_ptr,
        k_cache_ptr, v_cache_ptr, cache_position_ptr, q_out_ptr, k_out_ptr,
        seq_len, Q_HEADS, KV_HEADS, CACHE_LEN,
        stride_q_b, STRIDE_Q_H, STRIDE_Q_S, stride_k_b, STRIDE_K_H, STRIDE_K_S,
        stride_v_b, STRIDE_V_H, STRIDE_V_S, stride_qo_b, STRIDE_QO_H, STRIDE_QO_S,
        stride_ko_b, STRIDE_KO_H, STRIDE_KO_S, STRIDE_KC_B, STRIDE_KC_H, STRIDE_KC_L,
        STRIDE_VC_B, STRIDE_VC_H, STRIDE_VC_L, stride_cos_b, STRIDE_COS_S, stride_sin_b, STRIDE_SIN_S,
        stride_pos_b, STRIDE_POS_S, STRIDE_CACHE_POSITION,
        Q_EPS, K_EPS, ATTENTION_SCALING,
        HEAD_DIM, HALF_BLOCK, HEADS_PER_PROGRAM, TOKENS_PER_PROGRAM, BLOCKS_PER_PROGRAM, GROUP_MAJOR,
        ROPE_FROM_POSITIONS,
        INTERPRETED,
        NORM_STYLE, ROPE_FIRST, ROTARY_DIM, INTERLEAVED,
    )


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """Tile and grid of one launch (see the module docstring for the rule)."""

    half_block: int  # next_pow2(D / 2): the feature tile of each RoPE half
    heads_per_program: int  # heads of one block
    tokens_per_program: int
    blocks_per_program: int  # head blocks of one tensor one program does in turn, sharing its cos/sin
    group_major: bool  # one grid axis, a token block's groups consecutive (else tokens on axis 0)
    num_warps: int
    grid: tuple  # ints, or SymInts for dynamic shapes

    def constexprs(self) -> dict:
        """The kernel's tile constexprs."""
        return dict(HALF_BLOCK=self.half_block, HEADS_PER_PROGRAM=self.heads_per_program,
                    TOKENS_PER_PROGRAM=self.tokens_per_program, BLOCKS_PER_PROGRAM=self.blocks_per_program,
                    GROUP_MAJOR=self.group_major)


#: What ``launch_config`` takes as tuning overrides (tests and sweeps).
TILE_OVERRIDES = ("tokens_per_program", "heads_per_program", "num_warps", "blocks_per_program", "group_major")


def _vector_elements(element_size: int) -> int:
    """Elements in one 16-byte access: what one lane loads per half row in both tiles."""
    return max(1, 16 // element_size)


@functools.lru_cache(maxsize=4096)
def _tile(kv_heads: int, seq_len: int | None, head_dim: int, element_size: int, tokens_per_program: int | None,
          heads_per_program: int | None, num_warps: int | None) -> tuple[int, int, int, int]:
    """(half_block, heads, tokens, num_warps) of ``launch_config``; ``seq_len`` None: not known
    at trace time (a symbolic length), which takes ``rows // heads`` tokens."""
    half_block = triton.next_power_of_2(max(1, head_dim // 2))
    rows = max(1, TILE_ELEMENTS // (2 * half_block))
    heads = heads_per_program or min(triton.next_power_of_2(kv_heads), rows)
    tokens = tokens_per_program or max(1, rows // heads)
    if seq_len is not None and not tokens_per_program:
        tokens = min(tokens, triton.next_power_of_2(max(1, seq_len)))
    for name, value in (("heads_per_program", heads), ("tokens_per_program", tokens)):
        if value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if num_warps is None:
        # At most NUM_WARPS, and no more warps than give every lane one 16-byte vector per half
        # row: a decode tile of 8 heads x 1 token x 64 bf16 takes 2 warps, not 4 half-idle ones.
        num_warps = min(NUM_WARPS, triton.next_power_of_2(
            max(1, heads * tokens * half_block // (32 * _vector_elements(element_size)))))
    return half_block, heads, tokens, num_warps


def launch_config(
    batch,
    q_heads: int,
    kv_heads: int,
    seq_len,
    head_dim: int,
    element_size: int = 2,
    **overrides,
) -> LaunchConfig:
    """Pick the tile and grid for q [B, Hq, S, D] and k/v [B, Hkv, S, D] (element_size in bytes).

    Rule, with or without cos/sin computed in the kernel:

    * ``B x S >= STREAM_FROM_TOKENS`` and ``S >= tokens`` (concrete): one head per block, ``tokens =
      NUM_WARPS * 32 * (16 // element_size) // next_pow2(D / 2)`` (one 16-byte vector per lane per
      half row), ``STREAM_BLOCKS`` blocks per program, ``NUM_WARPS`` warps, group major (a batch
      of short rows, e.g. batched decode, would leave most of that tile masked);
    * otherwise ``rows = TILE_ELEMENTS // D`` rows (head x token), ``heads = min(next_pow2(Hkv), rows)``,
      ``tokens = min(rows // heads, next_pow2(S))``, one block per program,
      ``num_warps = min(NUM_WARPS, lanes needed for one 16-byte vector each per half row)``. A
      symbolic B or S takes this tile (a symbolic S with ``tokens = rows // heads``: no guard on the
      length, so no recompile per length): one kernel then serves decode steps and prefills alike, and this tile
      is within ~5 % of the streaming one on long prefills (S4096: 68.7 vs 65.3 us) where the
      streaming tile costs decode ~65 % (2.80 vs 1.69 us on the H200).

    The grid is (token blocks, q groups + 2 x k/v groups, B), or with ``group_major`` (token blocks x
    groups, 1, B), the groups of a token block consecutive; expressions of B and S when they are
    symbolic. ``overrides`` (names in ``TILE_OVERRIDES``; tile sizes powers of two) exist for
    tuning sweeps and tests.
    """
    unknown = set(overrides) - set(TILE_OVERRIDES)
    if unknown:
        raise TypeError(f"launch_config: unknown overrides {sorted(unknown)}; expected some of {TILE_OVERRIDES}")
    o = {name: overrides.get(name) for name in TILE_OVERRIDES}
    concrete = isinstance(batch, int) and isinstance(seq_len, int)
    half_block = triton.next_power_of_2(max(1, head_dim // 2))
    stream_tokens = max(1, NUM_WARPS * 32 * _vector_elements(element_size) // half_block)
    if (all(v is None for v in o.values()) and concrete and batch * seq_len >= STREAM_FROM_TOKENS
            and seq_len >= stream_tokens):
        o.update(heads_per_program=1, num_warps=NUM_WARPS, blocks_per_program=STREAM_BLOCKS,
                 tokens_per_program=stream_tokens, group_major=True)
    half_block, heads, tokens, num_warps = _tile(
        kv_heads, seq_len if isinstance(seq_len, int) else None, head_dim, element_size, o["tokens_per_program"],
        o["heads_per_program"], o["num_warps"])
    q_blocks, kv_blocks = triton.cdiv(q_heads, heads), triton.cdiv(kv_heads, heads)
    per_program = max(1, min(max(q_blocks, kv_blocks), o["blocks_per_program"] or 1))
    groups = triton.cdiv(q_blocks, per_program) + 2 * triton.cdiv(kv_blocks, per_program)
    token_blocks = (seq_len + tokens - 1) // tokens
    group_major = bool(o["group_major"])
    grid = (token_blocks * groups, 1, batch) if group_major else (token_blocks, groups, batch)
    return LaunchConfig(half_block, heads, tokens, per_program, group_major, num_warps, grid)


@dataclass(frozen=True)
class KernelForm:
    """The compile-time form of a launch, one kernel constexpr per field."""

    norm: str = "weight"  # NORM_STYLE: one of NORM_STYLES
    rope_first: bool = False  # ROPE_FIRST: RoPE, then the norm (HunYuan's order)
    rotary_dim: int | None = None  # ROTARY_DIM: features rotated, the first R of D; None: all D
    interleaved: bool = False  # INTERLEAVED: GPT-J's pairs (x[2i], x[2i+1])


@dataclass(frozen=True)
class RotaryFromPositions:
    """cos/sin computed in the kernel (ROPE_FROM_POSITIONS), as Hugging Face's rotary module does:
    ``cos = (cat(freqs, freqs).cos() * attention_scaling).to(dtype)``, ``freqs = position_ids * inv_freq``."""

    position_ids: torch.Tensor  # [B or 1, S] int64 or int32
    inv_freq: torch.Tensor  # [D/2] fp32, contiguous
    attention_scaling: float = 1.0


def _batch_stride(t: torch.Tensor):
    """A [1 or B, ...] table's batch stride: 0 when shared by the batch."""
    return 0 if isinstance(t.shape[0], int) and t.shape[0] == 1 else t.stride(0)


def cache_kernel_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_position: torch.Tensor,
    q_eps: float,
    k_eps: float,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    *,
    form: KernelForm = KernelForm(),
    from_positions: RotaryFromPositions | None = None,
    cache_storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    tile: dict | None = None,
    in_graph: bool = False,
) -> TritonCall:
    """The kernel launch for these (real or fake) tensors, with every argument named.

    Arguments are those of ``qk_norm_rope_cache_triton`` (which runs it; ``form`` holds its
    norm, rope_first, rotary_dim and interleaved) and, for cos/sin computed in the kernel
    (``from_positions``; cos = sin = None), of ``qk_norm_rope_cache_from_positions_triton``.
    ``k_cache``/``v_cache`` give the [B, Hkv, L, D] addressing (strides, L); the kernel writes
    through ``cache_storage`` (k's, v's) when given (the user's paged cache tensors, of which
    ``k_cache``/``v_cache`` are views at offset 0: the graph must name the tensors it mutates).
    Pure: nothing is launched or checked here beyond what the launch needs; sizes may be SymInts.
    The tensor arguments the kernel writes are ``WRITTEN_ARGS``.

    ``in_graph`` (a launch recorded into a compiled graph): ``_qk_norm_rope_cache_graph_kernel``,
    whose head counts, cache length, eps and every stride that does not scale with B or S are
    constexprs, when those are concrete here; otherwise (and for eager calls, which should not
    compile a kernel per cache length) ``_qk_norm_rope_cache_kernel``, all runtime arguments.
    Unused pointers are None in both.
    """
    batch, q_heads, seq_len, head_dim = q.shape
    kv_heads = k.shape[1]
    position_ids, inv_freq, attention_scaling = (
        (None, None, 1.0) if from_positions is None
        else (from_positions.position_ids, from_positions.inv_freq, from_positions.attention_scaling))
    k_written, v_written = (k_cache, v_cache) if cache_storage is None else cache_storage
    config = launch_config(batch, q_heads, kv_heads, seq_len, head_dim, q.element_size(), **(tile or {}))
    if from_positions is not None:
        cos_strides = sin_strides = (0, 0)
        pos_strides = (_batch_stride(position_ids), position_ids.stride(1))
    else:
        cos_strides = (_batch_stride(cos), cos.stride(1))
        sin_strides = (_batch_stride(sin), sin.stride(1))
        pos_strides = (0, 0)
    if form.norm == "no_weight":
        q_weight = k_weight = None
    pointers = (q, k, v, q_weight, k_weight, cos, sin, position_ids, inv_freq, k_written, v_written, cache_position,
                q_out, k_out)
    (q_b, q_h, q_s), (k_b, k_h, k_s), (v_b, v_h, v_s) = q.stride()[:3], k.stride()[:3], v.stride()[:3]
    (qo_b, qo_h, qo_s), (ko_b, ko_h, ko_s) = q_out.stride()[:3], k_out.stride()[:3]
    kc, vc = k_cache.stride()[:3], v_cache.stride()[:3]
    cache_len = k_cache.shape[2]
    per_batch_or_token = (seq_len, q_b, k_b, v_b, qo_b, ko_b, cos_strides[0], sin_strides[0], pos_strides[0])
    fixed = (q_heads, kv_heads, cache_len, q_h, q_s, k_h, k_s, v_h, v_s, qo_h, qo_s, ko_h, ko_s, *kc, *vc,
             cos_strides[1], sin_strides[1], pos_strides[1], cache_position.stride(0))
    scalars = (float(q_eps), float(k_eps), float(attention_scaling))
    constexprs = dict(
        HEAD_DIM=head_dim,
        **config.constexprs(),
        ROPE_FROM_POSITIONS=from_positions is not None,
        INTERPRETED=interpreting(),
        NORM_STYLE=NORM_STYLES.index(form.norm),
        ROPE_FIRST=bool(form.rope_first),
        ROTARY_DIM=head_dim if form.rotary_dim is None else int(form.rotary_dim),
        INTERLEAVED=bool(form.interleaved),
    )
    if in_graph and all(is_concrete_int(x) for x in fixed):
        kernel = _qk_norm_rope_cache_graph_kernel
        names = [n for n in kernel.arg_names if n.isupper()][:len(fixed) + len(scalars)]
        constexprs.update(zip(names, [int(x) for x in fixed] + list(scalars)))
        kwargs = named_args(kernel, *pointers, *per_batch_or_token, **constexprs)
    else:
        kernel = _qk_norm_rope_cache_kernel
        kwargs = named_args(
            kernel, *pointers, seq_len, q_heads, kv_heads, cache_len, q_b, q_h, q_s, k_b, k_h, k_s, v_b, v_h, v_s,
            qo_b, qo_h, qo_s, ko_b, ko_h, ko_s, *kc, *vc, *cos_strides, *sin_strides, *pos_strides,
            cache_position.stride(0), *scalars, **constexprs)
    return TritonCall(kernel, config.grid, kwargs, config.num_warps)


#: The tensor arguments of ``cache_kernel_call``'s launch that the kernel writes.
WRITTEN_ARGS = ("q_out_ptr", "k_out_ptr", "k_cache_ptr", "v_cache_ptr")


# --------------------------------------------------------------------------------------------
# Public launchers
# --------------------------------------------------------------------------------------------


def qk_norm_rope_cache_triton(
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
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    *,
    tile: dict | None = None,
    norm: str = "weight",
    rope_first: bool = False,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    check_positions: bool = True,
) -> None:
    """Fused per-head RMSNorm(q, k) -> RoPE -> K/V cache write, one kernel launch.

    Arguments are those of ``torch.ops.fusion_pass.qk_norm_rope_cache`` (validated there by
    ``check_qk_norm_rope_cache_args``), plus the preallocated outputs.

    Args:
        q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] (any strides, ``stride(-1) == 1``).
        q_weight, k_weight: [D] RMSNorm weights (None for ``norm="no_weight"``).
        cos, sin: [Bc, S, R] with Bc in {1, B}, rows contiguous; R = rotary_dim.
        k_cache, v_cache: [B, Hkv, L, D], written in place at ``cache_position``.
        cache_position: [S] int64 or int32; negative positions count from the end (Python
            indexing); a position outside [-L, L) fails a device assert (as ``index_copy_``
            does) when ``check_positions``, and is skipped otherwise (never written out of bounds).
        q_eps, k_eps: the norms' epsilons.
        q_out, k_out: outputs shaped like q and k (any strides, ``stride(-1) == 1``).
        check_positions: compile the launch with device asserts (Triton's ``debug``, without its
            integer-overflow checks, as Inductor compiles kernels). The interpreter skips asserts.
        tile: tuning overrides of ``launch_config``'s rule (``TILE_OVERRIDES``).
        norm: the RMSNorm form, one of ``NORM_STYLES`` (the kernel's ``NORM_STYLE`` constexpr).
        rope_first: RoPE before the norm (HunYuan's order; the ``ROPE_FIRST`` constexpr).
        rotary_dim: features rotated, the first R of D (partial rotary; the ``ROTARY_DIM``
            constexpr); None: all D. R < D must be a multiple of 16 (as must D), see
            ``_feature_offsets``.
        interleaved: rotate the pairs ``(x[2i], x[2i+1])``, cos/sin one entry per feature (GPT-J /
            GLM ``rotate_half`` on interleaved features; the ``INTERLEAVED`` constexpr).
    """
    if q.numel() == 0 and k.numel() == 0:  # Hq = 0 alone still has k and v to write
        return
    cache_kernel_call(
        q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps, q_out, k_out,
        form=KernelForm(norm, rope_first, rotary_dim, interleaved), tile=tile,
    ).run(device_asserts=check_positions)


def qk_norm_rope_cache_from_positions_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_position: torch.Tensor,
    q_eps: float,
    k_eps: float,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    *,
    tile: dict | None = None,
    check_positions: bool = True,
) -> None:
    """As ``qk_norm_rope_cache_triton``, with cos/sin computed in the kernel (Hugging Face rotary).

    ``cos, sin = rope_cos_sin_reference(position_ids, inv_freq, attention_scaling, q.dtype)``
    is evaluated in registers, once per program for its tokens.

    Args:
        position_ids: [B, S] int64 or int32 (a batch stride of 0 is fine, e.g. ``expand``).
        inv_freq: [D/2] fp32 inverse frequencies.
        attention_scaling: multiplies cos and sin before their rounding (1.0 for default RoPE).
        Other arguments: as ``qk_norm_rope_cache_triton``, without cos/sin.
    """
    batch, _, seq_len, head_dim = q.shape
    if position_ids.dim() != 2 or position_ids.shape[1] != seq_len or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids: expected shape [B={batch} or 1, S={seq_len}], got {tuple(position_ids.shape)}")
    if position_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"position_ids: expected dtype int64 or int32, got {position_ids.dtype}")
    if tuple(inv_freq.shape) != (head_dim // 2,) or inv_freq.dtype != torch.float32 or inv_freq.stride(0) != 1:
        raise ValueError(
            f"inv_freq: expected a contiguous fp32 tensor of shape [{head_dim // 2}], "
            f"got {inv_freq.dtype} {tuple(inv_freq.shape)} strides {inv_freq.stride()}"
        )
    if q.numel() == 0 and k.numel() == 0:  # Hq = 0 alone still has k and v to write
        return
    cache_kernel_call(
        q, k, v, q_weight, k_weight, None, None, k_cache, v_cache, cache_position, q_eps, k_eps, q_out, k_out,
        from_positions=RotaryFromPositions(position_ids, inv_freq, attention_scaling), tile=tile,
    ).run(device_asserts=check_positions)
