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

Variants (one registration each, generated from one definition, ``VARIANTS``):

- RoPE before the transpose too (Gemma3n, Gemma4: ``apply_rotary_pos_emb(x, cos, sin,
  unsqueeze_dim=2)`` on ``[B, S, H, D]``, tables ``[B, S, 1, D]``), with every norm form;
- layout: the norm runs on ``[B, S, H, D]`` before the transpose (Hugging Face), on
  ``[B, H, S, D]`` directly (the SOL-ExecBench formulation), or on flattened tokens
  ``[T, H, D]`` (vLLM; ``apply_rotary_pos_emb`` with ``cos/sin [T, D]``, whose
  ``unsqueeze(1)`` gives ``[T, 1, D]``);
- cache write into a dense ``[B, Hkv, L, D]`` cache: ``index_put`` (from ``index_copy_`` and
  ``cache[:, :, pos] = x``; with B = 1 the latter writes ``x.reshape(H, S, D)``, which is
  canonicalized to ``x`` first), or ``slice_scatter`` (from ``cache[:, :, start:end] = x``),
  canonicalized into an index_put at ``arange(start, end)`` before matching (a multi-output
  pattern cannot anchor the V write of a slice assignment: it shares no graph node with the
  rest, only the constants start/end);
- cache write into a paged cache through a slot mapping (vLLM's ``reshape_and_cache``, Hugging
  Face's continuous-batching ``PagedAttentionCache`` / ``FullAttentionAllocator.update``),
  replaced by ``fusion_pass.qk_norm_rope_paged_cache``::

      key_cache.view(-1, Hkv, D)[slot_mapping] = k              # key_cache [blocks, block_size, Hkv, D]
      key_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, k)
      key_cache[slot_mapping] = k                                # key_cache [slots, Hkv, D]

  with k ``[T, Hkv, D]`` (tokens layout) or ``k.squeeze(0).transpose(0, 1)`` of the Hugging
  Face ``[1, Hkv, S, D]`` (``PagedAttentionCache.update``). Functionalized, the first two are
  ``index_put(reshape(cache, [-1, Hkv, D]), [slots], k)`` then ``reshape`` back to the cache
  shape, which the ``copy_`` write-back reads: the pattern ends at that reshape.
  ``view(blocks * block_size, Hkv, D)`` and ``flatten(0, 1)`` are respelled ``view(-1, Hkv,
  D)`` first, and a single token's ``k.reshape(Hkv, D)`` (decode) is canonicalized to ``k``.

- norm: the per-head RMSNorm as Hugging Face's Qwen3 writes it (above), or one of these,
  each replaced by the op with its ``norm`` argument naming the form's rounding:

  - ``Gemma3RMSNorm`` (transformers' ``models/gemma3/modeling_gemma3.py``; Gemma3 norms after
    the transpose, the ``"bhsd"`` layout), ``norm="fp32_one_plus_weight"``::

        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

        def forward(self, x):
            output = self._norm(x.float())
            # Llama does x.to(float16) * w whilst Gemma3 is (x * w).to(float16)
            output = output * (1.0 + self.weight.float())
            return output.type_as(x)

  - ``torch.nn.RMSNorm(head_dim, eps)`` / ``F.rms_norm(x, (head_dim,), weight, eps)``. Inductor's
    post-grad graph holds torch's decomposition of ``aten._fused_rms_norm``
    (``torch/_decomp/decompositions.py``, torch 2.13)::

        upcasted_input = input.to(computation_dtype)
        rqrst_input = torch.rsqrt(
            torch.ops.aten.add.Scalar(
                torch.pow(upcasted_input, 2).mean(dim=dims_to_reduce, keepdim=True), eps_val
            )
        )
        upcasted_result = upcasted_input.mul(rqrst_input)
        if weight is not None:
            upcasted_result = upcasted_result.mul(weight)
        ...
            upcasted_result = upcasted_result.contiguous()
        result = upcasted_result.type_as(input)

    i.e. ``(n * weight).to(dtype)`` with the bf16 weight promoted, one rounding:
    ``norm="fp32_weight"``. ``eps=None`` is ``torch.finfo(torch.float32).eps`` there, a
    constant like any other. ``contiguous()`` is a ``clone`` when the input is a transposed
    view (the ``"bhsd"`` layout of Hugging Face code), so that layout has two registrations;
  - weight-free, ``norm="no_weight"`` (q_weight/k_weight None): ``torch.nn.RMSNorm(head_dim,
    elementwise_affine=False)`` (the decomposition above without ``mul(weight)``), and
    ``NeoMMERMSNorm(head_dim, eps, with_scale=False)`` (transformers' ``models/neomme``, its
    q_norm/k_norm; ``Gemma3nRMSNorm`` and ``Gemma4RMSNorm`` are the same code; ``pow(t, -0.5)``
    is computed as ``rsqrt(t)`` by PyTorch, same bits)::

        def _norm(self, hidden_states: torch.Tensor):
            mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
            return hidden_states * torch.pow(mean_squared, -0.5)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            normed_output = self._norm(hidden_states.float())
            if self.with_scale:
                normed_output = normed_output * self.weight.float()
            return normed_output.type_as(hidden_states)

  Each form is matched op for op, eps and weight bound from the graph: a norm with another
  constant (``2.0 + weight``), another reduction (over heads and head_dim) or another cast
  order is a different graph and is left alone.

