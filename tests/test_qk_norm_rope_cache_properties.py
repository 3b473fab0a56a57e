"""Property-based tests of the *compiled* fused path (torch.compile + the pass, the Triton kernel
under the interpreter): over shapes, cache positions / slots (negative and out of range),
q/k/v layouts and dtypes, the fused result equals eager bit for bit, every compiled graph
fuses exactly once, and cache rows that are not written stay bit-identical.

Compiles are the cost (seconds each on a CI core), so each test compiles one function and
lets Dynamo's dynamic shapes serve the drawn sizes: a new graph only for a new dtype, head
geometry, layout or a size of 1 (Dynamo specializes 0/1).

Out-of-range positions: eager ``cache[:, :, pos] = k`` raises ``IndexError``, and so does the
compiled fused region (CPU graphs call the op), before it writes anything.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compile_capture import compile_forward, fused_count
from fusion_pass.demo import apply_rotary_pos_emb
from fusion_pass.kernels.qk_norm_rope_cache_reference import rms_norm_reference

Q_EPS, K_EPS = 1e-6, 1e-5
# The compiled function is a function-scoped fixture on purpose: one compile per test, shared
# by its examples (conftest resets Dynamo between tests, not between examples).
PROPERTY_SETTINGS = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                    HealthCheck.function_scoped_fixture])


def dense_prologue(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, cache_position):
    """Qwen3: q [B, S, Hq, D] normed, transposed, rotated; ``cache[:, :, pos] = k`` (StaticCache)."""
    q = rms_norm_reference(q, q_weight, Q_EPS).transpose(1, 2)
    k = rms_norm_reference(k, k_weight, K_EPS).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k_cache[:, :, cache_position] = k
    v_cache[:, :, cache_position] = v.transpose(1, 2)
    return q, k


def paged_prologue(q, k, v, q_weight, k_weight, cos, sin, key_cache, value_cache, slot_mapping):
    """vLLM layout: q [T, Hq, D], cos [T, D]; ``key_cache.view(-1, Hkv, D)[slot_mapping] = k``."""
    q = rms_norm_reference(q, q_weight, Q_EPS)
    k = rms_norm_reference(k, k_weight, K_EPS)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    key_cache.view(-1, k.shape[1], k.shape[2])[slot_mapping] = k
    value_cache.view(-1, v.shape[1], v.shape[2])[slot_mapping] = v
    return q, k


class CompiledOnce:
    """``fn`` compiled with the forward fusion once per test; counts graphs and fusions."""

    def __init__(self, fn):
        self.compiled, _ = compile_forward(fn)
        self.graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def __call__(self, *inputs):
        with torch.no_grad():
            return self.compiled(*inputs)

    def assert_every_graph_fused_once(self):
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - self.graphs_before
        assert graphs >= 1 and fused_count() == graphs, (graphs, fused_count())


@pytest.fixture
def compiled_dense():
    return CompiledOnce(dense_prologue)


@pytest.fixture
def compiled_paged():
    return CompiledOnce(paged_prologue)


def random_tensor(shape, dtype, g, layout):
    """``shape`` [..., D] with values drawn from ``g``: contiguous, or a strided slice of a wider
    buffer (as q/k/v are when one fused QKV projection is split)."""
    if layout == "contiguous":
        return torch.randn(shape, generator=g).to(dtype)
    wide = torch.randn(*shape[:-2], shape[-2] + 3, shape[-1], generator=g).to(dtype)
    return wide[..., 1:shape[-2] + 1, :]


def rotary(shape, dtype, g):
    angles = torch.rand(*shape[:-1], shape[-1] // 2, generator=g) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mark_dynamic(*dims):
    for tensor, dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def drawn_positions(rows, count, g, negatives, out_of_range):
    """``count`` distinct rows of ``rows``, some spelled negative (Python indexing), the last
    ``out_of_range`` replaced by positions outside ``[-rows, rows)``."""
    positions = torch.randperm(rows, generator=g)[:count]
    positions[:negatives] -= rows  # the same rows, counted from the end
    for i in range(count - out_of_range, count):
        positions[i] = rows + i if i % 2 else -rows - 1 - i
    return positions


def eager_oracle(fn, inputs):
    """Eager ``fn`` on copies of the inputs: (outputs, its two caches)."""
    args = [t.clone() for t in inputs]
    with torch.no_grad():
        out = fn(*args)
    return out, args[7], args[8]


def assert_raises_like_eager_and_writes_nothing(compiled, eager_fn, inputs):
    with pytest.raises(IndexError), torch.no_grad():
        eager_fn(*[t.clone() for t in inputs])
    before = inputs[7].clone(), inputs[8].clone()
    with pytest.raises(IndexError, match="out of bounds"):
        compiled(*inputs)
    assert torch.equal(inputs[7], before[0]) and torch.equal(inputs[8], before[1])


def assert_untouched_rows(cache, before, written_rows, dim):
    keep = torch.ones(cache.shape[dim], dtype=torch.bool)
    keep[written_rows] = False
    assert torch.equal(cache.index_select(dim, keep.nonzero()[:, 0]), before.index_select(dim, keep.nonzero()[:, 0]))


@PROPERTY_SETTINGS
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    batch=st.integers(1, 3),
    seq=st.integers(1, 6),
    extra_rows=st.integers(0, 9),
    shared_cos=st.booleans(),
    layout=st.sampled_from(["contiguous", "fused_qkv_slice"]),
    negatives=st.integers(0, 6),
    out_of_range=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_compiled_dense_cache_equals_eager(compiled_dense, dtype, batch, seq, extra_rows, shared_cos, layout,
                                           negatives, out_of_range, seed):
    compiled = compiled_dense
    q_heads, kv_heads, head_dim = 4, 2, 32
    cache_len = seq + extra_rows
    g = torch.Generator().manual_seed(seed)
    q = random_tensor((batch, seq, q_heads, head_dim), dtype, g, layout)
    k = random_tensor((batch, seq, kv_heads, head_dim), dtype, g, layout)
    v = random_tensor((batch, seq, kv_heads, head_dim), dtype, g, layout)
    q_weight, k_weight = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype), torch.rand(head_dim, generator=g).to(dtype)
    cos, sin = rotary((1 if shared_cos else batch, seq, head_dim), dtype, g)
    k_cache, v_cache = (torch.randn(batch, kv_heads, cache_len, head_dim, generator=g).to(dtype) for _ in range(2))
    out_of_range = min(out_of_range, seq)
    positions = drawn_positions(cache_len, seq, g, min(negatives, seq), out_of_range)
    inputs = [q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions]
    mark_dynamic((q, 0), (q, 1), (k, 0), (k, 1), (v, 0), (v, 1), (cos, 1), (sin, 1), (k_cache, 2), (v_cache, 2),
                 (positions, 0))
    if out_of_range:
        assert_raises_like_eager_and_writes_nothing(compiled, dense_prologue, inputs)
    else:
        (q_ref, k_ref), k_want, v_want = eager_oracle(dense_prologue, inputs)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        q_out, k_out = compiled(*inputs)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
        assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
        for cache, before in ((k_cache, k_before), (v_cache, v_before)):
            assert_untouched_rows(cache, before, positions % cache_len, dim=2)
    compiled.assert_every_graph_fused_once()


@PROPERTY_SETTINGS
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    tokens=st.integers(1, 7),
    num_blocks=st.integers(2, 4),
    block_size=st.sampled_from([4, 8]),
    layout=st.sampled_from(["contiguous", "fused_qkv_slice"]),
    negatives=st.integers(0, 7),
    out_of_range=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_compiled_paged_cache_equals_eager(compiled_paged, dtype, tokens, num_blocks, block_size, layout, negatives,
                                           out_of_range, seed):
    compiled = compiled_paged
    q_heads, kv_heads, head_dim = 4, 2, 32
    slots = num_blocks * block_size
    g = torch.Generator().manual_seed(seed)
    q = random_tensor((tokens, q_heads, head_dim), dtype, g, layout)
    k = random_tensor((tokens, kv_heads, head_dim), dtype, g, layout)
    v = random_tensor((tokens, kv_heads, head_dim), dtype, g, layout)
    q_weight, k_weight = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype), torch.rand(head_dim, generator=g).to(dtype)
    cos, sin = rotary((tokens, head_dim), dtype, g)
    key_cache, value_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
                              for _ in range(2))
    out_of_range = min(out_of_range, tokens)
    slot_mapping = drawn_positions(slots, tokens, g, min(negatives, tokens), out_of_range)
    inputs = [q, k, v, q_weight, k_weight, cos, sin, key_cache, value_cache, slot_mapping]
    mark_dynamic((q, 0), (k, 0), (v, 0), (cos, 0), (sin, 0), (key_cache, 0), (value_cache, 0), (slot_mapping, 0))
    if out_of_range:
        assert_raises_like_eager_and_writes_nothing(compiled, paged_prologue, inputs)
    else:
        (q_ref, k_ref), k_want, v_want = eager_oracle(paged_prologue, inputs)
        before = key_cache.clone(), value_cache.clone()
        q_out, k_out = compiled(*inputs)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
        assert torch.equal(key_cache, k_want) and torch.equal(value_cache, v_want)
        for cache, old in zip((key_cache, value_cache), before):
            assert_untouched_rows(cache.view(slots, kv_heads, head_dim), old.view(slots, kv_heads, head_dim),
                                  slot_mapping % slots, dim=0)
    compiled.assert_every_graph_fused_once()

