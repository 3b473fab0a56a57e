"""Suite B's workload (WORKLOADS.md section B): its geometry, inputs, the eager backward, the calls
timed and the float64 reference.

Every function takes the geometry from its inputs (``make_inputs`` records it under ``"geometry"``),
so the CPU check runs the same code on a tiny one.
"""

from __future__ import annotations

import dataclasses

import torch

from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as kb

EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Heads and widths of the attention prologue (the suite's: Llama-3-8B-like)."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096

    @property
    def qkv(self) -> int:
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim


SUITE = Geometry()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_t(y):
    """Transpose of rotate_half: <rotate_half(x), y> = <x, rotate_half_t(y)>."""
    y1, y2 = y.chunk(2, dim=-1)
    return torch.cat((y2, -y1), dim=-1)


def forward(hidden, W, cos, sin, wq, wk, B, S, g: Geometry):
    """The workload's forward: qkv = hidden @ W.T, then per head RoPE -> RMSNorm on q and k."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    qkv = (hidden @ W.t()).view(B, S, g.qkv)
    q, k, v = qkv.split([g.q_heads * g.head_dim, g.kv_heads * g.head_dim, g.kv_heads * g.head_dim], dim=-1)
    q = q.view(B, S, g.q_heads, g.head_dim).transpose(1, 2)
    k = k.view(B, S, g.kv_heads, g.head_dim).transpose(1, 2)
    v = v.view(B, S, g.kv_heads, g.head_dim).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    outs = []
    for x, w in ((q, wq), (k, wk)):
        x = x * c + rotate_half(x) * s
        x32 = x.to(acc)
        outs.append(w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype))
    return outs[0], outs[1], v


def eager_backward(grad_query, grad_key, grad_value, hidden_states, cos, sin, qkv_weight,
                   q_norm_weight, k_norm_weight, query_pre_norm, key_pre_norm, q_rstd, k_rstd):
    """WORKLOADS.md B backward from its inputs, with autograd's gradients (inverse rotation).

    grad_query [B, Hq, S, D], grad_key / grad_value [B, Hkv, S, D], hidden_states [B, S, hidden],
    cos / sin [B, S, D], qkv_weight [qkv, hidden], *_pre_norm as the grads, *_rstd [B, H, S, 1].
    Returns (grad_hidden, grad_cos, grad_sin, grad_qkv_weight, grad_q_norm_w, grad_k_norm_w)."""
    B, _, S, _ = grad_query.shape
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)

    def norm_rope_bwd(g, x, r, w):
        g, x, r, w = g.float(), x.float(), r.float(), w.float()
        gw = (g * x * r).sum((0, 1, 2))
        gn = g * w
        dx = r * (gn - x * r * r * (gn * x).mean(-1, keepdim=True))
        q = x * c - rotate_half(x) * s  # un-rotate: the inverse of x = q*c + rotate_half(q)*s
        gcos = (dx * q).sum(1)
        gsin = (dx * rotate_half(q)).sum(1)
        dq = dx * c + rotate_half_t(dx * s)
        return dq, gw, gcos, gsin

    dq, gwq, gcq, gsq = norm_rope_bwd(grad_query, query_pre_norm, q_rstd, q_norm_weight)
    dk, gwk, gck, gsk = norm_rope_bwd(grad_key, key_pre_norm, k_rstd, k_norm_weight)
    dt = hidden_states.dtype
    grad_qkv = torch.cat([dq.transpose(1, 2).reshape(B, S, -1), dk.transpose(1, 2).reshape(B, S, -1),
                          grad_value.float().transpose(1, 2).reshape(B, S, -1)], dim=-1)
    grad_qkv = grad_qkv.reshape(B * S, -1).to(dt)
    h2 = hidden_states.reshape(B * S, -1)
    grad_hidden = (grad_qkv @ qkv_weight).view(B, S, -1)
    grad_w = grad_qkv.t() @ h2
    return (grad_hidden, (gcq + gck).to(dt), (gsq + gsk).to(dt), grad_w, gwq.to(dt), gwk.to(dt))


def make_inputs(S, B, device, g: Geometry = SUITE, dtype=torch.bfloat16) -> dict:
    """One case's tensors, consistent with each other: q/k, the pre-norm values and rstd all derived
    from hidden @ W.T; random upstream grads."""
    gen = torch.Generator(device=device).manual_seed(1000 * S + B)
    D = g.head_dim

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    hidden = rnd(B, S, g.hidden)
    W = rnd(g.qkv, g.hidden, scale=g.hidden ** -0.5)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    ang = torch.arange(S, device=device).float()[:, None] * inv
    emb = torch.cat((ang, ang), -1)[None].expand(B, S, D)
    cos, sin = emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()
    wq, wk = 1 + rnd(D, scale=0.2), 1 + rnd(D, scale=0.2)
    gq, gk, gv = rnd(B, g.q_heads, S, D), rnd(B, g.kv_heads, S, D), rnd(B, g.kv_heads, S, D)

    qkv = (hidden.view(B * S, -1) @ W.t()).view(B, S, g.qkv)
    q = qkv[..., : g.q_heads * D].view(B, S, g.q_heads, D)
    k = qkv[..., g.q_heads * D: (g.q_heads + g.kv_heads) * D].view(B, S, g.kv_heads, D)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def pre_norm(x):
        xt = x.transpose(1, 2)
        xr = xt * c + rotate_half(xt) * s
        return xr, torch.rsqrt(xr.float().pow(2).mean(-1) + EPS)

    xq, rq = pre_norm(q)
    xk, rk = pre_norm(k)
    return dict(geometry=g, hidden=hidden, W=W, cos=cos, sin=sin, wq=wq, wk=wk, gq=gq, gk=gk, gv=gv,
                q=q, k=k, rq=rq, rk=rk, xq=xq.contiguous(), xk=xk.contiguous())


def workload_args(t):
    """The workload's argument list (bf16 rstd [B, H, S, 1], as the suite passes it)."""
    return (t["gq"], t["gk"], t["gv"], t["hidden"], t["cos"], t["sin"], t["W"], t["wq"], t["wk"],
            t["xq"], t["xk"], t["rq"].to(t["hidden"].dtype).unsqueeze(-1),
            t["rk"].to(t["hidden"].dtype).unsqueeze(-1))


def ours(t):
    """The op the training pass puts into the backward graph, called as the compiled graph calls it."""
    gh, gw, _, gnorm, gcs = torch.ops.fusion_pass.qkv_rope_qk_norm_backward(
        t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"], t["wk"],
        t["hidden"], [t["W"]], False, True, True, True, True)
    return gh[0], gcs[0], gcs[1], gw[0], gnorm[0], gnorm[1]


def ours_kernels(t):
    """The same kernels through the Python entry point, without the op's dispatch and checks."""
    B, S = t["hidden"].shape[:2]
    out = kb.full_backward_triton(t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"],
                                  t["sin"], t["wq"], t["wk"], t["hidden"].view(B * S, -1), t["W"])
    return (out["grad_hidden"].view(B, S, -1), out["grad_cos"], out["grad_sin"], out["grad_weight"],
            out["grad_q_weight"], out["grad_k_weight"])


def elementwise_call(t):
    """The elementwise pass alone, into one [M, qkv] buffer (a callable for timing)."""
    g = t["geometry"]
    B, S = t["hidden"].shape[:2]
    grad_qkv = torch.empty(B * S, g.qkv, device=t["hidden"].device, dtype=t["hidden"].dtype)
    nq, nk = g.q_heads * g.head_dim, g.kv_heads * g.head_dim

    def elementwise():
        return kb.qk_norm_rope_backward_triton(
            t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"],
            t["wk"], grad_qkv[:, :nq], grad_qkv[:, nq: nq + nk], grad_qkv[:, nq + nk:], True, True)

    return elementwise


def reference64(t):
    """float64 autograd of ``forward``: (grad_hidden, grad_cos, grad_sin, grad_W, grad_wq, grad_wk)."""
    B, S = t["hidden"].shape[:2]
    leaves = [t[n].double().requires_grad_(True) for n in ("hidden", "W", "cos", "sin", "wq", "wk")]
    outs = forward(leaves[0].view(B * S, -1), *leaves[1:], B, S, t["geometry"])
    torch.autograd.backward(outs, [t[n].double() for n in ("gq", "gk", "gv")])
    h, W, c, s, wq, wk = (x.grad for x in leaves)
    return h, c, s, W, wq, wk


def rel_err(vals, refs):
    """max |v - r| / max |r| per output, and the largest of them."""
    errs = [((v.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for v, r in zip(vals, refs)]
    return max(errs), errs


def bytes_moved(S, B, g: Geometry = SUITE, el=2):
    """Bytes the backward must move: grads in, saved q/k/rstd/cos/sin, weights, hidden, outputs."""
    M = B * S
    D = g.head_dim
    grads_in = M * g.qkv * el  # grad_q, grad_k, grad_v
    saved = M * (g.q_heads + g.kv_heads) * D * el + M * (g.q_heads + g.kv_heads) * el + 2 * B * S * D * el
    weights = g.qkv * g.hidden * el + 2 * D * el  # W, norm weights
    hidden = M * g.hidden * el
    outs = M * g.hidden * el + g.qkv * g.hidden * el + 2 * B * S * D * el + 2 * D * el
    return grads_in + saved + weights + hidden + outs
