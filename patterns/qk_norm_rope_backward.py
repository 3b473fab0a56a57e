"""Fusion ``qk_norm_rope_backward``: per-head RMSNorm and RoPE of q or k, trained with our backward.

The model code matched, one tensor at a time, wherever its input comes from (a projection with or
without bias, a fused QKV weight split or sliced, LoRA adapters summed in, frozen weights, an input
that does not require grad, autocast casts in front of the GEMM: none of it is in the region)::

    q = self.q_norm(q_proj_out.view(hidden_shape)).transpose(1, 2)      # Qwen3 ("norm_then_transpose")
    q = apply_rotary_pos_emb(q, k, cos, sin)[0]                          #   cos.unsqueeze(1)

    q = self.q_norm(q_proj_out.view(hidden_shape).transpose(1, 2))      # Gemma3 ("norm_after_transpose")
    q = apply_rotary_pos_emb(q, k, cos, sin)[0]

    q = self.q_norm(q_proj_out.view(hidden_shape))                      # Gemma3n, Gemma4 ("rope_before_transpose")
    q = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)[0].transpose(1, 2)

    q = apply_rotary_pos_emb(q_proj_out.view(hidden_shape).transpose(1, 2), k, cos, sin)[0]
    q = self.query_layernorm(q)                                          # HunYuan ("rope_first")

with any norm form of ``NORM_FORMS`` (Qwen3's, Gemma3's ``1 + w``, ``nn.RMSNorm`` / ``F.rms_norm``,
Gemma3n's, AFMoE's, weight-free), in one dtype or under bf16 autocast over an fp32 model (Qwen3's form
and order; other mixed dtypes are reported).

unfused (joint graph): the region's forward nodes, and the ~20 backward nodes per tensor that
autograd derived from them (norm, RoPE and cast derivatives, gradient sums).
fused: the forward nodes stay (Inductor compiles them as before); the backward nodes are replaced by
``kernels/qk_norm_rope_backward_op.py``: on CUDA the elementwise Triton pass as kernel nodes of the
graph, writing grad_x, the norm weight's grad and (when required) cos/sin's grads; elsewhere one
``torch.ops.fusion_pass.qk_norm_rope_backward`` call.

How the region and its backward are found (``apply``):
1. The forward part of the joint graph is copied, canonicalized (``canonical_forms``: the spelling
   of the norm and of ``rotate_half`` does not matter) and matched with one pattern per norm form,
   placement and dtype family (``_variants``), each re-traced on the matched shapes at match time.
2. The region F in the joint graph: the forward nodes between the matched input and output.
3. Its backward: the nodes autograd recorded under F's sequence numbers (``meta["seq_nr"]``), plus
   the gradient sums among them. The backward of a recognized forward is autograd's derivative of
   it, so it is not matched op by op: only its boundary is checked (one incoming gradient; every
   outgoing one is the gradient of the region's input, norm weight, cos or sin).
Projection regions that ``qkv_rope_qk_norm`` fused earlier in the same hook are gone by then.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Any, Callable

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, gen_pattern, register_graph_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusion_pass import config as fusion_config
from fusion_pass import match_report
from fusion_pass.families import Family
from fusion_pass.kernels.qk_norm_rope_backward_op import backward_in_graph
from fusion_pass.kernels.qkv_rope_qk_norm_backward_triton import NORM_STYLES
from fusion_pass.kernels.qk_norm_rope_cache_reference import partial_rope_reference, rope_reference
from fusion_pass.kernels.rounding import SUPPORTED_DTYPES
from fusion_pass.kernels.triton_device import kernels_in_graph
from fusion_pass.pattern_cache import inputs_signature, retraced_check, traced_pattern
from fusion_pass.matching import node_value, trace_canonical
from fusion_pass.patterns.canonical_forms import NOOP_VIEWS_AND_COPIES, ORIGIN, canonicalize
from fusion_pass.patterns.norm_forms import NORM_FORMS, NormForm

FAMILY = Family("qk_norm_rope_backward", "per-head RMSNorm <-> RoPE of q or k in training, its backward one "
                "Triton pass (one count per tensor)", stage="joint")

aten = torch.ops.aten

#: ``NormForm.style`` -> the kernel's ``NORM_STYLES`` value: weight-free forms are the fp32 weight's
#: with a weight of ones (``R(n * 1)`` is ``R(n)``; like those forms, they end in x's dtype, which
#: decides the rounding of RoPE's backward under autocast).
KERNEL_NORM_STYLE = {"weight": NORM_STYLES["weight"], "no_weight": NORM_STYLES["fp32_weight"],
                     "fp32_weight": NORM_STYLES["fp32_weight"],
                     "fp32_one_plus_weight": NORM_STYLES["fp32_one_plus_weight"]}

PLACEMENTS = ("norm_then_transpose", "norm_after_transpose", "rope_before_transpose", "rope_first")

_EPS_EXAMPLE = 1.2345e-5


# --- the region, as model code writes it -----------------------------------------------------

def _region(norm: NormForm, placement: str, partial_rotary: bool = False) -> Callable:
    """The search function ``(x, weight, cos, sin, eps) -> y`` of one tensor's norm and RoPE
    (without ``weight`` for weight-free norms); cos/sin arrive unsqueezed, as the model's
    ``apply_rotary_pos_emb`` makes them (the unsqueeze is shared by layers, so it stays outside)."""
    rope = partial_rope_reference if partial_rotary else rope_reference  # partial: GLM-4.5, Qwen3-Next, Qwen3.5

    def region(x, weight, cos, sin, eps):
        if placement == "rope_first":
            return norm.fn(rope(x, cos, sin), weight, eps)
        normed = norm.fn(x, weight, eps)
        if placement == "norm_then_transpose":
            return rope(normed.transpose(1, 2), cos, sin)
        if placement == "norm_after_transpose":
            return rope(normed, cos, sin)
        return rope(normed, cos, sin).transpose(1, 2)

    if norm.weighted:
        return region
    return lambda x, cos, sin, eps: region(x, None, cos, sin, eps)


@dataclasses.dataclass(frozen=True)
class Variant:
    norm: str
    placement: str
    dtype: torch.dtype  # bf16 stands for every low-precision dtype (the casts are in the graph)
    strided: bool = False  # the [B, H, S, D] input is the transposed view (some norm forms then copy it)
    partial_rotary: bool = False  # RoPE on the first rotary_dim < head_dim features, the rest passed through
    autocast: bool = False  # bf16 x with fp32 weight and tables, where that traces otherwise than all-bf16

    @property
    def name(self) -> str:
        dtype = "autocast" if self.autocast else "fp32" if self.dtype == torch.float32 else "lowp"
        return f"{self.norm}_{self.placement}_{dtype}" + (
            "_strided" if self.strided else "") + ("_partial_rotary" if self.partial_rotary else "")


def _variants() -> tuple[Variant, ...]:
    out = []
    for (name, form), placement, dtype in itertools.product(NORM_FORMS.items(), PLACEMENTS,
                                                            (torch.bfloat16, torch.float32)):
        out.append(Variant(name, placement, dtype))
        # The input as the transposed view of [B, S, H, D] (HF's layout: such norm forms copy it)
        if placement in ("norm_after_transpose", "rope_first") and form.copies_strided_input:
            out.append(Variant(name, placement, dtype, strided=True))
    # Partial rotary (GLM-4.5, Qwen3-Next, Qwen3.5), in the placement those models use.
    out += [Variant(name, "norm_then_transpose", dtype, partial_rotary=True)
            for name, dtype in itertools.product(NORM_FORMS, (torch.bfloat16, torch.float32))]
    # Autocast graphs the all-bf16 patterns miss: an fp32 weight drops the form's ``weight.float()``,
    # and partial rotary after a norm ending in x's dtype concatenates RoPE's fp32 output with the
    # bf16 pass-through features (a promotion in the graph). RoPE first, the region is fp32 after it.
    for name, form in NORM_FORMS.items():
        if form.casts_weight:
            out += [Variant(name, placement, torch.bfloat16, autocast=True) for placement in PLACEMENTS[:3]]
        if form.style != "weight":
            out.append(Variant(name, "norm_then_transpose", torch.bfloat16, partial_rotary=True, autocast=True))
    return tuple(out)


def _example_inputs(variant: Variant) -> list[torch.Tensor]:
    t = functools.partial(torch.empty, dtype=variant.dtype)
    batch, seq, heads, head_dim = 2, 8, 4, 16
    if variant.placement in ("norm_then_transpose", "rope_before_transpose"):
        x = t(batch, seq, heads, head_dim)
    elif variant.strided:
        x = t(batch, seq, heads, head_dim).transpose(1, 2)
    else:
        x = t(batch, heads, seq, head_dim)
    rotary_dim = head_dim // 2 if variant.partial_rotary else head_dim
    table = (batch, seq, 1, rotary_dim) if variant.placement == "rope_before_transpose" else (batch, 1, seq, rotary_dim)
    t32 = functools.partial(torch.empty, dtype=torch.float32) if variant.autocast else t
    inputs = [x, t32(head_dim), t32(*table), t32(*table)]
    if not NORM_FORMS[variant.norm].weighted:
        del inputs[1]
    return inputs


# --- matching in a forward-only copy of the joint graph --------------------------------------


@dataclasses.dataclass
class _Found:
    variant: Variant
    x: torch.fx.Node
    weight: torch.fx.Node | None
    cos: torch.fx.Node
    sin: torch.fx.Node
    y: torch.fx.Node
    eps: Any


_found: list[_Found] = []


def _record(variant: Variant) -> Callable:
    def handler(match: Match, *args, **kwargs) -> None:
        y = match.output_nodes()[0]
        _found.append(_Found(variant, match.kwargs["x"], match.kwargs.get("weight"), match.kwargs["cos"],
                             match.kwargs["sin"], y, match.kwargs["eps"]))

    return handler


def _weight_fits(match: Match, form: NormForm) -> bool:
    """A weight read through a cast (``weight.float()``) is the weight of a form that casts it:
    canonicalized, ``x * rsqrt(.) * weight.float()`` also reads as ``nn.RMSNorm``'s ``x * rsqrt(.) *
    weight`` with the cast bound as its weight, whose variant would then refuse the mixed dtypes."""
    weight = match.kwargs.get("weight")
    return form.casts_weight or not (isinstance(weight, torch.fx.Node)
                                     and weight.target is torch.ops.prims.convert_element_type.default)


def register(pass_dict: PatternMatcherPass) -> None:
    """One pattern per variant (traced, or loaded from ``pattern_cache``); a match is recorded for
    ``apply``, the graph matched (a forward copy) is not changed."""
    for variant in _variants():
        search = _region(NORM_FORMS[variant.norm], variant.placement, variant.partial_rotary)
        example = _example_inputs(variant)
        scalars = {"eps": _EPS_EXAMPLE}
        pattern = traced_pattern(f"qk_norm_rope_backward_{variant.name}",
                                 functools.partial(gen_pattern, search, example, trace_canonical, scalars),
                                 inputs_signature(example))
        register_graph_pattern(
            pattern, pass_dict=pass_dict,
            extra_check=retraced_check(search, trace_canonical, scalars, (),
                                       functools.partial(_weight_fits, form=NORM_FORMS[variant.norm])),
        )(_record(variant))


def applies_to(graph: torch.fx.Graph) -> bool:
    """Joint graphs only: AOT autograd names the backward's incoming gradients ``tangents_<i>``."""
    return any(node.op == "placeholder" and node.name.startswith("tangents") for node in graph.nodes)


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The backward: nodes AOT autograd traced as backward (``partitioner_tag``; this includes the
    ones computed from saved forward values alone, e.g. ``pow(rstd, 3)``) and every node that
    depends on an incoming gradient (``tangents_<i>``)."""
    backward: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                backward.add(node)
        elif node.op == "call_function" and (node.meta.get("partitioner_tag") == "is_backward"
                                             or any(a in backward for a in node.all_input_nodes)):
            backward.add(node)
    return backward


def _forward_copy(graph: torch.fx.Graph, backward: set[torch.fx.Node]) -> torch.fx.GraphModule:
    """The forward nodes of ``graph`` in a new graph, each with ``meta[ORIGIN]`` = {its original}.
    Saved activations get no extra users, so the patterns' user counts hold. ``get_attr`` nodes (the
    tensor constants AOT autograd lifts, ``_tensor_constant0``) read the same attributes of
    ``graph``'s owning module; without one, they and what they feed are left out."""
    owner = graph.owning_module
    copy = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node in backward or node.op == "output":
            continue
        if node.op not in ("placeholder", "call_function", "get_attr") or (node.op == "get_attr" and owner is None):
            continue
        if any(a not in env for a in node.all_input_nodes):
            continue
        new = copy.node_copy(node, lambda a: env[a])
        new.meta = dict(node.meta)
        new.meta[ORIGIN] = {node}
        env[node] = new
    copy.output(None)
    # GraphModule(root, graph) takes from root exactly the attributes the graph's get_attr nodes name.
    return torch.fx.GraphModule(owner if owner is not None else torch.nn.Module(), copy)