- order: RoPE, then the norm of the rotated rows, with the Qwen3 norm form
  (``HunYuanDenseV1Attention``; ``HunYuanDenseV1RMSNorm`` is ``Qwen3RMSNorm``'s code), on
  ``[B, H, S, D]`` with a dense cache, or on flattened tokens with a paged or flat cache;
  replaced by the op with ``rope_first=True``::

      query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
      key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
      value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

      cos, sin = position_embeddings
      query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
      query_states = self.query_layernorm(query_states)
      key_states = self.key_layernorm(key_states)

      if cache is not None:
          key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

- rotary: all of head_dim, or partial (``partial_rotary_factor < 1``: only the first
  ``rotary_dim = cos.shape[-1]`` features rotated, the rest passed through), as transformers'
  ``Glm4MoeAttention`` (GLM-4.5, ``models/glm4_moe/modeling_glm4_moe.py``) writes it: the
  Qwen3 norm form before the transpose (``Glm4MoeRMSNorm`` is ``Qwen3RMSNorm``'s code,
  ``use_qk_norm=True``), then::

      def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
          cos = cos.unsqueeze(unsqueeze_dim)
          sin = sin.unsqueeze(unsqueeze_dim)

          # Keep half or full tensor for later concatenation
          rotary_dim = cos.shape[-1]
          q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
          k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]

          # Apply rotary embeddings on the first half or full tensor
          q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
          k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)

          # Concatenate back to full shape
          q_embed = torch.cat([q_embed, q_pass], dim=-1)
          k_embed = torch.cat([k_embed, k_pass], dim=-1)
          return q_embed, k_embed

  with a dense cache (``StaticCache.update``); replaced by the op with
  ``rotary_dim=cos.shape[-1]``. The slice bounds are bound by the re-check with the real
  shapes, so a graph that rotates other features than the first ``rotary_dim`` (or passes
  through other ones) is a different graph.
- interleaved (GPT-J style) pairs ``(x[2i], x[2i+1])``, all features rotated, as transformers'
  GLM (``models/glm/modeling_glm.py``) writes it (GPT-J's ``rotate_every_two`` with
  ``repeat_interleave(sin, 2, 3)`` is the same computation)::

      def rotate_half(x):
          x1 = x[..., 0::2]
          x2 = x[..., 1::2]
          return torch.stack((-x2, x1), dim=-1).flatten(-2)

      # in apply_rotary_pos_emb, after cos.unsqueeze(unsqueeze_dim):
      # Interleave them instead of usual shape
      cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
      sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
      ...
      q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)

  with cos/sin as wide as head_dim (GLM's ``q_rot, q_pass`` slices are then the whole tensor
  and nothing: the post-grad graph has neither). No transformers model combines this RoPE with
  a per-head RMSNorm before a KV-cache write (GLM, GPT-J and CodeGen have no q/k norm; Cohere's
  is a LayerNorm and rotates in fp32): the registration, Qwen3's norm before the transpose with
  a dense cache, is tested on a model written in that style. Replaced by the op with
  ``interleaved=True``.

q, k and v may be any views with a contiguous last dim: slices of one fused QKV projection
(``qkv_proj(x).split([Hq*D, Hkv*D, Hkv*D], -1)``) match like separate projections. cos/sin
may reach the multiply as ``[B or 1, 1, S, D]`` (``apply_rotary_pos_emb``), or shared by the
batch as ``[S, D]`` (broadcast as is, or ``cos[None, None]``) or ``[1, S, D]``; tables that
vary over heads are not RoPE as the op applies it and are left alone (``cos_rows``).

