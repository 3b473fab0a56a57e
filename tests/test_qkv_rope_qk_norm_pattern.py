"""Matching of the qkv_rope_qk_norm family: exact counts per registered variant, zero on look-alikes,
near-misses, dynamic shapes, and snapshots of the joint graph before and after the pass.

Graphs are compiled with ``joint_pass_backend`` (AOT autograd + Inductor's joint-graph passes, then
eager execution): the pass and the numerics of the rewritten graph, without C++ codegen. The
gradients checked here are those of the rewritten graphs; tests/test_qkv_rope_qk_norm_numerics.py
compiles with Inductor end to end.
"""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch
from torch import nn
from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense as hf_hunyuan

import fusion_pass
from fusion_pass.graph_text import CapturingPass
from fusion_pass.patterns import qkv_rope_qk_norm as pattern
from fusion_pass.patterns import qk_norm_rope_backward as per_tensor
from qkv_rope_qk_norm_models import (
    HEAD_DIM,
    HIDDEN,
    INFERENCE_VARIANTS,
    TRAINING_VARIANTS,
    FusedQKVAttention,
    FusedQKVPrologue,
    RegionCapture,
    VariantStack,
    compare_grads,
    joint_pass_backend,
    op_counts,
    rope_tables,
    swapped_rotate_half,
)

FAMILY = "qkv_rope_qk_norm"
PER_TENSOR = "qk_norm_rope_backward"
FWD_OP = "fusion_pass.qkv_rope_qk_norm.default"
# max |grad - grad_eager| / max |grad_eager| over a test's gradients: a few ulps of the largest
# entry, measured at these tests' inputs (see GRAD_TOLERANCE in test_qkv_rope_qk_norm_numerics.py:
# tight for the conftest seed, not for arbitrary inputs).
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1.5e-3}
BWD_OP = "fusion_pass.qkv_rope_qk_norm_backward.default"


def _compile(model, devices=("cpu",), capture=None):
    fusion_pass.install(devices=devices)
    pattern.reset_variant_counts()
    per_tensor.reset_variant_counts()
    return torch.compile(model, backend=joint_pass_backend(capture))


