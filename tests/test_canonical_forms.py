"""Every rewrite of ``patterns/canonical_forms.py`` keeps the values: a graph computing a spelling,
canonicalized, gives the same bits on random inputs, and the rewrite did change it. (The fusion tests
show the canonical forms match; these show the rewrites are exact wherever they apply.)"""

from __future__ import annotations

import operator

import pytest
import torch
from torch._inductor.pattern_matcher import fwd_only

from fusion_pass.patterns import canonical_forms as cf

D = 16
aten = torch.ops.aten


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


def _outputs(fn, args) -> tuple:
    """``fn(*args)`` as a tuple of tensors."""
    out = fn(*args)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


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
        got, want = _outputs(gm, args), _outputs(fn, args)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_integer_sums_are_not_means():
    gm = fwd_only(lambda x: x.sum(-1, keepdim=True) / 4, [torch.ones(3, 4, dtype=torch.int64)])
    cf.sums_over_size_as_means(gm.graph)
    assert not any(n.target is torch.ops.aten.mean.dim for n in gm.graph.nodes)


def assert_canonicalize_keeps_values(fn, args):
    """``fn`` traced and canonicalized computes what ``fn`` does: the same shapes, dtypes and bits."""
    gm = fwd_only(fn, args)
    cf.canonicalize(gm.graph)
    gm.recompile()
    got, want = _outputs(gm, args), _outputs(fn, args)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)


def test_a_half_precision_sum_over_size_is_not_a_mean():
    """An fp16 sum is rounded to fp16 before the division: 4 x 30000 overflows where the mean does not."""
    x = torch.full((2, 4), 30000.0, dtype=torch.float16)
    assert torch.isinf(x.sum(-1, keepdim=True) / 4).all()
    assert_canonicalize_keeps_values(lambda x: x.sum(-1, keepdim=True) / 4, [x])


def test_zero_dim_sums_and_means_keep_their_shapes():
    x = torch.tensor(3.0)
    assert_canonicalize_keeps_values(lambda x: x.sum(-1) / 1, [x])
    assert_canonicalize_keeps_values(lambda x: x.mean(-1).unsqueeze(-1), [x])


def test_reductions_over_every_dim_are_left_as_they_are():
    """``dim=None`` (a reduction over all dims) is no ``-1`` reduction."""
    aten = torch.ops.aten
    x = torch.randn(3, 4)
    assert_canonicalize_keeps_values(lambda x: aten.sum.dim_IntList(x, None, True) / 4, [x])
    assert_canonicalize_keeps_values(lambda x: aten.mean.dim(x, None).unsqueeze(-1), [x])


def test_a_complex_product_by_minus_one_is_not_a_negation():
    """(inf + 0j) * -1 is (-inf + nanj) in torch's complex product; -(inf + 0j) is (-inf - 0j)."""
    x = torch.tensor([complex(float("inf"), 0.0), complex(1.0, -2.0)])
    gm = fwd_only(lambda x: x * -1, [x])
    assert cf.negative_units_as_neg(gm.graph) == 0


def _hand_built(build) -> torch.fx.GraphModule:
    """A graph built node by node, with only the meta values ``build`` sets."""
    graph = torch.fx.Graph()
    graph.output(build(graph, graph.placeholder("x")))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_rewrites_pass_over_nodes_without_meta_values():
    """A node whose input has no meta value (a pass before ours made it) is left, not a crash."""
    aten = torch.ops.aten

    def build(g, x):
        product = g.call_function(aten.mul.Tensor, (x, -1))
        product.meta["val"] = torch.empty(2)
        return product

    gm = _hand_built(build)
    cf.canonicalize(gm.graph)
    gm.recompile()
    assert torch.equal(gm(torch.ones(2)), -torch.ones(2))


def test_an_in_place_add_to_a_view_still_writes_its_base():
    """``base[:, :2].add_(1)`` changes ``base``: rewritten out of place it would not."""
    aten = torch.ops.aten

    def build(g, x):
        base = g.call_function(aten.clone.default, (x,))
        view = g.call_function(aten.slice.Tensor, (base, 1, 0, 2))
        g.call_function(aten.add_.Tensor, (view, 1.0))
        return base

    gm = _hand_built(build)
    x = torch.zeros(2, 4)
    gm.graph.lint()
    cf.canonicalize(gm.graph)
    gm.recompile()
    assert torch.equal(gm(x), torch.tensor([[1.0, 1, 0, 0], [1, 1, 0, 0]]))


def test_two_dim_cats_keep_the_dim_inductors_own_patterns_match():
    """Inductor's ``cat_slice_cat`` matches ``cat(.., 1)`` of 2-D tensors; a last-dim cat of head
    tensors (3-D and up) is the one counted from the end."""
    aten = torch.ops.aten
    two = fwd_only(lambda a, b: torch.cat((a, b), 1), [torch.ones(2, 3), torch.ones(2, 4)])
    four = fwd_only(lambda a, b: torch.cat((a, b), 3), [torch.ones(1, 2, 2, 3), torch.ones(1, 2, 2, 4)])
    cf.canonicalize(two.graph), cf.canonicalize(four.graph)
    assert [n.args[1] for n in two.graph.find_nodes(op="call_function", target=aten.cat.default)] == [1]
    assert [n.args[1] for n in four.graph.find_nodes(op="call_function", target=aten.cat.default)] == [-1]


def _clones(gm) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default))


