"""Numerics of the training fusion: the reference backward against autograd (float64 gradcheck),
the ops against the eager model code, argument validation, and end-to-end training with Inductor
on Hugging Face's HunYuanDenseV1ForCausalLM and a HunyuanImage-3-style fused-QKV block.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

import fusion_pass
from fusion_pass.kernels.qkv_rope_qk_norm_reference import (
    qkv_rope_qk_norm_backward_reference,
    qkv_rope_qk_norm_forward_reference,
)
from qkv_rope_qk_norm_models import (
    EPS,
    HIDDEN,
    FusedQKVAttention,
    OpCounter,
    compare_grads,
    joint_pass_backend,
    rope_tables,
    tiny_config,
    train_beside_eager,
)
from transformers import HunYuanDenseV1ForCausalLM
from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RMSNorm, apply_rotary_pos_emb

FAMILY = "qkv_rope_qk_norm"
qkv_rope_qk_norm = torch.ops.fusion_pass.qkv_rope_qk_norm

# max |grad - grad_autograd| / max |grad_autograd| over the gradients of one test: a few ulps of
# the largest entry (d(qkv) is rounded where autograd rounds; the GEMMs and the sums over heads
# accumulate in another order). Measured worst at the tests' inputs (conftest seeds 0), in
# test_op_matches_the_eager_model_code: bf16 7.35e-3, fp16 1.28e-3 (the other tests: below
# those). These bounds hold for those inputs, not for any inputs: over seeds 0-19 of
# test_op_matches_the_eager_model_code the worst case reached 1.5e-2 (bf16, median 7e-3) and
# 1.6e-3 (fp16). Changing the inputs of a test may therefore need a re-measured bound.
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1.5e-3}


# ----------------------------------------------------------------------------------------------
# The model code being replaced, written out (eager oracle for the op).
# ----------------------------------------------------------------------------------------------


def eager_region(hidden, weights, biases, q_norm_weight, k_norm_weight, cos, sin, heads, kv_heads, eps):
    """QKV projection(s) -> split -> heads -> apply_rotary_pos_emb -> per-head RMSNorm, as the models do."""
    bsz, q_len, _ = hidden.shape
    head_dim = q_norm_weight.shape[0]
    biases = biases or [None] * len(weights)
    if len(weights) == 1:
        qkv = F.linear(hidden, weights[0], biases[0])
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    else:
        q, k, v = (F.linear(hidden, w, b) for w, b in zip(weights, biases))
    q, k, v = (t.view(bsz, q_len, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    # HunYuanDenseV1RMSNorm.forward itself, on the given (non-leaf) weights.
    q_norm = types.SimpleNamespace(weight=q_norm_weight, variance_epsilon=eps)
    k_norm = types.SimpleNamespace(weight=k_norm_weight, variance_epsilon=eps)
    return HunYuanDenseV1RMSNorm.forward(q_norm, q), HunYuanDenseV1RMSNorm.forward(k_norm, k), v


def region_inputs(structure, bias, dtype, batch=2, seq=5, hidden=24, heads=4, kv_heads=2, head_dim=8,
                  batch_cos=1, rope_grad=True, norm_grad=True):
    """(hidden, weights, biases, q_norm_weight, k_norm_weight, cos, sin), random, requiring grad."""
    def t(*shape, grad=True):
        return (torch.randn(*shape, dtype=torch.float64) * 0.5).to(dtype).requires_grad_(grad)

    rows = [(heads + 2 * kv_heads) * head_dim] if structure == "fused" else [heads * head_dim, kv_heads * head_dim,
                                                                               kv_heads * head_dim]
    weights = [t(n, hidden) for n in rows]
    biases = [t(n) for n in rows] if bias else []
    norms = [1 + t(head_dim, grad=False) for _ in range(2)]
    for w in norms:
        w.requires_grad_(norm_grad)
    cos, sin = (t(batch_cos, seq, head_dim, grad=rope_grad) for _ in range(2))
    return t(batch, seq, hidden), weights, biases, norms[0], norms[1], cos, sin


# ----------------------------------------------------------------------------------------------
# Reference backward vs autograd (float64 gradcheck).
# ----------------------------------------------------------------------------------------------


class _ReferenceRegion(torch.autograd.Function):
    """The reference forward with the reference backward as its derivative (for gradcheck)."""

    @staticmethod
    def forward(ctx, heads, kv_heads, eps, n_weights, n_biases, hidden, *tensors):
        weights, biases = list(tensors[:n_weights]), list(tensors[n_weights:n_weights + n_biases])
        q_norm_weight, k_norm_weight, cos, sin = tensors[n_weights + n_biases:]
        q_out, k_out, v, q_rstd, k_rstd, proj = qkv_rope_qk_norm_forward_reference(
            hidden, weights, biases, q_norm_weight, k_norm_weight, cos, sin, heads, kv_heads, eps, eps
        )
        ctx.save_for_backward(hidden, q_norm_weight, k_norm_weight, cos, sin, q_rstd, k_rstd, *weights, *proj)
        ctx.geometry = (heads, kv_heads, n_weights, n_biases)
        return q_out, k_out, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        heads, kv_heads, n_weights, n_biases = ctx.geometry
        hidden, q_w, k_w, cos, sin, q_rstd, k_rstd, *rest = ctx.saved_tensors
        weights, proj = rest[:n_weights], rest[n_weights:]
        batch, seq, head_dim = hidden.shape[0], hidden.shape[1], q_w.shape[0]
        if len(proj) == 1:
            q = proj[0][..., : heads * head_dim]
            k = proj[0][..., heads * head_dim: (heads + kv_heads) * head_dim]
        else:
            q, k = proj[0], proj[1]
        q, k = q.view(batch, seq, heads, head_dim), k.view(batch, seq, kv_heads, head_dim)
        g = qkv_rope_qk_norm_backward_reference(
            grad_q.contiguous(), grad_k.contiguous(), grad_v.contiguous(), q, k, q_rstd, k_rstd, cos, sin, q_w, k_w,
            hidden, list(weights), has_bias=n_biases > 0, need_norm_weight_grads=True, need_cos_sin_grads=True,
        )
        return (None, None, None, None, None, g["grad_hidden"], *g["grad_proj_weights"], *g["grad_proj_biases"],
                g["grad_q_norm_weight"], g["grad_k_norm_weight"], g["grad_cos"], g["grad_sin"])


@pytest.mark.parametrize("structure,bias,batch_cos", [("fused", True, 1), ("fused", False, 2),
                                                      ("separate", True, 2), ("separate", False, 1)])
def test_reference_backward_passes_gradcheck_in_float64(structure, bias, batch_cos):
    hidden, weights, biases, q_w, k_w, cos, sin = region_inputs(
        structure, bias, torch.float64, batch=2, seq=3, hidden=6, heads=2, kv_heads=1, head_dim=4,
        batch_cos=batch_cos,
    )
    q_w.requires_grad_(True)
    k_w.requires_grad_(True)

    def region(hidden, *tensors):
        return _ReferenceRegion.apply(2, 1, 1e-6, len(weights), len(biases), hidden, *tensors)

    assert torch.autograd.gradcheck(region, (hidden, *weights, *biases, q_w, k_w, cos, sin), eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# The ops against the eager model code.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("structure,bias,batch_cos", [("fused", False, 1), ("fused", True, 2),
                                                      ("separate", False, 2), ("separate", True, 1)])
def test_op_matches_the_eager_model_code(structure, bias, batch_cos, dtype):
    """Forward bit-identical to eager (same roundings, eager strides for q and k); every gradient
    equal to autograd's (fp32: tight; bf16 / fp16: within a few ulps of the largest entry)."""
    args = region_inputs(structure, bias, dtype, batch_cos=batch_cos)
    hidden, weights, biases, q_w, k_w, cos, sin = args
    flat = [hidden, *weights, *biases, q_w, k_w, cos, sin]
    expected = eager_region(*args, 4, 2, EPS)
    got = qkv_rope_qk_norm(hidden, weights, biases, q_w, k_w, cos, sin, 4, 2, EPS, EPS)[:3]
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    for e, g in zip(expected[:2], got[:2]):
        assert e.stride() == g.stride()
    grads = [torch.randn_like(e) for e in expected]
    want = torch.autograd.grad(expected, flat, grads)
    have = torch.autograd.grad(got, flat, grads)
    errors = []
    for w, h in zip(want, have):
        assert h.shape == w.shape and h.dtype == w.dtype
        errors.append(((h.float() - w.float()).abs().max() / w.float().abs().max()).item())
    assert max(errors) < GRAD_TOLERANCE[dtype], errors


