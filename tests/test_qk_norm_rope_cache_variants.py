"""The forward fusion on other real spellings of the prologue: a paged KV cache written through a
slot mapping (vLLM / Hugging Face continuous batching), a fused QKV projection + split, and
rotary tables shared by the batch as ``[S, D]``. Exact match counts, bit-exact numerics
against eager, the user's cache tensors updated in place, and no cache-sized copy."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fusion_pass
from fusion_pass.demo import apply_rotary_pos_emb
from compile_capture import compile_forward, eager, fused_count, run_fused
from prologue_variants import COS_FORMS, LAYOUTS, PAGED_WRITES, DensePrologue, PagedPrologue, make_paged_inputs
from qwen3_style import make_inputs

PAGED_OP = "fusion_pass.qk_norm_rope_paged_cache.default"
DENSE_OP = "fusion_pass.qk_norm_rope_cache.default"


def assert_cache_updated_in_place(cache, before, want, slots, kv_heads, head_dim):
    """``cache`` is the very tensor the user passed: equal to eager's, written rows changed and
    every other row bit-identical to what it held before."""
    assert torch.equal(cache, want)
    flat, flat_before = cache.view(-1, kv_heads, head_dim), before.view(-1, kv_heads, head_dim)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[slots] = True
    assert torch.equal(flat[~written], flat_before[~written])
    assert not torch.equal(flat[written], flat_before[written])


# --- paged caches ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache_write", PAGED_WRITES)
def test_paged_cache_writes_fuse_once_and_are_bit_exact(layout, cache_write):
    model = PagedPrologue(layout=layout, cache_write=cache_write).to(torch.bfloat16)
    inputs = make_paged_inputs(layout=layout, cache_write=cache_write)
    caches_before = [inputs[3].clone(), inputs[4].clone()]
    key_cache_ptr = inputs[3].data_ptr()
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    assert PAGED_OP in capture.after[0] and DENSE_OP not in capture.after[0]
    assert torch.equal(q_out, q_ref)
    assert inputs[3].data_ptr() == key_cache_ptr
    for cache, before, want in zip(inputs[3:5], caches_before, ref_inputs[3:5]):
        assert_cache_updated_in_place(cache, before, want, inputs[5], kv_heads=2, head_dim=16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_cache_fp16_decode_gqa(layout):
    """One token: indexing assignment writes k.reshape(Hkv, D) (leading 1 stripped)."""
    model = PagedPrologue(hidden=32, q_heads=8, kv_heads=2, head_dim=64, layout=layout).to(torch.float16)
    inputs = make_paged_inputs(tokens=1, hidden=32, kv_heads=2, head_dim=64, num_blocks=3, block_size=4,
                               layout=layout, dtype=torch.float16, slots=[7])
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), _ = run_fused(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_paged_cache_viewed_with_explicit_slot_count_fuses():
    """``cache.view(num_blocks * block_size, Hkv, D)`` is the same view as ``view(-1, Hkv, D)``."""

    class ExplicitView(PagedPrologue):
        def forward(self, hidden_states, cos, sin, key_cache, value_cache, slot_mapping):
            q, k, v = self.proj(hidden_states)
            q = self.q_norm(q.view(hidden_states.shape[0], -1, self.head_dim))
            k = self.k_norm(k.view(hidden_states.shape[0], -1, self.head_dim))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            slots = key_cache.shape[0] * key_cache.shape[1]
            key_cache.view(slots, self.kv_heads, self.head_dim)[slot_mapping] = k
            value_cache.flatten(0, 1)[slot_mapping] = v.view(k.shape)
            return q, key_cache.float().sum() + value_cache.float().sum()

    model = ExplicitView().to(torch.bfloat16)
    inputs = make_paged_inputs()
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), _ = run_fused(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_negative_slots_write_the_rows_eager_writes():
    """``cache.view(-1, Hkv, D)[slots] = k`` counts negative slots from the end."""
    model = PagedPrologue().to(torch.bfloat16)
    inputs = make_paged_inputs(slots=[-1, 4, -32, 17, -9])
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), _ = run_fused(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_paged_generated_code_writes_the_user_caches_in_place():
    """The op is called on the cache graph inputs themselves: no cache-sized buffer, no copy."""
    num_blocks, block_size = 5, 7  # unusual sizes, so the cache shape cannot be another buffer's
    model = PagedPrologue(layout="hf_batch1", fused_qkv=True).to(torch.bfloat16)
    inputs = make_paged_inputs(layout="hf_batch1", num_blocks=num_blocks, block_size=block_size)
    cache_shape = tuple(inputs[3].shape)
    (q_ref, _), ref_inputs = eager(model, inputs)
    compiled, _ = compile_forward(model, inductor=True)
    with torch.no_grad():
        (q_out, _), codes = run_and_get_code(compiled, *inputs)
    code = "\n".join(codes)
    assert fused_count() == 1
    assert f"torch.ops.{PAGED_OP}(" in code
    allocations = [line for line in code.splitlines() if "empty_strided" in line or "empty(" in line]
    assert allocations, "no allocation found: the inspection no longer sees the wrapper code"
    assert not [line for line in allocations if str(cache_shape) in line], "a cache-sized buffer was allocated"
    assert "copy_(" not in code and "clone(" not in code
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_paged_mark_dynamic_tokens_compiles_once():
    """vLLM batches vary T every step: one graph, fused, for every T."""
    model = PagedPrologue().to(torch.bfloat16)
    compiled, _ = compile_forward(model)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for tokens in (5, 3, 9):
        inputs = make_paged_inputs(tokens=tokens, seed=tokens)
        for t in (inputs[0], inputs[1], inputs[2], inputs[5]):
            torch._dynamo.mark_dynamic(t, 0)
        (q_ref, _), ref_inputs = eager(model, inputs)
        with torch.no_grad():
            q_out, _ = compiled(*inputs)
        assert torch.equal(q_out, q_ref)
        assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
    assert fused_count() == 1


def test_paged_dynamic_true_lifts_eps_to_a_graph_input_and_still_fuses():
    model = PagedPrologue(q_eps=1e-2, k_eps=3e-1).to(torch.bfloat16)
    inputs = make_paged_inputs()
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs, dynamic=True)
    assert fused_count() == 1
    assert "fusion_pass.qk_norm_rope_paged_cache_eps_tensor" in capture.after[0]
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_paged_unsupported_head_dim_is_a_reported_near_miss():
    model = PagedPrologue(hidden=32, q_heads=2, kv_heads=1, head_dim=24).to(torch.bfloat16)
    inputs = make_paged_inputs(hidden=32, kv_heads=1, head_dim=24)
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 0
    assert PAGED_OP not in capture.after[0]
    assert "head_dim 24 is not a power of two" in fusion_pass.report()
    torch.testing.assert_close(q_out, q_ref, rtol=2e-2, atol=5e-2)


def test_paged_op_rejects_a_cache_of_other_head_geometry_by_name():
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    w, cos = torch.ones(16), torch.randn(1, 3, 16)
    cache = torch.zeros(2, 4, 4, 16)  # Hkv = 4, k has 2 heads
    with pytest.raises(ValueError, match=r"key_cache: expected shape \[\.\.\., Hkv=2, D=16\]"):
        torch.ops.fusion_pass.qk_norm_rope_paged_cache(q, k, k, w, w, cos, cos, cache, cache.clone(),
                                                        torch.arange(3), 1e-6, 1e-6)


def test_paged_op_out_of_range_slot_raises_like_index_put_and_writes_nothing():
    """``cache.view(-1, Hkv, D)[slots] = k`` raises ``IndexError`` for a slot past the cache;
    so does the op, before it writes (issue 18 item 2)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 4, 16, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    w, cos, sin = (torch.randn(s, generator=g).to(torch.bfloat16) for s in ((16,), (1, 4, 16), (1, 4, 16)))
    key_cache, value_cache = (torch.randn(3, 4, 2, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    before = key_cache.clone(), value_cache.clone()
    for slots in (torch.tensor([2, 12, 3, 5]), torch.tensor([2, -13, 3, 5])):  # 12 slots
        with pytest.raises(IndexError, match=r"slot_mapping: index -?1[23] is out of bounds for a cache of 12 rows"):
            torch.ops.fusion_pass.qk_norm_rope_paged_cache(q, k, v, w, w, cos, sin, key_cache, value_cache, slots,
                                                            1e-6, 1e-6)
        with pytest.raises(IndexError):
            key_cache.clone().view(-1, 2, 16)[slots] = k[0].transpose(0, 1)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


# --- fused QKV projection and shared rotary tables ---------------------------------------------

@pytest.mark.parametrize("layout,cache_write", [("tokens", "index_copy"), ("hf_batch1", "index_put")])
def test_fused_qkv_projection_paged_fuses(layout, cache_write):
    model = PagedPrologue(layout=layout, cache_write=cache_write, fused_qkv=True).to(torch.bfloat16)
    inputs = make_paged_inputs(layout=layout, cache_write=cache_write)
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    assert "aten.split_with_sizes.default" in capture.after[0] and PAGED_OP in capture.after[0]
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


# (separate projections with cos [B, S, D] is the Qwen3 structure: test_qk_norm_rope_cache_pattern.py)
@pytest.mark.parametrize("fused_qkv,cos_form", [(True, form) for form in COS_FORMS]
                         + [(False, form) for form in COS_FORMS if form != "batch_unsqueeze"])
def test_dense_cache_fused_qkv_and_cos_forms_fuse(fused_qkv, cos_form):
    """q, k, v as strided slices of one projection; cos/sin [B, S, D], or [S, D] shared."""
    model = DensePrologue(fused_qkv=fused_qkv, cos_form=cos_form).to(torch.bfloat16)
    inputs = list(make_inputs(cos_batch=1 if cos_form != "batch_unsqueeze" else None))
    if cos_form != "batch_unsqueeze":
        inputs[1], inputs[2] = inputs[1][0], inputs[2][0]  # [S, D]
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    assert DENSE_OP in capture.after[0]
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_cos_varying_over_heads_is_left_alone():
    """cos [Hq, S, D] broadcasts over the batch, not over the heads: not RoPE as the op applies it."""
    model = DensePrologue(q_heads=2, kv_heads=2, cos_form="shared_broadcast").to(torch.bfloat16)
    inputs = list(make_inputs())
    g = torch.Generator().manual_seed(5)
    inputs[1], inputs[2] = (torch.randn(2, 5, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 0
    assert DENSE_OP not in capture.after[0]
    torch.testing.assert_close(q_out, q_ref, rtol=2e-2, atol=5e-2)
