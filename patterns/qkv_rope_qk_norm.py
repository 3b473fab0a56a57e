"""QKV projection -> RoPE -> per-head RMSNorm (or the norm, then RoPE), trained with our backward.

Matched in the joint (forward + backward) graph, from ``joint_custom_pre_pass``: only there can
the gradient formulas change. ``no_grad`` graphs pass through the same hook but are left alone:
the replacement's forward is the region's own computation, so there is nothing to gain there.

unfused, fused weight (HunyuanImage-3 style; contiguous [q | k | v] rows)::

    qkv = self.qkv_proj(hidden_states)                        # nn.Linear(K, (Hq + 2 Hkv) D, bias=?)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = q.view(bsz, q_len, -1, D).transpose(1, 2)             # likewise k, v
    query_states, key_states = apply_rotary_pos_emb(q, k, cos, sin)
    query_states = self.query_layernorm(query_states)
    key_states = self.key_layernorm(key_states)

unfused, separate weights (Hugging Face ``HunYuanDenseV1Attention.forward``)::

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    query_states = self.query_layernorm(query_states)
    key_states = self.key_layernorm(key_states)

unfused, Qwen3's order (Hugging Face ``Qwen3Attention.forward``; Qwen3-MoE, GLM-4-MoE, Dots1
alike): the per-head norm on the [B, S, H, D] view, before the transpose and RoPE::

    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    with apply_rotary_pos_emb = (cos, sin = cos.unsqueeze(1), sin.unsqueeze(1);
                                 q * cos + rotate_half(q) * sin; likewise k)
    and RMSNorm(x) = weight * (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

fused (``kernels/qkv_rope_qk_norm_op.py``, ``QKVRopeQKNormFunction``)::

    q, k, v = QKVRopeQKNormFunction.apply(
        hidden_states, q_norm_weight, k_norm_weight, cos, sin, Hq, Hkv, q_eps, k_eps,
        rope_first, 1 or 3, *weights, *biases)
    # forward: the same projection -> RoPE -> norm (or norm -> RoPE) in plain torch ops, plus
    #   the fp32 rstd it saves; Inductor compiles it into its own fused kernels, as it does the
    #   model's code.
    # backward (CUDA): the elementwise Triton pass as kernel nodes of the graph, writing grad_qkv
    #   in [B*S, qkv_size], then the GEMMs as aten.mm nodes: Inductor launches all of it from its
    #   generated code (cuBLAS or its own GEMM templates); every backward op of the region is gone.
    #   CPU graphs (and symbolic B*S): one torch.ops.fusion_pass.qkv_rope_qk_norm_backward.

The matched region ends v at the projection output (see _V_OUTSIDE) and starts at the
unsqueezed cos/sin. Not matched (no fusion, no wrong result): the official HunyuanImage-3.0
layout, whose fused rows are grouped per kv head ([q * G, k, v] x Hkv, split at dim 3), the
norm after the transpose in Qwen3's order (Gemma3), other norm forms, partial rotary, autocast
(casts before the GEMMs), frozen projection weights with a trainable input (LoRA), and
``dynamic=True`` without ``specialize_float`` (reported). The per-tensor family
(``patterns/qk_norm_rope_backward.py``), which runs next, fuses the norm and RoPE of those.

Variants (one registration each; generated below from ONE search function per structure):
structure (fused / separate) x bias (no / yes) x dtype family (fp32: no casts; bf16 and fp16:
the norm's casts) x norm weights (trainable / frozen) x cos and sin (constants / requiring
grad): every ``requires_grad`` combination changes the joint graph (32 registrations); and
Qwen3's order with constant cos/sin (16 more). The ``unsqueeze(cos, 1)`` nodes are outside the
pattern (the search functions take the unsqueezed tables): Inductor's CSE merges them across
layers, so inside a pattern they would have users outside it. The fused split sizes and both
epsilons are captured as scalars (``scalar_workaround``); everything the replacements compute
comes from the bound values.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    gen_pattern,
    joint_fwd_bwd,
    register_replacement,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from fusion_pass import config as fusion_config
from fusion_pass import match_report
from fusion_pass.families import Family
from fusion_pass.matching import match_value
from fusion_pass.pattern_cache import inputs_signature, traced_pattern
from fusion_pass.patterns.canonical_forms import NOOP_VIEWS_AND_COPIES, SCATTER_SUMS
# The Hugging Face building blocks (HunYuanDenseV1RMSNorm, apply_rotary_pos_emb), op for op.
from fusion_pass.kernels.qk_norm_rope_cache_reference import rms_norm_reference, rope_reference
from fusion_pass.kernels.qkv_rope_qk_norm_op import QKVRopeQKNormFunction
from fusion_pass.kernels.rounding import SUPPORTED_DTYPES

FAMILY = Family("qkv_rope_qk_norm", "QKV projection -> RoPE -> per-head RMSNorm, fused forward and backward",
                stage="joint")

# Unusual scalars that stand for the captured values while tracing (they must not collide with
# any other constant of the traced graphs: see _EXAMPLE below).
_EPS_WORKAROUND = {"q_eps": 1.2345e-5, "k_eps": 2.3456e-5}
_SIZE_WORKAROUND = {"q_size": 48, "kv_size": 24}


# ----------------------------------------------------------------------------------------------
# Search functions: the model code, verbatim in structure (the HF modules' order of operations).
# ----------------------------------------------------------------------------------------------


def _apply_rotary_pos_emb(q, k, cos, sin):
    """``apply_rotary_pos_emb`` after its ``unsqueeze(1)`` (cos/sin arrive [Bc, 1, S, D])."""
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


def _rope_norm(q, k, cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps):
    query_states, key_states = _apply_rotary_pos_emb(q, k, cos, sin)
    query_states = rms_norm_reference(query_states, q_norm_weight, q_eps)
    key_states = rms_norm_reference(key_states, k_norm_weight, k_eps)
    return query_states, key_states


def _heads_then_rope_norm(q, k, cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps, rope_first):
    """q, k [B, S, H, D] (the projections' views) -> the attention's q, k [B, H, S, D]: transpose,
    RoPE, norm (HunYuanDenseV1); or, ``rope_first=False``, norm, transpose, RoPE (Qwen3)."""
    if rope_first:
        return _rope_norm(q.transpose(1, 2), k.transpose(1, 2), cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps)
    q = rms_norm_reference(q, q_norm_weight, q_eps).transpose(1, 2)
    k = rms_norm_reference(k, k_norm_weight, k_eps).transpose(1, 2)
    return _apply_rotary_pos_emb(q, k, cos, sin)


def _fused_qkv_search(
    hidden, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, cos, sin, q_eps, k_eps, q_size, kv_size,
    rope_first=True,
):
    bsz, q_len = hidden.shape[0], hidden.shape[1]
    head_dim = q_norm_weight.shape[0]
    qkv = F.linear(hidden, qkv_weight, qkv_bias)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(bsz, q_len, -1, head_dim)
    k = k.view(bsz, q_len, -1, head_dim)
    # v's view and transpose stay outside: see _V_OUTSIDE.
    return (*_heads_then_rope_norm(q, k, cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps, rope_first), v)


def _separate_qkv_search(
    hidden, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight, cos, sin,
    q_eps, k_eps, rope_first=True,
):
    hidden_shape = (*hidden.shape[:-1], -1, q_norm_weight.shape[0])
    q = F.linear(hidden, q_weight, q_bias).view(hidden_shape)
    k = F.linear(hidden, k_weight, k_bias).view(hidden_shape)
    v = F.linear(hidden, v_weight, v_bias)  # .view(hidden_shape).transpose(1, 2) stays outside
    return (*_heads_then_rope_norm(q, k, cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps, rope_first), v)


# _V_OUTSIDE: the patterns end v at the projection output ([B, S, Hkv * D]). Its view and
# transpose, and their backward (permute -> clone? -> view), stay outside: whether the backward
# needs that clone depends on the layout of the gradient arriving from the attention (contiguous
# from eager attention or repeat_kv, [B, S, H, D]-ordered from some SDPA kernels), which a traced
# pattern would burn in. The q and k gradients are laid out by the RoPE backward's zero-filled
# slice_scatter, so their paths do not depend on it.


# ----------------------------------------------------------------------------------------------
# Replacements: same signatures; every size comes from the bound tensors and scalars.
# ----------------------------------------------------------------------------------------------


def _fused_op(hidden, weights, biases, q_norm_weight, k_norm_weight, cos, sin, q_heads, kv_heads, q_eps, k_eps,
              rope_first):
    # Forward in plain torch ops (Inductor fuses it as it fuses the model's code), backward ours.
    q, k, v = QKVRopeQKNormFunction.apply(
        hidden, q_norm_weight, k_norm_weight, cos.squeeze(1), sin.squeeze(1), q_heads, kv_heads, q_eps, k_eps,
        rope_first, len(weights), *weights, *biases,
    )
    # v [B, Hkv, S, D] ([B, S, Hkv, D] in memory) -> [B, S, Hkv * D], a view (see _V_OUTSIDE).
    return q, k, v.transpose(1, 2).flatten(2)


def _fused_qkv_replacement(
    hidden, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, cos, sin, q_eps, k_eps, q_size, kv_size,
    rope_first=True,
):
    head_dim = q_norm_weight.shape[0]
    return _fused_op(
        hidden, [qkv_weight], [] if qkv_bias is None else [qkv_bias], q_norm_weight, k_norm_weight, cos, sin,
        q_size // head_dim, kv_size // head_dim, q_eps, k_eps, rope_first,
    )


def _separate_qkv_replacement(
    hidden, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight, cos, sin,
    q_eps, k_eps, rope_first=True,
):
    head_dim = q_norm_weight.shape[0]
    biases = [] if q_bias is None else [q_bias, k_bias, v_bias]
    return _fused_op(
        hidden, [q_weight, k_weight, v_weight], biases, q_norm_weight, k_norm_weight, cos, sin,
        q_weight.shape[0] // head_dim, k_weight.shape[0] // head_dim, q_eps, k_eps, rope_first,
    )


# ----------------------------------------------------------------------------------------------
# Checks on the real (fake-tensor) values bound by a match.
#
# The patterns are pre-traced (``search_fn_pattern``): the matcher does not re-trace them with the
# real shapes, because with dynamic B or S that re-trace puts the SymInt arithmetic of the
# linear's view (``B * S``) into the pattern, where its users never agree with the real graph
# ("multiple_users"). Every int of the pattern is therefore a wildcard, and the checks below
# verify what the re-trace would have: the rotation halves AND their roles (which half is negated
# and where each goes: ``cat((-x1, x2))`` has the same ops and ints as rotate_half's
# ``cat((-x2, x1))``), the norm's reduction and exponent, the casts, the head layout, the split,
# and the geometry of every bound tensor. In joint matches the backward's rotate_half routing
# (which gradient half is negated, which half of x it is scattered into) is checked as well,
# rather than assumed to be autograd's derivative of the checked forward.
# ----------------------------------------------------------------------------------------------

aten = torch.ops.aten

_variant_counts: collections.Counter[str] = collections.Counter()


def variant_counts() -> dict[str, int]:
    """Replacements per registered variant (name -> count) since ``reset_variant_counts()``."""
    return dict(_variant_counts)


def reset_variant_counts() -> None:
    _variant_counts.clear()


def _near_miss(reason: str) -> bool:
    match_report.record_near_miss(FAMILY.name, reason)
    return False


def _same(a, b) -> bool:
    """``a == b`` for ints and SymInts, without adding guards (unknown counts as different)."""
    return statically_known_true(sym_eq(a, b))


def _same_shape(t: torch.Tensor, shape) -> bool:
    return t.dim() == len(shape) and all(_same(a, b) for a, b in zip(t.shape, shape))


def _is_last_dim(node: Any, dim: Any) -> bool:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and isinstance(dim, int) and dim in (-1, value.dim() - 1)


def _slice_bounds(node: Any) -> tuple[Any, Any, Any, Any, Any] | None:
    """(input, dim, start, end, step) of an ``aten.slice.Tensor`` node; None for anything else."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.slice.Tensor):
        return None
    x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    return x, dim, start, end, step


def _half_of(node: Any, head_dim: int) -> tuple[str, Any] | None:
    """(``"first"`` for ``x[..., :D/2]`` / ``"second"`` for ``x[..., D/2:]``, x) when ``node`` is
    a slice of one half of x's last dim ([0:D/2] or [D/2:end >= D], step 1); None otherwise."""
    bounds = _slice_bounds(node)
    if bounds is None:
        return None
    x, dim, start, end, step = bounds
    return _which_half(x, dim, start, end, step, head_dim)


def _which_half(x: Any, dim: Any, start: Any, end: Any, step: Any, head_dim: int) -> tuple[str, Any] | None:
    half = head_dim // 2
    if not _is_last_dim(x, dim) or step != 1:
        return None
    if start in (0, None) and end == half:
        return "first", x
    if start == half and (end is None or (isinstance(end, int) and end >= head_dim)):
        return "second", x
    return None


def _is_neg(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.neg.default


def _rotate_half_problem(cat: torch.fx.Node, head_dim: int) -> str | None:
    """A forward ``cat`` of the match must be rotate_half's ``cat((-x[..., D/2:], x[..., :D/2]), -1)``:
    the negated slice is the SECOND half and comes first, the plain slice is the FIRST half, both of
    one x. (The pre-traced pattern's slice ints are wildcards: ``cat((-x1, x2))`` has the same ops.)"""
    parts = cat.args[0]
    if len(parts) != 2 or not _is_neg(parts[0]):
        return "a concatenation that is not rotate_half's cat((-x2, x1))"
    negated, plain = _half_of(parts[0].args[0], head_dim), _half_of(parts[1], head_dim)
    if negated is None or plain is None or negated[1] is not plain[1]:
        return "rotate_half's concatenated slices are not the two halves of one tensor"
    if (negated[0], plain[0]) != ("second", "first"):
        return f"rotate_half as cat((-{negated[0]} half, {plain[0]} half)), not cat((-second, first))"
    return None


def _rotate_half_grad_problem(scatter: torch.fx.Node, head_dim: int) -> str | None:
    """A backward ``slice_scatter`` of the match must route rotate_half's gradient g back to x:
    ``-g[..., :D/2]`` into x's [D/2:] (x2 went to the first half, negated) and ``g[..., D/2:]``
    into x's [:D/2] (x1 went to the second half), each into zeros."""
    base, src = scatter.args[0], scatter.args[1]
    dim, start, end, step = (list(scatter.args[2:]) + [0, None, None, 1][len(scatter.args) - 2:])[:4]
    target = _which_half(base, dim, start, end, step, head_dim)
    if not (isinstance(base, torch.fx.Node) and base.target is aten.full.default and base.args[1] == 0):
        return "a slice_scatter into something other than zeros"
    if target is None:
        return "a slice_scatter outside the halves of the head dim"
    negated = _is_neg(src)
    source = _half_of(src.args[0] if negated else src, head_dim)
    if source is None:
        return "a slice_scatter of something other than a half of the rotate_half gradient"
    # g[..., D/2:] (plain) -> x[..., :D/2];  -g[..., :D/2] -> x[..., D/2:]
    expected = {"first": ("second", False), "second": ("first", True)}[target[0]]
    if (source[0], negated) != expected:
        return (f"rotate_half gradient routed as {'-' if negated else ''}g[{source[0]} half] -> "
                f"x[{target[0]} half] (not the derivative of cat((-x2, x1)))")
    return None


def _semantics_problem(match: Match, head_dim: int, dtype: torch.dtype) -> str | None:
    """What in the matched nodes differs from the modelled code (None: nothing).

    Beyond the per-node checks (every slice at one of the halves, every reduction over the head
    dim, ...), the roles of the rotation's nodes: which half is negated and where each half goes,
    in the forward ``cat`` and in the backward's ``slice_scatter`` routing (joint matches)."""
    half = head_dim // 2
    grad_roles: dict[Any, list[str]] = collections.defaultdict(list)
    for node in match.nodes:
        target, args = node.target, node.args
        if target in (aten.slice.Tensor, aten.slice_scatter.default):
            x, rest = (args[0], args[1:]) if target is aten.slice.Tensor else (args[0], args[2:])
            dim, start, end = (list(rest) + [0, None, None])[:3]
            step = rest[3] if len(rest) > 3 else 1
            if not _is_last_dim(x, dim) or step != 1:
                return "a slice outside the head dim"
            if _which_half(x, dim, start, end, step, head_dim) is None:
                return f"rotate_half split at [{start}:{end}], not at head_dim / 2 = {half}"
            if target is aten.slice_scatter.default:
                problem = _rotate_half_grad_problem(node, head_dim)
                if problem is not None:
                    return problem
                src = args[1].args[0] if _is_neg(args[1]) else args[1]
                grad_roles[src.args[0]].append("neg" if _is_neg(args[1]) else "plain")
        elif target is aten.cat.default:
            if not _is_last_dim(args[0][0], args[1] if len(args) > 1 else 0):
                return "a concatenation outside the last dim"
            if len(args[0]) != 3:  # 3: the QKV split's backward; anything else: rotate_half
                problem = _rotate_half_problem(node, head_dim)
                if problem is not None:
                    return problem
        elif target is aten.split_with_sizes.default:
            if not _is_last_dim(args[0], args[2] if len(args) > 2 else 0):
                return "the QKV split is not over the last dim"
        elif target is aten.mean.dim:
            if not (len(args[1]) == 1 and _is_last_dim(args[0], args[1][0]) and args[2] is True):
                return "the norm does not reduce over the head dim"
        elif target is aten.pow.Tensor_Scalar:
            of_rsqrt = isinstance(args[0], torch.fx.Node) and args[0].target is aten.rsqrt.default
            if (of_rsqrt and args[1] != 3) or (not of_rsqrt and args[1] not in (2, 1.0)):
                return f"pow exponent {args[1]} (the RMS is a mean of squares)"
        elif target is aten.permute.default:
            if list(args[1]) not in ([0, 2, 1, 3], [1, 0]):
                return f"permute {list(args[1])} (heads are transpose(1, 2))"
        elif target is torch.ops.prims.convert_element_type.default:
            if args[1] not in (torch.float32, dtype):
                return f"a cast to {args[1]}"
    # Each rotate_half gradient is split into exactly one negated and one plain half.
    if any(sorted(roles) != ["neg", "plain"] for roles in grad_roles.values()):
        return "the rotate_half gradient's halves are not routed once each"
    return None


def _check(match: Match, tensor_names: tuple[str, ...], q_size: int, kv_size: int, weight_cols: list[Any]) -> bool:
    """Checks shared by both structures (``q_size``/``kv_size``: the projection widths)."""
    nodes = [match.kwargs[n] for n in tensor_names]
    if len(set(nodes)) != len(nodes):
        return False  # one graph value bound to two pattern inputs: not the modelled code
    values = {n: match_value(match, n) for n in tensor_names}
    if any(not isinstance(v, torch.Tensor) for v in values.values()):
        return False
    hidden, q_w, k_w = values["hidden"], values["q_norm_weight"], values["k_norm_weight"]
    cos, sin = values["cos"], values["sin"]
    if not fusion_config.device_allowed(hidden.device):
        return _near_miss(f"device type {hidden.device.type!r} is not enabled (fusion_pass.install(devices=...))")
    if any(v.device != hidden.device for v in values.values()):
        return _near_miss("inputs on different devices")
    if hidden.dtype not in SUPPORTED_DTYPES:
        return _near_miss(f"dtype {hidden.dtype} is not one of bf16, fp16, fp32")
    if any(v.dtype != hidden.dtype for v in values.values()):
        return _near_miss("norm weights, cos/sin or projection weights differ in dtype from the activations")
    for name in ("q_eps", "k_eps"):
        if not isinstance(match.kwargs[name], (int, float)):
            return _near_miss("the norm's eps is a graph input (torch.compile(dynamic=True) lifts floats: "
                              "set torch._dynamo.config.specialize_float = True)")
    if hidden.dim() != 3 or q_w.dim() != 1 or tuple(k_w.shape) != tuple(q_w.shape):
        return False
    head_dim = q_w.shape[0]
    if not isinstance(head_dim, int) or head_dim % 2:
        return _near_miss(f"head_dim {head_dim} is not an even constant (RoPE rotates halves)")
    if q_size % head_dim or kv_size % head_dim or kv_size == 0:
        return False
    q_heads, kv_heads = q_size // head_dim, kv_size // head_dim
    if q_heads % kv_heads:
        return _near_miss(f"{q_heads} query heads is not a multiple of {kv_heads} key/value heads")
    if not all(_same(cols, hidden.shape[2]) for cols in weight_cols):
        return False
    batch, seq = hidden.shape[0], hidden.shape[1]
    if cos.dim() != 4 or not _same_shape(sin, cos.shape):
        return False
    if not (_same(cos.shape[1], 1) and _same(cos.shape[2], seq) and _same(cos.shape[3], head_dim)
            and (_same(cos.shape[0], 1) or _same(cos.shape[0], batch))):
        return _near_miss(f"cos/sin of shape {tuple(cos.shape)} (expected [1 or B, 1, S, D] after unsqueeze)")
    outputs = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in match.output_nodes()[:3]]
    expected = [(batch, q_heads, seq, head_dim), (batch, kv_heads, seq, head_dim), (batch, seq, kv_size)]
    if not all(isinstance(o, torch.Tensor) and _same_shape(o, e) for o, e in zip(outputs, expected)):
        return False  # q / k / v are not the [B, H, S, D] heads of the projection
    if _semantics_problem(match, head_dim, hidden.dtype) is not None:
        return False
    return True


def _check_fused(match: Match) -> bool:
    names = ("hidden", "qkv_weight", "q_norm_weight", "k_norm_weight", "cos", "sin")
    if "qkv_bias" in match.kwargs:
        names += ("qkv_bias",)
    q_size, kv_size = match.kwargs["q_size"], match.kwargs["kv_size"]
    if type(q_size) is not int or type(kv_size) is not int:
        return False
    weight = match_value(match, "qkv_weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not _same(weight.shape[0], q_size + 2 * kv_size):
        return False  # the split does not cover the projection: some other layout
    return _check(match, names, q_size, kv_size, [weight.shape[1]])


def _check_separate(match: Match) -> bool:
    names = ("hidden", "q_weight", "k_weight", "v_weight", "q_norm_weight", "k_norm_weight", "cos", "sin")
    if "q_bias" in match.kwargs:
        names += ("q_bias", "k_bias", "v_bias")
    weights = [match_value(match, n) for n in ("q_weight", "k_weight", "v_weight")]
    if any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in weights):
        return False
    if not _same_shape(weights[2], weights[1].shape):
        return False
    rows = [w.shape[0] for w in weights]
    if any(type(r) is not int for r in rows):
        return False
    return _check(match, names, rows[0], rows[1], [w.shape[1] for w in weights])


def _counting(check: Callable[[Match], bool], name: str) -> Callable[[Match], bool]:
    def extra_check(match: Match) -> bool:
        accepted = check(match)
        if accepted:
            _variant_counts[name] += 1
        return accepted

    return extra_check


# ----------------------------------------------------------------------------------------------
# Registration.
# ----------------------------------------------------------------------------------------------


def _joint_fwd_bwd_static_ints(fn: Callable, args, **kwargs) -> torch.fx.GraphModule:
    """``joint_fwd_bwd`` with the int arguments (the fused split sizes) kept as Python constants.

    AOT autograd turns int arguments into SymInts of the ambient ShapeEnv: at match time that is
    Dynamo's, which then fails to build guards for those source-less symbols. The ints are baked
    into the trace instead and a float stands in for each at its placeholder (the pattern binds
    the sizes through ``scalar_workaround``, not through the placeholder).
    """
    args = list(args)
    ints = {i: a for i, a in enumerate(args) if type(a) is int}
    if not ints:
        return joint_fwd_bwd(fn, args, **kwargs)

    def with_ints(*traced_args):
        return fn(*(ints.get(i, a) for i, a in enumerate(traced_args)))

    with_ints.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    return joint_fwd_bwd(with_ints, [float(a) if i in ints else a for i, a in enumerate(args)], **kwargs)


def _without(fn: Callable, **fixed: Any) -> Callable:
    """``functools.partial`` that also drops the fixed parameters from the signature (the
    pattern matcher names pattern inputs after the signature)."""
    signature = inspect.signature(fn)
    kept = [p for name, p in signature.parameters.items() if name not in fixed]
    kept_names = [p.name for p in kept]

    def wrapper(*args):
        return fn(**dict(zip(kept_names, args)), **fixed)

    wrapper.__name__ = fn.__name__  # no functools.wraps: tracers would follow __wrapped__
    wrapper.__signature__ = signature.replace(parameters=kept)  # type: ignore[attr-defined]
    return wrapper


# Example geometry for tracing: B=2, S=5, K=14, D=8, Hq=6, Hkv=3 (q_size 48, kv_size 24: no
# other constant of the traced graphs equals them).
_EXAMPLE = {"batch": 2, "seq": 5, "hidden": 14, "head_dim": 8, "q_heads": 6, "kv_heads": 3}


def _example_inputs(structure: str, bias: bool, dtype: torch.dtype, norm_grad: bool, rope_grad: bool,
                    training: bool) -> list[torch.Tensor]:
    e = _EXAMPLE
    q_size, kv_size = e["q_heads"] * e["head_dim"], e["kv_heads"] * e["head_dim"]
    assert (q_size, kv_size) == (_SIZE_WORKAROUND["q_size"], _SIZE_WORKAROUND["kv_size"])

    def t(*shape, grad: bool = training) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype).requires_grad_(grad and training)

    hidden = t(e["batch"], e["seq"], e["hidden"])
    rows = [q_size + 2 * kv_size] if structure == "fused" else [q_size, kv_size, kv_size]
    weights = [t(n, e["hidden"]) for n in rows]
    biases = [t(n) for n in rows] if bias else []
    norms = [t(e["head_dim"], grad=norm_grad), t(e["head_dim"], grad=norm_grad)]
    # cos and sin must be distinct tensors (a shared example merges them in the pattern).
    tables = [t(1, 1, e["seq"], e["head_dim"], grad=rope_grad), t(1, 1, e["seq"], e["head_dim"], grad=rope_grad)]
    return [hidden, *weights, *biases, *norms, *tables]


