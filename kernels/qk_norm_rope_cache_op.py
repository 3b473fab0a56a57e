"""``torch.ops.fusion_pass.qk_norm_rope_cache``: QK RMSNorm -> RoPE -> KV-cache write, one op.

unfused (Hugging Face Qwen3 attention)::

    q = q_norm(q); k = k_norm(k)                    # per-head RMSNorm
    q, k = apply_rotary_pos_emb(q, k, cos, sin)     # rotate_half RoPE
    k_cache.index_copy_(2, cache_position, k)       # StaticCache.update
    v_cache.index_copy_(2, cache_position, v)

fused::

    q, k = torch.ops.fusion_pass.qk_norm_rope_cache(q, k, v, q_w, k_w, cos, sin,
                                                    k_cache, v_cache, cache_position, eps, eps)

``torch.ops.fusion_pass.qk_norm_rope_paged_cache`` is the same op for a paged cache written
through a slot mapping (vLLM's ``reshape_and_cache``, Hugging Face's ``PagedAttentionCache``)::

    key_cache.view(-1, Hkv, D)[slot_mapping] = k      # key_cache [num_blocks, block_size, Hkv, D]

The norm is Qwen3's (``weight * normed.to(dtype)``) unless ``norm`` names another form of
RMSNorm (``NORM_STYLES``: ``torch.nn.RMSNorm``'s fp32 weight product, Gemma3's ``1 + weight``,
or no weight, then ``q_weight``/``k_weight`` are None). ``rope_first=True`` applies RoPE before
the norm (``HunYuanDenseV1Attention``: ``apply_rotary_pos_emb``, then ``query_layernorm``).
``rotary_dim`` < head_dim rotates only the first ``rotary_dim`` features and passes the rest
through (partial rotary, ``Glm4MoeAttention``); cos/sin are then ``rotary_dim`` wide.
``interleaved=True`` rotates the pairs ``(x[2i], x[2i+1])`` (GPT-J's ``rotate_every_two``, GLM's
``rotate_half``): ``x * cos + rotate_half_interleaved(x) * sin`` with cos/sin holding one entry
per feature, as the model passes them (GLM repeats each pair's entry, ``repeat_interleave(2)``).

Both ops mutate their cache arguments (``Tensor(a!)`` in the schema): under torch.compile each
appears as ``auto_functionalized`` and Inductor calls it directly on the cache buffers, so the caches
are updated in place with no copy. On CUDA (and on CPU under ``TRITON_INTERPRET=1``) it runs
the Triton kernel; elsewhere the PyTorch reference.
"""

from __future__ import annotations


import torch

from .argument_errors import ArgumentError, check_q_k_heads, failure
from .qk_norm_rope_cache_reference import NORM_STYLES, qk_norm_rope_cache_reference
from .triton_device import triton_applicable


def output_dtype(q: torch.Tensor, q_weight: torch.Tensor | None, cos: torch.Tensor, norm: str = "weight") -> torch.dtype:
    """dtype of q_out/k_out (and of cos/sin and the k cache): q's, or fp32 in a bf16/fp16
    ``torch.autocast`` region over an fp32 model, where the projections run in half precision
    while the norm's weight and the rotary tables stay fp32. Qwen3's ``weight * n.to(dtype)``
    promotes to the weight's dtype; the other forms end in q's dtype (``.to(x.dtype)``,
    ``type_as(x)``), and RoPE's products then promote to the tables' dtype."""
    normed = torch.promote_types(q.dtype, q_weight.dtype) if norm == "weight" and q_weight is not None else q.dtype
    return torch.promote_types(normed, cos.dtype)