bf16 and fp16 share a registration: the first match ignores dtypes and the pattern matcher
re-traces each candidate with its real dtypes and shapes before accepting it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import re
from typing import Callable

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch._inductor.fx_passes.post_grad import remove_assert_ops, view_to_reshape
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    fwd_only,
    gen_pattern,
    register_graph_pattern,
    register_replacement,
)

from fusion_pass import config as fusion_config
from fusion_pass import match_report
from fusion_pass.families import Family
from fusion_pass.kernels.qk_norm_rope_cache_op import (
    check_qk_norm_rope_cache_args,
    check_qk_norm_rope_paged_cache_args,
    output_dtype,
    paged_cache_rows,
    unsupported_reason,
)
from fusion_pass.kernels.qk_norm_rope_cache_triton import WRITTEN_ARGS as CACHE_KERNEL_WRITTEN_ARGS
from fusion_pass.kernels.qk_norm_rope_cache_triton import cache_kernel_call
from fusion_pass.kernels.triton_device import kernels_in_graph
# The Hugging Face building blocks, op for op: traced, they are the model's graph.
from fusion_pass.kernels.qk_norm_rope_cache_reference import (
    gemma3n_rms_norm_reference,
    gemma_rms_norm_reference,
    interleaved_rope_tables,
    partial_rope_reference,
    rms_norm_reference,
    rope_reference,
    rotate_half_interleaved,
    torch_rms_norm_reference,
    weight_first_fp32_rms_norm_reference,
)
from fusion_pass.matching import apply_first_to_last
from fusion_pass.pattern_cache import inputs_signature, retraced_check, traced_pattern
from fusion_pass.patterns.canonical_forms import canonicalize
from fusion_pass.patterns.rotary_tables import compute_tables_in_kernels

FAMILY = Family("qk_norm_rope_cache", "per-head RMSNorm(q, k) -> RoPE -> K/V cache write, one Triton kernel",
                stage="post_grad")

aten = torch.ops.aten

# Unusual values so that the traced pattern can tell the two epsilons apart and turn them
# into keyword arguments (register_replacement's scalar_workaround).
_Q_EPS_EXAMPLE = 1.2345e-5
_K_EPS_EXAMPLE = 2.3456e-5


# --- the variants ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NormForm:
    """One spelling of per-head RMSNorm in model code.

    style: the op's ``norm`` argument that computes it bit for bit (``NORM_STYLES``).
    fn: the model code, ``fn(x, weight, eps)`` (weight None for weight-free forms); traced,
        it is the graph matched.
    casts_weight: the graph has ``weight.float()``, which an fp32 weight (autocast over an fp32
        model) does not have: the training family registers such forms once more for autocast.
    copies_strided_input: the graph has a ``clone`` when the norm's input is dense but not
        contiguous (torch's rms_norm decomposition makes its result contiguous; the fp32 upcast
        of a sliced input is contiguous already): with the ``"bhsd"`` layout, whose input is
        Hugging Face's transposed view or a contiguous tensor, such forms are registered twice.
    """

    style: str
    fn: Callable
    copies_strided_input: bool = False
    casts_weight: bool = False

    @property
    def weighted(self) -> bool:
        return self.style != "no_weight"


