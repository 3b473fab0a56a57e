"""Backward kernels of QKV projection -> RoPE -> per-head RMSNorm, against torch.autograd.

CPU: the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set below before triton is
imported) on small shapes with few programs. The oracle is autograd on a plain-PyTorch forward,
in float64 (numerical truth) and in the model dtype (the eager graph a training user runs; our
kernel mirrors its roundings). GPU tests (skipped without CUDA) run the 16 cases of WORKLOADS.md B.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as kb  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# The forward being differentiated (Hugging Face HunYuanDenseV1 order: RoPE, then per-head norm)
# ---------------------------------------------------------------------------------------------
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, c, s):
    """RoPE on the first c.shape[-1] features (all of them, or partial rotary as GLM-4.5 writes it)."""
    rotary_dim = c.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * c + rotate_half(x_rot) * s, x_pass), dim=-1)


def rms_norm(x, w, eps=EPS):
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for the float64 oracle
    x32 = x.to(acc)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * (x32 * rstd).to(x.dtype)


def forward_from_qkv(qkv, cos, sin, wq, wk, hq, hkv, d, rotated=None, rope_first=True):
    """qkv [B, S, (hq+2hkv)*d] -> (query, key, value) [B, H, S, d], the module's attention inputs.
    ``rotated``: a list that receives the RoPE outputs (the norms' inputs), grads retained.
    ``rope_first=False``: Qwen3's order, the norm then RoPE (``rotated`` receives the norms' outputs)."""
    B, S, _ = qkv.shape
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q.view(B, S, hq, d).transpose(1, 2)
    k = k.view(B, S, hkv, d).transpose(1, 2)
    v = v.view(B, S, hkv, d).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    if not rope_first:
        q, k = rms_norm(q, wq), rms_norm(k, wk)
        if rotated is not None:
            for x in (q, k):
                x.retain_grad()
                rotated.append(x)
        return rope(q, c, s), rope(k, c, s), v
    q = rope(q, c, s)
    k = rope(k, c, s)
    if rotated is not None:
        for x in (q, k):
            x.retain_grad()
            rotated.append(x)
    return rms_norm(q, wq), rms_norm(k, wk), v


def saved_for_backward(qkv, cos, sin, hq, hkv, d, rope_first=True):
    """What the forward op saves: pre-RoPE q/k views of qkv, fp32 rstd [B, H, S] (of the norm's
    input: rope(x), or x itself when ``rope_first=False``)."""
    B, S, _ = qkv.shape
    q = qkv[..., : hq * d].view(B, S, hq, d)
    k = qkv[..., hq * d: (hq + hkv) * d].view(B, S, hkv, d)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rstd(x):  # x [B, S, H, D] -> [B, H, S]
        xt = x.transpose(1, 2)
        xr = rope(xt, c, s) if rope_first else xt
        return torch.rsqrt(xr.float().pow(2).mean(-1) + EPS)

    return q, k, rstd(q), rstd(k)


def autograd_grads(qkv, cos, sin, wq, wk, gq, gk, gv, hq, hkv, d, dtype=None, rope_first=True):
    """grads of (qkv, cos, sin, wq, wk) by autograd, computed in ``dtype`` (default: inputs')."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (qkv, cos, sin, wq, wk)]
    outs = forward_from_qkv(*leaves, hq, hkv, d, rope_first=rope_first)
    torch.autograd.backward(outs, [g.to(leaves[0].dtype) for g in (gq, gk, gv)])
    return [t.grad for t in leaves]


def norm_backward_term_scale(qkv, cos, sin, wq, wk, gq, gk, gv, hq, hkv, d):
    """Qwen3's order (norm, then RoPE): [B, S, qkv_size], per element of grad_qkv the larger of
    the two terms the norm's backward subtracts, |rstd * w * gy| and |x * rstd^3 * mean(w gy x)|
    (gy = grad of the norm's output: RoPE's backward of the incoming grad, itself a rounded sum;
    float64); 0 in the v columns. The scale at which one flipped rounding is compared."""
    leaves = [t.detach().double().requires_grad_(True) for t in (qkv, cos, sin, wq, wk)]
    normed = []
    outs = forward_from_qkv(*leaves, hq, hkv, d, rotated=normed, rope_first=False)
    torch.autograd.backward(outs, [g.double() for g in (gq, gk, gv)])
    B, S, _ = qkv.shape
    pre = leaves[0].detach()
    xs = (pre[..., : hq * d].view(B, S, hq, d).transpose(1, 2),
          pre[..., hq * d: (hq + hkv) * d].view(B, S, hkv, d).transpose(1, 2))
    parts = []
    for y, x, w in zip(normed, xs, (leaves[3].detach(), leaves[4].detach())):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        gn = y.grad * w
        terms = torch.maximum((rstd * gn).abs(), (x * rstd ** 3 * (gn * x).mean(-1, keepdim=True)).abs())
        parts.append(terms.transpose(1, 2).reshape(B, S, -1))
    parts.append(torch.zeros(B, S, hkv * d, dtype=torch.float64, device=qkv.device))
    return torch.cat(parts, dim=-1)


def rope_backward_term_scale(qkv, cos, sin, wq, wk, gq, gk, gv, hq, hkv, d):
    """[B, S, qkv_size]: per element of grad_qkv, the larger of |dx*cos| and |dx*sin|, the two
    terms the RoPE backward rounds and adds (dx = grad of the norm's input, float64); 0 in the
    v columns.
    A difference of one ulp in a term is many ulps of a sum that cancels: this is the scale at
    which the grads are compared (as the forward tests compare at the RoPE terms' scale)."""
    leaves = [t.detach().double().requires_grad_(True) for t in (qkv, cos, sin, wq, wk)]
    rotated = []
    outs = forward_from_qkv(*leaves, hq, hkv, d, rotated=rotated)
    torch.autograd.backward(outs, [g.double() for g in (gq, gk, gv)])
    c, s = leaves[1].detach().unsqueeze(1), leaves[2].detach().unsqueeze(1)
    B, S, _ = qkv.shape
    parts = []
    rotary_dim = c.shape[-1]
    for x in rotated:  # d(proj) = dx*cos + rotate_half^T(dx*sin), rotate_half^T(y) = cat(y2, -y1)
        dx = x.grad[..., :rotary_dim]
        sin_term = (dx * s).abs()
        half = rotary_dim // 2
        terms = torch.maximum((dx * c).abs(), torch.cat((sin_term[..., half:], sin_term[..., :half]), dim=-1))
        terms = torch.cat((terms, x.grad[..., rotary_dim:].abs()), dim=-1)  # passed-through features
        parts.append(terms.transpose(1, 2).reshape(B, S, -1))
    parts.append(torch.zeros(B, S, hkv * d, dtype=torch.float64, device=qkv.device))
    return torch.cat(parts, dim=-1)


def make_case(B, S, hq, hkv, d, bc, dtype, seed=0, real_rope=False, strided_grads=True, rotary_dim=None):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)

    qkv = rnd(B, S, (hq + 2 * hkv) * d)
    r = rotary_dim or d
    if real_rope:
        inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
        ang = torch.arange(S).float()[:, None] * inv
        emb = torch.cat((ang, ang), -1)[None].expand(bc, S, r)
        cos, sin = emb.cos().to(dtype).to(DEV), emb.sin().to(dtype).to(DEV)
    else:  # arbitrary tables: the grads must be exact for any cos/sin
        cos, sin = rnd(bc, S, r), rnd(bc, S, r)
    wq, wk = (1 + rnd(d, scale=0.2)), (1 + rnd(d, scale=0.2))
    if strided_grads:  # [B, S, H, D] storage seen as [B, H, S, D], like a transposed attention grad
        gq = rnd(B, S, hq, d).transpose(1, 2)
        gk = rnd(B, S, hkv, d).transpose(1, 2)
        gv = rnd(B, S, hkv, d).transpose(1, 2)
    else:
        gq, gk, gv = rnd(B, hq, S, d), rnd(B, hkv, S, d), rnd(B, hkv, S, d)
    return qkv, cos, sin, wq, wk, gq, gk, gv