def check_qk_norm_rope_cache_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_position: torch.Tensor,
    norm: str = "weight",
    rotary_dim: int | None = None,
    interleaved: bool = False,
    rope_first: bool = False,
) -> None:
    """Raise ``ArgumentError`` (a ``ValueError``) naming the first argument that breaks the op's contract.

    ``q_weight``/``k_weight`` are [D] tensors of q's dtype or fp32 (``output_dtype`` says what the
    outputs then are), or None exactly when ``norm`` is ``"no_weight"``. cos/sin and k_cache have the outputs' dtype, v_cache v's. cos/sin are ``rotary_dim`` wide (D when
    None); a partial ``rotary_dim`` is a multiple of 16 below a head_dim that is one too (the
    kernel's pass-through features then lie in 16-byte aligned runs).
    ``interleaved`` (GPT-J pairs) takes the same shapes, one table entry per feature.
    """

    fail = failure("qk_norm_rope_cache")
    if q.dim() != 4:
        fail("q", "a 4-D tensor [B, Hq, S, D]", f"shape {tuple(q.shape)}")
    batch, seq, q_heads, kv_heads, head_dim = check_q_k_heads(fail, q, k, heads_first=True)
    if tuple(v.shape) != tuple(k.shape):
        fail("v", f"k's shape {tuple(k.shape)}", f"shape {tuple(v.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            fail(name, f"q's dtype {q.dtype}", t.dtype)
    if norm not in NORM_STYLES:
        fail("norm", f"one of {NORM_STYLES}", repr(norm))
    weights = (("q_weight", q_weight), ("k_weight", k_weight))
    for name, w in weights:
        if (w is None) != (norm == "no_weight"):
            fail(name, "None (a weight-free norm)" if norm == "no_weight" else f"a tensor for norm={norm!r}",
                 "a tensor" if w is not None else None)
    weights = tuple((name, w) for name, w in weights if w is not None)
    for name, w in weights:
        if tuple(w.shape) != (head_dim,):
            fail(name, f"shape [{head_dim}] (head_dim)", f"shape {tuple(w.shape)}")
        # An fp32 weight (an fp32 model under autocast, ``nn.RMSNorm`` kept in fp32 in a bf16
        # model) multiplies the fp32 row as the model does; ``output_dtype`` says where it rounds.
        if w.dtype not in (q.dtype, torch.float32):
            fail(name, f"q's dtype {q.dtype} or torch.float32", w.dtype)
    if len(weights) == 2 and weights[0][1].dtype != weights[1][1].dtype:
        fail("k_weight", f"q_weight's dtype {weights[0][1].dtype}", weights[1][1].dtype)
    out_dtype = output_dtype(q, q_weight, cos, norm)
    if out_dtype != q.dtype and rope_first:
        fail("rope_first", f"False with {out_dtype} weights over {q.dtype} q (mixed precision, RoPE after the norm)",
             rope_first)
    rotary = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim is not None and rotary_dim != head_dim:
        if not 0 < rotary_dim < head_dim or rotary_dim % 16 or head_dim % 16:
            fail("rotary_dim", f"None, head_dim={head_dim}, or a multiple of 16 below a head_dim that is a multiple "
                 f"of 16 (partial rotary)", rotary_dim)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq or t.shape[2] != rotary:
            width = f"D={head_dim}" if rotary_dim is None else f"rotary_dim={rotary}"
            fail(name, f"shape [1 or B={batch}, S={seq}, {width}]", f"shape {tuple(t.shape)}")
        if t.dtype != out_dtype:
            fail(name, f"the outputs' dtype {out_dtype}", t.dtype)
    for name, cache, want in (("k_cache", k_cache, out_dtype), ("v_cache", v_cache, v.dtype)):
        if cache.dim() != 4 or cache.shape[0] != batch or cache.shape[1] != kv_heads or cache.shape[3] != head_dim:
            fail(name, f"shape [B={batch}, Hkv={kv_heads}, L, D={head_dim}]", f"shape {tuple(cache.shape)}")
        if cache.shape[2] < seq:
            fail(name, f"a cache length L >= S={seq} (the cache is too short)", cache.shape[2])
        if cache.dtype != want:
            fail(name, f"{'the outputs' if name == 'k_cache' else 'v'}' dtype {want}", cache.dtype)
    if v_cache.shape[2] != k_cache.shape[2]:  # the kernel bounds both writes by one length
        fail("v_cache", f"k_cache's length L={k_cache.shape[2]}", v_cache.shape[2])
    if cache_position.dim() != 1 or cache_position.shape[0] != seq:
        fail("cache_position", f"shape [S={seq}]", f"shape {tuple(cache_position.shape)}")
    if cache_position.dtype not in (torch.int64, torch.int32):
        fail("cache_position", "dtype int64 or int32", cache_position.dtype)
    named = (("q", q), ("k", k), ("v", v), *weights, ("cos", cos), ("sin", sin), ("k_cache", k_cache),
             ("v_cache", v_cache))
    for name, t in named:
        if t.numel() and t.stride(-1) != 1:
            fail(name, "a contiguous last dim (stride(-1) == 1)", f"strides {tuple(t.stride())}")
    for name, t in named + (("cache_position", cache_position),):
        if t.device != q.device:
            fail(name, f"q's device {q.device}", t.device)


def check_positions_in_cache(positions: torch.Tensor, rows: int, name: str) -> None:
    """Raise ``IndexError``, as ``index_copy_`` does, for a position outside ``[-rows, rows)``.

    For CPU tensors (reading them costs no device synchronization); on CUDA the kernel checks
    them with a device assert, as ``index_copy_``'s CUDA kernel does.
    """
    if positions.device.type != "cpu" or positions.numel() == 0:
        return
    bad = (positions < -rows) | (positions >= rows)
    if bad.any():
        raise IndexError(f"fusion_pass.qk_norm_rope_cache: {name}: index {int(positions[bad][0])} is out of bounds "
                         f"for a cache of {rows} rows (expected positions in [-{rows}, {rows}))")


# Defined with torch.library.Library rather than torch.library.custom_op: the custom_op wrapper
# costs ~40 us of host time per call for an op with mutated arguments (measured on the CPU CI
# machine: 40.9 us vs 4.4 us for the same schema), which is paid by every layer of every step
# that is not replayed as a CUDA graph. Functionalization (auto_functionalized) and Inductor
# treat both the same: the schema's (a!)/(b!) annotations are what they read.
_LIB = torch.library.Library("fusion_pass", "FRAGMENT")


def _schema(name: str, caches: tuple[str, str], positions: str, eps: str) -> str:
    """The schema of one of the four ops: dense or paged (``caches``, ``positions``), the epsilons
    as floats or as 0-d tensors (``eps``). ``norm`` (a NORM_STYLES name), ``rope_first``,
    ``rotary_dim`` and ``interleaved`` trail with the Qwen3 defaults; the weights are optional for
    the weight-free style rather than a ones tensor per layer."""
    return (f"{name}(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, "
            f"Tensor(a!) {caches[0]}, Tensor(b!) {caches[1]}, Tensor {positions}, {eps} q_eps, {eps} k_eps, "
            f'str norm="weight", bool rope_first=False, SymInt? rotary_dim=None, bool interleaved=False) '
            f"-> (Tensor, Tensor)")


# The paged op mutates the caches themselves ([num_blocks, block_size, Hkv, D]), not a view of them:
# Inductor re-inplaces auto_functionalized only for mutated graph inputs, and would clone a view of
# one (a full cache copy per layer).
_DENSE = ("qk_norm_rope_cache", ("k_cache", "v_cache"), "cache_position")
_PAGED = ("qk_norm_rope_paged_cache", ("key_cache", "value_cache"), "slot_mapping")
for _name, _caches, _positions in (_DENSE, _PAGED):
    for _suffix, _eps in (("", "float"), ("_eps_tensor", "Tensor")):
        _LIB.define(_schema(_name + _suffix, _caches, _positions, _eps))


def qk_norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_position: torch.Tensor,
    q_eps: float,
    k_eps: float,
    norm: str = "weight",
    rope_first: bool = False,
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, rotate_half RoPE, and the K/V cache write, fused.

    Args:
        q: [B, Hq, S, D] queries before the norm (any strides with a contiguous last dim).
        k, v: [B, Hkv, S, D] keys before the norm, values; Hq is a multiple of Hkv.
        q_weight, k_weight: [D] RMSNorm weights, q's dtype or fp32; None for ``norm="no_weight"``.
        cos, sin: [B or 1, S, D] rotary tables in the outputs' dtype (as the rotary module returns
            them): q's, or fp32 under autocast over an fp32 model (``output_dtype``).
        k_cache, v_cache: [B, Hkv, L, D] caches, updated in place at ``cache_position``.
        cache_position: [S] int64 cache rows to write. Negative positions count from the end
            (Python indexing, like ``cache[:, :, pos] = x``); a position outside [-L, L)
            raises ``IndexError`` on CPU and fails a device assert on CUDA, as ``index_copy_``
            does, before anything is written on CPU; nothing is ever written out of bounds.
        q_eps, k_eps: the two norms' epsilons.
        norm: the RMSNorm form, one of ``NORM_STYLES`` (default: Qwen3's
            ``weight * normed.to(dtype)``); both norms have the same form.
        rope_first: RoPE, then the norm of the rotated rows (HunYuan's order).
        rotary_dim: partial rotary: only the first ``rotary_dim`` features are rotated (cos/sin
            ``[B or 1, S, rotary_dim]``), the others pass through after the norm; a multiple of
            16 below head_dim (itself a multiple of 16). None (default): all head_dim features.
        interleaved: rotate the pairs ``(x[2i], x[2i+1])``: ``x * cos + rotate_half_interleaved(x)
            * sin``, cos/sin one entry per feature (GPT-J / GLM, whose tables repeat each pair's
            entry); default False: the pairs ``(x[i], x[i + D/2])`` (``rotate_half``).

    Returns:
        (q_rotated [B, Hq, S, D], k_rotated [B, Hkv, S, D]) with q's and k's strides.
    """
    check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, norm,
                                  rotary_dim, interleaved, rope_first)
    check_positions_in_cache(cache_position, k_cache.shape[2], "cache_position")
    return _run_checked(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps, norm,
                        rope_first, rotary_dim, interleaved)


def _run_checked(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps, norm,
                 rope_first, rotary_dim, interleaved) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope_cache`` once its arguments and positions are checked (the dense and the
    paged op each check theirs once, under their own names)."""
    if triton_applicable(q):
        from .qk_norm_rope_cache_triton import qk_norm_rope_cache_triton

        dtype = output_dtype(q, q_weight, cos, norm)
        q_out, k_out = torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)
        qk_norm_rope_cache_triton(
            q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps, q_out, k_out,
            norm=norm, rope_first=rope_first, rotary_dim=rotary_dim, interleaved=interleaved,
        )
        return q_out, k_out
    q_rot, k_rot = qk_norm_rope_cache_reference(
        q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps, norm, rope_first,
        rotary_dim, interleaved,
    )
    # Outputs must not alias inputs and must carry the eager layout of q and k.
    return _with_layout_of(q, q_rot), _with_layout_of(k, k_rot)