NORM_FORMS = {
    "qwen3": NormForm("weight", rms_norm_reference),
    "gemma3": NormForm("fp32_one_plus_weight", gemma_rms_norm_reference, casts_weight=True),
    "torch_rms_norm": NormForm("fp32_weight", torch_rms_norm_reference, copies_strided_input=True),
    "torch_rms_norm_no_weight": NormForm("no_weight", lambda x, weight, eps: torch_rms_norm_reference(x, None, eps),
                                         copies_strided_input=True),
    "gemma3n": NormForm("fp32_weight", gemma3n_rms_norm_reference, casts_weight=True),
    "afmoe": NormForm("fp32_weight", weight_first_fp32_rms_norm_reference),
    "pow_no_weight": NormForm("no_weight", lambda x, weight, eps: gemma3n_rms_norm_reference(x, None, eps)),
}


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
        rotated, ``_interleaved_rope``).
    rope_before_transpose:
        layout ``"bshd"`` with RoPE applied before the transpose, on ``[B, S, H, D]`` with
        ``cos.unsqueeze(2)`` (Gemma3n's and Gemma4's ``apply_rotary_pos_emb(..., unsqueeze_dim=2)``).
    """

    layout: str
    cache: str
    norm: str = "qwen3"
    strided: bool = False
    rope_first: bool = False
    partial_rope: bool = False
    interleaved: bool = False
    rope_before_transpose: bool = False

    @property
    def paged(self) -> bool:
        return self.cache != "dense"

    @property
    def norm_form(self) -> NormForm:
        return NORM_FORMS[self.norm]


_GEOMETRIES = (("bshd", "dense"), ("bhsd", "dense"), ("bshd", "paged"), ("bshd", "flat"),
               ("tokens", "paged"), ("tokens", "flat"))
# Every norm form with every layout and cache write: one registration each (two for a norm
# whose graph differs for strided inputs); then RoPE before the norm: HunYuan's norm (the
# Qwen3 form) on the layouts where RoPE can run first, every other form with a dense cache;
# then partial rotary and interleaved pairs (GLM's RoPE) with every norm form before the
# transpose and a dense cache (GLM-4.5's Glm4MoeAttention, Qwen3-Next's and Qwen3.5's
# (1 + weight) norm, with a StaticCache); then RoPE before the transpose with every norm form
# (Gemma3n, Gemma4).
VARIANTS = tuple(
    Variant(layout, cache, norm, strided)
    for norm, form in NORM_FORMS.items()
    for layout, cache in _GEOMETRIES
    for strided in ((False, True) if form.copies_strided_input and layout == "bhsd" else (False,))
) + tuple(Variant(layout, cache, "qwen3", rope_first=True)
          for layout, cache in _GEOMETRIES if layout != "bshd") + tuple(
    Variant("bhsd", "dense", norm, strided, rope_first=True)
    for norm, form in NORM_FORMS.items() if norm != "qwen3"
    for strided in ((False, True) if form.copies_strided_input else (False,))) + tuple(
    Variant("bshd", "dense", norm, partial_rope=True) for norm in NORM_FORMS) + tuple(
    Variant("bshd", "dense", norm, interleaved=True) for norm in NORM_FORMS
) + tuple(Variant("bshd", "dense", norm, rope_before_transpose=True) for norm in NORM_FORMS)


# --- the model code, as functions --------------------------------------------------------

def _interleaved_rope(q, k, cos, sin):
    """GLM's ``apply_rotary_pos_emb`` with all features rotated: the interleaved tables are made
    once and multiply both q and k, as in the model's graph (one table per tensor would be
    another graph)."""
    cos, sin = interleaved_rope_tables(cos, sin)
    return (q * cos) + (rotate_half_interleaved(q) * sin), (k * cos) + (rotate_half_interleaved(k) * sin)


def _norm_rope(norm: NormForm, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, norm_before_transpose,
               rope=rope_reference, interleaved=False, rope_before_transpose=False):
    q = norm.fn(q, q_weight, q_eps)
    k = norm.fn(k, k_weight, k_eps)
    if rope_before_transpose:
        return rope(q, cos, sin).transpose(1, 2), rope(k, cos, sin).transpose(1, 2)
    if norm_before_transpose:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if interleaved:
        return _interleaved_rope(q, k, cos, sin)
    return rope(q, cos, sin), rope(k, cos, sin)


def _rope_norm(norm: NormForm, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps):
    """HunYuan's order: ``apply_rotary_pos_emb``, then the norm of the rotated q and k."""
    return (norm.fn(rope_reference(q, cos, sin), q_weight, q_eps),
            norm.fn(rope_reference(k, cos, sin), k_weight, k_eps))