# --- the region in the joint graph and its backward ---------------------------------------------

class _Refused(Exception):
    """The region cannot be fused; ``str()`` is the near-miss reason (None: say nothing)."""


def _single(origins: set) -> torch.fx.Node:
    """The one original node a matched node stands for (a merged table stands for several)."""
    if len(origins) != 1:
        raise _Refused(None)
    return next(iter(origins))


_MAX_REGION_NODES = 64


def _nodes_computing(y: torch.fx.Node, inputs: set) -> set | None:
    """The nodes that compute ``y`` from ``inputs`` (y included); None when something else (a
    placeholder, another tensor) feeds them, or when they are too many for one tensor's norm and
    RoPE."""
    region, todo = {y}, [y]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg in inputs or arg in region:
                continue
            if arg.op != "call_function" or len(region) >= _MAX_REGION_NODES:
                return None
            region.add(arg)
            todo.append(arg)
    return region


@dataclasses.dataclass
class _Region:
    """A match's region in the joint graph: its inputs and output there (cos/sin: every node the
    matched table stands for), the backward B and its boundary."""

    found: _Found
    x: torch.fx.Node
    weight: torch.fx.Node | None
    cos: set
    sin: set
    y: torch.fx.Node
    backward: set  # B
    grad: torch.fx.Node  # the incoming gradient of y
    outputs: dict  # role ("x", "weight", "cos", "sin") -> the B node holding that input's gradient
    rstd: torch.fx.Node | None