def paged_cache_rows(cache: torch.Tensor, name: str, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The ``[1, Hkv, slots, D]`` view of a paged cache that the dense op addresses.

    A paged cache ``[num_blocks, block_size, Hkv, D]`` (or one already flat, ``[slots, Hkv, D]``)
    holds slot ``s = block * block_size + offset`` at ``cache.view(-1, Hkv, D)[s]``. Viewed as
    ``[1, Hkv, slots, D]`` with strides ``(slots * Hkv * D, D, Hkv * D, 1)`` the same memory is a
    dense cache of one batch row whose row ``s`` is that slot, so a write at ``cache_position =
    slot_mapping`` lands where ``cache.view(-1, Hkv, D)[slot_mapping] = k`` writes. It is a view:
    writes through it update ``cache`` itself.

    Raises ``ArgumentError`` (a ``ValueError``) naming ``name`` when the cache is not ``[..., Hkv, D]`` or its leading
    dims cannot be flattened without a copy.
    """
    if cache.dim() < 3 or tuple(cache.shape[-2:]) != (kv_heads, head_dim):
        raise ArgumentError("qk_norm_rope_paged_cache", f"{name}: expected shape [..., Hkv={kv_heads}, "
                            f"D={head_dim}] ([num_blocks, block_size, Hkv, D] or [slots, Hkv, D]), got shape "
                            f"{tuple(cache.shape)}")
    try:
        flat = cache.view(-1, kv_heads, head_dim)
    except RuntimeError:
        raise ArgumentError("qk_norm_rope_paged_cache", f"{name}: expected leading dims that flatten to "
                            f"slots without a copy, got strides {tuple(cache.stride())}") from None
    return flat.transpose(0, 1).unsqueeze(0)


def check_qk_norm_rope_paged_cache_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm: str = "weight",
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the paged op's arguments; return the ``[1, Hkv, slots, D]`` views of both caches.

    Raises ``ArgumentError`` (a ``ValueError``) naming the first argument that breaks the contract (the dense op's
    rules apply to the views, with ``slot_mapping`` as ``cache_position``).
    """
    if q.dim() != 4 or q.shape[0] != 1:
        raise ArgumentError("qk_norm_rope_paged_cache", "q: expected a 4-D tensor [1, Hq, T, D] (tokens "
                            f"flattened into one batch row), got shape {tuple(q.shape)}")
    kv_heads, head_dim = (k.shape[1], k.shape[3]) if k.dim() == 4 else (-1, -1)
    if key_cache.dtype != value_cache.dtype or tuple(key_cache.shape) != tuple(value_cache.shape):
        raise ArgumentError("qk_norm_rope_paged_cache", "value_cache: expected key_cache's shape "
                            f"{tuple(key_cache.shape)} and dtype {key_cache.dtype}, got {tuple(value_cache.shape)} "
                            f"and {value_cache.dtype}")
    k_rows = paged_cache_rows(key_cache, "key_cache", kv_heads, head_dim)
    v_rows = paged_cache_rows(value_cache, "value_cache", kv_heads, head_dim)
    check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_rows, v_rows, slot_mapping, norm,
                                  rotary_dim, interleaved)
    return k_rows, v_rows


