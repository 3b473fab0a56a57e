"""Rounding an fp32 value to bf16/fp16 precision inside Triton kernels, as eager PyTorch does.

The fused kernels reproduce eager's intermediate roundings (each bf16 product rounded before
the next operation). ``(a * b).to(tl.bfloat16).to(tl.float32)`` compiles to a native bf16
multiply (correctly rounded: fine), but when that product feeds an add the compiler contracts
the two into one bf16 FMA, which rounds once where eager rounds twice (measured on the H200,
Triton 3.6: ~12 % of the forward kernel's outputs differed from eager). ``round_*_opaque``
rounds through a ``cvt.rn`` in inline PTX, which the compiler cannot contract. It costs more
instructions than the native path (measured: 67 -> 85 us when every rounding of the forward
kernel used it), so kernels use it only for products that feed an add.

The Triton interpreter (CPU tests) has no inline PTX, and its fp32 -> bf16 cast truncates
instead of rounding to nearest even; there bf16 rounding is done on the fp32 bits, and fp16
by numpy's (correctly rounding) cast.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16_opaque(x, INTERPRETED: tl.constexpr):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), returned as fp32. NaN stays NaN."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        half = tl.inline_asm_elementwise(
            "cvt.rn.bf16.f32 $0, $1;", "=h,f", [x], dtype=tl.uint16, is_pure=True, pack=1
        )
        return (half.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp16_opaque(x, INTERPRETED: tl.constexpr):
    """fp32 ``x`` rounded to the nearest fp16 (ties to even), returned as fp32."""
    if INTERPRETED:
        return x.to(tl.float16).to(tl.float32)
    else:
        half = tl.inline_asm_elementwise(
            "cvt.rn.f16.f32 $0, $1;", "=h,f", [x], dtype=tl.uint16, is_pure=True, pack=1
        )
        return half.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (bf16, fp16 or fp32), returned as fp32; the compiler may
    turn the rounding into native half-precision arithmetic (exact unless contracted into an
    FMA: use ``round_to_opaque`` for a product that feeds an add)."""
    if dtype == tl.bfloat16:
        if INTERPRETED:
            return round_to_bf16_opaque(x, INTERPRETED)
        else:
            return x.to(tl.bfloat16).to(tl.float32)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def round_to_opaque(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``round_to`` that no compiler pass can fuse with the operation that consumes it."""
    if dtype == tl.bfloat16:
        return round_to_bf16_opaque(x, INTERPRETED)
    elif dtype == tl.float16:
        return round_to_fp16_opaque(x, INTERPRETED)
    else:
        return x