def test_op_backward_skips_what_is_not_needed():
    """Frozen norm weights and constant tables: no gradient for them, the rest unchanged."""
    args = region_inputs("fused", True, torch.float32, rope_grad=False, norm_grad=False)
    hidden, weights, biases, q_w, k_w, cos, sin = args
    out = qkv_rope_qk_norm(hidden, weights, biases, q_w, k_w, cos, sin, 4, 2, EPS, EPS)
    (out[0].sum() + out[1].sum() + out[2].sum()).backward()
    assert q_w.grad is None and k_w.grad is None and cos.grad is None
    assert hidden.grad is not None and weights[0].grad is not None and biases[0].grad is not None


def _bad(**changes):
    args = dict(zip(["hidden", "proj_weights", "proj_biases", "q_norm_weight", "k_norm_weight", "cos", "sin"],
                    region_inputs("fused", False, torch.float32)))
    args.update(num_q_heads=4, num_kv_heads=2, q_eps=EPS, k_eps=EPS)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,message", [
    (dict(hidden=torch.randn(10, 24)), "hidden: expected a 3-D tensor"),
    (dict(num_kv_heads=3), "num_kv_heads: expected a positive head count dividing num_q_heads=4"),
    (dict(num_q_heads=3, num_kv_heads=3), r"proj_weights\[0\]: expected shape \[72, 24\]"),
    (dict(proj_weights=[torch.randn(64, 24)] * 2), "proj_weights: expected 1 fused QKV weight or 3 weights"),
    (dict(proj_biases=[torch.randn(63)]), r"proj_biases\[0\]: expected shape \[64\]"),
    (dict(q_norm_weight=torch.randn(7), k_norm_weight=torch.randn(7), cos=torch.randn(1, 5, 7),
          sin=torch.randn(1, 5, 7)), "q_norm_weight: expected an even head_dim"),
    (dict(k_norm_weight=torch.randn(4)), r"k_norm_weight: expected shape \[8\]"),
    (dict(q_norm_weight=torch.randn(4)), r"q_norm_weight: expected shape \[8\] \(head_dim, as k_norm_weight and cos"),
    (dict(cos=torch.randn(1, 6, 8)), r"cos: expected shape \[1 or B=2, S=5, D=8\]"),
    (dict(sin=torch.randn(2, 5, 8)), "sin: expected cos's shape"),
    (dict(cos=torch.randn(1, 5, 8, dtype=torch.float64)), "cos: expected hidden's dtype torch.float32"),
])
def test_forward_op_rejects_bad_arguments(changes, message):
    with pytest.raises(ValueError, match=message):
        qkv_rope_qk_norm(**_bad(**changes))


