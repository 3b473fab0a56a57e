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
ops over exactly two leaves, an integer position tensor (``[B or 1, S]`` or ``[S]`` up to
size-1 dims; a graph input, or computed in the graph such as ``arange(past, past + S)``) and a
``inv_freq [D/2]`` (fp32, or the model dtype); that float subgraph is then run on the CPU on random positions and
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
from fusion_pass.kernels import qk_norm_rope_cache_reference as cache_reference

aten = torch.ops.aten

#: A rotary-embedding subgraph is a handful of ops; a larger ancestry is some other computation.
_MAX_NODES = 64
_FREQ_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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


def _is_integer_tensor(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and val.dtype != torch.bool


def _ancestry(table: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """(the pure call_function nodes ``table`` depends on back to its leaves, in graph order; the
    leaves: graph inputs, and the integer tensors where the float computation starts, which may
    be computed in the graph, e.g. ``arange(past, past + S)``), or None when an ancestor is
    anything but a pure aten op or the ancestry is too large."""
    seen, leaves, stack = set(), [], [table]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op in ("placeholder", "get_attr") or _is_integer_tensor(node):
            leaves.append(node)
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
    computed = sorted((n for n in seen if n not in leaves), key=order.__getitem__)
    return computed, leaves


def _position_strides(positions: torch.Tensor, batch: int, seq: int) -> tuple[int, int] | None:
    """(batch stride, token stride) of ``positions`` read as ``[batch or 1, seq]``: its dims
    other than size-1 ones must be (batch, seq) or (seq); None otherwise."""
    dims = [(size, stride) for size, stride in zip(positions.shape, positions.stride()) if size != 1]
    if seq == 1 and not dims:
        return 0, 0
    if seq == 1 and len(dims) == 1 and dims[0][0] == batch:
        return dims[0][1], 0
    if len(dims) == 1 and dims[0][0] == seq:
        return 0, dims[0][1]
    if len(dims) == 2 and dims[0][0] == batch and dims[1][0] == seq:
        return dims[0][1], dims[1][1]
    return None


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
    Hugging Face's rotary tables (then the kernel keeps reading the tables)."""
    found = [_ancestry(cos), _ancestry(sin)]
    if None in found:
        return None
    (cos_nodes, cos_inputs), (sin_nodes, sin_inputs) = found
    leaves = list(dict.fromkeys(cos_inputs + sin_inputs))
    integer = [n for n in leaves if _is_integer_tensor(n)]
    floats = [n for n in leaves if n not in integer]
    if len(integer) != 1 or len(floats) != 1:
        return None
    (positions,), (inv_freq,) = integer, floats
    pos_val, inv_val, table = positions.meta.get("val"), inv_freq.meta.get("val"), cos.meta.get("val")
    # inv_freq is fp32 as transformers creates it; ``model.to(bf16)`` casts the buffer too, and the
    # model's ``.float()`` (like the kernel's load) widens it exactly.
    if (not isinstance(inv_val, torch.Tensor) or inv_val.dtype not in _FREQ_DTYPES or not _concrete(inv_val.shape)
            or tuple(inv_val.shape) != (half,) or inv_val.stride() != (1,) or not _concrete(pos_val.shape)
            or not _concrete(pos_val.stride()) or table is None or table.dim() != 3 or not _concrete(table.shape)):
        return None
    batch, seq = table.shape[0], table.shape[1]
    strides = _position_strides(pos_val, batch, seq)
    if strides is None:
        return None
    stride_b, stride_s = strides
    g = torch.Generator().manual_seed(0)
    sample_positions = torch.randint(0, 1 << 17, tuple(pos_val.shape), generator=g).to(pos_val.dtype)
    theta = 10.0 ** (4 + 2 * torch.rand((), generator=g).item())
    sample_inv_freq = (1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))).to(inv_val.dtype)
    try:
        env = _evaluate(list(dict.fromkeys(cos_nodes + sin_nodes)),
                        {positions: sample_positions, inv_freq: sample_inv_freq})
    except Exception:  # noqa: BLE001 - an op that will not run on the CPU: keep the tables
        return None
    got_cos, got_sin = env[cos], env[sin]
    rows = sample_positions.reshape(-1, seq) if seq else sample_positions.reshape(1, 0)
    for scaling in [1.0, *_scalars(cos_nodes)]:
        want_cos, want_sin = cache_reference.rope_cos_sin_reference(rows, sample_inv_freq, scaling, dtype)
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
        # The tile, grid and warps stay: ``launch_config``'s rule is the same for computed tables.
        node.kwargs = dict(node.kwargs, kwargs=dict(launch, **update))
        if "eager_input_vals" in node.meta:  # Inductor reads the inputs' strides from here
            args, kwargs = node.meta["eager_input_vals"]
            vals = {k: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for k, v in update.items()}
            # The same containers as the node's kwargs (immutable_dict): torch 2.11's pytree
            # matching of the two in decompose_triton_kernel_wrapper_functional is strict on type.
            inner = type(kwargs["kwargs"])({**kwargs["kwargs"], **vals})
            launch_keys = {key: node.kwargs[key] for key in ("grid", "kernel_idx") if key in kwargs}
            node.meta["eager_input_vals"] = (args, type(kwargs)({**kwargs, "kwargs": inner, **launch_keys}))
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
