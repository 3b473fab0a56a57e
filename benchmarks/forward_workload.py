"""Suite F's workload (WORKLOADS.md section F): its shapes, the eager module, inputs and checks.

Shared by ``bench_forward.py``, ``forward_sweep.py`` and ``diagnostics/profile_forward_kernel.py``.
"""

from __future__ import annotations

import torch

from fusion_pass.kernels import qk_norm_rope_cache_reference as cache_reference
from fusion_pass.kernels.qk_norm_rope_cache_reference import rotate_half

Q_HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN = 96, 8, 128, 262144
DTYPE = torch.bfloat16
EPS = 1e-6  # Qwen3 rms_norm_eps
ROPE_THETA = 10_000_000.0  # Qwen3-Coder-480B-A35B rope_theta
DEVICE = "cuda"
K_FILL, V_FILL = 1.5, -2.5  # cache contents before the run; unwritten rows must keep them


class QKNormRopeCache(torch.nn.Module):
    """WORKLOADS.md F, line by line: RMSNorm(q, k) -> RoPE from inv_freq -> cache writes."""

    def __init__(self, head_dim: int, eps: float, theta: float, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q_norm_weight = torch.nn.Parameter((torch.rand(head_dim, generator=g) + 0.5).to(dtype), requires_grad=False)
        self.k_norm_weight = torch.nn.Parameter((torch.rand(head_dim, generator=g) + 0.5).to(dtype), requires_grad=False)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.eps = eps
        self.to(device)

    @staticmethod
    def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def forward(self, query, key, value, position_ids, key_cache, value_cache, cache_position):
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(query.dtype).unsqueeze(1)  # [B, 1, S, D], broadcast over heads
        sin = emb.sin().to(query.dtype).unsqueeze(1)
        q = self.rms(query, self.q_norm_weight, self.eps)
        k = self.rms(key, self.k_norm_weight, self.eps)
        query_rotated = q * cos + rotate_half(q) * sin
        key_rotated = k * cos + rotate_half(k) * sin
        key_cache[:, :, cache_position] = key_rotated
        value_cache[:, :, cache_position] = value
        return query_rotated, key_rotated


def case_bytes(seq: int, batch: int) -> int:
    per_token = 2 * Q_HEADS * HEAD_DIM * 2 + 5 * KV_HEADS * HEAD_DIM * 2 + 16
    return batch * seq * per_token


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()



def make_inputs(seq: int, cached: int, batch: int):
    device = DEVICE
    g = torch.Generator(device=device).manual_seed(seq * 1000 + batch)
    cache_position = torch.arange(cached, cached + seq, device=device)
    return dict(
        query=torch.randn(batch, Q_HEADS, seq, HEAD_DIM, device=device, generator=g).to(DTYPE),
        key=torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device=device, generator=g).to(DTYPE) * 3,
        value=torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device=device, generator=g).to(DTYPE),
        position_ids=cache_position[None, :].repeat(batch, 1),
        key_cache=torch.full((batch, KV_HEADS, CACHE_LEN, HEAD_DIM), K_FILL, dtype=DTYPE, device=device),
        value_cache=torch.full((batch, KV_HEADS, CACHE_LEN, HEAD_DIM), V_FILL, dtype=DTYPE, device=device),
        cache_position=cache_position,
    )


def untouched_rows(cached: int, seq: int) -> list[int]:
    rows = {0, 1, CACHE_LEN // 2, CACHE_LEN - 1, cached - 1, cached + seq, cached + seq + 1}
    return sorted(r for r in rows if 0 <= r < CACHE_LEN and not cached <= r < cached + seq)


def check_caches(x: dict, k_rows: torch.Tensor, cached: int, seq: int) -> None:
    """Written rows equal k_rows / value exactly; sampled unwritten rows still hold the fill."""
    kc, vc = x["key_cache"], x["value_cache"]
    if not torch.equal(kc[:, :, cached:cached + seq], k_rows):
        raise AssertionError("k_cache rows differ from k_out")
    if not torch.equal(vc[:, :, cached:cached + seq], x["value"]):
        raise AssertionError("v_cache rows differ from value")
    for r in untouched_rows(cached, seq):
        if not (bool((kc[:, :, r] == K_FILL).all()) and bool((vc[:, :, r] == V_FILL).all())):
            raise AssertionError(f"cache row {r} (not in cache_position) was modified")


def ulp_error(out_q, out_k, x: dict, module: QKNormRopeCache, cos, sin) -> float:
    q_ref, k_ref = (
        module.rms(x["query"], module.q_norm_weight, EPS), module.rms(x["key"], module.k_norm_weight, EPS)
    )
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot = q_ref * cos4 + rotate_half(q_ref) * sin4
    k_rot = k_ref * cos4 + rotate_half(k_ref) * sin4
    return max(cache_reference.rope_ulp_error(out_q, q_rot, q_ref, cos, sin),
               cache_reference.rope_ulp_error(out_k, k_rot, k_ref, cos, sin))

