"""The rotary tables computed inside the fused forward kernel, where the graph computes them from positions.

The model code (Hugging Face's ``*RotaryEmbedding.forward``, default rope type; the
elementwise form ``positions[..., None].float() * inv_freq`` works the same)::

    inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

unfused (after ``qk_norm_rope_cache`` replaced each layer)::

    position_ids, inv_freq -> bmm -> cat -> cos, sin -> * scaling -> bf16 tables [B, S, D]
    tables -> _qk_norm_rope_cache_kernel(..., cos_ptr, sin_ptr, ...)      (one per layer)

fused::

    _qk_norm_rope_cache_kernel(..., position_ids_ptr, inv_freq_ptr, ROPE_FROM_POSITIONS=True)

and the table kernels leave the graph once no node reads the tables. Each layer's kernel computes
its tokens' angles and their cos/sin in fp32 (a few flops per element, no bytes).

Recognition follows the computation, not a spelling: the tables' ancestors must be pure aten
ops over exactly two graph inputs, an integer position tensor ``[B or 1, S]`` (or ``[S]``) and a
float32 ``inv_freq [D/2]``; that subgraph is then run on the CPU on random positions and
frequencies and must equal ``rope_cos_sin_reference`` bit for bit (``attention_scaling`` taken
from the subgraph's scalar constants). Any other spelling of the same function passes; a
different rounding (fp64 angles, a bf16 product, another scaling) does not, and keeps its tables.
Static shapes only: a symbolic length keeps the tables too.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional

from fusion_pass.kernels import qk_norm_rope_cache_triton as cache_kernel

aten = torch.ops.aten

#: A rotary-embedding subgraph is a handful of ops; a larger ancestry is some other computation.
_MAX_NODES = 64
_KERNELS = (cache_kernel._qk_norm_rope_cache_kernel, cache_kernel._qk_norm_rope_cache_graph_kernel)


@dataclasses.dataclass(frozen=True)
class RotarySource:
    """Where a kernel's cos/sin tables come from: ``rope_cos_sin_reference(positions, inv_freq,
    attention_scaling, dtype)``, ``positions`` viewed as ``[B or 1, S]``."""

    positions: torch.fx.Node
    inv_freq: torch.fx.Node
    attention_scaling: float
    stride_b: int
    stride_s: int


def _ancestry(table: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """(the pure call_function nodes ``table`` depends on, in graph order; the graph inputs they
    read), or None when an ancestor is anything but a pure aten op or the ancestry is too large."""
    seen, inputs, stack = set(), [], [table]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op in ("placeholder", "get_attr"):
            inputs.append(node)
            continue
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return None
        if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            return None
        if len(seen) > _MAX_NODES:
            return None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(table.graph.nodes)}
    computed = sorted((n for n in seen if n.op == "call_function"), key=order.__getitem__)
    return computed, inputs


def _evaluate(nodes: list[torch.fx.Node], values: dict) -> dict:
    """Run ``nodes`` (pure aten ops, graph order) on the CPU with ``values`` for their inputs."""
    env = dict(values)

    def load(a):
        return env[a] if isinstance(a, torch.fx.Node) else a

    for node in nodes:
        args = torch.fx.node.map_aggregate(node.args, load)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, load)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=torch.device("cpu"))
        env[node] = node.target(*args, **kwargs)
    return env


def _scalars(nodes: list[torch.fx.Node]) -> list[float]:
    """Float constants among the nodes' arguments: the candidates for ``attention_scaling``."""
    found = []
    for node in nodes:
        for a in node.args:
            if isinstance(a, float) and a not in found:
                found.append(a)
    return found


