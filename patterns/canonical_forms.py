"""Equivalent spellings of the norm and of ``rotate_half``, rewritten to the one the patterns match.

Model code writes the same computation in many ways; the forward patterns are traced from one
spelling (``kernels/qk_norm_rope_cache_reference.py``). Before matching, the post-grad graph is
rewritten, exactly (the same values bit for bit), so that the others read as that one:

======================================================  ==========================================
model code                                              canonical form
======================================================  ==========================================
``x.float()`` twice of one tensor                       one cast, its users shared
``cos.unsqueeze(2)`` once per tensor rotated             one ``unsqueeze``, its users shared
``h * h`` (``torch.mean(h * h, -1)``)                   ``h.pow(2)`` (eager computes ``h * h``)
``1 / torch.sqrt(v)``                                   ``torch.rsqrt(v)`` (exact on CPU; see below)
``torch.pow(v, -0.5)``                                  ``torch.rsqrt(v)`` (ATen's pow is rsqrt)
``cos * x``, ``torch.rsqrt(v) * h``, ``weight * n``     the broadcast factor second: ``x * cos``, ...
``rotate_half(x) * sin + x * cos``                      ``x * cos + rotate_half(x) * sin``
``x * -1``                                              ``-x``
``add.Scalar(v, eps)``, ``v.add_(eps)`` (``F.rms_norm``)  ``add.Tensor(v, eps)``
``x.chunk(2, -1)``, ``torch.split(x, D // 2, -1)``      ``x[..., :D // 2]``, ``x[..., D // 2:]``
``x.unflatten(-1, (2, -1)).unbind(-2)``                 the same two slices
``x.narrow(-1, 8, 8)``, ``x[..., 8:16]``, ``x[..., -8:]``  ``x[..., 8:]`` (slice ints in one form: dim
                                                        counted from the front, ends past the size open)
``torch.cat(.., dim=3)`` of 4-D tensors, ``mean(h, 3)``  dims counted from the end: ``dim=-1`` (a cat
                                                        along its last dim, of 3 or more dims)
``h.sum(-1, keepdim=True) / D`` (D a power of two)       ``h.mean(-1, keepdim=True)`` (the same division)
``h.mean(-1).unsqueeze(-1)``, ``h.mean(-1)[..., None]``  ``h.mean(-1, keepdim=True)``
(training) ``rotate_half``'s backward sum, first half   the second half's term first
first (its slices taken second half first)
======================================================  ==========================================

Two more, for the forward family only (in its ``REWRITES``, each with the undo that puts back what no
fusion used: they change the layout Inductor gives the readers, which a stride-sensitive op further
on would see): ``clone(x)`` read only element by element (``.contiguous()``
after the transpose) -> ``x`` (``contiguous_copies_dropped``); ``cat((x1 * c - x2 * s, x2 * c + x1 *
s), -1)`` (half-width tables) -> ``x * cat(c, c) + cat(-x2, x1) * cat(s, s)``
(``half_table_rotations_as_rotate_half``). Each rewrite is a ``fusion_pass.rewrites.Rewrite``
(``CANONICAL_FORMS``, ``CONTIGUOUS_COPIES``, ``HALF_TABLE_ROTATIONS``, ``SCATTER_SUMS``,
``NOOP_VIEWS_AND_COPIES``).

Each rewrite is local and value-preserving, so a graph that then matches nothing computes what
it did before (the nodes differ, the values do not). The patterns are traced through the same
rewrites (``fusion_pass.matching.trace_as_post_grad``), so the canonical form is whatever the
rewrites make of the reference spelling, on both sides. One exception, on CUDA only: ``1 / sqrt`` and
``rsqrt`` may differ by an fp32 ulp there (``reciprocal_square_roots_as_rsqrt``).
"""

from __future__ import annotations

import operator
import sys

import torch
from torch._inductor.fx_passes.post_grad import remove_noop_ops

from fusion_pass.matching import VIEW_OPS, node_value
from fusion_pass.rewrites import Rewrite, apply_rewrites

aten = torch.ops.aten
prims = torch.ops.prims
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _is_real_float(val) -> bool:
    """``val`` is a tensor of a real floating-point dtype (not complex, not an integer)."""
    return isinstance(val, torch.Tensor) and val.is_floating_point()


#: Node meta key set by callers that canonicalize a copy of a graph: the set of original nodes a
#: node stands for. A merged duplicate's set joins the kept node's.
ORIGIN = "fusion_pass_origin"