def _accumulation_leaves(node: torch.fx.Node, backward: set) -> list[torch.fx.Node]:
    """The nodes whose gradients ``node`` sums (autograd's accumulation adds carry the sequence
    number of whatever ran last, not of the ops they sum)."""
    if node.target is aten.add.Tensor and all(a in backward for a in node.all_input_nodes) and len(
            node.all_input_nodes) == 2:
        return [leaf for a in node.all_input_nodes for leaf in _accumulation_leaves(a, backward)]
    return [node]


class _SequenceIndex:
    """The joint graph's nodes by autograd sequence number, built once per graph (a region looks up
    its own numbers instead of scanning the graph).

    owners: seq_nr -> the forward node that created the autograd node of that number: the first
        forward node carrying it (an op that records no autograd node, its inputs not requiring
        grad, carries the number of the last one that did).
    derived: seq_nr -> the backward nodes, and the input-less constants (the zeros a slice's
        gradient is scattered into), carrying it; ``forget`` drops erased ones.
    """

    def __init__(self, graph: torch.fx.Graph, backward_nodes: set):
        self.owners: dict[int, torch.fx.Node] = {}
        self.derived: dict[int, set[torch.fx.Node]] = collections.defaultdict(set)
        for node in graph.nodes:
            if "seq_nr" not in node.meta:
                continue
            seq_nr = node.meta["seq_nr"]
            if node not in backward_nodes:
                self.owners.setdefault(seq_nr, node)
            if node.op == "call_function" and (node in backward_nodes or not node.all_input_nodes):
                self.derived[seq_nr].add(node)

    def forget(self, nodes: set) -> None:
        for node in nodes:
            self.derived[node.meta.get("seq_nr")].discard(node)


