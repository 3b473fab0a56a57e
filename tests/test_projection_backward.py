"""The projection GEMMs of the training backward (kernels/projection_backward.py) against float64."""

from __future__ import annotations

import pytest
import torch

from fusion_pass.kernels import projection_backward as pb

TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def rel_err(a, ref):
    """max |a - ref| / max |ref|."""
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("columns", [False, True])
def test_gemms_match_float64(dtype, columns):
    """grad_hidden (accumulated over three projections), grad_W and grad_b; with ``columns`` the
    grads are column slices of one buffer, as the elementwise pass writes them."""
    gen = torch.Generator().manual_seed(0)
    M, K, sizes = 37, 48, (64, 32, 32)
    buffer = torch.randn(M, sum(sizes), generator=gen).to(dtype)
    grads = list(buffer.split(sizes, 1)) if columns else [g.contiguous() for g in buffer.split(sizes, 1)]
    hidden = torch.randn(M, K, generator=gen).to(dtype)
    weights = [(torch.randn(n, K, generator=gen) * 0.1).to(dtype) for n in sizes]
    gh, gws, gbs = pb.projection_gemms(grads, hidden, weights, need_bias_grad=True)
    ref_h = sum(g.double() @ w.double() for g, w in zip(grads, weights))
    assert rel_err(gh, ref_h) < TOL[dtype]
    for g, gw, gb in zip(grads, gws, gbs):
        assert rel_err(gw, g.double().t() @ hidden.double()) < TOL[dtype]
        assert rel_err(gb, g.double().sum(0)) < TOL[dtype]


def test_flags_skip_gradients():
    g, x, w = torch.randn(8, 16), torch.randn(8, 4), torch.randn(16, 4)
    gh, gws, gbs = pb.projection_gemms([g], x, [w], need_hidden_grad=False, need_weight_grad=True)
    assert gh is None and gws[0] is not None and gbs == [None]
    gh, gws, _ = pb.projection_gemms([g], x, [w], need_weight_grad=False)
    assert gh is not None and gws == [None]


def test_bad_arguments_name_themselves():
    g, x, w = torch.randn(8, 16), torch.randn(8, 4), torch.randn(16, 4)
    with pytest.raises(ValueError, match="grads and weights"):
        pb.projection_gemms([g], x, [w, w])
    with pytest.raises(ValueError, match=r"weights\[0\]"):
        pb.projection_gemms([g], x, [w.t()])
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        pb.projection_gemms([g[:4]], x, [w])
    with pytest.raises(ValueError, match="hidden"):
        pb.projection_gemms([g], x[None], [w])
