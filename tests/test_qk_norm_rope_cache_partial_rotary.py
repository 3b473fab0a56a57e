"""The forward fusion with partial rotary: only the first ``rotary_dim < head_dim`` features are
rotated, the rest passed through after the per-head norm, as transformers' ``Glm4MoeAttention``
(GLM-4.5, ``partial_rotary_factor=0.5``, ``use_qk_norm=True``) writes it. The prologue below calls
transformers' own ``Glm4MoeRMSNorm`` and ``apply_rotary_pos_emb``. Exact match counts, bit-exact
numerics against eager, a look-alike left alone, a near-miss reported, the op's ``rotary_dim``
argument checked and computed as the model computes it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb as glm4_moe_apply_rotary_pos_emb
from transformers.models.glm4_moe.modeling_glm4_moe import rotate_half

import fusion_pass
from fusion_pass.kernels.qk_norm_rope_cache_reference import partial_rope_reference
from compile_capture import assert_left_unfused, eager, fused_call, fused_count, fused_once_and_bit_exact, run_fused
from fused_op_calls import assert_op_call_matches_reference, random_op_args
from prologue_variants import Glm4MoePrologue, PagedPrologue, Qwen3NextPrologue, make_glm_inputs, make_paged_inputs



def rotate_last_features(q, k, cos, sin):
    """A look-alike of ``apply_rotary_pos_emb``: rotates the *last* ``rotary_dim`` features and
    passes the first ones through. Not what the op computes: must stay unfused."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    out = []
    for x in (q, k):
        x_pass, x_rot = x[..., :-rotary_dim], x[..., -rotary_dim:]
        out.append(torch.cat([x_pass, (x_rot * cos) + (rotate_half(x_rot) * sin)], dim=-1))
    return tuple(out)


# --- the model form fuses, bit for bit --------------------------------------------------------

@pytest.mark.parametrize(
    "dtype,geometry",
    [
        (torch.bfloat16, dict(batch=2, seq=5, q_heads=4, kv_heads=2, head_dim=64, rotary_dim=32)),  # factor 0.5
        (torch.float16, dict(batch=1, seq=1, q_heads=8, kv_heads=2, head_dim=64, rotary_dim=16)),  # decode, 0.25
    ],
    ids=["bf16_prefill_half", "fp16_decode_quarter"],
)
def test_glm4_moe_partial_rotary_fuses_once_and_is_bit_exact(dtype, geometry):
    q_heads = geometry.pop("q_heads")
    model = Glm4MoePrologue(hidden=64, q_heads=q_heads, kv_heads=geometry["kv_heads"],
                            head_dim=geometry["head_dim"]).to(dtype)
    inputs = make_glm_inputs(dtype=dtype, **geometry)
    cache_before = inputs[3].clone()
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    call = fused_call(capture.after[0])
    assert f"rotary_dim={geometry['rotary_dim']}" in call, call
    assert "norm=" not in call  # Glm4MoeRMSNorm is the Qwen3 form: the op's default
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])
    # The pass-through features of the written k rows are the normed k, not rotated: the write
    # changed them (random cache before), and eager agrees on every bit of them.
    position = int(inputs[5][0])
    assert not torch.equal(inputs[3][:, :, position], cache_before[:, :, position])


@pytest.mark.parametrize("seq", [5, 1], ids=["prefill", "decode"])
def test_qwen3_next_partial_rotary_with_its_one_plus_weight_norm_fuses_once_and_is_bit_exact(seq):
    """Qwen3-Next / Qwen3.5: a quarter of the features rotated, the norm ``(1 + weight)`` in fp32,
    the query a chunk of the gated projection (issue 16)."""
    torch.manual_seed(0)
    model = Qwen3NextPrologue(hidden=64, q_heads=4, kv_heads=2, head_dim=64).to(torch.bfloat16)
    inputs = make_glm_inputs(batch=2, seq=seq, kv_heads=2, head_dim=64, rotary_dim=16)
    call = fused_once_and_bit_exact(model, inputs)
    assert "rotary_dim=16" in call and "norm='fp32_one_plus_weight'" in call, call


def test_full_rotary_graph_still_calls_the_op_without_rotary_dim():
    """cos/sin as wide as head_dim: transformers' partial code slices nothing, and the graph is
    the Qwen3 one (``q[..., head_dim:]`` is empty): the op is called as before, no rotary_dim."""
    model = Glm4MoePrologue(head_dim=32).to(torch.bfloat16)
    inputs = make_glm_inputs(head_dim=32, rotary_dim=32)
    assert "rotary_dim" not in fused_once_and_bit_exact(model, inputs)


# --- look-alikes and near-misses stay unfused -------------------------------------------------

def test_rotating_the_last_features_is_not_fused():
    model = Glm4MoePrologue(rope=rotate_last_features).to(torch.bfloat16)
    inputs = make_glm_inputs(rotary_dim=32)
    assert_left_unfused(model, inputs)