def test_a_copy_read_through_a_view_stays():
    """``.contiguous().view(-1)``: a view needs the copy's strides."""
    gm = fwd_only(lambda x: (x * 2).transpose(0, 1).contiguous().view(-1), [torch.randn(3, 4)])
    assert cf.contiguous_copies_dropped(gm.graph) == [] and _clones(gm) == 1


def _copy_of_a_tensor_written_later(g, x):
    """The copy holds the value from before the in-place add; read through x, it would see the add."""
    doubled = g.call_function(aten.mul.Tensor, (x, 2.0))
    copy = g.call_function(aten.clone.default, (g.call_function(aten.t.default, (doubled,)),))
    g.call_function(aten.add_.Tensor, (doubled, 1.0))
    return g.call_function(aten.mul.Tensor, (copy, 3.0))


def _copy_of_an_in_place_result_written_again(g, x):
    """``y = x.mul(2).add_(1)`` aliases the product; a later ``add_`` to the product changes y too."""
    doubled = g.call_function(aten.mul.Tensor, (x, 2.0))
    copy = g.call_function(aten.clone.default, (g.call_function(aten.add_.Tensor, (doubled, 1.0)),))
    g.call_function(aten.add_.Tensor, (doubled, 1.0))
    return g.call_function(aten.mul.Tensor, (copy, 1.0))


def _copy_of_a_split_written_later(g, x):
    """``y = x.mul(2).split(2)[0]`` shares the product's storage; an ``add_`` to y later changes the
    copy's source (a write followed back through ``getitem`` of a view op)."""
    doubled = g.call_function(aten.mul.Tensor, (x, 2.0))
    first = g.call_function(operator.getitem, (g.call_function(aten.split.Tensor, (doubled, 2)), 0))
    copy = g.call_function(aten.clone.default, (doubled,))
    g.call_function(aten.add_.Tensor, (first, 1.0))
    return g.call_function(aten.mul.Tensor, (copy, 1.0))


@pytest.mark.parametrize("build,x,want", [
    (_copy_of_a_tensor_written_later, torch.ones(2, 3), torch.full((3, 2), 6.0)),
    (_copy_of_an_in_place_result_written_again, torch.ones(2), torch.full((2,), 3.0)),
    (_copy_of_a_split_written_later, torch.ones(4), torch.full((4,), 2.0)),
], ids=["written_later", "in_place_result_written_again", "split_written_later"])
def test_a_copy_of_a_tensor_written_later_stays(build, x, want):
    gm = _hand_built(build)
    assert cf.contiguous_copies_dropped(gm.graph) == [] and _clones(gm) == 1
    gm.recompile()
    assert torch.equal(gm(x), want)


def test_a_copy_of_a_graph_input_stays():
    """A graph input may be written by the caller's graph around this one (and is not ours to alias)."""
    gm = fwd_only(lambda x: x.transpose(0, 1).contiguous() * 2, [torch.randn(3, 4)])
    assert cf.contiguous_copies_dropped(gm.graph) == [] and _clones(gm) == 1


def half_table_rope(x, cos, sin):
    c, s = cos[..., :D // 2], sin[..., :D // 2]
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1), torch.cat((c * x2 - s * x1, s * x2 + x1 * c), -1)


def test_half_table_rotations_keep_every_bit():
    """Both the RoPE of x and a look-alike (x's halves swapped, so not x's rotation) traced; only the
    first is rewritten, and the graph gives the same bits."""
    def make(g):
        return [torch.randn(2, 4, 5, D, generator=g).bfloat16(), torch.randn(2, 1, 5, D, generator=g).bfloat16(),
                torch.randn(2, 1, 5, D, generator=g).bfloat16()]

    gm = fwd_only(half_table_rope, make(torch.Generator().manual_seed(0)))
    cf.canonicalize(gm.graph)
    rewritten = cf.half_table_rotations_as_rotate_half(gm.graph)
    assert len(rewritten) == 1
    gm.recompile()
    for seed in range(5):
        args = make(torch.Generator().manual_seed(seed))
        got, want = _outputs(gm, args), _outputs(half_table_rope, args)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # Where no fusion took it, the model's own ops come back: the same nodes, the same bits.
    def subtractions():
        return len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.sub.Tensor))

    assert subtractions() == 1  # the look-alike's
    assert cf.restore_unfused_half_table_rotations(gm.graph, rewritten) == 1
    gm.graph.lint()
    gm.recompile()
    assert subtractions() == 2 and not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.neg.default)
    args = make(torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip(_outputs(gm, args), _outputs(half_table_rope, args)))


def contiguous_copy_then_rotation(x, cos, sin):
    return rotation_spellings((x * 2).transpose(1, 2).contiguous(), cos, sin)


def test_a_copy_read_elementwise_is_dropped_and_put_back_unless_fused():
    def make(g):
        return [torch.randn(2, 5, 4, D, generator=g).bfloat16(), torch.randn(2, 1, 5, D, generator=g).bfloat16(),
                torch.randn(2, 1, 5, D, generator=g).bfloat16()]

    gm = fwd_only(contiguous_copy_then_rotation, make(torch.Generator().manual_seed(0)))
    dropped = cf.contiguous_copies_dropped(gm.graph)
    assert len(dropped) == 1 and _clones(gm) == 0
    gm.recompile()
    args = make(torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(_outputs(gm, args), _outputs(contiguous_copy_then_rotation, args)))
    assert cf.restore_unfused_copies(gm.graph, dropped) == 1 and _clones(gm) == 1
    gm.graph.lint()
    gm.recompile()
    assert all(torch.equal(a, b) for a, b in zip(_outputs(gm, args), _outputs(contiguous_copy_then_rotation, args)))