def _find_region(found: _Found, backward_nodes: set, index: _SequenceIndex) -> _Region | None:
    origin = lambda n: n.meta.get(ORIGIN, set())  # noqa: E731
    x = _single(origin(found.x))
    y = _single(origin(found.y))
    weight = _single(origin(found.weight)) if found.weight is not None else None
    cos, sin = set(origin(found.cos)), set(origin(found.sin))
    inputs = {x, *cos, *sin} | ({weight} if weight is not None else set())
    if isinstance(found.eps, torch.fx.Node):  # dynamic=True lifts the eps float to a graph input
        inputs |= origin(found.eps)
    region = _nodes_computing(y, inputs)
    if region is None:
        raise _Refused(None)  # something else feeds the region: not the modelled code
    seq_nrs = {n.meta["seq_nr"] for n in region if index.owners.get(n.meta.get("seq_nr")) in region}
    backward = {n for seq_nr in seq_nrs for n in index.derived.get(seq_nr, ())} - region
    if not backward:
        return None  # nothing requires its gradient (or the backward is ours already)
    todo = list(backward)
    while todo:  # the gradient sums among them
        for user in todo.pop().users:
            if (user not in backward and user in backward_nodes and user.target is aten.add.Tensor
                    and len(user.all_input_nodes) == 2 and all(a in backward for a in user.all_input_nodes)):
                backward.add(user)
                todo.append(user)
    incoming = {a for n in backward for a in n.all_input_nodes if a not in backward}
    grads_in = {a for a in incoming if a in backward_nodes and isinstance(node_value(a), torch.Tensor)}
    if len(grads_in) != 1:
        raise _Refused("per-head RMSNorm <-> RoPE in training whose backward could not be delimited "
                       f"({len(grads_in)} incoming gradients)")
    grad = next(iter(grads_in))
    # Sizes (SymInt nodes: the symbolic batch and sequence) may come from anywhere.
    if any(isinstance(node_value(a), torch.Tensor) for a in incoming - grads_in - region - inputs):
        raise _Refused("per-head RMSNorm <-> RoPE in training whose backward reads other forward values")
    roles = {x: "x", weight: "weight", **{c: "cos" for c in cos}, **{s: "sin" for s in sin}}
    seq_to_forward = collections.defaultdict(list)
    for n in region:
        if n.meta.get("seq_nr") in seq_nrs:
            seq_to_forward[n.meta["seq_nr"]].append(n)
    seq_nrs_with_backward = {n.meta.get("seq_nr") for n in backward}
    outputs: dict[str, torch.fx.Node] = {}
    for node in backward:
        if all(u in backward for u in node.users):
            continue
        candidates = None
        for leaf in _accumulation_leaves(node, backward):
            found_roles = {role for f in seq_to_forward.get(leaf.meta.get("seq_nr"), ())
                           for role in _input_roles(f, roles, region, seq_nrs_with_backward)}
            candidates = found_roles if candidates is None else candidates & found_roles
        value = node_value(node)
        candidates = {r for r in candidates or () if isinstance(value, torch.Tensor) and _role_shape_matches(
            r, value, x, weight, cos, sin)}
        if len(candidates) != 1 or next(iter(candidates)) in outputs:
            raise _Refused("per-head RMSNorm <-> RoPE in training whose backward could not be delimited "
                           "(an outgoing gradient of unknown input)")
        outputs[next(iter(candidates))] = node
    rsqrts = [n for n in region if n.target is aten.rsqrt.default]
    return _Region(found, x, weight, cos, sin, y, backward, grad, outputs, rsqrts[0] if len(rsqrts) == 1 else None)


