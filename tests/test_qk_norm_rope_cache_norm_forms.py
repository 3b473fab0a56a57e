"""The forward fusion on RMSNorm written other ways than Qwen3's: transformers' ``Gemma3RMSNorm``
(``1 + weight``, fp32 product), ``torch.nn.RMSNorm`` with and without a weight, and the
weight-free ``torch.pow(mean_squared, -0.5)`` norm (transformers' ``NeoMMERMSNorm`` /
``Gemma3nRMSNorm`` with ``with_scale=False``). Exact match counts, bit-exact numerics against
eager (the fused op rounds where each form rounds), look-alikes left alone, and the op's
``norm`` argument checked and computed as each form computes it."""

from __future__ import annotations

import pytest
import torch

import fusion_pass
from fusion_pass.demo import apply_rotary_pos_emb
from fusion_pass.kernels import qk_norm_rope_cache_reference as cache_reference
from fusion_pass.kernels.qk_norm_rope_cache_reference import NORM_STYLES, norm_reference
from compile_capture import assert_left_unfused, eager, fused_count, run_fused
from fused_op_calls import assert_op_call_matches_reference, random_op_args
from prologue_variants import (NORM_LOOK_ALIKES, NORMS, DensePrologue, Glm4MoePrologue, PagedPrologue, make_glm_inputs,
                               make_norm, make_paged_inputs)
from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as glm_apply_rotary_pos_emb
from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb as glm4_moe_apply_rotary_pos_emb
from qwen3_style import make_inputs

DENSE_OP = "fusion_pass.qk_norm_rope_cache"
PAGED_OP = "fusion_pass.qk_norm_rope_paged_cache.default"
# The op's ``norm`` argument each model form is fused with (absent: the Qwen3 default).
OP_NORM = {
    "qwen3": None,
    "gemma3": "fp32_one_plus_weight",
    "torch_rms_norm": "fp32_weight",
    "torch_rms_norm_no_weight": "no_weight",
    "gemma3n": "fp32_weight",
    "afmoe": "fp32_weight",
    "pow_no_weight": "no_weight",
}


def assert_fused_with_norm(graph_text: str, norm: str) -> None:
    """The graph calls the fused op with the ``norm`` argument of this model form."""
    calls = [line for line in graph_text.splitlines() if "fusion_pass.qk_norm_rope" in line]
    assert len(calls) == 1, calls
    if OP_NORM[norm] is None:
        assert "norm=" not in calls[0], calls[0]
    else:
        assert f"norm='{OP_NORM[norm]}'" in calls[0], calls[0]
    if OP_NORM[norm] == "no_weight":
        assert "q_weight=None, k_weight=None" in calls[0], calls[0]


def assert_fused_once_and_bit_exact(model, inputs: list, norm: str):
    """Compiled with the pass: one fusion with the op's ``norm`` for this form, q_rotated and
    both caches (inputs 3 and 4) bit-identical to eager's. Returns the graph capture."""
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    assert_fused_with_norm(capture.after[0], norm)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])
    return capture


# --- the model forms fuse, bit for bit --------------------------------------------------------

@pytest.mark.parametrize("norm_after_transpose", [False, True], ids=["norm_bshd", "norm_bhsd"])
@pytest.mark.parametrize("norm", NORMS)
def test_dense_cache_norm_forms_fuse_once_and_are_bit_exact(norm, norm_after_transpose):
    """Before the transpose (Qwen3's place) and after it (Gemma3's and NeoMME's place)."""
    model = DensePrologue(norm=norm, norm_after_transpose=norm_after_transpose).to(torch.bfloat16)
    assert_fused_once_and_bit_exact(model, list(make_inputs()), norm)


@pytest.mark.parametrize("norm", NORMS)
def test_rope_first_norm_forms_fuse_once_and_are_bit_exact(norm):
    """HunYuan's order (RoPE on the ``[B, H, S, D]`` views, then the norm) with every form."""
    model = DensePrologue(norm=norm, rope_first=True).to(torch.bfloat16)
    capture = assert_fused_once_and_bit_exact(model, list(make_inputs()), norm)
    assert "rope_first=True" in capture.after[0]


@pytest.mark.parametrize("norm", NORMS)
def test_interleaved_rope_norm_forms_fuse_once_and_are_bit_exact(norm):
    """GLM's interleaved ``apply_rotary_pos_emb`` after every form, in GLM-4.5's place."""
    model = Glm4MoePrologue(rope=glm_apply_rotary_pos_emb, head_dim=32, norm=norm).to(torch.bfloat16)
    capture = assert_fused_once_and_bit_exact(model, make_glm_inputs(head_dim=32), norm)
    assert "interleaved=True" in capture.after[0]