def run_kernel(qkv, cos, sin, wq, wk, gq, gk, gv, hq, hkv, d, need_w=True, need_cs=True,
               num_programs=None, rstd_override=None, rope_first=True):
    B, S, N = qkv.shape
    q, k, rq, rk = saved_for_backward(qkv, cos, sin, hq, hkv, d, rope_first)
    if rstd_override is not None:
        rq, rk = rstd_override(rq), rstd_override(rk)
    grad_qkv = torch.full((B * S, N), float("nan"), device=qkv.device, dtype=qkv.dtype)
    outs = kb.qk_norm_rope_backward_triton(
        gq, gk, gv, q, k, rq, rk, cos, sin, wq, wk,
        grad_qkv[:, : hq * d], grad_qkv[:, hq * d: (hq + hkv) * d], grad_qkv[:, (hq + hkv) * d:],
        need_weight_grad=need_w, need_cos_sin_grad=need_cs, num_programs=num_programs, rope_first=rope_first,
    )
    return grad_qkv.view(B, S, N), *outs


def rel_err(a, ref):
    """max |a - ref| / max |ref| (norm-wise relative error)."""
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def bf16_ulp(x):
    """One bf16 ulp at |x| (in fp32)."""
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


TOL_VS_F64 = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
ONE_ULP_REL = {torch.float32: 1e-6, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
NAMES = ("grad_qkv", "grad_cos", "grad_sin", "grad_q_weight", "grad_k_weight")


def check_case(B, S, hq, hkv, d, bc, dtype, need_w=True, need_cs=True, seed=0, real_rope=False,
               num_programs=None, strided_grads=True, rope_first=True, rotary_dim=None):
    case = make_case(B, S, hq, hkv, d, bc, dtype, seed=seed, real_rope=real_rope, strided_grads=strided_grads,
                     rotary_dim=rotary_dim)
    qkv, cos, sin, wq, wk, gq, gk, gv = case
    grad_qkv, gqw, gkw, gcos, gsin = run_kernel(*case, hq, hkv, d, need_w, need_cs, num_programs,
                                                rope_first=rope_first)
    assert not torch.isnan(grad_qkv).any(), "grad_qkv not fully written"
    ref64 = autograd_grads(*case, hq, hkv, d, dtype=torch.float64, rope_first=rope_first)
    ref_dt = autograd_grads(*case, hq, hkv, d, rope_first=rope_first)
    ours = {"grad_qkv": grad_qkv, "grad_cos": gcos, "grad_sin": gsin, "grad_q_weight": gqw, "grad_k_weight": gkw}
    order = {"grad_qkv": 0, "grad_cos": 1, "grad_sin": 2, "grad_q_weight": 3, "grad_k_weight": 4}
    errs = {}
    for name in NAMES:
        val = ours[name]
        if (name in ("grad_cos", "grad_sin") and not need_cs) or (name.endswith("weight") and not need_w):
            assert val is None
            continue
        assert val.dtype == dtype and val.shape == ref64[order[name]].shape, name
        errs[name] = rel_err(val, ref64[order[name]])
        assert errs[name] <= TOL_VS_F64[dtype], (name, errs[name])
        # Against the same-dtype eager autograd: never worse than what a user's eager run produces,
        # up to the final roundings of the sums (eager rounds the q and k parts of grad_cos/sin and
        # the weight grads separately, we round one fp32 total: <= 2 output ulps apart).
        eager_err = rel_err(ref_dt[order[name]], ref64[order[name]])
        assert errs[name] <= eager_err + 2 * ONE_ULP_REL[dtype], (name, errs[name], eager_err)
    # grad_qkv mirrors eager's roundings: bit-equal almost everywhere (only the fp32 summation
    # order of sum(gn * x) differs from autograd's), and never more than 1 ulp at the scale of
    # the RoPE backward's terms (where the sum cancels, one flipped rounding of dx is a few
    # ulps of the small result: 2 ulps of -0.0776 in a row reaching 4.4, seen on CPU).
    if dtype != torch.float32:
        diff = (grad_qkv.float() - ref_dt[0].float()).abs()
        terms = (rope_backward_term_scale if rope_first else norm_backward_term_scale)(*case, hq, hkv, d)
        scale = torch.maximum(ref_dt[0].double().abs(), terms).float()
        ulp = bf16_ulp(scale) if dtype == torch.bfloat16 else bf16_ulp(scale) / 8
        assert (diff <= ulp).all(), f"max diff {(diff / ulp).max().item():.2f} ulp"
        assert (diff == 0).float().mean().item() >= 0.99
    return errs


# ---------------------------------------------------------------------------------------------
# Elementwise pass (interpreter on CPU), both tilings: v5 token rows (the default) and v3 head
# tiles (kept selectable for comparison on the GPU)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(params=["token_rows", "head_tiles"])
def tiling(request, monkeypatch):
    monkeypatch.setattr(kb, "ELEMENTWISE_TILING", request.param)
    return request.param


both_tilings = pytest.mark.usefixtures("tiling")


@both_tilings
@pytest.mark.parametrize(
    "B,S,hq,hkv,d,bc,dtype",
    [
        (1, 5, 4, 2, 64, 1, torch.float32),  # B = 1
        (2, 7, 4, 1, 64, 2, torch.float32),  # Bc = B, GQA 4:1
        (3, 5, 4, 2, 64, 1, torch.float32),  # Bc = 1 < B: grad_cos summed over batch
        (2, 5, 8, 2, 128, 2, torch.bfloat16),
        (2, 7, 3, 3, 64, 1, torch.bfloat16),  # MHA with a non-power-of-two head count
        (1, 7, 4, 2, 128, 1, torch.float16),
    ],
)
def test_elementwise_matches_autograd(B, S, hq, hkv, d, bc, dtype):
    check_case(B, S, hq, hkv, d, bc, dtype)


@both_tilings
@pytest.mark.parametrize(
    "B,S,hq,hkv,d,bc,dtype",
    [
        (3, 5, 4, 2, 64, 1, torch.float32),  # Bc = 1 < B
        (2, 5, 8, 2, 128, 2, torch.bfloat16),
        (2, 7, 3, 3, 64, 1, torch.bfloat16),
        (1, 7, 4, 2, 128, 1, torch.float16),
    ],
)
def test_elementwise_norm_first_matches_autograd(B, S, hq, hkv, d, bc, dtype):
    """Qwen3's order, rope(norm(x)): the same kernels with ``rope_first=False``."""
    check_case(B, S, hq, hkv, d, bc, dtype, rope_first=False)


@both_tilings
@pytest.mark.parametrize("rope_first", [True, False])
@pytest.mark.parametrize(
    "B,S,hq,hkv,d,rotary_dim,bc,dtype",
    [
        (2, 5, 4, 2, 64, 32, 1, torch.float32),  # GLM-4.5: half the features rotated
        (2, 5, 4, 2, 64, 16, 2, torch.bfloat16),  # Qwen3-Next / Qwen3.5: a quarter
        (1, 7, 3, 1, 48, 20, 1, torch.bfloat16),  # rotary half not a power of two, D/2 padded
    ],
)
def test_elementwise_partial_rotary_matches_autograd(B, S, hq, hkv, d, rotary_dim, bc, dtype, rope_first):
    """Partial rotary: RoPE on the first rotary_dim features, the rest passed through (constexpr
    ROT_HALF); grad_cos / grad_sin are rotary_dim wide."""
    check_case(B, S, hq, hkv, d, bc, dtype, rope_first=rope_first, rotary_dim=rotary_dim)


@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("rope_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_autograd_in_both_orders(rope_first, dtype, rotary_dim):
    """The PyTorch reference (CPU graphs run it) in both orders, against float64 autograd."""
    from fusion_pass.kernels.qkv_rope_qk_norm_reference import qk_norm_rope_backward_reference

    hq, hkv, d, B, S = 4, 2, 64, 2, 5
    case = make_case(B, S, hq, hkv, d, 1, dtype, rotary_dim=rotary_dim)
    qkv, cos, sin, wq, wk, gq, gk, gv = case
    q, k, rq, rk = saved_for_backward(qkv, cos, sin, hq, hkv, d, rope_first)
    grad_qkv = torch.full((B * S, qkv.shape[-1]), float("nan"), device=qkv.device, dtype=dtype)
    parts = [t.view(B, S, -1) for t in grad_qkv.split([hq * d, hkv * d, hkv * d], dim=1)]
    gqw, gkw, gcos, gsin = qk_norm_rope_backward_reference(gq, gk, gv, q, k, rq, rk, cos, sin, wq, wk, *parts,
                                                           True, True, rope_first)
    ref64 = autograd_grads(*case, hq, hkv, d, dtype=torch.float64, rope_first=rope_first)
    for got, want in zip((grad_qkv.view(B, S, -1), gcos, gsin, gqw, gkw), ref64):
        assert rel_err(got, want) <= TOL_VS_F64[dtype]


@both_tilings
@pytest.mark.parametrize("need_w,need_cs", [(False, True), (True, False), (False, False)])
def test_elementwise_optional_grads(need_w, need_cs):
    check_case(2, 5, 4, 2, 64, 1, torch.bfloat16, need_w=need_w, need_cs=need_cs)


@both_tilings
def test_elementwise_real_rope_contiguous_grads_one_program():
    # one program walking all tokens; real rotary tables; contiguous [B, H, S, D] grads
    check_case(2, 5, 4, 2, 64, 2, torch.bfloat16, real_rope=True, num_programs=1, strided_grads=False)


@both_tilings
def test_elementwise_program_count_does_not_change_bits(tiling):
    """grad_qkv bits never depend on the grid. The sums: v3's cos/sin partials are per head block
    (grid-independent: same bits); v5 splits heads into more slices when the grid is small, so
    its cos/sin sums, like both kernels' weight sums, may move by one final rounding."""
    case = make_case(2, 7, 4, 2, 64, 1, torch.bfloat16, seed=3)
    a = run_kernel(*case, 4, 2, 64, num_programs=1)
    b = run_kernel(*case, 4, 2, 64, num_programs=5)
    assert torch.equal(a[0], b[0])
    summed = (1, 2, 3, 4) if tiling == "token_rows" else (1, 2)
    if tiling == "head_tiles":
        assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])
    for i in summed:
        assert (a[i].float() - b[i].float()).abs().le(bf16_ulp(a[i])).all(), i