def _input_roles(node: torch.fx.Node, roles: dict, region: set, seq_nrs_with_backward: set) -> set[str]:
    """The region inputs whose gradient the backward of forward ``node`` may produce: its arguments
    that are inputs, and through arguments made by ops autograd passed the gradient through without a
    node of its own (``1.0 + weight`` in fp32: the add's gradient is the mul's)."""
    found = set()
    for arg in node.all_input_nodes:
        if arg in roles:
            found.add(roles[arg])
        elif arg in region and arg.meta.get("seq_nr") not in seq_nrs_with_backward:
            found |= _input_roles(arg, roles, region, seq_nrs_with_backward)
    return found


def _role_shape_matches(role: str, value: torch.Tensor, x, weight, cos: set, sin: set) -> bool:
    node = {"x": x, "weight": weight, "cos": next(iter(cos)), "sin": next(iter(sin))}[role]
    expected = node_value(node)
    return isinstance(expected, torch.Tensor) and tuple(expected.shape) == tuple(value.shape)


# --- checks and the replacement -----------------------------------------------------------------

def _refusal(region: _Region) -> str | None:
    """Why the kernel cannot take this region (None: it can)."""
    x, grad = node_value(region.x), node_value(region.grad)
    cos, sin = node_value(next(iter(region.cos))), node_value(next(iter(region.sin)))
    weight = node_value(region.weight) if region.weight is not None else None
    if not fusion_config.device_allowed(x.device):
        return f"device type {x.device.type!r} is not enabled (fusion_pass.install(devices=...))"
    tensors = [t for t in (x, grad, cos, sin, weight) if t is not None]
    if x.dtype not in SUPPORTED_DTYPES:
        return f"per-head RMSNorm <-> RoPE in training in {x.dtype} (the backward kernel takes bf16, fp16, fp32)"
    if any(t.dtype != x.dtype for t in tensors):
        # Autocast over an fp32 model: x bf16 (the projection's output), the weight, the tables and so the
        # output and its gradient fp32. Anything else mixed: refused.
        autocast = (x.dtype in (torch.bfloat16, torch.float16)
                    and all(t.dtype == torch.float32 for t in tensors if t is not x))
        if not autocast:
            dtypes = ", ".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors}))
            return (f"per-head RMSNorm ({region.found.variant.norm} form) <-> RoPE in training with mixed dtypes "
                    f"({dtypes}): the backward kernel takes one dtype, or autocast's bf16/fp16 input with fp32 "
                    "weight, tables and gradient")
    if x.dim() != 4 or x.shape[-1] % 2:
        return f"per-head RMSNorm <-> RoPE in training with input shape {tuple(x.shape)} (expected 4-D, even head_dim)"
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        return (f"per-head RMSNorm <-> RoPE in training with a norm weight of shape {tuple(weight.shape)} "
                f"(expected [head_dim] = [{x.shape[-1]}])")
    if x.stride(-1) != 1:
        return "per-head RMSNorm <-> RoPE in training on an input with a strided last dim"
    table_problem = _table_problem(region)
    if table_problem is not None:
        return table_problem
    if cos.shape[-1] % 2 or cos.shape[-1] > x.shape[-1]:
        return (f"per-head RMSNorm <-> RoPE in training with rotary_dim {cos.shape[-1]} (the backward kernel "
                f"takes an even rotary_dim <= head_dim {x.shape[-1]})")
    if region.rstd is None and not isinstance(region.found.eps, (int, float)):
        return "per-head RMSNorm <-> RoPE in training without an rsqrt node and with a graph-input eps"
    return None


