"""The rewrites each family runs before matching (``fusion_pass.rewrites``), and their undos as pairs.

Every family declares its ``REWRITES``; a rewrite that changes a layout cannot be declared without
its undo. Each rewrite that carries an undo is run here with it on a graph it changes, with no
fusion in between: the graph must compute the same values, with the same ops and the same output
strides, as before the rewrite (what stock Inductor would have compiled).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch._inductor.pattern_matcher import fwd_only

from fusion_pass import config as fusion_config
from fusion_pass.families import NAMES, pattern_module
from fusion_pass.patterns import cache_write_forms, canonical_forms
from fusion_pass.rewrites import Rewrite, apply_rewrites, rewritten, undo_rewrites

aten = torch.ops.aten
D = 16


def test_every_family_declares_its_rewrites():
    for name in NAMES:
        declared = pattern_module(name).REWRITES
        assert isinstance(declared, tuple) and all(isinstance(r, Rewrite) for r in declared), name


def test_a_rewrite_that_changes_a_layout_must_carry_its_undo():
    with pytest.raises(ValueError, match="undo: contiguous_copies_dropped changes a layout"):
        Rewrite(canonical_forms.contiguous_copies_dropped, preserves_layout=False)


def _copy_then_rotation(x, cos, sin):
    x = (x * 2).transpose(1, 2).contiguous()
    d = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., d:], x[..., :d]), -1) * sin


def _half_table_rotation(x, cos, sin):
    c, s = cos[..., :D // 2], sin[..., :D // 2]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def _slice_write(cache, k):
    """``cache[:, :, 2:6] = k``, as functionalization spells it."""
    return aten.slice_scatter.default(cache, aten.copy.default(aten.slice.Tensor(cache, 2, 2, 6), k), 2, 2, 6)


def _bf16(*shape):
    return lambda g: torch.randn(*shape, generator=g).bfloat16()


#: Each rewrite with an undo: a function whose traced graph it changes, and its inputs' makers.
PAIRS = {
    canonical_forms.CONTIGUOUS_COPIES: (_copy_then_rotation, [_bf16(2, 5, 4, D), _bf16(2, 1, 5, D), _bf16(2, 1, 5, D)]),
    canonical_forms.HALF_TABLE_ROTATIONS: (_half_table_rotation,
                                           [_bf16(2, 4, 5, D), _bf16(2, 1, 5, D), _bf16(2, 1, 5, D)]),
    cache_write_forms.SLICE_WRITES: (_slice_write, [_bf16(2, 3, 8, D), _bf16(2, 3, 4, D)]),
}


def test_every_rewrite_with_an_undo_is_tested_as_a_pair():
    with_undo = {r for name in NAMES for r in pattern_module(name).REWRITES if r.undo is not None}
    assert with_undo == set(PAIRS), sorted(r.name for r in with_undo ^ set(PAIRS))


def _ops(gm) -> collections.Counter:
    return collections.Counter((n.op, str(n.target)) for n in gm.graph.nodes)


@pytest.mark.parametrize("rewrite", list(PAIRS), ids=lambda r: r.name)
def test_a_rewrite_and_its_undo_give_back_what_stock_inductor_would_compile(rewrite):
    fn, makers = PAIRS[rewrite]
    inputs = [make(torch.Generator().manual_seed(0)) for make in makers]
    gm = fwd_only(fn, inputs)
    before = _ops(gm)
    want = gm(*inputs)
    with fusion_config.using(fusion_config.FusionConfig.make(devices="cpu")):
        applied = apply_rewrites(gm.graph, [rewrite])
        assert _ops(gm) != before  # the rewrite applies to this graph
        gm.recompile()
        assert torch.equal(gm(*inputs), want)
        undo_rewrites(gm.graph, applied)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    assert _ops(gm) == before
    got = gm(*inputs)
    assert torch.equal(got, want) and got.stride() == want.stride()


def test_undos_run_last_rewrite_first_and_only_on_a_normal_exit():
    calls = []

    def rewrite(tag):
        def run(graph):
            calls.append(f"run {tag}")
            return tag

        run.__name__ = f"rewrite_{tag}"
        return Rewrite(run, preserves_layout=False, undo=lambda graph, record: calls.append(f"undo {record}"))

    graph = torch.fx.Graph()
    with rewritten(graph, [rewrite("a"), Rewrite(lambda graph: calls.append("run b"), preserves_layout=True),
                           rewrite("c")]):
        calls.append("match")
    assert calls == ["run a", "run b", "run c", "match", "undo c", "undo a"]
    calls.clear()
    with pytest.raises(KeyError), rewritten(graph, [rewrite("a")]):
        raise KeyError("fault")  # the family's transaction puts the graph back, not the undos
    assert calls == ["run a"]