@pytest.mark.parametrize("B,bc,slices", [(2, 1, 8), (2, 2, 4), (3, 3, 1), (1, 1, 2), (2, 1, 1)])
def test_token_rows_head_slices_and_cos_sin_paths(monkeypatch, B, bc, slices):
    """v5 grids: head slices (num_programs forces NS; 8 slices of 8 q heads leave the 2 k and v
    heads to slices 0-1, the rest have empty k/v loops), cos/sin written by the kernel itself
    (one slice, Bc = B) or summed over slices and batch by the finishing launch (Bc = 1 < B,
    also with one slice)."""
    monkeypatch.setattr(kb, "ELEMENTWISE_TILING", "token_rows")
    S = 7
    plan = kb._rows_plan(B, S, 8, 2, 64, bc, True, True, slices, kb.ROWS_TOKENS)
    assert plan.NS == slices and plan.cs_direct == (slices == 1 and bc == B)
    check_case(B, S, 8, 2, 64, bc, torch.bfloat16, seed=slices, num_programs=slices)


def test_auto_tiling_routes_by_token_count(monkeypatch):
    """v3 head tiles below ROWS_MIN_M tokens (measured faster there), v5 token rows from it."""
    monkeypatch.setattr(kb, "ELEMENTWISE_TILING", "auto")
    assert kb.elementwise_tiling(kb.ROWS_MIN_M - 1) == "head_tiles"
    assert kb.elementwise_tiling(kb.ROWS_MIN_M) == "token_rows"
    monkeypatch.setattr(kb, "ELEMENTWISE_TILING", "rows")
    with pytest.raises(ValueError, match="ELEMENTWISE_TILING"):
        kb.elementwise_tiling(4096)
    with pytest.raises(ValueError, match="ROWS_TOKENS: expected a power of two"):
        kb._rows_plan(2, 2048, 32, 8, 128, 2, True, True, 132, 24)
    # A head count that is not a power of two: slices never outnumber the q heads.
    assert kb._rows_plan(1, 5, 5, 1, 64, 1, True, True, 64, 16).NS == 4