def _kernel_layout(region: _Region) -> tuple[bool, int]:
    """(x arrives as [B, H, S, D], the heads' dim of the tensor RoPE multiplies with the tables)."""
    placement = region.found.variant.placement
    return placement in ("norm_after_transpose", "rope_first"), 2 if placement == "rope_before_transpose" else 1


def _table_problem(region: _Region) -> str | None:
    """Why cos/sin cannot be read as the kernel's [1 or B, S, R] rows (None: they can): a table
    broadcasts against RoPE's 4-D operand, so with leading ones it must be 1 over the heads, S over
    the positions and 1 or B over the batch ([S, R], [B, 1, S, R] and [B, S, 1, R] all are)."""
    heads_first, head_axis = _kernel_layout(region)
    x = node_value(region.x)
    batch, seq = x.shape[0], x.shape[2] if heads_first else x.shape[1]
    for name, nodes in (("cos", region.cos), ("sin", region.sin)):
        table = node_value(next(iter(nodes)))
        if not isinstance(table, torch.Tensor) or not 1 <= table.dim() <= 4:
            return f"per-head RMSNorm <-> RoPE in training with a {name} that is not a 1- to 4-D tensor"
        shape = (1,) * (4 - table.dim()) + tuple(table.shape)
        seq_axis = 3 - head_axis  # [B, H, S, R] or [B, S, H, R]
        if not (statically_known_true(shape[head_axis] == 1) and statically_known_true(shape[seq_axis] == seq)
                and (statically_known_true(shape[0] == 1) or statically_known_true(shape[0] == batch))):
            return (f"per-head RMSNorm <-> RoPE in training with {name} of shape {tuple(table.shape)} (the backward "
                    "kernel takes tables that vary over the batch and positions only)")
    cos, sin = (node_value(next(iter(nodes))) for nodes in (region.cos, region.sin))
    if cos.dim() != sin.dim() or not all(statically_known_true(a == b) for a, b in zip(cos.shape, sin.shape)):
        return (f"per-head RMSNorm <-> RoPE in training with cos {tuple(cos.shape)} and sin {tuple(sin.shape)} of "
                "different shapes")
    return None