@pytest.mark.parametrize("norm", NORMS)
def test_partial_interleaved_rope_norm_forms_fuse_once_and_are_bit_exact(norm):
    """GLM's ``apply_rotary_pos_emb`` with partial tables: the first 16 of 32 features rotated in
    interleaved pairs, the rest passed through."""
    model = Glm4MoePrologue(rope=glm_apply_rotary_pos_emb, head_dim=32, norm=norm).to(torch.bfloat16)
    capture = assert_fused_once_and_bit_exact(model, make_glm_inputs(head_dim=32, rotary_dim=16), norm)
    assert "interleaved=True" in capture.after[0] and "rotary_dim=16" in capture.after[0]


def partial_tables(inputs: list, rotary_dim: int) -> list:
    """``make_inputs`` with cos/sin cut to their first ``rotary_dim`` features."""
    return [inputs[0], inputs[1][..., :rotary_dim], inputs[2][..., :rotary_dim], *inputs[3:]]


@pytest.mark.parametrize("rope", ["partial", "interleaved"])
@pytest.mark.parametrize("norm", NORMS)
def test_rope_first_partial_and_interleaved_norm_forms_fuse_once_and_are_bit_exact(norm, rope):
    """HunYuan's order with GLM-4.5's partial RoPE (16 of 32 features) or GLM's interleaved one."""
    fn = glm4_moe_apply_rotary_pos_emb if rope == "partial" else glm_apply_rotary_pos_emb
    model = DensePrologue(norm=norm, rope_first=True, head_dim=32, rope=fn).to(torch.bfloat16)
    inputs = list(make_inputs(head_dim=32))
    capture = assert_fused_once_and_bit_exact(model, partial_tables(inputs, 16) if rope == "partial" else inputs,
                                              norm)
    assert "rope_first=True" in capture.after[0]
    assert ("rotary_dim=16" if rope == "partial" else "interleaved=True") in capture.after[0]


@pytest.mark.parametrize("norm", [n for n in NORMS if n != "qwen3"])
def test_fp16_decode_gqa_norm_forms_are_bit_exact(norm):
    model = DensePrologue(hidden=32, q_heads=8, kv_heads=2, head_dim=64, norm=norm,
                          norm_after_transpose=True).to(torch.float16)
    inputs = list(make_inputs(batch=1, seq=1, past=9, hidden=32, head_dim=64, dtype=torch.float16))
    assert_fused_once_and_bit_exact(model, inputs, norm)


@pytest.mark.parametrize("norm", [n for n in NORMS if n != "qwen3"])
def test_paged_cache_fused_qkv_norm_forms_fuse_once_and_are_bit_exact(norm):
    """vLLM's flattened tokens, q/k/v as slices of one fused QKV projection, a paged cache."""
    model = PagedPrologue(layout="tokens", fused_qkv=True, norm=norm).to(torch.bfloat16)
    capture = assert_fused_once_and_bit_exact(model, list(make_paged_inputs(layout="tokens")), norm)
    assert PAGED_OP in capture.after[0]


def test_torch_rms_norm_default_eps_fuses_with_float32_eps():
    """``nn.RMSNorm(D)`` (eps=None) normalizes with ``torch.finfo(torch.float32).eps``."""
    model = DensePrologue(norm="torch_rms_norm", norm_after_transpose=True).to(torch.bfloat16)
    for module in (model.q_norm, model.k_norm):
        module.eps = None
    inputs = list(make_inputs())
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    assert f"q_eps={torch.finfo(torch.float32).eps:g}" in capture.after[0]
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3])


def test_torch_rms_norm_kept_in_fp32_in_a_bf16_model_fuses():
    """An fp32 weight (norm modules left in fp32): the fp32 product is the same, one rounding."""
    model = DensePrologue(norm="torch_rms_norm", norm_after_transpose=True).to(torch.bfloat16)
    model.q_norm.float(), model.k_norm.float()
    assert_fused_once_and_bit_exact(model, list(make_inputs()), "torch_rms_norm")


@pytest.mark.parametrize("norm", ["gemma3_fp32", "gemma_two_plus_weight"])
def test_a_weight_computed_from_the_parameter_fuses_as_the_fp32_weight_form(norm):
    """``Gemma3RMSNorm`` kept in fp32 (``weight.float()`` is then no node) and one with ``2.0 +
    weight``: both are ``(n * w).to(dtype)`` with ``w`` computed from the parameter, ``nn.RMSNorm``'s
    form, which the op takes with that ``w`` (fp32): bit-exact."""
    model = DensePrologue(norm="gemma3" if norm == "gemma3_fp32" else norm, norm_after_transpose=True)
    model = model.to(torch.bfloat16)
    if norm == "gemma3_fp32":
        model.q_norm.float(), model.k_norm.float()
    assert_fused_once_and_bit_exact(model, list(make_inputs()), "torch_rms_norm")


