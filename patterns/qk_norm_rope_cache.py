"""Fusion ``qk_norm_rope_cache``: per-head RMSNorm(q, k) -> RoPE -> K/V cache write.

The model code matched (Hugging Face ``Qwen3Attention.forward`` with a ``StaticCache``)::

    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    # StaticCache.update:
    self.keys.index_copy_(2, cache_position, key_states)      # or keys[:, :, cache_position] = k
    self.values.index_copy_(2, cache_position, value_states)  # or keys[:, :, start:end] = k

with ``Qwen3RMSNorm``: ``weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(dtype)``
and ``apply_rotary_pos_emb``: ``x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)``.

unfused (post-grad graph, per layer)::

    q [B,S,Hq,D] -> f32 -> pow -> mean -> add eps -> rsqrt -> mul -> bf16 -> mul w -> permute -> RoPE -> q_rot
    k [B,S,Hkv,D] -> (same) -> RoPE -> k_rot -> index_put(k_cache, [None, None, pos], k_rot)
    v [B,Hkv,S,D] -> index_put(v_cache, [None, None, pos], v)

fused (CUDA: the Triton kernel itself is the node, ``kernels/triton_call.py``)::

    out = triton_kernel_wrapper_functional(_qk_norm_rope_cache_kernel, grid, kwargs={q, k, v, ...,
                                           k_cache, v_cache, strides, sizes, constexprs},
                                           tensors_to_clone=[q_out, k_out, k_cache, v_cache])

fused (CPU graphs, and ``dynamic=True``'s tensor eps)::

    q_rot, k_rot, k_cache', v_cache' = auto_functionalized(fusion_pass.qk_norm_rope_cache, ...)

The pattern ends at the functional cache writes and never spans the ``copy_`` write-back that
functionalization appends for the mutated cache inputs; Inductor re-inplaces the kernel node (or
``auto_functionalized``) on the cache buffers, so no cache-sized copy is made, and on CUDA its
generated wrapper launches the kernel itself: no op, no Python check per call. Everything the
launch needs (tile, grid, strides, constexprs) is derived from the matched values when the
replacement is traced, once per compile, also for a symbolic sequence length.

Variants: one registration each, generated from one definition (``VARIANTS``): the norm's form
(``norm_forms.NORM_FORMS``), its place (before or after the head transpose, or on flattened
tokens), the cache write (dense ``index_put`` / ``index_copy_`` / slice assignment, paged or flat
through a slot mapping; ``cache_write_forms``), the order (RoPE first: HunYuan), partial or
interleaved rotary, RoPE before the transpose (Gemma3n, Gemma4). Each axis with the model code it
matches: ``docs/fusions.md``, "The forward patterns' variants". bf16 and fp16 share a registration:
the matcher re-traces each candidate with its real dtypes and shapes before accepting it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch._inductor.fx_passes.post_grad import remove_assert_ops
from torch._inductor.pattern_matcher import Match, gen_pattern, register_replacement

from fusion_pass import config as fusion_config
from fusion_pass import match_report
from fusion_pass.families import Family
from fusion_pass.rewrites import Rewrite
from fusion_pass.kernels.argument_errors import ArgumentError
from fusion_pass.kernels.qk_norm_rope_cache_op import (
    check_qk_norm_rope_cache_args,
    check_qk_norm_rope_paged_cache_args,
    output_dtype,
    paged_cache_rows,
    unsupported_reason,
)
from fusion_pass.kernels.qk_norm_rope_cache_triton import WRITTEN_ARGS as CACHE_KERNEL_WRITTEN_ARGS
from fusion_pass.kernels.qk_norm_rope_cache_triton import KernelForm, cache_kernel_call
from fusion_pass.kernels.triton_device import kernels_in_graph
# The Hugging Face building blocks, op for op: traced, they are the model's graph.
from fusion_pass.kernels.qk_norm_rope_cache_reference import (
    interleaved_rope_reference,
    partial_interleaved_rope_reference,
    partial_rope_reference,
    rope_reference,
)
from fusion_pass.matching import VIEW_OPS, EPS_EXAMPLE, apply_first_to_last, match_value, trace_as_post_grad
from fusion_pass.pattern_cache import inputs_signature, retraced_check, traced_pattern
from fusion_pass.patterns.cache_write_forms import BATCH_OF_ONE_RESHAPES, FLAT_CACHE_VIEWS, SLICE_WRITES
from fusion_pass.patterns.canonical_forms import CANONICAL_FORMS, CONTIGUOUS_COPIES, HALF_TABLE_ROTATIONS
from fusion_pass.patterns.norm_forms import NORM_FORMS, NormForm
from fusion_pass.patterns.qk_norm_rope_cache_near_misses import REFUSED, near_miss_pass, report_unmatched_prologues
from fusion_pass.patterns.rotary_tables import compute_tables_in_kernels

FAMILY = Family("qk_norm_rope_cache", "per-head RMSNorm(q, k) -> RoPE -> K/V cache write, one Triton kernel",
                stage="post_grad")

aten = torch.ops.aten

# Unusual values so that the traced pattern can tell the two epsilons apart and turn them
# into keyword arguments (register_replacement's scalar_workaround).
_Q_EPS_EXAMPLE = EPS_EXAMPLE
_K_EPS_EXAMPLE = 2.3456e-5


# --- the variants ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Variant:
    """One registration: the token layout the norm sees, how the cache is written, the norm.

    layout:
        ``"bshd"``: the norm runs on ``[B, S, H, D]``, then ``transpose(1, 2)`` (Hugging Face);
        ``"bhsd"``: the norm runs on ``[B, H, S, D]`` (the SOL-ExecBench formulation);
        ``"tokens"``: ``[T, H, D]``, the tokens of all sequences flattened (vLLM), RoPE with
        ``cos.unsqueeze(1)`` of ``[T, D]``.
    cache:
        ``"dense"``: ``[B, Hkv, L, D]`` written at ``[:, :, cache_position]``;
        ``"paged"``: ``[num_blocks, block_size, Hkv, D]`` written at
        ``cache.view(-1, Hkv, D)[slot_mapping]``;
        ``"flat"``: ``[slots, Hkv, D]`` written at ``cache[slot_mapping]``.
        A paged or flat write of the ``"bshd"`` layout takes the rows as
        ``k.squeeze(0).transpose(0, 1)`` (B = 1, Hugging Face's ``PagedAttentionCache``).
    norm:
        a ``NORM_FORMS`` key: how the model spells the per-head RMSNorm.
    strided:
        q and k reach a ``"bhsd"`` norm as transposed views of ``[B, S, H, D]`` (Gemma3,
        NeoMME); registered only for norms whose graph then differs.
    rope_first:
        RoPE, then the norm (HunYuan's order); layouts ``"bhsd"`` and ``"tokens"`` (RoPE needs
        the heads before the tokens).
    partial_rope:
        partial rotary (``Glm4MoeAttention``): cos/sin are ``rotary_dim < head_dim`` wide, the
        first ``rotary_dim`` features are rotated and the rest passed through
        (``partial_rope_reference``).
    interleaved:
        GPT-J style pairs ``(x[2i], x[2i+1])`` (GLM's ``apply_rotary_pos_emb``, all features
        rotated, ``interleaved_rope_reference``); the pattern starts at the tables that multiply
        q and k, one entry per feature, however the model built them.
    rope_before_transpose:
        layout ``"bshd"`` with RoPE applied before the transpose, on ``[B, S, H, D]`` with
        ``cos.unsqueeze(2)`` (Gemma3n's and Gemma4's ``apply_rotary_pos_emb(..., unsqueeze_dim=2)``).
    autocast:
        a bf16/fp16 ``torch.autocast`` region over an fp32 model: half-precision q/k/v, fp32
        weights and tables; registered for the forms whose graph then differs (their
        ``weight.float()`` is no node: ``NormForm.casts_weight``).
    """

    layout: str
    cache: str
    norm: str = "qwen3"
    strided: bool = False
    rope_first: bool = False
    partial_rope: bool = False
    interleaved: bool = False
    rope_before_transpose: bool = False
    autocast: bool = False

    @property
    def writes_slots(self) -> bool:
        """The cache is written at a slot mapping (``"paged"`` or ``"flat"``), not at the positions
        of a dense cache."""
        return self.cache != "dense"

    @property
    def norm_form(self) -> NormForm:
        return NORM_FORMS[self.norm]


_GEOMETRIES = (("bshd", "dense"), ("bhsd", "dense"), ("bshd", "paged"), ("bshd", "flat"),
               ("tokens", "paged"), ("tokens", "flat"))
_ALL_NORMS = tuple(NORM_FORMS)
_AUTOCAST_NORMS = tuple(name for name, form in NORM_FORMS.items() if form.casts_weight)


def _variants_for(norms, geometries, **choices) -> tuple:
    """One variant per norm form and geometry with the given choices (``Variant``'s fields), two
    for a norm whose graph differs when it reads the transposed view of ``[B, S, H, D]`` (on
    ``[B, H, S, D]``; not after a partial RoPE, whose ``cat`` gives the norm a contiguous tensor)."""
    views = "bhsd" if not (choices.get("rope_first") and choices.get("partial_rope")) else None
    return tuple(Variant(layout, cache, norm, strided, **choices)
                 for norm in norms for layout, cache in geometries
                 for strided in ((False, True) if NORM_FORMS[norm].copies_strided_input and layout == views
                                 else (False,)))


# The combinations registered: each row a set of choices, with the norms and geometries it
# covers (``docs/fusions.md`` has the table; ``tests/test_fusions_doc.py`` keeps it equal).
VARIANTS = (
    _variants_for(_ALL_NORMS, _GEOMETRIES)  # Qwen3, Gemma3, ...: norm -> rotate_half RoPE -> cache
    + _variants_for(("qwen3",), [g for g in _GEOMETRIES if g[0] != "bshd"], rope_first=True)  # HunYuan
    + _variants_for(_ALL_NORMS[1:], [("bhsd", "dense")], rope_first=True)
    + _variants_for(_ALL_NORMS, [("bshd", "dense"), ("bshd", "paged"), ("bshd", "flat")],
                    partial_rope=True)  # GLM-4.5, Qwen3.5
    + _variants_for(_ALL_NORMS, [("bshd", "dense")], interleaved=True)  # GLM's RoPE
    + _variants_for(_ALL_NORMS, [("bshd", "dense")], rope_before_transpose=True)  # Gemma3n, Gemma4
    + _variants_for(_ALL_NORMS, [("bshd", "dense")], partial_rope=True, interleaved=True)  # GLM's partial RoPE
    + _variants_for(_ALL_NORMS, [("bhsd", "dense")], rope_first=True, partial_rope=True)
    + _variants_for(_ALL_NORMS, [("bhsd", "dense")], rope_first=True, interleaved=True)
    # Autocast over an fp32 model, the forms that cast their weight: Gemma3's and Qwen3-Next's
    # (after or before the transpose; partial rotary), Gemma3n's (RoPE before the transpose).
    + _variants_for(_AUTOCAST_NORMS, [("bshd", "dense"), ("bhsd", "dense")], autocast=True)
    + _variants_for(("gemma3",), [("bshd", "dense")], partial_rope=True, autocast=True)
    + _variants_for(("gemma3n",), [("bshd", "dense")], rope_before_transpose=True, autocast=True)
)


# --- the model code, as functions --------------------------------------------------------

def _norm_rope(norm: NormForm, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, norm_before_transpose,
               rope=rope_reference, rope_before_transpose=False):
    q = norm.fn(q, q_weight, q_eps)
    k = norm.fn(k, k_weight, k_eps)
    if rope_before_transpose:
        return rope(q, cos, sin).transpose(1, 2), rope(k, cos, sin).transpose(1, 2)
    if norm_before_transpose:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return rope(q, cos, sin), rope(k, cos, sin)


def _rope_norm(norm: NormForm, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, rope=rope_reference):
    """HunYuan's order: ``apply_rotary_pos_emb``, then the norm of the rotated q and k."""
    return (norm.fn(rope(q, cos, sin), q_weight, q_eps),
            norm.fn(rope(k, cos, sin), k_weight, k_eps))


def _rope(variant: Variant):
    """The variant's RoPE of one tensor: ``rotate_half`` or interleaved pairs, on all features or
    on the first ``rotary_dim`` (partial)."""
    if variant.partial_rope:
        return partial_interleaved_rope_reference if variant.interleaved else partial_rope_reference
    return interleaved_rope_reference if variant.interleaved else rope_reference


def _cache_write(variant: Variant, cache, position, rows):
    """The functional cache write of ``variant``: rows are ``[B, Hkv, S, D]`` or ``[T, Hkv, D]``."""
    if not variant.writes_slots:
        return aten.index_put.default(cache, [None, None, position], rows)
    if variant.layout == "bshd":
        rows = rows.squeeze(0).transpose(0, 1)  # [1, Hkv, S, D] -> [S, Hkv, D]
    if variant.cache == "flat":
        return aten.index_put.default(cache, [position], rows)
    # Functionalized ``cache.view(-1, Hkv, D)[slots] = rows``: the write into the flat view,
    # then the view of the result as the cache again (what the copy_ write-back reads).
    flat = aten.index_put.default(cache.reshape(-1, rows.shape[-2], rows.shape[-1]), [position], rows)
    return flat.reshape(cache.shape)


# --- search and replacement ------------------------------------------------------------------

def _search(variant: Variant):
    def search(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps):
        if variant.rope_first:
            q_rot, k_rot = _rope_norm(variant.norm_form, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps,
                                      _rope(variant))
        else:
            q_rot, k_rot = _norm_rope(variant.norm_form, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps,
                                      variant.layout == "bshd", _rope(variant), variant.rope_before_transpose)
        k_cache = _cache_write(variant, k_cache, cache_position, k_rot)
        v_cache = _cache_write(variant, v_cache, cache_position, v)
        return q_rot, k_rot, k_cache, v_cache

    return _without_weights(search) if not variant.norm_form.weighted else search


def _replace(variant: Variant):
    def replace(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps):
        return _fused(variant, q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps)

    return _without_weights(replace) if not variant.norm_form.weighted else replace


def _without_weights(fn):
    """``fn`` without its q_weight/k_weight parameters (passed as None): the pattern matcher
    binds every parameter of a search function to a graph node, and a weight-free norm has none."""
    def weight_free(q, k, v, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps):
        return fn(q, k, v, None, None, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps)

    return weight_free


def _op_layout(variant: Variant, q, k, v):
    """q, k, v as the op takes them: ``[B, H, S, D]`` (``[1, H, T, D]`` for flattened tokens)."""
    if variant.layout == "bshd":
        return q.transpose(1, 2), k.transpose(1, 2), v
    if variant.layout == "tokens":
        return q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
    return q, k, v


def cos_rows(cos, token_layout: bool, rope_before_transpose: bool = False):
    """cos (or sin) as bound by the pattern -> the op's ``[1 or B, S, D]``, or None.

    ``rope_before_transpose``: the table multiplies ``[B, S, H, D]``: ``[B or 1, S, 1, D]``
    (``unsqueeze(2)``) or ``[S, 1, D]``.

    The pattern binds the tensor that multiplies x, in whatever form the model broadcast it:
    ``[B or 1, 1, S, D]`` (``apply_rotary_pos_emb``'s ``unsqueeze(1)``), ``[1, S, D]`` or
    ``[S, D]`` (shared by the batch, broadcast by the multiply) against ``[B, H, S, D]``;
    ``[T, 1, D]`` against flattened tokens ``[T, H, D]``. A table that varies over heads is
    not one the op takes: None. Works on tensors, fake tensors and traced proxies alike.
    """
    if token_layout:
        return cos.squeeze(1).unsqueeze(0) if cos.dim() == 3 and cos.shape[1] == 1 else None
    if rope_before_transpose:
        if cos.dim() == 4:
            return cos.squeeze(2) if cos.shape[2] == 1 else None
        return cos.squeeze(1).unsqueeze(0) if cos.dim() == 3 and cos.shape[1] == 1 else None
    if cos.dim() == 4:
        return cos.squeeze(1) if cos.shape[1] == 1 else None
    if cos.dim() == 3:
        return cos if cos.shape[0] == 1 else None  # right-aligned, its first dim meets the heads
    if cos.dim() == 2:
        return cos.unsqueeze(0)
    return None


def _fused(variant: Variant, q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps):
    q, k, v = _op_layout(variant, q, k, v)
    token_layout = variant.layout == "tokens"
    cos, sin = (cos_rows(t, token_layout, variant.rope_before_transpose) for t in (cos, sin))
    # torch.compile(dynamic=True) lifts the float eps into a 0-d tensor graph input.
    eps_tensor = isinstance(q_eps, torch.Tensor) or isinstance(k_eps, torch.Tensor)
    kernel_args = {} if variant.norm_form.style == "weight" else dict(norm=variant.norm_form.style)
    if variant.rope_first:
        kernel_args["rope_first"] = True
    if variant.partial_rope:
        kernel_args["rotary_dim"] = cos.shape[-1]
    if variant.interleaved:
        kernel_args["interleaved"] = True
    # The kernel's constexprs (head_dim, head counts, rotary_dim) must be ints; only B, S and the
    # cache length may be symbolic. In models they are constants (projection widths), but a graph
    # input's head dims are symbolic under dynamic=True: such a graph keeps the op.
    static_geometry = all(isinstance(n, int) for n in (*q.shape[1:2], *k.shape[1:2], q.shape[-1], cos.shape[-1]))
    if kernels_in_graph(q) and not eps_tensor and static_geometry:
        q_rot, k_rot, k_cache, v_cache = _kernel_in_graph(variant, q, k, v, q_weight, k_weight, cos, sin, k_cache,
                                                          v_cache, cache_position, q_eps, k_eps, kernel_args)
    else:
        q_rot, k_rot, k_cache, v_cache = _op_call(variant, q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache,
                                                  cache_position, q_eps, k_eps, kernel_args, eps_tensor)
    if token_layout:
        q_rot, k_rot = q_rot.transpose(1, 2).squeeze(0), k_rot.transpose(1, 2).squeeze(0)
    return q_rot, k_rot, k_cache, v_cache


def _kernel_in_graph(variant: Variant, q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position,
                     q_eps, k_eps, kernel_args):
    """CUDA: the Triton kernel itself as a node of the graph (``TritonCall.in_graph``), so that
    Inductor's wrapper launches it and re-inplaces the caches; every launch parameter (tile,
    grid, strides) is fixed here, at trace time, from the matched values."""
    dtype = output_dtype(q, q_weight, cos, variant.norm_form.style)
    q_out, k_out = torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)
    if statically_known_true(q.numel() == 0) and statically_known_true(k.numel() == 0):
        return q_out, k_out, k_cache, v_cache
    storage = {}
    k_rows, v_rows = k_cache, v_cache
    if variant.writes_slots:
        # The kernel addresses the paged cache as [1, Hkv, slots, D] and writes the user's tensor.
        kv_heads, head_dim = k.shape[1], k.shape[3]
        k_rows = paged_cache_rows(k_cache, "key_cache", kv_heads, head_dim)
        v_rows = paged_cache_rows(v_cache, "value_cache", kv_heads, head_dim)
        storage = dict(cache_storage=(k_cache, v_cache))
    call = cache_kernel_call(q, k, v, q_weight, k_weight, cos, sin, k_rows, v_rows, cache_position, q_eps, k_eps,
                             q_out, k_out, form=KernelForm(**kernel_args), **storage, in_graph=True)
    out = call.in_graph(CACHE_KERNEL_WRITTEN_ARGS)
    return out["q_out_ptr"], out["k_out_ptr"], out["k_cache_ptr"], out["v_cache_ptr"]


def _op_call(variant: Variant, q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps,
             k_eps, kernel_args, eps_tensor: bool):
    """CPU graphs (and eps lifted to a tensor): the in-place op, which runs the PyTorch
    reference (or the Triton kernel under the interpreter)."""
    if eps_tensor:
        q_eps, k_eps = (e if isinstance(e, torch.Tensor) else torch.tensor(e, dtype=torch.float64)
                        for e in (q_eps, k_eps))
    cache_args = dict(k_cache=k_cache, v_cache=v_cache, cache_position=cache_position)
    if variant.writes_slots:
        # The paged op takes the cache tensors themselves (see the op's schema comment).
        cache_args = dict(key_cache=k_cache, value_cache=v_cache, slot_mapping=cache_position)
        op = (torch.ops.fusion_pass.qk_norm_rope_paged_cache_eps_tensor if eps_tensor
              else torch.ops.fusion_pass.qk_norm_rope_paged_cache).default
    else:
        op = (torch.ops.fusion_pass.qk_norm_rope_cache_eps_tensor if eps_tensor
              else torch.ops.fusion_pass.qk_norm_rope_cache).default
    out = auto_functionalized(op, q=q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin,
                              **cache_args, q_eps=q_eps, k_eps=k_eps, **kernel_args)
    # auto_functionalized returns the op's outputs, then the mutated caches in schema order.
    return out[0], out[1], out[2], out[3]


# --- checks ----------------------------------------------------------------------------


def _memory_root(node):
    """The node whose memory ``node`` views (itself when it is not a view)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in VIEW_OPS:
        node = node.args[0]
    return node


def _aliasing_reason(match: Match) -> str | None:
    """Why the kernel cannot run this region in place, if it aliases itself: one launch reads q,
    k, v while other programs write the cache rows, and writes both caches at once."""
    k_cache, v_cache = match.kwargs["k_cache"], match.kwargs["v_cache"]
    # One tensor as both caches: functionalization chains the second write on the first's result.
    if k_cache in match.nodes or v_cache in match.nodes or _memory_root(k_cache) is _memory_root(v_cache):
        return "k_cache and v_cache are the same tensor (left unfused: one launch would write it twice)"
    caches = {_memory_root(k_cache), _memory_root(v_cache)}
    for name in ("q", "k", "v"):
        if _memory_root(match.kwargs[name]) in caches:
            return f"{name} is a view of a cache the region writes (left unfused: the launch would read rows it overwrites)"
    return None


def _check(match: Match, variant: Variant) -> bool:
    """Accept a match only when the fused op computes exactly what the graph computed.

    The op's own argument check decides the geometry (shapes, dtypes, strides, cache length,
    devices); a match it would reject, or one the kernel does not serve, is a reported
    near-miss, never a compile-time error.
    """
    names = ("q", "k", "v", "k_cache", "v_cache", "cos", "sin")
    if len({match.kwargs[n] for n in names}) != len(names):
        return False  # symmetric branches bound to the same node
    if any(node.meta.get(REFUSED) for node in match.nodes):
        return False  # refused, with its reason, under another variant whose graph is the same here
    q, k, v = match_value(match, "q"), match_value(match, "k"), match_value(match, "v")
    if not fusion_config.device_allowed(q.device):
        return False
    token_layout = variant.layout == "tokens"
    if q.dim() != k.dim() or q.dim() != (3 if token_layout else 4):
        return False
    cos, sin = (cos_rows(match_value(match, name), token_layout, variant.rope_before_transpose) for name in ("cos", "sin"))
    if cos is None or sin is None:
        return False  # cos/sin that vary over heads: not RoPE as the op applies it
    q, k, v = _op_layout(variant, q, k, v)
    check = check_qk_norm_rope_paged_cache_args if variant.writes_slots else check_qk_norm_rope_cache_args
    reason = _aliasing_reason(match)
    try:
        if reason is None:
            order = {} if variant.writes_slots else dict(rope_first=variant.rope_first)
            check(q, k, v, match_value(match, "q_weight"), match_value(match, "k_weight"), cos, sin, match_value(match, "k_cache"),
                  match_value(match, "v_cache"), match_value(match, "cache_position"), variant.norm_form.style,
                  cos.shape[-1] if variant.partial_rope else None, variant.interleaved, **order)
            reason = unsupported_reason(q.shape[-1], q.dtype)
    except ArgumentError as error:
        reason = error.reason
    if reason is not None:
        match_report.record_near_miss(FAMILY.name, reason)
        for node in match.nodes:  # reported once, with its reason: not again as a bare norm -> RoPE
            node.meta[REFUSED] = True
        return False
    return True


# --- registration --------------------------------------------------------------------------

def _example_inputs(variant: Variant):
    batch, q_heads, kv_heads, seq, head_dim, length = 2, 4, 2, 8, 16, 24
    if variant.writes_slots:
        batch = 1  # tokens flattened into one batch row
    dtype = torch.bfloat16

    def t(*shape, dtype=dtype):
        return torch.empty(shape, dtype=dtype)

    # Autocast: fp32 weights, tables and k cache (RoPE promotes), the v cache as v (bf16).
    f32 = torch.float32 if variant.autocast else dtype

    def normed(*shape):
        """q or k as the norm sees it: contiguous, or (``variant.strided``) the transposed view
        of a [B, S, H, D] projection."""
        if not variant.strided:
            return t(*shape)
        return t(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)

    if variant.layout == "tokens":
        q, k, v = normed(seq, q_heads, head_dim), normed(seq, kv_heads, head_dim), t(seq, kv_heads, head_dim)
        cos, sin = t(seq, 1, head_dim), t(seq, 1, head_dim)
    else:
        if variant.layout == "bshd":
            q, k = normed(batch, seq, q_heads, head_dim), normed(batch, seq, kv_heads, head_dim)
        else:
            q, k = normed(batch, q_heads, seq, head_dim), normed(batch, kv_heads, seq, head_dim)
        v = t(batch, kv_heads, seq, head_dim)
        rotary_dim = head_dim // 2 if variant.partial_rope else head_dim
        table = (batch, seq, 1, rotary_dim) if variant.rope_before_transpose else (batch, 1, seq, rotary_dim)
        cos, sin = t(*table, dtype=f32), t(*table, dtype=f32)
    cache_shape = {"dense": (batch, kv_heads, length, head_dim), "paged": (3, length // 3, kv_heads, head_dim),
                   "flat": (length, kv_heads, head_dim)}[variant.cache]
    # Distinct example tensors for every argument: shared ones would merge in the pattern.
    # The epsilons are not listed: they come from scalar_workaround.
    weights = [t(head_dim, dtype=f32), t(head_dim, dtype=f32)] if variant.norm_form.weighted else []
    return [q, k, v, *weights, cos, sin, t(*cache_shape, dtype=f32), t(*cache_shape), torch.arange(seq)]


_SCALARS = {"q_eps": _Q_EPS_EXAMPLE, "k_eps": _K_EPS_EXAMPLE}
_EXCLUSIVE = ("q", "k", "v", "k_cache", "v_cache")


def variant_name(variant: Variant) -> str:
    """The variant's fields in one identifier (``pattern_cache``'s file name)."""
    return "_".join(str(int(v)) if isinstance(v, bool) else str(v) for v in dataclasses.astuple(variant))


def register(pass_dict) -> None:
    """Register every variant of this fusion into ``pass_dict`` (a ``PatternMatcherPass``): its
    pattern loaded from ``pattern_cache`` (traced in the first process), and checked at match time
    by the re-trace with the graph's shapes (``retraced_check``), then by ``_check``.

    Variants whose canonical patterns coincide (AFMoE's norm and ``nn.RMSNorm``'s, say) compute the
    same values and share one registration; the match is theirs if the re-trace of any of them
    fits the graph's strides (one form copies a strided input, the other does not)."""
    groups: dict[str, tuple] = {}
    for variant in VARIANTS:
        example_inputs = _example_inputs(variant)
        pattern = traced_pattern(
            f"qk_norm_rope_cache_{variant_name(variant)}",
            functools.partial(gen_pattern, _search(variant), example_inputs, trace_as_post_grad, _SCALARS,
                              _EXCLUSIVE),
            inputs_signature(example_inputs))
        groups.setdefault(repr(pattern), (pattern, []))[1].append(variant)
    for pattern, variants in groups.values():
        first = variants[0]
        for other in variants[1:]:  # one replacement serves them all
            if (other.norm_form.style, dataclasses.replace(other, norm=first.norm, strided=first.strided,
                                                           autocast=first.autocast)) != (first.norm_form.style, first):
                raise RuntimeError(f"variants {variant_name(first)} and {variant_name(other)} trace to one pattern "
                                   "but need different replacements")
        checks = [retraced_check(_search(v), trace_as_post_grad, _SCALARS, _EXCLUSIVE,
                                 functools.partial(_check, variant=v)) for v in variants]
        register_replacement(
            _search(first),
            _replace(first),
            _example_inputs(first),
            trace_as_post_grad,
            pass_dict,
            extra_check=lambda match, checks=checks: any(check(match) for check in checks),
            scalar_workaround=_SCALARS,
            exclusive_arg_names=_EXCLUSIVE,
            search_fn_pattern=pattern,
        )