def qk_norm_rope_paged_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_eps: float,
    k_eps: float,
    norm: str = "weight",
    rope_first: bool = False,
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope_cache`` writing a paged cache through a slot mapping (vLLM's ``reshape_and_cache``).

    Args:
        q: [1, Hq, T, D] queries before the norm, the T tokens of all sequences in one row.
        k, v: [1, Hkv, T, D].
        q_weight, k_weight, cos ([1, T, D]), sin, q_eps, k_eps, norm, rope_first, rotary_dim,
            interleaved: as for
            ``qk_norm_rope_cache``.
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] or [slots, Hkv, D], updated in
            place: token t's rows go to slot ``slot_mapping[t]`` of ``cache.view(-1, Hkv, D)``.
        slot_mapping: [T] int64 or int32 flat slot indices. Negative slots count from the end
            (Python indexing, as ``cache.view(-1, Hkv, D)[slot_mapping] = k`` does); a slot
            outside [-slots, slots) raises or asserts as an out-of-range ``cache_position`` of
            ``qk_norm_rope_cache`` does.

    Returns:
        (q_rotated [1, Hq, T, D], k_rotated [1, Hkv, T, D]) with q's and k's strides.

    The kernel is the dense op's: it addresses the cache as ``batch * stride_b + head *
    stride_h + row * stride_row``, and the paged cache viewed as ``[1, Hkv, slots, D]`` is
    such a cache (``paged_cache_rows``). The mutated arguments are the caches themselves, so
    under torch.compile Inductor calls this op on the user's cache buffers, with no copy.
    """
    k_rows, v_rows = check_qk_norm_rope_paged_cache_args(
        q, k, v, q_weight, k_weight, cos, sin, key_cache, value_cache, slot_mapping, norm, rotary_dim,
        interleaved)
    check_positions_in_cache(slot_mapping, k_rows.shape[2], "slot_mapping")
    return _run_checked(q, k, v, q_weight, k_weight, cos, sin, k_rows, v_rows, slot_mapping, q_eps, k_eps, norm,
                        rope_first, rotary_dim, interleaved)


def _with_eps_tensors(op):
    """``op`` (the dense or the paged op) taking its epsilons as 0-d tensors, the overload that
    ``torch.compile(dynamic=True)`` calls: it lifts a Python float such as ``variance_epsilon``
    into a 0-d CPU tensor graph input, which is read here without a device synchronization."""

    def op_with_eps_tensors(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions,
                            q_eps: torch.Tensor, k_eps: torch.Tensor, *options):
        return op(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions,
                  _eps_value(q_eps, "q_eps"), _eps_value(k_eps, "k_eps"), *options)

    op_with_eps_tensors.__name__ = op_with_eps_tensors.__qualname__ = f"{op.__name__}_eps_tensor"
    return op_with_eps_tensors


def _eps_value(eps: torch.Tensor, name: str) -> float:
    if eps.numel() != 1:
        raise ArgumentError("qk_norm_rope_cache", f"{name}: expected a 0-d tensor, got shape {tuple(eps.shape)}")
    return float(eps)


def _with_layout_of(template: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if value.stride() == template.stride():
        return value
    out = torch.empty_like(template, dtype=value.dtype)
    out.copy_(value)
    return out


def _fake(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, q_eps, k_eps, norm="weight",
          rope_first=False, rotary_dim=None, interleaved=False):
    """Shapes for tracing (both overloads): the checks run at compile time too."""
    check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position, norm,
                                  rotary_dim, interleaved, rope_first)
    dtype = output_dtype(q, q_weight, cos, norm)
    return torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)


def _fake_paged(q, k, v, q_weight, k_weight, cos, sin, key_cache, value_cache, slot_mapping, q_eps, k_eps,
                norm="weight", rope_first=False, rotary_dim=None, interleaved=False):
    """Shapes for tracing the paged op (both overloads)."""
    check_qk_norm_rope_paged_cache_args(q, k, v, q_weight, k_weight, cos, sin, key_cache, value_cache, slot_mapping,
                                        norm, rotary_dim, interleaved)
    dtype = output_dtype(q, q_weight, cos, norm)
    return torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)


for _name, _fake_impl in (("qk_norm_rope_cache", _fake), ("qk_norm_rope_paged_cache", _fake_paged)):
    for _suffix in ("", "_eps_tensor"):
        torch.library.register_fake(f"fusion_pass::{_name}{_suffix}", _fake_impl, lib=_LIB)


def unsupported_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the fused op would not serve this geometry, or None when it does.

    The pattern's check asks this before rewriting, and the report shows the reason.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the fusion serves bf16 and fp16 models)"
    if head_dim < 1 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two (the kernel serves powers of two in [16, 512])"
    if not 16 <= head_dim <= 512:
        return f"head_dim {head_dim} is outside [16, 512] (the kernel serves powers of two in that range)"
    return None


for _op in (qk_norm_rope_cache, qk_norm_rope_paged_cache):
    _LIB.impl(_op.__name__, _op, "CompositeExplicitAutograd")
    _LIB.impl(f"{_op.__name__}_eps_tensor", _with_eps_tensors(_op), "CompositeExplicitAutograd")