#: Pure ops computed twice on the same arguments in model code: a cast of one tensor (two
#: ``x.float()``), an ``unsqueeze`` of one table (``apply_rotary_pos_emb`` called once per tensor).
_MERGEABLE = (prims.convert_element_type.default, aten.unsqueeze.default)


def _replace_with_call(graph: torch.fx.Graph, node: torch.fx.Node, target, args: tuple) -> torch.fx.Node:
    """``node`` replaced by ``target(*args)``, a node computing the same value: it takes ``node``'s
    place, meta and users, and ``node`` is erased."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _replace_with_equal_node(graph: torch.fx.Graph, gone: torch.fx.Node, kept: torch.fx.Node) -> None:
    """``gone``'s users read ``kept`` (a node of the same value), which stands for both (``ORIGIN``),
    and ``gone`` is erased."""
    if ORIGIN in gone.meta:
        kept.meta[ORIGIN] = kept.meta.get(ORIGIN, set()) | gone.meta[ORIGIN]
    gone.replace_all_uses_with(kept)
    graph.erase_node(gone)


def merge_duplicate_casts(graph: torch.fx.Graph) -> int:
    """A cast (``convert_element_type(x, dtype)``) or ``unsqueeze(x, dim)`` computed twice: the
    later one's users take the first."""
    seen, merged = {}, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _MERGEABLE or node.kwargs:
            continue
        key = (node.target, *node.args)
        first = seen.setdefault(key, node)
        if first is not node:
            _replace_with_equal_node(graph, node, first)
            merged += 1
    return merged


def square_products_as_pow(graph: torch.fx.Graph) -> int:
    """``mul(h, h)`` -> ``pow(h, 2)``: torch computes ``pow(h, 2)`` as ``h * h`` (eager and
    Inductor), so the values are the same."""
    rewritten = 0
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is aten.mul.Tensor and len(node.args) == 2
                and node.args[0] is node.args[1] and isinstance(node.args[0], torch.fx.Node) and not node.kwargs):
            if not _is_real_float(node_value(node.args[0])):
                continue
            _replace_with_call(graph, node, aten.pow.Tensor_Scalar, (node.args[0], 2))
            rewritten += 1
    return rewritten


def inverse_square_root_powers_as_rsqrt(graph: torch.fx.Graph) -> int:
    """``torch.pow(v, -0.5)`` (Gemma3n's norm) -> ``rsqrt(v)``: ATen computes a tensor to the
    power -0.5 as ``rsqrt`` (CPU and CUDA), so the values are the same."""
    rewritten = 0
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is aten.pow.Tensor_Scalar and len(node.args) == 2
                and node.args[1] == -0.5 and not node.kwargs):
            _replace_with_call(graph, node, aten.rsqrt.default, (node.args[0],))
            rewritten += 1
    return rewritten