def variant_name(structure: str, bias: bool, dtype: torch.dtype, training: bool, norm_grad: bool = False,
                 rope_grad: bool = False, rope_first: bool = True) -> str:
    """The registration's name, e.g. ``fused_bias_lowp_joint_normgrad_ropeconst`` (lowp: bf16/fp16;
    Qwen3's order, the norm before RoPE, ends in ``_normfirst``)."""
    dtype_name = "fp32" if dtype == torch.float32 else "lowp"
    mode = "inference"
    if training:
        mode = f"joint_norm{'grad' if norm_grad else 'frozen'}_rope{'grad' if rope_grad else 'const'}"
    return f"{structure}_{'bias' if bias else 'nobias'}_{dtype_name}_{mode}{'' if rope_first else '_normfirst'}"


def _variants():
    """(structure, bias, dtype, training, norm_grad, rope_grad, rope_first) of every registration.

    Joint graphs only: the replacement's forward is the region's own computation in torch ops
    (only the backward is ours), so a ``no_grad`` graph has nothing to gain and is left alone.
    Qwen3's order (``rope_first=False``) only with constant cos/sin: its models take the tables
    from a rotary module without parameters, and each variant costs compile time.
    """
    for structure, bias, dtype in itertools.product(("fused", "separate"), (False, True),
                                                    (torch.float32, torch.bfloat16)):
        for norm_grad, rope_grad in itertools.product((True, False), (False, True)):
            yield structure, bias, dtype, True, norm_grad, rope_grad, True
        for norm_grad in (True, False):
            yield structure, bias, dtype, True, norm_grad, False, False