def _table_rows(table: torch.Tensor, head_axis: int) -> torch.Tensor:
    """``table`` as the kernel's [1 or B, S, R] rows (``_table_problem`` said it can be)."""
    return table.reshape((1,) * (4 - table.dim()) + tuple(table.shape)).squeeze(head_axis)


def _replacement(region: _Region) -> tuple[Callable, list[torch.fx.Node], list[str]]:
    """A function of graph values returning the new gradients (in ``roles`` order), its inputs."""
    heads_first, head_axis = _kernel_layout(region)
    form = NORM_FORMS[region.found.variant.norm]
    norm_style = KERNEL_NORM_STYLE[form.style]
    rope_first = region.found.variant.placement == "rope_first"
    roles = list(region.outputs)
    need_weight = "weight" in roles and form.weighted
    need_tables = "cos" in roles or "sin" in roles
    eps = region.found.eps
    x_val = node_value(region.x)
    batch, seq = (x_val.shape[0], x_val.shape[2]) if heads_first else (x_val.shape[0], x_val.shape[1])
    in_graph = kernels_in_graph(x_val) and all(isinstance(s, int) for s in x_val.shape) and batch * seq > 0

    def new_gradients(grad, x, cos, sin, weight=None, rstd=None):
        x_bshd = x.transpose(1, 2) if heads_first else x
        if rstd is None:
            rstd = torch.rsqrt(x_bshd.float().pow(2).mean(-1, keepdim=True) + eps).transpose(1, 2)
        elif not heads_first:
            rstd = rstd.transpose(1, 2)  # the norm ran on [B, S, H, D]
        if weight is None:
            weight = grad.new_ones(x.shape[-1])  # in the output's dtype, as the kernel takes weights
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        args = (grad, x_bshd, rstd, _table_rows(cos, head_axis), _table_rows(sin, head_axis), weight, need_weight,
                need_tables, rope_first, norm_style)
        if in_graph:
            grad_x, grad_weight, grad_tables = backward_in_graph(*args)
        else:
            grad_x, grad_weight, grad_tables = torch.ops.fusion_pass.qk_norm_rope_backward(*args)
        grad_x = grad_x.view(x_bshd.shape)
        results = {"x": grad_x.transpose(1, 2) if heads_first else grad_x}
        if need_weight:
            results["weight"] = grad_weight[0]
        if need_tables:
            results["cos"] = grad_tables[0].reshape(cos.shape)
            results["sin"] = grad_tables[1].reshape(sin.shape)
        return tuple(results[r] for r in roles)

    inputs = [region.grad, region.x, next(iter(region.cos)), next(iter(region.sin))]
    names = ["grad", "x", "cos", "sin"]
    if form.weighted:
        inputs.append(region.weight)
        names.append("weight")
    if region.rstd is not None and region.rstd.meta.get("val") is not None:
        inputs.append(region.rstd)
        names.append("rstd")

    def traced(*values):
        return new_gradients(**dict(zip(names, values)))

    return traced, inputs, roles


