"""The forward fusion in a bf16 ``torch.autocast`` region over an fp32 model (issue 16).

There the projections run in bf16 while the norm's weight stays fp32, so Qwen3's ``weight *
n.to(bf16)`` promotes to fp32: q and k leave the norm in fp32, RoPE runs in fp32 with the fp32
tables, and a ``StaticCache`` allocated on first use holds fp32 keys and bf16 values. The op
takes that as it comes (``output_dtype``): bf16 q/k/v in, fp32 q/k out, the k cache fp32 and
the v cache bf16, every rounding where eager rounds. Bit-exact against eager under the same
autocast on CPU (the kernel runs under the Triton interpreter there)."""

from __future__ import annotations

import pytest
import torch
import transformers

import fusion_pass
from compile_capture import eager, fused_count, run_fused
from fusion_pass.kernels.qk_norm_rope_cache_op import output_dtype
from fusion_pass.kernels.qk_norm_rope_cache_reference import qk_norm_rope_cache_reference
from prologue_variants import DensePrologue, Glm4MoePrologue, make_glm_inputs
from qwen3_style import Qwen3StylePrologue, make_inputs


def autocast_inputs(seq: int):
    """The prologue's inputs as an fp32 model under bf16 autocast has them: fp32 hidden states and
    tables, the k cache fp32 and the v cache bf16 (the dtypes of the states that filled them)."""
    hidden, cos, sin, k_cache, v_cache, cache_position = make_inputs(seq=seq, dtype=torch.float32)
    return [hidden, cos, sin, k_cache, v_cache.to(torch.bfloat16), cache_position]


@pytest.mark.parametrize("seq", [5, 1], ids=["prefill", "decode"])
def test_autocast_region_over_an_fp32_model_fuses_once_and_is_bit_exact(seq):
    torch.manual_seed(0)
    model = Qwen3StylePrologue()
    inputs = autocast_inputs(seq)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (q_ref, _), ref_inputs = eager(model, inputs)
        (q_out, _), _ = run_fused(model, inputs)
    assert fused_count() == 1
    assert q_out.dtype == q_ref.dtype == torch.float32
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


AUTOCAST_FORMS = [("gemma3", False), ("gemma3", True), ("gemma3n", False), ("afmoe", False), ("pow_no_weight", True)]


@pytest.mark.parametrize("norm,after_transpose", AUTOCAST_FORMS,
                         ids=[f"{n}_{'bhsd' if t else 'bshd'}" for n, t in AUTOCAST_FORMS])