def test_token_rows_plan_keeps_heads_together_at_large_m():
    """Suite B at M = 4096 with a 132-program target (one per H200 SM): every program owns all
    48 heads of its 16 tokens and writes grad_cos / grad_sin itself; at M = 128 the heads are
    split to fill the GPU."""
    big = kb._rows_plan(2, 2048, 32, 8, 128, 2, True, True, 132, 16)
    assert (big.BT, big.NS, big.programs, big.cs_direct, big.cs_programs) == (16, 1, 256, True, 0)
    small = kb._rows_plan(1, 128, 32, 8, 128, 1, True, True, 132, 16)
    assert (small.NS, small.programs, small.cs_direct) == (32, 256, False)
    assert small.cs_programs == 128  # the finishing sums: one token per program here


def test_elementwise_small_tiles_several_head_blocks(monkeypatch):
    monkeypatch.setattr(kb, "ELEMENTWISE_TILING", "head_tiles")
    """Tiles of 256 elements: 2 q head blocks, 1-token q tiles, programs walking several tiles;
    Bc = 1 < B so grad_cos/sin sum partials over head blocks and batch. grad_qkv bits do not
    depend on the tiling; the summed grads stay within 1 ulp."""
    case = make_case(2, 7, 8, 2, 64, 1, torch.bfloat16, seed=7)
    ref = run_kernel(*case, 8, 2, 64)
    monkeypatch.setattr(kb, "ELEMENTWISE_TILE_ELEMENTS", 256)
    monkeypatch.setattr(kb, "ELEMENTWISE_PROGRAMS_PER_SM", 2)
    check_case(2, 7, 8, 2, 64, 1, torch.bfloat16, seed=7)
    got = run_kernel(*case, 8, 2, 64)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:]):
        assert (a.float() - b.float()).abs().le(bf16_ulp(b)).all()