def _cache_write(variant: Variant, cache, position, rows):
    """The functional cache write of ``variant``: rows are ``[B, Hkv, S, D]`` or ``[T, Hkv, D]``."""
    if not variant.paged:
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
            q_rot, k_rot = _rope_norm(variant.norm_form, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps)
        else:
            q_rot, k_rot = _norm_rope(variant.norm_form, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps,
                                      variant.layout == "bshd",
                                      partial_rope_reference if variant.partial_rope else rope_reference,
                                      variant.interleaved, variant.rope_before_transpose)
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
    dtype = output_dtype(q, q_weight, variant.norm_form.style)
    q_out, k_out = torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)
    if statically_known_true(q.numel() == 0) and statically_known_true(k.numel() == 0):
        return q_out, k_out, k_cache, v_cache
    storage = {}
    k_rows, v_rows = k_cache, v_cache
    if variant.paged:
        # The kernel addresses the paged cache as [1, Hkv, slots, D] and writes the user's tensor.
        kv_heads, head_dim = k.shape[1], k.shape[3]
        k_rows = paged_cache_rows(k_cache, "key_cache", kv_heads, head_dim)
        v_rows = paged_cache_rows(v_cache, "value_cache", kv_heads, head_dim)
        storage = dict(k_cache_storage=k_cache, v_cache_storage=v_cache)
    call = cache_kernel_call(q, k, v, q_weight, k_weight, cos, sin, k_rows, v_rows, cache_position, q_eps, k_eps,
                             q_out, k_out, **kernel_args, **storage, in_graph=True)
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
    if variant.paged:
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

def _val(match: Match, name: str):
    """The value bound to ``name`` (a fake tensor or a constant); None when the pattern has no
    such argument (the weights of a weight-free norm)."""
    node = match.kwargs.get(name)
    return node.meta["val"] if isinstance(node, torch.fx.Node) else node


#: Ops whose result shares its input's memory (the region's inputs reach the kernel as views).
_VIEW_OPS = frozenset((aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
                       aten.transpose.int, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
                       aten.squeeze.dim, aten.expand.default, aten.alias.default, aten.as_strided.default))


def _memory_root(node):
    """The node whose memory ``node`` views (itself when it is not a view)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEW_OPS:
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
    if any(node.meta.get(_REJECTED) for node in match.nodes):
        return False  # refused, with its reason, under another variant whose graph is the same here
    q, k, v = _val(match, "q"), _val(match, "k"), _val(match, "v")
    if not fusion_config.device_allowed(q.device):
        return False
    token_layout = variant.layout == "tokens"
    if q.dim() != k.dim() or q.dim() != (3 if token_layout else 4):
        return False
    cos, sin = (cos_rows(_val(match, name), token_layout, variant.rope_before_transpose) for name in ("cos", "sin"))
    if cos is None or sin is None:
        return False  # cos/sin that vary over heads: not RoPE as the op applies it
    q, k, v = _op_layout(variant, q, k, v)
    check = check_qk_norm_rope_paged_cache_args if variant.paged else check_qk_norm_rope_cache_args
    reason = _aliasing_reason(match)
    try:
        if reason is None:
            order = {} if variant.paged else dict(rope_first=variant.rope_first)
            check(q, k, v, _val(match, "q_weight"), _val(match, "k_weight"), cos, sin, _val(match, "k_cache"),
                  _val(match, "v_cache"), _val(match, "cache_position"), variant.norm_form.style,
                  cos.shape[-1] if variant.partial_rope else None, variant.interleaved, **order)
            reason = unsupported_reason(q.shape[-1], q.dtype)
    except ValueError as error:
        reason = re.sub(r"^fusion_pass\.qk_norm_rope_(paged_)?cache: ", "", str(error))
    if reason is not None:
        match_report.record_near_miss(FAMILY.name, reason)
        for node in match.nodes:  # reported once, with its reason: not again as a bare norm -> RoPE
            node.meta[_REJECTED] = True
        return False
    return True


# --- registration --------------------------------------------------------------------------

def _example_inputs(variant: Variant):
    batch, q_heads, kv_heads, seq, head_dim, length = 2, 4, 2, 8, 16, 24
    if variant.paged:
        batch = 1  # tokens flattened into one batch row
    dtype = torch.bfloat16

    def t(*shape):
        return torch.empty(shape, dtype=dtype)

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
        cos, sin = t(*table), t(*table)
    cache_shape = {"dense": (batch, kv_heads, length, head_dim), "paged": (3, length // 3, kv_heads, head_dim),
                   "flat": (length, kv_heads, head_dim)}[variant.cache]
    # Distinct example tensors for every argument: shared ones would merge in the pattern.
    # The epsilons are not listed: they come from scalar_workaround.
    weights = [t(head_dim), t(head_dim)] if variant.norm_form.weighted else []
    return [q, k, v, *weights, cos, sin, t(*cache_shape), t(*cache_shape), torch.arange(seq)]


def _trace(fn, args, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only``, then views spelled as the post-grad graph spells them (``aten.reshape``:
    Inductor's ``view_to_reshape`` has run before the custom pre-pass)."""
    gm = fwd_only(fn, args, **kwargs)
    view_to_reshape(gm)
    return gm


