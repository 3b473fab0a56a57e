"""Direct calls of ``torch.ops.fusion_pass.qk_norm_rope_cache`` in tests: random arguments, and
the check of one call against the reference."""

from __future__ import annotations

import torch

from fusion_pass.kernels.qk_norm_rope_cache_reference import qk_norm_rope_cache_reference

# The kernel tests' interpreter bound for fp16 (numpy sums the fp32 statistic in another order,
# which can flip an fp16 rounding); bf16 is bit for bit.
FP16_INTERPRETED_MAX_ULPS = 2.0
# random_op_args' default positions [3, -1, 7, 5, 0] in 12 cache rows: (row, token) written
# (-1 counts from the end).
WRITTEN_ROWS = ((3, 0), (11, 1), (7, 2), (5, 3), (0, 4))
CACHE_ROWS = 12


def random_op_args(dtype=torch.bfloat16, head_dim=64, table_width=None, norm="weight", seed=0,
                   cache_position=None) -> dict:
    """Keyword arguments of the dense op: q [2, 4, 5, D], k/v [2, 2, 5, D] (transposed views of
    [B, S, H, D], as Hugging Face passes them), cos/sin [2, 5, table_width or D], caches
    [2, 2, 12, D], and cache positions [3, -1, 7, 5, 0] by default (a negative one). Norm weights around 1 (Gemma's ``fp32_one_plus_weight``: around 0, an offset from
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
        cache_position=torch.tensor([3, -1, 7, 5, 0]) if cache_position is None else cache_position,
        q_eps=1e-6, k_eps=1e-5,
    )
    if norm != "weight":
        args["norm"] = norm
    return args


def output_scale_ulps(out: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|out - want|`` in fp16 ulps at the output's own scale."""
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0**-14))) - 10)
    return float(((out.float() - want.float()).abs() / ulp).max())


def assert_op_call_matches_reference(args: dict, fp16_ulps=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the dense op on ``args`` (random_op_args' default positions) and check it against
    ``qk_norm_rope_cache_reference`` on clones: bf16 outputs bit for bit, fp16 within
    FP16_INTERPRETED_MAX_ULPS by ``fp16_ulps(out, want, which)`` (default: ulps at the output's
    scale; ``which`` is "q" or "k"); the written cache rows hold k_out and v, every other row is
    untouched. Returns (q_out, k_out)."""
    ref = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    k_cache_before, v_cache_before = args["k_cache"].clone(), args["v_cache"].clone()
    q_out, k_out = torch.ops.fusion_pass.qk_norm_rope_cache(**args)
    q_ref, k_ref = qk_norm_rope_cache_reference(**ref)
    if q_out.dtype == torch.bfloat16:
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    else:
        for which, out, want in (("q", q_out, q_ref), ("k", k_out, k_ref)):
            ulps = output_scale_ulps(out, want) if fp16_ulps is None else fp16_ulps(out, want, which)
            assert ulps <= FP16_INTERPRETED_MAX_ULPS, (which, ulps)
    for row, token in WRITTEN_ROWS:
        assert torch.equal(args["k_cache"][:, :, row], k_out[:, :, token])
        assert torch.equal(args["v_cache"][:, :, row], args["v"][:, :, token])
    untouched = [r for r in range(CACHE_ROWS) if r not in dict(WRITTEN_ROWS)]
    assert torch.equal(args["k_cache"][:, :, untouched], k_cache_before[:, :, untouched])
    assert torch.equal(args["v_cache"][:, :, untouched], v_cache_before[:, :, untouched])
    return q_out, k_out
