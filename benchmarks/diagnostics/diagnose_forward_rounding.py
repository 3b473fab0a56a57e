"""Where do the fused op's bf16 results differ from the Hugging Face reference on the GPU?

Runs the kernel with weight = 1, cos = 1, sin = 0 so that its output is the normalized row
itself, and compares it with the reference's normalized row computed several ways (torch's
rsqrt, 1/sqrt, float64 statistics). Prints the fraction of elements that differ from each.
"""

from __future__ import annotations

import torch

from fusion_pass.kernels import qk_norm_rope_cache_triton as kernel


def normalized(x: torch.Tensor, eps: float, how: str) -> torch.Tensor:
    x32 = x.float()
    if how == "float64 stats":
        var = x.double().pow(2).mean(-1, keepdim=True)
        return (x32 * torch.rsqrt(var + eps).float()).to(x.dtype)
    var = x32.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(var + eps) if how == "torch.rsqrt" else 1.0 / torch.sqrt(var + eps)
    return (x32 * rstd).to(x.dtype)


def main() -> None:
    torch.manual_seed(0)
    batch, q_heads, kv_heads, seq, dim, eps = 1, 96, 8, 2048, 128, 1e-6
    q = torch.randn(batch, q_heads, seq, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16)
    ones = torch.ones(dim, device="cuda", dtype=torch.bfloat16)
    cos = torch.ones(batch, seq, dim, device="cuda", dtype=torch.bfloat16)
    sin = torch.zeros_like(cos)
    cache = torch.empty(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    kernel.qk_norm_rope_cache_triton(q, k, k, ones, ones, cos, sin, cache, cache.clone(),
                                     torch.arange(seq, device="cuda"), eps, eps, q_out, k_out)
    for how in ("torch.rsqrt", "1/sqrt", "float64 stats"):
        ref = normalized(q, eps, how)
        frac = (q_out != ref).float().mean().item()
        print(f"kernel normalized row vs reference ({how}): {frac:.3e} of elements differ")
    ref_a, ref_b = normalized(q, eps, "torch.rsqrt"), normalized(q, eps, "float64 stats")
    print(f"reference torch.rsqrt vs float64 stats: {(ref_a != ref_b).float().mean().item():.3e} differ")


if __name__ == "__main__":
    main()