@both_tilings
@pytest.mark.parametrize("B,S,d,need_w,need_cs", [(1, 1, 64, True, True), (2, 3, 48, True, True),
                                                 (1, 4, 48, False, False)])
def test_elementwise_edge_shapes(B, S, d, need_w, need_cs):
    # a single token (M = 1); head_dim 48 (half 24 padded to 32: masked feature tail)
    check_case(B, S, 2, 1, d, 1, torch.bfloat16, need_w=need_w, need_cs=need_cs)


@both_tilings
def test_elementwise_accepts_workload_rstd_layout():
    """WORKLOADS.md B passes rstd as bf16 [B, H, S, 1]: upcast; error bounded by rstd's rounding."""
    case = make_case(2, 5, 4, 2, 64, 2, torch.bfloat16, seed=1)
    out = run_kernel(*case, 4, 2, 64, rstd_override=lambda r: r.to(torch.bfloat16).unsqueeze(-1))
    ref64 = autograd_grads(*case, 4, 2, 64, dtype=torch.float64)
    grad_qkv, gqw, gkw, gcos, gsin = out
    for val, ref in zip((grad_qkv, gcos, gsin, gqw, gkw), ref64):
        assert rel_err(val, ref) < 4e-2


@both_tilings
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 3), S=st.integers(1, 6), hkv=st.integers(1, 2), group=st.integers(1, 3),
    bc_is_b=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99),
)
def test_elementwise_random_shapes(B, S, hkv, group, bc_is_b, dtype, seed):
    check_case(B, S, hkv * group, hkv, 64, B if bc_is_b else 1, dtype, seed=seed)