@pytest.mark.parametrize("norm", ["gemma3", "pow_no_weight"])
def test_dynamic_true_norm_forms_fuse_with_eps_tensors(norm):
    model = DensePrologue(norm=norm, norm_after_transpose=True, q_eps=1e-2, k_eps=3e-1).to(torch.bfloat16)
    inputs = list(make_inputs())
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs, dynamic=True)
    assert fused_count() == 1
    assert "fusion_pass.qk_norm_rope_cache_eps_tensor" in capture.after[0]
    assert_fused_with_norm(capture.after[0], norm)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3])


# --- look-alikes ------------------------------------------------------------------------------

@pytest.mark.parametrize("look_alike", NORM_LOOK_ALIKES)
def test_norm_look_alikes_are_left_alone(look_alike):
    """``2.0 + weight``, one statistic over (heads, head_dim), a scaled weight-free norm: each
    differs from a fused form in one place, and fusing it would compute something else."""
    model = DensePrologue(norm=look_alike).to(torch.bfloat16)
    inputs = list(make_inputs())
    assert_left_unfused(model, inputs)


@pytest.mark.parametrize("norm", ["torch_rms_norm", "pow_no_weight"])
def test_norm_form_rope_without_cache_write_is_a_reported_near_miss(norm):

    class NormRope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_norm, self.k_norm = make_norm(norm, 4, 16, 1e-6), make_norm(norm, 2, 16, 1e-6)

        def forward(self, q, k, cos, sin):
            return apply_rotary_pos_emb(self.q_norm(q.transpose(1, 2)), self.k_norm(k.transpose(1, 2)), cos, sin)

    model = NormRope().to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, h, 16, generator=g).to(torch.bfloat16) for h in (4, 2))
    cos, sin = make_inputs()[1:3]
    run_fused(model, [q, k, cos, sin])
    assert fused_count() == 0
    assert "without a matching K/V cache write (left unfused) (x2)" in fusion_pass.report()


# --- the op's norm argument -------------------------------------------------------------------

def make_op_args(norm, dtype=torch.bfloat16, head_dim=64, seed=0):
    return dict(random_op_args(dtype, head_dim, norm=norm, seed=seed), norm=norm)


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", NORM_STYLES)
def test_op_norm_styles_match_the_reference(norm, dtype, head_dim):
    """The kernel (Triton interpreter on CPU) against the reference of each style: bf16 bit for
    bit; fp16 within the kernel tests' interpreter bound (numpy sums the fp32 statistic in
    another order, which can flip an fp16 rounding). head_dim 48 masks the padded half tile."""
    args = make_op_args(norm, dtype, head_dim)
    inputs = {"q": (args["q"], args["q_weight"], args["q_eps"]), "k": (args["k"], args["k_weight"], args["k_eps"])}

    def rope_scale_ulps(out, want, which):  # ulps of the RoPE terms (the output can cancel)
        x, w, eps = inputs[which]
        return cache_reference.rope_ulp_error(out, want, norm_reference(x, w, eps, norm), args["cos"], args["sin"])

    assert_op_call_matches_reference(args, rope_scale_ulps)


def test_op_norm_styles_round_differently():
    """The styles are distinct computations: the same q, k and weights give other bits."""
    base = make_op_args("weight")
    outputs = []
    for norm in ("weight", "fp32_weight"):
        args = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in base.items()}
        outputs.append(torch.ops.fusion_pass.qk_norm_rope_cache(**dict(args, norm=norm))[0])
    assert not torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize(
    "change,name,expected",
    [
        (dict(norm="gemma"), "norm", "one of"),
        (dict(norm="no_weight"), "q_weight", "None"),
        (dict(q_weight=None), "q_weight", "a tensor for norm='weight'"),
        (dict(norm="fp32_weight", k_weight=None), "k_weight", "a tensor for norm='fp32_weight'"),
        (lambda a: dict(a, q_weight=a["q_weight"].half()), "q_weight", "q's dtype torch.bfloat16 or torch.float32"),
        # an fp32 q_weight is mixed precision (``output_dtype``), and then so must be k's
        (lambda a: dict(a, q_weight=a["q_weight"].float()), "k_weight", "q_weight's dtype torch.float32"),
        (lambda a: dict(a, norm="fp32_weight", k_weight=a["k_weight"].half()), "k_weight",
         "q's dtype torch.bfloat16 or torch.float32"),
    ],
)
def test_op_rejects_weights_that_do_not_fit_the_norm_by_name(change, name, expected):
    args = make_op_args("weight")
    args = change(args) if callable(change) else dict(args, **change)
    with pytest.raises(ValueError, match=rf"qk_norm_rope_cache: {name}: expected {expected}"):
        torch.ops.fusion_pass.qk_norm_rope_cache(**args)