def reciprocal_square_roots_as_rsqrt(graph: torch.fx.Graph) -> int:
    """``1 / torch.sqrt(v)`` (``reciprocal(sqrt(v)) * 1`` once traced) -> ``rsqrt(v)``. torch's CPU
    ``rsqrt`` is ``1 / sqrt`` (the same value). On CUDA, eager's ``rsqrtf`` and ``sqrt`` + divide
    may differ by an fp32 ulp in the statistic, the size of the difference the kernel's reduction
    order already makes (``kernels/qk_norm_rope_cache_triton.py``, "Rounding and exactness")."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.reciprocal.default:
            continue
        root = node.args[0]
        if not isinstance(root, torch.fx.Node) or root.target is not aten.sqrt.default or len(root.users) != 1:
            continue
        rsqrt = _replace_with_call(graph, node, aten.rsqrt.default, (root.args[0],))
        graph.erase_node(root)
        for user in list(rsqrt.users):  # Python's ``1 / t`` traces as reciprocal(t) * 1
            if user.target is aten.mul.Tensor and user.args == (rsqrt, 1) and not user.kwargs:
                user.replace_all_uses_with(rsqrt)
                graph.erase_node(user)
        rewritten += 1
    return rewritten



def _shape(node) -> tuple | None:
    val = node_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _fold_pair_into_call(graph: torch.fx.Graph, node: torch.fx.Node, target, args: tuple, gone: torch.fx.Node) -> None:
    """``node`` and its only input ``gone`` replaced by one ``target(*args)`` node, which stands for
    both (``ORIGIN``, where the caller tracks it)."""
    kept = _replace_with_call(graph, node, target, args)
    if ORIGIN in gone.meta:
        kept.meta[ORIGIN] = kept.meta.get(ORIGIN, set()) | gone.meta[ORIGIN]
    graph.erase_node(gone)


def _broadcasts_into(small: tuple, big: tuple) -> bool:
    """``small`` broadcasts to ``big`` (right-aligned) and is strictly smaller: a table, a weight or
    a keepdim statistic beside the tensor it scales."""
    if len(small) > len(big) or small == big:
        return False
    return all(isinstance(a, int) and isinstance(b, int) and a in (1, b) for a, b in zip(small[::-1], big[::-1]))


def broadcast_factors_second(graph: torch.fx.Graph) -> int:
    """``mul(a, b)`` where ``a`` broadcasts into ``b`` -> ``mul(b, a)``: ``cos * x``, ``rsqrt(v) * h``,
    ``weight * n`` read as ``x * cos``, ``h * rsqrt(v)``, ``n * weight``; a product is the same in
    either order."""
    rewritten = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
            small, big = _shape(a), _shape(b)
            if small is not None and big is not None and _broadcasts_into(small, big):
                node.args = (b, a)
                rewritten += 1
    return rewritten


_VIEWS = (aten.reshape.default, aten.view.default, aten.unsqueeze.default, aten.clone.default)


def _is_rotation_term(node) -> bool:
    """``rotate_half(x) * t``: a product whose first factor is (a view of) a ``cat`` that starts with
    a negation (``cat((-x2, x1))``, or interleaved pairs stacked as ``cat`` of unsqueezed halves)."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.mul.Tensor or not node.args:
        return False
    cat = node.args[0]
    while isinstance(cat, torch.fx.Node) and cat.target in _VIEWS:
        cat = cat.args[0]
    if not isinstance(cat, torch.fx.Node) or cat.target is not aten.cat.default or not cat.args[0]:
        return False
    first = cat.args[0][0]
    while isinstance(first, torch.fx.Node) and first.target is aten.unsqueeze.default:
        first = first.args[0]
    return isinstance(first, torch.fx.Node) and first.target is aten.neg.default


def rotation_terms_second(graph: torch.fx.Graph) -> int:
    """``rotate_half(x) * sin + x * cos`` -> ``x * cos + rotate_half(x) * sin``: a sum of two values
    is the same in either order."""
    rewritten = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        if _is_rotation_term(a) and not _is_rotation_term(b) and isinstance(b, torch.fx.Node):
            node.args = (b, a)
            rewritten += 1
    return rewritten


def negative_units_as_neg(graph: torch.fx.Graph) -> int:
    """``x * -1`` -> ``-x`` for a real floating-point ``x``: the same value (a sign flip is exact;
    a complex product by ``-1 + 0j`` is not a sign flip where a part is zero, inf or nan)."""
    rewritten = 0
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is aten.mul.Tensor and len(node.args) == 2 and not node.kwargs
                and isinstance(node.args[0], torch.fx.Node) and not isinstance(node.args[1], torch.fx.Node)
                and node.args[1] == -1 and _is_real_float(node_value(node)) and _is_real_float(node_value(node.args[0]))
                and node_value(node).dtype == node_value(node.args[0]).dtype):
            _replace_with_call(graph, node, aten.neg.default, (node.args[0],))
            rewritten += 1
    return rewritten


def _slice_ints(shape: tuple, dim, start, end, step) -> tuple | None:
    """(dim, start, end, *step) in one form for a tensor of ``shape``, or None when not all ints."""
    if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        return None
    dim %= len(shape)
    size = shape[dim]
    start = 0 if start is None else start
    end = sys.maxsize if end is None else end
    if not (isinstance(size, int) and isinstance(start, int) and isinstance(end, int)):
        return None
    if start < 0:
        start = max(start + size, 0)
    if end < 0:
        end = max(end + size, 0)
    if end >= size:
        end = sys.maxsize
    return (dim, start, end) + (() if step == 1 else (step,))


def slices_in_one_form(graph: torch.fx.Graph) -> int:
    """``aten.slice(x, dim, start, end, step)`` (and ``slice_scatter``, the write into such a slice)
    with its ints in one form: ``dim`` counted from the front, a negative ``start``/``end`` counted
    from the size, an ``end`` at or past the size open (``sys.maxsize``, as ``x[..., a:]`` traces),
    a missing ``start`` 0, a step of 1 left out: the same elements."""
    rewritten = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target is aten.slice.Tensor:
            head, ints = node.args[:1], list(node.args[1:])
        elif node.target is aten.slice_scatter.default:
            head, ints = node.args[:2], list(node.args[2:])
        else:
            continue
        shape = _shape(node.args[0])
        if shape is None:
            continue
        dim, start, end, step = (ints + [0, None, sys.maxsize, 1][len(ints):])[:4]
        canonical = _slice_ints(shape, dim, start, end, step)
        if canonical is not None and head + canonical != tuple(node.args):
            node.args = head + canonical
            rewritten += 1
    return rewritten


