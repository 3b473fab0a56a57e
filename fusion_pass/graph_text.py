"""Readable, normalized FX graph text: op targets and data flow, nothing that churns.

Used by the demo to show a graph before and after the passes, and by the snapshot tests.

Node names (``mul_37``), shapes and devices change between torch versions and runs; the
sequence of operations and which result feeds which does not. Each node is printed as
``vN = target(args)`` with inputs numbered in graph order.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor import custom_graph_pass


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return getattr(target, "__name__", str(target))


def graph_text(graph: torch.fx.Graph, keep_constants: bool = True) -> str:
    names: dict[torch.fx.Node, str] = {}
    lines = []

    def fmt(a):
        if isinstance(a, torch.fx.Node):
            return names.get(a, "?")
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]"
        if isinstance(a, torch._ops.OpOverload):
            return _target_name(a)
        if isinstance(a, float):
            return f"{a:g}"
        if isinstance(a, torch.dtype):
            return str(a).replace("torch.", "")
        if isinstance(a, torch.device):
            return "device"
        return repr(a) if keep_constants else "_"

    inputs = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            names[node] = f"in{inputs}"
            inputs += 1
            continue
        if node.op == "output":
            lines.append(f"return {fmt(node.args[0])}")
            continue
        names[node] = f"v{len(names) - inputs}"
        args = [fmt(a) for a in node.args]
        args += [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
        lines.append(f"{names[node]} = {_target_name(node.target)}({', '.join(args)})")
    return "\n".join(lines)


_InferenceAwarePass = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", CustomGraphPass)


class CapturingPass(_InferenceAwarePass):
    """Wraps a graph pass: records ``graph_text`` before and after it, for every graph compiled.

    Its ``uuid()`` is None, so Inductor compiles afresh instead of serving a cached graph (a
    cached graph would run no pass and capture nothing).
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.before: list[str] = []
        self.after: list[str] = []
        self.after_graphs: list[torch.fx.Graph] = []

    def __call__(self, graph: torch.fx.Graph, is_inference: bool | None = None) -> None:
        self.before.append(graph_text(graph))
        if _InferenceAwarePass is not CustomGraphPass and isinstance(self.inner, _InferenceAwarePass):
            self.inner(graph, is_inference=is_inference)  # Inductor says which graph it is; pass it on
        else:
            self.inner(graph)
        self.after.append(graph_text(graph))
        self.after_graphs.append(graph)

    def uuid(self):
        return None