_SCALARS = {"q_eps": _Q_EPS_EXAMPLE, "k_eps": _K_EPS_EXAMPLE}
_EXCLUSIVE = ("q", "k", "v", "k_cache", "v_cache")


def variant_name(variant: Variant) -> str:
    """The variant's fields in one identifier (``pattern_cache``'s file name)."""
    return "_".join(str(int(v)) if isinstance(v, bool) else str(v) for v in dataclasses.astuple(variant))


def register(pass_dict) -> None:
    """Register every variant of this fusion into ``pass_dict`` (a ``PatternMatcherPass``): its
    pattern loaded from ``pattern_cache`` (traced in the first process), and checked at match time
    by the re-trace with the graph's shapes (``retraced_check``), then by ``_check``."""
    for variant in VARIANTS:
        search, example_inputs = _search(variant), _example_inputs(variant)
        register_replacement(
            search,
            _replace(variant),
            example_inputs,
            _trace,
            pass_dict,
            extra_check=retraced_check(search, _trace, _SCALARS, _EXCLUSIVE,
                                       functools.partial(_check, variant=variant)),
            scalar_workaround=_SCALARS,
            exclusive_arg_names=_EXCLUSIVE,
            search_fn_pattern=traced_pattern(
                f"qk_norm_rope_cache_{variant_name(variant)}",
                functools.partial(gen_pattern, search, example_inputs, _trace, _SCALARS, _EXCLUSIVE),
                inputs_signature(example_inputs)),
        )


def apply(graph: torch.fx.Graph, pass_dict) -> int:
    """Run the registered patterns on ``graph``; returns the number of layers fused.

    Equivalent spellings of the norm and of ``rotate_half`` are first rewritten to the one the
    patterns match (``canonical_forms``: exact, value-preserving rewrites). Slice-assigned cache
    writes are rewritten as index_put writes at ``arange(start, end)`` so that one pattern covers
    both; the ones no fusion consumed are put back as they were.
    """
    # torch.export puts an aten._assert_tensor_metadata on every .to(dtype) result: an extra user
    # of the norm's intermediates, it hid every prologue of an exported program (AOTInductor).
    # Inductor lowers them to nothing and erases them later in its post-grad passes anyway.
    remove_assert_ops(graph)
    canonicalize(graph)
    drop_batch_of_one_reshapes(graph)
    normalize_flat_cache_views(graph)
    rewrites = canonicalize_slice_writes(graph)
    count = apply_first_to_last(pass_dict, graph)
    if count:
        compute_tables_in_kernels(graph)
    restore_unfused_slice_writes(graph, rewrites)
    _near_miss_pass().apply(graph)
    return count


# --- near-misses: a per-head norm -> RoPE that no fusion consumed -----------------------------

_NO_CACHE_WRITE = "per-head RMSNorm -> RoPE without a matching K/V cache write (left unfused)"
_ROPE_FIRST_NO_CACHE_WRITE = "RoPE -> per-head RMSNorm without a matching K/V cache write (left unfused)"
_FP32_MODEL = ("per-head RMSNorm -> RoPE in float32: the fused kernel takes bf16 or fp16 models (left to "
               "Inductor)")
_FULL_WIDTH_NORM = ("RMSNorm over the whole projection width, then heads -> RoPE (e.g. OLMo2): not a per-head norm, "
                    "which the kernel computes (left unfused; under head-sharded tensor parallelism its variance "
                    "would need an all-reduce)")
# Node meta key: the whole fusion matched here and was refused, with a reason already reported.
_REJECTED = "fusion_pass_qk_norm_rope_cache_refused"


