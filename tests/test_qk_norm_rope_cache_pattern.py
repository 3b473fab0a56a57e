"""Graph side of the forward fusion: what is matched (exact counts), what is refused, and the
graph before/after as snapshots."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

import fusion_pass
from compile_capture import compile_forward, fused_count
from qwen3_style import LOOK_ALIKES, Qwen3StylePrologue, make_inputs

FUSED_OP = "fusion_pass.qk_norm_rope_cache"

# Stock Inductor keeps bf16 intermediates in fp32 where eager rounds them: unfused results
# differ from eager by a few bf16 ulps of the intermediates (|x| <= ~4: ulp 2^-6).
UNFUSED_TOL = dict(rtol=2e-2, atol=5e-2)


def run_compiled(model, inputs, **compile_kwargs):
    compiled, capture = compile_forward(model, **compile_kwargs)
    with torch.no_grad():
        out = compiled(*inputs)
    return out, capture


def reference(model, inputs):
    cloned = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    with torch.no_grad():
        out = model(*cloned)
    return out, cloned


@pytest.mark.parametrize("cache_write", ["index_copy", "index_put", "slice"])
@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 2), (torch.float16, 2), (torch.bfloat16, 1)])
def test_each_cache_write_fuses_once_and_is_bit_exact(cache_write, dtype, batch):
    # batch 1 matters: ``cache[:, :, pos] = k`` then traces with a reshape of k to [H, S, D].
    model = Qwen3StylePrologue(cache_write=cache_write).to(dtype)
    inputs = list(make_inputs(dtype=dtype, batch=batch))
    if cache_write == "slice":
        inputs[5] = 3  # the slice start
    (q_ref, _), ref_inputs = reference(model, inputs)
    (q_out, _), capture = run_compiled(model, inputs)
    assert fused_count() == 1
    assert FUSED_OP in capture.after[0] and FUSED_OP not in capture.before[0]
    # The reference path follows the Hugging Face rounding op by op: bit-identical.
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


@pytest.mark.parametrize(
    "batch,seq,past,q_heads,kv_heads,head_dim",
    [
        (1, 1, 9, 4, 2, 16),  # decode
        (3, 6, 0, 8, 2, 64),  # prefill, GQA 4:1
        (1, 4, 2, 2, 2, 128),  # MHA
        (2, 3, 1, 2, 1, 256),
    ],
)
def test_geometries_fuse(batch, seq, past, q_heads, kv_heads, head_dim):
    hidden = 32
    model = Qwen3StylePrologue(hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim).to(torch.bfloat16)
    inputs = make_inputs(batch=batch, seq=seq, past=past, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim)
    (q_ref, _), ref_inputs = reference(model, inputs)
    (q_out, _), _ = run_compiled(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3])


def test_cos_shared_over_batch_fuses():
    model = Qwen3StylePrologue().to(torch.bfloat16)
    inputs = make_inputs(cos_batch=1)
    (q_ref, _), _ = reference(model, inputs)
    (q_out, _), _ = run_compiled(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)


@pytest.mark.parametrize("cache_write", ["index_put", "slice"])
def test_negative_positions_write_the_rows_eager_writes(cache_write):
    """``cache[:, :, pos] = k`` and ``cache[:, :, -7:-2] = k`` count from the end of the cache."""
    model = Qwen3StylePrologue(cache_write=cache_write).to(torch.bfloat16)
    inputs = list(make_inputs(seq=5))
    inputs[5] = -7 if cache_write == "slice" else torch.arange(-7, -2)
    (q_ref, _), ref_inputs = reference(model, inputs)
    (q_out, _), _ = run_compiled(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_a_layout_the_op_rejects_is_left_unfused_not_a_compile_error():
    model = Qwen3StylePrologue().to(torch.bfloat16)
    inputs = list(make_inputs())
    # Same values, but cos/sin with a non-contiguous last dim: the op requires stride(-1) == 1.
    inputs[1] = inputs[1].transpose(1, 2).contiguous().transpose(1, 2)
    inputs[2] = inputs[2].transpose(1, 2).contiguous().transpose(1, 2)
    (q_ref, _), ref_inputs = reference(model, inputs)
    (q_out, _), _ = run_compiled(model, inputs)
    assert fused_count() == 0
    assert "contiguous last dim" in fusion_pass.report()
    torch.testing.assert_close(q_out, q_ref, **UNFUSED_TOL)


def test_different_eps_per_norm_are_both_honoured():
    model = Qwen3StylePrologue(q_eps=1e-2, k_eps=3e-1).to(torch.bfloat16)
    inputs = make_inputs()
    (q_ref, _), ref_inputs = reference(model, inputs)
    (q_out, _), _ = run_compiled(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3])


@pytest.mark.parametrize("variant", [v for v in LOOK_ALIKES if v != "no_cache_write"])
def test_look_alikes_are_left_alone(variant):
    model = Qwen3StylePrologue(variant=variant).to(torch.bfloat16)
    inputs = make_inputs()
    extra = ()
    if variant == "k_other_positions":
        cos_k, sin_k = make_inputs(seed=1)[1:3]
        extra = (cos_k, sin_k)
    (q_ref, _), ref_inputs = reference(model, list(inputs) + list(extra))
    (q_out, _), capture = run_compiled(model, list(inputs) + list(extra))
    assert fused_count() == 0
    assert FUSED_OP not in capture.after[0]
    torch.testing.assert_close(q_out, q_ref, **UNFUSED_TOL)
    if variant == "full_width_norm":  # q and k: reported with the reason
        assert [(m.reason.split(":")[0], n) for m, n in fusion_pass.near_misses().items()] == [
            ("RMSNorm over the whole projection width, then heads -> RoPE (e.g. OLMo2)", 2)]


def test_cache_of_another_dtype_than_k_is_left_alone():
    """``cache[:, :, start:end] = k`` into an fp32 cache converts k: not what the op writes.
    (``index_put_``/``index_copy_`` refuse mismatched dtypes in eager already.)"""
    model = Qwen3StylePrologue(cache_write="slice").to(torch.bfloat16)
    inputs = list(make_inputs())
    inputs[3], inputs[4], inputs[5] = inputs[3].float(), inputs[4].float(), 3
    (q_ref, _), ref_inputs = reference(model, inputs)
    (q_out, _), capture = run_compiled(model, inputs)
    assert fused_count() == 0
    assert FUSED_OP not in capture.after[0]
    torch.testing.assert_close(inputs[3], ref_inputs[3], **UNFUSED_TOL)


def test_norm_rope_without_cache_write_is_a_reported_near_miss():
    model = Qwen3StylePrologue(variant="no_cache_write").to(torch.bfloat16)
    run_compiled(model, make_inputs())
    assert fused_count() == 0
    assert "without a matching K/V cache write" in fusion_pass.report()


def test_one_tensor_as_both_caches_is_a_near_miss_and_compiles():
    """``k_cache is v_cache`` (issue 18 item 3): functionalization chains the v write on the k
    write's result; fusing both into one launch made a cycle (InductorError). Left unfused,
    reported, and as eager computes it."""
    model = Qwen3StylePrologue().to(torch.bfloat16)
    hidden, cos, sin, cache, _, position = make_inputs()
    cache_ref = cache.clone()
    with torch.no_grad():
        q_ref, _ = model(hidden, cos, sin, cache_ref, cache_ref, position)
    compiled, _ = compile_forward(model)
    with torch.no_grad():
        q_out, _ = compiled(hidden, cos, sin, cache, cache, position)
    assert fused_count() == 0
    assert "k_cache and v_cache are the same tensor" in fusion_pass.report()
    torch.testing.assert_close(q_out, q_ref, **UNFUSED_TOL)
    torch.testing.assert_close(cache, cache_ref, **UNFUSED_TOL)


class _ReadsRowsOfItsCache(torch.nn.Module):
    """k and v are rows of the caches they are written into, as a cache re-rotation would take them."""

    def __init__(self, head_dim=16):
        super().__init__()
        from fusion_pass.demo import RMSNorm

        self.q_norm, self.k_norm = RMSNorm(head_dim), RMSNorm(head_dim)

    def forward(self, q, k_cache, v_cache, cos, sin, position):
        from fusion_pass.demo import apply_rotary_pos_emb

        seq = q.shape[2]
        k, v = k_cache[:, :, 3:3 + seq], v_cache[:, :, 3:3 + seq]
        q, k = apply_rotary_pos_emb(self.q_norm(q), self.k_norm(k), cos, sin)
        k_cache.index_copy_(2, position, k)
        v_cache.index_copy_(2, position, v)
        return q, k


def test_k_as_a_view_of_its_own_cache_is_a_near_miss():
    """k read from the cache rows the launch overwrites (issue 18 item 3): one launch would read
    rows other programs already wrote. Left unfused, reported, and as eager computes it."""
    model = _ReadsRowsOfItsCache().to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 16, generator=g).to(torch.bfloat16)
    caches = [torch.randn(2, 2, 16, 16, generator=g).to(torch.bfloat16) for _ in range(2)]
    angles = torch.rand(2, 5, 8, generator=g) * 6.28
    emb = torch.cat((angles, angles), -1)
    inputs = (q, *caches, emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16), torch.arange(5, 10))
    (q_ref, k_ref), ref_inputs = reference(model, inputs)
    (q_out, k_out), _ = run_compiled(model, inputs)
    assert fused_count() == 0
    assert "is a view of a cache the region writes" in fusion_pass.report()
    torch.testing.assert_close(k_out, k_ref, **UNFUSED_TOL)
    torch.testing.assert_close(inputs[1], ref_inputs[1], **UNFUSED_TOL)


def test_fp32_model_is_a_reported_near_miss_with_its_reason():
    """fp32 traces the norm without casts, so the bf16/fp16 patterns cannot see it; the report
    still says why the prologue was left (once per norm: q and k), and nothing else."""
    model = Qwen3StylePrologue()
    inputs = make_inputs(dtype=torch.float32)
    (q_ref, _), _ = reference(model, inputs)
    (q_out, _), _ = run_compiled(model, inputs)
    assert fused_count() == 0
    report = fusion_pass.report()
    assert "RoPE in float32: the fused kernel takes bf16 or fp16 models" in report and "(x2)" in report, report
    assert "without a matching K/V cache write" not in report
    torch.testing.assert_close(q_out, q_ref, **UNFUSED_TOL)


def test_normed_q_with_another_user_is_not_fused_and_stays_correct():
    model = Qwen3StylePrologue(extra_use_of_normed_q=True).to(torch.bfloat16)
    inputs = make_inputs()
    (q_ref, _, normed_ref), ref_inputs = reference(model, inputs)
    (q_out, _, normed_out), _ = run_compiled(model, inputs)
    assert fused_count() == 0
    torch.testing.assert_close(normed_out, normed_ref, **UNFUSED_TOL)
    torch.testing.assert_close(inputs[3], ref_inputs[3], **UNFUSED_TOL)


def test_unsupported_head_dim_is_a_reported_near_miss():
    model = Qwen3StylePrologue(hidden=32, q_heads=2, kv_heads=1, head_dim=24).to(torch.bfloat16)
    inputs = make_inputs(hidden=32, kv_heads=1, head_dim=24)
    (q_ref, _), _ = reference(model, inputs)
    (q_out, _), _ = run_compiled(model, inputs)
    assert fused_count() == 0
    assert "head_dim 24 is not a power of two" in fusion_pass.report()
    assert "without a matching K/V cache write" not in fusion_pass.report()  # one reason, the right one
    torch.testing.assert_close(q_out, q_ref, **UNFUSED_TOL)


def test_device_not_enabled_is_not_rewritten():
    model = Qwen3StylePrologue().to(torch.bfloat16)
    run_compiled(model, make_inputs(), devices=("cuda",))
    assert fused_count() == 0


def test_dynamic_true_lifts_eps_to_a_graph_input_and_still_fuses():
    model = Qwen3StylePrologue(q_eps=1e-2, k_eps=3e-1).to(torch.bfloat16)
    inputs = make_inputs()
    (q_ref, _), ref_inputs = reference(model, inputs)
    (q_out, _), capture = run_compiled(model, inputs, dynamic=True)
    assert fused_count() == 1
    assert "fusion_pass.qk_norm_rope_cache_eps_tensor" in capture.after[0]
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3])


def test_mark_dynamic_sequence_compiles_once_across_lengths():
    model = Qwen3StylePrologue().to(torch.bfloat16)
    compiled, _ = compile_forward(model)
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seq in (5, 7, 11):
        inputs = make_inputs(seq=seq)
        for t, dim in ((inputs[0], 1), (inputs[1], 1), (inputs[2], 1), (inputs[5], 0)):
            torch._dynamo.mark_dynamic(t, dim)
        (q_ref, _), ref_inputs = reference(model, inputs)
        with torch.no_grad():
            q_out, _ = compiled(*inputs)
        assert torch.equal(q_out, q_ref)
        assert torch.equal(inputs[3], ref_inputs[3])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before == 1
    assert fused_count() == 1


def test_snapshot_before_and_after():
    model = Qwen3StylePrologue().to(torch.bfloat16)
    _, capture = run_compiled(model, make_inputs())
    assert_expected_inline(capture.before[0], """\