def dims_from_the_end(graph: torch.fx.Graph) -> int:
    """``cat(tensors, dim)`` along the last dim of a tensor of 3 or more dims, ``mean(x, dims)`` and
    ``sum(x, dims)``, with their dims counted from the end (``dim=3`` of a 4-D tensor -> ``-1``): the
    same op."""
    rewritten = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target is aten.cat.default and len(node.args) == 2 and isinstance(node.args[1], int):
            # Only a head tensor's last dim: Inductor's own patterns match 2-D cats at dim 1
            # (``cat_slice_cat``), which would read as another op at -1.
            shape = _shape(node)
            if shape is not None and len(shape) >= 3 and node.args[1] == len(shape) - 1:
                node.args = (node.args[0], node.args[1] - len(shape))
                rewritten += 1
        elif node.target in (aten.mean.dim, aten.sum.dim_IntList) and len(node.args) >= 2:
            shape, dims = _shape(node.args[0]), node.args[1]
            if shape is None or not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
                continue
            ends = [d - len(shape) if d >= 0 else d for d in dims]
            if ends != list(dims):
                node.args = (node.args[0], ends, *node.args[2:])
                rewritten += 1
    return rewritten


def _is_power_of_two(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


#: Dtypes whose ``sum`` is rounded once, as ``mean``'s is: a half-precision sum is rounded to its
#: dtype before the division (it can overflow, or round twice below the normal range), a mean is
#: not; an integer sum divided is a float, an integer mean an error.
_EXACT_SUM_DTYPES = (torch.float32, torch.float64)


def sums_over_size_as_means(graph: torch.fx.Graph) -> int:
    """``x.sum(-1, keepdim=True) / D`` (x fp32 or fp64 of at least one dim, D its last size, a power
    of two) -> ``x.mean(-1, keepdim=True)``: torch's mean is that sum divided by D, and dividing by a
    power of two is exact either way (``/ D`` or ``* (1 / D)``)."""
    rewritten = 0
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target is not aten.div.Tensor or len(node.args) != 2 or node.kwargs
                or not isinstance(node.args[0], torch.fx.Node)):
            continue
        total, size = node.args
        if total.target is not aten.sum.dim_IntList or len(total.users) != 1 or total.kwargs:
            continue
        shape, val = _shape(total.args[0]), node_value(total.args[0])
        if not (isinstance(val, torch.Tensor) and val.dtype in _EXACT_SUM_DTYPES and val.dim() >= 1):
            continue
        dims, keepdim = total.args[1], (total.args[2] if len(total.args) > 2 else False)
        if (not isinstance(dims, (list, tuple)) or list(dims) != [-1] or not _is_power_of_two(shape[-1])
                or isinstance(size, torch.fx.Node) or size != shape[-1] or len(total.args) > 3):
            continue
        _fold_pair_into_call(graph, node, aten.mean.dim, (total.args[0], [-1], keepdim), total)
        rewritten += 1
    return rewritten


def unsqueezed_means_as_keepdim(graph: torch.fx.Graph) -> int:
    """``x.mean(-1).unsqueeze(-1)`` (or ``[..., None]``), x of at least one dim -> ``x.mean(-1,
    keepdim=True)``: the same values, the reduced dim kept in place."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.unsqueeze.default or node.kwargs:
            continue
        mean, dim = node.args
        if (not isinstance(mean, torch.fx.Node) or mean.target is not aten.mean.dim or len(mean.users) != 1
                or mean.kwargs or len(mean.args) not in (2, 3) or (len(mean.args) == 3 and mean.args[2])
                or not isinstance(mean.args[1], (list, tuple)) or list(mean.args[1]) != [-1]):
            continue
        source, out = _shape(mean.args[0]), _shape(node)
        if source is None or out is None or len(source) == 0 or dim % len(out) != len(out) - 1:
            continue  # a 0-d mean unsqueezed is 1-d, its keepdim mean 0-d
        _fold_pair_into_call(graph, node, aten.mean.dim, (mean.args[0], [-1], True), mean)
        rewritten += 1
    return rewritten


def _returns_new_tensor(node: torch.fx.Node) -> bool:
    """``node`` is an ATen op whose result aliases none of its inputs (not a view, not in place):
    an in-place write to it changes no other tensor."""
    return (isinstance(node.target, torch._ops.OpOverload)
            and all(ret.alias_info is None for ret in node.target._schema.returns))


def scalar_adds_as_tensor_adds(graph: torch.fx.Graph) -> int:
    """``add.Scalar(x, s)``, or ``add_(x, s)`` on a new tensor only this add reads (``F.rms_norm``'s
    decomposition adds its eps so) -> ``add.Tensor(x, s)``: the same sum. An in-place add to a view
    writes its base too, and stays."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or len(node.args) != 2 or node.kwargs or isinstance(node.args[1], torch.fx.Node):
            continue
        x = node.args[0]
        in_place = node.target in (aten.add_.Scalar, aten.add_.Tensor)
        if node.target is not aten.add.Scalar and not (
                in_place and isinstance(x, torch.fx.Node) and x.op == "call_function" and len(x.users) == 1
                and _returns_new_tensor(x)):
            continue
        _replace_with_call(graph, node, aten.add.Tensor, tuple(node.args))
        rewritten += 1
    return rewritten


