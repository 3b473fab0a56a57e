"""Cache writes spelled other ways than the forward family's patterns match, rewritten to the
matched spelling before matching (and, where no fusion consumed them, back afterwards).

- ``drop_batch_of_one_reshapes``: ``cache[:, :, pos] = x`` with a batch of one writes
  ``x.reshape(H, S, D)``; the reshape is dropped (the same rows either way).
- ``normalize_flat_cache_views``: a flat ``[slots, Hkv, D]`` cache written through a view.
- ``canonicalize_slice_writes`` / ``restore_unfused_slice_writes``: ``cache[:, :, start:end] = k``
  becomes an ``index_put`` at ``arange(start, end)`` so that one pattern covers both writes; the
  ones left unfused are put back as they were.

Every rewrite is exact: the graph computes the same values before and after.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusion_pass import config as fusion_config
from fusion_pass.rewrites import Rewrite

aten = torch.ops.aten


def drop_batch_of_one_reshapes(graph: torch.fx.Graph) -> None:
    """``index_put(cache, indices, x.reshape(x.shape[1:]))`` -> ``index_put(cache, indices, x)``
    when x's first dim is 1: indexing assignment strips a value's leading 1s, so
    ``cache[:, :, pos] = x`` with x [1, H, S, D] (B = 1) writes ``x.reshape(H, S, D)`` and
    ``cache.view(-1, H, D)[slots] = x`` with x [1, H, D] (one token: decode) writes
    ``x.reshape(H, D)``.

    The value broadcasts to the same rows either way, so this changes no result.
    """
    for node in graph.find_nodes(op="call_function", target=aten.index_put.default):
        cache, indices, value = node.args[:3]
        if not (isinstance(value, torch.fx.Node) and value.target is aten.reshape.default):
            continue
        source = value.args[0]
        if not isinstance(source, torch.fx.Node) or "val" not in source.meta or "val" not in value.meta:
            continue
        if not fusion_config.device_allowed(source.meta["val"].device):
            continue
        before, after = source.meta["val"].shape, value.meta["val"].shape
        if len(before) >= 2 and before[0] == 1 and tuple(before[1:]) == tuple(after):
            node.replace_input_with(value, source)
            if not value.users:
                graph.erase_node(value)


def normalize_flat_cache_views(graph: torch.fx.Graph) -> None:
    """``index_put(cache.reshape(N, Hkv, D), [slots], x)`` -> ``index_put(cache.reshape(-1, Hkv, D),
    [slots], x)``: ``view(num_blocks * block_size, Hkv, D)`` and ``flatten(0, 1)`` are spelled
    as the pattern spells ``view(-1, Hkv, D)``. The same view either way: this changes no result.
    """
    for node in graph.find_nodes(op="call_function", target=aten.index_put.default):
        view, indices = node.args[:2]
        if len(indices) != 1 or not (isinstance(view, torch.fx.Node) and view.target is aten.reshape.default):
            continue
        cache, sizes = view.args[:2]
        if not (isinstance(cache, torch.fx.Node) and "val" in cache.meta and "val" in view.meta):
            continue
        before, after = cache.meta["val"].shape, view.meta["val"].shape
        if (fusion_config.device_allowed(cache.meta["val"].device) and len(before) >= 3 and len(after) == 3
                and tuple(before[-2:]) == tuple(after[1:]) and list(sizes)[1:] == list(after[1:])):
            view.args = (cache, [-1, *sizes[1:]])


def _slice_write_parts(node: torch.fx.Node):
    """(cache, value, start, end) of ``slice_scatter(cache, copy(cache[:, :, start:end], value), 2,
    start, end)`` (what ``cache[:, :, start:end] = value`` functionalizes to), else None.

    start/end come back as non-negative row indices with end - start = S: negative int bounds
    are normalized as Python slicing does; symbolic bounds must be provably non-negative.
    """
    cache, src, *rest = node.args
    dim, start, end, step = (list(rest) + [0, None, None, 1][len(rest):])[:4]
    if dim != 2 or step != 1 or start is None or end is None:
        return None
    if not (isinstance(src, torch.fx.Node) and src.target is aten.copy.default and len(src.users) == 1):
        return None
    rows, value = src.args[:2]
    if not (isinstance(rows, torch.fx.Node) and rows.target is aten.slice.Tensor
            and tuple(rows.args) == (cache, 2, start, end)):
        return None
    if not isinstance(value, torch.fx.Node) or "val" not in value.meta or "val" not in src.meta:
        return None
    if tuple(value.meta["val"].shape) != tuple(src.meta["val"].shape):
        return None  # a broadcasting assignment is not a row write
    bounds = []
    for bound in (start, end):
        if isinstance(bound, int):
            length = cache.meta["val"].shape[2]
            if not isinstance(length, int):
                return None
            bound = min(max(bound + length, 0) if bound < 0 else bound, length)
        elif not (isinstance(bound, torch.fx.Node)
                  and statically_known_true(bound.meta.get("val", -1) >= 0)):
            return None
        bounds.append(bound)
    return cache, value, bounds[0], bounds[1]


def canonicalize_slice_writes(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Rewrite each slice-assigned cache write as ``index_put(cache, [None, None, arange(start,
    end)], value)``; writes with the same bounds share one arange node (as K and V writes share
    ``cache_position``). Returns the (original, rewritten) node pairs."""
    rewrites = []
    positions: dict[tuple, torch.fx.Node] = {}
    for node in list(graph.find_nodes(op="call_function", target=aten.slice_scatter.default)):
        parts = _slice_write_parts(node)
        if parts is None:
            continue
        cache, value, start, end = parts
        device = cache.meta["val"].device
        if not fusion_config.device_allowed(device):
            continue
        key = (start, end, device)
        with graph.inserting_before(node):
            if key not in positions:
                positions[key] = _insert_arange(graph, node.meta["val"], start, end)
            write = graph.call_function(aten.index_put.default, (cache, [None, None, positions[key]], value))
        write.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(write)
        rewrites.append((node, write))
    return rewrites