def _inputs(dtype, batch=2, seq=12, batch_cos_g=1):
    """x, the constant tables [1, S, D], and tables requiring grad [batch_cos_g, S, D]."""
    x = torch.randn(batch, seq, HIDDEN, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(seq, dtype=dtype)
    cos_g, sin_g = rope_tables(seq, dtype=dtype, batch=batch_cos_g, requires_grad=True)
    return x, cos, sin, cos_g, sin_g


def _clone_inputs(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_training_variant_matches_exactly_once(dtype):
    """16 blocks in one graph: fused / separate QKV x bias x norm weights trainable / frozen x
    cos/sin constant / requiring grad. Each joint registration matches its block, once. The
    tables requiring grad are [1, S, D] in fp32 and [B, S, D] in bf16."""
    model = VariantStack(TRAINING_VARIANTS).to(dtype)
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    inputs = _inputs(dtype, batch_cos_g=1 if dtype == torch.float32 else 2)
    ref_inputs = _clone_inputs(inputs)
    exact_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    capture = CapturingPass(None)
    out = _compile(model, capture=capture)(*inputs)
    out.float().pow(2).mean().backward()

    assert fusion_pass.match_counts() == {FAMILY: len(TRAINING_VARIANTS)}
    assert pattern.variant_counts() == {
        pattern.variant_name(s, b, dtype, True, n, r): 1 for s, b, n, r in TRAINING_VARIANTS
    }
    assert fusion_pass.near_misses() == {}
    # One joint graph. The region's forward stays torch ops (Inductor fuses them): its projection
    # mm(s) and one rsqrt per q / k norm. Its whole backward is one op per block: besides o_proj's
    # forward mm (addmm with HF's attention_bias) and o_proj's two backward mm, no mm is left.
    (joint,) = capture.after_graphs
    ops = op_counts(joint)
    blocks = len(TRAINING_VARIANTS)
    projection_mms = sum(1 if structure == "fused" else 3 for structure, *_ in TRAINING_VARIANTS)
    assert ops[BWD_OP] == blocks
    assert FWD_OP not in ops  # the opaque forward op is not used: Inductor compiles the forward
    assert ops["aten.mm.default"] + ops.get("aten.addmm.default", 0) == 3 * blocks + projection_mms
    assert ops["aten.rsqrt.default"] == 3 * blocks  # the blocks' input norms + q and k norms

    expected = reference(*ref_inputs)
    expected.float().pow(2).mean().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the forward follows eager's roundings
    names = ["x", "cos", "sin", "cos_g", "sin_g"]
    extra = [(n, a, b) for n, a, b in zip(names, inputs, ref_inputs) if b.requires_grad]
    errors = compare_grads(model, reference, extra)
    assert len(errors) == sum(1 for p in reference.parameters() if p.requires_grad) + 3
    if dtype == torch.float32:
        assert max(errors.values()) < GRAD_TOLERANCE[dtype], sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    else:
        # bf16 against bf16 eager is a difference of two roundings of the same gradient, which
        # depends on the machine's bf16 matmul (oneDNN on AVX512-BF16 vs AVX2 CPUs): measured
        # 9.9e-3 on one CI machine where another gave < 8e-3 for the same seed. Against float64
        # the fused gradients must be as accurate as eager bf16 autograd's (within 2x, or 2 ulps).
        exact(*exact_inputs).pow(2).mean().backward()
        exact_extra = [(n, a, b) for n, a, b in zip(names, inputs, exact_inputs) if b.requires_grad]
        eager_extra = [(n, a, b) for n, a, b in zip(names, ref_inputs, exact_inputs) if b.requires_grad]
        ours = compare_grads(model, exact, exact_extra)
        eager = compare_grads(reference, exact, eager_extra)
        worse = {n: (e, eager[n]) for n, e in ours.items() if e > max(2 * eager[n], 2 * 2.0 ** -8)}
        assert not worse, sorted(worse.items(), key=lambda kv: -kv[1][0])[:3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_no_grad_graphs_are_left_to_inductor(dtype):
    """Under no_grad the replacement would be the region's own forward (only the backward is
    ours): nothing is rewritten, nothing is counted, outputs are eager's."""
    specs = [(s, b, True, False) for s, b in INFERENCE_VARIANTS]
    model = VariantStack(specs).to(dtype)
    inputs = _inputs(dtype)
    with torch.no_grad():
        out = _compile(model)(*inputs)
        expected = model(*inputs)
    assert fusion_pass.match_counts() == {}
    assert pattern.variant_counts() == {}
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_no_grad_graphs_do_not_register_the_training_patterns(monkeypatch):
    """Registering the 32 joint patterns takes seconds: an inference compile must not pay it
    (``applies_to``: only graphs with a backward can match); a training compile does."""
    import fusion_pass.passes as passes

    looked_up = []
    real = passes._family_pass
    monkeypatch.setattr(passes, "_family_pass", lambda family: looked_up.append(family) or real(family))
    model = VariantStack([("fused", False, True, False)])
    inputs = _inputs(torch.float32)[:3]
    with torch.no_grad():
        _compile(model)(*inputs)
    assert FAMILY not in looked_up
    torch._dynamo.reset()
    _compile(model)(*inputs).sum().backward()
    assert FAMILY in looked_up
    assert fusion_pass.match_counts() == {FAMILY: 1}


LOOKALIKES = ["norm_before_rope", "full_width_norm", "grouped_split", "quarter_rotate", "swapped_halves"]


@pytest.mark.parametrize("training", [True, False], ids=["training", "no_grad"])
def test_lookalikes_do_not_match(training):
    """Norm before RoPE; one norm over the whole projection width; HunyuanImage-3.0's grouped
    [q * G, k, v] rows; rotate_half split at D/4 (same ops, other ints: caught by the checks);
    rotate_half as cat((-x1, x2)) (same ops and ints, swapped roles: caught by the role checks).
    Outputs (and gradients) equal eager's. Two of them are real per-head norms and RoPE that the
    per-tensor family (``qk_norm_rope_backward``) fuses in training: norm before RoPE (Gemma3's
    placement) and the grouped layout (RoPE first), q and k each."""
    torch.manual_seed(0)
    model = VariantStack([("fused", False, True, False)] * len(LOOKALIKES), lookalikes=LOOKALIKES)
    reference = copy.deepcopy(model)
    inputs = _inputs(torch.float32)[:3]
    ref_inputs = _clone_inputs(inputs)
    compiled = _compile(model)
    if training:
        out = compiled(*inputs)
        out.pow(2).mean().backward()
        expected = reference(*ref_inputs)
        expected.pow(2).mean().backward()
        errors = compare_grads(model, reference, [("x", inputs[0], ref_inputs[0])])
        assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    else:
        with torch.no_grad():
            out, expected = compiled(*inputs), reference(*ref_inputs)
    assert pattern.variant_counts() == {}
    if training:
        assert fusion_pass.match_counts() == {PER_TENSOR: 4}
        assert per_tensor.variant_counts() == {"qwen3_norm_after_transpose_fp32": 2, "qwen3_rope_first_fp32": 2}
    else:
        assert fusion_pass.match_counts() == {}
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _rotate_half_constant_half(x):
    """``rotate_half`` written inline with the half as a constant (issue 17)."""
    return torch.cat((-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]), dim=-1)


@pytest.mark.parametrize("rotate_half", [_rotate_half_constant_half], ids=["constant_half"])
def test_rotate_half_spellings_match_in_training(rotate_half):
    """Equivalent spellings of ``rotate_half`` in the HunyuanImage-3-style block: fused once, and
    the gradients equal eager's. The inline form takes its second half first, which orders the
    backward's sum of the two ``slice_scatter`` terms the other way (``canonical_forms``). Not
    yet: ``chunk``, whose backward is a ``cat`` of the two gradients."""
    torch.manual_seed(0)
    model = FusedQKVAttention(rotate_half=rotate_half)
    reference = copy.deepcopy(model)
    inputs = _inputs(torch.float32)[:3]
    ref_inputs = _clone_inputs(inputs)
    out = _compile(model)(*inputs)
    out.pow(2).mean().backward()
    reference(*ref_inputs).pow(2).mean().backward()
    assert fusion_pass.match_counts() == {FAMILY: 1}, fusion_pass.report()
    errors = compare_grads(model, reference, [("x", inputs[0], ref_inputs[0])])
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("structure", ["fused", "separate"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "no_grad"])
def test_swapped_rotate_half_halves_do_not_match(structure, training, monkeypatch):
    """cat((-x[..., :D/2], x[..., D/2:])): the pre-traced pattern's slice ints are wildcards, so
    only the role checks (which slice is negated, which comes first) keep it from being fused as
    rotate_half (it was: q off by 3.3 from eager). bf16, both structures; eager-equal outputs."""
    torch.manual_seed(0)
    # The separate structure is HF's module: its apply_rotary_pos_emb looks rotate_half up at call time.
    monkeypatch.setattr(hf_hunyuan, "rotate_half", swapped_rotate_half)
    model = VariantStack([(structure, True, True, False)], lookalikes=["swapped_halves"]).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    inputs = _inputs(torch.bfloat16)[:3]
    ref_inputs = _clone_inputs(inputs)
    compiled = _compile(model)
    if training:
        out, expected = compiled(*inputs), reference(*ref_inputs)
        out.float().pow(2).mean().backward()
        expected.float().pow(2).mean().backward()
        errors = compare_grads(model, reference, [("x", inputs[0], ref_inputs[0])])
        assert max(errors.values()) < GRAD_TOLERANCE[torch.bfloat16], sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    else:
        with torch.no_grad():
            out, expected = compiled(*inputs), reference(*ref_inputs)
    assert fusion_pass.match_counts() == {}
    assert pattern.variant_counts() == {}
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_custom_rotate_half_backward_does_not_match_in_training():
    """rotate_half's forward with a custom backward that routes the gradient halves the other way
    (same ops as autograd's derivative, other ints): the joint match's backward roles are checked,
    so the custom gradient is kept (fusing would silently replace it by the true derivative)."""
    torch.manual_seed(0)
    model = VariantStack([("fused", False, True, True)], lookalikes=["swapped_grad"])
    reference = copy.deepcopy(model)
    inputs = _inputs(torch.float32)
    ref_inputs = _clone_inputs(inputs)
    out = _compile(model)(*inputs)
    out.pow(2).mean().backward()
    expected = reference(*ref_inputs)
    expected.pow(2).mean().backward()
    assert fusion_pass.match_counts() == {}
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    extra = [(name, inputs[i], ref_inputs[i]) for i, name in ((0, "x"), (3, "cos_g"), (4, "sin_g"))]
    errors = compare_grads(model, reference, extra)
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_layout_from_the_attention_does_not_matter(dtype):
    """q, k, v gradients arriving [B, S, H, D]-ordered (SDPA's CUDA kernels) instead of
    [B, H, S, D]-contiguous (CPU attention, repeat_kv): same match, same gradients."""
    model = nn.ModuleList([FusedQKVAttention(bias=True, consumer="bshd")]).to(dtype)
    reference = copy.deepcopy(model)
    x, cos, sin = _inputs(dtype)[:3]
    x_ref = x.detach().clone().requires_grad_()
    _compile(model[0])(x, cos, sin).float().pow(2).sum().backward()
    reference[0](x_ref, cos, sin).float().pow(2).sum().backward()
    assert fusion_pass.match_counts() == {FAMILY: 1}
    errors = compare_grads(model, reference, [("x", x, x_ref)])
    assert max(errors.values()) < GRAD_TOLERANCE[dtype], sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_near_misses_are_reported():
    """Structure found but not fused: a device type that is not enabled, an unsupported dtype."""
    x, cos, sin = torch.randn(2, 8, HIDDEN, requires_grad=True), *rope_tables(8)
    _compile(VariantStack([("fused", False, True, False)]), devices=("cuda",))(x, cos, sin).sum().backward()
    torch._dynamo.reset()
    model64 = VariantStack([("separate", False, True, False)]).double()
    x64, cos64, sin64 = x.detach().double().requires_grad_(), cos.double(), sin.double()
    _compile(model64)(x64, cos64, sin64).sum().backward()
    assert fusion_pass.match_counts() == {}
    misses = {(m.family, m.reason) for m in fusion_pass.near_misses()}
    assert misses == {
        (FAMILY, "device type 'cpu' is not enabled (fusion_pass.install(devices=...))"),
        (FAMILY, "dtype torch.float64 is not one of bf16, fp16, fp32"),
        # the per-tensor family finds each norm <-> RoPE inside and refuses it for the same reasons
        (PER_TENSOR, "device type 'cpu' is not enabled (fusion_pass.install(devices=...))"),
        (PER_TENSOR, "per-head RMSNorm <-> RoPE in training in torch.float64 (the backward kernel takes bf16, "
                     "fp16, fp32)"),
    }


def test_dynamic_batch_and_sequence_match_without_recompiling():
    """mark_dynamic on B and S: the pre-traced patterns match the symbolic graph (a re-traced
    pattern would not: see the module docstring of the pattern file), and a new S reuses it."""
    backend_calls = []
    model = VariantStack([("fused", True, True, False), ("separate", False, True, True)])
    reference = copy.deepcopy(model)
    fusion_pass.install(devices=("cpu",))
    inner = joint_pass_backend()

    def counting_backend(gm, example_inputs):
        backend_calls.append(gm)
        return inner(gm, example_inputs)

    compiled = torch.compile(model, backend=counting_backend)
    for batch, seq in ((3, 12), (2, 20)):
        inputs = _inputs(torch.float32, batch=batch, seq=seq)
        torch._dynamo.mark_dynamic(inputs[0], 0)
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 1)  # x [B, S, K] and the tables [1, S, D]
        ref_inputs = _clone_inputs(inputs)
        compiled(*inputs).pow(2).mean().backward()
        reference(*ref_inputs).pow(2).mean().backward()
        errors = compare_grads(model, reference, [("x", inputs[0], ref_inputs[0])])
        assert max(errors.values()) < 1e-5
        model.zero_grad()
        reference.zero_grad()
    assert len(backend_calls) == 1
    assert fusion_pass.match_counts() == {FAMILY: 2}


def test_fp16_training_uses_the_low_precision_variants():
    specs = [("fused", True, True, True), ("separate", False, False, True)]
    model = VariantStack(specs).to(torch.float16)
    reference = copy.deepcopy(model)
    inputs = _inputs(torch.float16, batch_cos_g=2)
    ref_inputs = _clone_inputs(inputs)
    _compile(model)(*inputs).float().pow(2).mean().backward()
    reference(*ref_inputs).float().pow(2).mean().backward()
    expected = {pattern.variant_name(s, b, torch.float16, True, n, r): 1 for s, b, n, r in specs}
    assert pattern.variant_counts() == expected
    extra = [("cos_g", inputs[3], ref_inputs[3]), ("sin_g", inputs[4], ref_inputs[4])]
    errors = compare_grads(model, reference, extra)
    assert max(errors.values()) < GRAD_TOLERANCE[torch.float16], sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_dynamic_true_is_reported_then_fused_with_specialized_floats():
    """torch.compile(dynamic=True) lifts the norms' eps to graph inputs: reported as a near-miss
    (a baked-in eps could silently go stale), and the per-tensor family, which takes eps from the
    graph, fuses q and k; with specialize_float the projection family fuses the whole region."""
    model = VariantStack([("fused", False, True, False)])
    inputs = _inputs(torch.float32)[:3]
    fusion_pass.install(devices=("cpu",))
    torch.compile(model, backend=joint_pass_backend(), dynamic=True)(*inputs).sum().backward()
    assert fusion_pass.match_counts() == {PER_TENSOR: 2}
    assert [m.reason for m in fusion_pass.near_misses()] == [
        "the norm's eps is a graph input (torch.compile(dynamic=True) lifts floats: "
        "set torch._dynamo.config.specialize_float = True)"
    ]
    torch._dynamo.reset()
    fusion_pass.reset_report()
    with torch._dynamo.config.patch(specialize_float=True):
        torch.compile(model, backend=joint_pass_backend(), dynamic=True)(*inputs).sum().backward()
    assert fusion_pass.match_counts() == {FAMILY: 1}


class TestJointGraphSnapshots(expecttest.TestCase):
    """The joint graph of the region alone (fused QKV, fp32, trainable norms, constant cos/sin)."""

    def test_before_and_after(self):
        torch.manual_seed(0)
        model = FusedQKVPrologue()
        x, (cos, sin) = torch.randn(2, 8, HIDDEN, requires_grad=True), rope_tables(8)
        capture = RegionCapture(None)
        q, k, v = _compile(model, capture=capture)(x, cos, sin)
        (q.sum() + k.sum() + v.sum()).backward()
        self.assertEqual(fusion_pass.match_counts(), {FAMILY: 1})
        (before,), (after,) = capture.before, capture.after
        self.assertExpectedInline(before, """\
v0 = aten.permute.default(in1, [_, _])
v1 = aten.view.default(in0, [_, _])
v2 = aten.mm.default(v1, v0)
v3 = aten.view.default(v2, [_, _, _])
v4 = aten.split_with_sizes.default(v3, [_, _, _], _)
v5 = getitem(v4, 0)
v6 = getitem(v4, 1)
v7 = getitem(v4, 2)
v8 = aten.view.default(v5, [_, _, _, _])
v9 = aten.permute.default(v8, [_, _, _, _])
v10 = aten.view.default(v6, [_, _, _, _])
v11 = aten.permute.default(v10, [_, _, _, _])
v12 = aten.view.default(v7, [_, _, _, _])
v13 = aten.permute.default(v12, [_, _, _, _])
v14 = aten.unsqueeze.default(in2, _)
v15 = aten.unsqueeze.default(in3, _)
v16 = aten.mul.Tensor(v9, v14)
v17 = aten.slice.Tensor(v9, _, _, _)
v18 = aten.slice.Tensor(v9, _, _, _)
v19 = aten.neg.default(v18)
v20 = aten.cat.default([v19, v17], _)
v21 = aten.mul.Tensor(v20, v15)
v22 = aten.add.Tensor(v16, v21)
v23 = aten.mul.Tensor(v11, v14)
v24 = aten.slice.Tensor(v11, _, _, _)
v25 = aten.slice.Tensor(v11, _, _, _)
v26 = aten.neg.default(v25)
v27 = aten.cat.default([v26, v24], _)
v28 = aten.mul.Tensor(v27, v15)
v29 = aten.add.Tensor(v23, v28)
v30 = aten.pow.Tensor_Scalar(v22, _)
v31 = aten.mean.dim(v30, [_], _)
v32 = aten.add.Tensor(v31, 1e-06)
v33 = aten.rsqrt.default(v32)
v34 = aten.alias.default(v33)
v35 = aten.mul.Tensor(v22, v33)
v36 = aten.mul.Tensor(in4, v35)
v37 = aten.pow.Tensor_Scalar(v29, _)
v38 = aten.mean.dim(v37, [_], _)
v39 = aten.add.Tensor(v38, 1e-06)
v40 = aten.rsqrt.default(v39)
v41 = aten.alias.default(v40)
v42 = aten.mul.Tensor(v29, v40)
v43 = aten.mul.Tensor(in5, v42)
v44 = aten.mul.Tensor(in7, in5)
v45 = aten.mul.Tensor(in7, v42)
v46 = aten.sum.dim_IntList(v45, [_, _, _], _)
v47 = aten.view.default(v46, [_])
v48 = aten.mul.Tensor(v44, v29)
v49 = aten.mul.Tensor(v44, v40)
v50 = aten.sum.dim_IntList(v48, [_], _)
v51 = aten.alias.default(v41)
v52 = aten.pow.Tensor_Scalar(v51, _)
v53 = aten.mul.Scalar(v50, -0.5)
v54 = aten.mul.Tensor(v53, v52)
v55 = aten.expand.default(v54, [_, _, _, _])
v56 = aten.div.Scalar(v55, _)
v57 = aten.pow.Tensor_Scalar(v29, 1)
v58 = aten.mul.Scalar(v57, 2)
v59 = aten.mul.Tensor(v56, v58)
v60 = aten.add.Tensor(v49, v59)
v61 = aten.mul.Tensor(in6, in4)
v62 = aten.mul.Tensor(in6, v35)
v63 = aten.sum.dim_IntList(v62, [_, _, _], _)
v64 = aten.view.default(v63, [_])
v65 = aten.mul.Tensor(v61, v22)
v66 = aten.mul.Tensor(v61, v33)
v67 = aten.sum.dim_IntList(v65, [_], _)
v68 = aten.alias.default(v34)
v69 = aten.pow.Tensor_Scalar(v68, _)
v70 = aten.mul.Scalar(v67, -0.5)
v71 = aten.mul.Tensor(v70, v69)
v72 = aten.expand.default(v71, [_, _, _, _])
v73 = aten.div.Scalar(v72, _)
v74 = aten.pow.Tensor_Scalar(v22, 1)
v75 = aten.mul.Scalar(v74, 2)
v76 = aten.mul.Tensor(v73, v75)
v77 = aten.add.Tensor(v66, v76)
v78 = aten.mul.Tensor(v60, v15)
v79 = aten.slice.Tensor(v78, _, _, _)
v80 = aten.slice.Tensor(v78, _, _, _)
v81 = aten.neg.default(v79)
v82 = aten.full.default([_, _, _, _], _, dtype=float32, layout=_, device=device, pin_memory=_)
v83 = aten.slice_scatter.default(v82, v81, _, _, _)
v84 = aten.full.default([_, _, _, _], _, dtype=float32, layout=_, device=device, pin_memory=_)
v85 = aten.slice_scatter.default(v84, v80, _, _, _)
v86 = aten.add.Tensor(v83, v85)
v87 = aten.mul.Tensor(v60, v14)
v88 = aten.add.Tensor(v86, v87)
v89 = aten.mul.Tensor(v77, v15)
v90 = aten.slice.Tensor(v89, _, _, _)
v91 = aten.slice.Tensor(v89, _, _, _)
v92 = aten.neg.default(v90)
v93 = aten.full.default([_, _, _, _], _, dtype=float32, layout=_, device=device, pin_memory=_)
v94 = aten.slice_scatter.default(v93, v92, _, _, _)
v95 = aten.full.default([_, _, _, _], _, dtype=float32, layout=_, device=device, pin_memory=_)
v96 = aten.slice_scatter.default(v95, v91, _, _, _)
v97 = aten.add.Tensor(v94, v96)
v98 = aten.mul.Tensor(v77, v14)
v99 = aten.add.Tensor(v97, v98)
v100 = aten.permute.default(in8, [_, _, _, _])
v101 = aten.view.default(v100, [_, _, _])
v102 = aten.permute.default(v88, [_, _, _, _])
v103 = aten.clone.default(v102, memory_format=_)
v104 = aten.view.default(v103, [_, _, _])
v105 = aten.permute.default(v99, [_, _, _, _])
v106 = aten.clone.default(v105, memory_format=_)
v107 = aten.view.default(v106, [_, _, _])
v108 = aten.cat.default([v107, v104, v101], _)
v109 = aten.view.default(v108, [_, _])
v110 = aten.permute.default(v109, [_, _])
v111 = aten.mm.default(v110, v1)
v112 = aten.permute.default(v111, [_, _])
v113 = aten.permute.default(v0, [_, _])
v114 = aten.mm.default(v109, v113)
v115 = aten.view.default(v114, [_, _, _])
v116 = aten.permute.default(v112, [_, _])
return [v36, v43, v13, v115, v116, _, _, v64, v47]""")
        self.assertExpectedInline(after, """\
v0 = aten.permute.default(in1, [_, _])
v1 = aten.view.default(in0, [_, _])
v2 = aten.mm.default(v1, v0)
v3 = aten.view.default(v2, [_, _, _])
v4 = aten.split_with_sizes.default(v3, [_, _, _], _)
v5 = getitem(v4, 0)
v6 = getitem(v4, 1)
v7 = getitem(v4, 2)
v8 = aten.view.default(v5, [_, _, _, _])
v9 = aten.permute.default(v8, [_, _, _, _])
v10 = aten.view.default(v6, [_, _, _, _])
v11 = aten.permute.default(v10, [_, _, _, _])
v12 = aten.view.default(v7, [_, _, _, _])
v13 = aten.slice.Tensor(v9, _, _, _)
v14 = aten.slice.Tensor(v9, _, _, _)
v15 = aten.neg.default(v14)
v16 = aten.cat.default([v15, v13], _)
v17 = aten.slice.Tensor(v11, _, _, _)
v18 = aten.slice.Tensor(v11, _, _, _)
v19 = aten.neg.default(v18)
v20 = aten.cat.default([v19, v17], _)
v21 = aten.view.default(v12, [_, _, _])
v22 = aten.slice.Tensor(v3, _, _, _)
v23 = aten.slice.Tensor(v3, _, _, _)
v24 = aten.view.default(v22, [_, _, _, _])
v25 = aten.view.default(v23, [_, _, _, _])
v26 = aten.view.default(v21, [_, _, _, _])
v27 = aten.permute.default(v26, [_, _, _, _])
v28 = aten.unsqueeze.default(in2, _)
v29 = aten.squeeze.dim(v28, _)
v30 = aten.unsqueeze.default(v29, _)
v31 = aten.mul.Tensor(v9, v30)
v32 = aten.mul.Tensor(v11, v30)
v33 = aten.unsqueeze.default(in3, _)
v34 = aten.squeeze.dim(v33, _)
v35 = aten.unsqueeze.default(v34, _)
v36 = aten.mul.Tensor(v16, v35)
v37 = aten.add.Tensor(v31, v36)
v38 = aten.pow.Tensor_Scalar(v37, _)
v39 = aten.mean.dim(v38, [_], _)
v40 = aten.add.Tensor(v39, 1e-06)
v41 = aten.rsqrt.default(v40)
v42 = aten.mul.Tensor(v37, v41)
v43 = aten.mul.Tensor(in4, v42)
v44 = aten.squeeze.dim(v41, _)
v45 = aten.mul.Tensor(v20, v35)
v46 = aten.add.Tensor(v32, v45)
v47 = aten.pow.Tensor_Scalar(v46, _)
v48 = aten.mean.dim(v47, [_], _)
v49 = aten.add.Tensor(v48, 1e-06)
v50 = aten.rsqrt.default(v49)
v51 = aten.mul.Tensor(v46, v50)
v52 = aten.mul.Tensor(in5, v51)
v53 = aten.squeeze.dim(v50, _)
v54 = aten.permute.default(in8, [_, _, _, _])
v55 = aten.view.default(v54, [_, _, _])
v56 = aten.view.default(v55, [_, _, _, _])
v57 = aten.permute.default(v56, [_, _, _, _])
v58 = fusion_pass.qkv_rope_qk_norm_backward.default(in6, in7, v57, v24, v25, v44, v53, v29, v34, in4, in5, in0, [in1], False, True, True, True, False)
v59 = getitem(v58, 0)
v60 = getitem(v59, 0)
v61 = getitem(v58, 1)
v62 = getitem(v61, 0)
v63 = getitem(v58, 3)
v64 = getitem(v63, 0)
v65 = getitem(v63, 1)
v66 = aten.permute.default(v62, [_, _])
v67 = aten.permute.default(v66, [_, _])
return [v43, v52, v27, v60, v67, _, _, v64, v65]""")