def _replace(region: _Region) -> list[torch.fx.Node]:
    """Insert the new backward after the incoming gradient, give its results to the users of the
    old gradients, erase the old backward; returns the inserted nodes."""
    fn, inputs, roles = _replacement(region)
    graph = region.y.graph
    with torch.inference_mode(False):
        replacement = fwd_only(fn, [node_value(n) for n in inputs], run_functional_passes=False)
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(inputs)
    results, anchor, inserted = None, region.grad, []
    for node in replacement.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            results = torch.fx.map_arg(node.args[0], lambda a: env[a])
        else:
            with graph.inserting_after(anchor):
                anchor = env[node] = graph.node_copy(node, lambda a: env[a])
            anchor.meta["partitioner_tag"] = "is_backward"
            # The trace's sequence number is not autograd's: it could make a later region claim these.
            anchor.meta.pop("seq_nr", None)
            inserted.append(anchor)
    for role, new in zip(roles, results):
        old = region.outputs[role]
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in region.backward)
    for node in reversed(list(graph.nodes)):
        if node in region.backward and not node.users:
            graph.erase_node(node)
    return inserted


# --- the pass -------------------------------------------------------------------------------------

_variant_counts: collections.Counter[str] = collections.Counter()


def variant_counts() -> dict[str, int]:
    """Replacements per variant name since ``reset_variant_counts()``."""
    return dict(_variant_counts)


def reset_variant_counts() -> None:
    _variant_counts.clear()


#: Before matching; the canonical forms are applied to the forward copy only (``apply``).
REWRITES = (NOOP_VIEWS_AND_COPIES,)


def apply(graph: torch.fx.Graph, pass_dict: PatternMatcherPass) -> int:
    """Find every region in the forward copy, then replace each one's backward; returns the count."""
    backward_nodes = _backward_nodes(graph)
    copy = _forward_copy(graph, backward_nodes)
    canonicalize(copy.graph)  # a merged duplicate's origins go to the node kept (ORIGIN)
    _found.clear()
    pass_dict.apply(copy.graph)
    found, seen_outputs = list(_found), set()
    _found.clear()
    index = _SequenceIndex(graph, backward_nodes)
    count = 0
    for item in found:
        if item.y in seen_outputs:
            continue  # two forms that trace to one graph (fp32)
        seen_outputs.add(item.y)
        try:
            region = _find_region(item, backward_nodes, index)
            if region is None:
                continue
            reason = _refusal(region)
            if reason is not None:
                raise _Refused(reason)
        except _Refused as refused:
            if refused.args[0]:
                match_report.record_near_miss(FAMILY.name, refused.args[0])
            continue
        backward_nodes -= region.backward
        index.forget(region.backward)
        backward_nodes.update(_replace(region))
        _variant_counts[region.found.variant.name] += 1
        count += 1
    return count
