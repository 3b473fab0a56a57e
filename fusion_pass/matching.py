"""Matching helpers the pattern files share; first of all, applying multi-output patterns layer by
layer, first layer first, without creating cycles.

A fusion over a whole attention prologue is a multi-output pattern whose branches (q, k, the
V write) meet only at nodes every layer shares: the cos/sin tables (Inductor CSEs each layer's
``cos.unsqueeze(1)`` into one node) and ``cache_position``. Inductor's matcher looks for the
later branches among the users of those shared nodes, in graph order, and takes the first
candidate that fits. ``PatternMatcherPass.apply`` visits anchors last to first, so the last
layer's q would be paired with the first layer's k: a graph with a cycle. Visiting anchors
first to last makes the first candidate the same layer's (the earlier layers' branches are
already replaced), and ``creates_cycle`` rejects any pairing that would still be wrong.
"""

from __future__ import annotations

import logging
import os

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    compute_mutation_region_ids,
    fwd_only,
    get_mutation_region_id,
    is_match,
)


log = logging.getLogger(__name__)

# Inductor's own switch: TORCHINDUCTOR_PATTERN_MATCH_DEBUG=<node name>[,<node name>...] prints
# why the patterns did or did not match at those nodes.
_DEBUG_NODES = frozenset(filter(None, os.environ.get("TORCHINDUCTOR_PATTERN_MATCH_DEBUG", "").split(",")))


def creates_cycle(match: Match) -> bool:
    """True when an input of the match is computed from one of its outputs.

    The replacement computes every output from the inputs, so such a match cannot be replaced
    (it pairs branches of different layers: the later layer's input depends, through the
    attention in between, on the earlier layer's cache write).
    """
    matched = set(match.nodes)
    inputs = {n for n in match.kwargs.values() if isinstance(n, torch.fx.Node)}
    outputs = [n for n in match.output_nodes() if n is not None]
    seen: set[torch.fx.Node] = set()
    pending = [user for out in outputs for user in out.users if user not in matched]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        if node in inputs:
            return True
        seen.add(node)
        pending.extend(node.users)
    return False


def apply_first_to_last(pass_dict: PatternMatcherPass, graph: torch.fx.Graph) -> int:
    """``pass_dict.apply(graph)`` visiting anchor nodes in graph order; returns replacements."""
    compute_mutation_region_ids(graph)
    count = 0
    for (op, target), entries in pass_dict.patterns.items():
        for node in list(graph.find_nodes(op=op, target=target)):
            for entry in entries:
                if node._erased:
                    break
                match = entry.pattern.match(node)
                if node.name in _DEBUG_NODES:
                    log.warning("%s%s %s %s", node, node.args, match, entry.pattern)
                if not is_match(match):
                    continue
                if len({get_mutation_region_id(graph, n) for n in match.nodes}) != 1:
                    continue  # the match crosses a mutation barrier
                if len({n.meta.get("custom", {}).get("stream", 0) for n in match.nodes}) != 1:
                    continue  # the match crosses a stream boundary
                if creates_cycle(match) or not guard_or_false(entry.extra_check(match)):
                    continue
                entry.apply(match, graph, node)
                compute_mutation_region_ids(graph)
                count += 1
    return count


#: The eps traced into patterns: an unusual value, so that a traced pattern can tell it apart
#: (``register_replacement``'s ``scalar_workaround`` turns it into a keyword argument).
EPS_EXAMPLE = 1.2345e-5

aten = torch.ops.aten

#: Ops whose result is a view of their first argument's memory (followed back to find what a
#: tensor aliases).
VIEW_OPS = frozenset((aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
                      aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
                      aten.squeeze.default, aten.slice.Tensor, aten.select.int, aten.expand.default,
                      aten.alias.default, aten.as_strided.default))


def node_value(node):
    """The value a graph node was traced with (``meta["val"]``: a fake tensor, a SymInt, ...); None
    for anything that is not a node, or a node without one."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def match_value(match: Match, name: str):
    """The value bound to ``name`` in ``match`` (a fake tensor or a constant); None when the
    pattern has no such argument (the weights of a weight-free norm)."""
    node = match.kwargs.get(name)
    return node_value(node) if isinstance(node, torch.fx.Node) else node


def is_new_pattern(pass_dict: PatternMatcherPass, pattern) -> bool:
    """Whether ``pattern`` is not yet in ``pass_dict`` (and now noted there). Two spellings whose
    canonical forms (``trace_canonical``) are one graph compute the same values, so the first
    registration serves both; Inductor refuses a duplicate pattern."""
    seen = pass_dict.__dict__.setdefault("_fusion_pass_patterns", set())
    key = repr(pattern)
    if key in seen:
        return False
    seen.add(key)
    return True


def trace_canonical(fn, args, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only``, then the spelling rewrites the graphs matched go through
    (``patterns/canonical_forms.py``): a pattern is the canonical form of its reference code."""
    from fusion_pass.patterns.canonical_forms import canonicalize  # the patterns package imports this module

    gm = fwd_only(fn, args, **kwargs)
    if canonicalize(gm.graph):
        gm.recompile()
    return gm


def trace_as_post_grad(fn, args, **kwargs) -> torch.fx.GraphModule:
    """``trace_canonical``, with views spelled as the post-grad graph spells them (``aten.reshape``:
    Inductor's ``view_to_reshape`` has run before the custom pre-passes)."""
    gm = trace_canonical(fn, args, **kwargs)
    view_to_reshape(gm)
    return gm