v0 = aten.reshape.default(in0, [10, 64])
v1 = aten.permute.default(in1, [1, 0])
v2 = aten.mm.default(v0, v1)
v3 = aten.reshape.default(v2, [2, 5, 64])
v4 = aten.reshape.default(v3, [2, 5, -1, 16])
v5 = prims.convert_element_type.default(v4, float32)
v6 = aten.pow.Tensor_Scalar(v5, 2)
v7 = aten.mean.dim(v6, [-1], True)
v8 = aten.add.Tensor(v7, 1e-06)
v9 = aten.rsqrt.default(v8)
v10 = aten.mul.Tensor(v5, v9)
v11 = prims.convert_element_type.default(v10, bfloat16)
v12 = aten.mul.Tensor(in2, v11)
v13 = aten.permute.default(v12, [0, 2, 1, 3])
v14 = aten.unsqueeze.default(in6, 1)
v15 = aten.mul.Tensor(v13, v14)
v16 = aten.slice.Tensor(v13, 3, 8, 9223372036854775807)
v17 = aten.neg.default(v16)
v18 = aten.slice.Tensor(v13, 3, 0, 8)
v19 = aten.cat.default([v17, v18], -1)
v20 = aten.unsqueeze.default(in7, 1)
v21 = aten.mul.Tensor(v19, v20)
v22 = aten.add.Tensor(v15, v21)
v23 = prims.convert_element_type.default(v22, float32)
v24 = aten.sum.default(v23)
v25 = aten.reshape.default(in0, [10, 64])
v26 = aten.permute.default(in3, [1, 0])
v27 = aten.mm.default(v25, v26)
v28 = aten.reshape.default(v27, [2, 5, 32])
v29 = aten.reshape.default(v28, [2, 5, -1, 16])
v30 = prims.convert_element_type.default(v29, float32)
v31 = aten.pow.Tensor_Scalar(v30, 2)
v32 = aten.mean.dim(v31, [-1], True)
v33 = aten.add.Tensor(v32, 1e-06)
v34 = aten.rsqrt.default(v33)
v35 = aten.mul.Tensor(v30, v34)
v36 = prims.convert_element_type.default(v35, bfloat16)
v37 = aten.mul.Tensor(in4, v36)
v38 = aten.permute.default(v37, [0, 2, 1, 3])
v39 = aten.mul.Tensor(v38, v14)
v40 = aten.slice.Tensor(v38, 3, 8, 9223372036854775807)
v41 = aten.neg.default(v40)
v42 = aten.slice.Tensor(v38, 3, 0, 8)
v43 = aten.cat.default([v41, v42], -1)
v44 = aten.mul.Tensor(v43, v20)
v45 = aten.add.Tensor(v39, v44)
v46 = aten.index_put.default(in8, [None, None, in9], v45)
v47 = prims.convert_element_type.default(v46, float32)
v48 = aten.sum.default(v47)
v49 = aten.add.Tensor(v24, v48)
v50 = aten.reshape.default(in0, [10, 64])
v51 = aten.permute.default(in5, [1, 0])
v52 = aten.mm.default(v50, v51)
v53 = aten.reshape.default(v52, [2, 5, 32])
v54 = aten.reshape.default(v53, [2, 5, -1, 16])
v55 = aten.permute.default(v54, [0, 2, 1, 3])
v56 = aten.index_put.default(in10, [None, None, in9], v55)
v57 = prims.convert_element_type.default(v56, float32)
v58 = aten.sum.default(v57)
v59 = aten.add.Tensor(v49, v58)
v60 = aten.copy_.default(in8, v46)
v61 = aten.copy_.default(in10, v56)
return [v22, v59]""")
    assert_expected_inline(capture.after[0], """\
