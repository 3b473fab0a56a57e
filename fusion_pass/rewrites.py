"""Rewrites of a graph before a family matches it, each with its undo where it needs one.

A family's patterns are traced from one spelling of a computation; model code writes others. A
``Rewrite`` turns one of them into the matched one, in place, keeping every value. Where it also
changes what stock Inductor would make of a place no fusion takes (the layout readers get, a form
Inductor lowers differently), it carries its ``undo``, which puts those places back after matching.
A family declares its rewrites in order (``REWRITES`` in its pattern module); ``rewritten`` runs
them and, once matching is over, the undos in reverse order. On an exception no undo runs: the
family's transaction (``transaction``) puts the whole graph back instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One value-preserving rewrite of a graph into the form a family matches.

    Attributes:
        run: ``run(graph)`` rewrites ``graph`` in place and returns what ``undo`` needs (for a
            rewrite without an undo, anything: a count, or None).
        preserves_layout: whether every node the rewrite leaves has the strides it had. A rewrite
            that changes a layout must have an ``undo``: a stride-sensitive op further on would see
            another layout than eager's where no fusion consumed the rewritten nodes.
        undo: ``undo(graph, record)``, with what ``run`` returned: puts back the places no fusion
            consumed (a fusion erases the nodes it replaced). None: nothing to put back.
    """

    run: Callable[[torch.fx.Graph], Any]
    preserves_layout: bool
    undo: Callable[[torch.fx.Graph, Any], Any] | None = None

    def __post_init__(self) -> None:
        if not self.preserves_layout and self.undo is None:
            raise ValueError(f"undo: {self.name} changes a layout and must carry the undo that puts it back")

    @property
    def name(self) -> str:
        return self.run.__name__


def apply_rewrites(graph: torch.fx.Graph, rewrites: Sequence[Rewrite]) -> list[tuple[Rewrite, Any]]:
    """Run ``rewrites`` on ``graph`` in order; returns each with what it returned (for ``undo_rewrites``)."""
    return [(rewrite, rewrite.run(graph)) for rewrite in rewrites]


def undo_rewrites(graph: torch.fx.Graph, applied: Sequence[tuple[Rewrite, Any]]) -> None:
    """The undos of ``applied`` (``apply_rewrites``' result), last rewrite first."""
    for rewrite, record in reversed(applied):
        if rewrite.undo is not None:
            rewrite.undo(graph, record)


@contextlib.contextmanager
def rewritten(graph: torch.fx.Graph, rewrites: Sequence[Rewrite]) -> Iterator[None]:
    """``graph`` rewritten by ``rewrites`` inside the block, undone (where a rewrite has an undo)
    on leaving it normally."""
    applied = apply_rewrites(graph, rewrites)
    yield
    undo_rewrites(graph, applied)