def test_autocast_other_norm_forms_fuse_once_and_are_bit_exact(norm, after_transpose):
    """Gemma3's ``(n * (1 + weight)).type_as(x)`` (its ``weight.float()`` no node for an fp32
    weight), Gemma3n's, AFMoE's and the weight-free form under bf16 autocast over an fp32 model:
    the norm ends in bf16 (``type_as(x)``), RoPE promotes to the fp32 tables."""
    torch.manual_seed(0)
    model = DensePrologue(norm=norm, norm_after_transpose=after_transpose)
    inputs = autocast_inputs(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (q_ref, _), ref_inputs = eager(model, inputs)
        (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1, capture.after
    assert q_out.dtype == q_ref.dtype == torch.float32
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_autocast_qwen3_next_partial_rotary_fuses_once_and_is_bit_exact():
    """Qwen3-Next's and Qwen3.5's prologue under autocast: the ``1 + weight`` norm before the
    transpose, GLM-4.5-style partial rotary (16 of 32 features)."""
    torch.manual_seed(0)
    model = Glm4MoePrologue(head_dim=32, norm="gemma3")
    hidden, cos, sin, k_cache, v_cache, pos = make_glm_inputs(head_dim=32, rotary_dim=16, dtype=torch.float32)
    inputs = [hidden, cos, sin, k_cache, v_cache.to(torch.bfloat16), pos]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (q_ref, _), ref_inputs = eager(model, inputs)
        (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1, capture.after
    assert "rotary_dim=16" in capture.after[0]
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_output_dtype_follows_the_model_code_under_autocast():
    """Qwen3's ``weight * n.to(dtype)`` promotes to the weight's dtype; the other forms end in
    q's dtype, and RoPE's products promote to the tables'."""
    q, w16, w32 = torch.empty(1, 2, 3, 16, dtype=torch.bfloat16), torch.empty(16, dtype=torch.bfloat16), torch.empty(16)
    cos16, cos32 = torch.empty(1, 3, 16, dtype=torch.bfloat16), torch.empty(1, 3, 16)
    assert output_dtype(q, w32, cos32, "weight") == torch.float32
    assert output_dtype(q, w32, cos16, "weight") == torch.float32  # then the op refuses the bf16 tables
    assert output_dtype(q, w16, cos16, "weight") == torch.bfloat16
    assert output_dtype(q, w32, cos16, "fp32_weight") == torch.bfloat16  # nn.RMSNorm kept in fp32: (n * w).to(dtype)
    assert output_dtype(q, w32, cos32, "fp32_one_plus_weight") == torch.float32  # Gemma3's form under autocast
    assert output_dtype(q, None, cos16, "no_weight") == torch.bfloat16


def test_mixed_precision_op_matches_the_reference_and_refuses_rope_first():
    g = torch.Generator().manual_seed(3)
    bf, f32 = torch.bfloat16, torch.float32
    q, k, v = (torch.randn(2, h, 4, 16, generator=g).to(bf) for h in (4, 2, 2))
    qw, kw = (1 + 0.1 * torch.randn(16, generator=g) for _ in range(2))
    angles = torch.rand(2, 4, 8, generator=g) * 6.28
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    k_cache, v_cache = torch.randn(2, 2, 8, 16, generator=g), torch.randn(2, 2, 8, 16, generator=g).to(bf)
    pos = torch.arange(2, 6)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = qk_norm_rope_cache_reference(q, k, v, qw, kw, cos, sin, ref_k, ref_v, pos, 1e-6, 1e-6)
    q_out, k_out = torch.ops.fusion_pass.qk_norm_rope_cache(q, k, v, qw, kw, cos, sin, k_cache, v_cache, pos, 1e-6, 1e-6)
    assert q_out.dtype == k_out.dtype == f32
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    with pytest.raises(ValueError, match="rope_first"):
        torch.ops.fusion_pass.qk_norm_rope_cache(q, k, v, qw, kw, cos, sin, k_cache, v_cache, pos, 1e-6, 1e-6,
                                                 rope_first=True)
    with pytest.raises(ValueError, match="k_cache: expected the outputs' dtype torch.float32"):
        torch.ops.fusion_pass.qk_norm_rope_cache(q, k, v, qw, kw, cos, sin, k_cache.to(bf), v_cache, pos, 1e-6, 1e-6)


@pytest.mark.slow
def test_hf_qwen3_fp32_model_under_bf16_autocast_prefill_then_decode():
    """transformers' Qwen3ForCausalLM in fp32 under CPU bf16 autocast, StaticCache prefill then one
    decode step: every layer fused in both graphs, written cache rows equal to eager's under the
    same autocast, logits within stock compile's bf16 drift."""
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 128, (2, 7))

    # Not test_qk_norm_rope_cache_model's _prefill_and_decode: that decodes eager's and the compiled
    # model's own argmax tokens, which bf16 autocast can make differ; here both decode the same token.
    def run(fn):
        cache = transformers.StaticCache(config=config, max_cache_len=16)
        logits = []
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            pos = torch.arange(7)
            logits.append(fn(input_ids=ids, past_key_values=cache, cache_position=pos,
                             position_ids=pos[None].expand(2, -1), use_cache=True).logits)
            pos = torch.tensor([7])
            logits.append(fn(input_ids=ids[:, :1], past_key_values=cache, cache_position=pos,
                             position_ids=pos[None].expand(2, -1), use_cache=True).logits)
        return logits, cache

    ref_logits, ref_cache = run(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, options=fusion_pass.options(devices=("cpu",)))
    logits, cache = run(compiled)
    assert fused_count() == 2 * config.num_hidden_layers
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        assert (layer.keys.dtype, layer.values.dtype) == (torch.float32, torch.bfloat16)
        torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=2e-2, atol=6e-2)
        torch.testing.assert_close(layer.values, ref_layer.values, rtol=2e-2, atol=6e-2)
        assert torch.equal(layer.keys[:, :, 8:], ref_layer.keys[:, :, 8:])
    for out, ref in zip(logits, ref_logits):
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=5e-2)