def test_backward_op_rejects_bad_arguments():
    hidden, weights, _, q_w, k_w, cos, sin = region_inputs("fused", False, torch.float32)
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    good = dict(grad_q=torch.randn(2, 4, 5, 8), grad_k=torch.randn(2, 2, 5, 8), grad_v=torch.randn(2, 2, 5, 8),
                q=q, k=k, q_rstd=torch.rand(2, 4, 5), k_rstd=torch.rand(2, 2, 5), cos=cos.detach(), sin=sin.detach(),
                q_norm_weight=q_w, k_norm_weight=k_w, hidden=hidden.detach(), proj_weights=[weights[0].detach()],
                has_bias=False, need_hidden_grad=True, need_proj_grads=True, need_norm_weight_grads=True,
                need_cos_sin_grads=True)
    backward = torch.ops.fusion_pass.qkv_rope_qk_norm_backward
    assert [len(g) for g in backward(**good)] == [1, 1, 0, 2, 2]
    cases = [
        (dict(q_rstd=torch.rand(2, 4, 5, dtype=torch.float64)), "q_rstd: expected dtype torch.float32"),
        (dict(grad_k=torch.randn(2, 3, 5, 8)), r"grad_k: expected shape \[2, 2, 5, 8\]"),
        (dict(k=torch.randn(2, 5, 3, 8)), "k: expected a head count dividing q's 4 heads"),
        (dict(proj_weights=[torch.randn(60, 24)]), r"proj_weights\[0\]: expected shape \[64, 24\]"),
        (dict(grad_q=torch.randn(2, 4, 8, 5).transpose(2, 3)), "grad_q: expected a contiguous last dim"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            backward(**{**good, **change})


def test_backward_op_dispatches_to_triton_under_the_interpreter():
    """On CPU with TRITON_INTERPRET=1 (set before triton is imported: a fresh process) the backward
    op runs the Triton kernels; its gradients equal the reference path's."""
    script = textwrap.dedent("""
        import os, torch
        os.environ["TRITON_INTERPRET"] = "1"
        import fusion_pass
        from fusion_pass.kernels import qkv_rope_qk_norm_op as op
        assert op.elementwise_backward_implementation(torch.empty(1)).__name__ == "qk_norm_rope_backward_triton"
        op_call = torch.ops.fusion_pass.qkv_rope_qk_norm
        torch.manual_seed(0)
        for structure, dtype in (("fused", torch.float32), ("separate", torch.bfloat16)):
            rows = [64] if structure == "fused" else [32, 16, 16]
            tensors = [torch.randn(2, 5, 24), *[torch.randn(n, 24) for n in rows], *[torch.randn(n) for n in rows],
                       1 + torch.randn(8), 1 + torch.randn(8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)]
            tensors = [t.to(dtype).requires_grad_() for t in tensors]
            n = len(rows)
            def run():
                out = op_call(tensors[0], tensors[1:1 + n], tensors[1 + n:1 + 2 * n], *tensors[1 + 2 * n:], 4, 2,
                              1e-6, 1e-6)
                return torch.autograd.grad((out[0] * 1.5).sum() + out[1].sum() + out[2].sum(), tensors)
            triton_grads = run()
            os.environ["TRITON_INTERPRET"] = "0"
            reference_grads = run()
            os.environ["TRITON_INTERPRET"] = "1"
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            for a, b in zip(triton_grads, reference_grads):
                err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                assert err < tol, (structure, err)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# End to end: training with the fusion installed.
# ----------------------------------------------------------------------------------------------


BWD_OP = "fusion_pass.qkv_rope_qk_norm_backward.default"


def test_hunyuan_dense_v1_trains_with_inductor_like_eager():
    """transformers' HunYuanDenseV1ForCausalLM (2 layers, fp32) compiled by Inductor with the pass:
    both layers fused, our backward op runs, every gradient equals eager autograd's, and an AdamW
    loop tracks the eager losses."""
    torch.manual_seed(0)
    model = HunYuanDenseV1ForCausalLM(tiny_config(layers=2)).train()
    reference = copy.deepcopy(model)
    fusion_pass.install(devices=("cpu",))
    compiled = torch.compile(model)

    def backward(loss):
        with OpCounter() as ops:
            loss.backward()
        assert ops.counts[BWD_OP] == 2  # loss.backward() runs our backward, once per layer
        assert fusion_pass.match_counts() == {FAMILY: 2}

    losses = train_beside_eager(compiled, model, reference, 4, backward)
    assert losses[-1] < losses[0]
    assert fusion_pass.match_counts() == {FAMILY: 2}  # no recompilation


class FusedQKVModel(nn.Module):
    """Input RMSNorm -> HunyuanImage-3-style attention -> residual, with the rotary tables inside."""

    def __init__(self, bias=True):
        super().__init__()
        self.input_layernorm = HunYuanDenseV1RMSNorm(HIDDEN, eps=EPS)
        self.attn = FusedQKVAttention(bias=bias)

    def forward(self, x):
        cos, sin = rope_tables(x.shape[1], dtype=x.dtype)
        return x + self.attn(self.input_layernorm(x), cos, sin)


def test_fused_qkv_block_bf16_with_inductor():
    torch.manual_seed(0)
    model = FusedQKVModel().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    fusion_pass.install(devices=("cpu",))
    loss = torch.compile(model)(x).float().pow(2).mean()
    with OpCounter() as ops:
        loss.backward()
    reference(x_ref).float().pow(2).mean().backward()
    assert fusion_pass.match_counts() == {FAMILY: 1}
    assert ops.counts[BWD_OP] == 1
    errors = compare_grads(model, reference, [("x", x, x_ref)])
    assert max(errors.values()) < GRAD_TOLERANCE[torch.bfloat16], sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_training_fusion_survives_inductors_matmul_padding(monkeypatch):
    """Inductor's ``pad_mm`` pads projection matmuls whose sizes are not multiples of 8 whenever
    its benchmark says so (on CUDA; forced here on CPU). Padded, the region no longer matched and
    nothing was reported (issue 18 item 1): the training fusion now runs before those passes."""
    import torch._inductor.fx_passes.pad_mm as pad_mm

    monkeypatch.setattr(pad_mm, "check_device", lambda a, b: True)  # pad as on CUDA
    monkeypatch.setattr(pad_mm, "has_triton", lambda: True)
    torch.manual_seed(0)
    model = FusedQKVAttention(hidden=60, heads=4, kv_heads=2, head_dim=16)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 131, 60, requires_grad=True)  # M = 262 and K = 60: both padded
    x_ref = x.detach().clone().requires_grad_()
    cos, sin = rope_tables(131, head_dim=16, dtype=torch.float32)
    with torch._inductor.config.patch(shape_padding=True, force_shape_pad=True):
        fusion_pass.install(devices=("cpu",))
        torch.compile(model)(x, cos, sin).float().pow(2).mean().backward()
    reference(x_ref, cos, sin).float().pow(2).mean().backward()
    assert fusion_pass.match_counts() == {FAMILY: 1}, fusion_pass.report()
    errors = compare_grads(model, reference, [("x", x, x_ref)])
    assert max(errors.values()) < GRAD_TOLERANCE[torch.float32], sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hunyuan_dense_v1_gradients_through_the_rewritten_joint_graph(dtype):
    """The HF model in fp32 and bf16 (eager attention, biases), through the rewritten joint graph."""
    torch.manual_seed(0)
    model = HunYuanDenseV1ForCausalLM(tiny_config(bias=True, attn_implementation="eager")).to(dtype)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 12))
    fusion_pass.install(devices=("cpu",))
    loss = torch.compile(model, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss
    loss.backward()
    reference_loss = reference(input_ids=ids, labels=ids).loss
    reference_loss.backward()
    assert fusion_pass.match_counts() == {FAMILY: 2}
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)
    errors = compare_grads(model, reference)
    assert max(errors.values()) < GRAD_TOLERANCE[dtype], sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_hunyuan_dense_v1_training_step_like_eager():
    """On CUDA (Triton backward kernels, head_dim 128, GQA 4:1, bf16): one compiled training step of
    transformers' HunYuanDenseV1ForCausalLM with the pass installed for CUDA only (the default) --
    both layers fused, the backward's kernels launched by Inductor's generated code (the op never
    runs), and the loss and every gradient as close to eager's as stock torch.compile's are (within
    2x its error, or the bf16 bound above)."""
    from transformers import HunYuanDenseV1Config

    torch.manual_seed(0)
    config = HunYuanDenseV1Config(
        hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        num_hidden_layers=2, vocab_size=512, max_position_embeddings=512, attention_bias=False,
        attn_implementation="sdpa", use_cache=False, rms_norm_eps=EPS,
    )
    model = HunYuanDenseV1ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    reference, stock = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, config.vocab_size, (2, 131), device="cuda")
    reference_loss = reference(input_ids=ids, labels=ids).loss
    reference_loss.backward()
    stock_loss = torch.compile(stock)(input_ids=ids, labels=ids).loss
    stock_loss.backward()
    torch._dynamo.reset()
    fusion_pass.install()
    compiled = torch.compile(model)

    def step():
        loss = compiled(input_ids=ids, labels=ids).loss
        with OpCounter() as ops:
            loss.backward()
        return loss, ops

    (loss, ops), codes = run_and_get_code(step)
    assert ops.counts.get(BWD_OP, 0) == 0
    assert any("_qk_norm_rope_bwd" in code and "torch.ops.fusion_pass" not in code for code in codes)
    assert fusion_pass.match_counts() == {FAMILY: 2}
    loss_bound = max(2 * abs(stock_loss.item() - reference_loss.item()), 1e-2 * abs(reference_loss.item()))
    assert abs(loss.item() - reference_loss.item()) <= loss_bound
    errors, stock_errors = compare_grads(model, reference), compare_grads(stock, reference)
    bound = max(2 * max(stock_errors.values()), GRAD_TOLERANCE[torch.bfloat16])
    assert max(errors.values()) <= bound, (sorted(errors.items(), key=lambda kv: -kv[1])[:3], bound)


def test_double_backward_is_refused():
    """The backward op has no derivative of its own: create_graph=True must fail loudly, not
    return first-order-only gradients."""
    args = region_inputs("fused", False, torch.float32)
    hidden, weights, biases, q_w, k_w, cos, sin = args
    out = qkv_rope_qk_norm(hidden, weights, biases, q_w, k_w, cos, sin, 4, 2, EPS, EPS)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out[0].sum(), hidden, create_graph=True)


def test_hunyuan_moe_v1_trains_fused_like_eager():
    """transformers' HunYuanMoEV1ForCausalLM: HunYuanDenseV1's attention (RoPE, then the per-head
    norm) with MoE MLPs, fp32, through Inductor's joint-graph passes (graphs run eagerly). Each
    layer's attention region fused and our backward run once per
    layer, every gradient equal to eager autograd's. (The expert dispatch may break the graph
    between layers; the second layer's graph is then a cache hit or a second match: 1 or 2, as
    for Qwen3-MoE in test_qkv_norm_rope_training.py.)"""
    from transformers import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM

    torch.manual_seed(0)
    dense = tiny_config(layers=2)
    config = HunYuanMoEV1Config(
        hidden_size=dense.hidden_size, intermediate_size=dense.intermediate_size, num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads, head_dim=dense.head_dim, num_hidden_layers=2,
        vocab_size=dense.vocab_size, max_position_embeddings=256, rms_norm_eps=EPS, use_cache=False,
        num_experts=4, moe_topk=2, attn_implementation="sdpa")
    model = HunYuanMoEV1ForCausalLM(config).train()
    with torch.no_grad():  # neutral norm weights would hide a weight applied twice or not at all
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    reference = copy.deepcopy(model)
    fusion_pass.install(devices=("cpu",))
    ids = torch.randint(0, 128, (2, 16))
    loss = torch.compile(model, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss
    with OpCounter() as ops:
        loss.backward()
    assert ops.counts[BWD_OP] == 2  # our backward, once per layer
    assert fusion_pass.match_counts().get(FAMILY) in (1, 2) and fusion_pass.near_misses() == {}, fusion_pass.report()
    reference(input_ids=ids, labels=ids).loss.backward()
    errors = compare_grads(model, reference)
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
