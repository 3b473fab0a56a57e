"""Random arguments for direct calls of ``torch.ops.fusion_pass.qk_norm_rope_cache`` in tests."""

from __future__ import annotations

import torch


def random_op_args(dtype=torch.bfloat16, head_dim=64, table_width=None, norm="weight", seed=0,
                   cache_position=None) -> dict:
    """Keyword arguments of the dense op: q [2, 4, 5, D], k/v [2, 2, 5, D] (transposed views of
    [B, S, H, D], as Hugging Face passes them), cos/sin [2, 5, table_width or D], caches
    [2, 2, 12, D], and cache positions [3, -1, 7, 20, 0] by default (a negative one and one past
    the cache). Norm weights around 1 (Gemma's ``fp32_one_plus_weight``: around 0, an offset from
    1), None for ``no_weight``; ``norm`` is passed on unless it is the default ``"weight"``."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    width = table_width or head_dim
    weighted = norm != "no_weight"
    offset = 0.0 if norm == "fp32_one_plus_weight" else 1.0
    args = dict(
        q=r(2, 5, 4, head_dim).transpose(1, 2), k=r(2, 5, 2, head_dim, scale=3.0).transpose(1, 2),
        v=r(2, 5, 2, head_dim).transpose(1, 2),
        q_weight=r(head_dim, scale=0.3) + offset if weighted else None,
        k_weight=r(head_dim, scale=0.3) + offset if weighted else None,
        cos=r(2, 5, width), sin=r(2, 5, width),
        k_cache=r(2, 2, 12, head_dim), v_cache=r(2, 2, 12, head_dim),
        cache_position=torch.tensor([3, -1, 7, 20, 0]) if cache_position is None else cache_position,
        q_eps=1e-6, k_eps=1e-5,
    )
    if norm != "weight":
        args["norm"] = norm
    return args