def test_elementwise_rejects_mixed_dtypes():
    qkv, cos, sin, wq, wk, gq, gk, gv = make_case(1, 3, 2, 1, 64, 1, torch.bfloat16)
    q, k = qkv[..., :128].view(1, 3, 2, 64), qkv[..., 128:192].view(1, 3, 1, 64)
    assert kb.elementwise_supported(gq, gk, gv, q, k, cos, sin, wq, wk)
    assert not kb.elementwise_supported(gq, gk, gv, q, k, cos.float(), sin.float(), wq, wk)
    with pytest.raises(ValueError, match="cos"):
        run_kernel(qkv, cos.float(), sin.float(), wq, wk, gq, gk, gv, 2, 1, 64)


# ---------------------------------------------------------------------------------------------
# GPU: the 16 cases of WORKLOADS.md B, whole backward (elementwise pass + GEMMs) vs float64
# ---------------------------------------------------------------------------------------------
WORKLOAD_B_CASES = [(128, 1), (128, 4), (128, 16), (128, 32), (128, 64), (131, 1), (256, 1), (256, 8),
                    (256, 16), (256, 32), (293, 2), (512, 1), (541, 4), (1024, 2), (1571, 1), (2048, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("S,B", WORKLOAD_B_CASES)
def test_gpu_workload_b_whole_backward(S, B):
    hq, hkv, d, hidden_size = 32, 8, 128, 4096
    gen = torch.Generator(device="cuda").manual_seed(S * 100 + B)
    dt = torch.bfloat16
    hidden = torch.randn(B, S, hidden_size, device="cuda", generator=gen).to(dt)
    W = (torch.randn((hq + 2 * hkv) * d, hidden_size, device="cuda", generator=gen) * 0.02).to(dt)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    ang = torch.arange(S, device="cuda").float()[:, None] * inv
    emb = torch.cat((ang, ang), -1)[None].expand(B, S, d)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    wq = (1 + 0.2 * torch.randn(d, device="cuda", generator=gen)).to(dt)
    wk = (1 + 0.2 * torch.randn(d, device="cuda", generator=gen)).to(dt)
    gq = torch.randn(B, hq, S, d, device="cuda", generator=gen).to(dt)
    gk = torch.randn(B, hkv, S, d, device="cuda", generator=gen).to(dt)
    gv = torch.randn(B, hkv, S, d, device="cuda", generator=gen).to(dt)

    qkv = (hidden.view(B * S, -1) @ W.t()).view(B, S, -1)
    q, k, rq, rk = saved_for_backward(qkv, cos, sin, hq, hkv, d)
    got = kb.full_backward_triton(gq, gk, gv, q, k, rq, rk, cos, sin, wq, wk, hidden.view(B * S, -1), W)

    leaves = [t.double().requires_grad_(True) for t in (hidden, W, cos, sin, wq, wk)]
    qkv64 = (leaves[0].view(B * S, -1) @ leaves[1].t()).view(B, S, -1)
    outs = forward_from_qkv(qkv64, *leaves[2:], hq, hkv, d)
    torch.autograd.backward(outs, [g.double() for g in (gq, gk, gv)])
    names = ("grad_hidden", "grad_W", "grad_cos", "grad_sin", "grad_q_weight", "grad_k_weight")
    refs = [leaves[0].grad.view(B * S, -1), leaves[1].grad, leaves[2].grad, leaves[3].grad,
            leaves[4].grad, leaves[5].grad]
    vals = [got["grad_hidden"], got["grad_weight"], got["grad_cos"], got["grad_sin"],
            got["grad_q_weight"], got["grad_k_weight"]]
    errs = {n: rel_err(v, r) for n, v, r in zip(names, vals, refs)}
    print(f"S={S} B={B} rel errs vs float64: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < 3e-2, (n, e)
