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
``normed.to(dtype) * weight``                           ``weight * normed.to(dtype)``
``x.chunk(2, -1)``, ``torch.split(x, D // 2, -1)``      ``x[..., :D // 2]``, ``x[..., D // 2:]``
``x.unflatten(-1, (2, -1)).unbind(-2)``                 the same two slices
(training) ``rotate_half``'s backward sum, first half   the second half's term first
first (its slices taken second half first)
======================================================  ==========================================

Each rewrite is local and value-preserving, so a graph that then matches nothing computes what
it did before (the nodes differ, the values do not). One exception, on CUDA only: ``1 / sqrt`` and
``rsqrt`` may differ by an fp32 ulp there (``reciprocal_square_roots_as_rsqrt``).
"""

from __future__ import annotations

import operator
import sys

import torch

aten = torch.ops.aten
prims = torch.ops.prims
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


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
            if ORIGIN in node.meta:
                first.meta[ORIGIN] = first.meta.get(ORIGIN, set()) | node.meta[ORIGIN]
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            merged += 1
    return merged


def square_products_as_pow(graph: torch.fx.Graph) -> int:
    """``mul(h, h)`` -> ``pow(h, 2)``: torch computes ``pow(h, 2)`` as ``h * h`` (eager and
    Inductor), so the values are the same."""
    rewritten = 0
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is aten.mul.Tensor and len(node.args) == 2
                and node.args[0] is node.args[1] and isinstance(node.args[0], torch.fx.Node) and not node.kwargs):
            val = _val(node.args[0])
            if not isinstance(val, torch.Tensor) or not val.is_floating_point():
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


def weight_first_products(graph: torch.fx.Graph) -> int:
    """``mul(normed.to(dtype), weight)`` -> ``mul(weight, normed.to(dtype))`` where ``weight`` is
    a 1-D graph input (a norm weight) and the other factor a cast to bf16/fp16: a product of two
    values is the same in either order."""
    rewritten = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.mul.Tensor or len(node.args) != 2:
            continue
        normed, weight = node.args
        if not (isinstance(normed, torch.fx.Node) and isinstance(weight, torch.fx.Node)):
            continue
        weight_val = _val(weight)
        if (weight.op == "placeholder" and isinstance(weight_val, torch.Tensor) and weight_val.dim() == 1
                and normed.target is prims.convert_element_type.default and normed.args[1] in _LOW_PRECISION):
            node.args = (weight, normed)
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
        val = _val(x)
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
    x, out = view.args[0], _val(view)
    x_val = _val(x)
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
        size, view = _val(x).shape[-1] // 2, node.args[0]
        for user, index in pieces:
            start, end = (0, size) if index == 0 else (size, sys.maxsize)
            _replace_with_call(graph, user, aten.slice.Tensor, (x, _val(x).dim() - 1, start, end))
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


def canonicalize(graph: torch.fx.Graph) -> int:
    """Apply every rewrite above to ``graph``; returns how many nodes were rewritten."""
    return (merge_duplicate_casts(graph) + square_products_as_pow(graph) + reciprocal_square_roots_as_rsqrt(graph)
            + inverse_square_root_powers_as_rsqrt(graph) + weight_first_products(graph)
            + half_splits_as_slices(graph) + half_unbinds_as_slices(graph))
