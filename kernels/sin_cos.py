"""sin and cos of fp32 angles inside Triton kernels: exact argument reduction, fp32 polynomials.

Rotary tables are ``cos(freqs)``, ``sin(freqs)`` of fp32 angles ``freqs = position * inv_freq``
that reach 262144 radians (Qwen3-Coder's context), rounded to the model dtype afterwards.
libdevice's ``cosf``/``sinf`` (what torch's CUDA kernels run) keep a Payne-Hanek path for
``|x| > 105615`` in every caller: local-memory tables, about 250 instructions and ~30 extra registers
per call site, even where it never runs. Here, for ``|x| < 2**22``::

    k = round(x * 2/pi)                      # fp64: x and k are exact there
    r = (x - k * PIO2_HI) - k * PIO2_LO      # fp64; PIO2_HI has 27 significant bits, so k * PIO2_HI
                                             # and x - k * PIO2_HI are exact (|k| < 2**26)
    sin x, cos x = +-sin r / +-cos r by k mod 4, from fp32 minimax polynomials on [-pi/4, pi/4]
    (Cephes' ``sinf``/``cosf`` coefficients: a few 1e-8 relative error)

A handful of fp64 operations (the product, the floor, two multiply-subtracts) and about 14 fp32 ones
give both functions. Against float64 the results are within 2 fp32 ulps (``tests/test_sin_cos.py``;
1.54 measured over 790,951 rotary angles); rounded to bf16 they equal torch's rounded
``cosf``/``sinf`` except where the exact value lies within a few fp32 ulps of a bf16 rounding tie:
6e-6 to 8e-6 of the values, one bf16 ulp off (CPU, where torch uses its own ``cos``; the same test
passed on the H200 against torch's CUDA functions). The interpreter runs the same code (fp64 through
numpy; its multiply-adds round twice where the GPU's FMAs round once: at most an fp32 ulp apart).
"""

import triton
import triton.language as tl


@triton.jit
def sin_cos(x):
    """``(sin(x), cos(x))`` of an fp32 tensor ``x`` with ``|x| < 2**22``, as fp32 (see the module docstring)."""
    # The constants are literals: Inductor copies a user kernel's source into its generated module
    # without the module-level names around it.
    x64 = x.to(tl.float64)
    k = tl.floor(x64 * 0.6366197723675814 + 0.5)  # 2 / pi
    # pi/2 = 1.570796325802803 (27 significant bits: k * it is exact for |k| < 2**26) + 9.920935796805404e-10
    r = ((x64 - k * 1.570796325802803) - k * 9.920935796805404e-10).to(tl.float32)
    quadrant = k.to(tl.int32) & 3
    z = r * r
    # Cephes sinf / cosf on [-pi/4, pi/4].
    sin_r = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    # x = k pi/2 + r: (sin, cos) = (sin r, cos r), (cos r, -sin r), (-sin r, -cos r), (-cos r, sin r)
    odd = (quadrant & 1) != 0
    sin_x = tl.where(odd, cos_r, sin_r)
    cos_x = tl.where(odd, sin_r, cos_r)
    sin_x = tl.where(quadrant >= 2, -sin_x, sin_x)
    cos_x = tl.where((quadrant == 1) | (quadrant == 2), -cos_x, cos_x)
    return sin_x, cos_x
