"""Every rewrite of ``patterns/canonical_forms.py`` keeps the values: a graph computing a spelling,
canonicalized, gives the same bits on random inputs, and the rewrite did change it. (The fusion tests
show the canonical forms match; these show the rewrites are exact wherever they apply.)"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.pattern_matcher import fwd_only

from fusion_pass.patterns import canonical_forms as cf

D = 16


def norm_spellings(x):
    h = x.float()
    sum_over_size = h.pow(2).sum(-1, keepdim=True) / D             # sums_over_size_as_means
    unsqueezed = (h * h).mean(3).unsqueeze(-1)                      # square, dims, keepdim
    stat = torch.rsqrt(unsqueezed + 1e-6) * h                       # broadcast factor second
    return stat.to(x.dtype), torch.rsqrt(sum_over_size + 1e-6)


def rotation_spellings(x, cos, sin):
    d = x.shape[-1] // 2
    rotated = torch.cat((x.narrow(-1, d, d) * -1, x[..., 0:d]), dim=3)  # neg, slices, cat dim
    return sin * rotated + cos * x                                       # both orders


def functional_norm(x):
    return torch.nn.functional.rms_norm(x.float(), (D,), eps=1e-6).to(x.dtype)  # add_ / add.Scalar


CASES = {
    "norm": (norm_spellings, lambda g: [torch.randn(2, 5, 4, D, generator=g).bfloat16()]),
    "rotation": (rotation_spellings, lambda g: [torch.randn(2, 4, 5, D, generator=g).bfloat16(),
                                                torch.randn(2, 1, 5, D, generator=g).bfloat16(),
                                                torch.randn(2, 1, 5, D, generator=g).bfloat16()]),
    "functional_norm": (functional_norm, lambda g: [torch.randn(2, 5, 4, D, generator=g).bfloat16()]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_canonical_rewrites_keep_every_bit(name):
    fn, make = CASES[name]
    g = torch.Generator().manual_seed(0)
    inputs = make(g)
    gm = fwd_only(fn, inputs)
    before = gm.graph.python_code("self").src
    assert cf.canonicalize(gm.graph) > 0
    gm.recompile()
    assert gm.graph.python_code("self").src != before
    for seed in range(5):
        args = make(torch.Generator().manual_seed(seed))
        got, want = gm(*args), fn(*args)
        got, want = (tuple(t) if isinstance(t, (tuple, list)) else (t,) for t in (got, want))
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_integer_sums_are_not_means():
    gm = fwd_only(lambda x: x.sum(-1, keepdim=True) / 4, [torch.ones(3, 4, dtype=torch.int64)])
    cf.sums_over_size_as_means(gm.graph)
    assert not any(n.target is torch.ops.aten.mean.dim for n in gm.graph.nodes)
