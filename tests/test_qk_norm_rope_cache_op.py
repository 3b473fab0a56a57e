"""The custom op's contract: argument checks that name the argument, the cache semantics
(a position outside the cache raises, as ``index_copy_`` does), eager layouts."""

from __future__ import annotations

import re

import pytest
import torch

from fusion_pass.kernels.qk_norm_rope_cache_reference import qk_norm_rope_cache_reference

op = torch.ops.fusion_pass.qk_norm_rope_cache


def make_args(batch=2, q_heads=4, kv_heads=2, seq=5, head_dim=16, cache_len=12, dtype=torch.bfloat16, past=3):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return dict(
        q=r(batch, seq, q_heads, head_dim).transpose(1, 2),  # Hugging Face's transposed view
        k=r(batch, seq, kv_heads, head_dim).transpose(1, 2),
        v=r(batch, seq, kv_heads, head_dim).transpose(1, 2),
        q_weight=r(head_dim), k_weight=r(head_dim),
        cos=r(batch, seq, head_dim), sin=r(batch, seq, head_dim),
        k_cache=r(batch, kv_heads, cache_len, head_dim), v_cache=r(batch, kv_heads, cache_len, head_dim),
        cache_position=torch.arange(past, past + seq), q_eps=1e-6, k_eps=1e-5,
    )


def test_matches_reference_and_keeps_eager_layout():
    args = make_args()
    ref = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    q_out, k_out = op(**args)
    q_ref, k_ref = qk_norm_rope_cache_reference(**ref)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.stride() == args["q"].stride() and k_out.stride() == args["k"].stride()
    assert torch.equal(args["k_cache"], ref["k_cache"]) and torch.equal(args["v_cache"], ref["v_cache"])


def test_negative_positions_count_from_the_end():
    args = make_args(seq=5, cache_len=6)
    args["cache_position"] = torch.tensor([5, 1, -2, -6, 3])  # -2 is row 4, -6 row 0 of 6
    before_k, before_v = args["k_cache"].clone(), args["v_cache"].clone()
    q_out, k_out = op(**args)
    for pos, s in ((5, 0), (1, 1), (4, 2), (0, 3), (3, 4)):
        assert torch.equal(args["k_cache"][:, :, pos], k_out[:, :, s])
        assert torch.equal(args["v_cache"][:, :, pos], args["v"][:, :, s])
    untouched = [2]
    assert torch.equal(args["k_cache"][:, :, untouched], before_k[:, :, untouched])
    assert torch.equal(args["v_cache"][:, :, untouched], before_v[:, :, untouched])


@pytest.mark.parametrize("bad", [6, -7, 2**40])
def test_a_position_outside_the_cache_raises_like_index_copy_before_any_write(bad):
    """Eager ``index_copy_`` raises ``IndexError``; a silent skip would hide a serving bug that
    then attends over a stale row (issue 18 item 2). Nothing is written first."""
    args = make_args(seq=5, cache_len=6)
    args["cache_position"] = torch.tensor([5, bad, -2, 0, 1])
    before_k, before_v = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(IndexError, match=rf"cache_position: index {bad} is out of bounds for a cache of 6 rows"):
        op(**args)
    with pytest.raises(IndexError):
        args["k_cache"].index_copy_(2, torch.tensor([bad]), args["k"][:, :, :1])
    assert torch.equal(args["k_cache"], before_k) and torch.equal(args["v_cache"], before_v)


@pytest.mark.parametrize(
    "change,name,expected",
    [
        (lambda a: a.update(k=a["k"].float()), "k", "dtype"),
        (lambda a: a.update(q=a["q"].to(torch.int32)), "q", "dtype"),
        (lambda a: a.update(k_weight=a["k_weight"][:8]), "k_weight", "shape [16]"),
        (lambda a: a.update(k=a["k"][..., :8], v=a["v"][..., :8]), "k", "D=16"),
        (lambda a: a.update(k_cache=a["k_cache"][:, :, :3]), "k_cache", "too short"),
        (lambda a: a.update(v_cache=a["v_cache"].to(torch.float16)), "v_cache", "dtype"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :, :8]), "v_cache", "k_cache's length"),
        (lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)), "q", "contiguous last dim"),
        (lambda a: a.update(cos=a["cos"][:, :3]), "cos", "shape"),
        (lambda a: a.update(cache_position=a["cache_position"].float()), "cache_position", "dtype"),
        (lambda a: a.update(k=torch.randn(2, 3, 5, 16).to(torch.bfloat16), v=torch.randn(2, 3, 5, 16).to(torch.bfloat16)), "k", "GQA"),
    ],
)
def test_bad_calls_name_the_argument_and_write_nothing(change, name, expected):
    args = make_args()
    change(args)
    caches = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(ValueError, match=rf"{name}: expected .*{re.escape(expected)}"):
        op(**args)
    assert torch.equal(args["k_cache"], caches[0]) and torch.equal(args["v_cache"], caches[1])
