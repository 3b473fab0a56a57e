"""The forward fusion with interleaved (GPT-J style) RoPE: the pairs ``(x[2i], x[2i+1])`` rotated by
the model's tables (one entry per feature), as transformers' GLM ``apply_rotary_pos_emb`` computes it (``rotate_half``
on ``x[..., 0::2]``/``x[..., 1::2]``, tables ``cos[..., :D/2].repeat_interleave(2)``).

No transformers model has this RoPE after a per-head RMSNorm in front of a KV-cache write (GLM,
GPT-J and CodeGen have no q/k norm; Cohere's q/k norm is a LayerNorm and it rotates in fp32), so
the prologue is GLM-4.5's (``prologue_variants.Glm4MoePrologue``: transformers' ``Glm4MoeRMSNorm``,
Qwen3's form, per head) with transformers' GLM ``apply_rotary_pos_emb`` itself as its RoPE, then a
StaticCache-style write. Exact match counts, bit-exact numerics against eager, tables built other
ways, the op's ``interleaved`` argument computed as the model computes it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as glm_apply_rotary_pos_emb
from transformers.models.glm.modeling_glm import rotate_half as glm_rotate_half

from fusion_pass.kernels.qk_norm_rope_cache_reference import rope_reference
from compile_capture import eager, fused_call, fused_count, fused_once_and_bit_exact, run_fused
from fused_op_calls import assert_op_call_matches_reference, random_op_args
from prologue_variants import Glm4MoePrologue, make_glm_inputs



def second_half_tables(q, k, cos, sin, unsqueeze_dim=1):
    """GLM's ``apply_rotary_pos_emb`` with the *second* half of the tables interleaved: other
    tables (where the halves differ), the same RoPE of q and k by them."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., cos.shape[-1] // 2:].repeat_interleave(2, dim=-1)
    sin = sin[..., sin.shape[-1] // 2:].repeat_interleave(2, dim=-1)
    return (q * cos) + (glm_rotate_half(q) * sin), (k * cos) + (glm_rotate_half(k) * sin)


def stacked_tables(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J's spelling: each pair's entry stacked with itself (``stack((c, c), -1).flatten(-2)``)
    and ``rotate_every_two``; the tables are GLM's, built another way."""
    half = cos.shape[-1] // 2
    cos = torch.stack((cos[..., :half], cos[..., :half]), dim=-1).flatten(-2).unsqueeze(unsqueeze_dim)
    sin = torch.stack((sin[..., :half], sin[..., :half]), dim=-1).flatten(-2).unsqueeze(unsqueeze_dim)

    def rotate_every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


# --- the model form fuses, bit for bit --------------------------------------------------------

@pytest.mark.parametrize(
    "dtype,geometry",
    [
        (torch.bfloat16, dict(batch=2, seq=5, q_heads=4, kv_heads=2, head_dim=32)),
        (torch.float16, dict(batch=1, seq=1, q_heads=8, kv_heads=2, head_dim=64)),  # decode, GQA 4
    ],
    ids=["bf16_prefill", "fp16_decode"],
)
def test_interleaved_rope_fuses_once_and_is_bit_exact(dtype, geometry):
    q_heads = geometry.pop("q_heads")
    model = Glm4MoePrologue(rope=glm_apply_rotary_pos_emb, q_heads=q_heads, kv_heads=geometry["kv_heads"],
                                    head_dim=geometry["head_dim"]).to(dtype)
    inputs = make_glm_inputs(dtype=dtype, **geometry)
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    call = fused_call(capture.after[0])
    assert "interleaved=True" in call, call
    assert "norm=" not in call and "rotary_dim" not in call
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


# --- the tables are the model's, however it builds them -------------------------------------

@pytest.mark.parametrize("rope", [second_half_tables, stacked_tables], ids=["second_half", "gptj_stack"])
def test_interleaved_rope_fuses_whatever_tables_the_model_builds(rope):
    """The pattern starts at the tables that multiply q and k (one entry per feature) and the
    kernel reads them as they are, so tables built from the other half, or by stacking, fuse
    and stay bit-exact; tables whose halves differ tell a kernel that re-derived them apart."""
    model = Glm4MoePrologue(head_dim=32, rope=rope).to(torch.bfloat16)
    assert "interleaved=True" in fused_once_and_bit_exact(model, make_glm_inputs(head_dim=32, halves_differ=True))


# --- the op's interleaved argument ------------------------------------------------------------

def make_op_args(dtype=torch.bfloat16, head_dim=64, seed=0):
    return dict(random_op_args(dtype, head_dim, seed=seed), interleaved=True)


@pytest.mark.parametrize("rope_first", [False, True], ids=["norm_rope", "rope_norm"])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_interleaved_matches_the_reference(dtype, head_dim, rope_first):
    """The kernel (Triton interpreter on CPU) against GLM's computation (the reference): bf16 bit
    for bit, fp16 within the interpreter bound; the cache rows hold k_out. head_dim 48 masks
    the padded half tile."""
    assert_op_call_matches_reference(dict(make_op_args(dtype, head_dim), rope_first=rope_first))


def test_op_interleaved_is_glm_rope_and_not_rotate_half():
    """With GLM's tables (``interleaved_rope_tables`` of Hugging Face's ``cat(freqs, freqs)``
    ones) the op computes transformers' GLM function itself (on the normed q), and the same op
    call without ``interleaved`` gives other bits."""
    from fusion_pass.kernels.qk_norm_rope_cache_reference import interleaved_rope_tables, rms_norm_reference

    args = make_op_args()
    hf_cos, hf_sin = args["cos"], args["sin"]
    args["cos"], args["sin"] = interleaved_rope_tables(hf_cos, hf_sin)
    q_out, _ = torch.ops.fusion_pass.qk_norm_rope_cache(**{n: (t.clone() if isinstance(t, torch.Tensor) else t)
                                                            for n, t in args.items()})
    normed_q = rms_norm_reference(args["q"], args["q_weight"], args["q_eps"])
    normed_k = rms_norm_reference(args["k"], args["k_weight"], args["k_eps"])
    glm_q, _ = glm_apply_rotary_pos_emb(normed_q, normed_k, hf_cos, hf_sin)
    assert torch.equal(q_out, glm_q)
    assert not torch.equal(q_out, rope_reference(normed_q, args["cos"].unsqueeze(1), args["sin"].unsqueeze(1)))


@pytest.mark.parametrize("rope_first", [False, True], ids=["norm_rope", "rope_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_partial_interleaved_matches_the_reference(dtype, rope_first):
    """GLM's partial rotary on interleaved pairs: the first 32 of 64 features rotated (the tables
    32 wide), the other 32 passed through."""
    args = dict(make_op_args(dtype), rotary_dim=32, rope_first=rope_first)
    args["cos"], args["sin"] = args["cos"][..., :32].contiguous(), args["sin"][..., :32].contiguous()
    assert_op_call_matches_reference(args)