#: Before matching, in order (``fusion_pass.rewrites``; undone, last first, where no fusion used them).
#: torch.export puts an ``aten._assert_tensor_metadata`` on every ``.to(dtype)`` result: an extra user
#: of the norm's intermediates, it hid every prologue of an exported program (AOTInductor); Inductor
#: lowers them to nothing and erases them in its post-grad passes anyway. Then the norm's and
#: ``rotate_half``'s spellings (``canonical_forms``), and the cache writes' (``cache_write_forms``):
#: slice-assigned writes become index_put writes at ``arange(start, end)``, so that one pattern
#: covers both.
REWRITES = (Rewrite(remove_assert_ops, preserves_layout=True), *CANONICAL_FORMS, CONTIGUOUS_COPIES,
            HALF_TABLE_ROTATIONS, BATCH_OF_ONE_RESHAPES, FLAT_CACHE_VIEWS, SLICE_WRITES)


def apply(graph: torch.fx.Graph, pass_dict) -> int:
    """Run the registered patterns on ``graph`` (rewritten by ``REWRITES``); returns the number of
    layers fused. Where a fusion computes the rotary tables in its kernel, the table nodes go; then
    the norm -> RoPE prologues left unfused are reported with their reasons."""
    count = apply_first_to_last(pass_dict, graph)
    if count:
        compute_tables_in_kernels(graph)
    near_miss_pass(FAMILY.name).apply(graph)
    report_unmatched_prologues(graph, FAMILY.name)
    return count
