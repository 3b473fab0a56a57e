"""``kernels/sin_cos.py`` against float64 and against torch's own cos/sin rounded to bf16.

The angles are the rotary embedding's: ``fp32(position) * inv_freq`` for positions up to 262143
(Qwen3-Coder's context) and inv_freq of rope_theta 1e6 and 1e7, plus negative and small angles.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusion_pass.kernels.sin_cos import sin_cos  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 1024


@triton.jit
def _sin_cos_kernel(x_ptr, sin_ptr, cos_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s, c = sin_cos(tl.load(x_ptr + offs, mask=mask, other=0.0))
    tl.store(sin_ptr + offs, s, mask=mask)
    tl.store(cos_ptr + offs, c, mask=mask)


def kernel_sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s, c = torch.empty_like(x), torch.empty_like(x)
    _sin_cos_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, s, c, x.numel(), BLOCK=BLOCK)
    return s, c


def rotary_angles(theta: float, positions: torch.Tensor, head_dim: int = 128) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return (positions[:, None].float() * inv_freq[None, :]).flatten()


def angles() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(0, 4096), torch.randint(0, 262144, (2048,), generator=g),
                           torch.tensor([131071, 262143, 105615, 105616])])
    extra = torch.cat([torch.linspace(-20, 20, 4001), torch.tensor([0.0, -0.0, 1e-30, 3.1415927, 1.5707964, 4e6])])
    return torch.cat([rotary_angles(1e6, positions), rotary_angles(1e7, positions), extra]).to(DEVICE)


def fp32_ulps(got: torch.Tensor, want64: torch.Tensor) -> torch.Tensor:
    """|got - want| in ulps of fp32 at want's magnitude (at least the ulp of 2**-24 near 0)."""
    scale = want64.abs().clamp_min(2.0**-24)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - 23)
    return (got.double() - want64).abs() / ulp


def test_within_two_fp32_ulps_of_float64():
    x = angles()
    s, c = kernel_sin_cos(x)
    x64 = x.double().cpu()
    assert fp32_ulps(s.cpu(), torch.sin(x64)).max().item() <= 2.0
    assert fp32_ulps(c.cpu(), torch.cos(x64)).max().item() <= 2.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounded_to_the_model_dtype_almost_always_equals_torchs(dtype):
    """Rounded as the rotary embedding rounds them, the values equal torch's except next to a rounding
    tie: at most 1 in 10^4 differ, by one ulp of the model dtype."""
    x = angles()
    s, c = kernel_sin_cos(x)
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    for got, want in ((s, torch.sin(x)), (c, torch.cos(x))):
        got, want = got.to(dtype), want.to(dtype)
        differ = got != want
        assert differ.float().mean().item() <= 1e-4  # measured on the CPU: 6e-6 to 3.4e-5
        magnitude = torch.maximum(got.float().abs(), want.float().abs()).clamp_min(torch.finfo(dtype).tiny)
        ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa)
        assert ((got.float() - want.float()).abs() <= ulp)[differ].all()