def _concrete(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def rotary_source(cos: torch.fx.Node, sin: torch.fx.Node, dtype: torch.dtype, half: int) -> RotarySource | None:
    """The positions and frequencies that ``cos`` and ``sin`` (``[B or 1, S, 2 * half]`` tables of
    ``dtype``) are computed from, checked by running their subgraph; None when they are not
    Hugging Face's rotary tables of graph inputs (then the kernel keeps reading the tables)."""
    found = [_ancestry(cos), _ancestry(sin)]
    if None in found:
        return None
    (cos_nodes, cos_inputs), (sin_nodes, sin_inputs) = found
    inputs = list(dict.fromkeys(cos_inputs + sin_inputs))
    if len(inputs) != 2:
        return None
    vals = [n.meta.get("val") for n in inputs]
    if not all(isinstance(v, torch.Tensor) and _concrete(v.shape) for v in vals):
        return None
    positions, inv_freq = (inputs if not vals[0].is_floating_point() else inputs[::-1])
    pos_val, inv_val = positions.meta["val"], inv_freq.meta["val"]
    table = cos.meta.get("val")
    if (pos_val.is_floating_point() or pos_val.dtype == torch.bool or inv_val.dtype != torch.float32
            or tuple(inv_val.shape) != (half,) or inv_val.stride() != (1,)
            or table is None or table.dim() != 3 or not _concrete(table.shape)):
        return None
    batch, seq = table.shape[0], table.shape[1]
    if pos_val.dim() == 1 and pos_val.shape[0] == seq:
        stride_b, stride_s = 0, pos_val.stride(0)
    elif pos_val.dim() == 2 and pos_val.shape[1] == seq and pos_val.shape[0] in (1, batch):
        stride_b = 0 if pos_val.shape[0] == 1 else pos_val.stride(0)
        stride_s = pos_val.stride(1)
    else:
        return None
    g = torch.Generator().manual_seed(0)
    sample_positions = torch.randint(0, 1 << 17, tuple(pos_val.shape), generator=g).to(pos_val.dtype)
    theta = 10.0 ** (4 + 2 * torch.rand((), generator=g).item())
    sample_inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))
    try:
        env = _evaluate(list(dict.fromkeys(cos_nodes + sin_nodes)),
                        {positions: sample_positions, inv_freq: sample_inv_freq})
    except Exception:  # noqa: BLE001 - an op that will not run on the CPU: keep the tables
        return None
    got_cos, got_sin = env[cos], env[sin]
    rows = sample_positions.reshape(-1, seq)
    for scaling in [1.0, *_scalars(cos_nodes)]:
        want_cos, want_sin = cache_kernel.rope_cos_sin_reference(rows, sample_inv_freq, scaling, dtype)
        if (got_cos.shape == got_sin.shape == (batch, seq, 2 * half) and got_cos.dtype == got_sin.dtype == dtype
                and torch.equal(got_cos, want_cos.expand(batch, -1, -1))
                and torch.equal(got_sin, want_sin.expand(batch, -1, -1))):
            return RotarySource(positions, inv_freq, scaling, stride_b, stride_s)
    return None


def _is_cache_kernel(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not triton_kernel_wrapper_functional:
        return False
    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    return getattr(kernel, "fn", kernel) in _KERNELS


def compute_tables_in_kernels(graph: torch.fx.Graph) -> int:
    """Point every fused forward kernel whose cos/sin tables are rotary tables of positions at
    the positions (``ROPE_FROM_POSITIONS``), then drop the table nodes nothing else reads.
    Returns the number of kernels changed."""
    changed, dead = 0, []
    for node in list(graph.nodes):
        if not _is_cache_kernel(node):
            continue
        launch = node.kwargs["kwargs"]
        cos, sin = launch.get("cos_ptr"), launch.get("sin_ptr")
        rotary = launch["ROTARY_DIM"]
        if (not isinstance(cos, torch.fx.Node) or not isinstance(sin, torch.fx.Node) or launch["INTERLEAVED"]
                or rotary != launch["HEAD_DIM"]):
            continue
        source = rotary_source(cos, sin, launch["q_out_ptr"].meta["val"].dtype, rotary // 2)
        if source is None:
            continue
        graph_entry = "ATTENTION_SCALING" in launch
        update = dict(cos_ptr=None, sin_ptr=None, position_ids_ptr=source.positions, inv_freq_ptr=source.inv_freq,
                      ROPE_FROM_POSITIONS=True, stride_cos_b=0, stride_sin_b=0, stride_pos_b=source.stride_b)
        if graph_entry:
            update.update(STRIDE_COS_S=0, STRIDE_SIN_S=0, STRIDE_POS_S=source.stride_s,
                          ATTENTION_SCALING=source.attention_scaling)
        else:
            update.update(stride_cos_s=0, stride_sin_s=0, stride_pos_s=source.stride_s,
                          attention_scaling=source.attention_scaling)
        node.kwargs = dict(node.kwargs, kwargs=dict(launch, **update))
        if "eager_input_vals" in node.meta:  # Inductor reads the inputs' strides from here
            args, kwargs = node.meta["eager_input_vals"]
            vals = {k: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for k, v in update.items()}
            node.meta["eager_input_vals"] = (args, dict(kwargs, kwargs=dict(kwargs["kwargs"], **vals)))
        dead += [cos, sin]
        changed += 1
    erased = set()
    while dead:  # the tables and the ops only they needed
        node = dead.pop()
        if node not in erased and not node.users and node.op == "call_function":
            inputs = node.all_input_nodes
            graph.erase_node(node)
            erased.add(node)
            dead.extend(inputs)
    return changed
