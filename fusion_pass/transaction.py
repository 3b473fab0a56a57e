"""A family applied as a transaction: a fault inside it leaves the graph as it was.

Inductor calls our hooks with a ``torch.fx.Graph`` that a pass changes in place, and whatever a pass
raises becomes the user's ``BackendCompilerFailed``. A user forgives a missed fusion, not a broken
compile, so each family runs between a snapshot of the graph and a check of what it left
(``graph.lint()``): on any exception the graph is put back node for node (names, arguments, order
and ``meta``), the fault is recorded for ``report()``, warned about once per family and exception
type and counted in ``counters["fusion_pass"]["internal_errors"]``, and the compile goes on as stock
Inductor's. Strict mode (``install(strict=True)`` or ``FUSION_PASS_STRICT=1``; the project's tests
run strict) re-raises instead, so that containment never hides a bug from us. A family that fused
nothing is put back too, where it rewrote the graph on the way (canonical forms): the graphs of
models it does not fuse are stock Inductor's, node for node.
"""

from __future__ import annotations

import os
import pathlib
import traceback
import warnings
from typing import Callable

import torch
from torch._inductor.pattern_matcher import stable_topological_sort

from . import match_report

#: ``FUSION_PASS_STRICT=1``: re-raise a family's faults (unless ``install(strict=False)`` says otherwise).
STRICT_ENV = "FUSION_PASS_STRICT"


def strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "0") == "1"


class GraphSnapshot:
    """A copy of every node of ``graph`` (op, target, arguments, name, type and a copy of ``meta``)
    that ``restore`` puts back into the same ``Graph`` object, which Inductor keeps using."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self._graph = graph
        self._copy = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in graph.nodes:
            env[node] = self._copy.node_copy(node, lambda a: env[a])  # node_copy copies meta (shallowly)
        self._signature = self._signature_of(graph)

    @staticmethod
    def _signature_of(graph: torch.fx.Graph) -> list:
        def leaf(a):
            # Nodes by name, plain constants by value; anything else (a SymInt, whose == would add a
            # guard) by identity.
            if isinstance(a, torch.fx.Node):
                return ("node", a.name)
            if a is None or type(a) in (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                        torch.memory_format):
                return a
            return ("object", id(a))

        def key(arg):
            return torch.fx.node.map_aggregate(arg, leaf)

        return [(n.name, n.op, leaf(n.target), key(n.args), key(n.kwargs), tuple(n.meta)) for n in graph.nodes]

    def changed(self) -> bool:
        """Whether the graph's nodes (names, ops, targets, arguments, meta keys) differ from the snapshot's."""
        return self._signature_of(self._graph) != self._signature

    def restore(self) -> None:
        graph = self._graph
        for node in graph.nodes:  # every use edge first: a faulty family may have left nodes out of order
            node.args, node.kwargs = (), {}
        for node in reversed(graph.nodes):
            graph.erase_node(node)
        # A graph's namespace never frees a name: without a fresh one every node put back would be
        # renamed (primals_1 -> primals_1_1). The nodes put back are all the nodes there are.
        graph._graph_namespace = torch.fx.graph._Namespace()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self._copy.nodes:
            env[node] = graph.node_copy(node, lambda a: env[a])
        if graph.owning_module is not None:
            graph.owning_module.recompile()


def _package_roots() -> tuple[str, ...]:
    import fusion_pass.kernels
    import fusion_pass.patterns

    return tuple(str(pathlib.Path(m.__file__).parent) for m in (fusion_pass, fusion_pass.patterns, fusion_pass.kernels))


def fault_location(error: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``error``'s traceback in this package's code
    (the last frame at all when none is ours), the file relative to its package folder."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    roots = _package_roots()
    ours = [f for f in frames if f.filename.startswith(roots)]
    frame = (ours or frames)[-1]
    path = pathlib.Path(frame.filename)
    return f"{path.parent.name}/{path.name}:{frame.lineno} in {frame.name}"


_warned: set[tuple[str, type]] = set()


def apply_contained(family: str, graph: torch.fx.Graph, applies: Callable[[], bool], apply: Callable[[], int],
                    strict: bool) -> int:
    """``apply()`` (the number of fusions) as a transaction on ``graph``; 0 when ``applies()`` says the
    family cannot match this graph (nothing to snapshot then), or when the family faulted (the graph
    restored, the fault reported; re-raised under ``strict``).

    Args:
        family: the family's name, for the report.
        graph: the graph the family changes in place.
        applies: a cheap look at the graph that must not change it.
        apply: runs the family on ``graph``.
        strict: re-raise a fault instead of containing it.
    """
    snapshot = None
    staged = match_report.Staged()
    try:
        with staged:
            if not applies():
                return 0
            snapshot = GraphSnapshot(graph)
            count = apply()
            if not count and snapshot.changed():
                # Rewrites into canonical form that no fusion used: a family that fused nothing
                # hands back exactly the graph it got, so the compile is stock Inductor's.
                snapshot.restore()
            if count:
                # A replacement is inserted where the pattern's first output was; inputs of later
                # outputs (k, v) may be defined after it. Later passes expect topological order.
                stable_topological_sort(graph)
            graph.lint()  # a family must leave a well-formed graph: Inductor's next pass would fail on it
    except Exception as error:  # noqa: BLE001 - containment is the point: any fault of ours
        if strict:
            raise
        if snapshot is not None:
            snapshot.restore()
        where = fault_location(error)
        match_report.record_internal_error(family, type(error).__name__, str(error).splitlines()[0] if str(error) else "",
                                           where)
        if (family, type(error)) not in _warned:
            _warned.add((family, type(error)))
            warnings.warn(f"fusion_pass: internal error in family {family} ({type(error).__name__}: {error}; at {where}). "
                          "The graph was left as it was and the compile goes on without this family's fusions. "
                          f"Please report it; {STRICT_ENV}=1 raises it instead.", RuntimeWarning, stacklevel=2)
        return 0
    staged.commit()
    return count