@functools.lru_cache(maxsize=None)
def _near_miss_pass():
    """A pass whose patterns only report: one hit per norm -> RoPE left in the graph."""
    near_misses = PatternMatcherPass(pass_name="fusion_pass_qk_norm_rope_cache_near_misses")

    def report(reason):
        def report_only(match: Match, *args, **kwargs) -> None:
            if not any(node.meta.get(_REJECTED) for node in match.nodes):
                match_report.record_near_miss(FAMILY.name, reason)
                for node in match.nodes:  # once: two forms can trace to one graph (fp32: Qwen3's, AFMoE's)
                    node.meta[_REJECTED] = True

        return report_only

    def norm_rope(norm: NormForm, norm_before_transpose):
        def search(x, weight, cos, sin, eps):
            x = norm.fn(x, weight, eps)
            return rope_reference(x.transpose(1, 2) if norm_before_transpose else x, cos, sin)

        if norm.weighted:
            return search
        return lambda x, cos, sin, eps: search(x, None, cos, sin, eps)

    # The norm on [B, S, H, D] before the transpose, on a contiguous [B, H, S, D], and (for the
    # forms whose graph then has a copy) on the transposed view of [B, S, H, D].
    # An fp32 model traces the same norm without its casts: matched apart, to say why it is left.
    placements = ((True, False), (False, False), (False, True))
    for (name, norm), (norm_before_transpose, strided), dtype in itertools.product(
            NORM_FORMS.items(), placements, (torch.bfloat16, torch.float32)):
        if strided and not norm.copies_strided_input:
            continue
        t = functools.partial(torch.empty, dtype=dtype)
        example = [t(2, 8, 4, 16), t(16), t(2, 1, 8, 16), t(2, 1, 8, 16)]
        if not norm_before_transpose:
            example[0] = t(2, 8, 4, 16).transpose(1, 2) if strided else t(2, 4, 8, 16)
        if not norm.weighted:
            del example[1]
        pattern = traced_pattern(
            f"qk_norm_rope_cache_near_miss_{name}_{int(norm_before_transpose)}_{int(strided)}_{str(dtype)[6:]}",
            functools.partial(gen_pattern, norm_rope(norm, norm_before_transpose), example, fwd_only,
                              {"eps": _Q_EPS_EXAMPLE}),
            inputs_signature(example))

        def allowed(match, fp32=dtype == torch.float32):
            x = _val(match, "x")
            return fusion_config.device_allowed(x.device) and (x.dtype == torch.float32) == fp32

        register_graph_pattern(pattern, pass_dict=near_misses, extra_check=allowed)(
            report(_FP32_MODEL if dtype == torch.float32 else _NO_CACHE_WRITE))

    # One norm over the projection's width, then the head view and RoPE (Olmo2Attention, whose norm is
    # AFMoE's form; Qwen3's form too). The view's sizes are the example's: ints are wildcards in patterns.
    def full_width_norm_rope(norm: NormForm):
        def search(x, weight, cos, sin, eps):
            return rope_reference(norm.fn(x, weight, eps).view(2, 8, 4, 16).transpose(1, 2), cos, sin)

        return search

    t = functools.partial(torch.empty, dtype=torch.bfloat16)
    example = [t(2, 8, 64), t(64), t(2, 1, 8, 16), t(2, 1, 8, 16)]
    for name in ("qwen3", "afmoe"):
        pattern = traced_pattern(f"qk_norm_rope_cache_near_miss_full_width_{name}",
                                 functools.partial(gen_pattern, full_width_norm_rope(NORM_FORMS[name]), example, _trace,
                                                   {"eps": _Q_EPS_EXAMPLE}),
                                 inputs_signature(example))
        register_graph_pattern(
            pattern, pass_dict=near_misses,
            extra_check=lambda match: fusion_config.device_allowed(_val(match, "x").device),
        )(report(_FULL_WIDTH_NORM))

    # HunYuan's order: RoPE on [B, H, S, D], then the (Qwen3-form) norm.
    def rope_norm(x, weight, cos, sin, eps):
        return rms_norm_reference(rope_reference(x, cos, sin), weight, eps)

    t = functools.partial(torch.empty, dtype=torch.bfloat16)
    example = [t(2, 4, 8, 16), t(16), t(2, 1, 8, 16), t(2, 1, 8, 16)]
    pattern = traced_pattern("qk_norm_rope_cache_near_miss_rope_first",
                             functools.partial(gen_pattern, rope_norm, example, fwd_only, {"eps": _Q_EPS_EXAMPLE}),
                             inputs_signature(example))
    register_graph_pattern(
        pattern, pass_dict=near_misses,
        extra_check=lambda match: fusion_config.device_allowed(_val(match, "x").device),
    )(report(_ROPE_FIRST_NO_CACHE_WRITE))
    return near_misses


# --- cache writes spelled otherwise ----------------------------------------------------------

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