v0 = aten.reshape.default(in0, [10, 64])
v1 = aten.permute.default(in1, [1, 0])
v2 = aten.mm.default(v0, v1)
v3 = aten.reshape.default(v2, [2, 5, 64])
v4 = aten.reshape.default(v3, [2, 5, -1, 16])
v5 = aten.unsqueeze.default(in6, 1)
v6 = aten.unsqueeze.default(in7, 1)
v7 = aten.permute.default(v4, [0, 2, 1, 3])
v8 = aten.squeeze.dim(v5, 1)
v9 = aten.squeeze.dim(v6, 1)
v10 = aten.reshape.default(in0, [10, 64])
v11 = aten.permute.default(in3, [1, 0])
v12 = aten.mm.default(v10, v11)
v13 = aten.reshape.default(v12, [2, 5, 32])
v14 = aten.reshape.default(v13, [2, 5, -1, 16])
v15 = aten.permute.default(v14, [0, 2, 1, 3])
v16 = aten.reshape.default(in0, [10, 64])
v17 = aten.permute.default(in5, [1, 0])
v18 = aten.mm.default(v16, v17)
v19 = aten.reshape.default(v18, [2, 5, 32])
v20 = aten.reshape.default(v19, [2, 5, -1, 16])
v21 = aten.permute.default(v20, [0, 2, 1, 3])
v22 = higher_order.auto_functionalized(fusion_pass.qk_norm_rope_cache.default, q=v7, k=v15, v=v21, q_weight=in2, k_weight=in4, cos=v8, sin=v9, k_cache=in8, v_cache=in10, cache_position=in9, q_eps=1e-06, k_eps=1e-06)
v23 = getitem(v22, 0)
v24 = prims.convert_element_type.default(v23, float32)
v25 = aten.sum.default(v24)
v26 = getitem(v22, 2)
v27 = prims.convert_element_type.default(v26, float32)
v28 = aten.sum.default(v27)
v29 = aten.add.Tensor(v25, v28)
v30 = getitem(v22, 3)
v31 = prims.convert_element_type.default(v30, float32)
v32 = aten.sum.default(v31)
v33 = aten.add.Tensor(v29, v32)
v34 = aten.copy_.default(in8, v26)
v35 = aten.copy_.default(in10, v30)
return [v23, v33]""")


def test_every_layer_of_a_deep_model_fuses_with_its_own_k_and_v():
    """Layers share cos/sin and cache_position: each q must pair with its own layer's k and V
    write (the matcher would otherwise pair the last q with the first k: a cycle)."""
    from fusion_pass.demo import Qwen3StyleModel

    layers, batch, seq, cache_len = 4, 2, 6, 16
    model = Qwen3StyleModel(layers=layers, hidden=512).to(torch.bfloat16).eval()
    hidden = torch.randn(batch, seq, 512).to(torch.bfloat16)
    position = torch.arange(3, 3 + seq)

    def caches():
        g = torch.Generator().manual_seed(1)
        return [torch.randn(batch, 2, cache_len, 64, generator=g).to(torch.bfloat16) for _ in range(2 * layers)]

    ref_caches, caches_in = caches(), caches()
    with torch.no_grad():
        ref = model(hidden, ref_caches[:layers], ref_caches[layers:], position)
    compiled, capture = compile_forward(model)
    with torch.no_grad():
        out = compiled(hidden, caches_in[:layers], caches_in[layers:], position)
    assert fused_count() == layers
    assert capture.after[0].count(FUSED_OP + ".default") == layers
    assert torch.equal(out, ref)
    for got, want in zip(caches_in, ref_caches):
        assert torch.equal(got, want)