def _insert_arange(graph: torch.fx.Graph, like: torch.Tensor, start, end) -> torch.fx.Node:
    """``arange(start, end)`` as the post-grad graph spells it (``prims.iota``; aten.arange is
    decomposed by then). start/end are ints or SymInt nodes."""
    def value(b):
        return b.meta["val"] if isinstance(b, torch.fx.Node) else b

    length = end - start if not isinstance(start, torch.fx.Node) and not isinstance(end, torch.fx.Node) else None
    if length is None:
        length = graph.call_function(operator.sub, (end, start))
        length.meta["val"] = value(end) - value(start)
    position = graph.call_function(
        torch.ops.prims.iota.default, (length,),
        {"start": start, "step": 1, "dtype": torch.int64, "device": like.device, "requires_grad": False},
    )
    with torch._guards.detect_fake_mode([like]):
        position.meta["val"] = torch.arange(value(start), value(end), dtype=torch.int64, device=like.device)
    return position


def restore_unfused_slice_writes(graph: torch.fx.Graph, rewrites) -> None:
    """Undo ``canonicalize_slice_writes`` where no fusion consumed the write; drop the originals
    that a fusion replaced."""
    for original, write in rewrites:
        if not getattr(write, "_erased", False) and write.users:  # still in the graph: not fused
            write.replace_all_uses_with(original)
        for node in (write, original):
            _erase_if_dead(graph, node)


def _erase_if_dead(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and then its producers that are left without users (view/copy chains)."""
    pending = [node]
    while pending:
        node = pending.pop()
        if getattr(node, "_erased", False) or node.op != "call_function" or node.users:
            continue
        inputs = [a for a in node.all_input_nodes]
        try:
            graph.erase_node(node)
        except RuntimeError:
            continue
        pending.extend(inputs)


#: This module's rewrites, in the order the forward family runs them (``qk_norm_rope_cache.REWRITES``).
BATCH_OF_ONE_RESHAPES = Rewrite(drop_batch_of_one_reshapes, preserves_layout=True)
FLAT_CACHE_VIEWS = Rewrite(normalize_flat_cache_views, preserves_layout=True)
#: Slice writes lower differently from index_put writes in stock Inductor: put back where unfused.
SLICE_WRITES = Rewrite(canonicalize_slice_writes, preserves_layout=True, undo=restore_unfused_slice_writes)
