"""Rounding an fp32 value to bf16/fp16 precision inside Triton kernels, as eager PyTorch does.

The fused kernels reproduce eager's intermediate roundings (each bf16 product rounded before
the next operation). ``x.to(tl.bfloat16).to(tl.float32)`` does not do that on the GPU: the
compiler folds the truncate/extend pair away (measured on the H200, Triton 3.6: ~12 % of the
outputs of the forward kernel then differed from eager, as stock Inductor's do). Here the
truncation is a ``cvt.rn`` in inline PTX, which the compiler cannot fold: one instruction.

The Triton interpreter (CPU tests) has no inline PTX, and its fp32 -> bf16 cast truncates
instead of rounding to nearest even; there bf16 rounding is done on the fp32 bits, and fp16
by numpy's (correctly rounding) cast.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x, INTERPRETED: tl.constexpr):
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
def round_to_fp16(x, INTERPRETED: tl.constexpr):
    """fp32 ``x`` rounded to the nearest fp16 (ties to even), returned as fp32."""
    if INTERPRETED:
        return x.to(tl.float16).to(tl.float32)
    else:
        half = tl.inline_asm_elementwise(
            "cvt.rn.f16.f32 $0, $1;", "=h,f", [x], dtype=tl.uint16, is_pure=True, pack=1
        )
        return half.to(tl.float16, bitcast=True).to(tl.float32)