def applies_to(graph: torch.fx.Graph) -> bool:
    """Only joint graphs can match (every registration is a forward + backward pattern). AOT
    autograd names the backward's incoming gradients ``tangents_<i>``; inference graphs, which
    pass through the same hook, have none, and then the patterns are not even registered."""
    return any(node.op == "placeholder" and node.name.startswith("tangents") for node in graph.nodes)


@dataclasses.dataclass(frozen=True)
class Registration:
    """One variant as ``register_replacement`` takes it; ``trace()`` gives its pattern."""

    name: str
    search: Callable
    replace: Callable
    check: Callable
    example_inputs: list
    scalars: dict
    tensor_names: tuple

    def trace(self):
        return gen_pattern(self.search, self.example_inputs, _joint_fwd_bwd_static_ints, self.scalars,
                           self.tensor_names)

    def signature(self) -> str:
        """What the traced pattern depends on beyond the sources (``pattern_cache``'s key)."""
        return repr((inputs_signature(self.example_inputs), sorted(self.scalars.items()), self.tensor_names))


def registrations() -> list[Registration]:
    """Every variant of ``_variants()``, ready to trace and register (under fake mode: see ``register``)."""
    out = []
    for structure, bias, dtype, training, norm_grad, rope_grad, rope_first in _variants():
        if structure == "fused":
            search, replace, check = _fused_qkv_search, _fused_qkv_replacement, _check_fused
            scalars = {**_EPS_WORKAROUND, **_SIZE_WORKAROUND}
            tensor_names = ("hidden", "qkv_weight", "qkv_bias", "q_norm_weight", "k_norm_weight", "cos", "sin")
            no_bias = {"qkv_bias": None}
        else:
            search, replace, check = _separate_qkv_search, _separate_qkv_replacement, _check_separate
            scalars = dict(_EPS_WORKAROUND)
            tensor_names = ("hidden", "q_weight", "k_weight", "v_weight", "q_bias", "k_bias", "v_bias",
                            "q_norm_weight", "k_norm_weight", "cos", "sin")
            no_bias = {"q_bias": None, "k_bias": None, "v_bias": None}
        fixed = dict(rope_first=rope_first)
        if not bias:
            fixed.update(no_bias)
            tensor_names = tuple(n for n in tensor_names if n not in no_bias)
        out.append(Registration(
            name=variant_name(structure, bias, dtype, training, norm_grad, rope_grad, rope_first),
            search=_without(search, **fixed), replace=_without(replace, **fixed), check=check,
            example_inputs=_example_inputs(structure, bias, dtype, norm_grad, rope_grad, training),
            scalars=scalars, tensor_names=tensor_names,
        ))
    names = [r.name for r in out]
    assert len(set(names)) == len(names), "two variants share a name (and a pattern_cache file)"
    return out


def register(pass_dict: PatternMatcherPass) -> None:
    """Register every variant (traced with joint_fwd_bwd, or loaded from ``pattern_cache``) into
    ``pass_dict``.

    ``fusion_pass.passes`` calls this outside any compile's tracing context, under a fresh
    FakeTensorMode and with inference mode off (the joint patterns need autograd).
    """
    for r in registrations():
        register_replacement(
            r.search,
            r.replace,
            r.example_inputs,
            _joint_fwd_bwd_static_ints,
            pass_dict,
            extra_check=_counting(r.check, r.name),
            scalar_workaround=r.scalars,
            exclusive_arg_names=r.tensor_names,
            search_fn_pattern=traced_pattern(f"qkv_rope_qk_norm_{r.name}", r.trace, r.signature()),
        )


#: Before matching the joint graph as ``joint_custom_pre_pass`` gets it.
REWRITES = (NOOP_VIEWS_AND_COPIES, SCATTER_SUMS)