def half_splits_as_slices(graph: torch.fx.Graph) -> int:
    """``split(x, D // 2, -1)`` read by ``getitem`` 0 and 1 (``x.chunk(2, -1)``) -> the two
    slices ``x[..., :D // 2]`` and ``x[..., D // 2:]``, as ``rotate_half`` slices them."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.split.Tensor or len(node.args) < 2:
            continue
        x, size = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        val = node_value(x)
        if not isinstance(val, torch.Tensor) or not isinstance(size, int) or not isinstance(dim, int):
            continue
        dim = dim % val.dim()
        if dim != val.dim() - 1 or val.shape[dim] != 2 * size:
            continue
        users = list(node.users)
        if not all(u.target is operator.getitem and u.args[1] in (0, 1) for u in users):
            continue
        for user in users:
            start, end = (0, size) if user.args[1] == 0 else (size, sys.maxsize)
            _replace_with_call(graph, user, aten.slice.Tensor, (x, dim, start, end))
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _halves_view(view: torch.fx.Node, dim) -> torch.fx.Node | None:
    """``x`` where ``view`` is ``x.reshape(*x.shape[:-1], 2, D // 2)`` and ``dim`` its size-2 axis
    (``x.unflatten(-1, (2, -1))``), else None."""
    if not isinstance(view, torch.fx.Node) or view.target not in (aten.reshape.default, aten.view.default):
        return None
    x, out = view.args[0], node_value(view)
    x_val = node_value(x)
    if not (isinstance(x_val, torch.Tensor) and isinstance(out, torch.Tensor) and isinstance(dim, int)):
        return None
    if out.dim() != x_val.dim() + 1 or dim % out.dim() != out.dim() - 2:
        return None
    if list(out.shape[:-2]) != list(x_val.shape[:-1]) or out.shape[-2] != 2 or 2 * out.shape[-1] != x_val.shape[-1]:
        return None
    return x


def half_unbinds_as_slices(graph: torch.fx.Graph) -> int:
    """``x.unflatten(-1, (2, -1)).unbind(-2)`` read by ``getitem`` 0 and 1 (or ``select`` 0/1 of
    that view) -> the slices ``x[..., :D // 2]`` and ``x[..., D // 2:]``: the same elements."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.unbind.int:
            x = _halves_view(node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
            users = list(node.users)
            if x is None or not all(u.target is operator.getitem and u.args[1] in (0, 1) for u in users):
                continue
            pieces = [(u, u.args[1]) for u in users]
        elif node.target is aten.select.int:
            x = _halves_view(node.args[0], node.args[1])
            if x is None or node.args[2] not in (0, 1, -1, -2):
                continue
            pieces = [(node, node.args[2] % 2)]
        else:
            continue
        size, view = node_value(x).shape[-1] // 2, node.args[0]
        for user, index in pieces:
            start, end = (0, size) if index == 0 else (size, sys.maxsize)
            _replace_with_call(graph, user, aten.slice.Tensor, (x, node_value(x).dim() - 1, start, end))
        if node.target is aten.unbind.int:
            graph.erase_node(node)
        if not view.users:  # a dead user of x would keep x's other users from matching
            graph.erase_node(view)
        rewritten += 1
    return rewritten


def scatter_sums_second_half_first(graph: torch.fx.Graph) -> int:
    """In the backward of ``rotate_half``, ``slice_scatter(g, first half) + slice_scatter(g',
    second half)`` -> the second half's term first, as autograd orders it when ``rotate_half``
    takes its first half first (Hugging Face's); the order follows the model's slice order, and
    a sum of two values is the same in either order."""
    rewritten = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        if not all(isinstance(t, torch.fx.Node) and t.target is aten.slice_scatter.default for t in (a, b)):
            continue
        (dim_a, start_a), (dim_b, start_b) = (t.args[2:4] if len(t.args) >= 4 else (None, None) for t in (a, b))
        if dim_a == dim_b and isinstance(start_a, int) and isinstance(start_b, int) and start_a < start_b:
            node.args = (b, a)
            rewritten += 1
    return rewritten


#: Ops whose every output element is a function of input elements, whatever the inputs' strides:
#: arithmetic, casts, and ``cat`` (a new tensor). A copy read only by these (or by slices read so)
#: can be dropped without changing a value.
_ELEMENTWISE_READERS = (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.pow.Tensor_Scalar,
                        prims.convert_element_type.default, aten.cat.default)

def _storage_root(node):
    """The node whose storage ``node`` shares: followed back through views, the items of views
    (``split``'s), in-place ops (their first input) and ``out=`` ops (their ``out``)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args:
        if "out" in node.kwargs:
            node = node.kwargs["out"]
        elif (node.target in VIEW_OPS or node.target is operator.getitem
              or (isinstance(node.target, torch._ops.OpOverload) and not _returns_new_tensor(node))):
            node = node.args[0]
        else:
            break
    return node


def _read_elementwise_only(node: torch.fx.Node) -> bool:
    """Every user of ``node`` reads its values one by one (``_ELEMENTWISE_READERS``), or is a slice
    whose users do."""
    return bool(node.users) and all(
        user.op == "call_function" and (user.target in _ELEMENTWISE_READERS
                                        or (user.target is aten.slice.Tensor and _read_elementwise_only(user)))
        for user in node.users)


def _written_roots(graph: torch.fx.Graph) -> set:
    """The storage roots of every tensor an op of ``graph`` writes in place."""
    roots = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                for written in (value if isinstance(value, (list, tuple)) else [value]):
                    if isinstance(written, torch.fx.Node):
                        roots.add(_storage_root(written))
    return roots


def contiguous_copies_dropped(graph: torch.fx.Graph) -> list:
    """``clone(x)`` (``x.transpose(1, 2).contiguous()``) read only element by element
    (``_read_elementwise_only``) -> ``x``: the same values, read through x's strides. Kept where
    ``x`` may be written in place (the copy then protects a value) or is a graph input. Returns what
    was dropped: ``restore_unfused_copies`` puts back the copies whose readers no fusion took, since
    Inductor then lays the readers out from x's strides (a stride-sensitive op further on would
    see another layout than eager's). Forward family only (``CONTIGUOUS_COPIES``)."""
    written = None
    dropped = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.clone.default or not isinstance(node.args[0],
                                                                                                  torch.fx.Node):
            continue
        x = node.args[0]
        root = _storage_root(x)
        if not isinstance(root, torch.fx.Node) or root.op != "call_function" or not _read_elementwise_only(node):
            continue
        if written is None:
            written = _written_roots(graph)
        if root in written:
            continue
        dropped.append((x, dict(node.kwargs), node.meta.get("val"), list(node.users)))
        _replace_with_equal_node(graph, node, x)
    return dropped


def _still_there(order: dict, nodes) -> list:
    """The nodes of ``nodes`` still in the graph whose ``order`` (node -> position, ``_positions``) is
    given (a fusion erases the ones it replaced), in graph order."""
    return sorted((n for n in nodes if n in order), key=order.__getitem__)


def _positions(graph: torch.fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def restore_unfused_copies(graph: torch.fx.Graph, dropped: list) -> int:
    """Undo ``contiguous_copies_dropped`` for the readers no fusion replaced: a copy of x again,
    before the first of them, which they read instead of x. Returns the number put back."""
    restored, order = 0, _positions(graph)
    for x, kwargs, val, readers in dropped:
        left = [r for r in _still_there(order, readers) if x in r.all_input_nodes]
        if not left:
            continue
        with graph.inserting_before(left[0]):
            copy = graph.call_function(aten.clone.default, (x,), kwargs)
        copy.meta["val"] = val
        for reader in left:
            reader.replace_input_with(x, copy)
        restored += 1
    return restored


def _half_of(node):
    """(x, 0 or 1) where ``node`` is ``x[..., :D // 2]`` or ``x[..., D // 2:]`` (slices in one form,
    along x's last dim), else None."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.slice.Tensor or len(node.args) != 4:
        return None
    x, dim, start, end = node.args
    shape = _shape(x)
    if shape is None or dim != len(shape) - 1 or not isinstance(shape[-1], int) or shape[-1] % 2:
        return None
    half = shape[-1] // 2
    return (x, 0) if (start, end) == (0, half) else (x, 1) if (start, end) == (half, sys.maxsize) else None


def _products_of_halves(node) -> list:
    """Every reading of ``node`` as ``half * table`` (either order): [(x, 0 or 1, half, table)]."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
        return []
    readings = []
    for half, table in (node.args, node.args[::-1]):
        found = _half_of(half)
        if found is not None and isinstance(table, torch.fx.Node):
            readings.append((*found, half, table))
    return readings


def _hf_rotation_values(x, x1, x2, cos, sin):
    """Meta values of ``half_table_rotations_as_rotate_half``'s nodes, computed on the inputs' fake
    values: (cat(c, c), cat(s, s), -x2, cat(-x2, x1), x * cos, rotated * sin, their sum)."""
    mode = torch._guards.detect_fake_mode([node_value(x)])
    with mode:
        # A graph made by a tracer that gives nodes fake modes of their own (pattern_matcher.fwd_only
        # does): values of x's mode with the same sizes, strides and dtype.
        xv, x1v, x2v, cv, sv = (v if getattr(v, "fake_mode", None) is mode
                                else torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                                for v in (node_value(n) for n in (x, x1, x2, cos, sin)))
        full_cos, full_sin, neg = torch.cat([cv, cv], -1), torch.cat([sv, sv], -1), torch.neg(x2v)
        rotated = torch.cat([neg, x1v], -1)
        x_cos, rotated_sin = xv * full_cos, rotated * full_sin
        return full_cos, full_sin, neg, rotated, x_cos, rotated_sin, x_cos + rotated_sin


def _full_table(graph: torch.fx.Graph, half: torch.fx.Node, made: dict, value) -> torch.fx.Node:
    """``cat((half, half), -1)``, made once per half table (right after it) and kept in ``made``; two
    slices of one table at the same bounds (``apply_rotary``'s ``cos[..., :d]`` for q, then for k)
    are one half table."""
    key = (half.target, half.args, tuple(half.kwargs.items())) if half.target is aten.slice.Tensor else half
    if key not in made:
        anchor = half if half.op != "placeholder" else [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            made[key] = graph.call_function(aten.cat.default, ([half, half], -1))
        made[key].meta["val"] = value
    return made[key]


def half_table_rotations_as_rotate_half(graph: torch.fx.Graph) -> list:
    """RoPE with half-width tables, ``cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)`` (x1, x2 the
    halves of x; vLLM's ``forward_native``, flash-attn's reference) -> Hugging Face's
    ``x * cat(c, c) + cat(-x2, x1) * cat(s, s)``: the same products (``-x2 * s`` is ``-(x2 * s)``) and
    sums (``a - b`` is ``a + -b``), rounded alike. Returns what was rewritten, for
    ``restore_unfused_half_table_rotations``. Forward family only (``HALF_TABLE_ROTATIONS``)."""
    rewritten, full_tables = [], {}
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target is not aten.cat.default or len(node.args) != 2
                or node.args[1] != -1 or len(node.args[0]) != 2 or node.kwargs):
            continue
        first, second = node.args[0]
        if not (isinstance(first, torch.fx.Node) and first.target is aten.sub.Tensor and len(first.args) == 2
                and not first.kwargs and isinstance(second, torch.fx.Node) and second.target is aten.add.Tensor
                and len(second.args) == 2 and not second.kwargs):
            continue
        readings = [_products_of_halves(t) for t in (*first.args, *second.args)]
        xs = set.intersection(*({r[0] for r in found} for found in readings))
        if len(xs) != 1:
            continue
        x = xs.pop()
        # first = x1 * c - x2 * s; second = x2 * c + x1 * s, its terms in either order
        terms = [next(r for r in found if r[0] is x) for found in readings]
        (_, half_a, x1, cos), (_, half_b, x2, sin) = terms[:2]
        if ((half_a, half_b) != (0, 1) or {terms[2][1]: terms[2][3], terms[3][1]: terms[3][3]} != {1: cos, 0: sin}
                or any((_half_of(t) or (None,))[0] is x for t in (cos, sin))):
            continue
        try:
            values = _hf_rotation_values(x, x1, x2, cos, sin)
        except Exception:  # noqa: BLE001  (tables that do not broadcast into x: not a RoPE)
            continue
        if values[-1].shape != node_value(node).shape or values[-1].dtype != node_value(node).dtype:
            continue
        # One full table per half table: q's and k's RoPE then read the same node, as the patterns'.
        full_cos, full_sin = (_full_table(graph, t, full_tables, v) for t, v in ((cos, values[0]), (sin, values[1])))
        with graph.inserting_before(node):
            x_cos = graph.call_function(aten.mul.Tensor, (x, full_cos))
            neg = graph.call_function(aten.neg.default, (x2,))
            rotated = graph.call_function(aten.cat.default, ([neg, x1], -1))
            rotated_sin = graph.call_function(aten.mul.Tensor, (rotated, full_sin))
            total = graph.call_function(aten.add.Tensor, (x_cos, rotated_sin))
        for new, value in zip((neg, rotated, x_cos, rotated_sin, total), values[2:]):
            new.meta["val"] = value
        node.replace_all_uses_with(total)
        rewritten.append((total, (first.target, [(p.target, p.args, node_value(p)) for p in first.args], node_value(first)),
                          (second.target, [(p.target, p.args, node_value(p)) for p in second.args], node_value(second)),
                          node.args[1], node_value(node)))
        for dead in (node, first, second, *first.args, *second.args):
            if not dead.users:
                graph.erase_node(dead)
    return rewritten


def restore_unfused_half_table_rotations(graph: torch.fx.Graph, rewritten: list) -> int:
    """Undo ``half_table_rotations_as_rotate_half`` where no fusion replaced the rotation: the
    model's own ops again, operands in their order (Inductor then lays them out, and contracts
    them into FMAs on the GPU, as without the pass). Returns the number put back."""
    restored, alive = 0, set(graph.nodes)
    for total, first, second, dim, val in rewritten:
        if total not in alive:
            continue
        with graph.inserting_before(total):
            halves = []
            for target, products, half_val in (first, second):
                terms = []
                for mul, args, term_val in products:
                    terms.append(graph.call_function(mul, args))
                    terms[-1].meta["val"] = term_val
                halves.append(graph.call_function(target, tuple(terms)))
                halves[-1].meta["val"] = half_val
            original = graph.call_function(aten.cat.default, (halves, dim))
        original.meta["val"] = val
        total.replace_all_uses_with(original)
        _erase_unused(graph, [total])
        restored += 1
    return restored


def _erase_unused(graph: torch.fx.Graph, nodes: list) -> None:
    """Erase ``nodes`` and then, as they become unused, the nodes they read (never a placeholder)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.users or node.op != "call_function" or node.graph is not graph:
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        stack.extend(inputs)


#: The rewrites of the table above, in the order ``canonicalize`` runs them; each returns how many
#: nodes it rewrote and keeps every layout (nothing to undo).
CANONICAL_FORMS = tuple(Rewrite(run, preserves_layout=True) for run in (
    merge_duplicate_casts, square_products_as_pow, reciprocal_square_roots_as_rsqrt,
    inverse_square_root_powers_as_rsqrt, negative_units_as_neg, scalar_adds_as_tensor_adds, half_splits_as_slices,
    half_unbinds_as_slices, slices_in_one_form, dims_from_the_end, sums_over_size_as_means,
    unsqueezed_means_as_keepdim, broadcast_factors_second, rotation_terms_second))

#: ``.contiguous()`` copies read element by element, dropped; put back where no fusion took the readers.
CONTIGUOUS_COPIES = Rewrite(contiguous_copies_dropped, preserves_layout=False, undo=restore_unfused_copies)

#: Half-width-table RoPE read as Hugging Face's; the model's ops put back where no fusion took it.
HALF_TABLE_ROTATIONS = Rewrite(half_table_rotations_as_rotate_half, preserves_layout=False,
                               undo=restore_unfused_half_table_rotations)

#: rotate_half's backward sums in the order the training patterns trace them.
SCATTER_SUMS = Rewrite(scatter_sums_second_half_first, preserves_layout=True)

#: Inductor's own: the no-op views and copies of a joint graph, which Inductor drops right after the
#: hook and the traced training patterns do not have.
NOOP_VIEWS_AND_COPIES = Rewrite(remove_noop_ops, preserves_layout=True)


def canonicalize(graph: torch.fx.Graph) -> int:
    """Apply every rewrite of ``CANONICAL_FORMS`` to ``graph``; returns how many nodes were rewritten."""
    return sum(count for _, count in apply_rewrites(graph, CANONICAL_FORMS))
