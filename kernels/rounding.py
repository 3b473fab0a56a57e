"""Rounding inside Triton kernels exactly where eager PyTorch rounds.

The fused kernels reproduce eager's intermediate roundings: each bf16/fp16 product is rounded
before the next operation, then the sum of two rounded products is rounded. ``round_to(x)``
(``x.to(dtype).to(fp32)``) compiles to native half-precision arithmetic, correctly rounded. The
one hazard is FMA contraction: a rounded product feeding an add is contracted into one FMA,
which rounds once where eager rounds twice (measured on the H200, Triton 3.6: ~12 % of the
forward kernel's outputs differed from eager). Launched by Inductor, a user-defined kernel is
compiled with Triton's default options (``enable_fp_fusion=True``; Inductor passes no options
for it), so contraction cannot be switched off per kernel: ``round_sum`` instead does the add in
inline PTX with an explicit rounding modifier (``round_sum``), which neither LLVM nor ptxas
fuse with the multiply before it.

Choosing between two such values per feature (partial rotary's pass-through features) has the
same kind of hazard for speed: the compiler keeps them as packed half-precision pairs, and a
per-element ``tl.where`` unpacks, selects and repacks each half (measured: +33 % of the forward
kernel's instructions, most on the integer pipe). ``select_rounded`` selects the packed pairs'
bits in one ``lop3`` instead.

The Triton interpreter (CPU tests) has no inline PTX, and its fp32 -> bf16 cast truncates
instead of rounding to nearest even; there bf16 rounding is done on the fp32 bits, and fp16
by numpy's (correctly rounding) cast.
"""

import torch
import triton
import triton.language as tl

#: The dtypes whose eager rounding the kernels reproduce, and so the dtypes every op and family takes.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _round_to_bf16_bits(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even) on its bits, returned as fp32; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (bf16, fp16 or fp32), returned as fp32. A rounded product
    that feeds an add must reach it through ``round_sum`` (see the module docstring)."""
    if dtype == tl.bfloat16:
        if INTERPRETED:
            return _round_to_bf16_bits(x)
        else:
            return x.to(tl.bfloat16).to(tl.float32)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def round_sum(a, b, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``round_to(a + b)`` of two fp32 values that hold ``dtype`` values (rounded products),
    returned as fp32; the add is never contracted with the multiplies that produced a and b.

    On the GPU the add is inline PTX on packed pairs, with an explicit rounding modifier, which
    neither LLVM nor ptxas fuse: ``add.rn.f16x2`` for fp16, ``fma.rn.bf16x2(a, 1.0, b)`` for bf16
    (sm_80+; ``add.rn.bf16x2`` needs sm_90). Both are correctly rounded sums, the same bits as
    eager's fp32 add then round (an inexact fp32 sum of two such values is far from a tie).
    """
    if dtype == tl.bfloat16:
        if INTERPRETED:
            return _round_to_bf16_bits(a + b)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 one; mov.b32 one, 0x3F803F80; fma.rn.bf16x2 $0, $1, one, $2; }", "=r,r,r",
                [a.to(tl.bfloat16), b.to(tl.bfloat16)], dtype=tl.bfloat16, is_pure=True, pack=2).to(tl.float32)
    elif dtype == tl.float16:
        if INTERPRETED:
            return (a + b).to(tl.float16).to(tl.float32)
        else:
            return tl.inline_asm_elementwise(
                "add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a.to(tl.float16), b.to(tl.float16)], dtype=tl.float16,
                is_pure=True, pack=2).to(tl.float32)
    else:
        return a + b


@triton.jit
def select_rounded(keep, a, b, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``tl.where(keep, a, b)`` of fp32 ``a``, ``b`` that hold ``dtype`` values (``keep`` broadcasts
    to their shape), returned as fp32; exact (the bits of a or b). For bf16/fp16 on the GPU the
    select is inline PTX on packed pairs (``lop3.b32``: ``(a & m) | (b & ~m)``, m all ones where
    ``keep``), see the module docstring."""
    if dtype.primitive_bitwidth == 16 and not INTERPRETED:
        packed_a = a.to(dtype)
        m = tl.broadcast_to(tl.where(keep, -1, 0).to(tl.int16), a.shape)
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xE4;", "=r,r,r,r", [packed_a, b.to(dtype), m],
                                         dtype=packed_a.dtype, is_pure=True, pack=2).to(tl.float32)
    else:
        return tl.where(keep, a, b)