def test_rotary_dim_the_kernel_does_not_serve_is_a_reported_near_miss():
    """rotary_dim 8 of head_dim 32 (not a multiple of 16): the whole prologue matches, the op's
    check refuses it, and the report names the argument."""
    model = Glm4MoePrologue(head_dim=32).to(torch.bfloat16)
    inputs = make_glm_inputs(head_dim=32, rotary_dim=8)
    assert_left_unfused(model, inputs)
    assert "rotary_dim: expected" in fusion_pass.report()


# --- the op's rotary_dim argument -------------------------------------------------------------

def make_op_args(dtype=torch.bfloat16, head_dim=64, rotary_dim=32, seed=0):
    return dict(random_op_args(dtype, head_dim, table_width=rotary_dim, seed=seed), rotary_dim=rotary_dim)


@pytest.mark.parametrize("rope_first", [False, True], ids=["norm_rope", "rope_norm"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 32), (128, 64), (64, 16), (64, 48), (48, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_partial_rotary_matches_the_reference(dtype, head_dim, rotary_dim, rope_first):
    """The kernel (Triton interpreter on CPU) against the reference: bf16 bit for bit, fp16
    within the interpreter bound; the pass-through features equal the normed input's (norm
    first), and the cache rows hold k_out. head_dim 48 masks the padded half tile."""
    assert_op_call_matches_reference(dict(make_op_args(dtype, head_dim, rotary_dim), rope_first=rope_first))


def test_op_partial_rotary_is_not_full_rotary_of_the_slice():
    """The pass-through features are the normed input, unrotated; the rotated ones differ from
    a full-width RoPE with cos/sin padded: the kernel really takes the partial branch."""
    args = make_op_args()
    q_out, _ = torch.ops.fusion_pass.qk_norm_rope_cache(**{n: (t.clone() if isinstance(t, torch.Tensor) else t)
                                                            for n, t in args.items()})
    from fusion_pass.kernels.qk_norm_rope_cache_reference import rms_norm_reference

    normed = rms_norm_reference(args["q"], args["q_weight"], args["q_eps"])
    assert torch.equal(q_out[..., 32:], normed[..., 32:])
    rotated = partial_rope_reference(normed, args["cos"].unsqueeze(1), args["sin"].unsqueeze(1))
    assert torch.equal(q_out, rotated)
    assert not torch.equal(q_out[..., :32], normed[..., :32])


@pytest.mark.parametrize(
    "change,name,expected",
    [
        (dict(rotary_dim=8), "rotary_dim", "None, head_dim=64, or a multiple of 16"),
        (dict(rotary_dim=80), "rotary_dim", "None, head_dim=64, or a multiple of 16"),
        (dict(rotary_dim=48), "cos", r"shape \[1 or B=2, S=5, rotary_dim=48\]"),
        (dict(rotary_dim=None), "cos", r"shape \[1 or B=2, S=5, D=64\]"),
    ],
)
def test_op_rejects_a_rotary_dim_that_does_not_fit_by_name(change, name, expected):
    args = dict(make_op_args(), **change)
    with pytest.raises(ValueError, match=rf"qk_norm_rope_cache: {name}: expected {expected}"):
        torch.ops.fusion_pass.qk_norm_rope_cache(**args)


# --- partial rotary with paged and flat caches ------------------------------------------------

@pytest.mark.parametrize("cache_write", ["index_put", "flat"])
@pytest.mark.parametrize("norm", ["qwen3", "gemma3"])
def test_partial_rotary_with_a_paged_or_flat_cache_fuses_once_and_is_bit_exact(norm, cache_write):
    """GLM-4.5's partial rotary (Qwen3's norm form) and Qwen3.5's (``1 + w``), written through a slot
    mapping as Hugging Face's continuous batching writes its ``[1, S, H, D]`` rows."""
    model = PagedPrologue(head_dim=64, layout="hf_batch1", cache_write=cache_write, norm=norm,
                          rope=glm4_moe_apply_rotary_pos_emb).to(torch.bfloat16)
    inputs = list(make_paged_inputs(head_dim=64, layout="hf_batch1", cache_write=cache_write, rotary_dim=32))
    call = fused_once_and_bit_exact(model, inputs)
    assert "rotary_dim=32" in call and "qk_norm_rope_paged_cache" in call, call


@pytest.mark.parametrize("norm", ["qwen3", "gemma3"])
def test_partial_rotary_on_flattened_tokens_is_a_reported_near_miss(norm):
    """vLLM's layout ([T, H, D], cos/sin [T, R]) with partial rotary is not registered: left to
    Inductor, and the report says so for q and for k."""
    model = PagedPrologue(head_dim=64, layout="tokens", norm=norm, rope=glm4_moe_apply_rotary_pos_emb).to(torch.bfloat16)
    assert_left_unfused(model, list(make_paged_inputs(head_dim=64, layout="tokens", rotary_dim=32)))
    [(miss, count)] = fusion_pass.near_misses().items()
    assert (miss.family, count) == ("qk_norm_rope_cache", 2)
    assert miss.reason.startswith("per-head RMSNorm -> partial RoPE without a matching K/V cache write"), miss
